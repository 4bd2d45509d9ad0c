"""Attention backward for Hopper (sm_90) in Gluon, with FlashAttention-3's dataflow: dK, dV and the
dQ partials of a key block in one program, five matmuls a step, dQ summed in fp32 by TMA reduce-add.

Maths. With the scores s = scale * q . k (masked), P = exp(s - lse) row by row, and dO the upstream
gradient of the output:
    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   delta_i = sum_d dO_id O_id - dlse_i,
    dQ = scale * dS K,   dK = scale * dS^T Q.
The probabilities are recomputed from the forward's lse, with exp2 and scale * log2(e) folded in:
P = exp2(q . k * qk_scale - lse * log2(e)), one FFMA and one exponential a score. delta comes from
``bwd``'s delta kernel (shared with the Triton backward).

Structure (one program = BLOCK_N = 128 keys of one (batch, key/value head); it walks every query
block of every query head of the head's group, so that dK and dV sum over a GQA group without
atomics):
- a producer warp (24 registers) loads the key block's K and V once (a 64-row tile per consumer),
  then streams Q and dO block by block (BLOCK_M = 64 rows) into a NUM_STAGES-deep ring, each stage
  guarded by a ready and an empty mbarrier (the empty one counts both consumers);
- two consumer warpgroups (240 registers each) of SPLIT_N = 64 keys each. A step's products are
  computed transposed (FA3's swapAB), keys by queries, so that P^T and dS^T leave the first two
  products in registers ready to be the A operand of the next two: S^T = K Q^T, exponentiate;
  issue dP^T = V dO^T and dV += P^T dO, wait for dP^T (dV runs on) and form dS^T (from P^T in the
  input dtype); issue dK += dS^T Q, store dS^T in shared memory and issue the partial dQ = dS K of
  this warpgroup's 64 keys (at D = 128 in two 64-column halves: a whole 64 x 128 fp32 partial
  beside dK and dV does not fit in 240 registers); the partial goes to shared memory and a TMA
  reduce-add (``cp.reduce.async.bulk.tensor ... add``) adds it to an fp32 accumulator in global
  memory under the next step's products. (``Config.overlap_sdp`` issues dP^T beside S^T instead.)
- the epilogue scales dK, writes dK and dV through the K and V buffers with TMA stores, which clip
  the rows past Sk; a conversion afterwards writes dq = scale * accumulator in q's dtype.
Masks only where a bound cuts a step: the causal diagonal (the first query blocks a key block sees)
and the ragged end of the keys (every step of the last key block: a key past Sk loads as zero and
would otherwise get exp2(-lse)). Rows past Sq need none: their lse reads as +inf, so P = 0.

Determinism. Without it (``deterministic=False``) the key blocks of a head add their partials in
whatever order they finish, so dq's last bits vary. With it, every (batch, query head, query block)
has a ticket counter in global memory, and a warpgroup adds its partial only when the counter
equals its turn; it increments it once its reduce has completed (one step later, under the next
step's products). Turns: key blocks ascending (warpgroup 0 before 1) for a full mask; for a causal
one, descending from the last key block that the query block sees (FA3's shortest-first order),
which is the order in which a lockstep walk of ascending query blocks reaches it. By default the
programs launch in turn order (key blocks the slowest grid axis), so one that waits only waits on
programs already running or done; ``KEY_MAJOR_DETERMINISTIC`` (off, not yet run on the H200) keeps
a head's key blocks together instead (see there).

Measured on the H200 (bf16, at fa3667b; ``benchmarks/results/h200/history/``): 0.77-0.93x cuDNN
free, 0.39-0.51x deterministic (the running programs' dq accumulators spread over 132 heads, past
the L2). Short of FA3's design still: the two warpgroups add separate dQ partials (twice the reduce
traffic of one shared 64 x D tile), the products of a step wait on each other more than FA3's, and
at D = 128 ptxas keeps a few values (deterministic: many) on the stack.

Work. 2.5 x 4 * B * Hq * Sq * Sk * D FLOPs (five matmuls; about half when causal with Sq = Sk);
bytes: q, k, v, dO, o once (o by the delta kernel), each key block re-reading its head's Q and dO
(from L2 when the blocks of a head run together), and the dQ accumulator's reduce-adds, 2 x 4 x
Sk / 64 x |q| bytes of L2 traffic (each warpgroup adds its own partial).

References: Shah et al., "FlashAttention-3" (arXiv 2407.08608), section 3 and the backward in
Dao-AILab/flash-attention ``hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp``; Triton's Gluon tutorials.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tritonkit._launch import Launch, cdiv, tma_ready
from tritonkit._runtime import sm_count
from tritonkit.dtypes import HALVES
from tritonkit.jit import LOG2E
from tritonkit.ops.attention.fwd_sm90 import _capability

DTYPES = HALVES
HEAD_DIMS = (64, 128)
SM90 = (9, 0)  # wgmma, setmaxnreg and the TMA engine: Hopper only (sm_90a)

SPLIT_N = 64  # keys a consumer warpgroup holds: a wgmma's M per warpgroup
NUM_CONSUMERS = gl.constexpr(2)  # FA3's 2 x 64 = 128 keys a program
BLOCK_N = NUM_CONSUMERS.value * SPLIT_N
BLOCK_M = 64  # query rows a step (FA3's at D = 128 causal): S^T is 64 x 64 fp32, 32 registers a thread
CONSUMER_WARPS = gl.constexpr(4)  # a consumer is a warpgroup; the first is the default partition
PRODUCER_WARPS = gl.constexpr(1)  # one warp issues every TMA load
# setmaxnreg budgets (FA3's): 2 x 128 threads x 240 + 128 x 24 <= 65,536. A consumer's live set at
# D = 128: dK and dV (2 x 64 fp32), the dQ partial (64), S^T or dP^T and P^T (32 + 32 + 16).
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)


class Config(NamedTuple):
    """A launch's shape: NUM_STAGES Q/dO tiles in flight; overlap_sdp issues dP^T beside S^T (both
    64 x 64 fp32 accumulators live at the exponentials, 32 registers more a thread) instead of
    after P^T, beside dV."""

    num_stages: int
    overlap_sdp: bool = False


# Shared memory a program at D = 128, 16-bit elements: K and V 2 x 32 KB, the Q/dO ring NUM_STAGES x
# 32 KB, dS^T 2 x 8 KB, the fp32 dQ staging 2 x 32 KB: 208 KB with two stages (of 227 KB). At D =
# 64 everything halves but dS^T: 112 KB with two stages, 144 KB with three.
CONFIGS = {64: Config(num_stages=2), 128: Config(num_stages=2)}
# What the benchmark compares (and the tests check) beside the default: dP^T issued beside S^T
CANDIDATES = {
    d: [config, config._replace(overlap_sdp=not config.overlap_sdp)] for d, config in CONFIGS.items()
}


# ---------------------------------------------------------------- kernels


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add the shared-memory tile ``src`` into the global tensor of ``tensor_desc`` at ``coord``
    with one bulk TMA reduction (``cp.reduce.async.bulk.tensor ... .add``); like
    ``tma.async_copy_shared_to_global`` it clips at the tensor's bounds and ``tma.store_wait``
    waits for it. Gluon 3.6 has the op in its builder but no wrapper."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
    )


@gluon.jit
def _bulk_wait_all(token):
    """Wait until this thread's bulk async groups (its TMA reduces) have completed, not merely read
    their shared memory (``tma.store_wait`` waits for that), and order their writes before what
    follows in the generic proxy. ``token``: any int32 tensor (inline assembly needs an operand)."""
    return gl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0; fence.proxy.async.global; fence.acq_rel.gpu; mov.b32 $0, $1;",
        "=r,r",
        [token],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _load_partition(
    q_desc,
    k_desc,
    v_desc,
    do_desc,  # TMA descriptors of q and dO (B, Hq, Sq, D), k and v (B, Hkv, Sk, D); boxes of 64 rows
    q_smem,
    do_smem,  # (NUM_STAGES, BLOCK_M, D): the Q and dO ring
    k_smem,
    v_smem,  # (NUM_CONSUMERS, SPLIT_N, D): each consumer's keys and values
    kv_ready,  # (NUM_CONSUMERS,) mbarriers: a consumer's K and V landed
    qd_ready,
    qd_empty,  # (NUM_STAGES,) mbarriers: a ring stage landed / was released by both consumers
    batch,
    kv_head,
    start_n,  # this program's batch, key/value head and first key
    GROUP,  # query heads of the group
    m_start,
    m_end,  # the query blocks it walks in each head: [m_start, m_end)
    rot,  # ... starting at m_start + rot, round to m_start + rot - 1 (ROTATE's order; 0 otherwise)
    lse_ptr,
    delta_ptr,  # the rows' lse and delta (the kernel's), copied into lse_smem and delta_smem
    lse_smem,
    delta_smem,  # (NUM_STAGES, BLOCK_M) fp32: beside the ring's Q and dO tiles
    SEQ_Q,
    stride_lb,
    stride_lh,
    stride_db,
    stride_dh,
):
    row_layout: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
    CONSUMERS: gl.constexpr = k_smem.type.shape[0]
    ROWS: gl.constexpr = k_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[2]
    NUM_STAGES: gl.constexpr = q_smem.type.shape[0]
    BLOCK: gl.constexpr = q_smem.type.shape[1]
    n_tiles = m_end - m_start
    if n_tiles > 0:  # a key block that no row sees loads nothing (its consumers write zeros)
        for c in gl.static_range(CONSUMERS):
            mbarrier.expect(kv_ready.index(c), 2 * k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                k_desc,
                [batch, kv_head, start_n + c * ROWS, 0],
                kv_ready.index(c),
                k_smem.index(c).reshape([1, 1, ROWS, HEAD_DIM]),
            )
            tma.async_copy_global_to_shared(
                v_desc,
                [batch, kv_head, start_n + c * ROWS, 0],
                kv_ready.index(c),
                v_smem.index(c).reshape([1, 1, ROWS, HEAD_DIM]),
            )
        for step in range(GROUP * n_tiles):
            head = kv_head * GROUP + step // n_tiles
            start_m = (m_start + (step % n_tiles + rot) % n_tiles) * BLOCK
            stage = step % NUM_STAGES
            # the rows' statistics: the lse in log2 units, +inf past Sq and where a row sees no key
            # (so that P = 0 there), and delta
            rows = start_m + gl.arange(0, BLOCK, layout=row_layout)
            in_rows = rows < SEQ_Q
            lse = gl.load(
                lse_ptr + (batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh) + rows,
                mask=in_rows,
                other=-float("inf"),
            )
            lse = gl.where(lse == -float("inf"), float("inf"), lse * LOG2E)
            delta = gl.load(
                delta_ptr + (batch.to(gl.int64) * stride_db + head.to(gl.int64) * stride_dh) + rows,
                mask=in_rows,
                other=0.0,
            )
            # the first pass over the ring waits on the phase before init, which counts as complete
            mbarrier.wait(qd_empty.index(stage), ((step // NUM_STAGES) & 1) ^ 1)
            lse_smem.index(stage).store(lse)
            delta_smem.index(stage).store(delta)
            gl.thread_barrier()  # every lane's stores before the arrive that publishes them
            mbarrier.expect(qd_ready.index(stage), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                q_desc,
                [batch, head, start_m, 0],
                qd_ready.index(stage),
                q_smem.index(stage).reshape([1, 1, BLOCK, HEAD_DIM]),
            )
            tma.async_copy_global_to_shared(
                do_desc,
                [batch, head, start_m, 0],
                qd_ready.index(stage),
                do_smem.index(stage).reshape([1, 1, BLOCK, HEAD_DIM]),
            )


@gluon.jit
def _release(pending, token, sem_ptr):
    """Deterministic mode: once this warpgroup's last reduce has completed, advance the ticket
    counter at ``sem_ptr + pending`` (none when ``pending`` < 0)."""
    if pending >= 0:
        _bulk_wait_all(token)
        gl.atomic_add(sem_ptr + pending, 1, sem="release", scope="gpu")


@gluon.jit
def _starts_up_to(x, blocks, m_count):
    """How many of ``blocks`` key blocks start their walk (ROTATE) at a query block <= x (>= -1):
    block n starts at n * m_count // blocks."""
    return gl.minimum(blocks, gl.cdiv((x + 1) * blocks, m_count))


