"""Accuracy-gated autotuning: the gate, the choice, the memo and the on-disk cache.

No real kernels: a fake "kernel" sums a list in blocks, one config skips its last block (fastest,
wrong), and the timings are a table. The CPU suite runs under the interpreter, where tuning is off;
the ``tuning_on`` fixture turns off the interpreter's single-config mode for this module alone.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from tritonkit import kernel_sources, tuning

pytestmark = pytest.mark.tuning

KEY = {"N": 64, "dtype": "fp32"}
DEFAULT = {"BLOCK": 16, "SKIP_TAIL": False, "num_warps": 4}
CONFIGS = [
    {"BLOCK": 8, "SKIP_TAIL": False, "num_warps": 4},
    {"BLOCK": 16, "SKIP_TAIL": False, "num_warps": 4},
    {"BLOCK": 32, "SKIP_TAIL": False, "num_warps": 8},
    {"BLOCK": 32, "SKIP_TAIL": True, "num_warps": 8},  # skips work: the fastest, and wrong
]
# ms per config index: the skipping config is fastest, then BLOCK 16, which should win
TIMES = [3.0, 1.0, 2.0, 0.5]
VALUES = [float(i % 7 + 1) for i in range(KEY["N"])]  # never zeros: a skipped block changes the sum


class FakeKernel:
    """admit/time_ms for CONFIGS; records which configs each was called with."""

    def __init__(self, times=TIMES, raise_in_admit=(), raise_in_time=()):
        self.times, self.raise_in_admit, self.raise_in_time = times, raise_in_admit, raise_in_time
        self.admitted: list[dict] = []
        self.timed: list[dict] = []

    def run(self, config: dict) -> float:
        blocks = [VALUES[i : i + config["BLOCK"]] for i in range(0, len(VALUES), config["BLOCK"])]
        return sum(sum(b) for b in (blocks[:-1] if config["SKIP_TAIL"] else blocks))

    def admit(self, config: dict) -> bool:
        self.admitted.append(config)
        if CONFIGS.index(config) in self.raise_in_admit:
            raise RuntimeError("out of resources: shared memory, Required: 300000")
        return abs(self.run(config) - sum(VALUES)) <= 1e-6

    def time_ms(self, config: dict) -> float:
        self.timed.append(config)
        if CONFIGS.index(config) in self.raise_in_time:
            raise RuntimeError("illegal memory access")
        return self.times[CONFIGS.index(config)]

    @property
    def calls(self) -> int:
        return len(self.admitted) + len(self.timed)


def make_tuner(name="fake", configs=CONFIGS, sources=("kernel v1",), prune=None) -> tuning.Tuner:
    return tuning.Tuner(name, configs, sources=sources, default=lambda key: DEFAULT, prune=prune)


def tune(tuner: tuning.Tuner, fake: FakeKernel, key=KEY) -> dict:
    return tuner.config(key, admit=fake.admit, time_ms=fake.time_ms)


def cache_files(cache: Path) -> list[Path]:
    return sorted(cache.iterdir()) if cache.exists() else []


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """A private cache directory per test; returns the folder the tuning files go in."""
    monkeypatch.setenv("TRITONKIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tuning"


@pytest.fixture
def tuning_on(monkeypatch):
    """The seam: leave the interpreter's single-config mode, as on a GPU."""
    monkeypatch.setattr(tuning, "_single_config", lambda: False)


# ---------------------------------------------------------------- choosing


def test_fastest_admitted_config_wins(tuning_on, cache, caplog):
    fake = FakeKernel()
    with caplog.at_level(logging.INFO, logger="tritonkit"):
        assert tune(make_tuner(), fake) == CONFIGS[1]
    assert fake.admitted == CONFIGS
    assert CONFIGS[3] not in fake.timed  # the skipping config is never timed
    [path] = cache_files(cache)
    assert path.name.startswith("fake-") and len(path.stem) == len("fake-") + tuning.NAME_HASH_CHARS
    entry = json.loads(path.read_text())
    assert entry["config"] == CONFIGS[1]
    assert entry["format"] == tuning.FORMAT and entry["key"] == KEY and entry["tuner"] == "fake"
    assert entry["ms"][tuning._canonical(CONFIGS[3])] is None
    assert list(entry["rejected"]) == [tuning._canonical(CONFIGS[3])]
    [line] = [r.getMessage() for r in caplog.records if "tuned fake" in r.getMessage()]
    assert "1.0000 ms" in line and "1 of 4 configs rejected" in line


