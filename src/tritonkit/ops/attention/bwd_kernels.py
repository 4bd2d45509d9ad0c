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

The kernels with the configs, prune and default they are tuned over; their launches, tuners and
the backward itself are in ``bwd``. The scores' scale, cap and masks, the packed batches and the jit
helpers both directions call are in ``common``.
"""

from __future__ import annotations

from tritonkit._runtime import current_device, interpret, shared_memory_bytes
from tritonkit._triton import tl, triton
from tritonkit.jit import LOG2E, dot_fp32
from tritonkit.ops.attention.common import _block_d, _exponent, _key_ranges, _sequence, _visible

DELTA_BLOCK_M = 64  # query rows a delta program reduces


@triton.jit
def _attn_bwd_delta_kernel(
    o_ptr,  # forward output, (B, H, Sq, D), strides stride_o* and 1
    do_ptr,  # upstream gradient of o, (B, H, Sq, D), strides stride_do*
    dlse_ptr,  # upstream gradient of the lse, (B, H, Sq), contiguous (unused without HAS_DLSE)
    delta_ptr,  # fp32 out: rowsum(dO * O) - dlse, (B, H, Sq), contiguous
    stride_ob,
    stride_oh,
    stride_om,  # elements between batches, heads, rows of o
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,  # ... and head dims of dO
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
    o_rows = o_ptr + batch * stride_ob + head * stride_oh
    o = tl.load(o_rows + rows[:, None] * stride_om + dims[None, :], mask=mask, other=0.0)
    do = tl.load(
        do_ptr
        + batch * stride_dob
        + head * stride_doh
        + rows[:, None] * stride_dom
        + dims[None, :] * stride_dod,
        mask=mask,
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + bh * SEQ_Q + rows, mask=rows < SEQ_Q, other=0.0)
    tl.store(delta_ptr + bh * SEQ_Q + rows, delta, mask=rows < SEQ_Q)


@triton.jit
def _dkdv_steps(
    dk,
    dv,
    k,
    v,
    q_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_target,
    batch,
    kv_head,
    q_start,
    cols,
    dims,
    d_mask,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_lb,
    stride_lh,
    stride_ab,
    stride_ah,
    stride_am,
    GROUP,
    SEQ_Q,
    SEQ_K,
    UPPER_OFFSET,
    LOWER_OFFSET,
    score_scale,
    cap_log2,
    lead_start,
    n_lead,
    rest_start,
    n_rest,
    IS_CAUSAL: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    EXACT_DOT_IN_FP32: tl.constexpr,
    TMA_DQ: tl.constexpr,
):
    """dk and dv after query blocks of every query head of the key block's group: for each head,
    ``n_lead`` blocks from row ``lead_start``, then ``n_rest`` from ``rest_start``. One loop over
    (head, block) pairs: a nested loop over the heads kept both loops from pipelining on sm_90 and
    spilled at D = 128 with 4 heads a group. MASKED blocks mask rows past SEQ_Q, keys past SEQ_K and
    keys outside each row's bounds; the others are inside all of them, and load and exponentiate
    unmasked.

    The scores are computed transposed, keys by queries, so that every matmul has the program's
    keys as its M (wgmma's 64-row operand) and the query step BLOCK_M may be small. ATOMIC_DQ also
    adds each step's dS Q-side product, dS^T K, to the fp32 dq accumulator with atomics (its order,
    so its rounding, varies from run to run): ``dq_target`` is the accumulator's pointer, or with
    TMA_DQ a tensor descriptor of it as (rows, D), which adds the whole tile in one bulk reduction.
    Rows past SEQ_Q add zeros there (their P is 0), so a tile that runs past its head's rows into
    the next head's (or sequence's) changes nothing."""
    per_head = n_lead + n_rest
    local_m = tl.arange(0, BLOCK_M)
    for step in range(GROUP * per_head):
        head = kv_head * GROUP + step // per_head
        index = step % per_head
        start_m = tl.where(
            index < n_lead, lead_start + index * BLOCK_M, rest_start + (index - n_lead) * BLOCK_M
        )
        rows = start_m + local_m
        block = q_start + tl.cast(start_m, tl.int64)
        row_stats = batch * stride_lb + head * stride_lh + block + local_m  # lse and delta
        q_ptrs = (
            q_ptr
            + batch * stride_qb
            + head * stride_qh
            + block * stride_qm
            + local_m[:, None] * stride_qm
            + dims[None, :] * stride_qd
        )
        do_ptrs = (
            do_ptr
            + batch * stride_dob
            + head * stride_doh
            + block * stride_dom
            + local_m[:, None] * stride_dom
            + dims[None, :] * stride_dod
        )
        if MASKED:
            row_mask = rows < SEQ_Q
            q = tl.load(q_ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
            lse = tl.load(lse_ptr + row_stats, mask=row_mask, other=float("inf"))
            delta = tl.load(delta_ptr + row_stats, mask=row_mask, other=0.0)
        else:
            q = tl.load(q_ptrs, mask=d_mask[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=d_mask[None, :], other=0.0)
            lse = tl.load(lse_ptr + row_stats)
            delta = tl.load(delta_ptr + row_stats)
        lse_log2 = tl.where(lse == -float("inf"), float("inf"), lse * LOG2E)
        s_t, tanh_t = _exponent(
            dot_fp32(k, tl.trans(q), EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32),
            score_scale,
            cap_log2,
            SOFTCAP=SOFTCAP,
        )
        p_t = tl.math.exp2(s_t - lse_log2[None, :])  # (BLOCK_N, BLOCK_M)
        if MASKED:
            visible = _visible(
                rows[None, :],
                cols[:, None],
                SEQ_K,
                UPPER_OFFSET,
                LOWER_OFFSET,
                IS_CAUSAL=IS_CAUSAL,
                HAS_LOWER=HAS_LOWER,
            )
            p_t = tl.where(visible & row_mask[None, :], p_t, 0.0)
        dv += dot_fp32(p_t.to(do.dtype), do, EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32)
        dp_t = dot_fp32(v, tl.trans(do), EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:  # through the cap: d(c tanh(s / c)) / ds = 1 - tanh^2
            ds_t = ds_t * (1.0 - tanh_t * tanh_t)
        ds_t = ds_t.to(q.dtype)
        dk += dot_fp32(ds_t, q, EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32)
        if ATOMIC_DQ:
            dq = dot_fp32(tl.trans(ds_t), k, EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32)  # (BLOCK_M, D)
            if TMA_DQ:  # the accumulator is contiguous: its row stride is D
                first_row = (batch * stride_ab + head * stride_ah) // stride_am + block
                dq_target.atomic_add([first_row.to(tl.int32), 0], dq)
            else:
                acc_ptrs = (
                    dq_target
                    + batch * stride_ab
                    + head * stride_ah
                    + (block + local_m[:, None]) * stride_am
                    + dims[None, :]
                )
                if MASKED:
                    tl.atomic_add(acc_ptrs, dq, mask=row_mask[:, None] & d_mask[None, :], sem="relaxed")
                else:
                    tl.atomic_add(acc_ptrs, dq, mask=d_mask[None, :], sem="relaxed")
    return dk, dv


# ---------------------------------------------------------------- the main kernels' tiles: configs and prune

KERNELS = ("dkdv", "dq")  # a backward config holds one launch config for each: {"dkdv": ..., "dq": ...}
# The interpreter's tiles, as the forward's: several blocks a test shape, both loops' edges run.
INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
# In both kernels BLOCK_M counts query rows and BLOCK_N keys: dK/dV programs hold BLOCK_N keys and
# step BLOCK_M rows; dQ programs hold BLOCK_M rows and step BLOCK_N keys. Held tiles of 32 to 128
# (64 and up: wgmma's M), steps of 16 to 64.
_LAUNCH = [{"num_warps": warps, "num_stages": stages} for warps in (4, 8) for stages in (2, 3)]
HELD = {"dkdv": "BLOCK_N", "dq": "BLOCK_M"}  # the tile a program holds; the other is its loop's step
# fp32 values a thread past which a config spills on sm_90, fitted to `tritonkit inspect` scans at
# D = 64, 128 and 256 (4 and 8 warps, 2 and 3 stages): dK/dV holds two accumulators of its keys
# by D and a scores tile and dP tile of keys by step, (2 held D + 2 held step) / threads; it spilled
# from 192 on and not up to 160 at D <= 128 (at D = 256, 64-key tiles spill from 136: an estimate,
# and the tuner times what it lets through). dQ holds its accumulator and Q and dO: up to 192.
MAX_TILE_VALUES = {"dkdv": 160, "dq": 192}


# The untuned tiles at D <= 64 and D <= 128 of a mask without a window or soft cap (what the records
# hold), from the H200's shipped tuning records (tuned/h200.json: each key's candidates timed): of
# the tiles that compile for sm_90 to wgmma without spills, the nearest to every record's fastest.
# FIXED's tiles (32 x 64-128 keys by 2 stages at 8 warps for dK/dV, 128 rows by 32-key steps for
# dQ) ran 1.6-2.6x each record's fastest on average (up to 3.1x). These, on average and at worst:
# dK/dV with dq by atomics 1.03x and 1.07x at D = 128 (dq added through TMA), 1.19x and 1.29x at
# D = 64; dQ 1.00x and 1.04x, 1.01x and 1.05x (tests/test_attention_tuning.py). The deterministic
# dK/dV keeps FIXED's tile: every faster one spills with a window, soft cap or GQA, or compiles to
# mma.sync. Windowed or soft-capped keys keep FIXED's (the TMA-dq tile spills there, packed).
FIXED = {
    64: {
        "dkdv": {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
        "dq": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    },
    128: {
        "dkdv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        "dq": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    },
    256: {
        "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
        "dq": {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2},
    },
}
UNTUNED = {
    64: {
        "dkdv atomic-dq": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
        "dq": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    },
    128: {
        "dkdv atomic-dq": {"BLOCK_M": 32, "BLOCK_N": 128, "TMA_DQ": True, "num_warps": 8, "num_stages": 3},
        "dq": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    },
}


def default_config(head_dim: int, atomic_dq: bool = False, plain: bool = True) -> dict:
    """The backward's launch configs before tuning (``atomic_dq``: the dK/dV kernel's for
    deterministic=False, which also adds dq; ``plain``: no window or soft cap): FIXED's, with
    UNTUNED's over them for plain masks up to D = 128. At D = 256 every wgmma tile of dK/dV spilled
    (two fp32 accumulators of BLOCK_N x 256, and the masked and unmasked loops each hold their
    tiles), so 32 keys by 16-row steps at 4 warps there, which compile to mma.sync (HMMA) in 241
    registers."""
    if interpret():
        return {kernel: dict(INTERPRETER_CONFIG) for kernel in KERNELS}
    size = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
    tiles = {kernel: dict(tile) for kernel, tile in FIXED[size].items()}
    if plain and size in UNTUNED:
        tiles["dq"] = dict(UNTUNED[size]["dq"])
        if atomic_dq:
            tiles["dkdv"] = dict(UNTUNED[size]["dkdv atomic-dq"])
    return tiles


def _prune(kernel: str, config: dict, key: dict) -> bool:
    """True drops the config: more fp32 values a thread than compile without spilling, more shared
    memory than an SM has (the pipelined step's two tiles a stage, and the held tiles), or a held
    tile past twice the problem's rows (keys for dK/dV, query rows for dQ)."""
    block_d, threads = _block_d(key["head_dim"]), 32 * config["num_warps"]
    held, step = config[HELD[kernel]], config["BLOCK_M" if kernel == "dkdv" else "BLOCK_N"]
    values = (2 * held * block_d + 2 * held * step) / threads
    shared = 2 * (config["num_stages"] * 2 * step * block_d + 2 * held * block_d)
    if config.get("TMA_DQ"):  # the dq tile is staged in shared memory for the bulk reduction
        if key.get("dq") != "atomic":
            return True
        shared += 4 * step * block_d
    rows = key["seq_k"] if kernel == "dkdv" else key["seq_q"]
    too_much_shared = shared > shared_memory_bytes(current_device())
    return values > MAX_TILE_VALUES[kernel] or too_much_shared or held > 2 * rows


# dK/dV: programs hold BLOCK_N keys and step BLOCK_M query rows
DKDV_CONFIGS = (
    [
        {"BLOCK_M": step, "BLOCK_N": held, **launch}
        for held in (32, 64, 128)
        for step in (16, 32, 64)
        for launch in _LAUNCH
    ]
    # atomic dq added a tile at a time by TMA (keys whose dq is atomic only; not yet timed)
    + [
        {"BLOCK_M": step, "BLOCK_N": held, **launch, "TMA_DQ": True}
        for held in (64, 128)
        for step in (32, 64)
        for launch in _LAUNCH
    ]
)


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,  # inputs as the forward took them, and dO: (B, H*, S*, D), strided
    lse_ptr,  # forward lse (natural log), (B, Hq, Sq), strides stride_l* and 1
    delta_ptr,  # rowsum(dO * O) - dlse, laid out as the lse
    dk_ptr,
    dv_ptr,  # out: (B, Hkv, Sk, D), strides stride_g* and 1
    dq_acc_ptr,  # ATOMIC_DQ: fp32 dq accumulator, (B, Hq, Sq, D), zeros, strides stride_a* and 1
    cu_q_ptr,
    cu_k_ptr,  # VARLEN: int32 first row of each packed sequence of q and of k, and the total
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,  # elements between batches, heads, rows, dims of q
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,  # ... of k
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,  # ... of v
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,  # ... of dO
    stride_lb,
    stride_lh,  # ... of the lse and delta
    stride_gb,
    stride_gh,
    stride_gn,  # ... of dk and dv
    stride_ab,
    stride_ah,
    stride_am,  # ... of the dq accumulator
    H_KV,  # key/value heads
    GROUP,  # query heads per key/value head
    SEQ_Q,
    SEQ_K,  # rows of q and of k per head
    UPPER_OFFSET,
    LOWER_OFFSET,
    score_scale,
    cap_log2,  # the scores' masks and exponent: Scores.kernel_args
    sm_scale,  # the softmax scale
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # D, and a power of two >= D
    IS_CAUSAL: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    SOFTCAP: tl.constexpr,  # Scores.kernel_args
    VARLEN: tl.constexpr,  # a packed batch: a program's "batch" is a sequence; batch strides are 0
    ATOMIC_DQ: tl.constexpr,  # also accumulate dq, with atomics (no dQ kernel)
    BLOCK_M: tl.constexpr,  # query rows a step of the loop takes
    BLOCK_N: tl.constexpr,  # keys a program holds
    EXACT_DOT_IN_FP32: tl.constexpr,  # multiply the 16-bit tiles as fp32 (the interpreter's path)
    TMA_DQ: tl.constexpr,  # ATOMIC_DQ through a tensor descriptor: one bulk reduction a tile (sm_90)
):
    start_n = tl.program_id(0) * BLOCK_N
    bh_kv = tl.program_id(1).to(tl.int64)
    batch, kv_head = bh_kv // H_KV, bh_kv % H_KV
    q_start, SEQ_Q, k_start, SEQ_K, UPPER_OFFSET, LOWER_OFFSET = _sequence(
        batch, cu_q_ptr, cu_k_ptr, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, VARLEN=VARLEN
    )
    local_n = tl.arange(0, BLOCK_N)
    cols = start_n + local_n
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < HEAD_DIM
    kv_mask = (cols[:, None] < SEQ_K) & d_mask[None, :]
    block = k_start + tl.cast(start_n, tl.int64)  # int64: S * stride may pass 2^31 (a (B, S, H, D) layout)
    k_rows = k_ptr + batch * stride_kb + kv_head * stride_kh + block * stride_kn
    v_rows = v_ptr + batch * stride_vb + kv_head * stride_vh + block * stride_vn
    k = tl.load(k_rows + local_n[:, None] * stride_kn + dims[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(v_rows + local_n[:, None] * stride_vn + dims[None, :] * stride_vd, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Query blocks, as row ranges: [first, inner_start) cross a bound's diagonal (masked); [inner_start,
    # inner_end) see every key of this block and lie inside SEQ_Q (unmasked); [inner_end, end) cross
    # the other bound or hold the ragged last rows (masked). A ragged key block masks them all.
    all_end = tl.cdiv(SEQ_Q, BLOCK_M) * BLOCK_M
    last_key = start_n + BLOCK_N - 1
    inner_end = SEQ_Q // BLOCK_M * BLOCK_M
    # row i sees key j only if i >= j - UPPER_OFFSET: the first key bounds the rows that see any,
    # the last those that see all
    if IS_CAUSAL:
        first = tl.minimum(tl.maximum(start_n - UPPER_OFFSET, 0) // BLOCK_M * BLOCK_M, all_end)
        inner_start = tl.cdiv(tl.maximum(last_key - UPPER_OFFSET, 0), BLOCK_M) * BLOCK_M
    else:
        first = tl.full([], 0, tl.int32)
        inner_start = tl.full([], 0, tl.int32)
    # and only if i <= j - LOWER_OFFSET: the last key bounds the rows that see any, the first all
    if HAS_LOWER:
        end = tl.maximum(
            tl.minimum(tl.cdiv(tl.maximum(last_key - LOWER_OFFSET + 1, 0), BLOCK_M) * BLOCK_M, all_end), first
        )
        inner_end = tl.minimum(inner_end, tl.maximum(start_n - LOWER_OFFSET + 1, 0) // BLOCK_M * BLOCK_M)
    else:
        end = all_end
    end = tl.where(start_n < SEQ_K, end, first)  # a program past its packed sequence's keys
    if start_n + BLOCK_N > SEQ_K:
        inner_start = end
    inner_start = tl.minimum(tl.maximum(inner_start, first), end)
    inner_end = tl.maximum(tl.minimum(inner_end, end), inner_start)
    if TMA_DQ:  # the whole (contiguous) accumulator as rows of D: (B, Hq, Sq) rows, or (Hq, T) packed
        if VARLEN:
            dq_rows = H_KV * GROUP * (stride_ah // stride_am)
        else:
            dq_rows = tl.num_programs(1) // H_KV * (stride_ab // stride_am)
        dq_target = tl.make_tensor_descriptor(
            dq_acc_ptr, shape=[dq_rows, HEAD_DIM], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_D]
        )
    else:
        dq_target = dq_acc_ptr
    # what the masked and the unmasked steps share: tiles, pointers, strides and scalars
    shared = (
        k,
        v,
        q_ptr,
        do_ptr,
        lse_ptr,
        delta_ptr,
        dq_target,
        batch,
        kv_head,
        q_start,
        cols,
        dims,
        d_mask,
        stride_qb,
        stride_qh,
        stride_qm,
        stride_qd,
        stride_dob,
        stride_doh,
        stride_dom,
        stride_dod,
        stride_lb,
        stride_lh,
        stride_ab,
        stride_ah,
        stride_am,
        GROUP,
        SEQ_Q,
        SEQ_K,
        UPPER_OFFSET,
        LOWER_OFFSET,
        score_scale,
        cap_log2,
    )
    dk, dv = _dkdv_steps(
        dk,
        dv,
        *shared,
        first,
        (inner_start - first) // BLOCK_M,
        inner_end,
        (end - inner_end) // BLOCK_M,
        IS_CAUSAL=IS_CAUSAL,
        HAS_LOWER=HAS_LOWER,
        SOFTCAP=SOFTCAP,
        ATOMIC_DQ=ATOMIC_DQ,
        MASKED=True,
        BLOCK_M=BLOCK_M,
        EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32,
        TMA_DQ=TMA_DQ,
    )
    dk, dv = _dkdv_steps(
        dk,
        dv,
        *shared,
        inner_start,
        (inner_end - inner_start) // BLOCK_M,
        inner_end,
        0,
        IS_CAUSAL=IS_CAUSAL,
        HAS_LOWER=HAS_LOWER,
        SOFTCAP=SOFTCAP,
        ATOMIC_DQ=ATOMIC_DQ,
        MASKED=False,
        BLOCK_M=BLOCK_M,
        EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32,
        TMA_DQ=TMA_DQ,
    )
    out = batch * stride_gb + kv_head * stride_gh + (block + local_n[:, None]) * stride_gn + dims[None, :]
    tl.store(dk_ptr + out, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_steps(
    dq,
    q,
    do,
    lse_log2,
    delta,
    k_head,
    v_head,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    rows,
    dims,
    d_mask,
    start,
    end,
    SEQ_Q,
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
):
    """dq after the key blocks in [start, end); MASKED blocks mask keys past SEQ_K and outside each
    row's bounds (rows past SEQ_Q need no mask: their lse is +inf, so their P is 0, and they are not
    stored)."""
    local_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + local_n
        block_n = tl.cast(start_n, tl.int64)
        k_ptrs = k_head + block_n * stride_kn + local_n[:, None] * stride_kn + dims[None, :] * stride_kd
        v_ptrs = v_head + block_n * stride_vn + local_n[:, None] * stride_vn + dims[None, :] * stride_vd
        if MASKED:
            kv_mask = (cols[:, None] < SEQ_K) & d_mask[None, :]
        else:
            kv_mask = d_mask[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        s, tanh_s = _exponent(
            dot_fp32(q, tl.trans(k), EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32),
            score_scale,
            cap_log2,
            SOFTCAP=SOFTCAP,
        )
        p = tl.math.exp2(s - lse_log2[:, None])
        if MASKED:
            visible = _visible(
                rows[:, None],
                cols[None, :],
                SEQ_K,
                UPPER_OFFSET,
                LOWER_OFFSET,
                IS_CAUSAL=IS_CAUSAL,
                HAS_LOWER=HAS_LOWER,
            )
            p = tl.where(visible & (rows[:, None] < SEQ_Q), p, 0.0)
        dp = dot_fp32(do, tl.trans(v), EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - tanh_s * tanh_s)
        dq += dot_fp32(ds.to(k.dtype), k, EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32)
    return dq


# dQ: programs hold BLOCK_M query rows and step BLOCK_N keys
DQ_CONFIGS = [
    {"BLOCK_M": held, "BLOCK_N": step, **launch}
    for held in (64, 128)
    for step in (16, 32, 64)
    for launch in _LAUNCH
]


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,  # as in the dK/dV kernel
    lse_ptr,
    delta_ptr,  # (B, Hq, Sq), strides stride_l* and 1
    dq_ptr,  # out: (B, Hq, Sq, D), strides stride_g* and 1
    cu_q_ptr,
    cu_k_ptr,  # as in the dK/dV kernel
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_lb,
    stride_lh,
    stride_gb,
    stride_gh,
    stride_gn,
    H,  # query heads
    GROUP,  # query heads per key/value head
    SEQ_Q,
    SEQ_K,
    UPPER_OFFSET,
    LOWER_OFFSET,
    score_scale,
    cap_log2,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows a program holds
    BLOCK_N: tl.constexpr,  # keys a step of the loop takes
    EXACT_DOT_IN_FP32: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // H, bh % H
    kv_head = head // GROUP
    q_start, SEQ_Q, k_start, SEQ_K, UPPER_OFFSET, LOWER_OFFSET = _sequence(
        batch, cu_q_ptr, cu_k_ptr, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, VARLEN=VARLEN
    )
    local_m = tl.arange(0, BLOCK_M)
    rows = start_m + local_m
    row_mask = rows < SEQ_Q
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < HEAD_DIM
    tile_mask = row_mask[:, None] & d_mask[None, :]
    block = q_start + tl.cast(start_m, tl.int64)  # int64: S * stride may pass 2^31 (a (B, S, H, D) layout)
    q_rows = q_ptr + batch * stride_qb + head * stride_qh + block * stride_qm
    do_rows = do_ptr + batch * stride_dob + head * stride_doh + block * stride_dom
    q = tl.load(q_rows + local_m[:, None] * stride_qm + dims[None, :] * stride_qd, mask=tile_mask, other=0.0)
    do = tl.load(
        do_rows + local_m[:, None] * stride_dom + dims[None, :] * stride_dod, mask=tile_mask, other=0.0
    )
    row_stats = batch * stride_lb + head * stride_lh + block + local_m  # lse and delta
    lse = tl.load(lse_ptr + row_stats, mask=row_mask, other=float("inf"))
    delta = tl.load(delta_ptr + row_stats, mask=row_mask, other=0.0)
    lse_log2 = tl.where(lse == -float("inf"), float("inf"), lse * LOG2E)
    k_head = k_ptr + batch * stride_kb + kv_head * stride_kh + k_start * stride_kn
    v_head = v_ptr + batch * stride_vb + kv_head * stride_vh + k_start * stride_vn
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
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
    dq = _dq_steps(
        dq,
        q,
        do,
        lse_log2,
        delta,
        k_head,
        v_head,
        stride_kn,
        stride_kd,
        stride_vn,
        stride_vd,
        rows,
        dims,
        d_mask,
        start,
        inner_start,
        SEQ_Q,
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
    )
    dq = _dq_steps(
        dq,
        q,
        do,
        lse_log2,
        delta,
        k_head,
        v_head,
        stride_kn,
        stride_kd,
        stride_vn,
        stride_vd,
        rows,
        dims,
        d_mask,
        inner_start,
        inner_end,
        SEQ_Q,
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
    )
    dq = _dq_steps(
        dq,
        q,
        do,
        lse_log2,
        delta,
        k_head,
        v_head,
        stride_kn,
        stride_kd,
        stride_vn,
        stride_vd,
        rows,
        dims,
        d_mask,
        inner_end,
        end,
        SEQ_Q,
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
    )
    out = batch * stride_gb + head * stride_gh + (block + local_m[:, None]) * stride_gn + dims[None, :]
    tl.store(dq_ptr + out, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=tile_mask)


CONFIGS = {"dkdv": DKDV_CONFIGS, "dq": DQ_CONFIGS}  # by kernel, as KERNELS names them
