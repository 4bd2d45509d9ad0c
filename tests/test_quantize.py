"""quantize_fp8 against its fp32 reference (the scales and the fp8 values bit for bit, NaN as NaN) and
against float64 arithmetic (`test_scales_and_values_against_float64`).

Under the CPU interpreter the kernels build the fp8 bits themselves (its cast is wrong); the gpu
tests hold the GPU's cast to the same bits.
"""

from __future__ import annotations

import pytest
import torch

import sm90
import tritonkit
from tritonkit._runtime import interpret
from tritonkit.ops import quantize as qz

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _device() -> str:
    return "cpu" if interpret() else "cuda"


def _input(shape, dtype=torch.bfloat16, seed=0, spread=True):
    """Random values whose rows span several orders of magnitude (so scales differ), never zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if spread:
        x = x * torch.exp2(torch.randint(-6, 7, shape[:-1] + (1,), generator=g).float())
    return x.to(dtype).to(_device())


def _assert_cast(q: torch.Tensor, values: torch.Tensor) -> None:
    """q is torch's cast of values (which rounds to nearest even), bit for bit; NaN where NaN."""
    nan = values.isnan()
    assert torch.equal(q.float().isnan(), nan), "NaN where the reference has none, or the reverse"
    differ = q.view(torch.uint8)[~nan] != values[~nan].to(q.dtype).view(torch.uint8)
    assert not differ.any(), f"{int(differ.sum())} of {q.numel()} values differ from torch's cast"


def _check(x, granularity, *, dtype=E4M3, block_size=128, pow2=False):
    q, scale = tritonkit.quantize_fp8(
        x, granularity, block_size=block_size, dtype=dtype, round_scale_to_pow2=pow2
    )
    values, want_scale = qz.quantize_fp8_reference(
        x, granularity, block_size=block_size, dtype=dtype, round_scale_to_pow2=pow2, saturated=True
    )
    assert q.shape == x.shape and q.dtype == dtype and scale.dtype == torch.float32
    assert scale.shape == qz.scale_shape(tuple(x.shape), granularity, block_size)
    nan = want_scale.isnan()
    assert torch.equal(scale.isnan(), nan), (scale, want_scale)
    assert torch.equal(scale[~nan].view(torch.int32), want_scale[~nan].view(torch.int32)), (scale, want_scale)
    _assert_cast(q, values)
    return q, scale


# (granularity, shape, block_size): groups cut by the edges (partial blocks, odd rows)
CASES = [
    ("tensor", (37, 300), 128),
    ("row", (37, 300), 128),
    ("column", (37, 300), 128),
    ("column", (300, 37), 128),
    ("block", (37, 300), 128),
    ("block", (5, 100), 32),
    ("column_block", (300, 37), 128),
    ("column_block", (50, 5), 16),
    ("block2d", (37, 50), 16),
]


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}")
def test_matches_the_reference(case, dtype):
    granularity, shape, block_size = case
    x = _input(shape, seed=CASES.index(case))
    for pow2 in (False, True):
        _check(x, granularity, dtype=dtype, block_size=block_size, pow2=pow2)


