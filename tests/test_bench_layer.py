"""The decoder-layer benchmark: the layer, its check against torch, its FLOP count, rows, files, CLI."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tritonkit import _runtime
from tritonkit.bench import layer
from tritonkit.cli import build_parser, main

pytestmark = pytest.mark.infra


def _meta_layer(shape: layer.LayerShape) -> tuple:
    """(x, weights) of the shape on the meta device: the real sizes, no memory, no arithmetic."""

    def meta(*size):
        return torch.empty(size, device="meta", dtype=torch.bfloat16, requires_grad=True)

    qkv, d, f = (shape.heads + 2 * shape.kv_heads) * shape.head_dim, shape.dim, shape.ffn
    w = layer.Weights(
        meta(d),
        meta(qkv, d),
        meta(d, shape.heads * shape.head_dim),
        meta(d),
        meta(f, d),
        meta(f, d),
        meta(d, f),
    )
    return meta(shape.batch, shape.seq, d), w


def test_the_layer_builds_with_the_weights_of_its_shape():
    shape = layer.TINY
    x, g = layer.make_inputs(shape, torch.bfloat16, "cpu")
    w = layer.make_weights(shape, torch.bfloat16, "cpu")
    assert w.qkv.shape == ((2 + 2 * 1) * 32, 64) and w.out.shape == (64, 64) and w.down.shape == (64, 128)
    assert all(p.requires_grad and p.is_leaf for p in (x, *w)) and not g.requires_grad
    assert layer.torch_layer(x, w, shape).shape == x.shape
    # seeded: the same weights every run, and the norm weights are not all ones
    assert torch.equal(layer.make_weights(shape, torch.bfloat16, "cpu").gate, w.gate)
    assert not torch.equal(w.attn_norm, torch.ones_like(w.attn_norm))
    assert [case.dims() for case in layer.CASES.values()] == [
        [2, 4096, 4096, 32, 8, 128, 14336],
        [2, 4096, 2048, 32, 8, 64, 8192],
        [1, 16384, 4096, 32, 8, 128, 14336],
    ]


def test_the_tritonkit_layer_matches_the_torch_layer_under_the_interpreter():
    assert _runtime.interpret()  # the CPU suite: every tritonkit kernel of the layer interpreted
    rows = layer.run_case("tiny", layer.TINY, torch.bfloat16, layer.PROVIDERS, layer.MODES, "cpu")
    by = {(r["provider"], r["mode"]): r for r in rows}
    assert set(by) == {(p, m) for p in layer.PROVIDERS for m in layer.PROVIDER_MODES.get(p, layer.MODES)}
    assert by["tritonkit[nondeterministic]", "fwd+bwd"]["check"] == "pass"
    for mode in layer.MODES:
        ours = by["tritonkit", mode]
        assert ours["check"] == "pass" and 0 < ours["max_rel_err"] <= layer.REL_TOLERANCE, ours
        assert by["torch", mode]["check"] == "reference"
        assert "unavailable" in by["torch.compile", mode]  # needs a GPU
        assert ours["flops"] == layer.layer_flops(layer.TINY, mode)["total"] and "ms" not in ours


def test_the_check_fails_a_wrong_layer_and_names_the_tensor():
    reference = [torch.randn(8, 8) for _ in layer.TENSOR_NAMES]
    assert layer.check([r.clone() for r in reference], reference)["check"] == "pass"
    wrong = [r.clone() for r in reference]
    wrong[3] *= 1.1  # one gradient 10% off
    verdict = layer.check(wrong, reference)
    assert verdict["check"] == "FAIL" and verdict["worst_tensor"] == layer.TENSOR_NAMES[3]
    assert verdict["max_rel_err"] == pytest.approx(0.1, rel=1e-3)
    wrong[3] = torch.full((8, 8), math.nan)
    assert layer.check(wrong, reference)["max_rel_err"] == math.inf
    wrong[3] = None  # a gradient that never arrived
    assert layer.check(wrong, reference)["check"] == "FAIL"


def test_a_provider_that_raises_gives_rows_saying_so(monkeypatch):
    def broken(provider, shape, backend):
        return lambda x, w: (_ for _ in ()).throw(RuntimeError("kernel exploded"))

    monkeypatch.setattr(layer, "build", broken)
    with pytest.raises(RuntimeError):  # the reference itself cannot fail quietly
        layer.run_case("tiny", layer.TINY, torch.bfloat16, ["tritonkit"], layer.MODES, "cpu")
    x, g = layer.make_inputs(layer.TINY, torch.bfloat16, "cpu")
    w = layer.make_weights(layer.TINY, torch.bfloat16, "cpu")
    inputs = (x, w, g, None)
    fn = broken("tritonkit", layer.TINY, None)
    ours = layer._checked_rows("tritonkit", fn, "tiny", layer.TINY, inputs, [], ["fwd"])
    assert ours[0]["check"] == "FAIL" and "kernel exploded" in ours[0]["error"]
    peer = layer._checked_rows("torch.compile", fn, "tiny", layer.TINY, inputs, [], ["fwd"])
    assert "kernel exploded" in peer[0]["unavailable"] and "check" not in peer[0]


def test_the_providers_are_timed_in_turns_a_mode_at_a_time(monkeypatch):
    """Every checked provider's step of a mode goes to one ``time_in_turns`` call with the others';
    a provider left out of ``built`` (unavailable, or raised) is not timed."""
    turns = []

    def fake_turns(calls, tensors):
        turns.append(sorted(calls))
        return {name: 2.0 + i for i, name in enumerate(calls)}, dict.fromkeys(calls, 0.01)

    monkeypatch.setattr(layer, "time_in_turns", fake_turns)
    monkeypatch.setattr(layer, "measure", lambda call, tensors: {"peak_bytes": 1, "host_ms": 0.5})
    rows = [
        layer._base_row("tiny", layer.TINY, torch.bfloat16, provider, mode)
        for provider in ("tritonkit", "torch", "liger")
        for mode in layer.MODES
    ]
    x, g = layer.make_inputs(layer.TINY, torch.bfloat16, "cpu")
    w = layer.make_weights(layer.TINY, torch.bfloat16, "cpu")
    built = {name: layer.build(name, layer.TINY, None) for name in ("tritonkit", "torch")}
    layer._time_rows(built, rows, (x, w, g))
    assert turns == [["torch", "tritonkit"], ["torch", "tritonkit"]]  # fwd+bwd, then fwd
    timed = {(r["provider"], r["mode"]): r for r in rows if "ms" in r}
    assert set(timed) == {(p, m) for p in ("tritonkit", "torch") for m in layer.MODES}
    ours = timed[("tritonkit", "fwd")]
    assert ours["ms"] == 2.0 and ours["ms_spread"] == 0.01 and ours["host_ms"] == 0.5
    assert ours["tflops"] == pytest.approx(ours["flops"] / 2e-3 / 1e12)


def test_a_provider_failing_in_the_turns_loses_no_other_row(monkeypatch):
    """Turns that raise (one provider out of memory) time each provider alone; the one that raises
    alone has its rows marked, the others are timed."""

    def fake_turns(calls, tensors):
        if len(calls) > 1 or "torch" in calls:
            raise RuntimeError("CUDA out of memory")
        return dict.fromkeys(calls, 3.0), dict.fromkeys(calls, 0.02)

    monkeypatch.setattr(layer, "time_in_turns", fake_turns)
    monkeypatch.setattr(layer, "measure", lambda call, tensors: {"peak_bytes": 1})
    rows = [layer._base_row("tiny", layer.TINY, torch.bfloat16, p, "fwd") for p in ("tritonkit", "torch")]
    rows = [row | {"check": "pass"} for row in rows]
    x, g = layer.make_inputs(layer.TINY, torch.bfloat16, "cpu")
    w = layer.make_weights(layer.TINY, torch.bfloat16, "cpu")
    built = {name: layer.build(name, layer.TINY, None) for name in ("tritonkit", "torch")}
    layer._time_rows(built, rows, (x, w, g))
    ours, theirs = rows
    assert ours["ms"] == 3.0 and "ms" not in theirs and "out of memory" in theirs["unavailable"]


@pytest.mark.parametrize("case", list(layer.CASES))
def test_flops_match_torchs_flop_counter(case):
    """The counter's own count at the real sizes (meta tensors): its mm are the projections (forward
    and, in the backward, dX and dW of each); the SDPA on meta runs the math path, whose bmm count
    the full score matrix, two matmuls forward and four backward. The kernels' count takes half the
    matrix (causal) and five backward matmuls (the scores recomputed)."""
    shape = layer.CASES[case]
    x, w = _meta_layer(shape)
    counts = {}
    for mode in layer.MODES:
        with FlopCounterMode(display=False) as counter:
            out = layer.torch_layer(x, w, shape)
            if mode == "fwd+bwd":
                out.backward(torch.empty_like(out))
        counts[mode] = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    # (score-matrix matmuls the counter counts, the kernels' count) per mode
    for mode, (theirs, kernels) in (("fwd", (2, 2)), ("fwd+bwd", (2 + 4, 2 + 5))):
        ours = layer.layer_flops(shape, mode)
        assert ours["matmul"] == counts[mode]["aten.mm"]
        assert ours["attention"] == pytest.approx(counts[mode]["aten.bmm"] / theirs * kernels / 2)
        assert ours["total"] == ours["matmul"] + ours["attention"]


def test_the_causal_attention_count_is_the_visible_pairs():
    """Counted pair by pair: query i sees keys 0..i, each pair 2 D FLOPs a matmul; the formula's S^2 / 2
    leaves out the diagonal's S / 2 pairs, a relative 1 / (S + 1)."""
    for shape in (*layer.CASES.values(), layer.TINY):
        pairs = sum(i + 1 for i in range(shape.seq))
        exact = shape.batch * shape.heads * pairs * 2 * shape.head_dim * 2
        ours = layer.layer_flops(shape, "fwd")["attention"]
        assert ours == pytest.approx(exact, rel=1.01 / (shape.seq + 1))
        assert layer.layer_flops(shape, "bwd")["attention"] == 2.5 * ours


