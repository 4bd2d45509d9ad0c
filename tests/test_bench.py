"""The benchmark harness and the CLI: sweeps, checks, writers and commands."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tritonkit import roofline
from tritonkit.bench import add_peer_ratios, format_table, run, runner, write_results
from tritonkit.bench.providers import providers_for
from tritonkit.bench.report import markdown_table
from tritonkit.bench.runner import Case, run_case
from tritonkit.cli import main
from tritonkit.ops import get_workload

pytestmark = pytest.mark.infra

ROW_FIELDS = {
    "op",
    "provider",
    "mode",
    "shape",
    "dtype",
    "max_err",
    "check",
    "gpu",
    "torch",
    "triton",
    "git_sha",
    "flops",
    "bytes",
    "predicted_ms_h200",
}
TIMED_FIELDS = {
    "ms_p20",
    "ms",
    "ms_p80",
    "gbps",
    "tflops",
    "pct_roofline",
    "pct_roofline_datasheet",
    "host_us",
    "timing",
}


@pytest.fixture
def workload():
    return get_workload("bias_gelu")


def _with_fn(workload, fn):
    """The workload with its op's function replaced by ``fn``."""
    return dataclasses.replace(workload, op=dataclasses.replace(workload.op, fn=fn))


def test_unknown_workload_is_refused():
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        get_workload("nope")


def test_a_row_collects_garbage_only_where_the_device_may_lack_room(workload, monkeypatch):
    """``runner._make_room``: the collection and the allocator's release run before a row only where
    ROOM_FACTOR times the case's bytes passes the device's free memory (a collection took a third
    of each row's time in a sweep)."""
    from tritonkit.bench import runner

    collected = []
    monkeypatch.setattr(runner.gc, "collect", lambda: collected.append("gc"))
    monkeypatch.setattr(runner.torch.cuda, "empty_cache", lambda: collected.append("empty"))
    case = Case(workload, (8192, 4096), torch.bfloat16, "bwd")
    need = runner.ROOM_FACTOR * workload.cost(case.shape, case.dtype, case.mode).bytes
    for free, expected in ((need + 1, []), (need - 1, ["gc", "empty"])):
        monkeypatch.setattr(runner.torch.cuda, "mem_get_info", lambda free=free: (free, 2 * need))
        collected.clear()
        runner._make_room(case)
        assert collected == expected, free


def test_correctness_run_rows(workload):
    rows = run(["bias_gelu"], dtypes=[torch.float32], modes=["fwd", "bwd"], progress=False)
    ran = [r for r in rows if "unavailable" not in r]
    assert {r["provider"] for r in ran} >= {"tritonkit", "torch"}
    assert len({tuple(r["shape"]) for r in ran}) == len(workload.op.shapes)
    for row in ran:
        assert row.keys() >= ROW_FIELDS
        assert list(row["bench_s"]) == ["setup", "check"]  # the interpreter times nothing after
        assert all(seconds >= 0 for seconds in row["bench_s"].values())
        assert row["check"] == "pass" and 0 < row["max_err"] < 1e-5
        assert all(isinstance(d, int) for d in row["shape"])
        cost = workload.cost(tuple(row["shape"]), torch.float32, row["mode"])
        assert row["bytes"] == cost.bytes
        assert row["predicted_ms_h200"] == pytest.approx(cost.bytes / 4.8e12 * 1e3)


def test_unavailable_providers_say_why(workload):
    rows = run_case(Case(workload, (4, 96), torch.float32, "fwd"), None, "cpu")
    reasons = {r["provider"]: r["unavailable"] for r in rows if "unavailable" in r}
    if not torch.cuda.is_available():
        assert "CUDA" in reasons["torch.compile"]
    table = format_table(rows, interpreter=True)
    for name, reason in reasons.items():
        assert f"not run: {name} ({reason})" in table


def test_check_fails_a_wrong_kernel(workload):
    def off_by_a_percent(input, bias, approximate="none"):
        return workload.op.reference(input, bias, approximate) * 1.01

    broken = _with_fn(workload, off_by_a_percent)
    rows = run_case(Case(broken, (7, 33), torch.float32, "fwd"), ["tritonkit"], "cpu")
    assert [r["check"] for r in rows] == ["FAIL"]
    # the row names the tensor that failed, its error and the bound it missed
    assert rows[0]["error"].startswith("wrong output: output[0]: err ") and "vs bound" in rows[0]["error"]


def test_ops_with_several_outputs_and_non_tensor_inputs_are_checked_in_every_mode():
    # add_rms_norm returns (normed, x + residual) and takes the normalized shape as an input
    workload = get_workload("add_rms_norm")
    for mode in ("fwd", "bwd", "fwd+bwd"):
        [row] = run_case(Case(workload, (5, 96), torch.float32, mode), ["tritonkit"], "cpu")
        assert row["check"] == "pass" and 0 < row["max_err"] < 1e-4, (mode, row)
    broken = _with_fn(
        workload,
        lambda x, r, shape, w, eps=None: tuple(t * 1.01 for t in workload.op.fn(x, r, shape, w, eps)),
    )
    [row] = run_case(Case(broken, (5, 96), torch.float32, "bwd"), ["tritonkit"], "cpu")
    assert row["check"] == "FAIL"


