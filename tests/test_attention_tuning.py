"""Attention's tuners: the candidates each keeps, the gates of the forward and of the backward's two
main kernels (every tile admitted, a wrong output or gradient rejected, rows that see no key held
to lse -inf, atomic dq judged), and the fastest admitted config is the one the op launches. The
checks every tuned kernel shares are in contract/test_tuners.py."""

from __future__ import annotations

import pytest
import torch

from test_attention import check, qkv
from tritonkit import testing, tuning
from tritonkit._launch import Launch
from tritonkit._runtime import interpret
from tritonkit.ops.attention import bwd as ab
from tritonkit.ops.attention import bwd_kernels as abk
from tritonkit.ops.attention import common as ac
from tritonkit.ops.attention import fwd as af

pytestmark = pytest.mark.attention


def _shapes(seq_q, seq_k, head_dim, dtype, group, device):
    """Unwritten q, k and v of a problem's shapes (4 batches, 8 key/value heads): what a tuning
    key and a calibration problem are made from."""
    q = torch.empty((4, 8 * group, seq_q, head_dim), dtype=_dtype_named(dtype), device=device)
    kv = torch.empty((4, 8, seq_k, head_dim), dtype=q.dtype, device=device)
    return q, kv


def _key(
    seq_q=4096,
    seq_k=4096,
    head_dim=64,
    mask="bottom-right",
    dtype="bf16",
    group=1,
    window=(-1, -1),
    softcap=0.0,
):
    q, k = _shapes(seq_q, seq_k, head_dim, dtype, group, "meta")
    return ac.tuning_key(q, k, _scores(mask, 0.125, window, softcap))


def _fwd_problem(key: dict, scores: ac.Scores, device) -> dict:
    """A forward problem whose tuning key is ``key`` (its calibration problem is what the gate runs)."""
    q, kv = _shapes(key["seq_q"], key["seq_k"], key["head_dim"], key["dtype"], key["group"], device)
    return af._problem(q, kv, kv, torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32), scores)


def _bwd_problem(kernel: str, key: dict, scores: ac.Scores, device) -> dict:
    """A problem of ``kernel`` ("dkdv" or "dq") whose tuning key is ``key`` (with "dq": "atomic",
    dK/dV accumulating dq)."""
    q, kv = _shapes(key["seq_q"], key["seq_k"], key["head_dim"], key["dtype"], key["group"], device)
    rows = q.new_empty(q.shape[:3], dtype=torch.float32)
    if kernel == "dq":
        return ab._problem(q, kv, kv, q, rows, rows, scores, dq=q)
    dq_acc = q.float() if key.get("dq") == "atomic" else None
    return ab._problem(
        q, kv, kv, q, rows, rows, scores, dk=kv, dv=kv, dq=q if dq_acc is not None else None, dq_acc=dq_acc
    )


def _scores(mask="bottom-right", scale=0.125, window=(-1, -1), softcap=0.0):
    return ac.Scores(scale, mask != "none", mask == "bottom-right", window, softcap)


def _dtype_named(name):
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _spoiling(monkeypatch, name: str, spoil) -> None:
    """Every launch named ``name`` runs, then ``spoil(its arguments)``."""
    run = Launch.run

    def spoiled(launch):
        run(launch)
        if launch.name == name:
            spoil(launch.args)

    monkeypatch.setattr(Launch, "run", spoiled)


def _fresh(monkeypatch, tuned: tuning.Tuned, configs=None, **options) -> None:
    """``tuned`` with a fresh tuner over ``configs`` (default: its own; ``options`` replace its
    default or prune) and an empty memo."""
    tuner = tuned.tuner
    options = {"default": tuner.default, "prune": tuner.prune} | options
    fresh = tuning.Tuner(tuner.name, configs or tuner.configs, sources=tuner.sources, **options)
    monkeypatch.setattr(tuned, "tuner", fresh)
    monkeypatch.setattr(tuned, "_chosen", {})


def _launched(monkeypatch) -> dict:
    """Launch name -> the meta of its last launch, from now on."""
    launched, run = {}, Launch.run
    monkeypatch.setattr(
        Launch, "run", lambda launch: (launched.__setitem__(launch.name, launch.meta), run(launch))[1]
    )
    return launched


def test_the_keys_powers_of_two_are_tritons():
    """The tuning key's buckets and BLOCK_D use a plain next power of two (triton's unwraps
    constexprs, microseconds a call): the same values, so the same keys as the shipped entries."""
    import triton

    assert [ac.next_power_of_2(n) for n in range(5000)] == [triton.next_power_of_2(n) for n in range(5000)]
    assert ac.next_power_of_2(2**31 + 1) == triton.next_power_of_2(2**31 + 1) == 2**32