def test_raising_configs_are_rejected_not_fatal(tuning_on, cache):
    # BLOCK 16 fails to compile and BLOCK 32 crashes while timed: BLOCK 8 is the one left
    fake = FakeKernel(raise_in_admit=(1,), raise_in_time=(2,))
    assert tune(make_tuner(), fake) == CONFIGS[0]
    rejected = json.loads(cache_files(cache)[0].read_text())["rejected"]
    assert "out of resources" in rejected[tuning._canonical(CONFIGS[1])]
    assert "illegal memory access" in rejected[tuning._canonical(CONFIGS[2])]


def test_no_admitted_config_raises_with_every_reason(tuning_on, cache):
    fake = FakeKernel(raise_in_admit=(0, 1), raise_in_time=(2,))
    with pytest.raises(RuntimeError) as raised:
        tune(make_tuner(), fake)
    message = str(raised.value)
    assert "'fake'" in message and "'N': 64" in message
    assert "out of resources" in message and "illegal memory access" in message
    assert "does not match the reference" in message  # the skipping config
    assert cache_files(cache) == []


def test_non_finite_time_rejects_the_config(tuning_on):
    fake = FakeKernel(times=[float("nan"), 1.0, 2.0, 0.5])  # first, where min() would keep a NaN
    assert tune(make_tuner(), fake) == CONFIGS[1]


def test_pruned_configs_are_never_run(tuning_on):
    tuner = make_tuner(prune=lambda config, key: config["BLOCK"] < key["N"] // 4)  # drops BLOCK 8
    fake = FakeKernel(times=[0.1, 1.0, 2.0, 0.5])  # BLOCK 8 would win
    assert tune(tuner, fake) == CONFIGS[1]
    assert fake.admitted == CONFIGS[1:] and CONFIGS[0] not in fake.timed


def test_default_is_always_a_candidate(tuning_on):
    # pruning everything leaves the default, which still has to pass the gate
    fake = FakeKernel()
    assert tune(make_tuner(prune=lambda config, key: True), fake) == DEFAULT
    assert fake.admitted == [DEFAULT]
    # a default outside the config list is tried too, after the kept configs
    outside = {"BLOCK": 64, "SKIP_TAIL": False, "num_warps": 4}
    tuner = tuning.Tuner("outside", CONFIGS[:1], sources=("v1",), default=lambda key: outside)
    admitted = []

    def admit(config):
        admitted.append(config)
        return True

    assert tuner.config(KEY, admit=admit, time_ms=lambda c: 0.5 if c == outside else 1.0) == outside
    assert admitted == [CONFIGS[0], outside]


def test_wrong_default_raises(tuning_on):
    # every candidate, the default included, fails the gate: a kernel bug, reported with the reasons
    wrong = {"BLOCK": 32, "SKIP_TAIL": True, "num_warps": 8}
    tuner = tuning.Tuner("wrong", [wrong], sources=("v1",), default=lambda key: wrong)
    with pytest.raises(RuntimeError, match="does not match the reference"):
        tuner.config(KEY, admit=FakeKernel().admit, time_ms=FakeKernel().time_ms)


def test_entry_holds_every_timing_and_fastest_picks_within_a_subset(tuning_on):
    tuner, fake = make_tuner(), FakeKernel()
    entry = tuner.entry(KEY, admit=fake.admit, time_ms=fake.time_ms)
    assert entry["config"] == CONFIGS[1]
    assert {tuning._canonical(c): t for c, t in zip(CONFIGS, TIMES, strict=True)} | {
        tuning._canonical(CONFIGS[3]): None
    } == entry["ms"]
    # the fastest admitted 8-warp config is BLOCK 32 (the faster skipping one was rejected)
    assert tuning.fastest(entry, lambda c: c["num_warps"] == 8) == CONFIGS[2]
    assert tuning.fastest(entry, lambda c: c["BLOCK"] == 64) is None
    calls = fake.calls  # the subset is read from the same tuning: nothing runs again
    assert tuner.entry(KEY, admit=fake.admit, time_ms=fake.time_ms) is entry and fake.calls == calls


def test_precompile_sees_every_candidate_before_any_runs(tuning_on):
    fake, seen = FakeKernel(), []

    def precompile(candidates):
        assert fake.calls == 0
        seen.extend(candidates)

    tuner = make_tuner(prune=lambda config, key: config["BLOCK"] == 8)
    tuner.config(KEY, admit=fake.admit, time_ms=fake.time_ms, precompile=precompile)
    assert seen == CONFIGS[1:] == fake.admitted


def test_a_failing_precompile_only_costs_its_speed_up(tuning_on, caplog):
    def precompile(candidates):
        raise ValueError("no such kernel")

    with caplog.at_level(logging.INFO, logger="tritonkit"):
        assert (
            make_tuner().config(
                KEY, admit=FakeKernel().admit, time_ms=FakeKernel().time_ms, precompile=precompile
            )
            == CONFIGS[1]
        )
    assert "could not compile its candidates ahead (ValueError: no such kernel)" in caplog.text


def test_no_entry_where_tuning_cannot_run(monkeypatch):
    fake = FakeKernel()
    assert make_tuner().entry(KEY, admit=fake.admit, time_ms=fake.time_ms) is None  # the interpreter
    monkeypatch.setattr(tuning, "_single_config", lambda: False)
    with tuning.disabled():
        assert make_tuner().entry(KEY, admit=fake.admit, time_ms=fake.time_ms) is None
    assert fake.calls == 0


# ---------------------------------------------------------------- memo and disk


def test_second_call_uses_the_memo(tuning_on):
    tuner, fake = make_tuner(), FakeKernel()
    tune(tuner, fake)
    calls = fake.calls
    assert tune(tuner, fake) == CONFIGS[1]
    assert fake.calls == calls
    tune(tuner, fake, key={"N": 128, "dtype": "fp32"})  # another key is tuned on its own
    assert fake.calls > calls


def test_fresh_tuner_reads_the_disk_cache(tuning_on, cache):
    tune(make_tuner(), FakeKernel())
    # a new process: same name, sources and configs; timings that would now pick another config
    fake = FakeKernel(times=[0.1, 1.0, 2.0, 0.5])
    assert tune(make_tuner(), fake) == CONFIGS[1]
    assert fake.calls == 0
    assert len(cache_files(cache)) == 1


def _corrupt_garbage(path: Path) -> None:
    path.write_bytes(b"\xff\xfe\x00garbage\x80")


def _corrupt_truncated(path: Path) -> None:
    path.write_text(path.read_text()[:40])


def _edit(field, value):
    def corrupt(path: Path) -> None:
        entry = json.loads(path.read_text())
        entry[field] = value
        path.write_text(json.dumps(entry))

    return corrupt


def _corrupt_not_a_dict(path: Path) -> None:
    path.write_text("[1, 2]")


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_garbage,
        _corrupt_truncated,
        _corrupt_not_a_dict,
        _edit("format", tuning.FORMAT + 1),
        _edit("source_hash", "0" * 64),
        _edit("triton", "0.0.0"),
        _edit("device", "another GPU"),
        _edit("key", {"N": 65, "dtype": "fp32"}),
        _edit("config", {"BLOCK": 999}),
        _edit("ms", [1.0]),
        _edit("ms", {tuning._canonical(CONFIGS[1]): "fast"}),
        _edit("ms", {}),
        _edit("rejected", None),
    ],
    ids=lambda f: f.__name__,
)
def test_damaged_or_stale_entry_is_rebuilt(tuning_on, cache, corrupt):
    tune(make_tuner(), FakeKernel())
    [path] = cache_files(cache)
    corrupt(path)
    fake = FakeKernel(times=[0.1, 1.0, 2.0, 0.5])  # the rebuild picks BLOCK 8, telling it from the old
    assert tune(make_tuner(), fake) == CONFIGS[0]
    assert fake.admitted == CONFIGS
    assert cache_files(cache) == [path]
    assert json.loads(path.read_text())["config"] == CONFIGS[0]
    assert tune(make_tuner(), FakeKernel(times=[9.0] * 4)) == CONFIGS[0]  # and it reads back


