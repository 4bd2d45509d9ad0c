"""linear and gated_linear: outputs and gradients of every epilogue against the float64 reference,
shapes the tiles cut (M = 1, 17, 130; K = 33; N = 257), layouts, empty dimensions, errors, the
custom ops, nn.Linear, tuning (TMA, persistent and split-K tiles through the oracle). The sm_90
SASS of every default launch (HGMMA, no spills) is checked at the benchmark shapes with the other
ops' in test_inspect.py; the TMA tiles' here."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

import tritonkit
import tritonkit.ops.linear.kernels as kn
import tritonkit.ops.linear.matmul as mm
from grids import in_turn
from tritonkit.ops.linear import ACTIVATIONS, gated_linear_reference, linear_reference
from tritonkit.testing import check_against_reference, generator, poisoned_outputs, random_tensor

op_module = importlib.import_module("tritonkit.ops.linear.linear")  # the package's `linear` is the function
pytestmark = pytest.mark.linear

BF16, F16 = torch.bfloat16, torch.float16
K, N = 33, 257  # in and out features: neither a multiple of a tile
# Out features for opcheck and compile, which check the ops' schemas, fake tensors, autograd
# registration and graph breaks, none of which depends on the size: two of the interpreter's 32-wide
# column tiles, the second ragged
SMALL_N = 40


def _inputs(leading, dtype, device, seed, bias=True, residual=False, noncontiguous=False, n=N):
    g = generator(seed)
    x = random_tensor((*leading, K), dtype, device, generator=g, noncontiguous=noncontiguous)
    w = random_tensor((n, K), dtype, device, generator=g, noncontiguous=noncontiguous)
    b = random_tensor((n,), dtype, device, generator=g) if bias else None
    r = random_tensor((*leading, n), dtype, device, generator=g) if residual else None
    dy = random_tensor((*leading, n), dtype, device, generator=g, noncontiguous=noncontiguous)
    return x, w, b, r, dy


def _check(x, w, b, r, dy, activation):
    """Output and the gradient of every tensor input, against the float64 reference."""
    inputs = [t for t in (x, w, b, r) if t is not None]
    has_b, has_r = b is not None, r is not None

    def call(fn):
        def run(*tensors):
            it = iter(tensors)
            x_, w_ = next(it), next(it)
            b_ = next(it) if has_b else None
            r_ = next(it) if has_r else None
            return fn(x_, w_, b_, activation, r_)

        return run

    check_against_reference(
        call(tritonkit.linear),
        call(linear_reference),
        inputs,
        grad_inputs=tuple(range(len(inputs))),
        grad_outputs=[dy],
    )


# every activation with and without a bias and a residual, and every bias/residual pair (the
# epilogue's three switches are independent constexprs: each pair of values meets in some case)
EPILOGUES = in_turn(list(ACTIVATIONS), [False, True], last=[False, True, True, False])


@pytest.mark.parametrize(
    "activation, bias, residual",
    EPILOGUES,
    ids=[f"{a}-{'bias' if b else ''}-{'residual' if r else ''}" for a, b, r in EPILOGUES],
)
def test_every_epilogue_matches_the_reference(activation, bias, residual, device):
    _check(*_inputs((17,), BF16, device, seed=1, bias=bias, residual=residual), activation)


@pytest.mark.parametrize("leading, dtype", [((1,), BF16), ((130,), F16), ((2, 65), BF16)], ids=str)
def test_row_counts_and_leading_dims(leading, dtype, device):
    _check(*_inputs(leading, dtype, device, seed=2, residual=True), "gelu_tanh")


def test_noncontiguous_inputs_and_grad_output(device):
    x, w, b, r, dy = _inputs((3, 11), F16, device, seed=3, residual=True, noncontiguous=True)
    assert not (x.is_contiguous() or w.is_contiguous() or dy.is_contiguous())
    _check(x, w, b, r, dy, "silu")
    _check(x.transpose(0, 1), w, b, r.transpose(0, 1), dy.transpose(0, 1), "relu2")  # rows of stride 11 K


def test_relu_gradient_is_zero_where_the_unit_is_off(device):
    """relu' is a step: dx and dW get nothing through the entries whose pre-activation is negative."""
    x, w, b, _, dy = _inputs((9,), BF16, device, seed=4)
    x.requires_grad_()
    with poisoned_outputs():
        y = tritonkit.linear(x, w, b - 100.0, "relu")  # every unit off
        (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(y, torch.zeros_like(y)) and torch.equal(dx, torch.zeros_like(dx))


def test_empty_dimensions(device):
    """No rows: empty outputs and dx, zero dW and db. No in_features: act(bias) + residual."""
    x, w, b, _, dy = _inputs((0,), BF16, device, seed=5)
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    with poisoned_outputs():
        y = tritonkit.linear(x, w, b, "gelu")
        dx, dw, db = torch.autograd.grad(y, (x, w, b), dy)
    assert y.shape == (0, N) and dx.shape == (0, K)
    assert torch.equal(dw, torch.zeros_like(dw)) and torch.equal(db, torch.zeros_like(db))
    g = generator(6)
    x0, w0 = (random_tensor(shape, BF16, device, generator=g) for shape in ((4, 0), (N, 0)))
    r = random_tensor((4, N), BF16, device, generator=g)
    with poisoned_outputs():
        y = tritonkit.linear(x0, w0, b, "silu", r)
    expected = linear_reference(x0.float(), w0.float(), b.float(), "silu", r.float())
    torch.testing.assert_close(y, expected.to(BF16))
    x, w_none, b_none = (
        random_tensor(shape, BF16, device, generator=g).requires_grad_() for shape in ((4, K), (0, K), (0,))
    )
    with poisoned_outputs():  # no out_features: an empty output, and dx a sum over nothing
        y = tritonkit.linear(x, w_none, b_none, "gelu")
        (dx,) = torch.autograd.grad(y, x, torch.empty_like(y))
    assert y.shape == (4, 0) and torch.equal(dx, torch.zeros_like(dx))


def test_without_grad_no_pre_activation_is_kept(device):
    x, w, b, r, _ = _inputs((5,), BF16, device, seed=7, residual=True)
    y = tritonkit.linear(x, w, b, "gelu", r)
    assert y.grad_fn is None and y.shape == (5, N)


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("fp32", TypeError, "float16 or bfloat16"),
        ("weight dtype", TypeError, "weight must have input's dtype"),
        ("in_features", ValueError, "in_features"),
        ("bias shape", ValueError, "bias must have shape"),
        ("residual shape", ValueError, "residual must have shape"),
        ("activation", ValueError, "activation must be one of"),
        ("not a tensor", TypeError, "weight must be a torch.Tensor"),
    ],
)
def test_bad_input_raises(case, error, match, device):
    x, w, b, r, _ = _inputs((4,), BF16, device, seed=8, residual=True)
    args = {"input": x, "weight": w, "bias": b, "activation": "gelu", "residual": r}
    args |= {
        "fp32": {"input": x.float()},
        "weight dtype": {"weight": w.half()},
        "in_features": {"weight": w[:, :-1]},
        "bias shape": {"bias": b[:-1]},
        "residual shape": {"residual": r[:, :-1]},
        "activation": {"activation": "tanh"},
        "not a tensor": {"weight": w.tolist()},
    }[case]
    with pytest.raises(error, match=match):
        tritonkit.linear(**args)


