"""Cross-entropy over few long rows: each row split into segments, a program each, side by side.

The row kernels (cross_entropy.py) give a row one program: 2 rows of 12291808 fp16 logits were 2
programs on 132 SMs, the forward 0.08x the best peer and the backward 0.42x; 4 rows of 13795015
fp32 0.45x and 0.63x (the sweep, docs/perf-notes/cross-entropy.md). Where the rows are fewer than
the SMs and each holds at least SPLIT_MIN_ROW_BYTES, a row is cut into segments of a whole number of
blocks, about SPLIT_PER_SM programs an SM in all:

- forward, in two launches: each segment's (max, sum of exponentials, smoothing sums), the row
  kernels' ``row_sums`` over the segment (in windows where the rows start off their vectors), into
  fp64 partials; then a program a row combines its segments' in a fixed order (the same bits each
  call) and finishes the row as the row kernel does: its lse, target logit, loss.
- backward, in one: a segment's logits' gradients need only the row's lse, target and upstream
  gradient, so each program writes its segment's (at the accesses the rows' alignment allows).
"""

from __future__ import annotations

import torch

from tritonkit._launch import Launch, cdiv, next_power_of_2, scratch
from tritonkit._runtime import sm_count
from tritonkit._triton import tl, triton
from tritonkit.jit import LOG2E, aligned
from tritonkit.ops.cross_entropy_math import (
    capped,
    grad_terms,
    logit_grads,
    row_loss,
    row_sums,
    row_sums_in_window,
)

SPLIT_MIN_ROW_BYTES = 1 << 20  # shorter rows keep a program each (their launch and reads are the time)
SPLIT_PER_SM = 2  # programs an SM the segments aim for


