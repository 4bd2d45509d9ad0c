"""FP8 quantization: ``quantize_fp8(x) -> (x_fp8, scale)`` with dequantized = x_fp8 * scale, the
convention of ``torch._scaled_mm``'s scales.

Maths. For each group of x (a row, a column, a 1 x block_size run along the last dimension, a
block_size x 1 run down a column, a block_size x block_size tile, or the whole tensor), with m the
fp8 dtype's largest finite value (448 for e4m3fn, 57344 for e5m2):
    amax  = max |x| over the group, raised to AMAX_FLOOR (a group of zeros keeps a finite scale)
    scale = amax / m                         (round_scale_to_pow2: the power of two at or above it)
    q     = fp8(clamp(x * inv, -m, m)),  inv = m / amax   (round_scale_to_pow2: 1 / scale, exact)
every step in fp32, the divisions rounded to nearest (``div_rn``: Triton's ``/`` is an approximate
division on the GPU), the cast to fp8 rounding to nearest even. The clamp saturates what rounding
pushes past m; the cast never overflows. A NaN in a group makes its amax, scale and every q NaN
(the reduction checks for it: ``max`` drops NaN on the GPU); an inf makes the amax inf, its own q
NaN and the group's finite values 0. There is no gradient: quantization is not differentiable.

Work. x is read once and q written once, scales beside: bytes s * N + N + 4 * groups for N
elements of s bytes (the tensor and the columns read x twice: their amax is a pass of its own, an
atomic max over programs, so that no host sync waits for it; columns of SHORT_COLUMNS rows or fewer
fit a tile and take one pass; ``transpose=True`` writes q^T in a
pass of its own, x read once more and a byte an element written).
A few FLOPs per element on CUDA cores: memory-bound, its roofline the copy bandwidth.

Kernels. ``_quantize_tiles_kernel`` takes a tile of rows x columns and quantizes the groups
inside it (row groups whose row fits a tile, blocks, 2-D blocks, or the whole tensor and the
columns with their amaxes given by ``_amax_kernel``, a pass of its own whose programs each reduce
a strip and raise the result by an atomic max); ``_quantize_lines_kernel`` walks rows too long for
a tile twice, the amax then the quantization. (Columns walked as lines, a program a strip of 256
columns down every row, ran at 3% of the copy bandwidth on the H200: 32 programs at 16384 x 8192.)

References: DeepSeek-V3 technical report (arXiv 2412.19437), section 3.3 (1 x 128 activation and
128 x 128 weight blocks); torch._scaled_mm's scale layouts.
"""

from __future__ import annotations

import functools
import math

import torch

from tritonkit._launch import Launch, cdiv, next_power_of_2, scratch
from tritonkit._runtime import empty_output, interpret, sm_count
from tritonkit._triton import tl, triton
from tritonkit.dtypes import FLOATS
from tritonkit.opdef import check_tensor, op

GRANULARITIES = ("tensor", "row", "column", "block", "column_block", "block2d")
# the groups that are a row's or a 1 x block_size run's of x^T, or stay what they are (a column of
# x is a row of x^T, a run down a column a run along a row of x^T): transpose=True takes these
TRANSPOSABLE = ("tensor", "column", "column_block", "block2d")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
AMAX_FLOOR = 1e-12  # an all-zero group's amax: its scale stays finite and its q 0 (torchao's EPS)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)  # the same, as the kernels read it
MIN_FILL_COLUMNS = 32  # a tile shrunk to fill the SMs keeps 64 bytes of a 16-bit row (two sectors)
# A tile holds at most this many elements: 32 fp32 values a thread at 8 warps. A row longer than
# this is walked in lines (two passes); a 2-D block must fit (block_size <= 128).
TILE_ELEMENTS = 8192
NUM_WARPS = 8
LINE_CHUNK = 2048  # elements of a line a lines program takes a step
# Transposes: a pass that stores q^T alone (TRANSPOSED: x read in its own order, q^T stored through
# the tile's transpose). A pass storing both q and q^T from its registers came out wrong on the H200
# wherever M or N divided by 16 (Triton 3.6; fp32 input at every tile from 32 x 32 up, bf16 at 64 x
# 160 in 64 x 128 tiles; right in the interpreter and at ragged sizes): found by the gpu tests, and
# known upstream (triton-lang/triton#11111: the transposed store reads bytes the kernel never wrote,
# with both stores in one kernel only; ptxas 12.9). torch's copy of q transposed, used instead until
# then, moved 0.34 TB/s on the H200 (1.19 of Float8Linear's 4.40 ms tensorwise step at 8192 x 4096 x 14336).
# A transposed pass's tile: 128 bytes of a bf16 row read, 128 bytes of a q^T row stored
TRANSPOSED_TILE = (128, 64)

