"""Attention forward, FlashAttention-2 style: ``O = softmax(scale * Q K^T + mask) V``, never storing
the Sq x Sk scores.

Maths. For query row i and the keys j it may attend to, with scores s_ij = scale * q_i . k_j:
    m_i = max_j s_ij,   l_i = sum_j exp(s_ij - m_i),   o_i = sum_j exp(s_ij - m_i) v_j / l_i,
    lse_i = m_i + log l_i   (the log-sum-exp: what merging results over disjoint key sets needs).
A program holds a block of query rows and walks the key blocks once with the online softmax: when
a block raises the running max from m to m', the running sum and the accumulator are rescaled by
exp(m - m'). Exponentials are exp2, with scale * log2(e) folded into the scores (one multiply).

Masks. Causal: query i sees key j iff j <= i + offset. offset = 0 aligns the mask top-left, as
torch's scaled_dot_product_attention does; offset = Sk - Sq aligns it bottom-right, as
FlashAttention >= 2.1 does (the last query sees every key, which KV-cache decoding needs). A
sliding window (left, right) bounds j to [i + offset - left, i + offset + right] (either side may
be open; causal closes the right at 0). A row that sees no key outputs 0 and has lse = -inf. Only
the key blocks a bound cuts (its diagonal and the ragged end) are masked; blocks outside the bounds
are skipped. Soft-capping replaces the scaled score s by softcap * tanh(s / softcap) before the
softmax. GQA/MQA: query head h reads key/value head h // (Hq / Hkv). Packed variable-length
batches run the same kernels on (1, H, T, D) views of the (T, H, D) tensors: a program's batch
index names its sequence, whose rows and lengths it reads from cu_seqlens (VARLEN). On sm_90 a
tuned config may read K and V through tensor descriptors (TMA) built per program over its
sequence's keys.

Work. FLOPs 4 * B * Hq * Sq * Sk * D (two matmuls), about half of it when causal with Sq = Sk; HBM
bytes s * (|Q| + |K| + |V| + |O|) + 4 * B * Hq * Sq for the lse when K and V of a head stay in L2
while its query blocks pass. At D = 128 and S = 4096 that is about 1000 FLOP a byte: compute-bound,
so the roofline is the tensor cores' peak.

The scores' scale, cap and masks, the packed batches, the tuning key, the calibration problem and
the reference the gate compares against are in ``common``, which the backward shares.
"""

from __future__ import annotations

import logging

import torch

from tritonkit import tuning
from tritonkit._launch import Launch, cdiv, ensure_allocator, tma_ready
from tritonkit._runtime import current_device, empty_output, interpret, shared_memory_bytes
from tritonkit._triton import tl, triton
from tritonkit.jit import dot_fp32
from tritonkit.ops.attention.common import (
    Packed,
    Scores,
    _block_d,
    _exponent,
    _key_ranges,
    _sequence,
    _visible,
    attention_reference,
    calibration_inputs,
    calibration_scores,
    empty_in_layout,
    grid_lengths,
    per_sequence,
    problem_runs,
    sequence_args,
    tuning_key,
)