def test_op_specific_peers_are_providers(workload):
    with_peer = dataclasses.replace(workload, peers={"cublaslt": lambda kwargs: workload.op.reference})
    assert [p.name for p in providers_for(with_peer)][-1] == "cublaslt"


def test_a_workloads_kwargs_reach_its_calls_its_cost_and_its_launches():
    """attention and attention_causal run one op; the causal workload's causal=True reaches the
    providers and peers it builds, its cost (half the FLOPs) and what inspect compiles."""
    full, causal = get_workload("attention"), get_workload("attention_causal")
    assert full.op is causal.op and full.op.kwargs == {}
    shape, dtype = (1, 2, 2, 256, 64), torch.bfloat16
    assert causal.cost(shape, dtype, "bwd").flops == full.cost(shape, dtype, "bwd").flops / 2
    for workload, flag in ((full, False), (causal, True)):
        built = {p.name: p.build(workload) for p in providers_for(workload)}
        assert built["tritonkit"].keywords == built["torch"].keywords == {"causal": flag}
        assert built["tritonkit[atomic-dq]"].keywords == {"causal": flag, "deterministic": False}
        launches = workload.launches(shape, dtype)
        assert [launch.meta["IS_CAUSAL"] for launch in launches if "IS_CAUSAL" in launch.meta] == [flag] * 3


def test_a_peer_that_refuses_a_case_gets_a_row_saying_so(workload):
    def refuses(input, bias, approximate="none"):
        raise RuntimeError(f"Cannot launch Triton kernel since n = {input.shape[-1]} exceeds 65536")

    with_peer = dataclasses.replace(workload, peers={"picky": lambda kwargs: refuses})
    [row] = run_case(Case(with_peer, (7, 33), torch.float32, "fwd"), ["picky"], "cpu")
    assert row["unavailable"].startswith("refused: RuntimeError: Cannot launch") and "check" not in row
    # tritonkit's own failure is a bug, never a row
    broken = _with_fn(workload, refuses)
    with pytest.raises(RuntimeError, match="Cannot launch"):
        run_case(Case(broken, (7, 33), torch.float32, "fwd"), ["tritonkit"], "cpu")


def _timed_row(provider: str, ms: float, **extra) -> dict:
    cost = roofline.Cost(flops=2e8, bytes=1.3e8)
    return {
        "op": "bias_gelu",
        "provider": provider,
        "mode": "fwd",
        "shape": [8192, 4096],
        "dtype": "bf16",
        "ms": ms,
        "ms_p20": ms * 0.99,
        "ms_p80": ms * 1.01,
        "eager_ms": ms * 1.25,
        "flops": cost.flops,
        "bytes": cost.bytes,
        "gbps": cost.bytes / ms / 1e6,
        "tflops": cost.flops / ms / 1e9,
        "gpu": "NVIDIA H200",
    } | extra


def test_peer_ratio_is_best_peer_over_tritonkit():
    rows = [_timed_row("tritonkit", 0.05), _timed_row("torch", 0.13), _timed_row("torch.compile", 0.06)]
    add_peer_ratios(rows)
    assert rows[0]["speedup_vs_best_peer"] == pytest.approx(0.06 / 0.05)
    assert "speedup_vs_best_peer" not in rows[1]


def test_writers(tmp_path):
    rows = [
        _timed_row(
            "tritonkit",
            0.05,
            check="pass",
            pct_roofline=62.1,
            pct_copy_same_bytes=70.2,
            bench_s={"check": 1.5},
        ),
        _timed_row("torch", 0.13, check="pass"),
        _timed_row("tritonkit[online]", 0.04, check="FAIL"),
        {
            "op": "bias_gelu",
            "provider": "liger",
            "mode": "fwd",
            "shape": [8192, 4096],
            "dtype": "bf16",
            "gpu": "NVIDIA H200",
            "unavailable": "refused: RuntimeError: n too large",
        },
    ]
    add_peer_ratios(rows)
    datasheet = roofline.device_spec("h200")
    measured = dataclasses.replace(datasheet, bandwidth=4.25e12, source="measured")
    written = write_results(rows, tmp_path, ceilings=(datasheet, measured))
    folder = tmp_path / "h200"
    assert sorted(written) == sorted(
        [folder / f"bias_gelu.{ext}" for ext in ("json", "csv", "md", "png")]
        + [folder / "bias_gelu-bandwidth.png"]
    )
    assert json.loads((folder / "bias_gelu.json").read_text()) == rows
    csv_lines = (folder / "bias_gelu.csv").read_text().splitlines()
    assert len(csv_lines) == 5 and "8192x4096" in csv_lines[1]
    assert "bench_s.check" in csv_lines[0].split(",") and "1.5" in csv_lines[1].split(",")  # a column a phase
    assert (folder / "bias_gelu.png").read_bytes()[:4] == b"\x89PNG"
    assert (folder / "bias_gelu-bandwidth.png").read_bytes()[:4] == b"\x89PNG"
    # the docs' table: GB/s per provider, a failed check marked, a refusal said, the ratio to the
    # best peer (torch: a tritonkit variant is not a peer)
    header, rule, line = (folder / "bias_gelu.md").read_text().splitlines()
    providers = ["tritonkit", "torch", "tritonkit[online]", "liger"]
    assert header.split(" | ")[3:7] == [f"{p} GB/s" for p in providers]
    cells = line.strip("| ").split(" | ")
    assert cells[:3] == ["fwd", "8192x4096", "bf16"]
    assert cells[3:7] == ["2600", "1000", "3250 (FAIL)", "refused"]
    assert cells[7:] == ["62.1", "70.2", "0.0500", "0.0625", f"{0.13 / 0.05:.2f}x"]  # ms: replayed, eager


