"""The norms over few long rows: each row split across programs side by side (``tritonkit.split_rows``).

The looped kernels take a row a program (the backward 4-16 rows a program past 32 rows): 2 rows of
12M entries are 2 programs on 132 SMs, 100 rows of 784772 fp32 25 backward programs. Here every row
of a launch is cut into segments, a program each, so that rows x segments fill the SMs; a segment's
partial statistics are combined by every program of its row between the two passes.

Forward, per segment of c entries: LayerNorm publishes its own mean and sum of squared deviations
from it (``_segment_moments``; combined by Chan's parallel rule, no cancellation between a large mean
and a small variance), RMSNorm its sum of squares. Backward: the segment's sums of g * xhat and g.
dw and db: a program takes the same segment of every row it walks, so it sums its rows' dy * xhat
and dy into its group's row of a (groups, N) fp32 slice, which L2 holds between rows where it fits
(N * 4 bytes a group and parameter), and the partial-sum stage adds the groups, as in the other
backward kernels.

The split launch is the looped kernels' untuned default (``split_default``) for rows too few to
give every SM ``SPLIT_PER_SM`` programs a row a program; tuning times it beside their candidates.
"""

from __future__ import annotations

import functools

import torch

from tritonkit._launch import (
    VECTOR_BYTES,
    Launch,
    cdiv,
    launcher_of,
    next_power_of_2,
    row_align,
    row_span,
    row_window,
    scratch,
)
from tritonkit._runtime import current_device, interpret, l2_bytes, sm_count
from tritonkit._triton import tl, triton
from tritonkit.dtypes import DTYPE_OF
from tritonkit.jit import aligned, segment_edges, window_base, window_interior, window_span
from tritonkit.ops.norm.terms import BACKWARD_SUMS, centres_rows, row_terms
from tritonkit.split_rows import _publish_and_wait, _segment_of_program, cooperative_programs

SPLIT_PER_SM = 2  # programs an SM the split launches aim for
# RMSNorm's backward (one dw slice, no db) takes the split up to this many programs an SM's rows
# too, at that many programs an SM: 1.14-1.79x at 411 x 25911 fp32 and 512 and 1024 x 16384 bf16
# on an H100 (docs/perf-notes/norms-split-rows.md); LayerNorm's (two slices) lost at 16384 bf16 (0.78-0.87x)
SPLIT_PER_SM_RMS_BWD = 8
# a segment is at least this many chunks: 97 rows of 11079 fp16 split in two segments of 2 chunks
SPLIT_CHUNKS_MIN = 2
SPLIT_WARPS = 8
# Pass 1's chunks a loop iteration where it unrolls (``_unrolled``), their loads in flight at once
# (``tl.range``'s unroll). Left to the compiler, LayerNorm's loop (a branch in it) stayed rolled and
# RMSNorm's was unrolled 4 times on 16-byte vectors only
SPLIT_PASS1_UNROLL = 4
SPLIT_L2_SHARE = 0.5  # of L2, what the rows in flight may hold between their two passes
# a chunk: 8 fp32 values a thread at 8 warps in fp32, 16 in 16 bits (16-byte loads either way); the
# backward holds h, dy, w and its two sums of a chunk at once
SPLIT_BLOCK_N = {4: 2048, 2: 4096}
# the forward reads rows that start off 16 bytes in windows (``_windowed_row``): 16-bit rows, and RMSNorm's
# (no residual) in fp32 too. On an H100 (docs/perf-notes/norms-split-rows.md) 16-bit rows of 3738195 ran
# 1.14-1.57x their speed an entry at a time, fp32 rows of 13795015 0.94-1.00x but RMSNorm's (not timed there),
# so those keep an entry at a time; SPLIT_WINDOWS_FP32 takes them in windows too (the tests' fp32 windows).
# SPLIT_WINDOWS False: an entry at a time everywhere (a benchmark's comparison)
SPLIT_WINDOWS = True
SPLIT_WINDOWS_FP32 = False


def split_default(key: dict) -> dict | None:
    """The looped kernels' untuned config where the key's rows (a power of two) are fewer than
    SPLIT_PER_SM programs an SM (the H200: 256 rows and fewer; RMSNorm's backward: fewer than
    SPLIT_PER_SM_RMS_BWD programs an SM, 1024 rows and fewer): the split launch, its segments made at
    the launch from the rows and their length (``split_segment``); else None."""
    per_sm, sms = SPLIT_PER_SM, sm_count(current_device())
    if key["rows"] >= per_sm * sms:  # (SPLIT_PER_SM = 0: no split at all)
        rms_bwd = key["direction"] == "bwd" and key["rms"] and key["rows"] < SPLIT_PER_SM_RMS_BWD * sms
        if not (per_sm and rms_bwd):
            return None
        per_sm = SPLIT_PER_SM_RMS_BWD
    block_n = SPLIT_BLOCK_N[DTYPE_OF[key["dtype"]].itemsize]
    return {"SPLIT": True, "BLOCK_N": block_n, "num_warps": SPLIT_WARPS, "PER_SM": per_sm}


