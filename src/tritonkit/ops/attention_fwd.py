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
index names its sequence, whose rows and lengths it reads from cu_seqlens (VARLEN).

Work. FLOPs 4 * B * Hq * Sq * Sk * D (two matmuls), about half of it when causal with Sq = Sk; HBM
bytes s * (|Q| + |K| + |V| + |O|) + 4 * B * Hq * Sq for the lse when K and V of a head stay in L2
while its query blocks pass. At D = 128 and S = 4096 that is about 1000 FLOP a byte: compute-bound,
so the roofline is the tensor cores' peak.
"""

from __future__ import annotations

import functools
import math

import torch

from tritonkit import tuning
from tritonkit._runtime import check_device, empty_output, interpret

interpret()  # choose GPU or interpreter before triton is imported and any kernel is defined

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tritonkit._launch import Launcher, cdiv, precompile  # noqa: E402
from tritonkit.ops.attention_bwd import (  # noqa: E402
    Packed,
    Scores,
    _exponent,
    _key_ranges,
    _sequence,
    _visible,
    attention_bwd,
    per_sequence,
)
from tritonkit.ops.attention_bwd import _inspect_launches as _inspect_bwd_launches  # noqa: E402

DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # a (BLOCK_M, 256) fp32 accumulator is already 128 registers a thread at 8 warps
LOG2_E = 1.4426950408889634
LN_2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _attn_fwd_blocks(acc, l_i, m_i, q, k_tile_ptr, v_tile_ptr, stride_kn, stride_vn, offs_m, offs_n, d_mask,
                     start, end, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, score_scale, cap_log2,
                     IS_CAUSAL: tl.constexpr, HAS_LOWER: tl.constexpr, SOFTCAP: tl.constexpr,
                     MASKED: tl.constexpr, BLOCK_N: tl.constexpr, EXACT_DOT_IN_FP32: tl.constexpr):
    """The online softmax over the key blocks in [start, end): the running (acc, l_i, m_i) after them.

    ``k_tile_ptr`` points at the head's first key block as a transposed (D, BLOCK_N) tile,
    ``v_tile_ptr`` at its first value block, (BLOCK_N, D); ``d_mask`` masks head dims past D.
    MASKED blocks also mask keys past SEQ_K and keys outside each row's bounds (``Scores``).
    EXACT_DOT_IN_FP32 multiplies the 16-bit tiles as fp32 (their products are exact there): Triton
    3.6's interpreter returns wrong bf16 dot products, so the interpreter takes this path."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k_ptrs = k_tile_ptr + tl.cast(start_n, tl.int64) * stride_kn  # int64: S * stride may pass 2^31
        v_ptrs = v_tile_ptr + tl.cast(start_n, tl.int64) * stride_vn
        if MASKED:
            k = tl.load(k_ptrs, mask=d_mask[:, None] & (cols[None, :] < SEQ_K), other=0.0)
        else:
            k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
        if EXACT_DOT_IN_FP32:
            dot = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            dot = tl.dot(q, k)
        s, _ = _exponent(dot, score_scale, cap_log2, SOFTCAP)  # scores in log2 units
        if MASKED:
            visible = _visible(offs_m[:, None], cols[None, :], SEQ_K, UPPER_OFFSET, LOWER_OFFSET, IS_CAUSAL,
                               HAS_LOWER)
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
        if MASKED:
            v = tl.load(v_ptrs, mask=d_mask[None, :] & (cols[:, None] < SEQ_K), other=0.0)
        else:
            v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
        if EXACT_DOT_IN_FP32:  # p rounded to v's dtype first, as the tensor-core path rounds it
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32),
                                                input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    q_ptr,  # queries, (B, Hq, Sq, D), strides stride_q*
    k_ptr,  # keys, (B, Hkv, Sk, D), strides stride_k*
    v_ptr,  # values, (B, Hkv, Sk, D), strides stride_v*
    o_ptr,  # output, (B, Hq, Sq, D), strides stride_o* and 1
    lse_ptr,  # fp32 log-sum-exp of each query row's scores (natural log), (B, Hq, Sq), strides stride_l*, 1
    cu_q_ptr, cu_k_ptr,  # VARLEN: int32 first row of each packed sequence of q and of k, and the total
    stride_qb, stride_qh, stride_qm, stride_qd,  # elements between batches, heads, rows, head dims of q
    stride_kb, stride_kh, stride_kn, stride_kd,  # ... of k
    stride_vb, stride_vh, stride_vn, stride_vd,  # ... of v
    stride_ob, stride_oh, stride_om,  # ... of o
    stride_lb, stride_lh,  # ... of the lse
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
):
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1) % H
    batch = (tl.program_id(1) // H).to(tl.int64)  # int64: batch * stride may pass 2^31
    kv_head = (head // GROUP).to(tl.int64)
    q_start, SEQ_Q, k_start, SEQ_K, UPPER_OFFSET, LOWER_OFFSET = _sequence(
        batch, cu_q_ptr, cu_k_ptr, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, VARLEN)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM  # all true (and folded away) when D is a power of two
    first_row = q_start + start_m.to(tl.int64)  # int64: S * stride may pass 2^31
    q_rows = q_ptr + batch * stride_qb + head.to(tl.int64) * stride_qh + first_row * stride_qm
    q = tl.load(q_rows + tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=(offs_m[:, None] < SEQ_Q) & d_mask[None, :], other=0.0)
    k_tile_ptr = k_ptr + batch * stride_kb + kv_head * stride_kh + k_start * stride_kn \
        + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd  # (D, BLOCK_N): K^T, scores = q @ k
    v_tile_ptr = v_ptr + batch * stride_vb + kv_head * stride_vh + k_start * stride_vn \
        + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    start, inner_start, inner_end, end = _key_ranges(start_m, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET,
                                                     IS_CAUSAL, HAS_LOWER, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _attn_fwd_blocks(acc, l_i, m_i, q, k_tile_ptr, v_tile_ptr, stride_kn, stride_vn, offs_m,
                                     offs_n, d_mask, start, inner_start, SEQ_K, UPPER_OFFSET, LOWER_OFFSET,
                                     score_scale, cap_log2, IS_CAUSAL, HAS_LOWER, SOFTCAP, True, BLOCK_N,
                                     EXACT_DOT_IN_FP32)
    acc, l_i, m_i = _attn_fwd_blocks(acc, l_i, m_i, q, k_tile_ptr, v_tile_ptr, stride_kn, stride_vn, offs_m,
                                     offs_n, d_mask, inner_start, inner_end, SEQ_K, UPPER_OFFSET,
                                     LOWER_OFFSET, score_scale, cap_log2, IS_CAUSAL, HAS_LOWER, SOFTCAP,
                                     False, BLOCK_N, EXACT_DOT_IN_FP32)
    acc, l_i, m_i = _attn_fwd_blocks(acc, l_i, m_i, q, k_tile_ptr, v_tile_ptr, stride_kn, stride_vn, offs_m,
                                     offs_n, d_mask, inner_end, end, SEQ_K, UPPER_OFFSET, LOWER_OFFSET,
                                     score_scale, cap_log2, IS_CAUSAL, HAS_LOWER, SOFTCAP, True, BLOCK_N,
                                     EXACT_DOT_IN_FP32)
    seen = l_i > 0.0  # false only for a row that sees no key: its output is 0, its lse -inf
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    row_mask = offs_m < SEQ_Q
    o_rows = o_ptr + batch * stride_ob + head.to(tl.int64) * stride_oh + first_row * stride_om
    o_ptrs = o_rows + tl.arange(0, BLOCK_M)[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN_2, -float("inf"))
    lse_rows = lse_ptr + batch * stride_lb + head.to(tl.int64) * stride_lh + q_start
    tl.store(lse_rows + offs_m, lse, mask=row_mask)


# ---------------------------------------------------------------- launcher and tuning

_fwd_launcher = Launcher(_attn_fwd_kernel)
# The interpreter runs each program in numpy: small tiles, so that the few rows of a test shape
# still make several query blocks and key blocks (the masked and unmasked stages both run).
INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
CONFIGS = [{"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
           for block_m in (64, 128) for block_n in (32, 64, 128) for warps in (4, 8) for stages in (2, 3, 4)]
# A config is pruned when its accumulator and score tile pass MAX_TILE_VALUES fp32 values a thread
# (sm_90 doubles that in registers: 128 rows at D = 256 and 8 warps, 160 values, spilled) or when
# its stages of K and V tiles and the Q tile pass the shared memory of an SM.
MAX_TILE_VALUES = 128
SHARED_BYTES = 227 * 1024


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _default(key: dict) -> dict:
    """The untuned config: 128 query rows a program, the tile Triton's own Hopper tutorial runs; at
    D = 256, 64 rows at 8 warps (sm_90: 128 rows at 8 warps, or 64 at 4, spill; this compiles to 222
    registers and none). The interpreter's small tiles under the interpreter."""
    if interpret():
        return dict(INTERPRETER_CONFIG)
    if key["head_dim"] <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    if key["head_dim"] <= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}


def _prune(config: dict, key: dict) -> bool:
    """True drops the config: too many fp32 values a thread, too much shared memory, or more query
    rows a program than the problem has."""
    block_d, threads = _block_d(key["head_dim"]), 32 * config["num_warps"]
    values = (config["BLOCK_M"] * block_d + config["BLOCK_M"] * config["BLOCK_N"]) / threads
    shared = 2 * (config["num_stages"] * 2 * config["BLOCK_N"] * block_d + config["BLOCK_M"] * block_d)
    return values > MAX_TILE_VALUES or shared > SHARED_BYTES or config["BLOCK_M"] > 2 * key["seq_q"]


_TUNER = tuning.Tuner("attention_fwd", CONFIGS, default=_default, prune=_prune,
                      sources=(_attn_fwd_kernel, _attn_fwd_blocks, _exponent, _visible, _key_ranges,
                               _sequence))


def _tuning_key(q: torch.Tensor, k: torch.Tensor, scores: Scores, packed: Packed | None = None) -> dict:
    """What the fastest tile depends on: the head dim, the masks, the soft cap, the dtype and the
    problem's size (sequence lengths and batch x heads, each to the next power of two). A packed
    batch (q and k its (1, H, T, D) views) counts its longest sequences and its sequences, as the
    dense batch it would pad to; the tile found for that is the one it runs."""
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    if packed is not None:
        batch, seq_q, seq_k = packed.sequences, packed.max_q, packed.max_k
    pow2 = triton.next_power_of_2
    mask = ("bottom-right" if scores.bottom_right else "top-left") if scores.causal else "none"
    sides = [side for side, bound in zip(("left", "right"), scores.window, strict=True) if bound >= 0]
    window = "+".join(sides)
    return {"head_dim": head_dim, "mask": mask, "window": window or "none", "softcap": bool(scores.softcap),
            "dtype": tuning.DTYPE_NAMES[q.dtype], "seq_q": pow2(seq_q), "seq_k": pow2(seq_k),
            "batch_heads": pow2(batch * heads), "group": heads // k.shape[1]}


def _calibration(key: dict, config: dict, device) -> tuple:
    """Seeded q, k, v of the key's kind, small: two query blocks and a ragged third, three key blocks
    and a ragged fourth (fewer where the key's sequences are shorter)."""
    from tritonkit.testing import generator, random_tensor

    seq_q = min(key["seq_q"], 2 * config["BLOCK_M"] + 5)
    seq_k = min(key["seq_k"], 3 * config["BLOCK_N"] + 7)
    dtype = {name: dtype for dtype, name in tuning.DTYPE_NAMES.items()}[key["dtype"]]
    g = generator(12)
    q = random_tensor((1, 2 * key["group"], seq_q, key["head_dim"]), dtype, device, generator=g)
    kv = [random_tensor((1, 2, seq_k, key["head_dim"]), dtype, device, generator=g) for _ in range(2)]
    return q, *kv


def _calibration_scores(scores: Scores, config: dict) -> Scores:
    """The call's scores for the calibration problem: a window's sides, where it has them, cut
    inside its few blocks (a window of the real problem's width would cover them whole)."""
    left, right = scores.window
    return scores._replace(window=(config["BLOCK_N"] + 7 if left >= 0 else -1, 5 if right >= 0 else -1))


def _admit(key: dict, scores: Scores, device, config: dict):
    """The oracle on ``config``'s output and lse for a calibration problem (the worse of the two);
    a row that sees no key must have lse -inf."""
    from tritonkit.testing import Comparison, compare, worst

    q, k, v = _calibration(key, config, device)
    scores = _calibration_scores(scores, config)
    o, lse = _attention_fwd(q, k, v, scores, config=config)
    exact = attention_reference(q.double(), k.double(), v.double(), return_lse=True, **scores._asdict())
    in_dtype = attention_reference(q, k, v, return_lse=True, **scores._asdict())
    seen = torch.isfinite(exact[1])
    if not torch.equal(torch.isneginf(lse), ~seen):
        return Comparison("lse of the rows that see no key", math.inf, 0.0, 0.0)
    return worst([compare("output", o, in_dtype[0], exact[0], q.dtype),
                  compare("lse", lse[seen], in_dtype[1][seen], exact[1][seen], torch.float32)])


def _time_ms(run, config: dict) -> float:
    """Median ms of ``run(config)``: the real problem with the config."""
    return tuning.median_ms(lambda: run(config))


def _precompile(key: dict, scores: Scores, launch_args, device, configs: list[dict]) -> None:
    """Compile every candidate for its calibration problem and the real one, together on threads."""
    calls = []
    for config in configs:
        q, k, v = _calibration(key, config, device)
        o, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
        calibration = _fwd_launch_args(q, k, v, o, lse, _calibration_scores(scores, config), config)
        for grid, args, meta in (calibration, launch_args(config)):
            calls.append((_fwd_launcher, grid, args, meta))
    precompile(calls)


MAX_CHOSEN = 4096  # call signatures whose config is kept, so a repeated call skips the tuning key
_chosen: dict[tuple, dict] = {}


def _config(q, k, v, o, lse, scores: Scores, packed: Packed | None) -> dict:
    """The tuned (or default) config for this call's signature."""
    signature = (q.shape, k.shape, q.dtype, q.device, scores, packed and packed[2:])
    config = _chosen.get(signature)
    if config is not None:
        return config
    key = _tuning_key(q, k, scores, packed)

    def launch_args(candidate):
        return _fwd_launch_args(q, k, v, o, lse, scores, candidate, packed)

    def run(candidate):
        grid, args, meta = launch_args(candidate)
        _fwd_launcher(grid, *args, **meta)

    entry = _TUNER.entry(key, admit=functools.partial(_admit, key, scores, q.device),
                         time_ms=functools.partial(_time_ms, run),
                         precompile=functools.partial(_precompile, key, scores, launch_args, q.device))
    config = _TUNER.default(key) if entry is None else entry["config"]
    if entry is not None or interpret():  # final: tuned, cached, or the interpreter's one config
        tuning.remember(_chosen, signature, config, MAX_CHOSEN)
    return config


def _validate(q, k, v) -> None:
    for name, tensor in (("query", q), ("key", k), ("value", v)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in DTYPES:
            raise TypeError(f"{name} must be float16 or bfloat16, got {tensor.dtype}")
        if tensor.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, sequence, head dim), got shape "
                             f"{tuple(tensor.shape)}")
        check_device(name, tensor)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"query, key and value must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"query, key and value must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}")
    (batch, heads_q, _, head_dim), (batch_k, heads_kv, _, head_dim_k) = q.shape, k.shape
    if v.shape != k.shape:
        raise ValueError(f"value must have key's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if batch_k != batch:
        raise ValueError(f"key and value must have query's batch size {batch}, got {batch_k}")
    if head_dim_k != head_dim:
        raise ValueError(f"key and value must have query's head dim {head_dim}, got {head_dim_k}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be 1 to {MAX_HEAD_DIM}, got {head_dim}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")


def _attention_fwd(q, k, v, scores: Scores, config: dict | None = None,
                   packed: Packed | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, lse) of attention: over (B, H, S, D) tensors, lse (B, H, S); or with ``packed`` over
    (T, H, D) tensors, lse (H, T). ``config`` overrides the launch config."""
    o = empty_output(q.shape, q.dtype, q.device)
    if packed is None:
        _validate(q, k, v)
        lse = empty_output(q.shape[:3], torch.float32, q.device)
        views = (q, k, v, o, lse)
    else:
        lse = empty_output((q.shape[1], q.shape[0]), torch.float32, q.device)
        views = (*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v, o)), lse.unsqueeze(0))
    if o.numel() == 0:
        return o, lse
    if config is None:
        config = _config(*views, scores, packed)
    grid, args, meta = _fwd_launch_args(*views, scores, config, packed)
    _fwd_launcher(grid, *args, **meta)
    return o, lse


def _fwd_launch_args(q, k, v, o, lse, scores: Scores, config: dict | None,
                     packed: Packed | None = None) -> tuple[tuple, tuple, dict]:
    """(grid, arguments, constexprs and options) of the forward kernel; ``packed`` for a packed
    batch (q, k, v, o and the lse are then its (1, H, T, ...) views)."""
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    config = dict(config or _default({"head_dim": head_dim}))
    if packed is None:
        score_args, score_meta = scores.kernel_args(seq_q, seq_k)
        cu_q = cu_k = lse  # not read
    else:  # the offsets hold the window's sides; each sequence adds its own alignment
        score_args, score_meta = scores.kernel_args(0, 0)
        cu_q, cu_k, batch, seq_q, seq_k = packed
    strides = [per_sequence(t.stride()[:rank], packed)
               for t, rank in ((q, 4), (k, 4), (v, 4), (o, 3), (lse, 2))]
    args = (q, k, v, o, lse, cu_q, cu_k, *(s for group in strides for s in group), heads, heads // k.shape[1],
            seq_q, seq_k, *score_args)
    meta = {"HEAD_DIM": head_dim, "BLOCK_D": _block_d(head_dim), **score_meta, "VARLEN": packed is not None,
            "BLOCK_M": config.pop("BLOCK_M"), "BLOCK_N": config.pop("BLOCK_N"),
            "EXACT_DOT_IN_FP32": interpret(), **config}
    return (cdiv(seq_q, meta["BLOCK_M"]), batch * heads), args, meta


# ---------------------------------------------------------------- custom op and public functions


# The custom ops take Scores' and Packed's fields one by one (a custom op's arguments are tensors
# and scalars); a dense call has no cu_seqlens.
@torch.library.custom_op("tritonkit::attention_fwd", mutates_args=())
def _attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
                      cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                      causal: bool, bottom_right: bool, window_left: int, window_right: int,
                      softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _attention_fwd(q, k, v, Scores(scale, causal, bottom_right, (window_left, window_right), softcap),
                          packed=_packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


@_attention_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *scores):
    if cu_seqlens_q is None:
        _validate(q, k, v)
        return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("tritonkit::attention_bwd", mutates_args=())
def _attention_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor, dlse: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
                      cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                      causal: bool, bottom_right: bool, window_left: int, window_right: int,
                      softcap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attention_bwd(do, q, k, v, o, lse, dlse,
                         Scores(scale, causal, bottom_right, (window_left, window_right), softcap),
                         packed=_packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


@_attention_bwd_op.register_fake
def _(do, q, k, v, o, lse, dlse, *options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int) -> Packed | None:
    if cu_seqlens_q is None:
        return None
    return Packed(cu_seqlens_q, cu_seqlens_k, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_k, *options = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.options = options
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros to read


def _backward(ctx, do, dlse):
    q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    if do is None:  # only the lse was differentiated
        do = torch.zeros_like(o)
    dq, dk, dv = _attention_bwd_op(do, q, k, v, o, lse, dlse, cu_seqlens_q, cu_seqlens_k, *ctx.options)
    return dq, dk, dv, *([None] * (2 + len(ctx.options)))


_attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _call(q, k, v, scores: Scores, packed: Packed | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward custom op (differentiable) on validated inputs."""
    cu_q, cu_k, _, max_q, max_k = packed or (None, None, 0, 0, 0)
    return _attention_fwd_op(q, k, v, cu_q, cu_k, max_q, max_k, scores.scale, scores.causal,
                             scores.bottom_right, *scores.window, scores.softcap)


def _scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    return_lse: bool = False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                    max_seqlen_k=None):
    """Attention over (B, H, S, D) fp16/bf16 tensors, FlashAttention's conventions: ``causal``
    aligned bottom-right when Sq != Sk; GQA/MQA when k and v have fewer heads (a divisor of q's);
    ``scale`` defaults to 1/sqrt(D). ``window`` = (left, right) lets query i see only the keys from
    i + Sk - Sq - left to i + Sk - Sq + right (-1: no bound on that side; causal sets right to 0).
    ``softcap`` > 0 caps each scaled score s as softcap * tanh(s / softcap). With ``return_lse``,
    also the fp32 log-sum-exp of each query row's scores, (B, Hq, Sq). A row that sees no key
    outputs 0, with lse -inf and zero gradients.

    Packed variable-length batches: q (total_q, Hq, D), k and v (total_k, Hkv, D), with int32
    ``cu_seqlens_q`` and ``cu_seqlens_k`` of B + 1 entries (sequence b is rows cu[b]:cu[b + 1];
    empty sequences allowed), masks aligned per sequence; the output is (total_q, Hq, D) and the lse
    (Hq, total_q). ``max_seqlen_q``/``max_seqlen_k`` (the longest sequences) are read from the
    cu_seqlens when not given, which waits for the GPU; the cu_seqlens are checked on the host.

    Differentiable in q, k, v (GQA gradients summed over each group) and in the lse."""
    window = _window(window)
    softcap = float(softcap)
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0: no cap), got {softcap}")
    if cu_seqlens_q is None and cu_seqlens_k is None:
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if value is not None:
                raise ValueError(f"{name} is for packed batches: pass cu_seqlens_q and cu_seqlens_k too")
        _validate(q, k, v)
        packed = None
    else:
        packed = _validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    o, lse = _call(q, k, v, Scores(_scale(scale, q.shape[-1]), bool(causal), True, window, softcap), packed)
    return (o, lse) if return_lse else o


def _validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Packed:
    """The packed batch's Packed, or a TypeError or ValueError naming what is wrong."""
    for name, tensor in (("query", q), ("key", k), ("value", v)):
        if isinstance(tensor, torch.Tensor) and tensor.dim() != 3:
            raise ValueError(f"a packed {name} must be 3-D (total tokens, heads, head dim), got shape "
                             f"{tuple(tensor.shape)}")
    _validate(*(t.transpose(0, 1).unsqueeze(0) if isinstance(t, torch.Tensor) else t for t in (q, k, v)))
    lengths = {}
    for name, cu, tensor in (("cu_seqlens_q", cu_seqlens_q, q), ("cu_seqlens_k", cu_seqlens_k, k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (pass both cu_seqlens), got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be 1-D with B + 1 entries, got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on the tensors' device {q.device}, got {cu.device}")
        host = cu.cpu()
        if host[0] != 0:
            raise ValueError(f"{name} must start at 0, got {int(host[0])}")
        steps = host.diff()
        if (steps < 0).any():
            raise ValueError(f"{name} must be non-decreasing, got {host.tolist()}")
        if host[-1] != tensor.shape[0]:
            raise ValueError(f"{name} must end at the packed tensor's {tensor.shape[0]} rows, got "
                             f"{int(host[-1])}")
        lengths[name] = int(steps.max()) if steps.numel() else 0
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one entry a sequence each, got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    longest = []
    for name, given, found in (("max_seqlen_q", max_seqlen_q, lengths["cu_seqlens_q"]),
                               ("max_seqlen_k", max_seqlen_k, lengths["cu_seqlens_k"])):
        if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < found):
            raise ValueError(f"{name} must be an int >= the longest sequence ({found}), got {given!r}")
        longest.append(found if given is None else given)
    return Packed(cu_seqlens_q, cu_seqlens_k, cu_seqlens_q.shape[0] - 1, *longest)


def _window(window) -> tuple[int, int]:
    """``window`` as (left, right) ints >= -1, or ValueError naming what is wrong."""
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right), got {window!r}") from None
    for side, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ValueError(f"window's {side} side must be an int >= -1 (-1: unbounded), got {value!r}")
    return left, right


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` on (B, H, S, D) fp16/bf16 tensors, with its
    semantics: ``is_causal`` aligned top-left when Sq != Sk, fewer key/value heads only with
    ``enable_gqa``. A dense ``attn_mask`` and ``dropout_p > 0`` raise NotImplementedError."""
    if attn_mask is not None:
        raise NotImplementedError("scaled_dot_product_attention: attn_mask is not supported (use is_causal, "
                                  "or flash_attention's window)")
    if dropout_p:
        raise NotImplementedError("scaled_dot_product_attention: dropout_p > 0 is not supported")
    _validate(query, key, value)
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key/value {key.shape[1]}: pass "
                         "enable_gqa=True for grouped-query attention, as torch requires")
    o, _ = _call(query, key, value, Scores(_scale(scale, query.shape[-1]), bool(is_causal), False))
    return o


# ---------------------------------------------------------------- reference and cost


REFERENCE_SCORE_BYTES = 2**31  # the reference takes query rows in chunks whose scores fit in this


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        scale: float | None = None, bottom_right: bool = True, return_lse: bool = False,
                        window: tuple[int, int] = (-1, -1), softcap: float = 0.0, cu_seqlens_q=None,
                        cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """Plain PyTorch attention with the kernel's conventions (rows that see no key give 0 and lse
    -inf); pass float64 inputs for the oracle's reference. Query rows go in chunks whose scores
    take at most REFERENCE_SCORE_BYTES (at (2, 16, 16384, 128) whole float64 scores would be 69 GB);
    with several chunks, each is recomputed in the backward instead of kept (activation
    checkpointing), so the reference's gradients fit too. A packed batch (``cu_seqlens_*``) goes
    a sequence at a time; ``max_seqlen_*`` are accepted and not needed."""
    if cu_seqlens_q is not None:
        bounds = [(int(a), int(b), int(c), int(d)) for a, b, c, d in
                  zip(cu_seqlens_q[:-1], cu_seqlens_q[1:], cu_seqlens_k[:-1], cu_seqlens_k[1:], strict=True)]
        parts = [attention_reference(*(t[start:end].transpose(0, 1).unsqueeze(0)
                                       for t, start, end in ((q, q0, q1), (k, k0, k1), (v, k0, k1))),
                                     causal, scale, bottom_right, True, window, softcap)
                 for q0, q1, k0, k1 in bounds]
        o = torch.cat([q[:0], *(part[0][0].transpose(0, 1) for part in parts)])
        lse = torch.cat([q.new_empty((q.shape[1], 0), dtype=parts[0][1].dtype if parts else torch.float32),
                         *(part[1][0] for part in parts)], dim=1)
        return (o, lse) if return_lse else o
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    batch, heads, seq_q, _ = q.shape
    rows = max(1, REFERENCE_SCORE_BYTES // max(1, batch * heads * k.shape[2] * q.element_size()))
    chunk = functools.partial(_reference_rows, scores=Scores(_scale(scale, q.shape[-1]), causal, bottom_right,
                                                             tuple(window), softcap), seq_q=seq_q)
    if seq_q <= rows:
        o, lse = chunk(q, k, v, 0)
    else:
        from torch.utils.checkpoint import checkpoint

        parts = [checkpoint(chunk, q[:, :, start:start + rows], k, v, start, use_reentrant=False)
                 for start in range(0, seq_q, rows)]
        o, lse = torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=2)
    return (o, lse if lse.dtype == torch.float64 else lse.float()) if return_lse else o


def reference_visible(scores: Scores, first_row: int, rows: int, seq_q: int, seq_k: int, device):
    """(rows, Sk) whether query rows first_row... see each key under ``scores``' masks; None when
    every row sees every key."""
    left, right = scores.window
    if not scores.causal and left < 0 and right < 0:
        return None
    offset = seq_k - seq_q if scores.bottom_right else 0
    diagonal = torch.arange(first_row, first_row + rows, device=device)[:, None] + offset
    keys = torch.arange(seq_k, device=device)[None, :]
    visible = torch.ones((rows, seq_k), dtype=torch.bool, device=device)
    if scores.causal or right >= 0:
        visible &= keys <= diagonal + (0 if scores.causal else right)
    if left >= 0:
        visible &= keys >= diagonal - left
    return visible


def _reference_rows(q, k, v, first_row: int, scores: Scores, seq_q: int):
    """(output, lse) of the reference for the query rows ``q`` (the first of them row ``first_row``)."""
    logits = (q @ k.transpose(-1, -2)) * scores.scale
    if scores.softcap:
        logits = scores.softcap * torch.tanh(logits / scores.softcap)
    visible = reference_visible(scores, first_row, q.shape[2], seq_q, k.shape[2], q.device)
    if visible is None:
        return torch.softmax(logits, dim=-1) @ v, torch.logsumexp(logits, dim=-1)
    sees = visible.any(-1, keepdim=True)  # a row that sees no key: 0 out, lse -inf, no NaN in the VJP
    logits = logits.masked_fill(~visible, -math.inf).masked_fill(~sees, 0.0)
    return ((torch.softmax(logits, dim=-1) * sees) @ v,
            torch.logsumexp(logits, dim=-1).masked_fill(~sees[:, 0], -math.inf))


def attention_cost(shape: tuple, dtype: torch.dtype, mode: str = "fwd", causal: bool = False):
    """FLOPs and minimal bytes of attention over a benchmark shape (B, Hq, Hkv, S, D), Sq = Sk = S:
    forward 4 B Hq S^2 D FLOPs (half when causal), backward 2.5x that; the forward reads q, k and v
    once and writes o and the lse, the backward also reads o, dO and the lse and writes dq, dk, dv."""
    from tritonkit.roofline import Cost

    batch, heads_q, heads_kv, seq, head_dim = shape
    size = torch.finfo(dtype).bits // 8
    flops = 4 * batch * heads_q * seq * seq * head_dim / (2 if causal else 1)
    q_bytes, kv_bytes = batch * heads_q * seq * head_dim * size, batch * heads_kv * seq * head_dim * size
    lse_bytes = 4 * batch * heads_q * seq
    fwd = Cost(flops, 2 * q_bytes + 2 * kv_bytes + lse_bytes)
    bwd = Cost(2.5 * flops, 5 * q_bytes + 4 * kv_bytes + lse_bytes)  # q, o, dO, dq; k, v, dk, dv
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def _inspect_launches(shape: tuple, dtype: torch.dtype, config: dict | None = None,
                      causal: bool = False) -> list:
    """The forward's launch and the backward's three for a benchmark shape (B, Hq, Hkv, S, D): what
    ``tritonkit inspect`` compiles. A ``config`` sets the forward's tile, and under "dkdv" and "dq"
    the backward kernels' (over their defaults)."""
    from tritonkit.inspect import Launch
    from tritonkit.ops.attention_bwd import KERNELS

    batch, heads_q, heads_kv, seq, head_dim = shape
    q = torch.empty((batch, heads_q, seq, head_dim), dtype=dtype, device="meta")
    kv = torch.empty((batch, heads_kv, seq, head_dim), dtype=dtype, device="meta")
    lse = torch.empty((batch, heads_q, seq), dtype=torch.float32, device="meta")
    fwd_config = {name: value for name, value in (config or {}).items() if name not in KERNELS}
    bwd_config = {name: value for name, value in (config or {}).items() if name in KERNELS}
    scores = Scores(_scale(None, head_dim), causal)
    _, args, meta = _fwd_launch_args(q, kv, kv, q, lse, scores, fwd_config or None)
    return [Launch("fwd", _attn_fwd_kernel, args, meta, fwd_config),
            *_inspect_bwd_launches(shape, dtype, bwd_config, scores)]


# ---------------------------------------------------------------- benchmark peers and specs


def _sdpa_backend(backend: str):
    """A peer: torch's scaled_dot_product_attention pinned to one backend (FLASH_ATTENTION, CUDNN_ATTENTION,
    EFFICIENT_ATTENTION); a backend that cannot take a case raises, and the harness reports it."""
    def factory(kwargs: dict):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        chosen = getattr(SDPBackend, backend)

        def run(q, k, v):
            with sdpa_kernel(chosen):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=kwargs.get("causal", False), enable_gqa=q.shape[1] != k.shape[1])
        return run
    return factory


def _flex(kwargs: dict):
    """A peer: compiled FlexAttention, with a causal block mask built once per sequence length."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not torch.cuda.is_available():
        return "needs a CUDA GPU (timings only)"
    compiled = torch.compile(flex_attention)

    @functools.cache
    def causal_mask(seq_q: int, seq_k: int):
        return create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, None, None, seq_q, seq_k)

    def run(q, k, v):
        mask = causal_mask(q.shape[2], k.shape[2]) if kwargs.get("causal") else None
        return compiled(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return run


def _make_inputs(shape: tuple, dtype: torch.dtype, device, generator: torch.Generator) -> tuple:
    from tritonkit.testing import random_tensor

    batch, heads_q, heads_kv, seq, head_dim = shape
    return (random_tensor((batch, heads_q, seq, head_dim), dtype, device, generator=generator),
            random_tensor((batch, heads_kv, seq, head_dim), dtype, device, generator=generator),
            random_tensor((batch, heads_kv, seq, head_dim), dtype, device, generator=generator))


def _spec(causal: bool):
    from tritonkit.ops import OpSpec

    return OpSpec(
        name="attention_causal" if causal else "attention",
        family="attention",
        fn=flash_attention,
        reference=attention_reference,
        cost=functools.partial(attention_cost, causal=causal),
        make_inputs=_make_inputs,
        grad_inputs=(0, 1, 2),
        flop_unit="bf16",
        # (B, Hq, Hkv, S, D): the shapes; GQA at Hq 32, Hkv 8; fp16 at the first
        shapes={
            "interpreter": [((1, 2, 1, 40, 64), "bf16"), ((1, 2, 2, 33, 32), "fp16")],
            "quick": [((4, 32, 32, 4096, 128), "bf16"), ((2, 16, 16, 16384, 128), "bf16"),
                      ((4, 32, 32, 4096, 64), "bf16"), ((16, 16, 16, 1024, 128), "bf16"),
                      ((4, 32, 32, 4096, 128), "fp16"), ((4, 32, 8, 4096, 128), "bf16")],
            "full": [((4, 32, 32, 4096, 128), "bf16"), ((2, 16, 16, 16384, 128), "bf16"),
                     ((4, 32, 32, 4096, 64), "bf16"), ((16, 16, 16, 1024, 128), "bf16"),
                     ((4, 32, 32, 4096, 128), "fp16"), ((4, 32, 8, 4096, 128), "bf16"),
                     ((1, 32, 32, 8192, 256), "bf16"), ((8, 16, 16, 2048, 96), "bf16")],
        },
        tiny_shape=(1, 1, 1, 128, 64),
        dtypes=DTYPES,
        kwargs={"causal": causal},
        peers={"sdpa-flash": _sdpa_backend("FLASH_ATTENTION"), "sdpa-cudnn": _sdpa_backend("CUDNN_ATTENTION"),
               "sdpa-efficient": _sdpa_backend("EFFICIENT_ATTENTION"), "flex": _flex},
        inspect=functools.partial(_inspect_launches, causal=causal),
    )


SPECS = {"attention": _spec(False), "attention_causal": _spec(True)}