def test_opcheck(device):
    x, w, b, r, dy = _inputs((6,), BF16, device, seed=9, residual=True, n=SMALL_N)
    x.requires_grad_(), w.requires_grad_()
    y, pre = torch.empty_like(r), torch.empty_like(r)
    torch.library.opcheck(torch.ops.tritonkit.linear.default, (x, w, b, r, "gelu_tanh", y, pre))
    torch.library.opcheck(torch.ops.tritonkit.linear.default, (x, w, None, None, None, y, None))
    pre = linear_reference(x, w, b).detach()
    grads = (torch.empty_like(x), torch.empty_like(w), torch.empty_like(b))
    torch.library.opcheck(
        torch.ops.tritonkit.linear_backward.default, (dy, x.detach(), w.detach(), pre, "gelu_tanh", *grads)
    )
    torch.library.opcheck(
        torch.ops.tritonkit.linear_backward.default,
        (dy, x.detach(), w.detach(), None, None, None, grads[1], None),
    )
    torch.library.opcheck(
        torch.ops.tritonkit.linear_backward_spending_pre.default,
        (dy, x.detach(), w.detach(), pre.clone(), "gelu_tanh", *grads),
    )


def test_compile_fullgraph(device):
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: tritonkit.linear(*a), fullgraph=True)
    x, w, b, r, dy = _inputs((5,), BF16, device, seed=10, residual=True, n=SMALL_N)
    for t in (x, w, b, r):
        t.requires_grad_()
    y = compiled(x, w, b, "silu", r)
    grads = torch.autograd.grad(y, (x, w, b, r), dy)
    eager = tritonkit.linear(x, w, b, "silu", r)
    assert torch.equal(y, eager)
    assert all(
        torch.equal(a, e) for a, e in zip(grads, torch.autograd.grad(eager, (x, w, b, r), dy), strict=True)
    )


def test_a_gradient_graph_leaves_the_callers_upstream_gradient_alone(device):
    """The residual's gradient is the upstream gradient itself: marking it for create_graph=True
    once set a graph on the caller's tensor, whose later use then raised."""
    x, w, _, r, dy = _inputs((4,), BF16, device, seed=12, bias=False, residual=True)
    leaves = [t.requires_grad_() for t in (x, w, r)]
    torch.autograd.grad(tritonkit.linear(x, w, residual=r), leaves, dy, create_graph=True)
    assert not dy.requires_grad and dy.grad_fn is None


def test_module_loads_torch_state_dict(device):
    torch_layer = torch.nn.Linear(K, N, dtype=BF16, device=device)
    layer = tritonkit.nn.Linear(K, N, True, device, BF16, activation="relu2")  # torch.nn.Linear's order
    layer.load_state_dict(torch_layer.state_dict())
    x = random_tensor((3, K), BF16, device, generator=generator(11))
    with poisoned_outputs():
        y = layer(x)
    torch.testing.assert_close(y, torch.nn.functional.relu(torch_layer(x)).square(), atol=0.5, rtol=2**-6)
    assert "activation='relu2'" in repr(layer)
    with pytest.raises(ValueError, match="activation must be one of"):
        tritonkit.nn.Linear(K, N, activation="gelu_erf")
    # built as torch.nn.Linear builds by default, in fp32: refused at the call, saying what to do
    with pytest.raises(TypeError, match=r"computes in fp16 or bf16.*dtype=torch\.bfloat16"):
        tritonkit.nn.Linear(K, N, device=device)(x.float())


