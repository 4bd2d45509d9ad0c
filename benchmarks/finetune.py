"""A small Llama trained from one seed twice, as transformers builds it and with
tritonkit.integrations.transformers applied: the two loss curves, and each run's step time.

    python benchmarks/finetune.py OUT.json [--steps N] [--plot OUT.png] [--control] [--parts] [--seeds N]
    python benchmarks/finetune.py OUT.json --blocks

The model: Llama's architecture at d 512, 8 layers, 8 query / 2 KV heads of 64, FFN 1536, a 32000-
token vocabulary (57 M parameters), mixed precision as people train: fp32 weights, the step under
``torch.autocast`` to bf16, AdamW (fused, lr 1e-3, 50 warm-up steps of a linear ramp).
The task, synthetic and learnable (no download): each sequence of SEQ tokens is a first half
walked on a random chain (over CHAIN = 4096 of the tokens, each followed by one of BRANCH = 4
successors of its own), then that half again. A uniform guess scores ln 32000 = 10.37; the chain's
tokens learnt, ln 4096 = 8.3; its successors, ln 4 = 1.39 a token in the first half; the second
half, copied by looking back, 0 (a mean near 0.7 over the sequence). With a first half of
uniformly random tokens (an earlier version: bf16 weights at lr 3e-4 for 300 steps, then this
recipe for 500) the loss stayed at 10.38-10.41: nothing to learn but the copy, which did not form
in time. Both runs take the same initial weights and the same batches in the
same order; the loss is transformers' mean over the sequence. Step time: CUDA events around each step
(forward, backward, optimizer), the median over the steps after the first WARMUP (``step_ms``); the
first step also compiles and tunes (``first_ms``). After the run, where each step's time goes: the
host's time to issue one (``host_ms``: at or above the step's time, the host is the bound) and a
kernel profile (``bench.layer``'s). The step is the host's at this size, and the host's speed drifts
within a run (the same model's host time moved by 1.3x between two of its runs in one process on
the H200), so the two runs timed one after the other do not compare: the speedup is taken after
both have trained, their steps alternating (``alternating``: ROUNDS rounds, each a burst of BURST
steps of one model then of the other, the order reversed each round; CUDA events around a
burst, and the host's time to issue one step after a sync). With ``--control`` transformers' second
model alternates too: its ratio to the first should read 1.0, and what it reads is the protocol's
bias.

The curves cannot agree exactly: bf16 rounds the two runs' sums differently, and training amplifies
the differences step by step. How much, the controls say (``--control``): transformers' model
again, and with its eager attention in place of SDPA (numerics only: the same maths). On the H200
(at ed5bb9e) the step where the loss leaves its plateau moves with any such difference, and the
last TAIL steps' mean with it: 2.32 and 2.78 for transformers twice, 4.04 with eager attention, so
one run's tail is no test of a patch; the curves' first 120 steps agree to the plot's width.
``--blocks`` times transformers' model alone, beside the patched one and after it, in blocks of steps:
whether tritonkit slows another model in the process.
``--seeds N`` trains both main runs again from N - 1 other seeds (initial weights and batches),
their tails and curves only: how far apart one seed's tails lie, run to run.
``--parts`` trains the model patched one part at a time (each under ``tuning.disabled()``, as the
controls): where a part's maths were wrong, its curve would part from the others from the start.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from attention_bwd_sm90 import result_header

STEPS, WARMUP, TAIL = 500, 10, 50
ROUNDS, BURST = 20, 5  # the alternating timing: rounds, and steps of each model a round
LR, RAMP = 1e-3, 50
BATCH, SEQ, VOCAB = 16, 512, 32000
CHAIN, BRANCH = 4096, 4  # the task's tokens (of VOCAB), successors a token


def _argument(name: str, default):
    return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def _model(seed: int = 0):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device("cuda"):
        return transformers.LlamaForCausalLM(config).train()


def _batches(steps: int, seed: int = 0, device="cuda") -> torch.Tensor:
    """(steps, BATCH, SEQ) token ids: a first half walked on a random chain over the first CHAIN
    tokens (each followed by one of BRANCH successors of its own, fixed for the run, uniformly), then
    the same half again."""
    generator = torch.Generator(device).manual_seed(1 + seed)
    successors = torch.randint(0, CHAIN, (CHAIN, BRANCH), device=device, generator=generator)
    tokens = [torch.randint(0, CHAIN, (steps, BATCH), device=device, generator=generator)]
    for _ in range(SEQ // 2 - 1):
        pick = torch.randint(0, BRANCH, (steps, BATCH, 1), device=device, generator=generator)
        tokens.append(successors[tokens[-1]].gather(-1, pick).squeeze(-1))
    half = torch.stack(tokens, dim=-1)
    return torch.cat([half, half], dim=-1)


def _trainer(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """One training step of the model on a batch of ids (forward, backward, AdamW), returning the loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    ramp = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / RAMP))

    def step(ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ramp.step()
        return loss.detach()

    return step


def _train(step: Callable[[torch.Tensor], torch.Tensor], batches: torch.Tensor, profile: bool = True) -> dict:
    from tritonkit.bench import layer

    losses, times = [], []
    for ids in batches:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        losses.append(step(ids))
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in times]
    run = {"loss": [x.item() for x in losses], "step_ms": statistics.median(ms[WARMUP:]), "first_ms": ms[0]}
    if not profile:
        return run
    return (
        run
        | {"host_ms": layer.host_ms(lambda: step(batches[-1]), [])}
        | layer.kernel_profile(lambda: step(batches[-1]), [])
    )