def test_changed_source_or_configs_retune(tuning_on, cache):
    tune(make_tuner(sources=("kernel v1",)), FakeKernel())
    edited = FakeKernel(times=[0.1, 1.0, 2.0, 0.5])
    assert tune(make_tuner(sources=("kernel v2",)), edited) == CONFIGS[0]
    assert edited.calls > 0
    fewer = FakeKernel()
    assert tune(make_tuner(configs=CONFIGS[1:]), fewer) == CONFIGS[1]
    assert fewer.calls > 0
    assert len(cache_files(cache)) == 3
    assert tune(make_tuner(sources=("kernel v1",)), FakeKernel(times=[9.0] * 4)) == CONFIGS[1]


def test_new_triton_version_retunes(tuning_on, monkeypatch):
    import triton

    tune(make_tuner(), FakeKernel())
    monkeypatch.setattr(triton, "__version__", "99.0.0")
    fake = FakeKernel(times=[0.1, 1.0, 2.0, 0.5])
    assert tune(make_tuner(), fake) == CONFIGS[0]
    assert fake.calls > 0


def test_source_hash_reads_strings_functions_and_kernels():
    @functools.cache  # a decorator, as @triton.jit: not part of the hashed text
    def kernel(x):
        return x + 1

    text = "def kernel(x):\n    return x + 1\n"  # triton's JITFunction.src: dedented, from "def"
    assert make_tuner(sources=[kernel.__wrapped__]).source_hash == make_tuner(sources=[text]).source_hash
    jit_like = types.SimpleNamespace(src=text)  # triton's JITFunction, as on the GPU
    interpreted_like = types.SimpleNamespace(fn=kernel.__wrapped__)  # the interpreter's InterpretedFunction
    # the same hash under the interpreter as on the GPU: a CPU run can tell shipped configs are current
    assert make_tuner(sources=[jit_like]).source_hash == make_tuner(sources=[interpreted_like]).source_hash
    assert make_tuner(sources=["a", "bc"]).source_hash != make_tuner(sources=["ab", "c"]).source_hash
    assert make_tuner(sources=[text]).source_hash != make_tuner(sources=[text + " "]).source_hash


