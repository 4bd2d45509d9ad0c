"""The untuned tiles on the H200: what a first call on a shape outside the shipped tuning table runs,
against the fixed tiles they replaced (``docs/perf-notes/``: norms.md, linear.md and
attention-backward.md, "... against the shipped tuning records") and against the library the op
stands beside.

    python benchmarks/untuned_defaults.py OUT.json

Matmuls (``matmul.untuned_tile`` against ``kernels.DEFAULT_CONFIGS``, beside torch.matmul) at
model shapes outside ``tuned/h200.json``'s keys, plain and with the bias-GELU epilogue. Every
call's output is checked against torch's (the largest difference over the largest value) before
it is timed; the calls of a row take turns (``timing.interleaved_ms``, eager calls,
L2 flushed). Nothing is tuned: the configs are forced.
"""

from __future__ import annotations

import json
import sys

import torch

from tritonkit.bench.runner import provenance
from tritonkit.bench.timing import interleaved_ms
from tritonkit.ops.linear import kernels as lk
from tritonkit.ops.linear import matmul as mm

# (M, K, N): a Qwen2-7B-like MLP (hidden 3584, FFN 18944), a 5120 x 13824 projection at 8192 and
# 12288 tokens, and two decode-like batches
MATMUL_SHAPES = [
    (8192, 3584, 18944),
    (8192, 18944, 3584),
    (12288, 5120, 13824),
    (16, 5120, 13824),
    (96, 3584, 18944),
]


def _error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def matmul_row(m: int, k: int, n: int, epilogue: bool) -> dict:
    """One shape's untuned and fixed tiles and torch's matmul, checked, then timed in turns."""
    g = torch.Generator(device="cuda").manual_seed(m + n)
    a = torch.randn((m, k), device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn((n, k), device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
    bias = torch.randn((n,), device="cuda", dtype=torch.bfloat16, generator=g) if epilogue else None
    out = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
    operands = {"bias": bias, "activation": lk.ACTIVATIONS["gelu"]} if epilogue else {}
    problem = mm.matmul_problem(a, b, out, **operands)
    configs = {"untuned": mm.untuned_tile(mm.tuning_key(problem)), "fixed": lk.DEFAULT_CONFIGS["linear"]}

    def torch_call() -> torch.Tensor:
        product = torch.addmm(bias, a, b.t()) if epilogue else a @ b.t()
        return torch.nn.functional.gelu(product) if epilogue else product

    expected = torch_call()
    calls, errors = {}, {}
    for name, config in configs.items():
        calls[name] = lambda config=config: mm.MATMUL.run(problem, config)
        out.fill_(float("nan"))
        calls[name]()
        errors[name] = _error(out, expected)
    calls["torch"] = torch_call
    ms, spread = interleaved_ms(calls)
    flops = 2 * m * n * k
    tflops = {name: flops / t / 1e9 for name, t in ms.items()}
    label = "bias+gelu" if epilogue else "plain"
    print(f"{(m, k, n)} {label}: " + "  ".join(f"{name} {v:.0f}" for name, v in tflops.items()) + " TFLOP/s")
    return {
        "op": "matmul", "shape": [m, k, n], "epilogue": label, "configs": configs,
        "max_rel_err": errors, "ms": ms, "spread": spread, "tflops": tflops,
    }  # fmt: skip


def main(out: str) -> None:
    rows = [matmul_row(*shape, epilogue) for shape in MATMUL_SHAPES for epilogue in (False, True)]
    record = {
        "op": "untuned_defaults",
        "command": "python benchmarks/untuned_defaults.py OUT.json",
        **provenance(),
        "timing": "eager calls in turns (timing.interleaved_ms), L2 flushed",
        "rows": rows,
    }
    with open(out, "w") as file:
        json.dump(record, file, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1])
