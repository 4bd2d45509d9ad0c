"""Attention forward for Hopper (sm_90) in Gluon, the host side: which calls it takes
(``supports``), its tiles (``CONFIGS``, ``CANDIDATES``), the order of its programs and the launch
(``attention_fwd_sm90``: the kernel of ``fwd_sm90_kernels``, whose docstring has the maths and the
design).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tritonkit._launch import TMA_ALIGN_BYTES, Launch, cdiv, tma_ready
from tritonkit._runtime import capability, sm_count
from tritonkit.dtypes import HALVES
from tritonkit.jit import LOG2E
from tritonkit.ops.attention.fwd_sm90_kernels import CONSUMER_WARPS, SPLIT_M, _attn_fwd_sm90_kernel

DTYPES = HALVES
HEAD_DIMS = (64, 128, 256)  # the forward kernel's; the backward's are BACKWARD_HEAD_DIMS
BACKWARD_HEAD_DIMS = (64, 128)  # the backward kernel's (bwd_sm90.PADDED_HEAD_DIMS: those it takes)
# The head dims this forward takes: a multiple of 8 (a row's bytes a multiple of TMA's 16) up to 256,
# run by the kernel of the next head dim of HEAD_DIMS up, whose TMA boxes reach past the tensor's D:
# the loads fill the columns past it with zeros (they add nothing to q . k, and O's come out 0) and
# the stores drop them. D = 96 thus runs the D = 128 kernel, a quarter of its products on zeros.
PADDED_HEAD_DIMS = tuple(range(8, HEAD_DIMS[-1] + 1, 8))


def kernel_head_dim(head_dim: int) -> int:
    """The head dim of the kernel that runs ``head_dim`` (one of PADDED_HEAD_DIMS)."""
    return next(d for d in HEAD_DIMS if d >= head_dim)


SM90 = (9, 0)  # wgmma, setmaxnreg and the TMA engine: Hopper only (sm_90a)

NUM_CONSUMERS = 2  # consumer warpgroups by default: FA3's 2 x 64 = 128 rows a program at D = 128
BLOCK_M = NUM_CONSUMERS * SPLIT_M
# setmaxnreg budgets, FA3's: 2 x 128 threads x 240 + the producer's warpgroup x 24 <= 65,536
# registers of an SM. A consumer's live set at D = 128, BLOCK_N = 128: S (64 fp32), O (64 fp32), P in
# flight and the next P (2 x 32 packed halves), row statistics and addresses.
CONSUMER_REGS = 240


# Ping-pong (FA3's warp-scheduler barrier): the consumer warpgroups take turns to issue their products, so
# that one's softmax runs while the other's products hold the tensor cores. Gluon 3.6 has no named barriers,
# so the turn is an mbarrier pair, and each hand-on costs a warpgroup bar.sync besides. Off: on the H200
# (2026-12-01, docs/perf-notes/attention-forward.md) it was level at D = 128 full (604 vs 601 TFLOP/s at (4,
# 32, 4096)), 4% slower causal (514 vs 534), 4-6% slower at D = 64 and 5% slower at (16, 16, 1024, 128) full.
# The two warpgroups interleave well enough unordered here. On the persistent grid (2c26f94, causal): level or
# 1-9% slower than the default but at (16, 16, 1024, 128) (+1%).
PINGPONG = False


class Config(NamedTuple):
    """A launch's tile: BLOCK_N keys a step, NUM_STAGES K/V tiles in flight; pin_softmax keeps a
    block's exponentials under the previous block's PV product (see ``_attend_blocks``); pingpong
    orders the consumers' products (``PINGPONG``); persistent launches one program an SM, each
    walking tiles one after another (its turns, with ping-pong, running on across them)."""

    block_n: int
    num_stages: int
    pin_softmax: bool = True
    pingpong: bool = PINGPONG
    persistent: bool = False


# Per head dim. The shared memory of a program is 2 x 64 x D for Q (reused for O) and NUM_STAGES x 2
# x BLOCK_N x D for the K/V ring, in 16-bit elements, against 227 KB an SM:
# - D = 128: 128-key steps (64-key steps ran 0.92x of 128 in a first version: the softmax's fixed cost a
#   block and the wgmma's N halve). Two stages are 160 KB; three, 224 KB, still fit because O
#   reuses Q's buffer, but timed level with two on the H200 (within the ~2% run-to-run spread).
# - D = 64: 128-key steps (256 would hold a 64 x 256 fp32 S, 128 registers, beside P: spills), three
#   stages (112 KB); two and four timed the same (the loop is softmax-bound at D = 64).
# - D = 256: 64-key steps, two stages (Q 64 KB, the ring 128 KB: 193 KB), one tile a program (the
#   persistent tile's own O buffers, 64 KB more, do not fit). A consumer holds O (128 fp32), S (32)
#   and P: no values on the stack compiled for sm_90; not yet timed.
CONFIGS = {
    64: Config(block_n=128, num_stages=3),
    128: Config(block_n=128, num_stages=2),
    256: Config(block_n=64, num_stages=2),
}
PERSISTENT_HEAD_DIMS = (64, 128)  # where the persistent tile fits in shared memory
# A persistent grid (one program an SM walking tiles, the next tile's Q loading under the epilogue)
# over at most this many keys, where a tile's fixed cost weighs. On the H200, x cuDNN,
# one run each: full masks (499beb9) 0.92 against 0.83 one tile a program at (16, 16, 1024, 128),
# 1.04 against 1.03 and 1.01 against 0.98 in two runs at (4, 32, 4096, 128), 1.05 against 1.03 at
# (2, 32/8, 8192, 128); causal, in pairs of a long and a short block (ec0160e): 0.92 against 0.81 at
# (16, 16, 1024, 128), 1.06 against 1.02 at (4, 32, 4096, 128), 1.02 against 0.96 in the decoder
# layer, 1.08 against 1.05 at (2, 32/8, 8192, 128). Over 16384 keys it lost: 0.98 against 1.02
# full, 0.93 against 1.06 causal (not understood yet). At D = 64 level in a first run (0.93-0.95
# against 0.92-0.97), then (0bbcc80) 0.95 against 0.94 full and 0.89 against 0.88 causal at (4, 32,
# 4096, 64), 0.89 against 0.76 full and 0.81 against 0.67 causal at (16, 16, 1024, 64).
PERSISTENT_MAX_KEYS = 8192


def default_config(head_dim: int, seq_k: int) -> Config:
    """The tile a launch takes unless told: CONFIGS', persistent over at most PERSISTENT_MAX_KEYS
    keys, causal or not (the causal walk pairs a head's query blocks, ``fwd_sm90_tiles._walk``),
    where it fits (PERSISTENT_HEAD_DIMS)."""
    config = CONFIGS[head_dim]
    persistent = head_dim in PERSISTENT_HEAD_DIMS and seq_k <= PERSISTENT_MAX_KEYS
    return config._replace(persistent=True) if persistent else config


# What the benchmark compares per head dim (and the tests check): the default, the same tile with ping-pong
# toggled and without PIN_SOFTMAX (what each is worth), a deeper ring at D = 128, and the tile persistent (the
# default over at most PERSISTENT_MAX_KEYS keys; causal, its walk in pairs of a long and a short block,
# fwd_sm90_tiles._walk). FA3's three consumers at D = 64 (64-key steps, 160 registers) ran 0.84-0.89x cuDNN
# against the default's 0.92-0.93: removed. So were (0bbcc80, docs/perf-notes/attention-forward-sm90-loop.md)
# three at 128-key steps with P through shared memory (0.47-0.95x against one tile a program's 0.67-0.94x) and
# K released with V after the PV product, one arrive and warpgroup barrier a step fewer (level: 0.67-0.93x at
# D = 64, 0.97-1.01x at D = 128), (c8fc77b) P through shared memory, two tiles a consumer: +1-2% over 4096
# keys, -3-4% at 1024, and (6680c00) PV_{j-1} issued after block j's row max: -1-3% at D = 64, -8% at D = 128
# persistent, and (5062b8f) O's rescale under the next S product, FA3's order: -1.3% to +1.9% at D = 64,
# -2.7% to +0.6% at D = 128 (two placements, on an H100).
CANDIDATES = {
    64: [
        CONFIGS[64],
        CONFIGS[64]._replace(pingpong=not PINGPONG),
        CONFIGS[64]._replace(pin_softmax=False),
        CONFIGS[64]._replace(persistent=True),
    ],
    128: [
        CONFIGS[128],
        CONFIGS[128]._replace(pingpong=not PINGPONG),
        CONFIGS[128]._replace(pin_softmax=False),
        CONFIGS[128]._replace(num_stages=3),
        CONFIGS[128]._replace(persistent=True),
        CONFIGS[128]._replace(persistent=True, pingpong=not PINGPONG),
    ],
    256: [
        CONFIGS[256],
        CONFIGS[256]._replace(pingpong=not PINGPONG),
        CONFIGS[256]._replace(pin_softmax=False),
    ],
}


# ---------------------------------------------------------------- launcher


def supports(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = (-1, -1),
    softcap: float = 0.0,
    packed: bool = False,
    scale: float | None = None,
) -> bool:
    """Whether ``attention_fwd_sm90`` takes this call: (B, H, S, D) fp16/bf16 tensors of one dtype
    on an sm_90 GPU, D a multiple of 8 up to 256 (PADDED_HEAD_DIMS), Hq a multiple of Hkv, TMA-ready
    (unit last stride; base and other strides 16-byte aligned), scale > 0 (the default 1/sqrt(D) is),
    a soft cap finite and >= 0 (0: none). ``causal`` either way, windows too. ``packed``: a packed
    batch's (1, H, T, D) views (O's rows stored masked by row, and by column past a padded D)."""
    del causal, window, packed  # every mask is taken, and packed batches at every head dim
    if not (math.isfinite(softcap) and softcap >= 0):
        return False
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        return False
    if not (sm90_dense_inputs(q, k, v) and all(tma_ready(t) for t in (q, k, v))):
        return False
    (batch, heads_q, seq_q, _) = q.shape
    return cdiv(seq_q, BLOCK_M) * batch * heads_q < MAX_GRID_X


MAX_GRID_X = 2**31  # programs a launch may have along its x axis (CUDA's limit, and int32 ids)


def sm90_dense_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dims=PADDED_HEAD_DIMS) -> bool:
    """What both sm_90 Gluon kernels (this forward and ``bwd_sm90``) need of their inputs: (B, H, S,
    D) fp16/bf16 tensors of one dtype on one sm_90 GPU, D one of ``head_dims``, Hq a multiple of Hkv."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_cuda for t in tensors):
        return False
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if k.device != q.device or v.device != q.device or capability(q.device.index or 0) != SM90:
        return False
    (batch, heads_q, _, head_dim), (batch_k, heads_kv, _, head_dim_k) = q.shape, k.shape
    if head_dim not in head_dims or head_dim_k != head_dim or v.shape != k.shape or batch_k != batch:
        return False
    return heads_kv > 0 and heads_q % heads_kv == 0