LN_2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _attn_fwd_blocks(
    acc,
    l_i,
    m_i,
    q,
    k_source,
    v_source,
    stride_kn,
    stride_vn,
    offs_m,
    offs_n,
    d_mask,
    start,
    end,
    SEQ_K,
    UPPER_OFFSET,
    LOWER_OFFSET,
    score_scale,
    cap_log2,
    IS_CAUSAL: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EXACT_DOT_IN_FP32: tl.constexpr,
    TMA: tl.constexpr,
):
    """The online softmax over the key blocks in [start, end): the running (acc, l_i, m_i) after them.

    ``k_source`` points at the head's first key block as a transposed (D, BLOCK_N) tile,
    ``v_source`` at its first value block, (BLOCK_N, D); ``d_mask`` masks head dims past D. With
    TMA they are tensor descriptors of the sequence's keys and values instead, whose loads fill
    rows past SEQ_K and dims past D with zeros. MASKED blocks also mask keys past SEQ_K and keys
    outside each row's bounds (``Scores``). EXACT_DOT_IN_FP32: see ``_dot``. P is rounded to
    V's dtype before its product in both paths, as the tensor cores take it."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if TMA:
            k = tl.trans(k_source.load([start_n, 0]))
        else:
            k_ptrs = k_source + tl.cast(start_n, tl.int64) * stride_kn  # int64: S * stride may pass 2^31
            v_ptrs = v_source + tl.cast(start_n, tl.int64) * stride_vn
            if MASKED:
                k = tl.load(k_ptrs, mask=d_mask[:, None] & (cols[None, :] < SEQ_K), other=0.0)
            else:
                k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
        s, _ = _exponent(  # log2 units
            dot_fp32(q, k, EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32), score_scale, cap_log2, SOFTCAP=SOFTCAP
        )
        if MASKED:
            visible = _visible(
                offs_m[:, None],
                cols[None, :],
                SEQ_K,
                UPPER_OFFSET,
                LOWER_OFFSET,
                IS_CAUSAL=IS_CAUSAL,
                HAS_LOWER=HAS_LOWER,
            )
            s = tl.where(visible, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row with no key yet keeps m = -inf (a 0 there would leave its first key's p unscaled,
            # below 1 and rounded, or under fp32's range); exp2 takes 0 then, so that -inf - -inf
            # does not make NaN
            m_exp = tl.where(m_new == -float("inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_exp = m_new
        p = tl.math.exp2(s - m_exp[:, None])
        alpha = tl.math.exp2(m_i - m_exp)
        l_i = l_i * alpha + tl.sum(p, 1)
        if TMA:
            v = v_source.load([start_n, 0])
        else:
            if MASKED:
                v = tl.load(v_ptrs, mask=d_mask[None, :] & (cols[:, None] < SEQ_K), other=0.0)
            else:
                v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + dot_fp32(p.to(v.dtype), v, EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _unmasked_scores(
    q, k_source, start_n, stride_kn, d_mask, EXACT_DOT_IN_FP32: tl.constexpr, TMA: tl.constexpr
):
    """q @ K^T for the key block at ``start_n``, a block every row sees whole (no key mask)."""
    if TMA:
        k = tl.trans(k_source.load([start_n, 0]))
    else:
        k = tl.load(k_source + tl.cast(start_n, tl.int64) * stride_kn, mask=d_mask[:, None], other=0.0)
    return dot_fp32(q, k, EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32)


@triton.jit
def _fold_unmasked(
    acc,
    l_i,
    m_i,
    dot,
    v_source,
    start_n,
    stride_vn,
    d_mask,
    score_scale,
    cap_log2,
    SOFTCAP: tl.constexpr,
    EXACT_DOT_IN_FP32: tl.constexpr,
    TMA: tl.constexpr,
):
    """The online softmax's step for an unmasked key block whose scores ``dot`` are in hand."""
    s, _ = _exponent(dot, score_scale, cap_log2, SOFTCAP=SOFTCAP)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if TMA:
        v = v_source.load([start_n, 0])
    else:
        v = tl.load(v_source + tl.cast(start_n, tl.int64) * stride_vn, mask=d_mask[None, :], other=0.0)
    acc = acc * alpha[:, None] + dot_fp32(p.to(v.dtype), v, EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32)
    return acc, l_i, m_new


