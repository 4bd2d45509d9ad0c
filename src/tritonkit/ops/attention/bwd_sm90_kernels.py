"""Attention backward for Hopper (sm_90) in Gluon, the kernels (launched by ``bwd_sm90``), with
FlashAttention-3's dataflow: dK, dV and the dQ partials of a key block in one program, five
matmuls a step, dQ summed in fp32 by TMA reduce-add.

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
  issue dP^T = V dO^T and dV += P^T dO, wait for dP^T (dV runs on) and form dS^T (from P^T's fp32
  values in the free bf16 mode, else from P^T in the input dtype); issue dK += dS^T Q, store dS^T
  in shared memory and issue the partial dQ = dS K of this warpgroup's 64 keys (at D = 128 in two
  64-column halves: a whole 64 x 128 fp32 partial beside dK and dV does not fit in 240
  registers); the partial goes to a shared-memory staging
  buffer (two a consumer in turn at D = 64, one at D = 128, where two do not fit), handed to the
  dQ warp by an mbarrier. (``bwd_sm90.Config``'s overlap_sdp issues dP^T beside S^T instead; its
  shared_dq adds one 64 x D tile a step for the program, each warpgroup D / 2 columns over both
  warpgroups' dS^T, as FA3 does.)
- a dQ warp (24 registers; ``bwd_sm90_dq``) adds each step's partials to an fp32 accumulator in
  global memory with TMA reduce-adds (``cp.reduce.async.bulk.tensor ... add``) under the next
  step's products, and frees the staging buffers once the reduces have read them; in the
  deterministic mode it also waits for the turns and publishes them (below), so that the consumers
  never do;
- the epilogue scales dK, writes dK and dV through the K and V buffers with TMA stores, which clip
  the rows past Sk; a conversion afterwards writes dq = scale * accumulator in q's dtype.
Masks only where a bound cuts a step: the causal diagonal (the first query blocks a key block sees),
a window's left edge (the last ones: a key block walks only the query blocks whose rows reach it)
and the ragged end of the keys (every step of the last key block: a key past Sk loads as zero and
would otherwise get exp2(-lse)). Rows past Sq need none: their lse reads as +inf, so P = 0. A
window has an upper bound (causal, or a right side), so its turns are the causal order's.

Packed batches (VARLEN): the tensors are (1, H, T, D) views of (T, H, D) ones, sequence b's rows
cu_q[b]:cu_q[b + 1] (its keys likewise); the grid is the sequences' key blocks over the longest
sequence's, a program past its sequence's keys doing nothing. Its boxes start at the sequence's
first row, so those that reach past its end read the next sequence's rows: its keys are masked as
the ragged end's are (the last key block's every step), its query rows get P = 0 from their lse
(+inf: the producer reads lse and delta masked by the sequence's rows), and dQ's reduce-add over
them adds zeros (dS = P (dP - delta) = 0 there; such rows must hold finite values, as a sequence's
own do). dK and dV cannot leave by a TMA store (a box past the sequence's keys would overwrite the
next sequence's): packed programs store them row by row, masked, from the registers, as the
forward stores O.

Determinism. Without it (``deterministic=False``) the key blocks of a head add their partials in
whatever order they finish, so dq's last bits vary. With it, every (batch, query head, query block)
has a ticket counter in global memory: the dQ warp adds a step's partials only when the counter
equals its key block's turn (polled before its consumers are done with the step) and increments
it once the adds have completed (``cp.async.bulk.wait_group 0``; without shared_dq the two
partials add the same columns, the second once the first has completed). Turns: for a full mask
key blocks ascending, or, where ``bwd_sm90.order`` rotates the walk (key block n starting at query
block n * Mb / Nb), the order of arrival; for a causal one, descending from the last key block
that the query block sees (FA3's shortest-first order), the order in which a lockstep walk of
ascending query blocks reaches it. In the rotated and the causal orders the next key block
reaches a query block about two steps after the last, so that in a steady walk no turn is waited
for; in the ascending one key block n starts n adds late. Causal programs launch in turn order, so
one that waits only waits on programs already running or done; the rotated walk's turns are
cyclic, so its launches must fit on the GPU at once (``bwd_sm90.order``).

Measured on the H200 (bf16, at c3a4ea5; ``benchmarks/results/h200/attention{,_causal}.json``):
0.86-1.04x cuDNN free; deterministic 0.81-0.91x at D = 128 without GQA, and with GQA by query
head (``bwd_sm90.Config.per_query_head``: a program one query head's, reading its group's K and V,
writing that head's share of dK and dV; at af34fdd) 0.85x at the Llama-3-8B layer's shape, 0.85-0.94x
at (2, 32/8, 8192, 128) (the default takes D = 128; elsewhere the Triton kernels). Short of FA3's
design still: at D = 64 the free mode ran 0.89x causal against 0.95x before the dQ warp, the
products of a step wait on each other more than FA3's, and at D = 128 ptxas keeps some values on
the stack.

Work. 2.5 x 4 * B * Hq * Sq * Sk * D FLOPs (five matmuls; about half when causal with Sq = Sk);
bytes: q, k, v, dO, o once (o by the delta kernel), each key block re-reading its head's Q and dO
(from L2 when the blocks of a head run together), and the dQ accumulator's reduce-adds, 2 x 4 x
Sk / 64 x |q| bytes of L2 traffic (each warpgroup its own partial; half that with shared_dq).

References: Shah et al., "FlashAttention-3" (arXiv 2407.08608), section 3 and the backward in
Dao-AILab/flash-attention ``hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp``; Triton's Gluon tutorials.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from tritonkit.jit import LOG2E
from tritonkit.ops.attention.bwd_sm90_dq import _dq_partition
from tritonkit.ops.attention.bwd_sm90_walk import _program
from tritonkit.ops.attention.sm90_elementwise import from_pairs, softcapped_tanh, to_pairs

SPLIT_N = 64  # keys a consumer warpgroup holds: a wgmma's M per warpgroup
NUM_CONSUMERS = gl.constexpr(2)  # FA3's 2 x 64 = 128 keys a program
BLOCK_N = NUM_CONSUMERS.value * SPLIT_N
BLOCK_M = 64  # query rows a step (FA3's at D = 128 causal): S^T is 64 x 64 fp32, 32 registers a thread
CONSUMER_WARPS = gl.constexpr(4)  # a consumer is a warpgroup; the first is the default partition
PRODUCER_WARPS = gl.constexpr(1)  # one warp issues every TMA load
# setmaxnreg budgets (FA3's): 2 x 128 threads x 240 + 128 x 24 <= 65,536. A consumer's live set at
# D = 128: dK and dV (2 x 64 fp32), S^T and dP^T (2 x 32), P^T and dS^T in 16 bits (2 x 16), a
# 64-column slice of the dQ partial (32).
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)


# ---------------------------------------------------------------- kernels


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
    kv_head,  # this program's batch and head (its query heads' group; its dK's and dV's head)
    q_row0,
    k_row0,  # its sequence's first query row and first key in the tensors (0 but packed)
    KV_SHARE,  # programs' heads a k/v head serves (per query head), else 1: k's and v's head
    start_n,  # its first key
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
        kv_row = kv_head // KV_SHARE
        for c in gl.static_range(CONSUMERS):
            mbarrier.expect(kv_ready.index(c), 2 * k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                k_desc,
                [batch, kv_row, k_row0 + start_n + c * ROWS, 0],
                kv_ready.index(c),
                k_smem.index(c).reshape([1, 1, ROWS, HEAD_DIM]),
            )
            tma.async_copy_global_to_shared(
                v_desc,
                [batch, kv_row, k_row0 + start_n + c * ROWS, 0],
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
                lse_ptr + (batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh + q_row0) + rows,
                mask=in_rows,
                other=-float("inf"),
            )
            lse = gl.where(lse == -float("inf"), float("inf"), lse * LOG2E)
            delta = gl.load(
                delta_ptr + (batch.to(gl.int64) * stride_db + head.to(gl.int64) * stride_dh + q_row0) + rows,
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
                [batch, head, q_row0 + start_m, 0],
                qd_ready.index(stage),
                q_smem.index(stage).reshape([1, 1, BLOCK, HEAD_DIM]),
            )
            tma.async_copy_global_to_shared(
                do_desc,
                [batch, head, q_row0 + start_m, 0],
                qd_ready.index(stage),
                do_smem.index(stage).reshape([1, 1, BLOCK, HEAD_DIM]),
            )


@gluon.jit
def _grad_steps(
    dk,
    dv,
    buffers,  # this warpgroup's K, V; K and the Q, dO, dS^T, dQ tiles, their barriers, lse and delta
    key_start,
    first,
    last,
    step0,
    rot,
    m_count,
    SEQ_K,
    UPPER_OFFSET,
    LOWER_OFFSET,
    qk_scale,
    cap_log2,
    MASKED: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    DETERMINISTIC: gl.constexpr,
    ROTATE: gl.constexpr,
    OVERLAP_SDP: gl.constexpr,
    SHARED_DQ: gl.constexpr,
    P_PAIRS: gl.constexpr,
    CID: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_LOWER: gl.constexpr,
):
    """Query blocks [first, last) of one query head against this warpgroup's keys (from
    ``key_start``): step step0 + (m - first) of the ring for block m (with ROTATE, block
    (m + rot) % m_count: a full mask's walk starting at block ``rot``). Returns (dk, dv). MASKED
    steps hide keys past SEQ_K and, causal, those past each row's diagonal (key j <= row i +
    UPPER_OFFSET), and with HAS_LOWER those before a window's left edge (key j >= row i +
    LOWER_OFFSET). Each step's dQ columns go to this warpgroup's tile of ``dq_smem``, a buffer a
    step in turn (free once its ``dq_empty`` completes, handed over by its ``dq_full``), for the dQ
    warp to add. SHARED_DQ: ``ds_smem`` holds both warpgroups' dS^T (2 steps x 2 warpgroups,
    step-major, guarded by ``ds_ready`` and ``ds_free``) and this one computes the D / 2 columns
    of dQ from CID * D / 2 over all 128 keys (``k_smem``) at the step's end; otherwise ``ds_smem``
    is this warpgroup's own and it computes a whole partial over its 64 keys."""
    (k, v, k_smem, q_smem, do_smem, ds_smem, dq_smem, qd_ready, qd_empty, ds_ready, ds_free, dq_full,
     dq_empty, lse_smem, delta_smem) = buffers  # fmt: skip
    BLOCK: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    ROWS: gl.constexpr = k.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 16]
    )
    zero_s = gl.zeros([ROWS, BLOCK], gl.float32, s_layout)
    DQ_COLS: gl.constexpr = HEAD_DIM // 2 if SHARED_DQ else (64 if HEAD_DIM > 64 else HEAD_DIM)
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_COLS, 16]
    )
    zero_dq = gl.zeros([BLOCK, DQ_COLS], gl.float32, dq_layout)
    keys = key_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    # fmt: off
    walk = (buffers, keys, zero_s, zero_dq, first, step0, rot, m_count, SEQ_K, UPPER_OFFSET, LOWER_OFFSET,
            qk_scale, cap_log2)
    for i in range(first, last):
        dk, dv = _grad_step(
            dk, dv, i, walk, MASKED, IS_CAUSAL, DETERMINISTIC, ROTATE, OVERLAP_SDP, SHARED_DQ, P_PAIRS, CID,
            SOFTCAP, HAS_LOWER)
    # fmt: on
    return dk, dv


