"""Rotary position embeddings, in Hugging Face's form (``apply_rotary_pos_emb``: q and k of one
layer in one launch, rotate-half, cos and sin tables of the full head dim) and in flash-attn's
(``apply_rotary_emb``: half tables, interleaved pairs or halves, a partial rotary dim, per-sequence
position offsets for decoding, packed sequences, in place).

Maths. A token at position p rotates each pair (x1, x2) of its head's vector: the halves of the
rotary dims (rotate-half) or neighbouring entries (interleaved). With c = cos(p theta_i) and s =
sin(p theta_i) read from the tables,
    o1 = x1 c1 - x2 s1,    o2 = x2 c2 + x1 s2
(c1 = c2 and s1 = s2 for a half table; Hugging Face's full table holds both halves, which the
formula reads apart). Its VJP is the transposed rotation,
    dx1 = do1 c1 + do2 s2,    dx2 = do2 c2 - do1 s1,
the same kernel with the sine's sign and halves swapped (CONJUGATE). Dims past the rotary ones
pass through.

Work. Each element is read once and written once: 2 x numel x s bytes for q (and k), plus the
tables' rows, which the heads of a token share (in L2). Six FLOPs a pair: memory-bound.
"""

from __future__ import annotations

import torch

from tritonkit._launch import Launch, call_signature, cdiv, next_power_of_2
from tritonkit._runtime import empty_output_like, l2_bytes
from tritonkit._triton import tl, triton
from tritonkit.dtypes import FLOATS
from tritonkit.opdef import as_int, check_tensor, checked_once, first_derivative_only, op
from tritonkit.ops import Op, Workload

DTYPES = FLOATS
# A program's tile: tokens x heads x rotary pairs (64 pairs, 128 elements, a thread at 4 warps).
# Swept on the H200 (benchmarks/rotary_tiles.py, results/h200/history/rotary-tiles-685feb1.json;
# 2048-16384 at 4 and 8 warps, graph-replayed): 8192 at 4 warps led at both of the shapes,
# 89.2 us at (4, 32/8, 4096, 128) against 4096's 94.7 and torch.compile's 90.1, and 177.6 at
# (1, 32/8, 32768, 128) against 187.1 and 218.8.
TILE_ELEMENTS = 8192
NUM_WARPS = 4
# Heads a tile at most (None: as many as the tile holds, up to the fewer of q's and k's): a tile of
# BLOCK_H heads reads BLOCK_H runs of its tokens, a head's S x D apart; one head reads one run, but
# loads a table row a token where BLOCK_H heads share it. Two, from eight: on an H100 (L2 flushed,
# `benchmarks/rotary_tiles.py OUT.json --heads 2 8 --flushed`, three processes,
# results/h100/history/rotary-heads-*-6343cea.json) 122.4-122.5 us against 124.2-124.4 at (4, 32/8,
# 4096, 128), torch.compile 123.8-124.0; 247.9-248.1 against 252.4-252.6 at (1, 32/8, 32768, 128).
TILE_HEADS = 2
NO_OFFSET, SCALAR_OFFSET, TENSOR_OFFSET = 0, 1, 2
# The programs' order (the kernel's groups). A head block's pass over a sequence reads each row of
# the tables; the next head block's pass reads them again from L2 only if what the first moved in
# between (its reads and writes, and the tables) fits there. Where it does, each head block walks
# all the sequence's tokens (one group: the longest runs of each head); where not, groups of
# TOKEN_GROUP token blocks take their head blocks one after another, the group's tables' rows read
# from DRAM once. Half the L2 is taken as the room (the H200's is two partitions). On the H200
# (benchmarks/rotary_tiles.py --groups, results/h200/history/rotary-groups-916bb7f.json), us:
# 85.7 one group against 87.8-88.2 for groups of 1-64 at (4, 32/8, 4096, 128), whose pass moves 19
# MB; 186.0 against 177.5 for groups of 16 at (1, 32/8, 32768, 128), 151 MB.
TOKEN_GROUP = 16


