"""The norms' tuning: every config a tuner may offer passes the accuracy gate on the real kernels,
the gate rejects a wrong result, and the tuner launches the fastest admitted config (a fake timer:
do_bench needs CUDA). The helpers come from test_norm.py."""

from __future__ import annotations

import json
import threading

import pytest
import torch

import test_norm
from test_norm import BF16, F32, KERNELS, _case
from tritonkit import _launch, partial_sums, tuning
from tritonkit._runtime import interpret
from tritonkit.dtypes import DTYPE_OF
from tritonkit.ops.norm import kernels as nk
from tritonkit.ops.norm import norm as nm
from tritonkit.ops.norm import spec as ns
from tritonkit.testing import check_against_reference, generator, random_tensor

pytestmark = pytest.mark.norm
looped = test_norm.looped  # the fixture sending rows past 64 entries through the looped kernels


def _key(direction, n, rows, dtype=F32, *, rms=False, residual=False, weight=F32, bias=F32):
    params = nm._params_key(
        residual,
        torch.empty(0, dtype=weight) if weight else None,
        torch.empty(0, dtype=bias) if bias and not rms else None,
        rms,
    )
    return nm._tuning_key(direction, n, rows, dtype, params)


def _tuned(key):
    return nm._TUNED[key["direction"], key["looped"]]


def _candidates(key):
    return _tuned(key).tuner._candidates(key)


def _problem(key, n, device, eps=1e-5):
    """A call of the key's kind as its Tuned sees it, with what the gate reads of it: the shapes,
    dtypes and device of its inputs. Rows are one row expanded: a bucket of 65536 costs nothing."""

    def rows():
        return torch.empty((1, n), dtype=DTYPE_OF[key["dtype"]], device=device).expand(key["rows"], n)

    def param(name):
        return torch.empty(n, dtype=DTYPE_OF[key[name]], device=device) if key[name] else None

    residual = rows() if key["residual"] else None
    given = {"weight": param("weight"), "bias": param("bias"), "rms": key["rms"]}
    if key["direction"] == "fwd":
        return {"input": rows(), "residual": residual, "eps": eps, **given}
    return {"grad_y": rows(), "grad_h": residual, "h": rows(), **given}


def _admit(key, n, device, config, eps=1e-5):
    """The gate's verdict on ``config`` for a call of the key's kind."""
    return _tuned(key).admit(_problem(key, n, device, eps), config)


# Rows of 96 forward (block of 128: BLOCK_M of 8 and more keep 8+ values a thread) and of 1000
# backward (h and dy: 4 and 8 warps), in a bucket of many rows so that no ROWS is pruned; rows of
# 1000 and 4097 forward also through the looped candidates, compiled for their length.
GATE_CASES = [
    ("fwd", 96, 4096, {}),
    ("fwd", 96, 4096, {"rms": True, "residual": True}),
    ("bwd", 1000, 65536, {}),
    ("bwd", 1000, 65536, {"rms": True, "residual": True, "dtype": BF16, "weight": BF16}),
    ("fwd", 1000, 64, {"dtype": BF16, "bias": None}),
    # the looped candidates compiled for a row of several chunks and a ragged tail
    ("fwd", 4097, 4, {"rms": True, "residual": True}),
]


def _distinct_runs(candidates: list[dict]) -> list[dict]:
    """The candidates, but under the interpreter one of those that differ only in warps or eviction
    hints: what it ignores, so they run the same computation."""
    if not interpret():
        return candidates
    ignored = ("num_warps", "EVICT")
    return list(
        {
            json.dumps({k: v for k, v in c.items() if k not in ignored}, sort_keys=True): c
            for c in candidates
        }.values()
    )


