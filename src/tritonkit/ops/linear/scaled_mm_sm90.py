"""``scaled_mm`` on the sm_90 Gluon kernel (``scaled_mm_sm90_kernels``): which calls it takes, and
their launch. ``scaled_mm`` sends it the products where it measured faster (``scaled_mm._gluon_pays``).

It takes tensorwise, rowwise and (promoted, on a 128-column tile) blockwise scales without a bias
on an sm_90 GPU, A (M, K) and B^T (N, K) K-major and TMA-ready (K a multiple of 16), out
contiguous; everything else stays on the linear family's Triton kernel.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tritonkit._launch import Launch, cdiv, tma_ready
from tritonkit._runtime import capability, interpret, sm_count
from tritonkit.ops.linear.kernels import SCALINGS
from tritonkit.ops.linear.scaled_mm_sm90_kernels import CONSUMER_WARPS, ROWS, _scaled_mm_sm90_kernel

BLOCK_K, GROUP_M = 128, 8


# a consumer warpgroup's setmaxnreg budget by the consumers' count: what the register file holds
# beside the producer's warpgroup at 24 (2 x 128 x 240 or 3 x 128 x 160, + 128 x 24 <= 65,536)
CONSUMER_REGS = {2: 240, 3: 160}


class Tile(NamedTuple):
    """A launch's tile: ``consumers`` warpgroups of 64 rows (the tile's rows: 64 x consumers),
    ``block_n`` columns, a ring of ``stages`` K steps; ``persistent``: a program an SM walking
    tiles, the next tile's steps loading under this one's epilogue (else a program a tile)."""

    consumers: int
    block_n: int
    stages: int
    persistent: bool = False

    @property
    def regs(self) -> int:
        return CONSUMER_REGS[self.consumers]


# Promoted (False): the step's product beside the accumulator (two register sets of 64 x BLOCK_N a
# warpgroup), on three consumers, so that two others' products queue on the tensor cores while one
# waits for its own and adds it (the register file holds three at 160): 986-1085 TFLOP/s on the
# H200 against two consumers' 883-967 in the same run (docs/perf-notes/fp8.md, "scaled_mm's promoted
# product on three consumers"). Chained (True): one accumulator of 64 x 256 (128 registers a thread).
TILES = {False: Tile(3, 128, 5), True: Tile(2, 256, 3)}
# each mode's tiles timed beside TILES' (benchmarks/scaled_mm.py --gluon-tiles)
CANDIDATES = {
    False: [Tile(2, 128, 4), Tile(3, 128, 4), TILES[False]._replace(persistent=True)],
    True: [Tile(3, 128, 4), Tile(3, 128, 5), TILES[True]._replace(persistent=True)],
}
FP8 = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}


def takes(a: torch.Tensor, b_t: torch.Tensor, bias, scaling: int, out: torch.Tensor) -> bool:
    """Whether the Gluon kernel computes this product (module docstring)."""
    if interpret() or bias is not None or scaling not in SCALINGS.values() or scaling == SCALINGS[None]:
        return False
    if scaling == SCALINGS["block"] and TILES[False].block_n != BLOCK_K:  # a tile one block of N
        return False
    if not (a.is_cuda and capability(a.device.index or 0) == (9, 0)):
        return False
    return a.stride(1) == 1 and b_t.stride(1) == 1 and out.is_contiguous() and tma_ready(a) and tma_ready(b_t)


@functools.cache
def _layout(rows: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([rows, BLOCK_K], FP8[dtype])


def launch(a, b_t, scale_a, scale_b, scaling: int, chained: bool, out) -> Launch:
    """C = (A B^T) * scales into out: A (M, K), B^T (N, K), fp8, K-major; the scales flat fp32;
    on the mode's tile (TILES[chained])."""
    (m, k), n = a.shape, b_t.shape[0]
    tile = TILES[chained]
    a_desc = TensorDescriptor.from_tensor(a, [ROWS.value, BLOCK_K], _layout(ROWS.value, a.dtype))
    b_desc = TensorDescriptor.from_tensor(b_t, [tile.block_n, BLOCK_K], _layout(tile.block_n, b_t.dtype))
    args = (a_desc, b_desc, out, scale_a, scale_b, m, n, k, out.stride(0))
    meta = {
        "SCALING": scaling,
        "CHAINED": chained,
        "NUM_STAGES": tile.stages,
        "GROUP_M": GROUP_M,
        "CONSUMERS": tile.consumers,
        "CONSUMER_REGS": tile.regs,
        "num_warps": CONSUMER_WARPS.value,
    }
    tiles = cdiv(m, ROWS.value * tile.consumers) * cdiv(n, tile.block_n)
    grid = (min(tiles, sm_count(a.device)) if tile.persistent else tiles,)
    return Launch("scaled_mm sm90", _scaled_mm_sm90_kernel, args, meta, {}, grid)
