"""``tritonkit bench --sweep``: the shapes it draws, what it runs them under, its summary and the
files it writes (the GPU run faked; under the interpreter a real correctness run)."""

from __future__ import annotations

import math

import pytest
import torch

from test_bench import _timed_row, _with_fn
from tritonkit import tuning
from tritonkit.bench import sweep
from tritonkit.bench.runner import Case, run_case
from tritonkit.cli import main
from tritonkit.ops import get_workload

pytestmark = pytest.mark.infra


def test_shapes_are_drawn_log_uniformly_within_bounds_and_the_same_for_a_seed():
    shapes = sweep.sample_shapes(300, seed=3)
    assert shapes == sweep.sample_shapes(300, seed=3) != sweep.sample_shapes(300, seed=4)
    assert len(set(shapes)) == 300
    rows, lengths = zip(*(shape for shape, _ in shapes), strict=True)
    assert all(sweep.ROWS[0] <= r <= sweep.ROWS[1] for r in rows)
    assert all(sweep.LENGTH[0] <= n <= sweep.LENGTH[1] for n in lengths)
    assert all(r * n <= sweep.MAX_ELEMENTS for r, n in zip(rows, lengths, strict=True))
    assert {dtype for _, dtype in shapes} == set(sweep.DTYPES)
    # log-uniform: about as many lengths under 2^12 as over (uniform would put nearly all over)
    assert 0.3 < sum(n < 2**12 for n in lengths) / 300 < 0.7
    assert sum(n & (n - 1) != 0 for n in lengths) > 250  # mostly not powers of two
    assert min(lengths) < 16 and max(lengths) > 2**20 and min(rows) < 16 and max(rows) > 2**16


def test_impossible_draws_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        sweep.sample_shapes(0)
    with pytest.raises(ValueError, match="do not fit"):
        sweep.sample_shapes(5, rows=(1, 1), length=(1, 1))  # 3 distinct: one shape, 3 dtypes


def test_the_sweep_takes_the_row_families_only():
    assert sweep.check_workloads([]) == list(sweep.WORKLOADS)
    assert sweep.check_workloads(["rms_norm"]) == ["rms_norm"]
    with pytest.raises(ValueError, match="not \\['attention'\\]"):
        sweep.check_workloads(["rms_norm", "attention"])


def test_calls_run_untuned_with_room_for_recompiles():
    import torch._dynamo

    limit = torch._dynamo.config.recompile_limit
    with sweep.untuned_calls():
        assert tuning._single_config() or tuning._disabled_depth > 0
        assert torch._dynamo.config.recompile_limit >= sweep.RECOMPILE_LIMIT
    assert torch._dynamo.config.recompile_limit == limit and tuning._disabled_depth == 0


def test_cases_are_timed_under_the_sweeps_shorter_protocol():
    from tritonkit.bench import timing

    tables = timing.WARMUP_MS, timing.REP_MS
    with sweep.sweep_timing():
        assert (timing.WARMUP_MS, timing.REP_MS) == (sweep.SWEEP_WARMUP_MS, sweep.SWEEP_REP_MS) != tables
        with timing.protocol(1, 2):  # nested blocks restore their own
            assert (timing.WARMUP_MS, timing.REP_MS) == (1, 2)
        assert timing.REP_MS == sweep.SWEEP_REP_MS
    assert tables == (timing.WARMUP_MS, timing.REP_MS)


def _ours(shape, ratio, nbytes, dtype="bf16", mode="fwd", op="softmax"):
    row = _timed_row("tritonkit", 1.0, op=op, mode=mode, shape=list(shape), dtype=dtype, bytes=nbytes)
    return row | {"gbps": nbytes / 1e6, "measured_bandwidth": 4e12, "speedup_vs_best_peer": ratio}


def test_the_summary_and_the_tables_name_the_worst_shapes():
    big = 2**27  # 128 MB
    rows = [
        _ours((8, 8), 1.3, 2**10),
        _ours((1000, 3), 0.4, 2**14),  # the worst ratio, small
        _ours((4096, 8192), 1.0, big),  # 128 MB in 1 ms: 3% of 4 TB/s
        _ours((4096, 16384), 0.9, 4 * big),  # 13%
        _ours((7, 7), 2.0, 2**10, mode="bwd"),
        _timed_row("torch", 0.5, op="softmax", shape=[8, 8]),
        {"op": "softmax", "provider": "tritonkit", "mode": "bwd", "shape": [3, 5], "dtype": "fp32"}
        | {"check": "FAIL", "error": "ValueError: boom", "bytes": 60},
    ]
    [fwd, bwd] = sweep.summary(rows)
    assert fwd["shapes"] == 4 and fwd["at_or_past_best_peer"] == 0.5
    assert fwd["worst_vs_best_peer"] == 0.4 and fwd["worst_shape"] == "1000x3 bf16"
    assert fwd["large_shapes"] == 2 and fwd["least_copy_share_large"] == pytest.approx(big / 1e6 * 1e9 / 4e12)
    assert fwd["least_copy_shape"] == "4096x8192 bf16"
    assert bwd["shapes"] == 1 and bwd["large_shapes"] == 0 and bwd["least_copy_share_large"] is None
    table = sweep.markdown(rows, worst=2)
    assert "| softmax | fwd | 4 | 50% | 0.40x | 1000x3 bf16 | 2 | 3% | 4096x8192 bf16 |" in table
    assert "Worst 2 by x the best peer" in table and "| softmax | fwd | 1000x3 bf16 |" in table
    assert "Failed (1):" in table and "softmax bwd 3x5 fp32 tritonkit: ValueError: boom" in table