def _alternate(steps: dict[str, Callable[[torch.Tensor], torch.Tensor]], batches: torch.Tensor) -> dict:
    """The trained models' steps alternating, ROUNDS rounds of a burst of BURST steps each (the order
    reversed each round): {name: {"step_ms", "host_ms"}: medians over the rounds}, "speedup": the
    median over the rounds of the first model's burst time over the second's, with its 20th and
    80th percentiles, and "speedup of NAME" the same for each further model (a control, where the
    ratio should read 1.0: the protocol's own bias)."""
    from tritonkit.bench import timing

    names = list(steps)
    burst_ms: dict[str, list[float]] = {name: [] for name in names}
    host_ms: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(ROUNDS):
        for name in names if round_ % 2 == 0 else names[::-1]:
            ids = batches[round_ % len(batches)]
            torch.cuda.synchronize()
            started = time.perf_counter()
            steps[name](ids)
            host_ms[name].append((time.perf_counter() - started) * 1e3)
            torch.cuda.synchronize()

            def burst(step=steps[name], ids=ids):
                for _ in range(BURST):
                    step(ids)

            burst_ms[name].append(timing.call_ms(burst, "cuda") / BURST)
    result: dict = {
        name: {"step_ms": statistics.median(burst_ms[name]), "host_ms": statistics.median(host_ms[name])}
        for name in names
    }
    result["rounds"] = {"burst_ms": burst_ms, "host_ms": host_ms}
    for other in names[1:]:  # the speedup of each other model over the first, and its spread
        ratios = sorted(a / b for a, b in zip(burst_ms[names[0]], burst_ms[other], strict=True))
        result["speedup" if other == names[1] else f"speedup of {other}"] = {
            f"{names[0]} / {other}": statistics.median(ratios),
            "p20": ratios[len(ratios) // 5],
            "p80": ratios[(4 * len(ratios)) // 5],
        }
    return result


def _plot(result: dict, path: str) -> None:
    """The loss curves (seed 0's runs, and the main runs of the other seeds thinner, in their run's
    colour) over each seed's gap, tritonkit's loss less transformers'."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curves, gap) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1))
    colours = {}
    for name, run in result["runs"].items():
        timed = name in result["alternating"]  # the others' steps run untuned
        label = f"{name} ({result['alternating'][name]['step_ms']:.1f} ms a step)" if timed else name
        (line,) = curves.plot(run["loss"], label=label, linewidth=1.5 if timed else 0.8)
        colours[name] = line.get_color()
    seeds = {"0": result["runs"], **result.get("seeds", {})}  # (a JSON's keys: strings)
    for seed, runs in seeds.items():
        ours, theirs = runs["tritonkit"]["loss"], runs["transformers"]["loss"]
        if seed != "0":
            curves.plot(theirs, linewidth=0.6, alpha=0.6, color=colours["transformers"])
            curves.plot(ours, linewidth=0.6, alpha=0.6, color=colours["tritonkit"])
        difference = [a - b for a, b in zip(ours, theirs, strict=True)]
        gap.plot(difference, linewidth=1 if seed == "0" else 0.6, label=f"seed {seed}")
    curves.set_ylabel("loss")
    millions = result["parameters"] / 1e6
    more = f"; thin: {len(seeds) - 1} more seeds" if len(seeds) > 1 else ", one seed"
    title = f"a {millions:.0f} M-parameter Llama on the repeat task{more}, bf16 autocast"
    curves.set_title(title, fontsize=10)
    curves.legend()
    gap.axhline(0.0, color="black", linewidth=0.5)
    if len(seeds) > 1:
        gap.legend(fontsize=7, ncol=len(seeds))
    gap.set_ylabel("tritonkit - transformers")
    gap.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


PARTS = ("rms_norm", "rope", "attention", "mlp", "cross_entropy")  # apply()'s switches
# --parts' runs: each part alone, but attention with rope (transformers' RoPE hands the attention
# fp32 q and k under autocast, which tritonkit's attention refuses)
PART_RUNS = {
    "only rms_norm": ("rms_norm",),
    "only mlp": ("mlp",),
    "only cross_entropy": ("cross_entropy",),
    "attention and rope": ("attention", "rope"),
}


def _runs() -> dict:
    """The runs' names and how each builds its model from the seed's: transformers' and tritonkit's,
    then the controls' and the parts' where asked."""
    from tritonkit.integrations import transformers as tk_hf

    def eager_attention(model):
        model.config._attn_implementation = "eager"
        return model

    runs = {"transformers": lambda m: m, "tritonkit": tk_hf.apply}
    if "--control" in sys.argv:
        runs |= {"transformers again": lambda m: m, "transformers, eager attention": eager_attention}
    if "--parts" in sys.argv:
        for name, parts in PART_RUNS.items():
            runs[name] = lambda m, parts=parts: tk_hf.apply(m, **{p: p in parts for p in PARTS})
    return runs


def _other_seeds(seeds: int, steps: int) -> dict:
    """The two main runs again from seeds 1 .. seeds - 1 (other initial weights, other batches):
    {seed: {name: the last TAIL steps' mean loss}}, and each run's curve."""
    from tritonkit import tuning
    from tritonkit.integrations import transformers as tk_hf

    result = {}
    for seed in range(1, seeds):
        batches, result[seed] = _batches(steps, seed), {}
        for name, prepare in (("transformers", lambda m: m), ("tritonkit", tk_hf.apply)):
            with tuning.enabled():
                loss = _train(_trainer(prepare(_model(seed))), batches, profile=False)["loss"]
            result[seed][name] = {"tail": statistics.mean(loss[-TAIL:]), "loss": loss}
            print(f"seed {seed}, {name}: loss {loss[0]:.3f} -> {result[seed][name]['tail']:.3f}", flush=True)
            torch.cuda.empty_cache()
    return result


BLOCK_STEPS = 30  # --blocks: steps a block


def _blocks(out: str) -> None:
    """--blocks: whether running the patched model slows transformers' in the same process. Blocks
    of BLOCK_STEPS steps, each step's host time after a sync (the median a block): transformers'
    model alone twice; then, the control, a second unpatched model and the first in turn twice, and
    the first once the second is deleted; then the patched model and transformers' in turn twice,
    and transformers' once the patched model is deleted. Untuned (the defaults), so that no tuning
    runs between."""
    from tritonkit.integrations import transformers as tk_hf

    batches = _batches(WARMUP + BLOCK_STEPS)
    result = result_header("finetune_blocks", "finetune.py", "host ms a step after a sync, median a block")
    steps = {"transformers": _trainer(_model())}

    def block(name: str, where: str) -> None:
        for ids in batches[:WARMUP]:
            steps[name](ids)  # (a block's first steps: nothing compiles or allocates in the timed ones)
        host = []
        for ids in batches[WARMUP:]:
            torch.cuda.synchronize()
            started = time.perf_counter()
            steps[name](ids)
            host.append((time.perf_counter() - started) * 1e3)
        torch.cuda.synchronize()
        result["rows"].append({"block": f"{name}, {where}", "host_ms": statistics.median(host)})
        print(result["rows"][-1], flush=True)

    block("transformers", "alone")
    block("transformers", "alone")
    # the control, a second unpatched model, then the patched one: each beside the first, in turn
    for other, prepare, what in (
        ("transformers again", lambda m: m, "a second unpatched model"),
        ("tritonkit", tk_hf.apply, "the patched model"),
    ):
        steps[other] = _trainer(prepare(_model()))
        for _ in range(2):
            block(other, "beside transformers' model")
            block("transformers", f"beside {what}")
        del steps[other]
        torch.cuda.empty_cache()
        block("transformers", f"{what} deleted")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


def main() -> None:
    from tritonkit import tuning

    if "--blocks" in sys.argv:
        return _blocks(sys.argv[1])
    out, steps, seeds = sys.argv[1], _argument("--steps", STEPS), _argument("--seeds", 1)
    timing = f"CUDA events a step (forward, backward, AdamW), median after {WARMUP}"
    result = result_header("finetune", "finetune.py", timing) | {"steps": steps, "runs": {}}
    batches = _batches(steps)
    timed = {}  # the main runs' trained steps, alternated after every run
    for name, prepare in _runs().items():
        model = prepare(_model())  # the same seed: the same initial weights
        result["parameters"] = sum(p.numel() for p in model.parameters())
        main_run = name in ("transformers", "tritonkit")
        with tuning.enabled() if main_run else tuning.disabled():
            step = _trainer(model)
            result["runs"][name] = run = _train(step, batches, profile=main_run)
        tail = statistics.mean(run["loss"][-TAIL:])
        print(
            f"{name}: {run['step_ms']:.2f} ms a step (host {run.get('host_ms', float('nan')):.2f}, kernels "
            f"{run.get('kernel_ms', float('nan')):.2f}), first {run['first_ms'] / 1e3:.1f} s, "
            f"loss {run['loss'][0]:.3f} -> {tail:.3f}",
            flush=True,
        )
        for kernel in run.get("kernels", [])[:8]:
            print(f"  {kernel['ms']:.3f} ms  {kernel['calls']:.0f}x  {kernel['name'][:100]}", flush=True)
        if main_run or name == "transformers again":  # (the control alternates too)
            timed[name] = step
        del model, step
        torch.cuda.empty_cache()
    with tuning.enabled():
        result["alternating"] = alternating = _alternate(timed, batches[-ROUNDS:])
    for key, speedup in alternating.items():
        if key.startswith("speedup"):
            print(f"alternating, {key}: {speedup}", flush=True)
    if seeds > 1:
        result["seeds"] = _other_seeds(seeds, steps)
    runs = result["runs"]
    tails = {name: statistics.mean(run["loss"][-TAIL:]) for name, run in runs.items()}
    result["tail_loss"] = tails
    result["tail_loss_ratio"] = tails["tritonkit"] / tails["transformers"]
    # the speedup from the alternating steps; step_ms of each run is its own, timed while it trained
    result["step_speedup"] = alternating["speedup"]["transformers / tritonkit"]
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    if "--plot" in sys.argv:
        _plot(result, sys.argv[sys.argv.index("--plot") + 1])


if __name__ == "__main__":
    main()
