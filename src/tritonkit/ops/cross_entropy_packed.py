"""Cross-entropy over many short rows: ROWS rows of logits a program, held as one (ROWS, BLOCK_C) tile.

The row-a-program kernels (cross_entropy.py) give a row of C logits one program whose warps fill
its block (C rounded up to a power of two): one warp for rows of at most WARP_BYTES. At 162064 rows
of 76 bf16 classes each of 162064 one-warp programs moved 152 bytes, and the forward ran at 4% of
the copy bandwidth (0.26x the best peer; the sweep, docs/perf-notes/cross-entropy.md). Rows whose
block one warp's vectors span (``packed_rows``) go here instead: a program loads TILE_BYTES of
logits, ROWS rows of BLOCK_C, and reduces along the tile's second axis, within each warp; a row's
targets, sums and gradient coefficients are (ROWS, 1) columns, the maths the row kernels'
(cross_entropy_math.py). No windows: the tile's rows are read at the accesses their alignment
allows (``ALIGN``)."""

from __future__ import annotations

from tritonkit._launch import VECTOR_BYTES, Launch, next_power_of_2, row_align
from tritonkit._triton import tl, triton
from tritonkit.jit import LOG2E, aligned
from tritonkit.ops.cross_entropy_math import capped, grad_terms, logit_grads, row_loss

# False keeps every row on the row kernels (a test's, a benchmark's comparison)
PACKED = True
# logits a program holds: a quarter of the row kernels' BLOCK_BYTES. On an H100, against 16 KB, 4 KB
# took 0.81-0.95x the forward's time and 0.87-1.00x the backward's at 327218 x 5 fp16, 107804 x 3
# fp32, 68647 x 11 bf16 and 162064 x 76 bf16 (8 KB 0.80-0.98x and 0.84-0.98x): more programs, of
# fewer rows each, keep more SMs loading (docs/perf-notes/cross-entropy.md)
TILE_BYTES = 4096
WARP_BYTES = 2048  # logits a warp holds: four 16-byte loads a thread


