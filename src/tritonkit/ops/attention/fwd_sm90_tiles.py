"""The sm_90 attention forward's tiles (``fwd_sm90_kernels``): which (batch, head) and query rows a
program's tile is, in which order programs take them, and which key blocks a tile reads (the masks'
bounds and a packed batch's sequences).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _sequence(b, cu_q_ptr, cu_k_ptr, UPPER_OFFSET, LOWER_OFFSET):
    """A packed batch's sequence ``b`` (both sm_90 kernels'): its first query row and first key in the
    tensors, its query rows and keys (cu_seqlens' differences), and the bounds' offsets, which hold
    the window's sides alone, aligned bottom-right for its lengths."""
    q_row0 = gl.load(cu_q_ptr + b)
    k_row0 = gl.load(cu_k_ptr + b)
    seq_q = gl.load(cu_q_ptr + b + 1) - q_row0
    seq_k = gl.load(cu_k_ptr + b + 1) - k_row0
    return q_row0, k_row0, seq_q, seq_k, UPPER_OFFSET + seq_k - seq_q, LOWER_OFFSET + seq_k - seq_q


@gluon.jit
def _tile(
    tile,
    HEADS,
    BATCH_HEADS,
    HEADS_PER_GROUP,
    GROUP,
    SEQ_Q,
    SEQ_K,
    UPPER_OFFSET,
    LOWER_OFFSET,
    cu_q_ptr,
    cu_k_ptr,
    BLOCK: gl.constexpr,
    BLOCK_N: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_LOWER: gl.constexpr,
    VARLEN: gl.constexpr,
):
    """(batch, head, kv_head, start_m, first_block, n_blocks, n_lead, n_full, seq) of a tile: BLOCK query
    rows of a (batch, head), tiles numbered group after group of HEADS_PER_GROUP (batch, head)s, in a
    group the query blocks the slow axis and its heads the fast one, causal blocks longest (last)
    first, so that the short ones fill the tail. Its keys are the n_blocks blocks from first_block
    (blocks of BLOCK_N keys); of those, the ones from n_lead (a window's lower bound cuts the blocks
    before it) to n_full (an upper bound cuts the blocks from it) every row sees whole. ``seq``: (the
    sequence's first query row and first key in the tensors, its query rows, keys and bounds' offsets):
    VARLEN, from cu_seqlens for the packed sequence ``batch`` numbers (whose tensors have one batch
    slot: the batch returned is 0), its offsets aligned bottom-right for its lengths (UPPER_OFFSET and
    LOWER_OFFSET hold the window's sides, SEQ_Q and SEQ_K the longest lengths); else (0, 0, SEQ_Q,
    SEQ_K, UPPER_OFFSET, LOWER_OFFSET)."""
    m_blocks = gl.cdiv(SEQ_Q, BLOCK)
    group_programs = HEADS_PER_GROUP * m_blocks
    first = (tile // group_programs) * HEADS_PER_GROUP
    group_heads = gl.minimum(HEADS_PER_GROUP, BATCH_HEADS - first)
    pid_m = (tile % group_programs) // group_heads
    if IS_CAUSAL:
        pid_m = m_blocks - 1 - pid_m
    bh = first + (tile % group_programs) % group_heads
    head = bh % HEADS
    batch = bh // HEADS
    kv_head = head // GROUP
    start_m = pid_m * BLOCK
    if VARLEN:
        q_row0, k_row0, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET = _sequence(
            batch, cu_q_ptr, cu_k_ptr, UPPER_OFFSET, LOWER_OFFSET
        )
        batch = batch * 0
    else:
        q_row0 = 0
        k_row0 = 0
    seq = (q_row0, k_row0, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET)
    # Keys [0, end) some row of the tile sees, [0, full_end) every row sees: causal, the last real
    # row's bound and the first row's (rows past SEQ_Q need no keys)
    if IS_CAUSAL:
        end = gl.maximum(gl.minimum(SEQ_K, gl.minimum(start_m + BLOCK, SEQ_Q) + UPPER_OFFSET), 0)
        full_end = gl.maximum(gl.minimum(SEQ_K, start_m + 1 + UPPER_OFFSET), 0)
    else:
        end = SEQ_K
        full_end = SEQ_K
    # A window's lower bound (key j >= i + LOWER_OFFSET): the first row's is the least, from which
    # the blocks start; the last real row's the greatest, below which the blocks are cut
    if HAS_LOWER:
        first_block = gl.minimum(gl.maximum(start_m + LOWER_OFFSET, 0), end) // BLOCK_N
        last_row = gl.minimum(start_m + BLOCK, SEQ_Q) - 1
        n_lead = gl.cdiv(gl.maximum(last_row + LOWER_OFFSET, 0), BLOCK_N) - first_block
    else:
        first_block = 0
        n_lead = 0
    n_blocks = gl.maximum(gl.cdiv(end, BLOCK_N) - first_block, 0)
    if VARLEN:  # a tile past its sequence's rows (the longest's grid): no keys, nothing stored
        n_blocks = gl.where(start_m < SEQ_Q, n_blocks, 0)
    return (
        batch,
        head,
        kv_head,
        start_m,
        first_block,
        n_blocks,
        n_lead,
        full_end // BLOCK_N - first_block,
        seq,
    )


@gluon.jit
def _walk(step, m_blocks, BATCH_HEADS, HEADS_PER_GROUP, IS_CAUSAL: gl.constexpr):
    """The tile (``_tile``'s numbering) a persistent program takes at its loop's ``step``
    (``_walk_range``). A full mask's tiles are alike: the step is the tile. Causal, a program takes
    pairs: query block j of a head and block m_blocks - 1 - j of the same head, whose walks add up to
    the same number of key blocks in every pair (m_blocks + 1 with Sq = Sk), so that programs taking
    pairs in a stride of num_programs finish together. Pairs are numbered as ``_tile`` numbers the
    tiles, group after group of HEADS_PER_GROUP heads, so the programs running at once read the K
    and V of a few heads, which stay in L2. With an odd m_blocks the middle block pairs with itself:
    its second turn is ``twin``, which ``_walk_tile`` makes a tile of no keys past the last row.
    Simulated on 132 SMs at the decoder layer's (2, 32, 4096, 128) causal (benchmarks/
    program_order.py): the busiest program 296 steps against the even spread's 287, where a stride
    over single tiles took 424. A snake over every head's blocks at once (288) ran on the H200 at
    0.77x cuDNN at (4, 32, 4096, 128) against one tile a program's 0.90x: 128 heads' K and V at once
    do not fit in L2."""
    if not IS_CAUSAL:
        return step, False
    half = (m_blocks + 1) // 2
    pair = (step // 2) * gl.num_programs(0) + gl.program_id(0)
    first_head = (pair // (HEADS_PER_GROUP * half)) * HEADS_PER_GROUP
    group_heads = gl.minimum(HEADS_PER_GROUP, BATCH_HEADS - first_head)
    in_group = pair - first_head * half
    j = in_group // group_heads
    rank = gl.where(step % 2 == 0, j, m_blocks - 1 - j)  # longest first: the pair's long block
    twin = (step % 2 == 1) & (2 * j == m_blocks - 1)
    return first_head * m_blocks + rank * group_heads + in_group % group_heads, twin


@gluon.jit
def _walk_tile(
    step, HEADS, BATCH_HEADS, HEADS_PER_GROUP, GROUP, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, cu_q_ptr,
    cu_k_ptr, BLOCK: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_LOWER: gl.constexpr,
    VARLEN: gl.constexpr,
):  # fmt: skip
    """``_tile``'s tuple for a persistent program's ``step``: ``_walk``'s tile, or for the second turn
    of a middle block paired with itself, a tile at row SEQ_Q with no keys: its producer loads
    nothing, its consumers wait on nothing and their stores fall past the rows (TMA drops them)."""
    tile, twin = _walk(step, gl.cdiv(SEQ_Q, BLOCK), BATCH_HEADS, HEADS_PER_GROUP, IS_CAUSAL)
    batch, head, kv_head, start_m, first_block, n_blocks, n_lead, n_full, seq = _tile(
        tile, HEADS, BATCH_HEADS, HEADS_PER_GROUP, GROUP, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, cu_q_ptr,
        cu_k_ptr, BLOCK, BLOCK_N, IS_CAUSAL, HAS_LOWER, VARLEN,
    )  # fmt: skip
    start_m = gl.where(twin, SEQ_Q, start_m)
    n_blocks = gl.where(twin, 0, n_blocks)
    return batch, head, kv_head, start_m, first_block, n_blocks, n_lead, n_full, seq


@gluon.jit
def _walk_range(m_blocks, BATCH_HEADS, IS_CAUSAL: gl.constexpr):
    """The (first, last, stride) of a persistent program's loop over ``_walk``'s steps: causal, two
    steps a pair, its pairs program_id, + num_programs, ...; a full mask's tiles directly, in the
    same stride."""
    programs = gl.num_programs(0)
    lane = gl.program_id(0)
    if IS_CAUSAL:
        pairs = (m_blocks + 1) // 2 * BATCH_HEADS
        first, last, stride = 0, 2 * ((pairs - lane + programs - 1) // programs), 1
    else:
        first, last, stride = lane, m_blocks * BATCH_HEADS, programs
    return first, last, stride