# ---------------------------------------------------------------- forward


# Candidates a key keeps at least: a GPU prunes by its own shared memory (an H100 keeps 5 at D = 256)
MIN_CANDIDATES = 6 if interpret() else 5


def test_the_candidates_fit_and_the_default_is_among_them():
    for head_dim in (64, 128, 256):
        candidates = af._TUNER._candidates(_key(head_dim=head_dim))
        assert len(candidates) >= MIN_CANDIDATES, (head_dim, candidates)
        assert af._TUNER.default(_key(head_dim=head_dim)) in candidates
        assert all(c["BLOCK_M"] * head_dim / (32 * c["num_warps"]) <= af.MAX_TILE_VALUES for c in candidates)
    fewer = af._TUNER._candidates(_key(seq_q=16))  # 128 query rows a program > 2 x 16
    assert len(fewer) < len(af._TUNER._candidates(_key()))


# the distinct tiles (warps and stages change nothing in the interpreter), GQA, ragged blocks
@pytest.mark.parametrize("mask", ["bottom-right", "top-left", "none"])
def test_every_tile_passes_the_gate(mask, device):
    key = _key(seq_q=256, seq_k=512, head_dim=64, mask=mask, group=2)
    problem = _fwd_problem(key, _scores(key["mask"], 0.125), device)
    tiles = {(c["BLOCK_M"], c["BLOCK_N"]): c for c in af._TUNER._candidates(key)}
    assert len(tiles) >= 4, tiles
    for config in tiles.values():
        assert af._TUNED.admit(problem, config).passed, config


def test_gate_rejects_a_wrong_result(monkeypatch, device):
    """An output 10% off fails the gate (bf16 bounds: 4e-2 here), and so does a finite lse for a row
    that sees no key (Sq > Sk bottom-right: the first 32 rows see none)."""
    key = _key(seq_q=64, seq_k=32, head_dim=32)
    problem = _fwd_problem(key, _scores(key["mask"], 0.2), device)
    # (three stages, the default's: at two ptxas crashed compiling this kernel for sm_90 at D = 32, a
    # candidate the tuner logs and passes over)
    config = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
    calibration = af._TUNED.calibrate(problem, config)
    assert calibration["q"].shape[2] > calibration["k"].shape[2]
    assert af._TUNED.admit(problem, config).passed
    with monkeypatch.context() as patched:
        _spoiling(patched, "fwd", lambda args: args[3].mul_(1.1))  # o
        verdict = af._TUNED.admit(problem, config)
        assert not verdict.passed and verdict.name == "o", verdict
    with monkeypatch.context() as patched:
        _spoiling(
            patched, "fwd", lambda args: args[4].nan_to_num_(neginf=0.0)
        )  # the lse of rows that see no key
        verdict = af._TUNED.admit(problem, config)
        assert not verdict.passed and verdict.name == "lse", verdict


# ---------------------------------------------------------------- backward


@pytest.mark.parametrize("kernel", abk.KERNELS)
def test_backward_candidates_fit_and_the_default_is_among_them(kernel):
    tuner = ab._TUNERS[kernel]
    held = abk.HELD[kernel]
    for head_dim in (64, 128, 256):
        candidates = tuner._candidates(_key(head_dim=head_dim))
        assert len(candidates) >= MIN_CANDIDATES, (head_dim, candidates)
        assert tuner.default(_key(head_dim=head_dim)) in candidates
        for c in candidates[:-1]:  # the last may be the default, which is kept whatever prune says
            step = c["BLOCK_M"] + c["BLOCK_N"] - c[held]
            values = (2 * c[held] * head_dim + 2 * c[held] * step) / (32 * c["num_warps"])
            assert values <= abk.MAX_TILE_VALUES[kernel], c
    short = _key(seq_q=16, seq_k=16)  # held tiles past 2 x 16 rows go
    assert all(c[held] <= 32 for c in tuner._candidates(short)[:-1])


