"""The transformers benchmark model's training step under FSDP2 (``fully_shard``) on every GPU of one
host, patched with tritonkit, against the same step on one GPU: tokens/s per GPU, and its share of
one GPU's.

    PYTHONPATH=src python benchmarks/fsdp_step.py OUT.json [--case llama3-8b] [--layers N]
    PYTHONPATH=src python benchmarks/fsdp_step.py OUT.json --dry-run   # 2 CPU processes, a tiny Llama

The model is ``tritonkit bench model``'s (``bench.model.build_model``: bf16, random weights, the full
vocabulary, ``--layers`` decoder layers, default LAYERS) with tritonkit.integrations.transformers
applied; under FSDP2 each decoder layer and then the model are sharded (``fully_shard``). Every rank
trains on a batch of its own, as many tokens as the one-GPU step's (TRAIN_BATCH x TRAIN_SEQ), with
AdamW; a step's time is the slowest rank's median over STEPS steps after WARMUP (CUDA events, a
barrier before each), and tokens/s per GPU a rank's tokens over it. The one-GPU row is rank 0's step
on the same model unsharded, run before the group's steps with the other GPUs idle. The losses:
each row's first step's (the sharded row's, the mean over the ranks), and the unsharded model's on
every rank's batch at once, which the sharded mean should match (each rank holds as many tokens).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

import torch
import torch.multiprocessing as mp
from ring_attention import join_group

LAYERS = 4  # bench model's default: the step's memory and the run's time stay small
DRY = {"batch": (1, 16), "warmup": 0, "steps": 1}  # --dry-run: tokens a rank, steps (the first step besides)
TINY = dict(  # --dry-run's Llama
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip


def _argument(name: str, default):
    return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def _model(case: str, layers: int, device: str) -> torch.nn.Module:
    """The patched model, the same initial weights on every rank."""
    from tritonkit.bench import model as bench_model
    from tritonkit.integrations import transformers as tk_hf

    if device == "cpu":
        import transformers

        torch.manual_seed(0)
        tiny = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(torch.bfloat16)
        return tk_hf.apply(tiny.train())
    return tk_hf.apply(bench_model.build_model(bench_model.CASES[case], layers, device))


def _batch(rank: int, shape: tuple, vocab: int, device: str) -> torch.Tensor:
    """Rank ``rank``'s token ids: seeded by the rank, so that any rank can rebuild another's."""
    generator = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, vocab, shape, generator=generator).to(device)


def _timed_steps(model: torch.nn.Module, ids: torch.Tensor, counts: tuple, grouped: bool) -> tuple:
    """(median ms of a step, the slowest rank's where ``grouped``; the first step's loss)."""
    import torch.distributed as dist

    from tritonkit.bench import timing

    warmup, steps = counts
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=ids.is_cuda)

    def step() -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    first = step().float().item()
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if grouped:
            dist.barrier()
        times.append(timing.call_ms(step, ids.device))
    ms = torch.tensor([statistics.median(times)], device=ids.device)
    if grouped:
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item(), first


def _worker(rank: int, world: int, store: str, out_path: str, dry: bool, case: str, layers: int) -> None:
    device = join_group(rank, world, store, dry, 900)
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from tritonkit.bench import model as bench_model
    from tritonkit.bench.runner import provenance

    shape = DRY["batch"] if dry else (bench_model.TRAIN_BATCH, bench_model.TRAIN_SEQ)
    counts = (DRY["warmup"], DRY["steps"]) if dry else (bench_model.WARMUP, bench_model.STEPS)
    vocab = TINY["vocab_size"] if dry else bench_model.CASES[case].vocab
    batches = [_batch(r, shape, vocab, device) for r in range(world)]
    rows = []
    if rank == 0:
        one_ms, one_loss = _timed_steps(_model(case, layers, device), batches[0], counts, grouped=False)
        everyone = torch.cat(batches)
        with torch.no_grad():
            whole = _model(case, layers, device)(input_ids=everyone, labels=everyone).loss.float().item()
        rows.append({"world": 1, "ms": one_ms, "first_loss": one_loss, "loss_on_every_batch": whole})
        if device == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    model = _model(case, layers, device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ms, first = _timed_steps(model, batches[rank], counts, grouped=True)
    mean = torch.tensor([first], device=device)
    dist.all_reduce(mean)
    if rank == 0:
        rows.append({"world": world, "ms": ms, "first_loss": mean.item() / world})
        tokens = shape[0] * shape[1]
        for row in rows:
            row |= {"tokens_a_gpu": tokens, "tokens_per_s_per_gpu": tokens / row["ms"] * 1e3}
        rows[1]["share_of_one_gpu"] = rows[1]["tokens_per_s_per_gpu"] / rows[0]["tokens_per_s_per_gpu"]
        result = provenance() | {
            "command": "python benchmarks/fsdp_step.py " + " ".join(sys.argv[1:]),
            "case": "tiny llama (dry run)" if dry else case,
            "layers": TINY["num_hidden_layers"] if dry else layers,
            "gpu": "cpu" if dry else torch.cuda.get_device_name(),
            "rows": rows,
        }
        print(json.dumps(rows), flush=True)
        with open(out_path, "w") as out:
            json.dump(result, out, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    out_path, dry = sys.argv[1], "--dry-run" in sys.argv[2:]
    case, layers = _argument("--case", "llama3-8b"), _argument("--layers", LAYERS)
    world = 2 if dry else torch.cuda.device_count()
    if world < 2:
        raise SystemExit(f"needs two GPUs or more on one host, found {world} (--dry-run: two CPU processes)")
    with tempfile.TemporaryDirectory() as scratch:
        store = os.path.join(scratch, "store")
        mp.spawn(_worker, args=(world, store, out_path, dry, case, layers), nprocs=world, join=True)


if __name__ == "__main__":
    os.environ.setdefault("TRITONKIT_AUTOTUNE", "1")  # tritonkit as tuned, in every rank's process
    main()
