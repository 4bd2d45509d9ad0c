"""The norms' tuning: every config a tuner may offer passes the accuracy gate on the real kernels,
the gate rejects a wrong result, and the tuner launches the fastest admitted config (a fake timer:
do_bench needs CUDA). The helpers come from test_norm.py."""

from __future__ import annotations

import json

import pytest
import torch

import test_norm
from test_norm import BF16, F32, _case
from tritonkit import tuning
from tritonkit._runtime import interpret
from tritonkit.ops.norm import norm as nm
from tritonkit.testing import check_against_reference

pytestmark = pytest.mark.norm
looped = test_norm.looped  # the fixture sending rows past 64 entries through the looped kernels


def _key(direction, n, rows, dtype=F32, *, rms=False, residual=False, weight=F32, bias=F32):
    params = nm._params_key(residual, torch.empty(0, dtype=weight) if weight else None,
                            torch.empty(0, dtype=bias) if bias and not rms else None, rms)
    return nm._tuning_key(direction, n, rows, dtype, params)


def _candidates(key):
    return nm._TUNERS[key["direction"], key["looped"]]._candidates(key)


# Rows of 96 forward (block of 128: BLOCK_M of 8 and more keep 8+ values a thread) and of 1000
# backward (h and dy: 4 and 8 warps), in a bucket of many rows so that no ROWS is pruned; rows of
# 1000 and 4097 forward also through the looped candidates, compiled for their length.
GATE_CASES = [("fwd", 96, 4096, {}), ("fwd", 96, 4096, {"rms": True, "residual": True}),
              ("bwd", 1000, 65536, {}),
              ("bwd", 1000, 65536, {"rms": True, "residual": True, "dtype": BF16, "weight": BF16}),
              ("fwd", 1000, 64, {"dtype": BF16, "bias": None}),
              # the looped candidates compiled for a row of several chunks and a ragged tail
              ("fwd", 4097, 4, {"rms": True, "residual": True})]


def _distinct_runs(candidates: list[dict]) -> list[dict]:
    """The candidates, but under the interpreter one of those that differ only in warps or eviction
    hints: what it ignores, so they run the same computation."""
    if not interpret():
        return candidates
    ignored = ("num_warps", "EVICT")
    return list({json.dumps({k: v for k, v in c.items() if k not in ignored}, sort_keys=True): c
                 for c in candidates}.values())


@pytest.mark.parametrize("direction, n, rows, options", GATE_CASES, ids=str)
def test_every_candidate_passes_the_gate(direction, n, rows, options, device):
    key = _key(direction, n, rows, **options)
    candidates = _candidates(key)
    assert len(candidates) >= 4, candidates  # the tuner has a real choice
    eps = 1e-5
    for config in _distinct_runs(candidates):
        assert nm._admit(key, n, eps, device, config).passed, config


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_every_looped_candidate_passes_the_gate(direction, looped, device):
    key = _key(direction, 200, 4096, rms=direction == "bwd", residual=True)
    assert key["looped"]
    candidates = _candidates(key)
    assert len(candidates) >= 3, candidates
    for config in _distinct_runs(candidates):
        assert nm._admit(key, 200, 1e-5, device, config).passed, config


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_gate_rejects_a_wrong_result(direction, monkeypatch, device):
    """A launch whose output is 1% off (y forward, dx backward) fails the gate; the same config
    passes with the real launch."""
    key = _key(direction, 96 if direction == "fwd" else 1000, 4096)
    n, config = (96, {"BLOCK_M": 16, "num_warps": 4}) if direction == "fwd" else (1000, {"ROWS": 8,
                                                                                         "num_warps": 4})
    assert nm._admit(key, n, 1e-5, device, config).passed
    launcher = nm._LAUNCHERS[direction, False]
    output = 3 if direction == "fwd" else 6  # y, or dx, among the launch arguments

    def off_by_a_percent(grid, *args, **meta):
        launcher(grid, *args, **meta)
        args[output].mul_(1.01)

    monkeypatch.setitem(nm._LAUNCHERS, (direction, False), off_by_a_percent)
    assert not nm._admit(key, n, 1e-5, device, config).passed


def fake_ms(config):
    """A fake timing under which more warps and fewer rows a program are faster, and PREFETCH and
    EVICT too."""
    return (1.0 + config.get("BLOCK_M", config.get("ROWS", 1)) / 100 - config["num_warps"] / 1000
            - config.get("PREFETCH", False) / 10000 - config.get("EVICT", False) / 100000)