def descriptor(
    t: torch.Tensor, rows: int, cols: int | None = None, swizzle: int | None = None
) -> TensorDescriptor:
    """A 4-D TMA descriptor over a (B, H, S, D) tensor with a (1, 1, rows, cols or D) box: the S
    bound is the head's own, so a box past it loads zeros and stores (or adds) nothing. The shared
    layout is the default for the box, or ``swizzle`` bytes wide."""
    block = (1, 1, rows, cols or t.shape[3])
    return TensorDescriptor.from_tensor(t, list(block), _shared_layout(block, t.dtype, swizzle))


@functools.cache
def _shared_layout(block: tuple, dtype: torch.dtype, swizzle: int | None) -> gl.NVMMASharedLayout:
    """A box's shared-memory layout (immutable), computed once a box, dtype and swizzle: building it
    is Python work that would otherwise recur for each of a call's descriptors (seven a backward)."""
    element = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for(list(block), element)
    if swizzle is not None:
        layout = gl.NVMMASharedLayout(swizzle, layout.element_bitwidth, rank=len(block))
    return layout


def attention_fwd_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    bottom_right: bool = True,
    window: tuple[int, int] | None = (-1, -1),
    softcap: float = 0.0,
    packed=None,
    config: Config | None = None,
) -> None:
    """Write attention's output into ``o`` and the fp32 log-sum-exp (natural log) into ``lse``.

    q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D), o like q, lse (B, Hq, Sq) fp32; fp16 or bf16, D a
    multiple of 8 up to 256 (64, 128 and 256 natively, the others on the next one's kernel:
    PADDED_HEAD_DIMS), Hq a multiple of Hkv (GQA/MQA). Strides: any, as long as the last dim of q, k,
    v and o is contiguous and their base and other strides are multiples of 16 bytes (TMA's rules);
    the lse's
    last dim contiguous. ``causal`` is aligned bottom-right (query i sees keys j <= i + Sk - Sq), or
    with ``bottom_right=False`` top-left (j <= i, torch's ``is_causal``); a row that sees no key gets
    0 and lse -inf. ``scale`` > 0 multiplies q . k; ``softcap`` > 0 then caps each score s to
    softcap * tanh(s / softcap) (0: no cap). ``window`` = (left, right): query i sees keys j with
    i + offset - left <= j <= i + offset + right (offset as the causal mask's alignment; -1 leaves a
    side unbounded; causal with a window: right 0), as ``flash_attention``'s. ``config`` overrides
    the tile (``default_config``). ``packed`` (``common.Packed``): q, k, v and o are a packed batch's
    (1, H, T, D) views and lse (1, H, T), sequence b's rows cu_q[b]:cu_q[b + 1] (keys likewise), each
    causal mask and window aligned bottom-right for its sequence's lengths, as the Triton kernels'
    (O's rows stored masked, by column too past a padded D). ``supports`` says which calls this takes."""
    window = (-1, -1) if window is None else tuple(window)
    if len(window) != 2 or not all(isinstance(side, int) and side >= -1 for side in window):
        raise ValueError(f"window must be (left, right), each an int >= -1 (-1: unbounded), got {window}")
    scale, softcap = float(scale), float(softcap)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0: no cap), got {softcap}")
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_cuda or t.device != q.device:
            raise ValueError(f"{name} must be on q's CUDA device, got {t.device}")
    device_capability = capability(q.device.index or 0)
    if device_capability != SM90:
        raise ValueError(f"attention_fwd_sm90 needs an sm_90 GPU, got capability {device_capability}")
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, heads, sequence, head dim), got shape {tuple(t.shape)}"
            )
        if t.dtype != q.dtype or q.dtype not in DTYPES:
            raise TypeError(f"{name} must be float16 or bfloat16 like q, got {t.dtype}")
    (batch, heads_q, seq_q, head_dim), (_, heads_kv, seq_k, _) = q.shape, k.shape
    if head_dim not in PADDED_HEAD_DIMS:
        raise ValueError(f"head dim must be a multiple of 8 up to {PADDED_HEAD_DIMS[-1]}, got {head_dim}")
    if k.shape[0] != batch or k.shape[3] != head_dim or v.shape != k.shape:
        raise ValueError(
            f"k and v must be (B, Hkv, Sk, D) = ({batch}, Hkv, Sk, {head_dim}), got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")
    if o.shape != q.shape:
        raise ValueError(f"o must have q's shape {tuple(q.shape)}, got {tuple(o.shape)}")
    if lse.shape != q.shape[:3] or lse.dtype != torch.float32 or (seq_q > 1 and lse.stride(2) != 1):
        raise ValueError(
            f"lse must be float32 {tuple(q.shape[:3])} with a contiguous last dim, got "
            f"{lse.dtype} {tuple(lse.shape)} strides {lse.stride()}"
        )
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o)):
        if not tma_ready(t):
            raise ValueError(
                f"{name} must have a unit last stride and a base and other strides that are "
                f"multiples of {TMA_ALIGN_BYTES} bytes (TMA), got strides {t.stride()}"
            )
    if packed is not None:
        check_packed_views(q, k, packed)
    if o.numel() == 0:
        return
    if seq_k == 0:  # no keys: every row sees none
        o.zero_()
        lse.fill_(-math.inf)
        return
    upper_offset, lower_offset = seq_k - seq_q if bottom_right else 0, None
    if window != (-1, -1) or packed is not None:
        # the bounds as every kernel takes them (Scores, which drops sides past the keys); a packed
        # batch's hold the window's sides, to which each sequence adds its alignment
        from tritonkit.ops.attention.common import Scores

        lengths = (packed.max_q, packed.max_k) if packed is not None else (seq_q, seq_k)
        scores = Scores(scale, causal, bottom_right, window, softcap).within(*lengths)
        (upper_offset, lower_offset, *_), flags = scores.kernel_args(*(lengths if packed is None else (0, 0)))
        causal, lower_offset = flags["IS_CAUSAL"], lower_offset if flags["HAS_LOWER"] else None
    for launch in launches(
        q, k, v, o, lse, scale=scale, causal=causal, upper_offset=upper_offset, lower_offset=lower_offset,
        softcap=softcap, packed=packed, config=config,
    ):  # fmt: skip
        launch.run()


