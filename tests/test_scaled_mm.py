"""scaled_mm against the float64 reference with the oracle's rule (torch's error: torch._scaled_mm's
on the GPU, the same maths in fp32 under the interpreter; ``fp8_peer``), with and without
use_fast_accum: tensorwise, rowwise and blockwise scales, with and without a bias, every
output dtype, both fp8 types and a mixed pair, ragged shapes; opcheck and a fullgraph compile; empty
and zero-depth inputs; bad input refused by name; and, compiled for sm_90, the fp8 wgmma fed by TMA
without spills."""

from __future__ import annotations

import json

import pytest
import torch

import sm90
import tritonkit
from fp8_peer import scaled_mm_peer
from tritonkit._runtime import interpret
from tritonkit.ops import scaled_mm as sm
from tritonkit.ops.linear import scaled_mm_sm90 as host
from tritonkit.oracle import compare

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _device() -> str:
    return "cpu" if interpret() else "cuda"


def _operands(m, k, n, dtypes=(E4M3, E4M3), scaling="row", seed=0):
    """fp8 a (M, K) row-major and b (K, N) column-major from random values spread over the fp8
    range, and positive fp32 scales of the granularity."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 8).to(dtypes[0])
    b = (torch.randn(n, k, generator=g) * 8).to(dtypes[1]).t()
    if scaling == "tensor":
        scale_a, scale_b = torch.rand((), generator=g) + 0.01, torch.rand(1, 1, generator=g) + 0.01
    elif scaling == "block":
        blocks_k, blocks_n = -(-k // 128), -(-n // 128)
        scale_a = torch.rand(m, blocks_k, generator=g) + 0.01
        scale_b = torch.rand(blocks_k, blocks_n, generator=g) + 0.01
    else:
        scale_a, scale_b = torch.rand(m, 1, generator=g) + 0.01, torch.rand(1, n, generator=g) + 0.01
    return tuple(t.to(_device()) for t in (a, b, scale_a, scale_b))


def _check(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, fast=False):
    out = tritonkit.scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum=fast)
    assert out.shape == (a.shape[0], b.shape[1]) and out.dtype == out_dtype
    exact = sm.scaled_mm_reference(a, b, scale_a, scale_b, bias, torch.float64)
    theirs = scaled_mm_peer(a, b, scale_a, scale_b, bias, out_dtype, fast)
    comparison = compare("out", out, theirs, exact, out_dtype)
    assert comparison.passed, str(comparison)


# (M, K, N): one row and column, K off the interpreter's 16-deep steps, several tiles each way
SHAPES = [(1, 16, 1), (7, 33, 5), (37, 80, 45), (65, 130, 70)]


def test_blockwise_scales_over_several_blocks_each_way():
    """Blockwise: K and N over several 128-blocks with ragged last ones, so that each step and
    tile takes its own block's scales (a scale a block apart from its neighbours' by far)."""
    a, b, scale_a, scale_b = _operands(33, 300, 270, scaling="block", seed=5)
    scale_a = scale_a * torch.tensor([1.0, 64.0, 1 / 64], device=a.device)
    scale_b = scale_b * torch.tensor([[1.0, 8.0, 1 / 8]], device=a.device).t()
    _check(a, b, scale_a, scale_b, out_dtype=torch.float32)


FEATURES = [
    {"scaling": "tensor", "bias": None, "out_dtype": torch.bfloat16, "dtypes": (E4M3, E4M3)},
    {"scaling": "row", "bias": torch.bfloat16, "out_dtype": torch.bfloat16, "dtypes": (E5M2, E5M2)},
    {"scaling": "row", "bias": None, "out_dtype": torch.float32, "dtypes": (E5M2, E4M3)},
    {"scaling": "row", "bias": None, "out_dtype": torch.float32, "dtypes": (E4M3, E4M3), "fast": True},
    {"scaling": "tensor", "bias": torch.float32, "out_dtype": torch.float16, "dtypes": (E4M3, E5M2)},
    {"scaling": "block", "bias": torch.bfloat16, "out_dtype": torch.bfloat16, "dtypes": (E4M3, E4M3)},
]


@pytest.mark.parametrize(
    "features",
    FEATURES,
    ids=lambda f: f"{f['scaling']}-{f['out_dtype']}" + ("-fast" if f.get("fast") else ""),
)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_the_reference(shape, features):
    a, b, scale_a, scale_b = _operands(*shape, features["dtypes"], features["scaling"], seed=sum(shape))
    bias = None
    if features["bias"] is not None:
        g = torch.Generator().manual_seed(7)
        bias = torch.randn(shape[2], generator=g).to(features["bias"]).to(a.device)
    _check(a, b, scale_a, scale_b, bias, features["out_dtype"], features.get("fast", False))


@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
def test_split_k_takes_the_scales_in_each_share(scaling):
    """SPLIT_K launches (K in three shares, each summed apart into fp32 partials and added in a
    fixed order): each share's product takes the scales, as the whole would, so the sum is the
    reference's (blockwise: each share starts on a block of K)."""
    from tritonkit.ops.linear import kernels as kn
    from tritonkit.ops.linear import matmul as mm

    a, b, scale_a, scale_b = _operands(37, 700, 45, scaling=scaling, seed=11)
    config = (kn.INTERPRETER_CONFIG if interpret() else sm.TILE | {"TMA": True}) | {"SPLIT_K": 3}
    out = torch.full((37, 45), float("nan"), device=a.device)
    scales = {"scale_a": scale_a.reshape(-1).contiguous(), "scale_b": scale_b.reshape(-1).contiguous()}
    problem = mm.matmul_problem(a, b.t(), out, scaling=kn.SCALINGS[scaling], **scales)
    for launch in mm.matmul_launches(problem, config):
        launch.run()
    exact = sm.scaled_mm_reference(a, b, scale_a, scale_b, None, torch.float64)
    theirs = scaled_mm_peer(a, b, scale_a, scale_b, None, torch.float32)
    comparison = compare("out", out, theirs, exact, torch.float32)
    assert comparison.passed, str(comparison)


