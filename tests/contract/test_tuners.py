"""The contract of every tuned kernel (``tuning.Tuned``), checked once for all of them on the problems
the registered ops really pose: the accuracy gate admits the candidates (one sampled per kind of
config under the interpreter; every one on the GPU), rejects a kernel that gets any one output
wrong, and the fastest admitted config is the one that launches.
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_ops import OPS, _forward_and_backward, _problem

from tritonkit import tuning
from tritonkit._launch import Launch
from tritonkit.ops import get_op


def _posed(name: str, device) -> list[tuple[tuning.Tuned, dict, dict]]:
    """(tuned kernel, key, problem) for each tuning lookup a forward and backward of ``name`` make
    at each of its interpreter shapes."""
    seen, choose = [], tuning.Tuned.choose

    def recording(self, key, problem, **options):
        key, problem = (key() if callable(key) else key), (problem() if callable(problem) else problem)
        seen.append((self, key, problem))
        return choose(self, key, problem, **options)

    tuning.forget_chosen()  # every call looks its config up
    # untuned (cached winners, else defaults): on a GPU, tuning each lookup while posing would time
    # every candidate of every kernel before the tests below run a single one. No launch runs: a
    # lookup comes before its launches, and what is asked depends on the shapes alone (each tuner's
    # calibration problem is seeded, made from the problem's shapes and layouts, never its values),
    # so the posing costs no kernel time (the tests below run the kernels themselves)
    with pytest.MonkeyPatch.context() as patched, tuning.disabled():
        patched.setattr(tuning.Tuned, "choose", recording)
        patched.setattr(Launch, "run", lambda self: None)
        for index in range(len(get_op(name).shape_list())):
            op, inputs, _, _ = _problem(name, device, seed=11, shape_index=index)
            _forward_and_backward(op, inputs)
    # each tuned kernel on one problem the op poses it (one key a kernel keeps this cheap): the one
    # whose candidates are of the most kinds
    richest = {}
    for tuned, key, problem in seen:
        kinds = len({_kind(c) for c in tuned.tuner._candidates(key)})
        if kinds > richest.get(id(tuned), (-1,))[0]:
            richest[id(tuned)] = (kinds, tuned, key, problem)
    return [entry[1:] for entry in richest.values()]


def _kind(config: dict) -> tuple:
    """What a config is, beyond its tile sizes: the kernel variant and the switches it sets."""
    return tuple(sorted((k, v) for k, v in config.items() if not isinstance(v, int) or isinstance(v, bool)))


def _sampled(tuned: tuning.Tuned, key: dict) -> list[dict]:
    """The key's default and the first candidate of each kind."""
    candidates = tuned.tuner._candidates(key)
    by_kind = {}
    for config in candidates:
        by_kind.setdefault(_kind(config), config)
    default = tuned.tuner.default(key)
    return [default, *(c for c in by_kind.values() if c != default)]


@pytest.fixture(scope="module")
def posed():
    """name -> the problems its tuned kernels are asked to choose for (computed once)."""
    device = "cpu" if tuning._single_config() else "cuda"
    return functools.cache(lambda name: _posed(name, device))


@pytest.mark.parametrize("name", OPS)
def test_the_gate_admits_a_sample_of_each_kind_of_candidate(name, posed):
    for tuned, key, problem in posed(name):
        for config in _sampled(tuned, key):
            verdict = tuned.admit(problem, config)
            assert verdict.passed, (tuned.tuner.name, key, config, str(verdict))


# Every candidate is a compile each: attention's are about a hundred, minutes in one test. The
# shards split each op's candidates so that the suite's workers share them.
GATE_SHARDS = 4


@pytest.mark.gpu
@pytest.mark.parametrize("shard", range(GATE_SHARDS))
@pytest.mark.parametrize("name", OPS)
def test_the_gate_admits_every_candidate(name, shard, posed):
    from triton.runtime.errors import PTXASError

    for tuned, key, problem in posed(name):
        default = tuned.tuner.default(key)
        for config in tuned.tuner._candidates(key)[shard::GATE_SHARDS]:
            try:
                verdict = tuned.admit(problem, config)
            except PTXASError:
                # ptxas itself crashed (it does on some specializations): tuning rejects the
                # config, but the default is the fallback and must compile
                assert config != default, (tuned.tuner.name, key, config)
                continue
            assert verdict.passed, (tuned.tuner.name, key, config, str(verdict))