@triton.jit
def _attn_fwd_blocks_ahead(
    acc,
    l_i,
    m_i,
    q,
    k_source,
    v_source,
    stride_kn,
    stride_vn,
    d_mask,
    start,
    end,
    score_scale,
    cap_log2,
    SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EXACT_DOT_IN_FP32: tl.constexpr,
    TMA: tl.constexpr,
):
    """``_attn_fwd_blocks`` over unmasked key blocks [start, end) (a multiple of BLOCK_N), one block
    ahead: each step issues the next block's q @ K^T before this block's softmax, so that the tensor
    cores have work while the exponentials run (FlashAttention-3's overlap within a warpgroup)."""
    if start < end:
        dot = _unmasked_scores(
            q, k_source, start, stride_kn, d_mask, EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32, TMA=TMA
        )
        for start_n in range(start, end - BLOCK_N, BLOCK_N):
            dot_next = _unmasked_scores(
                q,
                k_source,
                start_n + BLOCK_N,
                stride_kn,
                d_mask,
                EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32,
                TMA=TMA,
            )
            acc, l_i, m_i = _fold_unmasked(
                acc,
                l_i,
                m_i,
                dot,
                v_source,
                start_n,
                stride_vn,
                d_mask,
                score_scale,
                cap_log2,
                SOFTCAP=SOFTCAP,
                EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32,
                TMA=TMA,
            )
            dot = dot_next
        acc, l_i, m_i = _fold_unmasked(
            acc,
            l_i,
            m_i,
            dot,
            v_source,
            end - BLOCK_N,
            stride_vn,
            d_mask,
            score_scale,
            cap_log2,
            SOFTCAP=SOFTCAP,
            EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32,
            TMA=TMA,
        )
    return acc, l_i, m_i


# ---------------------------------------------------------------- the kernel's tiles: configs and prune

# The interpreter runs each program in numpy: small tiles, so that the few rows of a test shape
# still make several query blocks and key blocks (the masked and unmasked stages both run).
INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
CONFIGS = [
    {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
    for block_m in (64, 128)
    for block_n in (32, 64, 128)
    for warps in (4, 8)
    for stages in (2, 3, 4)
]
# K and V through tensor descriptors (TMA): no address arithmetic or cp.async in the loop (sm_90:
# 145 registers at 128 x 64 and 8 warps, against 190); on the H200 0-9% slower than pointer loads
CONFIGS += [
    {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages, "TMA": True}
    for block_m, warps in ((64, 4), (128, 8))
    for block_n in (64, 128)
    for stages in (3, 4)
]
# One block ahead (LOOKAHEAD): two score tiles live at once, so 64-key steps only (sm_90, D = 128:
# 228-231 registers, no spills; 128-key steps spill). Two or three stages, or TMA at three (two
# crash ptxas with descriptors).
CONFIGS += [
    {"BLOCK_M": block_m, "BLOCK_N": 64, "num_warps": warps, "num_stages": stages, "LOOKAHEAD": True, **tma}
    for block_m, warps in ((64, 4), (128, 8))
    for stages, tma in ((2, {}), (3, {}), (3, {"TMA": True}))
]
# A config is pruned when its accumulator and score tiles (two with LOOKAHEAD) pass MAX_TILE_VALUES
# fp32 values a thread (sm_90 doubles that in registers: 128 rows at D = 256 and 8 warps, 160
# values, spilled) or when its stages of K and V tiles and the Q tile pass the shared memory of an SM.
MAX_TILE_VALUES = 128


def _default(key: dict) -> dict:
    """The untuned config, from the H200's shipped tuning records (tuned/h200.json), the tile nearest
    to every record's fastest among those that compile for sm_90 without spills: at D = 128 64
    query rows by 64-key steps (1.03x the fastest on average, 1.12x at worst, where
    Triton's tutorial tile, 128 rows at 8 warps, ran 1.08x and 1.15x), at D = 64 64 rows by
    32-key steps in three stages (1.13x and 1.37x, against 1.39x and 2.60x; in two stages 1.22x
    and 1.36x, but those segfault ptxas causal at D = 16 and 32; tests/test_attention_tuning.py).
    At D = 256, 64 rows at 8 warps (sm_90: 128 rows at 8 warps, or 64 at 4, spill; this compiles
    to 222 registers and none). The interpreter's small tiles under the interpreter."""
    if interpret():
        return dict(INTERPRETER_CONFIG)
    if key["head_dim"] <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
    if key["head_dim"] <= 128:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}


