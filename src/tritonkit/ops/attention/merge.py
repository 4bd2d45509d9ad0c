"""Merging attention over disjoint key sets: the partial results of the same query rows against
different keys fold into the result against all of them, exactly, from each part's output and
log-sum-exp. Ring attention merges the blocks that come around the ring this way; split-K decoding
(flash-decoding) merges its key splits the same way.

Maths. With parts a and b of one query row (outputs o_a, o_b, log-sum-exps lse_a, lse_b):
    lse = log(exp(lse_a) + exp(lse_b)),   o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b,
computed from m = max(lse_a, lse_b) so that no exponential overflows. A part whose row saw no key
has lse -inf and weight 0; a row that neither part saw keeps o = 0 and lse = -inf.

Work. Memory-bound: per row, the running output read and written in fp32, the part's output read
in its dtype, and three fp32 log-sum-exps.
"""

from __future__ import annotations

import torch

from tritonkit._launch import Launcher, cdiv
from tritonkit._triton import tl, triton

MERGE_ROWS = 16  # query rows a merge program takes


@triton.jit
def _merge_kernel(
    o_ptr,  # fp32 running output, (rows, D), contiguous: updated in place
    lse_ptr,  # fp32 running log-sum-exp, (rows,): updated in place
    part_ptr,  # a block's output, (rows, D), contiguous, in the inputs' dtype
    part_lse_ptr,  # its fp32 log-sum-exp, (rows,); -inf where the row saw no key of the block
    ROWS,  # rows of all heads and batches
    D,  # head dim
    BLOCK_R: tl.constexpr,  # rows a program merges
    BLOCK_D: tl.constexpr,  # power of two >= D
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < ROWS
    mask = row_mask[:, None] & (cols[None, :] < D)
    lse_a = tl.load(lse_ptr + rows, mask=row_mask, other=-float("inf"))
    lse_b = tl.load(part_lse_ptr + rows, mask=row_mask, other=-float("inf"))
    top = tl.maximum(lse_a, lse_b)
    top = tl.where(top == -float("inf"), 0.0, top)  # neither saw a key: the weights are exp(-inf) = 0
    weight_a, weight_b = tl.exp(lse_a - top), tl.exp(lse_b - top)
    total = weight_a + weight_b
    seen = total > 0.0
    o_a = tl.load(o_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0)
    o_b = tl.load(part_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    o = (weight_a[:, None] * o_a + weight_b[:, None] * o_b) / tl.where(seen, total, 1.0)[:, None]
    tl.store(o_ptr + rows[:, None] * D + cols[None, :], o, mask=mask)
    tl.store(
        lse_ptr + rows, tl.where(seen, top + tl.log(tl.where(seen, total, 1.0)), -float("inf")), mask=row_mask
    )


_merge_launcher = Launcher(_merge_kernel)


def merge_attention(o: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold a part's (output, lse) into the running fp32 (``o``, ``lse``), in place. ``o`` is
    (..., D) and ``lse`` its leading dims (...,), both contiguous fp32, as ``flash_attention``'s
    (B, H, S, D) output and (B, H, S) lse are laid out; start them at zeros and -inf to merge the
    first part in too. ``part`` (in the inputs' dtype; a strided one is copied) and ``part_lse``
    (fp32) have their shapes: the same query rows, against other keys."""
    if not (o.dtype == lse.dtype == part_lse.dtype == torch.float32):
        raise TypeError(
            f"o, lse and part_lse must be float32, got {o.dtype}, {lse.dtype} and {part_lse.dtype}"
        )
    if not (o.is_contiguous() and lse.is_contiguous()):
        raise ValueError("o and lse must be contiguous: the kernel updates them in place, row by row")
    if lse.shape != o.shape[:-1] or part.shape != o.shape or part_lse.shape != lse.shape:
        raise ValueError(
            f"lse must have o's leading dims, part o's shape and part_lse lse's; got o "
            f"{tuple(o.shape)}, lse {tuple(lse.shape)}, part {tuple(part.shape)}, part_lse "
            f"{tuple(part_lse.shape)}"
        )
    rows, head_dim = lse.numel(), o.shape[-1]
    if rows:
        _merge_launcher(
            (cdiv(rows, MERGE_ROWS),),
            o,
            lse,
            part.contiguous(),
            part_lse.contiguous(),
            rows,
            head_dim,
            BLOCK_R=MERGE_ROWS,
            BLOCK_D=triton.next_power_of_2(head_dim),
            num_warps=4,
        )
