"""Attention backward for Hopper (sm_90) in Gluon: which key block of which (batch, key/value head) a
program of the backward kernels (``bwd_sm90_kernels``, ``bwd_sm90_wide``) takes (``_pair``), and the
query blocks it walks, by mask (``_walk``); both, and a packed sequence's rows, at a program's entry
(``_program``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tritonkit.ops.attention.fwd_sm90_tiles import _sequence


@gluon.jit
def _program(
    PAIRS,
    PAIRS_PER_GROUP,
    HEADS_KV,
    SEQ_Q,
    SEQ_K,  # (VARLEN: the longest sequence's, the grid's)
    UPPER_OFFSET,
    LOWER_OFFSET,
    cu_q_ptr,
    cu_k_ptr,
    BLOCK: gl.constexpr,
    KEYS: gl.constexpr,
    TURN_BLOCKS: gl.constexpr,
    DETERMINISTIC: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    ROTATE: gl.constexpr,
    HAS_LOWER: gl.constexpr,
    VARLEN: gl.constexpr,
):
    """This program's (batch, kv_head, pid_n, start_n, sequence, q_row0, k_row0, SEQ_Q, SEQ_K,
    UPPER_OFFSET, LOWER_OFFSET, n_blocks, m_start, m_mid, m_tail, m_end, rot): its pair and key
    block (``_pair``; the deterministic causal mask's in turn order), the tickets' index
    (``sequence``), and VARLEN its sequence's first rows in the tensors, lengths and bounds aligned
    bottom-right (the tensors' batch then 0), and its walk (``_walk``)."""
    batch, kv_head, pid_n = _pair(
        gl.program_id(0), PAIRS, PAIRS_PER_GROUP, HEADS_KV, SEQ_K, KEYS, DETERMINISTIC and IS_CAUSAL
    )
    start_n = pid_n * KEYS
    sequence = batch  # (the tickets' index)
    if VARLEN:  # the sequence's rows in the tensors, its lengths, its bounds aligned bottom-right
        q_row0, k_row0, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET = _sequence(
            sequence, cu_q_ptr, cu_k_ptr, UPPER_OFFSET, LOWER_OFFSET
        )
        batch = batch * 0
    else:  # (tensors, not constants: the partitions take them as arguments)
        q_row0 = start_n * 0
        k_row0 = start_n * 0
    n_blocks, m_start, m_mid, m_tail, m_end, rot = _walk(
        pid_n, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, BLOCK, KEYS, TURN_BLOCKS, IS_CAUSAL, ROTATE,
        HAS_LOWER, VARLEN,
    )  # fmt: skip
    return (
        batch, kv_head, pid_n, start_n, sequence, q_row0, k_row0, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET,
        n_blocks, m_start, m_mid, m_tail, m_end, rot,
    )  # fmt: skip


@gluon.jit
def _pair(pid, PAIRS, PAIRS_PER_GROUP, HEADS_KV, SEQ_K, KEYS: gl.constexpr, TURN_ORDER: gl.constexpr):
    """Program ``pid``'s (batch, key/value head, key block). One program a (key block, pair),
    launched group after group of PAIRS_PER_GROUP pairs; in a group the key blocks are the slow axis
    and its pairs the fast one. 1: a head's key blocks together, first to last (they share its Q, dO
    and dq in L2); PAIRS: key block n of every pair before block n + 1 of any. TURN_ORDER (the
    deterministic causal mask's): the last key block first."""
    grid_blocks = gl.cdiv(SEQ_K, KEYS)
    group_programs = PAIRS_PER_GROUP * grid_blocks
    first_pair = (pid // group_programs) * PAIRS_PER_GROUP
    group_pairs = gl.minimum(PAIRS_PER_GROUP, PAIRS - first_pair)
    pid_n = (pid % group_programs) // group_pairs
    bh = first_pair + (pid % group_programs) % group_pairs
    if TURN_ORDER:
        pid_n = grid_blocks - 1 - pid_n
    return bh // HEADS_KV, bh % HEADS_KV, pid_n


@gluon.jit
def _walk(
    pid_n,
    SEQ_Q,
    SEQ_K,  # query rows and keys of the program's head (of its sequence, packed)
    UPPER_OFFSET,  # IS_CAUSAL: row i sees key j iff j <= i + UPPER_OFFSET
    LOWER_OFFSET,  # HAS_LOWER: ... and j >= i + LOWER_OFFSET
    BLOCK: gl.constexpr,  # query rows a step
    KEYS: gl.constexpr,  # keys a program
    TURN_BLOCKS: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    ROTATE: gl.constexpr,
    HAS_LOWER: gl.constexpr,
    VARLEN: gl.constexpr,
):
    """Key block ``pid_n``'s (n_blocks, m_start, m_mid, m_tail, m_end, rot): the head's key blocks,
    and the query blocks it walks, [m_start, m_mid) masked (the causal diagonal; every one at the
    ragged last key block), [m_mid, m_tail) not, [m_tail, m_end) masked (a window's left edge),
    starting at m_start + rot (ROTATE)."""
    start_n = pid_n * KEYS
    n_blocks = gl.cdiv(SEQ_K, KEYS)
    m_end = gl.cdiv(SEQ_Q, BLOCK)
    if VARLEN:  # a key block past its sequence's keys (the longest's grid): no walk, nothing stored
        m_end = gl.where(start_n < SEQ_K, m_end, 0)
    if IS_CAUSAL:
        # the first block with a row that sees key start_n, the first whose every row sees the
        # program's last key
        m_start = gl.minimum(gl.maximum(start_n - UPPER_OFFSET, 0) // BLOCK, m_end)
        m_mid = gl.minimum(
            gl.maximum(gl.cdiv(gl.maximum(start_n + KEYS - 1 - UPPER_OFFSET, 0), BLOCK), m_start), m_end
        )
    else:
        m_start = pid_n * 0
        m_mid = pid_n * 0
    m_tail = m_end
    if HAS_LOWER:
        # the block past the last with a row that sees the program's last key (row i sees key j
        # only if i <= j - LOWER_OFFSET), and the first with a row that does not see its first key
        last_key = gl.minimum(start_n + KEYS, SEQ_K) - 1
        m_end = gl.maximum(
            gl.minimum(gl.cdiv(gl.maximum(last_key - LOWER_OFFSET + 1, 0), BLOCK), m_end), m_start
        )
        m_tail = gl.minimum(gl.maximum(start_n - LOWER_OFFSET + 1, 0) // BLOCK, m_end)
    if start_n + KEYS > SEQ_K:  # the ragged last block: every step masks the keys past Sk
        m_mid = m_end
    if HAS_LOWER:  # (a short walk: the masked head may reach past the window's end)
        m_mid = gl.minimum(m_mid, m_end)
        m_tail = gl.maximum(m_tail, m_mid)
    rot = pid_n * 0
    if ROTATE:  # (a packed sequence without keys divides by n_blocks = 0: an unspecified rot, unused)
        rot = (pid_n * gl.cdiv(m_end, TURN_BLOCKS)) // n_blocks * TURN_BLOCKS  # a turn's first block
    return n_blocks, m_start, m_mid, m_tail, m_end, rot
