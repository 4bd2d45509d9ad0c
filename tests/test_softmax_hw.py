"""softmax as the hardware sees it: the SASS its kernels compile to for Hopper (checked without a
GPU), offsets past 2^31 elements, and on the H200 (`gpu`) large shapes and real tuning. The CPU
semantics are in test_softmax.py, whose helpers these tests share."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import sm90
import test_softmax
import tritonkit.ops.softmax.softmax as sm
from test_softmax import BF16, F16, LOGS, _check, _inputs, _kernel, _reference, _variants
from tritonkit import tuning
from tritonkit.ops.softmax.softmax import softmax
from tritonkit.testing import compare, poisoned_outputs

pytestmark = pytest.mark.softmax
launches = test_softmax.launches  # the fixture recording each launch, shared


# ---------------------------------------------------------------- compiles for Hopper, no GPU needed

_HOPPER_CHECK = r"""
import concurrent.futures
import torch
import tritonkit.ops.softmax.configs as sk
import tritonkit.ops.softmax.softmax as sm

ROWS = 8192  # rows of the input whose default config is compiled
CASES = [  # (layout, direction, row length, the variant auto starts from there)
    ("rows", "fwd", 4096, "one-pass"), ("rows", "fwd", 32768, "one-pass"),
    ("rows", "bwd", 4096, "one-pass"), ("rows", "bwd", 16384, "one-pass"),
    ("rows", "fwd", 65536, "online"), ("rows", "bwd", 65536, "online"),  # longer: the split default
    # softmax over a leading dim: rows are the contiguous axis (stride_r == 1)
    ("cols", "fwd", 1024, "one-pass"), ("cols", "bwd", 512, "one-pass"),
    ("cols", "fwd", 131072, "online"), ("cols", "bwd", 131072, "online"),
]
BF16_CASES = [("rows", "bwd", 32768, "one-pass")]  # y and dy kept 16-bit: the whole row in registers