def _prune(config: dict, key: dict) -> bool:
    """True drops the config: too many fp32 values a thread, too much shared memory, or more query
    rows a program than the problem has."""
    block_d, threads = _block_d(key["head_dim"]), 32 * config["num_warps"]
    score_tiles = 2 if config.get("LOOKAHEAD") else 1
    values = (config["BLOCK_M"] * block_d + score_tiles * config["BLOCK_M"] * config["BLOCK_N"]) / threads
    shared = 2 * (config["num_stages"] * 2 * config["BLOCK_N"] * block_d + config["BLOCK_M"] * block_d)
    too_much_shared = shared > shared_memory_bytes(current_device())
    return (
        values > MAX_TILE_VALUES
        or too_much_shared
        or config["BLOCK_M"] > 2 * key["seq_q"]
        or _crashes_ptxas(config, key)
    )


def _crashes_ptxas(config: dict, key: dict) -> bool:
    """Configs whose sm_90 compile segfaults ptxas (Triton 3.6's) at D = 64 on some of the shapes
    the tuner calibrates on (found compiling every candidate for sm_90): LOOKAHEAD, and a 64 x 32
    tile over 8 warps. The tuner would reject them, after a compile each; none ever won."""
    if key["head_dim"] > 64:
        return False
    small_tile_wide = config["BLOCK_M"] == 64 and config["BLOCK_N"] == 32 and config["num_warps"] == 8
    return bool(config.get("LOOKAHEAD")) or small_tile_wide


