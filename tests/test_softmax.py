"""softmax and log_softmax on the CPU: outputs and gradients against the float64 reference for
every kernel, layouts and dims, edge values, invariants, poisoning, the tuner's accuracy gate,
errors and custom ops (torch.compile: test_softmax_compile.py). What the hardware sees (SASS,
offsets past 2^31, the H200) is in test_softmax_hw.py."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import tritonkit.ops.softmax.configs as sk
import tritonkit.ops.softmax.softmax as sm
from grids import case_id, in_turn
from tritonkit import opdef, tuning
from tritonkit._launch import next_power_of_2
from tritonkit._runtime import interpret, sm_count
from tritonkit.ops.softmax.softmax import (
    DTYPES,
    OPS,
    WORKLOADS,
    log_softmax,
    log_softmax_reference,
    softmax,
    softmax_reference,
    softmax_variant,
)
from tritonkit.testing import (
    check_against_reference,
    compare,
    compare_with_reference,
    generator,
    poisoned_outputs,
    random_tensor,
)

pytestmark = pytest.mark.softmax

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
LOGS = [pytest.param(False, id="softmax"), pytest.param(True, id="log_softmax")]


# Untuned (under the interpreter), "auto" runs the one-pass kernel at every row length of the CPU
# suite (checked below); "online" forces the chunked kernel on the same inputs, and "split" the
# split-row one, in small segments of two chunks (small_segments_config).
KERNELS = ("auto", "online", "split")


def small_segments_config(key: dict) -> dict:
    """The split config the CPU suite runs: rows of up to four segments (three where the row is just
    past a power of two), each of two chunks, most with a ragged end: few programs for the
    interpreter, every path of the kernel."""
    segment = max(32, key["block_n"] // 4)
    return {"variant": "split", "SEGMENT": segment, "BLOCK_N": segment // 2, "num_warps": 4, "PER_SM": 1}


@pytest.fixture(autouse=True)
def small_segments(monkeypatch):
    """The split kernel's untuned config (which the named "split" variant runs wherever it was not
    tuned for the shape: under the interpreter, and on a GPU for rows too short to tune it for)
    becomes small_segments_config, with fresh memos of chosen configs and plans."""
    monkeypatch.setattr(sm, "_plans", {})
    for tuned in sm._TUNED.values():
        monkeypatch.setattr(tuned, "_chosen", {})
    for tuner in sm._TUNERS.values():
        default = tuner.default
        monkeypatch.setattr(
            tuner,
            "default",
            lambda key, default=default: (
                small_segments_config(key) if key.get("variant") == "split" else default(key)
            ),
        )


def _kernel(log: bool, variant: str = "auto"):
    """The public function for "auto", else softmax_variant with the named kernel."""
    if variant == "auto":
        return log_softmax if log else softmax

    def kernel(input, dim=-1, dtype=None):
        return softmax_variant(input, dim, dtype, log=log, variant=variant)

    return kernel


def _reference(log: bool):
    """The reference; its float64 run ignores ``dtype``, so that it stays the float64 reference."""
    fn = log_softmax_reference if log else softmax_reference

    def reference(input, dim=-1, dtype=None):
        return fn(input, dim, dtype=None if input.dtype == torch.float64 else dtype)

    return reference


def _inputs(shape, dtype, device, seed, *, noncontiguous=False, grad_noncontiguous=False, grad_dtype=None):
    """Input (standard normal times 3: rows with a clear maximum and small tails) and upstream gradient."""
    g = generator(seed)
    x = random_tensor(shape, dtype, device, generator=g, scale=3.0, noncontiguous=noncontiguous)
    dy = random_tensor(shape, grad_dtype or dtype, device, generator=g, noncontiguous=grad_noncontiguous)
    return x, dy


def _check(x, dy, *, log=False, variant="auto", dim=-1, dtype=None):
    """The oracle on output and input gradient. Tolerances are those of the output dtype: with
    ``dtype`` the gradient is computed from that output, so it carries the output's precision."""
    kwargs = {"dim": dim} | ({"dtype": dtype} if dtype is not None else {})
    return check_against_reference(
        _kernel(log, variant),
        _reference(log),
        [x],
        kwargs=kwargs,
        grad_inputs=(0,),
        grad_outputs=[dy],
        dtype=dtype or x.dtype,
    )


def _backward_op(grad_output, output, dim, input_dtype, log):
    """The backward custom op, through the dispatcher, into a fresh gradient of ``input_dtype``."""
    dx = torch.empty(output.shape, dtype=input_dtype, device=output.device)
    torch.ops.tritonkit.softmax_backward(grad_output, output, dim, log, "auto", dx)
    return dx


