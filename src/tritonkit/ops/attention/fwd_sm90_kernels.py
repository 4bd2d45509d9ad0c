"""Attention forward for Hopper (sm_90) in Gluon, with FlashAttention-3's structure:
``O = softmax(scale * Q K^T + mask) V`` and the log-sum-exp of each query row, never storing the
Sq x Sk scores.

Maths. For query row i and the keys j it may attend to, with scores s_ij = scale * q_i . k_j:
    m_i = max_j s_ij,   l_i = sum_j exp(s_ij - m_i),   o_i = sum_j exp(s_ij - m_i) v_j / l_i,
    lse_i = m_i + log l_i.
The key blocks are walked once with the online softmax: when a block raises the running max from m
to m', the running sum and the accumulator are rescaled by exp(m - m'). Exponentials are exp2 with
scale * log2(e) folded into the scores: the exponent is one FFMA, s * qk_scale - m, per score.
The backward is ``tritonkit``'s (it needs only O and the lse this writes).

Masks (``flash_attention``'s conventions). Causal is aligned bottom-right: query i sees key j iff
j <= i + Sk - Sq (the last query sees every key). A row that sees no key (causal with Sq > Sk)
outputs 0 with lse -inf. Only the key blocks that a bound cuts are masked: the causal diagonal and
the ragged end of the keys, both at the end of a program's key range; blocks past the diagonal are
never loaded. GQA/MQA: query head h reads key/value head h // (Hq / Hkv).

Work. 4 * B * Hq * Sq * Sk * D FLOPs (two matmuls; about half when causal with Sq = Sk); HBM bytes
s * (|Q| + |K| + |V| + |O|) + 4 * B * Hq * Sq for the lse when K and V of a head stay in L2 while
its query blocks pass. At (4, 32, 4096, 128) that is 1.10 TFLOP over 537 MB, about 2000 FLOP a
byte, far above the H200's ~206 FLOP/byte ridge: compute-bound, the roofline is the tensor cores'
dense peak (989 TFLOP/s bf16; ~790 measured for a cuBLAS GEMM on the H200: 1.39 ms there).

Structure (one program = BLOCK_M = 128 query rows of one (batch, head); a one-dimensional grid in
``order``'s order, the blocks of a causal head longest first):
- a producer warp (24 registers) issues every TMA load: Q once (two 64-row tiles), then K and V
  block by block into a NUM_STAGES-deep ring, each stage guarded by a ready and an empty mbarrier
  (K and V have their own, so that Q K^T can start before V has landed);
- two consumer warpgroups (240 registers each, ``setmaxnreg``) of SPLIT_M = 64 rows each (a wgmma
  has M = 64 per warpgroup), sharing the K/V ring (its empty barriers count both). Each walks the
  keys with FA3's intra-warpgroup overlap: issue S_j = Q K_j^T, issue O += P_{j-1} V_{j-1} (P from
  registers), ``warpgroup_mma_wait(num_outstanding=1)`` (S_j done, PV may still run), release K_j,
  softmax of block j under the PV product, ``wait(0)``, release V_{j-1}, rescale O. The exp2 work
  of block j thus runs while the tensor cores do the PV product of block j - 1 (ptxas would hoist
  the full wait above the exponentials; PIN_SOFTMAX keeps them under it, see ``_attend_blocks``),
  and the two warpgroups' products and softmaxes interleave on the SM's tensor cores. P goes to 16
  bits two values an instruction in the order the PV product reads them (``to_pairs``);
- the epilogue divides by l, writes the lse with plain stores and O through shared memory (Q's
  buffer, free by then) and a TMA store that clips the rows past Sq.
Tensors are read through 4-D TMA descriptors over the (B, H, S, D) views, whose box of
(1, 1, rows, D) is bounded by each head's own S: rows past it load as zeros (and are masked for K,
harmless for Q and V) and are never stored, so ragged lengths need no padding.

``Config.persistent`` (the default over at most 8192 keys; a candidate otherwise)
launches one program an SM, each walking its tiles in ``_tile``'s numbering (causal: ``_walk``'s
pairs of a long and a short block): the K/V ring runs on across tiles, and O leaves
through buffers of its own so that the next tile's Q lands under the epilogue.

Soft-capping (SOFTCAP) replaces each score by softcap * tanh(scale * q . k / softcap) before the
masks and the softmax (``softcapped_tanh``). Sliding windows: a right side is an upper bound as the
causal mask's (IS_CAUSAL, UPPER_OFFSET), a left side a lower bound (HAS_LOWER, LOWER_OFFSET); a tile
walks only the key blocks its rows' window reaches, and masks the blocks either bound cuts. Packed
batches (VARLEN, persistent): each tile's sequence from cu_seqlens (``fwd_sm90_tiles._tile``), O
stored row by row, masked. Head dims: kernels of 64, 128 and 256; others run on the next one's with
TMA boxes past D (``fwd_sm90.PADDED_HEAD_DIMS``). Ping-pong between the consumer warpgroups is
written (PINGPONG, through an mbarrier pair) but off: it measured no gain on the H200.

References: Shah et al., "FlashAttention-3" (arXiv 2407.08608); Dao-AILab/flash-attention
``hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp``; Triton's Gluon tutorials (05-wgmma,
08-warp-specialization).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from tritonkit.jit import LN2, LOG2E
from tritonkit.ops.attention.fwd_sm90_tiles import _tile, _walk_range, _walk_tile
from tritonkit.ops.attention.sm90_elementwise import hide_outside, hide_past, softcapped_tanh, to_pairs

SPLIT_M = 64  # query rows a consumer warpgroup holds: a wgmma's M per warpgroup
# a consumer is a warpgroup; the first is the default partition (the launch's num_warps)
CONSUMER_WARPS = gl.constexpr(4)
PRODUCER_WARPS = gl.constexpr(1)  # one warp issues every TMA load (one thread does, in fact)
PRODUCER_REGS = gl.constexpr(24)  # its setmaxnreg budget (the consumers': fwd_sm90.CONSUMER_REGS)


# ---------------------------------------------------------------- kernels


@gluon.jit
def _load_tile(
    q_desc,
    k_desc,
    v_desc,  # TMA descriptors of q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D)
    q_smem,  # (NUM_CONSUMERS, SPLIT_M, D): each consumer's query tile
    k_smem,
    v_smem,  # (NUM_STAGES, BLOCK_N, D): the K and V rings
    q_ready,  # (NUM_CONSUMERS,) mbarriers: a consumer's Q tile landed
    q_free,  # PERSISTENT: (NUM_CONSUMERS,) mbarriers: a consumer is done with its Q tile
    k_ready,
    k_empty,
    v_ready,
    v_empty,  # (NUM_STAGES,) mbarriers: a ring stage landed / was released
    batch,
    head,
    kv_head,  # the tile's batch, query head and the key/value head it reads
    start_m,  # its first query row
    first_block,  # the first key block it reads
    n_blocks,  # key blocks it reads
    q_row0,
    k_row0,  # its sequence's first query row and first key in the tensors (0 but packed)
    kv_base,  # the ring's blocks loaded before this tile (its first block's turn in the ring)
    loads,  # the tiles whose Q was loaded before this one
    PERSISTENT: gl.constexpr,  # tiles follow each other in one program
):
    CONSUMERS: gl.constexpr = q_smem.type.shape[0]
    ROWS: gl.constexpr = q_smem.type.shape[1]
    NUM_STAGES: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[2]
    # a tile whose rows see no key loads nothing (its consumers wait on nothing)
    if n_blocks > 0:
        for c in gl.static_range(CONSUMERS):
            if PERSISTENT:  # the consumer's last tile is done reading its Q buffer
                mbarrier.wait(q_free.index(c), (loads & 1) ^ 1)
            mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                q_desc,
                [batch, head, q_row0 + start_m + c * ROWS, 0],
                q_ready.index(c),
                q_smem.index(c).reshape([1, 1, ROWS, HEAD_DIM]),
            )
    for j in range(n_blocks):
        stage = (kv_base + j) % NUM_STAGES
        phase = ((kv_base + j) // NUM_STAGES) & 1
        # the first pass over the ring waits on the phase before init, which counts as complete
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            k_desc,
            [batch, kv_head, k_row0 + (first_block + j) * BLOCK_N, 0],
            k_ready.index(stage),
            k_smem.index(stage).reshape([1, 1, BLOCK_N, HEAD_DIM]),
        )
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            v_desc,
            [batch, kv_head, k_row0 + (first_block + j) * BLOCK_N, 0],
            v_ready.index(stage),
            v_smem.index(stage).reshape([1, 1, BLOCK_N, HEAD_DIM]),
        )


@gluon.jit
def _load_partition(
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
    batch, head, kv_head, start_m, first_block, n_blocks, q_row0, k_row0,
):  # fmt: skip
    """The producer of a program of one tile (``_load_tile``'s arguments)."""
    _load_tile(
        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_ready, k_ready, k_empty, v_ready, v_empty,
        batch, head, kv_head, start_m, first_block, n_blocks, q_row0, k_row0, 0, 0, False,
    )  # fmt: skip


@gluon.jit
def _load_partition_persistent(
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, k_ready, k_empty, v_ready, v_empty,
    HEADS, BATCH_HEADS, HEADS_PER_GROUP, GROUP, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, cu_q_ptr, cu_k_ptr,
    IS_CAUSAL: gl.constexpr, HAS_LOWER: gl.constexpr, VARLEN: gl.constexpr,
):  # fmt: skip
    """The producer of a persistent program: its tiles in ``_walk_range``'s order."""
    BLOCK: gl.constexpr = q_smem.type.shape[0] * q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    m_blocks = gl.cdiv(SEQ_Q, BLOCK)
    kv_base = 0
    loads = 0
    first, last, stride = _walk_range(m_blocks, BATCH_HEADS, IS_CAUSAL)
    for step in range(first, last, stride):
        batch, head, kv_head, start_m, first_block, n_blocks, _lead, _full, seq = _walk_tile(
            step, HEADS, BATCH_HEADS, HEADS_PER_GROUP, GROUP, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET,
            cu_q_ptr, cu_k_ptr, BLOCK, BLOCK_N, IS_CAUSAL, HAS_LOWER, VARLEN,
        )  # fmt: skip
        q_row0, k_row0, _seq_q, _seq_k, _upper, _lower = seq
        _load_tile(
            q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, k_ready, k_empty, v_ready,
            v_empty, batch, head, kv_head, start_m, first_block, n_blocks, q_row0, k_row0, kv_base, loads,
            True,
        )  # fmt: skip
        kv_base += n_blocks
        loads += gl.where(n_blocks > 0, 1, 0)


@gluon.jit
def _online_softmax(
    s, m_i, l_i, rows, start_n, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale, cap_log2, MASKED: gl.constexpr,
    IS_CAUSAL: gl.constexpr, HAS_LOWER: gl.constexpr, SOFTCAP: gl.constexpr,
):  # fmt: skip
    """One key block's step of the online softmax on its raw scores ``s`` = q . k: (p, m, l, alpha),
    p = exp2(s * qk_scale - m) unnormalised, m the new running max in log2 units, l the new running
    sum, alpha = exp2(m_old - m) the factor the accumulator takes. MASKED blocks hide keys past
    SEQ_K and, causal, keys past each row's diagonal (j <= i + UPPER_OFFSET), and HAS_LOWER those
    below a window's lower bound (j >= i + LOWER_OFFSET); a row that has seen no
    key keeps m = -inf, and exp2 then takes 0 in its place so that -inf - -inf does not make NaN.
    The max is taken on the raw scores (qk_scale > 0: a hidden score, -inf raw, stays -inf scaled)
    and the exponent is a single FFMA. SOFTCAP: the scores in log2 units are cap_log2 * tanh(s *
    qk_scale) (``softcapped_tanh``), hidden after the tanh (which takes -inf to -1), and the max
    taken on the tanh (cap_log2 > 0)."""
    if SOFTCAP:  # the exponent is tanh(s * qk_scale) * cap_log2: the factor's place is qk_scale's
        s = softcapped_tanh(s, qk_scale, qk_scale * (2.0 * LOG2E))
        unit = cap_log2
    else:
        unit = qk_scale
    if MASKED:
        BLOCK_N: gl.constexpr = s.type.shape[1]
        # (the keys' indices from the block's start: computed a block, not held across the loop)
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        if IS_CAUSAL:  # one compare a score: key j < min(i + UPPER_OFFSET + 1, SEQ_K)
            bound = gl.minimum(rows + (UPPER_OFFSET + 1), SEQ_K)
        else:
            bound = rows * 0 + SEQ_K
        if HAS_LOWER:
            s = hide_outside(s, cols[None, :], (rows + LOWER_OFFSET)[:, None], bound[:, None])
        else:
            s = hide_past(s, cols[None, :], bound[:, None])
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * unit)
    if MASKED:
        m_exp = gl.where(m_new == -float("inf"), 0.0, m_new)
    else:  # every row sees a key of an unmasked block
        m_exp = m_new
    p = gl.exp2(s * unit - m_exp[:, None])
    alpha = gl.exp2(m_i - m_exp)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _attend_blocks(
    o,
    p,
    m_i,
    l_i,
    q,
    ring,  # (k_smem, v_smem, k_ready, k_empty, v_ready, v_empty): see _load_tile
    pin,
    my_turn,
    next_turn,
    turn0,
    rows,
    first,
    last,
    kv_base,
    first_block,
    SEQ_K,
    UPPER_OFFSET,
    LOWER_OFFSET,
    qk_scale,
    cap_log2,
    MASKED: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_LOWER: gl.constexpr,
    PIN_SOFTMAX: gl.constexpr,
    PINGPONG: gl.constexpr,
    SOFTCAP: gl.constexpr,
):
    """Key blocks [first, last) of a consumer's tile, whose block 0 is the keys' block first_block (the
    ring's blocks kv_base + first, ...), one block
    behind for PV: on entry ``p`` holds block first - 1's probabilities (in the A-operand layout)
    whose PV product is still to do; on exit, block last - 1's. Returns (o, p, m_i, l_i). ``pin``:
    this consumer's (SPLIT_M,) fp32 scratch in shared memory, written and never read
    (PIN_SOFTMAX). ``my_turn``/``next_turn``: PINGPONG's mbarriers; block j is this consumer's
    (turn0 + j)-th turn (the tile's prologue, S_0, its turn0-th)."""
    k_smem, v_smem, k_ready, k_empty, v_ready, v_empty = ring
    NUM_STAGES: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    ROWS: gl.constexpr = q.type.shape[0]
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o.type.layout)
    for j in range(first, last):
        stage = (kv_base + j) % NUM_STAGES
        prev = (kv_base + j - 1) % NUM_STAGES
        # S_j = Q K_j^T, then O += P_{j-1} V_{j-1}: two wgmma groups in flight
        mbarrier.wait(k_ready.index(stage), ((kv_base + j) // NUM_STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(my_turn, (turn0 + j) & 1)
        s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), ((kv_base + j - 1) // NUM_STAGES) & 1)
        o = warpgroup_mma(p, v_smem.index(prev), o, is_async=True)
        if PINGPONG:  # both products issued: the other consumer's turn
            mbarrier.arrive(next_turn, count=1)
        # the older group (S_j) done, PV_{j-1} may still run: block j's softmax overlaps it
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        mbarrier.arrive(k_empty.index(stage), count=1)
        p_j, m_i, l_i, alpha = _online_softmax(
            s, m_i, l_i, rows, (first_block + j) * BLOCK_N, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale,
            cap_log2, MASKED, IS_CAUSAL, HAS_LOWER, SOFTCAP,
        )  # fmt: skip
        p_next = gl.convert_layout(to_pairs(p_j, p.dtype), p.type.layout)
        # P_{j-1} is read from registers by the product in flight: keep it alive until it is done
        if PIN_SOFTMAX:
            # ptxas schedules the full wait as early as it can, above this block's exponentials,
            # which then wait for PV_{j-1} instead of running under it; a shared-memory store of l
            # (which needs every exponential) stays above the wait and keeps them there
            pin.store(l_i)
        o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))
        mbarrier.arrive(v_empty.index(prev), count=1)
        o = o * gl.convert_layout(alpha, row_o)[:, None]
        p = p_next
    return o, p, m_i, l_i