@pytest.mark.gpu  # every tile: the contract samples each kind of tile on the CPU
@pytest.mark.parametrize("kernel", abk.KERNELS)
def test_every_backward_tile_passes_the_gate(kernel, device):
    """The distinct tiles a ragged GQA problem admits (warps and stages change nothing in the
    interpreter), causal bottom-right: each kernel's gradients against the float64 reference."""
    key = _key(seq_q=48, seq_k=80, head_dim=32, group=2)
    problem = _bwd_problem(kernel, key, _scores(key["mask"], 0.2), device)
    tiles = {(c["BLOCK_M"], c["BLOCK_N"]): c for c in ab._TUNERS[kernel]._candidates(key)}
    assert len(tiles) >= 4, tiles
    for config in tiles.values():
        verdict = ab._TUNED[kernel].admit(problem, config)
        assert verdict.passed, (config, verdict)


@pytest.mark.parametrize("kernel", abk.KERNELS)
def test_backward_gate_rejects_a_wrong_gradient(kernel, monkeypatch, device):
    """A gradient 10% off fails the gate; the other kernel's is not what it judges."""
    key = _key(seq_q=40, seq_k=24, head_dim=32, mask="top-left")
    scores = _scores(key["mask"], 0.2)
    config = dict(abk.INTERPRETER_CONFIG)
    other = "dq" if kernel == "dkdv" else "dkdv"
    problem, other_problem = (_bwd_problem(name, key, scores, device) for name in (kernel, other))
    assert ab._TUNED[kernel].admit(problem, config).passed
    _spoiling(
        monkeypatch, "bwd dk dv" if kernel == "dkdv" else "bwd dq", lambda args: args[6].mul_(1.1)
    )  # dk, or dq
    verdict = ab._TUNED[kernel].admit(problem, config)
    assert not verdict.passed and verdict.name == ("dk" if kernel == "dkdv" else "dq")
    assert ab._TUNED[other].admit(other_problem, config).passed


@pytest.mark.slow
def test_tuning_the_atomic_backward_leaves_dq_alone(monkeypatch, tmp_path, device):
    """deterministic=False while its dK/dV kernel is tuned: the candidates' timing runs (real runs,
    twice each, every one adding into the call's dq accumulator) must not reach the call's dq."""
    monkeypatch.setattr(tuning, "_single_config", lambda: False)
    monkeypatch.setattr(ab, "sm90_takes", lambda *args, **kwargs: False)  # the Triton kernels, on sm_90 too
    monkeypatch.setenv("TRITONKIT_CACHE_DIR", str(tmp_path))
    # the forward as if its tuning were cached (its interpreter tile): only dK/dV's tuning is under
    # test, and the forward's own (a gate run and two timed runs) would add nothing to it
    monkeypatch.setattr(af._TUNED, "_chosen", {})
    monkeypatch.setattr(af._TUNED, "entry", lambda key, problem: {"config": dict(af.INTERPRETER_CONFIG)})
    small = [{"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": stages} for stages in (2, 3)]
    _fresh(monkeypatch, ab._TUNED["dkdv"], small)  # the kernel under test: two candidates timed
    _fresh(monkeypatch, ab._TUNED["dq"], small[:1])
    monkeypatch.setattr(tuning, "median_ms", lambda call: (call(), call(), 1.0)[-1])  # as on a GPU, twice
    timed, time_ms = [], ab._TUNED["dkdv"].time_ms
    monkeypatch.setattr(
        ab._TUNED["dkdv"],
        "time_ms",
        lambda problem, config: (timed.append(config), time_ms(problem, config))[1],
    )
    q, k, v = qkv(1, 2, 1, 20, 33, 32, torch.bfloat16, device, seed=10)
    check(q, k, v, causal=True, deterministic=False)
    assert timed, "the dK/dV tuner timed no candidate"


@pytest.mark.parametrize("causal, bottom_right", [(False, True), (True, False), (True, True)])
def test_the_backward_gates_reference_is_finite_and_zero_where_rows_see_no_key(causal, bottom_right):
    """The gates' reference gradients (autograd through the reference, in float64): no NaN from the
    masked softmax, and a zero dq for rows that see no key (Sq > Sk bottom-right), so that a
    kernel right there is admitted; GQA, ragged lengths."""
    q, k, v = (t.double() for t in qkv(2, 4, 2, 23, 17, 16, torch.float32, "cpu", seed=21))
    do = torch.randn(q.shape, dtype=torch.float64, generator=testing.generator(22))
    grads = ab._gradients_reference(
        ab._problem(q, k, v, do, None, None, ac.Scores(0.3, causal, bottom_right))
    )
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert {name: g.shape for name, g in grads.items()} == {"dq": q.shape, "dk": k.shape, "dv": v.shape}
    blind = 23 - 17 if causal and bottom_right else 0
    assert torch.equal(grads["dq"][:, :, :blind], torch.zeros_like(grads["dq"][:, :, :blind]))


