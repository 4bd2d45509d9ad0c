"""FP8 matmul with scales: ``scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)`` computes
``out = (a @ b) * scale_a * scale_b + bias`` from fp8 operands, ``torch._scaled_mm``'s call.

Maths. a (M, K) and b (K, N) hold fp8 values (e4m3fn or e5m2; ``quantize_fp8`` makes them, with
dequantized = fp8 * scale); their product is summed in fp32 on the tensor cores, then
    out[i, j] = acc[i, j] * scale_a[i] * scale_b[j] + bias[j]
in fp32, rounded once to ``out_dtype``. Scales: tensorwise (one each, shape () or (1, 1)) or
rowwise (scale_a (M, 1), one a row of a; scale_b (1, N), one a column of b), fp32, as
``torch._scaled_mm`` takes them; or blockwise (DeepSeek-V3's recipe): scale_a (M, cdiv(K, 128)),
one a run of 128 along a row of a, as ``quantize_fp8(x, "block")`` makes them, and scale_b
(cdiv(K, 128), cdiv(N, 128)), one a 128 x 128 block of b, the transpose of what
``quantize_fp8(w, "block2d")`` makes for the weight w = b^T; then
    out[i, j] = sum over the blocks kb of K of (sum over k in kb of a[i, k] b[k, j])
                * scale_a[i, kb] * scale_b[kb, j // 128] + bias[j].
Layouts as ``torch._scaled_mm``'s: a row-major, b column-major (b.t() contiguous), so that both
operands run along K in memory, which Hopper's fp8 tensor-core instructions (wgmma) require of
both.

Kernel. The linear family's matmul (``ops/linear/kernels.py``: TMA loads, the grouped tile order,
its epilogues), with the scales applied to the fp32 accumulator in the epilogue (``SCALING``), or,
blockwise, to each step's product before it is added (a step lies in one block of K: the tensor
cores' sum restarts every step, as DeepSeek-V3's kernels promote it every 128 of K). A
fixed tile for now (``TILE``, ``FAST_TILE``: 128 x 128 or 128 x 256 outputs, 128 deep, a 128-byte
row of fp8 a step) instead of the tuner's: fp8 keys are not in its table yet. On sm_90 the large
tensorwise and rowwise products without a bias run on a warp-specialized Gluon kernel instead
(``ops/linear/scaled_mm_sm90.py``: a TMA producer warp and two or three consumer warpgroups),
where it measured faster (``_gluon_pays``).

Accumulation. Hopper's fp8 tensor cores sum their products keeping about 14 bits. By default each
128-deep step's product is added to the fp32 accumulator on its own (promoted): on the H200 its
error is ``torch._scaled_mm``'s default one to three digits, and the step's wait for its product
costs a fifth of the speed. ``use_fast_accum=True`` (torch's argument) chains the
steps in the tensor cores' accumulator instead: torch's fast-accumulation error, and speed
(measured in docs/perf-notes/fp8.md). Blockwise scales promote every step by their recipe.

Work. 2 M N K FLOPs; bytes M K + K N (one byte each) + M N x the output's size, + the scales.
Hopper's fp8 rate is twice its bf16 rate: compute-bound from a few hundred rows on.

References: torch._scaled_mm's scale conventions; DeepSeek-V3 technical report (arXiv 2412.19437)
section 3.3 for the recipes that use them.
"""

from __future__ import annotations

import functools

import torch

from tritonkit._launch import cdiv
from tritonkit._runtime import empty_output, interpret, sm_count
from tritonkit.dtypes import FLOATS
from tritonkit.opdef import check_tensor, op
from tritonkit.ops.linear import scaled_mm_sm90
from tritonkit.ops.linear.kernels import INTERPRETER_CONFIG, SCALE_BLOCK, SCALINGS
from tritonkit.ops.linear.matmul import matmul_launches, matmul_problem, unit_stride_bias
from tritonkit.ops.quantize import FP8_DTYPES