def _gated_inputs(leading, dtype, device, seed, n=N):
    g = generator(seed)
    x = random_tensor((*leading, K), dtype, device, generator=g)
    w_gate, w_up = (random_tensor((n, K), dtype, device, generator=g) for _ in range(2))
    return x, w_gate, w_up, random_tensor((*leading, n), dtype, device, generator=g)


def _check_gated(x, w_gate, w_up, dy, activation, grad_inputs=(0, 1, 2)):
    check_against_reference(
        lambda *a: tritonkit.gated_linear(*a, activation=activation),
        lambda *a: gated_linear_reference(*a, activation=activation),
        [x, w_gate, w_up],
        grad_inputs=grad_inputs,
        grad_outputs=[dy],
    )


@pytest.mark.parametrize("activation", list(ACTIVATIONS), ids=str)
def test_gated_linear_matches_the_reference(activation, device):
    _check_gated(*_gated_inputs((17,), BF16, device, seed=20), activation)


@pytest.mark.parametrize("leading, dtype", [((1,), BF16), ((2, 65), BF16), ((130,), F16)], ids=str)
def test_gated_linear_row_counts_and_leading_dims(leading, dtype, device):
    _check_gated(*_gated_inputs(leading, dtype, device, seed=21), "gelu_tanh")


@pytest.mark.parametrize("grad_inputs", [(0,), (1,), (2,), (1, 2)], ids=str)
def test_gated_linear_computes_the_gradients_asked_for(grad_inputs, device):
    """Each backward product alone, and the two weight gradients without dx."""
    _check_gated(*_gated_inputs((9,), F16, device, seed=22), "silu", grad_inputs=grad_inputs)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_linear_as_two_matmuls_matches_the_reference(activation, device, monkeypatch):
    """From SPLIT_ROWS rows (lowered here to 2) the forward is two plain matmuls and the elementwise
    act(g) * u (the backward's dx one kernel at every row count): against the reference, and the same
    values with and without a gradient."""
    monkeypatch.setattr(op_module, "SPLIT_ROWS", 2)
    x, w_gate, w_up, dy = _gated_inputs((3, 7), F16, device, seed=25)
    _check_gated(x, w_gate, w_up, dy, activation)
    with torch.no_grad():
        plain = tritonkit.gated_linear(x, w_gate, w_up, activation=activation)
    tracked = tritonkit.gated_linear(*(t.requires_grad_() for t in (x, w_gate, w_up)), activation=activation)
    assert torch.equal(plain, tracked.detach())


def test_gated_linear_without_rows_and_bad_input(device):
    x, w_gate, w_up, dy = _gated_inputs((0,), BF16, device, seed=23)
    for t in (x, w_gate, w_up):
        t.requires_grad_()
    with poisoned_outputs():
        y = tritonkit.gated_linear(x, w_gate, w_up)
        grads = torch.autograd.grad(y, (x, w_gate, w_up), dy)
    assert y.shape == (0, N) and grads[0].shape == (0, K)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads[1:])
    with pytest.raises(ValueError, match="weight_up must have weight_gate's shape"):
        tritonkit.gated_linear(x, w_gate, w_up[:-1])
    with pytest.raises(TypeError, match="weight_up must have input's dtype"):
        tritonkit.gated_linear(x, w_gate, w_up.half())
    with pytest.raises(ValueError, match="activation must be one of"):
        tritonkit.gated_linear(x, w_gate, w_up, activation="swish")


def test_gated_linear_opcheck_and_compile(device):
    x, w_gate, w_up, dy = _gated_inputs((6,), BF16, device, seed=24, n=SMALL_N)
    for t in (x, w_gate, w_up):
        t.requires_grad_()
    y, g, u = (torch.empty_like(dy) for _ in range(3))
    torch.library.opcheck(torch.ops.tritonkit.gated_linear.default, (x, w_gate, w_up, "silu", y, g, u))
    torch.library.opcheck(torch.ops.tritonkit.gated_linear.default, (x, w_gate, w_up, "silu", y, None, None))
    with torch.no_grad():
        g, u = torch.nn.functional.linear(x, w_gate), torch.nn.functional.linear(x, w_up)
    plain = [t.detach() for t in (dy, x, w_gate, w_up)]
    grads = (torch.empty_like(x), torch.empty_like(w_gate), torch.empty_like(w_up))
    torch.library.opcheck(torch.ops.tritonkit.gated_linear_backward.default, (*plain, g, u, "silu", *grads))
    spending = torch.ops.tritonkit.gated_linear_backward_spending_products.default
    torch.library.opcheck(spending, (*plain, g.clone(), u.clone(), "silu", *grads))
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: tritonkit.gated_linear(*a), fullgraph=True)
    y = compiled(x, w_gate, w_up)
    eager = tritonkit.gated_linear(x, w_gate, w_up)
    assert torch.equal(y, eager)
    for a, e in zip(
        torch.autograd.grad(y, (x, w_gate, w_up), dy),
        torch.autograd.grad(eager, (x, w_gate, w_up), dy),
        strict=True,
    ):
        assert torch.equal(a, e)


