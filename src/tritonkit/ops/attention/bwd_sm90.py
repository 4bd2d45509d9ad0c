"""Attention backward for Hopper (sm_90) in Gluon, the host side: which calls it takes
(``supports``), its tiles (``CONFIGS``), the order of its programs, and the launch
(``attention_bwd_sm90``: the kernel of ``bwd_sm90_kernels``, whose docstring has the maths and the
design), then the passes that finish it (``finish_launches``: dq's conversion from its fp32
accumulator, and per query head the sums of the dK and dV shares).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch

from tritonkit._launch import Launch, cdiv, next_power_of_2, scratch, tma_ready
from tritonkit._runtime import sm_count
from tritonkit._triton import tl, triton
from tritonkit.jit import LOG2E
from tritonkit.ops.attention import bwd_sm90_wide as wide
from tritonkit.ops.attention.bwd_sm90_kernels import (
    BLOCK_M,
    BLOCK_N,
    CONSUMER_WARPS,
    SPLIT_N,
    _attn_bwd_sm90_kernel,
)
from tritonkit.ops.attention.common import Packed
from tritonkit.ops.attention.fwd_sm90 import (
    BACKWARD_HEAD_DIMS,
    check_packed_views,
    descriptor,
    kernel_head_dim,
    sm90_dense_inputs,
)

# The head dims the kernel takes: a multiple of 8 (a row's bytes a multiple of TMA's 16) up to 128,
# run by the kernel of the next head dim of BACKWARD_HEAD_DIMS up, as the forward's (``fwd_sm90.
# PADDED_HEAD_DIMS``): its TMA boxes reach past the tensors' D, the loads fill the columns past it
# with zeros (they add nothing to S or dP, and dQ's, dK's and dV's come out 0) and the stores and
# dQ's reduce-adds drop them. A packed batch's dK and dV leave row by row from the registers, masked
# by rows and by the tensors' columns (the kernel's TENSOR_D).
PADDED_HEAD_DIMS = tuple(range(8, BACKWARD_HEAD_DIMS[-1] + 1, 8))
# D = 256, and the head dims it pads (136-248): ``bwd_sm90_wide``'s kernel, its two warpgroups splitting
# a step's products (dK and dV of 64 keys at D = 256 do not fit one warpgroup's registers); dense
# batches
WIDE_HEAD_DIMS = tuple(range(BACKWARD_HEAD_DIMS[-1] + 8, 257, 8))


class Config(NamedTuple):
    """A launch's shape: NUM_STAGES Q/dO tiles in flight; overlap_sdp issues dP^T beside S^T (both
    64 x 64 fp32 accumulators live at the exponentials, 32 registers more a thread) instead of
    after P^T, beside dV; shared_dq adds one 64 x D dQ tile a step for the program, each
    warpgroup its D / 2 columns over the 128 keys (FA3's split), instead of a 64-key partial each.
    per_query_head (GQA only): a program a key block of one query head, not of the group, its dK
    and dV that head's share, in q's dtype, summed over the group afterwards (FlashAttention-2's
    GQA backward): programs G times shorter, so that an ordered launch (a deterministic one, whose
    programs start in turn order, the longest last) ends evenly, at 2 x B x Hq x Sk x D elements of
    shares written and read once. acquire_first (deterministic): the dQ warp polls its turn by an
    acquiring load first, one L2 round trip where the turn is already reached, where a relaxed spin
    and then the acquire took two. turn_blocks (deterministic): the query blocks one turn of the
    dQ warp covers (a ticket counter each group of them), so that a turn's round trips, the read
    and the completion before the release, are paid once a group instead of once a step.
    block_m: the query rows a step (BLOCK_M or 128; FA3's at D = 64): a step's S^T and dP^T are
    64 keys x block_m a warpgroup, so that its fixed costs (the barriers, the dQ hand-over, the dQ
    warp's reduce and, deterministic, its turn) are paid once for twice the products. p_in_pairs:
    where P reaches dS in 16 bits (the deterministic mode at D = 128, fp16), P and dS converted two
    values an instruction on the ALU (F2FP) instead of one on the MUFU's pipe beside the
    exponentials (F2F), P unpacked for dS. dq_buffers (D = 256's kernel alone, ``bwd_sm90_wide``): its
    dQ staging tiles a warpgroup, 2 so that a step's store waits on the reduce of two steps before
    rather than one (the dQ warp's turn between them), 32 KB more shared memory. rotate (the free
    mode's full mask, D <= 128): key block n walks the query blocks from n * Mb / Nb on, as the
    deterministic mode's full mask does, so that a head's key blocks add their dQ partials to
    different tiles at a time rather than all to the same one; in the free mode at D = 128,
    p_in_pairs takes the deterministic mode's 16-bit P too (the default: ``CONFIGS``)."""

    num_stages: int
    overlap_sdp: bool = False
    shared_dq: bool = False
    per_query_head: bool = False
    acquire_first: bool = False
    turn_blocks: int = 1
    block_m: int = BLOCK_M
    p_in_pairs: bool = False
    dq_buffers: int = 1
    rotate: bool = False


# Shared memory a program at D = 128, 16-bit elements: K and V 2 x 32 KB, the Q/dO ring NUM_STAGES x
# 32 KB, dS^T 2 x 8 KB, the fp32 dQ staging 2 x 32 KB: 208 KB with two stages (of 227 KB); with
# shared_dq 193 KB. At D = 64 everything halves but dS^T, and the dQ staging doubles (two buffers a
# consumer): 145 KB with two stages, 129 KB with shared_dq.
# The free mode's defaults: at D = 128 one dQ tile a step (on the H200 with 11871ed's kernel, nine
# shapes: 0.83-0.94x cuDNN against 0.78-0.90x, behind only at (2, 32/8, 8192, 128) full, 0.87
# against 0.90; overlap_sdp led at the causal MHA shapes, 0.85-0.92x, and trailed with GQA), and at
# D = 64 too since the free mode forms dS from P's fp32 values (each switch cost 1-6% there at
# 6ea5362; one dQ tile a step gained 1-5% at (4, 32, 4096, 64) and (2, 32/8, 4096, 64), both
# masks, on the H200 at a8ec601 and on an H100 at fe8dea5, and -2% to +4% on an H100 at b9ac710:
# `python benchmarks/attention_bwd_sm90.py OUT.json --candidates --skip-triton --shape
# 4,32,32,4096,64 --shape 2,32,8,4096,64`; docs/perf-notes/attention-backward-determinism.md).
# Deterministic launches take shared_dq (``default_config``). At D = 64 a step is 128 query rows
# (FA3's tile there): on an H100 at 548605e, x the 64-row step in the same run, +7% free and +3-4%
# deterministic under a full mask, level to +5% causal, ahead or level at every cell (the
# deterministic 128-row step one turn a step, against 64-row steps in turns of two, which had
# measured 0.90x cuDNN full and 0.96-0.97x causal against one block's 0.74x and 0.87-0.88x; `python
# benchmarks/attention_bwd_sm90.py OUT.json --defaults --skip-triton --config free:block_m=128
# --config det:block_m=128,turn_blocks=1 --shape 4,32,32,4096,64 --shape 2,32,8,4096,64`;
# docs/perf-notes/attention-backward-sm90-steps.md). A second run (9b33d42, H100, --rounds 9, x the 64-row
# step round by round): +1-5% full in both modes, +5% GQA causal free, -1-3% at the MHA causal shapes.
# At D = 128 the free mode converts its 16-bit P in pairs too (p_in_pairs, the deterministic mode's):
# on the H200 at c1360a6, x the fp32 P round by round, +7% at (4, 32, 4096, 128) and (8, 16, 1024,
# 128) full, level at (2, 32/8, 4096, 128) full (a noisy 0.99x) and level causal (0.99-1.00x); `python
# benchmarks/attention_bwd_sm90.py OUT.json --full --skip-triton --skip-deterministic --defaults
# --config free:p_in_pairs=True --shape 4,32,32,4096,128 ...`, results/h200/history/
# attention-bwd-free-candidates-c1360a6.json; docs/perf-notes/attention-backward-determinism.md).
CONFIGS = {
    64: Config(num_stages=2, shared_dq=True, block_m=128),
    128: Config(num_stages=2, shared_dq=True, p_in_pairs=True),
}
# D = 256: steps of 32 query rows, one dQ tile a step in two warpgroups' halves; two stages of Q and dO
# (181 KB of shared memory; three, 214 KB, are ``num_stages=3``)
WIDE_CONFIG = Config(num_stages=2, shared_dq=True, block_m=wide.BLOCK_M)
# D = 256 deterministic: a turn of the dQ warp covers two 32-row steps. On an H100 at ed982f2, x cuDNN
# (`python benchmarks/attention_bwd_sm90.py OUT.json --defaults --skip-triton --config
# det:turn_blocks=2 --config det:turn_blocks=4 --shape 2,16,8,4096,256 --shape 8,16,16,1024,256`):
# 0.82-0.90 against one block's 0.73-0.82, both masks; four blocks 0.51-0.66 (a program trails the one
# before it by a whole group, which one staging tile a warpgroup cannot hide)
WIDE_TURN_BLOCKS = 2
# What the benchmark compares (and the tests check): the default first, then each setting of its
# two switches (dP^T beside S^T, one dQ tile a step) at 64-row steps (at D = 64, the 128-row step
# takes only shared_dq: ``check_config``), then at D = 128 the fp32 P converted a value an
# instruction (the free default before c1360a6's run; 52 values on the stack causal against the 16-bit
# P's 13), and the rotated walk of a full mask in the free mode
CANDIDATES = {
    d: list(
        dict.fromkeys(
            [config]
            + [
                config._replace(overlap_sdp=overlap, shared_dq=shared, block_m=BLOCK_M)
                for overlap, shared in itertools.product((False, True), repeat=2)
            ]
        )
    )
    + [config._replace(p_in_pairs=False)] * (d == 128)
    + [config._replace(rotate=True)]
    for d, config in CONFIGS.items()
}


def default_config(
    head_dim: int, deterministic: bool, gqa: bool = False, causal: bool = True, softcap: bool = False
) -> Config:
    """The launch's config where the caller names none: CONFIGS', with shared_dq where the mode is
    deterministic (one ticketed add a step instead of two in turn: at D = 64 on the H200, at
    6ea5362, 0.67-0.77x cuDNN against 0.51-0.58x; `python benchmarks/attention_bwd_sm90.py OUT.json
    --candidates --skip-triton --shape 4,32,32,4096,64`), and per_query_head where it is
    deterministic with GQA and the mask wants it (DETERMINISTIC_GQA_PER_QUERY_HEAD), and
    acquire_first (on an H100: +12-13% at D = 64 under a full mask, +3% causal, level to +5% at
    D = 128; `docs/perf-notes/attention-backward-determinism.md`), and p_in_pairs (its 16-bit P: on
    an H100 at 9b33d42, x the one-value conversion in the same run, +9-14% causal and level to +2%
    full at D = 128; `python benchmarks/attention_bwd_sm90.py OUT.json --defaults --skip-triton
    --config det:p_in_pairs=True --shape 4,32,32,4096,128`;
    docs/perf-notes/attention-backward-sm90-steps.md); a turn of the dQ warp a step (at D = 256 two:
    WIDE_TURN_BLOCKS). With a soft cap at D = 64, 64-row steps (a turn two of them): the 128-row
    step's P (1 - tanh^2) beside P kept 7 values a step on the stack in the bf16 free mode (compiled
    for sm_90; none with 64 rows)."""
    config = WIDE_CONFIG if head_dim == 256 else CONFIGS[head_dim]
    if softcap and head_dim == 64:
        config = config._replace(block_m=BLOCK_M, turn_blocks=2 if deterministic else 1)
    if not deterministic:
        return config
    if head_dim == 256:
        config = config._replace(turn_blocks=WIDE_TURN_BLOCKS)
    return config._replace(
        shared_dq=True,
        per_query_head=gqa and (DETERMINISTIC_GQA_PER_QUERY_HEAD[causal] or head_dim == 256),
        acquire_first=True,
        p_in_pairs=True,
    )


# Whether a deterministic GQA launch takes a program a query head (Config.per_query_head). A
# group's programs walk G query heads each, launched in turn order (shortest walk first): at the
# Llama-3-8B decoder layer's attention (B = 2, GQA 32/8, causal, S = 4096: 512 programs of 4 to
# 128 steps on 132 SMs) the longest start last and run on alone. On the H200 (at af34fdd,
# `python benchmarks/attention_bwd_sm90.py OUT.json --layer --defaults` and `... --defaults --shape
# 2,32,8,8192,128`), x cuDNN, a query head against the group: 0.85 against 0.72 at the layer's,
# 0.94 against 0.84 causal at (2, 32/8, 8192, 128), 0.85 against 0.87 full there. A full mask's
# walks are all as long, so the group's programs end together, and they read K and V once a group:
# at (2, 32/8, 4096, 128) full (`... --defaults --skip-triton --shape 2,32,8,4096,128`), the group
# 479 and 481 TFLOP/s against 463 and 464 a query head in two runs at 10242e8, and 475-495 against
# 454-468 in four runs of two other builds (`history/attention-bwd-sm90-two-dq-warps-10242e8.json`,
# `...-next-ticket-read-10242e8.json`). By mask, causal or not:
DETERMINISTIC_GQA_PER_QUERY_HEAD = {True: True, False: False}
# D = 256 takes a program a query head under either mask: at (2, 16/8, 4096, 256) full on the H200 at
# c1360a6, 337 TFLOP/s against the group's 318, round by round 1.059x, the rounds' range 1.7%
# (results/h200/history/attention-bwd-d256-turns-c1360a6.json; causal, the group 0.906x a query head)


# ---------------------------------------------------------------- launcher


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed | None = None) -> bool:
    """Whether ``attention_bwd_sm90`` takes these inputs: (B, H, S, D) fp16/bf16 tensors of one dtype
    on an sm_90 GPU (with ``packed``, a packed batch's (1, H, T, D) views), D a multiple of 8 up to
    256 (PADDED_HEAD_DIMS; past 128 WIDE_HEAD_DIMS), Hq a multiple of Hkv, within the grid's bounds.
    Strides are free (tensors that TMA cannot read as they are are copied first). Masks, windows and
    the rest are the caller's to check (``bwd.sm90_takes``)."""
    if not sm90_dense_inputs(q, k, v, PADDED_HEAD_DIMS + WIDE_HEAD_DIMS):
        return False
    (batch, heads_q, seq_k) = (*q.shape[:2], k.shape[2])
    if packed is not None:
        batch, seq_k = packed.sequences, packed.max_k
    keys = wide.KEYS.value if q.shape[3] in WIDE_HEAD_DIMS else BLOCK_N  # a program's
    return batch * heads_q * cdiv(seq_k, keys) < MAX_GRID_X  # (per query head: a program a q head)


MAX_GRID_X = 2**31  # programs a launch may have along its x axis (CUDA's limit, and int32 ids)


def attention_bwd_sm90(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    upper_offset: int,
    lower_offset: int | None = None,
    softcap: float = 0.0,
    deterministic: bool = True,
    config: Config | None = None,
    packed: Packed | None = None,
) -> None:
    """Write attention's gradients into ``dq``, ``dk`` and ``dv`` (q's, k's, v's shapes and dtype).

    q and do (B, Hq, Sq, D), k and v (B, Hkv, Sk, D); ``lse`` the forward's fp32 log-sum-exp
    (B, Hq, Sq) with a contiguous last dim (-inf where a row sees no key), ``delta`` (B, Hq, Sq) fp32
    from the delta kernel, likewise. ``causal``: row i sees key j iff j <= i + ``upper_offset``
    (Sk - Sq aligned bottom-right, 0 top-left; a window's right side adds to it). ``lower_offset``: a
    window's left side, row i sees key j only if j >= i + lower_offset (none if None; only with
    ``causal``, the upper bound). ``scale`` > 0 multiplies q . k; ``softcap`` > 0 caps
    the scaled scores to softcap * tanh(s / softcap), as the forward did (0: no cap). ``deterministic``
    orders the additions into dq (the same bits every run). ``packed`` (``common.Packed``): the
    tensors are a packed batch's (1, H, T, D) views and lse and delta (1, H, T), sequence b's rows
    cu_q[b]:cu_q[b + 1] (keys likewise), the offsets then the window's sides alone, to which each
    sequence adds its alignment (Sk - Sq of its own lengths), as the forward's. The caller has
    checked ``supports``; tensors TMA cannot take as they are are copied (gradients written back)."""
    scale, softcap = float(scale), float(softcap)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0: no cap), got {softcap}")
    if config is not None:
        check_config(config, q.shape[-1])
    if not supports(q, k, v, packed):
        raise ValueError("attention_bwd_sm90 does not take these inputs (see supports)")
    if packed is not None:
        check_packed_views(q, k, packed)
    if lower_offset is not None and not causal:
        raise ValueError(
            "attention_bwd_sm90 takes a window's left side (lower_offset) only with an upper bound"
        )
    for name, t in (("lse", lse), ("delta", delta)):
        if t.shape != q.shape[:3] or t.dtype != torch.float32 or (q.shape[2] > 1 and t.stride(2) != 1):
            raise ValueError(f"{name} must be float32 {tuple(q.shape[:3])} with a contiguous last dim")
    if q.numel() == 0 or k.numel() == 0:
        for grad in (dq, dk, dv):
            grad.zero_()
        return
    kernel_dim = kernel_head_dim(q.shape[3])
    do, q, k, v = (t if tma_ready(t) else t.contiguous() for t in (do, q, k, v))
    # a window's walks are all about as long, as a full mask's: its GQA programs take the group (on
    # an H100, 1.78 against 2.03 ms deterministic at (2, 32/8, 8192, 128) with a 1024-key window;
    # results/h100/history/attention-bwd-sm90-window-1023-6343cea.json)
    even_walks = not causal or lower_offset is not None
    config = config or default_config(
        kernel_dim, deterministic, q.shape[1] != k.shape[1], not even_walks, bool(softcap)
    )
    shares = config.per_query_head and q.shape[1] != k.shape[1]
    if shares:  # each query head's share of dK and dV, (B, Hq, Sk, D), summed below
        outputs = [scratch((*q.shape[:2], *k.shape[2:]), k.dtype, k.device) for _ in "kv"]
    else:
        outputs = [
            g if tma_ready(g) else torch.empty_like(g, memory_format=torch.contiguous_format)
            for g in (dk, dv)
        ]
    dq_acc = scratch(q.shape, torch.float32, q.device, zeroed=True)
    # a ticket counter a turn's group of query blocks (of a batch's, or a packed sequence's, head): the
    # key blocks' turns to add into it
    batch, seq_q = (q.shape[0], q.shape[2]) if packed is None else (packed.sequences, packed.max_q)
    blocks_q = cdiv(seq_q, config.block_m * config.turn_blocks)
    tickets = dq_acc  # (unused but deterministic)
    if deterministic:
        tickets = scratch((batch, q.shape[1], blocks_q), torch.int32, q.device, zeroed=True)
    for launch in launches(
        do, q, k, v, lse, delta, dq_acc, tickets, *outputs, scale=scale, causal=causal,
        upper_offset=upper_offset, lower_offset=lower_offset, softcap=softcap, deterministic=deterministic,
        config=config, packed=packed,
    ):  # fmt: skip
        launch.run()
    if not shares:
        for grad, out in zip((dk, dv), outputs, strict=True):
            if out is not grad:
                grad.copy_(out)
    for launch in finish_launches(dq_acc, dq, scale, (dk, dv) if shares else (), outputs if shares else ()):
        launch.run()


def check_config(config: Config, head_dim: int) -> None:
    """Raise ValueError unless ``config`` is one the kernel runs at ``head_dim``: turn_blocks an int
    >= 1; block_m BLOCK_M, or 128 on the D = 64 kernel (D <= 64) with shared_dq and without
    overlap_sdp (anything else needs more than a program's 227 KB of shared memory or 240 registers
    a thread)."""
    if not (isinstance(config.turn_blocks, int) and config.turn_blocks >= 1):
        raise ValueError(f"Config.turn_blocks must be an int >= 1, got {config.turn_blocks!r}")
    if head_dim > BACKWARD_HEAD_DIMS[-1]:  # the wide kernel's: its step, one dQ tile, 2 or 3 stages
        # (two stages with two dQ staging tiles a warpgroup: three would need 246 KB)
        shape = (config.block_m, config.shared_dq, config.overlap_sdp)
        stages = (2, 3) if config.dq_buffers == 1 else (2,) if config.dq_buffers == 2 else ()
        if shape != (wide.BLOCK_M, True, False) or config.num_stages not in stages or config.rotate:
            raise ValueError(
                f"at D = 256 Config takes block_m {wide.BLOCK_M}, shared_dq, 2-3 stages (2 with two dQ "
                f"buffers), no rotate; got {config}"
            )
        return
    if config.dq_buffers != 1:
        raise ValueError(f"Config.dq_buffers is D = 256's alone (1 below it); got {config}")
    if config.block_m != BLOCK_M and (
        config.block_m != 128 or head_dim > 64 or not config.shared_dq or config.overlap_sdp
    ):
        raise ValueError(f"Config.block_m is {BLOCK_M}, or 128 at D = 64 with shared_dq alone; got {config}")


# The deterministic mode's order of programs. Programs launch in turn order within each pair (a
# program waits only on programs already running or done); pairs go in groups of
# DETERMINISTIC_PAIRS_PER_GROUP, or all together where None (turns on the slow axis). All together
# spreads the running programs over 132 heads, whose dq accumulators do not fit in L2: on the H200
# (at 11871ed, six causal shapes) 0.37-0.50x cuDNN against 0.39-0.56x with a head's key blocks
# together (groups of 1) and 0.38-0.56x in groups of 4. Every order gave the same bits run to run.
DETERMINISTIC_PAIRS_PER_GROUP: int | None = 1
# The free order of a causal mask. Key block n walks the query blocks from n's diagonal on: the
# first block of a head all of them, the last one or two. A head's blocks together (first to last)
# leave long programs to the last heads, which run on alone at the end: simulated as a greedy
# schedule on 132 SMs (benchmarks/program_order.py), 668 steps of a program's walk against 532
# with every pair's block n before any pair's n + 1 (524 if the work were spread evenly) at the
# layer's (2, 32/8, 4096, 128); 2277 against 2048 at (2, 32/8, 8192, 128), 3% at (4, 32, 4096,
# 128). Groups of a few pairs keep that balance (524 in groups of 4 at the layer's shape) with
# fewer heads' Q, dO and dq in L2 at once. Measured on the H200 (at 11871ed): groups of 4
# 0.87-0.89x cuDNN at the layer's attention against 0.76-0.79x, +3-5% at (2, 32/8, 8192, 128),
# level elsewhere; all pairs at once 24-32% slower without GQA (the L2).
FREE_CAUSAL_PAIRS_PER_GROUP = 4


def order(
    deterministic: bool, causal: bool, pairs: int, blocks: int, resident: int, rotate_free: bool = False
) -> tuple[int, bool]:
    """(PAIRS_PER_GROUP, ROTATE) for a launch of ``pairs`` (batch, head) pairs of ``blocks`` key
    blocks each, ``resident`` programs running at once: the free order a head's key blocks
    together for a full mask (their walks are all as long) and groups of
    FREE_CAUSAL_PAIRS_PER_GROUP for a causal one; the deterministic one in groups of
    DETERMINISTIC_PAIRS_PER_GROUP (None: every pair's key block before the next).

    ROTATE, the deterministic full mask's walk: key block n starts at query block n * Mb / Nb and
    the turns at a query block go in the order of arrival, so that no two key blocks of a head
    reach one query block at one step. Without it every key block starts at block 0 and key block
    n's adds wait for n - 1's: block n starts n adds' latency late, idle meanwhile. The order of
    arrival is cyclic (key block n waits on n + 1, n + 2, ..., launched after it, and past its
    walk's wrap on 0, 1, ...), so a head's key blocks must all run at once: rotated only where a
    group's programs (launched together, key blocks on the slow axis) fit in ``resident``. The free
    mode's full mask rotates where ``rotate_free`` asks (Config.rotate): it waits on no one."""
    group = FREE_CAUSAL_PAIRS_PER_GROUP if causal else 1
    if deterministic:
        group = DETERMINISTIC_PAIRS_PER_GROUP or pairs
    group = min(group, pairs)
    if not deterministic:
        return group, rotate_free and not causal
    return group, not causal and group * blocks <= resident


def launches(
    do,
    q,
    k,
    v,
    lse,
    delta,
    dq_acc,
    tickets,
    dk,
    dv,
    *,
    scale,
    causal,
    upper_offset,
    deterministic,
    config,
    softcap=0.0,
    lower_offset=None,
    packed=None,
) -> list[Launch]:
    """The kernel's launch for checked, TMA-ready arguments (``attention_bwd_sm90``'s): one program
    per BLOCK_N keys of a (batch, key/value head), a one-dimensional grid in ``order``'s order (a
    packed batch's: its sequences' over the longest one's key blocks)."""
    (batch, heads_q, seq_q, head_dim), (_, heads_kv, seq_k, _) = q.shape, k.shape
    head_dim = kernel_head_dim(head_dim)  # the boxes' columns (PADDED_HEAD_DIMS)
    if head_dim == 256:  # (bwd_sm90_wide)
        tensors = (do, q, k, v, lse, delta, dq_acc, tickets, dk, dv)
        mask = {"causal": causal, "upper_offset": upper_offset, "lower_offset": lower_offset}
        scores = {"scale": scale, "softcap": softcap}
        return [
            _wide_launch(
                *tensors, **mask, **scores, deterministic=deterministic, config=config, packed=packed
            )
        ]
    if packed is not None:  # the grid of the sequences and their longest lengths
        batch, seq_q, seq_k = packed.sequences, packed.max_q, packed.max_k
    kv_share, heads_kv, blocks, pairs, pairs_per_group, rotate = _grid(
        q, k, dk, batch, seq_k, BLOCK_N, deterministic, causal, config.rotate
    )
    walk = (heads_kv, pairs, pairs_per_group, heads_q // heads_kv, kv_share, seq_q, seq_k)
    # shared_dq: each warpgroup adds D / 2 columns of a dq tile; at D = 64 K (and dK, which leaves
    # through K's buffer) takes a 64-byte swizzle, so that 32 columns of its tile slice
    k_swizzle = 64 if config.shared_dq and head_dim == 64 else None
    args = (
        descriptor(q, config.block_m, head_dim),
        descriptor(k, SPLIT_N, head_dim, swizzle=k_swizzle),
        descriptor(v, SPLIT_N, head_dim),
        descriptor(do, config.block_m, head_dim),
        descriptor(dk, SPLIT_N, head_dim, swizzle=k_swizzle),
        descriptor(dv, SPLIT_N, head_dim),
        descriptor(dq_acc, config.block_m, head_dim // 2 if config.shared_dq else head_dim),
        *_after_boxes(lse, delta, tickets, dk, dv, packed, walk, upper_offset, lower_offset, scale, softcap),
    )
    meta = kernel_meta(
        config, causal, deterministic, rotate, bool(softcap), lower_offset is not None,
        packed is not None, q.shape[3] if packed is not None else 0,
    )  # fmt: skip
    grid = (blocks * pairs,)
    return [Launch("bwd sm90", _attn_bwd_sm90_kernel, args, meta, config._asdict(), grid)]


def _after_boxes(
    lse, delta, tickets, dk, dv, packed, walk: tuple, upper_offset, lower_offset, scale, softcap
) -> tuple:
    """Both kernels' runtime arguments after their TMA descriptors, in their order: the row statistics
    and tickets, dk and dv and the cu_seqlens (a packed batch's; else unused), their strides, the
    walk's sizes (``walk``: heads, pairs, pairs a group, query heads a key/value head, the share,
    Sq, Sk), the bounds' offsets, and the exponent's factors: q . k * scale * log2(e), or capped
    cap_log2 * tanh(q . k * scale / cap)."""
    return (
        lse,
        delta,
        tickets,
        dk,  # (packed: stored row by row, masked)
        dv,
        lse if packed is None else packed.cu_q,  # (unused but packed)
        lse if packed is None else packed.cu_k,
        lse.stride(0),
        lse.stride(1),
        delta.stride(0),
        delta.stride(1),
        tickets.stride(0),
        tickets.stride(1),
        dk.stride(1),
        dk.stride(2),
        dv.stride(1),
        dv.stride(2),
        *walk,
        int(upper_offset),
        0 if lower_offset is None else int(lower_offset),
        scale / softcap if softcap else scale * LOG2E.value,
        softcap * LOG2E.value if softcap else 1.0,
        scale,
    )


def _grid(
    q, k, dk, batch: int, seq_k: int, keys: int, deterministic: bool, causal: bool, rotate: bool = False
) -> tuple:
    """(kv_share, heads_kv, blocks, pairs, pairs_per_group, rotate) of a launch of programs of ``keys``
    keys: per query head (dk and dv the shares, (B, Hq, Sk, D)) the programs' heads are q's, each
    reading k's and v's head of its group (kv_share of them); a program an SM (its shared memory
    leaves room for no second), in ``order``'s order."""
    heads_q, heads_kv = q.shape[1], k.shape[1]
    kv_share = heads_q // heads_kv if dk.shape[1] != heads_kv else 1
    heads_kv = heads_kv * kv_share
    blocks, pairs = cdiv(seq_k, keys), batch * heads_kv
    pairs_per_group, rotate = order(deterministic, causal, pairs, blocks, sm_count(q.device), rotate)
    return kv_share, heads_kv, blocks, pairs, pairs_per_group, rotate


def _wide_launch(
    do, q, k, v, lse, delta, dq_acc, tickets, dk, dv, *, scale, softcap, causal, upper_offset, lower_offset,
    deterministic, config, packed=None,
) -> Launch:  # fmt: skip
    """The D = 256 kernel's launch (``bwd_sm90_wide``): one program per 64 keys of a (batch, key/value
    head), in ``order``'s order, 32 query rows a step (a packed batch's: its sequences' over the
    longest one's key blocks, dK and dV stored row by row)."""
    (batch, heads_q, seq_q, _), seq_k = q.shape, k.shape[2]
    if packed is not None:  # the grid of the sequences and their longest lengths
        batch, seq_q, seq_k = packed.sequences, packed.max_q, packed.max_k
    keys, rows = wide.KEYS.value, wide.BLOCK_M
    kv_share, heads_kv, blocks, pairs, pairs_per_group, rotate = _grid(
        q, k, dk, batch, seq_k, keys, deterministic, causal
    )
    walk = (heads_kv, pairs, pairs_per_group, heads_q // heads_kv, kv_share, seq_q, seq_k)
    args = (
        descriptor(q, rows, 256),
        descriptor(k, keys, 256),
        descriptor(v, keys, 256),
        descriptor(do, rows, 256),
        descriptor(dk, keys, 256),
        descriptor(dv, keys, 256),
        descriptor(dq_acc, rows, wide.DQ_COLS.value),
        *_after_boxes(lse, delta, tickets, dk, dv, packed, walk, upper_offset, lower_offset, scale, softcap),
    )
    meta = {
        "IS_CAUSAL": bool(causal),
        "DETERMINISTIC": bool(deterministic),
        "NUM_STAGES": config.num_stages,
        "ROTATE": rotate,
        "ACQUIRE_FIRST": config.acquire_first and deterministic,
        "TURN_BLOCKS": config.turn_blocks if deterministic else 1,
        "HAS_LOWER": lower_offset is not None,
        "SOFTCAP": bool(softcap),
        "DQ_BUFFERS": config.dq_buffers,
        "VARLEN": packed is not None,
        "TENSOR_D": q.shape[3] if packed is not None else 0,
        "num_warps": CONSUMER_WARPS.value,
    }
    grid = (blocks * pairs,)
    return Launch("bwd sm90 wide", wide._attn_bwd_sm90_wide_kernel, args, meta, config._asdict(), grid)


def kernel_meta(
    config: Config,
    causal: bool,
    deterministic: bool,
    rotate: bool,
    softcap: bool = False,
    lower: bool = False,
    varlen: bool = False,
    tensor_d: int = 0,
) -> dict:
    """The kernel's constexpr arguments, in its order (the launcher takes them as its trailing
    parameters), and its warps. ``tensor_d``: a packed batch's D, to which dK's and dV's masked row
    stores keep (a padded head dim's is under the kernel's); 0 for a dense batch (unused), so that
    a padded head dim's launch is the next one's up, compiled once."""
    return {
        "IS_CAUSAL": bool(causal),
        "DETERMINISTIC": bool(deterministic),
        "NUM_STAGES": config.num_stages,
        "ROTATE": rotate,
        "OVERLAP_SDP": config.overlap_sdp,
        "SHARED_DQ": config.shared_dq,
        "P_PAIRS": config.p_in_pairs,
        "ACQUIRE_FIRST": config.acquire_first and deterministic,
        "TURN_BLOCKS": config.turn_blocks if deterministic else 1,
        "SOFTCAP": softcap,
        "HAS_LOWER": lower,
        "VARLEN": varlen,
        "TENSOR_D": tensor_d,
        "num_warps": CONSUMER_WARPS.value,
    }


# ---------------------------------------------------------------- the passes after the kernel

FINISH_ROWS = 64  # (S rows of D) a program of the passes below: 16-32 KB in, 8-16 KB out


@triton.jit
def _group_sum_kernel(
    src_ptr, out_ptr, scale, stride_ob, stride_oh, stride_os, heads, seq,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """out[b, h] = scale * the sum of src[b, h G + g] over g = 0 .. G - 1, in fp32 in that order,
    rounded once to out's dtype: src (B, H G, S, D) contiguous, out (B, H, S, D) any strides with a
    unit last one. A program ROWS rows of one (batch, head), a (batch, head)'s programs neighbours,
    BLOCK_D (D's power of two) columns, those past D masked. dq's conversion is G = 1 (its fp32
    accumulator times the softmax scale); the GQA shares' sums are scale 1 (exact)."""
    blocks = tl.cdiv(seq, ROWS)
    pair = tl.program_id(0) // blocks
    rows = (tl.program_id(0) % blocks) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    inside = rows < seq
    if BLOCK_D != HEAD_DIM:  # a padded head dim (PADDED_HEAD_DIMS)
        inside = inside & (cols < HEAD_DIM)
    first = src_ptr + pair.to(tl.int64) * GROUP * seq * HEAD_DIM + rows * HEAD_DIM + cols
    total = tl.zeros((ROWS, BLOCK_D), tl.float32)
    for member in tl.static_range(GROUP):
        total += tl.load(first + member * seq * HEAD_DIM, mask=inside).to(tl.float32)
    batch, head = pair // heads, pair % heads
    out = out_ptr + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh + rows * stride_os + cols
    tl.store(out, (total * scale).to(out_ptr.dtype.element_ty), mask=inside)


def finish_launches(dq_acc, dq, scale: float, grads=(), shares=()) -> list[Launch]:
    """The passes after the kernel: dq = scale * dq_acc (the conversion from the fp32 accumulator,
    (B, Hq, Sq, D) contiguous, into dq's dtype and strides), then, per query head, each of ``grads``
    (dk, dv: (B, Hkv, Sk, D), any strides) the sum of its ``shares`` ((B, Hq, Sk, D) contiguous)
    over each group of query heads, in a fixed order. Memory-bound: 6 bytes an element of dq, and
    2 (G + 1) of dk's and dv's at 16 bits, a pass each over HBM."""
    heads_q = dq.shape[1]
    passes = [
        (dq_acc, dq, float(scale)),
        *((share, grad, 1.0) for grad, share in zip(grads, shares, strict=True)),
    ]
    launches = []
    for src, out, factor in passes:
        (batch, heads, seq, head_dim) = out.shape
        args = (src, out, factor, *out.stride()[:3], heads, seq)
        meta = {"GROUP": heads_q // heads, "HEAD_DIM": head_dim, "BLOCK_D": next_power_of_2(head_dim)}
        meta |= {"ROWS": FINISH_ROWS, "num_warps": 4}
        grid = (cdiv(seq, FINISH_ROWS) * batch * heads,)
        launches.append(Launch("bwd sm90 finish", _group_sum_kernel, args, meta, {}, grid))
    return launches
