"""Cross-entropy over (N, C) logits with integer targets: ``F.cross_entropy``'s semantics (class
weights, ignore_index, label smoothing, every reduction), plus the PaLM z-loss, Gemma's logit
soft-cap and the per-row log-sum-exp.

Maths. Row i has logits x (soft-capped first where asked: x <- cap * tanh(x / cap)), target t,
class weights w (all 1 without), smoothing e, z-loss factor z and lse = log sum_c exp(x_c):
    loss_i = (1 - e) w_t (lse - x_t) + (e / C) sum_c w_c (lse - x_c) + z lse^2,   0 where t = ignore_index
and the reduction is torch's: none, sum, or mean = sum_i loss_i / sum_i w_{t_i} over the rows not
ignored (0 / 0 = NaN when every row is). The z term is per row, unweighted. VJP, with g_i the
loss's upstream gradient of row i (none: grad[i]; sum: grad; mean: grad / the divisor), h_i that of
the returned lse, p = softmax(x) and W = sum_c w_c:
    dx_c = (g_i (p_c ((1 - e) w_t + (e / C) W + 2 z lse) - (1 - e) w_t [c = t] - (e / C) w_c) + h_i p_c)
           * sech^2(x_c / cap)                                             (the last factor with a cap)

Work. The forward reads the logits once (N C s bytes) and writes a few floats a row; the backward
reads them again and writes their gradient (2 N C s). The least a fused step could move is N C s
fewer: a forward that kept each row on chip until its gradient was written, which a row of 128K
logits (256 KB in bf16) does not allow one program. A handful of FLOPs an element: memory-bound.

Rows whose logits start off their 16-byte vectors (an odd vocabulary: GPT-2's 50257) are read in
windows from each row's rounded-down offset, the vectors inside the row whole and its ends an
entry at a time (``WINDOWS``, ``_launch.row_window``, ``jit.window_base``).

A row's target outside 0..C-1 (other than ignore_index) is marked, not raised (raising would read
the targets on the host): that row's loss, and so a sum or mean, is NaN, and so is its gradient.
"""

from __future__ import annotations

import torch

from tritonkit._launch import Launch, cdiv, next_power_of_2, row_align, row_window, scratch
from tritonkit._runtime import empty_output, empty_output_like
from tritonkit._triton import tl, triton
from tritonkit.dtypes import FLOATS
from tritonkit.jit import aligned, window_base, window_edges, window_interior
from tritonkit.opdef import as_int, check_tensor, finite, first_derivative_only, op
from tritonkit.ops import Op, Workload
from tritonkit.ops import cross_entropy_packed as packed
from tritonkit.ops import cross_entropy_split as split
from tritonkit.ops.cross_entropy_math import (
    capped,
    grad_terms,
    logit_grads,
    row_loss,
    row_sums,
    row_sums_in_window,
)

DTYPES = FLOATS
REDUCTIONS = ("none", "sum", "mean")
TARGET_DTYPES = (torch.int64, torch.int32)
BLOCK_BYTES = 16384  # logits a program holds a step: 8192 in 16-bit dtypes, four 16-byte loads a thread
WARP_BYTES = 2048  # logits a warp holds a step: four 16-byte loads a thread (8 warps at BLOCK_BYTES)
# rows the reduction adds a step (one program: a fixed order, the same bits each call): 64 KB of
# losses and divisor terms in flight a step. Over more rows, programs of SUM_SPAN rows sum theirs
# first (a launch more, the SMs' bandwidth instead of one's), and the one program sums their sums.
SUM_BLOCK = 8192
SUM_SPAN = 2048  # (0: one program sums every row, for a benchmark's comparison)