def _timed_rows() -> list[dict]:
    base = {"op": "layer", "case": "8b-4k", "model": "llama3-8b", "shape": layer.CASES["8b-4k"].dims()}
    base |= {"dtype": "bf16", "gpu": "NVIDIA H200", "torch": "2.9", "triton": "3.6", "git_sha": "abc1234"}
    times = {
        "torch": (19.0, 3 * 2**30),
        "torch.compile": (18.0, 2 * 2**30),
        "tritonkit[nondeterministic]": (16.0, 4 * 2**30),
        "tritonkit": (20.0, 4 * 2**30),
    }
    rows = []
    for provider, (ms, peak) in times.items():
        row = base | {"provider": provider, "mode": "fwd+bwd", "ms": ms, "tflops": 600.0}
        rows.append(
            row | {"peak_bytes": peak, "peak_gib": peak / 2**30, "check": "pass", "max_rel_err": 0.01}
        )
    return rows


def test_ratios_tables_and_files(tmp_path):
    rows = _timed_rows()
    layer.add_ratios(rows)
    ours = rows[-1]
    assert ours["vs_torch"] == pytest.approx(19 / 20) and ours["vs_compile"] == pytest.approx(18 / 20)
    assert ours["memory_vs_torch"] == pytest.approx(4 / 3) and ours["memory_vs_compile"] == 2
    assert "vs_torch" not in rows[0]
    table = layer.markdown_table(rows)
    assert "19.00 / 18.00 / 20.00" in table and "3.00 / 2.00 / 4.00" in table
    assert "| fwd+bwd | 19.00 / 18.00 / 20.00 |" in table and "| 0.95x | 0.90x | pass (1.0e-02) |" in table
    # the nondeterministic step on a line of its own, below the default's
    assert "| fwd+bwd [nondeterministic] | 19.00 / 18.00 / 16.00 |" in table
    assert table.index("[nondeterministic]") > table.index("20.00")
    assert layer.profile_table(rows) == ""  # no profiled rows, no table
    rows[-1] |= {"kernel_ms": 19.5, "profiled_span_ms": 20.5, "host_ms": 7.25}
    rows[-1]["kernel_ms_by_kind"] = {"attention": 4.0, "matmul": 14.0, "other": 1.5}
    assert (
        "| 8b-4k | fwd+bwd | tritonkit | 20.00 | 7.25 | 4.00 | 14.00 | 1.50 | 1.00 |"
        in layer.profile_table(rows)
    )
    # the second profile, in the reverse order, beside the first's kernel time
    rows[-1]["kernel_ms_reversed"] = 19.25
    assert "| 1.50 | 1.00 | 19.50 / 19.25 |" in layer.profile_table(rows)
    assert [
        layer.kernel_kind(n) for n in ("_attn_fwd_sm90_kernel", "nvjet_tst_128x256", "_norm_fwd_kernel")
    ] == [
        "attention",
        "matmul",
        "other",
    ]
    paths = layer.write_results(rows, tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in paths] == ["h200/layer.json", "h200/layer.md"]
    assert json.loads(paths[0].read_text()) == rows
    # another case's run into the same folder keeps these rows (same commit), a rerun replaces them
    other = [row | {"case": "d64-4k"} for row in rows]
    layer.write_results(other, tmp_path)
    assert json.loads(paths[0].read_text()) == rows + other
    layer.write_results(rows, tmp_path)
    assert json.loads(paths[0].read_text()) == other + rows
    # rows of another commit go
    layer.write_results([row | {"git_sha": "0000000"} for row in rows], tmp_path)
    assert {row["git_sha"] for row in json.loads(paths[0].read_text())} == {"0000000"}
    layer.write_results(rows, tmp_path)
    assert paths[1].read_text().startswith("NVIDIA H200, torch 2.9, triton 3.6, at abc1234")
    # rows of two runs (a case measured later, at another commit) name both runs
    later = [row | {"git_sha": "def5678", "command": "tritonkit bench layer --case 8b-16k"} for row in rows]
    line = layer.provenance_line(rows + later).split(", ", 3)[3]
    assert line.startswith("at abc1234: `") and line.endswith(
        "; at def5678: `tritonkit bench layer --case 8b-16k`"
    )


