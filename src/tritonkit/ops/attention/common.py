"""What attention's forward and backward share, so that each imports it from here and neither
imports the other for it: how scores are scaled, capped and masked (``Scores``), packed
variable-length batches (``Packed``), the ``@triton.jit`` helpers both kernels call for the
exponent, the masks, a packed sequence's bounds and a query block's key ranges; the argument
checks and the default scale; the forward's tuning key and calibration problem, which both
tuners key and gate with; and the plain-PyTorch reference the gates compare against.

The maths and the kernels are in ``fwd`` and ``bwd``; the public functions in ``attention``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from tritonkit._launch import GRID_YZ_MAX
from tritonkit._runtime import empty_output, empty_output_like
from tritonkit._triton import tl, triton
from tritonkit.dtypes import DTYPE_OF, HALVES, NAME_OF
from tritonkit.jit import LOG2E
from tritonkit.opdef import as_int, check_tensor, finite

DTYPES = HALVES  # the dtypes attention takes
MAX_HEAD_DIM = 256  # a (BLOCK_M, 256) fp32 accumulator is already 128 registers a thread at 8 warps


class Scores(NamedTuple):
    """How q . k becomes the softmax's input: scaled, soft-capped, masked. Query i sees key j iff
    j <= i + offset + right (causal: right = 0) and j >= i + offset - left, where offset = Sk - Sq
    aligned bottom-right and 0 top-left, and a -1 in ``window`` = (left, right) leaves that side
    unbounded. ``softcap`` > 0 turns the scaled score s into softcap * tanh(s / softcap)."""

    scale: float
    causal: bool = False
    bottom_right: bool = True
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0

    def within(self, seq_q: int, seq_k: int) -> Scores:
        """These scores with each window side that cuts no key of a (seq_q, seq_k) attention, either
        alignment (a side of max(seq_q, seq_k) or more), made unbounded: the same mask, and offsets
        that the kernels' 32-bit index arithmetic holds however wide a side was given."""
        if self.window == (-1, -1):  # (the usual call: no new tuple, 1 us of host time)
            return self
        reach = max(seq_q, seq_k)
        return self._replace(window=tuple(-1 if side >= reach else side for side in self.window))

    def kernel_args(self, seq_q: int, seq_k: int) -> tuple[tuple, dict]:
        """The kernels' (UPPER_OFFSET, LOWER_OFFSET, score_scale, cap_log2) and their constexprs
        (IS_CAUSAL: any upper bound, HAS_LOWER, SOFTCAP): row i sees key j iff j <= i + UPPER_OFFSET
        and j >= i + LOWER_OFFSET; the exponent (log2 units) is dot * score_scale, or with SOFTCAP
        tanh(dot * score_scale) * cap_log2."""
        offset = seq_k - seq_q if self.bottom_right else 0
        left, right = self.window
        upper = self.causal or right >= 0
        upper_offset = offset + (0 if self.causal else right) if upper else 0
        lower_offset = offset - left if left >= 0 else 0
        if self.softcap:
            factors = (self.scale / self.softcap, self.softcap * LOG2E.value)
        else:
            factors = (self.scale * LOG2E.value, 1.0)
        return (
            (upper_offset, lower_offset, *factors),
            {"IS_CAUSAL": upper, "HAS_LOWER": left >= 0, "SOFTCAP": bool(self.softcap)},
        )


class Packed(NamedTuple):
    """A packed batch of variable-length sequences: sequence b's query rows are
    cu_q[b]:cu_q[b + 1] of the packed tensor, its keys cu_k[b]:cu_k[b + 1]."""

    cu_q: torch.Tensor  # int32, (B + 1,), on the tensors' device
    cu_k: torch.Tensor
    sequences: int  # B
    max_q: int  # the longest sequence's query rows: the grid's extent
    max_k: int


def grid_lengths(q: torch.Tensor, k: torch.Tensor, packed: Packed | None) -> tuple[int, int]:
    """The (query rows, keys) a call's grid covers: a (B, H, S, D) batch's, or a packed batch's
    longest sequence's (q and k its (1, H, T, D) views)."""
    return (packed.max_q, packed.max_k) if packed is not None else (q.shape[2], k.shape[2])