def split_segment(n: int, classes: int, element_size: int, block_c: int, device) -> int:
    """Logits a segment (a multiple of ``block_c``) for ``n`` rows of ``classes``, or 0 where the rows
    stay a program each: no rows, as many rows as SMs or more, or rows under SPLIT_MIN_ROW_BYTES."""
    sms = sm_count(device)
    if not SPLIT_PER_SM or not 0 < n < sms or classes * element_size < SPLIT_MIN_ROW_BYTES:
        return 0
    segments = max(2, SPLIT_PER_SM * sms // n)
    return cdiv(cdiv(classes, segments), block_c) * block_c


@triton.jit
def _cross_entropy_segments_kernel(
    x_ptr,  # logits (N, C), strides (stride_xn, stride_xc)
    weight_ptr,  # HAS_WEIGHT and HAS_SMOOTHING: class weights (C,), contiguous
    partials_ptr,  # fp64 (4, N, S): each segment's max, sum of exp(x - max), sum_c w_c x_c, sum_c w_c
    N,
    C,
    S,  # segments a row
    SEGMENT,  # logits a segment (a multiple of BLOCK_C)
    stride_xn,
    stride_xc,
    softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ALIGN: tl.constexpr,  # C and the row stride are multiples of it (jit.aligned)
    WINDOW: tl.constexpr,  # 0, or the row read in windows of vectors of WINDOW entries (jit.window_base)
):
    C = aligned(C, ALIGN)
    stride_xn = aligned(stride_xn, ALIGN)
    row = tl.program_id(0) // S
    segment = tl.program_id(0) % S
    start = segment.to(tl.int64) * SEGMENT
    length = aligned(tl.minimum(SEGMENT, C - start), ALIGN)
    offset = row.to(tl.int64) * stride_xn + start * stride_xc
    if HAS_WEIGHT:
        w_ptr = weight_ptr + start  # the segment's classes' weights
    else:
        w_ptr = weight_ptr
    if WINDOW > 0:  # (SEGMENT is a multiple of WINDOW: a segment starts where its row would)
        m, s, sum_wx, sum_w = row_sums_in_window(
            x_ptr, w_ptr, offset, length, softcap, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP, BLOCK_C, WINDOW,
        )  # fmt: skip
    else:
        m, s, sum_wx, sum_w = row_sums(
            x_ptr + offset, w_ptr, length, stride_xc, softcap,
            HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP, BLOCK_C,
        )  # fmt: skip
    place = partials_ptr + row * S + segment
    tl.store(place, m.to(tl.float64))
    tl.store(place + N * S, s)
    if HAS_SMOOTHING:
        tl.store(place + 2 * N * S, sum_wx.to(tl.float64))
        if HAS_WEIGHT:
            tl.store(place + 3 * N * S, sum_w.to(tl.float64))


@triton.jit
def _cross_entropy_rows_of_segments_kernel(
    x_ptr,  # logits (N, C), strides (stride_xn, stride_xc): the target's logit
    target_ptr,  # (N,) int64 or int32, stride stride_t
    weight_ptr,  # HAS_WEIGHT: class weights (C,), contiguous
    loss_ptr,  # (N,): each row's loss (the output itself, in its dtype, for reduction "none")
    lse_ptr,  # fp32 (N,)
    row_weight_ptr,  # HAS_DIVISOR: fp32 (N,), w_t of each row counted
    partials_ptr,  # fp64 (4, N, S): _cross_entropy_segments_kernel's
    N,
    C,
    S,
    stride_xn,
    stride_xc,
    stride_t,
    ignore_index,
    smoothing,
    z_loss,
    softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_DIVISOR: tl.constexpr,
    BLOCK_S: tl.constexpr,  # S rounded up to a power of two
):
    """A row's segments' partials combined (in fp64, in the segments' order), then its loss."""
    row = tl.program_id(0).to(tl.int64)
    segments = tl.arange(0, BLOCK_S)
    place = partials_ptr + row * S + segments
    present = segments < S
    m_each = tl.load(place, mask=present, other=-float("inf")).to(tl.float32)
    m = tl.max(m_each, 0)
    shift = tl.where(m == -float("inf"), 0.0, m)
    scale = tl.exp2((m_each - shift) * LOG2E).to(tl.float64)
    s = tl.sum(tl.load(place + N * S, mask=present, other=0.0) * scale, 0)
    lse = m + tl.log(s.to(tl.float32))
    sum_wx = 0.0
    sum_w = 0.0
    if HAS_SMOOTHING:
        sum_wx = tl.sum(tl.load(place + 2 * N * S, mask=present, other=0.0), 0).to(tl.float32)
        if HAS_WEIGHT:
            sum_w = tl.sum(tl.load(place + 3 * N * S, mask=present, other=0.0), 0).to(tl.float32)
    target = tl.load(target_ptr + row * stride_t)
    safe = tl.where((target >= 0) & (target < C), target, 0).to(tl.int64)
    x_t = capped(tl.load(x_ptr + row * stride_xn + safe * stride_xc).to(tl.float32), softcap, HAS_SOFTCAP)
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
def _cross_entropy_bwd_segments_kernel(
    x_ptr,  # logits (N, C), strides (stride_xn, stride_xc)
    target_ptr,  # (N,), stride stride_t
    weight_ptr,  # HAS_WEIGHT: (C,)
    lse_ptr,  # fp32 (N,): the forward's
    grad_ptr,  # the loss's upstream gradient: (N,) with stride stride_g ("none"), or one element (stride 0)
    totals_ptr,  # fp32 (3,), or None: the forward's sums
    grad_lse_ptr,  # HAS_LSE_GRAD: the lse's upstream gradient (N,), stride stride_gl
    dx_ptr,  # (N, C) contiguous, the logits' dtype (it may be x itself: each block is read, then written)
    C,  # the classes x holds: classes col0 .. col0 + C - 1 of C_ALL
    col0,
    C_ALL,
    S,
    SEGMENT,
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
):
    C = aligned(C, ALIGN)
    col0 = aligned(col0, ALIGN)
    stride_xn = aligned(stride_xn, ALIGN)
    row = (tl.program_id(0) // S).to(tl.int64)
    start = (tl.program_id(0) % S).to(tl.int64) * SEGMENT
    target, lse, w_t, g, coef, h = grad_terms(
        row, True, target_ptr, weight_ptr, lse_ptr, grad_ptr, totals_ptr, grad_lse_ptr, stride_t, stride_g,
        stride_gl, ignore_index, smoothing, z_loss, C_ALL, MEAN, HAS_WEIGHT, HAS_SMOOTHING, HAS_Z_LOSS,
        HAS_LSE_GRAD,
    )  # fmt: skip
    end = tl.minimum(start + SEGMENT, C)
    for block in range(start, end, BLOCK_C):
        cols = block + tl.arange(0, BLOCK_C)
        mask = cols < end
        x = tl.load(x_ptr + row * stride_xn + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
        d = logit_grads(
            x, cols + col0, mask, target, weight_ptr, lse, coef, w_t, g, h, smoothing, softcap, C_ALL,
            HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP, HAS_LSE_GRAD,
        )  # fmt: skip
        tl.store(dx_ptr + row * C + cols, d.to(dx_ptr.dtype.element_ty), mask=mask)


def fwd_launches(args: tuple, flags: dict, row_meta: dict, n: int, segment: int) -> list[Launch]:
    """The split forward over ``n`` rows: ``args`` the row kernel's (cross_entropy._fwd_launches),
    ``flags`` its HAS_ constexprs, ``row_meta`` its BLOCK_C, ALIGN, WINDOW and num_warps."""
    x, target, weight, losses, lse, row_weight, classes, stride_xn, stride_xc, stride_t, *options = args
    ignore_index, smoothing, z_loss, softcap = options
    segments = cdiv(classes, segment)
    partials = scratch((4, n, segments), torch.float64, x.device)
    has = {k: flags[k] for k in ("HAS_WEIGHT", "HAS_SMOOTHING", "HAS_SOFTCAP")}
    first = (x, weight, partials, n, classes, segments, segment, stride_xn, stride_xc, softcap)
    grid = (n * segments,)
    launches = [Launch("fwd segments", _cross_entropy_segments_kernel, first, has | row_meta, grid=grid)]
    second = (
        x, target, weight, losses, lse, row_weight, partials, n, classes, segments, stride_xn, stride_xc,
        stride_t, ignore_index, smoothing, z_loss, softcap,
    )  # fmt: skip
    meta = flags | {"BLOCK_S": next_power_of_2(segments), "num_warps": 4}
    return [*launches, Launch("fwd", _cross_entropy_rows_of_segments_kernel, second, meta, grid=(n,))]


def bwd_launch(args: tuple, meta: dict, n: int, segment: int) -> Launch:
    """The split backward over ``n`` rows: ``args`` the row kernel's (cross_entropy._bwd_launches),
    ``meta`` its constexprs but WINDOW."""
    width = args[8]
    segments = cdiv(width, segment)
    args = (*args[:11], segments, segment, *args[11:])
    return Launch("bwd", _cross_entropy_bwd_segments_kernel, args, meta, grid=(n * segments,))