@pytest.mark.parametrize("input_dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_every_input_dtype(input_dtype):
    _check(_input((9, 70), input_dtype, seed=11), "row")
    _check(_input((9, 70), input_dtype, seed=12), "tensor", dtype=E5M2)


def test_dequantized_values_are_within_half_an_fp8_step():
    """|q * scale - x| <= |x| 2^-(mantissa bits + 1) + scale * (half the smallest subnormal): what
    rounding to the nearest fp8 value allows, no more."""
    x = _input((16, 256), torch.float32, seed=3)
    for dtype, mantissa, subnormal in ((E4M3, 3, 2.0**-9), (E5M2, 2, 2.0**-16)):
        for granularity in ("row", "block", "tensor"):
            q, scale = tritonkit.quantize_fp8(x, granularity, block_size=64, dtype=dtype)
            each = scale if granularity != "block" else scale.repeat_interleave(64, dim=-1)
            error = (q.float() * each - x).abs()
            bound = x.abs() * 2.0 ** -(mantissa + 1) + each * subnormal / 2
            assert (error <= bound * (1 + 2**-20)).all(), (dtype, granularity, (error - bound).max())


def test_tiles_shrink_until_their_programs_fill_the_sms():
    """A small input's tile halves, rows first, then columns (whole groups, 32 columns at least), until
    its programs are at least the SMs; a large one's stays as _tile made it."""
    assert qz._fill(*qz._tile(1, 4096, 4096), (128, 4096), (1, 4096), 132) == (1, 4096)  # 128 programs
    assert qz._fill(*qz._tile(128, 1, 4096), (128, 4096), (128, 1), 132) == (128, 32)  # 128 programs
    assert qz._fill(*qz._tile(64, 1, 8192), (64, 8192), (64, 1), 132) == (64, 32)  # 256 programs
    assert qz._fill(*qz._tile(1, 128, 4096), (128, 4096), (1, 128), 132) == (1, 2048)  # 256 programs
    assert qz._fill(*qz._tile(128, 128, 4096), (128, 4096), (128, 128), 132) == (128, 128)  # whole blocks
    assert qz._fill(*qz._tile(1, 4096, 4096), (8192, 4096), (1, 4096), 132) == qz._tile(1, 4096, 4096)


def test_short_columns_take_one_pass_and_long_ones_an_amax_pass_first():
    """Columns that fit a tile are quantized as one column block each, in one pass; longer ones by
    the amax pass and then the tiles. Both are held to the reference by the cases above."""
    assert qz._as_launched("column", 128, qz.SHORT_COLUMNS) == ("column_block", qz.SHORT_COLUMNS)
    assert qz._as_launched("column", 128, 37) == ("column_block", 64)
    assert qz._as_launched("column", 128, qz.SHORT_COLUMNS + 1) == ("column", 128)
    assert qz._as_launched("column_block", 16, 37) == ("column_block", 16)


def test_long_rows_columns_and_strided_inputs():
    """Rows past a tile (the two-pass walk), a transposed (strided) x, and a 3-D x."""
    _check(_input((3, qz.TILE_ELEMENTS + 77), seed=4), "row")
    wide = _input((40, 24), seed=5)
    _check(wide.t(), "row")
    _check(wide.t(), "column")
    _check(wide.t(), "block", block_size=8)
    deep = _input((2, 3, 96), seed=6)
    for granularity in ("row", "block", "tensor"):
        _check(deep, granularity, block_size=32)


def test_zero_groups_and_empty_inputs():
    x = _input((4, 64), seed=7)
    x[1] = 0
    q, scale = _check(x, "row")
    assert (q[1].float() == 0).all() and scale[1, 0] == torch.tensor(qz.AMAX_FLOOR) / qz.fp8_max(E4M3)
    for granularity, shape in (("row", (0, 8)), ("row", (3, 0)), ("tensor", (0, 4)), ("column", (0, 5))):
        q, scale = _check(torch.empty(shape, dtype=torch.bfloat16, device=_device()), granularity)
        assert scale.numel() == 0 or torch.isfinite(scale).all()


def test_non_finite_values():
    """A NaN makes its group's scale and every value NaN; an inf makes the scale inf, its own value
    NaN and the group's others 0."""
    x = _input((4, 40), seed=8)
    x[1, 3], x[2, 5] = float("nan"), float("inf")
    for dtype in (E4M3, E5M2):
        for granularity in ("row", "column", "block", "tensor"):
            _check(x, granularity, dtype=dtype, block_size=8)
    q, scale = tritonkit.quantize_fp8(x, "row")
    assert scale[1].isnan().all() and q[1].float().isnan().all()
    assert scale[2].isinf().all() and q[2, 5].float().isnan() and (q[2, :5].float() == 0).all()
    assert torch.isfinite(scale[[0, 3]]).all()


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(37, 50), (32, 48)], ids=["ragged", "by-16"])
def test_the_transposed_copy_is_the_transpose(dtype, x_dtype, shape):
    """transpose=True: x_fp8's transpose, contiguous, bit for bit; the scales of
    the tensor as they are, the columns', column blocks' and 2-D blocks' transposed (the columns':
    x^T's rowwise scales, the column blocks' its block scales, which quantizing x^T by rows or by
    blocks gives too, bit for bit). Dimensions that divide by 16 and
    fp32 input too (where the GPU's transposed store in the pass itself came out wrong: quantize.py's
    Transposes)."""
    x = _input(shape, x_dtype, seed=14)
    for granularity, block_size in (("tensor", 128), ("column", 128), ("column_block", 16), ("block2d", 16)):
        q, scale = _check(x, granularity, dtype=dtype, block_size=block_size)
        _, _, qt, scale_t = tritonkit.quantize_fp8(
            x, granularity, dtype=dtype, block_size=block_size, transpose=True
        )
        assert qt.is_contiguous() and qt.dtype == dtype
        assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
        assert torch.equal(scale_t, scale.t() if scale.dim() else scale)
        alone, alone_scale = qz.quantize_fp8_transposed(x, granularity, dtype=dtype, block_size=block_size)
        assert torch.equal(alone.view(torch.uint8), qt.view(torch.uint8)) and alone.is_contiguous()
        assert torch.equal(alone_scale, scale_t)
        if granularity in ("column", "column_block"):  # x^T's rows' or blocks' quantization
            of_rows = {"column": "row", "column_block": "block"}[granularity]
            q_rows, scale_rows = tritonkit.quantize_fp8(
                x.t().contiguous(), of_rows, dtype=dtype, block_size=block_size
            )
            assert torch.equal(qt.view(torch.uint8), q_rows.view(torch.uint8))
            assert torch.equal(scale_t, scale_rows)


