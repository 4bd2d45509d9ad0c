"""The second stage of a reduction over rows: fp32 partial sums, a row a program of the first stage
(a norm's dw and db, bias_gelu's and linear's db, split-K's partial products), summed down their
columns in one launch that casts the result as it stores it, in a fixed order (the same bits on
every run). A launch, not a torch sum and copy after the first stage's kernel, so that an op made
of launches alone replays them (``opdef``'s ``replay``)."""

from __future__ import annotations

from tritonkit._launch import Launch, cdiv, next_power_of_2, row_align
from tritonkit._runtime import interpret
from tritonkit._triton import tl, triton
from tritonkit.jit import aligned

INTERPRETER_SUM_COLUMNS = 1024  # columns a program under the interpreter

# Untuned, one rule: about SUM_PROGRAMS programs (two an SM), BLOCK_COLS columns a program within
# 8-64 fp32 (a 32-byte sector to two 128-byte lines a partial row), each adding tiles of at most
# SUM_TILE values (32 a thread at SUM_WARPS warps) a step, of both partials at once.
SUM_PROGRAMS = 256
SUM_TILE = 4096
SUM_WARPS = 4


@triton.jit
def _sum_partials_kernel(
    dw_partial_ptr,  # fp32 partial sums of dw, (PROGRAMS, N) (unused without HAS_WEIGHT)
    db_partial_ptr,  # fp32 partial sums of db, (PROGRAMS, N) (unused without HAS_BIAS)
    dw_ptr,  # dw, (N,), in the weight's dtype
    db_ptr,  # db, (N,), in the bias's dtype
    PROGRAMS,  # rows of partials: the backward's programs
    N,  # row length
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_P: tl.constexpr,  # partial rows a step loads
    BLOCK_COLS: tl.constexpr,  # columns a program sums
    ALIGN: tl.constexpr,  # N and the row strides are multiples of it (jit.aligned)
):
    """The backward's second stage: dw and db, each the column sums of its partials, in one launch
    that also casts them to the parameters' dtype. The steps add into a (BLOCK_P, BLOCK_COLS)
    accumulator, reduced across rows once at the end, so a step's loads wait on no reduction; the
    order of the additions is fixed, so the sums are the same bits on every run."""
    N = aligned(N, ALIGN)
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < N
    dw = tl.zeros([BLOCK_P, BLOCK_COLS], tl.float32)
    db = tl.zeros([BLOCK_P, BLOCK_COLS], tl.float32)
    for start in range(0, PROGRAMS, BLOCK_P):
        partial_rows = start + tl.arange(0, BLOCK_P)
        mask = (partial_rows < PROGRAMS)[:, None] & col_mask[None, :]
        offsets = partial_rows.to(tl.int64)[:, None] * N + cols[None, :]
        if HAS_WEIGHT:
            dw += tl.load(dw_partial_ptr + offsets, mask=mask, other=0.0)
        if HAS_BIAS:
            db += tl.load(db_partial_ptr + offsets, mask=mask, other=0.0)
    if HAS_WEIGHT:
        tl.store(dw_ptr + cols, tl.sum(dw, axis=0).to(dw_ptr.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(db_ptr + cols, tl.sum(db, axis=0).to(db_ptr.dtype.element_ty), mask=col_mask)


def sum_partials_launch(dw_partial, db_partial, dw, db, name: str = "bwd partial sums") -> Launch:
    """The second stage: it sums the (programs, N) fp32 partials of dw and db (each None where its
    output is) into ``dw`` and ``db``, in their dtypes (any two (N,) outputs: a bias's gradient
    alone, split-K's product flattened; ``name`` the launch's). One launch for both: as two torch
    sums, two casts and a memset it took 23 of the 234 us of LayerNorm's backward at 32768x4096
    bf16 on the H200."""
    partials = dw_partial if dw_partial is not None else db_partial
    programs, n = partials.shape
    block_cols = min(64, max(8, 1 << max(0, (n // SUM_PROGRAMS).bit_length() - 1)))
    if interpret():  # a program costs the interpreter milliseconds whatever its width: 16x fewer
        block_cols = INTERPRETER_SUM_COLUMNS
    block_p = min(SUM_TILE // block_cols, next_power_of_2(programs))
    args = (dw_partial, db_partial, dw, db, programs, n)  # None where absent (HAS_* leave them)
    meta = {
        "HAS_WEIGHT": dw is not None,
        "HAS_BIAS": db is not None,
        "BLOCK_P": block_p,
        "BLOCK_COLS": block_cols,
        "num_warps": SUM_WARPS,
        "ALIGN": row_align((n,), min(t.element_size() for t in (dw, db) if t is not None)),
    }
    return Launch(name, _sum_partials_kernel, args, meta, grid=(cdiv(n, block_cols),))
