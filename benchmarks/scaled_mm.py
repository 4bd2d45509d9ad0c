"""FP8 matmuls on the H200: tritonkit.scaled_mm against torch._scaled_mm (cuBLAS) and the bf16
matmul, and nn.Float8Linear's training step against torch.nn.Linear in bf16, in one process.

    python benchmarks/scaled_mm.py OUT.json [--shape M,K,N ...] [--scaling S ...] [--tiles] [--gluon]
        [--skip-matmul] [--skip-linear] [--profile] [--gluon-tiles]

Rows: each shape (default SHAPES, (M, K, N), e4m3 operands, bf16 out) and scaling ("tensor", "row",
"block"; torch._scaled_mm takes the first two here, each call by default and with use_fast_accum),
then Float8Linear's forward + backward for each recipe at LINEAR_SHAPES (tokens, in, out: bf16
activations, fp32 master weights), eager and under torch.compile, beside torch.nn.Linear's and
tritonkit.linear's on bf16 weights and, where torchao is installed, torchao's Float8Linear
(rowwise, tensorwise) under torch.compile. A matmul row's calls take turns
(``tritonkit.bench.timing.interleaved_ms``: each one's median turn, and its ``spread``); the other
rows' time is the median of ``triton.testing.do_bench`` over an eager call; L2 flushed; TFLOP/s
from 2 M N K a matmul (three a training step). Each scaled_mm row also gives the largest difference
from torch._scaled_mm's output, relative to its largest value. ``--skip-matmul`` and
``--skip-linear`` leave out those rows; ``--gluon`` adds scaled_mm made to run each call on the
sm_90 Gluon kernel and on the Triton one (``scaled_mm.GLUON`` True and False; the plain rows take
its measured rule), in both modes (blockwise: promoted only). ``--tiles`` adds, for each shape,
scaled_mm rowwise on each candidate tile of TILES (on the Triton kernel, whatever the shape).
``--profile`` adds to each linear row each layer's kernels (torch.profiler: their GPU time a step).
``--gluon-tiles`` adds each mode's product forced onto the Gluon kernel on its tile and on each of
``scaled_mm_sm90.CANDIDATES``.
"""

from __future__ import annotations

import copy
import functools
import json
import sys

import torch
from attention_bwd_sm90 import _bench, arguments, result_header

import tritonkit
from tritonkit import nn, tuning
from tritonkit.bench import layer as bench_layer
from tritonkit.bench import timing
from tritonkit.ops.float8_linear import RECIPES
from tritonkit.ops.linear import scaled_mm_sm90 as sm90
from tritonkit.ops.scaled_mm import scaled_mm_reference

SHAPES = [
    (8192, 4096, 16384),
    (8192, 8192, 8192),
    (16384, 8192, 28672),
    (128, 4096, 14336),
    (128, 4096, 16384),  # the decode-like product (14336 above: the MLP's width)
    (1024, 16384, 1024),
]
# --tiles: scaled_mm's candidate tiles (ops/scaled_mm.py's TILE first), timed at rowwise scales


def _tile(m, n, k, warps, stages, persistent=0, split=1) -> dict:
    tile = {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8, "num_warps": warps, "num_stages": stages}
    return (
        tile | ({"PERSISTENT": persistent} if persistent else {}) | ({"SPLIT_K": split} if split > 1 else {})
    )