def test_torch_compile_and_opcheck():
    from tritonkit.opdef import recording_calls

    x = _input((8, 64), seed=9)
    with recording_calls() as calls:
        tritonkit.quantize_fp8(x, "block", block_size=32)
    for custom, args in calls:
        torch.library.opcheck(custom, args)
    compiled = torch.compile(lambda t: tritonkit.quantize_fp8(t, "row"), fullgraph=True)
    q, scale = compiled(x)
    eager_q, eager_scale = tritonkit.quantize_fp8(x, "row")
    assert torch.equal(q.view(torch.uint8), eager_q.view(torch.uint8)) and torch.equal(scale, eager_scale)


def test_bad_arguments_fail_clearly():
    x = _input((4, 64), seed=10)
    with pytest.raises(ValueError, match="granularity"):
        tritonkit.quantize_fp8(x, "channel")
    with pytest.raises(ValueError, match="2-D"):
        tritonkit.quantize_fp8(x[None], "column")
    with pytest.raises(ValueError, match="block_size"):
        tritonkit.quantize_fp8(x, "block", block_size=100)
    with pytest.raises(ValueError, match="block_size"):
        tritonkit.quantize_fp8(x, "block2d", block_size=256)
    with pytest.raises(ValueError, match="block_size"):  # a tile holds whole runs, 64 columns wide
        tritonkit.quantize_fp8(x, "column_block", block_size=256)
    with pytest.raises(ValueError, match="2-D"):
        tritonkit.quantize_fp8(x[None], "column_block")
    with pytest.raises(TypeError, match="dtype"):
        tritonkit.quantize_fp8(x, dtype=torch.int8)
    with pytest.raises(TypeError, match="x must be"):
        tritonkit.quantize_fp8(x.to(torch.int32))
    with pytest.raises(NotImplementedError, match="scale_dtype"):
        tritonkit.quantize_fp8(x, scale_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="transpose=True keeps the groups"):
        tritonkit.quantize_fp8(x, "row", transpose=True)
    with pytest.raises(ValueError, match="2-D"):
        tritonkit.quantize_fp8(x[None], "tensor", transpose=True)
    with pytest.raises(RuntimeError, match="no gradient"):
        tritonkit.quantize_fp8(x.float().requires_grad_())


# ---------------------------------------------------------------- compiles for Hopper, no GPU needed