@pytest.mark.tuning_default  # (tuning off: the configs chosen are final, so plans record)
def test_a_replayed_call_keys_on_the_tiles(monkeypatch, launches_faked):
    """A call like one before replays its launches only while the dispatch's switches are the same:
    the Triton kernel's tiles among them, so that a tile set between calls (a benchmark's sweep of
    tiles) is the one launched, not the first call's recording. Launches faked on the CPU, the GPU's
    dispatch (132 SMs: a product of few tiles, ``SMALL_TILE``'s), each fresh launch's stages logged."""
    from tritonkit import opdef, testing

    launched = []
    monkeypatch.setattr(testing._NoLauncher, "__call__", lambda self, grid, *a, **meta: launched.append(meta))
    monkeypatch.setattr(sm, "interpret", lambda: False)
    monkeypatch.setattr(sm, "_sms", lambda device: 132)
    monkeypatch.setattr(sm, "GLUON", False)
    a, b, scale_a, scale_b = _operands(128, 256, 512, scaling="row", seed=5)
    a, b, scale_a, scale_b = (t.cpu() for t in (a, b, scale_a, scale_b))
    shipped, other = sm.SMALL_TILE, sm.SMALL_TILE | {"num_stages": 3}
    fresh = []
    try:
        for tile in (shipped, shipped, other, other):
            monkeypatch.setattr(sm, "SMALL_TILE", tile)
            launched.clear()
            tritonkit.scaled_mm(a, b, scale_a, scale_b)
            fresh.append([meta["num_stages"] for meta in launched])
    finally:
        opdef.forget_plans()
    # the first call of each tile launches it; its second replays it
    assert fresh == [[shipped["num_stages"]], [], [3], []], fresh


def test_empty_and_zero_depth():
    """No rows or no columns: an empty output; K = 0: a sum over nothing, the bias alone."""
    a, b, scale_a, scale_b = _operands(0, 32, 5, scaling="tensor")
    assert tritonkit.scaled_mm(a, b, scale_a, scale_b).shape == (0, 5)
    a, b, scale_a, scale_b = _operands(3, 0, 5, scaling="row")
    bias = torch.arange(5, dtype=torch.float32, device=a.device)
    out = tritonkit.scaled_mm(a, b, scale_a, scale_b, bias, torch.float32)
    assert torch.equal(out, bias.expand(3, 5))


