"""Context-parallel attention across the GPUs of one host: tritonkit.distributed.ring_attention against
torch's experimental context_parallel (cuDNN SDPA inside), and tritonkit's one-GPU attention on the
whole sequence for the scaling efficiency. B = 1, H = 32, D = 128, bf16; S = 32768 and 65536 causal,
32768 full.

    PYTHONPATH=src python benchmarks/ring_attention.py OUT.json            # every GPU of the host
    PYTHONPATH=src python benchmarks/ring_attention.py OUT.json --dry-run  # 2 CPU processes, tiny
    PYTHONPATH=src python benchmarks/ring_attention.py OUT.json --full-only  # the full case alone

Each timing is the median of ITERATIONS calls, each call started on every rank after a barrier and
timed with CUDA events; a row's time is the slowest rank's. Total TFLOP/s counts 4 B H S^2 D
forward (half causal) and 2.5 times that backward; the scaling efficiency is the one-GPU time of
the whole sequence over W times the ring's.

Where the ring's time goes, three more rows: the ring with its exchanges left out ("compute
only": each block received is the one sent, so every attention and merge runs, on wrong data), the
exchanges with the compute left out ("exchanges only": the same sends and receives, in order), and
ring_attention's input check (one all_gather_object across the ranks). The JSON is rewritten after
each case, so a run cut short keeps the cases it finished.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CASES = [(32768, True), (65536, True), (32768, False)]  # (S, causal)
DRY_CASES = [(16, True), (16, False)]
HEADS, HEAD_DIM = 32, 128
WARMUP, ITERATIONS = 3, 10
DRY_ROUNDS = (0, 1)  # --dry-run's warm-up and timed calls: its times mean nothing, its values are checked
_rounds = (WARMUP, ITERATIONS)  # this process's (_worker sets a dry run's)


def _timed(fn, device) -> float:
    """Median ms of ``fn()`` on this rank, each call after a barrier; the slowest rank's."""
    from tritonkit.bench import timing

    warmup, iterations = _rounds
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iterations):
        dist.barrier()
        times.append(timing.call_ms(fn, device))
    slowest = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def _inputs(seq: int, heads: int, head_dim: int, device):
    """q, k, v and dO over the whole sequence, the same on every rank."""
    g = torch.Generator(device="cpu").manual_seed(0)
    return [torch.randn((1, heads, seq, head_dim), generator=g).to(device, torch.bfloat16) for _ in range(4)]


class _NoExchangeRing:
    """The ring's interface without its exchanges: each block "received" is the one sent."""

    def __init__(self, ring):
        self.world, self.rank = ring.world, ring.rank

    def start(self, tensors, tag=0):
        return list(tensors), []


def _exchanges(ring, block, backward: bool) -> None:
    """The ring's sends and receives alone, in its order: W - 1 hops of K and V; backward, also a
    hop of fp32 dK and dV sums after each step, the last in the inputs' dtype."""

    def wait(requests):
        for request in requests:
            request.wait()

    sums = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in block]
    for step in range(ring.world):
        more = step < ring.world - 1
        incoming, requests = ring.start(block) if more else (None, [])
        if backward:
            wait(ring.start(sums if more else block, tag=2)[1])
        wait(requests)
        block = incoming if more else block


def _diagnostic_rows(shards, grad, causal, device) -> dict:
    from tritonkit.distributed.groups import process_group
    from tritonkit.distributed.ring import _check_across_ranks, _Ring, _RingAttention
    from tritonkit.ops.attention.common import softmax_scale

    group = process_group(None, "ring attention")
    ring, scale = _Ring(group), softmax_scale(None, shards[0].shape[-1])
    local = _NoExchangeRing(ring)
    out = _RingAttention.apply(*shards, scale, causal, local)[0]
    fwd = _timed(lambda: _RingAttention.apply(*shards, scale, causal, local), device)
    bwd = _timed(lambda: torch.autograd.grad(out, shards, grad, retain_graph=True), device)
    block = [shards[1].detach(), shards[2].detach()]
    exchange = (
        _timed(lambda: _exchanges(ring, block, False), device),
        _timed(lambda: _exchanges(ring, block, True), device),
    )
    check = _timed(lambda: _check_across_ranks(*shards, causal, None, group), device)
    return {
        "tritonkit ring, compute only": (fwd, bwd),
        "ring exchanges only": exchange,
        "ring input check": (check, None),
    }  # forward only


def _ring_rows(seq, causal, heads, head_dim, device) -> dict:
    import tritonkit
    from tritonkit.distributed import ring_attention, shard_sequence, unshard_sequence

    q, k, v, do = _inputs(seq, heads, head_dim, device)
    shards = [shard_sequence(t, 2, causal=causal).requires_grad_() for t in (q, k, v)]
    grad = shard_sequence(do, 2, causal=causal)
    out = ring_attention(*shards, causal=causal)
    whole = unshard_sequence(out.detach(), 2, causal=causal)
    single_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    single = tritonkit.flash_attention(*single_inputs, causal=causal)
    error = (whole.float() - single.float()).abs().max().item()
    fwd = _timed(lambda: ring_attention(*shards, causal=causal), device)
    bwd = _timed(lambda: torch.autograd.grad(out, shards, grad, retain_graph=True), device)
    one_fwd = _timed(lambda: tritonkit.flash_attention(*single_inputs, causal=causal), device)
    one_bwd = _timed(lambda: torch.autograd.grad(single, single_inputs, do, retain_graph=True), device)
    return {
        "tritonkit ring": (fwd, bwd),
        "tritonkit one GPU": (one_fwd, one_bwd),
        "max_err_vs_one_gpu": error,
    } | _diagnostic_rows(shards, grad, causal, device)