_HOPPER_CHECK = r"""
import torch
import tritonkit.ops.quantize as qz

def show(name, report):
    wide = {width for width in report.loads if width != 32}  # (32: the tensor's amax)
    fp8_stores = {width for width in report.stores if width != 32}  # (32: the fp32 scales)
    print(name, wide == {128}, fp8_stores == {128}, report.opcodes["F2FP"] > 0,
          not report.spills, report.opcodes["ATOMG"] + report.opcodes["RED"])

fmt = qz._format(torch.float8_e4m3fn) | {"SOFT_CAST": False}
tiles = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
         "amax_bits_ptr": "*i32", "M": "i32", "N": "i32", "stride_xm": "i32", "stride_xn": "constexpr",
         "stride_sm": "i32", "stride_sn": "i32"}
groups = (("row", (1, 4096)), ("block", (1, 128)), ("column_block", (128, 1)), ("block2d", (128, 128)),
          ("tensor", (1, 1)), ("column", (1, 1)))
transposes = (("tensor transposed", (1, 1)), ("column transposed", (1, 1)),
              ("column_block transposed", (128, 1)))
for name, group in groups + transposes:
    transposed = name.endswith("transposed")
    block_m, block_n = qz.COLUMN_TILE if name == "column" else qz._tile(*group, 4096)
    block_m, block_n = qz.TRANSPOSED_TILE if transposed and group == (1, 1) else (block_m, block_n)
    meta = fmt | {"POW2": False, "TENSOR": name.startswith("tensor"), "COLUMNS": name.split()[0] == "column",
                  "TRANSPOSED": transposed, "GROUP_M": group[0], "GROUP_N": group[1], "BLOCK_M": block_m,
                  "BLOCK_N": block_n, "stride_xn": 1}
    show(name, compile_kernel(qz._quantize_tiles_kernel, tiles, meta, qz.NUM_WARPS))
for name, group in (("row, filled", (1, 4096)), ("column_block, filled", (128, 1))):  # at 128 x 4096
    block_m, block_n = qz._fill(*qz._tile(*group, 4096), (128, 4096), group, 132)
    meta = fmt | {"POW2": False, "TENSOR": False, "COLUMNS": False, "TRANSPOSED": False, "GROUP_M": group[0],
                  "GROUP_N": group[1], "BLOCK_M": block_m, "BLOCK_N": block_n, "stride_xn": 1}
    show(name, compile_kernel(qz._quantize_tiles_kernel, tiles, meta, qz.NUM_WARPS))
lines = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "LINES": "i32", "LENGTH": "i32",
         "stride_xl": "i32", "stride_xe": "constexpr", "stride_ql": "i32", "stride_qe": "constexpr",
         "stride_s": "constexpr"}
meta = fmt | {"POW2": True, "BLOCK_L": 4, "BLOCK_E": qz.LINE_CHUNK,
              "stride_xe": 1, "stride_qe": 1, "stride_s": 1}
show("lines", compile_kernel(qz._quantize_lines_kernel, lines, meta, qz.NUM_WARPS))
amax = {"x_ptr": "*bf16", "amax_bits_ptr": "*i32", "M": "i32", "N": "i32", "stride_xm": "i32",
        "stride_xn": "constexpr"}
for name, meta in (("amax", {"COLUMNS": False, "STEPS": 1, "BLOCK_M": 2, "BLOCK_N": 4096}),
                   ("column amax", {"COLUMNS": True, "STEPS": 16, "BLOCK_M": 64, "BLOCK_N": 128})):
    report = compile_kernel(qz._amax_kernel, amax, meta | {"stride_xn": 1}, qz.NUM_WARPS)
    atomics = report.opcodes["ATOMG"] + report.opcodes["RED"]
    print(name, set(report.loads) == {128}, not report.spills, atomics)
"""


def test_kernels_compile_for_hopper_with_wide_accesses_the_hardware_cast_and_no_spills():
    """Compiled for sm_90 with Triton's own ptxas (the interpreter never compiles): 16-byte loads of
    x and stores of q, the fp8 cast in hardware (F2FP), no spills, and one
    atomic for the tensor's amax a program (the columns' pass: a few a thread, none in its loop)."""
    lines = sm90.run(_HOPPER_CHECK)
    assert len(lines) == 14, lines
    # the tiles (the transposed passes' q^T stores 16 bytes wide too, the tiles shrunk to fill the SMs
    # too), the lines
    for line in lines[:12]:
        assert line.endswith("True True True True 0"), line
    assert lines[12] == "amax True True 1", lines[12]
    name, loads, no_spills, atomics = lines[13].rsplit(" ", 3)
    assert (name, loads, no_spills) == ("column amax", "True", "True") and 0 < int(atomics) <= 4, lines[7]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("granularity", qz.GRANULARITIES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_gpu_large_shapes_bit_for_bit(granularity, dtype):
    """At sizes the benchmarks run, every bit as torch's cast of the reference's values."""
    shape = (4099, 4096) if granularity != "block2d" else (1000, 4104)
    x = _input(shape, seed=13)
    for pow2 in (False, True):
        q, _ = _check(x, granularity, dtype=dtype, pow2=pow2)
    if granularity in qz.TRANSPOSABLE:
        qt = tritonkit.quantize_fp8(x, granularity, dtype=dtype, round_scale_to_pow2=True, transpose=True)[2]
        assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(128, 4096), (37, 4104), (1, 8192)], ids=str)