def test_passes_opcheck_and_compiles():
    """The custom op on a real call's arguments, and torch.compile's output bit for bit eager's."""
    from tritonkit import opdef

    a, b, scale_a, scale_b = _operands(37, 80, 45)
    with opdef.recording_calls() as calls:
        eager = tritonkit.scaled_mm(a, b, scale_a, scale_b)
    (custom, args) = next((c, a) for c, a in calls if c._name.endswith("scaled_mm"))
    torch.library.opcheck(custom, args)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *t: tritonkit.scaled_mm(*t), fullgraph=True)
    assert torch.equal(compiled(a, b, scale_a, scale_b), eager)


def test_bad_input_is_refused_by_name():
    a, b, scale_a, scale_b = _operands(8, 32, 4)
    with pytest.raises(TypeError, match="a must be one of"):
        tritonkit.scaled_mm(a.float(), b, scale_a, scale_b)
    with pytest.raises(ValueError, match="share K"):
        tritonkit.scaled_mm(a[:, :16], b, scale_a, scale_b)
    with pytest.raises(ValueError, match="a must be row-major"):
        tritonkit.scaled_mm(a.t().contiguous().t(), b, scale_a, scale_b)
    with pytest.raises(ValueError, match="b must be column-major"):
        tritonkit.scaled_mm(a, b.contiguous(), scale_a, scale_b)
    with pytest.raises(ValueError, match="tensorwise scales .*, rowwise ones"):
        tritonkit.scaled_mm(a, b, scale_a[:4], scale_b)
    with pytest.raises(ValueError, match="blockwise ones"):
        tritonkit.scaled_mm(a, b, scale_a.repeat(1, 2), scale_b)  # (8, 2): not (8, cdiv(32, 128))
    with pytest.raises(TypeError, match="scale_a must be one of"):
        tritonkit.scaled_mm(a, b, scale_a.double(), scale_b)
    with pytest.raises(TypeError, match="out_dtype"):
        tritonkit.scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="bias must have N = 4"):
        tritonkit.scaled_mm(a, b, scale_a, scale_b, torch.zeros(5, device=a.device))
    with pytest.raises(RuntimeError, match="no gradient"):
        tritonkit.scaled_mm(a, b, scale_a.requires_grad_(), scale_b)
    with pytest.raises(RuntimeError, match="no gradient"):  # an fp8 operand that asks for one (was silent)
        tritonkit.scaled_mm(a.detach().requires_grad_(), b, scale_a.detach(), scale_b)
    a, b, scale_a, scale_b = _operands(8, 32, 4, scaling="block")
    with pytest.raises(ValueError, match="use_fast_accum is for tensorwise and rowwise"):
        tritonkit.scaled_mm(a, b, scale_a, scale_b, use_fast_accum=True)


_HOPPER_CHECK = r"""
import json, torch
from tritonkit.asm import compile_launch
from tritonkit.ops import scaled_mm as sm
from tritonkit.ops.linear import scaled_mm_sm90 as host
from tritonkit.ops.linear import kernels as kn, matmul as mm
big, small = (8192, 4096, 16384), (1024, 16384, 1024)  # (M, K, N)
cases = [(big, "tensor", False), (big, "row", False), (big, "block", False), (big, "row", True),
         (small, "row", True)]
for (m, k, n), scaling, fast in cases:
    a = torch.empty(m, k, dtype=torch.float8_e4m3fn)
    b = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales = {"tensor": (1, 1), "row": (m, n), "block": (m * k // 128, k * n // 128 ** 2)}[scaling]
    config, chained = sm._launch_choice(fast, m, n, "cpu")  # (the nominal SM count off a GPU)
    problem = mm.matmul_problem(a, b, torch.empty(m, n, dtype=torch.bfloat16),
                                scale_a=torch.empty(scales[0]), scale_b=torch.empty(scales[1]),
                                scaling=kn.SCALINGS[scaling], fast_accum=chained)
    r = compile_launch(mm.matmul_launches(problem, config)[0], "sm_90")
    ptx, sass = r.asm["ptx"], r.asm["sass"]
    print(json.dumps({"scaling": scaling, "fast": chained, "block_m": config["BLOCK_M"],
                      "fp8_wgmma": "e4m3.e4m3" in ptx and "wgmma" in ptx,
                      "gmma": {op: n for op, n in r.opcodes.items() if "GMMA" in op},
                      "fadd": r.opcodes.get("FADD", 0), "ffma": r.opcodes.get("FFMA", 0),
                      "waits": sorted(set(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass))),
                      "tma": r.opcodes["UTMALDG"], "spills": r.spills,
                      "shared": r.shared_bytes}))
"""


