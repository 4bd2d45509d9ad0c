"""Where each microsecond of a short call goes: host wall time per call on a tiny input.

Run on a GPU:  PYTHONPATH=src python benchmarks/host_overhead.py OUT.json [PROFILE.txt]
Each figure is tritonkit.bench.timing.host_us: the median over bursts of 100 calls on a 4 x 256
bf16 input of the time to issue one call (the bursts never fill the launch queue, so the host
never waits for the GPU). PROFILE.txt gets cProfile's view of the eager forward and backward.
"""

from __future__ import annotations

import json
import sys

import torch

import tritonkit.ops.bias_gelu as bg
from tritonkit._launch import cdiv, launcher_of
from tritonkit.bench.runner import provenance
from tritonkit.bench.timing import host_us, profile_calls

SHAPE = (4, 256)


def measure() -> dict[str, float]:
    x = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(SHAPE[-1], device="cuda", dtype=torch.bfloat16)
    x_grad = x.clone().requires_grad_(True)
    y = torch.empty_like(x)
    m, n = SHAPE
    block_m, block_n = bg.tile_shape(n, x.element_size())
    grid = (cdiv(m, block_m), cdiv(n, block_n), 1)
    args = (x, b, y, m, n, x.stride(0), x.stride(1), b.stride(0))
    meta = dict(APPROX_TANH=False, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=bg.NUM_WARPS)
    compiled = bg._bias_gelu_fwd_kernel[grid](*args, **meta)
    runner = compiled[grid]
    constexprs = tuple(v for k, v in meta.items() if k != "num_warps")
    op = torch.ops.tritonkit.bias_gelu
    launcher = launcher_of(bg._bias_gelu_fwd_kernel)
    kernel = bg._bias_gelu_fwd_kernel
    cases = {
        "torch.empty (the output allocation)": lambda: torch.empty_like(x),
        "torch.softmax (eager baseline)": lambda: torch.softmax(x, -1),
        "torch eager gelu(x + b)": lambda: torch.nn.functional.gelu(x + b),
        "triton kernel[grid](...) (bare Triton launch)": lambda: kernel[grid](*args, **meta),
        "CompiledKernel[grid](...) (cached kernel, Triton's runner)": lambda: runner(*args, *constexprs),
        "tritonkit Launcher (lean launch)": lambda: launcher(grid, *args, **meta),
        "tritonkit validation alone": lambda: bg._validate(x, b, "none"),
        "tritonkit op, eager (build the launch + launch)": lambda: bg._forward(x, b, "none", y),
        "tritonkit.bias_gelu (eager, no grad)": lambda: bg.bias_gelu(x, b),
        "tritonkit.bias_gelu (input requires grad: autograd.Function)": lambda: bg.bias_gelu(x_grad, b),
        "torch.ops.tritonkit.bias_gelu (through the dispatcher)": lambda: op(x, b, "none", y),
        "torch eager gelu(x + b), requires grad": lambda: torch.nn.functional.gelu(x_grad + b),
    }
    return {name: host_us(call) for name, call in cases.items()}


def profile(path: str) -> None:
    """cProfile of 2000 eager forwards and 500 backwards, the top entries by own time."""
    x = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(SHAPE[-1], device="cuda", dtype=torch.bfloat16)
    x_grad = x.clone().requires_grad_(True)
    dy = torch.randn_like(x)
    text = profile_calls(
        (
            ("eager forward", lambda: bg.bias_gelu(x, b), 2000),
            ("forward + backward", lambda: bg.bias_gelu(x_grad, b).backward(dy), 500),
        )
    )
    with open(path, "w") as f:
        f.write(text)


def main() -> None:
    results = measure()
    bare = results["triton kernel[grid](...) (bare Triton launch)"]
    alloc = results["torch.empty (the output allocation)"]
    eager = results["tritonkit.bias_gelu (eager, no grad)"]
    summary = {
        "eager_forward_us": eager,
        "eager_forward_goal_us": 12.0,
        "added_over_bare_triton_launch_us": eager - (bare + alloc),
        "added_goal_us": 5.0,
        "grad_path_added_over_bare_us": results[
            "tritonkit.bias_gelu (input requires grad: autograd.Function)"
        ]
        - (bare + alloc),
    }
    for name, us in results.items():
        print(f"{us:8.2f} us  {name}")
    for name, value in summary.items():
        print(f"{name}: {value:.2f}")
    record = {
        "shape": list(SHAPE),
        "dtype": "bf16",
        "host_us": results,
        "summary": summary,
        "command": "PYTHONPATH=src python benchmarks/host_overhead.py OUT.json",
    } | provenance()
    with open(sys.argv[1], "w") as f:
        json.dump(record, f, indent=1)
    if len(sys.argv) > 2:
        profile(sys.argv[2])


if __name__ == "__main__":
    main()