def _cudnn_times(q, k, v, do, causal: bool, device) -> tuple[float, float]:
    """(forward ms, backward ms) of SDPA's cuDNN backend on these tensors."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):

        def forward():
            return torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)

        out = forward()
        return (
            _timed(forward, device),
            _timed(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True), device),
        )


def _context_parallel_rows(seq, causal, heads, head_dim, device) -> dict:
    """torch's context_parallel with the cuDNN SDPA backend (its fastest measured), and cuDNN on the
    whole sequence on one GPU (GPUs only)."""
    if device != "cuda":
        return {}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    q, k, v, do = _inputs(seq, heads, head_dim, device)
    balanced = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = causal  # torch balances causal shards only; refused without the mask
    try:
        with context_parallel(mesh, buffers=[q, k, v, do], buffer_seq_dims=[2, 2, 2, 2]):
            sharded = _cudnn_times(q, k, v, do, causal, device)
    finally:
        _cp_options.enable_load_balance = balanced
    whole = _cudnn_times(*_inputs(seq, heads, head_dim, device), causal, device)  # the whole sequence
    return {"torch context_parallel (cuDNN)": sharded, "torch cuDNN one GPU": whole}


def join_group(rank: int, world: int, store: str, dry: bool, timeout_s: float) -> str:
    """Join the group: nccl on this rank's GPU, or for a dry run gloo on the CPU with the kernels in
    the interpreter (chosen before anything imports triton: FSDP's modules do). The rank's device."""
    if dry:
        os.environ["TRITONKIT_INTERPRET"] = "1"
    from tritonkit import _runtime

    _runtime.interpret()
    if not dry:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "gloo" if dry else "nccl",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return "cpu" if dry else "cuda"


def _worker(rank: int, world: int, store: str, out_path: str, dry: bool, cases: list) -> None:
    global _rounds
    device = join_group(rank, world, store, dry, 600)
    _rounds = DRY_ROUNDS if dry else _rounds
    heads, head_dim = (4, 16) if dry else (HEADS, HEAD_DIM)
    import tritonkit.distributed  # noqa: F401  (it chooses GPU or interpreter before triton is imported)

    rows = []
    provenance = {
        "gpu": "cpu" if dry else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "git_sha": _git_sha(),
        "command": "python benchmarks/ring_attention.py " + " ".join(sys.argv[1:]),
    }
    for seq, causal in cases:
        found = _ring_rows(seq, causal, heads, head_dim, device)
        found |= _context_parallel_rows(seq, causal, heads, head_dim, device)
        flops = 4 * heads * seq * seq * head_dim / (2 if causal else 1)
        one_gpu = found["tritonkit one GPU"]
        case_rows = []
        for provider, times in found.items():
            if provider == "max_err_vs_one_gpu":
                continue
            alone = provider.endswith("one GPU")  # the whole sequence on each rank's GPU
            attention = provider not in ("ring exchanges only", "ring input check")
            for mode, ms, work in (("fwd", times[0], flops), ("bwd", times[1], 2.5 * flops)):
                if ms is None:
                    continue
                ones = one_gpu[0] if mode == "fwd" else one_gpu[1]
                efficiency = ones / (world * ms) if attention and not alone else None
                case_rows.append(
                    {
                        "provider": provider,
                        "mode": mode,
                        "shape": [1, heads, seq, head_dim],
                        "causal": causal,
                        "world": 1 if alone else world,
                        "ms": ms,
                        "tflops_total": work / ms / 1e9 if attention else None,
                        "scaling_efficiency": efficiency,
                        "max_err_vs_one_gpu": found["max_err_vs_one_gpu"]
                        if provider == "tritonkit ring"
                        else None,
                    }
                )
        rows += case_rows
        if rank == 0:
            print(json.dumps(case_rows), flush=True)
            with open(out_path, "w") as out:  # after each case: a run cut short keeps what it finished
                json.dump([row | provenance for row in rows], out, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def _git_sha() -> str:
    if os.environ.get("TRITONKIT_GIT_SHA"):
        return os.environ["TRITONKIT_GIT_SHA"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main() -> None:
    out_path, dry = sys.argv[1], "--dry-run" in sys.argv[2:]
    cases = DRY_CASES if dry else CASES
    if "--full-only" in sys.argv[2:]:  # the cases without the mask alone
        cases = [case for case in cases if not case[1]]
    world = 2 if dry else torch.cuda.device_count()
    if world < 2:
        raise SystemExit(f"needs two GPUs or more on one host, found {world}")
    with tempfile.TemporaryDirectory() as scratch:
        store = os.path.join(scratch, "store")
        mp.spawn(_worker, args=(world, store, out_path, dry, cases), nprocs=world, join=True)


if __name__ == "__main__":
    os.environ.setdefault("TRITONKIT_AUTOTUNE", "1")  # tritonkit as tuned, in every rank's process
    main()