def test_a_run_of_some_shapes_keeps_the_tables_other_shapes(tmp_path):
    """``--only``'s write (``merge``): the new rows take their case's place in the table already
    there, its other cases stay, a case it lacks goes last, and the .md says the rows come from
    two commits; without ``merge`` the table is the run's rows alone."""
    datasheet = roofline.device_spec("h200")
    ceilings = (datasheet, dataclasses.replace(datasheet, bandwidth=4.25e12, source="measured"))

    def case(shape, provider, sha):
        return _timed_row(provider, 0.05, shape=shape, git_sha=sha)

    shapes = ([8192, 4096], [4096, 16384], [1024, 1024])
    table = [case(shape, p, "aaaaaaa") for shape in shapes[:2] for p in ("tritonkit", "torch")]
    write_results(table, tmp_path, ceilings)
    rerun = [case(shape, p, "bbbbbbb") for shape in (shapes[2], shapes[0]) for p in ("tritonkit", "torch")]
    write_results(rerun, tmp_path, ceilings, merge=True)
    rows = json.loads((tmp_path / "h200" / "bias_gelu.json").read_text())
    assert [(r["shape"], r["git_sha"]) for r in rows[::2]] == [
        (shapes[0], "bbbbbbb"),
        (shapes[1], "aaaaaaa"),
        (shapes[2], "bbbbbbb"),
    ]
    assert [r["provider"] for r in rows] == ["tritonkit", "torch"] * 3
    md = tmp_path / "h200" / "bias_gelu.md"
    assert "more than one run: bbbbbbb (4 rows), aaaaaaa (2 rows)" in md.read_text()
    write_results(rerun, tmp_path, ceilings)
    assert len(json.loads((tmp_path / "h200" / "bias_gelu.json").read_text())) == 4
    assert "more than one run" not in md.read_text()


def test_markdown_table_counts_flops_for_a_compute_bound_op():
    """Attention-like rows (FLOPs a byte past the measured ridge) are shown in TFLOP/s against the
    peak, with no copy columns; the same rows under a ridge they do not pass stay in GB/s."""
    ceilings = {"measured_peak": 680e12, "measured_bandwidth": 4.25e12}  # ridge: 160 FLOPs a byte
    attention = roofline.Cost(flops=1.1e12, bytes=5.4e8)
    rows = [
        _timed_row(
            p,
            ms,
            check="pass",
            flops=attention.flops,
            bytes=attention.bytes,
            gbps=attention.bytes / ms / 1e6,
            tflops=attention.flops / ms / 1e9,
            **ceilings,
        )
        for p, ms in (("tritonkit", 2.0), ("sdpa-cudnn", 2.5))
    ]
    rows[0]["pct_roofline"] = 80.9
    add_peer_ratios(rows)
    header, _, line = markdown_table(rows).splitlines()
    assert header.split(" | ")[3:] == [
        "tritonkit TFLOP/s",
        "sdpa-cudnn TFLOP/s",
        "tritonkit %peak",
        "tritonkit ms",
        "tritonkit eager ms",
        "vs best peer |",
    ]
    assert line.strip("| ").split(" | ")[3:] == ["550", "440", "80.9", "2.0000", "2.5000", "1.25x"]
    for row in rows:
        row["measured_peak"] = 1e15  # a ridge of 235 FLOPs a byte: still compute-bound
    assert "TFLOP/s" in markdown_table(rows)
    for row in rows:
        row["measured_peak"] = 1e19  # past the op's 2037 FLOPs a byte: memory-bound
    assert "tritonkit GB/s" in markdown_table(rows) and "%copy" in markdown_table(rows)


