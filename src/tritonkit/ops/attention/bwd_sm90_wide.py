"""Attention backward for Hopper (sm_90) in Gluon at D = 256 (launched by ``bwd_sm90``): the kernel of
``bwd_sm90_kernels`` holds a key's dK and dV rows in one warpgroup's registers, 2 x 64 x 256 fp32 at
this head dim, 256 registers a thread of its 240; this one splits the products between its two
consumer warpgroups instead of the keys.

Structure (one program = KEYS = 64 keys of one (batch, key/value head), walking every query block of
every query head of its group, BLOCK_M = 32 rows a step; the producer warp and the dQ warp are
``bwd_sm90_kernels``' and ``bwd_sm90_dq``'s):
- warpgroup 0: S^T = K Q^T (64 keys x 32 rows), the exponentials (masked where a bound cuts the
  step), P^T to shared memory for the other, and dV += P^T dO from its registers;
- warpgroup 1: dP^T = V dO^T, P^T from shared memory, dS^T = P^T (dP^T - delta) to shared memory,
  and dK += dS^T Q from its registers;
- each then its 128 columns of the step's dQ partial, transposed (dQ^T = K^T dS^T: a product's 64
  rows are dQ's columns, the step's 32 rows too few for one), in two 64-column products, into its
  staging tile for the dQ warp's reduce-add (``bwd_sm90.Config.shared_dq``'s hand-over: a tile a
  warpgroup, at its column offset).
Registers a thread: dV or dK 128, S^T or dP^T 16, a dQ^T product 16, P^T or dS^T in 16 bits 8.
Tensor-core work a step: S^T, dP^T, dV and dK 0.5M multiply-adds each and dQ 0.5M, 1.25M a
warpgroup. Shared memory: K and V 64 KB, the Q and dO ring 32 KB a stage, P^T and dS^T two buffers
of 4 KB each, dQ's staging 32 KB (64 KB with two tiles a warpgroup, ``Config.dq_buffers``). Two
hand-overs a step, each an mbarrier: P^T to warpgroup 1, dS^T to both (each warpgroup's dQ columns read it).

The walk, the masks (the causal diagonal, a window's left edge and the ragged end of the keys; rows
past Sq get P = 0 from their +inf lse), the program order and, deterministic, the turns are
``bwd_sm90_kernels``', packed batches' too (VARLEN: dK and dV stored row by row from the registers,
masked by the sequence's keys and by TENSOR_D's columns, ``_store_rows``). Warpgroup 0 alone
masks: warpgroup 1's dS^T is P^T (dP^T - delta), zero where P^T is. With a soft cap warpgroup 0 alone
takes the tanh, and hands over P^T (1 - tanh^2) (the cap's derivative folded in where P is made, as
``bwd_sm90_kernels`` does) in P^T's place: dS^T reads nothing else of P.
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
from tritonkit.ops.attention.bwd_sm90_kernels import (
    CONSUMER_REGS,
    CONSUMER_WARPS,
    PRODUCER_REGS,
    PRODUCER_WARPS,
    _load_partition,
)
from tritonkit.ops.attention.bwd_sm90_walk import _program
from tritonkit.ops.attention.sm90_elementwise import softcapped_tanh, to_pairs

KEYS = gl.constexpr(64)  # keys a program: one K and V tile, which both warpgroups read
BLOCK_M = 32  # query rows a step
DQ_COLS = gl.constexpr(128)  # the dQ columns a warpgroup adds a step
DQ_PRODUCT = gl.constexpr(64)  # ... in products of this many (a wgmma's M)


@gluon.jit
def _wide_step(
    acc,
    i,
    walk,
    MASKED: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    ROTATE: gl.constexpr,
    CID: gl.constexpr,
    HAS_LOWER: gl.constexpr,
    SOFTCAP: gl.constexpr,
):
    """Query block i's step of the walk for warpgroup CID (0: S^T, P^T and dV; 1: dP^T, dS^T and
    dK), then its dQ columns; ``acc`` is its dV or dK. MASKED steps hide keys past SEQ_K and,
    causal, those past each row's diagonal (key j <= row i + UPPER_OFFSET); with HAS_LOWER those
    before its window's left edge too (key j >= row i + LOWER_OFFSET). SOFTCAP: the exponent is
    cap_log2 * tanh(s * qk_scale) (the forward's ``softcapped_tanh``)."""
    (buffers, keys, zero_s, first, step0, rot, m_count, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale,
     cap_log2) = walk  # fmt: skip
    (k, v, q_smem, do_smem, pt_smem, ds_smem, dq_smem, qd_ready, qd_empty, pt_ready, pt_free, ds_ready,
     ds_free, dq_full, dq_empty, lse_smem, delta_smem) = buffers  # fmt: skip
    NUM_STAGES: gl.constexpr = q_smem.type.shape[0]
    BLOCK: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    acc_layout: gl.constexpr = acc.type.layout
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, zero_s.type.layout)  # along the query rows (S^T's columns)
    step = step0 + i - first
    m = i
    if ROTATE:
        m = (i + rot) % m_count
    stage = step % NUM_STAGES
    x = step % 2  # the P^T and dS^T buffers, and their phases
    x_phase = (step // 2) & 1
    q = q_smem.index(stage)
    do = do_smem.index(stage)
    mbarrier.wait(qd_ready.index(stage), (step // NUM_STAGES) & 1)
    if CID == 0:
        s = warpgroup_mma(k, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)
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
        if SOFTCAP:  # what dS^T reads: P^T (1 - tanh^2)
            handed = to_pairs(p * (1.0 - s * s), dtype)
            p = to_pairs(p, dtype)
        else:
            p = to_pairs(p, dtype)
            handed = p
        mbarrier.wait(pt_free.index(x), x_phase ^ 1)  # warpgroup 1 has read it two steps ago
        pt_smem.index(x).store(handed)
        fence_async_shared()  # the generic-proxy store before the other warpgroup reads it
        mbarrier.arrive(pt_ready.index(x), count=1)
        operand = gl.convert_layout(p, a_layout)
        acc = warpgroup_mma(operand, do, acc, is_async=True)  # dV += P^T dO
    else:
        dp = warpgroup_mma(v, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        mbarrier.wait(pt_ready.index(x), x_phase)
        p = pt_smem.index(x).load(zero_s.type.layout).to(gl.float32)
        mbarrier.arrive(pt_free.index(x), count=1)
        ds = to_pairs(p * (dp - delta_smem.index(stage).load(col_s)[None, :]), dtype)
        mbarrier.wait(ds_free.index(x), x_phase ^ 1)  # both warpgroups' dQ products of two steps ago
        ds_smem.index(x).store(ds)
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(x), count=1)
        operand = gl.convert_layout(ds, a_layout)
        acc = warpgroup_mma(operand, q, acc, is_async=True)  # dK += dS^T Q
    # this warpgroup's dQ columns, transposed: dQ^T = K^T dS^T, DQ_PRODUCT columns a product
    mbarrier.wait(ds_ready.index(x), x_phase)
    DQ_BUFFERS: gl.constexpr = dq_smem.type.shape[0] // 2  # staging tiles a warpgroup
    dq_slot = step % DQ_BUFFERS * 2 + CID
    # the reduce DQ_BUFFERS steps before has read it
    mbarrier.wait(dq_empty.index(dq_slot), ((step // DQ_BUFFERS) & 1) ^ 1)
    for part in gl.static_range(DQ_COLS // DQ_PRODUCT):
        dq = warpgroup_mma(
            k.slice(CID * DQ_COLS + part * DQ_PRODUCT, DQ_PRODUCT, dim=1).permute((1, 0)),
            ds_smem.index(x),
            zero_s,
            use_acc=False,
            is_async=True,
        )
        dq, acc, operand = warpgroup_mma_wait(num_outstanding=0, deps=(dq, acc, operand))
        dq_smem.index(dq_slot).slice(part * DQ_PRODUCT, DQ_PRODUCT, dim=1).store(gl.permute(dq, (1, 0)))
    gl.static_assert(HEAD_DIM == 2 * DQ_COLS, "two warpgroups of DQ_COLS columns")
    mbarrier.arrive(ds_free.index(x), count=1)
    mbarrier.arrive(qd_empty.index(stage), count=1)
    fence_async_shared()  # the dQ columns' generic-proxy stores before the reduce reads them
    mbarrier.arrive(dq_full.index(dq_slot), count=1)
    return acc


@gluon.jit
def _wide_steps(
    acc, buffers, key_start, first, last, step0, rot, m_count, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale,
    cap_log2, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, ROTATE: gl.constexpr, CID: gl.constexpr,
    HAS_LOWER: gl.constexpr, SOFTCAP: gl.constexpr,
):  # fmt: skip
    """Query blocks [first, last) of one query head: step step0 + (m - first) of the ring for block
    m (ROTATE: block (m + rot) % m_count). Returns ``acc``."""
    q_smem = buffers[2]
    BLOCK: gl.constexpr = q_smem.type.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 16]
    )
    zero_s = gl.zeros([KEYS, BLOCK], gl.float32, s_layout)
    keys = key_start + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
    walk = (buffers, keys, zero_s, first, step0, rot, m_count, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale,
            cap_log2)  # fmt: skip
    for i in range(first, last):
        acc = _wide_step(acc, i, walk, MASKED, IS_CAUSAL, ROTATE, CID, HAS_LOWER, SOFTCAP)
    return acc


@gluon.jit
def _wide_partition(
    cid: gl.constexpr, dk_desc, dv_desc, dk_ptr, dv_ptr, stride_dkh, stride_dks, stride_dvh, stride_dvs,
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, pt_smem, ds_smem, dq_smem, kv_ready, qd_ready,
    qd_empty, pt_ready, pt_free, ds_ready, ds_free, dq_full, dq_empty, batch, kv_head, start_n, k_row0, GROUP,
    m_start, m_mid, m_tail, m_end, rot, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale, cap_log2, scale,
    IS_CAUSAL: gl.constexpr, ROTATE: gl.constexpr, HAS_LOWER: gl.constexpr, SOFTCAP: gl.constexpr,
    VARLEN: gl.constexpr, TENSOR_D: gl.constexpr,
):  # fmt: skip
    """A consumer warpgroup (0: dV, 1: dK) over its program's walk (masked, unmasked, and with
    HAS_LOWER masked again past the key block's first key's reach: ``_walk``), then its gradient out:
    through its K or V buffer (once both warpgroups' last products have read them) by a TMA store,
    or VARLEN row by row from its registers (``_store_rows``)."""
    HEAD_DIM: gl.constexpr = k_smem.type.shape[2]
    dtype: gl.constexpr = k_smem.dtype
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    acc = gl.zeros([KEYS, HEAD_DIM], gl.float32, acc_layout)
    k = k_smem.index(0)
    v = v_smem.index(0)
    n_tiles = m_end - m_start
    if n_tiles > 0:
        mbarrier.wait(kv_ready.index(0), 0)
        buffers = (k, v, q_smem, do_smem, pt_smem, ds_smem, dq_smem, qd_ready, qd_empty, pt_ready, pt_free,
                   ds_ready, ds_free, dq_full, dq_empty, lse_smem, delta_smem)  # fmt: skip
        for g in range(GROUP):
            # fmt: off
            acc = _wide_steps(acc, buffers, start_n, m_start, m_mid, g * n_tiles, rot, m_end, SEQ_K,
                              UPPER_OFFSET, LOWER_OFFSET, qk_scale, cap_log2, True, IS_CAUSAL, ROTATE, cid,
                              HAS_LOWER, SOFTCAP)
            acc = _wide_steps(acc, buffers, start_n, m_mid, m_tail, g * n_tiles + m_mid - m_start, rot, m_end,
                              SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale, cap_log2, False, IS_CAUSAL, ROTATE,
                              cid, HAS_LOWER, SOFTCAP)
            if HAS_LOWER:
                acc = _wide_steps(acc, buffers, start_n, m_tail, m_end, g * n_tiles + m_tail - m_start, rot,
                                  m_end, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale, cap_log2, True,
                                  IS_CAUSAL, ROTATE, cid, HAS_LOWER, SOFTCAP)
            # fmt: on
        if not VARLEN:
            # K and V are free once both warpgroups' last dQ products (and warpgroup 1's dP^T) are done
            last = GROUP * n_tiles - 1
            mbarrier.wait(ds_free.index(last % 2), (last // 2) & 1)
    if cid == 1:
        acc = acc * scale
    if VARLEN:  # row by row, masked: a box past the sequence's keys would overwrite the next one's
        if cid == 0:
            _store_rows(
                acc.to(dtype), dv_ptr, stride_dvh, stride_dvs, kv_head, k_row0, start_n, SEQ_K, TENSOR_D
            )
        else:
            _store_rows(
                acc.to(dtype), dk_ptr, stride_dkh, stride_dks, kv_head, k_row0, start_n, SEQ_K, TENSOR_D
            )
    else:  # through this warpgroup's K or V buffer, by a TMA store, which clips the keys past Sk
        if cid == 0:
            buffer = v
            desc = dv_desc
        else:
            buffer = k
            desc = dk_desc
        buffer.store(acc.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(
            desc, [batch, kv_head, start_n, 0], buffer.reshape([1, 1, KEYS, HEAD_DIM])
        )
        tma.store_wait(pendings=0)


@gluon.jit
def _store_rows(grad, ptr, stride_h, stride_s, kv_head, k_row0, start_n, SEQ_K, TENSOR_D: gl.constexpr):
    """A packed batch's dK or dV rows of the program's keys, those past the sequence's keys masked
    (and at a padded head dim the columns past TENSOR_D, the next head's in memory)."""
    HEAD_DIM: gl.constexpr = grad.type.shape[1]
    layout: gl.constexpr = grad.type.layout
    keys = start_n + gl.arange(0, KEYS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))[None, :]
    inside = (keys < SEQ_K)[:, None]
    if TENSOR_D < HEAD_DIM:
        inside = inside & (cols < TENSOR_D)
    at = (k_row0 + keys).to(gl.int64)[:, None]
    gl.store(ptr + kv_head.to(gl.int64) * stride_h + at * stride_s + cols, grad, mask=inside)


@gluon.jit
def _attn_bwd_sm90_wide_kernel(
    q_desc,  # TMA descriptor of q, (B, Hq, Sq, D), box (1, 1, BLOCK_M, D)
    k_desc,  # ... of k, (B, Hkv, Sk, D), box (1, 1, KEYS, D)
    v_desc,  # ... of v, like k
    do_desc,  # ... of dO, like q
    dk_desc,  # ... of dk, like k (per query head: (B, Hq, Sk, D), a query head's share, summed after)
    dv_desc,  # ... of dv, like k
    dq_desc,  # ... of the fp32 dq accumulator (B, Hq, Sq, D), zeroed, box (1, 1, BLOCK_M, DQ_COLS)
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
    HEADS_KV,  # key/value heads (per query head: query heads)
    PAIRS,  # (batch, key/value head) pairs: B * HEADS_KV (VARLEN: sequences * HEADS_KV)
    PAIRS_PER_GROUP,  # the order of programs (bwd_sm90.order)
    GROUP,  # query heads a program walks (1 per query head)
    KV_SHARE,  # per query head: programs' heads a k/v head serves, else 1
    SEQ_Q,
    SEQ_K,  # query rows and keys of a head (VARLEN: the longest sequence's)
    UPPER_OFFSET,  # IS_CAUSAL: row i sees key j iff j <= i + UPPER_OFFSET (VARLEN: a sequence adds Sk - Sq)
    LOWER_OFFSET,  # HAS_LOWER: ... and j >= i + LOWER_OFFSET (a window's left side; likewise)
    qk_scale,  # scale * log2(e); SOFTCAP: scale / softcap, the tanh's argument's factor
    cap_log2,  # SOFTCAP: softcap * log2(e), the exponent's factor on the tanh (else unused)
    scale,  # the scores' scale (dK's factor)
    IS_CAUSAL: gl.constexpr,
    DETERMINISTIC: gl.constexpr,  # dq's partials added in a fixed order (ticket counters)
    NUM_STAGES: gl.constexpr,  # Q/dO tiles in flight
    ROTATE: gl.constexpr,  # DETERMINISTIC, full mask: the rotated walk (bwd_sm90.order)
    ACQUIRE_FIRST: gl.constexpr,
    TURN_BLOCKS: gl.constexpr,
    HAS_LOWER: gl.constexpr,  # a window's left side (LOWER_OFFSET); only under an upper bound (IS_CAUSAL)
    SOFTCAP: gl.constexpr,  # capped scores: softcap * tanh(s * scale / softcap)
    DQ_BUFFERS: gl.constexpr,  # dQ staging tiles a warpgroup (2: a store waits on the reduce two steps back)
    VARLEN: gl.constexpr,  # a packed batch of B sequences: tensors (1, H, T, D), a program's batch a sequence
    TENSOR_D: gl.constexpr,  # VARLEN: the tensors' D, the boxes' (HEAD_DIM) or fewer (a padded head dim)
):
    BLOCK: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(k_desc.block_type.shape[2] == KEYS, "a program's keys are one K tile")
    gl.static_assert(HEAD_DIM == 2 * DQ_COLS, "each warpgroup adds half of dQ's columns")
    gl.static_assert(IS_CAUSAL or not HAS_LOWER, "a window's left side comes with an upper bound")
    (batch, kv_head, pid_n, start_n, sequence, q_row0, k_row0, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET,
     n_blocks, m_start, m_mid, m_tail, m_end, rot) = _program(
        PAIRS, PAIRS_PER_GROUP, HEADS_KV, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, cu_q_ptr, cu_k_ptr, BLOCK,
        KEYS, TURN_BLOCKS, DETERMINISTIC, IS_CAUSAL, ROTATE, HAS_LOWER, VARLEN,
    )  # fmt: skip

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, HEAD_DIM], dtype)
    s_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, BLOCK], dtype)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, DQ_COLS], gl.float32)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK, HEAD_DIM], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [1, KEYS, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, KEYS, HEAD_DIM], kv_layout)
    pt_smem = gl.allocate_shared_memory(dtype, [2, KEYS, BLOCK], s_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, KEYS, BLOCK], s_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2 * DQ_BUFFERS, BLOCK, DQ_COLS], dq_layout)
    rows_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK], rows_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK], rows_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    qd_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    qd_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    pt_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pt_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2 * DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2 * DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready.index(0), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(qd_ready.index(i), count=1)  # the producer's expect; the TMA's bytes complete it
        mbarrier.init(qd_empty.index(i), count=2)  # free once both warpgroups release it
    for i in gl.static_range(2):
        mbarrier.init(pt_ready.index(i), count=1)  # warpgroup 0's P^T stored
        mbarrier.init(pt_free.index(i), count=1)  # ... and read by warpgroup 1
        mbarrier.init(ds_ready.index(i), count=1)  # warpgroup 1's dS^T stored
        mbarrier.init(ds_free.index(i), count=2)  # ... and both warpgroups' dQ products done with it
    for i in gl.static_range(2 * DQ_BUFFERS):
        mbarrier.init(dq_full.index(i), count=1)  # a warpgroup's dQ columns stored
        mbarrier.init(dq_empty.index(i), count=1)  # ... and read by the dQ warp's reduce

    # fmt: off
    gl.warp_specialize([
        (_wide_partition, (0, dk_desc, dv_desc, dk_ptr, dv_ptr, stride_dkh, stride_dks, stride_dvh,
                           stride_dvs, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, pt_smem,
                           ds_smem, dq_smem, kv_ready, qd_ready, qd_empty, pt_ready, pt_free, ds_ready,
                           ds_free, dq_full, dq_empty, batch, kv_head, start_n, k_row0, GROUP, m_start,
                           m_mid, m_tail, m_end, rot, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale, cap_log2,
                           scale, IS_CAUSAL, ROTATE, HAS_LOWER, SOFTCAP, VARLEN, TENSOR_D)),
        (_wide_partition, (1, dk_desc, dv_desc, dk_ptr, dv_ptr, stride_dkh, stride_dks, stride_dvh,
                           stride_dvs, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, pt_smem,
                           ds_smem, dq_smem, kv_ready, qd_ready, qd_empty, pt_ready, pt_free, ds_ready,
                           ds_free, dq_full, dq_empty, batch, kv_head, start_n, k_row0, GROUP, m_start,
                           m_mid, m_tail, m_end, rot, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale, cap_log2,
                           scale, IS_CAUSAL, ROTATE, HAS_LOWER, SOFTCAP, VARLEN, TENSOR_D)),
        (_load_partition, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, kv_ready,
                           qd_ready, qd_empty, batch, kv_head, q_row0, k_row0, KV_SHARE, start_n, GROUP,
                           m_start, m_end, rot, lse_ptr, delta_ptr, lse_smem, delta_smem, SEQ_Q, stride_lb,
                           stride_lh, stride_db, stride_dh)),
        (_dq_partition, (dq_desc, dq_smem, dq_full, dq_empty, sem_ptr, batch, sequence, q_row0, kv_head,
                         start_n, GROUP, m_start, m_end, gl.cdiv(SEQ_Q, BLOCK), n_blocks - 1, rot,
                         UPPER_OFFSET, stride_sb, stride_sh, KEYS, IS_CAUSAL, DETERMINISTIC, ROTATE, True,
                         ACQUIRE_FIRST, TURN_BLOCKS, 2)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    # fmt: on