def _spoiling(tuned: tuning.Tuned, wrong: str, written: dict):
    """``tuned.run`` that then adds 1000 to the first element of the output named ``wrong``. The
    kernel runs once, into ``written`` (empty at first); later calls, on the same calibration
    problem, copy its outputs from there: a run would write the same values again."""

    def run(problem, config):
        if not written:
            tuning.Tuned.run(tuned, problem, config)
            written.update({name: problem[name].clone() for name in _outputs(tuned, problem)})
        for name, value in written.items():
            problem[name].copy_(value)
        value = problem[wrong]
        value[(0,) * value.dim()] += 1000.0

    return run


def _outputs(tuned: tuning.Tuned, problem: dict) -> list[str]:
    return [name for name in tuned.outputs if problem.get(name) is not None]


def _calibrating_again(tuned: tuning.Tuned, calibration: dict):
    """``tuned.calibrate`` that gives ``calibration`` again, with fresh outputs for the gate to
    poison: the problem is seeded, so each call would make the same one again (attention's backward
    runs the forward and delta kernels to make it)."""
    outputs = _outputs(tuned, calibration)
    return lambda problem, config: (
        calibration | {name: torch.empty_like(calibration[name]) for name in outputs}
    )


@pytest.mark.parametrize("name", OPS)
def test_the_gate_rejects_a_kernel_that_gets_any_one_output_wrong(name, posed):
    for tuned, key, problem in posed(name):
        config = tuned.tuner.default(key)
        calibration, written = tuned.calibrate(problem, config), {}
        for wrong in tuned.outputs:
            if calibration.get(wrong) is None or not calibration[wrong].numel():
                continue  # an output this kind of problem has not
            with pytest.MonkeyPatch.context() as patched:
                patched.setattr(tuned, "calibrate", _calibrating_again(tuned, calibration))
                patched.setattr(tuned, "run", _spoiling(tuned, wrong, written))
                assert not tuned.admit(problem, config).passed, (tuned.tuner.name, wrong)


@pytest.mark.parametrize("name", OPS)
def test_the_fastest_admitted_config_launches(name, posed, monkeypatch, tmp_path):
    """Tuning as on a GPU over the sampled candidates with a fake timer and a fake gate (the real
    one's verdicts on these candidates are the test above's) that rejects the fastest: the winner
    is the fastest of those admitted, it is remembered, and the next call with the key launches it."""
    problems = posed(name)  # posed as the interpreter poses them, before tuning is switched on
    monkeypatch.setattr(tuning, "_single_config", lambda: False)
    monkeypatch.setenv("TRITONKIT_CACHE_DIR", str(tmp_path))
    for tuned, key, problem in problems:
        sample = _sampled(tuned, key)
        monkeypatch.setattr(tuned.tuner, "_candidates", lambda key, sample=sample: sample)
        monkeypatch.setattr(tuned, "_chosen", {})
        fake = {tuning._canonical(c): 1.0 + i for i, c in enumerate(reversed(sample))}  # the last fastest
        monkeypatch.setattr(
            tuned, "time_ms", lambda problem, config, fake=fake: fake[tuning._canonical(config)]
        )
        by_speed = sorted(sample, key=lambda c: fake[tuning._canonical(c)])
        rejected = by_speed[0] if len(sample) > 1 else None
        monkeypatch.setattr(tuned, "admit", lambda problem, config, rejected=rejected: config != rejected)
        with tuning.retuning():
            config, final = tuned.choose(key, problem)
        fastest = by_speed[1] if rejected is not None else by_speed[0]
        assert final and config == fastest, (tuned.tuner.name, key)
        assert tuned.choose(key, problem) == (fastest, True)
        tuned.tuner.forget()


def test_every_tuned_kernel_is_reached_by_a_registered_op(posed):
    reached = {id(tuned) for name in OPS for tuned, _, _ in posed(name)}
    assert {tuned.tuner.name for tuned in tuning.TUNED if id(tuned) not in reached} == set()