@pytest.mark.parametrize(
    "mask, window", [("none", (9, 4)), ("bottom-right", (20, -1))], ids=["window", "causal"]
)
def test_windowed_soft_capped_tiles_pass_the_gates(mask, window, device):
    """The gates of the forward and of both backward kernels with a window and a soft cap (the
    calibration problem's window cuts inside its blocks): tiles of two sizes each."""
    key = _key(seq_q=48, seq_k=80, head_dim=32, group=2, mask=mask, window=window, softcap=3.0)
    assert key["window"] == ("left+right" if window[1] >= 0 else "left") and key["softcap"]
    scores = _scores(mask, 0.2, window, 3.0)
    for tile in ((16, 16), (32, 64)):
        config = {"BLOCK_M": tile[0], "BLOCK_N": tile[1], "num_warps": 4, "num_stages": 2}
        assert af._TUNED.admit(_fwd_problem(key, scores, device), config).passed, config
        for kernel in abk.KERNELS:
            verdict = ab._TUNED[kernel].admit(_bwd_problem(kernel, key, scores, device), config)
            assert verdict.passed, (kernel, config, verdict)


def test_the_atomic_dq_gate_judges_dq_too(monkeypatch, device):
    """With dq accumulated by the dK/dV kernel, its gate compares dq as well as dk and dv: a dq 10%
    off fails it."""
    key = _key(seq_q=40, seq_k=24, head_dim=32, mask="top-left") | {"dq": "atomic"}
    problem = _bwd_problem("dkdv", key, _scores("top-left", 0.2), device)
    config = dict(abk.INTERPRETER_CONFIG)
    assert ab._TUNED["dkdv"].admit(problem, config).passed
    _spoiling(monkeypatch, "bwd dk dv", lambda args: args[8].mul_(1.1))  # the fp32 dq accumulator
    verdict = ab._TUNED["dkdv"].admit(problem, config)
    assert not verdict.passed and verdict.name == "dq"


# ---------------------------------------------------------------- untuned tiles against the records

# the most a Triton attention kernel's untuned tile may run over an H200 record's fastest, by
# (tuner, head dim, dq by atomics), and how many records each group holds at least
RECORD_BOUNDS = {
    ("attention_fwd", 128, False): 1.12,
    ("attention_fwd", 64, False): 1.40,
    ("attention_bwd_dkdv", 128, False): 3.10,  # (the fixed tiles: every faster one spills somewhere)
    ("attention_bwd_dkdv", 128, True): 1.08,
    ("attention_bwd_dkdv", 64, False): 2.50,
    ("attention_bwd_dkdv", 64, True): 1.30,
    ("attention_bwd_dq", 128, False): 1.05,
    ("attention_bwd_dq", 64, False): 1.06,
}


def test_untuned_tiles_are_near_each_records_fastest(monkeypatch):
    """The forward's and the backward's untuned tiles at D = 64 and 128 against the H200's shipped
    tuning records (every candidate timed at each key): each record's default was timed and lies
    within its group's bound of the fastest; on average they beat the fixed tiles they replaced
    (1.6-2.6x the fastest on average in the backward) by more than 1.3x at D = 128."""
    for module in (af, abk):
        monkeypatch.setattr(module, "interpret", lambda: False)
    fixed = {  # the fixed tiles replaced: 128 x 64 at 8 warps, and the backward's 2-stage tiles
        "attention_fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
        "attention_bwd_dkdv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        "attention_bwd_dq": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    }
    gains, groups = [], set()
    for tuner in fixed:
        for entry in tuning.shipped_records(tuner):
            key = entry["key"]
            if key["head_dim"] not in (64, 128):
                continue
            atomic = key.get("dq") == "atomic"
            if tuner == "attention_fwd":
                tile = af._default(key)
            else:
                tile = abk.default_config(key["head_dim"], atomic)[tuner.rsplit("_", 1)[1]]
            ratio = tuning.time_over_fastest(entry, tile)
            group = (tuner, key["head_dim"], atomic)
            groups.add(group)
            assert ratio <= RECORD_BOUNDS[group], (key, tile, ratio)
            if key["head_dim"] == 128 and (before := tuning.time_over_fastest(entry, fixed[tuner])):
                gains.append(before / ratio)
    assert groups == set(RECORD_BOUNDS) and sum(gains) / len(gains) > 1.3