def test_the_kernel_compiles_for_hopper_to_fp8_wgmma_fed_by_tma():
    """sm_90 at (8192, 4096) x (4096, 16384), every scaling: the tensor cores' fp8 instruction
    (wgmma ... e4m3.e4m3, QGMMA in SASS, and no 16-bit one), A and B by TMA, no spills, within the
    H200's shared memory; at a short M and N (fewer tiles than SMs) the small tile, promoted. The
    accumulation as designed: by default a step's product is waited for
    (no wgmma left in flight) and added to the fp32 accumulator (an FADD an accumulator register,
    64 a thread at 128 x 128 on 256 threads; blockwise an FFMA, times its scales); with
    use_fast_accum the steps chain in the tensor cores' accumulator with the next step's wgmma in
    flight (a wait for all but one), no FADD."""
    rows = [json.loads(line) for line in sm90.run(_HOPPER_CHECK)]
    assert len(rows) == 5 and rows[4]["block_m"] == 64 and not rows[4]["fast"]  # the small tile, promoted
    for row in rows:
        # QGMMA: the SASS of an fp8 wgmma (HGMMA is the 16-bit one's)
        assert row["fp8_wgmma"] and set(row["gmma"]) == {"QGMMA"}, row
        assert row["tma"] > 0 and not row["spills"], row
        assert row["shared"] <= 227 * 1024, row
        if row["fast"]:
            assert row["fadd"] == 0 and "0x1" in row["waits"], row
        else:
            assert row["waits"] == ["0x0"] and row["fadd" if row["scaling"] != "block" else "ffma"] >= 64, row


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fast", [False, True], ids=["promoted", "fast"])
@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("shape", [(8192, 4096, 16384), (128, 4096, 14336), (4097, 4096, 1040)], ids=str)
def test_gpu_large_shapes_against_torch_scaled_mm(shape, scaling, fast):
    """On the GPU's tile and TMA at the issue's shapes (and a ragged one): the oracle with torch's
    error taken from torch._scaled_mm itself at the same use_fast_accum, bias and bf16 output."""
    a, b, scale_a, scale_b = _operands(*shape, scaling=scaling, seed=3)
    bias = torch.randn(shape[2], device="cuda").to(torch.bfloat16)
    _check(a, b, scale_a, scale_b, bias, fast=fast)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fast", [False, True], ids=["promoted", "fast"])
def test_gpu_fp32_output_has_torchs_error(fast):
    """At an fp32 output nothing hides the fp8 sums' error: ours within the oracle's bound of
    torch._scaled_mm's at a long K (the fast sums' error is 20x the promoted ones' on the H200)."""
    a, b, scale_a, scale_b = _operands(1024, 16384, 1024, scaling="row", seed=6)
    _check(a, b, scale_a, scale_b, out_dtype=torch.float32, fast=fast)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_blockwise_large_shapes():
    """Blockwise on the GPU's tile at a ragged large shape, against the float64 reference."""
    a, b, scale_a, scale_b = _operands(4097, 4096 + 64, 1000, scaling="block", seed=4)
    _check(a, b, scale_a, scale_b)


_GLUON_CHECK = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from tritonkit.asm import _cuobjdump
from tritonkit.ops.linear import scaled_mm_sm90 as host
from tritonkit.ops.linear import scaled_mm_sm90_kernels as kern

def numbers(pattern, text):
    return sorted(set(int(n) for n in re.findall(pattern, text)))

def descriptor(rows):
    return f"tensordesc<fp8e4nv[{rows},{host.BLOCK_K}],{host._layout(rows, torch.float8_e4m3fn)!r}>"

