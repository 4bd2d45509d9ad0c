"""Bias + GELU, fused: ``y = gelu(x + b)`` over the last dimension (the example elementwise op).

Maths. With ``z = x + b`` broadcast over rows,
    exact:  gelu(z) = z * Phi(z) = 0.5 * z * (1 + erf(z / sqrt(2)))
            gelu'(z) = Phi(z) + z * phi(z),  phi(z) = exp(-z^2 / 2) / sqrt(2 pi)
            (Phi from the lower tail erfc(|z| / sqrt 2) / 2: ``jit.normal_cdf``)
    tanh:   gelu(z) ~ 0.5 * z * (1 + t),  t = tanh(u),  u = sqrt(2 / pi) * (z + 0.044715 z^3)
            gelu'(z) ~ 0.5 * (1 + t) + 0.5 * z * sech^2(u) * sqrt(2 / pi) * (1 + 3 * 0.044715 z^2)
VJP: dx = dy * gelu'(z); db = sum over rows of dx.

Work. x (M, N) and b (N) are read once, y written once: forward bytes s * (2 M N + N). Backward
reads dy and x, writes dx, and reads/writes b-sized vectors: s * (3 M N + 2 N); the fp32 partial
sums of db add 4 * N * M / (BLOCK_M * ROW_TILES) bytes, about 1.5% of dx at the chosen tiles.
FLOPs are a handful per element on CUDA cores (counted below); at about 3 FLOP/byte against a
ridge point near 16 (fp32 on the H200), the op is memory-bound: its roofline is the copy bandwidth.

The add is done in fp32 and not rounded before the GELU, so the op is more accurate than eager
``F.gelu(x + b)`` in 16-bit dtypes, which rounds ``x + b`` first.
"""

from __future__ import annotations

import functools
import math

import torch

from tritonkit._launch import VECTOR_BYTES, Launch, cdiv, row_align, row_window, scratch
from tritonkit._runtime import empty_output_like, sm_count
from tritonkit._triton import tl, triton
from tritonkit.dtypes import FLOATS
from tritonkit.jit import (
    aligned,
    gelu_lean,
    gelu_lean_grad,
    window_base,
    window_edges,
    window_interior,
)
from tritonkit.opdef import check_tensor, first_derivative_only, op
from tritonkit.ops import Op, Workload
from tritonkit.partial_sums import sum_partials_launch

APPROXIMATIONS = ("none", "tanh")
DTYPES = FLOATS
# Tiles hold TILE_BYTES of input a program: at 4 warps, 64 bytes a thread, four 16-byte loads in
# flight per thread whatever the dtype. With 2048 elements a tile (two loads a thread in 16-bit
# dtypes) bf16 reached 59% of the copy bandwidth on the H200 against fp32's 87%.
TILE_BYTES = 8192
MAX_BLOCK_N = 1024
NUM_WARPS = 4
# Whether a contiguous input whose rows start off their vectors runs the flat kernels (the forward at
# any row length, the backward up to FLAT_BWD_MAX_N); False keeps the row tiles (what a test compares
# them with)
FLAT = True
# The flat forward gathers the bias an entry at a time, a 64-bit address each: at 4 warps (32 entries
# a thread) the sm_90 compile held 110 registers, 4 programs an SM; at 8 warps, 16 entries a thread
FLAT_WARPS = 8
# Whether the backward reads rows that start off their vectors in windows (_bias_gelu_bwd_window);
# False keeps them on ALIGN's narrower accesses (what a test compares them with)
WINDOWS = True
# A window tile's bytes of each input: at 2 KB (8 x 128 in 16 bits, 4 x 128 in fp32) the sm_90
# compile holds 64 registers a thread, 8 programs an SM, two tiles' loads in flight
WINDOW_TILE_BYTES = 2048


@triton.jit
def _tile_of_program(M, ROWS: tl.constexpr):
    """(row tile, column tile) of this program: the grid is flat, row tiles of ROWS rows fastest (a
    grid's second and third dimensions hold at most 65535 programs: a row of 13795015 fp32 entries
    is 107774 column blocks of the backward's 128)."""
    row_tiles = tl.cdiv(M, ROWS)
    return (tl.program_id(0) % row_tiles).to(tl.int64), tl.program_id(0) // row_tiles


