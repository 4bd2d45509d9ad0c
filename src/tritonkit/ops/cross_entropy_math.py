"""Cross-entropy's maths as the kernels compute it, a row's or a block of rows' alike: the capped
logit, a row's loss from its sums, and the logits' gradient (cross_entropy.py's docstring has the
formulas). These helpers are elementwise, so the row-a-program kernels (cross_entropy.py) call them
on scalars and the packed kernels (cross_entropy_packed.py) on (ROWS, 1) columns and (ROWS,
BLOCK_C) tiles. Then the sums a row's loss needs, over a row (or a split row's segment:
cross_entropy_split.py) walked in blocks: its max, its sum of exponentials, its smoothing sums."""

from __future__ import annotations

from tritonkit._triton import tl, triton
from tritonkit.jit import LOG2E, softcap_tanh_and_sech2, window_base, window_edges, window_interior


@triton.jit
def capped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    """cap * tanh(x / cap), or x."""
    if HAS_SOFTCAP:
        t, _ = softcap_tanh_and_sech2(x / softcap)
        return softcap * t
    else:
        return x


@triton.jit
def row_loss(
    lse, target, x_t, w_t, sum_wx, sum_w, C, ignore_index, smoothing, z_loss,
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
):  # fmt: skip
    """(loss, w_t counted) of a row with log-sum-exp ``lse``, target logit ``x_t`` and class weight
    ``w_t``, and (smoothing) sum_c w_c x_c and sum_c w_c (with class weights): 0 and 0 where the
    target is ignore_index, NaN and NaN where it is outside 0..C-1."""
    ignored = target == ignore_index
    valid = (target >= 0) & (target < C)
    # (1 - e) w_t (lse - x_t) + e / C (W lse - sum_c w_c x_c), gathered as a lse - b: a product and
    # a difference round at the loss's magnitude, where three rounded terms added up to 1-2 of its
    # ulps in fp32 (past the oracle's bound at a loss of 16, where torch's fp32 happened to be close)
    a = (1.0 - smoothing) * w_t
    b = a * x_t
    if HAS_SMOOTHING:
        if not HAS_WEIGHT:
            sum_w = C * 1.0
        a += smoothing / C * sum_w
        b += smoothing / C * sum_wx
    loss = a * lse - b
    if HAS_Z_LOSS:
        loss += z_loss * lse * lse
    loss = tl.where(ignored, 0.0, tl.where(valid, loss, float("nan")))
    return loss, tl.where(ignored, 0.0, tl.where(valid, w_t, float("nan")))


@triton.jit
def logit_grads(
    x, classes, mask, target, weight_ptr, lse, coef, w_t, g, h, smoothing, softcap, C_ALL,
    HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_LSE_GRAD: tl.constexpr,
):  # fmt: skip
    """dx of the logits ``x`` of ``classes`` (the VJP in cross_entropy.py's docstring)."""
    if HAS_SOFTCAP:
        t, sech2 = softcap_tanh_and_sech2(x / softcap)
        x = softcap * t
    p = tl.exp2((x - lse) * LOG2E)
    d = p * coef - tl.where(classes == target, (1.0 - smoothing) * w_t, 0.0)
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + classes, mask=mask, other=0.0).to(tl.float32)
            d -= smoothing / C_ALL * w
        else:
            d -= smoothing / C_ALL
    d = g * d
    if HAS_LSE_GRAD:
        d += h * p
    if HAS_SOFTCAP:
        d *= sech2
    return d


@triton.jit
def grad_terms(
    rows, row_in, target_ptr, weight_ptr, lse_ptr, grad_ptr, totals_ptr, grad_lse_ptr, stride_t, stride_g,
    stride_gl, ignore_index, smoothing, z_loss, C_ALL, MEAN: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr, HAS_LSE_GRAD: tl.constexpr,
):  # fmt: skip
    """(target, lse, w_t, g, coef, h) of ``rows`` (a row, or a (ROWS, 1) column of them, under
    ``row_in``), what the logits' gradient takes besides the logits: the target, the row's lse and
    target class weight, its loss's upstream gradient as the gradient takes it (over the mean's
    divisor; 0 where ignored, NaN where the target is outside 0..C_ALL-1), the coefficient of p_c in
    d loss / d x_c, and the lse's upstream gradient (0 without)."""
    target = tl.load(target_ptr + rows * stride_t, mask=row_in, other=ignore_index)
    lse = tl.load(lse_ptr + rows, mask=row_in, other=0.0)
    ignored = target == ignore_index
    valid = (target >= 0) & (target < C_ALL)
    if HAS_WEIGHT:
        safe = tl.where(valid, target, 0).to(tl.int64)
        w_t = tl.load(weight_ptr + safe, mask=row_in, other=0.0).to(tl.float32)
    else:
        w_t = 1.0
    g = tl.load(grad_ptr + rows * stride_g, mask=row_in, other=0.0).to(tl.float32)
    if MEAN:
        g = g / tl.load(totals_ptr + 1)
    g = tl.where(ignored, 0.0, tl.where(valid, g, float("nan")))
    coef = (1.0 - smoothing) * w_t
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            coef += smoothing / C_ALL * tl.load(totals_ptr + 2)
        else:
            coef += smoothing
    if HAS_Z_LOSS:
        coef += 2.0 * z_loss * lse
    if HAS_LSE_GRAD:
        h = tl.load(grad_lse_ptr + rows * stride_gl, mask=row_in, other=0.0)
    else:
        h = 0.0
    return target, lse, w_t, g, coef, h