@gluon.jit
def _grad_steps(
    dk,
    dv,
    pending,
    k,
    v,
    q_smem,
    do_smem,
    ds_smem,
    dq_smem,
    qd_ready,
    qd_empty,
    dq_desc,
    lse_smem,
    delta_smem,
    sem_ptr,
    batch,
    head,
    key_start,
    first,
    last,
    step0,
    n_last,
    rot,
    m_count,
    SEQ_K,
    UPPER_OFFSET,
    stride_sb,
    stride_sh,
    qk_scale,
    MASKED: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    DETERMINISTIC: gl.constexpr,
    ROTATE: gl.constexpr,
    OVERLAP_SDP: gl.constexpr,
):
    """Query blocks [first, last) of query head ``head`` against this warpgroup's keys (from
    ``key_start``): step step0 + (m - first) of the ring for block m (with ROTATE, block
    (m + rot) % m_count: a full mask's walk starting at block ``rot``). Returns (dk, dv, pending);
    ``pending`` is the ticket offset of the last reduce whose completion is not yet published
    (DETERMINISTIC; -1 if none). MASKED steps hide keys past SEQ_K and, causal, those past each
    row's diagonal (key j <= row i + UPPER_OFFSET)."""
    NUM_STAGES: gl.constexpr = q_smem.type.shape[0]
    BLOCK: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    ROWS: gl.constexpr = k.type.shape[0]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)  # along the query rows (S^T's columns)
    zero_s = gl.zeros([ROWS, BLOCK], gl.float32, s_layout)
    DQ_COLS: gl.constexpr = 64 if HEAD_DIM > 64 else HEAD_DIM
    DQ_SPLIT: gl.constexpr = HEAD_DIM // DQ_COLS
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_COLS, 16]
    )
    zero_dq = gl.zeros([BLOCK, DQ_COLS], gl.float32, dq_layout)
    keys = key_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    token = gl.full([1], 0, gl.int32, gl.BlockedLayout([1], [32], [4], [0]))
    for i in range(first, last):
        step = step0 + i - first
        m = i
        if ROTATE:
            m = (i + rot) % m_count
        stage = step % NUM_STAGES
        q = q_smem.index(stage)
        do = do_smem.index(stage)
        mbarrier.wait(qd_ready.index(stage), (step // NUM_STAGES) & 1)
        s = warpgroup_mma(k, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        if OVERLAP_SDP:
            dp = warpgroup_mma(v, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        else:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        lse = lse_smem.index(stage).load(col_s)
        if MASKED:
            rows = m * BLOCK + gl.arange(0, BLOCK, layout=col_s)
            visible = keys[:, None] < SEQ_K
            if IS_CAUSAL:
                visible = visible & (keys[:, None] <= rows[None, :] + UPPER_OFFSET)
            p = gl.exp2(gl.where(visible, s * qk_scale - lse[None, :], -float("inf")))
        else:
            p = gl.exp2(s * qk_scale - lse[None, :])
        # P^T in the input dtype only: the A operand of dV (the same registers as the accumulator's
        # layout for 16-bit types) and dS's factor, which keeps 32 fp32 registers free at D = 128
        p = p.to(dtype)
        p_a = gl.convert_layout(p, a_layout)
        if not OVERLAP_SDP:  # dP^T now, under P's conversion and dV
            dp = warpgroup_mma(v, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dv = warpgroup_mma(p_a, do, dv, is_async=True)
        dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp,))
        ds = (p.to(gl.float32) * (dp - delta_smem.index(stage).load(col_s)[None, :])).to(dtype)
        ds_a = gl.convert_layout(ds, a_layout)
        dk = warpgroup_mma(ds_a, q, dk, is_async=True)
        ds_smem.store(ds)
        fence_async_shared()  # the generic-proxy store before the wgmma reads it
        # dQ = dS K in DQ_SPLIT column slices of DQ_COLS (at D = 128 a whole 64 x 128 fp32 partial
        # beside dK and dV does not fit in 240 registers)
        dv, dk, p_a = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dk, p_a))
        tma.store_wait(pendings=0)  # the previous reduce has read the staging buffer
        for half in gl.static_range(DQ_SPLIT):
            dq = warpgroup_mma(
                ds_smem.permute((1, 0)),
                k.slice(half * DQ_COLS, DQ_COLS, dim=1),
                zero_dq,
                use_acc=False,
                is_async=True,
            )
            dq, dk, ds_a = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dk, ds_a))
            dq_smem.slice(half * DQ_COLS, DQ_COLS, dim=1).store(dq)
        mbarrier.arrive(qd_empty.index(stage), count=1)
        fence_async_shared()
        if DETERMINISTIC:
            # the previous step's reduce has completed under this step's products: publish it
            _release(pending, token, sem_ptr)
            # this warpgroup's turn at the block: key blocks ascending, or causal descending from
            # the last one the block sees (n_last for the block, by the same rule as the launcher's)
            key_block = key_start // (2 * ROWS)
            part = (key_start // ROWS) % 2
            if ROTATE:
                # key block n starts its walk at block rot = n * m_count // (n_last + 1), so it
                # reaches block m at step t = (m - rot) mod m_count; turns in the order of
                # arrival, ties (equal starts) by key block: the turn's rank counts the key
                # blocks that start in the t blocks up to m, and those of equal start before n
                blocks = n_last + 1
                t = (m - rot + m_count) % m_count
                low = m - t + 1
                before = _starts_up_to(m, blocks, m_count)
                if low >= 0:
                    before -= _starts_up_to(low - 1, blocks, m_count)
                else:
                    before += blocks - _starts_up_to(m_count + low - 1, blocks, m_count)
                rank = before + key_block - _starts_up_to(rot - 1, blocks, m_count)
                turn = 2 * rank + part
            elif IS_CAUSAL:
                # (the block's last row counted as m * BLOCK + BLOCK - 1 even past Sq: the
                # launcher's m_start counts it so)
                top = gl.minimum((m * BLOCK + BLOCK - 1 + UPPER_OFFSET) // (2 * ROWS), n_last)
                turn = 2 * (top - key_block) + part
            else:
                turn = 2 * key_block + part
            ticket = batch.to(gl.int64) * stride_sb + head.to(gl.int64) * stride_sh + m
            while gl.atomic_add(sem_ptr + ticket, 0, sem="acquire", scope="gpu") != turn:
                pass
            pending = ticket
        _tma_reduce_add(dq_desc, [batch, head, m * BLOCK, 0], dq_smem.reshape([1, 1, BLOCK, HEAD_DIM]))
    return dk, dv, pending


@gluon.jit
def _grad_partition(
    cid: gl.constexpr,  # which consumer warpgroup: keys start_n + cid * SPLIT_N, ...
    dk_desc,
    dv_desc,  # TMA descriptors of dk and dv (B, Hkv, Sk, D), like k's
    dq_desc,  # ... of the fp32 dq accumulator (B, Hq, Sq, D), box (1, 1, BLOCK_M, D)
    sem_ptr,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    k_smem,
    v_smem,
    ds_smem,
    dq_smem,
    kv_ready,
    qd_ready,
    qd_empty,
    batch,
    kv_head,
    start_n,
    GROUP,
    m_start,
    m_mid,
    m_end,  # per head: blocks [m_start, m_mid) masked, [m_mid, m_end) not
    n_last,  # the last key block of the heads
    rot,  # ROTATE: the walk of each head starts at this block
    SEQ_K,
    UPPER_OFFSET,
    stride_sb,
    stride_sh,
    qk_scale,
    scale,
    IS_CAUSAL: gl.constexpr,
    DETERMINISTIC: gl.constexpr,
    ROTATE: gl.constexpr,
    OVERLAP_SDP: gl.constexpr,
):
    ROWS: gl.constexpr = k_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[2]
    dtype: gl.constexpr = k_smem.dtype
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    k = k_smem.index(cid)
    v = v_smem.index(cid)
    ds_buf = ds_smem.index(cid)
    dq_buf = dq_smem.index(cid)
    key_start = start_n + cid * ROWS
    dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, acc_layout)
    n_tiles = m_end - m_start
    pending = (batch * 0 - 1).to(gl.int64)  # no reduce awaiting its ticket's advance
    if n_tiles > 0:
        mbarrier.wait(kv_ready.index(cid), 0)
        for g in range(GROUP):
            head = kv_head * GROUP + g
            # fmt: off
            dk, dv, pending = _grad_steps(
                dk, dv, pending, k, v, q_smem, do_smem, ds_buf, dq_buf, qd_ready, qd_empty, dq_desc, lse_smem,
                delta_smem, sem_ptr, batch, head, key_start, m_start, m_mid, g * n_tiles, n_last, rot, m_end,
                SEQ_K, UPPER_OFFSET, stride_sb, stride_sh, qk_scale, True, IS_CAUSAL, DETERMINISTIC, ROTATE,
                OVERLAP_SDP)
            dk, dv, pending = _grad_steps(
                dk, dv, pending, k, v, q_smem, do_smem, ds_buf, dq_buf, qd_ready, qd_empty, dq_desc, lse_smem,
                delta_smem, sem_ptr, batch, head, key_start, m_mid, m_end, g * n_tiles + m_mid - m_start,
                n_last, rot, m_end, SEQ_K, UPPER_OFFSET, stride_sb, stride_sh, qk_scale, False, IS_CAUSAL,
                DETERMINISTIC, ROTATE, OVERLAP_SDP)
            # fmt: on
    tma.store_wait(pendings=0)
    if DETERMINISTIC:
        _release(pending, gl.full([1], 0, gl.int32, gl.BlockedLayout([1], [32], [4], [0])), sem_ptr)
    # dK and dV leave through this warpgroup's K and V buffers: every product that read them is done
    k.store((dk * scale).to(dtype))
    v.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(
        dk_desc, [batch, kv_head, key_start, 0], k.reshape([1, 1, ROWS, HEAD_DIM])
    )
    tma.async_copy_shared_to_global(
        dv_desc, [batch, kv_head, key_start, 0], v.reshape([1, 1, ROWS, HEAD_DIM])
    )
    tma.store_wait(pendings=0)


@gluon.jit
def _attn_bwd_sm90_kernel(
    q_desc,  # TMA descriptor of q, (B, Hq, Sq, D), box (1, 1, BLOCK_M, D)
    k_desc,  # ... of k, (B, Hkv, Sk, D), box (1, 1, SPLIT_N, D)
    v_desc,  # ... of v, like k
    do_desc,  # ... of dO, like q
    dk_desc,  # ... of dk, like k
    dv_desc,  # ... of dv, like k
    dq_desc,  # ... of the fp32 dq accumulator (B, Hq, Sq, D), zeroed, box (1, 1, BLOCK_M, D)
    lse_ptr,  # fp32 forward log-sum-exp (natural log), (B, Hq, Sq), strides stride_lb, stride_lh, 1
    delta_ptr,  # fp32 rowsum(dO * O) - dlse, (B, Hq, Sq), strides stride_db, stride_dh, 1
    sem_ptr,  # DETERMINISTIC: int32 ticket counters, zeroed, (B, Hq, cdiv(Sq, BLOCK_M)) strides stride_s*, 1
    stride_lb,
    stride_lh,
    stride_db,
    stride_dh,
    stride_sb,
    stride_sh,
    HEADS_KV,  # key/value heads
    GROUP,  # query heads per key/value head (1 without GQA)
    SEQ_Q,  # query rows of a head
    SEQ_K,  # keys of a head
    UPPER_OFFSET,  # IS_CAUSAL: row i sees key j iff j <= i + UPPER_OFFSET
    qk_scale,  # scale * log2(e)
    scale,  # the scores' scale (dK's factor)
    IS_CAUSAL: gl.constexpr,  # the causal mask
    DETERMINISTIC: gl.constexpr,  # dq's partials added in a fixed order (ticket counters)
    NUM_STAGES: gl.constexpr,  # Q/dO tiles in flight
    KEY_MAJOR: gl.constexpr,  # key blocks on the grid's fastest axis (else (batch, head) pairs)
    ROTATE: gl.constexpr,  # DETERMINISTIC, full mask: key block n walks the query blocks from n * Mb / Nb
    OVERLAP_SDP: gl.constexpr,  # dP^T issued beside S^T (Config.overlap_sdp)
):
    BLOCK: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    ROWS: gl.constexpr = k_desc.block_type.shape[2]
    KEYS: gl.constexpr = NUM_CONSUMERS * ROWS
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(ROWS == 64, "a consumer warpgroup's wgmma has 64 rows")
    gl.static_assert(k_desc.block_type.shape[3] == HEAD_DIM, "q and k share D")

    n_blocks = gl.cdiv(SEQ_K, KEYS)
    if KEY_MAJOR:  # the key blocks of a head run together and share its Q, dO and dq in L2
        pid_n = gl.program_id(0)
        bh = gl.program_id(1)
    else:
        bh = gl.program_id(0)
        pid_n = gl.program_id(1)
    if DETERMINISTIC and IS_CAUSAL:  # in turn order: the last key block first
        pid_n = n_blocks - 1 - pid_n
    batch = bh // HEADS_KV
    kv_head = bh % HEADS_KV
    start_n = pid_n * KEYS
    m_end = gl.cdiv(SEQ_Q, BLOCK)
    if IS_CAUSAL:
        # the first block with a row that sees key start_n, the first whose every row sees the
        # program's last key
        m_start = gl.minimum(gl.maximum(start_n - UPPER_OFFSET, 0) // BLOCK, m_end)
        m_mid = gl.minimum(
            gl.maximum(gl.cdiv(gl.maximum(start_n + KEYS - 1 - UPPER_OFFSET, 0), BLOCK), m_start), m_end
        )
    else:
        m_start = 0
        m_mid = 0
    if start_n + KEYS > SEQ_K:  # the ragged last block: every step masks the keys past Sk
        m_mid = m_end
    rot = pid_n * 0
    if ROTATE:
        rot = (pid_n * m_end) // n_blocks

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK], dtype)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, HEAD_DIM], gl.float32)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK, HEAD_DIM], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, ROWS, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, ROWS, HEAD_DIM], kv_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, ROWS, BLOCK], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [NUM_CONSUMERS, BLOCK, HEAD_DIM], dq_layout)
    rows_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK], rows_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK], rows_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    qd_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    qd_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(kv_ready.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(qd_ready.index(i), count=1)  # the producer's expect; the TMA's bytes complete it
        mbarrier.init(qd_empty.index(i), count=NUM_CONSUMERS)  # free once both consumers release it

    # fmt: off
    gl.warp_specialize([
        # the default partition (the launch's warps), the second consumer, the producer
        (_grad_partition, (0, dk_desc, dv_desc, dq_desc, sem_ptr, q_smem, do_smem, lse_smem, delta_smem,
                           k_smem, v_smem, ds_smem, dq_smem, kv_ready, qd_ready, qd_empty, batch, kv_head,
                           start_n, GROUP, m_start, m_mid, m_end, n_blocks - 1, rot, SEQ_K,
                           UPPER_OFFSET, stride_sb, stride_sh, qk_scale, scale, IS_CAUSAL, DETERMINISTIC,
                           ROTATE, OVERLAP_SDP)),
        (_grad_partition, (1, dk_desc, dv_desc, dq_desc, sem_ptr, q_smem, do_smem, lse_smem, delta_smem,
                           k_smem, v_smem, ds_smem, dq_smem, kv_ready, qd_ready, qd_empty, batch, kv_head,
                           start_n, GROUP, m_start, m_mid, m_end, n_blocks - 1, rot, SEQ_K,
                           UPPER_OFFSET, stride_sb, stride_sh, qk_scale, scale, IS_CAUSAL, DETERMINISTIC,
                           ROTATE, OVERLAP_SDP)),
        (_load_partition, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, kv_ready,
                           qd_ready, qd_empty, batch, kv_head, start_n, GROUP, m_start, m_end, rot,
                           lse_ptr, delta_ptr, lse_smem, delta_smem, SEQ_Q, stride_lb, stride_lh,
                           stride_db, stride_dh)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    # fmt: on


# ---------------------------------------------------------------- launcher


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``attention_bwd_sm90`` takes these inputs: (B, H, S, D) fp16/bf16 tensors of one dtype
    on an sm_90 GPU, D 64 or 128, Hq a multiple of Hkv, within the grid's bounds. Strides are free
    (tensors that TMA cannot read as they are are copied first). Masks, windows and the rest are the
    caller's to check (``bwd.sm90_takes``)."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_cuda for t in tensors):
        return False
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if k.device != q.device or v.device != q.device or _capability(q.device.index or 0) != SM90:
        return False
    (batch, heads_q, _, head_dim), (batch_k, heads_kv, seq_k, head_dim_k) = q.shape, k.shape
    if head_dim not in HEAD_DIMS or head_dim_k != head_dim or v.shape != k.shape or batch_k != batch:
        return False
    if heads_kv == 0 or heads_q % heads_kv:
        return False
    return batch * heads_kv < MAX_GRID_Y and cdiv(seq_k, BLOCK_N) < MAX_GRID_Y


MAX_GRID_Y = 65536  # programs a launch may have along its y axis (CUDA's limit)


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A 4-D TMA descriptor over a (B, H, S, D) tensor with a (1, 1, rows, D) box: the S bound is the
    head's own, so a box past it loads zeros and stores (or adds) nothing."""
    dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[t.dtype]
    block = [1, 1, rows, t.shape[3]]
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dtype))


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
    deterministic: bool = True,
    config: Config | None = None,
) -> None:
    """Write attention's gradients into ``dq``, ``dk`` and ``dv`` (q's, k's, v's shapes and dtype).

    q and do (B, Hq, Sq, D), k and v (B, Hkv, Sk, D); ``lse`` the forward's fp32 log-sum-exp
    (B, Hq, Sq) with a contiguous last dim (-inf where a row sees no key), ``delta`` (B, Hq, Sq) fp32
    from the delta kernel, likewise. ``causal``: row i sees key j iff j <= i + ``upper_offset``
    (Sk - Sq aligned bottom-right, 0 top-left). ``scale`` > 0 multiplies q . k. ``deterministic``
    orders the additions into dq (the same bits every run). The caller has checked ``supports``;
    tensors TMA cannot take as they are are copied (gradients written back)."""
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale}")
    if not supports(q, k, v):
        raise ValueError("attention_bwd_sm90 does not take these inputs (see supports)")
    for name, t in (("lse", lse), ("delta", delta)):
        if t.shape != q.shape[:3] or t.dtype != torch.float32 or (q.shape[2] > 1 and t.stride(2) != 1):
            raise ValueError(f"{name} must be float32 {tuple(q.shape[:3])} with a contiguous last dim")
    if q.numel() == 0 or k.numel() == 0:
        for grad in (dq, dk, dv):
            grad.zero_()
        return
    do, q, k, v = (t if tma_ready(t) else t.contiguous() for t in (do, q, k, v))
    outputs = [
        g if tma_ready(g) else torch.empty_like(g, memory_format=torch.contiguous_format) for g in (dk, dv)
    ]
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    tickets = (
        torch.zeros((*q.shape[:2], cdiv(q.shape[2], BLOCK_M)), dtype=torch.int32, device=q.device)
        if deterministic
        else dq_acc
    )
    for launch in launches(
        do, q, k, v, lse, delta, dq_acc, tickets, *outputs, scale=scale, causal=causal,
        upper_offset=upper_offset, deterministic=deterministic, config=config,
    ):  # fmt: skip
        launch.run()
    for grad, out in zip((dk, dv), outputs, strict=True):
        if out is not grad:
            grad.copy_(out)
    torch.mul(dq_acc, scale, out=dq)  # the conversion: dq = scale * dS K, in q's dtype