# ---------------------------------------------------------------- tuning


def fake_ms(config):
    """A fake timing under which 64 x 64 tiles, 3 stages and 8 warps are fastest, and the default
    (the interpreter's small tile, a candidate too) slowest."""
    return (
        config["BLOCK_N"] / 1000
        + config["num_stages"] / 10**4
        - config["num_warps"] / 10**5
        + config["BLOCK_M"] / 10**6
        + (config == kn.INTERPRETER_CONFIG)
    )


@pytest.fixture
def tuned(monkeypatch, tmp_path):
    """Tuning as on a GPU, with a fresh tuner, a private cache, an empty memo and a fake timer (the
    Tuned's hooks); records launches."""
    from tritonkit import tuning

    monkeypatch.setattr(tuning, "_single_config", lambda: False)
    monkeypatch.setenv("TRITONKIT_CACHE_DIR", str(tmp_path))
    tuner = mm.MATMUL.tuner
    monkeypatch.setattr(
        mm.MATMUL,
        "tuner",
        tuning.Tuner(
            tuner.name, tuner.configs, sources=tuner.sources, default=tuner.default, prune=tuner.prune
        ),
    )
    monkeypatch.setattr(mm.MATMUL, "_chosen", {})
    monkeypatch.setattr(mm.MATMUL, "time_ms", lambda problem, config: fake_ms(config))
    return tmp_path / tuning.SUBDIR, _recorded_launches(monkeypatch)


def test_each_matmul_launches_its_fastest_admitted_tile(tuned, device):
    """A training step tunes the forward, dx and dW each through the gate, launches each winner, and
    a second step tunes nothing."""
    cache, launched = tuned
    x, w, b, _, dy = _inputs((17,), F16, device, seed=30)
    _check(x, w, b, None, dy, "gelu_tanh")
    entries = [json.loads(path.read_text()) for path in cache.iterdir()]
    forms = sorted((e["key"]["epilogue"], e["key"]["a"], e["key"]["b"]) for e in entries)
    # forward: x and W as they are; dx: dz and W^T; dW: dz^T and x^T
    assert forms == [
        (False, "k-major", "n-major"),
        (False, "m-major", "n-major"),
        (True, "k-major", "k-major"),
    ]
    for entry in entries:
        admitted = [json.loads(c) for c, ms in entry["ms"].items() if ms is not None]
        assert len(admitted) >= 4 and not entry["rejected"], entry
        assert entry["config"] == min(admitted, key=fake_ms) and entry["config"]["BLOCK_N"] == 64
    winners = [meta for _, meta in launched if meta["BLOCK_N"] == 64 and meta["num_stages"] == 3]
    assert len(winners) >= 3  # the kernel's own launches ran the winners
    launched.clear()
    _check(x, w, b, None, dy, "gelu_tanh")
    assert len(launched) == 3  # no candidate ran again


@pytest.mark.parametrize("form", ["linear", "gated dx"])
def test_gate_rejects_a_wrong_result(form, monkeypatch, device):
    """A launch 1% off fails the gate; the exact one passes (dW's layouts; gated dx's two products)."""
    x, w, _, _, dy = _inputs((17,), F16, device, seed=31)
    if form == "linear":
        a, b, operands = dy.t(), x.t(), {}
    else:
        du = random_tensor(dy.shape, F16, device, generator=generator(32))
        a, b, operands = dy, w.t(), {"a2": du, "b2": w.t(), "gated": kn.GATED_DX}
    config = dict(kn.INTERPRETER_CONFIG)
    assert _admit(a, b, operands, config).passed
    run = mm.MATMUL.run

    def off_by_a_percent(problem, config):
        run(problem, config)
        problem["out"].mul_(1.01)  # C

    monkeypatch.setattr(mm.MATMUL, "run", off_by_a_percent)
    assert not _admit(a, b, operands, config).passed


def _admit(a, b, operands: dict, config: dict):
    """The gate's verdict on ``config`` for the matmul of A, B and ``operands`` (into a fresh C)."""
    out = torch.empty((a.shape[0], b.shape[0]), dtype=a.dtype, device=a.device)
    return mm.MATMUL.admit(mm.matmul_problem(a, b, out, **operands), config)


def _recorded_launches(monkeypatch) -> list:
    """Every launch of the matmul from here on (the op's, the gate's), as (grid, constexprs), each
    still launched: the Tuned's run, hooked."""
    launched = []

    def recording(problem, config):
        for launch in mm.MATMUL.launches(problem, config):
            launched.append((launch.grid, launch.meta))
            launch.run()

    monkeypatch.setattr(mm.MATMUL, "run", recording)
    return launched


def _forms(x, w, w_up, dy, du, epilogue: dict) -> dict:
    """(A, B, operands) of each matmul form of a training step: the forward with ``epilogue``, dx
    (dz W), dW (dz^T x), gated_linear's forward and its dx (dg Wg + du Wu)."""
    silu = ACTIVATIONS["silu"]
    return {
        "fwd": (x, w, epilogue),
        "dx": (dy, w.t(), {}),
        "dw": (dy.t(), x.t(), {}),
        "gated fwd": (x, w, {"b2": w_up, "activation": silu, "gated": kn.GATED_FWD}),
        "gated dx": (dy, w.t(), {"a2": du, "b2": w_up.t(), "gated": kn.GATED_DX}),
    }