@pytest.mark.gpu  # every candidate: seconds on the GPU, minutes interpreted (the contract samples each kind)
@pytest.mark.parametrize("direction, n, rows, options", GATE_CASES, ids=str)
def test_every_candidate_passes_the_gate(direction, n, rows, options, device):
    key = _key(direction, n, rows, **options)
    candidates = _candidates(key)
    assert len(candidates) >= 4, candidates  # the tuner has a real choice
    for config in _distinct_runs(candidates):
        assert _admit(key, n, device, config).passed, config


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_every_looped_candidate_passes_the_gate(direction, looped, device):
    key = _key(direction, 200, 4096, rms=direction == "bwd", residual=True)
    assert key["looped"]
    candidates = _candidates(key)
    assert len(candidates) >= 3, candidates
    for config in _distinct_runs(candidates):
        assert _admit(key, 200, device, config).passed, config


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_gate_rejects_a_wrong_result(direction, monkeypatch, device):
    """A launch whose output is 1% off (y forward, dx backward) fails the gate; the same config
    passes with the real launch."""
    key = _key(direction, 96 if direction == "fwd" else 1000, 4096)
    n, config = (
        (96, {"BLOCK_M": 16, "num_warps": 4}) if direction == "fwd" else (1000, {"ROWS": 8, "num_warps": 4})
    )
    assert _admit(key, n, device, config).passed
    tuned = _tuned(key)
    run = tuned.run

    def off_by_a_percent(problem, config):
        run(problem, config)
        problem["y" if direction == "fwd" else "dx"].mul_(1.01)

    monkeypatch.setattr(tuned, "run", off_by_a_percent)
    assert not _admit(key, n, device, config).passed


def fake_ms(config):
    """A fake timing under which more warps and fewer rows a program are faster, and PREFETCH and
    EVICT too."""
    return (
        1.0
        + config.get("BLOCK_M", config.get("ROWS", 1)) / 100
        - config["num_warps"] / 1000
        - config.get("PREFETCH", False) / 10000
        - config.get("EVICT", False) / 100000
    )


@pytest.fixture
def tuned(monkeypatch, tmp_path):
    """Tuning as on a GPU with fresh tuners, a private cache and a fake timer; records the op's own
    launches of its main kernels (not the tuner's) as ((direction, looped), meta)."""
    monkeypatch.setattr(tuning, "_single_config", lambda: False)
    monkeypatch.setenv("TRITONKIT_CACHE_DIR", str(tmp_path))
    _fresh_tuners(monkeypatch)
    for tuned in nm._TUNED.values():
        monkeypatch.setattr(tuned, "time_ms", lambda problem, config: fake_ms(config))  # the injected timer
    launched, run = [], nm._run

    def recording(launches):
        launched.extend((KERNELS[c.kernel], c.meta) for c in launches if c.kernel in KERNELS)
        run(launches)

    monkeypatch.setattr(nm, "_run", recording)
    return tmp_path / tuning.SUBDIR, launched


def _fresh_tuners(monkeypatch):
    """Each Tuned with a tuner of its own (nothing remembered of earlier keys) and an empty memo."""
    for tuned in nm._TUNED.values():
        tuner = tuned.tuner
        fresh = tuning.Tuner(
            tuner.name, tuner.configs, sources=tuner.sources, default=tuner.default, prune=tuner.prune
        )
        monkeypatch.setattr(tuned, "tuner", fresh)
        monkeypatch.setattr(tuned, "_chosen", {})


