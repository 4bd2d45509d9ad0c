"""Decode attention over a KV cache (flash-attn's ``flash_attn_with_kvcache``): a few new query
tokens a sequence against the tokens already cached, contiguous or paged, with the new keys and
values appended in place, the cache split across programs where batch x heads leaves SMs idle.

Maths. Sequence b has L_b keys: ``cache_seqlens[b]`` cached, plus the Sq new ones when ``k`` and
``v`` are appended. Query token i (of Sq) sees key j iff j < L_b and, causal, j <= i + L_b - Sq (the
bottom-right alignment of ``flash_attention``; a window bounds it as there). Then the usual
softmax(scale * q . k) v, accumulated in fp32 with a running max (log2 units, exp2).

Layout. q and the output (B, Sq, Hq, D); a contiguous cache (B, S_cache, Hkv, D), or a paged one
(num_blocks, block_size, Hkv, D) whose sequence b's key j lives in block ``block_table[b, j //
block_size]`` at slot j % block_size. Both are addressed as (block, slot, head): a contiguous
cache is a paged one of one block a sequence. The lse is (B, Hq, Sq) fp32, natural log.

Kernel. One program a (key split, batch, key/value head, block of rows): its rows are the query
tokens of the query heads of the head's GQA group (GROUP x Sq of them, padded to 16 for tl.dot, at
most MAX_ROWS a program), so that at decode's few tokens each cached key and value is read once for
the group. It walks its split's keys BLOCK_N at a time,
gathering a paged block's slots through the block table. With one split it writes the output;
with several each writes its normalised partial output and lse, and a second kernel folds the
splits together by their lse (``merge.py``'s fold of two parts, over any number of them).

Work. Memory-bound: the cache's K and V of the L_b keys, 2 x B x Hkv x L x D x s bytes, dominate
(q and the output are Sq rows); 4 x B x Hq x Sq x L x D FLOPs.
"""

from __future__ import annotations

import torch

from tritonkit._launch import Launch, Plan, call_signature, cdiv, next_power_of_2
from tritonkit._runtime import empty_output, empty_output_like, interpret, sm_count
from tritonkit._triton import tl, triton
from tritonkit.jit import LOG2E, dot_fp32
from tritonkit.opdef import as_int, check_tensor, finite, op
from tritonkit.ops.attention.common import (
    Scores,
    _exponent,
    _visible,
    attention_reference,
    check_window,
    softmax_scale,
)
from tritonkit.roofline import Cost