TILES = [
    _tile(128, 128, 128, 8, 3),
    _tile(128, 128, 128, 8, 4),
    _tile(128, 256, 128, 8, 3),
    _tile(128, 256, 128, 8, 4),
    _tile(256, 128, 128, 8, 3),
    _tile(128, 256, 128, 8, 3, persistent=1),
    _tile(128, 128, 128, 8, 4, persistent=1),
    _tile(128, 256, 64, 8, 5),
    _tile(64, 128, 128, 4, 5),
    _tile(64, 256, 128, 4, 4),
    _tile(128, 128, 128, 8, 4, split=2),
    _tile(128, 128, 128, 8, 4, split=4),
    _tile(64, 128, 128, 4, 5, split=2),
    _tile(64, 128, 128, 4, 5, split=4),
    _tile(64, 64, 128, 4, 6),
    _tile(64, 64, 128, 4, 6, split=2),
    # deeper rings (more of B in flight an SM, where M = 128 streams B at 1.8 TB/s on TILE's 4 stages):
    # 160-197 KB of shared memory, compiled for sm_90 without spills
    _tile(128, 128, 128, 8, 5),
    _tile(128, 128, 128, 8, 6),
    _tile(128, 128, 256, 8, 3),
    _tile(128, 64, 256, 4, 4),
    _tile(64, 128, 256, 4, 4),
]
LINEAR_SHAPES = [(8192, 4096, 14336), (8192, 14336, 4096)]  # Llama-3-8B MLP: up (and gate), down
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
    """scaled_mm, torch._scaled_mm (tensorwise and rowwise) each promoting every 128 of K (their
    default) and with use_fast_accum, and the bf16 matmul of the same values. fp32 outputs' largest
    error against float64, relative to the largest output, for each fp8 call (M N <= 2^24)."""
    m, k, n = shape
    a, b, scale_a, scale_b = _operands(m, k, n, scaling)

    def ours(fast=False, out_dtype=torch.bfloat16):
        return tritonkit.scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype, use_fast_accum=fast)

    def theirs(fast=False, out_dtype=torch.bfloat16):
        return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype, use_fast_accum=fast)

    def forced(gluon, fast=False, out_dtype=torch.bfloat16, tile=None):  # one kernel, whatever the rule
        from tritonkit.ops import scaled_mm as module

        module.GLUON, shipped = gluon, sm90.TILES[fast]
        sm90.TILES[fast] = tile or shipped
        try:
            return ours(fast, out_dtype)
        finally:
            module.GLUON, sm90.TILES[fast] = None, shipped

    calls = {"tritonkit": ours}
    modes = (False,) if scaling == "block" else (False, True)  # blockwise: promoted only
    if "--gluon" in sys.argv:
        for name, gluon in (("gluon", True), ("triton", False)):
            for fast in modes:
                label = f"tritonkit {name}" + (" fast_accum" if fast else "")
                calls[label] = functools.partial(forced, gluon, fast)
    if "--gluon-tiles" in sys.argv:  # the Gluon kernel on each tile, each mode
        for fast in modes:
            for tile in [sm90.TILES[fast], *sm90.CANDIDATES[fast]]:
                if scaling == "block" and tile.block_n != 128:  # a tile one block of N: not taken
                    continue
                name = f"tritonkit gluon {64 * tile.consumers}x{tile.block_n} s{tile.stages}"
                name += " persistent" if tile.persistent else ""
                name += " fast_accum" if fast else ""
                calls[name] = functools.partial(forced, True, fast, tile=tile)
    if scaling != "block":
        calls |= {
            "tritonkit fast_accum": functools.partial(ours, True),
            "torch._scaled_mm": theirs,
            "torch._scaled_mm fast_accum": functools.partial(theirs, True),
        }
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    timed = calls | {"bf16 matmul": lambda: a16 @ b16}
    for call in timed.values():  # compiled outside the timing
        call()
    torch.cuda.synchronize()
    row = {"shape": list(shape), "scaling": scaling}
    row["ms"], row["spread"] = timing.interleaved_ms(timed)
    row["tflops"] = {name: 2 * m * n * k / ms / 1e9 for name, ms in row["ms"].items()}
    if scaling != "block":
        for mode in ("", " fast_accum"):
            row[f"vs_torch._scaled_mm{mode}"] = (
                row["ms"][f"torch._scaled_mm{mode}"] / row["ms"][f"tritonkit{mode}"]
            )
    if m * n <= 2**24:
        exact = scaled_mm_reference(a, b, scale_a, scale_b, None, torch.float64, torch.float64)
        largest = exact.abs().max()
        row["fp32_out_max_rel_err"] = {
            name: ((call(out_dtype=torch.float32).double() - exact).abs().max() / largest).item()
            for name, call in calls.items()
        }
    return row