@gluon.jit
def _consume_tile(
    cid: gl.constexpr,  # which consumer warpgroup: rows start_m + cid * SPLIT_M, ...
    o_desc,  # TMA descriptor of the output (B, Hq, Sq, D)
    lse_ptr,  # fp32 log-sum-exp (natural log), (B, Hq, Sq), strides stride_lb, stride_lh, 1
    q_smem,
    o_smem,  # PERSISTENT: (NUM_CONSUMERS, SPLIT_M, D), the output tiles (else Q's buffers carry O)
    k_smem,
    v_smem,
    q_ready,
    q_free,
    k_ready,
    k_empty,
    v_ready,
    v_empty,  # see _load_partition
    pin_smem,  # (NUM_CONSUMERS, SPLIT_M) fp32 scratch: see _attend_blocks
    turn_smem,  # (NUM_CONSUMERS,) mbarriers, PINGPONG: consumer c may issue its products
    batch,
    head,
    start_m,  # this program's batch, query head and first query row
    first_block,  # the first key block it reads
    n_blocks,  # key blocks it reads
    n_lead,  # HAS_LOWER: its blocks before the n_lead-th are cut by the window's lower bound
    n_full,  # its blocks from the n_full-th are cut by an upper bound (the others every row sees whole)
    kv_base,  # the ring's blocks consumed before this tile
    loads,  # the tiles whose Q was loaded before this one
    q_row0,  # its sequence's first query row in the tensors (0 but packed)
    o_ptr,
    stride_oh,
    stride_os,  # VARLEN: the output (1, Hq, T, D) and its strides, for masked stores
    SEQ_Q,
    SEQ_K,  # query rows and keys of a head (of the tile's sequence)
    UPPER_OFFSET,  # IS_CAUSAL: row i sees key j iff j <= i + UPPER_OFFSET (Sk - Sq, bottom-right)
    LOWER_OFFSET,  # HAS_LOWER: ... and j >= i + LOWER_OFFSET (a window's lower bound)
    stride_lb,
    stride_lh,  # elements between batches and heads of the lse
    qk_scale,  # scale * log2(e); SOFTCAP: scale / softcap, the tanh's argument a unit of q . k
    cap_log2,  # SOFTCAP: softcap * log2(e) (``softcapped_tanh``)
    IS_CAUSAL: gl.constexpr,  # an upper bound: the causal mask, or a window's right side
    PIN_SOFTMAX: gl.constexpr,  # keep the exponentials between the two waits (see _attend_blocks)
    PINGPONG: gl.constexpr,  # the consumers take turns to issue their products
    PERSISTENT: gl.constexpr,  # tiles follow each other in one program
    SOFTCAP: gl.constexpr,  # the scores are soft-capped
    HAS_LOWER: gl.constexpr,  # a window's lower bound
    VARLEN: gl.constexpr,  # a packed batch: O leaves by masked stores (a box past the sequence's rows
    # would write the next sequence's)
    TENSOR_D: gl.constexpr,  # VARLEN: O's head dim, HEAD_DIM or fewer (a padded one: its columns masked)
):
    """One consumer's part of a tile: its 64 rows' output and lse."""
    ROWS: gl.constexpr = q_smem.type.shape[1]
    NUM_STAGES: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    # P feeds the PV wgmma from registers (its A operand): no trip through shared memory
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q = q_smem.index(cid)
    pin = pin_smem.index(cid)
    # turns go round the consumers: each issues one step's products (both consumers walk the same
    # n_blocks + 1 steps a tile), then hands the turn on; turn0 of them were taken by earlier tiles
    my_turn = turn_smem.index(cid)
    next_turn = turn_smem.index((cid + 1) % turn_smem.type.shape[0])
    turn0 = kv_base + loads
    rows = start_m + cid * ROWS + gl.arange(0, ROWS, layout=row_s)
    o = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([ROWS], -float("inf"), gl.float32, row_s)
    l_i = gl.zeros([ROWS], gl.float32, row_s)
    if n_blocks > 0:
        mbarrier.wait(q_ready.index(cid), loads & 1)
        # block 0 alone (nothing to overlap yet), masked: cheap, and right whether or not a bound cuts it
        first = kv_base % NUM_STAGES
        mbarrier.wait(k_ready.index(first), (kv_base // NUM_STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(my_turn, turn0 & 1)
        s = warpgroup_mma(
            q,
            k_smem.index(first).permute((1, 0)),
            gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
            use_acc=False,
            is_async=True,
        )
        if PINGPONG:
            mbarrier.arrive(next_turn, count=1)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(k_empty.index(first), count=1)
        p, m_i, l_i, _ = _online_softmax(
            s, m_i, l_i, rows, first_block * BLOCK_N, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale, cap_log2,
            True, IS_CAUSAL, HAS_LOWER, SOFTCAP,
        )  # fmt: skip
        p = gl.convert_layout(to_pairs(p, dtype), p_layout)
        # the blocks every row sees whole, then those a bound cuts (the diagonal, the ragged end);
        # with a window's lower bound, the blocks it cuts first
        ring = (k_smem, v_smem, k_ready, k_empty, v_ready, v_empty)
        # fmt: off
        if HAS_LOWER:
            lead_end = gl.minimum(gl.maximum(n_lead, 1), n_blocks)
            o, p, m_i, l_i = _attend_blocks(
                o, p, m_i, l_i, q, ring, pin, my_turn, next_turn, turn0, rows, 1, lead_end, kv_base,
                first_block, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale, cap_log2, True, IS_CAUSAL,
                HAS_LOWER, PIN_SOFTMAX, PINGPONG, SOFTCAP)
            full_end = gl.minimum(gl.maximum(n_full, lead_end), n_blocks)
            o, p, m_i, l_i = _attend_blocks(
                o, p, m_i, l_i, q, ring, pin, my_turn, next_turn, turn0, rows, lead_end, full_end, kv_base,
                first_block, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale, cap_log2, False, IS_CAUSAL,
                HAS_LOWER, PIN_SOFTMAX, PINGPONG, SOFTCAP)
        else:
            o, p, m_i, l_i = _attend_blocks(
                o, p, m_i, l_i, q, ring, pin, my_turn, next_turn, turn0, rows, 1, n_full, kv_base,
                first_block, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale, cap_log2, False, IS_CAUSAL,
                HAS_LOWER, PIN_SOFTMAX, PINGPONG, SOFTCAP)
            full_end = gl.maximum(n_full, 1)
        o, p, m_i, l_i = _attend_blocks(
            o, p, m_i, l_i, q, ring, pin, my_turn, next_turn, turn0, rows, full_end, n_blocks, kv_base,
            first_block, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, qk_scale, cap_log2, True, IS_CAUSAL, HAS_LOWER,
            PIN_SOFTMAX, PINGPONG, SOFTCAP)
        # fmt: on
        # the last block's PV product
        last = (kv_base + n_blocks - 1) % NUM_STAGES
        mbarrier.wait(v_ready.index(last), ((kv_base + n_blocks - 1) // NUM_STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(my_turn, (turn0 + n_blocks) & 1)
        o = warpgroup_mma(p, v_smem.index(last), o, is_async=True)
        if PINGPONG:  # the second consumer's last hand-on opens the next tile (unwaited after the last)
            mbarrier.arrive(next_turn, count=1)
        o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))
        mbarrier.arrive(v_empty.index(last), count=1)
        if PERSISTENT:  # every product that read Q is done: the next tile's may land
            mbarrier.arrive(q_free.index(cid), count=1)

    # l = 0 only for a row that sees no key: its output is 0, its lse -inf
    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    o = o / gl.convert_layout(l_safe, row_o)[:, None]
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * LN2, -float("inf"))
    # 64-bit (the strides are): B * H * Sq may pass 2^31
    lse_rows = lse_ptr + batch * stride_lb + head * stride_lh + q_row0
    gl.store(lse_rows + rows, lse, mask=rows < SEQ_Q)
    if VARLEN:
        o_rows = gl.convert_layout(rows, row_o)
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = o_ptr + head * stride_oh + (q_row0 + o_rows)[:, None] * stride_os + cols[None, :]
        inside = (o_rows < SEQ_Q)[:, None]
        if TENSOR_D < HEAD_DIM:  # a padded head dim: the columns past O's own are the next head's
            inside = inside & (cols < TENSOR_D)[None, :]
        gl.store(o_ptrs, o.to(dtype), mask=inside)
    else:
        if PERSISTENT:
            # O goes out through its own buffer, once the last tile's store has read it; the store
            # runs on under the next tile
            out = o_smem.index(cid)
            tma.store_wait(pendings=0)
        else:
            # O goes out through this consumer's Q buffer: every product that read it has been waited
            out = q_smem.index(cid)
        out.store(o.to(dtype))
        fence_async_shared()  # the generic-proxy stores before the TMA engine reads them
        tma.async_copy_shared_to_global(
            o_desc, [batch, head, start_m + cid * ROWS, 0], out.reshape([1, 1, ROWS, HEAD_DIM])
        )
        if not PERSISTENT:
            tma.store_wait(pendings=0)


@gluon.jit
def _softmax_partition(
    cid: gl.constexpr, o_desc, o_ptr, stride_oh, stride_os, lse_ptr, q_smem, k_smem, v_smem, q_ready, k_ready,
    k_empty, v_ready, v_empty, pin_smem, turn_smem, batch, head, start_m, first_block, n_blocks, n_lead,
    n_full, q_row0, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, stride_lb, stride_lh, qk_scale, cap_log2,
    IS_CAUSAL: gl.constexpr, PIN_SOFTMAX: gl.constexpr, PINGPONG: gl.constexpr, SOFTCAP: gl.constexpr,
    HAS_LOWER: gl.constexpr, VARLEN: gl.constexpr, TENSOR_D: gl.constexpr,
):  # fmt: skip
    """A consumer of a program of one tile (``_consume_tile``'s arguments; VARLEN, the tile's
    sequence's rows, lengths and bounds)."""
    _consume_tile(
        cid, o_desc, lse_ptr, q_smem, q_smem, k_smem, v_smem, q_ready, q_ready, k_ready, k_empty, v_ready,
        v_empty, pin_smem, turn_smem, batch, head, start_m, first_block, n_blocks, n_lead, n_full, 0, 0,
        q_row0, o_ptr, stride_oh, stride_os, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, stride_lb, stride_lh,
        qk_scale, cap_log2, IS_CAUSAL, PIN_SOFTMAX, PINGPONG, False, SOFTCAP, HAS_LOWER, VARLEN, TENSOR_D,
    )  # fmt: skip


@gluon.jit
def _softmax_partition_persistent(
    cid: gl.constexpr, o_desc, o_ptr, stride_oh, stride_os, lse_ptr, q_smem, o_smem, k_smem, v_smem, q_ready,
    q_free, k_ready, k_empty, v_ready, v_empty, pin_smem, turn_smem, HEADS, BATCH_HEADS, HEADS_PER_GROUP,
    GROUP, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, cu_q_ptr, cu_k_ptr, stride_lb, stride_lh, qk_scale,
    cap_log2, IS_CAUSAL: gl.constexpr, PIN_SOFTMAX: gl.constexpr, PINGPONG: gl.constexpr,
    SOFTCAP: gl.constexpr, HAS_LOWER: gl.constexpr, VARLEN: gl.constexpr, TENSOR_D: gl.constexpr,
):  # fmt: skip
    """A consumer of a persistent program: the producer's tiles, in its order."""
    BLOCK: gl.constexpr = q_smem.type.shape[0] * q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    m_blocks = gl.cdiv(SEQ_Q, BLOCK)
    kv_base = 0
    loads = 0
    first, last, stride = _walk_range(m_blocks, BATCH_HEADS, IS_CAUSAL)
    for step in range(first, last, stride):
        batch, head, _kv_head, start_m, first_block, n_blocks, n_lead, n_full, seq = _walk_tile(
            step, HEADS, BATCH_HEADS, HEADS_PER_GROUP, GROUP, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET,
            cu_q_ptr, cu_k_ptr, BLOCK, BLOCK_N, IS_CAUSAL, HAS_LOWER, VARLEN,
        )  # fmt: skip
        q_row0, _k_row0, seq_q, seq_k, upper, lower = seq
        _consume_tile(
            cid, o_desc, lse_ptr, q_smem, o_smem, k_smem, v_smem, q_ready, q_free, k_ready, k_empty,
            v_ready, v_empty, pin_smem, turn_smem, batch, head, start_m, first_block, n_blocks, n_lead,
            n_full, kv_base, loads, q_row0, o_ptr, stride_oh, stride_os, seq_q, seq_k, upper, lower,
            stride_lb, stride_lh, qk_scale, cap_log2, IS_CAUSAL, PIN_SOFTMAX, PINGPONG, True, SOFTCAP,
            HAS_LOWER, VARLEN, TENSOR_D,
        )  # fmt: skip
        kv_base += n_blocks
        loads += gl.where(n_blocks > 0, 1, 0)
    tma.store_wait(pendings=0)  # the last tile's output written before the program ends


@gluon.jit
def _attn_fwd_sm90_kernel(
    q_desc,  # TMA descriptor of q, (B, Hq, Sq, D), box (1, 1, SPLIT_M, D)
    k_desc,  # ... of k, (B, Hkv, Sk, D), box (1, 1, BLOCK_N, D)
    v_desc,  # ... of v, like k
    o_desc,  # ... of the output, like q
    o_ptr,  # VARLEN: the output (1, Hq, T, D), its strides between heads and rows (masked stores)
    stride_oh: gl.int64,
    stride_os: gl.int64,
    lse_ptr,  # fp32 out: log-sum-exp of each row's scores (natural log), (B, Hq, Sq), strides stride_l*, 1
    # elements between batches and heads of the lse; 64-bit, so that the row's offset needs no
    # widening, which ptxas hoisted to the kernel's entry and spilled across the register
    # reallocation (2 spills in the persistent causal walk)
    stride_lb: gl.int64,
    stride_lh: gl.int64,
    HEADS,  # query heads
    BATCH_HEADS,  # B * HEADS
    HEADS_PER_GROUP,  # the order of programs (``order``): (batch, head)s whose blocks run together
    GROUP,  # query heads per key/value head (1 without GQA)
    SEQ_Q,  # query rows of a head (VARLEN: the longest sequence's)
    SEQ_K,  # keys of a head (VARLEN: the longest sequence's)
    UPPER_OFFSET,  # IS_CAUSAL: row i sees key j iff j <= i + UPPER_OFFSET (VARLEN: a window's side)
    LOWER_OFFSET,  # HAS_LOWER: ... and j >= i + LOWER_OFFSET (VARLEN: a window's side)
    cu_q_ptr,  # VARLEN: int32 (B + 1,) cu_seqlens of the queries: sequence b's rows cu_q[b]:cu_q[b + 1]
    cu_k_ptr,  # ... of the keys
    qk_scale,  # scale * log2(e): the exponent in log2 units is q . k * qk_scale (SOFTCAP: scale / softcap)
    cap_log2,  # SOFTCAP: softcap * log2(e); the exponent is cap_log2 * tanh(q . k * qk_scale)
    IS_CAUSAL: gl.constexpr,  # an upper bound: the causal mask, or a window's right side
    NUM_STAGES: gl.constexpr,  # K/V tiles in flight
    PIN_SOFTMAX: gl.constexpr,  # keep the exponentials under the PV product (see _attend_blocks)
    PINGPONG: gl.constexpr,  # the consumers take turns to issue their products
    CONSUMERS: gl.constexpr,  # consumer warpgroups of ROWS query rows
    CONSUMER_REGS: gl.constexpr,  # their setmaxnreg budget
    PERSISTENT: gl.constexpr,  # a program walks tiles in _walk_range's order (two consumers)
    SOFTCAP: gl.constexpr,  # the scores are soft-capped (``softcapped_tanh``)
    HAS_LOWER: gl.constexpr,  # a window's lower bound
    VARLEN: gl.constexpr,  # a packed batch of B sequences (persistent only): tensors (1, H, T, D)
    TENSOR_D: gl.constexpr,  # VARLEN: the tensors' D, the boxes' (HEAD_DIM) or fewer (a padded head dim)
):
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    BLOCK: gl.constexpr = CONSUMERS * ROWS
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(ROWS == 64, "a consumer warpgroup's wgmma has 64 rows")
    gl.static_assert(k_desc.block_type.shape[3] == HEAD_DIM, "q and k share D")

    # One program a tile (``_tile``; VARLEN, the tile's sequence's rows, lengths and bounds), or,
    # PERSISTENT, a tile after another
    batch, head, kv_head, start_m, first_block, n_blocks, n_lead, n_full, seq = _tile(
        gl.program_id(0), HEADS, BATCH_HEADS, HEADS_PER_GROUP, GROUP, SEQ_Q, SEQ_K, UPPER_OFFSET,
        LOWER_OFFSET, cu_q_ptr, cu_k_ptr, BLOCK, BLOCK_N, IS_CAUSAL, HAS_LOWER, VARLEN and not PERSISTENT,
    )  # fmt: skip
    q_row0, k_row0, seq_q, seq_k, upper, lower = seq

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    pin_smem = gl.allocate_shared_memory(gl.float32, [CONSUMERS, ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    turn_smem = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(turn_smem.index(i), count=1)  # one arrive (one elected thread of a warpgroup) a turn
    if PINGPONG:
        mbarrier.arrive(turn_smem.index(0), count=1)  # the first consumer has the first turn
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)  # the producer's expect; the TMA's bytes complete it
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)  # a stage is free once every consumer released it
        mbarrier.init(v_empty.index(i), count=CONSUMERS)

    # (the partitions' arguments are spelled out: a tuple bound to a name turns its constexprs into
    # tensors); the consumers' argument lists side by side: the same but for the index
    # fmt: off
    gl.static_assert(CONSUMERS == 2, "two consumer warpgroups (FA3's three at D = 64 measured slower)")
    if PERSISTENT:
        # O's own buffers (Q's take the next tile's rows while O leaves), and a barrier a consumer
        # saying its Q buffer is free
        o_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, HEAD_DIM], q_layout)
        q_free = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(q_free.index(i), count=1)
        gl.warp_specialize([
            (_softmax_partition_persistent, (0, o_desc, o_ptr, stride_oh, stride_os, lse_ptr, q_smem, o_smem,
                                             k_smem, v_smem, q_ready, q_free, k_ready, k_empty, v_ready,
                                             v_empty, pin_smem, turn_smem, HEADS, BATCH_HEADS,
                                             HEADS_PER_GROUP, GROUP, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET,
                                             cu_q_ptr, cu_k_ptr, stride_lb, stride_lh, qk_scale, cap_log2,
                                             IS_CAUSAL, PIN_SOFTMAX, PINGPONG, SOFTCAP, HAS_LOWER, VARLEN,
                                             TENSOR_D)),
            (_softmax_partition_persistent, (1, o_desc, o_ptr, stride_oh, stride_os, lse_ptr, q_smem, o_smem,
                                             k_smem, v_smem, q_ready, q_free, k_ready, k_empty, v_ready,
                                             v_empty, pin_smem, turn_smem, HEADS, BATCH_HEADS,
                                             HEADS_PER_GROUP, GROUP, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET,
                                             cu_q_ptr, cu_k_ptr, stride_lb, stride_lh, qk_scale, cap_log2,
                                             IS_CAUSAL, PIN_SOFTMAX, PINGPONG, SOFTCAP, HAS_LOWER, VARLEN,
                                             TENSOR_D)),
            (_load_partition_persistent, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free,
                                          k_ready, k_empty, v_ready, v_empty, HEADS, BATCH_HEADS,
                                          HEADS_PER_GROUP, GROUP, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET,
                                          cu_q_ptr, cu_k_ptr, IS_CAUSAL, HAS_LOWER, VARLEN)),
        ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_softmax_partition, (0, o_desc, o_ptr, stride_oh, stride_os, lse_ptr, q_smem, k_smem, v_smem,
                                  q_ready, k_ready, k_empty, v_ready, v_empty, pin_smem, turn_smem, batch,
                                  head, start_m, first_block, n_blocks, n_lead, n_full, q_row0, seq_q, seq_k,
                                  upper, lower, stride_lb, stride_lh, qk_scale, cap_log2, IS_CAUSAL,
                                  PIN_SOFTMAX, PINGPONG, SOFTCAP, HAS_LOWER, VARLEN, TENSOR_D)),
            (_softmax_partition, (1, o_desc, o_ptr, stride_oh, stride_os, lse_ptr, q_smem, k_smem, v_smem,
                                  q_ready, k_ready, k_empty, v_ready, v_empty, pin_smem, turn_smem, batch,
                                  head, start_m, first_block, n_blocks, n_lead, n_full, q_row0, seq_q, seq_k,
                                  upper, lower, stride_lb, stride_lh, qk_scale, cap_log2, IS_CAUSAL,
                                  PIN_SOFTMAX, PINGPONG, SOFTCAP, HAS_LOWER, VARLEN, TENSOR_D)),
            (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty,
                               v_ready, v_empty, batch, head, kv_head, start_m, first_block, n_blocks, q_row0,
                               k_row0)),
        ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    # fmt: on