def test_a_tritonkit_error_is_a_failed_row_when_the_run_keeps_going():
    workload = get_workload("bias_gelu")

    def refuses(input, bias, approximate="none"):
        raise ValueError("this shape is not supported")

    case = Case(_with_fn(workload, refuses), (3, 5), torch.float32, "fwd")
    with pytest.raises(ValueError, match="not supported"):
        run_case(case, ["tritonkit"], "cpu")
    [row] = run_case(case, ["tritonkit"], "cpu", keep_going=True)
    assert row["check"] == "FAIL" and row["error"] == "ValueError: this shape is not supported"


def test_cli_sweep_under_the_interpreter(capsys):
    assert main(["bench", "--sweep", "1", "bias_gelu", "--mode", "fwd", "--no-progress"]) == 0
    out = capsys.readouterr().out
    if not torch.cuda.is_available():
        assert "Correctness run" in out and "pass" in out and "FAIL" not in out
        assert "tritonkit[" not in out
    assert main(["bench", "--sweep", "1", "--shapes", "full"]) != 0
    assert "--shapes and --only do not apply to --sweep" in capsys.readouterr().err
    assert main(["bench", "--sweep", "1", "--only", "4x96"]) != 0
    assert "--shapes and --only do not apply to --sweep" in capsys.readouterr().err
    assert main(["bench", "--sweep", "1", "attention"]) != 0
    assert "not ['attention']" in capsys.readouterr().err


def test_cli_sweep_on_a_gpu_writes_the_sweep_files_and_leaves_the_tables(tmp_path, monkeypatch, capsys):
    """(The GPU run faked.) N drawn shapes, fwd and bwd, untuned, torch.compile once a family, the
    peers without tritonkit's variants, errors as rows; sweep.{json,md,png}, no <op>.json."""
    import tritonkit._runtime
    import tritonkit.bench
    import tritonkit.bench.runner

    monkeypatch.setattr(tritonkit._runtime, "interpret", lambda: False)
    origin = {"gpu": "NVIDIA H200", "torch": "t", "triton": "3.6.0", "git_sha": "abc"}
    monkeypatch.setattr(tritonkit.bench.runner, "provenance", lambda: origin)
    monkeypatch.setattr(
        tritonkit.bench, "write_results", lambda rows, out, **kw: pytest.fail("tables written")
    )
    seen = {}

    def fake_run(names, **kwargs):
        seen.update(kwargs, names=names, untuned=tuning._disabled_depth > 0)
        big = 2**27
        return [_ours((4096, 8192), 1.0, big) | origin, _timed_row("torch", 1.1, shape=[4096, 8192]) | origin]

    monkeypatch.setattr(tritonkit.bench, "run", fake_run)
    argv = ["bench", "--sweep", "7", "--seed", "2", "softmax", "--out", str(tmp_path), "--no-progress"]
    monkeypatch.setattr("sys.argv", ["tritonkit", *argv])
    assert main(argv) == 0
    assert seen["names"] == ["softmax"] and seen["shapes"] == sweep.sample_shapes(7, 2)
    assert seen["modes"] == ["fwd", "bwd"] and seen["untuned"]
    assert not seen["compile_per_shape"] and seen["keep_going"]
    assert "tritonkit" in seen["providers"] and not any("[" in p for p in seen["providers"])
    written = sorted(p.name for p in (tmp_path / "h200").iterdir())
    assert written == ["sweep.json", "sweep.md", "sweep.png"]  # no <op>.json, no checkpoint left
    assert "| softmax | fwd | 1 |" in (tmp_path / "h200" / "sweep.md").read_text()
    assert math.isclose(sweep.copy_share(_ours((1, 1), 1.0, 4e9)), 1.0)


