"""``tritonkit bench model``: a Hugging Face causal LM's training step and its generation on one GPU,
transformers as it is against torch.compile, liger-kernel and tritonkit.integrations.transformers.

Cases (CASES): Llama-3-8B's and Qwen3-8B's shapes with LAYERS of their decoder layers (the rest of
the model whole: embeddings, final norm, the LM head over the full vocabulary), random weights,
bf16, built from a config (no download). Providers, in this order:
- ``transformers``: the model as transformers builds it, attention by SDPA;
- ``transformers+compile``: ``torch.compile`` of that model;
- ``tritonkit``: ``tritonkit.integrations.transformers.apply(model)``;
- ``tritonkit+compile``: ``torch.compile`` of the patched model;
- ``liger``: liger-kernel's ``_apply_liger_kernel_to_instance(model)``. liger patches globally (it
  replaces transformers' RoPE function and the model classes' forwards), so it runs last, after
  every other provider's rows.

A training step: the forward with labels, the backward, ``torch.optim.AdamW(fused=True).step()``
and ``zero_grad``, on TRAIN_BATCH x TRAIN_SEQ random tokens; timed by CUDA events, the median of
STEPS steps after WARMUP steps and HEAT_S seconds of steps (hot: at the power limit a training run
sustains, which the step reaches after about a second); tokens/s from the batch's tokens; peak
memory over what was held before the step (the weights, their gradients and AdamW's state); the
first step's loss (the same weights and batch for every provider: they agree to bf16's rounding);
the host's time to issue a step and a kernel profile (``bench.layer``'s: GPU time by kernel
kind, the longest kernels).

Generation (GENERATE_PROVIDERS): greedy, GEN_BATCH sequences of GEN_PROMPT random tokens. The
prefill is a generate of one new token, the decode the rest of a generate of GEN_NEW: decode
tokens/s = GEN_BATCH x (GEN_NEW - 1) over the two calls' difference; each call timed after an
untimed one of its own length (what compiles, tunes or allocates for a length does it there);
``gpu_busy``, from one more generate under torch.profiler, is the share of its time the GPU ran
kernels (far under 1: the host's issuing is the decode's time).
"""

from __future__ import annotations

import copy
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger("tritonkit")

OP = "model"
PROVIDERS = ("transformers", "transformers+compile", "tritonkit", "tritonkit+compile", "liger")
GENERATE_PROVIDERS = ("transformers", "tritonkit")
TRAIN_BATCH, TRAIN_SEQ = 2, 4096
GEN_BATCH, GEN_PROMPT, GEN_NEW = 16, 2048, 256
WARMUP, STEPS = 3, 10
# Seconds of steps before the timed ones, so that they run at the clock of the H200's 700 W limit: a
# decoder layer's step reached it within about a second and ran 12-16% slower there than cool (perf
# notes, "The layer's step under sustained load"); 3 warm-up steps of a ~90 ms step fell short of it.
HEAT_S = 2.0
LAYERS = 4  # of the 32 (Llama-3-8B) and 36 (Qwen3-8B): a step's memory and the run's time stay small


class ModelShape(NamedTuple):
    arch: str  # transformers' model_type
    model: str
    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float

    def config(self, layers: int):
        """The transformers config of this shape with ``layers`` decoder layers."""
        import transformers

        kind = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[self.arch]
        return kind(
            vocab_size=self.vocab,
            hidden_size=self.dim,
            intermediate_size=self.ffn,
            num_hidden_layers=layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=max(TRAIN_SEQ, GEN_PROMPT + GEN_NEW),
            rope_theta=self.rope_theta,
            tie_word_embeddings=False,
        )


CASES = {
    "llama3-8b": ModelShape("llama", "Llama-3-8B", 4096, 32, 8, 128, 14336, 128256, 500000.0),
    "qwen3-8b": ModelShape("qwen3", "Qwen3-8B", 4096, 32, 8, 128, 12288, 151936, 1000000.0),
}


# ---------------------------------------------------------------- providers


def build_model(shape: ModelShape, layers: int, device) -> torch.nn.Module:
    """The case's model, random weights (seeded), bf16, in training mode."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(shape.config(layers)).to(torch.bfloat16)
    return model.train()


def prepare(provider: str, base: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``base`` as ``provider`` runs it (module docstring)."""
    model = copy.deepcopy(base)
    if provider.startswith("tritonkit"):
        from tritonkit.integrations import transformers as tk_hf

        model = tk_hf.apply(model)
    if provider == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    return torch.compile(model) if provider.endswith("+compile") else model


def available(provider: str) -> bool:
    if provider == "liger":
        try:
            import liger_kernel.transformers  # noqa: F401
        except ImportError:
            return False
    return True


# ---------------------------------------------------------------- the step and the generation