@triton.jit
def _cross_entropy_fwd_kernel(
    x_ptr,  # logits (N, C), strides (stride_xn, stride_xc)
    target_ptr,  # (N,) int64 or int32, stride stride_t
    weight_ptr,  # HAS_WEIGHT: class weights (C,), contiguous
    loss_ptr,  # (N,): each row's loss (the output itself, in its dtype, for reduction "none")
    lse_ptr,  # fp32 (N,)
    row_weight_ptr,  # HAS_DIVISOR: fp32 (N,), w_t of each row counted (0 ignored): the mean's divisor
    C,  # classes
    stride_xn,
    stride_xc,
    stride_t,
    ignore_index,
    smoothing,  # e
    z_loss,  # z
    softcap,  # HAS_SOFTCAP: the cap
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_DIVISOR: tl.constexpr,
    BLOCK_C: tl.constexpr,  # logits a step
    ALIGN: tl.constexpr,  # C and the row stride are multiples of it (jit.aligned)
    WINDOW: tl.constexpr,  # 0, or the row read in windows of vectors of WINDOW entries (jit.window_base)
):
    C = aligned(C, ALIGN)
    stride_xn = aligned(stride_xn, ALIGN)
    row = tl.program_id(0).to(tl.int64)  # int64: N * C may pass 2^31
    x_row = x_ptr + row * stride_xn
    if WINDOW > 0:  # rows off their vectors' alignment: see jit.window_base
        m, s, sum_wx, sum_w = row_sums_in_window(
            x_ptr, weight_ptr, row * stride_xn, C, softcap,
            HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP, BLOCK_C, WINDOW,
        )  # fmt: skip
    else:
        m, s, sum_wx, sum_w = row_sums(
            x_row, weight_ptr, C, stride_xc, softcap, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP, BLOCK_C
        )
    lse = m + tl.log(s.to(tl.float32))

    target = tl.load(target_ptr + row * stride_t)
    safe = tl.where((target >= 0) & (target < C), target, 0).to(tl.int64)
    x_t = capped(tl.load(x_row + safe * stride_xc).to(tl.float32), softcap, HAS_SOFTCAP)
    if HAS_WEIGHT:
        w_t = tl.load(weight_ptr + safe).to(tl.float32)
    else:
        w_t = 1.0
    loss, counted = row_loss(
        lse, target, x_t, w_t, sum_wx, sum_w, C, ignore_index, smoothing, z_loss,
        HAS_WEIGHT, HAS_SMOOTHING, HAS_Z_LOSS,
    )  # fmt: skip
    tl.store(loss_ptr + row, loss.to(loss_ptr.dtype.element_ty))
    tl.store(lse_ptr + row, lse)
    if HAS_DIVISOR:
        tl.store(row_weight_ptr + row, counted)


