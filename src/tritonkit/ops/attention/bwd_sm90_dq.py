"""Attention backward for Hopper (sm_90) in Gluon: the dQ warp of ``bwd_sm90_kernels``' kernel, its
reduce-adds and its turns.

Each step the consumers hand over their dQ columns in shared memory; this warp adds them into the
fp32 accumulator in global memory with TMA reduce-adds (``cp.reduce.async.bulk.tensor ... add``)
and frees the staging buffers once the reduces have read them. In the deterministic mode it also
keeps the order of the adds: every (batch, query head, group of ``Config.turn_blocks`` query blocks)
has a ticket counter, and a key block's adds wait for its turn there (``_turn``: ascending key
blocks for a full mask, the order of arrival on a rotated walk, FA3's shortest-first order under a
causal one) and advance it once they have completed. The consumers never wait on a ticket, only
on their staging buffer (``bwd_sm90_kernels``' docstring has the whole kernel).
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma


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
    follows in the generic proxy (a releasing atomic after it publishes them: its release orders
    them, so no full fence is needed here). ``token``: any int32 tensor (inline assembly needs an
    operand)."""
    return gl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.b32 $0, $1;",
        "=r,r",
        [token],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _starts_up_to(x, blocks, m_count):
    """How many of ``blocks`` key blocks start their walk (ROTATE) at a group of query blocks <= x
    (>= -1), of ``m_count``: block n starts at n * m_count // blocks."""
    return gl.minimum(blocks, gl.cdiv((x + 1) * blocks, m_count))


@gluon.jit
def _rotated_rank_base(key_block, rot_g, blocks, g_count):
    """ROTATE: the part of ``_turn``'s rank that is the same at every group (once a program: the
    divisions in the turns' branch stay there, a division being no instruction to run ahead of its
    condition, and their values held across the consumers' code cost those 60-odd values on the
    stack)."""
    return key_block - _starts_up_to(rot_g, blocks, g_count) - _starts_up_to(rot_g - 1, blocks, g_count)