def test_inspect_takes_a_config_for_each_kernel():
    launches = ns._inspect_launches(
        False, True, False, (8192, 4096), BF16, {"BLOCK_M": 4, "ROWS": 16, "num_warps": 8}
    )
    assert [(launch.meta["BLOCK_M"], launch.meta["num_warps"]) for launch in launches[:1]] == [(4, 8)]
    assert (launches[1].meta["ROWS"], launches[1].meta["num_warps"]) == (16, 8)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kind, shape", [("add_rms_norm", (4096, 4096)), ("layer_norm", (512, 65536))], ids=str
)
def test_real_tuning_picks_a_timed_winner_that_matches_the_reference(
    kind, shape, monkeypatch, tmp_path, device
):
    """On the GPU, with an empty cache: each kernel tunes, its winner was admitted and timed, and
    the op's outputs and gradients pass the oracle."""
    monkeypatch.setenv("TRITONKIT_CACHE_DIR", str(tmp_path))
    _fresh_tuners(monkeypatch)
    kernel, reference, inputs, grad_inputs, grads = _case(kind, shape, BF16, device, seed=21)
    check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)
    entries = [json.loads(path.read_text()) for path in (tmp_path / tuning.SUBDIR).iterdir()]
    assert sorted(e["tuner"] for e in entries) == (
        ["norm_bwd", "norm_fwd"] if shape[1] <= 8192 else ["norm_bwd_looped", "norm_fwd_looped"]
    )
    for entry in entries:
        assert entry["ms"][tuning._canonical(entry["config"])] is not None, entry


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_candidates_compile_together_for_both_problems(direction, monkeypatch, device):
    """The tuner's precompile step hands every candidate's launches, for the calibration problem and
    the real one, to one concurrent compile (which itself is a no-op under the interpreter): the
    main kernel's, and the backward's second stage."""
    compiled = []
    monkeypatch.setattr(_launch, "precompile", compiled.extend)
    n = 96 if direction == "fwd" else 1000
    kernel, reference, inputs, grad_inputs, grads = _case("add_rms_norm", (40, n), BF16, device, seed=9)
    x, residual, weight = inputs
    key = _key(direction, n, 40, BF16, rms=True, residual=True, weight=BF16)
    if direction == "fwd":
        outputs = nm._forward_outputs(x, residual, True, stats=True)
        problem = nm._problem(nm._FWD_NAMES, x, residual, weight, None, 1e-5, True, *outputs)
    else:  # statistics stood in for by empty ones: nothing here reads them
        dx, dw = torch.empty_like(x), torch.empty_like(weight)
        problem = {"grad_y": grads[0], "grad_h": grads[1], "h": x, "weight": weight, "bias": None}
        problem |= {"mean": None, "rstd": None, "rms": True, "dx": dx, "dw": dw, "db": None}
    configs = _candidates(key)
    _tuned(key).precompile(problem, configs)
    main = nk._norm_fwd_kernel if direction == "fwd" else nk._norm_bwd_kernel
    assert [launch.kernel for launch in compiled].count(main) == 2 * len(configs)
    if direction == "bwd":
        sums = partial_sums._sum_partials_kernel
        assert [launch.kernel for launch in compiled].count(sums) == 2 * len(configs)
    for launch in compiled:  # args: tensors first, then the ints
        assert isinstance(launch.args[0], torch.Tensor) and launch.grid[0] >= 1
        if launch.kernel is main:
            assert launch.meta["num_warps"] in (2, 4, 8, 16) and launch.meta["BLOCK_M"] >= 1


def test_a_call_seen_before_reuses_its_config(monkeypatch, device):
    """The chosen config is kept by call signature: a repeat skips the tuning key; the memo is
    cleared, not grown without end, past MAX_CHOSEN signatures."""
    tuned = nm._TUNED["fwd", False]
    monkeypatch.setattr(tuned, "_chosen", {})
    monkeypatch.setattr(tuning, "MAX_CHOSEN", 2)
    x = torch.randn(3, 40, device=device)
    torch.testing.assert_close(nm.rms_norm(x, (40,)), torch.nn.functional.rms_norm(x, (40,)))
    monkeypatch.setattr(nm, "_tuning_key", lambda *args: pytest.fail("the tuning key was rebuilt"))
    nm.rms_norm(x, (40,))
    monkeypatch.undo()
    monkeypatch.setattr(tuned, "_chosen", {})
    monkeypatch.setattr(tuning, "MAX_CHOSEN", 2)
    for rows in (1, 2, 3, 4, 5):
        nm.rms_norm(torch.randn(rows, 40, device=device), (40,))
        assert 1 <= len(tuned._chosen) <= 2


def _large_one_pass(tuner: str) -> list[dict]:
    """The one-pass norm kernels' shipped records of 8192 rows or more."""
    return [e for e in tuning.shipped_records(tuner) if not e["key"]["looped"] and e["key"]["rows"] >= 8192]