@triton.jit
def _rotate_tile(
    in_ptr, out_ptr, cos_ptr, sin_ptr, offsets_ptr, cu_ptr,
    sib, sis, sih, sid, sob, sos, soh, sod, scb, scs, scd,
    batch, s_block, h_block, seq, heads, rotary_dim, head_dim, offset, table_rows,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_REST: tl.constexpr,
    INTERLEAVED: tl.constexpr, FULL_TABLE: tl.constexpr, CONJUGATE: tl.constexpr, OFFSETS: tl.constexpr,
    VARLEN: tl.constexpr, COPY_REST: tl.constexpr,
):  # fmt: skip
    """One tile of BLOCK_S tokens x BLOCK_H heads of sequence ``batch``: its rotary pairs rotated,
    and (COPY_REST) its other dims copied."""
    s = s_block * BLOCK_S + tl.arange(0, BLOCK_S)
    h = h_block * BLOCK_H + tl.arange(0, BLOCK_H)
    if VARLEN:  # packed: the sequence's tokens are rows cu[b] ... cu[b + 1] - 1 of (total, H, D)
        first = tl.load(cu_ptr + batch)
        seq = tl.load(cu_ptr + batch + 1) - first
        token = (first + s).to(tl.int64)
    else:
        token = s.to(tl.int64)
    position = s
    if OFFSETS == 1:
        position += offset
    if OFFSETS == 2:
        position += tl.load(offsets_ptr + batch)
    ok = (s < seq)[:, None] & (h < heads)[None, :]  # (BLOCK_S, BLOCK_H)
    b64 = batch.to(tl.int64)
    in_rows = in_ptr + b64 * sib + token[:, None] * sis + h[None, :].to(tl.int64) * sih
    out_rows = out_ptr + b64 * sob + token[:, None] * sos + h[None, :].to(tl.int64) * soh
    half = rotary_dim // 2
    k = tl.arange(0, BLOCK_K)
    mask = ok[:, :, None] & (k < half)[None, None, :]
    if INTERLEAVED:
        d1, d2 = 2 * k, 2 * k + 1
    else:
        d1, d2 = k, k + half
    x1 = tl.load(in_rows[:, :, None] + d1[None, None, :] * sid, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(in_rows[:, :, None] + d2[None, None, :] * sid, mask=mask, other=0.0).to(tl.float32)
    # the tables' rows, (BLOCK_S, BLOCK_K) each, shared by the tile's heads
    table = (b64 * scb + position.to(tl.int64) * scs)[:, None]
    table_mask = (s < seq)[:, None] & (k < half)[None, :]
    # positions that no host check bounds (offsets read on the GPU, packed lengths): one outside the
    # tables reads nothing, and its token's outputs are NaN
    if OFFSETS == 2 or VARLEN:
        outside = (position < 0) | (position >= table_rows)
        table_mask &= ~outside[:, None]
    if FULL_TABLE:  # a column for every rotary dim: each half its own
        c1 = tl.load(cos_ptr + table + d1[None, :] * scd, mask=table_mask, other=0.0).to(tl.float32)[
            :, None, :
        ]
        c2 = tl.load(cos_ptr + table + d2[None, :] * scd, mask=table_mask, other=0.0).to(tl.float32)[
            :, None, :
        ]
        s1 = tl.load(sin_ptr + table + d1[None, :] * scd, mask=table_mask, other=0.0).to(tl.float32)[
            :, None, :
        ]
        s2 = tl.load(sin_ptr + table + d2[None, :] * scd, mask=table_mask, other=0.0).to(tl.float32)[
            :, None, :
        ]
    else:  # a column a pair
        c1 = tl.load(cos_ptr + table + k[None, :] * scd, mask=table_mask, other=0.0).to(tl.float32)[
            :, None, :
        ]
        s1 = tl.load(sin_ptr + table + k[None, :] * scd, mask=table_mask, other=0.0).to(tl.float32)[
            :, None, :
        ]
        c2, s2 = c1, s1
    if CONJUGATE:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    if OFFSETS == 2 or VARLEN:
        o1 = tl.where(outside[:, None, None], float("nan"), o1)
        o2 = tl.where(outside[:, None, None], float("nan"), o2)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_rows[:, :, None] + d1[None, None, :] * sod, o1.to(dtype), mask=mask)
    tl.store(out_rows[:, :, None] + d2[None, None, :] * sod, o2.to(dtype), mask=mask)
    if COPY_REST:
        for start in range(rotary_dim, head_dim, BLOCK_REST):
            d = start + tl.arange(0, BLOCK_REST)
            rest = ok[:, :, None] & (d < head_dim)[None, None, :]
            x = tl.load(in_rows[:, :, None] + d[None, None, :] * sid, mask=rest)
            tl.store(out_rows[:, :, None] + d[None, None, :] * sod, x, mask=rest)


