"""A Hugging Face Llama's training step and generation on the H200: transformers as it is (SDPA),
under torch.compile, with liger-kernel and with tritonkit.integrations.transformers, in one run.

    python benchmarks/transformers_step.py OUT.json [--layers N] [--batch B] [--seq S]
        [--providers NAME ...] [--skip-generate]

The model is Llama-3-8B's shapes (d 4096, 32 query / 8 KV heads of 128, FFN 14336, vocabulary
128256) with ``--layers`` decoder layers (default 2: the LM head and embeddings stay whole), random
weights, bf16, built from its config (no download). A step is the forward with labels and the
backward (no optimizer), timed by CUDA events over ``STEPS`` steps after ``WARMUP``, median;
tokens/s from B x S; peak memory over the step, from the allocator's high-water mark, over what
was held before it (every model's weights and this one's gradients). Each provider's first loss
is recorded (the same weights and batch for all: they should agree to bf16's rounding).
Generation: greedy decoding of ``NEW_TOKENS`` tokens after a 512-token prompt at batch 8, tokens/s
of the new tokens, transformers (SDPA) against tritonkit. Each row also has the layer benchmark's
diagnostics (``tritonkit.bench.layer``): ``host_ms`` (the host's time to issue a step or a whole
generate call) and a kernel profile (GPU time by kind, the longest kernels) after warm-up calls;
a generate row's ``kernel_ms`` over its ``s`` is how busy the GPU was while decoding.

liger-kernel patches classes and module functions globally (its ``apply_liger_kernel_to_llama``
replaces transformers' RoPE function and LlamaForCausalLM.forward), so its step runs last, after
the generation rows: every other row sees transformers unpatched.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch
from attention_bwd_sm90 import result_header

PROVIDERS = ("transformers", "transformers+compile", "tritonkit", "liger")
WARMUP, STEPS, NEW_TOKENS = 3, 10, 64


def _argument(name: str, default):
    return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def _model(layers: int):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    return model.train()


def _prepare(provider: str, base):
    model = copy.deepcopy(base)
    if provider == "transformers+compile":
        return torch.compile(model)
    if provider == "tritonkit":
        from tritonkit.integrations import transformers as tk_hf

        return tk_hf.apply(model)
    if provider == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    return model


def _step_row(provider: str, base, ids: torch.Tensor) -> dict:
    model = _prepare(provider, base)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    first = step().item()
    for _ in range(WARMUP):
        step()
    model.zero_grad(set_to_none=False)  # the gradients stay allocated: held before the step
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(STEPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    peak = torch.cuda.max_memory_allocated() - held  # activations and workspace over the weights and grads
    ms = statistics.median(times)
    row = {"ms": ms, "tokens_per_s": ids.numel() / ms * 1e3, "peak_gib": peak / 2**30, "loss": first}
    return row | _profile(step, list(model.parameters()))


def _profile(call, grads_to_none: list) -> dict:
    """The layer benchmark's diagnostics of a call (``tritonkit.bench.layer``): the host's time to
    issue it, and its GPU time by kernel kind with the longest kernels. A profile that fails leaves
    the timing standing."""
    from tritonkit.bench import layer

    try:
        return {"host_ms": layer.host_ms(call, grads_to_none)} | layer.kernel_profile(call, grads_to_none)
    except Exception as error:  # a diagnostic
        print(f"profile failed: {error}", flush=True)
        return {}


def _generate_row(provider: str, base) -> dict:
    model = _prepare(provider, base).eval()
    prompt = torch.randint(
        0, 128256, (8, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    # no padding: the mask is all ones, said so that transformers does not warn or guess
    settings = {"attention_mask": torch.ones_like(prompt), "pad_token_id": 0, "do_sample": False}
    settings |= {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}
    with torch.no_grad():
        # the same call untimed first: whatever compiles, tunes or allocates for this length and
        # these settings does it there
        model.generate(prompt, **settings)
        torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = model.generate(prompt, **settings)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        profile = _profile(lambda: model.generate(prompt, **settings), [])
    return {
        "s": seconds,
        "tokens_per_s": prompt.shape[0] * NEW_TOKENS / seconds,
        "tokens": tokens[:, 512:].tolist(),
    } | profile


def _generation_rows(result: dict, base, providers: list[str]) -> None:
    for provider in providers:
        row = _generate_row(provider, base)
        torch.cuda.empty_cache()
        result["generate"][provider] = row
        gpu = f", GPU busy {row['kernel_ms'] / 1e3 / row['s']:.0%} of it" if "kernel_ms" in row else ""
        print(f"generate {provider}: {row['tokens_per_s']:.0f} tokens/s{gpu}", flush=True)


def _same_until(rows: dict) -> list[int]:
    """Per sequence, the new tokens tritonkit's greedy decoding shares with transformers' before
    the first that differs (random weights leave near-ties that bf16's rounding breaks either way)."""
    same = []
    for ours, theirs in zip(rows["tritonkit"]["tokens"], rows["transformers"]["tokens"], strict=True):
        differ = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
        same.append(differ[0] if differ else len(ours))
    return same


def main() -> None:
    import json

    out = sys.argv[1]
    layers, batch, seq = _argument("--layers", 2), _argument("--batch", 2), _argument("--seq", 4096)
    named = (
        [a for a in sys.argv[sys.argv.index("--providers") + 1 :] if not a.startswith("--")]
        if ("--providers" in sys.argv)
        else list(PROVIDERS)
    )
    timing = f"CUDA events, median of {STEPS} steps after {WARMUP}; forward with labels + backward"
    result = result_header("transformers_step", "transformers_step.py", timing)
    result |= {"layers": layers, "batch": batch, "seq": seq, "steps": {}, "generate": {}}
    base = _model(layers)
    ids = torch.randint(
        0, 128256, (batch, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0)
    )
    generating = () if "--skip-generate" in sys.argv else ("transformers", "tritonkit")
    for provider in [p for p in PROVIDERS if p in named]:
        if provider == "liger":  # its patches are global: every generation row runs before it
            _generation_rows(result, base, [p for p in generating if p in named])
        row = _step_row(provider, base, ids)
        torch.cuda.empty_cache()  # the provider's copy of the model is gone with its step
        result["steps"][provider] = row
        print(
            f"step {provider}: {row['ms']:.2f} ms, {row['tokens_per_s']:.0f} tokens/s, "
            f"{row['peak_gib']:.2f} GiB, loss {row['loss']:.4f}, by kind {row.get('kernel_ms_by_kind')}",
            flush=True,
        )
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    if "liger" not in named:
        _generation_rows(result, base, [p for p in generating if p in named])
    if {"transformers", "tritonkit"} <= result["generate"].keys():
        result["generate_same_until"] = _same_until(result["generate"])
    if "transformers" in result["steps"]:
        eager = result["steps"]["transformers"]["ms"]
        result["step_speedup_vs_transformers"] = {p: eager / r["ms"] for p, r in result["steps"].items()}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