@triton.jit
def _attn_fwd_kernel(
    q_ptr,  # queries, (B, Hq, Sq, D), strides stride_q*
    k_ptr,  # keys, (B, Hkv, Sk, D), strides stride_k*
    v_ptr,  # values, (B, Hkv, Sk, D), strides stride_v*
    o_ptr,  # output, (B, Hq, Sq, D), strides stride_o* and 1
    lse_ptr,  # fp32 log-sum-exp of each query row's scores (natural log), (B, Hq, Sq), strides stride_l*, 1
    cu_q_ptr,
    cu_k_ptr,  # VARLEN: int32 first row of each packed sequence of q and of k, and the total
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,  # elements between batches, heads, rows, head dims of q
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,  # ... of k
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,  # ... of v
    stride_ob,
    stride_oh,
    stride_om,  # ... of o
    stride_lb,
    stride_lh,  # ... of the lse
    H,  # query heads
    GROUP,  # query heads per key/value head (1 without GQA)
    SEQ_Q,  # query rows per head (VARLEN: per sequence, read from cu_q_ptr)
    SEQ_K,  # keys per head (VARLEN: per sequence)
    UPPER_OFFSET,  # IS_CAUSAL: query i sees key j only if j <= i + UPPER_OFFSET
    LOWER_OFFSET,  # HAS_LOWER: ... and only if j >= i + LOWER_OFFSET
    score_scale,  # the exponent in log2 units is dot * score_scale (with SOFTCAP, its tanh's argument)
    cap_log2,  # SOFTCAP: softcap * log2(e), the tanh's scale
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # power of two >= D
    IS_CAUSAL: tl.constexpr,  # keys have an upper bound (causal, or a window's right side)
    HAS_LOWER: tl.constexpr,  # keys have a lower bound (a window's left side)
    SOFTCAP: tl.constexpr,  # the scores are soft-capped
    VARLEN: tl.constexpr,  # a packed batch: a program's "batch" is a sequence; batch strides are 0
    BLOCK_M: tl.constexpr,  # query rows a program holds
    BLOCK_N: tl.constexpr,  # keys a step of the loop takes
    EXACT_DOT_IN_FP32: tl.constexpr,  # multiply the 16-bit tiles as fp32 (the interpreter's path)
    TMA: tl.constexpr,  # load K and V through tensor descriptors (sm_90; unit head-dim stride)
    LOOKAHEAD: tl.constexpr,  # unmasked blocks: the next block's scores before this one's softmax
):
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1) % H
    batch = (tl.program_id(1) // H).to(tl.int64)  # int64: batch * stride may pass 2^31
    kv_head = (head // GROUP).to(tl.int64)
    q_start, SEQ_Q, k_start, SEQ_K, UPPER_OFFSET, LOWER_OFFSET = _sequence(
        batch, cu_q_ptr, cu_k_ptr, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, VARLEN=VARLEN
    )
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM  # all true (and folded away) when D is a power of two
    first_row = q_start + start_m.to(tl.int64)  # int64: S * stride may pass 2^31
    q_rows = q_ptr + batch * stride_qb + head.to(tl.int64) * stride_qh + first_row * stride_qm
    q = tl.load(
        q_rows + tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=(offs_m[:, None] < SEQ_Q) & d_mask[None, :],
        other=0.0,
    )
    k_head = k_ptr + batch * stride_kb + kv_head * stride_kh + k_start * stride_kn
    v_head = v_ptr + batch * stride_vb + kv_head * stride_vh + k_start * stride_vn
    if TMA:  # bounded by this sequence's keys: rows past them, and dims past D, load as zeros (a
        # sequence without keys gets a one-row extent, never read: its key loops are empty)
        keys = tl.maximum(SEQ_K, 1)
        k_source = tl.make_tensor_descriptor(
            k_head, shape=[keys, HEAD_DIM], strides=[stride_kn, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
        v_source = tl.make_tensor_descriptor(
            v_head, shape=[keys, HEAD_DIM], strides=[stride_vn, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
    else:  # K^T as a (D, BLOCK_N) tile, so that the scores are q @ k; V as (BLOCK_N, D)
        k_source = k_head + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
        v_source = v_head + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    start, inner_start, inner_end, end = _key_ranges(
        start_m,
        SEQ_Q,
        SEQ_K,
        UPPER_OFFSET,
        LOWER_OFFSET,
        IS_CAUSAL=IS_CAUSAL,
        HAS_LOWER=HAS_LOWER,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
    )
    acc, l_i, m_i = _attn_fwd_blocks(
        acc,
        l_i,
        m_i,
        q,
        k_source,
        v_source,
        stride_kn,
        stride_vn,
        offs_m,
        offs_n,
        d_mask,
        start,
        inner_start,
        SEQ_K,
        UPPER_OFFSET,
        LOWER_OFFSET,
        score_scale,
        cap_log2,
        IS_CAUSAL=IS_CAUSAL,
        HAS_LOWER=HAS_LOWER,
        SOFTCAP=SOFTCAP,
        MASKED=True,
        BLOCK_N=BLOCK_N,
        EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32,
        TMA=TMA,
    )
    if LOOKAHEAD:
        acc, l_i, m_i = _attn_fwd_blocks_ahead(
            acc,
            l_i,
            m_i,
            q,
            k_source,
            v_source,
            stride_kn,
            stride_vn,
            d_mask,
            inner_start,
            inner_end,
            score_scale,
            cap_log2,
            SOFTCAP=SOFTCAP,
            BLOCK_N=BLOCK_N,
            EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32,
            TMA=TMA,
        )
    else:
        acc, l_i, m_i = _attn_fwd_blocks(
            acc,
            l_i,
            m_i,
            q,
            k_source,
            v_source,
            stride_kn,
            stride_vn,
            offs_m,
            offs_n,
            d_mask,
            inner_start,
            inner_end,
            SEQ_K,
            UPPER_OFFSET,
            LOWER_OFFSET,
            score_scale,
            cap_log2,
            IS_CAUSAL=IS_CAUSAL,
            HAS_LOWER=HAS_LOWER,
            SOFTCAP=SOFTCAP,
            MASKED=False,
            BLOCK_N=BLOCK_N,
            EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32,
            TMA=TMA,
        )
    acc, l_i, m_i = _attn_fwd_blocks(
        acc,
        l_i,
        m_i,
        q,
        k_source,
        v_source,
        stride_kn,
        stride_vn,
        offs_m,
        offs_n,
        d_mask,
        inner_end,
        end,
        SEQ_K,
        UPPER_OFFSET,
        LOWER_OFFSET,
        score_scale,
        cap_log2,
        IS_CAUSAL=IS_CAUSAL,
        HAS_LOWER=HAS_LOWER,
        SOFTCAP=SOFTCAP,
        MASKED=True,
        BLOCK_N=BLOCK_N,
        EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32,
        TMA=TMA,
    )
    seen = l_i > 0.0  # false only for a row that sees no key: its output is 0, its lse -inf
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    row_mask = offs_m < SEQ_Q
    o_rows = o_ptr + batch * stride_ob + head.to(tl.int64) * stride_oh + first_row * stride_om
    o_ptrs = o_rows + tl.arange(0, BLOCK_M)[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN_2, -float("inf"))
    lse_rows = lse_ptr + batch * stride_lb + head.to(tl.int64) * stride_lh + q_start
    tl.store(lse_rows + offs_m, lse, mask=row_mask)


# ---------------------------------------------------------------- launches and tuning


def _problem(q, k, v, o, lse, scores: Scores, packed: Packed | None = None) -> dict:
    """A forward call as its launches and tuner see it: q, k, v, o and the lse as the kernel takes
    them ((B, H, S, ...), or a packed batch's (1, H, T, ...) views), the scores and the batch."""
    return {"q": q, "k": k, "v": v, "o": o, "lse": lse, "scores": scores, "packed": packed}


def _fwd_launches(problem: dict, config: dict | None) -> list[Launch]:
    """The forward kernel's launch for ``problem`` with ``config`` (None: the untuned tile); a launch
    a run of batches where batch x heads pass the grid's second dimension (``problem_runs``)."""
    if len(runs := problem_runs(problem, problem["q"].shape[1])) > 1:
        return [launch for run in runs for launch in _fwd_launches(run, config)]
    q, k, v, o, lse = problem["q"], problem["k"], problem["v"], problem["o"], problem["lse"]
    scores, packed = problem["scores"], problem["packed"]
    _, heads, _, head_dim = q.shape
    shown = config or {}
    config = dict(config or _default({"head_dim": head_dim}))
    batch, seq_q, seq_k, cu, score_args, score_meta = sequence_args(
        scores, packed, q.shape[0], q.shape[2], k.shape[2], lse
    )
    strides = [
        per_sequence(t.stride()[:rank], packed) for t, rank in ((q, 4), (k, 4), (v, 4), (o, 3), (lse, 2))
    ]
    args = (
        q,
        k,
        v,
        o,
        lse,
        *cu,
        *(s for group in strides for s in group),
        heads,
        heads // k.shape[1],
        seq_q,
        seq_k,
        *score_args,
    )
    tma = config.pop("TMA", False) and _tma_ready(k, v)
    meta = {
        "HEAD_DIM": head_dim,
        "BLOCK_D": _block_d(head_dim),
        **score_meta,
        "BLOCK_M": config.pop("BLOCK_M"),
        "BLOCK_N": config.pop("BLOCK_N"),
        "EXACT_DOT_IN_FP32": interpret(),
        "TMA": tma,
        "LOOKAHEAD": config.pop("LOOKAHEAD", False),
        **config,
    }
    if tma:
        ensure_allocator()
    grid = (cdiv(seq_q, meta["BLOCK_M"]), batch * heads)
    return [Launch("fwd", _attn_fwd_kernel, args, meta, shown, grid)]


def _tma_ready(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether K and V can be read through tensor descriptors (``_launch.tma_ready``), on a GPU. A
    TMA config on other tensors runs its tile with pointer loads."""
    return not interpret() and tma_ready(k) and tma_ready(v)


# The gate compares every element of the lse, and the lse of a row that sees no key is -inf, which
# differs from itself by NaN: a calibration problem has those rows' lse set to this after its
# launch and in its reference, so that a finite lse where the reference has none, or -inf where it
# has one, is off by about 1e30 (a power of two: float32 holds it exactly, as float64 does).
UNSEEN_LSE = -(2.0**100)


def _calibration(problem: dict, config: dict) -> dict:
    """A small seeded dense problem of the call's kind (``common.calibration_inputs``), its window
    cut inside its blocks, outputs allocated (the gate poisons them)."""
    key = tuning_key(problem["q"], problem["k"], problem["scores"], problem["packed"])
    q, k, v = calibration_inputs(key, config, problem["q"].device)
    o, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
    scores = calibration_scores(problem["scores"], config)
    return _problem(q, k, v, o, lse, scores) | {"unseen_lse": UNSEEN_LSE}


def _problem_reference(problem: dict) -> dict:
    """The output and lse of a dense problem in plain PyTorch; where the problem names an
    ``unseen_lse``, the lse of a row that sees no key is that instead of -inf."""
    if problem["packed"] is not None:
        raise ValueError("the forward's problem reference takes dense problems (calibration problems are)")
    o, lse = attention_reference(
        problem["q"], problem["k"], problem["v"], return_lse=True, **problem["scores"]._asdict()
    )
    if problem.get("unseen_lse") is not None:
        lse = lse.masked_fill(torch.isneginf(lse), problem["unseen_lse"])
    return {"o": o, "lse": lse}


class _ForwardTuned(tuning.Tuned):
    """The forward's tuned kernel: the scaffolding's, with a run that, on a problem naming an
    ``unseen_lse`` (a calibration problem), sets the lse of the rows that see no key to it after
    the launch, as its reference does (see UNSEEN_LSE)."""

    def run(self, problem: dict, config: dict) -> None:
        super().run(problem, config)
        unseen = problem.get("unseen_lse")
        if unseen is not None:
            problem["lse"].masked_fill_(torch.isneginf(problem["lse"]), unseen)


_TUNER = tuning.Tuner("attention_fwd", CONFIGS, default=_default, prune=_prune, sources=(_attn_fwd_kernel,))
_TUNED = _ForwardTuned(
    _TUNER, launches=_fwd_launches, calibrate=_calibration, reference=_problem_reference, outputs=("o", "lse")
)


log = logging.getLogger("tritonkit")

# Whether a forward the sm_90 Gluon kernel takes (``fwd_sm90.supports``) runs there: on the H200 it
# ran at 1.01-1.08x cuDNN at D = 128 and 0.89-0.96x at D = 64 and 1024 tokens
# (docs/perf-notes/attention-forward.md), past this Triton kernel's 0.76-0.88x at every shape measured.
SM90_FORWARD = True

# A window whose rows see at most this many keys runs this Triton kernel: a Gluon tile there walks 2
# to 5 key blocks (why they cost is not established: walking them in one loop, less code, ran no
# faster). Measured on an H100 at 6e9ec9c (docs/perf-notes/attention-forward-sm90-features.md),
# causal at 4096 keys: a window of 256 keys (capped at 30) ran on the Gluon kernel at 0.70x the
# Triton kernel's rate at D = 128 and 0.48x at D = 64, one of 1025 keys at 1.60x and 1.09x. Not
# measured between: the bound is the middle.
NARROW_WINDOW_KEYS = 512
# Uncapped at the D = 128 kernel (head dims 72 to 128) there is none: there a 256-key window ran 1.35x
# the Triton kernel (0.76x at D = 64; an H100 at 3688ffe, "A tile of few blocks in one masked loop" in
# the same notes), so the cap, not the window, made the capped row lose; and at (2, 32/8, 4096, 128)
# causal a 128-key window 1.30x, 64 keys 1.15x, 32 keys 1.12x (an H100 at c4c0611, one run each, the
# ratios' spread 9-12%; at D = 64 a 128-key window 0.79x; `results/h100/history/
# attention-fwd-sm90-narrow-windows-c4c0611.json`).
NARROW_UNCAPPED_WINDOW_KEYS = 0


def narrow_window_keys(scores: Scores, head_dim: int) -> int:
    """The widest window, in keys a row sees, that takes the Triton forward for these scores."""
    uncapped_128 = not scores.softcap and 64 < head_dim <= 128
    return NARROW_UNCAPPED_WINDOW_KEYS if uncapped_128 else NARROW_WINDOW_KEYS


def window_keys(scores: Scores, seq_q: int, seq_k: int) -> int | None:
    """The keys a row's window spans (left + right + 1; causal, right 0) for (seq_q, seq_k) lengths, or
    None where a side cuts nothing (``Scores.within``)."""
    left, right = scores.within(seq_q, seq_k).window
    right = 0 if scores.causal else right
    return None if left < 0 or right < 0 else left + right + 1


def sm90_takes(q, k, v, scores: Scores, packed: Packed | None) -> bool:
    """Whether the sm_90 Gluon forward (``fwd_sm90``) computes this call (a packed batch's as (1, H, T,
    D) views): natively compiled, on an sm_90 GPU, within what it supports, and no window of at most
    ``narrow_window_keys`` keys. Everything else takes the Triton kernel below."""
    if not SM90_FORWARD or interpret() or not q.is_cuda:
        return False
    span = window_keys(scores, *grid_lengths(q, k, packed))
    if span is not None and span <= narrow_window_keys(scores, q.shape[3]):
        return False
    from tritonkit.ops.attention import fwd_sm90

    return fwd_sm90.supports(
        q,
        k,
        v,
        causal=scores.causal,
        window=scores.window,
        softcap=scores.softcap,
        packed=packed is not None,
        scale=scores.scale,
    )


def attention_fwd_into(
    q, k, v, o, lse, scores: Scores, packed: Packed | None = None, config: dict | None = None
) -> None:
    """Write attention's output into ``o`` and its lse into ``lse``: over (B, H, S, D) tensors, lse
    (B, H, S); or with ``packed`` over (T, H, D) tensors, lse (H, T). The inputs are valid
    (``common.validate_qkv`` checks them); ``config`` overrides the tuned launch config of the
    Triton kernel (and so chooses it). On sm_90 the Gluon kernel takes what it supports
    (:func:`sm90_takes`); a debug log line says which kernel ran."""
    if o.numel() == 0:
        return
    shape = tuple(q.shape)
    if packed is not None:  # the kernels take (1, H, T, D) views of (T, H, D) and (1, H, T) of (H, T)
        q, k, v, o = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v, o))
        lse = lse.unsqueeze(0)
    if config is None and sm90_takes(q, k, v, scores, packed):
        from tritonkit.ops.attention import fwd_sm90

        log.debug("tritonkit: attention forward %s on the sm_90 Gluon kernel", shape)
        fwd_sm90.attention_fwd_sm90(
            q,
            k,
            v,
            o,
            lse,
            scale=scores.scale,
            causal=scores.causal,
            bottom_right=scores.bottom_right,
            window=scores.window,
            softcap=scores.softcap,
            packed=packed,
        )
        return
    log.debug("tritonkit: attention forward %s on the Triton kernel", shape)
    problem = _problem(q, k, v, o, lse, scores, packed)
    if config is None:
        signature = (q.shape, k.shape, q.dtype, q.device, scores, packed and packed[2:])
        config, _ = _TUNED.choose(tuning_key(q, k, scores, packed), problem, signature=signature)
    _TUNED.run(problem, config)


def fwd_outputs(q: torch.Tensor, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) allocated for a forward over ``q``: (B, H, S, D), laid out as q
    (``common.empty_in_layout``), and (B, H, S), or for a packed batch's (T, H, D) q, (T, H, D) and
    (H, T)."""
    o = empty_in_layout(q)
    rows = (q.shape[1], q.shape[0]) if packed else q.shape[:3]
    return o, empty_output(rows, torch.float32, q.device)


def attention_fwd(
    q, k, v, scores: Scores, config: dict | None = None, packed: Packed | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, lse) of attention, allocated here (see :func:`attention_fwd_into`)."""
    o, lse = fwd_outputs(q, packed is not None)
    attention_fwd_into(q, k, v, o, lse, scores, packed, config)
    return o, lse