def split_segment(
    direction: str, rows: int, n: int, size: int, device, config: dict, programs: int = 0
) -> int:
    """Entries a segment (a multiple of the config's BLOCK_N) for ``rows`` rows of ``n`` entries of
    ``size`` bytes, unless the config names one (SEGMENT): as many rows at once as keep what pass 2
    reads again within SPLIT_L2_SHARE of L2 (the forward its x or h; the backward h, dy and the dw
    and db slices it adds to), each in as many segments (SPLIT_CHUNKS_MIN chunks at least) as the
    config's programs an SM allow, as few at once as make as many rounds: one row at a time on the
    SMs makes every program wait at every row. ``programs``: those that run at once where known
    (``_fitted`` passes the compiled kernel's), else the config's PER_SM an SM; the launch then
    lengthens the segments where the rows at once would take more (``_fitted``)."""
    if "SEGMENT" in config:
        return config["SEGMENT"]
    block_n, programs = config["BLOCK_N"], programs or config["PER_SM"] * sm_count(device)
    reread = n * (size if direction == "fwd" else 2 * size + 8)  # bytes of a row pass 2 finds in L2
    at_once = max(1, min(rows, int(SPLIT_L2_SHARE * l2_bytes(device)) // reread))
    # as few rows at once as take as many rounds: 14 rows at 6 at once left two thirds of the
    # programs idle in the third round; 5 at once runs rounds of 5, 5 and 4, each shorter
    at_once = cdiv(rows, cdiv(rows, at_once))
    segments = max(1, min(max(2, programs // at_once), cdiv(n, SPLIT_CHUNKS_MIN * block_n)))
    return cdiv(cdiv(n, segments), block_n) * block_n


# fp32 inputs: rows a program adds into its dw and db slice one after another, at most (a chain of 50
# erred past the oracle's bound on db at 100 x 784772 on an H100; kernels.FP32_SUM_CHAIN_MAX says why)
FP32_CHAIN_MAX = 32

# The backward by columns (``_norm_bwd_columns_kernel``): rows at most this many, of which fewer
# than COLUMNS_AT_ONCE fit in SPLIT_L2_SHARE of L2 with their slices (the row-major split then reads
# and writes its dw and db slices from memory at every row, up to 2.5x the rows' own bytes; with
# more at once it reads each row from memory once: 1.3-1.6x the columns at 74 x 187426 bf16 on an
# H100); a program's dw and db add a block of COLUMNS_ROW_BLOCK rows at a time, a chain of
# COLUMNS_ROWS_MAX / COLUMNS_ROW_BLOCK <= FP32_CHAIN_MAX
COLUMNS_ROWS_MAX = 128
COLUMNS_AT_ONCE = 4
COLUMNS_ROW_BLOCK = 4  # (fewer where the rows are fewer)
COLUMNS_PER_SM = 4  # programs an SM it aims for, fewer where occupancy allows fewer
# Tiles: where the rows start on 16 bytes, 4 warps and 16 bytes a thread a row; where they do not,
# each entry is an access of its own, with its own address registers, and the same tile over 8
# warps. Timed on an H100 against 4 warps: off 16 bytes, 8 warps took 0.82x the time (LayerNorm at
# 4 x 13795015 fp32) and 0.65-0.78x (32 x 3738195 bf16); on 16 bytes 1.2-2.2x (8-byte accesses).
# 32 bytes a thread a row in fp32 took 0.89-0.90x at 100 x 784772, but LayerNorm's spills there.
COLUMNS_TILES = {  # (element size, rows on 16 bytes): (BLOCK_N, num_warps)
    (4, True): (512, 4),
    (2, True): (1024, 4),
    (4, False): (512, 8),
    (2, False): (1024, 8),
}


def _fitted(
    kernel, config: dict, segment_for, rows: int, n: int, probe: tuple, meta: dict, device, chain: int
) -> tuple:
    """(SEGMENT, segments, groups) of a launch: ``segment_for(programs)`` (``split_segment``'s) for the
    programs that run at once (the compiled kernel's occupancy: registers decide it, and may allow
    fewer than the config's PER_SM: segments sized for those left LayerNorm at 32 x 3738195 bf16 a row
    at a time, 1.57x the time, on an H100), lengthened where its segments and ``rows`` / ``chain``
    rows at once (the least groups) would take more; as many rows at once as the rest allow.
    ``probe`` holds the launch's arguments with stand-ins for the workspace, which is sized after."""
    programs = cooperative_programs(launcher_of(kernel), config["PER_SM"], probe, meta, device)
    segment = segment_for(programs)
    most = max(1, programs // cdiv(rows, chain))
    if cdiv(n, segment) > most:
        segment = cdiv(cdiv(n, most), config["BLOCK_N"]) * config["BLOCK_N"]
    segments = cdiv(n, segment)
    return segment, segments, max(1, min(rows, programs // segments))


def _phases(name: str, kernel, args: tuple, meta: dict, config: dict, grid: tuple) -> list[Launch]:
    """One PHASE 0 launch on the GPU, cooperative: it fails, not hangs, where its programs cannot all
    run at once. Under the interpreter PHASE 1 then PHASE 2, which never wait."""
    if interpret():
        first = meta | {"PHASE": 1}
        return [
            Launch(name, kernel, args, first, config, grid),
            Launch(name, kernel, args, first | {"PHASE": 2}, config, grid),
        ]
    return [Launch(name, kernel, args, meta | {"launch_cooperative_grid": True}, config, grid)]


def _meta(config: dict, flags: dict, align: int) -> dict:
    """The constexprs and options of either split kernel but SEGMENTS, which the fit decides."""
    phase = 1 if interpret() else 0
    return (
        flags
        | {"BLOCK_N": config["BLOCK_N"], "SEGMENTS": 0, "PHASE": phase, "ALIGN": align}
        | {"num_warps": config["num_warps"]}
    )


def _stand_in(dtype, device) -> torch.Tensor | None:
    """A one-entry tensor of ``dtype`` in place of a workspace the fit sizes later (None: absent)."""
    return None if dtype is None else torch.empty(1, dtype=dtype, device=device)


def _on_vectors(values: tuple, size: int) -> bool:
    """Whether rows of these lengths and strides of ``size``-byte entries start on 16 bytes (accessed
    16 bytes at a time)."""
    return all(value % 16 == 0 for value in values) or row_align(values, size) * size == VECTOR_BYTES


def _unrolled(rms: bool, residual: bool, values: tuple, size: int) -> bool:
    """Whether the forward's pass 1 takes SPLIT_PASS1_UNROLL chunks an iteration: fp32 entries only
    (16-bit chunks hold 16 entries a thread; unrolled, at 32 x 3738192 bf16 on an H100 the forward
    took 1.10x the time rolled (RMSNorm) and 1.07x (LayerNorm), and level at 32 x 3738195); off
    16-byte vectors, RMSNorm's without a residual only (LayerNorm's held 196 registers). Unrolled,
    RMSNorm's took 0.95x the time at 4 x 13795015 fp32 (off 16 bytes)."""
    return size == 4 and (_on_vectors(values, size) or rms and not residual)


def fwd_split_launches(
    x2, r2, h, y, weight, bias, mean, rstd, eps: float, rms: bool, config: dict
) -> list[Launch]:
    """The split forward of (rows, n) ``x2`` (and ``r2``): y, h and the row statistics, which it
    always stores (``mean`` LayerNorm's)."""
    rows, n = x2.shape
    flags = {"RMS": rms, "HAS_RESIDUAL": r2 is not None, "HAS_WEIGHT": weight is not None}
    strides = (x2.stride(0), r2.stride(0) if r2 is not None else 0)
    size = min(x2.element_size(), y.element_size())
    align = row_align((n, *strides), size)
    meta = _meta(config, flags | {"HAS_BIAS": bias is not None}, align)
    meta["UNROLL"] = SPLIT_PASS1_UNROLL if _unrolled(rms, r2 is not None, (n, *strides), size) else 1
    # rows off 16 bytes in windows (SPLIT_WINDOWS): x, the residual, h and y 16 bytes at a time, w and b an
    # entry at a time
    views, tensors = [(0, x2.stride(0)), (0, n)], (x2, y)
    if r2 is not None:
        views, tensors = views + [(0, r2.stride(0))], tensors + (r2, h)
    windowed = SPLIT_WINDOWS and (size < 4 or rms and r2 is None or SPLIT_WINDOWS_FP32)
    window = row_window(n, views, tensors) if windowed else 0
    meta["WINDOW"] = window
    span = row_span(n, window)

    def args(partials, arrived, segments, segment):
        head = (x2, r2, h, y, weight, bias, mean, rstd, partials, arrived, rows, n, segments, segment)
        return (*head, *strides, float(eps))

    kernel, device = _norm_fwd_split_kernel, x2.device
    segment_for = functools.partial(split_segment, "fwd", rows, span, x2.element_size(), device, config)
    wanted = segment_for()
    provisional = cdiv(span, wanted)
    stand_ins = (_stand_in(torch.float32, device), _stand_in(torch.int32, device))
    probe = args(*stand_ins, provisional, wanted)
    meta["SEGMENTS"] = next_power_of_2(provisional)
    segment, segments, groups = _fitted(kernel, config, segment_for, rows, span, probe, meta, device, rows)
    partials = scratch((rows, segments, 2), torch.float32, device)
    arrived = scratch((rows,), torch.int32, device, zeroed=True)
    meta["SEGMENTS"] = next_power_of_2(segments)
    launch_args = args(partials, arrived, segments, segment)
    return _phases("fwd split", kernel, launch_args, meta, config, (groups * segments,))


def by_columns(rows: int, n: int, size: int, device) -> bool:
    """Whether the split backward of ``rows`` rows of ``n`` entries of ``size`` bytes goes by columns:
    few rows (COLUMNS_ROWS_MAX) of which fewer than COLUMNS_AT_ONCE, and not all, fit in
    SPLIT_L2_SHARE of L2 with their slices."""
    at_once = int(SPLIT_L2_SHARE * l2_bytes(device)) // (n * (2 * size + 8))
    return rows <= COLUMNS_ROWS_MAX and at_once < min(rows, COLUMNS_AT_ONCE)


def bwd_split_launches(dy2, dh2, h2, weight, bias, mean, rstd, rms: bool, dx, dw, db, config: dict) -> tuple:
    """The split backward's launch(es) and its (groups, n) fp32 partials of dw and db (None where
    absent), which the caller sums into dw and db; by columns (``by_columns``), no partials: the
    launch writes ``dw`` and ``db`` itself."""
    rows, n = h2.shape
    if by_columns(rows, n, h2.element_size(), h2.device):
        return _bwd_columns_launches(dy2, dh2, h2, weight, mean, rstd, rms, dx, dw, db), None, None
    flags = {"RMS": rms, "HAS_DH": dh2 is not None, "HAS_WEIGHT": weight is not None}
    strides = (dy2.stride(0), dh2.stride(0) if dh2 is not None else 0, h2.stride(0))
    meta = _meta(config, flags | {"HAS_BIAS": bias is not None}, row_align((n, *strides), h2.element_size()))

    def args(partials, arrived, dw_partial, db_partial, segments, segment):
        head = (dy2, dh2, h2, weight, mean, rstd, partials, arrived, dx, dw_partial, db_partial)
        return (*head, rows, n, segments, segment, *strides)

    kernel, device = _norm_bwd_split_kernel, h2.device
    segment_for = functools.partial(split_segment, "bwd", rows, n, h2.element_size(), device, config)
    wanted = segment_for()
    provisional = cdiv(n, wanted)
    stand_ins = [_stand_in(dtype, device) for dtype in (torch.float32, torch.int32)]
    stand_ins += [_stand_in(torch.float32 if p is not None else None, device) for p in (weight, bias)]
    meta["SEGMENTS"] = next_power_of_2(provisional)
    chain = FP32_CHAIN_MAX if h2.dtype == torch.float32 else rows
    segment, segments, groups = _fitted(
        kernel, config, segment_for, rows, n, args(*stand_ins, provisional, wanted), meta, device, chain
    )
    partials = scratch((rows, segments, BACKWARD_SUMS.value), torch.float32, device)
    arrived = scratch((rows,), torch.int32, device, zeroed=True)
    dw_partial, db_partial = (
        scratch((groups, n), torch.float32, device) if p is not None else None for p in (weight, bias)
    )
    meta["SEGMENTS"] = next_power_of_2(segments)
    launch_args = args(partials, arrived, dw_partial, db_partial, segments, segment)
    launches = _phases("bwd split", kernel, launch_args, meta, config, (groups * segments,))
    return launches, dw_partial, db_partial


def _bwd_columns_launches(dy2, dh2, h2, weight, mean, rstd, rms: bool, dx, dw, db) -> list[Launch]:
    """The backward by columns: programs side by side over the columns, each through every row."""
    rows, n = h2.shape
    size, device = h2.element_size(), h2.device
    strides = (dy2.stride(0), dh2.stride(0) if dh2 is not None else 0, h2.stride(0))
    align = row_align((n, *strides), size)
    block_n, warps = COLUMNS_TILES[size, _on_vectors((n, *strides), size)]
    flags = {
        "RMS": rms,
        "HAS_DH": dh2 is not None,
        "HAS_WEIGHT": weight is not None,
        "HAS_BIAS": db is not None,
    }
    meta = flags | {
        "BLOCK_M": min(COLUMNS_ROW_BLOCK, next_power_of_2(rows)),
        "BLOCK_N": block_n,
        "PROGRAMS": 0,
        "PHASE": 1 if interpret() else 0,
    }
    meta |= {"ALIGN": align, "num_warps": warps}

    def args(sums, totals, arrived, segment):
        head = (dy2, dh2, h2, weight, mean, rstd, sums, totals, arrived, dx, dw, db, rows, n, segment)
        return (*head, *strides)

    kernel = _norm_bwd_columns_kernel
    meta["PROGRAMS"] = next_power_of_2(COLUMNS_PER_SM * sm_count(device))  # (until the fit says)
    stand_ins = (
        _stand_in(torch.float32, device),
        _stand_in(torch.float32, device),
        _stand_in(torch.int32, device),
    )
    most = cooperative_programs(launcher_of(kernel), COLUMNS_PER_SM, args(*stand_ins, block_n), meta, device)
    segment = cdiv(cdiv(n, most), block_n) * block_n
    programs = cdiv(n, segment)
    meta["PROGRAMS"] = next_power_of_2(programs)
    sums = scratch((rows, programs, BACKWARD_SUMS.value), torch.float32, device)
    totals = scratch((programs, rows, 2), torch.float32, device)
    arrived = scratch((1,), torch.int32, device, zeroed=True)
    launch_args = args(sums, totals, arrived, segment)
    config = {"COLUMNS": True, "BLOCK_N": block_n, "num_warps": warps}
    return _phases("bwd split columns", kernel, launch_args, meta, config, (programs,))


@triton.jit
def _segment_moments(total, squares, count, shift, RMS: tl.constexpr):
    """A segment's published pair: RMSNorm (sum h^2, 0); LayerNorm (its mean, its sum of squared
    deviations from that mean), from its sums of h - shift and (h - shift)^2 over ``count`` entries."""
    if RMS:
        return squares, 0.0
    offset = total / tl.maximum(count, 1.0)  # (a window's last segment may hold no entry: 0, 0)
    return shift + offset, tl.maximum(squares - total * offset, 0.0)


@triton.jit
def _segment_count(first, N, SEGMENT, head):
    """The row's entries in the segment of positions first, ... first + SEGMENT - 1, the row being at
    positions head, ... head + N - 1 (head 0 but in windows): 0 for a window's last segment that
    holds none of them."""
    return tl.maximum(tl.minimum(first + SEGMENT, head + N) - tl.maximum(first, head), 0).to(tl.float32)


@triton.jit
def _row_moments(partials_ptr, row, N, segments, SEGMENT, head, RMS: tl.constexpr, SEGMENTS: tl.constexpr):
    """(mean, variance) of the row from its segments' pairs (RMSNorm: 0 and the mean square); a
    LayerNorm row combines them by Chan's rule, M2 = sum(M2_s + c_s * (mean_s - mean)^2), each
    segment's count c_s of entries from the row's ``head`` (``_segment_count``)."""
    parts = tl.arange(0, SEGMENTS)
    exists = parts < segments
    first = tl.load(partials_ptr + (row * segments + parts) * 2, mask=exists, other=0.0, cache_modifier=".cg")
    second = tl.load(
        partials_ptr + (row * segments + parts) * 2 + 1, mask=exists, other=0.0, cache_modifier=".cg"
    )
    if RMS:
        return 0.0, tl.sum(first, axis=0) / N
    counts = tl.where(exists, _segment_count(parts * SEGMENT, N, SEGMENT, head), 0.0)
    # about the first segment's mean: a sum of the means themselves would round at their magnitude
    ref = tl.sum(tl.where(parts == 0, first, 0.0), axis=0)
    offsets = tl.where(exists, first - ref, 0.0)
    offset = tl.sum(counts * offsets, axis=0) / N
    deviation = offsets - offset
    return ref + offset, tl.sum(second + counts * deviation * deviation, axis=0) / N


@triton.jit
def _fwd_chunk(x_row, r_ptr, h_ptr, row64, stride_rm, start, N, offsets, HAS_RESIDUAL: tl.constexpr):
    """Pass 1's chunk of entries ``start + offsets`` of a row: h in fp32 (x, or x plus the residual,
    which it stores: pass 2 reads it from L2) and the chunk's mask."""
    cols = start + offsets
    mask = cols < N
    h = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row64 * stride_rm + cols, mask=mask, other=0.0, eviction_policy="evict_first")
        h = (h + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row64 * N + cols, h, mask=mask, eviction_policy="evict_last")
        h = h.to(tl.float32)
    return h, mask


@triton.jit
def _norm_fwd_split_kernel(
    x_ptr,  # input, (M, N), row stride stride_xm, unit column stride
    r_ptr,  # residual, (M, N), row stride stride_rm (unused without HAS_RESIDUAL)
    h_ptr,  # x + residual out, (M, N), contiguous (unused without HAS_RESIDUAL)
    y_ptr,  # normalised output, (M, N), contiguous
    w_ptr,  # weight, (N,) (unused without HAS_WEIGHT)
    b_ptr,  # bias, (N,) (unused without HAS_BIAS)
    mean_ptr,  # fp32 row means, (M,) (LayerNorm only)
    rstd_ptr,  # fp32 reciprocal standard deviations (or RMS), (M,)
    partials_ptr,  # fp32 (M, segments, 2): each segment's pair (_segment_moments)
    arrived_ptr,  # int32 (M,): segments of each row through pass 1, zero at launch (PHASE 0)
    M,  # rows
    N,  # row length
    segments,  # programs a row, cdiv(N, SEGMENT); the grid is a multiple of it
    SEGMENT,  # row entries a program, a multiple of BLOCK_N
    stride_xm,  # elements between rows of x
    stride_rm,  # elements between rows of the residual
    eps,  # added to the variance (mean square) before the square root
    RMS: tl.constexpr,  # RMSNorm instead of LayerNorm
    HAS_RESIDUAL: tl.constexpr,  # add the residual first and store the sum
    HAS_WEIGHT: tl.constexpr,  # scale by w
    HAS_BIAS: tl.constexpr,  # shift by b
    BLOCK_N: tl.constexpr,  # entries a chunk
    SEGMENTS: tl.constexpr,  # power of two >= segments: the pairs a program combines
    PHASE: tl.constexpr,  # 0: both passes, waiting between them; 1: pass 1 only; 2: pass 2 only
    ALIGN: tl.constexpr,  # N and the row strides are multiples of it (jit.aligned)
    UNROLL: tl.constexpr,  # pass 1's chunks a loop iteration (SPLIT_PASS1_UNROLL or 1: _unrolled)
    WINDOW: tl.constexpr,  # 0, or rows read in windows (_windowed_row)
):
    N = aligned(N, ALIGN)
    stride_xm = aligned(stride_xm, ALIGN)
    stride_rm = aligned(stride_rm, ALIGN)
    # windowed, segments cut the positions from each row's window base
    first_row, groups, segment, first, chunks = _segment_of_program(
        window_span(N, WINDOW), segments, SEGMENT, BLOCK_N=BLOCK_N
    )
    offsets = tl.arange(0, BLOCK_N)
    count = tl.minimum(N - first, SEGMENT).to(tl.float32)
    for row in range(first_row, M, groups):
        row64 = tl.cast(row, tl.int64)  # M * N may pass 2^31
        x_row = x_ptr + row64 * stride_xm
        if WINDOW > 0:
            _windowed_row(
                x_ptr, r_ptr, h_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, partials_ptr, arrived_ptr, row,
                row64, N, segments, segment, first, chunks, stride_xm, stride_rm, eps, offsets, SEGMENT, RMS,
                HAS_RESIDUAL, HAS_WEIGHT, HAS_BIAS, SEGMENTS, PHASE, UNROLL, WINDOW,
            )  # fmt: skip
        elif PHASE != 2:  # pass 1: the segment's sums about the mean of its first chunk (LayerNorm)
            shift = 0.0
            total = tl.zeros([BLOCK_N], tl.float32)
            squares = tl.zeros([BLOCK_N], tl.float32)
            start = 0
            if not RMS and UNROLL > 1:  # the first chunk before the loop, whose branch kept it rolled
                # (off 16-byte vectors the same code held 196 registers, not 114)
                h, mask = _fwd_chunk(x_row, r_ptr, h_ptr, row64, stride_rm, first, N, offsets, HAS_RESIDUAL)
                shift = tl.sum(h, axis=0) / tl.minimum(count, BLOCK_N)
                h = tl.where(mask, h - shift, 0.0)
                total += h
                squares += h * h
                start = 1
            for i in tl.range(start, chunks, loop_unroll_factor=UNROLL):
                cols = first + i * BLOCK_N
                h, mask = _fwd_chunk(x_row, r_ptr, h_ptr, row64, stride_rm, cols, N, offsets, HAS_RESIDUAL)
                if not RMS:
                    if UNROLL == 1 and i == 0:
                        shift = tl.sum(h, axis=0) / tl.minimum(count, BLOCK_N)
                    h = tl.where(mask, h - shift, 0.0)
                total += h
                squares += h * h
            pair_first, pair_second = _segment_moments(
                tl.sum(total, axis=0), tl.sum(squares, axis=0), count, shift, RMS=RMS
            )
            tl.store(partials_ptr + (row * segments + segment) * 2, pair_first)
            tl.store(partials_ptr + (row * segments + segment) * 2 + 1, pair_second)
        if PHASE == 0 and WINDOW == 0:
            _publish_and_wait(arrived_ptr, row, segments)
        if PHASE != 1 and WINDOW == 0:  # pass 2: the row's statistics, then this segment's output
            mean, variance = _row_moments(partials_ptr, row, N, segments, SEGMENT, 0, RMS, SEGMENTS)
            rstd = 1.0 / tl.sqrt(variance + eps)
            if segment == 0:
                tl.store(rstd_ptr + row, rstd)
                if not RMS:
                    tl.store(mean_ptr + row, mean)
            if HAS_RESIDUAL:
                source_row = h_ptr + row64 * N
            else:
                source_row = x_row
            y_row = y_ptr + row64 * N
            for i in range(chunks):
                cols = first + (chunks - 1 - i) * BLOCK_N + offsets
                mask = cols < N
                h = tl.load(source_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(
                    tl.float32
                )
                y = (h - mean) * rstd
                if HAS_WEIGHT:
                    y *= tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_BIAS:
                    y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _windowed_row(
    x_ptr, r_ptr, h_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, partials_ptr, arrived_ptr, row, row64, N,
    segments, segment, first, chunks, stride_xm, stride_rm, eps, offsets, SEGMENT, RMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, SEGMENTS: tl.constexpr,
    PHASE: tl.constexpr, UNROLL: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """The two passes over a segment of a row that starts off 16 bytes, read in windows
    (``jit.window_base``: from the row's offset rounded down to WINDOW entries, ``head`` entries before
    the row, the heads of x, the residual, h and y alike): the vectors wholly in the row 16 bytes at a
    time, the row's two edge vectors an entry at a time by the segments holding them, the weight and
    bias an entry at a time (their entries sit ``head`` off x's). The segment covers positions first,
    ... of the window; LayerNorm's sums are about the mean of its first chunk, as the unwindowed pass
    1's."""
    x_base, head = window_base(row64 * stride_xm, WINDOW)
    y_base, _ = window_base(row64 * N, WINDOW)  # (h's too: both (M, N), contiguous)
    x_row, y_row, r_row, h_row = x_ptr + x_base, y_ptr + y_base, r_ptr, h_ptr  # (r_ptr, h_ptr: None, unused)
    if HAS_RESIDUAL:
        r_row, h_row = r_ptr + window_base(row64 * stride_rm, WINDOW)[0], h_ptr + y_base
    edges, on_edge = segment_edges(head, N, first, SEGMENT, WINDOW)
    if PHASE != 2:  # pass 1: the segment's sum of squares (LayerNorm: and sum, about the shift)
        shift = 0.0
        if not RMS:
            inner = window_interior(first + offsets, head, N, WINDOW)
            h = _window_h(x_row, r_row, h_row, first + offsets, inner, HAS_RESIDUAL, STORE=False)
            shift = tl.sum(h, axis=0) / tl.maximum(tl.sum(inner.to(tl.float32), axis=0), 1.0)
        total = tl.zeros(offsets.shape, tl.float32)
        squares = tl.zeros(offsets.shape, tl.float32)
        for i in tl.range(0, chunks, loop_unroll_factor=UNROLL):
            positions = first + i * offsets.shape[0] + offsets
            inner = window_interior(positions, head, N, WINDOW)
            h = _window_h(x_row, r_row, h_row, positions, inner, HAS_RESIDUAL, STORE=True)
            if not RMS:
                h = tl.where(inner, h - shift, 0.0)
                total += h
            squares += h * h
        h = _window_h(x_row, r_row, h_row, edges, on_edge, HAS_RESIDUAL, STORE=True)
        h = tl.where(on_edge, h - shift, 0.0)
        pair_first, pair_second = _segment_moments(
            tl.sum(total, axis=0) + tl.sum(h, axis=0),
            tl.sum(squares, axis=0) + tl.sum(h * h, axis=0),
            _segment_count(first, N, SEGMENT, head),
            shift,
            RMS=RMS,
        )
        tl.store(partials_ptr + (row * segments + segment) * 2, pair_first)
        tl.store(partials_ptr + (row * segments + segment) * 2 + 1, pair_second)
    if PHASE == 0:
        _publish_and_wait(arrived_ptr, row, segments)
    if PHASE != 1:  # pass 2: the row's statistics, then this segment's output, last-read chunk first
        mean, variance = _row_moments(partials_ptr, row, N, segments, SEGMENT, head, RMS, SEGMENTS)
        rstd = 1.0 / tl.sqrt(variance + eps)
        if segment == 0:
            tl.store(rstd_ptr + row, rstd)
            if not RMS:
                tl.store(mean_ptr + row, mean)
        if HAS_RESIDUAL:  # (pass 2 reads h, which pass 1 stored)
            source = h_row
        else:
            source = x_row
        for i in range(chunks):
            positions = first + (chunks - 1 - i) * offsets.shape[0] + offsets
            inner = window_interior(positions, head, N, WINDOW)
            _normed_out(source, y_row, w_ptr, b_ptr, positions, head, inner, mean, rstd, HAS_WEIGHT, HAS_BIAS)
        _normed_out(source, y_row, w_ptr, b_ptr, edges, head, on_edge, mean, rstd, HAS_WEIGHT, HAS_BIAS)


@triton.jit
def _window_h(x_row, r_row, h_row, positions, mask, HAS_RESIDUAL: tl.constexpr, STORE: tl.constexpr):
    """h in fp32 at window ``positions`` of a row (``_windowed_row``): x, or x plus the residual,
    rounded to h's dtype and, with STORE, stored (pass 2 reads it from L2)."""
    h = tl.load(x_row + positions, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_row + positions, mask=mask, other=0.0, eviction_policy="evict_first")
        h = (h + r.to(tl.float32)).to(h_row.dtype.element_ty)
        if STORE:
            tl.store(h_row + positions, h, mask=mask, eviction_policy="evict_last")
        h = h.to(tl.float32)
    return h


@triton.jit
def _normed_out(
    x_row, y_row, w_ptr, b_ptr, positions, head, mask, mean, rstd, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """y = (x - mean) * rstd (* w) (+ b) at window ``positions`` of a row (``_windowed_row``)."""
    x = tl.load(x_row + positions, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    y = (x - mean) * rstd
    if HAS_WEIGHT:
        y *= tl.load(w_ptr + (positions - head), mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + (positions - head), mask=mask, other=0.0).to(tl.float32)
    tl.store(y_row + positions, y.to(y_row.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_split_kernel(
    dy_ptr,  # upstream gradient of y, (M, N), row stride stride_dym, unit column stride
    dh_ptr,  # upstream gradient of h (add_ forms), (M, N), row stride stride_dhm
    h_ptr,  # the forward's normalised input, (M, N), row stride stride_hm
    w_ptr,  # weight, (N,) (unused without HAS_WEIGHT)
    mean_ptr,  # fp32 row means from the forward, (M,) (LayerNorm only)
    rstd_ptr,  # fp32 reciprocal standard deviations from the forward, (M,)
    partials_ptr,  # fp32 (M, segments, BACKWARD_SUMS): each segment's sums of g * xhat, g and xhat
    arrived_ptr,  # int32 (M,): segments of each row through pass 1, zero at launch (PHASE 0)
    dx_ptr,  # gradient of x (and of the residual), (M, N), contiguous
    dw_partial_ptr,  # fp32 (groups, N): each group's sums of dy * xhat over its rows (HAS_WEIGHT)
    db_partial_ptr,  # fp32 (groups, N): ... of dy (HAS_BIAS)
    M,  # rows
    N,  # row length
    segments,  # programs a row, cdiv(N, SEGMENT); the grid is groups x segments
    SEGMENT,  # row entries a program, a multiple of BLOCK_N
    stride_dym,  # elements between rows of dy
    stride_dhm,  # elements between rows of dh
    stride_hm,  # elements between rows of h
    RMS: tl.constexpr,  # RMSNorm instead of LayerNorm
    HAS_DH: tl.constexpr,  # add the gradient of h (add_ forms)
    HAS_WEIGHT: tl.constexpr,  # the forward scaled by w
    HAS_BIAS: tl.constexpr,  # db is wanted
    BLOCK_N: tl.constexpr,  # entries a chunk
    SEGMENTS: tl.constexpr,  # power of two >= segments: the sums a program combines
    PHASE: tl.constexpr,  # 0: both passes, waiting between them; 1: pass 1 only; 2: pass 2 only
    ALIGN: tl.constexpr,  # N and the row strides are multiples of it (jit.aligned)
):
    N = aligned(N, ALIGN)
    stride_dym = aligned(stride_dym, ALIGN)
    stride_dhm = aligned(stride_dhm, ALIGN)
    stride_hm = aligned(stride_hm, ALIGN)
    first_row, groups, segment, first, chunks = _segment_of_program(N, segments, SEGMENT, BLOCK_N=BLOCK_N)
    offsets = tl.arange(0, BLOCK_N)
    for row in range(first_row, M, groups):
        row64 = tl.cast(row, tl.int64)  # M * N may pass 2^31
        h_row = h_ptr + row64 * stride_hm
        dy_row = dy_ptr + row64 * stride_dym
        rstd = tl.load(rstd_ptr + row)
        shift = 0.0 if RMS else tl.load(mean_ptr + row)
        if PHASE != 2:  # pass 1: the segment's sums of g * xhat, g and (LayerNorm) xhat
            gx = tl.zeros([BLOCK_N], tl.float32)
            g_sum = tl.zeros([BLOCK_N], tl.float32)
            x_sum = tl.zeros([BLOCK_N], tl.float32)
            for i in range(chunks):
                cols = first + i * BLOCK_N + offsets
                mask = cols < N
                h = tl.load(h_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
                g = tl.load(dy_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
                if HAS_WEIGHT:
                    g *= tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                gx += g * tl.where(mask, (h - shift) * rstd, 0.0)
                g_sum += g
                if centres_rows(h_ptr) and not RMS:
                    x_sum += tl.where(mask, (h - shift) * rstd, 0.0)
            at = partials_ptr + (row * segments + segment) * BACKWARD_SUMS
            tl.store(at, tl.sum(gx, axis=0))
            tl.store(at + 1, tl.sum(g_sum, axis=0))
            if centres_rows(h_ptr) and not RMS:
                tl.store(at + 2, tl.sum(x_sum, axis=0))
        if PHASE == 0:
            _publish_and_wait(arrived_ptr, row, segments)
        if PHASE != 1:  # pass 2: dx of this segment, and its rows' dw and db into the group's slice
            parts = tl.arange(0, SEGMENTS)
            exists = parts < segments
            at = partials_ptr + (row * segments + parts) * BACKWARD_SUMS
            c1, c2 = row_terms(at, exists, N, RMS=RMS, CENTRE=centres_rows(h_ptr))
            later = row != first_row  # the group's first row stores its slice, later rows add to it
            for i in range(chunks):
                cols = first + (chunks - 1 - i) * BLOCK_N + offsets
                mask = cols < N
                h = tl.load(h_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                dy = tl.load(dy_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(
                    tl.float32
                )
                xhat = tl.where(mask, (h - shift) * rstd, 0.0)
                g = dy * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) if HAS_WEIGHT else dy
                dh = (g - xhat * c1) * rstd if RMS else (g - xhat * c1 - c2) * rstd
                if HAS_DH:
                    dh += tl.load(
                        dh_ptr + row64 * stride_dhm + cols,
                        mask=mask,
                        other=0.0,
                        eviction_policy="evict_first",
                    ).to(tl.float32)
                tl.store(dx_ptr + row64 * N + cols, dh.to(dx_ptr.dtype.element_ty), mask=mask)
                # this program's group's slice: its earlier rows' sums, in L2
                if HAS_WEIGHT:
                    dw_at = dw_partial_ptr + tl.cast(first_row, tl.int64) * N + cols
                    tl.store(dw_at, dy * xhat + tl.load(dw_at, mask=mask & later, other=0.0), mask=mask)
                if HAS_BIAS:
                    db_at = db_partial_ptr + tl.cast(first_row, tl.int64) * N + cols
                    tl.store(db_at, dy + tl.load(db_at, mask=mask & later, other=0.0), mask=mask)


@triton.jit
def _row_block(rows_ptr, start, M, BLOCK_M: tl.constexpr):
    """The rows ``start`` ... ``start + BLOCK_M - 1``, whether each exists, and their entries of the
    per-row ``rows_ptr``."""
    rows = start + tl.arange(0, BLOCK_M)
    exists = rows < M
    return rows, exists, tl.load(rows_ptr + rows, mask=exists, other=0.0)


@triton.jit
def _norm_bwd_columns_kernel(
    dy_ptr,  # upstream gradient of y, (M, N), row stride stride_dym, unit column stride
    dh_ptr,  # upstream gradient of h (add_ forms), (M, N), row stride stride_dhm
    h_ptr,  # the forward's normalised input, (M, N), row stride stride_hm
    w_ptr,  # weight, (N,) (unused without HAS_WEIGHT)
    mean_ptr,  # fp32 row means from the forward, (M,) (LayerNorm only)
    rstd_ptr,  # fp32 reciprocal standard deviations from the forward, (M,)
    sums_ptr,  # fp32 (M, programs, BACKWARD_SUMS): each program's sums of g * xhat, g, xhat over its columns
    totals_ptr,  # fp32 (programs, M, 2): each program's own copy of the rows' terms c1 and c2
    arrived_ptr,  # int32 (1,): programs through pass 1, zero at launch (PHASE 0)
    dx_ptr,  # gradient of x (and of the residual), (M, N), contiguous
    dw_ptr,  # gradient of w, (N,) (HAS_WEIGHT)
    db_ptr,  # gradient of the bias, (N,) (HAS_BIAS)
    M,  # rows
    N,  # row length
    SEGMENT,  # columns a program, a multiple of BLOCK_N; the grid is cdiv(N, SEGMENT)
    stride_dym,  # elements between rows of dy
    stride_dhm,  # elements between rows of dh
    stride_hm,  # elements between rows of h
    RMS: tl.constexpr,  # RMSNorm instead of LayerNorm
    HAS_DH: tl.constexpr,  # add the gradient of h (add_ forms)
    HAS_WEIGHT: tl.constexpr,  # the forward scaled by w
    HAS_BIAS: tl.constexpr,  # db is wanted
    BLOCK_M: tl.constexpr,  # rows a tile
    BLOCK_N: tl.constexpr,  # columns a tile
    PROGRAMS: tl.constexpr,  # power of two >= the programs: the sums a row's mean adds
    PHASE: tl.constexpr,  # 0: both passes, waiting between them; 1: pass 1 only; 2: pass 2 only
    ALIGN: tl.constexpr,  # N and the row strides are multiples of it (jit.aligned)
):
    """The split backward by columns: pass 1 sums g * xhat and g over this program's columns of every
    row; one wait for every program; pass 2 walks its columns a tile at a time through every row,
    writing dx, and adds dw and db in registers, which it stores: one program a column, no slices."""
    N = aligned(N, ALIGN)
    stride_dym = aligned(stride_dym, ALIGN)
    stride_dhm = aligned(stride_dhm, ALIGN)
    stride_hm = aligned(stride_hm, ALIGN)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    first = pid * SEGMENT
    chunks = tl.cdiv(tl.minimum(N - first, SEGMENT), BLOCK_N)
    offsets = tl.arange(0, BLOCK_N)
    blocks = tl.cdiv(M, BLOCK_M)
    if PHASE != 2:  # pass 1, a block of rows at a time (w read once a block)
        for block in range(blocks):
            rows, exists, rstd = _row_block(rstd_ptr, block * BLOCK_M, M, BLOCK_M=BLOCK_M)
            shift = 0.0 if RMS else tl.load(mean_ptr + rows, mask=exists, other=0.0)[:, None]
            rows64 = tl.cast(rows, tl.int64)[:, None]  # M * N may pass 2^31
            gx = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            g_sum = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            x_sum = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for i in range(chunks):
                cols = first + i * BLOCK_N + offsets
                mask = exists[:, None] & (cols < N)[None, :]
                h = tl.load(h_ptr + rows64 * stride_hm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                g = tl.load(dy_ptr + rows64 * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                if HAS_WEIGHT:
                    g *= tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
                gx += g * tl.where(mask, (h - shift) * rstd[:, None], 0.0)
                g_sum += g
                if centres_rows(h_ptr) and not RMS:
                    x_sum += tl.where(mask, (h - shift) * rstd[:, None], 0.0)
            at = sums_ptr + (rows * programs + pid) * BACKWARD_SUMS
            tl.store(at, tl.sum(gx, axis=1), mask=exists)
            tl.store(at + 1, tl.sum(g_sum, axis=1), mask=exists)
            if centres_rows(h_ptr) and not RMS:
                tl.store(at + 2, tl.sum(x_sum, axis=1), mask=exists)
    if PHASE == 0:
        _publish_and_wait(arrived_ptr, 0, programs)
    if PHASE != 1:
        # every row's terms, its sums added in the same order by every program (same bits)
        parts = tl.arange(0, PROGRAMS)
        for block in range(blocks):
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            exists = rows < M
            at = sums_ptr + (rows[:, None] * programs + parts[None, :]) * BACKWARD_SUMS
            mask = exists[:, None] & (parts < programs)[None, :]
            c1, c2 = row_terms(at, mask, N, RMS=RMS, CENTRE=centres_rows(h_ptr))
            tl.store(totals_ptr + (pid * M + rows) * 2, c1, mask=exists)
            tl.store(totals_ptr + (pid * M + rows) * 2 + 1, c2, mask=exists)
        tl.debug_barrier()  # the totals' stores before any thread's loads of them
        # pass 2: last-read columns and rows first (L2 holds pass 1's last reads)
        for i in range(chunks):
            cols = first + (chunks - 1 - i) * BLOCK_N + offsets
            w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32) if HAS_WEIGHT else 1.0
            dw = tl.zeros([BLOCK_N], tl.float32)
            db = tl.zeros([BLOCK_N], tl.float32)
            for j in range(blocks):
                start = (blocks - 1 - j) * BLOCK_M
                rows, exists, rstd = _row_block(rstd_ptr, start, M, BLOCK_M=BLOCK_M)
                shift = 0.0 if RMS else tl.load(mean_ptr + rows, mask=exists, other=0.0)[:, None]
                c1 = tl.load(totals_ptr + (pid * M + rows) * 2, mask=exists, other=0.0)[:, None]
                c2 = tl.load(totals_ptr + (pid * M + rows) * 2 + 1, mask=exists, other=0.0)[:, None]
                rows64 = tl.cast(rows, tl.int64)[:, None]
                mask = exists[:, None] & (cols < N)[None, :]
                h = tl.load(h_ptr + rows64 * stride_hm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + rows64 * stride_dym + cols[None, :], mask=mask, other=0.0).to(
                    tl.float32
                )
                xhat = tl.where(mask, (h - shift) * rstd[:, None], 0.0)
                g = dy * w[None, :] if HAS_WEIGHT else dy
                dh = (g - xhat * c1) * rstd[:, None] if RMS else (g - xhat * c1 - c2) * rstd[:, None]
                if HAS_DH:
                    dh += tl.load(dh_ptr + rows64 * stride_dhm + cols[None, :], mask=mask, other=0.0).to(
                        tl.float32
                    )
                tl.store(dx_ptr + rows64 * N + cols[None, :], dh.to(dx_ptr.dtype.element_ty), mask=mask)
                dw += tl.sum(dy * xhat, axis=0)
                db += tl.sum(dy, axis=0)
            if HAS_WEIGHT:
                tl.store(dw_ptr + cols, dw.to(dw_ptr.dtype.element_ty), mask=cols < N)
            if HAS_BIAS:
                tl.store(db_ptr + cols, db.to(db_ptr.dtype.element_ty), mask=cols < N)