OUT_DTYPES = FLOATS
BLOCK = SCALE_BLOCK.value  # the blockwise scales' run of a's rows and block of b: 128
# The GPU's tiles: fp8 steps twice as deep as 16-bit ones for the same bytes a stage. A promoted
# step holds its product beside the accumulator (twice the registers): 128 x 128 outputs on four
# stages (128 KB of shared memory; at 128 x 256 the two spill). Steps chained in the tensor cores'
# sum (use_fast_accum) keep one accumulator: 128 x 256 on three (144 KB). Each the best of ten tiles
# timed at the shapes (docs/perf-notes/fp8.md).
TILE = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
FAST_TILE = TILE | {"BLOCK_N": 256, "num_stages": 3}
# Outputs of fewer 128 x 128 tiles than the GPU has SMs (short M, N): 64 x 128 on four warps and five
# stages, promoted, where its tiles too are one wave; else TILE's one wave (_launch_choice). Taken
# whatever use_fast_accum says: promoted is the more exact, and chained 128 x 256 tiles are half as
# many programs. On the H200 at c1360a6, graph replays (`python benchmarks/scaled_mm.py OUT.json
# --tiles --skip-linear --shape 128,4096,14336 --shape 1024,16384,1024`,
# results/h200/history/scaled-mm-tiles-c1360a6.json): at (128, 4096, 14336), 112 tiles of 128 x 128
# and 224 of 64 x 128, TILE 454 TFLOP/s against SMALL_TILE's 382 (cuBLAS 570); at (1024, 16384,
# 1024) 64 x 128 691 against TILE's 501 (its products, of many tiles, take the Gluon kernel)
SMALL_TILE = TILE | {"BLOCK_M": 64, "num_warps": 4, "num_stages": 5}
# Which products the warp-specialized Gluon kernel (ops/linear/scaled_mm_sm90.py: tensorwise and
# rowwise scales, no bias, sm_90) computes among those it can: None, the measured rule
# (_gluon_pays); True, all of them; False, none (the switch the benchmark and the tests turn).
GLUON: bool | None = None


_sms = functools.cache(sm_count)  # (a launch path's query, once a device)


def _few_tiles(m: int, n: int, device) -> bool:
    """Fewer 128 x 128 output tiles than the GPU has SMs: one wave of promoted tiles (SMALL_TILE's or
    TILE's, ``_launch_choice``)."""
    return cdiv(m, 128) * cdiv(n, 128) < _sms(device)


def _launch_choice(fast_accum: bool, m: int, n: int, device) -> tuple[dict, bool]:
    """(the launch's tile, whether its steps chain in the tensor cores' sum): the interpreter's small
    tile (several programs and steps in a test), else TILE, FAST_TILE or SMALL_TILE (above) through
    TMA where the operands allow it."""
    if interpret():
        return dict(INTERPRETER_CONFIG), fast_accum
    if _few_tiles(m, n, device):  # one wave: SMALL_TILE's where its tiles are one too
        one_wave = cdiv(m, SMALL_TILE["BLOCK_M"]) * cdiv(n, SMALL_TILE["BLOCK_N"]) <= _sms(device)
        return (SMALL_TILE if one_wave else TILE) | {"TMA": True}, False
    return (FAST_TILE if fast_accum else TILE) | {"TMA": True}, fast_accum


def _gluon_pays(few_tiles: bool, chained: bool, scaling: int) -> bool:
    """Where the Gluon kernel measured faster than the Triton one (H200, two runs at three large
    shapes, docs/perf-notes/fp8.md): promoted, +3-17% at both scalings; chained tensorwise -1% to +28%
    (ahead at five of six); chained rowwise -7% to +1% (behind at five of six), so not there.
    Products of few tiles keep SMALL_TILE (level with the Gluon kernel at (128, 4096, 14336), 1-12%
    ahead at (1024, 16384, 1024)). Blockwise (always promoted): 885-960 TFLOP/s against the Triton
    kernel's 701-775 at the three large shapes, 0.45x and 0.59x of it at the two of few tiles
    (history/scaled_mm-blockwise-gluon-3d286c9.json)."""
    return not few_tiles and not (chained and scaling == SCALINGS["row"])


_tile_keys: dict[int, tuple] = {}  # id(tile) -> (tile, its items): a tile's key made once