def check_packed_views(q: torch.Tensor, k: torch.Tensor, packed) -> None:
    """ValueError unless q and k are a packed batch's (1, H, T, D) views and its cu_seqlens are int32,
    one entry a sequence and one more, on q's device (what both sm_90 kernels read)."""
    if q.shape[0] != 1 or k.shape[0] != 1:
        raise ValueError(f"a packed batch's q, k and v are (1, H, T, D) views, got {tuple(q.shape)}")
    for name, cu in (("cu_q", packed.cu_q), ("cu_k", packed.cu_k)):
        if cu.dtype != torch.int32 or cu.device != q.device or cu.shape != (packed.sequences + 1,):
            raise ValueError(
                f"{name} must be int32 ({packed.sequences + 1},) on q's device, got {cu.dtype} "
                f"{tuple(cu.shape)} on {cu.device}"
            )


# The order of programs. A full mask's query blocks all walk every key: a head's blocks together
# (groups of 1), sharing its K and V in L2. A causal block m walks m + 1 key blocks: a head's blocks
# together, longest first, leave the last heads' long blocks running alone at the end; groups of a
# few heads, each group's longest blocks first, balance them (simulated as a greedy schedule on 132
# SMs, benchmarks/program_order.py, at the layer's (2, 32, 4096, 128): 306 block-steps against 288
# in groups of 4, 287 spread evenly; 593 against 576 at (4, 32, 4096, 128)). Measured on the H200
# at 48877f9: level with groups of 1 (within 2%, either way by shape); every head at once 2-27%
# slower. Groups of 2 (measured at f976360): groups of 4 ran 3-7% behind 1, 2 and 8 at (4, 32,
# 4096, 64) in three runs on an H100, and 2 ran 3% ahead of 4 at (16, 16, 1024, 128) in two on the
# H200; level (within 2%, either way) at the other shapes timed
# (docs/perf-notes/attention-forward-sm90-loop.md, "The causal order's groups"). The backward orders
# its pairs by its own rule (bwd_sm90).
CAUSAL_HEADS_PER_GROUP = 2
# At D = 256 (one tile a program), groups of 4: on an H100, 1.19x cuDNN against 2's 1.08x at (2, 16/8,
# 4096, 256) causal, 1.21x against 1.10x in an earlier run, level (1.12x) at (1, 32/8, 8192, 256)
# (results/h100/history/attention-fwd-sm90-d256-groups-6343cea.json, ...-d256-6e9ec9c.json)
WIDE_CAUSAL_HEADS_PER_GROUP = 4