def check(layout, direction, n, variant, dtype, log):
    key = {"direction": direction, "variant": "auto", "layout": layout, "block_n": n, "rows": ROWS,
           "dtype": f"{dtype}>{dtype}"}
    config = sm._default(key)
    kernel = sm._LAUNCHERS[direction, config["variant"]].kernel
    unit = "n" if layout == "rows" else "r"  # the stride that is 1, which Triton makes a constant
    constexprs = {a: 1 for a in kernel.arg_names if a.startswith("stride_") and a.endswith(unit)}
    sum_fp64 = sm.sums_in_fp64(direction, log, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
    constexprs |= {"LOG": log, "SUM_FP64": sum_fp64, "BLOCK_M": config["BLOCK_M"],
                   "BLOCK_N": config.get("BLOCK_N", n), "ALIGN": 1}
    if config["variant"] == "online":
        constexprs |= {"PREFETCH": config.get("PREFETCH", False), "WINDOW": 0}  # (whole vectors here)
    else:
        constexprs |= {"STAGES": config.get("STAGES", 0), "WINDOW": 0}
    signature = {a: f"*{dtype}" if a.endswith("_ptr") else "i32"
                 for a in kernel.arg_names if a not in constexprs}
    report = compile_kernel(kernel, signature, constexprs, config["num_warps"])
    sass = report.asm["sass"]
    loads = set(re.findall(r"LDG(?:STS)?\.E[.\w]*", sass))
    stores = set(re.findall(r"STG\.E[.\w]*", sass))
    wide_loads = bool(loads) and all(re.fullmatch(r"LDG(STS)?\.E(\.E[LF]|\.BYPASS)?\.128", x) for x in loads)
    wide_stores = stores == {"STG.E.128"}
    if variant == "online":  # eviction hints
        hints = loads == {"LDG.E.EL.128", "LDG.E.EF.128"}
    else:  # a persistent one-pass default copies its blocks to shared memory, the rest load them
        hints = loads == ({"LDGSTS.E.BYPASS.128"} if config.get("STAGES") else {"LDG.E.128"})
    fp64 = ("DADD" in sass) == constexprs["SUM_FP64"]
    return (f"{kernel.__name__} {layout} {n} {dtype} {'log' if log else 'softmax'} {config} | "
            f"{config['variant'] == variant} {wide_loads} {wide_stores} {hints} {not report.spills} {fp64} | "
            f"{sorted(loads)} {sorted(stores)}")

jobs = [(*case, dtype, log) for case in CASES if case[0] == "rows" for dtype in ("bf16", "fp32")
        for log in (False, True)]
jobs += [(*case, dtype, log) for case in CASES if case[0] == "cols" for dtype, log in (("bf16", False),
                                                                                      ("fp32", True))]
jobs += [(*case, "bf16", log) for case in BF16_CASES for log in (False, True)]
# Compiles in threads overlap ptxas and Triton's passes: about half the time on two cores.
with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
    for line in pool.map(lambda job: check(*job), jobs):
        print(line)
"""


def test_kernels_compile_for_hopper_with_wide_accesses_and_no_spills():
    """Each kernel compiled for sm_90 at the config the tuner starts from (its default) for 8192
    rows: only 16-byte global loads and stores (the online kernels' with their eviction hints, the
    persistent one-pass defaults' as asynchronous copies to shared memory), no spills, and fp64
    adds exactly where the fp32 log_softmax asks for an fp64 sum."""
    lines = sm90.run(_HOPPER_CHECK)
    assert len(lines) == 6 * 4 + 4 * 2 + 2, lines
    for line in lines:
        verdicts = line.split("|")[1].split()
        assert verdicts == ["True"] * 6, line


_PREFETCH_HOPPER_CHECK = r"""
import concurrent.futures
import torch
import tritonkit.ops.softmax.configs as sk
import tritonkit.ops.softmax.softmax as sm

def check(direction, dtype, log, config):
    kernel = sm._LAUNCHERS[direction, "online"].kernel
    constexprs = {a: 1 for a in kernel.arg_names if a.startswith("stride_") and a.endswith("n")}
    constexprs |= {"LOG": log, "SUM_FP64": log and dtype == "fp32", "BLOCK_M": 1,
                   "BLOCK_N": config["BLOCK_N"], "PREFETCH": True, "ALIGN": 1, "WINDOW": 0}
    signature = {a: f"*{dtype}" if a.endswith("_ptr") else "i32" for a in kernel.arg_names
                 if a not in constexprs}
    report = compile_kernel(kernel, signature, constexprs, config["num_warps"])
    loads = set(re.findall(r"LDG\.E[.\w]*", report.asm["sass"]))
    return f"{direction} {dtype} {log} {config} | {report.spills} {sorted(loads)} {report.registers}"

key = {"layout": "rows", "block_n": 131072, "rows": 2048}
jobs = [(direction, dtype, log, config)
        for direction in ("fwd", "bwd") for dtype, log in (("bf16", False), ("fp32", True))
        for config in sm._TUNERS[direction]._candidates({**key, "direction": direction,
                                                           "dtype": f"{dtype}>{dtype}"})
        if config.get("PREFETCH")]
with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
    for line in pool.map(lambda job: check(*job), jobs):
        print(line)
"""


def test_prefetching_online_candidates_compile_for_hopper_without_spills():
    """Every PREFETCH candidate of a long-row bucket, compiled for sm_90: two chunks in registers and
    no spills, the loads 16 bytes wide with their eviction hints."""
    lines = sm90.run(_PREFETCH_HOPPER_CHECK)
    assert len(lines) >= 4 * 3, lines  # at least three (chunk, warps) a direction and flavour
    for line in lines:
        spills, loads = line.split("|")[1].split(" ", 2)[1:]
        assert spills == "False" and loads.startswith("['LDG.E.EF.128', 'LDG.E.EL.128']"), line


_SPLIT_HOPPER_CHECK = r"""
import concurrent.futures
import torch
import tritonkit.ops.softmax.configs as sk
import tritonkit.ops.softmax.softmax as sm

def check(direction, dtype, log, config):
    kernel = sm._LAUNCHERS[direction, "split"].kernel
    sum_fp64 = log and dtype == "fp32"
    constexprs = {a: 1 for a in kernel.arg_names if a.startswith("stride_") and a.endswith("n")}
    constexprs |= {"LOG": log, "SUM_FP64": sum_fp64, "BLOCK_N": config["BLOCK_N"], "SEGMENTS": 64,
                   "PHASE": 0, "ALIGN": 1, "PREFETCH": config.get("PREFETCH", False), "WINDOW": 0}
    workspace = {"max_ptr": "*fp32", "sum_ptr": "*fp64" if sum_fp64 else "*fp32",
                 "dot_ptr": "*fp64" if sum_fp64 else "*fp32", "arrived_ptr": "*i32"}
    signature = {a: workspace.get(a, f"*{dtype}") if a.endswith("_ptr") else "i32"
                 for a in kernel.arg_names if a not in constexprs}
    report = compile_kernel(kernel, signature, constexprs, config["num_warps"])
    sass = report.asm["sass"]
    loads, stores = set(re.findall(r"LDG\.E[.\w]*", sass)), set(re.findall(r"STG\.E[.\w]*", sass))
    row_loads = {x for x in loads if "STRONG" not in x}  # the rest read the partials, bypassing L1
    partial_loads = loads - row_loads
    verdicts = [row_loads == {"LDG.E.EL.128", "LDG.E.EF.128"},
                "STG.E.128" in stores,
                bool(partial_loads) and all(x.endswith("STRONG.GPU") for x in partial_loads),
                "ATOMG.E.ADD.STRONG.GPU" in sass and "MEMBAR" in sass]
    name = f"{kernel.__name__} {dtype} {'log' if log else 'softmax'} {config}"
    return (f"{name} | {' '.join(map(str, verdicts))} | {report.spills} | {sorted(loads)} "
            f"{sorted(stores)} registers {report.registers}")

def candidates(direction, n, dtype):
    key = {"direction": direction, "layout": "rows", "block_n": n, "rows": 512, "dtype": f"{dtype}>{dtype}"}
    return [c for c in sm._TUNERS[direction]._candidates(key) if c["variant"] == "split"]

# each (BLOCK_N, num_warps) a tuner may try at SEGMENT 16384, in four flavours
jobs = [(direction, dtype, log, config)
        for config in candidates("fwd", 1 << 20, "fp32")
        if config["SEGMENT"] == 16384 and config["PER_SM"] == 2
        for direction in ("fwd", "bwd") for dtype, log in (("bf16", False), ("fp32", True))]
# and the untuned default, whose pass 1 holds two chunks (PREFETCH)
default = {"direction": "fwd", "variant": "split", "layout": "rows", "block_n": 1 << 22, "rows": 64,
           "dtype": "bf16>bf16"}
jobs += [(direction, dtype, log, sm._default({**default, "dtype": f"{dtype}>{dtype}"}))
         for direction in ("fwd", "bwd") for dtype, log in (("bf16", False), ("fp32", True))]
with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
    for line in pool.map(lambda job: check(*job), jobs):
        print(line)
"""


def test_split_kernels_compile_for_hopper():
    """The split kernels for sm_90 (candidates, and the default with PREFETCH): the row's loads 16
    bytes wide with their eviction hints (evict last in pass 1, first in pass 2), 16-byte stores,
    the partials read past L1 (written by other SMs), the per-row counter a GPU-scope atomic behind
    a fence, and no spills."""
    lines = sm90.run(_SPLIT_HOPPER_CHECK)
    assert len(lines) == 3 * 4 + 4, lines  # (chunk, warps) x 4 flavours, and the default's 4
    assert sum("'PREFETCH': True" in line for line in lines) == 4, lines
    for line in lines:
        assert line.split("|")[1].split() == ["True"] * 4, line
        assert line.split("|")[2].strip() == "False", line


# ---------------------------------------------------------------- offsets past 2^31 on a few elements

_STRIDED_PAST_2_31 = r"""
import torch
import tritonkit
from tritonkit._runtime import interpret

STRIDE = 2**30 + 1  # an int32 stride; entry 2 of a row sits 2 * STRIDE > 2^31 elements from entry 0
device = "cpu" if interpret() else "cuda"
base = torch.empty(2 * STRIDE + 4, dtype=torch.bfloat16, device=device)  # 4 GiB, 12 entries touched
x, dy = (base.as_strided((3, 2), (STRIDE, 1), offset) for offset in (0, 2))
x.copy_(torch.tensor([[1.0, -2.0], [2.0, 0.5], [3.0, 0.25]]))
dy.copy_(torch.tensor([[0.5, 1.0], [-1.0, 2.0], [0.25, -0.5]]))
y = tritonkit.softmax(x, 0)
torch.testing.assert_close(y.double(), torch.softmax(x.double(), 0), rtol=0, atol=2**-7)
print("fwd ok", flush=True)
grad = torch.empty_like(y)
torch.ops.tritonkit.softmax_backward(dy, y, 0, False, "auto", grad)
y64 = y.double()
reference = y64 * (dy.double() - (dy.double() * y64).sum(0, keepdim=True))
torch.testing.assert_close(grad.double(), reference, rtol=0, atol=2**-7)
print("bwd ok", flush=True)
"""


def test_row_entry_offsets_past_2_31():
    """A row whose entries lie 2^30 + 1 elements apart (a column of a tensor past 2^31 elements,
    laid out sparsely so that only 12 entries are touched): offsets past 2^31 must not wrap. Run in
    a child process: a wrapped offset reads outside the tensor and may crash it."""
    result = subprocess.run(
        [sys.executable, "-c", _STRIDED_PAST_2_31], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.split("\n")[:2] == ["fwd ok", "bwd ok"], (
        f"exit status {result.returncode}; stdout {result.stdout!r}; stderr {result.stderr[-2000:]}"
    )


# ---------------------------------------------------------------- GPU: large shapes

HUGE_SHAPE = (2**16 + 3, 2**15 + 1)  # past 2^31 elements: int32 offsets would wrap
assert math.prod(HUGE_SHAPE) > 2**31


def _sampled_rows(rows: int, n: int, device) -> torch.Tensor:
    """A few hundred rows spread over the tensor, the last ones and those around element 2^31."""
    past = 2**31 // n
    spread = torch.linspace(0, rows - 1, 300).long().tolist()
    return torch.tensor(sorted({*spread, past - 1, past, past + 1, rows - 2, rows - 1}), device=device)


def _compare_rows(name, kernel_rows, x_rows, dy_rows=None, *, log=False, dim=-1):
    """compare() on sampled rows: forward, or with ``dy_rows`` the input gradient."""

    def run(upcast=None):
        x = x_rows.detach().to(upcast or x_rows.dtype).requires_grad_(dy_rows is not None)
        y = _reference(log)(x, dim)
        if dy_rows is None:
            return y.detach()
        return torch.autograd.grad(y, x, dy_rows.to(y.dtype))[0]

    comparison = compare(name, kernel_rows, run(), run(torch.float64), kernel_rows.dtype)
    assert comparison.passed, str(comparison)


@pytest.mark.gpu
@pytest.mark.hbm
def test_past_2_31_elements():
    g = torch.Generator("cuda").manual_seed(53)
    x = torch.randn(HUGE_SHAPE, generator=g, device="cuda", dtype=BF16)
    rows = _sampled_rows(*HUGE_SHAPE, "cuda")
    with poisoned_outputs():
        y = softmax(x)
    assert not torch.isnan(y).any()
    _compare_rows("sampled rows", y[rows], x[rows])
    dy = torch.randn(HUGE_SHAPE, generator=g, device="cuda", dtype=BF16)
    grad = torch.full_like(y, float("nan"))
    torch.ops.tritonkit.softmax_backward(dy, y, -1, False, "auto", grad)
    assert not torch.isnan(grad).any()
    _compare_rows("sampled gradient rows", grad[rows], x[rows], dy[rows])


@pytest.mark.gpu
@pytest.mark.hbm
@pytest.mark.parametrize(
    "shape, dtype", [((4096, 4096), F16), ((2048, 131072), BF16), ((8192, 1823), BF16)], ids=str
)
@pytest.mark.parametrize("log", LOGS)
def test_large_shapes_match_reference(shape, dtype, log, device):
    _check(*_inputs(shape, dtype, device, seed=54), log=log)


@pytest.mark.gpu
@pytest.mark.hbm
@pytest.mark.parametrize("shape, dtype", [((2048, 131072), BF16), ((64, 1048576), torch.float32)], ids=str)
@pytest.mark.parametrize("log", LOGS)
def test_split_rows_at_scale(shape, dtype, log, launches, device):
    """The split kernels as tuned on the GPU: cooperative launches whose segments wait for each other."""
    _check(*_inputs(shape, dtype, device, seed=57), log=log, variant="split")
    assert _variants(launches) == {"fwd": {"split"}, "bwd": {"split"}}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["auto", "split"])
@pytest.mark.parametrize("log", LOGS)
def test_longest_rows_forward(log, variant):
    """(256, 4194304) fp32: the online kernel over 1024 chunks a row, or 128 to 256 segments; some
    rows checked."""
    x = torch.randn((256, 4194304), generator=torch.Generator("cuda").manual_seed(55), device="cuda")
    with poisoned_outputs():
        y = _kernel(log, variant)(x)
    assert not torch.isnan(y).any()
    rows = torch.tensor([0, 1, 100, 254, 255], device="cuda")
    _compare_rows("sampled rows", y[rows], x[rows], log=log)


@pytest.fixture
def tuning_afresh(monkeypatch, tmp_path):
    """Real tuning on the GPU, from scratch: fresh tuners, a private cache, an empty memo."""
    assert tuning.tuning_possible()
    monkeypatch.setenv("TRITONKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sm, "_plans", {})  # plans hold configs too
    for direction, tuner in list(sm._TUNERS.items()):
        fresh = tuning.Tuner(
            tuner.name, tuner.configs, sources=tuner.sources, default=tuner.default, prune=tuner.prune
        )
        monkeypatch.setitem(sm._TUNERS, direction, fresh)
        monkeypatch.setattr(sm._TUNED[direction], "tuner", fresh)
        monkeypatch.setattr(sm._TUNED[direction], "_chosen", {})
    return tmp_path / tuning.SUBDIR


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 1823), (64, 65536)], ids=str)
def test_tuned_winner_matches_reference(shape, tuning_afresh, launches, device):
    """Real tuning (every variant is a candidate for auto): the winners pass the oracle, are cached
    on disk, and are what the op launched with."""
    _check(*_inputs(shape, BF16, device, seed=56))
    files = {path.name.split("-")[0]: path for path in tuning_afresh.iterdir()}
    assert sorted(files) == ["softmax_bwd", "softmax_fwd"]
    for direction in ("fwd", "bwd"):
        entry = json.loads(files[f"softmax_{direction}"].read_text())
        assert entry["ms"][tuning._canonical(entry["config"])] is not None
        assert [config for d, config in launches if d == direction][-1] == entry["config"]


def test_the_launch_promises_the_alignment_its_rows_have():
    """ALIGN (``softmax._align``): the largest power of two of entries, up to 16 bytes, dividing N
    and every view's outer and row strides; 1 where a view's entries are not contiguous."""

    def align(n, strides, dtype=torch.bfloat16):
        tensors = (torch.empty(0, dtype=dtype),)
        return sm._align(tensors, (1, 3, n, strides))

    assert align(2904, (3 * 2904, 2904, 1)) == 8  # 16-byte rows: 8 bf16 entries
    assert align(4096, (3 * 4096, 4096, 1)) == 1  # multiples of 16: Triton knows, the kernels as before
    assert align(2900, (3 * 2900, 2900, 1)) == 4 and align(76, (228, 76, 1)) == 4
    assert align(2900, (3 * 2904, 2904, 1)) == 4  # a view of wider rows: its length decides
    assert align(4099, (3 * 4099, 4099, 1)) == 1
    assert align(2904, (3 * 2904, 2904, 1), torch.float32) == 4  # 16 bytes of fp32
    assert align(2904, (3 * 2904, 1, 3), torch.float32) == 1  # entries strided (a leading dim)
    assert align(2904, (3 * 2904, 2904, 1, 3 * 2900, 2900, 1)) == 4  # a second view's stride too


def test_rows_of_any_length_load_as_wide_as_their_alignment_allows():
    """Compiled for sm_90: rows of 2904 bf16 entries (a multiple of 8: 16-byte rows) move in 16-byte
    vectors through ALIGN; rows of 2900 and 76 (multiples of 4, whose rows start off 16 bytes) in
    16-byte vectors through windows (test_softmax_window.py), their first and last vectors' entries
    alone; forward and backward. Triton alone, which specializes multiples of 16 only, loaded them
    an entry (2 bytes) at a time."""
    rows = sm90.access_widths("softmax", [(4096, 2900), (4096, 2904), (4096, 76)])
    assert len(rows) == 6
    for row in rows:
        widths = {128} if row["shape"][1] == 2904 else {128, 16}
        assert set(row["loads"]) == widths and set(row["stores"]) == widths, row