def _tile_key(tile: dict) -> tuple:
    """``tile``'s items, a key's part (a dict does not hash), made once a tile object (the module's
    tiles are set by assignment, not changed in place)."""
    known = _tile_keys.get(id(tile))
    if known is None or known[0] is not tile:
        known = _tile_keys[id(tile)] = (tile, tuple(sorted(tile.items())))
    return known[1]


def _switches() -> tuple:
    """What the dispatch reads besides the call: a replayed call (opdef's ``replay``) keys on it too,
    the Triton kernel's tiles among it (a tile set for a benchmark's call, not the first call's
    recorded launch)."""
    tiles = _tile_key(TILE), _tile_key(FAST_TILE), _tile_key(SMALL_TILE)
    return GLUON, scaled_mm_sm90.TILES[False], scaled_mm_sm90.TILES[True], *tiles


@op("scaled_mm", mutates=("out",), replay=_switches)
def _scaled_mm(
    a_bits: torch.Tensor,
    b_bits: torch.Tensor,
    a_dtype: torch.dtype,
    b_dtype: torch.dtype,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    scaling: int,
    fast_accum: bool,
    out: torch.Tensor,
) -> None:
    """out = (a @ b) * scales + bias, a and b given as their uint8 bits (torch's CPU ops, which
    opcheck runs on the arguments, take no fp8) and fp8 dtypes; b (K, N) column-major, read as
    B = b^T (N, K)."""
    a, b = a_bits.view(a_dtype), b_bits.view(b_dtype)
    (m, _), n = a.shape, b.shape[1]
    config, chained = _launch_choice(fast_accum, m, n, a.device)
    gluon = GLUON if GLUON is not None else _gluon_pays(_few_tiles(m, n, a.device), chained, scaling)
    if gluon and scaled_mm_sm90.takes(a, b.t(), bias, scaling, out):
        scaled_mm_sm90.launch(a, b.t(), scale_a, scale_b, scaling, chained, out).run()
        return
    scales = {"scale_a": scale_a, "scale_b": scale_b, "scaling": scaling, "fast_accum": chained}
    problem = matmul_problem(a, b.t(), out, bias=bias, **scales)
    for launch in matmul_launches(problem, config):
        launch.run()