@triton.jit
def _bias_gelu_fwd_kernel(
    x_ptr,  # input, (M, N), strides (stride_xm, stride_xn)
    b_ptr,  # bias, (N,), stride stride_bn
    y_ptr,  # output, (M, N), contiguous
    M,  # rows: every dimension of the input but the last
    N,  # columns: the last dimension
    stride_xm,  # elements between rows of x
    stride_xn,  # elements between columns of x (1 when contiguous; Triton specializes on it)
    stride_bn,  # elements between entries of b
    APPROX_TANH: tl.constexpr,  # tanh approximation instead of erf
    BLOCK_M: tl.constexpr,  # rows a program handles
    BLOCK_N: tl.constexpr,  # columns a program handles
    ALIGN: tl.constexpr,  # N and the row stride are multiples of it (jit.aligned)
):
    N = aligned(N, ALIGN)
    stride_xm = aligned(stride_xm, ALIGN)
    row_tile, col_tile = _tile_of_program(M, BLOCK_M)
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: M*N may pass 2^31
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask)
    b = tl.load(b_ptr + cols * stride_bn, mask=cols < N)
    z = x.to(tl.float32) + b.to(tl.float32)[None, :]
    y = gelu_lean(z, APPROX_TANH=APPROX_TANH, FAST=y_ptr.dtype.element_ty != tl.float32)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


# Rows that start off their 16-byte vectors (an odd length in 16 bits, or rows of 5) moved forward
# an entry or a few at a time in row tiles (327218 x 5 fp16: 0.64x torch.compile, the sweep's shard
# 7). A contiguous input is one run of M * N entries whatever its rows, so the flat forward reads it
# in 16-byte vectors and finds each entry's bias column from its place: one modulo a vector, then
# the vector's entries one past it (wrapping once, as a row is at least a vector long), or a modulo
# an entry where rows are shorter than a vector (TINY).
@triton.jit
def _bias_gelu_fwd_flat_kernel(
    x_ptr,  # input, numel entries, contiguous
    b_ptr,  # bias, (N,), stride stride_bn
    y_ptr,  # output, numel entries, contiguous
    numel,  # M * N
    N,  # columns
    stride_bn,  # elements between entries of b
    APPROX_TANH: tl.constexpr,  # tanh approximation instead of erf
    BLOCK: tl.constexpr,  # entries a program handles
    VECTOR: tl.constexpr,  # entries of a 16-byte vector
    TINY: tl.constexpr,  # N < VECTOR
):
    start = tl.program_id(0).to(tl.int64) * BLOCK  # int64: numel may pass 2^31
    vectors = tl.arange(0, BLOCK // VECTOR)[:, None] * VECTOR
    lanes = tl.arange(0, VECTOR)[None, :]
    offsets = start + vectors + lanes
    first_column = (start % N).to(tl.int32)
    if TINY:
        cols = (first_column + vectors + lanes) % N
    else:
        cols = (first_column + vectors) % N + lanes
        cols = tl.where(cols >= N, cols - N, cols)
    # Only the last program masks: a mask against a numel that is no multiple of VECTOR would keep
    # every program's accesses an entry wide
    if start + BLOCK <= numel:
        _flat_block(x_ptr, b_ptr, y_ptr, offsets, cols, None, stride_bn, APPROX_TANH)
    else:
        _flat_block(x_ptr, b_ptr, y_ptr, offsets, cols, offsets < numel, stride_bn, APPROX_TANH)


@triton.jit
def _flat_block(x_ptr, b_ptr, y_ptr, offsets, cols, mask, stride_bn, APPROX_TANH: tl.constexpr):
    """gelu(x + b) over a block of the flat forward, b gathered at each entry's column."""
    x = tl.load(x_ptr + offsets, mask=mask)
    b = tl.load(b_ptr + cols * stride_bn)  # (every column is a bias entry: no mask)
    z = x.to(tl.float32) + b.to(tl.float32)
    y = gelu_lean(z, APPROX_TANH=APPROX_TANH, FAST=y_ptr.dtype.element_ty != tl.float32)
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


# Backward tiles as forward; each program also walks ROW_TILES tiles down its columns, summing
# db in registers, so the fp32 partials of db are 1/(BLOCK_M * ROW_TILES) of dx's rows.
MAX_ROW_TILES = 16
PROGRAMS_PER_SM = 2  # what the backward keeps before a program walks more tiles


@triton.jit
def _bias_gelu_bwd_kernel(
    dy_ptr,  # upstream gradient, (M, N), strides (stride_dym, stride_dyn)
    x_ptr,  # input of the forward, (M, N), strides (stride_xm, stride_xn)
    b_ptr,  # bias, (N,), stride stride_bn
    dx_ptr,  # gradient of x, (M, N), contiguous
    db_partial_ptr,  # fp32 partial sums of db, (cdiv(M, BLOCK_M * ROW_TILES), N), contiguous
    M,  # rows
    N,  # columns
    stride_dym,  # elements between rows of dy
    stride_dyn,  # elements between columns of dy
    stride_xm,  # elements between rows of x
    stride_xn,  # elements between columns of x
    stride_bn,  # elements between entries of b
    APPROX_TANH: tl.constexpr,  # tanh approximation instead of erf
    BLOCK_M: tl.constexpr,  # rows of one tile
    BLOCK_N: tl.constexpr,  # columns a program handles
    ROW_TILES: tl.constexpr,  # tiles a program walks down its columns
    ALIGN: tl.constexpr,  # N and the row strides are multiples of it (jit.aligned)
    WINDOW: tl.constexpr,  # 0, or rows read in windows of vectors of WINDOW entries (_bwd_window)
):
    if WINDOW > 0:
        _bias_gelu_bwd_window(
            dy_ptr, x_ptr, b_ptr, dx_ptr, db_partial_ptr, M, N, stride_dym, stride_xm, stride_bn,
            APPROX_TANH, BLOCK_M, BLOCK_N, ROW_TILES, WINDOW,
        )  # fmt: skip
    else:
        _bias_gelu_bwd_tiles(
            dy_ptr, x_ptr, b_ptr, dx_ptr, db_partial_ptr, M, N, stride_dym, stride_dyn, stride_xm,
            stride_xn, stride_bn, APPROX_TANH, BLOCK_M, BLOCK_N, ROW_TILES, ALIGN,
        )  # fmt: skip


@triton.jit
def _bias_gelu_bwd_tiles(
    dy_ptr, x_ptr, b_ptr, dx_ptr, db_partial_ptr, M, N, stride_dym, stride_dyn, stride_xm, stride_xn,
    stride_bn, APPROX_TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROW_TILES: tl.constexpr, ALIGN: tl.constexpr,
):  # fmt: skip
    """The backward on rows whose vectors' alignment Triton knows: a tile's columns line up down it,
    so db's column sums are the tile's sums down its rows."""
    N = aligned(N, ALIGN)
    stride_dym = aligned(stride_dym, ALIGN)
    stride_xm = aligned(stride_xm, ALIGN)
    row_tile, col_tile = _tile_of_program(M, BLOCK_M * ROW_TILES)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    b = tl.load(b_ptr + cols * stride_bn, mask=col_mask).to(tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    first_row = row_tile * (BLOCK_M * ROW_TILES)
    for tile in range(ROW_TILES):
        rows = first_row + tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < M) & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + cols[None, :] * stride_dyn, mask=mask)
        dz = dy.to(tl.float32) * gelu_lean_grad(
            x.to(tl.float32) + b[None, :], APPROX_TANH=APPROX_TANH, FAST=dx_ptr.dtype.element_ty != tl.float32
        )
        tl.store(dx_ptr + rows[:, None] * N + cols[None, :], dz.to(dx_ptr.dtype.element_ty), mask=mask)
        db += tl.sum(tl.where(mask, dz, 0.0), axis=0)
    tl.store(db_partial_ptr + row_tile * N + cols, db, mask=col_mask)


