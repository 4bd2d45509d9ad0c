"""FP8 quantization on the H200: tritonkit.quantize_fp8 against its PyTorch reference eager and
under torch.compile and, where it is installed, torchao's own quantization (``_torchao``), in one
process, bf16 in and e4m3 out, beside a copy of the same bytes.

    python benchmarks/quantize_fp8.py OUT.json [--shape M,N ...] [--granularity G ...] [--warps W ...]

Rows: each shape (default SHAPES) and granularity (default every one), and with ``--warps`` each
warp count of the tiles' and lines' programs (``quantize.NUM_WARPS``, forced for the row) in turn.
Each time is the median of ``triton.testing.do_bench`` over an eager call (L2 flushed); GB/s from
the op's bytes (``quantize_fp8_cost``); ``copy`` is one ``torch.Tensor.copy_`` of half the op's bytes, so that
it reads and writes as many bytes as the op moves (the bandwidth ceiling). Each
row also says whether tritonkit's output equals the reference's bit for bit (NaN as NaN).
"""

from __future__ import annotations

import json
import sys

import torch
from attention_bwd_sm90 import _bench, arguments, result_header

import tritonkit
from tritonkit import opdef, tuning
from tritonkit.ops import quantize as qz

SHAPES = [(8192, 4096), (16384, 8192), (128, 4096)]


def _same(ours: tuple, reference: tuple) -> bool:
    (q, scale), (ref_q, ref_scale) = ours, reference
    nan = ref_scale.isnan()
    scales = torch.equal(scale.isnan(), nan) and torch.equal(scale[~nan], ref_scale[~nan])
    values = torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    return scales and values


def _torchao(granularity: str):
    """torchao's quantization at ``granularity``, or None where torchao is not installed: its float8
    training's scale and saturated cast (tensor, row, column), compiled as its Float8Linear runs them,
    or its blockwise training's Triton kernels (block: an activation's 1 x 128 groups; column_block:
    128 x 1, written column-major; block2d: a weight's 128 x 128 tiles). Its scales are the
    reciprocals of ours (fp8 = x * scale) where it returns them so."""
    try:
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
        from torchao.prototype.blockwise_fp8_training import kernels
    except ImportError:
        return None
    blockwise = {
        "block": kernels.triton_fp8_blockwise_act_quant_lhs,
        "column_block": kernels.triton_fp8_blockwise_act_quant_rhs,
        "block2d": kernels.triton_fp8_blockwise_weight_quant_rhs,
    }
    if granularity in blockwise:
        return blockwise[granularity]
    scaling, dim = {
        "tensor": (ScalingGranularity.TENSORWISE, None),
        "row": (ScalingGranularity.AXISWISE, -1),
        "column": (ScalingGranularity.AXISWISE, 0),
    }[granularity]

    def quantize(x: torch.Tensor) -> tuple:
        scale = tensor_to_scale(x, torch.float8_e4m3fn, scaling_granularity=scaling, axiswise_dim=dim)
        return to_fp8_saturated(x.to(torch.float32) * scale, torch.float8_e4m3fn), scale

    return torch.compile(quantize, dynamic=False)


def _bench_graph(fn) -> float:
    """The kernels' time alone: one call captured in a CUDA graph, its replay timed (an eager call
    of a small input is the host's time)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _bench(graph.replay)


def _row(shape: tuple, granularity: str, warps: int | None) -> dict:
    if warps is not None:
        qz.NUM_WARPS = warps
        opdef.forget_plans()  # (a replayed call would keep the launches recorded before)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()  # a compile of its own: the rows' recompiles would pass dynamo's limit
    compiled = torch.compile(qz.quantize_fp8_reference, dynamic=False)
    cost = qz.quantize_fp8_cost(shape, torch.bfloat16, granularity)
    calls = {
        "tritonkit": lambda: tritonkit.quantize_fp8(x, granularity),
        "torch": lambda: qz.quantize_fp8_reference(x, granularity),
        "torch.compile": lambda: compiled(x, granularity),
    }
    theirs = _torchao(granularity)
    if theirs is not None:
        calls["torchao"] = lambda: theirs(x)
    row = {"shape": list(shape), "granularity": granularity, "dtype": "bf16", "fp8": "e4m3fn"}
    row["num_warps"] = qz.NUM_WARPS
    row["bit_exact"] = _same(calls["tritonkit"](), calls["torch"]())
    row["ms"] = {name: _bench(call) for name, call in calls.items()}
    row["ms"]["tritonkit (graph)"] = _bench_graph(calls["tritonkit"])
    source = torch.empty(int(cost.bytes) // 2, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    row["ms"]["copy"] = _bench(lambda: target.copy_(source))  # reads and writes the op's bytes
    row["gbps"] = {name: cost.bytes / ms / 1e6 for name, ms in row["ms"].items()}
    row["vs_torch.compile"] = row["ms"]["torch.compile"] / row["ms"]["tritonkit"]
    if theirs is not None:
        row["vs_torchao"] = row["ms"]["torchao"] / row["ms"]["tritonkit"]
    row["pct_copy"] = 100 * row["ms"]["copy"] / row["ms"]["tritonkit"]
    return row


def main() -> None:
    out = sys.argv[1]
    shapes = arguments("--shape", lambda s: tuple(int(v) for v in s.split(","))) or SHAPES
    granularities = arguments("--granularity", str) or list(qz.GRANULARITIES)
    warp_counts = arguments("--warps", int) or [None]
    timing = "do_bench median over eager calls, L2 flushed"
    result = result_header("quantize_fp8", "quantize_fp8.py", timing)
    for shape in shapes:
        for granularity in granularities:
            for warps in warp_counts:
                row = _row(shape, granularity, warps)
                result["rows"].append(row)
                ms = "  ".join(f"{name} {gbps:.0f} GB/s" for name, gbps in row["gbps"].items())
                label = f"{shape} {granularity} {row['num_warps']} warps"
                print(f"{label}: {ms}  bit-exact {row['bit_exact']}", flush=True)
            with open(out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    with tuning.enabled():  # tritonkit as tuned (where nothing is cached or shipped, tuned here)
        main()