# The launch (BLOCK_N keys a step, warps, stages: the loads in flight a program), by the split count, from
# sweeps of BLOCK_N 32-128, 2-8 warps and 2-4 stages at issue 28's six shapes on the H200
# (benchmarks/decode_attention.py --configs; docs/perf-notes/decode-and-ring.md, "The launch sweep" and "The
# launch by kind"): where one split leaves B x Hkv programs, two or so an SM, 64-key steps keep more bytes in
# flight a program (paged at B = 32: 263 us against 324 at 32-key steps; contiguous 259 against 263); where
# the keys are split, there are programs enough and 32-key steps were 1-5% faster
ONE_SPLIT_LAUNCH = (64, 4, 3)
SPLIT_LAUNCH = (32, 4, 3)
# A program alone on its SM (a contiguous cache, B x Hkv x splits programs within one an SM): steps of
# ALONE_STEP_BYTES of keys and values (128 keys at D = 128), three in flight, 192 KB of shared memory, as
# many bytes as two or three programs of the launches above hold between them. On an H100 at 5393a53
# (results/h100/history/decode-alone-5393a53.json, graph replays, two rounds): (16, 32/8, 8192, 128) at one
# split 187.0 us against the rule's three splits of 32-key steps 191.4 (cuDNN 186.2), four new tokens 188.4
# against 196.7; (8, 32/8, 32768, 128) at two splits 357.0 against six 361.2 (cuDNN 354.7)
ALONE_LAUNCH = (128, 4, 3)
ALONE_STEP_BYTES = 65536
MIN_ROWS = 16  # tl.dot's least M: a program's rows (GROUP x Sq) pad to this
MAX_ROWS = 64  # rows a program at most: more (a long chunk of new tokens) take more programs
PAGES = 32  # table entries a paged walk reads at once (PAGE_A_STEP)
MIN_SPLIT_KEYS = 256  # keys a split takes at least, where the rule splits
# Split programs an SM at most (B x Hkv x splits <= 3 x SMs), from a sweep of split counts at the split shapes
# on the H200 (benchmarks/decode_attention.py --splits; docs/perf-notes/decode-and-ring.md, "The split
# count"): the time follows the programs' spread over the SMs. At 8 x 8 pairs and 32768 keys, 6 splits (384
# programs, just under 3 an SM) took 255 us, 5 and 7 (2.4 and 3.4 an SM) 266 and 270-273; at 16 x 8 pairs 3
# splits (384) were the best count; at B = 1 MIN_SPLIT_KEYS caps the count first
SPLIT_PROGRAMS_PER_SM = 3
MAX_SPLITS = 64
COMBINE_SPLITS = 64  # splits the combine loads at once (a 64 x 128 fp32 tile: 64 registers a thread)
DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _attend(q, k, v, cols, bound, token, row_ok, m_i, l_i, acc, upper, lower, score_scale, cap_log2,
            IS_CAUSAL: tl.constexpr, HAS_LOWER: tl.constexpr, SOFTCAP: tl.constexpr,
            EXACT_DOT_IN_FP32: tl.constexpr):  # fmt: skip
    """One block of keys ``cols`` (those at or past ``bound`` masked) folded into the running max
    ``m_i`` (log2 units), sum ``l_i`` and output ``acc`` of each row."""
    x, _ = _exponent(
        dot_fp32(q, tl.trans(k), EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32), score_scale, cap_log2, SOFTCAP
    )
    visible = _visible(token[:, None], cols[None, :], bound, upper, lower, IS_CAUSAL, HAS_LOWER)
    x = tl.where(visible & row_ok[:, None], x, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(x, 1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row that sees nothing yet
    p = tl.exp2(x - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot_fp32(p.to(v.dtype), v, EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32)
    return m_new, l_i, acc


@triton.jit
def _cache_slots(table_ptr, batch, cols, col_ok, stride_tb, SLOTS, NUM_BLOCKS, PAGED: tl.constexpr):
    """(block, slot, ok) of cache positions ``cols`` of sequence ``batch``: ok where the position is
    wanted (``col_ok``) and its block exists."""
    if PAGED:
        row = table_ptr + batch.to(tl.int64) * stride_tb
        block = tl.load(row + cols // SLOTS, mask=col_ok, other=0)
        return block, cols % SLOTS, col_ok & (block >= 0) & (block < NUM_BLOCKS)
    else:
        return batch + cols * 0, cols, col_ok


@triton.jit
def _attend_cached(q, k_ptr, v_ptr, block, slot, ok, cols, cached_end, kv_head, dims, dim_ok,
                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, token, row_ok, m_i, l_i,
                   acc, refused, upper, lower, score_scale, cap_log2, IS_CAUSAL: tl.constexpr,
                   HAS_LOWER: tl.constexpr, SOFTCAP: tl.constexpr,
                   EXACT_DOT_IN_FP32: tl.constexpr):  # fmt: skip
    """Cache positions ``cols`` (at ``block``, ``slot``; ``ok`` where wanted and held) folded into the
    running softmax; ``refused`` counts those wanted whose block the table does not hold."""
    refused += tl.sum(((cols < cached_end) & ~ok).to(tl.int32))
    mask = ok[:, None] & dim_ok[None, :]
    k_rows = block.to(tl.int64) * stride_kb + slot.to(tl.int64) * stride_ks + kv_head * stride_kh
    k = tl.load(k_ptr + k_rows[:, None] + dims[None, :], mask=mask, other=0.0)
    v_rows = block.to(tl.int64) * stride_vb + slot.to(tl.int64) * stride_vs + kv_head * stride_vh
    v = tl.load(v_ptr + v_rows[:, None] + dims[None, :], mask=mask, other=0.0)
    m_i, l_i, acc = _attend(
        q, k, v, cols, cached_end, token, row_ok, m_i, l_i, acc, upper, lower, score_scale, cap_log2,
        IS_CAUSAL, HAS_LOWER, SOFTCAP, EXACT_DOT_IN_FP32,
    )  # fmt: skip
    return m_i, l_i, acc, refused


@triton.jit
def _decode_kernel(
    q_ptr,  # (B, Sq, Hq, D)
    k_ptr,  # cache (blocks, slots, Hkv, D): (B, S_cache) contiguous, or paged
    v_ptr,
    k_new_ptr,  # HAS_NEW: (B, Sq, Hkv, D), the keys appended at cached..cached + Sq - 1
    v_new_ptr,
    seqlens_ptr,  # int32 (B,): cached tokens (HAS_SEQLENS), else every sequence S_MAX
    table_ptr,  # PAGED: int32 (B, blocks a sequence), strides stride_tb, 1
    out_ptr,  # FINAL: the output, q's layout and dtype; else the fp32 partials (splits, B x Hkv, R, D)
    lse_ptr,  # FINAL: fp32 (B, Hq, Sq) contiguous; else the partials' (splits, B x Hkv, R)
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_nkb, stride_nks, stride_nkh,
    stride_nvb, stride_nvs, stride_nvh,
    stride_ob, stride_os, stride_oh,
    stride_tb,
    HEADS_KV,
    SEQ_Q,  # new query tokens a sequence
    S_MAX,  # keys a sequence may hold (the contiguous cache's S_cache, a paged one's table width x SLOTS)
    SLOTS,  # a block's slots (PAGED)
    NUM_BLOCKS,  # the cache's blocks (PAGED: a table entry outside 0..NUM_BLOCKS - 1 is refused)
    SPLIT_KEYS,  # keys a split walks (a multiple of BLOCK_N)
    RIGHT,  # the window's right side (0 causal)
    LEFT,  # the window's left side (HAS_LOWER)
    score_scale,
    cap_log2,
    HEAD_DIM,
    GROUP: tl.constexpr,  # query heads a key/value head
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_NEW: tl.constexpr,  # new keys a step: a few, where Sq is (their tiles stay small)
    PAGED: tl.constexpr,
    PAGE_A_STEP: tl.constexpr,  # PAGED with SLOTS a multiple of BLOCK_N: a step's keys in one page
    PAGES: tl.constexpr,  # PAGE_A_STEP: table entries read at once
    HAS_SEQLENS: tl.constexpr,
    HAS_NEW: tl.constexpr,  # k and v appended: L_b = cached + Sq
    IS_CAUSAL: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FINAL: tl.constexpr,  # one split: write the output itself
    EXACT_DOT_IN_FP32: tl.constexpr,  # the interpreter's (tritonkit.jit.dot_fp32)
):  # fmt: skip
    split = tl.program_id(0)
    pair = tl.program_id(1)
    batch, kv_head = pair // HEADS_KV, pair % HEADS_KV
    # row r: query head kv_head * GROUP + r // Sq, token r % Sq
    rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    token, group = rows % SEQ_Q, rows // SEQ_Q
    row_ok = rows < GROUP * SEQ_Q
    head = kv_head * GROUP + group
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_rows = batch.to(tl.int64) * stride_qb + token.to(tl.int64) * stride_qs + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    if HAS_SEQLENS:
        cached = tl.load(seqlens_ptr + batch)
    else:
        cached = S_MAX
    if HAS_NEW:
        keys = cached + SEQ_Q
    else:
        keys = cached
    offset = keys - SEQ_Q  # token i sees key j <= i + offset (bottom-right)
    upper, lower = offset + RIGHT, offset - LEFT
    start = split * SPLIT_KEYS
    end = tl.minimum(start + SPLIT_KEYS, keys)
    m_i = tl.full([BLOCK_R], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    # the cached keys, from the cache (never past it, even where cache_seqlens says so)
    cached_end = tl.minimum(tl.minimum(end, cached), S_MAX)
    refused = tl.full([], 0, tl.int32)  # positions whose block the table does not hold
    if PAGE_A_STEP:
        # PAGES table entries read at once, each step's picked from them in registers: a step's K
        # and V addresses then hang on no load, so the loop's pipeline fetches them steps ahead (a
        # table entry loaded in the loop joins the pipeline's loads, and its wait holds them all)
        table_row = table_ptr + batch.to(tl.int64) * stride_tb
        page_ids = tl.arange(0, PAGES)
        for page0 in range(start // SLOTS, tl.cdiv(cached_end, SLOTS), PAGES):
            pages = tl.load(
                table_row + page0 + page_ids, mask=page0 + page_ids < tl.cdiv(cached_end, SLOTS), other=0
            )  # fmt: skip
            lo, hi = tl.maximum(start, page0 * SLOTS), tl.minimum((page0 + PAGES) * SLOTS, cached_end)
            for n in range(lo, hi, BLOCK_N):
                cols = n + tl.arange(0, BLOCK_N)
                page = tl.sum(tl.where(page_ids == n // SLOTS - page0, pages, 0), 0)
                ok = (cols < cached_end) & (page >= 0) & (page < NUM_BLOCKS)
                m_i, l_i, acc, refused = _attend_cached(
                    q, k_ptr, v_ptr, page, cols % SLOTS, ok, cols, cached_end, kv_head, dims,
                    dim_ok, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, token, row_ok,
                    m_i, l_i, acc, refused, upper, lower, score_scale, cap_log2, IS_CAUSAL, HAS_LOWER,
                    SOFTCAP, EXACT_DOT_IN_FP32,
                )  # fmt: skip
    else:
        for n in range(start, cached_end, BLOCK_N):
            cols = n + tl.arange(0, BLOCK_N)
            block, slot, ok = _cache_slots(
                table_ptr, batch, cols, cols < cached_end, stride_tb, SLOTS, NUM_BLOCKS, PAGED
            )  # fmt: skip
            m_i, l_i, acc, refused = _attend_cached(
                q, k_ptr, v_ptr, block, slot, ok, cols, cached_end, kv_head, dims, dim_ok, stride_kb,
                stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, token, row_ok, m_i, l_i, acc, refused,
                upper, lower, score_scale, cap_log2, IS_CAUSAL, HAS_LOWER, SOFTCAP, EXACT_DOT_IN_FP32,
            )  # fmt: skip
    if HAS_NEW:  # the new keys, from k and v; the first block of rows also writes them to the cache
        for n in range(tl.maximum(start, cached), end, BLOCK_NEW):
            cols = n + tl.arange(0, BLOCK_NEW)
            col_ok = cols < end
            new = batch.to(tl.int64) * stride_nkb + (cols - cached).to(tl.int64) * stride_nks
            k = tl.load(
                k_new_ptr + (new + kv_head * stride_nkh)[:, None] + dims[None, :],
                mask=col_ok[:, None] & dim_ok[None, :], other=0.0,
            )  # fmt: skip
            new = batch.to(tl.int64) * stride_nvb + (cols - cached).to(tl.int64) * stride_nvs
            v = tl.load(
                v_new_ptr + (new + kv_head * stride_nvh)[:, None] + dims[None, :],
                mask=col_ok[:, None] & dim_ok[None, :], other=0.0,
            )  # fmt: skip
            writable = col_ok & (cols < S_MAX) & (cached >= 0)  # (a negative length writes nothing)
            block, slot, ok = _cache_slots(
                table_ptr, batch, cols, writable, stride_tb, SLOTS, NUM_BLOCKS, PAGED
            )
            refused += tl.sum((writable & ~ok).to(tl.int32))  # a new token's block the table lacks
            if tl.program_id(2) == 0:
                mask = ok[:, None] & dim_ok[None, :]
                k_rows = block.to(tl.int64) * stride_kb + slot.to(tl.int64) * stride_ks + kv_head * stride_kh
                tl.store(k_ptr + k_rows[:, None] + dims[None, :], k, mask=mask)
                v_rows = block.to(tl.int64) * stride_vb + slot.to(tl.int64) * stride_vs + kv_head * stride_vh
                tl.store(v_ptr + v_rows[:, None] + dims[None, :], v, mask=mask)
            m_i, l_i, acc = _attend(
                q, k, v, cols, end, token, row_ok, m_i, l_i, acc, upper, lower, score_scale, cap_log2,
                IS_CAUSAL, HAS_LOWER, SOFTCAP, EXACT_DOT_IN_FP32,
            )  # fmt: skip

    # A sequence whose keys overrun the cache, whose cached length is negative, or whose table names a
    # block the cache lacks, gets NaN: checking its lengths or table on the host would cost a sync a call
    broken = (keys > S_MAX) | (refused > 0) | (cached < 0)
    seen = l_i > 0.0
    o = tl.where(broken, float("nan"), acc / tl.where(seen, l_i, 1.0)[:, None])
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / LOG2E, -float("inf"))
    lse = tl.where(broken, float("nan"), lse)
    if FINAL:
        o_rows = (
            batch.to(tl.int64) * stride_ob + token.to(tl.int64) * stride_os + head.to(tl.int64) * stride_oh
        )
        tl.store(
            out_ptr + o_rows[:, None] + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
        lse_rows = (batch * HEADS_KV * GROUP + head).to(tl.int64) * SEQ_Q + token
        tl.store(lse_ptr + lse_rows, lse, mask=row_ok)
    else:
        part = (split.to(tl.int64) * tl.num_programs(1) + pair) * (GROUP * SEQ_Q) + rows
        tl.store(
            out_ptr + part[:, None] * HEAD_DIM + dims[None, :], o, mask=row_ok[:, None] & dim_ok[None, :]
        )
        tl.store(lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _combine_kernel(
    part_ptr,  # fp32 (splits, B x Hkv, R, D)
    part_lse_ptr,  # fp32 (splits, B x Hkv, R)
    out_ptr,  # q's layout and dtype
    lse_ptr,  # fp32 (B, Hq, Sq)
    stride_ob,
    stride_os,
    stride_oh,
    SPLITS,
    HEADS_KV,
    SEQ_Q,
    HEAD_DIM,
    GROUP: tl.constexpr,
    BLOCK_S: tl.constexpr,  # splits a step: all of them at once up to COMBINE_SPLITS
    BLOCK_D: tl.constexpr,
):
    """The splits of one row (a query head's token) of one (batch, key/value head) folded by their
    lse: o = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max lse), lse = max + log(sum w); a
    split that saw no key weighs 0, and a split's NaN lse (a broken sequence: its length or table)
    makes the row's o and lse NaN. Every split's partial is loaded at once (one round trip to
    memory, not one a split: at B = 1 the splits are many and the rows few). The maths is
    ``merge``'s, not its kernel: that one folds one part into a running fp32 output in place, a
    launch a part, where this folds every split in one launch straight into q's layout and dtype."""
    pair, row = tl.program_id(0), tl.program_id(1)
    batch, kv_head = pair // HEADS_KV, pair % HEADS_KV
    rows = GROUP * SEQ_Q
    dims = tl.arange(0, BLOCK_D)
    top = tl.full([], -float("inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    broken = tl.zeros([], tl.int32)
    for first in range(0, SPLITS, BLOCK_S):  # one step unless the splits outnumber BLOCK_S
        splits = first + tl.arange(0, BLOCK_S)
        part = (splits.to(tl.int64) * tl.num_programs(0) + pair) * rows + row
        split_lse = tl.load(part_lse_ptr + part, mask=splits < SPLITS, other=-float("inf"))
        broken += tl.sum((split_lse != split_lse).to(tl.int32))  # NaN: the sequence's split was broken
        top_new = tl.maximum(top, tl.max(split_lse, 0))
        top_safe = tl.where(top_new == -float("inf"), 0.0, top_new)  # no split has seen a key yet
        weight = tl.exp(split_lse - top_safe)
        o = tl.load(
            part_ptr + part[:, None] * HEAD_DIM + dims[None, :],
            mask=(splits < SPLITS)[:, None] & (dims < HEAD_DIM)[None, :], other=0.0,
        )  # fmt: skip
        rescale = tl.exp(top - top_safe)  # the earlier steps' weights, to this step's max
        acc = acc * rescale + tl.sum(weight[:, None] * o, 0)
        total = total * rescale + tl.sum(weight, 0)
        top = top_new
    seen = total > 0.0
    top_safe = tl.where(top == -float("inf"), 0.0, top)
    token, head = row % SEQ_Q, kv_head * GROUP + row // SEQ_Q
    o_row = batch.to(tl.int64) * stride_ob + token.to(tl.int64) * stride_os + head.to(tl.int64) * stride_oh
    o = tl.where(broken > 0, float("nan"), acc / tl.where(seen, total, 1.0))
    tl.store(out_ptr + o_row + dims, o.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
    lse = tl.where(seen, top_safe + tl.log(tl.where(seen, total, 1.0)), -float("inf"))
    lse = tl.where(broken > 0, float("nan"), lse)
    tl.store(lse_ptr + (batch * HEADS_KV * GROUP + head).to(tl.int64) * SEQ_Q + token, lse)


# The registry's lists (tritonkit._registry) stay empty: the op contract's tests check gradients and
# one input layout, where decoding has no gradient and its own cases (tests/test_attention_decode.py);
# its benchmark is benchmarks/decode_attention.py, its cost model kvcache_cost
OPS: dict = {}
WORKLOADS: dict = {}


def kvcache_cost(shape: tuple, dtype: torch.dtype, seq_q: int = 1) -> Cost:
    """FLOPs and minimal bytes of a call over full caches, shape (B, Hq, Hkv, S_cache, D): each
    cached key and value read once (the GQA group's query heads share them), q read and the output
    written once; 4 x B x Hq x Sq x S x D FLOPs (two products). Memory-bound: the K + V bytes are
    what a call's time is measured against."""
    batch, heads_q, heads_kv, seq, head_dim = shape
    size = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * batch * heads_kv * seq * head_dim * size
    q_bytes = batch * seq_q * heads_q * head_dim * size
    return Cost(4 * batch * heads_q * seq_q * seq * head_dim, kv_bytes + 2 * q_bytes)


def default_splits(batch: int, heads_kv: int, max_keys: int, device, paged: bool = False) -> int:
    """Key splits where B x Hkv programs leave SMs idle (flash-decoding). A contiguous cache of more
    than a third as many programs as SMs takes the one or two splits that make one wave of programs
    alone on their SMs (ALONE_LAUNCH's deep steps; measured at 64 and 128 programs); else as many as
    keep the programs within SPLIT_PROGRAMS_PER_SM an SM, each split at least MIN_SPLIT_KEYS keys, at
    most MAX_SPLITS. From shapes alone: no host sync."""
    programs = batch * heads_kv
    sms = sm_count(device)
    if programs == 0 or programs >= sms:
        return 1
    if not paged and 3 * programs > sms:
        return sms // programs
    return max(1, min(SPLIT_PROGRAMS_PER_SM * sms // programs, cdiv(max_keys, MIN_SPLIT_KEYS), MAX_SPLITS))


def row_block(rows: int) -> int:
    """A program's rows (the GQA group times Sq), padded to tl.dot's least M, at most MAX_ROWS: more
    rows take more programs."""
    return min(max(MIN_ROWS, next_power_of_2(rows)), MAX_ROWS)


def _launch_config(programs: int, paged: bool, splits: int, block_d: int, element_size: int, device) -> tuple:
    """(BLOCK_N, warps, stages): ALONE_LAUNCH's where a contiguous cache's programs are one an SM at
    most, its steps ALONE_STEP_BYTES of keys and values (fewer keys at D = 256); else ONE_SPLIT_LAUNCH
    or SPLIT_LAUNCH, by the split count."""
    if not paged and programs <= sm_count(device):
        block_n, num_warps, num_stages = ALONE_LAUNCH
        return min(block_n, ALONE_STEP_BYTES // (2 * block_d * element_size)), num_warps, num_stages
    return ONE_SPLIT_LAUNCH if splits == 1 else SPLIT_LAUNCH


MAX_PLANS = 256  # call signatures kept: a decode loop's calls repeat a few
# a call's signature -> its split count and its launches' Plan (None where they cannot be replayed)
_plans: dict[tuple, tuple[int, Plan | None]] = {}


def _remember(key: tuple | None, splits: int, plan: Plan | None) -> None:
    if key is not None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[key] = (splits, plan)


def _max_keys(k_cache, block_table) -> int:
    """Keys a sequence may hold: a contiguous cache's slots, or a paged one's table width x block."""
    return k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)


def _check(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softcap) -> None:
    """TypeError or ValueError naming what is wrong (nothing here reads a tensor's values)."""
    check_tensor("q", q, dtypes=DTYPES, ndim=4)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, dtypes=(q.dtype,), ndim=4, device_of=("q", q))
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    batch, seq_q, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"the cache's head dim {k_cache.shape[3]} is not q's {head_dim}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"q's {heads_q} heads must be a multiple of the cache's {heads_kv}")
    if not 1 <= head_dim <= 256:
        raise ValueError(f"head dims 1-256 are supported, got {head_dim}")
    if (k is None) != (v is None):
        raise ValueError("k and v are appended together: give both or neither")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t, dtypes=(q.dtype,), ndim=4, device_of=("q", q))
            if t.shape != (batch, seq_q, heads_kv, head_dim):
                raise ValueError(
                    f"{name} must be (B, Sq, Hkv, D) = {(batch, seq_q, heads_kv, head_dim)}, "
                    f"got {tuple(t.shape)}"
                )
        if cache_seqlens is None:
            raise ValueError("appending k and v needs cache_seqlens: where each sequence's new tokens go")
    if cache_seqlens is not None:
        check_tensor("cache_seqlens", cache_seqlens, dtypes=(torch.int32,), ndim=1, device_of=("q", q))
        if cache_seqlens.shape[0] != batch:
            raise ValueError(f"cache_seqlens must have B = {batch} entries, got {cache_seqlens.shape[0]}")
    if block_table is not None:
        check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, device_of=("q", q))
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have B = {batch} rows, got {block_table.shape[0]}")
        if cache_seqlens is None:
            raise ValueError(
                "a paged cache (block_table) needs cache_seqlens: how many of its slots hold keys"
            )
    elif k_cache.shape[0] != batch:
        raise ValueError(f"a contiguous cache must have B = {batch} sequences, got {k_cache.shape[0]}")
    # the new tokens must fit a sequence's slots at all (the room each one has left is cache_seqlens's
    # values: a sync, so not checked here)
    if k is not None and seq_q > _max_keys(k_cache, block_table):
        raise ValueError(
            f"the cache holds {_max_keys(k_cache, block_table)} keys a sequence, fewer than the "
            f"Sq = {seq_q} tokens appended"
        )
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(-1) != 1:  # written in place, so never through a copy
            raise ValueError(f"{name} must have a unit stride in its last dim, got strides {cache.stride()}")
    if not (finite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0, got {softcap}")


@op(
    "decode_attention",
    mutates=("k_cache", "v_cache", "out", "lse", "part", "part_lse"),
    in_place=("k_cache", "v_cache"),
)
def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    block_table: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    part: torch.Tensor,
    part_lse: torch.Tensor,
    scale: float,
    causal: bool,
    left: int,
    right: int,
    softcap: float,
) -> None:
    """Attend q to each sequence's keys into ``out`` (q's shape, unit last stride) and ``lse``, k
    and v (if given) appended to the cache by the kernel as it attends to them; ``part`` and
    ``part_lse`` hold the splits' partials (their first dim is the splits: 1 writes ``out``
    directly)."""
    for launch in launches(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, lse, part, part_lse, scale, causal, left,
        right, softcap,
    ):  # fmt: skip
        launch.run()


def launches(
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, lse, part, part_lse, scale, causal, left,
    right, softcap,
) -> list[Launch]:  # fmt: skip
    """The decode kernel's launch and, with several splits, the combine's: what ``_decode`` runs
    and what the sm_90 checks compile (its tensors may be on the meta device)."""
    batch, seq_q, heads_q, head_dim = q.shape
    heads_kv, splits = k_cache.shape[2], part.shape[0]
    group = heads_q // heads_kv
    paged = block_table is not None
    max_keys = _max_keys(k_cache, block_table)
    block_r = row_block(group * seq_q)
    row_blocks = cdiv(group * seq_q, block_r)
    block_d = max(16, next_power_of_2(head_dim))
    programs = splits * batch * heads_kv * row_blocks
    block_n, num_warps, num_stages = _launch_config(
        programs, paged, splits, block_d, k_cache.element_size(), q.device
    )
    split_keys = cdiv(cdiv(max_keys, splits), block_n) * block_n
    # a side that cuts no key (row i of Sq sees keys up to cached + i + right, from cached + i - left)
    # is unbounded: the kernel's 32-bit offset + RIGHT and offset - LEFT then hold for any side given
    left, right = (
        -1 if side >= reach else side for side, reach in ((left, max_keys + seq_q), (right, seq_q))
    )
    (_, _, score_scale, cap_log2), flags = Scores(scale, causal, True, (left, right), softcap).kernel_args(
        1, 1
    )
    final = splits == 1
    q, k, v = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    new_strides = (*k.stride()[:3], *v.stride()[:3]) if k is not None else (0,) * 6
    args = (
        q, k_cache, v_cache, k, v, cache_seqlens, block_table,
        out if final else part, lse if final else part_lse,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *new_strides, *out.stride()[:3],
        block_table.stride(0) if paged else 0,
        heads_kv, seq_q, max_keys, k_cache.shape[1], k_cache.shape[0], split_keys,
        0 if causal else max(right, 0), max(left, 0), score_scale, cap_log2, head_dim,
    )  # fmt: skip
    meta = dict(
        GROUP=group, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_N=block_n,
        BLOCK_NEW=min(max(MIN_ROWS, next_power_of_2(seq_q)), block_n), PAGED=paged,
        PAGE_A_STEP=paged and k_cache.shape[1] % block_n == 0, PAGES=PAGES,
        HAS_SEQLENS=cache_seqlens is not None,
        HAS_NEW=k is not None, IS_CAUSAL=flags["IS_CAUSAL"], HAS_LOWER=flags["HAS_LOWER"],
        SOFTCAP=flags["SOFTCAP"], FINAL=final, EXACT_DOT_IN_FP32=interpret(), num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    result = [Launch("decode" if final else "decode split", _decode_kernel, args, meta,
                     grid=(splits, batch * heads_kv, row_blocks))]  # fmt: skip
    if not final:
        combine = (part, part_lse, out, lse, *out.stride()[:3], splits, heads_kv, seq_q, head_dim)
        meta = dict(GROUP=group, BLOCK_S=min(next_power_of_2(splits), COMBINE_SPLITS), BLOCK_D=block_d,
                    num_warps=4)  # fmt: skip
        result.append(
            Launch("decode combine", _combine_kernel, combine, meta, grid=(batch * heads_kv, group * seq_q))
        )
    return result


def flash_attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    num_splits: int = 0,
):
    """Attention of new query tokens over a KV cache (flash-attn's ``flash_attn_with_kvcache``).

    q (B, Sq, Hq, D) fp16/bf16; ``k_cache``, ``v_cache`` (B, S_cache, Hkv, D), or paged
    (num_blocks, block_size, Hkv, D) with ``block_table`` (B, blocks a sequence) int32;
    ``cache_seqlens`` (B,) int32, or an int for every sequence, the tokens already cached (None: every
    sequence full). ``k``, ``v`` (B, Sq, Hkv, D), when given, are written into the cache at positions
    cache_seqlens[b]... in place and attended to with the rest (the caller advances cache_seqlens).
    Causal masks align bottom-right; ``window`` and ``softcap`` as ``flash_attention``'s.
    ``num_splits``: key splits (0: by ``default_splits``). Returns the output (B, Sq, Hq, D), and
    with ``return_lse`` the fp32 lse (B, Hq, Sq). Forward only: decoding needs no gradient, and
    asking for one raises.

    No host sync and no allocation that depends on the lengths: a CUDA graph replays a call with
    new ``cache_seqlens`` and ``block_table`` contents. So what only their values show is not
    raised but marked: a sequence whose keys (cached plus appended) would overrun its cache, whose
    ``cache_seqlens`` entry is negative, or whose table names a block outside the cache, gets NaN
    outputs and lse, and nothing is written past its cache (nothing at all for a negative length)."""
    window = check_window(window)
    splits = as_int(num_splits)
    if splits is None or splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: by the rule), got {num_splits!r}")
    num_splits = splits
    softcap = float(softcap)
    one_length = None if isinstance(cache_seqlens, torch.Tensor) else as_int(cache_seqlens)  # numpy's too
    if one_length is not None and isinstance(q, torch.Tensor):
        cache_seqlens = q.new_full((q.shape[0],), one_length, dtype=torch.int32)  # flash-attn takes one
    # the kernel reads an entry of each at the row's index (a table row's at its column)
    cache_seqlens, block_table = (
        t.contiguous() if isinstance(t, torch.Tensor) else t for t in (cache_seqlens, block_table)
    )
    inputs = (q, k_cache, v_cache, k, v, cache_seqlens, block_table)
    key = call_signature(inputs, window, softcap, num_splits, scale, causal)
    splits, plan = _plans.get(key, (0, None)) if key is not None else (0, None)
    known = splits > 0
    # the check once a signature: at B = 1 the call is host-bound (docs/perf-notes/decode-and-ring.md)
    if not known:
        _check(*inputs, softcap)
        splits = num_splits or default_splits(
            q.shape[0], k_cache.shape[2], _max_keys(k_cache, block_table), q.device, block_table is not None
        )
    batch, seq_q, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[2]
    out = empty_output_like(q)
    lse = empty_output((batch, heads_q, seq_q), torch.float32, q.device)
    part, part_lse = _partials(splits, batch * heads_kv, (heads_q // heads_kv) * seq_q, head_dim, q.device)
    tensors = (*inputs, out, lse, part, part_lse)
    replayed = bool(out.numel()) and plan is not None and plan.run(tensors)
    if replayed:  # the op's own call moves the written caches' version counters (in_place); a replay
        for cache in (k_cache, v_cache) if k is not None else ():
            torch.autograd.graph.increment_version(cache)
    elif out.numel():
        options = (softmax_scale(scale, head_dim), bool(causal), window[0], window[1], softcap)
        _decode(*tensors, *options)
        if key is not None and not known:  # its launches, once run, replayed by later calls like it
            plan = Plan.record(launches(*tensors, *options), tensors)
    if not known:
        _remember(key, splits, plan)
    wanting = [t for t in (q, k_cache, v_cache, k, v) if t is not None and t.requires_grad]
    if torch.is_grad_enabled() and wanting:
        out, lse = (_NoGradient.apply(t, wanting[0]) for t in (out, lse))
    return (out, lse) if return_lse else out


_ONE_SPLIT: dict = {}  # device -> the (part, part_lse) pair eager calls of one split share


def _partials(splits: int, pairs: int, rows: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' fp32 partial outputs (splits, B x Hkv, rows, D) and lses. At one split no launch
    touches them (the kernel writes the output and lse) and they carry only the count, their first
    dim: eager calls then share one pair a device, two allocations a call fewer (a traced call
    allocates its own, the graph's)."""
    shapes = (
        ((splits, pairs, rows, head_dim), (splits, pairs, rows)) if splits > 1 else ((1, 1, 1, 1), (1, 1, 1))
    )
    if splits > 1 or torch.compiler.is_compiling():
        return tuple(empty_output(shape, torch.float32, device) for shape in shapes)
    pair = _ONE_SPLIT.get(device)
    if pair is None:
        pair = _ONE_SPLIT[device] = tuple(
            torch.empty(shape, dtype=torch.float32, device=device) for shape in shapes
        )
    return pair


class _NoGradient(torch.autograd.Function):
    """Marks the output of a call made with grad enabled: its backward raises, naming the op."""

    @staticmethod
    def forward(ctx, out, source):  # source: an input that requires grad, so that the output does
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "tritonkit.flash_attention_with_kvcache has no backward: decoding needs none; "
            "train with tritonkit.flash_attention"
        )


def kvcache_reference(
    q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, causal=True, scale=None,
    window=(-1, -1), softcap=0.0, return_lse=False, num_splits=0,
):  # fmt: skip
    """Plain PyTorch, sequence by sequence (host loops; for tests): the keys gathered from the cache
    (after the append, on copies: the caller's cache is left alone) into (1, Hkv, L_b, D), then
    ``attention_reference``, causal bottom-right. Pass float64 tensors for the oracle's reference."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    slots = k_cache.shape[1]
    if k is not None:  # the new tokens at positions cache_seqlens[b] + i, one sequence at a time
        for b in range(q.shape[0]):
            positions = int(cache_seqlens[b]) + torch.arange(k.shape[1], device=q.device)
            blocks = positions * 0 + b if block_table is None else block_table[b].long()[positions // slots]
            slot = positions if block_table is None else positions % slots
            k_cache[blocks, slot], v_cache[blocks, slot] = k[b], v[b]
    batch, seq_q = q.shape[:2]
    outputs, lses = [], []
    for b in range(batch):
        length = (
            k_cache.shape[1] if cache_seqlens is None else int(cache_seqlens[b]) + (0 if k is None else seq_q)
        )
        if block_table is None:
            keys, values = k_cache[b, :length], v_cache[b, :length]
        else:
            index = torch.arange(length, device=q.device)
            blocks = block_table[b].long()[index // slots]
            keys, values = k_cache[blocks, index % slots], v_cache[blocks, index % slots]
        o, lse = attention_reference(
            q[b : b + 1].transpose(1, 2), keys[None].transpose(1, 2), values[None].transpose(1, 2),
            causal, scale, True, True, tuple(window), softcap,
        )  # fmt: skip
        outputs.append(o.transpose(1, 2))
        lses.append(lse)
    out, lse = torch.cat(outputs), torch.cat(lses)
    return (out, lse) if return_lse else out