def test_cli_roofline(capsys):
    assert main(["roofline", "bias_gelu", "--shape", "8192x4096", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "memory-bound" in out
    expected_ms = 2 * (2 * 8192 * 4096 + 4096) / 4.8e12 * 1e3
    assert f"roofline: {expected_ms:.4g} ms" in out


def test_cli_roofline_unknown_device(capsys):
    assert main(["roofline", "bias_gelu", "--shape", "8", "8", "--device", "rtx9090"]) == 2
    assert "rtx9090" in capsys.readouterr().err


def test_cli_bench_unknown_provider(capsys):
    assert main(["bench", "bias_gelu", "--providers", "ligerr", "--no-progress"]) == 2
    assert "ligerr" in capsys.readouterr().err


def test_cli_roofline_bad_shape(capsys):
    assert main(["roofline", "bias_gelu", "--shape", "8192xabc"]) == 2
    assert "--shape takes integers like 8192x4096, got 8192xabc" in capsys.readouterr().err
    assert main(["roofline", "attention", "--shape", "1x4x3x128x64"]) == 2  # (was a prediction)
    assert "query heads (4) must be a multiple of key/value heads (3)" in capsys.readouterr().err
    assert main(["bench", "softmax", "--only", "abc", "--no-progress"]) == 2  # (named --shape)
    assert "--only takes integers" in capsys.readouterr().err
    assert main(["roofline", "bias_gelu", "--shape", "4096x0"]) == 2  # nothing to divide by
    assert "dimensions >= 1" in capsys.readouterr().err
    assert main(["roofline", "attention", "--shape", "1x2x2x64x64", "--dtype", "fp32"]) == 2
    assert "attention takes fp16, bf16, not fp32" in capsys.readouterr().err


def test_cli_bench_dtype_no_workload_takes(capsys, caplog):
    assert main(["bench", "attention", "--dtype", "fp32", "--no-progress"]) == 2
    assert "no case in fp32: attention (takes fp16, bf16)" in capsys.readouterr().err
    assert main(["bench", "attention", "bias_gelu", "--dtype", "fp32", "--mode", "fwd", "--no-progress"]) == 0
    assert "left out, no kernel in fp32: attention (takes fp16, bf16)" in caplog.text  # a warning


def test_cli_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "tuning cache: " in out and "TRITONKIT_CACHE_DIR" in out
    if torch.cuda.is_available():
        assert "tuning on a key's first call: on" in out  # (the suite tunes on first use)
    else:  # (it said on: the interpreter never tunes)
        assert "tuning on a key's first call: off: the interpreter runs each kernel's default" in out
    if torch.cuda.is_available():
        assert "measured ceilings" in out and "copy bandwidth" in out and "bf16 matmul" in out
    else:
        assert "interpreter" in out and "no CUDA GPU" in out and "4.80 TB/s" in out


def test_cli_info_unknown_device_is_the_error_alone(capsys):
    assert main(["info", "--device", "b200"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "no datasheet for device 'b200'" in err


def test_cli_bench_correctness_run(capsys):
    code = main(["bench", "bias_gelu", "--mode", "fwd", "--dtype", "fp32", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    if not torch.cuda.is_available():
        assert "Correctness run" in out and "pass" in out and "FAIL" not in out


def test_only_keeps_the_named_shapes_and_refuses_a_shape_the_list_lacks(workload):
    from tritonkit.bench.runner import cases

    shapes = [shape for shape, _ in workload.shape_list("interpreter")]
    kept = cases(["bias_gelu"], "quick", [torch.float32], ["fwd", "bwd"], only=[shapes[-1]])
    assert [(c.shape, c.mode) for c in kept] == [(shapes[-1], "fwd"), (shapes[-1], "bwd")]
    with pytest.raises(ValueError, match=r"--only 3x5: not among the shapes of bias_gelu: "):
        cases(["bias_gelu"], "quick", None, ["fwd"], only=[(3, 5)])


def test_run_skips_cases_already_done_and_reports_each_case(workload):
    kwargs = {"dtypes": [torch.float32], "modes": ["fwd", "bwd"], "progress": False}
    finished, lines = [], []
    full = run(["bias_gelu"], on_case=finished.append, report=lines.append, **kwargs)
    assert len(finished) == 2 * len(workload.op.shapes) and sum(map(len, finished)) == len(full)
    assert len(lines) == len(finished) and lines[0].startswith("bench [1/4] bias_gelu fwd 4x96 fp32: ")
    done = finished[1] + finished[2]  # two cases of an interrupted run
    again = []
    resumed = run(["bias_gelu"], done=done, on_case=again.append, **kwargs)
    assert [row["mode"] for rows in again for row in rows[:1]] == ["fwd", "bwd"]  # only the others ran
    assert [r for r in resumed if r in done] == done
    key = ("op", "mode", "shape", "dtype", "provider")
    assert [[r[k] for k in key] for r in resumed] == [[r[k] for k in key] for r in full]  # sweep order


def test_host_time_is_measured_once_per_op_provider_mode_and_dtype(workload, monkeypatch):
    from tritonkit.bench import runner

    measured = []
    monkeypatch.setattr(runner.timing, "host_us", lambda call: measured.append(call) or 7.5)
    monkeypatch.setattr(runner, "_inputs", lambda case, device, seed, grad: (case.shape,))
    monkeypatch.setattr(runner, "_call", lambda fn, case, inputs: (case, inputs))
    monkeypatch.setattr(runner, "_host_times", {})
    rows = [
        runner._host_time(lambda *a: None, Case(workload, shape, dtype, mode), provider)
        for shape in [(8192, 4096), (4096, 4096)]
        for dtype in (torch.float32, torch.bfloat16)
        for mode in ("fwd", "bwd")
        for provider in ("tritonkit", "torch")
    ]
    assert len(measured) == 2 * 2 * 2  # the second shape reuses every measurement
    assert all(row == {"host_us": 7.5, "host_shape": list(workload.tiny_shape)} for row in rows)


def test_checkpoint_keeps_rows_of_the_same_run_only(tmp_path):
    from tritonkit.bench.report import append_checkpoint, read_checkpoint

    same = {
        "command": "tritonkit bench softmax",
        "gpu": "NVIDIA H200",
        "torch": "2.11",
        "triton": "3.6.0",
        "git_sha": "abc1234",
    }
    path = tmp_path / "h200" / "bench-checkpoint-x.jsonl"
    append_checkpoint(path, [same | {"op": "softmax", "n": 1}, same | {"op": "softmax", "n": 2}])
    append_checkpoint(
        path, [same | {"git_sha": "fff0000", "n": 3}, same | {"command": "tritonkit bench", "n": 4}]
    )
    with path.open("a") as out:
        out.write(json.dumps(same | {"n": 5})[:30])  # a line cut short by a stop
    rows, left_out = read_checkpoint(path, same)
    assert [r["n"] for r in rows] == [1, 2] and left_out == 3
    assert read_checkpoint(tmp_path / "missing.jsonl", same) == ([], 0)


def test_cli_bench_resumes_an_interrupted_gpu_run(tmp_path, monkeypatch, capsys):
    """Stopped after its first case, the run resumes with --resume (another command run between
    leaves its checkpoint alone), runs only the rest, writes every row and removes the
    checkpoint. (GPU runs; the sweep is faked here.)"""
    import tritonkit._runtime
    import tritonkit.bench
    import tritonkit.bench.runner
    from tritonkit.bench.report import checkpoint_path

    monkeypatch.setattr(tritonkit._runtime, "interpret", lambda: False)
    origin = {"gpu": "NVIDIA H200", "torch": "t", "triton": "3.6.0", "git_sha": "abc"}
    monkeypatch.setattr(tritonkit.bench.runner, "provenance", lambda: origin)
    monkeypatch.setattr(tritonkit.bench, "add_peer_ratios", lambda rows: None)
    written = []
    monkeypatch.setattr(tritonkit.bench, "write_results", lambda rows, out, **kw: written.append(rows) or [])
    case = {"op": "softmax", "mode": "fwd", "shape": [8, 8], "dtype": "bf16"}
    cases = [[case | origin | {"provider": p, "n": i} for p in ("tritonkit", "torch")] for i in range(3)]
    runs, stop = [], [True]

    def fake_run(names, *, done, on_case, **kwargs):
        runs.append(list(done))
        rest = cases[len(done) // 2 :]
        for rows in rest:
            on_case(rows)
            if stop:
                stop.clear()
                raise KeyboardInterrupt  # the first run stopped after its first case
        return list(done) + [dict(r) for rows in rest for r in rows]

    monkeypatch.setattr(tritonkit.bench, "run", fake_run)
    argv = ["bench", "softmax", "--out", str(tmp_path), "--no-progress"]
    monkeypatch.setattr("sys.argv", ["tritonkit", *argv])
    checkpoint = checkpoint_path(tmp_path, "NVIDIA H200", "tritonkit " + " ".join(argv))
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    assert len(checkpoint.read_text().splitlines()) == 2
    other = ["bench", "softmax", "--mode", "fwd", "--out", str(tmp_path), "--no-progress"]
    monkeypatch.setattr("sys.argv", ["tritonkit", *other])
    assert main(other) == 0  # another command, run through
    assert not checkpoint_path(tmp_path, "NVIDIA H200", "tritonkit " + " ".join(other)).exists()
    assert len(checkpoint.read_text().splitlines()) == 2
    runs.clear()
    written.clear()
    monkeypatch.setattr("sys.argv", ["tritonkit", *argv, "--resume"])
    assert main([*argv, "--resume"]) == 0
    assert [r["n"] for r in runs[0]] == [0, 0] and "2 rows kept" in capsys.readouterr().out
    [rows] = written
    assert [r["n"] for r in rows] == [0, 0, 1, 1, 2, 2]
    assert {r["command"] for r in rows} == {"tritonkit " + " ".join(argv)}  # --resume is not recorded
    assert not checkpoint.exists()
    main(argv)  # without --resume a run starts afresh
    assert runs[1] == []


def test_interleaved_calls_take_turns_in_a_rotated_order(monkeypatch):
    """Every call is timed once a round after one warm-up of the first, the round's first call
    moving a place each round; a call's time is its median round and its spread the rounds' range
    over it, so a clock that drifts during the run falls on every call."""
    import triton.testing

    from tritonkit.bench import timing

    order, clock = [], iter(range(100))

    def fake_do_bench(fn, warmup, rep, grad_to_none=None, return_mode="mean"):
        name = fn()
        order.append((name, warmup))
        return {"a": 1.0, "b": 2.0, "c": 4.0}[name] * (1 + next(clock) / 100)  # a slowing clock

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    calls = {name: (lambda name=name: name) for name in "abc"}
    medians, spreads = timing.interleaved_ms(calls, rounds=3)
    assert order[0] == ("a", timing.WARMUP_MS)
    rounds = [[name for name, _ in order[1 + 3 * r : 4 + 3 * r]] for r in range(3)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert {warmup for _, warmup in order[1:]} == {timing.ROUND_WARMUP_MS}
    # a's rounds ran at ticks 1, 6 and 8: its median is the middle one, its spread their range
    assert medians["a"] == pytest.approx(1.06) and spreads["a"] == pytest.approx(0.07 / 1.06)
    assert medians["c"] == pytest.approx(4 * 1.05)
    with pytest.raises(ValueError, match="at least one round"):
        timing.interleaved_ms(calls, rounds=0)


def test_round_ratios_pair_each_call_with_the_reference_in_the_same_round():
    """A clock that halves the speed of one round moves both sides of that round's ratios: the
    paired ratio stays the calls' true 2x and 0.5x, while the ratio of medians moves with where the
    slow round falls in each call's turns."""
    from tritonkit.bench import timing

    turns = {"ref": [1.0, 1.0, 2.0], "fast": [0.5, 1.0, 1.0], "slow": [2.0, 2.0, 4.0]}
    ratios = timing.round_ratios(turns, "ref")
    assert ratios == {"ref": [1.0, 1.0, 1.0], "fast": [2.0, 1.0, 2.0], "slow": [0.5, 0.5, 0.5]}
    assert {name: timing.median_of(r) for name, r in ratios.items()} == {"ref": 1.0, "fast": 2.0, "slow": 0.5}
    assert timing.median_of(turns["ref"]) / timing.median_of(turns["fast"]) == 1.0  # medians: no gain seen
    with pytest.raises(ValueError):  # (rounds of unequal counts are no pairs)
        timing.round_ratios({"ref": [1.0, 2.0], "other": [1.0]}, "ref")


@pytest.mark.gpu
def test_timing_protocol_on_gpu():
    from tritonkit.bench import timing

    x = torch.randn(4096, 4096, device="cuda")
    (p20, median, p80), method = timing.kernel_ms([lambda: lambda: x * 2])
    assert method == "cuda-graph" and 0 < p20 <= median <= p80
    assert 0 < timing.host_us(lambda: x * 2) < 1000
    assert 0.5 * median < timing.eager_ms(lambda: x * 2) < 100 * median  # its host path included


@pytest.mark.gpu
def test_extra_memory_counts_what_a_call_holds_beyond_its_gradients():
    """softmax's backward on (4096, 4096) fp32 (64 MiB): the forward's saved output and the upstream
    gradient are the backward's working memory (about 128 MiB), its returned dx is not counted."""
    workload = get_workload("softmax")
    fwd, bwd = (
        run_case(Case(workload, (4096, 4096), torch.float32, mode), ["tritonkit"], "cuda")[0]
        for mode in ("fwd", "bwd")
    )
    assert 48 <= fwd["peak_extra_mib"] <= 80  # the output
    assert 96 <= bwd["peak_extra_mib"] <= 200


@pytest.mark.gpu
def test_captured_backward_keeps_what_its_graph_reads_alive():
    """A backward's graph reads the forward output and upstream gradient that only the call holds:
    once capture returns, the replay must keep them alive, or their memory is reused under it."""
    import gc
    import weakref

    from tritonkit.bench import timing

    held = []

    def make_call():
        x = torch.randn(2048, 2048, device="cuda", requires_grad=True)
        y = torch.softmax(x, -1)
        dy = torch.randn_like(y)
        held.extend([weakref.ref(y), weakref.ref(dy)])
        return lambda: torch.autograd.grad(y, x, dy, retain_graph=True)

    replay, method = timing.capture(make_call)
    gc.collect()
    torch.cuda.empty_cache()
    assert method == "cuda-graph"
    assert held[0]() is not None and held[1]() is not None
    for _ in range(3):
        replay()
    torch.cuda.synchronize()  # an illegal address would raise here


@pytest.mark.gpu
def test_a_call_that_syncs_is_timed_eagerly_without_a_capture():
    """A call that waits on the host (liger-kernel's ``.item()``) is found before any capture begins:
    a failed capture would leave torch 2.11's allocator unable to free its idle memory."""
    from tritonkit.bench import timing

    x = torch.randn(4096, device="cuda")
    stream = torch.cuda.current_stream()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    call, method = timing.capture(lambda: lambda: (x * 2).sum().item())
    assert method.startswith("eager: capture failed (synchronizes with the host")
    assert torch.cuda.current_stream() == stream
    assert isinstance(call(), float)
    big = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    del big
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= reserved + 2**25


def test_cli_roofline_plot(tmp_path, capsys):
    """The device's roofline with the benchmarked points found under the results folder."""
    folder = tmp_path / "results" / "h200"
    folder.mkdir(parents=True)
    rows = [_timed_row("tritonkit", 0.05, measured_bandwidth=4.25e12), _timed_row("torch", 0.13)]
    (folder / "bias_gelu.json").write_text(json.dumps(rows))
    (folder / "host_overhead.json").write_text(json.dumps({"not": "rows"}))  # other files are skipped
    png = tmp_path / "roofline.png"
    assert main(["roofline", "--plot", str(png), "--results", str(tmp_path / "results")]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "bias_gelu, softmax, log_softmax" in capsys.readouterr().out
    assert main(["roofline"]) == 2 and "needs an OP and --shape" in capsys.readouterr().err
    # into a folder not there yet, from results not there: it says it plotted no points
    elsewhere = tmp_path / "new" / "roofline.png"
    assert main(["roofline", "--plot", str(elsewhere), "--results", str(tmp_path / "none")]) == 0
    assert elsewhere.is_file() and "no benchmarked points" in capsys.readouterr().out


def test_roofline_plot_axis_spans_the_points_and_the_ridge():
    from tritonkit.bench.report import _intensity_axis

    axis = _intensity_axis([0.3, 1.7], ridge=14.0)
    assert axis[0] == pytest.approx(0.01) and axis[-1] == pytest.approx(1000)  # a decade around each
    assert all(b > a for a, b in zip(axis, axis[1:], strict=False))
    axis = _intensity_axis([0.3, 400.0], ridge=14.0)  # a matmul past the ridge widens it
    assert axis[-1] == pytest.approx(1e4)


def test_python_dash_m_is_the_command():
    """``python -m tritonkit`` runs the same parser as the ``tritonkit`` script (a bad op: exit 2)."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "tritonkit", "roofline", "no_such_op"], capture_output=True, text=True
    )
    assert run.returncode == 2 and "no_such_op" in run.stderr


@pytest.mark.gpu
def test_gpu_a_cases_inputs_are_drawn_on_the_device(workload):
    """``runner._inputs`` on a GPU draws with a seeded generator of the GPU (a large case's inputs
    drawn on the CPU and copied took a second a row): bias_gelu's x is that generator's first draw,
    and the same seed gives the same values."""
    from tritonkit.bench import runner

    case = Case(workload, (64, 256), torch.float32, "fwd")
    x, bias = runner._inputs(case, "cuda", 7, False)
    expected = torch.randn(64, 256, generator=torch.Generator(device="cuda").manual_seed(7), device="cuda")
    assert x.is_cuda and bias.is_cuda and torch.equal(x, expected)
    assert torch.equal(runner._inputs(case, "cuda", 7, False)[0], x)


def test_a_setting_is_timed_as_a_provider_of_its_own_and_put_back(monkeypatch):
    """bench.settings: tritonkit's rows again under a module setting, labelled "tritonkit[label]",
    the setting put back (and plans and chosen configs forgotten) even when the run raises; a
    command line's shape; one line with every provider's times and the setting's ratio."""
    from types import SimpleNamespace

    from tritonkit.bench import runner, settings

    module, forgotten = SimpleNamespace(SWITCH=True), []
    monkeypatch.setattr(settings, "forget", lambda: forgotten.append(module.SWITCH))

    def run_case(case, providers, device, keep_going):
        assert providers == ["tritonkit"] and module.SWITCH is False
        return [{"provider": "tritonkit", "ms": 0.02, "eager_ms": 0.03}]

    monkeypatch.setattr(runner, "run_case", run_case)
    rows = settings.rows_under("case", "off", module, "SWITCH", False)
    assert rows == [{"provider": "tritonkit[off]", "ms": 0.02, "eager_ms": 0.03}]
    assert module.SWITCH is True and forgotten == [False, True]
    monkeypatch.setattr(runner, "run_case", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        settings.rows_under("case", "off", module, "SWITCH", False)
    assert module.SWITCH is True
    assert settings.shape_argument("2x12291808:fp16") == ((2, 12291808), "fp16")
    case = SimpleNamespace(
        workload=SimpleNamespace(name="cross_entropy"), shape=(8, 76), dtype=torch.bfloat16
    )
    case.mode = "fwd"
    line = settings.line(
        case,
        [
            {"provider": "tritonkit", "ms": 0.01, "eager_ms": 0.02, "pct_copy_same_bytes": 40.0},
            {"provider": "torch", "ms": 0.03, "eager_ms": 0.04},
            {"provider": "tritonkit[off]", "ms": 0.02, "eager_ms": 0.03, "check": "FAIL"},
        ],
    )
    assert line.startswith("cross_entropy 8x76 bf16 fwd: tritonkit 10.0, torch 30.0, tritonkit[off] 20.0 us")
    assert "x best peer 3.00" in line and "x off 2.00" in line and "40% of copy" in line
    assert "FAILED ['tritonkit[off]']" in line


def test_settings_compare_reports_each_case_and_writes_the_rows_so_far(monkeypatch, tmp_path):
    """``settings.compare``: every provider's rows then tritonkit's under each setting, a line a case
    through the caller's ``report``, the JSON rewritten after each case, torch.compile's peer
    compiled afresh for each case (past Dynamo's recompile limit it would run eagerly); no case
    starts past the deadline."""
    import json
    from types import SimpleNamespace

    from tritonkit.bench import runner, settings

    module = SimpleNamespace(SWITCH=True)
    monkeypatch.setattr(settings, "forget", lambda: None)
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(len(resets)))

    def run_case(case, providers, device, keep_going):
        if providers is None:  # every provider's: Dynamo reset before each case's
            assert len(resets) == case.shape[1] - 4
        return [{"provider": "tritonkit", "ms": 0.01 if module.SWITCH else 0.02, "eager_ms": 0.03}]

    monkeypatch.setattr(runner, "run_case", run_case)
    cases = [
        SimpleNamespace(workload=SimpleNamespace(name="op"), shape=(4, n), dtype=torch.float32, mode="fwd")
        for n in (5, 6)
    ]
    out, lines = tmp_path / "rows.json", []
    rows = settings.compare(cases, {"off": (module, "SWITCH", False)}, str(out), "cmd", lines.append)
    assert [row["provider"] for row in rows] == ["tritonkit", "tritonkit[off]"] * 2
    assert len(lines) == 2 and lines[1].startswith("op 4x6 fp32 fwd:") and "x off 2.00" in lines[1]
    assert len(resets) == 2
    assert json.loads(out.read_text()) == {"command": "cmd", "rows": rows}
    lines.clear()
    assert settings.compare(cases, {}, str(out), "cmd", lines.append, deadline=-1.0) == []
    assert lines == ["deadline: op (4, 5) fwd and later cases not run"]


def test_a_reference_out_of_device_memory_leaves_the_row_timed_and_marked_unchecked(workload, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB (a stand-in)")

    monkeypatch.setattr(runner, "_check", out_of_memory)
    [row] = run_case(Case(workload, (7, 33), torch.float32, "fwd"), ["tritonkit"], "cpu")
    assert row["check"] == runner.UNCHECKED and "ran out of device memory" in row["error"]
    assert "check" in row["bench_s"]  # the row went on past its check
    table = markdown_table(
        [_timed_row("tritonkit", 0.1, check=row["check"]), _timed_row("torch", 0.2, check="pass")]
    )
    assert "(unchecked)" in table and "FAIL" not in table


def test_cli_bench_says_which_rows_went_unchecked(monkeypatch, capsys):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(runner, "_check", out_of_memory)
    assert main(["bench", "bias_gelu", "--mode", "fwd", "--providers", "tritonkit", "--no-progress"]) == 0
    assert "rows not checked: the float64 reference ran out of device memory" in capsys.readouterr().err


def test_a_peer_out_of_device_memory_while_timed_gets_a_row_saying_so(workload, monkeypatch):
    fails = {"torch"}  # the providers whose measures run out of device memory

    def measured(fn, case, inputs, provider, clock):
        if provider in fails:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB (a stand-in)")
        return {"ms": 0.1, "gbps": 100.0}

    made_on = []
    real_inputs = runner._inputs

    def inputs_on_the_cpu(case, device, seed, requires_grad):  # the row's "cuda" run, on this machine
        made_on.append(device)
        return real_inputs(case, "cpu", seed, requires_grad)

    monkeypatch.setattr(runner, "_measured", measured)
    monkeypatch.setattr(runner, "_make_room", lambda case: None)
    monkeypatch.setattr(runner, "_free_device_memory", lambda: None)
    monkeypatch.setattr(runner, "_inputs", inputs_on_the_cpu)
    case = Case(workload, (7, 33), torch.float32, "fwd")
    rows = run_case(case, ["tritonkit", "torch"], "cuda")
    assert made_on == ["cuda", "cuda"]
    ours, peer = rows
    assert ours["ms"] == 0.1 and "unavailable" not in ours
    assert peer["provider"] == "torch" and peer["unavailable"].startswith(runner.OUT_OF_MEMORY)
    assert "8.00 GiB" in peer["unavailable"] and peer["check"] == "pass"  # checked before it was timed
    table = markdown_table([_timed_row("tritonkit", 0.1), peer | {"shape": [8192, 4096], "dtype": "bf16"}])
    assert "out of memory" in table and "refused" not in table
    # tritonkit's own is a finding: raised, or in a sweep (keep_going) a row saying so
    fails.add("tritonkit")
    with pytest.raises(torch.OutOfMemoryError):
        run_case(case, ["tritonkit"], "cuda")
    [row] = run_case(case, ["tritonkit"], "cuda", keep_going=True)
    assert row["unavailable"].startswith(runner.OUT_OF_MEMORY)