def _key(direction, n, layout="rows", rows=64, variant="auto", dtype="fp32>fp32"):
    """A tuning key as the launcher builds it (with a variant: as _default reads it), rows of ``n``."""
    return {
        "direction": direction,
        "variant": variant,
        "layout": layout,
        "block_n": next_power_of_2(n),
        "rows": rows,
        "dtype": dtype,
    }


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch the op makes, as (direction, config): which kernel ran, with which
    parameters. The tuner's own launches (its gate and timings, over every variant, on a GPU) do
    not pass through the op's ``_launch``, so they are left out."""
    launch, seen = sm._launch, []

    def recording_launch(direction, config, *args):
        seen.append((direction, config))
        launch(direction, config, *args)

    monkeypatch.setattr(sm, "_launch", recording_launch)
    return seen


def _variants(launches) -> dict:
    """direction -> the set of kernel variants launched in it."""
    ran = {}
    for direction, config in launches:
        ran.setdefault(direction, set()).add(config["variant"])
    return ran


# ---------------------------------------------------------------- the oracle over shapes and dtypes

SHAPES = [
    (7, 123),  # several rows to a program, a ragged row tile
    (5, 1823),  # prime row length
    (3, 4097),  # online: two chunks of the default 4096, the second of one entry
    (1, 7),  # one row
    (9, 1),  # one entry a row: softmax 1, log_softmax 0, gradient 0 (softmax) or dy - sum(dy)
]


MATCHES_REFERENCE = in_turn(SHAPES, DTYPES, KERNELS, last=[False, True])


@pytest.mark.parametrize("shape, dtype, variant, log", MATCHES_REFERENCE, ids=map(case_id, MATCHES_REFERENCE))
def test_matches_reference(shape, dtype, log, variant, launches, device):
    x, dy = _inputs(shape, dtype, device, seed=shape[0] * 10000 + shape[1])
    comparisons = _check(x, dy, log=log, variant=variant)
    assert [c.name for c in comparisons] == ["output[0]", "grad input[0]"]
    if variant != "auto" or interpret():  # tuned, auto may pick any kernel
        expected = {"one-pass"} if variant == "auto" else {variant}
        assert _variants(launches) == {"fwd": expected, "bwd": expected}