def _tiles_row(shape) -> dict:
    """scaled_mm at rowwise scales on each of TILES (``ops/scaled_mm.TILE`` and ``SMALL_TILE``, the tile
    of products of few tiles, set for the call: each tile whatever the shape), on the Triton kernel
    (``GLUON`` False: its rule sends the large promoted products to the Gluon kernel)."""
    from tritonkit.ops import scaled_mm as module

    m, k, n = shape
    a, b, scale_a, scale_b = _operands(m, k, n, "row")
    shipped = module.TILE, module.SMALL_TILE, module.GLUON
    row = {"shape": list(shape), "scaling": "row", "kind": "tiles", "ms": {}}

    def theirs():
        return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)

    row["ms"]["torch._scaled_mm"] = _bench(theirs)
    reference = theirs().float()
    for tile in TILES:
        name = "x".join(str(tile[key]) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        name += f" w{tile['num_warps']} s{tile['num_stages']}"
        name += " persistent" if tile.get("PERSISTENT") else ""
        name += f" split {tile['SPLIT_K']}" if tile.get("SPLIT_K") else ""
        module.TILE = module.SMALL_TILE = tile
        module.GLUON = False
        try:
            ours = tritonkit.scaled_mm(a, b, scale_a, scale_b).float()
            difference = (ours - reference).abs().max() / reference.abs().max()
            row[f"{name} max_rel_diff_vs_torch"] = difference.item()
            row["ms"][name] = _bench(lambda: tritonkit.scaled_mm(a, b, scale_a, scale_b))
        except Exception as error:  # a tile that does not fit (shared memory, registers): say so, go on
            row[f"{name} error"] = f"{type(error).__name__}: {str(error)[:200]}"
        finally:
            module.TILE, module.SMALL_TILE, module.GLUON = shipped
    row["tflops"] = {name: 2 * m * n * k / ms / 1e9 for name, ms in row["ms"].items()}
    row["vs_torch._scaled_mm"] = {name: row["ms"]["torch._scaled_mm"] / ms for name, ms in row["ms"].items()}
    return row


def _torchao_linear(master: torch.nn.Linear, recipe: str):
    """torchao's Float8Linear over a copy of ``master`` (its recipes "rowwise" and "tensorwise"),
    or None where torchao is not installed."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    layer = torch.nn.Sequential(copy.deepcopy(master))
    return convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(recipe))


def _linear_row(shape) -> dict:
    """One training step (forward and backward) of each layer at ``shape``: the bf16 layers of
    torch and tritonkit, Float8Linear of each recipe eager and compiled, torchao's compiled."""
    tokens, d_in, d_out = shape
    x = torch.randn(tokens, d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, d_out, device="cuda", dtype=torch.bfloat16)
    bf16 = torch.nn.Linear(d_in, d_out, bias=False, device="cuda", dtype=torch.bfloat16)
    master = torch.nn.Linear(d_in, d_out, bias=False, device="cuda")  # fp32 master weights

    def step(layer, weight):
        def call():
            layer(x).backward(dy)
            x.grad = weight.grad = None

        return call

    layers = {
        "torch.nn.Linear bf16": (bf16, bf16.weight),
        "tritonkit.linear bf16": (lambda t: tritonkit.linear(t, bf16.weight), bf16.weight),
    }
    for recipe in RECIPES:
        ours = nn.Float8Linear.from_linear(master, recipe)
        layers[f"Float8Linear {recipe}"] = (ours, master.weight)
        layers[f"Float8Linear {recipe} compiled"] = (torch.compile(ours), master.weight)
    for recipe in ("rowwise", "tensorwise"):
        theirs = _torchao_linear(master, recipe)
        if theirs is not None:
            layers[f"torchao Float8Linear {recipe} compiled"] = (torch.compile(theirs), theirs[0].weight)
    row = {"shape": list(shape), "kind": "linear fwd+bwd", "ms": {}}
    if "--profile" in sys.argv:
        row["kernels"] = {}
    for name, (layer, weight) in layers.items():
        torch._dynamo.reset()  # each compiled layer its own graphs
        row["ms"][name] = _bench(step(layer, weight))
        if "--profile" in sys.argv:  # where the step's GPU time goes, kernel by kernel
            profile = bench_layer.kernel_profile(step(layer, weight), [])
            row["kernels"][name] = {key: profile[key] for key in ("kernel_ms", "profiled_span_ms", "kernels")}
    row["tflops"] = {name: 6 * tokens * d_in * d_out / ms / 1e9 for name, ms in row["ms"].items()}
    bf16_ms = row["ms"]["tritonkit.linear bf16"]
    row["vs_tritonkit.linear_bf16"] = {name: bf16_ms / ms for name, ms in row["ms"].items()}
    return row


def main() -> None:
    out = sys.argv[1]
    shapes = arguments("--shape", lambda s: tuple(int(v) for v in s.split(","))) or SHAPES
    scalings = arguments("--scaling", str) or ["tensor", "row", "block"]
    result = result_header(
        "scaled_mm",
        "scaled_mm.py",
        "eager calls, L2 flushed: a matmul row's calls in turns (timing.interleaved_ms, its median turn);"
        " the tiles' and linear rows' do_bench median a call",
    )
    for shape in [] if "--skip-matmul" in sys.argv else shapes:
        for scaling in scalings:
            row = _matmul_row(shape, scaling)
            result["rows"].append(row)
            tflops = "  ".join(f"{name} {value:.0f}" for name, value in row["tflops"].items())
            print(f"{shape} {scaling}: TFLOP/s {tflops}", flush=True)
            with open(out, "w") as f:
                json.dump(result, f, indent=1)
    if "--tiles" in sys.argv:
        for shape in shapes:
            row = _tiles_row(shape)
            result["rows"].append(row)
            ours = {name: value for name, value in row["tflops"].items() if name != "torch._scaled_mm"}
            best = max(ours, key=ours.get)
            theirs = row["tflops"]["torch._scaled_mm"]
            print(f"{shape} tiles: torch._scaled_mm {theirs:.0f}, best {best} {ours[best]:.0f}", flush=True)
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
    with tuning.enabled():  # tritonkit as tuned (where nothing is cached or shipped, tuned here)
        main()
