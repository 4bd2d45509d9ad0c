"""Attention's pipes on the H200: what share of its cycles the tensor cores, the MUFU (XU) and the
FMA and ALU pipes are busy, ours beside cuDNN's, from Nsight Compute's counters.

    ncu --clock-control none --profile-from-start off --set full -o PROF \\
        python benchmarks/attention_profile.py [--shape B,H,S,D ...] [--config JSON] [--backward]
    ncu --import PROF.ncu-rep --page raw --csv > RAW.csv
    python benchmarks/attention_profile.py --read RAW.csv

The first form makes, per shape (default (4, 32, 4096, 64) and (4, 32, 4096, 128), bf16, full
mask), one call of ``fwd_sm90.attention_fwd_sm90`` (its default tile, or ``--config``'s fields over
it, e.g. '{"persistent": false}') and one of cuDNN's SDPA forward between cudaProfilerStart and
Stop, after warm-up calls, so that ncu profiles those two kernels alone; ``--backward`` adds the
backward of ``tritonkit.flash_attention`` (free, then deterministic) and of cuDNN's SDPA (every
kernel each launches). The second prints a row a kernel from the raw page: duration, SM clock,
cycles, and each pipe's active share. Where the tensor and MUFU shares add up to about 100%, the
two never run at once (docs/perf-notes/attention-forward-sm90-loop.md, "The forward's pipes, counted").
"""

from __future__ import annotations

import csv
import json
import sys

PIPES = {
    "tensor": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "xu (mufu)": "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "fma": "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "alu": "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
    "issue": "smsp__issue_active.avg.pct_of_peak_sustained_active",
}
TIMES = {
    "us": "gpu__time_duration.sum",
    "GHz": "sm__cycles_elapsed.avg.per_second",
    "cycles": "sm__cycles_elapsed.avg",
}
# ncu picks each duration's and clock's unit by its size: the factors to us and GHz
TO_US_AND_GHZ = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
TO_US_AND_GHZ |= {"Ghz": 1.0, "Mhz": 1e-3}


def read(path: str) -> None:
    """Print a row a kernel of ncu's raw page (its CSV: names, then units, then a row a kernel)."""
    with open(path) as f:
        rows = list(csv.reader(f))
    header, units, data = rows[0], rows[1], rows[2:]
    column = {name: i for i, name in enumerate(header)}
    print(f"{'kernel':32} {'us':>8} {'GHz':>5} {'cycles':>10} " + " ".join(f"{p:>9}" for p in PIPES))
    for row in data:
        value = {}
        for key, metric in (TIMES | PIPES).items():
            if metric in column:
                i = column[metric]
                value[key] = float(row[i].replace(",", "")) * TO_US_AND_GHZ.get(units[i], 1.0)
        print(
            f"{row[column['Kernel Name']][:32]:32} {value.get('us', 0):8.1f} {value.get('GHz', 0):5.2f} "
            f"{value.get('cycles', 0):10.0f} "
            + " ".join(f"{value.get(p, float('nan')):8.1f}%" for p in PIPES)
        )


def profile(shapes: list[tuple[int, ...]], config_fields: dict, backward: bool) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tritonkit.ops.attention import fwd_sm90

    torch.manual_seed(0)
    calls = []
    for batch, heads, seq, head_dim in shapes:
        q, k, v = (
            torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)
        )
        o, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
        config = fwd_sm90.default_config(head_dim, seq)._replace(**config_fields)

        def ours(q=q, k=k, v=v, o=o, lse=lse, config=config):
            fwd_sm90.attention_fwd_sm90(
                q, k, v, o, lse, scale=q.shape[3] ** -0.5, causal=False, config=config
            )

        def cudnn(q=q, k=k, v=v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(q, k, v)

        calls += [ours, cudnn]
        if backward:
            calls += _backward_calls((batch, heads, seq, head_dim))
    for call in calls * 3:
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in calls:
        call()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _backward_calls(shape: tuple[int, ...]) -> list:
    """Backward calls at ``shape``: ours free and deterministic, then cuDNN's (each output made once,
    its graph kept for every call)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import tritonkit

    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    outputs = [tritonkit.flash_attention(q, k, v, deterministic=d) for d in (False, True)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        outputs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v))
    return [lambda out=out: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True) for out in outputs]


def main() -> None:
    args = sys.argv[1:]
    if "--read" in args:
        read(args[args.index("--read") + 1])
        return
    shapes = [tuple(int(n) for n in args[i + 1].split(",")) for i, a in enumerate(args) if a == "--shape"]
    fields = json.loads(args[args.index("--config") + 1]) if "--config" in args else {}
    profile(shapes or [(4, 32, 4096, 64), (4, 32, 4096, 128)], fields, "--backward" in args)


if __name__ == "__main__":
    main()