def test_untuned_auto_is_one_pass_up_to_the_register_limit():
    """The kernel "auto" starts from (and runs under the interpreter), at the one-pass kernel's limits."""

    def variant(*args, **kwargs):
        return sm._default(_key(*args, **kwargs))["variant"]

    many = 4096  # rows: enough for the online kernel's one program a row (see the split test below)
    for n in (1, 7, 4097, sk.ONE_PASS_MAX_BLOCK_N):
        assert variant("fwd", n) == variant("fwd", n, rows=1) == "one-pass"
    assert variant("fwd", sk.ONE_PASS_MAX_BLOCK_N + 1, rows=many) == "online"
    # the backward holds y and dy: half the row; the column layout holds 16 rows at once, with int64
    # entry offsets: half of that again
    assert variant("bwd", sk.ONE_PASS_MAX_BLOCK_N // 2) == "one-pass"
    assert variant("bwd", sk.ONE_PASS_MAX_BLOCK_N // 2 + 1, rows=many) == "online"
    # ... unless it keeps them bf16: the whole row, at 32 warps (64 values a thread)
    bf16 = sm._default(_key("bwd", sk.ONE_PASS_MAX_BLOCK_N, dtype="bf16>bf16"))
    assert bf16 == {"variant": "one-pass", "BLOCK_M": 1, "num_warps": 32}
    assert variant("bwd", sk.ONE_PASS_MAX_BLOCK_N, rows=many, dtype="fp16>fp16") == "online"
    assert variant("bwd", sk.ONE_PASS_MAX_BLOCK_N + 1, rows=many, dtype="bf16>bf16") == "online"
    assert variant("fwd", sk.ONE_PASS_MAX_BLOCK_N // 32, "cols") == "one-pass"
    assert variant("fwd", sk.ONE_PASS_MAX_BLOCK_N // 32 + 1, "cols") == "online"
    assert variant("bwd", sk.ONE_PASS_MAX_BLOCK_N // 64, "cols") == "one-pass"
    assert variant("bwd", sk.ONE_PASS_MAX_BLOCK_N // 64 + 1, "cols") == "online"


def test_forward_one_pass_backward_split(launches, device):
    """A row that fits the one-pass forward but not the one-pass backward: auto switches per
    direction (one row: the backward splits it)."""
    n = sk.ONE_PASS_MAX_BLOCK_N // 2 + 117
    for log in (False, True):
        _check(*_inputs((1, n), F32, device, seed=30 + log), log=log)
    if interpret():  # tuned, the forward may pick online too
        assert _variants(launches) == {"fwd": {"one-pass"}, "bwd": {"split"}}


def test_bf16_backward_holds_the_longest_rows(launches, device):
    """bf16 rows of sk.ONE_PASS_MAX_BLOCK_N entries: the backward keeps y and dy 16-bit and widens them
    twice (for the dot, then by their bits for dx); infinities and NaN in dy come through as torch's."""
    x, dy = _inputs((3, sk.ONE_PASS_MAX_BLOCK_N - 5), BF16, device, seed=32)
    for log in (False, True):
        _check(x, dy, log=log)
    if interpret():  # tuned, the backward may pick online
        assert _variants(launches)["bwd"] == {"one-pass"}
    y = softmax(x)
    dy[0, 10], dy[1, 20], dy[2, 21] = float("inf"), float("-inf"), float("nan")
    expected = torch._softmax_backward_data(dy.float(), y.float(), -1, torch.float32)
    got = _backward_op(dy, y, -1, BF16, False)
    torch.testing.assert_close(got, expected.to(BF16), equal_nan=True)  # +-inf and NaN where torch has them


def test_one_pass_variant_backward_rejects_long_rows(device):
    """Forcing "one-pass" where only its forward fits: the backward says to use "online"."""
    x = random_tensor((1, sk.ONE_PASS_MAX_BLOCK_N // 2 + 1), F32, device, generator=generator(31))
    x.requires_grad_()
    y = softmax_variant(x, variant="one-pass")
    with pytest.raises(ValueError, match="online"):
        y.backward(torch.ones_like(y))


# ---------------------------------------------------------------- layouts and dims


def _expanded_rows(g, device):
    x = random_tensor((1, 70), F32, device, generator=g).expand(5, 70)  # every row the same, stride 0
    return x, random_tensor((5, 70), F32, device, generator=g)


def _expanded_entries(g, device):
    x = random_tensor((5, 1), F32, device, generator=g).expand(5, 70)  # constant rows: softmax 1/70
    return x, random_tensor((5, 70), F32, device, generator=g)


# (name, shape, dtype, dim, how the input is laid out)
LAYOUTS = [
    ("strided input", (9, 70), F32, -1, {"noncontiguous": True}),
    ("strided grad output", (9, 70), BF16, -1, {"grad_noncontiguous": True}),
    ("strided both, dim 1 of 3", (2, 40, 6), BF16, 1, {"noncontiguous": True, "grad_noncontiguous": True}),
    ("dim 0", (123, 7), F32, 0, {}),  # rows are the contiguous axis: the column layout
    ("3-D dim -1", (2, 3, 96), F16, -1, {}),
    ("3-D dim -2", (2, 33, 6), F32, -2, {}),
    ("3-D dim 0", (5, 3, 8), BF16, 0, {}),
    ("4-D dim 1", (2, 3, 4, 5), F32, 1, {}),
    ("4-D dim -1", (2, 3, 2, 5), F16, -1, {}),
    ("1-D", (37,), F32, 0, {}),
    ("0-D", (), F32, 0, {}),
    ("0-D dim -1", (), BF16, -1, {}),
]


LAYOUT_GRID = in_turn(LAYOUTS, KERNELS, last=[False, True])
LAYOUT_CASES = [(*layout, variant, log) for layout, variant, log in LAYOUT_GRID]


@pytest.mark.parametrize(
    "name, shape, dtype, dim, layout, variant, log",
    LAYOUT_CASES,
    ids=[f"{case[0]}-{case_id(case[-2:])}" for case in LAYOUT_CASES],
)
def test_layouts_and_dims(name, shape, dtype, dim, layout, log, variant, device):
    x, dy = _inputs(shape, dtype, device, seed=len(name), **layout)
    assert x.is_contiguous() != layout.get("noncontiguous", False)
    assert dy.is_contiguous() != layout.get("grad_noncontiguous", False)
    _check(x, dy, log=log, variant=variant, dim=dim)
    y = _kernel(log, variant)(x, dim)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()


@pytest.mark.parametrize("log", LOGS)
def test_long_columns_run_online(log, launches, device):
    """Softmax over a leading dim of 2049: the column layout's one-pass limit is 2048, so auto runs
    the online kernel, in chunks of 64 entries."""
    _check(*_inputs((2049, 3), BF16, device, seed=32), log=log, dim=0)
    assert _variants(launches) == {"fwd": {"online"}, "bwd": {"online"}}
    if interpret():  # the untuned chunk
        assert {config["BLOCK_N"] for _, config in launches} == {64}


@pytest.mark.parametrize("dim", [-1, 0])
@pytest.mark.parametrize("log", LOGS)
@pytest.mark.parametrize("variant", KERNELS)
def test_transposed_input(dim, log, variant, device):
    g = generator(33 + dim)
    x = random_tensor((40, 9), BF16, device, generator=g, scale=3.0).t()
    assert x.stride() == (1, 9)
    _check(x, random_tensor((9, 40), BF16, device, generator=g), log=log, variant=variant, dim=dim)


@pytest.mark.parametrize("make", [_expanded_rows, _expanded_entries], ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("log", LOGS)
@pytest.mark.parametrize("variant", KERNELS)
def test_expanded_input(make, log, variant, device):
    x, dy = make(generator(33), device)
    assert 0 in x.stride()
    _check(x, dy, log=log, variant=variant)


@pytest.mark.parametrize(
    "shape, dim", [((0, 16), -1), ((0, 16), 0), ((3, 0), 0), ((3, 0), -1), ((2, 0, 5), 2)], ids=str
)
@pytest.mark.parametrize("variant", KERNELS)
def test_empty_input(shape, dim, variant, device):
    for log in (False, True):
        x = torch.empty(shape, device=device, dtype=BF16).requires_grad_()
        y = _kernel(log, variant)(x, dim)
        assert y.shape == shape and y.dtype == BF16
        (grad,) = torch.autograd.grad(y, x, torch.empty(shape, device=device, dtype=BF16))
        assert grad.shape == shape and grad.dtype == BF16


# ---------------------------------------------------------------- the dtype argument


DTYPE_ARGUMENTS = in_turn([(F16, F32), (F32, BF16), (BF16, F32)], KERNELS, last=[False, True])


@pytest.mark.parametrize("dtypes, variant, log", DTYPE_ARGUMENTS, ids=map(case_id, DTYPE_ARGUMENTS))
def test_dtype_argument(dtypes, log, variant, device):
    in_dtype, out_dtype = dtypes
    g = generator(34)
    x = random_tensor((6, 123), in_dtype, device, generator=g, scale=3.0)
    dy = random_tensor((6, 123), out_dtype, device, generator=g)
    _check(x, dy, log=log, variant=variant, dtype=out_dtype)
    x.requires_grad_()
    y = _kernel(log, variant)(x, -1, out_dtype)
    assert y.dtype == out_dtype
    (grad,) = torch.autograd.grad(y, x, dy)
    assert grad.dtype == in_dtype  # the gradient arrives in the input's dtype


# ---------------------------------------------------------------- many online chunks

# A chunk of 64 entries makes the online kernels walk several chunks on rows the interpreter runs
# quickly; two rows a program puts a masked (absent) row next to a real one in every odd-rowed case.
# Each such test runs twice: with pass 1 loading one chunk at a time, and with PREFETCH.
SMALL_CHUNKS = {"variant": "online", "BLOCK_M": 2, "BLOCK_N": 64, "num_warps": 4}
_small_chunks = {"config": SMALL_CHUNKS}  # that of the running test: set by the fixture


@pytest.fixture(params=["one-chunk", "prefetch"])
def small_chunks(request, monkeypatch, launches):
    """The online kernel's default config (the one used under the interpreter) becomes SMALL_CHUNKS,
    with PREFETCH where the param is "prefetch" (a test may pick it: indirect parametrization). The
    tuners hold the default function itself, so it is wrapped there; nothing is tuned (on a GPU
    too); the memo of chosen configs starts empty and is restored afterwards. Returns the launches."""
    config = SMALL_CHUNKS | ({"PREFETCH": True} if request.param == "prefetch" else {})
    monkeypatch.setitem(_small_chunks, "config", config)
    monkeypatch.setattr(tuning, "_single_config", lambda: True)
    monkeypatch.setattr(sm, "_plans", {})  # plans hold configs too
    for tuned in sm._TUNED.values():
        monkeypatch.setattr(tuned, "_chosen", {})
    for tuner in sm._TUNERS.values():
        default = tuner.default
        monkeypatch.setattr(
            tuner,
            "default",
            lambda key, default=default: (
                dict(config) if default(key)["variant"] == "online" else default(key)
            ),
        )
    return launches


ONLINE_CASES = [((5, 200), -1), ((3, 128), -1), ((7, 1), -1), ((3, 65), -1), ((200, 5), 0), ((2, 130, 3), 1)]
ONLINE = in_turn(ONLINE_CASES, [F32, BF16], last=[False, True, True, False])  # each meets both logs


@pytest.mark.parametrize("case, dtype, log", ONLINE, ids=map(case_id, ONLINE))
def test_online_over_many_chunks(case, dtype, log, small_chunks, device):
    shape, dim = case
    x, dy = _inputs(shape, dtype, device, seed=35 + shape[0])
    _check(x, dy, log=log, variant="online", dim=dim)
    _assert_small_chunks_ran(small_chunks)


# ---------------------------------------------------------------- split rows


SPLIT_SHAPES = [(3, 64), (5, 200), (1, 129), (7, 130), (2, 4100), (9, 1)]
SPLIT_ROWS = in_turn(SPLIT_SHAPES, [F32, BF16], last=[False, True, True, False])  # each meets both logs


@pytest.mark.parametrize("shape, dtype, log", SPLIT_ROWS, ids=map(case_id, SPLIT_ROWS))
def test_split_rows_over_many_segments(shape, dtype, log, launches, monkeypatch, device):
    """Rows of one to four segments, ragged last segments and chunks. On 20 SMs, 7 rows of three
    segments are more than the 6 that run at once, so a program walks two rows; the others all run at once."""
    monkeypatch.setattr(sm, "sm_count", lambda device: 20)  # (the nominal 132 would take 45 rows to walk)
    x, dy = _inputs(shape, dtype, device, seed=39 + shape[1])
    _check(x, dy, log=log, variant="split")
    assert _variants(launches) == {"fwd": {"split"}, "bwd": {"split"}}
    if interpret():
        segments = {-(-shape[1] // config["SEGMENT"]) for _, config in launches}
        assert segments == {{64: 2, 200: 4, 129: 3, 130: 3, 4100: 3, 1: 1}[shape[1]]}


def test_split_refuses_more_segments_than_can_run_at_once(device):
    config = {"variant": "split", "SEGMENT": 64, "BLOCK_N": 32, "num_warps": 4, "PER_SM": 1}
    programs = sm_count(device)
    x = torch.empty((1, 64 * programs + 1), device=device)
    views = (sm._as_3d(x, 1), sm._as_3d(torch.empty_like(x), 1))
    message = rf"{programs + 1} segments of 64, more than the {programs} programs"
    with pytest.raises(ValueError, match=message):
        sm._launch_args("fwd", config, False, views, sm._geometry(views))


# ---------------------------------------------------------------- edge values


def _outputs_and_grad(fn, x, dy, dim, upcast=None, poison=False):
    x = x.detach().to(upcast or x.dtype).requires_grad_()
    with poisoned_outputs() if poison else contextlib.nullcontext():
        y = fn(x, dim)
        (grad,) = torch.autograd.grad(y, x, dy.to(y.dtype))
    return y.detach(), grad


def _check_nonfinite(x, dy, *, log, variant, dim=-1):
    """The oracle where the float64 reference has NaN or infinite entries: the kernel must have the
    same values there (NaN where NaN, -inf where -inf) and pass the error bound everywhere else."""
    kernel = _outputs_and_grad(_kernel(log, variant), x, dy, dim, poison=True)
    same_dtype = _outputs_and_grad(_reference(log), x, dy, dim)
    reference = _outputs_and_grad(_reference(log), x, dy, dim, upcast=torch.float64)
    for name, k, t, r in zip(("output", "grad input"), kernel, same_dtype, reference, strict=True):
        special = ~torch.isfinite(r)
        torch.testing.assert_close(
            k[special].double(),
            r[special],
            rtol=0,
            atol=0,
            equal_nan=True,
            msg=lambda m, name=name: f"{name} where the reference is not finite: {m}",
        )
        comparison = compare(
            name, k.masked_fill(special, 0), t.masked_fill(special, 0), r.masked_fill(special, 0), x.dtype
        )
        assert math.isfinite(comparison.err_torch), comparison  # torch agrees where values are finite
        assert comparison.passed, str(comparison)
    return reference


def _with_rows(x, rows: dict):
    """``x`` with row i replaced by the function rows[i] of that row."""
    x = x.clone()
    for i, fill in rows.items():
        x[i] = fill(x[i])
    return x


INF, NAN = float("inf"), float("nan")


def _at(*entries):
    """A mask of a row: true at ``entries``."""
    return lambda r: torch.isin(_entries(r), torch.tensor(entries, device=r.device))


def _entries(r):
    return torch.arange(r.numel(), device=r.device)


EDGE_ROWS = {  # name -> {row: new row}; the other rows stay random and must stay right
    "all -inf row": {1: lambda r: torch.full_like(r, -INF)},
    "+inf entry": {2: lambda r: r.masked_fill(_at(5)(r), INF)},
    "two +inf entries": {0: lambda r: r.masked_fill(_at(0, 70)(r), INF)},
    "nan entry": {3: lambda r: r.masked_fill(_at(99)(r), NAN)},
    "one finite entry": {1: lambda r: r.masked_fill(~_at(50)(r), -INF)},
    "-inf entries": {i: (lambda r, i=i: r.masked_fill(_entries(r) % (i + 2) == 0, -INF)) for i in range(4)},
}


LOG_AND_DTYPE = [(False, F32), (True, BF16), (True, F32), (False, BF16)]  # in turn; every pair still meets
NONFINITE = [(c, v, *s) for c, v, s in in_turn(EDGE_ROWS, KERNELS, last=LOG_AND_DTYPE)]


@pytest.mark.parametrize("case, variant, log, dtype", NONFINITE, ids=map(case_id, NONFINITE))
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, in the interpreter
def test_nonfinite_inputs_match_torch(case, dtype, log, variant, device):
    x, dy = _inputs((5, 100), dtype, device, seed=36)
    reference = _check_nonfinite(_with_rows(x, EDGE_ROWS[case]), dy, log=log, variant=variant)
    changed = [i for i in range(5) if i in EDGE_ROWS[case]]
    assert torch.isfinite(reference[0][[i for i in range(5) if i not in changed]]).all()


def _masked_attention(shape, dtype, device, seed, keep):
    """Rows with -inf at masked positions, as attention masks make them: row i keeps its entries
    keep[i][0] to keep[i][1] - 1 and masks the rest."""
    x, dy = _inputs(shape, dtype, device, seed)
    cols = torch.arange(shape[-1], device=device)
    for i, (start, stop) in enumerate(keep):
        x[i].masked_fill_((cols < start) | (cols >= stop), -INF)
    return x, dy


def _assert_small_chunks_ran(launches):
    small = _small_chunks["config"]
    directions = {direction for direction, config in launches if config == small}
    assert directions == {"fwd", "bwd"}, launches
    assert all(config == small for _, config in launches if config["variant"] == "online"), launches


MASKED_ROWS = in_turn(DTYPES, KERNELS, last=[False, True])  # PREFETCH (below) changes the online kernel only
MASKED_RUNS = [(*c, p) for c in MASKED_ROWS for p in ["one-chunk", "prefetch"][: 1 + (c[1] == "online")]]


@pytest.mark.parametrize(
    "dtype, variant, log, small_chunks", MASKED_RUNS, ids=map(case_id, MASKED_RUNS), indirect=["small_chunks"]
)
def test_masked_rows_with_first_chunks_all_masked(dtype, log, variant, small_chunks, device):
    """With 64-entry chunks: a row whose first chunk, or first two, hold only -inf, then finite values."""
    keep = [(0, 200), (64, 150), (199, 200), (130, 151), (1, 190)]  # chunks start at 0, 64, 128, 192
    x, dy = _masked_attention((5, 200), dtype, device, seed=37, keep=keep)
    _check_nonfinite(x, dy, log=log, variant=variant)
    if variant == "online":
        _assert_small_chunks_ran(small_chunks)


@pytest.mark.parametrize("log", LOGS)
def test_masked_first_chunk_at_the_default_chunk(log, launches, device):
    """The online kernel's default 4096-entry chunk, the first all -inf, the second finite."""
    x, dy = _masked_attention((2, 4200), BF16, device, seed=38, keep=[(4096, 4200), (4100, 4150)])
    _check_nonfinite(x, dy, log=log, variant="online")
    if interpret():  # the untuned chunk
        assert {config["BLOCK_N"] for _, config in launches} == {4096}


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize("log", LOGS)
@pytest.mark.parametrize("variant", KERNELS)
def test_large_magnitudes(dtype, log, variant, device):
    """Values up to several times 1e4 (exp would overflow any dtype without the max subtracted)."""
    g = generator(39)
    x = random_tensor((6, 300), F32, device, generator=g, scale=1e4).clamp(-6e4, 6e4).to(dtype)
    assert x.abs().max() > 2e4
    _check(x, random_tensor((6, 300), dtype, device, generator=g), log=log, variant=variant)


# ---------------------------------------------------------------- invariants


# a Latin square of (shape, variant) -> dtype: every pair of values of two axes meets once
SUM_CASES = [
    (shape, dim, DTYPES[(i + j) % len(DTYPES)], variant)
    for i, (shape, dim) in enumerate([((6, 123), -1), ((3, 1823), -1), ((40, 5), 0)])
    for j, variant in enumerate(KERNELS)
]


@pytest.mark.parametrize("shape, dim, dtype, variant", SUM_CASES, ids=str)
def test_rows_sum_to_one(shape, dim, dtype, variant, device):
    """Each output is within one ulp of its true value, so a row sums to 1 within one ulp of 1, plus
    the reciprocal's rounding and the fp32 tree sum's log2(N) ulps."""
    x, _ = _inputs(shape, dtype, device, seed=40)
    n = shape[dim]
    bound = (2 + math.ceil(math.log2(n))) * torch.finfo(dtype).eps
    y = _kernel(False, variant)(x, dim).double()
    assert (y >= 0).all() and (y <= 1).all()
    assert (y.sum(dim) - 1).abs().max().item() <= bound
    log_y = _kernel(True, variant)(x, dim).double()
    assert (log_y <= 0).all()
    # exp(log y) errs by y * |log y| * eps/2 at most: sum(y |log y|) is the entropy, at most log(N)
    assert (log_y.exp().sum(dim) - 1).abs().max().item() <= bound + math.log(n) * torch.finfo(dtype).eps


@pytest.mark.parametrize("log", LOGS)
@pytest.mark.parametrize("variant", KERNELS)
def test_shift_invariance(log, variant, device):
    """softmax(x + c) = softmax(x) for a per-row c. With x on a 2^-10 grid and integer c, x + c and
    x + c - max(x + c) = x - max(x) are exact in fp32, so the outputs agree bit for bit; without
    the max subtracted, exp(x + 8000) overflows."""
    g = generator(41)
    x = torch.round(random_tensor((6, 300), F32, device, generator=g, scale=3.0) * 1024) / 1024
    c = torch.randint(-8000, 8000, (6, 1), generator=g).to(device=device, dtype=F32)
    c[0] = 8000
    fn = _kernel(log, variant)
    torch.testing.assert_close(fn(x + c), fn(x), rtol=0, atol=0)


@pytest.mark.parametrize("variant", KERNELS)
def test_log_softmax_is_log_of_softmax(variant, device):
    x, _ = _inputs((6, 300), F32, device, seed=42)
    y, log_y = _kernel(False, variant)(x).double(), _kernel(True, variant)(x).double()
    # log(y) errs by y's relative error, a few fp32 ulps; log y itself is rounded to fp32 (rtol)
    eps = torch.finfo(F32).eps
    torch.testing.assert_close(log_y, y.log(), rtol=eps, atol=8 * eps)


# ---------------------------------------------------------------- poisoning


def _skip_last_row(direction_skipped: str):
    """A launch that leaves the last row of its output unwritten in ``direction_skipped``."""
    launch = sm._launch

    def partial_launch(direction, config, log, tensors, geometry):
        if direction == direction_skipped:
            outer, rows, n, strides = geometry
            geometry = (outer, rows - 1, n, strides)
        launch(direction, config, log, tensors, geometry)

    return partial_launch


POISONING = in_turn(["fwd", "bwd"], KERNELS, last=[False, True])  # each direction, and kernel, with both logs


@pytest.mark.parametrize("direction, variant, log", POISONING, ids=map(case_id, POISONING))
def test_poisoning_catches_an_unwritten_row(direction, log, variant, monkeypatch, device):
    x, dy = _inputs((5, 40), F32, device, seed=43)
    _check(x, dy, log=log, variant=variant)  # passes with the real launch
    monkeypatch.setattr(tuning, "_single_config", lambda: True)  # no tuning with the broken launch
    monkeypatch.setattr(sm, "_launch", _skip_last_row(direction))
    # a GPU call of a signature seen before replays its recorded launches, not _launch: record afresh
    # (conftest's _fresh_plans forgets the broken launches' plans before the next test)
    opdef.forget_plans()
    comparisons = compare_with_reference(
        _kernel(log, variant), _reference(log), [x], grad_inputs=(0,), grad_outputs=[dy]
    )
    failed = [c.name for c in comparisons if not c.passed]
    assert failed == (["output[0]", "grad input[0]"] if direction == "fwd" else ["grad input[0]"])
    with poisoned_outputs():
        y = _kernel(log, variant)(x)
    assert torch.isnan(y[-1]).all().item() == (direction == "fwd") and not torch.isnan(y[:-1]).any()


# ---------------------------------------------------------------- bad arguments


def _valid(device):
    return random_tensor((4, 8), F32, device, generator=generator(46))


BAD_ARGUMENTS = [  # (call with a valid input, exception, pattern of its message)
    pytest.param(lambda x: softmax(x.tolist()), TypeError, "^input must be a torch.Tensor", id="list input"),
    pytest.param(lambda x: log_softmax(x.double()), TypeError, "^input .*float64", id="float64 input"),
    pytest.param(lambda x: softmax((10 * x).int()), TypeError, "^input ", id="int input"),
    pytest.param(lambda x: softmax(x, dtype=torch.int32), TypeError, "^dtype ", id="int dtype"),
    pytest.param(lambda x: softmax(x, dtype=torch.float64), TypeError, "^dtype ", id="float64 dtype"),
    pytest.param(lambda x: softmax(x, dim=2), IndexError, "^dim 2 ", id="dim 2 of 2-D"),
    pytest.param(lambda x: log_softmax(x, dim=-3), IndexError, "^dim -3 ", id="dim -3 of 2-D"),
    pytest.param(lambda x: softmax(x[0, 0], dim=1), IndexError, "^dim 1 ", id="dim 1 of 0-D"),
    pytest.param(lambda x: softmax(x, dim=1.0), TypeError, "^dim ", id="float dim"),
    pytest.param(lambda x: softmax(x, dim=True), TypeError, "^dim ", id="bool dim"),
    pytest.param(lambda x: softmax_variant(x, variant="two-pass"), ValueError, "^variant ", id="bad variant"),
    pytest.param(
        lambda x: softmax_variant(x.new_ones(1, 70000), variant="one-pass"),
        ValueError,
        "'online'",
        id="row too long for one-pass",
    ),
    pytest.param(
        lambda x: softmax_variant(x.new_ones(70000, 2), dim=0, variant="one-pass"),
        ValueError,
        "'online'",
        id="column too long for one-pass",
    ),
]


@pytest.mark.parametrize("call, error, pattern", BAD_ARGUMENTS)
def test_bad_arguments(call, error, pattern, device):
    with pytest.raises(error, match=pattern):
        call(_valid(device))


def test_bad_arguments_with_autograd(device):
    x = _valid(device).requires_grad_()
    with pytest.raises(IndexError, match="^dim "):
        softmax(x, dim=5)
    with pytest.raises(TypeError, match="^dtype "):
        log_softmax(x, dtype=torch.int64)


def test_backward_rejects_mismatched_grad_output(device):
    y = softmax(_valid(device))
    with pytest.raises(ValueError, match="grad_output"):
        torch.ops.tritonkit.softmax_backward(y[:, :7], y, -1, False, "auto", torch.empty_like(y))


# ---------------------------------------------------------------- autograd, custom ops, compile


def test_repeated_calls_take_the_stored_plan(monkeypatch, device):
    """A call like one before skips validation, views and the tuning lookup; a call whose views
    need a copy of the input is never planned (its pointer is not the input's)."""
    monkeypatch.setattr(sm, "_plans", {})
    x, dy = _inputs((6, 50), F32, device, seed=51)
    x.requires_grad_()
    for log in (False, True):
        y = _kernel(log)(x)
        (grad,) = torch.autograd.grad(y, x, dy)
        assert len(sm._plans) == 2 * (1 + log)  # forward and backward

        def no_lookup(*args):
            raise AssertionError("a planned call looked up its config")

        with monkeypatch.context() as patched:
            patched.setattr(sm, "_config", no_lookup)
            patched.setattr(sm, "_validate", no_lookup)
            with poisoned_outputs():
                y_again = _kernel(log)(x)
                (grad_again,) = torch.autograd.grad(y_again, x, dy)
        torch.testing.assert_close(y_again, y, rtol=0, atol=0)
        torch.testing.assert_close(grad_again, grad, rtol=0, atol=0)
    # (6, 4, 50) permuted to (4, 6, 50): its rows do not merge into one stride, so a copy is made
    permuted = random_tensor((6, 4, 50), F32, device, generator=generator(52)).permute(1, 0, 2)
    planned = len(sm._plans)
    torch.testing.assert_close(softmax(permuted), softmax_reference(permuted))
    assert len(sm._plans) == planned
    # the same shape with other strides is another plan
    torch.testing.assert_close(softmax(x.detach().t().contiguous().t()), softmax_reference(x.detach()))
    assert len(sm._plans) == planned + 1


def test_custom_ops_match_the_public_functions(device):
    x, dy = _inputs((5, 40), F32, device, seed=49)
    for log in (False, True):
        y = torch.empty(x.shape, dtype=BF16, device=device)
        torch.ops.tritonkit.softmax(x, 0, log, "auto", y)
        torch.testing.assert_close(y, _kernel(log)(x, 0, BF16), rtol=0, atol=0)
        eager_x = x.clone().requires_grad_()
        (eager_grad,) = torch.autograd.grad(_kernel(log)(eager_x, 0, BF16), eager_x, dy.to(BF16))
        grad = _backward_op(dy.to(BF16), y, 0, F32, log)
        torch.testing.assert_close(grad, eager_grad, rtol=0, atol=0)


# ---------------------------------------------------------------- registry, cost model, harness shapes


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
@pytest.mark.parametrize("shape", OPS["softmax"].shapes, ids=str)
def test_op_inputs_match_reference(name, shape, device):
    op = OPS[name]
    assert op.shapes == OPS["softmax"].shapes
    for dtype in op.dtypes:
        g = generator(51)
        inputs = op.make_inputs(shape, dtype, device, g)
        dy = random_tensor(shape, dtype, device, generator=g)
        check_against_reference(
            op.fn, op.reference, inputs, kwargs=op.kwargs, grad_inputs=op.grad_inputs, grad_outputs=[dy]
        )


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_variant_peers_match_reference(name, device):
    workload, log = WORKLOADS[name], name == "log_softmax"
    for peer in ("tritonkit[one-pass]", "tritonkit[online]"):
        fn = workload.peers[peer]({"dim": 0})
        x, dy = _inputs((70, 9), F32, device, seed=52)
        check_against_reference(
            fn, _reference(log), [x], kwargs={"dim": 0}, grad_inputs=(0,), grad_outputs=[dy]
        )
    if not log:
        assert isinstance(workload.peers["liger"]({"dim": 0}), str)  # liger covers dim=-1 only: says so