tiles = [(mode, tile) for mode in (False, True) for tile in [host.TILES[mode], *host.CANDIDATES[mode]]]
# rowwise on every tile; blockwise promoted, on the tiles of 128 columns it takes
cases = [(chained, tile, 2) for chained, tile in tiles]
cases += [(False, tile, 3) for chained, tile in tiles if not chained and tile.block_n == 128]
for chained, tile, scaling in cases:
    signature = {"a_desc": descriptor(kern.ROWS.value), "b_desc": descriptor(tile.block_n), "c_ptr": "*bf16",
                 "scale_a_ptr": "*fp32", "scale_b_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
                 "stride_cm": "i32", "SCALING": "constexpr", "CHAINED": "constexpr",
                 "NUM_STAGES": "constexpr", "GROUP_M": "constexpr", "CONSUMERS": "constexpr",
                 "CONSUMER_REGS": "constexpr"}
    constants = {"SCALING": scaling, "CHAINED": chained, "NUM_STAGES": tile.stages, "GROUP_M": host.GROUP_M,
                 "CONSUMERS": tile.consumers, "CONSUMER_REGS": tile.regs}
    source = GluonASTSource(kern._scaled_mm_sm90_kernel, signature, constants)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": kern.CONSUMER_WARPS.value})
    ptx, sass = kernel.asm["ptx"], _cuobjdump(kernel.asm["cubin"], "-sass")
    # the longest run of QGMMA between two waits: a step's chain issued together, not serialized
    run, longest = 0, 0
    for line in sass.splitlines():
        if "QGMMA" in line:
            run += 1
            longest = max(longest, run)
        elif "WARPGROUP.DEPBAR" in line:
            run = 0
    print(json.dumps({
        "chained": chained, "scaling": scaling, "consumers": tile.consumers, "regs": tile.regs,
        "shared": kernel.metadata.shared, "warps": kernel.metadata.num_warps,
        "waits": numbers(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx),
        "setmaxnreg": numbers(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx),
        "qgmma_run": longest, "hgmma": sass.count("HGMMA"), "fadd": sass.count("FADD"),
        "ffma": sass.count("FFMA"),
        "spills": sass.count("STL") + sass.count("LDL"), "tma_loads": ptx.count("cp.async.bulk.tensor.2d"),
    }))
"""


def test_the_gluon_kernel_compiles_for_hopper_warp_specialized():
    """The sm_90 Gluon kernel (``ops/linear/scaled_mm_sm90.py``): two consumer warpgroups and a producer warp
    with their register budgets, TMA loads, no spills, each 128-deep step's four fp8 wgmma issued
    together (ptxas serialized them when a product stayed in flight across steps); chained, the
    main loop waits for the older step only; promoted, for its step's product, then adds it
    (blockwise: times its step's scales, an FFMA an accumulator register)."""
    rows = [json.loads(line) for line in sm90.run("import torch\n" + _GLUON_CHECK)]
    promoted = [host.TILES[False], *host.CANDIDATES[False]]
    blockwise = sum(tile.block_n == 128 for tile in promoted)
    assert blockwise and len(rows) == len(promoted) + 1 + len(host.CANDIDATES[True]) + blockwise
    for row in rows:
        warps = 4 * (row["consumers"] + 1)  # (the producer warp's warpgroup counts whole)
        assert row["warps"] == warps and {row["regs"], 24} <= set(row["setmaxnreg"]), row
        assert row["shared"] <= 227 * 1024 and not row["spills"] and row["tma_loads"] > 0, row
        assert row["qgmma_run"] >= 4 and row["hgmma"] == 0, row
        if row["chained"]:
            assert row["waits"] == [0, 1] and row["fadd"] == 0, row
        elif row["scaling"] == 3:
            assert row["waits"] == [0] and row["ffma"] >= 64, row
        else:
            assert row["waits"] == [0] and row["fadd"] >= 64, row


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm_90 GPU",
)
@pytest.mark.parametrize("fast", [False, True], ids=["promoted", "fast"])
@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("shape", [(8192, 4096, 16384), (4097, 4096, 1040), (300, 256, 272)], ids=str)
def test_gpu_the_gluon_kernel_has_torchs_error(shape, scaling, fast, monkeypatch):
    """The Gluon kernel made to take every call it can (``scaled_mm.GLUON = True``, the small and
    ragged products included): the oracle with torch._scaled_mm's error in the same mode, fp32 output
    (nothing hides the sums' error), ragged M and N; the Gluon launch is the one that ran."""
    from tritonkit.ops.linear import scaled_mm_sm90

    launched, launch = [], scaled_mm_sm90.launch
    monkeypatch.setattr(sm, "GLUON", True)
    monkeypatch.setattr(scaled_mm_sm90, "launch", lambda *args: launched.append(1) or launch(*args))
    a, b, scale_a, scale_b = _operands(*shape, scaling=scaling, seed=8)
    _check(a, b, scale_a, scale_b, out_dtype=torch.float32, fast=fast)
    assert launched


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm_90 GPU",
)
@pytest.mark.parametrize(
    "fast, tile", [(fast, tile) for fast in (False, True) for tile in host.CANDIDATES[fast]], ids=str
)
@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_gpu_each_candidate_tile_has_torchs_error(fast, tile, scaling, monkeypatch):
    """Each mode's product on each of its candidate tiles (timed by benchmarks/scaled_mm.py
    --gluon-tiles), ragged M and N (a partial tile of each consumer's rows): the oracle with torch's
    error in the same mode."""
    monkeypatch.setattr(sm, "GLUON", True)
    monkeypatch.setitem(host.TILES, fast, tile)
    for shape in ((4097, 4096, 1040), (8192, 2048, 4096), (100, 384, 200)):
        a, b, scale_a, scale_b = _operands(*shape, scaling=scaling, seed=9)
        _check(a, b, scale_a, scale_b, out_dtype=torch.float32, fast=fast)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm_90 GPU",
)
@pytest.mark.parametrize("tile", [host.TILES[False], *host.CANDIDATES[False]], ids=str)
def test_gpu_the_gluon_kernels_blockwise_product(tile, monkeypatch):
    """Blockwise scales on the Gluon kernel (``GLUON = True``; the default from many tiles on), each
    promoted tile, ragged M, N and K (scales a block apart by 64x: a step or tile that took its
    neighbour's fails): the float64 reference with the oracle's rule; the Gluon launch ran."""
    from tritonkit.ops.linear import scaled_mm_sm90

    launched, launch = [], scaled_mm_sm90.launch
    monkeypatch.setattr(sm, "GLUON", True)
    monkeypatch.setitem(host.TILES, False, tile)
    monkeypatch.setattr(scaled_mm_sm90, "launch", lambda *args: launched.append(1) or launch(*args))
    for shape in ((4097, 4096 + 64, 1000), (8192, 2048, 4096), (100, 384, 200)):
        a, b, scale_a, scale_b = _operands(*shape, scaling="block", seed=10)
        spread = torch.tensor([1.0, 64.0, 1 / 64], device=a.device)  # by block of K, cycling
        scale_a = scale_a * spread.repeat(scale_a.shape[1])[: scale_a.shape[1]]
        scale_b = scale_b * spread.repeat(scale_b.shape[1])[: scale_b.shape[1]]  # by block of N
        _check(a, b, scale_a, scale_b, out_dtype=torch.float32)
    assert launched if tile.block_n == 128 else not launched