def test_a_shard_takes_every_nth_shape():
    shapes = sweep.sample_shapes(10, seed=1)
    shards = [sweep.shard(shapes, f"{i}/3") for i in range(3)]
    assert shards[1] == shapes[1::3] and sorted(sum(shards, [])) == sorted(shapes)
    for bad in ("3/3", "-1/2", "1", "a/b"):
        with pytest.raises(ValueError, match="--shard"):
            sweep.shard(shapes, bad)


def test_cli_merges_shards_into_one_sweep_and_refuses_a_stray(tmp_path, capsys):
    """``--merge`` reads each shard's <gpu>/sweep.json and writes one sweep; shards of another GPU
    model or another sweep (beyond --shard and --out) are refused."""
    import json

    def shard(name: str, rows: list[dict], index: int, sweep_args: str = "--sweep 9") -> str:
        folder = tmp_path / name / "h200"
        folder.mkdir(parents=True)
        command = f"tritonkit bench {sweep_args} --shard {index}/2 --out {tmp_path / name}"
        (folder / "sweep.json").write_text(json.dumps([row | {"command": command} for row in rows]))
        return str(tmp_path / name)

    a = shard("a", [_ours((8, 8), 1.2, 2**10)], 0)
    b = shard("b", [_ours((9, 9), 0.9, 2**28)], 1)
    out = tmp_path / "merged"
    assert main(["bench", "--merge", a, b, "--out", str(out)]) == 0
    rows = json.loads((out / "h200" / "sweep.json").read_text())
    assert [r["shape"] for r in rows] == [[8, 8], [9, 9]]
    assert "| softmax | fwd | 2 |" in (out / "h200" / "sweep.md").read_text()
    other = shard("c", [_ours((7, 7), 1.0, 2**10)], 1, sweep_args="--sweep 5")
    assert main(["bench", "--merge", a, other, "--out", str(out)]) != 0
    assert "shards of one GPU model and sweep" in capsys.readouterr().err
    assert main(["bench", "--merge", str(tmp_path / "nothing"), "--out", str(out)]) != 0
    assert main(["bench", "--shard", "0/2", "softmax"]) != 0
    assert "give --sweep N too" in capsys.readouterr().err
    # each of these merged, counting shapes twice or passing part of the sweep for all of it
    third = shard("d", [_ours((6, 6), 1.0, 2**10)], 1)
    for folders, given in [([a, a], "0/2, 0/2"), ([a], "0/2"), ([a, b, third], "0/2, 1/2, 1/2")]:
        assert main(["bench", "--merge", *folders, "--out", str(out)]) == 2
        assert f"every shard I/N of one sweep once (I = 0 .. N - 1), got {given}" in capsys.readouterr().err
    # shards run as --shard=I/N --out=DIR are one sweep too (they were refused as two)
    e = tmp_path / "e" / "h200"
    e.mkdir(parents=True)
    command = f"tritonkit bench --sweep 9 --shard=1/2 --out={tmp_path / 'e'}"
    (e / "sweep.json").write_text(json.dumps([_ours((9, 9), 0.9, 2**28) | {"command": command}]))
    assert main(["bench", "--merge", a, str(tmp_path / "e"), "--out", str(out)]) == 0


def test_a_sweep_with_nothing_to_run_or_no_ratio_says_so(tmp_path, capsys):
    """A shard past the shapes drawn is a one-line error (was an empty run); writing no rows is
    refused (was an IndexError); rows without a ratio to a peer write no plot (plotting raised)."""
    assert main(["bench", "softmax", "--sweep", "1", "--shard", "1/2", "--no-progress"]) == 2
    assert "shard 1/2 of a sweep of 1 shapes has no shapes" in capsys.readouterr().err
    with pytest.raises(ValueError, match="ran no case"):
        sweep.write([], tmp_path)
    alone = {k: v for k, v in _ours((8, 8), 1.2, 2**10).items() if k != "speedup_vs_best_peer"}
    written = sweep.write([alone], tmp_path)
    assert [p.name for p in written] == ["sweep.json", "sweep.md"]


def test_a_single_row_of_cross_entropy_is_checked_like_any_other():
    """The workload's targets ignore every eighth row from the eighth: a lone row (the sweep draws
    1 x C) keeps its loss, where ignoring row 0 made the mean 0 / 0 and every provider's check fail."""
    from tritonkit.testing import generator

    make = get_workload("cross_entropy").op.make_inputs
    _, target = make((1, 50), torch.float32, "cpu", generator(0))
    assert target.tolist() != [-100]
    _, target = make((16, 50), torch.float32, "cpu", generator(0))
    assert (target == -100).nonzero().flatten().tolist() == [7, 15]
    rows = run_case(
        Case(get_workload("cross_entropy"), (1, 50), torch.float32, "fwd"), ["tritonkit", "torch"], "cpu"
    )
    assert rows and all(row["check"] == "pass" for row in rows), rows