def test_the_untuned_forward_default_is_near_the_shipped_winners():
    """The forward's default rule (ROW_ELEMENTS a program, PER_THREAD a thread) against the H200's
    shipped tuning records: at every key of 8192 rows or more where the tuner timed the default's
    config, within 10% of the key's fastest (the 8192-element rule it replaced: 17% behind at 65536
    rows of 1024 bf16, 16 warps against the winner's 4)."""
    ratios = [tuning.time_over_fastest(e, nk._fwd_default(e["key"])) for e in _large_one_pass("norm_fwd")]
    timed = [r for r in ratios if r is not None]
    assert len(timed) >= 10 and max(timed) <= 1.10, ratios


def test_the_untuned_backward_default_is_near_the_shipped_winners():
    """The one-pass backward's default rule against the H200's shipped tuning records: at every
    key of 8192 rows or more (each timed the default), within 10% of the key's fastest config
    (16 bits: PREFETCH at block_n / 512 warps; without it 5-48% behind)."""
    ratios = [tuning.time_over_fastest(e, nm._default(e["key"])) for e in _large_one_pass("norm_bwd")]
    assert len(ratios) >= 12 and None not in ratios and max(ratios) <= 1.10, ratios


_GATED: dict = {}


@torch.library.custom_op("tritonkit_tests::norm_bwd_gate", mutates_args=())
def _gate_inside_an_op(x: torch.Tensor) -> torch.Tensor:
    """Whether the backward's gate admits the config set aside, asked inside a custom op's kernel."""
    verdict = nm._TUNED["bwd", False].admit(_GATED["problem"], _GATED["config"])
    return torch.tensor(verdict.passed)


def test_the_backward_gate_takes_its_references_gradients_inside_a_custom_op(device):
    """The backward's tuning gate runs inside the op, and a call through ``torch.ops`` (torch.compile's
    graphs, opcheck) runs it where the dispatcher has turned autograd off: its reference's gradients
    (``_runtime.with_autograd``) come out there as outside, where inside they failed (on an H100:
    'element 0 of tensors does not require grad', every candidate rejected)."""
    g = generator(3)
    x = random_tensor((9, 50), F32, device, generator=g)
    w, b = (random_tensor((50,), F32, device, generator=g) for _ in range(2))
    problem = {"h": x, "grad_h": None, "weight": w, "bias": b, "rms": False}
    _GATED.update(problem=problem, config={"ROWS": 8, "num_warps": 4})
    assert nm._TUNED["bwd", False].admit(problem, _GATED["config"]).passed
    assert torch.ops.tritonkit_tests.norm_bwd_gate(x).item()


class _GateInABackward(torch.autograd.Function):
    """A backward that asks the norms' backward gate, as a backward's tuning on first use does."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _GATED["threads"].append(threading.get_ident())
        _GATED["verdict"] = nm._TUNED["bwd", False].admit(_GATED["problem"], _GATED["config"]).passed
        return grad


def test_the_backward_gate_runs_its_references_in_the_backward_s_own_thread(device):
    """A backward's gate runs its reference's gradients in the thread that runs the backward: on a GPU
    that is autograd's CUDA worker, and gradients taken in another thread queued for that worker while
    it waited for them (test_norm.py's gpu tests hung there)."""
    g = generator(5)
    x = random_tensor((9, 50), F32, device, generator=g)
    w, b = (random_tensor((50,), F32, device, generator=g) for _ in range(2))
    _GATED.update(
        problem={"h": x, "grad_h": None, "weight": w, "bias": b, "rms": False},
        config={"ROWS": 8, "num_warps": 4},
        threads=[],
    )
    seen = []
    real = nm._TUNED["bwd", False].reference

    def reference(problem):
        seen.append(threading.get_ident())
        return real(problem)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nm._TUNED["bwd", False], "reference", reference)
        leaf = x.clone().requires_grad_()
        _GateInABackward.apply(leaf).sum().backward()
    assert _GATED["verdict"] and seen and set(seen) == set(_GATED["threads"])
