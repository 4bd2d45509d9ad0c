"""The rotary kernel's tile: ``rotary.TILE_ELEMENTS`` (tokens x heads x rotary pairs a program) and
``rotary.NUM_WARPS`` swept at the issue's two shapes, Hugging Face's ``apply_rotary_pos_emb``
forward (q and k in one launch), beside torch.compile of the reference.

    python benchmarks/rotary_tiles.py OUT.json

Times are CUDA-graph replays (``triton.testing.do_bench_cudagraph``, 200 ms), in us.
"""

from __future__ import annotations

import json
import sys

import torch
import triton.testing

from tritonkit.ops import rotary

SHAPES = [(4, 32, 8, 4096, 128), (1, 32, 8, 32768, 128)]  # (B, Hq, Hkv, S, D), bf16
TILES = (2048, 4096, 8192, 16384)
WARPS = (4, 8)


def _us(fn, *args) -> float:
    return triton.testing.do_bench_cudagraph(lambda: fn(*args), rep=200) * 1e3


def _row(batch: int, heads_q: int, heads_kv: int, seq: int, head_dim: int) -> dict:
    """us of torch.compile and of each tile at one shape."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = ((batch, heads_q, seq, head_dim), (batch, heads_kv, seq, head_dim), (batch, seq, head_dim))
    q, k, cos, sin = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for shape in (*shapes, shapes[2])
    )
    us = {"torch.compile": _us(torch.compile(rotary.rotary_pos_emb_reference), q, k, cos, sin)}
    default = rotary.TILE_ELEMENTS, rotary.NUM_WARPS
    for tile in TILES:
        for warps in WARPS:
            rotary.TILE_ELEMENTS, rotary.NUM_WARPS = tile, warps
            us[f"{tile}/{warps}"] = _us(rotary.apply_rotary_pos_emb, q, k, cos, sin)
    rotary.TILE_ELEMENTS, rotary.NUM_WARPS = default
    return us


def main() -> None:
    result = {"op": "rotary_tiles", "command": "python benchmarks/rotary_tiles.py OUT.json", "rows": []}
    for shape in SHAPES:
        us = _row(*shape)
        result["rows"].append({"shape": list(shape), "us": us})
        print(shape, {name: round(t, 1) for name, t in us.items()})
    with open(sys.argv[1], "w") as out:
        json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
