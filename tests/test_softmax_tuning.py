"""softmax's tuning: the accuracy gate run on the real kernels (a config that skips entries never
passes), the tuner's choice and cache with a fake timer, one tuning per shape serving every named
variant, and which shapes get split-row candidates. Real tuning on the GPU is in test_softmax_hw.py.
The helpers and fixtures come from test_softmax.py."""

from __future__ import annotations

import json

import pytest

import test_softmax
import tritonkit.ops.softmax.configs as sk
import tritonkit.ops.softmax.softmax as sm
from test_softmax import BF16, F32, LOGS, _check, _inputs, _key
from tritonkit import tuning
from tritonkit._runtime import current_device, sm_count
from tritonkit.dtypes import NAME_OF
from tritonkit.testing import generator, random_tensor

pytestmark = pytest.mark.softmax
launches = test_softmax.launches  # the fixture recording each launch, shared


# ---------------------------------------------------------------- the accuracy gate with the real kernels

# On rows of 200 the one-pass kernel's BLOCK_N is 256; these configs cut it, so the kernel
# normalises only the first 64 or 128 entries and never writes the rest. The second passes the
# prune function (16 values a thread, 32 backward), so a tuner really offers it.
SHORT_TILE = {"variant": "one-pass", "BLOCK_M": 1, "BLOCK_N": 64, "num_warps": 4}
SHORT_TILE_UNPRUNED = {"variant": "one-pass", "BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4}
GATE_ROWS, GATE_N = 64, 200


def _gate_views(direction, dtype, layout, device):
    """(O, R, N) views of a 64 x 200 problem as the launcher builds them; content is irrelevant."""
    shape, dim = ((GATE_ROWS, GATE_N), 1) if layout == "rows" else ((GATE_N, GATE_ROWS), 0)
    tensors = [random_tensor(shape, dtype, device, generator=generator(i)) for i in range(3)]
    views = tuple(sm._as_3d(t, dim) for t in tensors[: 2 if direction == "fwd" else 3])
    assert sm._layout(views[0]) == layout
    return views


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("layout, dtype", [("rows", F32), ("cols", BF16)], ids=str)
@pytest.mark.parametrize("log", LOGS)
def test_gate_rejects_a_config_that_skips_entries(direction, layout, dtype, log, device):
    views = _gate_views(direction, dtype, layout, device)
    name = NAME_OF[dtype]
    key = _key(direction, GATE_N, layout, GATE_ROWS, dtype=f"{name}>{name}")
    assert not sm._prune(SHORT_TILE_UNPRUNED, key)
    for bad in (SHORT_TILE, SHORT_TILE_UNPRUNED):
        assert not sm._TUNED[direction].admit(sm._problem(direction, log, views), bad).passed, bad
    good = [
        sm._default(key),
        {**SHORT_TILE, "BLOCK_N": 256},
        sm._default({**key, "variant": "online"}),
        {**SHORT_TILE, "variant": "online"},
    ]  # the online kernel takes any chunk: 64 is fine
    assert [config["variant"] for config in good] == ["one-pass", "one-pass", "online", "online"]
    for config in good:
        assert sm._TUNED[direction].admit(sm._problem(direction, log, views), config).passed, config


def fake_ms(config):
    """A fake timing: fewer rows and warps a program are faster."""
    return 1.0 + config.get("BLOCK_M", 1) / 100 + config["num_warps"] / 1000


@pytest.fixture
def tuned(monkeypatch, tmp_path):
    """Tuning as on a GPU, with fresh tuners (also offered SHORT_TILE_UNPRUNED), a private cache, an
    empty memo, and a fake timer (do_bench needs CUDA) under which SHORT_TILE_UNPRUNED is by far the
    fastest. Returns the cache folder and the configs timed."""
    monkeypatch.setattr(tuning, "_single_config", lambda: False)
    monkeypatch.setenv("TRITONKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sm, "_plans", {})  # plans hold configs too
    timed = []

    def fake_time_ms(problem, config):
        timed.append(config)
        return 0.001 if config == SHORT_TILE_UNPRUNED else fake_ms(config)

    for direction, tuner in list(sm._TUNERS.items()):
        fresh = tuning.Tuner(
            tuner.name,
            [*tuner.configs, SHORT_TILE_UNPRUNED],
            sources=tuner.sources,
            default=tuner.default,
            prune=tuner.prune,
        )
        monkeypatch.setitem(sm._TUNERS, direction, fresh)
        monkeypatch.setattr(sm._TUNED[direction], "tuner", fresh)
        monkeypatch.setattr(sm._TUNED[direction], "_chosen", {})
        monkeypatch.setattr(sm._TUNED[direction], "time_ms", fake_time_ms)  # the injected timer
    return tmp_path / tuning.SUBDIR, timed


@pytest.mark.parametrize("log", LOGS)
def test_tuner_never_picks_the_fast_wrong_config(log, tuned, launches, device):
    cache, timed = tuned
    x, dy = _inputs((GATE_ROWS, GATE_N), F32, device, seed=45)
    _check(x, dy, log=log)
    assert SHORT_TILE_UNPRUNED not in timed and timed
    files = {path.name.split("-")[0]: path for path in cache.iterdir()}
    assert sorted(files) == ["softmax_bwd", "softmax_fwd"]
    bad = tuning._canonical(SHORT_TILE_UNPRUNED)
    for direction in ("fwd", "bwd"):
        entry = json.loads(files[f"softmax_{direction}"].read_text())
        assert entry["ms"][bad] is None and "does not match" in entry["rejected"][bad], direction
        admitted = [json.loads(c) for c, ms in entry["ms"].items() if ms is not None]
        assert len(admitted) > 1 and entry["config"] == min(admitted, key=fake_ms)
        # the memo holds the winner, and the op's own launch (the last, after tuning) used it
        key = {k: v for k, v in _key(direction, GATE_N, rows=GATE_ROWS).items() if k != "variant"}
        assert sm._TUNED[direction]._chosen[("auto", *key.values())] == entry["config"]
        assert [config for d, config in launches if d == direction][-1] == entry["config"]


def test_named_variants_read_the_one_tuning_of_their_shape(tuned, launches, device):
    """softmax, then each named variant on the same shape: one tuning per direction (every config
    timed once), and each variant launches the fastest admitted config of its own kind."""
    cache, timed = tuned
    x, dy = _inputs((GATE_ROWS, GATE_N), F32, device, seed=47)
    for variant in ("auto", "one-pass", "online"):
        _check(x, dy, variant=variant)
    assert sorted(path.name.split("-")[0] for path in cache.iterdir()) == ["softmax_bwd", "softmax_fwd"]
    admitted_total = 0
    for direction in ("fwd", "bwd"):
        entry = json.loads(next(cache.glob(f"softmax_{direction}-*")).read_text())
        admitted = [json.loads(c) for c, ms in entry["ms"].items() if ms is not None]
        admitted_total += len(admitted)
        ran = [config for d, config in launches if d == direction]
        for variant in ("one-pass", "online"):
            fastest = min((c for c in admitted if c["variant"] == variant), key=fake_ms)
            assert fastest in ran, (direction, variant)
    assert len(timed) == admitted_total  # each admitted config timed once, for all three variants


# ---------------------------------------------------------------- split-row candidates


def test_untuned_auto_splits_few_rows_and_rows_of_many_chunks(monkeypatch):
    """Past the one-pass limit the untuned default splits a row over several programs where the online
    kernel's one program a row would leave the GPU short of loads in flight (few rows, or rows of many
    chunks) or (SPLIT_ONE_WAVE) one wave of rows would read more than L2 holds for pass 2. A row's
    segments fit at once (two programs an SM) and hold four chunks or more, and it is the tuner's winner
    at the shapes tuned on the H200."""
    past = 2 * sk.ONE_PASS_MAX_BLOCK_N
    assert sm._default(_key("fwd", past, rows=sk.SPLIT_DEFAULT_MAX_ROWS))["variant"] == "split"
    # more rows: with SPLIT_ONE_WAVE, split while the online kernel's one wave of them reads more
    # than L2 holds again
    wave = sk.SPLIT_ONE_WAVE_MAX_ROWS
    for one_wave in (False, True):
        monkeypatch.setattr(sk, "SPLIT_ONE_WAVE", one_wave)
        for dtype in ("fp32>fp32", "bf16>bf16"):
            for direction in ("fwd", "bwd"):
                key = _key(direction, past, rows=wave, dtype=dtype)
                assert sk._pass_two_bytes(key) > sk.SPLIT_L2_BYTES
                assert sm._default(key)["variant"] == ("split" if one_wave else "online"), key
                assert sm._default(key | {"rows": 2 * wave})["variant"] == "online", key
    assert sm._default(_key("fwd", sk.SPLIT_DEFAULT_MIN_BLOCK_N, rows=1 << 20))["variant"] == "split"
    assert sm._default(_key("fwd", past, "cols", rows=1))["variant"] == "online"  # rows only
    programs = sm_count(current_device())
    for n in (past, 3 << 20, 12291808, 1 << 24):
        for dtype in ("fp32>fp32", "bf16>bf16"):
            for direction in ("fwd", "bwd"):
                key = _key(direction, n, rows=2, dtype=dtype)
                config = sm._default(key)
                assert config["variant"] == "split", config
                assert -(-n // config["SEGMENT"]) <= sk.SPLIT_DEFAULT_SEGMENTS_PER_SM * programs, config
                assert config["SEGMENT"] >= 4 * config["BLOCK_N"], config
                assert config["PER_SM"] * config["num_warps"] <= sk.SPLIT_MAX_WARPS_PER_SM, config
                low, high = sk.PER_THREAD["split"]
                assert low <= config["BLOCK_N"] / (32 * config["num_warps"]) <= high, config
    if programs == 132:  # the H200's winners (src/tritonkit/tuned/h200.json), prefetching pass 1
        winner = {"variant": "split", "SEGMENT": 8192, "BLOCK_N": 2048, "num_warps": 8, "PER_SM": 4}
        prefetching = {"PREFETCH": True}  # (not among the candidates those were tuned from)
        assert sm._default(_key("bwd", 524288, rows=512)) == winner | prefetching
        assert sm._default(_key("bwd", 131072, rows=2048, dtype="bf16>bf16")) == winner | prefetching | {
            "SEGMENT": 16384,
            "BLOCK_N": 4096,
        }


def test_split_is_tuned_only_for_long_rows_that_fit_at_once():
    """Split candidates: rows of two segments or more, all in flight at once, the segments together
    within SPLIT_L2_BYTES (backward: y and dy) and SPLIT_MAX_WARPS_PER_SM. (The untuned default,
    which the tuner keeps beside them whatever the prune says, holds any row: see
    test_softmax.py's test of it.)"""

    def split_candidates(n, dtype="bf16>bf16", direction="fwd"):
        key = {k: v for k, v in _key(direction, n, rows=2048, dtype=dtype).items() if k != "variant"}
        default = sm._default(key)
        return [c for c in sm._TUNERS[direction]._candidates(key) if c["variant"] == "split" and c != default]

    assert split_candidates(4096) == [] and split_candidates(8192)  # two segments of 4096 at least
    sms = sm_count(current_device())
    for n in (1 << 17, 1 << 22, 1 << 24):  # the untuned split config fits any row up to 2^24 at once
        default = sm._default({**_key("fwd", n, rows=2048), "variant": "split"})
        assert -(-n // default["SEGMENT"]) <= default["PER_SM"] * sms
    for n, dtype, direction in [
        (131072, "bf16>bf16", "fwd"),
        (524288, "fp32>fp32", "fwd"),
        (4194304, "fp32>fp32", "bwd"),
    ]:
        candidates = split_candidates(n, dtype, direction)
        assert candidates, (n, dtype, direction)
        tiles, element_bytes = (1 if direction == "fwd" else 2), (2 if "bf16" in dtype else 4)
        for config in candidates:
            programs = config["PER_SM"] * sms
            assert 2 <= n // config["SEGMENT"] <= programs
            assert config["PER_SM"] * config["num_warps"] <= sk.SPLIT_MAX_WARPS_PER_SM
            assert programs * config["SEGMENT"] * element_bytes * tiles <= sk.SPLIT_L2_BYTES