def step_row(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    """The training step's fields (module docstring) for a prepared model."""
    from tritonkit.bench import layer, timing

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    first = step().item()
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    heated = time.perf_counter()
    while time.perf_counter() - heated < HEAT_S:
        step()
        torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = [timing.call_ms(step, ids.device) for _ in range(STEPS)]
    peak = torch.cuda.max_memory_allocated() - held
    ms = statistics.median(times)
    row = {"ms": ms, "tokens_per_s": ids.numel() / ms * 1e3, "peak_gib": peak / 2**30, "loss": first}
    try:
        return row | {"host_ms": layer.host_ms(step, [])} | layer.kernel_profile(step, [])
    except Exception as error:  # a diagnostic: the timing stands without it
        log.warning("tritonkit: bench model's kernel profile failed: %s", error)
        return row


def _timed_generate(model: torch.nn.Module, prompt: torch.Tensor, new: int) -> tuple[float, torch.Tensor]:
    settings = {"attention_mask": torch.ones_like(prompt), "pad_token_id": 0, "do_sample": False}
    settings |= {"max_new_tokens": new, "min_new_tokens": new}
    model.generate(prompt, **settings)  # untimed: this length's one-time work
    torch.cuda.synchronize()
    started = time.perf_counter()
    tokens = model.generate(prompt, **settings)
    torch.cuda.synchronize()
    return time.perf_counter() - started, tokens[:, prompt.shape[1] :]


def generate_row(model: torch.nn.Module, prompt: torch.Tensor) -> dict:
    """The generation's fields (module docstring) for a prepared model."""
    model.eval()
    with torch.no_grad():
        prefill_s, _ = _timed_generate(model, prompt, 1)
        total_s, tokens = _timed_generate(model, prompt, GEN_NEW)
        busy = _gpu_busy(lambda: _timed_generate(model, prompt, GEN_NEW))
    decode_s = max(total_s - prefill_s, 1e-9)
    return {
        "prefill_ms": prefill_s * 1e3,
        "generate_s": total_s,
        "decode_tokens_per_s": prompt.shape[0] * (GEN_NEW - 1) / decode_s,
        "decode_ms_per_token": decode_s / (GEN_NEW - 1) * 1e3,
        "tokens": tokens.tolist(),
    } | busy


def _gpu_busy(call: Callable[[], tuple[float, torch.Tensor]]) -> dict:
    """{"gpu_busy": the share of a timed call's time its kernels ran}, from one torch.profiler run of
    it: far under 1, the host's issuing is the time; {} where the profiler sees no GPU."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            seconds, _ = call()
    except Exception as error:  # a diagnostic
        log.warning("tritonkit: bench model's generation profile failed: %s", error)
        return {}
    kernel_us = sum(
        e.device_time_total for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    )
    return {"gpu_busy": kernel_us / 1e6 / seconds}


def same_until(tokens: list[list[int]], reference: list[list[int]]) -> list[int]:
    """Per sequence, the new tokens shared with ``reference`` before the first that differs (random
    weights give flat logits, whose near-ties bf16's rounding breaks either way)."""
    same = []
    for ours, theirs in zip(tokens, reference, strict=True):
        differ = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
        same.append(differ[0] if differ else len(ours))
    return same


# ---------------------------------------------------------------- a run


def run_case(
    name: str,
    layers: int,
    providers: list[str],
    report: Callable[[str], None],
    generate: bool = True,
    device="cuda",
) -> list[dict]:
    """One case's rows: a step row for each provider, a generate row for GENERATE_PROVIDERS (before
    liger's step: its patches are global)."""
    from tritonkit.bench.runner import provenance

    shape = CASES[name]
    base = build_model(shape, layers, device)
    seeded = torch.Generator(device)
    train, gen = (TRAIN_BATCH, TRAIN_SEQ), (GEN_BATCH, GEN_PROMPT)
    ids = torch.randint(0, shape.vocab, train, device=device, generator=seeded.manual_seed(0))
    prompt = torch.randint(0, shape.vocab, gen, device=device, generator=seeded.manual_seed(1))
    common = {"op": OP, "case": name, "model": shape.model, "layers": layers, "shape": list(shape)}
    common |= provenance()
    rows: list[dict] = []

    def add(provider: str, kind: str, measure: Callable[[torch.nn.Module], dict]) -> None:
        started = time.perf_counter()
        try:
            fields = measure(prepare(provider, base))
        except Exception as error:  # a provider that fails (out of memory, an unsupported model)
            fields = {"error": f"{type(error).__name__}: {error}"[:300]}  # is a row that says so
        torch.cuda.empty_cache()  # the provider's copy is gone with its row
        rows.append(common | {"provider": provider, "kind": kind} | fields)
        outcome = f"FAILED, {fields['error']}" if "error" in fields else "done"
        report(f"bench model {name} {kind} {provider}: {outcome} in {time.perf_counter() - started:.1f} s")

    for provider in providers:
        if provider == "liger" and generate:
            for generating in [p for p in GENERATE_PROVIDERS if p in providers]:
                add(generating, "generate", lambda model: generate_row(model, prompt))
            generate = False
        add(provider, "step", lambda model: step_row(model, ids))
    for generating in [p for p in GENERATE_PROVIDERS if p in providers] if generate else []:
        add(generating, "generate", lambda model: generate_row(model, prompt))
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Each step row's speed over each other provider's in its case (``vs``: provider -> ratio of
    their times), each generate row's decode rate over transformers'; the generated tokens' agreement
    with transformers'."""
    measured = [r for r in rows if "error" not in r]
    for row in measured:
        peers = [
            r for r in measured if r["case"] == row["case"] and r["kind"] == row["kind"] and r is not row
        ]
        if row["kind"] == "step":
            row["vs"] = {p["provider"]: p["ms"] / row["ms"] for p in peers}
        else:
            row["vs"] = {p["provider"]: row["decode_tokens_per_s"] / p["decode_tokens_per_s"] for p in peers}
            reference = next((p for p in peers if p["provider"] == "transformers"), None)
            if reference is not None:
                row["same_tokens_until"] = same_until(row["tokens"], reference["tokens"])


# ---------------------------------------------------------------- tables, plot, files


def markdown_table(rows: list[dict]) -> str:
    """The step rows and the generate rows of every case, ratios against transformers, torch.compile
    and liger (the step) and transformers (the decode)."""
    lines = [
        "| case | provider | step ms | tokens/s | vs transformers | vs compile | vs liger "
        "| peak GiB | loss |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in [r for r in rows if r["kind"] == "step"]:
        if "error" in row:
            lines.append(f"| {_label(row)} | {row['provider']} | failed: {row['error']} |||||||")
            continue
        ratios = [_ratio(row, peer) for peer in ("transformers", "transformers+compile", "liger")]
        lines.append(
            f"| {_label(row)} | {row['provider']} | {row['ms']:.2f} | {row['tokens_per_s']:,.0f} | "
            f"{' | '.join(ratios)} | {row['peak_gib']:.2f} | {row['loss']:.4f} |"
        )
    generated = [r for r in rows if r["kind"] == "generate"]
    if generated:
        lines += [
            "",
            "| case | provider | prefill ms | decode tokens/s | ms a token | vs transformers | GPU busy |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in generated:
            if "error" in row:
                lines.append(f"| {_label(row)} | {row['provider']} | failed: {row['error']} |||||")
                continue
            lines.append(
                f"| {_label(row)} | {row['provider']} | {row['prefill_ms']:.1f} | "
                f"{row['decode_tokens_per_s']:,.0f} | {row['decode_ms_per_token']:.2f} | "
                f"{_ratio(row, 'transformers')} | {_share(row.get('gpu_busy'))} |"
            )
    return "\n".join(lines)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _label(row: dict) -> str:
    return f"{row['model']}, {row['layers']} layers"


def _ratio(row: dict, peer: str) -> str:
    if row["provider"] == peer:
        return "1.00x"
    return f"{row['vs'][peer]:.2f}x" if peer in row.get("vs", {}) else "-"


def plot(rows: list[dict], path: Path) -> None:
    """Training tokens/s and decode tokens/s by provider, a panel each, a bar group per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for axis, kind, key, title in (
        (axes[0], "step", "tokens_per_s", "training step (fwd, bwd, AdamW): tokens/s"),
        (axes[1], "generate", "decode_tokens_per_s", f"greedy decode, batch {GEN_BATCH}: tokens/s"),
    ):
        providers = list(dict.fromkeys(r["provider"] for r in rows if r["kind"] == kind))
        width = 0.8 / max(len(providers), 1)
        for i, provider in enumerate(providers):
            values = [
                next(
                    (
                        r.get(key, 0.0)
                        for r in rows
                        if (r["case"], r["kind"], r["provider"]) == (c, kind, provider)
                    ),
                    0.0,
                )
                for c in cases
            ]
            axis.bar([c + i * width for c in range(len(cases))], values, width, label=provider)
        axis.set_xticks([c + width * (len(providers) - 1) / 2 for c in range(len(cases))], cases)
        axis.set_title(title, fontsize=10)
        # below the panel: inside it, the legend covered the tallest bars
        axis.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3, frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_results(rows: list[dict], out_dir: Path) -> list[Path]:
    """``<out>/<gpu-slug>/model.json`` (the rows, after those of other cases already there at the same
    commit: ``layer.with_other_cases``), ``model.md`` (their tables) and ``model.png``."""
    from tritonkit.bench import layer
    from tritonkit.bench.report import gpu_slug

    folder = out_dir / gpu_slug(rows[0]["gpu"])
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{OP}.json", folder / f"{OP}.md", folder / f"{OP}.png"]
    rows = layer.with_other_cases(paths[0], rows)
    paths[0].write_text(json.dumps(rows, indent=1) + "\n")
    provenance = layer.provenance_line(rows, "tritonkit bench model")
    paths[1].write_text(f"{provenance}\n\n{markdown_table(rows)}\n")
    plot(rows, paths[2])
    return paths