@pytest.fixture
def tuned(monkeypatch, tmp_path):
    """Tuning as on a GPU with fresh tuners, a private cache and a fake timer; records launches."""
    monkeypatch.setattr(tuning, "_single_config", lambda: False)
    monkeypatch.setenv("TRITONKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(nm, "_chosen", {})
    for name, tuner in list(nm._TUNERS.items()):
        monkeypatch.setitem(nm._TUNERS, name, tuning.Tuner(tuner.name, tuner.configs, sources=tuner.sources,
                                                           default=tuner.default, prune=tuner.prune))
    monkeypatch.setattr(nm, "_time_ms", lambda run, config: fake_ms(config))
    launched = []
    for name, launcher in list(nm._LAUNCHERS.items()):
        def recording(grid, *args, _launcher=launcher, _name=name, **meta):
            launched.append((_name, meta))
            _launcher(grid, *args, **meta)
        monkeypatch.setitem(nm._LAUNCHERS, name, recording)
    return tmp_path / tuning.SUBDIR, launched


def test_the_op_launches_the_fastest_admitted_config(tuned, device):
    cache, launched = tuned
    kernel, reference, inputs, grad_inputs, grads = _case("add_layer_norm", (9, 1000), BF16, device, seed=3)
    kernel(*inputs)  # the forward alone: tuned, then launched
    fwd_launches = len(launched)
    check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)
    files = {path.name.split("-")[0]: json.loads(path.read_text()) for path in cache.iterdir()}
    assert sorted(files) == ["norm_bwd", "norm_fwd"]
    for direction, entry in ((d, files[f"norm_{d}"]) for d in ("fwd", "bwd")):
        admitted = [json.loads(c) for c, ms in entry["ms"].items() if ms is not None]
        assert len(admitted) >= 2 and not entry["rejected"], entry
        assert entry["config"] == min(admitted, key=fake_ms)
        # the op's own launch, after its tuning (the backward's gate runs forwards of its own)
        ours = [meta for (d, _), meta in (launched[:fwd_launches] if direction == "fwd" else launched)
                if d == direction][-1]
        expected = dict(entry["config"])
        evict = expected.pop("EVICT", False)  # launched as the loads' eviction hints
        assert {k: ours[k] for k in expected} == expected
        if direction == "fwd":
            assert (ours["STREAM"], ours["KEEP"]) == (("evict_first", "evict_last") if evict else ("", ""))


def test_inspect_takes_a_config_for_each_kernel():
    launches = nm._inspect_launches(False, True, False, (8192, 4096), BF16, {"BLOCK_M": 4, "ROWS": 16,
                                                                            "num_warps": 8})
    assert [(launch.meta["BLOCK_M"], launch.meta["num_warps"]) for launch in launches[:1]] == [(4, 8)]
    assert (launches[1].meta["ROWS"], launches[1].meta["num_warps"]) == (16, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("kind, shape", [("add_rms_norm", (4096, 4096)), ("layer_norm", (512, 65536))],
                         ids=str)
def test_real_tuning_picks_a_timed_winner_that_matches_the_reference(kind, shape, monkeypatch, tmp_path,
                                                                      device):
    """On the GPU, with an empty cache: each kernel tunes, its winner was admitted and timed, and
    the op's outputs and gradients pass the oracle."""
    monkeypatch.setenv("TRITONKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(nm, "_chosen", {})
    for name, tuner in list(nm._TUNERS.items()):
        monkeypatch.setitem(nm._TUNERS, name, tuning.Tuner(tuner.name, tuner.configs, sources=tuner.sources,
                                                           default=tuner.default, prune=tuner.prune))
    kernel, reference, inputs, grad_inputs, grads = _case(kind, shape, BF16, device, seed=21)
    check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)
    entries = [json.loads(path.read_text()) for path in (tmp_path / tuning.SUBDIR).iterdir()]
    assert sorted(e["tuner"] for e in entries) == (["norm_bwd", "norm_fwd"] if shape[1] <= 8192
                                                   else ["norm_bwd_looped", "norm_fwd_looped"])
    for entry in entries:
        assert entry["ms"][tuning._canonical(entry["config"])] is not None, entry


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_candidates_compile_together_for_both_problems(direction, monkeypatch, device):
    """The tuner's precompile step hands every candidate's launch, for the calibration problem and
    the real one, to one concurrent compile (which itself is a no-op under the interpreter)."""
    compiled = []
    monkeypatch.setattr(nm, "precompile", compiled.extend)
    n = 96 if direction == "fwd" else 1000
    kernel, reference, inputs, grad_inputs, grads = _case("add_rms_norm", (40, n), BF16, device, seed=9)
    x, residual, weight = inputs
    key = _key(direction, n, 40, BF16, rms=True, residual=True, weight=BF16)
    if direction == "fwd":
        real = lambda c: nm._fwd_launch_args(x, residual, weight, None, 1e-5, True, c)  # noqa: E731
    else:
        real = lambda c: nm._bwd_launch_args(grads[0], grads[1], x, weight, None, True, c)  # noqa: E731
    configs = _candidates(key)
    nm._precompile(key, n, device, real, configs)
    assert len(compiled) == 2 * len(configs)
    for launcher, grid, args, meta in compiled:  # args: tensors first, then the ints
        assert isinstance(args[0], torch.Tensor)
        assert launcher is nm._LAUNCHERS[direction, False] and grid[0] >= 1
        assert meta["num_warps"] in (2, 4, 8, 16) and meta["BLOCK_M"] >= 1


def test_a_call_seen_before_reuses_its_config(monkeypatch, device):
    """The chosen config is kept by call signature: a repeat skips the tuning key; the memo is
    cleared, not grown without end, past MAX_CHOSEN signatures."""
    monkeypatch.setattr(nm, "_chosen", {})
    monkeypatch.setattr(nm, "MAX_CHOSEN", 2)
    x = torch.randn(3, 40, device=device)
    torch.testing.assert_close(nm.rms_norm(x, (40,)), torch.nn.functional.rms_norm(x, (40,)))
    monkeypatch.setattr(nm, "_tuning_key", lambda *args: pytest.fail("the tuning key was rebuilt"))
    nm.rms_norm(x, (40,))
    monkeypatch.undo()
    monkeypatch.setattr(nm, "_chosen", {})
    monkeypatch.setattr(nm, "MAX_CHOSEN", 2)
    for rows in (1, 2, 3, 4, 5):
        nm.rms_norm(torch.randn(rows, 40, device=device), (40,))
        assert 1 <= len(nm._chosen) <= 2