@triton.jit
def row_sums(
    x_row, weight_ptr, C, stride_xc, softcap, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """A row's (max, sum of exp(x - max), sum_c w_c x_c, sum_c w_c), the last two for smoothing. The
    sum of exponentials runs on in fp64 from step to step (each step's own sum in fp32): in fp32 a
    chain of 3368 steps (4 x 13795015 fp32) put the loss 1.6e-6 off, past the oracle's 1.5e-6."""
    m = -float("inf")  # running max
    s = tl.full((), 0.0, tl.float64)  # running sum of exp(x - m)
    sum_wx = 0.0  # HAS_SMOOTHING: sum_c w_c x_c
    sum_w = 0.0  # HAS_SMOOTHING and HAS_WEIGHT: sum_c w_c
    for start in range(0, C, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        mask = cols < C
        x = capped(
            tl.load(x_row + cols * stride_xc, mask=mask, other=0.0).to(tl.float32), softcap, HAS_SOFTCAP
        )
        x = tl.where(mask, x, -float("inf"))
        m, s, sum_wx, sum_w = step_sums(
            x, cols, mask, weight_ptr, m, s, sum_wx, sum_w, HAS_WEIGHT, HAS_SMOOTHING
        )
    return m, s, sum_wx, sum_w


@triton.jit
def step_sums(
    x, classes, mask, weight_ptr, m, s, sum_wx, sum_w, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr
):
    """A row's running sums (row_sums') taken on over a step ``x`` (-inf where not the row's) at
    ``classes`` under ``mask``, which may hold none of the row (a max of -inf shifts by 0: a window's
    edges, a row of -inf logits)."""
    m_new = tl.maximum(m, tl.max(x, 0))
    shift = tl.where(m_new == -float("inf"), 0.0, m_new)
    step = tl.sum(tl.exp2((x - shift) * LOG2E), 0)
    s = s * tl.exp2((m - shift) * LOG2E).to(tl.float64) + step.to(tl.float64)  # (fp64: row_sums)
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + classes, mask=mask, other=0.0).to(tl.float32)
            sum_wx += tl.sum(w * tl.where(mask, x, 0.0), 0)
            sum_w += tl.sum(w, 0)
        else:
            sum_wx += tl.sum(tl.where(mask, x, 0.0), 0)
    return m_new, s, sum_wx, sum_w


@triton.jit
def row_sums_in_window(
    x_ptr, weight_ptr, offset, C, softcap, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, BLOCK_C: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """row_sums of the row at ``offset`` (entries contiguous) read in a window: its vectors in
    16-byte accesses, the entries of its first and last vectors alone (jit.window_edges)."""
    base, head = window_base(offset, WINDOW)
    x_window = x_ptr + base
    edges, on_edge = window_edges(head, C, WINDOW)
    x_edge = tl.load(x_window + edges, mask=on_edge, other=0.0).to(tl.float32)
    x_edge = tl.where(on_edge, capped(x_edge, softcap, HAS_SOFTCAP), -float("inf"))
    m, s, sum_wx, sum_w = step_sums(
        x_edge, edges - head, on_edge, weight_ptr, -float("inf"), 0.0, 0.0, 0.0, HAS_WEIGHT, HAS_SMOOTHING
    )
    for start in range(0, head + C, BLOCK_C):
        positions = start + tl.arange(0, BLOCK_C)
        inner = window_interior(positions, head, C, WINDOW)
        x = tl.load(x_window + positions, mask=inner, other=0.0).to(tl.float32)
        x = tl.where(inner, capped(x, softcap, HAS_SOFTCAP), -float("inf"))
        m, s, sum_wx, sum_w = step_sums(
            x, positions - head, inner, weight_ptr, m, s, sum_wx, sum_w, HAS_WEIGHT, HAS_SMOOTHING
        )
    return m, s, sum_wx, sum_w