# The deterministic mode's order of programs. Turns on the slow axis (key blocks in turn order,
# (batch, head) pairs fastest) wait only on earlier programs, but spread the running programs over
# 132 heads, whose dq accumulators do not fit in L2: on the H200 at fa3667b it ran at 0.39-0.51x
# cuDNN against the free order's 0.77-0.93x. KEY_MAJOR_DETERMINISTIC runs a head's key blocks
# together instead: causal in its shortest-first turns (a block still waits only on earlier
# programs), a full mask's walk rotated so that each key block reaches a query block at its own
# step (a block may then wait on a later one of its head, so all of a head's blocks must be
# resident at once: at most one a multiprocessor, else the slow-axis order). Written and checked on
# the CPU (the rank rule against a simulation; it compiles), not yet run on the H200: off.
KEY_MAJOR_DETERMINISTIC = False


def order(deterministic: bool, causal: bool, blocks: int, sms: int) -> tuple[bool, bool]:
    """(KEY_MAJOR, ROTATE) for a launch of ``blocks`` key blocks a head on ``sms`` multiprocessors."""
    if not deterministic:
        return True, False
    if not KEY_MAJOR_DETERMINISTIC:
        return False, False
    rotate = not causal and blocks <= sms
    return causal or rotate, rotate


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
    config=None,
) -> list[Launch]:
    """The kernel's launch for checked, TMA-ready arguments (``attention_bwd_sm90``'s): one program
    per BLOCK_N keys of a (batch, key/value head). Without determinism key blocks run fastest (a
    head's blocks together, sharing its Q and dO in L2); with it, (batch, head) pairs do, key blocks
    in turn order on the y axis."""
    (batch, heads_q, seq_q, head_dim), (_, heads_kv, seq_k, _) = q.shape, k.shape
    config = config or CONFIGS[head_dim]
    args = (
        _descriptor(q, BLOCK_M),
        _descriptor(k, SPLIT_N),
        _descriptor(v, SPLIT_N),
        _descriptor(do, BLOCK_M),
        _descriptor(dk, SPLIT_N),
        _descriptor(dv, SPLIT_N),
        _descriptor(dq_acc, BLOCK_M),
        lse,
        delta,
        tickets,
        lse.stride(0),
        lse.stride(1),
        delta.stride(0),
        delta.stride(1),
        tickets.stride(0),
        tickets.stride(1),
        heads_kv,
        heads_q // heads_kv,
        seq_q,
        seq_k,
        int(upper_offset),
        scale * LOG2E.value,
        scale,
    )
    blocks, pairs = cdiv(seq_k, BLOCK_N), batch * heads_kv
    key_major, rotate = order(deterministic, causal, blocks, sm_count(q.device))
    meta = {
        "IS_CAUSAL": bool(causal),
        "DETERMINISTIC": bool(deterministic),
        "NUM_STAGES": config.num_stages,
        "KEY_MAJOR": key_major,
        "ROTATE": rotate,
        "OVERLAP_SDP": config.overlap_sdp,
        "num_warps": CONSUMER_WARPS.value,
    }
    grid = (blocks, pairs) if meta["KEY_MAJOR"] else (pairs, blocks)
    return [Launch("bwd sm90", _attn_bwd_sm90_kernel, args, meta, config._asdict(), grid)]