@gluon.jit
def _shared_dq(ds_smem, k_smem, ds_ready, step, zero_dq, CID: gl.constexpr):
    """SHARED_DQ: issue this warpgroup's dQ columns of ``step`` over both warpgroups' dS^T (two
    products, asynchronous) once both have stored theirs."""
    DQ_COLS: gl.constexpr = zero_dq.type.shape[1]
    ds_stage = step % 2
    mbarrier.wait(ds_ready.index(ds_stage), (step // 2) & 1)
    dq = warpgroup_mma(
        ds_smem.index(2 * ds_stage).permute((1, 0)),
        k_smem.index(0).slice(CID * DQ_COLS, DQ_COLS, dim=1),
        zero_dq,
        use_acc=False,
        is_async=True,
    )
    return warpgroup_mma(
        ds_smem.index(2 * ds_stage + 1).permute((1, 0)),
        k_smem.index(1).slice(CID * DQ_COLS, DQ_COLS, dim=1),
        dq,
        is_async=True,
    )


@gluon.jit
def _grad_step(
    dk,
    dv,
    i,
    walk,  # (buffers, keys, zero_s, zero_dq, first, step0, rot, m_count, SEQ_K, UPPER_OFFSET,
    # LOWER_OFFSET, qk_scale, cap_log2)
    MASKED: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    DETERMINISTIC: gl.constexpr,
    ROTATE: gl.constexpr,
    OVERLAP_SDP: gl.constexpr,
    SHARED_DQ: gl.constexpr,
    P_PAIRS: gl.constexpr,
    CID: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_LOWER: gl.constexpr,
):
    """Query block i's step of ``_grad_steps``' walk: S^T, P^T, dP^T, dS^T and the products into dV
    and dK, and its dQ columns. Returns (dk, dv). SOFTCAP: the exponent is cap_log2 * tanh(s *
    qk_scale) (the forward's ``softcapped_tanh``), and dS^T takes the tanh's derivative, 1 - tanh^2
    (the scale comes after, as without the cap)."""
    (buffers, keys, zero_s, zero_dq, first, step0, rot, m_count, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale,
     cap_log2) = walk  # fmt: skip
    (k, v, k_smem, q_smem, do_smem, ds_smem, dq_smem, qd_ready, qd_empty, ds_ready, ds_free, dq_full,
     dq_empty, lse_smem, delta_smem) = buffers  # fmt: skip
    NUM_STAGES: gl.constexpr = q_smem.type.shape[0]
    BLOCK: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    DQ_BUFFERS: gl.constexpr = dq_smem.type.shape[0] // NUM_CONSUMERS
    DQ_COLS: gl.constexpr = zero_dq.type.shape[1]
    DQ_SPLIT: gl.constexpr = 1 if SHARED_DQ else HEAD_DIM // DQ_COLS
    dtype: gl.constexpr = q_smem.dtype
    # P read twice in 16 bits (below): fp16, and the deterministic mode (or P_PAIRS) at D = 128
    P16: gl.constexpr = ((DETERMINISTIC or P_PAIRS) and HEAD_DIM > 64) or dtype == gl.float16 or BLOCK > 64
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, zero_s.type.layout)  # along the query rows (S^T's columns)
    step = step0 + i - first
    m = i
    if ROTATE:
        m = (i + rot) % m_count
    stage = step % NUM_STAGES
    dq_slot = step % DQ_BUFFERS * NUM_CONSUMERS + CID
    dq_phase = (step // DQ_BUFFERS) & 1
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
    if SOFTCAP:  # the exponent's factor is cap_log2 on the tanh, in qk_scale's place
        s = softcapped_tanh(s, qk_scale, qk_scale * (2.0 * LOG2E))
        factor = cap_log2
    else:
        factor = qk_scale
    if MASKED:
        rows = m * BLOCK + gl.arange(0, BLOCK, layout=col_s)
        visible = keys[:, None] < SEQ_K
        if IS_CAUSAL:
            visible = visible & (keys[:, None] <= rows[None, :] + UPPER_OFFSET)
        if HAS_LOWER:
            visible = visible & (keys[:, None] >= rows[None, :] + LOWER_OFFSET)
        p = gl.exp2(gl.where(visible, s * factor - lse[None, :], -float("inf")))
    else:
        p = gl.exp2(s * factor - lse[None, :])
    # P^T in the input dtype, packed in pairs as dV's A operand (F2FP, two a conversion on the
    # ALU), and dS from P's fp32 values: a 16-bit bf16 P that dS also reads compiles to one F2F
    # a value, on the MUFU's pipe beside the exponentials. fp16's converts in pairs either way
    # (and the fp32 P spills more), and the deterministic mode measured 4-8% faster with it at
    # D = 128 (why is not established; the free mode gained 1-12%,
    # docs/perf-notes/attention-backward-determinism.md): both keep the 16-bit P, read twice.
    # At D = 64 the 16-bit P cost the free mode 3-15% on the H200, and the deterministic one
    # takes the fp32 P there too: +11-12% causal, level full
    P16_PAIRS: gl.constexpr = P_PAIRS or BLOCK > 64  # (an fp32 P of 128 rows spills: 16 bits, in pairs)
    # dS reads p_ds: P, or SOFTCAP P (1 - tanh^2), the cap's derivative folded in where P is made
    # (the tanh is not held until dP: the free D = 128 mode's fp32 P and tanh spilled 250 values a
    # step), in the form dS reads P in; P itself feeds dV
    p_ds = p
    if SOFTCAP:
        p_ds = p * (1.0 - s * s)
    if P16 and P16_PAIRS:  # converted in pairs on the ALU (F2FP), unpacked for dS
        p = to_pairs(p, dtype)
        p_a = gl.convert_layout(p, a_layout)
        if SOFTCAP:
            p_ds = to_pairs(p_ds, dtype)
        else:
            p_ds = p
    elif P16:
        p = p.to(dtype)
        p_a = gl.convert_layout(p, a_layout)
        if SOFTCAP:
            p_ds = p_ds.to(dtype)
        else:
            p_ds = p
    else:
        p_a = gl.convert_layout(to_pairs(p, dtype), a_layout)
    if not OVERLAP_SDP:  # dP^T now, under P's conversion and dV
        dp = warpgroup_mma(v, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dv = warpgroup_mma(p_a, do, dv, is_async=True)
    dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp,))
    if P16 and dtype == gl.bfloat16:  # (an fp16 P converts: its exponent is not an fp32's)
        p_wide = from_pairs(p_ds)
    else:
        p_wide = p_ds.to(gl.float32)
    ds = p_wide * (dp - delta_smem.index(stage).load(col_s)[None, :])
    if P16 and not P16_PAIRS:
        ds = ds.to(dtype)
    else:
        ds = to_pairs(ds, dtype)
    ds_a = gl.convert_layout(ds, a_layout)
    dk = warpgroup_mma(ds_a, q, dk, is_async=True)
    if SHARED_DQ:
        # both warpgroups' dS^T of this step in one buffer of two (free once both products
        # of two steps ago that read it are done), then this warpgroup's columns of dQ over
        # all 128 keys: one 64 x D tile a step for the two, half the reduce traffic
        ds_stage = step % 2
        ds_phase = (step // 2) & 1
        mbarrier.wait(ds_free.index(ds_stage), ds_phase ^ 1)
        ds_smem.index(2 * ds_stage + CID).store(ds)
        fence_async_shared()  # the generic-proxy store before either warpgroup's wgmma reads it
        mbarrier.arrive(ds_ready.index(ds_stage), count=1)
    if SHARED_DQ:
        dv, dk, p_a = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dk, p_a))
        dq = _shared_dq(ds_smem, k_smem, ds_ready, step, zero_dq, CID)
        dq, dk, ds_a = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dk, ds_a))
        mbarrier.arrive(ds_free.index(ds_stage), count=1)
        mbarrier.wait(dq_empty.index(dq_slot), dq_phase ^ 1)  # the reduce of its last use has read it
        dq_smem.index(dq_slot).store(dq)
    else:
        ds_smem.store(ds)
        fence_async_shared()  # the generic-proxy store before the wgmma reads it
        # dQ = dS K in DQ_SPLIT column slices of DQ_COLS (at D = 128 a whole 64 x 128 fp32
        # partial beside dK and dV does not fit in 240 registers)
        dv, dk, p_a = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dk, p_a))
        mbarrier.wait(dq_empty.index(dq_slot), dq_phase ^ 1)  # the reduce of its last use has read it
        for half in gl.static_range(DQ_SPLIT):
            dq = warpgroup_mma(
                ds_smem.permute((1, 0)),
                k.slice(half * DQ_COLS, DQ_COLS, dim=1),
                zero_dq,
                use_acc=False,
                is_async=True,
            )
            dq, dk, ds_a = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dk, ds_a))
            dq_smem.index(dq_slot).slice(half * DQ_COLS, DQ_COLS, dim=1).store(dq)
    mbarrier.arrive(qd_empty.index(stage), count=1)
    fence_async_shared()  # the dQ columns' generic-proxy stores before the reduce reads them
    mbarrier.arrive(dq_full.index(dq_slot), count=1)
    return dk, dv