@pytest.mark.parametrize("persistent", [False, True], ids=["", "persistent"])
@pytest.mark.parametrize("form", ["fwd", "dx", "dw", "gated fwd", "gated dx"])
def test_tma_tiles_match_the_reference(form, persistent, monkeypatch, device):
    """The TMA candidates (descriptors over K-contiguous and transposed operands; gated: four) and the
    persistent grid (two programs walking six or nine tiles in the interpreter) through the gate's oracle,
    on shapes whose rows are 16-byte aligned and cut ragged tiles; the launch took the TMA path."""
    g = generator(34)
    m, k, n = 72, 40, 72  # 3 x 3 tiles of 32, the third ragged; K: 2.5 steps of 16
    x = random_tensor((m, k), F16, device, generator=g)
    w, w_up = (random_tensor((n, k), F16, device, generator=g) for _ in range(2))
    dy, du = (random_tensor((m, n), F16, device, generator=g) for _ in range(2))
    epilogue = {
        "bias": random_tensor((n,), F16, device, generator=g),
        "residual": du,
        "pre": torch.empty_like(dy),
        "activation": ACTIVATIONS["gelu_tanh"],
    }
    a, b, operands = _forms(x, w, w_up, dy, du, epilogue)[form]
    launched = _recorded_launches(monkeypatch)
    config = kn.INTERPRETER_CONFIG | {"TMA": True} | ({"PERSISTENT": 1} if persistent else {})
    assert _admit(a, b, operands, config).passed
    (((grid,), meta),) = launched
    assert meta["TMA"] and meta["PERSISTENT"] == persistent
    tiles = -(-a.shape[0] // 32) * -(-b.shape[0] // 32)  # the calibration keeps these shapes
    assert tiles >= 6 and grid == (2 if persistent else tiles)


@pytest.mark.parametrize("form", ["dx", "dw"])
def test_split_k_matches_the_reference(form, monkeypatch, device):
    """SPLIT_K: four programs a tile over shares of K (one share empty), their fp32 partial products
    summed by the launcher, through the gate's oracle; an epilogue is refused; the tuner offers the
    split only for few tiles over a long K."""
    g = generator(35)
    x = random_tensor((72, 40), F16, device, generator=g)
    w = random_tensor((72, 40), F16, device, generator=g)
    dy = random_tensor((72, 72), F16, device, generator=g)
    a, b, operands = _forms(x, w, w, dy, dy, {})[form]
    launched = _recorded_launches(monkeypatch)
    assert _admit(a, b, operands, kn.INTERPRETER_CONFIG | {"SPLIT_K": 4}).passed
    (_, split), _ = launched[0]
    assert split == 4
    # the partials summed by a second launch, not by torch after it (so that the op replays)
    problem = mm.matmul_problem(a, b, torch.empty((a.shape[0], b.shape[0]), dtype=F16, device=device))
    summed = mm.matmul_launches(problem, kn.INTERPRETER_CONFIG | {"SPLIT_K": 4})
    assert [launch.name for launch in summed] == ["matmul", "split-K sum"]
    with pytest.raises(ValueError, match="plain matmuls"):
        mm.matmul_launches(
            mm.matmul_problem(x, w, torch.empty_like(dy), activation=ACTIVATIONS["silu"]),
            kn.INTERPRETER_CONFIG | {"SPLIT_K": 4},
        )
    split = {
        "BLOCK_M": 64,
        "BLOCK_N": 64,
        "BLOCK_K": 64,
        "GROUP_M": 8,
        "num_warps": 4,
        "num_stages": 3,
        "SPLIT_K": 4,
    }
    decode_dx = {"form": "linear", "epilogue": False, "m": 16, "n": 4096, "k": 16384}
    assert not kn._prune(split, decode_dx)
    assert kn._prune(split, decode_dx | {"m": 8192})  # 8192 tiles fill the GPU
    assert kn._prune(split, decode_dx | {"k": 512})  # shares of two steps
    assert kn._prune(split, decode_dx | {"epilogue": True})


@pytest.mark.parametrize("sms", [132, 1], ids=["one tile a program", "eight tiles a program"])
def test_activation_backward_pass(sms, monkeypatch, device):
    """The elementwise pass alone: dz = dy * act'(z) rounded to the dtype and db = the column sums of
    that dz; gated, dg and du; on strided dy, ragged tiles and rows of none. On 132 SMs the 17 row
    tiles are a program each; on one SM each program walks eight, summing db down its columns."""
    monkeypatch.setattr(op_module, "sm_count", lambda device: sms)

    g = generator(33)
    dy = random_tensor((130, 257), F16, device, generator=g, noncontiguous=True)
    z, u = (random_tensor((130, 257), F16, device, generator=g) for _ in range(2))
    slope = torch.autograd.functional.vjp(
        lambda t: mm.REFERENCE_ACTIVATIONS["silu"](t), z.double(), torch.ones_like(z, dtype=torch.float64)
    )[1]

    def unset_db():
        return torch.full((257,), float("nan"), dtype=torch.float32, device=device)

    with poisoned_outputs():
        db = unset_db()
        dz, du = op_module._activation_backward(dy, z, ACTIVATIONS["silu"], db=db)
    assert du is None
    expected = (dy.double() * slope).to(F16)
    assert (dz.double() - expected.double()).abs().max() <= 1e-3 * expected.double().abs().max()
    assert torch.allclose(db.double(), dz.double().sum(0), rtol=1e-5, atol=1e-3)
    with poisoned_outputs():
        dg, du = op_module._activation_backward(dy, z, ACTIVATIONS["silu"], u=u)
    torch.testing.assert_close(dg.double(), dy.double() * u.double() * slope, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(
        du.double(), dy.double() * mm.REFERENCE_ACTIVATIONS["silu"](z.double()), rtol=2e-3, atol=2e-3
    )
    db = unset_db()
    plain, _ = op_module._activation_backward(dy, None, 0, db=db)  # no activation: dz is dy
    assert plain is dy and torch.allclose(db.double(), dy.double().sum(0), rtol=1e-5, atol=1e-3)
    zeros = unset_db()
    op_module._activation_backward(dy[:0], None, 0, db=zeros)
    assert torch.equal(zeros, torch.zeros(257, dtype=torch.float32, device=device))


@pytest.mark.parametrize("name", ["gelu_tanh"])
def test_fast_activation_forms_equal_the_exact_ones(name, monkeypatch, device):
    """The epilogue's GELU (tanh) for 16-bit outputs (z sigmoid(2u): one exp2 and a division)
    against the float64 activation, out to the tails where the exponential overflows, and as close
    as the form kept for fp32 outputs."""
    import triton
    import triton.language as tl

    @triton.jit
    def both(z_ptr, fast_ptr, exact_ptr, ACTIVATION: tl.constexpr):
        offsets = tl.arange(0, 1024)
        z = tl.load(z_ptr + offsets)
        tl.store(fast_ptr + offsets, kn._activate(z, ACTIVATION, True))
        tl.store(exact_ptr + offsets, kn._activate(z, ACTIVATION, False))

    z = torch.cat(
        [
            torch.linspace(-30.0, 30.0, 512),
            random_tensor((512,), torch.float32, "cpu", generator=generator(7)),
        ]
    ).to(device)
    fast, exact = torch.empty_like(z), torch.empty_like(z)
    both[(1,)](z, fast, exact, ACTIVATIONS[name])
    reference = mm.REFERENCE_ACTIVATIONS[name](z.double())
    exact_error = (exact.double() - reference).abs().max().item()
    assert (fast.double() - reference).abs().max().item() <= max(2 * exact_error, 1e-6)
    assert torch.isfinite(fast).all()


_TMA_SASS_CHECK = r"""
import json, torch
from tritonkit.asm import compile_launch
from tritonkit.ops.linear.linear import _inspect_launches
tiles = {"tma": (128, {"num_warps": 8, "num_stages": 3, "TMA": True}),
         "persistent": (256, {"num_warps": 8, "num_stages": 4, "TMA": True, "PERSISTENT": 1})}
for name, (block_n, tile) in tiles.items():
    config = {"BLOCK_M": 128, "BLOCK_N": block_n, "BLOCK_K": 64, "GROUP_M": 8} | tile
    for launch in _inspect_launches((8192, 4096, 16384), torch.bfloat16, config, None, ("linear",)):
        r = compile_launch(launch, "sm_90")
        print(json.dumps({"tile": name, "launch": r.name, "hgmma": r.opcodes["HGMMA"],
                          "tma": r.opcodes["UTMALDG"], "cp_async": r.opcodes["LDGSTS"], "spills": r.spills}))
"""


def test_tma_candidates_compile_for_hopper():
    """The bare matmul's forward, dx and dW (the three layouts) on a TMA tile and on the persistent
    TMA tile, compiled for sm_90 at the benchmark shape: A and B loaded by TMA (UTMALDG, no cp.async),
    wgmma, no spills."""
    import sm90

    rows = [json.loads(line) for line in sm90.run(_TMA_SASS_CHECK)]
    assert len(rows) == 6
    for row in rows:
        assert row["tma"] > 0 and row["cp_async"] == 0 and row["hgmma"] > 0 and not row["spills"], row


_SHARED_MEMORY_CHECK = r"""
import json, torch
from tritonkit.asm import compile_launch
from tritonkit.ops.linear import kernels as kn, matmul as mm
wide = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "TMA": True}
for out_dtype in (torch.bfloat16, torch.float32):
    for stages, persistent in ((4, {}), (3, {"PERSISTENT": 1}), (4, {"PERSISTENT": 1})):
        config = wide | {"num_stages": stages} | persistent
        a, b = torch.empty(8192, 16384, dtype=torch.bfloat16), torch.empty(4096, 16384, dtype=torch.bfloat16)
        problem = mm.matmul_problem(a, b, torch.empty(8192, 4096, dtype=out_dtype))
        r = compile_launch(mm.matmul_launches(problem, config)[0], "sm_90")
        fits = kn._fits_shared_memory(config, mm.tuning_key(problem))
        print(json.dumps({"out": str(out_dtype), "config": config, "shared": r.shared_bytes, "fits": fits}))
"""


def test_the_shared_memory_prune_agrees_with_the_compiler():
    """The prune's shared memory against sm_90's compiled kernels on the wide TMA tile, one tile a
    program and persistent, with bf16 and fp32 C (whose tile the persistent grid keeps apart from the
    stages): a config the prune keeps compiles within the H200's 227 KB, one it drops does not."""
    import sm90

    rows = [json.loads(line) for line in sm90.run(_SHARED_MEMORY_CHECK)]
    assert len(rows) == 6
    for row in rows:
        assert row["fits"] == (row["shared"] <= 227 * 1024), row
    assert [row["fits"] for row in rows] == [True, True, True, True, False, False]


def test_the_tuning_key_and_memo_tell_output_dtypes_apart():
    """An fp32 C (an accumulator, as linear_cross_entropy's dx) is tuned and remembered apart from
    the inputs' dtype: its tile takes more shared memory, so a 16-bit C's winner may not compile."""
    a, b = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(48, 32, dtype=torch.bfloat16)
    half, full = (
        mm.matmul_problem(a, b, torch.empty(64, 48, dtype=d)) for d in (torch.bfloat16, torch.float32)
    )
    assert (mm.tuning_key(half)["out"], mm.tuning_key(full)["out"]) == ("bf16", "fp32")
    assert mm._signature(half) != mm._signature(full)


_SHALLOW_SASS_CHECK = r"""
import json, torch
from tritonkit.asm import compile_launch
from tritonkit.ops.linear.linear import _inspect_launches
tiles = {"shallow": (16, {"BLOCK_N": 128, "BLOCK_K": 16, "num_warps": 4}),
         "descriptor store": (128, {"BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "TMA": True,
                                    "PERSISTENT": 1, "TMA_STORE": True})}
for name, (rows, tile) in tiles.items():
    config = {"BLOCK_M": 128, "GROUP_M": 8, "num_stages": 3} | tile
    launches = _inspect_launches((rows, 4096, 16384), torch.bfloat16, config, None, ("linear",))
    r = compile_launch(next(launch for launch in launches if launch.name == "bwd dw"), "sm_90")
    print(json.dumps({"tile": name, "hgmma": r.opcodes["HGMMA"], "tma_store": r.opcodes["UTMASTG"],
                      "stores": {str(bits): n for bits, n in r.stores.items()}, "spills": r.spills}))
"""


def test_shallow_dw_tiles_compile_for_hopper():
    """dW of decode-like rows (16 and 128) on the tiles the H200's tuner chose, compiled for sm_90:
    wgmma, no spills; the 16-deep pointer tile stores 128 bits a thread at a time, the descriptor
    store's tile stores only through the copy engine (UTMASTG, no st.global)."""
    import sm90

    shallow, store = (json.loads(line) for line in sm90.run(_SHALLOW_SASS_CHECK))
    for row in (shallow, store):
        assert row["hgmma"] > 0 and not row["spills"], row
    assert shallow["stores"] and set(shallow["stores"]) == {"128"} and shallow["tma_store"] == 0, shallow
    assert store["tma_store"] > 0 and not store["stores"], store


# ---------------------------------------------------------------- on the H200


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu_tanh", "silu", None], ids=str)
def test_gpu_default_tiles_match_the_reference(activation, device):
    """Tensor-core tiles (the interpreter multiplies in fp32) at ragged sizes past several tiles
    each way and a deep K, bf16, every gradient; on the default tiles (tuning here would gate and
    time every candidate at each key)."""
    from tritonkit import tuning

    g = generator(40)
    x = random_tensor((1000, 1537), BF16, device, generator=g)
    w, w_up = (random_tensor((3001, 1537), BF16, device, generator=g) for _ in range(2))
    b = random_tensor((3001,), BF16, device, generator=g)
    r, dy = (random_tensor((1000, 3001), BF16, device, generator=g) for _ in range(2))
    with tuning.disabled():
        _check(x, w, b, r, dy, activation)
        _check_gated(x, w, w_up, dy, activation or "silu")


TMA_GPU_TILES = {
    "persistent": {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "PERSISTENT": 1},
    "wide persistent": {"BLOCK_N": 256, "num_warps": 8, "num_stages": 3, "PERSISTENT": 1},  # gated dx's
    "grid": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    "shallow, descriptor store": {
        "BLOCK_N": 64,
        "BLOCK_K": 16,
        "num_warps": 4,
        "num_stages": 3,
        "PERSISTENT": 2,
        "TMA_STORE": True,
    },
}


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(TMA_GPU_TILES.values()), ids=list(TMA_GPU_TILES))
@pytest.mark.parametrize("form", ["fwd", "dx", "dw", "gated fwd", "gated dx"])
def test_gpu_tma_tiles_match_the_reference(form, config, device):
    """The TMA candidates on the tensor cores, bf16, through the gate's oracle at ragged, aligned
    sizes (two tiles and 8 more each way, three steps and 8 deep)."""
    g = generator(41)
    x = random_tensor((1000, 1536), BF16, device, generator=g)
    w, w_up = (random_tensor((3008, 1536), BF16, device, generator=g) for _ in range(2))
    dy, du = (random_tensor((1000, 3008), BF16, device, generator=g) for _ in range(2))
    epilogue = {
        "bias": random_tensor((3008,), BF16, device, generator=g),
        "residual": du,
        "pre": torch.empty_like(dy),
        "activation": ACTIVATIONS["gelu_tanh"],
    }
    a, b, operands = _forms(x, w, w_up, dy, du, epilogue)[form]
    tile = {"BLOCK_M": 128, "BLOCK_K": 64, "GROUP_M": 8, "TMA": True} | config
    if form not in ("dx", "dw"):  # the descriptor store is for plain matmuls: the others refuse it
        tile.pop("TMA_STORE", None)
    assert mm._tma_ready(a) and mm._tma_ready(b)
    assert _admit(a, b, operands, tile).passed


@pytest.mark.parametrize("form", ["fwd", "dx"])
def test_decode_tiles_match_the_reference_and_only_decode_keys_get_them(form, device):
    """A 16-row tile, deeper than the usual 64 (the decode tiles' kind), through the gate's oracle on
    5 rows with a ragged last step of K; the tuner offers such tiles only to decode-like rows, a
    16-row tile only where the rows fit it, and no tile deeper than K."""
    g = generator(36)
    x = random_tensor((5, 200), F16, device, generator=g)
    w = random_tensor((72, 200), F16, device, generator=g)
    dy = random_tensor((5, 72), F16, device, generator=g)
    a, b, operands = _forms(
        x,
        w,
        w,
        dy,
        dy,
        {"bias": random_tensor((72,), F16, device, generator=g), "activation": ACTIVATIONS["gelu_tanh"]},
    )[form]
    tile = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 2}
    assert _admit(a, b, operands, tile).passed
    decode = {"form": "linear", "epilogue": False, "m": 16, "n": 16384, "k": 4096}
    sixteen_rows, deep = (
        {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 6}
        for bm in (16, 64)
    )
    assert not kn._prune(sixteen_rows, decode) and not kn._prune(deep, decode | {"m": 128})
    assert kn._prune(sixteen_rows, decode | {"m": 32})  # rows past the tile
    assert kn._prune(deep, decode | {"m": 256})  # not decode-like
    assert kn._prune(deep, decode | {"k": 64})  # K shallower than a step
    assert any(c["BLOCK_M"] == 16 for c in kn.CONFIGS) and any(c["BLOCK_K"] > 64 for c in kn.CONFIGS)