# Programs a launch grid's second dimension holds (``_launch.GRID_YZ_MAX``): the Triton kernels'
# grids put batch x heads there, so a call of more (2048 sequences of 32 heads) runs in runs of batches
GRID_Y_MAX = GRID_YZ_MAX


def batch_runs(batch: int, heads: int) -> list[tuple[int, int]]:
    """(first, end) of each run of batches whose batch x heads programs the grid's second dimension
    holds: one run (0, batch) where all of them fit."""
    if batch * heads <= GRID_Y_MAX:  # (every call but the largest: no list built)
        return [(0, batch)]
    per = max(1, GRID_Y_MAX // heads)
    return [(b, min(b + per, batch)) for b in range(0, batch, per)]


def problem_runs(problem: dict, heads: int) -> list[dict]:
    """A main kernel's problem (q, k, v, ... as (B, H, ...) tensors, ``scores``, ``packed``) cut into
    :func:`batch_runs`: each tensor's batches of the run, or a packed batch's run of sequences (its
    cu_seqlens sliced: their offsets into the packed tensors stay as they are); [problem] where one
    run holds them all."""
    packed = problem["packed"]
    runs = batch_runs(packed.sequences if packed is not None else problem["q"].shape[0], heads)
    if len(runs) == 1:
        return [problem]
    if packed is not None:
        return [
            problem
            | {
                "packed": packed._replace(
                    cu_q=packed.cu_q[b0 : b1 + 1], cu_k=packed.cu_k[b0 : b1 + 1], sequences=b1 - b0
                )
            }
            for b0, b1 in runs
        ]
    return [
        {name: value[b0:b1] if isinstance(value, torch.Tensor) else value for name, value in problem.items()}
        for b0, b1 in runs
    ]


def per_sequence(strides: tuple, packed: Packed | None) -> tuple:
    """A tensor's strides as a kernel takes them: in a packed batch the leading (batch) stride is 0,
    since a program's "batch" index is its sequence, found by its first row instead."""
    return tuple(strides) if packed is None else (0, *strides[1:])


def sequence_args(
    scores: Scores, packed: Packed | None, batch: int, seq_q: int, seq_k: int, unused: torch.Tensor
) -> tuple:
    """What the three main kernels take about the sequences and the scores: (batch, seq_q, seq_k,
    (cu_q, cu_k), the scores' runtime arguments, their constexprs with VARLEN). A packed batch's
    are its sequence count and longest lengths, with offsets holding only the window's sides (each
    sequence adds its own alignment); a dense one passes ``unused`` for the cu_seqlens pointers."""
    if packed is None:
        score_args, score_meta = scores.kernel_args(seq_q, seq_k)
        return batch, seq_q, seq_k, (unused, unused), score_args, {**score_meta, "VARLEN": False}
    score_args, score_meta = scores.kernel_args(0, 0)
    return (
        packed.sequences,
        packed.max_q,
        packed.max_k,
        (packed.cu_q, packed.cu_k),
        score_args,
        {**score_meta, "VARLEN": True},
    )


def softmax_scale(scale: float | None, head_dim: int) -> float:
    """``scale``, or 1/sqrt(D) where it is None (torch's and FlashAttention's default); ValueError
    where it is not a finite number (a NaN or infinite scale would only give NaN outputs)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = float(scale)
    if not finite(scale):
        raise ValueError(f"scale must be a finite number (None: 1/sqrt(head dim)), got {scale}")
    return scale


def check_window(window) -> tuple[int, int]:
    """``window`` as (left, right) ints >= -1, or ValueError naming what is wrong."""
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right), got {window!r}") from None
    sides = []
    for side, value in (("left", left), ("right", right)):
        number = as_int(value)
        if number is None or number < -1:
            raise ValueError(f"window's {side} side must be an int >= -1 (-1: unbounded), got {value!r}")
        sides.append(number)
    return tuple(sides)


def empty_in_layout(t: torch.Tensor) -> torch.Tensor:
    """A new tensor of t's shape and dtype (an output, or a gradient of t), laid out as t is where t
    is a (B, H, S, D) view of (B, S, H, D) memory (the heads inside each position: a projection's
    output viewed as heads and transposed, as decoder layers and transformers' models pass q, k and
    v), so that the caller's transpose back to (B, S, H D) is a view, not a copy, and a fused QKV
    projection's gradient gathers rows, not transposed blocks; else contiguous."""
    if t.dim() == 4 and t.stride(1) < t.stride(2):
        batch, heads, seq, head_dim = t.shape
        return empty_output((batch, seq, heads, head_dim), t.dtype, t.device).transpose(1, 2)
    return empty_output_like(t)


def validate_qkv(q, k, v, names: tuple[str, str, str] = ("query", "key", "value")) -> None:
    """Check dense (B, H, S, D) query, key and value: a TypeError or ValueError naming what is wrong,
    each tensor by its name in ``names`` (the caller's parameter names)."""
    for name, tensor in zip(names, (q, k, v), strict=True):
        check_tensor(name, tensor, dtypes=DTYPES)
        if tensor.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, heads, sequence, head dim), got shape {tuple(tensor.shape)}"
            )
    q_name, k_name, v_name = names
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"{q_name}, {k_name} and {v_name} must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(
            f"{q_name}, {k_name} and {v_name} must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    (batch, heads_q, _, head_dim), (batch_k, heads_kv, _, head_dim_k) = q.shape, k.shape
    if v.shape != k.shape:
        raise ValueError(f"{v_name} must have {k_name}'s shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if batch_k != batch:
        raise ValueError(f"{k_name} and {v_name} must have {q_name}'s batch size {batch}, got {batch_k}")
    if head_dim_k != head_dim:
        raise ValueError(f"{k_name} and {v_name} must have {q_name}'s head dim {head_dim}, got {head_dim_k}")
    _check_heads(heads_q, heads_kv, head_dim)


def _check_heads(heads_q: int, heads_kv: int, head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be 1 to {MAX_HEAD_DIM}, got {head_dim}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")


def benchmark_shape(shape: tuple) -> tuple[int, int, int, int, int]:
    """A benchmark shape (B, Hq, Hkv, S, D) as its five sizes, refused (ValueError) where the op
    refuses such tensors: what ``tritonkit roofline`` and ``inspect`` read a --shape through."""
    batch, heads_q, heads_kv, seq, head_dim = shape
    _check_heads(heads_q, heads_kv, head_dim)
    return batch, heads_q, heads_kv, seq, head_dim


# ---------------------------------------------------------------- jit helpers of both kernels


@triton.jit
def _exponent(dot, score_scale, cap_log2, SOFTCAP: tl.constexpr):
    """(the scores in log2 units, tanh of the capped score or 0): dot * score_scale, or with SOFTCAP
    tanh(dot * score_scale) * cap_log2; tanh as 1 - 2 / (e^2x + 1), which saturates to +-1 cleanly,
    and near 0 as its series: there 1 - 2 / (e^2x + 1) keeps only 1's absolute precision (6e-8),
    which cap_log2 multiplies (a cap of 1e7 put its scores 0.6 off)."""
    if SOFTCAP:
        x = dot * score_scale
        t = 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)
        x2 = x * x  # x - x^3 / 3 + 2 x^5 / 15: within 3e-9 of tanh x, relatively, where |x| < 1/16
        t = tl.where(tl.abs(x) < 0.0625, x + x * x2 * (x2 * (2.0 / 15.0) - 1.0 / 3.0), t)
        return t * cap_log2, t
    else:  # the else keeps Triton from compiling both returns (their types differ)
        return dot * score_scale, 0.0


@triton.jit
def _visible(rows, cols, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, IS_CAUSAL: tl.constexpr, HAS_LOWER: tl.constexpr):
    """Whether query ``rows`` see keys ``cols`` (broadcast against each other): the key exists and
    lies within the bounds."""
    visible = cols < SEQ_K
    if IS_CAUSAL:
        visible = visible & (cols <= rows + UPPER_OFFSET)
    if HAS_LOWER:
        visible = visible & (cols >= rows + LOWER_OFFSET)
    return visible


@triton.jit
def _sequence(batch, cu_q_ptr, cu_k_ptr, SEQ_Q, SEQ_K, UPPER_OFFSET, LOWER_OFFSET, VARLEN: tl.constexpr):
    """(first query row, query rows, first key, keys, UPPER_OFFSET, LOWER_OFFSET) of sequence ``batch``:
    the problem's own in a dense batch; in a packed one (VARLEN) from cu_seqlens, the offsets then
    aligned bottom-right for this sequence's lengths (they hold only the window's sides)."""
    if VARLEN:
        q_start = tl.load(cu_q_ptr + batch)
        k_start = tl.load(cu_k_ptr + batch)
        seq_q = tl.load(cu_q_ptr + batch + 1) - q_start
        seq_k = tl.load(cu_k_ptr + batch + 1) - k_start
        return (
            q_start.to(tl.int64),
            seq_q,
            k_start.to(tl.int64),
            seq_k,
            UPPER_OFFSET + seq_k - seq_q,
            LOWER_OFFSET + seq_k - seq_q,
        )
    else:  # the else keeps Triton from compiling both returns (their types differ)
        return 0, SEQ_Q, 0, SEQ_K, UPPER_OFFSET, LOWER_OFFSET


@triton.jit
def _key_ranges(
    start_m,
    SEQ_Q,
    SEQ_K,
    UPPER_OFFSET,
    LOWER_OFFSET,
    IS_CAUSAL: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The keys of query rows [start_m, start_m + BLOCK_M), as (start, inner_start, inner_end, end):
    [inner_start, inner_end) every row sees whole, a multiple of BLOCK_N long; [start, inner_start)
    and [inner_end, end) need masks; keys outside [start, end) no row sees (all of them when the
    rows lie past SEQ_Q: a program past its packed sequence's end)."""
    if IS_CAUSAL:  # the last row's bound for the end, the first row's for the blocks all rows see
        end = tl.maximum(tl.minimum(SEQ_K, start_m + BLOCK_M + UPPER_OFFSET), 0)
        inner_end = tl.maximum(tl.minimum(SEQ_K, start_m + 1 + UPPER_OFFSET), 0) // BLOCK_N * BLOCK_N
    else:
        end = SEQ_K
        inner_end = SEQ_K // BLOCK_N * BLOCK_N
    if HAS_LOWER:  # the first row's bound for the start, the last row's for the blocks all rows see
        start = tl.maximum(start_m + LOWER_OFFSET, 0) // BLOCK_N * BLOCK_N
        inner_start = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + LOWER_OFFSET, 0), BLOCK_N) * BLOCK_N
    else:
        start = tl.full([], 0, tl.int32)
        inner_start = tl.full([], 0, tl.int32)
    end = tl.where(start_m < SEQ_Q, end, start)
    inner_start = tl.minimum(tl.maximum(inner_start, start), end)
    inner_end = tl.maximum(tl.minimum(inner_end, end), inner_start)
    return start, inner_start, inner_end, end


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2(n)`` for n >= 0 without its constexpr unwrapping, which costs
    microseconds a call: each call of attention builds its tuning key and BLOCK_D with it."""
    return 1 << (n - 1).bit_length() if n > 1 else n


def _block_d(head_dim: int) -> int:
    """The kernels' BLOCK_D: a power of two >= D, and at least 16, the smallest extent tl.dot
    takes (D is the contraction of q . k)."""
    return max(16, next_power_of_2(head_dim))


# ---------------------------------------------------------------- tuning key and calibration problem
# The backward's tuners key by the forward's key (plus how dq is summed) and gate on the same small
# problem, so that a shape's forward and backward entries name the same bucket.


def tuning_key(q: torch.Tensor, k: torch.Tensor, scores: Scores, packed: Packed | None = None) -> dict:
    """What the fastest tile depends on: the head dim, the masks, the soft cap, the dtype and the
    problem's size (sequence lengths and batch x heads, each to the next power of two). A packed
    batch (q and k its (1, H, T, D) views) counts its longest sequences and its sequences, as the
    dense batch it would pad to; the tile found for that is the one it runs."""
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    if packed is not None:
        batch, seq_q, seq_k = packed.sequences, packed.max_q, packed.max_k
    pow2 = next_power_of_2
    mask = ("bottom-right" if scores.bottom_right else "top-left") if scores.causal else "none"
    sides = [side for side, bound in zip(("left", "right"), scores.window, strict=True) if bound >= 0]
    window = "+".join(sides)
    return {
        "head_dim": head_dim,
        "mask": mask,
        "window": window or "none",
        "softcap": bool(scores.softcap),
        "dtype": NAME_OF[q.dtype],
        "seq_q": pow2(seq_q),
        "seq_k": pow2(seq_k),
        "batch_heads": pow2(batch * heads),
        "group": heads // k.shape[1],
    }


def calibration_inputs(key: dict, config: dict, device) -> tuple:
    """Seeded q, k, v of the key's kind, small: two query blocks and a ragged third, three key blocks
    and a ragged fourth (fewer where the key's sequences are shorter)."""
    from tritonkit.testing import generator, random_tensor

    seq_q = min(key["seq_q"], 2 * config["BLOCK_M"] + 5)
    seq_k = min(key["seq_k"], 3 * config["BLOCK_N"] + 7)
    dtype = DTYPE_OF[key["dtype"]]
    g = generator(12)
    q = random_tensor((1, 2 * key["group"], seq_q, key["head_dim"]), dtype, device, generator=g)
    kv = [random_tensor((1, 2, seq_k, key["head_dim"]), dtype, device, generator=g) for _ in range(2)]
    return q, *kv


def calibration_scores(scores: Scores, config: dict) -> Scores:
    """The call's scores for the calibration problem: a window's sides, where it has them, cut
    inside its few blocks (a window of the real problem's width would cover them whole)."""
    left, right = scores.window
    return scores._replace(window=(config["BLOCK_N"] + 7 if left >= 0 else -1, 5 if right >= 0 else -1))


# ---------------------------------------------------------------- reference


REFERENCE_SCORE_BYTES = 2**31  # the reference takes query rows in chunks whose scores fit in this


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    bottom_right: bool = True,
    return_lse: bool = False,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    deterministic: bool = True,
):
    """Plain PyTorch attention with the kernel's conventions (rows that see no key give 0 and lse
    -inf); pass float64 inputs for the oracle's reference. Query rows go in chunks whose scores
    take at most REFERENCE_SCORE_BYTES (at (2, 16, 16384, 128) whole float64 scores would be 69 GB);
    with several chunks, each is recomputed in the backward instead of kept (activation
    checkpointing), so the reference's gradients fit too. A packed batch (``cu_seqlens_*``) goes
    a sequence at a time; ``max_seqlen_*`` and ``deterministic`` are flash_attention's, accepted and
    not needed."""
    if cu_seqlens_q is not None:
        bounds = [
            (int(a), int(b), int(c), int(d))
            for a, b, c, d in zip(
                cu_seqlens_q[:-1], cu_seqlens_q[1:], cu_seqlens_k[:-1], cu_seqlens_k[1:], strict=True
            )
        ]
        parts = [
            attention_reference(
                *(
                    t[start:end].transpose(0, 1).unsqueeze(0)
                    for t, start, end in ((q, q0, q1), (k, k0, k1), (v, k0, k1))
                ),
                causal,
                scale,
                bottom_right,
                True,
                window,
                softcap,
            )
            for q0, q1, k0, k1 in bounds
        ]
        o = torch.cat([q[:0], *(part[0][0].transpose(0, 1) for part in parts)])
        lse = torch.cat(
            [
                q.new_empty((q.shape[1], 0), dtype=parts[0][1].dtype if parts else torch.float32),
                *(part[1][0] for part in parts),
            ],
            dim=1,
        )
        return (o, lse) if return_lse else o
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    batch, heads, seq_q, _ = q.shape
    rows = max(1, REFERENCE_SCORE_BYTES // max(1, batch * heads * k.shape[2] * q.element_size()))
    scores = Scores(softmax_scale(scale, q.shape[-1]), causal, bottom_right, tuple(window), softcap)
    chunk = functools.partial(_reference_rows, scores=scores, seq_q=seq_q)
    if seq_q <= rows:
        o, lse = chunk(q, k, v, 0)
    else:
        from torch.utils.checkpoint import checkpoint

        parts = [
            checkpoint(chunk, q[:, :, start : start + rows], k, v, start, use_reentrant=False)
            for start in range(0, seq_q, rows)
        ]
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
    return (
        (torch.softmax(logits, dim=-1) * sees) @ v,
        torch.logsumexp(logits, dim=-1).masked_fill(~sees[:, 0], -math.inf),
    )