def test_gpu_short_columns_bit_for_bit(shape):
    """Columns of one pass (SHORT_COLUMNS rows at most), q and q^T, as the reference's values cast."""
    x = _input(shape, seed=22)
    for dtype in (E4M3, E5M2):
        q, _ = _check(x, "column", dtype=dtype)
        qt = tritonkit.quantize_fp8(x, "column", dtype=dtype, transpose=True)[2]
        assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(4096, 4096), (8192, 1024), (64, 160), (4099, 4096), (48, 37)], ids=str)
def test_gpu_the_transposed_pass_is_the_transpose(shape, x_dtype):
    """The passes that store q^T (quantize.py's Transposes) bit for bit against q transposed, at
    sizes that divide by 16 (where a pass storing both q and q^T came out wrong on the H200) and
    ragged ones, both fp8 types, with and without q beside them (transpose=True)."""
    x = _input(shape, x_dtype, seed=21)
    for granularity in qz.TRANSPOSABLE:
        for dtype in (E4M3, E5M2):
            q, scale = tritonkit.quantize_fp8(x, granularity, dtype=dtype, block_size=64)
            expected = q.t().contiguous().view(torch.uint8)
            alone, scale_t = qz.quantize_fp8_transposed(x, granularity, dtype=dtype, block_size=64)
            both = tritonkit.quantize_fp8(x, granularity, dtype=dtype, block_size=64, transpose=True)[2]
            assert torch.equal(alone.view(torch.uint8), expected), (granularity, dtype)
            assert torch.equal(both.view(torch.uint8), expected), (granularity, dtype)
            assert torch.equal(scale_t, scale.t() if scale.dim() else scale)


# (granularity, block_size, the group's rows and columns at (37, 300))
FLOAT64_CASES = [
    ("tensor", 128, (37, 300)),
    ("row", 128, (1, 300)),
    ("column", 128, (37, 1)),
    ("block", 32, (1, 32)),
    ("column_block", 16, (16, 1)),
    ("block2d", 16, (16, 16)),
]


@pytest.mark.parametrize("case", FLOAT64_CASES, ids=lambda c: c[0])
def test_scales_and_values_against_float64(case):
    """Against float64 arithmetic, not the fp32 reference: each scale is its group's amax / 448
    rounded once to fp32 (the kernels' fp32 division is correctly rounded, and float64 holds the
    quotient exactly enough that rounding it to fp32 gives the same bits), and each fp8 value is the
    nearest to x / scale in exact arithmetic, but where x / scale lies within 2^-22 of a midpoint
    between two fp8 values (the kernels multiply by an fp32 reciprocal: two roundings)."""
    granularity, block, (group_m, group_n) = case
    x = _input((37, 300), torch.float32, seed=21)
    q, scale = tritonkit.quantize_fp8(x, granularity, block_size=block)
    x64 = x.double().cpu()
    m, n = x64.shape
    gm, gn = -(-m // group_m), -(-n // group_n)
    padded = torch.zeros(gm * group_m, gn * group_n, dtype=torch.float64)
    padded[:m, :n] = x64.abs()
    amax = padded.view(gm, group_m, gn, group_n).amax(dim=(1, 3))
    exact_scale = amax / qz.fp8_max(E4M3)
    assert torch.equal(scale.cpu().reshape(gm, gn), exact_scale.float())
    each = exact_scale.repeat_interleave(group_m, 0).repeat_interleave(group_n, 1)[:m, :n]
    exact = x64 / each
    nearest = exact.to(E4M3).double()
    ours = q.cpu().double()
    off = ours != nearest
    if off.any():  # only at near-ties: the exact value within 2^-22 of the two values' midpoint
        other = torch.where(off, ours, nearest)
        midpoint = (nearest[off] + other[off]) / 2
        assert ((exact[off] - midpoint).abs() <= exact[off].abs() * 2.0**-22).all()