def _scaling(a, b, scale_a, scale_b) -> str:
    """ "tensor", "row" or "block" from the scales' shapes; anything else raises, naming what is
    taken."""
    (m, _), n = a.shape, b.shape[1]
    for name, scale in (("scale_a", scale_a), ("scale_b", scale_b)):
        check_tensor(name, scale, dtypes=(torch.float32,), device_of=("a", a))
    if scale_a.numel() == 1 and scale_b.numel() == 1 and scale_a.dim() <= 2 and scale_b.dim() <= 2:
        return "tensor"
    if tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n):
        return "row"
    blocks_k, blocks_n = -(-a.shape[1] // BLOCK), -(-n // BLOCK)
    if tuple(scale_a.shape) == (m, blocks_k) and tuple(scale_b.shape) == (blocks_k, blocks_n):
        return "block"
    raise ValueError(
        f"scaled_mm takes tensorwise scales (one element each), rowwise ones (scale_a ({m}, 1), "
        f"scale_b (1, {n})) or blockwise ones (scale_a ({m}, {blocks_k}), scale_b ({blocks_k}, "
        f"{blocks_n})), got scale_a {tuple(scale_a.shape)} and scale_b {tuple(scale_b.shape)}"
    )


def _validate(a, b, bias, out_dtype) -> None:
    for name, t in (("a", a), ("b", b)):
        check_tensor(name, t, dtypes=FP8_DTYPES, ndim=2, device_of=("a", a))
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a (M, K) and b (K, N) must share K, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.stride(1) != 1 and a.shape[1] > 1:
        raise ValueError(
            f"a must be row-major (a unit stride along K), as torch._scaled_mm takes it: {a.stride()}"
        )
    if b.stride(0) != 1 and b.shape[0] > 1:
        raise ValueError(
            f"b must be column-major (b.t() contiguous: a unit stride along K), as torch._scaled_mm takes "
            f"it: {b.stride()}"
        )
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOATS, ndim=1, device_of=("a", a))
        if bias.shape[0] != b.shape[1]:
            raise ValueError(f"bias must have N = {b.shape[1]} elements, got {bias.shape[0]}")


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``(a @ b) * scale_a * scale_b + bias`` in ``out_dtype`` from fp8 ``a`` (M, K), row-major, and
    ``b`` (K, N), column-major, with tensorwise, rowwise or blockwise fp32 scales (the module
    docstring), as ``torch._scaled_mm(a, b, scale_a, scale_b, bias, out_dtype=out_dtype,
    use_fast_accum=use_fast_accum)`` for the first two. ``use_fast_accum``: sum every step in the
    tensor cores' accumulator (faster, less exact; the module docstring), where the output has at
    least as many 128 x 128 tiles as the GPU has SMs (fewer: the promoted small tile, faster there
    and exact to the step). No gradient."""
    _validate(a, b, bias, out_dtype)
    bias = unit_stride_bias(bias)
    scaling = _scaling(a, b, scale_a, scale_b)
    if use_fast_accum and scaling == "block":
        raise ValueError(
            "use_fast_accum is for tensorwise and rowwise scales: blockwise scales apply to each 128 of "
            "K, whose products are summed apart by the recipe"
        )
    wanting = [t for t in (a, b, scale_a, scale_b, bias) if t is not None and t.requires_grad]
    if wanting and torch.is_grad_enabled():
        raise RuntimeError("scaled_mm has no gradient: its operands are fp8 (pass them detached)")
    (m, k), n = a.shape, b.shape[1]
    out = empty_output((m, n), out_dtype, a.device)
    if not (m and n):
        return out
    if k == 0:  # a sum over nothing: the bias alone (TMA takes no empty operand)
        return out.copy_(torch.zeros(n, device=a.device) if bias is None else bias.expand(m, n))
    flat = (scale_a.reshape(-1).contiguous(), scale_b.reshape(-1).contiguous())
    bits = (a.view(torch.uint8), b.view(torch.uint8), a.dtype, b.dtype)
    _scaled_mm(*bits, *flat, bias, SCALINGS[scaling], use_fast_accum, out)
    return out


def scaled_mm_reference(
    a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, compute_dtype=torch.float64
) -> torch.Tensor:
    """The same in float64 (the oracle's exact reference), rounded to ``out_dtype``: each fp8 value is
    exact in float64 and so are the products; only the sums and the scales round. Blockwise, as
    (a times its runs' scales) @ (b times its blocks' scales), which the kernel's per-block sums
    equal in exact arithmetic. ``compute_dtype`` float32: the same in fp32 (torch's arithmetic, the
    oracle's torch error)."""
    k, n = b.shape
    c = compute_dtype
    if _scaling(a, b, scale_a, scale_b) == "block":  # each value times its run's or block's scale
        rows_a = scale_a.to(c).repeat_interleave(BLOCK, dim=1)[:, :k]
        blocks_b = scale_b.to(c).repeat_interleave(BLOCK, dim=0)[:k].repeat_interleave(BLOCK, dim=1)[:, :n]
        out = (a.to(c) * rows_a) @ (b.to(c) * blocks_b)
    else:
        out = (a.to(c) @ b.to(c)) * scale_a.to(c).reshape(-1, 1) * scale_b.to(c).reshape(1, -1)
    if bias is not None:
        out = out + bias.to(c)
    return out.to(out_dtype)


def scaled_mm_cost(shape: tuple, out_dtype: torch.dtype = torch.bfloat16):
    """(M, K, N): 2 M N K FLOPs; the fp8 operands read once, the output written once."""
    from tritonkit.roofline import Cost

    m, k, n = shape
    out_size = torch.finfo(out_dtype).bits // 8
    return Cost(2 * m * n * k, m * k + k * n + out_size * m * n + 4 * (m + n))


# No op contract (a gradient-free op with fp8 inputs is held to its reference by
# tests/test_scaled_mm.py) and no workload yet
OPS: dict = {}
WORKLOADS: dict = {}