@triton.jit
def _cross_entropy_sum_kernel(
    loss_ptr,  # REDUCE: fp32 (N,), the rows' losses
    row_weight_ptr,  # MEAN: fp32 (N,)
    weight_ptr,  # HAS_WEIGHT_SUM: class weights (C,)
    out_ptr,  # REDUCE: the reduced loss, one element in the output dtype
    totals_ptr,  # fp32 (3,): the loss's sum, the mean's divisor, sum_c w_c (W), as far as computed
    N,
    C,
    REDUCE: tl.constexpr,  # a sum or mean (not "none", where only W is wanted)
    MEAN: tl.constexpr,
    HAS_WEIGHT_SUM: tl.constexpr,  # the backward's W, for smoothing with class weights
    BLOCK: tl.constexpr,
):
    """One program, in a fixed order: the same bits every call, eager or compiled. In fp64: the
    rows' fp32 losses summed exactly and rounded once (an fp32 sum of a thousand losses near 10 is
    off by several of its ulps, where torch's is off by about one)."""
    if REDUCE:
        acc = tl.zeros([BLOCK], tl.float64)
        divisor = tl.zeros([BLOCK], tl.float64)
        for start in range(0, N, BLOCK):
            rows = start + tl.arange(0, BLOCK)
            acc += tl.load(loss_ptr + rows, mask=rows < N, other=0.0).to(tl.float64)
            if MEAN:
                divisor += tl.load(row_weight_ptr + rows, mask=rows < N, other=0.0).to(tl.float64)
        total = tl.sum(acc, 0)
        if MEAN:
            count = tl.sum(divisor, 0)
            tl.store(totals_ptr + 1, count.to(tl.float32))
            total = total / count  # 0 / 0 = NaN where every row is ignored, as torch
        total = total.to(tl.float32)  # then to the output's dtype: the interpreter's fp64 -> bf16 is wrong
        tl.store(totals_ptr, total)
        tl.store(out_ptr, total.to(out_ptr.dtype.element_ty))
    if HAS_WEIGHT_SUM:
        w_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(0, C, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            w_sum += tl.load(weight_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
        tl.store(totals_ptr + 2, tl.sum(w_sum, 0))


@triton.jit
def _cross_entropy_span_sums_kernel(
    loss_ptr,  # fp32 (N,), the rows' losses
    row_weight_ptr,  # MEAN: fp32 (N,)
    partials_ptr,  # fp64 (2, P): each span's sum of losses, then (MEAN) of divisor terms
    N,
    P,  # spans
    MEAN: tl.constexpr,
    SPAN: tl.constexpr,  # rows a program
):
    """The sum kernel's first stage over many rows: program p sums rows p SPAN .. (p + 1) SPAN - 1 in
    fp64 (exactly, as the one-program sum), in a fixed order."""
    rows = tl.program_id(0) * SPAN + tl.arange(0, SPAN)
    tl.store(
        partials_ptr + tl.program_id(0),
        tl.sum(tl.load(loss_ptr + rows, mask=rows < N, other=0.0).to(tl.float64), 0),
    )
    if MEAN:
        terms = tl.load(row_weight_ptr + rows, mask=rows < N, other=0.0).to(tl.float64)
        tl.store(partials_ptr + P + tl.program_id(0), tl.sum(terms, 0))


@triton.jit
def _cross_entropy_bwd_kernel(
    x_ptr,  # logits (N, C), strides (stride_xn, stride_xc)
    target_ptr,  # (N,), stride stride_t
    weight_ptr,  # HAS_WEIGHT: (C,)
    lse_ptr,  # fp32 (N,): the forward's
    grad_ptr,  # the loss's upstream gradient: (N,) with stride stride_g ("none"), or one element (stride 0)
    totals_ptr,  # fp32 (3,), or None: the forward's sums (MEAN reads the divisor, smoothing with weights W)
    grad_lse_ptr,  # HAS_LSE_GRAD: the lse's upstream gradient (N,), stride stride_gl
    dx_ptr,  # (N, C) contiguous, the logits' dtype (it may be x itself: each block is read, then written)
    C,  # the classes x holds: classes col0 .. col0 + C - 1 of C_ALL
    col0,
    C_ALL,
    stride_xn,
    stride_xc,
    stride_t,
    stride_g,
    stride_gl,
    ignore_index,
    smoothing,
    z_loss,
    softcap,
    MEAN: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_LSE_GRAD: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ALIGN: tl.constexpr,  # C, col0 and the row stride are multiples of it (jit.aligned)
    WINDOW: tl.constexpr,  # 0, or the row read in windows of vectors of WINDOW entries (jit.window_base)
):
    C = aligned(C, ALIGN)
    col0 = aligned(col0, ALIGN)
    stride_xn = aligned(stride_xn, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xn
    target, lse, w_t, g, coef, h = grad_terms(
        row, True, target_ptr, weight_ptr, lse_ptr, grad_ptr, totals_ptr, grad_lse_ptr, stride_t, stride_g,
        stride_gl, ignore_index, smoothing, z_loss, C_ALL, MEAN, HAS_WEIGHT, HAS_SMOOTHING, HAS_Z_LOSS,
        HAS_LSE_GRAD,
    )  # fmt: skip
    if WINDOW > 0:  # rows off their vectors' alignment (jit.window_base); x and dx share a head
        x_base, head = window_base(row * stride_xn, WINDOW)
        dx_base, _ = window_base(row * C, WINDOW)
        edges, on_edge = window_edges(head, C, WINDOW)  # first: dx may be x, read before written
        x_edge = tl.load(x_ptr + x_base + edges, mask=on_edge, other=0.0).to(tl.float32)
        d_edge = logit_grads(
            x_edge,
            edges - head + col0,
            on_edge,
            target,
            weight_ptr,
            lse,
            coef,
            w_t,
            g,
            h,
            smoothing,
            softcap,
            C_ALL,
            HAS_WEIGHT,
            HAS_SMOOTHING,
            HAS_SOFTCAP,
            HAS_LSE_GRAD,
        )
        tl.store(dx_ptr + dx_base + edges, d_edge.to(dx_ptr.dtype.element_ty), mask=on_edge)
        for start in range(0, head + C, BLOCK_C):
            positions = start + tl.arange(0, BLOCK_C)
            inner = window_interior(positions, head, C, WINDOW)
            x = tl.load(x_ptr + x_base + positions, mask=inner, other=0.0).to(tl.float32)
            d = logit_grads(
                x,
                positions - head + col0,
                inner,
                target,
                weight_ptr,
                lse,
                coef,
                w_t,
                g,
                h,
                smoothing,
                softcap,
                C_ALL,
                HAS_WEIGHT,
                HAS_SMOOTHING,
                HAS_SOFTCAP,
                HAS_LSE_GRAD,
            )
            tl.store(dx_ptr + dx_base + positions, d.to(dx_ptr.dtype.element_ty), mask=inner)
    else:
        for start in range(0, C, BLOCK_C):
            cols = start + tl.arange(0, BLOCK_C)
            mask = cols < C
            x = tl.load(x_row + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
            d = logit_grads(
                x,
                cols + col0,
                mask,
                target,
                weight_ptr,
                lse,
                coef,
                w_t,
                g,
                h,
                smoothing,
                softcap,
                C_ALL,
                HAS_WEIGHT,
                HAS_SMOOTHING,
                HAS_SOFTCAP,
                HAS_LSE_GRAD,
            )
            tl.store(dx_ptr + row * C + cols, d.to(dx_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- launches


def _step(classes: int, element_size: int) -> tuple[int, int]:
    """(BLOCK_C, num_warps): a row's logits a step, and the warps that fill it (WARP_BYTES a warp)."""
    block_c = min(next_power_of_2(classes), BLOCK_BYTES // element_size)
    return block_c, max(1, min(8, block_c * element_size // WARP_BYTES))


def _align(logits: torch.Tensor, *values: int) -> int:
    """The kernels' ALIGN (``_launch.row_align`` of ``values`` and the logits' row stride) where the
    logits' entries are contiguous; else 1."""
    if logits.stride(1) != 1:
        return 1
    return row_align((*values, logits.stride(0)), logits.element_size())


# Whether rows of logits that start off their vectors' alignment (an odd vocabulary: GPT-2's 50257)
# are read in windows (``_window``); False keeps them on ALIGN's narrower accesses (for a test).
WINDOWS = True


def _window(classes: int, tensors: tuple, row_strides: tuple) -> int:
    """The kernels' WINDOW (``_launch.row_window``) where the logits' entries are contiguous; else 0.
    ``tensors`` are the logits (and dx, written at its own row stride); a row is read in chunks,
    so no tile bounds its window."""
    if not WINDOWS or tensors[0].stride(1) != 1:
        return 0
    return row_window(classes, [(0, stride) for stride in row_strides], tensors)


def _flags(weight, smoothing: float, z_loss: float, softcap: float) -> dict:
    values = (weight is not None, smoothing > 0, z_loss > 0, softcap > 0)
    return dict(zip(("HAS_WEIGHT", "HAS_SMOOTHING", "HAS_Z_LOSS", "HAS_SOFTCAP"), values, strict=True))


def _needs_sums(reduction: str, weight, smoothing: float) -> bool:
    """Whether the forward runs the sum kernel: for a sum or mean, and for the backward's W."""
    return reduction != "none" or (weight is not None and smoothing > 0)


def _fwd_launches(input, target, weight, options: tuple, outputs: tuple) -> list[Launch]:
    """The row kernel (losses into ``rows``, or into ``out`` itself for "none") and, where
    :func:`_needs_sums`, the sum kernel. ``options``: (ignore_index, reduction, smoothing, z_loss,
    softcap); ``outputs``: :func:`_outputs`'."""
    ignore_index, reduction, smoothing, z_loss, softcap = options
    out, rows, lse, row_weight, totals = outputs
    n, classes = input.shape
    mean = reduction == "mean"
    losses = out if reduction == "none" else rows
    args = (
        input, target, weight, losses, lse, row_weight, classes,
        input.stride(0), input.stride(1), target.stride(0), ignore_index, smoothing, z_loss, softcap,
    )  # fmt: skip
    meta = _flags(weight, smoothing, z_loss, softcap) | {"HAS_DIVISOR": mean}  # in the kernels' order
    size, align = input.element_size(), _align(input, classes)
    block_c, warps = _step(classes, size)
    if rows_a_program := packed.packed_rows(n, classes, size, packed.vector_entries(input, classes)):
        meta |= packed.packed_meta(n, classes, size, rows_a_program, align)
        launches = [packed.fwd_launch(args, meta, n)]
    else:
        window = _window(classes, (input,), (input.stride(0),))
        # (the windows' bases carry the alignment)
        row_meta = {"BLOCK_C": block_c, "ALIGN": 1 if window else align, "WINDOW": window, "num_warps": warps}
        if segment := split.split_segment(n, classes, size, block_c, input.device):  # few long rows
            launches = split.fwd_launches(args, meta, row_meta, n, segment)
        else:
            launches = [Launch("fwd", _cross_entropy_fwd_kernel, args, meta | row_meta, grid=(n,))]
    if totals is not None:
        launches += sum_launches(weight, options, (out, rows, lse, row_weight, totals), n, classes)
    return launches if n else launches[1:]


def sum_launches(weight, options: tuple, outputs: tuple, n: int, classes: int) -> list[Launch]:
    """The sum kernel over ``n`` rows' losses (:func:`_fwd_launches`' last launch); over more than
    SUM_BLOCK rows, after programs of SUM_SPAN rows each have summed theirs (fp64 partials)."""
    _, reduction, smoothing, _, _ = options
    out, rows, _, row_weight, totals = outputs
    reduce, mean = reduction != "none", reduction == "mean"
    launches = []
    if reduce and SUM_SPAN and n > SUM_BLOCK:  # the rows' losses (and divisor terms) a span a program first
        partials = scratch((2, cdiv(n, SUM_SPAN)), torch.float64, rows.device)
        meta = {"MEAN": mean, "SPAN": SUM_SPAN, "num_warps": 4}
        args = (rows, row_weight, partials, n, partials.shape[1])
        launches.append(Launch("fwd sum spans", _cross_entropy_span_sums_kernel, args, meta, grid=args[-1:]))
        rows, row_weight, n = partials[0], partials[1], partials.shape[1]
    sums = (rows, row_weight, weight, out if reduce else None, totals, n, classes)
    meta = {"REDUCE": reduce, "MEAN": mean, "HAS_WEIGHT_SUM": weight is not None and smoothing > 0}
    meta |= {"BLOCK": SUM_BLOCK, "num_warps": 8}
    return [*launches, Launch("fwd sum", _cross_entropy_sum_kernel, sums, meta, grid=(1,))]


def _bwd_launches(
    grad, grad_lse, input, target, weight, lse, totals, options: tuple, dx, col0: int = 0, classes=None
) -> list[Launch]:
    """The backward's row kernel (``options`` as :func:`_fwd_launches`'); ``input`` may hold the
    classes ``col0`` on of ``classes`` (all of them by default)."""
    ignore_index, reduction, smoothing, z_loss, softcap = options
    n, width = input.shape
    args = (
        input, target, weight, lse, grad, totals, grad_lse, dx, width, col0, classes or width,
        input.stride(0), input.stride(1),
        target.stride(0), grad.stride(0) if reduction == "none" else 0,
        grad_lse.stride(0) if grad_lse is not None else 0, ignore_index, smoothing, z_loss, softcap,
    )  # fmt: skip
    meta = {"MEAN": reduction == "mean"} | _flags(weight, smoothing, z_loss, softcap)  # in the kernels' order
    meta["HAS_LSE_GRAD"] = grad_lse is not None
    size, align = input.element_size(), _align(input, width, col0)
    if not n:
        return []
    if rows_a_program := packed.packed_rows(n, width, size, packed.vector_entries(input, width, col0)):
        return [packed.bwd_launch(args, meta | packed.packed_meta(n, width, size, rows_a_program, align), n)]
    block_c, warps = _step(width, size)
    if segment := split.split_segment(n, width, size, block_c, input.device):  # few long rows
        meta |= {"BLOCK_C": block_c, "ALIGN": align, "num_warps": warps}
        return [split.bwd_launch(args, meta, n, segment)]
    window = _window(width, (input, dx), (input.stride(0), width))
    meta |= {"BLOCK_C": block_c, "ALIGN": 1 if window else align, "WINDOW": window, "num_warps": warps}
    return [Launch("bwd", _cross_entropy_bwd_kernel, args, meta, grid=(n,))]


# ---------------------------------------------------------------- ops and autograd


@op("cross_entropy", mutates=("out", "lse", "work"), replay=lambda: (WINDOWS,))
def _forward(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    smoothing: float,
    z_loss: float,
    softcap: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    work: torch.Tensor | None,
) -> None:
    options = (ignore_index, reduction, smoothing, z_loss, softcap)
    rows, row_weight, totals = _work_parts(work, input.shape[0], reduction)
    for launch in _fwd_launches(input, target, weight, options, (out, rows, lse, row_weight, totals)):
        launch.run()


@op("cross_entropy_backward", mutates=("dx",), replay=lambda: (WINDOWS,))
def _backward(
    grad: torch.Tensor,
    grad_lse: torch.Tensor | None,
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    lse: torch.Tensor,
    work: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    smoothing: float,
    z_loss: float,
    softcap: float,
    dx: torch.Tensor,
) -> None:
    options = (ignore_index, reduction, smoothing, z_loss, softcap)
    totals = _work_parts(work, input.shape[0], reduction)[2]
    for launch in _bwd_launches(grad, grad_lse, input, target, weight, lse, totals, options, dx):
        launch.run()


def _forward_outputs(input: torch.Tensor, reduction: str, sums: bool) -> tuple[torch.Tensor, ...]:
    """(out, lse, work): the loss (input's dtype), the fp32 lse, and one fp32 workspace for the rest
    where there are sums (``sums``, :func:`_needs_sums`; else None), :func:`_work_parts`: one
    allocation for three, each costing a GPU's host about a launch's Python (docs/perf-notes/host.md)."""
    n, device = input.shape[0], input.device
    out = empty_output((n,) if reduction == "none" else (), input.dtype, device)
    lse = empty_output((n,), torch.float32, device)
    if not sums:
        return out, lse, None
    size = 4 + (4 * ((n + 3) // 4) if reduction != "none" else 0) + (n if reduction == "mean" else 0)
    return out, lse, empty_output((size,), torch.float32, device)


def _work_parts(work: torch.Tensor | None, n: int, reduction: str) -> tuple[torch.Tensor | None, ...]:
    """(rows, row_weight, totals), views of :func:`_forward_outputs`' workspace: the totals (3 of 4
    entries), the rows' losses (a sum or mean), a mean's divisor terms, each on 16 bytes, or None."""
    if work is None:
        return None, None, None
    rows = work[4 : 4 + n] if reduction != "none" else None
    after = 4 + 4 * ((n + 3) // 4)
    return rows, work[after : after + n] if reduction == "mean" else None, work[:3]


class _CrossEntropy(torch.autograd.Function):
    """One autograd function for eager calls and torch.compile (the ops skip the dispatcher eagerly)."""

    @staticmethod
    def forward(ctx, input, target, weight, *options):
        ctx.set_materialize_grads(False)  # an unused lse's gradient stays None: no kernel reads zeros
        out, lse, work = _forward_outputs(input, options[1], _needs_sums(options[1], weight, options[2]))
        _forward(input, target, weight, *options, out, lse, work)
        ctx.save_for_backward(input, target, weight, lse, work)
        ctx.options = options
        return out, lse

    @staticmethod
    @first_derivative_only("cross_entropy")
    def backward(ctx, grad, grad_lse):
        input, target, weight, lse, work = ctx.saved_tensors
        reduction = ctx.options[1]
        if grad is None:  # only the lse is used: its gradient alone, the loss's upstream zero
            grad = torch.zeros((input.shape[0],) if reduction == "none" else (), device=input.device)
        grad = grad.expand(1) if grad.dim() == 0 else grad
        dx = empty_output_like(input)
        _backward(grad, grad_lse, input, target, weight, lse, work, *ctx.options, dx)
        return dx, None, None, None, None, None, None, None


def _validate(input, target, weight, reduction, label_smoothing, z_loss, softcap) -> None:
    check_tensor("input", input, dtypes=DTYPES)
    if input.dim() != 2:
        raise NotImplementedError(
            f"cross_entropy takes (N, C) logits; got input of shape {tuple(input.shape)} (flatten other "
            "dimensions into N, classes last)"
        )
    if isinstance(target, torch.Tensor) and target.is_floating_point():
        raise NotImplementedError(
            "cross_entropy takes class indices as target; class probabilities are not supported"
        )
    check_tensor("target", target, dtypes=TARGET_DTYPES, ndim=1, device_of=("input", input))
    if target.shape[0] != input.shape[0]:
        raise ValueError(f"target must have N = {input.shape[0]} entries, got {target.shape[0]}")
    if input.shape[1] == 0:
        raise ValueError("input must have at least one class")
    validate_options(input, input.shape[1], weight, reduction, label_smoothing, z_loss, softcap)


def validate_options(input, classes: int, weight, reduction, label_smoothing, z_loss, softcap) -> None:
    """The checks of everything but the logits and targets: class ``weight`` (fp32 or ``input``'s
    dtype, ``classes`` entries, on its device), the reduction and the numbers."""
    if weight is not None:
        check_tensor(
            "weight", weight, dtypes=(torch.float32, input.dtype), ndim=1, device_of=("input", input)
        )
        if weight.shape[0] != classes:
            raise ValueError(f"weight must have C = {classes} entries, got {weight.shape[0]}")
        if weight.requires_grad:
            raise NotImplementedError("cross_entropy has no gradient for weight: pass weight.detach()")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not (finite(z_loss) and z_loss >= 0):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss}")
    if softcap is not None and not (finite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap}")


def class_weights(weight: torch.Tensor | None) -> torch.Tensor | None:
    """The class weights as the kernels read them, entry c at weight_ptr + c (a (C,) view of any
    stride, an expanded one included, copied once)."""
    return weight if weight is None else weight.contiguous()


def class_index(ignore_index) -> int:
    """``ignore_index`` as an int, or TypeError (a float was once truncated to the class below it)."""
    index = as_int(ignore_index)
    if index is None:
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    return index


def cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    z_loss: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
):
    """``F.cross_entropy(input, target, weight, ignore_index=..., reduction=..., label_smoothing=...)``
    for (N, C) logits (fp32, fp16, bf16) and int64/int32 class indices, accumulated in fp32.

    ``z_loss`` adds z_loss * lse^2 to each row not ignored (PaLM's auxiliary loss); ``softcap``
    applies softcap * tanh(logits / softcap) first (Gemma's); ``return_lse`` also returns each
    row's fp32 log-sum-exp (of the capped logits), differentiable. The loss has the logits' dtype.
    A target outside 0..C-1 other than ignore_index gives that row (and a sum or mean) NaN rather
    than an error: checking would read the targets on the host."""
    label_smoothing, z_loss = float(label_smoothing), float(z_loss)
    _validate(input, target, weight, reduction, label_smoothing, z_loss, softcap)
    weight = class_weights(weight)
    options = (class_index(ignore_index), reduction, label_smoothing, z_loss, float(softcap or 0.0))
    if torch.is_grad_enabled() and input.requires_grad:
        loss, lse = _CrossEntropy.apply(input, target, weight, *options)
    else:
        out, lse, work = _forward_outputs(input, reduction, _needs_sums(reduction, weight, label_smoothing))
        _forward(input, target, weight, *options, out, lse, work)
        loss = out
    return (loss, lse) if return_lse else loss


# ---------------------------------------------------------------- reference and cost


def cross_entropy_reference(
    input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, *, z_loss=0.0,
    softcap=None, return_lse=False,
):  # fmt: skip
    """Plain PyTorch (``F.cross_entropy`` on the capped logits, the z term added per row); pass
    float64 logits for the oracle's reference."""
    x = input if softcap is None else softcap * torch.tanh(input / softcap)
    weight = weight.to(x.dtype) if weight is not None else None
    target = target.long()
    rows = torch.nn.functional.cross_entropy(
        x, target, weight, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    lse = torch.logsumexp(x, dim=1)
    kept = target != ignore_index
    rows = rows + z_loss * lse.square() * kept
    if reduction == "none":
        loss = rows
    elif reduction == "sum":
        loss = rows.sum()
    else:
        counted = kept.to(x.dtype) if weight is None else weight[target.clamp(0, x.shape[1] - 1)] * kept
        loss = rows.sum() / counted.sum()
    return (loss, lse.float() if x.dtype != torch.float64 else lse) if return_lse else loss


def cross_entropy_cost(shape: tuple, dtype: torch.dtype, mode: str = "fwd", reduction: str = "mean"):
    """Bytes of the launches (int64 targets, no class weights): the forward reads the logits and
    targets and writes the rows' losses, lse and the mean's divisor terms, then sums them; the
    backward reads logits, targets, lse, the upstream gradient and the sums, and writes dx."""
    from tritonkit.roofline import Cost

    n, classes = shape
    size = torch.finfo(dtype).bits // 8
    logits, flops = n * classes * size, 8 * n * classes
    rows = {"none": n * size + 4 * n, "sum": 8 * n + size + 12, "mean": 12 * n + size + 12}[reduction]
    fwd = Cost(flops, logits + 8 * n + rows)
    upstream = n * size if reduction == "none" else size
    sums = 0 if reduction == "none" else 12  # the forward's sums, which a mean's divisor is read from
    bwd = Cost(flops, 2 * logits + 8 * n + 4 * n + upstream + sums)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def _inspect_launches(shape: tuple, dtype: torch.dtype, config: dict | None = None, reduction="mean") -> list:
    """The forward and backward launches at ``shape`` (N, C): what ``tritonkit inspect`` compiles."""
    if config is not None:
        raise ValueError("cross_entropy has no tuning configs: its block follows from the classes and dtype")
    x = torch.empty(shape, dtype=dtype, device="meta")
    target = torch.empty(shape[:1], dtype=torch.int64, device="meta")
    out, lse, work = _forward_outputs(x, reduction, _needs_sums(reduction, None, 0.0))
    rows, row_weight, totals = _work_parts(work, shape[0], reduction)
    outputs, options = (out, rows, lse, row_weight, totals), (-100, reduction, 0.0, 0.0, 0.0)
    grad = torch.empty(shape[:1] if reduction == "none" else (1,), dtype=dtype, device="meta")
    return [
        *_fwd_launches(x, target, None, options, outputs),
        *_bwd_launches(grad, None, x, target, None, lse, totals, options, x),
    ]


def _make_inputs(shape: tuple, dtype: torch.dtype, device, generator: torch.Generator) -> tuple:
    """Logits and targets, every eighth row ignored (-100) from the eighth: a lone row's mean is finite."""
    from tritonkit.testing import random_tensor

    n, classes = shape
    target = torch.randint(0, classes, (n,), generator=generator, device=generator.device).to(device)
    target[7::8] = -100
    return random_tensor(shape, dtype, device, generator=generator), target


def _liger(kwargs: dict):
    from liger_kernel.transformers.functional import liger_cross_entropy

    def run(input, target):
        return liger_cross_entropy(input, target, reduction=kwargs.get("reduction", "mean"))

    return run


OPS = {
    "cross_entropy": Op(
        name="cross_entropy",
        family="cross_entropy",
        fn=cross_entropy,
        reference=cross_entropy_reference,
        cost=cross_entropy_cost,
        make_inputs=_make_inputs,
        grad_inputs=(0,),
        shapes=[((9, 37), "bf16"), ((5, 300), "fp32")],
        dims=("tokens", "classes"),
        inspect=_inspect_launches,
    )
}
WORKLOADS = {
    "cross_entropy": Workload(
        name="cross_entropy",
        op=OPS["cross_entropy"],
        flop_unit="fp32",
        # (tokens, vocabulary): the issue's vocabularies at 8192 tokens, and GPT-2's odd one
        shapes={
            "quick": [((8192, 32000), "bf16"), ((8192, 128256), "bf16"), ((8192, 262144), "bf16")],
            "full": [((8192, v), "bf16") for v in (32000, 50257, 50304, 128256, 151936, 262144)],
        },
        tiny_shape=(4, 256),
        peers={"liger": _liger},
    )
}
