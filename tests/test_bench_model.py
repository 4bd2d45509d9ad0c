"""The model benchmark: its CLI, and its rows, tables, plot and files from a tiny model on the CPU
(CUDA's timers stood in: the timing itself runs on a GPU only)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from tritonkit.bench import model
from tritonkit.cli import build_parser, main

pytestmark = pytest.mark.infra
transformers = pytest.importorskip("transformers")

TINY = model.ModelShape("llama", "tiny", 64, 4, 2, 16, 96, 128, 10000.0)


def test_cli_parses_bench_model_and_refuses_what_it_does_not_take(capsys):
    args = build_parser().parse_args(
        ["bench", "model", "--case", "qwen3-8b", "--layers", "2", "--no-generate"]
    )
    assert args.ops == ["model"] and args.case == ["qwen3-8b"] and args.layers == 2 and args.no_generate
    assert main(["bench", "model", "--mode", "fwd"]) == 2
    assert "takes --case" in capsys.readouterr().err
    assert main(["bench", "model", "--providers", "vllm"]) == 2
    assert main(["bench", "layer", "--case", "llama3-8b"]) == 2  # a model's case, not a layer's
    assert "bench layer's cases" in capsys.readouterr().err
    assert main(["bench", "softmax", "--layers", "2"]) == 2
    assert main(["bench", "layer", "--no-generate"]) == 2
    if not torch.cuda.is_available():
        assert main(["bench", "model"]) == 2
        assert "CUDA GPU" in capsys.readouterr().err


def test_every_case_builds_its_configuration():
    for shape in model.CASES.values():
        config = shape.config(2)
        assert (config.hidden_size, config.vocab_size, config.num_hidden_layers) == (
            shape.dim,
            shape.vocab,
            2,
        )
        assert (config.num_attention_heads, config.num_key_value_heads) == (shape.heads, shape.kv_heads)
        assert config.head_dim == shape.head_dim and config.model_type == shape.arch


class _Event:
    """torch.cuda.Event's timing on the host clock."""

    def __init__(self, **_):
        self.at = 0.0

    def record(self):
        self.at = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return (end.at - self.at) * 1e3


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(model.CASES, "tiny", TINY)
    for name, value in {
        "TRAIN_BATCH": 2,
        "TRAIN_SEQ": 16,
        "GEN_BATCH": 2,
        "GEN_PROMPT": 8,
        "GEN_NEW": 3,
    }.items():
        monkeypatch.setattr(model, name, value)
    monkeypatch.setattr(model, "WARMUP", 0)
    monkeypatch.setattr(model, "STEPS", 2)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    for name in ("memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: 0)


def test_a_tiny_models_rows_tables_plot_and_files(tiny, tmp_path):
    """A step row and a generate row of transformers' own model, their tables and plot; a later run
    of another case at the same commit keeps these rows in model.json, one of another commit drops
    them."""
    lines = []
    rows = model.run_case("tiny", 1, ["transformers"], lines.append, device="cpu")
    assert [(r["provider"], r["kind"]) for r in rows] == [
        ("transformers", "step"),
        ("transformers", "generate"),
    ]
    step, generated = rows
    assert step["ms"] > 0 and step["tokens_per_s"] > 0 and 0 < step["loss"] < 20
    assert generated["decode_tokens_per_s"] > 0 and len(generated["tokens"]) == 2
    assert all(len(t) == 3 for t in generated["tokens"])
    assert len(lines) == 2 and lines[0].startswith("bench model tiny step transformers: ")
    table = model.markdown_table(rows)
    assert "| tiny, 1 layers | transformers |" in table and "decode tokens/s" in table
    for row in rows:
        row["gpu"] = "NVIDIA H200"
    json_path, md_path, png_path = model.write_results(rows, tmp_path)
    assert png_path.read_bytes()[:4] == b"\x89PNG" and "decode tokens/s" in md_path.read_text()
    other = [r | {"case": "other"} for r in rows]
    model.write_results(other, tmp_path)
    assert [r["case"] for r in json.loads(json_path.read_text())] == ["tiny", "tiny", "other", "other"]
    model.write_results([r | {"git_sha": "0000000"} for r in other], tmp_path)
    assert [r["case"] for r in json.loads(json_path.read_text())] == ["other", "other"]


def test_ratios_and_token_agreement():
    rows = [
        {"case": "c", "kind": "step", "provider": "transformers", "ms": 100.0},
        {"case": "c", "kind": "step", "provider": "tritonkit", "ms": 80.0},
        {"case": "c", "kind": "generate", "provider": "transformers", "decode_tokens_per_s": 100.0,
         "tokens": [[1, 2, 3], [4, 5, 6]]},
        {"case": "c", "kind": "generate", "provider": "tritonkit", "decode_tokens_per_s": 90.0,
         "tokens": [[1, 2, 9], [4, 5, 6]]},
    ]  # fmt: skip
    rows.append({"case": "c", "kind": "step", "provider": "liger", "error": "OutOfMemoryError: ..."})
    model.add_ratios(rows)
    assert rows[1]["vs"] == {"transformers": 1.25} and rows[0]["vs"] == {"tritonkit": 0.8}
    assert rows[3]["vs"] == {"transformers": 0.9} and rows[3]["same_tokens_until"] == [2, 3]
    assert "vs" not in rows[4]  # a failed provider's row: no ratio, to it or from it


def test_a_provider_that_fails_is_a_row_that_says_so(tiny, monkeypatch):
    prepare = model.prepare

    def failing(provider, base):
        if provider == "liger":
            raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")
        return prepare(provider, base)

    monkeypatch.setattr(model, "prepare", failing)
    rows = model.run_case(
        "tiny", 1, ["transformers", "liger"], lambda line: None, generate=False, device="cpu"
    )
    failed = rows[1]
    assert failed["provider"] == "liger" and failed["error"].startswith("OutOfMemoryError: CUDA out of")
    assert "| tiny, 1 layers | liger | failed: " in model.markdown_table(rows)