# The columns' tile: 512 bytes of each of 32 bf16 rows, and 256 amaxes to read beside them (a tile
# one row of 8192 read 32 KB of amaxes a 16 KB row: 20% of the copy bandwidth on the H200)
COLUMN_TILE = (32, 256)
AMAX_CHUNK = 8192  # elements a tile of the amax pass reduces
AMAX_COLUMNS = 128  # columns a program of the columns' amax pass takes (256 bytes a bf16 row)
AMAX_ROWS = 1024  # rows it walks before its atomic max: N x M / AMAX_ROWS atomics in all
# Columns this short are column blocks of one block, quantized in one pass (a tile holds whole columns, 64
# or more wide), not an amax pass and then the tiles: at 128 x 4096 the two passes and the amaxes' zeroed
# workspace took 13 us replayed, 0.42x torch.compile's one kernel (benchmarks/quantize_fp8.py on the H200)
SHORT_COLUMNS = 128


@triton.jit
def _scales(amax, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """(scale, inv) of a group's amax (module docstring): scale dequantizes, inv quantizes."""
    amax = tl.where(amax < _AMAX_FLOOR, _AMAX_FLOOR, amax)  # (NaN compares false: it stays)
    scale = tl.math.div_rn(amax, FP8_MAX)
    if POW2:  # up to the power of two at or above: clear the mantissa, carry one if it was not 0
        bits = scale.to(tl.int32, bitcast=True)
        carry = ((bits & 0x7FFFFF) != 0).to(tl.int32)
        pow2 = ((bits >> 23) + carry) << 23
        scale = tl.where(scale == scale, pow2.to(tl.float32, bitcast=True), scale)
        inv = tl.math.div_rn(1.0, scale)
    else:
        inv = tl.math.div_rn(FP8_MAX, amax)
    return scale, inv


@triton.jit
def _saturate(x, inv, FP8_MAX: tl.constexpr):
    """x * inv clamped to [-FP8_MAX, FP8_MAX]; NaN passes (where, not minimum: NaN compares false)."""
    y = x * inv
    y = tl.where(y > FP8_MAX, FP8_MAX, y)
    return tl.where(y < -FP8_MAX, -FP8_MAX, y)


@triton.jit
def _to_fp8(y, dtype: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr, SOFT_CAST: tl.constexpr):
    """y (fp32, within the fp8 range) as ``dtype`` rounded to nearest even: the GPU's cast, or
    (SOFT_CAST, under the CPU interpreter, whose cast carries a rounding into the exponent wrongly
    and loses -0 and NaN) the same value's bits, as uint8, built here."""
    if SOFT_CAST:
        q = _fp8_bits(y, MANTISSA, MIN_EXP)
    else:
        q = y.to(dtype)
    return q


@triton.jit
def _fp8_bits(y, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """The uint8 bits of fp32 y's nearest fp8 value (ties to even), y within the fp8 range."""
    DROP: tl.constexpr = 23 - MANTISSA
    REBIAS: tl.constexpr = (127 - (1 - MIN_EXP)) << MANTISSA  # fp32's exponent bias to fp8's
    bits = y.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    # normal: the mantissa rounded on the bits (a carry runs into the exponent, as it should)
    normal = ((magnitude + ((1 << (DROP - 1)) - 1) + ((magnitude >> DROP) & 1)) >> DROP) - REBIAS
    # subnormal: steps of 2^(MIN_EXP - MANTISSA), rounded by adding a number whose fp32 step it is
    small = tl.abs(y) < 2.0**MIN_EXP
    MAGIC: tl.constexpr = 1.5 * 2.0 ** (23 + MIN_EXP - MANTISSA)
    steps = ((tl.where(small, tl.abs(y), 0.0) + MAGIC) - MAGIC) * 2.0 ** (MANTISSA - MIN_EXP)
    code = tl.where(small, steps.to(tl.int32), normal)
    code = tl.where(y != y, 0x7F, code)  # NaN: every exponent and mantissa bit set
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _abs_max(x, axis):
    """max |x| along ``axis``, NaN where any element is NaN (the GPU's max would drop it)."""
    amax = tl.max(tl.abs(x), axis=axis)
    nans = tl.max((x != x).to(tl.int32), axis=axis)
    return tl.where(nans > 0, float("nan"), amax)


@triton.jit
def _quantize_tiles_kernel(
    x_ptr,  # input, (M, N), strides (stride_xm, stride_xn)
    q_ptr,  # fp8 output (uint8 where SOFT_CAST), (M, N), contiguous
    scale_ptr,  # fp32 scales, (cdiv(M, GROUP_M), cdiv(N, GROUP_N)), strides (stride_sm, stride_sn)
    amax_bits_ptr,  # TENSOR: the tensor's amax, its fp32 bits as one int32; COLUMNS: N of them, a column's
    M,  # rows
    N,  # columns
    stride_xm,  # elements between rows of x
    stride_xn,  # elements between columns of x
    stride_sm,  # elements between rows of scales
    stride_sn,  # elements between columns of scales
    FP8: tl.constexpr,  # the fp8 dtype (q_ptr's, or uint8 where SOFT_CAST)
    SOFT_CAST: tl.constexpr,  # the cast done on integers (see _to_fp8)
    FP8_MAX: tl.constexpr,  # the fp8 dtype's largest finite value
    MANTISSA: tl.constexpr,  # its mantissa bits
    MIN_EXP: tl.constexpr,  # the exponent of its least normal value
    POW2: tl.constexpr,  # scales rounded up to powers of two
    TENSOR: tl.constexpr,  # one group, the whole tensor, whose amax the amax pass wrote
    COLUMNS: tl.constexpr,  # a group a column, whose amaxes the amax pass wrote
    TRANSPOSED: tl.constexpr,  # q_ptr holds q^T, (N, M) contiguous (see Transposes), and nothing else
    GROUP_M: tl.constexpr,  # rows of a group (a power of two, dividing BLOCK_M)
    GROUP_N: tl.constexpr,  # columns of a group (a power of two, dividing BLOCK_N)
    BLOCK_M: tl.constexpr,  # rows a program takes
    BLOCK_N: tl.constexpr,  # columns a program takes
):
    tl.static_assert(BLOCK_M % GROUP_M == 0 and BLOCK_N % GROUP_N == 0)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: M*N may pass 2^31
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if TENSOR:
        scale, inv = _scales(tl.load(amax_bits_ptr).to(tl.float32, bitcast=True), FP8_MAX, POW2)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(scale_ptr, scale)
        y = _saturate(x, inv, FP8_MAX)
    elif COLUMNS:
        amax = tl.load(amax_bits_ptr + cols, mask=cols < N, other=0).to(tl.float32, bitcast=True)
        scale, inv = _scales(amax, FP8_MAX, POW2)
        if tl.program_id(0) == 0:
            tl.store(scale_ptr + cols * stride_sn, scale, mask=cols < N)
        y = _saturate(x, inv[None, :], FP8_MAX)
    else:
        # the tile as (row groups, GROUP_M, column groups, GROUP_N): a group's amax over axes 1 and 3
        groups = tl.reshape(x, (BLOCK_M // GROUP_M, GROUP_M, BLOCK_N // GROUP_N, GROUP_N))
        amax = _abs_max(_abs_max(groups, 3), 1)
        scale, inv = _scales(amax, FP8_MAX, POW2)
        y = tl.reshape(_saturate(groups, inv[:, None, :, None], FP8_MAX), (BLOCK_M, BLOCK_N))
        group_rows = tl.program_id(0).to(tl.int64) * (BLOCK_M // GROUP_M) + tl.arange(0, BLOCK_M // GROUP_M)
        group_cols = tl.program_id(1) * (BLOCK_N // GROUP_N) + tl.arange(0, BLOCK_N // GROUP_N)
        scale_mask = (group_rows[:, None] < tl.cdiv(M, GROUP_M)) & (group_cols[None, :] < tl.cdiv(N, GROUP_N))
        scale_at = scale_ptr + group_rows[:, None] * stride_sm + group_cols[None, :] * stride_sn
        tl.store(scale_at, scale, mask=scale_mask)
    q = _to_fp8(y, FP8, MANTISSA, MIN_EXP, SOFT_CAST)
    if TRANSPOSED:
        tl.store(q_ptr + cols[None, :].to(tl.int64) * M + rows[:, None], q, mask=mask)
    else:
        tl.store(q_ptr + rows[:, None] * N + cols[None, :], q, mask=mask)


@triton.jit
def _quantize_lines_kernel(
    x_ptr,  # input: LINES lines of LENGTH elements, strides (stride_xl, stride_xe)
    q_ptr,  # fp8 output (uint8 where SOFT_CAST), the same lines, strides (stride_ql, stride_qe)
    scale_ptr,  # fp32 scales, one a line, stride stride_s
    LINES,  # lines (rows of x)
    LENGTH,  # elements a line
    stride_xl,  # elements between lines of x
    stride_xe,  # elements between a line's elements in x
    stride_ql,  # ... of q
    stride_qe,
    stride_s,  # elements between scales
    FP8: tl.constexpr,  # the fp8 dtype (q_ptr's, or uint8 where SOFT_CAST)
    SOFT_CAST: tl.constexpr,  # the cast done on integers (see _to_fp8)
    FP8_MAX: tl.constexpr,  # the fp8 dtype's largest finite value
    MANTISSA: tl.constexpr,  # its mantissa bits
    MIN_EXP: tl.constexpr,  # the exponent of its least normal value
    POW2: tl.constexpr,  # scales rounded up to powers of two
    BLOCK_L: tl.constexpr,  # lines a program takes
    BLOCK_E: tl.constexpr,  # elements of each a step takes
):
    lines = tl.program_id(0).to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
    line_mask = lines < LINES
    amax = tl.zeros([BLOCK_L], dtype=tl.float32)
    for start in range(0, LENGTH, BLOCK_E):  # the first pass: each line's amax
        elements = start + tl.arange(0, BLOCK_E)
        mask = line_mask[:, None] & (elements[None, :] < LENGTH)
        at = x_ptr + lines[:, None] * stride_xl + elements[None, :] * stride_xe
        x = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        step = _abs_max(x, 1)
        amax = tl.where((step > amax) | (step != step), step, amax)  # NaN, once in, stays
    scale, inv = _scales(amax, FP8_MAX, POW2)
    tl.store(scale_ptr + lines * stride_s, scale, mask=line_mask)
    for start in range(0, LENGTH, BLOCK_E):  # the second: the quantized values
        elements = start + tl.arange(0, BLOCK_E)
        mask = line_mask[:, None] & (elements[None, :] < LENGTH)
        x = tl.load(x_ptr + lines[:, None] * stride_xl + elements[None, :] * stride_xe, mask=mask, other=0.0)
        y = _saturate(x.to(tl.float32), inv[:, None], FP8_MAX)
        at = q_ptr + lines[:, None] * stride_ql + elements[None, :] * stride_qe
        tl.store(at, _to_fp8(y, FP8, MANTISSA, MIN_EXP, SOFT_CAST), mask=mask)


@triton.jit
def _amax_kernel(
    x_ptr,  # input, (M, N), strides (stride_xm, stride_xn)
    amax_bits_ptr,  # int32 fp32 bits of max |x|, raised by every program (atomic max): one, or N (COLUMNS)
    M,  # rows
    N,  # columns
    stride_xm,  # elements between rows of x
    stride_xn,  # elements between columns of x
    COLUMNS: tl.constexpr,  # a maximum a column, else one for the tensor
    STEPS: tl.constexpr,  # tiles a program reduces, down the rows, before its atomic max
    BLOCK_M: tl.constexpr,  # rows a tile takes
    BLOCK_N: tl.constexpr,  # columns a tile takes
):
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # each thread keeps the largest |x| of its own elements over the steps, so that the loop only
    # loads and compares; the one reduction across threads comes after it
    amaxes = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(STEPS):
        rows = (tl.program_id(0).to(tl.int64) * STEPS + step) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask, other=0.0)
        x = tl.abs(x.to(tl.float32))
        amaxes = tl.where((x > amaxes) | (x != x), x, amaxes)  # NaN, once in, stays
    amax = _abs_max(amaxes, 0)
    # non-negative floats order as their bits do, and the NaN made above (0x7FC00000) tops inf
    if COLUMNS:
        tl.atomic_max(amax_bits_ptr + cols, amax.to(tl.int32, bitcast=True), mask=cols < N)
    else:
        tl.atomic_max(amax_bits_ptr, _abs_max(amax, 0).to(tl.int32, bitcast=True))


# ---------------------------------------------------------------- launches


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


@functools.cache  # (a call's host path would redo finfo and log2 each time)
def _format(dtype: torch.dtype) -> dict:
    """The fp8 dtype's constexprs: its largest value, mantissa bits and least normal exponent."""
    info = torch.finfo(dtype)
    mantissa = round(-math.log2(info.eps))  # eps = 2^-mantissa
    least_normal_exponent = round(math.log2(info.tiny))
    fp8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}[dtype]
    return {
        "FP8": fp8,
        "SOFT_CAST": interpret(),
        "FP8_MAX": float(info.max),
        "MANTISSA": mantissa,
        "MIN_EXP": least_normal_exponent,
    }


@functools.lru_cache(maxsize=1024)
def _tile(group_m: int, group_n: int, n_cols: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): whole groups, at most TILE_ELEMENTS, as wide as the row allows."""
    block_n = max(group_n, min(next_power_of_2(n_cols), TILE_ELEMENTS // group_m))
    return max(group_m, TILE_ELEMENTS // block_n // group_m * group_m), block_n


def _fill(
    block_m: int, block_n: int, shape: tuple[int, int], group: tuple[int, int], sms: int
) -> tuple[int, int]:
    """The tile halved (its rows first, then its columns, whole groups kept and columns down to
    MIN_FILL_COLUMNS) while its programs leave SMs idle: a small input is one round trip to memory a
    program, so its time is that of its busiest SM (at 128 x 4096 the row-wise tile of 2 x 4096 made
    64 programs, the columns' 128 x 64 as many, for the H200's 132 SMs)."""
    (m, n), (group_m, group_n) = shape, group
    while cdiv(m, block_m) * cdiv(n, block_n) < sms:
        if block_m // 2 >= group_m:
            block_m //= 2
        elif block_n // 2 >= max(group_n, MIN_FILL_COLUMNS):
            block_n //= 2
        else:
            break
    return block_m, block_n


def _tiles_launch(
    x, q, scale, group: tuple[int, int], dtype, pow2: bool, amax=None, transposed: bool = False
) -> Launch:
    """Tiles of x (module docstring), writing q (``transposed``: q^T, (N, M)) and the scales.
    ``amax``: (the amax pass's bits, "tensor" or "column") where the groups' amaxes are given."""
    m, n = x.shape
    group_m, group_n = group
    amax_bits, given = amax or (None, None)
    if transposed and group == (1, 1):  # the tensor's or the columns': rows as long as columns
        block_m, block_n = TRANSPOSED_TILE
    elif given == "column":  # tall tiles: each reads its columns' amaxes, BLOCK_N of them a tile
        block_m, block_n = COLUMN_TILE
    else:
        block_m, block_n = _tile(group_m, group_n, n)
    if not transposed:  # (a transposed pass's rows are q^T's stores: kept 128 bytes long)
        block_m, block_n = _fill(block_m, block_n, (m, n), group, sm_count(x.device))
    scale_strides = (0, 0) if given == "tensor" else (scale.stride(0), scale.stride(1))
    meta = {
        **_format(dtype),
        "POW2": pow2,
        "TENSOR": given == "tensor",
        "COLUMNS": given == "column",
        "TRANSPOSED": transposed,
        "GROUP_M": group_m,
        "GROUP_N": group_n,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "num_warps": NUM_WARPS,
    }
    args = (x, q, scale, scale if amax_bits is None else amax_bits, m, n)
    args = (*args, x.stride(0), x.stride(1))
    return Launch(
        "tiles",
        _quantize_tiles_kernel,
        (*args, *scale_strides),
        meta,
        grid=(cdiv(m, block_m), cdiv(n, block_n)),
    )


def _lines_launch(x, q, scale, dtype, pow2: bool) -> Launch:
    """Rows of x too long for a tile, each walked twice, in long steps along it."""
    lines, length = x.shape
    block_e = min(LINE_CHUNK, next_power_of_2(length))
    block_l = max(1, min(TILE_ELEMENTS // block_e, next_power_of_2(lines)))
    meta = {
        **_format(dtype),
        "POW2": pow2,
        "BLOCK_L": block_l,
        "BLOCK_E": block_e,
        "num_warps": NUM_WARPS,
    }
    args = (x, q, scale, lines, length, x.stride(0), x.stride(1), q.stride(0), q.stride(1), 1)
    return Launch("lines", _quantize_lines_kernel, args, meta, grid=(cdiv(lines, block_l),))


def _amax_launch(x, amax_bits, columns: bool) -> Launch:
    """The amax pass: the tensor's, or each column's (``columns``), into ``amax_bits``, zeros before.
    A column's runs of AMAX_COLUMNS elements a row (256 contiguous bytes in 16 bits), each program
    down AMAX_ROWS rows, so that the atomics are few; the tensor's in tiles of AMAX_CHUNK."""
    m, n = x.shape
    if columns:
        block_n = min(next_power_of_2(n), AMAX_COLUMNS)
        block_m = max(1, min(AMAX_CHUNK // block_n, next_power_of_2(m)))
        steps = max(1, min(AMAX_ROWS, next_power_of_2(m)) // block_m)
    else:
        block_n = min(next_power_of_2(n), AMAX_CHUNK)
        block_m, steps = max(1, AMAX_CHUNK // block_n), 1
    meta = {
        "COLUMNS": columns,
        "STEPS": steps,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "num_warps": NUM_WARPS,
    }
    args = (x, amax_bits, m, n, x.stride(0), x.stride(1))
    return Launch("amax", _amax_kernel, args, meta, grid=(cdiv(m, block_m * steps), cdiv(n, block_n)))


def _launches(
    x, q, qt, scale, amax_bits, granularity: str, block_size: int, dtype, pow2: bool
) -> list[Launch]:
    """The launches that fill q, qt (where not None: q^T, by a pass of its own) and scale for a
    2-D x (module docstring)."""
    if granularity in ("tensor", "column"):  # the amaxes first, then every tile at once
        given = (amax_bits, granularity)
        passes = [(out, out is qt) for out in (q, qt) if out is not None]
        tiles = [_tiles_launch(x, out, scale, (1, 1), dtype, pow2, given, flip) for out, flip in passes]
        return [_amax_launch(x, amax_bits, granularity == "column"), *tiles]
    if granularity == "row" and x.shape[1] > TILE_ELEMENTS:
        return [_lines_launch(x, q, scale, dtype, pow2)]
    group = {
        "row": (1, next_power_of_2(x.shape[1])),
        "block": (1, block_size),
        "column_block": (block_size, 1),
        "block2d": (block_size, block_size),
    }[granularity]
    passes = [(out, out is qt) for out in (q, qt) if out is not None]
    return [_tiles_launch(x, out, scale, group, dtype, pow2, transposed=flip) for out, flip in passes]


def _as_launched(granularity: str, block_size: int, rows: int) -> tuple[str, int]:
    """The groups the launches take: short columns (SHORT_COLUMNS rows at most) as column blocks, a
    block a column, whose scales are the columns' (1, N)."""
    if granularity == "column" and next_power_of_2(rows) <= SHORT_COLUMNS:
        return "column_block", next_power_of_2(rows)
    return granularity, block_size


def scale_shape(shape: tuple, granularity: str, block_size: int) -> tuple:
    """The scales' shape for an input of ``shape``: () for the tensor, (..., 1) a row, (1, N) a column,
    (..., cdiv(N, block_size)) a block, (cdiv(M, block_size), N) a column's block, (cdiv(M,
    block_size), cdiv(N, block_size)) a 2-D block."""
    if granularity == "tensor":
        return ()
    if granularity == "row":
        return (*shape[:-1], 1)
    if granularity == "column":
        return (1, shape[1])
    if granularity == "block":
        return (*shape[:-1], cdiv(shape[-1], block_size))
    if granularity == "column_block":
        return (cdiv(shape[0], block_size), shape[1])
    return (cdiv(shape[0], block_size), cdiv(shape[1], block_size))


def _validate(x, granularity: str, block_size: int, dtype, scale_dtype, transpose: bool) -> None:
    check_tensor("x", x, dtypes=FLOATS, min_ndim=1)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity in ("column", "column_block", "block2d") and x.dim() != 2:
        raise ValueError(f"granularity {granularity!r} takes a 2-D x, got shape {tuple(x.shape)}")
    if dtype not in FP8_DTYPES:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if scale_dtype != torch.float32:
        raise NotImplementedError(f"scale_dtype {scale_dtype}: only torch.float32 scales are implemented")
    if transpose and granularity not in TRANSPOSABLE:
        raise ValueError(
            f"transpose=True keeps the groups, which only {TRANSPOSABLE} keep under a transpose: the "
            f"{granularity!r} scales of x's transpose are other groups (quantize x.t() for them)"
        )
    if transpose and x.dim() != 2:
        raise ValueError(f"transpose=True takes a 2-D x, got shape {tuple(x.shape)}")
    if granularity in ("block", "column_block", "block2d"):
        # a tile holds whole groups: a run down a column at least 64 columns wide (128-byte rows)
        largest = TILE_ELEMENTS if granularity == "block" else 128
        power_of_two = isinstance(block_size, int) and block_size > 0 and not block_size & (block_size - 1)
        if not power_of_two or not 8 <= block_size <= largest:
            raise ValueError(
                f"block_size must be a power of two from 8 to {largest} for {granularity!r}, "
                f"got {block_size!r}"
            )


# ---------------------------------------------------------------- op


@op("quantize_fp8", mutates=("q_bits", "qt_bits", "scale"), replay=True)
def _quantize(
    x: torch.Tensor,
    granularity: str,
    block_size: int,
    round_scale_to_pow2: bool,
    dtype: torch.dtype,
    q_bits: torch.Tensor,
    qt_bits: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """Writes q (dtype, as its uint8 bits ``q_bits``: torch's CPU ops, which opcheck runs, do not
    take fp8) where ``q_bits`` has elements, its transpose where ``qt_bits`` has, and the scales."""
    if x.numel() == 0:  # no program runs: each group's amax is that of nothing, 0
        scale.copy_(_reference_scales(torch.zeros_like(scale), dtype, round_scale_to_pow2)[0])
        return
    x2 = x.reshape(-1, x.shape[-1])
    q2 = q_bits.view(-1, x.shape[-1]) if q_bits.numel() else None
    qt = qt_bits if qt_bits.numel() else None
    if not interpret():  # (the interpreter's kernels write the bits: _to_fp8's SOFT_CAST)
        q2, qt = (None if out is None else out.view(dtype) for out in (q2, qt))
    scale2 = scale.view(-1, scale.shape[-1]) if scale.dim() else scale
    granularity, block_size = _as_launched(granularity, block_size, x2.shape[0])
    amaxes = {"tensor": 1, "column": x.shape[-1]}.get(granularity)
    # (zeroed workspace, which a replay allocates afresh: the op's launches are all it does)
    amax_bits = scratch((amaxes,), torch.int32, x.device, zeroed=True) if amaxes else None
    pow2 = round_scale_to_pow2
    for launch in _launches(x2, q2, qt, scale2, amax_bits, granularity, block_size, dtype, pow2):
        launch.run()


def quantize_fp8(
    x: torch.Tensor,
    granularity: str = "row",
    *,
    block_size: int = 128,
    dtype: torch.dtype = torch.float8_e4m3fn,
    scale_dtype: torch.dtype = torch.float32,
    transpose: bool = False,
    round_scale_to_pow2: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``(x_fp8, scale)`` with ``x_fp8 * scale`` (broadcast per group) approximating x: one scale for
    the ``"tensor"``, each ``"row"`` (over the last dimension), each ``"column"`` (2-D x), each
    ``"block"`` of ``block_size`` along the last dimension, each ``"column_block"`` of ``block_size``
    down a column (2-D x: x^T's blocks), or each ``"block2d"`` tile of ``block_size`` x
    ``block_size`` (2-D x). Scales are fp32 in ``scale_shape``'s shape; the casts
    saturate. See the module docstring for the exact arithmetic, zeros and non-finite values. No
    gradient (raises if x requires one).

    ``transpose=True`` (the tensor, columns, column blocks and 2-D blocks: a column of x is a row of
    x^T, a column's block a block of x^T) returns ``(x_fp8, scale, xt_fp8, scale_t)``: also x_fp8's
    transpose, contiguous (what a backward's ``_scaled_mm`` takes; written by a pass of its own),
    and its scales (the same scale, or the columns', column blocks' or 2-D blocks' transposed, a
    view: x^T's rowwise, block or 2-D block scales). ``quantize_fp8_transposed`` gives the transpose alone."""
    _validate(x, granularity, block_size, dtype, scale_dtype, transpose)
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError("quantize_fp8 has no gradient: call it on x.detach(), or under torch.no_grad()")
    q = torch.empty(x.shape, dtype=dtype, device=x.device)  # (fp8 cannot hold the NaN poison)
    scale = empty_output(scale_shape(tuple(x.shape), granularity, block_size), torch.float32, x.device)
    qt = torch.empty(x.shape[::-1] if transpose else (0,), dtype=dtype, device=x.device)
    _quantize(
        x,
        granularity,
        block_size,
        round_scale_to_pow2,
        dtype,
        q.view(torch.uint8),
        qt.view(torch.uint8),
        scale,
    )
    if not transpose:
        return q, scale
    return q, scale, qt, scale.t() if scale.dim() == 2 else scale


def quantize_fp8_transposed(
    x: torch.Tensor,
    granularity: str = "column",
    *,
    block_size: int = 128,
    dtype: torch.dtype = torch.float8_e4m3fn,
    round_scale_to_pow2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xt_fp8, scale_t)``: ``quantize_fp8(x, granularity, transpose=True)``'s last two, x^T's fp8
    values (contiguous) and its scales (x's columns' scales are x^T's rowwise ones), without x_fp8:
    x read in its own order, x^T stored by the pass. What a backward's transposed operand needs
    (x^T of a contiguous x), without the strided reads of quantizing the view x^T."""
    _validate(x, granularity, block_size, dtype, torch.float32, True)
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError("quantize_fp8 has no gradient: call it on x.detach(), or under torch.no_grad()")
    scale = empty_output(scale_shape(tuple(x.shape), granularity, block_size), torch.float32, x.device)
    qt = torch.empty(x.shape[::-1], dtype=dtype, device=x.device)
    # (an empty q_bits: no q written, unless x itself is empty, where nothing is written at all)
    none = torch.empty(0, dtype=torch.uint8, device=x.device)
    _quantize(x, granularity, block_size, round_scale_to_pow2, dtype, none, qt.view(torch.uint8), scale)
    return qt, scale.t() if scale.dim() == 2 else scale


# ---------------------------------------------------------------- reference and cost


def _reference_scales(
    amax: torch.Tensor, dtype: torch.dtype, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, inv) of fp32 amaxes, as the kernels' ``_scales``."""
    top = torch.tensor(fp8_max(dtype), dtype=torch.float32, device=amax.device)
    amax = torch.where(
        amax < AMAX_FLOOR, torch.tensor(AMAX_FLOOR, dtype=torch.float32, device=amax.device), amax
    )
    scale = amax / top
    if not pow2:
        return scale, top / amax
    bits = scale.view(torch.int32)
    up = ((bits & 0x7FFFFF) != 0).to(torch.int32)
    pow2_scale = (((bits >> 23) + up) << 23).view(torch.float32)
    scale = torch.where(scale.isnan(), scale, pow2_scale)
    return scale, 1.0 / scale


def quantize_fp8_reference(
    x: torch.Tensor,
    granularity: str = "row",
    *,
    block_size: int = 128,
    dtype: torch.dtype = torch.float8_e4m3fn,
    round_scale_to_pow2: bool = False,
    saturated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch, fp32 as the kernels: ``(x_fp8, scale)``; ``saturated=True`` returns the fp32
    values before the cast instead of x_fp8 (what a test of the cast's rounding needs)."""
    x32 = x.float()
    n = x32.shape[-1]
    rows = x32.reshape(math.prod(x32.shape[:-1]), n)
    m = rows.shape[0]
    group_m, group_n = {
        "tensor": (max(m, 1), max(n, 1)),
        "row": (1, max(n, 1)),
        "column": (max(m, 1), 1),
        "block": (1, block_size),
        "column_block": (block_size, 1),
        "block2d": (block_size, block_size),
    }[granularity]
    # a row of no elements still has a scale (so do a column and the tensor): at least one group
    gm = max(cdiv(m, group_m), int(granularity in ("tensor", "column")))
    gn = max(cdiv(n, group_n), int(granularity in ("tensor", "row")))
    padded = torch.zeros(gm * group_m, gn * group_n, dtype=torch.float32, device=x.device)
    padded[:m, :n] = rows
    amax = padded.view(gm, group_m, gn, group_n).abs().amax(dim=(1, 3))
    scale, inv = _reference_scales(amax, dtype, round_scale_to_pow2)
    inv_each = inv.repeat_interleave(group_m, 0).repeat_interleave(group_n, 1)[:m, :n]
    top = fp8_max(dtype)
    values = (rows * inv_each).clamp(-top, top).reshape(x.shape)
    scale = scale.reshape(scale_shape(tuple(x.shape), granularity, block_size))
    return (values if saturated else values.to(dtype)), scale


def quantize_fp8_cost(shape: tuple, dtype: torch.dtype, granularity: str = "row", block_size: int = 128):
    """x read once (twice for the tensor's amax; the columns' amax pass reads it a second time too,
    not counted, so that their GB/s is against the least a column's scales need), the fp8 values
    and fp32 scales written; a few FLOPs an element (abs, max, multiply, two compares)."""
    from tritonkit.roofline import Cost

    elements = math.prod(shape)
    size = torch.finfo(dtype).bits // 8
    scales = math.prod(scale_shape(tuple(shape), granularity, block_size))
    reads = 2 if granularity == "tensor" else 1
    return Cost(5 * elements, reads * size * elements + elements + 4 * scales)


# No op contract (an op without a gradient, whose outputs are fp8, is held to its reference by
# tests/test_quantize.py) and no workload yet (benchmarks/quantize_fp8.py times it)
OPS: dict = {}
WORKLOADS: dict = {}