def order(causal: bool, batch_heads: int, head_dim: int = 128) -> int:
    """HEADS_PER_GROUP for a launch over ``batch_heads`` (batch, head)s of the kernel's ``head_dim``:
    one tile a program and persistent (``fwd_sm90_tiles._walk`` numbers its pairs of blocks in the
    same groups)."""
    if not causal:
        return 1
    return min(WIDE_CAUSAL_HEADS_PER_GROUP if head_dim > 128 else CAUSAL_HEADS_PER_GROUP, batch_heads)


def launches(
    q,
    k,
    v,
    o,
    lse,
    *,
    scale: float,
    causal: bool,
    upper_offset: int | None = None,
    lower_offset: int | None = None,
    softcap: float = 0.0,
    packed=None,
    config: Config | None = None,
) -> list[Launch]:
    """The kernel's launch for checked arguments (``attention_fwd_sm90``'s; ``causal``: an upper
    bound, row i sees key j iff j <= i + upper_offset, Sk - Sq unless given; ``lower_offset``: a
    lower bound, j >= i + lower_offset, none if None; ``softcap`` > 0 caps the scores; ``packed``: a
    packed batch, its offsets the window's sides): one program per 128 query rows of a (batch, head),
    or persistent, a one-dimensional grid in ``order``'s order (the heads of a GQA group are
    neighbours, so their blocks share K and V in L2)."""
    (batch, heads_q, seq_q, head_dim), (_, heads_kv, seq_k, _) = q.shape, k.shape
    if packed is not None:  # the grid of the sequences and their longest lengths
        batch, seq_q, seq_k = packed.sequences, packed.max_q, packed.max_k
    kernel_dim = kernel_head_dim(head_dim)
    config = config or default_config(kernel_dim, seq_k if packed is None else 0)
    if config.persistent and kernel_dim not in PERSISTENT_HEAD_DIMS:
        raise ValueError(f"a persistent tile does not fit in shared memory at D = {kernel_dim}: {config}")
    args = (
        descriptor(q, SPLIT_M, kernel_dim),
        descriptor(k, config.block_n, kernel_dim),
        descriptor(v, config.block_n, kernel_dim),
        descriptor(o, SPLIT_M, kernel_dim),
        o,  # (packed: stored row by row, masked)
        o.stride(1),
        o.stride(2),
        lse,
        lse.stride(0),
        lse.stride(1),
        heads_q,
        batch * heads_q,
        order(causal, batch * heads_q, kernel_dim),
        heads_q // heads_kv,
        seq_q,
        seq_k,
        seq_k - seq_q if upper_offset is None else upper_offset,
        0 if lower_offset is None else lower_offset,
        lse if packed is None else packed.cu_q,  # (unused but packed)
        lse if packed is None else packed.cu_k,
        # the exponent's factors: q . k * scale * log2(e), or capped cap_log2 * tanh(q . k * scale / cap)
        scale / softcap if softcap else scale * LOG2E.value,
        softcap * LOG2E.value if softcap else 1.0,
    )
    meta = {
        "IS_CAUSAL": bool(causal),
        "NUM_STAGES": config.num_stages,
        "PIN_SOFTMAX": config.pin_softmax,
        "PINGPONG": config.pingpong,
        "CONSUMERS": NUM_CONSUMERS,
        "CONSUMER_REGS": CONSUMER_REGS,
        "PERSISTENT": config.persistent,
        "SOFTCAP": bool(softcap),
        "HAS_LOWER": lower_offset is not None,
        "VARLEN": packed is not None,
        # packed: the tensors' D, to which O's masked row stores keep; dense: 0 (unused), so that a
        # padded head dim's launch is the next one's up, compiled once
        "TENSOR_D": head_dim if packed is not None else 0,
        "num_warps": CONSUMER_WARPS.value,
    }
    tiles = cdiv(seq_q, BLOCK_M) * batch * heads_q
    grid = (min(tiles, sm_count(q.device)) if config.persistent else tiles,)
    return [Launch("fwd sm90", _attn_fwd_sm90_kernel, args, meta, config._asdict(), grid)]