def test_the_gluon_kernel_takes_the_products_it_measured_faster_on():
    """The rule (``_gluon_pays``): promoted products of many tiles (blockwise ones included), and
    chained tensorwise ones; not chained rowwise ones, nor products of fewer tiles than SMs
    (SMALL_TILE's)."""
    tensor, row, block = sm.SCALINGS["tensor"], sm.SCALINGS["row"], sm.SCALINGS["block"]
    assert sm._gluon_pays(False, False, block) and not sm._gluon_pays(True, False, block)
    assert sm._gluon_pays(False, False, tensor) and sm._gluon_pays(False, False, row)
    assert sm._gluon_pays(False, True, tensor) and not sm._gluon_pays(False, True, row)
    assert not any(sm._gluon_pays(True, chained, s) for chained in (False, True) for s in (tensor, row))
    assert sm._few_tiles(1024, 1024, "cpu") and not sm._few_tiles(8192, 16384, "cpu")


def test_products_of_few_tiles_take_one_wave_of_promoted_tiles(monkeypatch):
    """Fewer 128 x 128 output tiles than SMs: 64 x 128 tiles (SMALL_TILE) where they too are one wave,
    else 128 x 128 ones (TILE: at (128, 4096, 14336) 224 tiles of 64 rows are two waves on 132 SMs),
    promoted whatever use_fast_accum says; more tiles than SMs: TILE, or FAST_TILE chained."""
    monkeypatch.setattr(sm, "interpret", lambda: False)
    monkeypatch.setattr(sm, "_sms", lambda device: 132)
    few = [((128, 14336), sm.TILE), ((128, 4096), sm.SMALL_TILE), ((64, 14336), sm.SMALL_TILE)]
    for fast in (False, True):
        for (m, n), tile in few:
            assert sm._launch_choice(fast, m, n, "cuda") == (tile | {"TMA": True}, False), (m, n, fast)
        large = sm.FAST_TILE if fast else sm.TILE
        assert sm._launch_choice(fast, 8192, 16384, "cuda") == (large | {"TMA": True}, fast)