def packed_rows(n: int, classes: int, element_size: int, vector: int) -> int:
    """ROWS for ``n`` rows of ``classes`` logits of ``element_size`` bytes read ``vector`` entries an
    access (:func:`vector_entries`), or 0 where they are too long to pack and take the row kernels:
    rows whose block spans more than one warp's vectors were slower packed, their max and sums
    reduced across warps through shared memory (300 bf16 classes: the forward 0.69x the row
    kernel's; docs/perf-notes/cross-entropy.md)."""
    block_c = next_power_of_2(classes)
    if not PACKED or block_c > 32 * vector:
        return 0
    return min(TILE_BYTES // (block_c * element_size), next_power_of_2(n))


def vector_entries(logits, *values: int) -> int:
    """Entries an access of the logits' rows takes: the largest power of two, at most VECTOR_BYTES,
    dividing every one of ``values`` (the row's length and its strides), where the entries are
    contiguous; else 1. (``row_align``'s, but for rows Triton already knows to be multiples of 16,
    for which it answers 1.)"""
    if logits.stride(1) != 1:
        return 1
    values = (*values, logits.stride(0))
    if all(value % 16 == 0 for value in values):
        return VECTOR_BYTES // logits.element_size()
    return row_align(values, logits.element_size())


def packed_meta(n: int, classes: int, element_size: int, rows: int, align: int) -> dict:
    """The packed kernels' ROWS, BLOCK_C, ALIGN (``align``) and num_warps (WARP_BYTES of the tile a
    warp), in the kernels' order."""
    block_c = next_power_of_2(classes)
    warps = max(1, min(8, rows * block_c * element_size // WARP_BYTES))
    return {"ROWS": rows, "BLOCK_C": block_c, "ALIGN": align, "num_warps": warps}


@triton.jit
def _tile(x_ptr, rows, row_in, C, stride_xn, stride_xc, BLOCK_C: tl.constexpr):
    """The (ROWS, BLOCK_C) tile of logits of ``rows`` (a (ROWS, 1) column) in fp32, its mask and
    its classes."""
    cols = tl.arange(0, BLOCK_C)[None, :]
    mask = row_in & (cols < C)
    x = tl.load(x_ptr + rows * stride_xn + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
    return x, mask, cols


@triton.jit
def _cross_entropy_fwd_packed_kernel(
    x_ptr,  # logits (N, C), strides (stride_xn, stride_xc)
    target_ptr,  # (N,) int64 or int32, stride stride_t
    weight_ptr,  # HAS_WEIGHT: class weights (C,), contiguous
    loss_ptr,  # (N,): each row's loss (the output itself, in its dtype, for reduction "none")
    lse_ptr,  # fp32 (N,)
    row_weight_ptr,  # HAS_DIVISOR: fp32 (N,), w_t of each row counted (0 ignored): the mean's divisor
    N,
    C,
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
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,  # C rounded up to a power of two: a row in one step
    ALIGN: tl.constexpr,  # C and the row stride are multiples of it (jit.aligned)
):
    C = aligned(C, ALIGN)
    stride_xn = aligned(stride_xn, ALIGN)
    rows = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]  # int64: N C may pass 2^31
    row_in = rows < N
    x, mask, cols = _tile(x_ptr, rows, row_in, C, stride_xn, stride_xc, BLOCK_C)
    x = tl.where(mask, capped(x, softcap, HAS_SOFTCAP), -float("inf"))
    m = tl.where(row_in, tl.max(x, 1, keep_dims=True), 0.0)  # rows past N: all -inf, shifted by 0
    lse = m + tl.log(tl.sum(tl.exp2((x - m) * LOG2E), 1, keep_dims=True))
    target = tl.load(target_ptr + rows * stride_t, mask=row_in, other=ignore_index)
    safe = tl.where((target >= 0) & (target < C), target, 0)
    x_t = tl.sum(tl.where(cols == safe, x, 0.0), 1, keep_dims=True)  # the target's logit, from the tile
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
        w_t = tl.load(weight_ptr + safe, mask=row_in, other=0.0).to(tl.float32)
    else:
        w = 1.0
        w_t = 1.0
    sum_wx = 0.0
    sum_w = 0.0
    if HAS_SMOOTHING:
        sum_wx = tl.sum(w * tl.where(mask, x, 0.0), 1, keep_dims=True)
        if HAS_WEIGHT:
            sum_w = tl.sum(w, 1, keep_dims=True)
    loss, counted = row_loss(
        lse, target, x_t, w_t, sum_wx, sum_w, C, ignore_index, smoothing, z_loss,
        HAS_WEIGHT, HAS_SMOOTHING, HAS_Z_LOSS,
    )  # fmt: skip
    tl.store(loss_ptr + rows, loss.to(loss_ptr.dtype.element_ty), mask=row_in)
    tl.store(lse_ptr + rows, lse, mask=row_in)
    if HAS_DIVISOR:
        tl.store(row_weight_ptr + rows, counted, mask=row_in)


@triton.jit
def _cross_entropy_bwd_packed_kernel(
    x_ptr,  # logits (N, C), strides (stride_xn, stride_xc)
    target_ptr,  # (N,), stride stride_t
    weight_ptr,  # HAS_WEIGHT: (C,)
    lse_ptr,  # fp32 (N,): the forward's
    grad_ptr,  # the loss's upstream gradient: (N,) with stride stride_g ("none"), or one element (stride 0)
    totals_ptr,  # fp32 (3,), or None: the forward's sums (MEAN reads the divisor, smoothing with weights W)
    grad_lse_ptr,  # HAS_LSE_GRAD: the lse's upstream gradient (N,), stride stride_gl
    dx_ptr,  # (N, C) contiguous, the logits' dtype (it may be x itself: the tile is read, then written)
    N,
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
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ALIGN: tl.constexpr,  # C, col0 and the row stride are multiples of it (jit.aligned)
):
    C = aligned(C, ALIGN)
    col0 = aligned(col0, ALIGN)
    stride_xn = aligned(stride_xn, ALIGN)
    rows = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]
    row_in = rows < N
    target, lse, w_t, g, coef, h = grad_terms(
        rows, row_in, target_ptr, weight_ptr, lse_ptr, grad_ptr, totals_ptr, grad_lse_ptr, stride_t,
        stride_g, stride_gl, ignore_index, smoothing, z_loss, C_ALL, MEAN, HAS_WEIGHT, HAS_SMOOTHING,
        HAS_Z_LOSS, HAS_LSE_GRAD,
    )  # fmt: skip
    x, mask, cols = _tile(x_ptr, rows, row_in, C, stride_xn, stride_xc, BLOCK_C)
    d = logit_grads(
        x, cols + col0, mask, target, weight_ptr, lse, coef, w_t, g, h, smoothing, softcap, C_ALL,
        HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP, HAS_LSE_GRAD,
    )  # fmt: skip
    tl.store(dx_ptr + rows * C + cols, d.to(dx_ptr.dtype.element_ty), mask=mask)


def fwd_launch(args: tuple, meta: dict, n: int) -> Launch:
    """The packed forward over ``n`` rows: ``args`` and ``meta`` those of the row kernel
    (cross_entropy._fwd_launches) but for N before C, and ROWS, BLOCK_C and num_warps."""
    grid = (-(-n // meta["ROWS"]),)
    return Launch("fwd", _cross_entropy_fwd_packed_kernel, (*args[:6], n, *args[6:]), meta, grid=grid)


def bwd_launch(args: tuple, meta: dict, n: int) -> Launch:
    """The packed backward over ``n`` rows, likewise (cross_entropy._bwd_launches' args, N before C)."""
    grid = (-(-n // meta["ROWS"]),)
    return Launch("bwd", _cross_entropy_bwd_packed_kernel, (*args[:8], n, *args[8:]), meta, grid=grid)