@gluon.jit
def _turn(
    g,
    g_last_block,
    key_block,
    rot_g,
    rank_base,
    n_last,
    g_count,
    UPPER_OFFSET,
    BLOCK: gl.constexpr,
    KEYS: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    ROTATE: gl.constexpr,
):
    """Deterministic mode: the rank of key block ``key_block`` among the key blocks that add into
    group ``g`` of query blocks (a turn's blocks, ``Config.turn_blocks``; ``g_last_block`` its last,
    ``g_count`` the groups; 0: the first to add). Key blocks ascending for a full mask; causal,
    descending from the last one the group sees (FA3's shortest-first order), the order in which a
    lockstep walk of ascending query blocks reaches it; ROTATE, the order of arrival."""
    if ROTATE:
        # key block n starts its walk at group rot_g = n * g_count // (n_last + 1), so it reaches
        # group g at step t = (g - rot_g) mod g_count; turns in the order of arrival, ties (equal
        # starts) by key block: the rank counts the key blocks that start in the t groups up to g,
        # and those of equal start before n (starts ascend with n, so each set is a range of key
        # blocks). Those of the groups up to g, S(g) - S(rot_g), plus, where the walk wrapped (g <
        # rot_g), every block; those of equal start before n, n - S(rot_g - 1) (S:
        # ``_starts_up_to``): all but S(g) and the wrap are ``rank_base``
        rank = _starts_up_to(g, n_last + 1, g_count) + gl.where(g < rot_g, n_last + 1, 0) + rank_base
    elif IS_CAUSAL:
        # (the group's last block's last row counted as m * BLOCK + BLOCK - 1 even past Sq: the
        # launcher's m_start counts it so)
        rank = gl.minimum((g_last_block * BLOCK + BLOCK - 1 + UPPER_OFFSET) // KEYS, n_last) - key_block
    else:
        rank = key_block
    return rank


@gluon.jit
def _dq_partition(
    dq_desc,  # TMA descriptor of the fp32 dq accumulator (B, Hq, Sq, D), box (1, 1, BLOCK_M, DQ_COLS)
    dq_smem,  # (DQ_BUFFERS x CONSUMERS, BLOCK_M, DQ_COLS) fp32: each consumer's dQ columns of a step
    dq_full,
    dq_empty,  # (DQ_BUFFERS x CONSUMERS,) mbarriers: a consumer's columns stored / read by the reduce
    sem_ptr,
    batch,  # the tensors' batch (0 but packed)
    sequence,  # the tickets' (the batch, or the packed sequence)
    q_row0,  # the sequence's first query row in the tensors (0 but packed)
    kv_head,
    start_n,
    GROUP,
    m_start,
    m_end,
    q_blocks,  # the head's query blocks (of its sequence, packed), a window's trim of m_end aside
    n_last,
    rot,
    UPPER_OFFSET,
    stride_sb,
    stride_sh,
    KEYS: gl.constexpr,  # keys a program
    IS_CAUSAL: gl.constexpr,
    DETERMINISTIC: gl.constexpr,
    ROTATE: gl.constexpr,
    SHARED_DQ: gl.constexpr,
    ACQUIRE_FIRST: gl.constexpr,
    TURN_BLOCKS: gl.constexpr,
    CONSUMERS: gl.constexpr,  # consumer warpgroups a program
):
    """The dQ warp: adds each step's dQ columns of both consumers into the fp32 accumulator by TMA
    reduce-add, walking the query blocks as the consumers do, the step's reduces issued together
    (one wait for their reads frees both staging buffers). DETERMINISTIC: a step's adds wait for
    the key block's turn at the query block's ticket counter (``_turn``; polled before the
    consumers are done, so that a turn already reached costs no round trip after them) and, once
    they have completed, advance it; without SHARED_DQ both partials add the same columns, the
    second once the first has completed. A turn covers TURN_BLOCKS query blocks (a ticket counter
    a group of them): taken at the walk's first block of the group, held while each block's adds
    are issued as its partials come, passed on once the last block's have completed, so that the
    turn's two round trips are paid once a group. The consumers never wait on a ticket: only on
    their staging buffer."""
    BUFFERS: gl.constexpr = dq_smem.type.shape[0] // CONSUMERS
    BLOCK: gl.constexpr = dq_smem.type.shape[1]
    DQ_COLS: gl.constexpr = dq_smem.type.shape[2]
    n_tiles = m_end - m_start
    key_block = start_n // KEYS
    g_count = gl.cdiv(m_end, TURN_BLOCKS)
    rot_g = rot // TURN_BLOCKS
    rank_base = key_block * 0
    if DETERMINISTIC and ROTATE:
        rank_base = _rotated_rank_base(key_block, rot_g, n_last + 1, g_count)
    token = gl.full([1], 0, gl.int32, gl.BlockedLayout([1], [32], [1], [0]))
    for step in range(GROUP * n_tiles):
        head = kv_head * GROUP + step // n_tiles
        idx = step % n_tiles
        m = m_start + idx
        if ROTATE:  # (m + rot) % m_end without a division: m and rot are below m_end
            m = m + rot
            m = gl.where(m >= m_end, m - m_end, m)
        g = m // TURN_BLOCKS  # the turn's group of query blocks
        ticket = sem_ptr + (sequence.to(gl.int64) * stride_sb + head.to(gl.int64) * stride_sh + g)
        # a walk enters a group at its first block (a rotated walk starts on one) or where it starts
        # (a causal walk may start inside one), and leaves it at its last block or where it ends
        if DETERMINISTIC and ((idx == 0) | (m % TURN_BLOCKS == 0)):
            if TURN_BLOCKS == 1:
                g_last_block = m
            else:  # the head's last block, not the walk's: a window's left side ends the walks at
                # different blocks, and every key block that adds into g must rank it alike
                g_last_block = gl.minimum(g * TURN_BLOCKS + TURN_BLOCKS, q_blocks) - 1
            rank = _turn(
                g, g_last_block, key_block, rot_g, rank_base, n_last, g_count, UPPER_OFFSET, BLOCK, KEYS,
                IS_CAUSAL, ROTATE,
            )  # fmt: skip
            _take_turn(ticket, rank, ACQUIRE_FIRST)
        for c in gl.static_range(CONSUMERS):
            mbarrier.wait(dq_full.index(step % BUFFERS * CONSUMERS + c), (step // BUFFERS) & 1)
            if DETERMINISTIC and not SHARED_DQ and c > 0:
                _bulk_wait_all(token)  # the first partial added before the second adds the same columns
            _tma_reduce_add(
                dq_desc,
                [batch, head, q_row0 + m * BLOCK, c * DQ_COLS if SHARED_DQ else 0],
                dq_smem.index(step % BUFFERS * CONSUMERS + c).reshape([1, 1, BLOCK, DQ_COLS]),
            )
        tma.store_wait(pendings=0)  # the reduces have read the columns: the consumers may store
        for c in gl.static_range(CONSUMERS):
            mbarrier.arrive(dq_empty.index(step % BUFFERS * CONSUMERS + c), count=1)
        last = (idx == n_tiles - 1) | (m % TURN_BLOCKS == TURN_BLOCKS - 1) | (m == m_end - 1)
        if DETERMINISTIC and last:
            _bulk_wait_all(token)  # added, not only read: the next turn may start
            gl.atomic_add(ticket, 1, sem="release", scope="gpu")


@gluon.jit
def _take_turn(ticket, rank, ACQUIRE_FIRST: gl.constexpr):
    """Wait until the ticket counter reads ``rank``. Spin on relaxed reads, then acquire (a loop
    that runs once: nothing else moves the ticket before this program's release): an acquiring
    load carries an L1 invalidation (CCTL.IVALL) on sm_90, which the spin need not repeat.
    ACQUIRE_FIRST tries the acquiring load first: a turn already reached costs one round trip, not
    two."""
    reached = False
    if ACQUIRE_FIRST:
        reached = gl.atomic_add(ticket, 0, sem="acquire", scope="gpu") == rank
    if not reached:
        while gl.load(ticket, volatile=True) != rank:
            pass
        while gl.atomic_add(ticket, 0, sem="acquire", scope="gpu") != rank:
            pass