@pytest.mark.parametrize("persistent", [0, 2], ids=["", "two programs an SM"])
@pytest.mark.parametrize("form", ["fwd", "dw"])
def test_shallow_tiles_and_the_descriptor_store_match_the_reference(form, persistent, monkeypatch, device):
    """C stored through a tensor descriptor (TMA_STORE), from the forward's and dW's operands, on a
    NaN-filled output whose last tiles are ragged (the copy engine clips them); rows that are not
    16-byte aligned fall back to pointer stores; an epilogue or a split of K refuses it. The tuner
    offers the shallow tiles only where K is at most DECODE_ROWS, none deeper than K (16 at least), and the
    descriptor store only to plain matmuls."""
    from tritonkit.testing import compare

    g = generator(37)
    launched = _recorded_launches(monkeypatch)
    config = kn.INTERPRETER_CONFIG | {"TMA": True, "TMA_STORE": True, "PERSISTENT": persistent}
    for k, n in ((40, 72), (37, 69)):  # rows of C of 80 or 144 bytes (fwd and dW), or 74 or 138
        x = random_tensor((72, k), F16, device, generator=g)
        w = random_tensor((n, k), F16, device, generator=g)
        dy = random_tensor((72, n), F16, device, generator=g)
        a, b, operands = _forms(x, w, w, dy, dy, {})[form]
        out = torch.full((a.shape[0], b.shape[0]), float("nan"), dtype=F16, device=device)
        mm.MATMUL.run(mm.matmul_problem(a, b, out, **operands), config)
        assert launched[-1][1]["C_TMA"] == (k == 40)
        exact = mm.matmul_reference(a.double(), b.double())
        checked = compare("output", out, mm.matmul_reference(a, b), exact, F16)
        assert checked.passed, checked
    with pytest.raises(ValueError, match="plain matmuls"):
        mm.MATMUL.run(mm.matmul_problem(x, w, torch.empty_like(dy), activation=ACTIVATIONS["silu"]), config)
    with pytest.raises(ValueError, match="not both"):
        mm.MATMUL.run(mm.matmul_problem(a, b, out), config | {"SPLIT_K": 2, "PERSISTENT": 0})
    dw = {"form": "linear", "epilogue": False, "m": 16384, "n": 4096, "k": 16}
    shallow, store = (
        {
            "BLOCK_M": 128,
            "BLOCK_N": 128,
            "BLOCK_K": bk,
            "GROUP_M": 8,
            "num_warps": 4,
            "num_stages": 3,
            **extra,
        }
        for bk, extra in ((16, {}), (64, {"TMA_STORE": True}))
    )
    assert not kn._prune(shallow, dw) and not kn._prune(store, dw)
    assert kn._prune(shallow | {"BLOCK_K": 32}, dw)  # deeper than K
    assert not kn._prune(shallow, dw | {"k": 4}) and kn._prune(shallow | {"BLOCK_K": 32}, dw | {"k": 4})
    assert kn._prune(shallow, dw | {"k": 4096}) and kn._prune(store, dw | {"k": 4096})  # K not shallow
    assert kn._prune(store, dw | {"epilogue": True}) and not kn._prune(shallow, dw | {"epilogue": True})
    assert kn._prune(store | {"num_stages": 12}, dw)  # the stages and C's staged tile pass shared memory
