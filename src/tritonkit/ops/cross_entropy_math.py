"""Cross-entropy's maths as the kernels compute it, a row's or a block of rows' alike: the capped
logit, a row's loss from its sums, and the logits' gradient (cross_entropy.py's docstring has the
formulas). The helpers are elementwise, so the row-a-program kernels (cross_entropy.py) call them on
scalars and the packed kernels (cross_entropy_packed.py) on (ROWS, 1) columns and (ROWS, BLOCK_C)
tiles."""

from __future__ import annotations

from tritonkit._triton import tl, triton
from tritonkit.jit import LOG2E, softcap_tanh_and_sech2


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
def grad_coefficients(
    target, lse, g, w_t, totals_ptr, ignore_index, smoothing, z_loss, C_ALL,
    MEAN: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
):  # fmt: skip
    """(g, coef) of a row: its loss's upstream gradient ``g`` as the gradient takes it (over the
    mean's divisor; 0 where ignored, NaN where the target is outside 0..C_ALL-1), and the
    coefficient of p_c in d loss / d x_c."""
    ignored = target == ignore_index
    valid = (target >= 0) & (target < C_ALL)
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
    return g, coef