def test_a_time_limit_starts_no_case_the_run_would_not_finish(monkeypatch):
    monkeypatch.setattr(_runtime, "interpret", lambda: False)  # the GPU path's case list, faked cases

    def fake_case(name, shape, dtype, providers, modes, device, on_provider=None):
        time.sleep(0.2)
        return [{"op": "layer", "case": name, "provider": "torch", "mode": "fwd"}]

    monkeypatch.setattr(layer, "run_case", fake_case)
    rows, not_run = layer.run(list(layer.CASES), progress=False, time_limit=0.3)
    assert [r["case"] for r in rows] == ["8b-4k"] and not_run == ["d64-4k", "8b-16k"]
    rows, not_run = layer.run(["8b-4k", "8b-16k"], progress=False)
    assert [r["case"] for r in rows] == ["8b-4k", "8b-16k"] and not_run == []


def test_cli_parses_bench_layer(capsys):
    args = build_parser().parse_args(["bench", "layer", "--case", "8b-4k", "d64-4k", "--time-limit", "200"])
    assert args.ops == ["layer"] and args.case == ["8b-4k", "d64-4k"] and args.time_limit == 200
    assert args.mode is None  # each benchmark's own default modes
    assert main(["bench", "layer", "--mode", "bwd"]) == 2
    assert "fwd+bwd and fwd" in capsys.readouterr().err
    assert main(["bench", "layer", "softmax"]) == 2
    assert main(["bench", "softmax", "--case", "8b-4k"]) == 2
    assert "layer's and the model's" in capsys.readouterr().err
    assert main(["bench", "softmax", "--time-limit", "60"]) == 2
    assert "--time-limit is the layer's" in capsys.readouterr().err
    assert main(["bench", "layer", "--dtype", "fp32"]) == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "layer", "--case", "70b"])
    # the op tables' options were ignored by the layer (a stopped run given --resume started over)
    assert main(["bench", "layer", "--resume", "--only", "9x9"]) == 2
    assert (
        "--resume, --only: the op tables' options, not `tritonkit bench layer`'s" in capsys.readouterr().err
    )
    assert main(["bench", "layer", "--sweep", "3"]) == 2
    assert main(["bench", "softmax", "--seed", "7"]) == 2  # (ignored without --sweep)
    assert "give --sweep N too" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # no abbreviations: --resum once ran a stopped run from the start
        build_parser().parse_args(["bench", "softmax", "--resum"])