@gluon.jit
def _grad_partition(
    cid: gl.constexpr,  # which consumer warpgroup: keys start_n + cid * SPLIT_N, ...
    dk_desc,
    dv_desc,  # TMA descriptors of dk and dv (B, Hkv, Sk, D), like k's
    dk_ptr,
    dv_ptr,  # VARLEN: dk and dv, stored row by row (strides of a head and a key: stride_dkh, ...)
    stride_dkh,
    stride_dks,
    stride_dvh,
    stride_dvs,
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
    ds_ready,
    ds_free,
    dq_full,
    dq_empty,
    batch,
    kv_head,
    start_n,
    sequence,  # VARLEN: the packed sequence (its keys cu_k_ptr[sequence]:cu_k_ptr[sequence + 1])
    cu_k_ptr,
    GROUP,
    m_start,
    m_mid,
    m_tail,
    m_end,  # per head: blocks [m_start, m_mid) masked, [m_mid, m_tail) not, [m_tail, m_end) masked
    rot,  # ROTATE: the walk of each head starts at this block
    SEQ_K,
    UPPER_OFFSET,
    LOWER_OFFSET,
    qk_scale,
    cap_log2,
    scale,
    IS_CAUSAL: gl.constexpr,
    DETERMINISTIC: gl.constexpr,
    ROTATE: gl.constexpr,
    OVERLAP_SDP: gl.constexpr,
    SHARED_DQ: gl.constexpr,
    P_PAIRS: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_LOWER: gl.constexpr,
    VARLEN: gl.constexpr,
    TENSOR_D: gl.constexpr,
):
    ROWS: gl.constexpr = k_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[2]
    dtype: gl.constexpr = k_smem.dtype
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    k = k_smem.index(cid)
    v = v_smem.index(cid)
    if SHARED_DQ:
        ds_buf = ds_smem
    else:
        ds_buf = ds_smem.index(cid)
    key_start = start_n + cid * ROWS
    dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, acc_layout)
    n_tiles = m_end - m_start
    # a window's left side: its rows past the key block's first key's reach in a masked loop of
    # their own, or, where a third loop's code leaves the registers short (the deterministic mode at
    # D = 128: 45 values a step on the stack against 2), masked in the second loop
    SPLIT_TAIL: gl.constexpr = HAS_LOWER and not (DETERMINISTIC and HEAD_DIM > 64)
    MIDDLE_MASKED: gl.constexpr = HAS_LOWER and not SPLIT_TAIL
    if SPLIT_TAIL:
        middle_end = m_tail
    else:
        middle_end = m_end
    if VARLEN:
        # the masks count keys from the sequence's end, so that no register holds its length across
        # the walk (the dense kernel reads SEQ_K and the offsets as constants; with them in registers
        # ptxas put 3-10 values a step on the stack at D = 128); the epilogue reads the length again
        walk_keys = key_start - SEQ_K
        walk_end = 0
        upper = UPPER_OFFSET - SEQ_K
        lower = LOWER_OFFSET - SEQ_K
    else:
        walk_keys = key_start
        walk_end = SEQ_K
        upper = UPPER_OFFSET
        lower = LOWER_OFFSET
    if n_tiles > 0:
        mbarrier.wait(kv_ready.index(cid), 0)
        for g in range(GROUP):
            # fmt: off
            buffers = (k, v, k_smem, q_smem, do_smem, ds_buf, dq_smem, qd_ready, qd_empty, ds_ready, ds_free,
                       dq_full, dq_empty, lse_smem, delta_smem)
            dk, dv = _grad_steps(
                dk, dv, buffers, walk_keys, m_start, m_mid, g * n_tiles, rot, m_end, walk_end, upper, lower,
                qk_scale, cap_log2, True, IS_CAUSAL, DETERMINISTIC, ROTATE, OVERLAP_SDP, SHARED_DQ, P_PAIRS,
                cid, SOFTCAP, HAS_LOWER)
            dk, dv = _grad_steps(
                dk, dv, buffers, walk_keys, m_mid, middle_end, g * n_tiles + m_mid - m_start, rot, m_end,
                walk_end, upper, lower, qk_scale, cap_log2, MIDDLE_MASKED, IS_CAUSAL, DETERMINISTIC, ROTATE,
                OVERLAP_SDP, SHARED_DQ, P_PAIRS, cid, SOFTCAP, HAS_LOWER)
            if SPLIT_TAIL:
                dk, dv = _grad_steps(
                    dk, dv, buffers, walk_keys, m_tail, m_end, g * n_tiles + m_tail - m_start, rot, m_end,
                    walk_end, upper, lower, qk_scale, cap_log2, True, IS_CAUSAL, DETERMINISTIC, ROTATE,
                    OVERLAP_SDP, SHARED_DQ, P_PAIRS, cid, SOFTCAP, HAS_LOWER)
            # fmt: on
    if SHARED_DQ and n_tiles > 0:
        # the other warpgroup's dQ columns read this one's K too: its products of the last step
        # must be done before dK overwrites K (both arrive at that step's ds_free once they are)
        last = GROUP * n_tiles - 1
        mbarrier.wait(ds_free.index(last % 2), (last // 2) & 1)
    if VARLEN:  # row by row, masked: a box past the sequence's keys would overwrite the next one's
        k_row0 = gl.load(cu_k_ptr + sequence)
        keys = key_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))[None, :]
        at = (k_row0 + keys).to(gl.int64)[:, None]
        inside = (keys < gl.load(cu_k_ptr + sequence + 1) - k_row0)[:, None]
        if TENSOR_D < HEAD_DIM:  # a padded head dim: the columns past the tensors' are the next head's
            inside = inside & (cols < TENSOR_D)
        head = kv_head.to(gl.int64)
        gl.store(dk_ptr + head * stride_dkh + at * stride_dks + cols, (dk * scale).to(dtype), mask=inside)
        gl.store(dv_ptr + head * stride_dvh + at * stride_dvs + cols, dv.to(dtype), mask=inside)
    else:
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
    dk_desc,  # ... of dk, like k (per query head: (B, Hq, Sk, D), a query head's share, summed after)
    dv_desc,  # ... of dv, like k
    dq_desc,  # ... of the fp32 dq accumulator (B, Hq, Sq, D), zeroed, box (1, 1, BLOCK_M, D)
    lse_ptr,  # fp32 forward log-sum-exp (natural log), (B, Hq, Sq), strides stride_lb, stride_lh, 1
    delta_ptr,  # fp32 rowsum(dO * O) - dlse, (B, Hq, Sq), strides stride_db, stride_dh, 1
    sem_ptr,  # DETERMINISTIC: zeroed int32 counters (B, Hq, cdiv(Sq, BLOCK_M x TURN_BLOCKS)), stride_s*, 1
    dk_ptr,  # VARLEN: dk (1, Hkv, T, D) (per query head: the shares, (1, Hq, T, D)), stored row by row
    dv_ptr,  # VARLEN: dv, like dk
    cu_q_ptr,  # VARLEN: int32 (B + 1,) cu_seqlens of the queries: sequence b's rows cu_q[b]:cu_q[b + 1]
    cu_k_ptr,  # VARLEN: ... of the keys
    stride_lb,
    stride_lh,
    stride_db,
    stride_dh,
    stride_sb,
    stride_sh,
    stride_dkh,
    stride_dks,  # dk's strides of a head and of a key (VARLEN)
    stride_dvh,
    stride_dvs,
    HEADS_KV,  # key/value heads
    PAIRS,  # (batch, key/value head) pairs: B * HEADS_KV (VARLEN: sequences * HEADS_KV)
    PAIRS_PER_GROUP,  # the order of programs (bwd_sm90.order): pairs a group of programs walks together
    GROUP,  # query heads per key/value head (1 without GQA)
    KV_SHARE,  # per query head (bwd_sm90.Config.per_query_head): programs' heads a k/v head serves, else 1
    SEQ_Q,  # query rows of a head (VARLEN: the longest sequence's)
    SEQ_K,  # keys of a head (VARLEN: the longest sequence's)
    UPPER_OFFSET,  # IS_CAUSAL: row i sees key j iff j <= i + UPPER_OFFSET (VARLEN: a sequence adds Sk - Sq)
    LOWER_OFFSET,  # HAS_LOWER: ... and j >= i + LOWER_OFFSET (a window's left side; likewise)
    qk_scale,  # scale * log2(e) (SOFTCAP: scale / softcap, the tanh's argument a unit of q . k)
    cap_log2,  # SOFTCAP: softcap * log2(e), the exponent's factor on the tanh
    scale,  # the scores' scale (dK's factor)
    IS_CAUSAL: gl.constexpr,  # the causal mask
    DETERMINISTIC: gl.constexpr,  # dq's partials added in a fixed order (ticket counters)
    NUM_STAGES: gl.constexpr,  # Q/dO tiles in flight
    ROTATE: gl.constexpr,  # DETERMINISTIC, full mask: key block n walks the turns' groups from n * Gb / Nb
    OVERLAP_SDP: gl.constexpr,  # dP^T issued beside S^T (Config.overlap_sdp)
    SHARED_DQ: gl.constexpr,  # one dQ tile a step for both warpgroups (Config.shared_dq)
    P_PAIRS: gl.constexpr,  # a 16-bit P and dS converted two values an instruction (Config.p_in_pairs)
    ACQUIRE_FIRST: gl.constexpr,  # DETERMINISTIC: the turn polled acquiring first (Config.acquire_first)
    TURN_BLOCKS: gl.constexpr,  # DETERMINISTIC: query blocks a turn covers (Config.turn_blocks; else 1)
    SOFTCAP: gl.constexpr,  # the scores soft-capped (the forward's ``softcapped_tanh``)
    HAS_LOWER: gl.constexpr,  # a window's left side (LOWER_OFFSET); only under an upper bound (IS_CAUSAL)
    VARLEN: gl.constexpr,  # a packed batch of B sequences: tensors (1, H, T, D), a program's batch a sequence
    TENSOR_D: gl.constexpr,  # VARLEN: the tensors' D, the boxes' (HEAD_DIM) or fewer (a padded head dim)
):
    BLOCK: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    ROWS: gl.constexpr = k_desc.block_type.shape[2]
    KEYS: gl.constexpr = NUM_CONSUMERS * ROWS
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(ROWS == 64, "a consumer warpgroup's wgmma has 64 rows")
    gl.static_assert(k_desc.block_type.shape[3] == HEAD_DIM, "q and k share D")
    # (the dQ warp's turns descend from the last key block a query block sees: an upper bound's)
    gl.static_assert(IS_CAUSAL or not HAS_LOWER, "a window's left side comes with an upper bound")

    (batch, kv_head, pid_n, start_n, sequence, q_row0, k_row0, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET,
     n_blocks, m_start, m_mid, m_tail, m_end, rot) = _program(
        PAIRS, PAIRS_PER_GROUP, HEADS_KV, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, cu_q_ptr, cu_k_ptr, BLOCK,
        KEYS, TURN_BLOCKS, DETERMINISTIC, IS_CAUSAL, ROTATE, HAS_LOWER, VARLEN,
    )  # fmt: skip

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK], dtype)
    if SHARED_DQ:  # K as its descriptor has it (D = 64: a 64-byte swizzle, so that D / 2 columns slice)
        k_layout: gl.constexpr = gl.NVMMASharedLayout(k_desc.layout.swizzle_byte_width, 16)
        DQ_COLS: gl.constexpr = HEAD_DIM // 2
    else:
        k_layout: gl.constexpr = kv_layout
        DQ_COLS: gl.constexpr = HEAD_DIM
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, DQ_COLS], gl.float32)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK, HEAD_DIM], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, ROWS, HEAD_DIM], k_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, ROWS, HEAD_DIM], kv_layout)
    if SHARED_DQ:
        ds_smem = gl.allocate_shared_memory(dtype, [2 * NUM_CONSUMERS, ROWS, BLOCK], ds_layout)
    else:
        ds_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, ROWS, BLOCK], ds_layout)
    # the dQ staging a buffer a step in turn: two where they fit (D = 64), so that a consumer's store
    # never waits for the reduce of the step before; one at D = 128 (with shared_dq two fit, 230,984
    # of 232,448 bytes, but measured no faster in either mode:
    # docs/perf-notes/attention-backward-determinism.md; without, 278 KB)
    DQ_BUFFERS: gl.constexpr = 2 if HEAD_DIM <= 64 else 1
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFFERS * NUM_CONSUMERS, BLOCK, DQ_COLS], dq_layout)
    rows_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK], rows_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK], rows_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    qd_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    qd_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(kv_ready.index(i), count=1)
    if SHARED_DQ:
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=NUM_CONSUMERS)  # both warpgroups' dS^T stored
            mbarrier.init(ds_free.index(i), count=NUM_CONSUMERS)  # both warpgroups' dQ products done
    else:  # (unused)
        ds_ready = kv_ready
        ds_free = kv_ready
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS * NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS * NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(DQ_BUFFERS * NUM_CONSUMERS):
        mbarrier.init(dq_full.index(i), count=1)  # the consumer's dQ columns stored
        mbarrier.init(dq_empty.index(i), count=1)  # ... and read by the dQ warp's reduce
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(qd_ready.index(i), count=1)  # the producer's expect; the TMA's bytes complete it
        mbarrier.init(qd_empty.index(i), count=NUM_CONSUMERS)  # free once both consumers release it

    # fmt: off
    gl.warp_specialize([
        # the default partition (the launch's warps), the second consumer, the producer, the dQ warp
        (_grad_partition, (0, dk_desc, dv_desc, dk_ptr, dv_ptr, stride_dkh, stride_dks, stride_dvh,
                           stride_dvs, q_smem, do_smem, lse_smem, delta_smem, k_smem,
                           v_smem, ds_smem, dq_smem, kv_ready, qd_ready, qd_empty, ds_ready, ds_free, dq_full,
                           dq_empty, batch, kv_head, start_n, sequence, cu_k_ptr, GROUP, m_start, m_mid,
                           m_tail, m_end, rot, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale, cap_log2, scale,
                           IS_CAUSAL, DETERMINISTIC, ROTATE, OVERLAP_SDP, SHARED_DQ, P_PAIRS, SOFTCAP,
                           HAS_LOWER, VARLEN, TENSOR_D)),
        (_grad_partition, (1, dk_desc, dv_desc, dk_ptr, dv_ptr, stride_dkh, stride_dks, stride_dvh,
                           stride_dvs, q_smem, do_smem, lse_smem, delta_smem, k_smem,
                           v_smem, ds_smem, dq_smem, kv_ready, qd_ready, qd_empty, ds_ready, ds_free, dq_full,
                           dq_empty, batch, kv_head, start_n, sequence, cu_k_ptr, GROUP, m_start, m_mid,
                           m_tail, m_end, rot, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale, cap_log2, scale,
                           IS_CAUSAL, DETERMINISTIC, ROTATE, OVERLAP_SDP, SHARED_DQ, P_PAIRS, SOFTCAP,
                           HAS_LOWER, VARLEN, TENSOR_D)),
        (_load_partition, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, kv_ready,
                           qd_ready, qd_empty, batch, kv_head, q_row0, k_row0, KV_SHARE, start_n, GROUP,
                           m_start, m_end, rot,
                           lse_ptr, delta_ptr, lse_smem, delta_smem, SEQ_Q, stride_lb, stride_lh,
                           stride_db, stride_dh)),
        (_dq_partition, (dq_desc, dq_smem, dq_full, dq_empty, sem_ptr, batch, sequence, q_row0, kv_head,
                         start_n, GROUP, m_start, m_end, gl.cdiv(SEQ_Q, BLOCK), n_blocks - 1, rot,
                         UPPER_OFFSET, stride_sb, stride_sh, KEYS, IS_CAUSAL, DETERMINISTIC, ROTATE,
                         SHARED_DQ, ACQUIRE_FIRST, TURN_BLOCKS, NUM_CONSUMERS)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    # fmt: on