@triton.jit
def _rotary_kernel(
    x_ptr,  # (B, S, H, D) as strides (sxb, sxs, sxh, sxd); VARLEN: (total, H, D), sxb unused
    out_x_ptr,  # the same, strides (soxb, ...); x_ptr itself in place
    y_ptr,  # HAS_Y: a second tensor of the same positions (Hugging Face's k), its own heads
    out_y_ptr,
    cos_ptr,  # the tables: (B or 1, positions, columns) with strides (scb, scs, scd); sin's the same
    sin_ptr,
    offsets_ptr,  # OFFSETS == 2: int32 (B,), the first position of each sequence
    cu_ptr,  # VARLEN: int32 (B + 1,)
    sxb, sxs, sxh, sxd,
    soxb, soxs, soxh, soxd,
    syb, sys, syh, syd,
    soyb, soys, soyh, soyd,
    scb, scs, scd,
    SEQ,  # tokens a sequence (VARLEN: the most, as the grid)
    HEADS_X,
    HEADS_Y,
    ROTARY_DIM,
    HEAD_DIM,
    OFFSET,  # OFFSETS == 1: every sequence's first position
    TABLE_ROWS,  # the tables' positions (OFFSETS == 2 or VARLEN: a position past them is marked)
    GROUP,  # token blocks a group (above)
    BLOCK_S: tl.constexpr,  # tokens a tile
    BLOCK_H: tl.constexpr,  # heads a tile
    BLOCK_K: tl.constexpr,  # pairs a tile (the rotary dim's half, to a power of two)
    BLOCK_REST: tl.constexpr,  # COPY_REST: dims past the rotary ones a step
    INTERLEAVED: tl.constexpr,  # pairs (2i, 2i + 1); else (i, i + ROTARY_DIM / 2)
    FULL_TABLE: tl.constexpr,  # the tables have a column for each rotary dim (Hugging Face's)
    CONJUGATE: tl.constexpr,  # the transposed rotation: the backward
    OFFSETS: tl.constexpr,  # 0 none, 1 OFFSET, 2 offsets_ptr
    VARLEN: tl.constexpr,
    COPY_REST: tl.constexpr,  # write the dims past ROTARY_DIM too (out of place)
    HAS_Y: tl.constexpr,
):  # fmt: skip
    # programs walk groups of GROUP token blocks, each group's head blocks one after another, so
    # that the group's rows of the tables, read from DRAM by its first head block, are in L2 for
    # the others, while each head block still reads GROUP token blocks in a row
    x_blocks = tl.cdiv(HEADS_X, BLOCK_H)
    h_blocks = x_blocks + tl.cdiv(HEADS_Y, BLOCK_H)
    pid, batch = tl.program_id(0), tl.program_id(1)
    first = pid // (GROUP * h_blocks) * GROUP
    size = tl.minimum(tl.cdiv(SEQ, BLOCK_S) - first, GROUP)
    in_group = pid - first * h_blocks
    s_block, h_block = first + in_group % size, in_group // size
    if h_block < x_blocks:
        _rotate_tile(
            x_ptr, out_x_ptr, cos_ptr, sin_ptr, offsets_ptr, cu_ptr,
            sxb, sxs, sxh, sxd, soxb, soxs, soxh, soxd, scb, scs, scd,
            batch, s_block, h_block, SEQ, HEADS_X, ROTARY_DIM, HEAD_DIM, OFFSET, TABLE_ROWS,
            BLOCK_S, BLOCK_H, BLOCK_K, BLOCK_REST, INTERLEAVED, FULL_TABLE, CONJUGATE, OFFSETS, VARLEN,
            COPY_REST,
        )  # fmt: skip
    elif HAS_Y:
        _rotate_tile(
            y_ptr, out_y_ptr, cos_ptr, sin_ptr, offsets_ptr, cu_ptr,
            syb, sys, syh, syd, soyb, soys, soyh, soyd, scb, scs, scd,
            batch, s_block, h_block - x_blocks, SEQ, HEADS_Y, ROTARY_DIM, HEAD_DIM, OFFSET, TABLE_ROWS,
            BLOCK_S, BLOCK_H, BLOCK_K, BLOCK_REST, INTERLEAVED, FULL_TABLE, CONJUGATE, OFFSETS, VARLEN,
            COPY_REST,
        )  # fmt: skip