# Rows that start off their vectors (an odd row length in 16 bits): read 2 bytes at a time, the
# backward held a sixth of the aligned kernel's loads in flight (its registers full of 16-bit
# values) and ran at 13% of the copy bandwidth (0.23x torch at 38788 x 3027 bf16 on the H200). In
# windows (jit.window_base) every vector wholly inside a row is one 16-byte access. A tile is
# WINDOW rows from a multiple of WINDOW, so its row i starts ``head`` (r * stride mod WINDOW, the
# same for i's rows in every tile) past its window: the program's column block k covers positions
# k * BLOCK_N + p of each window, columns k * BLOCK_N + p - head, the same columns of row i in every
# tile. So db's sums are kept per row of the tile (as the tile lies) and its partials written a row
# of db_partial for each (row program, i), each at its own columns. The entries of a row's first
# and last vectors that are not whole (at most 2 * WINDOW - 2) are column block 0's, one at a time.


@triton.jit
def _bias_gelu_bwd_window(
    dy_ptr, x_ptr, b_ptr, dx_ptr, db_partial_ptr, M, N, stride_dym, stride_xm, stride_bn,
    APPROX_TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROW_TILES: tl.constexpr,
    WINDOW: tl.constexpr,
):  # fmt: skip
    """The backward in windows (above): BLOCK_M is WINDOW; x's, dy's and dx's row strides agree
    modulo WINDOW and their entries are contiguous."""
    row_tile, block = _tile_of_program(M, BLOCK_M * ROW_TILES)
    first_row = row_tile * (BLOCK_M * ROW_TILES)
    place = tl.arange(0, BLOCK_M)
    head = window_base((first_row + place) * stride_xm, WINDOW)[1]  # (the same in every tile)
    positions = block * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    inner = window_interior(positions, head[:, None], N, WINDOW)
    edges, on_edge = window_edges(head[:, None], N, WINDOW)
    on_edge &= block == 0
    cols, edge_cols = positions - head[:, None], edges - head[:, None]
    b = tl.load(b_ptr + cols * stride_bn, mask=inner).to(tl.float32)
    b_edge = tl.load(b_ptr + edge_cols * stride_bn, mask=on_edge).to(tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_edge = tl.zeros([BLOCK_M, 2 * WINDOW], dtype=tl.float32)
    x_next, dy_next = _window_tile(
        x_ptr, dy_ptr, first_row + place, M, stride_xm, stride_dym, positions, inner, WINDOW
    )
    for tile in range(ROW_TILES):
        rows = first_row + tile * BLOCK_M + place
        in_rows = (rows < M)[:, None]
        # the next tile's loads in flight under this one's arithmetic (issued here, used a step on)
        x, dy = x_next, dy_next
        x_next, dy_next = _window_tile(
            x_ptr,
            dy_ptr,
            rows + BLOCK_M,
            M,
            stride_xm,
            stride_dym,
            positions,
            inner & (tile + 1 < ROW_TILES),
            WINDOW,
        )
        x_base = window_base(rows * stride_xm, WINDOW)[0]
        dy_base = window_base(rows * stride_dym, WINDOW)[0]
        dx_base = window_base(rows * N, WINDOW)[0]
        mask = inner & in_rows
        dz = dy.to(tl.float32) * gelu_lean_grad(
            x.to(tl.float32) + b, APPROX_TANH=APPROX_TANH, FAST=dx_ptr.dtype.element_ty != tl.float32
        )
        tl.store(dx_ptr + dx_base[:, None] + positions, dz.to(dx_ptr.dtype.element_ty), mask=mask)
        db += tl.where(mask, dz, 0.0)
        if block == 0:  # (the other blocks would compute the masked edges for nothing)
            edge = on_edge & in_rows
            x_edge = tl.load(x_ptr + x_base[:, None] + edges, mask=edge).to(tl.float32)
            dy_edge = tl.load(dy_ptr + dy_base[:, None] + edges, mask=edge).to(tl.float32)
            dz_edge = dy_edge * gelu_lean_grad(
                x_edge + b_edge, APPROX_TANH=APPROX_TANH, FAST=dx_ptr.dtype.element_ty != tl.float32
            )
            tl.store(dx_ptr + dx_base[:, None] + edges, dz_edge.to(dx_ptr.dtype.element_ty), mask=edge)
            db_edge += tl.where(edge, dz_edge, 0.0)
    partial = db_partial_ptr + (row_tile * BLOCK_M + place)[:, None] * N
    tl.store(partial + cols, db, mask=inner)  # (rows past M: zeros, so that every entry is written)
    tl.store(partial + edge_cols, db_edge, mask=on_edge)


@triton.jit
def _window_tile(x_ptr, dy_ptr, rows, M, stride_xm, stride_dym, positions, inner, WINDOW: tl.constexpr):
    """x's and dy's whole vectors of a tile of rows in windows (what the window backward computes on)."""
    mask = inner & (rows < M)[:, None]
    x = tl.load(x_ptr + window_base(rows * stride_xm, WINDOW)[0][:, None] + positions, mask=mask)
    dy = tl.load(dy_ptr + window_base(rows * stride_dym, WINDOW)[0][:, None] + positions, mask=mask)
    return x, dy


# Rows of at most FLAT_BWD_MAX_N entries off their vectors go backward flat too: row tiles move them
# an entry at a time (327218 x 5 fp16: 0.81x torch; 107804 x 3 fp32 0.39x, 55993 x 14 fp32 0.59x in
# the sweep). The run is walked in chunks of L entries, L a multiple of N and of VECTOR, so every
# chunk starts on a row and on a vector: an entry's column is its place in the chunk modulo N, the
# same in every chunk, and db's sums are kept a place (acc) over the program's chunks, then summed
# by column, FLAT_BWD_MAX_N (padded to NP) reductions a program, into a (programs, N) partial.
FLAT_BWD_MAX_N = 16
# A chunk's tile, of each of x and dy, at FLAT_WARPS: at 8 KB (16 entries a thread in 16 bits) the
# sm_90 compile held 105 registers, 2 programs an SM; at 4 KB 80, 3 programs an SM (fp32: 40, 6)
FLAT_BWD_TILE_BYTES = 4096


@triton.jit
def _bias_gelu_bwd_flat_kernel(
    dy_ptr,  # upstream gradient, numel entries, contiguous
    x_ptr,  # input of the forward, numel entries, contiguous
    b_ptr,  # bias, (N,), stride stride_bn
    dx_ptr,  # gradient of x, numel entries, contiguous
    db_partial_ptr,  # fp32 partial sums of db, (programs, N), contiguous
    numel,  # M * N
    N,  # columns
    stride_bn,  # elements between entries of b
    chunk_vectors,  # vectors a chunk: L = chunk_vectors * VECTOR entries, a multiple of N
    APPROX_TANH: tl.constexpr,  # tanh approximation instead of erf
    BLOCK: tl.constexpr,  # entries a chunk's tile holds (L or more)
    VECTOR: tl.constexpr,  # entries of a 16-byte vector
    NP: tl.constexpr,  # N padded to a power of two
    CHUNKS: tl.constexpr,  # chunks a program walks
):
    vectors = tl.arange(0, BLOCK // VECTOR)[:, None]
    places = vectors * VECTOR + tl.arange(0, VECTOR)[None, :]
    in_chunk = vectors < chunk_vectors  # (a vector's entries alike: its accesses stay 16 bytes)
    b = tl.load(b_ptr + places % N * stride_bn).to(tl.float32)  # (every column a bias entry: no mask)
    acc = tl.zeros([BLOCK // VECTOR, VECTOR], dtype=tl.float32)
    length = chunk_vectors.to(tl.int64) * VECTOR
    for k in range(CHUNKS):
        start = (tl.program_id(0).to(tl.int64) * CHUNKS + k) * length
        if start + length <= numel:
            acc += _flat_grads(dy_ptr, x_ptr, dx_ptr, start + places, in_chunk, b, APPROX_TANH)
        else:  # the last chunk: masked an entry at a time
            mask = in_chunk & (start + places < numel)
            acc += _flat_grads(dy_ptr, x_ptr, dx_ptr, start + places, mask, b, APPROX_TANH)
    acc = acc.to(tl.float64)  # (a column's sum over a thousand places or more, once a program)
    cols = places % N  # (made again here, not held through the chunks)
    for n in tl.static_range(NP):
        if n < N:
            column_sum = tl.sum(tl.where(cols == n, acc, 0.0))
            tl.store(db_partial_ptr + tl.program_id(0) * N + n, column_sum.to(tl.float32))


@triton.jit
def _flat_grads(dy_ptr, x_ptr, dx_ptr, offsets, mask, b, APPROX_TANH: tl.constexpr):
    """dx over a chunk of the flat backward, stored; returns its values, zero where masked."""
    x = tl.load(x_ptr + offsets, mask=mask)
    dy = tl.load(dy_ptr + offsets, mask=mask)
    FAST: tl.constexpr = dx_ptr.dtype.element_ty != tl.float32
    dz = dy.to(tl.float32) * gelu_lean_grad(x.to(tl.float32) + b, APPROX_TANH=APPROX_TANH, FAST=FAST)
    tl.store(dx_ptr + offsets, dz.to(dx_ptr.dtype.element_ty), mask=mask)
    return tl.where(mask, dz, 0.0)


# ---------------------------------------------------------------- launches


@functools.lru_cache(maxsize=1024)
def tile_shape(n_cols: int, element_size: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of a TILE_BYTES tile; as wide as the row up to MAX_BLOCK_N."""
    block_n = min(triton.next_power_of_2(n_cols), MAX_BLOCK_N)
    return max(1, TILE_BYTES // element_size // block_n), block_n


@functools.lru_cache(maxsize=1024)
def row_tiles_per_program(n_tiles: int, column_programs: int, sms: int) -> int:
    """Tiles a backward program walks: a power of two (few compiled variants), at most MAX_ROW_TILES,
    and fewer where more would leave under PROGRAMS_PER_SM programs an SM (128 rows of 16384
    entries walked 16 tiles a program: 32 programs for 132 SMs)."""
    most = max(1, n_tiles * column_programs // (PROGRAMS_PER_SM * sms))
    return min(MAX_ROW_TILES, triton.next_power_of_2(n_tiles), 1 << (most.bit_length() - 1))


def _validate(input, bias, approximate: str) -> None:
    check_tensor("input", input, dtypes=DTYPES, min_ndim=1)
    check_tensor("bias", bias, dtypes=(input.dtype,), ndim=1, device_of=("input", input))
    if bias.shape[0] != input.shape[-1]:
        raise ValueError(
            f"bias must have shape ({input.shape[-1]},) to match input's last dimension, "
            f"got {tuple(bias.shape)}"
        )
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")


def _fwd_launches(input, bias, y, approximate: str) -> list[Launch]:
    """The forward kernel's launch: tiles from the row length and dtype (no tuning); a contiguous
    input whose rows start off their 16-byte vectors in one flat run (``_bias_gelu_fwd_flat_kernel``)."""
    n_cols = input.shape[-1]
    x = input if input.dim() == 2 else input.reshape(-1, n_cols)  # a view whenever strides allow
    vector = VECTOR_BYTES // input.element_size()
    contiguous = x.stride(1) == 1 and (x.stride(0) == n_cols or x.shape[0] == 1)
    if FLAT and contiguous and n_cols % vector:
        return [_fwd_flat_launch(x, bias, y, approximate, vector)]
    block_m, block_n = tile_shape(n_cols, input.element_size())
    meta = {
        "APPROX_TANH": approximate == "tanh",
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "ALIGN": _align(n_cols, x, bias),
        "num_warps": NUM_WARPS,
    }
    args = (x, bias, y, x.shape[0], n_cols, x.stride(0), x.stride(1), bias.stride(0))
    return [
        Launch(
            "fwd",
            _bias_gelu_fwd_kernel,
            args,
            meta,
            grid=(cdiv(x.shape[0], block_m) * cdiv(n_cols, block_n),),
        )
    ]


def _fwd_flat_launch(x, bias, y, approximate: str, vector: int) -> Launch:
    """The flat forward over x's M * N contiguous entries: a TILE_BYTES block a program."""
    block = TILE_BYTES // x.element_size()
    n_cols = x.shape[1]
    meta = {
        "APPROX_TANH": approximate == "tanh",
        "BLOCK": block,
        "VECTOR": vector,
        "TINY": n_cols < vector,
        "num_warps": FLAT_WARPS,
    }
    args = (x, bias, y, x.numel(), n_cols, bias.stride(0))
    return Launch("fwd", _bias_gelu_fwd_flat_kernel, args, meta, grid=(cdiv(x.numel(), block),))


def _align(n_cols: int, *tensors: torch.Tensor) -> int:
    """The kernels' ALIGN (``_launch.row_align`` of the row length and the 2-D tensors' row
    strides) where every tensor's entries are contiguous; else 1."""
    if any(t.stride(-1) != 1 for t in tensors):
        return 1
    rows = [t.stride(0) for t in tensors if t.dim() == 2]
    return row_align((n_cols, *rows), min(t.element_size() for t in tensors))


def _bwd_launches(grad_output, input, bias, dx, db, approximate: str) -> list[Launch]:
    """The backward kernel's launch, then the sum of db's fp32 partials (the norms' second stage,
    which casts as it stores): one partial row a program's ROW_TILES tiles of rows, or in windows
    one per row of its tiles (``_bias_gelu_bwd_window``); ``db`` itself where that makes one row
    (a tiny input: no sum after the kernel). Narrow rows off their vectors go flat
    (``_bias_gelu_bwd_flat_kernel``)."""
    n_cols = input.shape[-1]
    x, dy = input.reshape(-1, n_cols), grad_output.reshape(-1, n_cols)
    if _flat_backward(x, dy):
        return _bwd_flat_launches(dy, x, bias, dx, db, approximate)
    block_m, block_n, row_tiles, window = _bwd_tiles(x, dy, dx.reshape(-1, n_cols))
    # in windows, enough column blocks that every row's columns, shifted by up to WINDOW - 1 from
    # its window's start, are covered
    row_programs = cdiv(x.shape[0], block_m * row_tiles)
    grid = (row_programs * cdiv(n_cols + max(window - 1, 0), block_n),)  # flat: _tile_of_program
    partial_rows = row_programs * (block_m if window else 1)
    if partial_rows == 1 and db.is_contiguous():  # one row of partials: db itself, cast as stored
        db_partial = db
    else:
        db_partial = scratch((partial_rows, n_cols), torch.float32, input.device)
    meta = {
        "APPROX_TANH": approximate == "tanh",
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "ROW_TILES": row_tiles,
        "ALIGN": 1 if window else _align(n_cols, x, bias, dy),
        "WINDOW": window,
        "num_warps": NUM_WARPS,
    }
    args = (
        dy,
        x,
        bias,
        dx,
        db_partial,
        x.shape[0],
        n_cols,
        dy.stride(0),
        dy.stride(1),
        x.stride(0),
        x.stride(1),
        bias.stride(0),
    )
    main = Launch("bwd", _bias_gelu_bwd_kernel, args, meta, grid=grid)
    return [main] if db_partial is db else [main, sum_partials_launch(None, db_partial, None, db)]


def _flat_backward(x: torch.Tensor, dy: torch.Tensor) -> bool:
    """Whether the (M, N) views go backward flat: FLAT's rows (contiguous, off their vectors)
    of at most FLAT_BWD_MAX_N entries, more than one plain tile of them (that one program sums db
    itself)."""
    n_rows, n_cols = x.shape
    vector = VECTOR_BYTES // x.element_size()
    contiguous = all(t.stride(1) == 1 and (t.stride(0) == n_cols or n_rows == 1) for t in (x, dy))
    one_tile = n_rows <= tile_shape(n_cols, x.element_size())[0]
    return FLAT and contiguous and n_cols % vector and n_cols <= FLAT_BWD_MAX_N and not one_tile


def _bwd_flat_launches(dy, x, bias, dx, db, approximate: str) -> list[Launch]:
    """The flat backward over chunks of L entries (the most whole lcm(N, VECTOR) runs a
    FLAT_BWD_TILE_BYTES tile holds), CHUNKS a program (a power of two, at most MAX_ROW_TILES,
    PROGRAMS_PER_SM programs an SM kept), then the sum of its (programs, N) partials into db."""
    n_cols, vector = x.shape[1], VECTOR_BYTES // x.element_size()
    block = FLAT_BWD_TILE_BYTES // x.element_size()
    period = math.lcm(n_cols, vector)
    chunk_vectors = block // period * period // vector
    chunks = cdiv(x.numel(), chunk_vectors * vector)
    per_program = row_tiles_per_program(chunks, 1, sm_count(x.device))
    programs = cdiv(chunks, per_program)
    db_partial = scratch((programs, n_cols), torch.float32, x.device)
    meta = {
        "APPROX_TANH": approximate == "tanh",
        "BLOCK": block,
        "VECTOR": vector,
        "NP": triton.next_power_of_2(n_cols),
        "CHUNKS": per_program,
        "num_warps": FLAT_WARPS,
    }
    args = (dy, x, bias, dx, db_partial, x.numel(), n_cols, bias.stride(0), chunk_vectors)
    main = Launch("bwd", _bias_gelu_bwd_flat_kernel, args, meta, grid=(programs,))
    return [main, sum_partials_launch(None, db_partial, None, db)]


def _bwd_tiles(x: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, ROW_TILES, WINDOW) of the backward over (M, N) views: WINDOW rows a tile in
    windows (``_launch.row_window``: rows off their vectors, entries contiguous), else tile_shape's."""
    n_rows, n_cols = x.shape
    window = 0
    # (an input of one plain tile of rows takes it whole: one program, whose db needs no sum after)
    one_tile = n_rows <= tile_shape(n_cols, x.element_size())[0]
    if WINDOWS and x.stride(1) == 1 and dy.stride(1) == 1 and not one_tile:
        views = [(0, x.stride(0)), (0, dy.stride(0)), (0, n_cols)]
        window = row_window(n_cols, views, (x, dy, dx))
    if n_cols < 2 * window:  # rows too short to hold a whole vector each: windows of WINDOW rows
        window = 0  # bought nothing but small tiles (327218 x 5 fp16: 0.28x the best peer, the sweep)
    if window:  # (a smaller tile: its db sums are kept per row, and the next tile is in flight)
        block_m, block_n = window, max(window, WINDOW_TILE_BYTES // x.element_size() // window)
        block_n = min(block_n, triton.next_power_of_2(n_cols + window - 1))
    else:
        block_m, block_n = tile_shape(n_cols, x.element_size())
    columns = cdiv(n_cols + max(window - 1, 0), block_n)
    row_tiles = row_tiles_per_program(cdiv(n_rows, block_m), columns, sm_count(x.device))
    return block_m, block_n, row_tiles, window


# ---------------------------------------------------------------- ops and autograd


@op("bias_gelu", mutates=("y",), replay=lambda: (FLAT,))
def _forward(input: torch.Tensor, bias: torch.Tensor, approximate: str, y: torch.Tensor) -> None:
    if y.numel():
        for launch in _fwd_launches(input, bias, y, approximate):
            launch.run()


@op("bias_gelu_backward", mutates=("dx", "db"), replay=lambda: (WINDOWS, FLAT))
def _backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    bias: torch.Tensor,
    approximate: str,
    dx: torch.Tensor,
    db: torch.Tensor,
) -> None:
    if grad_output.shape != input.shape or grad_output.dtype != input.dtype:
        raise ValueError(
            f"grad_output must match input: {tuple(input.shape)} {input.dtype}, "
            f"got {tuple(grad_output.shape)} {grad_output.dtype}"
        )
    if input.numel() == 0:  # before the reshape, which cannot infer -1 when the last dim is 0
        db.zero_()
        return
    for launch in _bwd_launches(grad_output, input, bias, dx, db, approximate):
        launch.run()


class _BiasGelu(torch.autograd.Function):
    """One autograd function for eager calls and torch.compile (the ops skip the dispatcher eagerly).

    forward takes ctx itself: with a separate setup_context, Function.apply binds arguments through
    inspect.signature on every call (about 10 us on the H200's host).
    """

    @staticmethod
    def forward(ctx, input, bias, approximate):
        ctx.save_for_backward(input, bias)
        ctx.approximate = approximate
        y = empty_output_like(input)
        _forward(input, bias, approximate, y)
        return y

    @staticmethod
    @first_derivative_only("bias_gelu")
    def backward(ctx, grad_output):
        input, bias = ctx.saved_tensors
        dx = empty_output_like(input)
        db = empty_output_like(bias)
        _backward(grad_output, input, bias, ctx.approximate, dx, db)
        return dx, db, None


def bias_gelu(input: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(input + bias)`` in one pass; ``approximate`` as in ``torch.nn.functional.gelu``.

    ``bias`` has shape ``(input.shape[-1],)``. The output is contiguous, in input's dtype.
    """
    _validate(input, bias, approximate)
    if torch.is_grad_enabled() and (input.requires_grad or bias.requires_grad):
        return _BiasGelu.apply(input, bias, approximate)
    y = empty_output_like(input)
    _forward(input, bias, approximate, y)
    return y


# ---------------------------------------------------------------- reference and cost


def bias_gelu_reference(input: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Plain PyTorch; pass float64 inputs for the oracle's reference."""
    return torch.nn.functional.gelu(input + bias, approximate=approximate)


# FLOPs per element, counting each add, multiply and special function once:
# forward: add bias, scale, erf, add one, two multiplies; backward: the forward's z and cdf (4),
# exp and its argument (3), z * phi (2), the sum with cdf, the multiply by dy and the db add.
FWD_FLOPS_PER_ELEMENT = 6
BWD_FLOPS_PER_ELEMENT = 12


def bias_gelu_cost(shape: tuple, dtype: torch.dtype, mode: str = "fwd"):
    from tritonkit.roofline import Cost

    n_cols, elements = shape[-1], math.prod(shape)
    size = torch.finfo(dtype).bits // 8
    fwd = Cost(FWD_FLOPS_PER_ELEMENT * elements, size * (2 * elements + n_cols))
    bwd = Cost(BWD_FLOPS_PER_ELEMENT * elements, size * (3 * elements + 2 * n_cols))
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def _inspect_launches(shape: tuple, dtype: torch.dtype, config: dict | None = None) -> list[Launch]:
    """The forward and backward launches for ``shape`` (exact GELU): what ``tritonkit inspect`` compiles."""
    if config is not None:
        raise ValueError("bias_gelu has no tuning configs: its tile follows from the row length and dtype")
    x, b = torch.empty(shape, dtype=dtype, device="meta"), torch.empty(shape[-1:], dtype=dtype, device="meta")
    return [*_fwd_launches(x, b, x, "none"), *_bwd_launches(x, x, b, x, torch.empty_like(b), "none")]


def _make_inputs(shape: tuple, dtype: torch.dtype, device, generator: torch.Generator) -> tuple:
    from tritonkit.testing import random_tensor

    return (
        random_tensor(shape, dtype, device, generator=generator),
        random_tensor(shape[-1:], dtype, device, generator=generator),
    )


OPS = {
    "bias_gelu": Op(
        name="bias_gelu",
        family="elementwise",
        fn=bias_gelu,
        reference=bias_gelu_reference,
        cost=bias_gelu_cost,
        make_inputs=_make_inputs,
        grad_inputs=(0, 1),
        shapes=[(4, 96), (33, 257)],
        dims=("rows", "columns"),
        inspect=_inspect_launches,
    )
}
WORKLOADS = {
    "bias_gelu": Workload(
        name="bias_gelu",
        op=OPS["bias_gelu"],
        flop_unit="fp32",
        shapes={
            "quick": [(8192, 4096), (4096, 16384)],
            "full": [(8192, 4096), (4096, 16384), (16384, 8192), (65536, 1024), (1823, 4097), (32768, 3072)],
        },
        tiny_shape=(4, 256),
    )
}