_CHILD = """
import json, sys, time
from pathlib import Path
from tritonkit import tuning

tuning._single_config = lambda: False
me, other = Path(sys.argv[1]), Path(sys.argv[2])
timed = []

def time_ms(config):
    if not timed:  # wait until the other process is tuning too, so that their writes race
        me.touch()
        deadline = time.monotonic() + 60
        while not other.exists():
            if time.monotonic() > deadline:
                sys.exit("the other process never started tuning")
            time.sleep(0.01)
    timed.append(config)
    time.sleep(0.05)
    return {8: 3.0, 16: 1.0, 32: 2.0}[config["BLOCK"]]

configs = [{"BLOCK": b} for b in (8, 16, 32)]
tuner = tuning.Tuner("race", configs, sources=["src"], default=lambda key: configs[0])
winner = tuner.config({"N": 64}, admit=lambda config: True, time_ms=time_ms)
print(json.dumps({"winner": winner, "timed": len(timed)}))
"""


def test_two_processes_tuning_at_once_leave_one_whole_file(tuning_on, tmp_path, cache):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = dict(os.environ, TRITONKIT_INTERPRET="1", PYTHONPATH=str(Path(tuning.__file__).parents[1]))
    flags = [tmp_path / "a", tmp_path / "b"]
    children = [
        subprocess.Popen(
            [sys.executable, str(script), str(me), str(other)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me, other in (flags, flags[::-1])
    ]
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        assert json.loads(out.splitlines()[-1]) == {"winner": {"BLOCK": 16}, "timed": 3}
    [path] = cache_files(cache)  # no stray temporary files
    assert path.suffix == ".json" and json.loads(path.read_text())["config"] == {"BLOCK": 16}
    configs = [{"BLOCK": b} for b in (8, 16, 32)]
    reader = tuning.Tuner("race", configs, sources=["src"], default=lambda key: configs[0])
    assert reader.config({"N": 64}, admit=pytest.fail, time_ms=pytest.fail) == {"BLOCK": 16}


# ---------------------------------------------------------------- when tuning is off


def test_interpreter_uses_the_default_and_leaves_the_disk_alone(monkeypatch, cache):
    monkeypatch.setattr(tuning, "interpret", lambda: True)
    fake = FakeKernel()
    assert tune(make_tuner(), fake) == DEFAULT
    assert fake.calls == 0 and cache_files(cache) == []
    assert not tuning.tuning_possible()
    # a cached winner other than the default is not read either
    with monkeypatch.context() as patch:
        patch.setattr(tuning, "interpret", lambda: False)
        patch.setattr(tuning, "tuning_possible", lambda: True)
        tune(make_tuner(), FakeKernel(times=[0.1, 1.0, 2.0, 0.5]))
    assert tune(make_tuner(), fake) == DEFAULT and fake.calls == 0


def test_tuning_impossible_uses_default_or_a_cached_winner(tuning_on, monkeypatch, cache):
    tune(make_tuner(), FakeKernel(times=[0.1, 1.0, 2.0, 0.5]))  # caches BLOCK 8 for KEY
    monkeypatch.setattr(tuning, "tuning_possible", lambda: False)
    fake = FakeKernel()
    assert tune(make_tuner(), fake, key={"N": 128, "dtype": "fp32"}) == DEFAULT
    assert tune(make_tuner(), fake) == CONFIGS[0]
    assert fake.calls == 0 and len(cache_files(cache)) == 1


def test_disabled_turns_tuning_off(tuning_on, cache):
    assert tuning.tuning_possible()
    tuner, fake = make_tuner(), FakeKernel()
    with tuning.disabled():
        with tuning.disabled():
            assert not tuning.tuning_possible()
        assert not tuning.tuning_possible()
        assert tune(tuner, fake) == DEFAULT
        assert fake.calls == 0 and cache_files(cache) == []
    assert tuning.tuning_possible()
    assert tune(tuner, fake) == CONFIGS[1]


def test_torch_compile_tracing_turns_tuning_off(tuning_on, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not tuning.tuning_possible()


def test_unwritable_cache_keeps_the_winner_in_memory(tuning_on, tmp_path, monkeypatch, caplog):
    if os.geteuid() == 0:  # root ignores permissions: put the cache under a regular file instead
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        monkeypatch.setenv("TRITONKIT_CACHE_DIR", str(blocker / "cache"))
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        monkeypatch.setenv("TRITONKIT_CACHE_DIR", str(locked))
    tuner, fake = make_tuner(), FakeKernel()
    with caplog.at_level(logging.WARNING, logger="tritonkit"):
        assert tune(tuner, fake) == CONFIGS[1]
        assert tune(tuner, fake, key={"N": 128, "dtype": "fp32"}) == CONFIGS[1]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot write the tuning cache" in warnings[0].getMessage()
    calls = fake.calls
    assert tune(tuner, fake) == CONFIGS[1] and fake.calls == calls
    assert [p.name for p in tmp_path.rglob("*.tmp")] == []


def test_failed_write_leaves_no_temporary_file(tuning_on, cache, monkeypatch, caplog):
    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(tuning.os, "replace", refuse)
    with caplog.at_level(logging.WARNING, logger="tritonkit"):
        assert tune(make_tuner(), FakeKernel()) == CONFIGS[1]
    assert "disk full" in caplog.text
    assert cache.is_dir() and cache_files(cache) == []


def test_entry_is_synced_under_a_temporary_name_before_it_takes_the_final_one(tuning_on, cache, monkeypatch):
    seen_at_fsync = []
    real_fsync = os.fsync

    def fsync(fd):
        seen_at_fsync.append([p.suffix for p in cache_files(cache)])
        real_fsync(fd)

    monkeypatch.setattr(tuning.os, "fsync", fsync)
    tune(make_tuner(), FakeKernel())
    assert seen_at_fsync == [[".tmp"]]  # only the temporary file exists while it is synced
    assert [p.suffix for p in cache_files(cache)] == [".json"]


# ---------------------------------------------------------------- moving a cache between machines


def test_export_then_import_into_an_empty_cache(tuning_on, cache, tmp_path, monkeypatch):
    tune(make_tuner(), FakeKernel())
    tune(make_tuner(), FakeKernel(), key={"N": 128, "dtype": "fp32"})
    bundle = tmp_path / "h200-tuning.json"
    assert tuning.export_cache(bundle) == 2
    assert tuning.export_cache(tmp_path / "other.json", device="another GPU") == 0
    monkeypatch.setenv("TRITONKIT_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert tuning.import_cache(bundle) == 2
    fake = FakeKernel(times=[0.1, 1.0, 2.0, 0.5])  # would pick another config if it tuned
    assert tune(make_tuner(), fake) == CONFIGS[1] and fake.calls == 0


@pytest.mark.parametrize(
    "content", ["not json", '{"format": 1}', '{"format": 1, "entries": [{"format": 1}]}', "[1, 2]"]
)
def test_import_refuses_what_is_not_an_export(tmp_path, content):
    bundle = tmp_path / "bundle.json"
    bundle.write_text(content)
    with pytest.raises(ValueError, match="tuning (export|entry)"):
        tuning.import_cache(bundle)
    assert not (tmp_path / "cache" / "tuning").exists()  # nothing half-imported


@pytest.mark.parametrize(
    "spoil",
    [
        lambda e: e.pop("ms"),
        lambda e: e.update(ms={"{}": "fast"}),
        lambda e: e.update(key="x"),
        lambda e: e.update(rejected=[]),
        lambda e: e.update(error={"{}": None}),
    ],
    ids=["no ms", "a time as text", "a key as text", "rejected a list", "an error of None"],
)
def test_import_refuses_an_entry_tune_show_could_not_print(tmp_path, spoil):
    """An imported entry lacking what the tuner writes (every config's time, rejection and error)
    was written into the cache, and every later ``tune --show`` ended in a traceback."""
    entry = dict(tuning.shipped_exports()["h200.json"][0])
    spoil(entry)
    bundle = tmp_path / "bundle.json"
    bundle.write_text(json.dumps({"format": tuning.FORMAT, "entries": [entry]}))
    with pytest.raises(ValueError, match="entry 0 is not a format-1 tuning entry"):
        tuning.import_cache(bundle)


def test_entry_keeps_the_errors_a_comparison_reports_and_tune_prints_them(tuning_on):
    from tritonkit.cli_tune import format_tuning
    from tritonkit.testing import Comparison

    fake = FakeKernel()

    def admit(config):  # as the ops' gates do: the oracle's comparison, not a bare bool
        error = abs(fake.run(config) - sum(VALUES))
        return Comparison("output", err_kernel=error + 1e-9, err_torch=1e-9, tolerance=1e-6)

    entry = make_tuner().entry(KEY, admit=admit, time_ms=fake.time_ms)
    skipping, winner = tuning._canonical(CONFIGS[3]), tuning._canonical(CONFIGS[1])
    assert entry["config"] == CONFIGS[1]
    assert entry["rejected"] == {skipping: "output does not match the reference"}
    assert entry["error"][skipping] > 1 and entry["error"][winner] == pytest.approx(1e-9)
    text = format_tuning([{"tuner": "fake", "key": KEY} | entry]).splitlines()
    assert text[0].startswith("fake {'N': 64") and "1000.0 us" in text[1] and "err 1.00e-09" in text[1]
    assert text[-1].startswith(f"  rejected   {skipping}: output does not match") and "(err " in text[-1]


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """An empty folder of shipped exports in place of the package's; returns it."""
    folder = tmp_path / "tuned"
    folder.mkdir()
    monkeypatch.setattr(tuning, "SHIPPED_DIR", folder)
    tuning._shipped.cache_clear()
    yield folder
    tuning._shipped.cache_clear()


def test_shipped_configs_are_used_where_the_cache_has_none(tuning_on, cache, shipped, monkeypatch):
    tune(make_tuner(), FakeKernel(times=[0.1, 1.0, 2.0, 0.5]))  # tuned "on the H200": BLOCK 8 wins
    tuning.export_cache(shipped / "h200.json")
    for path in cache_files(cache):
        path.unlink()
    (shipped / "other.json").write_text("{not an export")  # a broken file is skipped with a warning
    tuning._shipped.cache_clear()
    fake = FakeKernel()  # tuning here would pick BLOCK 16
    assert tune(make_tuner(), fake) == CONFIGS[0] and fake.calls == 0
    assert cache_files(cache) == []  # shipped entries are read in place, not copied
    # an edited kernel: the shipped entry is stale and the tuner tunes
    assert tune(make_tuner(sources=("kernel v2",)), fake) == CONFIGS[1] and fake.calls > 0
    # this machine's own cache wins over what ships
    with monkeypatch.context() as patch:
        patch.setattr(tuning, "_shipped", dict)
        assert tune(make_tuner(), FakeKernel()) == CONFIGS[1]  # tuned here, into the cache
    assert tune(make_tuner(), FakeKernel(times=[0.1] * 4)) == CONFIGS[1]


def test_the_package_ships_well_formed_exports():
    tuning._shipped.cache_clear()
    for path in sorted(tuning.SHIPPED_DIR.glob("*.json")):
        entries = tuning._export_entries(json.loads(path.read_text()))
        assert entries and all(tuning._is_entry(e) for e in entries), path
        assert {e["device"] for e in entries} == {"NVIDIA H200"}, path
    assert all(tuning._is_entry(e) for e in tuning._shipped().values())


def test_shipped_configs_describe_the_kernels_as_they_are():
    """A kernel edited after its configs were tuned on the H200 leaves them stale (ignored, so a first
    call there tunes again): re-export them there (tritonkit tune --export) or delete the entries."""
    from tritonkit.ops import get_op, op_names

    for name in op_names():
        get_op(name)  # each op module defines its tuners on import
    tuning._shipped.cache_clear()
    assert tuning.stale_shipped() == []
    shipped_tuners = {e["tuner"] for e in tuning._shipped().values()}
    assert {
        "softmax_fwd",
        "softmax_bwd",
        "norm_fwd",
        "norm_fwd_looped",
        "norm_bwd",
        "norm_bwd_looped",
        "attention_fwd",
        "attention_bwd_dkdv",
        "attention_bwd_dq",
        "linear",
    } <= shipped_tuners


def test_stale_shipped_names_each_entry_that_would_be_ignored(tuning_on, cache, shipped, monkeypatch):
    monkeypatch.setattr(tuning, "TUNERS", {})
    tune(make_tuner(), FakeKernel(times=[0.1, 1.0, 2.0, 0.5]))
    tuning.export_cache(shipped / "h200.json")
    assert tuning.stale_shipped() == []
    make_tuner(name="other")  # defined, but it has no shipped entry: nothing to report
    tuning.TUNERS["fake"] = make_tuner(sources=("kernel v2",))  # the kernel was edited since
    (problem,) = tuning.stale_shipped()
    assert problem.startswith("h200.json: fake {") and "stored source_hash" in problem
    tuning.TUNERS["fake"] = make_tuner(prune=lambda config, key: config == CONFIGS[0])  # prunes the winner
    (problem,) = tuning.stale_shipped()
    assert "is not one of the current candidates" in problem
    del tuning.TUNERS["fake"]
    (problem,) = tuning.stale_shipped()
    assert problem == "h200.json: entry 0 names no defined tuner"
    (shipped / "broken.json").write_text("[]")
    assert tuning.stale_shipped()[0] == "broken.json: not a format-1 tuning export"


def test_cli_tune(tuning_on, cache, tmp_path, capsys):
    from tritonkit.cli import main

    tune(make_tuner(), FakeKernel())
    bundle = tmp_path / "bundle.json"
    assert main(["tune", "--export", str(bundle)]) == 0
    assert "exported 1 tuned configs" in capsys.readouterr().out
    assert main(["tune", "--import", str(bundle)]) == 0
    assert "imported 1 tuned configs" in capsys.readouterr().out
    assert main(["tune"]) == 2 and "name ops to tune" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["tune", "softmax"]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_cli_tune_show(tuning_on, cache, shipped, tmp_path, capsys):
    from tritonkit.cli import main

    tune(make_tuner(), FakeKernel(times=[0.1, 1.0, 2.0, 0.5]))
    tune(make_tuner(name="other"), FakeKernel(), key={"N": 128, "dtype": "bf16"})
    bundle = tmp_path / "bundle.json"
    tuning.export_cache(bundle)
    tuning.export_cache(shipped / "h200.json")
    tuning._shipped.cache_clear()
    assert main(["tune", "--show", str(bundle), "--tuner", "fake", "--where", "N=64", "dtype=fp32"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{bundle}: 1 of 2 entries (")
    assert out[1].startswith("fake {'N': 64, 'dtype': 'fp32'}: {'BLOCK': 8")  # the fastest won
    assert "100.0 us" in out[2] and len(out) == 3 + len(CONFIGS)
    assert out[-1] == "1 entries shown: fake 1 (narrow with --tuner NAME and --where FIELD=VALUE)"
    assert main(["tune", "--show", "--where", "N=128"]) == 0  # the cache, then what ships
    out = capsys.readouterr().out
    assert out.count("1 of 2 entries") == 2 and "shipped h200.json" in out and "fake {" not in out
    assert main(["tune", "--show", "--where", "N=65"]) == 0
    assert "no tuned entries match" in capsys.readouterr().out
    assert main(["tune", "--show", "--where", "N"]) == 2 and "FIELD=VALUE" in capsys.readouterr().err
    assert main(["tune", "--show", "--import", str(bundle)]) == 2
    assert "takes no ops" in capsys.readouterr().err
    assert main(["tune", "--export", str(bundle), "--tuner", "fake"]) == 2
    assert "filter what --show prints" in capsys.readouterr().err
    (tmp_path / "junk.json").write_text("{}")
    assert main(["tune", "--show", str(tmp_path / "junk.json")]) == 2
    assert "not a format-1 tuning export" in capsys.readouterr().err
    assert main(["tune", "--show", str(tmp_path / "missing.json")]) == 2
    assert "missing.json: no such file" in capsys.readouterr().err


def test_retuning_tunes_again_whatever_is_stored(tuning_on, cache, shipped, monkeypatch):
    tune(make_tuner(), FakeKernel(times=[0.1, 1.0, 2.0, 0.5]))
    tuning.export_cache(shipped / "h200.json")  # the same winner cached here and shipped
    tuning._shipped.cache_clear()
    tuner = make_tuner()
    assert tune(tuner, FakeKernel(times=[9.0] * 4)) == CONFIGS[0]  # read back, nothing timed
    monkeypatch.setitem(tuning.TUNERS, "fake", tuner)
    faster = FakeKernel(times=[2.0, 0.1, 1.0, 0.5])
    with tuning.retuning():
        assert tune(tuner, faster) == CONFIGS[1] and faster.calls > 0  # the memo was forgotten too
        calls = faster.calls
        assert tune(tuner, faster) == CONFIGS[1] and faster.calls == calls  # once a key, then the memo
    assert tune(make_tuner(), FakeKernel(times=[9.0] * 4)) == CONFIGS[1]  # the new winner was written
    assert not tuning._retuning


def test_timing_never_fills_outputs_with_nan(monkeypatch):
    """Tuning may start inside a test's poisoned block; the timed calls allocate unpoisoned."""
    import triton

    from tritonkit import _runtime
    from tritonkit.testing import poisoned_outputs

    seen = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **options: fn() or 1.0)
    with poisoned_outputs():
        assert tuning.median_ms(lambda: seen.append(_runtime.poison_outputs)) == 1.0
        assert _runtime.poison_outputs
    assert seen == [False]


def test_remember_keeps_at_most_limit_signatures():
    memo = {}
    for signature in range(5):
        tuning.remember(memo, signature, {"BLOCK": signature}, limit=2)
        assert 1 <= len(memo) <= 2 and memo[signature] == {"BLOCK": signature}


def test_a_tuners_hash_covers_every_jit_helper_its_kernels_call():
    """The closure is found from the kernels' bodies: helpers called through other helpers, in other
    modules (tritonkit.jit), and the constexpr globals they read, with no list kept by hand."""
    from tritonkit.ops.attention import bwd as attention_bwd
    from tritonkit.ops.linear import kernels as linear_kernels

    dq = kernel_sources.jit_closure(attention_bwd._attn_bwd_dq_kernel)
    assert {"_attn_bwd_dq_kernel()", "_dq_steps()", "_sequence()", "_key_ranges()", "dot_fp32()"} <= set(dq)
    assert dq["LOG2E"] == repr(1.4426950408889634)
    linear = kernel_sources.jit_closure(linear_kernels._linear_kernel)
    assert {"_activate()", "gelu()", "tanh_and_sech2()"} <= set(linear)  # through jit.gelu
    assert "tl" not in linear and not any(name.startswith("triton") for name in linear)


def test_editing_a_helper_deep_in_the_closure_changes_the_hash(monkeypatch):
    from tritonkit.ops.linear import matmul

    tuner = matmul.TUNER
    copy = lambda: tuning.Tuner("closure-copy", tuner.configs, sources=tuner.sources, default=tuner.default)  # noqa: E731
    before = copy().source_hash
    real = kernel_sources.source_text
    edited = lambda s: real(s).replace("4.0 * e", "4.0000001 * e")  # noqa: E731  (in jit.tanh_and_sech2)
    monkeypatch.setattr(kernel_sources, "source_text", lambda s: s if isinstance(s, str) else edited(s))
    after = copy().source_hash
    assert before != after
    tuning.TUNERS.pop("closure-copy", None)


def test_rekey_moves_only_entries_whose_hash_alone_changed(monkeypatch, tmp_path):
    """An entry tuned on the earlier source (same configs) takes the new hash; one whose configs
    changed since, or that was tuned on yet another source, is left as it was (and stays stale)."""
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path)
    tuner = make_tuner(name="rekeyed", sources=("kernel v2",))
    other = make_tuner(name="reconfigured", sources=("kernel v2",), configs=CONFIGS[:2])
    monkeypatch.setitem(tuning.TUNERS, "rekeyed", tuner)
    monkeypatch.setitem(tuning.TUNERS, "reconfigured", other)
    old = make_tuner(name="old", sources=("kernel v1",)).source_hash
    entry = {
        "format": tuning.FORMAT,
        "key": {"n": 1},
        "device": "d",
        "triton": "t",
        "config": CONFIGS[0],
        "ms": {tuning._canonical(CONFIGS[0]): 1.0},
        "rejected": {},
    }
    entries = [
        {**entry, "tuner": "rekeyed", "source_hash": old},
        {**entry, "tuner": "rekeyed", "source_hash": "f" * 64},
        {**entry, "tuner": "reconfigured", "source_hash": old},
    ]
    (tmp_path / "h200.json").write_text(json.dumps({"format": tuning.FORMAT, "entries": entries}))
    before = {
        "rekeyed": {"source_hash": old, "configs": tuning._canonical(CONFIGS)},
        "reconfigured": {"source_hash": old, "configs": tuning._canonical(CONFIGS)},
    }
    assert tuning.rekey_shipped(before) == {"rekeyed": 1}
    hashes = [e["source_hash"] for e in json.loads((tmp_path / "h200.json").read_text())["entries"]]
    assert hashes == [tuner.source_hash, "f" * 64, old]
    tuning._shipped.cache_clear()


def test_a_tuned_kernel_builds_a_key_given_as_a_function_only_when_its_memo_does_not_answer():
    """Under the interpreter the default is final: the first call builds key and problem, the
    second answers from the memo without calling either."""
    built = []
    tuned = tuning.Tuned(make_tuner(name="lazy"), launches=None, calibrate=None, reference=None, outputs=())
    try:

        def key():
            built.append("key")
            return KEY

        def problem():
            built.append("problem")
            return {}

        assert tuned.choose(key, problem, signature=("s",)) == (DEFAULT, True)
        assert tuned.choose(key, problem, signature=("s",)) == (DEFAULT, True)
        assert built == ["key", "problem"]
        with pytest.raises(TypeError, match="signature"):
            tuned.choose(key, problem)
    finally:
        tuning.TUNED.remove(tuned)
        tuning.TUNERS.pop("lazy", None)
