"""Where the norms' backward time goes: device time per kernel of one backward call.

Run on a GPU:  PYTHONPATH=src python benchmarks/norm_backward_kernels.py OUT.json
For each op and benchmark shape ("quick"), the backward runs ITERATIONS times under the torch
profiler on the shipped (or default) configs, nothing tuned, and each kernel's device time is
averaged over the calls: the main kernel against the second stage of dw and db (their sums of the
per-program partials, and the casts to the weight's dtype), which the benchmark's time includes.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from tritonkit import tuning
from tritonkit.bench.runner import provenance
from tritonkit.ops import get_workload

OPS = ("layer_norm", "rms_norm", "add_rms_norm")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ITERATIONS = 20


def kernel_us(op: str, shape: tuple, dtype: torch.dtype) -> dict[str, float]:
    """Kernel name -> mean device microseconds per backward call."""
    spec = get_workload(op).op
    inputs = spec.make_inputs(shape, dtype, "cuda", torch.Generator().manual_seed(0))
    leaves = [t.requires_grad_() if i in spec.grad_inputs else t for i, t in enumerate(inputs)]
    outputs = spec.fn(*leaves, **spec.kwargs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = [torch.randn_like(o) for o in outputs]
    wanted = [leaves[i] for i in spec.grad_inputs]

    def backward():
        torch.autograd.grad(outputs, wanted, grads, retain_graph=True)

    for _ in range(3):  # compile and warm up outside the profile
        backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERATIONS):
            backward()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:80]] += event.device_time / ITERATIONS
    return dict(totals)


def main(out: str) -> None:
    rows = []
    with tuning.disabled():
        for op in OPS:
            for shape, dtype_name in get_workload(op).shape_list("quick"):
                kernels = kernel_us(op, shape, DTYPES[dtype_name])
                main_us = max(kernels.values())
                rows.append(
                    {
                        "op": op,
                        "shape": list(shape),
                        "dtype": dtype_name,
                        "kernels_us": kernels,
                        "main_us": main_us,
                        "rest_us": sum(kernels.values()) - main_us,
                    }
                )
                print(
                    f"{op:13s} {'x'.join(map(str, shape)):11s} {dtype_name}: main {main_us:7.1f} us, "
                    f"the rest {rows[-1]['rest_us']:6.1f} us in {len(kernels) - 1} kernels",
                    flush=True,
                )
    with open(out, "w") as f:
        json.dump({"provenance": provenance(), "iterations": ITERATIONS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
