"""Attention backward, FlashAttention-2's split: the gradients of ``O = softmax(scale * Q K^T + mask) V``
from the forward's output O and log-sum-exp, recomputing the probabilities instead of storing them.

Maths. With P = exp(S - lse) row by row (S the scaled, masked scores) and dO the upstream gradient:
    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   delta_i = sum_d dO_id O_id - dlse_i,
    dQ = scale * dS K,   dK = scale * dS^T Q,
where dlse is the upstream gradient of the lse (zero unless the caller differentiates it: d lse_i /
d S_ij = P_ij). Three kernels: delta per query row; dK and dV per key block, walking the query rows
that see it (with GQA, those of every query head of its group: the sum over the group without
atomics); dQ per query block, walking its keys. No atomics anywhere, so the same inputs give the
same bits.

Work. 2.5x the forward's FLOPs (five matmuls of B·Hq·Sq·Sk·D, against two), the probabilities
recomputed in each of the two main kernels. Bytes: q, k, v, o, dO and the lse read, dq, dk, dv
written, K and V re-read from L2 by the dQ programs and Q, dO by the dK/dV programs.
"""

from __future__ import annotations

import torch

from tritonkit._runtime import empty_output, interpret

interpret()  # choose GPU or interpreter before triton is imported and any kernel is defined

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tritonkit._launch import Launcher, cdiv  # noqa: E402

LOG2_E = 1.4426950408889634


@triton.jit
def _attn_bwd_delta_kernel(
    o_ptr,  # forward output, (B, H, Sq, D), contiguous
    do_ptr,  # upstream gradient of o, (B, H, Sq, D), strides stride_do*
    dlse_ptr,  # upstream gradient of the lse, (B, H, Sq), contiguous (unused without HAS_DLSE)
    delta_ptr,  # fp32 out: rowsum(dO * O) - dlse, (B, H, Sq)
    stride_dob, stride_doh, stride_dom, stride_dod,  # elements between batches, heads, rows, dims of dO
    H,  # heads
    SEQ_Q,  # query rows per head
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # power of two >= D
    HAS_DLSE: tl.constexpr,  # the lse has an upstream gradient
    BLOCK_M: tl.constexpr,  # rows a program reduces
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // H, bh % H
    dims = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < SEQ_Q) & (dims[None, :] < HEAD_DIM)
    o = tl.load(o_ptr + (bh * SEQ_Q + rows[:, None]) * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    do = tl.load(do_ptr + batch * stride_dob + head * stride_doh + rows[:, None] * stride_dom
                 + dims[None, :] * stride_dod, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + bh * SEQ_Q + rows, mask=rows < SEQ_Q, other=0.0)
    tl.store(delta_ptr + bh * SEQ_Q + rows, delta, mask=rows < SEQ_Q)


@triton.jit
def _probabilities(q, k_t, lse_log2, rows, cols, SEQ_Q, SEQ_K, CAUSAL_OFFSET, qk_scale,
                   IS_CAUSAL: tl.constexpr, EXACT_DOT_IN_FP32: tl.constexpr):
    """P = exp(S - lse) for a (rows x cols) tile: q (BLOCK_M, D) and K^T (D, BLOCK_N), the rows'
    lse in log2 units (+inf for a row that sees no key, so its P is 0), masked entries 0."""
    if EXACT_DOT_IN_FP32:
        s = tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k_t)
    visible = (rows[:, None] < SEQ_Q) & (cols[None, :] < SEQ_K)
    if IS_CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None] + CAUSAL_OFFSET)
    return tl.where(visible, tl.math.exp2(s * qk_scale - lse_log2[:, None]), 0.0)