def test_the_roofline_plot_passes_over_the_layer_rows(tmp_path, capsys):
    """layer.json sits beside the ops' results: its rows have FLOPs and no bytes, so no roofline point."""
    folder = tmp_path / "results" / "h200"
    folder.mkdir(parents=True)
    rows = _timed_rows()
    (folder / "layer.json").write_text(json.dumps([r | {"flops": 1e13} for r in rows]))
    png = tmp_path / "roofline.png"
    assert main(["roofline", "--plot", str(png), "--results", str(tmp_path / "results")]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_second_profile_runs_the_providers_in_the_reverse_order(monkeypatch):
    """``_profile_reversed`` profiles each provider again, last timed first, and keeps its kernel time
    beside the first pass's; a failing profile leaves the rows as they were."""
    from tritonkit.bench import layer

    seen = []

    def fake_profile(call, tensors):
        seen.append(call())
        return {"kernel_ms": 10.0 + len(seen), "kernel_ms_by_kind": {"other": 1.0}}

    monkeypatch.setattr(layer, "kernel_profile", fake_profile)
    rows = {"a": {}, "b": {}}
    layer._profile_reversed({"b": lambda: "b", "a": lambda: "a"}, rows, [])
    assert seen == ["b", "a"]
    assert rows == {
        "a": {"kernel_ms_reversed": 12.0, "kernel_ms_by_kind_reversed": {"other": 1.0}},
        "b": {"kernel_ms_reversed": 11.0, "kernel_ms_by_kind_reversed": {"other": 1.0}},
    }

    def failing(call, tensors):
        raise RuntimeError("no profiler")

    monkeypatch.setattr(layer, "kernel_profile", failing)
    untouched = {"a": {}}
    layer._profile_reversed({"a": lambda: "a"}, untouched, [])
    assert untouched == {"a": {}}
