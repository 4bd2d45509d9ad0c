"""FP8 matmuls on the H200: tritonkit.scaled_mm against torch._scaled_mm (cuBLAS) and the bf16
matmul, and nn.Float8Linear's training step against torch.nn.Linear in bf16, in one process.

    python benchmarks/scaled_mm.py OUT.json [--shape M,K,N ...] [--scaling S ...] [--skip-linear]

Rows: each shape (default SHAPES, (M, K, N), e4m3 operands, bf16 out) and scaling ("tensor", "row",
"block"; torch._scaled_mm takes the first two here), then Float8Linear's forward + backward for
each recipe at LINEAR_SHAPES (tokens, in, out: bf16 activations, fp32 master weights) beside
torch.nn.Linear's on bf16 weights. Each time is the median of ``triton.testing.do_bench`` over an
eager call (L2 flushed); TFLOP/s from 2 M N K a matmul (three a training step). Each scaled_mm row
also gives the largest difference from torch._scaled_mm's output, relative to its largest value.
"""

from __future__ import annotations

import json
import sys

import torch
from attention_bwd_sm90 import _bench, arguments, result_header

import tritonkit
from tritonkit import nn
from tritonkit.ops.float8_linear import RECIPES

SHAPES = [(8192, 4096, 16384), (8192, 8192, 8192), (16384, 8192, 28672), (128, 4096, 14336)]
LINEAR_SHAPES = [(8192, 4096, 14336)]
E4M3 = torch.float8_e4m3fn


def _operands(m, k, n, scaling):
    a = (torch.randn(m, k, device="cuda") * 4).to(E4M3)
    b = (torch.randn(n, k, device="cuda") * 4).to(E4M3).t()
    if scaling == "tensor":
        return a, b, torch.rand((), device="cuda") + 0.5, torch.rand((), device="cuda") + 0.5
    if scaling == "row":
        return a, b, torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
    scale_a = torch.rand(m, -(-k // 128), device="cuda") + 0.5
    return a, b, scale_a, torch.rand(-(-k // 128), -(-n // 128), device="cuda") + 0.5


def _matmul_row(shape, scaling) -> dict:
    m, k, n = shape
    a, b, scale_a, scale_b = _operands(m, k, n, scaling)
    calls = {"tritonkit": lambda: tritonkit.scaled_mm(a, b, scale_a, scale_b)}
    if scaling != "block":
        calls["torch._scaled_mm"] = lambda: torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    calls["bf16 matmul"] = lambda: a16 @ b16
    row = {
        "shape": list(shape),
        "scaling": scaling,
        "ms": {name: _bench(call) for name, call in calls.items()},
    }
    row["tflops"] = {name: 2 * m * n * k / ms / 1e9 for name, ms in row["ms"].items()}
    if "torch._scaled_mm" in calls:
        ours, theirs = calls["tritonkit"]().float(), calls["torch._scaled_mm"]().float()
        row["max_rel_diff_vs_torch"] = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        row["vs_torch._scaled_mm"] = row["ms"]["torch._scaled_mm"] / row["ms"]["tritonkit"]
    return row


def _linear_row(shape) -> dict:
    tokens, d_in, d_out = shape
    x = torch.randn(tokens, d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, d_out, device="cuda", dtype=torch.bfloat16)
    bf16 = torch.nn.Linear(d_in, d_out, bias=False, device="cuda", dtype=torch.bfloat16)
    master = torch.nn.Linear(d_in, d_out, bias=False, device="cuda")  # fp32 master weights

    def step(layer):
        def call():
            layer(x).backward(dy)
            x.grad = layer.weight.grad = None

        return call

    row = {"shape": list(shape), "kind": "linear fwd+bwd", "ms": {"torch.nn.Linear bf16": _bench(step(bf16))}}
    for recipe in RECIPES:
        row["ms"][f"Float8Linear {recipe}"] = _bench(step(nn.Float8Linear.from_linear(master, recipe)))
    row["tflops"] = {name: 6 * tokens * d_in * d_out / ms / 1e9 for name, ms in row["ms"].items()}
    return row


def main() -> None:
    out = sys.argv[1]
    shapes = arguments("--shape", lambda s: tuple(int(v) for v in s.split(","))) or SHAPES
    scalings = arguments("--scaling", str) or ["tensor", "row", "block"]
    result = result_header("scaled_mm", "scaled_mm.py", "do_bench median over eager calls, L2 flushed")
    for shape in shapes:
        for scaling in scalings:
            row = _matmul_row(shape, scaling)
            result["rows"].append(row)
            tflops = "  ".join(f"{name} {value:.0f}" for name, value in row["tflops"].items())
            print(f"{shape} {scaling}: TFLOP/s {tflops}", flush=True)
            with open(out, "w") as f:
                json.dump(result, f, indent=1)
    if "--skip-linear" not in sys.argv:
        for shape in LINEAR_SHAPES:
            row = _linear_row(shape)
            result["rows"].append(row)
            print(f"{shape} linear fwd+bwd: " + "  ".join(f"{k} {v:.2f} ms" for k, v in row["ms"].items()))
            with open(out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