@triton.jit
def _dot(a, b, EXACT_DOT_IN_FP32: tl.constexpr):
    """a @ b with an fp32 result: 16-bit tiles on tensor cores, or as fp32 under the interpreter,
    whose bf16 dot products Triton 3.6 gets wrong (the products of 16-bit values are exact in fp32)."""
    if EXACT_DOT_IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # inputs as the forward took them, and dO: (B, H*, S*, D), strided
    lse_ptr,  # forward lse (natural log), (B, Hq, Sq), contiguous
    delta_ptr,  # rowsum(dO * O) - dlse, (B, Hq, Sq), contiguous
    dk_ptr, dv_ptr,  # out: (B, Hkv, Sk, D), contiguous
    stride_qb, stride_qh, stride_qm, stride_qd,  # elements between batches, heads, rows, dims of q
    stride_kb, stride_kh, stride_kn, stride_kd,  # ... of k
    stride_vb, stride_vh, stride_vn, stride_vd,  # ... of v
    stride_dob, stride_doh, stride_dom, stride_dod,  # ... of dO
    H_KV,  # key/value heads
    GROUP,  # query heads per key/value head
    SEQ_Q, SEQ_K,  # rows of q and of k per head
    CAUSAL_OFFSET,  # causal: query i sees key j iff j <= i + CAUSAL_OFFSET
    qk_scale,  # the softmax scale times log2(e)
    sm_scale,  # the softmax scale
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  # D, and a power of two >= D
    IS_CAUSAL: tl.constexpr,  # mask keys past each row's diagonal
    BLOCK_M: tl.constexpr,  # query rows a step of the loop takes
    BLOCK_N: tl.constexpr,  # keys a program holds
    EXACT_DOT_IN_FP32: tl.constexpr,  # multiply the 16-bit tiles as fp32 (the interpreter's path)
):
    start_n = tl.program_id(0) * BLOCK_N
    bh_kv = tl.program_id(1).to(tl.int64)
    batch, kv_head = bh_kv // H_KV, bh_kv % H_KV
    local_n = tl.arange(0, BLOCK_N)
    cols = start_n + local_n
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < HEAD_DIM
    kv_mask = (cols[:, None] < SEQ_K) & d_mask[None, :]
    block = tl.cast(start_n, tl.int64)  # int64: S * stride may pass 2^31 (a (B, S, H, D) layout)
    k_rows = k_ptr + batch * stride_kb + kv_head * stride_kh + block * stride_kn
    v_rows = v_ptr + batch * stride_vb + kv_head * stride_vh + block * stride_vn
    k = tl.load(k_rows + local_n[:, None] * stride_kn + dims[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(v_rows + local_n[:, None] * stride_vn + dims[None, :] * stride_vd, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # the first query row that sees any key of this block: i >= start_n - CAUSAL_OFFSET
    first = tl.maximum(start_n - CAUSAL_OFFSET, 0) // BLOCK_M * BLOCK_M if IS_CAUSAL else 0
    # One loop over (query head of the group, query block): a nested loop over the heads kept both
    # loops from pipelining on sm_90 and spilled at D = 128 with 4 heads a group. The scores are
    # computed transposed, keys by queries, so that every matmul has this block's BLOCK_N keys as
    # its M (wgmma's 64-row operand) and the query step BLOCK_M may be small.
    blocks = tl.cdiv(SEQ_Q - first, BLOCK_M)
    local_m = tl.arange(0, BLOCK_M)
    for step in range(GROUP * blocks):
        head = kv_head * GROUP + step // blocks
        start_m = first + (step % blocks) * BLOCK_M
        bh = batch * (H_KV * GROUP) + head
        rows = start_m + local_m
        row_mask = rows < SEQ_Q
        tile_mask = row_mask[:, None] & d_mask[None, :]
        block = tl.cast(start_m, tl.int64)
        q_rows = q_ptr + batch * stride_qb + head * stride_qh + block * stride_qm
        do_rows = do_ptr + batch * stride_dob + head * stride_doh + block * stride_dom
        q = tl.load(q_rows + local_m[:, None] * stride_qm + dims[None, :] * stride_qd, mask=tile_mask,
                    other=0.0)
        do = tl.load(do_rows + local_m[:, None] * stride_dom + dims[None, :] * stride_dod, mask=tile_mask,
                     other=0.0)
        lse = tl.load(lse_ptr + bh * SEQ_Q + rows, mask=row_mask, other=float("inf"))
        delta = tl.load(delta_ptr + bh * SEQ_Q + rows, mask=row_mask, other=0.0)
        lse_log2 = tl.where(lse == -float("inf"), float("inf"), lse * 1.4426950408889634)
        s_t = _dot(k, tl.trans(q), EXACT_DOT_IN_FP32)  # (BLOCK_N, BLOCK_M)
        visible = (cols[:, None] < SEQ_K) & row_mask[None, :]
        if IS_CAUSAL:
            visible = visible & (cols[:, None] <= rows[None, :] + CAUSAL_OFFSET)
        p_t = tl.where(visible, tl.math.exp2(s_t * qk_scale - lse_log2[None, :]), 0.0)
        dv += _dot(p_t.to(do.dtype), do, EXACT_DOT_IN_FP32)
        dp_t = _dot(v, tl.trans(do), EXACT_DOT_IN_FP32)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += _dot(ds_t.to(q.dtype), q, EXACT_DOT_IN_FP32)
    out = bh_kv * SEQ_K * HEAD_DIM + cols[:, None] * HEAD_DIM + dims[None, :]
    tl.store(dk_ptr + out, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # as in the dK/dV kernel
    lse_ptr, delta_ptr,  # (B, Hq, Sq), contiguous
    dq_ptr,  # out: (B, Hq, Sq, D), contiguous
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    H,  # query heads
    GROUP,  # query heads per key/value head
    SEQ_Q, SEQ_K,
    CAUSAL_OFFSET,
    qk_scale,
    sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows a program holds
    BLOCK_N: tl.constexpr,  # keys a step of the loop takes
    EXACT_DOT_IN_FP32: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // H, bh % H
    kv_head = head // GROUP
    local_m = tl.arange(0, BLOCK_M)
    rows = start_m + local_m
    row_mask = rows < SEQ_Q
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < HEAD_DIM
    tile_mask = row_mask[:, None] & d_mask[None, :]
    block = tl.cast(start_m, tl.int64)  # int64: S * stride may pass 2^31 (a (B, S, H, D) layout)
    q_rows = q_ptr + batch * stride_qb + head * stride_qh + block * stride_qm
    do_rows = do_ptr + batch * stride_dob + head * stride_doh + block * stride_dom
    q = tl.load(q_rows + local_m[:, None] * stride_qm + dims[None, :] * stride_qd, mask=tile_mask, other=0.0)
    do = tl.load(do_rows + local_m[:, None] * stride_dom + dims[None, :] * stride_dod, mask=tile_mask,
                 other=0.0)
    lse = tl.load(lse_ptr + bh * SEQ_Q + rows, mask=row_mask, other=float("inf"))
    delta = tl.load(delta_ptr + bh * SEQ_Q + rows, mask=row_mask, other=0.0)
    lse_log2 = tl.where(lse == -float("inf"), float("inf"), lse * 1.4426950408889634)
    k_head = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_head = v_ptr + batch * stride_vb + kv_head * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # keys past the block's last row's diagonal are seen by none of its rows
    end = tl.maximum(tl.minimum(SEQ_K, start_m + BLOCK_M + CAUSAL_OFFSET), 0) if IS_CAUSAL else SEQ_K
    local_n = tl.arange(0, BLOCK_N)
    for start_n in range(0, end, BLOCK_N):
        cols = start_n + local_n
        kv_mask = (cols[:, None] < SEQ_K) & d_mask[None, :]
        block_n = tl.cast(start_n, tl.int64)
        k = tl.load(k_head + block_n * stride_kn + local_n[:, None] * stride_kn + dims[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        v = tl.load(v_head + block_n * stride_vn + local_n[:, None] * stride_vn + dims[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        p = _probabilities(q, tl.trans(k), lse_log2, rows, cols, SEQ_Q, SEQ_K, CAUSAL_OFFSET, qk_scale,
                           IS_CAUSAL, EXACT_DOT_IN_FP32)
        dp = _dot(do, tl.trans(v), EXACT_DOT_IN_FP32)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, EXACT_DOT_IN_FP32)
    out = (bh * SEQ_Q + rows[:, None]) * HEAD_DIM + dims[None, :]
    tl.store(dq_ptr + out, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=tile_mask)


# ---------------------------------------------------------------- launcher

_delta_launcher = Launcher(_attn_bwd_delta_kernel)
_dkdv_launcher = Launcher(_attn_bwd_dkdv_kernel)
_dq_launcher = Launcher(_attn_bwd_dq_kernel)
DELTA_BLOCK_M = 64
# The interpreter's tiles, as the forward's: several blocks a test shape, both loops' edges run.
INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_M_KV": 16, "BLOCK_N_KV": 16, "num_warps": 4,
                      "num_stages": 1}


def default_config(head_dim: int) -> dict:
    """The backward's tiles before tuning: dQ programs hold BLOCK_M query rows and step BLOCK_N keys;
    dK/dV programs hold BLOCK_N_KV keys and step BLOCK_M_KV query rows. Picked from a scan of sm_90
    builds (`tritonkit inspect attention --config ...`) among the tiles whose matmuls are all HGMMA
    with no spills, preferring more rows held (fewer re-reads of the other operand) below ~200
    registers. At D = 256 every wgmma tile of dK/dV spilled (two fp32 accumulators of BLOCK_N_KV x
    256), so 16-row steps there, which compile to mma.sync (HMMA)."""
    if interpret():
        return dict(INTERPRETER_CONFIG)
    if head_dim <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 32, "BLOCK_M_KV": 32, "BLOCK_N_KV": 128, "num_warps": 8,
                "num_stages": 2}
    if head_dim <= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 32, "BLOCK_M_KV": 32, "BLOCK_N_KV": 64, "num_warps": 8,
                "num_stages": 2}
    return {"BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_M_KV": 16, "BLOCK_N_KV": 64, "num_warps": 8, "num_stages": 2}


def _launches(q, k, v, o, do, lse, dlse, delta, dq, dk, dv, scale: float, causal: bool, bottom_right: bool,
              config: dict | None) -> list[tuple]:
    """(launcher, grid, arguments, constexprs and options) of delta, dK/dV and dQ, in that order."""
    batch, heads, seq_q, head_dim = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    config = dict(config or default_config(head_dim))
    tiles = {name: config.pop(name) for name in ("BLOCK_M", "BLOCK_N", "BLOCK_M_KV", "BLOCK_N_KV")}
    block_d = max(16, triton.next_power_of_2(head_dim))
    delta_args = (o, do, dlse if dlse is not None else lse, delta, *do.stride(), heads, seq_q)
    delta_meta = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "HAS_DLSE": dlse is not None,
                  "BLOCK_M": DELTA_BLOCK_M, "num_warps": 4}
    offset = seq_k - seq_q if bottom_right else 0
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    def meta(block_m: int, block_n: int) -> dict:
        return {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "IS_CAUSAL": causal, "BLOCK_M": block_m,
                "BLOCK_N": block_n, "EXACT_DOT_IN_FP32": interpret(), **config}

    group, qk_scale = heads // heads_kv, scale * LOG2_E
    return [(_delta_launcher, (cdiv(seq_q, DELTA_BLOCK_M), batch * heads), delta_args, delta_meta),
            (_dkdv_launcher, (cdiv(seq_k, tiles["BLOCK_N_KV"]), batch * heads_kv),
             (q, k, v, do, lse, delta, dk, dv, *strides, heads_kv, group, seq_q, seq_k, offset, qk_scale,
              scale), meta(tiles["BLOCK_M_KV"], tiles["BLOCK_N_KV"])),
            (_dq_launcher, (cdiv(seq_q, tiles["BLOCK_M"]), batch * heads),
             (q, k, v, do, lse, delta, dq, *strides, heads, group, seq_q, seq_k, offset, qk_scale, scale),
             meta(tiles["BLOCK_M"], tiles["BLOCK_N"]))]


def attention_bwd(do, q, k, v, o, lse, dlse, scale: float, causal: bool, bottom_right: bool,
                  config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of attention; ``o`` and ``lse`` are the forward's (contiguous), ``dlse`` the
    upstream gradient of the lse or None. Arguments are the forward's, already validated."""
    batch, heads, seq_q, _ = q.shape
    seq_k = k.shape[2]
    dq = empty_output(q.shape, q.dtype, q.device)
    dk = empty_output(k.shape, k.dtype, k.device)
    dv = empty_output(v.shape, v.dtype, v.device)
    if seq_k == 0 or batch * heads == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if seq_q == 0:
        return dq, dk.zero_(), dv.zero_()
    if dlse is not None:
        dlse = dlse.contiguous()  # the delta kernel reads it by row index (a sum's gradient is expanded)
    delta = empty_output((batch, heads, seq_q), torch.float32, q.device)
    for launcher, grid, args, meta in _launches(q, k, v, o, do, lse, dlse, delta, dq, dk, dv, scale, causal,
                                                bottom_right, config):
        launcher(grid, *args, **meta)
    return dq, dk, dv


def _inspect_launches(shape: tuple, dtype: torch.dtype, config: dict | None = None,
                      causal: bool = False) -> list:
    """The backward's three launches for a benchmark shape (B, Hq, Hkv, S, D), for ``tritonkit inspect``."""
    from tritonkit.inspect import Launch

    batch, heads_q, heads_kv, seq, head_dim = shape
    q = torch.empty((batch, heads_q, seq, head_dim), dtype=dtype, device="meta")
    kv = torch.empty((batch, heads_kv, seq, head_dim), dtype=dtype, device="meta")
    rows = torch.empty((batch, heads_q, seq), dtype=torch.float32, device="meta")
    return [Launch(name, launcher.kernel, args, meta, config or {})
            for name, (launcher, _, args, meta) in zip(("bwd delta", "bwd dk dv", "bwd dq"),
                                                       _launches(q, kv, kv, q, q, rows, None, rows, q, kv, kv,
                                                                 head_dim**-0.5, causal, True, config),
                                                       strict=True)]