# ---------------------------------------------------------------- launches


class Tables:
    """What the kernel needs to know of the tables and positions (host values only)."""

    def __init__(self, cos, sin, full: bool, interleaved: bool, offsets, cu_seqlens, max_seqlen):
        self.cos, self.sin, self.full, self.interleaved = cos, sin, full, interleaved
        self.offsets, self.cu_seqlens, self.max_seqlen = offsets, cu_seqlens, max_seqlen

    @property
    def rotary_dim(self) -> int:
        return self.cos.shape[-1] if self.full else 2 * self.cos.shape[-1]


def _strides(t: torch.Tensor | None, varlen: bool) -> tuple[int, ...]:
    """(batch, token, head, dim) strides of a (B, S, H, D) tensor, or a packed (total, H, D) one."""
    if t is None:
        return (0, 0, 0, 0)
    return (0, *t.stride()) if varlen else tuple(t.stride())


def _group(seq_blocks: int, pass_bytes: int, device) -> int:
    """Token blocks a group of the kernel's programs, from the bytes a head block's pass over the
    sequence moves (TOKEN_GROUP's comment)."""
    return max(seq_blocks, 1) if pass_bytes <= l2_bytes(device) // 2 else TOKEN_GROUP


def _launch(x, out_x, y, out_y, tables: Tables, conjugate: bool, inplace: bool = False) -> Launch:
    """The rotation of x (and y) in (B, S, H, D) (packed: (total, H, D)) layout into the outputs
    (``inplace``: out_x is x, and the dims past the rotary ones are left as they are)."""
    varlen = tables.cu_seqlens is not None
    batch = tables.cu_seqlens.shape[0] - 1 if varlen else x.shape[0]
    seq = tables.max_seqlen if varlen else x.shape[1]
    heads_x, heads_y, head_dim = x.shape[-2], (y.shape[-2] if y is not None else 0), x.shape[-1]
    rotary_dim = tables.rotary_dim
    block_k = max(1, next_power_of_2(rotary_dim // 2))
    # heads a tile: no more than the fewer of x's and y's (GQA's k), which would leave lanes idle
    block_h = min(
        next_power_of_2(min(heads_x, heads_y) if y is not None else heads_x),
        TILE_ELEMENTS // block_k,
        TILE_HEADS or TILE_ELEMENTS,
    )
    block_h = max(1, block_h)
    block_s = max(1, min(next_power_of_2(seq), TILE_ELEMENTS // (block_k * block_h)))
    seq_blocks, head_blocks = cdiv(seq, block_s), cdiv(heads_x, block_h) + cdiv(heads_y, block_h)
    table_row = (2 if tables.full else 1) * (rotary_dim // 2) * tables.cos.element_size() * 2  # cos, sin
    pass_bytes = seq * (block_h * head_dim * x.element_size() * 2 + table_row)  # read, written, tables
    cos = tables.cos if tables.cos.dim() == 3 else tables.cos[None]
    sin = tables.sin if tables.sin.dim() == 3 else tables.sin[None]
    offsets = tables.offsets
    mode = TENSOR_OFFSET if isinstance(offsets, torch.Tensor) else (SCALAR_OFFSET if offsets else NO_OFFSET)
    cos_strides = (cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), cos.stride(2))
    args = (
        x, out_x, y, out_y, cos, sin, offsets if mode == TENSOR_OFFSET else None, tables.cu_seqlens,
        *_strides(x, varlen), *_strides(out_x, varlen), *_strides(y, varlen), *_strides(out_y, varlen),
        *cos_strides, seq, heads_x, heads_y, rotary_dim, head_dim,
        int(offsets) if mode == SCALAR_OFFSET else 0, cos.shape[1], _group(seq_blocks, pass_bytes, x.device),
    )  # fmt: skip
    copy_rest = rotary_dim < head_dim and not inplace
    meta = {
        "BLOCK_S": block_s,
        "BLOCK_H": block_h,
        "BLOCK_K": block_k,
        "BLOCK_REST": max(1, min(next_power_of_2(head_dim - rotary_dim), 64)),
        "INTERLEAVED": tables.interleaved,
        "FULL_TABLE": tables.full,
        "CONJUGATE": conjugate,
        "OFFSETS": mode,
        "VARLEN": varlen,
        "COPY_REST": copy_rest,
        "HAS_Y": y is not None,
        "num_warps": NUM_WARPS,
    }
    grid = (seq_blocks * head_blocks, batch)
    return Launch("bwd" if conjugate else "fwd", _rotary_kernel, args, meta, grid=grid)


# ---------------------------------------------------------------- ops and autograd


@op("rotary", mutates=("out_x", "out_y"), replay=True)
def _rotary(
    x: torch.Tensor,
    out_x: torch.Tensor,
    y: torch.Tensor | None,
    out_y: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    offsets: torch.Tensor | None,
    offset: int,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    full: bool,
    interleaved: bool,
    conjugate: bool,
) -> None:
    """x (and y) rotated into out_x (and out_y), each (B, S, H, D) or packed (total, H, D)."""
    tables = Tables(
        cos, sin, full, interleaved, offsets if offsets is not None else offset, cu_seqlens, max_seqlen
    )
    if x.numel() or (y is not None and y.numel()):
        _launch(x, out_x, y, out_y, tables, conjugate).run()


@op("rotary_inplace", mutates=("x",), replay=True, in_place=("x",))
def _rotary_inplace(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    offsets: torch.Tensor | None,
    offset: int,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    interleaved: bool,
    conjugate: bool,
) -> None:
    """x rotated in place (flash-attn's half tables); its dims past the rotary ones untouched."""
    tables = Tables(
        cos, sin, False, interleaved, offsets if offsets is not None else offset, cu_seqlens, max_seqlen
    )
    if x.numel():
        _launch(x, x, None, None, tables, conjugate, inplace=True).run()


def _heads_second(t: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    """A Hugging Face (B, H, S, D) tensor (unsqueeze_dim 1) as the kernel's (B, S, H, D) view."""
    return t.transpose(1, 2) if unsqueeze_dim == 1 else t


class _RotaryPosEmb(torch.autograd.Function):
    """Hugging Face's q and k rotation, one launch each way."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim):
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim = unsqueeze_dim
        return _hf_rotate(q, k, cos, sin, unsqueeze_dim, conjugate=False)

    @staticmethod
    @first_derivative_only("apply_rotary_pos_emb")
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        dq, dk = _hf_rotate(grad_q, grad_k, cos, sin, ctx.unsqueeze_dim, conjugate=True)
        return dq, dk, None, None, None


def _hf_rotate(q, k, cos, sin, unsqueeze_dim: int, conjugate: bool):
    q_out = empty_output_like(q)
    k_out = empty_output_like(k)
    views = [_heads_second(t, unsqueeze_dim) for t in (q, q_out, k, k_out)]
    _rotary(*views, cos, sin, None, 0, None, 0, True, False, conjugate)
    return q_out, k_out


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1):
    """Hugging Face's ``apply_rotary_pos_emb``: ``(q * cos + rotate_half(q) * sin, the same for k)``
    with cos and sin (B, S, D) or (S, D) broadcast over the heads; q (B, Hq, S, D) and k (B, Hkv, S,
    D) (``unsqueeze_dim=2``: (B, S, H, D)), any strides (views of a fused QKV projection need no
    copy), rotated in one launch. Outputs are contiguous, in q's and k's dtype."""
    if position_ids is not None:
        raise NotImplementedError(
            "position_ids is deprecated and unused in Hugging Face's apply_rotary_pos_emb: "
            "index cos and sin by position instead"
        )
    _validate_hf_once(q, k, cos, sin, unsqueeze_dim)
    if cos.requires_grad or sin.requires_grad:
        raise NotImplementedError("apply_rotary_pos_emb has no gradient for cos and sin: pass them detached")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _RotaryPosEmb.apply(q, k, cos, sin, unsqueeze_dim)
    return _hf_rotate(q, k, cos, sin, unsqueeze_dim, conjugate=False)


def _validate_hf(q, k, cos, sin, unsqueeze_dim) -> None:
    check_tensor("q", q, dtypes=DTYPES, ndim=4)
    check_tensor("k", k, dtypes=(q.dtype,), ndim=4, device_of=("q", q))
    if unsqueeze_dim not in (1, 2):
        raise NotImplementedError(
            f"unsqueeze_dim must be 1 ((B, H, S, D)) or 2 ((B, S, H, D)), got {unsqueeze_dim}"
        )
    batch, _, seq, head_dim = _heads_second(q, unsqueeze_dim).transpose(1, 2).shape
    kb, _, ks, kd = _heads_second(k, unsqueeze_dim).transpose(1, 2).shape
    if (kb, ks, kd) != (batch, seq, head_dim):
        raise ValueError(
            f"k must match q's batch, sequence and head dim, got {tuple(k.shape)} for {tuple(q.shape)}"
        )
    if head_dim % 2:
        raise ValueError(f"the head dim must be even, got {head_dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, dtypes=FLOATS, device_of=("q", q))
        if (
            t.dim() not in (2, 3)
            or t.shape[-2:] != (seq, head_dim)
            or (t.dim() == 3 and t.shape[0] not in (1, batch))
        ):
            raise ValueError(
                f"{name} must be (B, S, D) = {(batch, seq, head_dim)} or (S, D), got {tuple(t.shape)}"
            )
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        raise ValueError(
            f"cos and sin must have one shape and strides, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )


_validate_hf_once = checked_once(
    _validate_hf,
    lambda q, k, cos, sin, unsqueeze_dim: call_signature((q, k, cos, sin), unsqueeze_dim),
)


class _RotaryEmb(torch.autograd.Function):
    """flash-attn's rotation of one tensor, out of place or in place; the backward rotates the
    gradient back (conjugate), the dims past the rotary ones passing through."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, inplace, offsets, offset, cu_seqlens, max_seqlen):
        ctx.save_for_backward(cos, sin, offsets, cu_seqlens)
        ctx.options = interleaved, offset, max_seqlen
        if inplace:
            ctx.mark_dirty(x)
        return _flash_rotate(x, cos, sin, interleaved, inplace, offsets, offset, cu_seqlens, max_seqlen)

    @staticmethod
    @first_derivative_only("apply_rotary_emb")
    def backward(ctx, grad):
        cos, sin, offsets, cu_seqlens = ctx.saved_tensors
        interleaved, offset, max_seqlen = ctx.options
        dx = empty_output_like(grad)
        _rotary(
            grad, dx, None, None, cos, sin, offsets, offset, cu_seqlens, max_seqlen, False, interleaved, True
        )
        return dx, None, None, None, None, None, None, None, None


def apply_rotary_emb(
    x, cos, sin, interleaved: bool = False, inplace: bool = False, seqlen_offsets=0, cu_seqlens=None,
    max_seqlen: int | None = None,
):  # fmt: skip
    """flash-attn's ``apply_rotary_emb``: x (B, S, H, D), or packed (total, H, D) with int32
    ``cu_seqlens`` (B + 1,) and ``max_seqlen``; cos and sin (S_table, rotary_dim / 2), rotary_dim <=
    D, the dims past it passed through. ``interleaved`` rotates pairs (2i, 2i + 1), else the rotary
    dims' halves (GPT-NeoX). Token s of sequence b sits at position s + seqlen_offsets (an int >= 0,
    or an int32 (B,) tensor: decoding). ``inplace`` writes x itself. ``max_seqlen`` must be at least
    the longest sequence: tokens past it are not written. Positions outside the tables raise where
    the host knows them (an int offset, no packing); otherwise (that would read the offsets or the
    lengths on the host) such a token's outputs are NaN and nothing past the tables is read."""
    if isinstance(seqlen_offsets, torch.Tensor):  # the kernel reads entry b at offsets + b
        seqlen_offsets = seqlen_offsets.contiguous()
    elif _whole(seqlen_offsets) is None:
        raise ValueError(f"seqlen_offsets must be an int >= 0 or an int32 tensor, got {seqlen_offsets!r}")
    if isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = cu_seqlens.contiguous()
    _validate_flash_once(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen)
    if cos.requires_grad or sin.requires_grad:
        raise NotImplementedError("apply_rotary_emb has no gradient for cos and sin: pass them detached")
    offsets = seqlen_offsets if isinstance(seqlen_offsets, torch.Tensor) else None
    offset = 0 if offsets is not None else int(seqlen_offsets)
    max_seqlen = int(max_seqlen) if cu_seqlens is not None else x.shape[1]
    options = (bool(interleaved), bool(inplace), offsets, offset, cu_seqlens, max_seqlen)
    if torch.is_grad_enabled() and x.requires_grad:
        return _RotaryEmb.apply(x, cos, sin, *options)
    return _flash_rotate(x, cos, sin, *options)


def _flash_rotate(x, cos, sin, interleaved, inplace, offsets, offset, cu_seqlens, max_seqlen):
    """x rotated (flash-attn's half tables): in place, or into a new tensor."""
    if inplace:
        _rotary_inplace(x, cos, sin, offsets, offset, cu_seqlens, max_seqlen, interleaved, False)
        return x
    out = empty_output_like(x)
    _rotary(x, out, None, None, cos, sin, offsets, offset, cu_seqlens, max_seqlen, False, interleaved, False)
    return out


def _whole(value) -> int | None:
    """``value`` as an int >= 0 (an int, or a numpy or torch integer), or None where it is not one."""
    number = as_int(value)
    return number if number is not None and number >= 0 else None


def _validate_flash(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen) -> None:
    check_tensor("x", x, dtypes=DTYPES, ndim=3 if cu_seqlens is not None else 4)
    head_dim = x.shape[-1]
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, dtypes=FLOATS, ndim=2, device_of=("x", x))
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        raise ValueError(
            f"cos and sin must have one shape and strides, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if not 0 < 2 * cos.shape[1] <= head_dim:
        raise ValueError(
            f"cos must be (S, rotary_dim / 2) with rotary_dim <= {head_dim}, got {tuple(cos.shape)}"
        )
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32,), ndim=1, device_of=("x", x))
        if _whole(max_seqlen) is None:
            raise ValueError(
                "packed sequences (cu_seqlens) need max_seqlen, an int >= the longest sequence (the grid "
                f"is sized from it), got {max_seqlen!r}"
            )
        batch = cu_seqlens.shape[0] - 1
    else:
        batch = x.shape[0]
        last = x.shape[1] + (0 if isinstance(seqlen_offsets, torch.Tensor) else int(seqlen_offsets)) - 1
        if last >= cos.shape[0]:
            raise ValueError(
                f"positions up to {last} need cos and sin of {last + 1} rows, got {cos.shape[0]}"
            )
    if isinstance(seqlen_offsets, torch.Tensor):
        check_tensor("seqlen_offsets", seqlen_offsets, dtypes=(torch.int32,), ndim=1, device_of=("x", x))
        if seqlen_offsets.shape[0] != batch:
            raise ValueError(f"seqlen_offsets must have B = {batch} entries, got {seqlen_offsets.shape[0]}")


def _flash_signature(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen) -> tuple | None:
    """What :func:`_validate_flash` reads: the tensors' geometry, an int offset, max_seqlen and its
    type (a float equal to an int is refused)."""
    offsets = seqlen_offsets if isinstance(seqlen_offsets, torch.Tensor) else None
    offset = None if offsets is not None else seqlen_offsets
    return call_signature((x, cos, sin, offsets, cu_seqlens), offset, max_seqlen, type(max_seqlen))


_validate_flash_once = checked_once(_validate_flash, _flash_signature)


# ---------------------------------------------------------------- references and cost


def _rotate_half(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_pos_emb_reference(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1):
    """Hugging Face's formula, in plain PyTorch (cos and sin (S, D) taken as (1, S, D))."""
    cos, sin = (t if t.dim() == 3 else t[None] for t in (cos, sin))
    cos, sin = cos.unsqueeze(unsqueeze_dim).to(q.dtype), sin.unsqueeze(unsqueeze_dim).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rotary_emb_reference(
    x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None
):  # fmt: skip
    """flash-attn's formula, in plain PyTorch: each token's table row gathered by its position
    (never in place: the reference leaves x alone)."""
    if cu_seqlens is None:
        batch, seq = x.shape[:2]
        positions = torch.arange(seq, device=x.device)[None, :] + (
            seqlen_offsets[:, None].long()
            if isinstance(seqlen_offsets, torch.Tensor)
            else int(seqlen_offsets)
        )
        positions = positions.expand(batch, seq)
    else:
        starts, lengths = cu_seqlens[:-1].long(), cu_seqlens.diff().long()
        sequence = torch.repeat_interleave(torch.arange(len(lengths), device=x.device), lengths)
        positions = torch.arange(x.shape[0], device=x.device) - starts[sequence]
        if isinstance(seqlen_offsets, torch.Tensor):
            positions = positions + seqlen_offsets.long()[sequence]
        else:
            positions = positions + int(seqlen_offsets)
    rotary_dim = 2 * cos.shape[1]
    pattern = (lambda t: t.repeat_interleave(2, -1)) if interleaved else (lambda t: torch.cat((t, t), -1))
    c, s = (pattern(t[positions]).unsqueeze(-2).to(x.dtype) for t in (cos, sin))
    rotary = x[..., :rotary_dim]
    return torch.cat((rotary * c + _rotate_half(rotary, interleaved) * s, x[..., rotary_dim:]), dim=-1)


def rotary_cost(shape: tuple, dtype: torch.dtype, mode: str = "fwd"):
    """Bytes of Hugging Face's rotation of q and k (B, Hq, Hkv, S, D), both ways: q and k read and
    written, each table's (S, D) once; about six FLOPs a pair."""
    from tritonkit.roofline import Cost

    batch, heads_q, heads_kv, seq, head_dim = shape
    size = torch.finfo(dtype).bits // 8
    elements = batch * (heads_q + heads_kv) * seq * head_dim
    cost = Cost(3 * elements, 2 * elements * size + 2 * seq * head_dim * size)
    return {"fwd": cost, "bwd": cost, "fwd+bwd": cost + cost}[mode]


def _input_shapes(shape: tuple) -> tuple:
    """The shapes of q (B, Hq, S, D), k (B, Hkv, S, D) and the cos and sin tables (S, D)."""
    batch, heads_q, heads_kv, seq, head_dim = shape
    table = (seq, head_dim)
    return (batch, heads_q, seq, head_dim), (batch, heads_kv, seq, head_dim), table, table


def _make_inputs(shape: tuple, dtype: torch.dtype, device, generator: torch.Generator) -> tuple:
    """q, k (``_input_shapes``) and Llama's cos and sin tables at base 10000."""
    from tritonkit.testing import random_tensor

    q_shape, k_shape, _, _ = _input_shapes(shape)
    q = random_tensor(q_shape, dtype, device, generator=generator)
    k = random_tensor(k_shape, dtype, device, generator=generator)
    *_, seq, head_dim = shape
    inverse = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inverse[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return q, k, angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def _inspect_launches(shape: tuple, dtype: torch.dtype, config: dict | None = None) -> list[Launch]:
    if config is not None:
        raise ValueError("rotary embeddings have no tuning configs: the tile follows from the shape")
    # the inputs' shapes on the meta device: no benchmark-sized random tensors to make and drop
    q, k, cos, sin = (torch.empty(s, dtype=dtype, device="meta") for s in _input_shapes(shape))
    tables = Tables(cos, sin, True, False, 0, None, 0)
    views = [_heads_second(t, 1) for t in (q, q, k, k)]
    return [_launch(*views, tables, conjugate=False), _launch(*views, tables, conjugate=True)]


def _liger(kwargs: dict):
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    return liger_rotary_pos_emb


OPS = {
    "rotary_pos_emb": Op(
        name="rotary_pos_emb",
        family="rotary",
        fn=apply_rotary_pos_emb,
        reference=rotary_pos_emb_reference,
        cost=rotary_cost,
        make_inputs=_make_inputs,
        grad_inputs=(0, 1),
        shapes=[((2, 4, 2, 9, 16), "bf16"), ((1, 2, 1, 5, 32), "fp32")],
        dims=("batch", "query heads", "key heads", "sequence", "head dim"),
        inspect=_inspect_launches,
    )
}
WORKLOADS = {
    "rotary_pos_emb": Workload(
        name="rotary_pos_emb",
        op=OPS["rotary_pos_emb"],
        flop_unit="fp32",
        # (B, Hq, Hkv, S, D): the Llama-shaped q and k, and one long sequence
        shapes={
            "quick": [((4, 32, 8, 4096, 128), "bf16"), ((1, 32, 8, 32768, 128), "bf16")],
            "full": [
                ((4, 32, 8, 4096, 128), "bf16"),
                ((1, 32, 8, 32768, 128), "bf16"),
                ((8, 16, 16, 2048, 64), "bf16"),
            ],
        },
        tiny_shape=(1, 1, 1, 4, 64),
        peers={"liger": _liger},
    )
}
