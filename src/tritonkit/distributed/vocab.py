"""A tensor-parallel LM head's loss: cross-entropy over a vocabulary split across the ranks of a group,
each rank holding a shard of the head's weight, the logits never gathered (nor held whole on a rank).

Maths. Rank r holds W_r, the rows of classes o_r .. o_r + V_r - 1 (shards in rank order, any sizes),
and every rank the same input x (N, H) and targets t (N,). With z_r = x W_r^T its logits, each
rank's row log-sum-exp lse_r and, where t falls in its shard, the target's logit z_t combine exactly:
    lse = log sum_r exp(lse_r),   loss_i = lse_i - z_t,i,
and the gradient of a row's loss in its shard's logits is softmax's over the whole vocabulary,
    dz_r = exp(z_r - lse) - onehot(t - o_r),
so each rank has dW_r = dz_r^T x whole, and dx = sum_r dz_r W_r is one all-reduce.

Structure. linear_cross_entropy's kernels on each rank's shard: its forward (chunks of tokens: the
matmul, then cross_entropy's row kernel; the targets outside the shard ignored) for lse_r and the
rows' losses, from which z_t = lse_r - loss; one all_gather of (lse_r, z_t) for every rank's; its
vocabulary-order backward (a block of the shard's logits again, dz in place from the whole lse and
the global targets) for dW_r and a partial dx, then one all_reduce of dx in fp32.

Work per rank: four matmuls of 2 N V_r H FLOPs (the backward recomputes the logits), the exchange of
2 N floats a rank forward and of dx (N H floats) backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tritonkit.distributed.groups import dtype_code, gather_facts, process_group, same_on_every_rank
from tritonkit.opdef import first_derivative_only
from tritonkit.ops import cross_entropy as ce
from tritonkit.ops import linear_cross_entropy as lce

WHAT = "vocab_parallel_linear_cross_entropy"
REDUCTIONS = ("none", "sum", "mean")
OUTSIDE = -1  # a row's target in this rank's numbering where it falls outside the shard (ignored)


class _VocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, target, first_class, classes, ignore_index, reduction, group):
        shard = (target >= first_class) & (target < first_class + weight.shape[0])
        local = torch.where(shard, target - first_class, OUTSIDE)
        out, rows, lse_r, row_weight, _ = lce._outputs(input, "sum", False)
        options = (OUTSIDE, "sum", 0.0, 0.0, 0.0)
        outputs = (out, rows, lse_r, row_weight, None, None, None, None)  # no gradients in the forward
        lce._forward(input, weight, None, local, None, *options, *outputs)
        target_logit = torch.where(shard, lse_r - rows, 0.0)  # rows: lse_r - z_t where t is in the shard
        mine = torch.stack([lse_r, target_logit])
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        every = torch.stack(every)  # (ranks, 2, N), in rank order on every rank: the same sums
        lse = torch.logsumexp(every[:, 0], 0)
        ignored = target == ignore_index
        valid = (target >= 0) & (target < classes)
        nan = torch.full((), float("nan"), device=input.device)
        losses = torch.where(ignored, 0.0, torch.where(valid, lse - every[:, 1].sum(0), nan))
        counted = (~ignored).sum().float()
        ctx.save_for_backward(input, weight, target, lse, counted)
        ctx.shard, ctx.reduction, ctx.group = (first_class, classes, ignore_index), reduction, group
        if reduction == "none":
            return losses.to(input.dtype)
        total = losses.sum()
        return (total / counted if reduction == "mean" else total).to(input.dtype)  # a mean of none: NaN

    @staticmethod
    @first_derivative_only(WHAT)
    def backward(ctx, grad):
        input, weight, target, lse, counted = ctx.saved_tensors
        first_class, classes, ignore_index = ctx.shard
        needs_dx, needs_dw = ctx.needs_input_grad[:2]
        grad = grad.float()
        if ctx.reduction == "mean":
            grad = grad / counted
        rows = grad.reshape(-1) if ctx.reduction == "none" else grad.reshape(1).expand(input.shape[0])
        dx = torch.empty(input.shape, dtype=torch.float32, device=input.device) if needs_dx else None
        # written as a contiguous (V_shard, H) matrix, whatever the shard's layout
        dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if needs_dw else None
        options = (ignore_index, "none", 0.0, 0.0, 0.0)
        lce._backward(
            rows, input, weight, None, target, None, lse, None, *options, dx, dw, None, first_class, classes
        )  # fmt: skip
        if dx is not None:
            dist.all_reduce(dx, group=ctx.group)  # every rank's share of dz W, summed in fp32
            dx = dx.to(input.dtype)
        return dx, dw, None, None, None, None, None, None


def _local_check(input, weight, target, ignore_index: int, reduction: str) -> None:
    lce._validate(input, weight, target, None, None)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")


def vocab_parallel_linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    group=None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(input, W), target, ignore_index=..., reduction=...)`` where W's rows
    (the classes) are split across the ranks of ``group`` (a process group, a one-dimensional
    DeviceMesh, or None for the default group): ``weight`` is this rank's shard, the classes after
    the lower ranks' (shards of any sizes, in rank order). ``input`` (..., H) fp16 or bf16 and
    ``target`` (class indices over the whole vocabulary, of input's leading shape) are the same on
    every rank, as a tensor-parallel LM head has them. Returns the whole loss on every rank, in
    input's dtype (with reduction "none", target's shape); gradients for input (the same on every
    rank) and this rank's weight shard. A target outside the vocabulary other than ignore_index
    gives its row NaN. Every rank must call it, and backward through it where any rank does (input's
    gradient is an all-reduce); bad input, or input requiring grad on some ranks only, raises the
    same ValueError on every rank. The targets' values are not compared across ranks (that would
    cost an exchange of N integers a call)."""
    group = process_group(group, WHAT)
    try:
        _local_check(input, weight, target, ce.class_index(ignore_index), reduction)
        local_error = ""
        input_grad = int(torch.is_grad_enabled() and input.requires_grad)  # dx: an all-reduce
        facts = [input.numel() // max(input.shape[-1], 1), input.shape[-1], dtype_code(input.dtype),
                 REDUCTIONS.index(reduction), ce.class_index(ignore_index), input_grad,
                 weight.shape[0]]  # fmt: skip
    except (TypeError, ValueError, NotImplementedError) as error:
        local_error = f"{type(error).__name__}: {error}"
        facts = [0] * 7
    rows = gather_facts(local_error, facts, WHAT, group)
    names = (
        "tokens",
        "hidden size",
        "dtype",
        "reduction",
        "ignore_index",
        "input's gradient (requires_grad)",
    )
    same_on_every_rank(rows, names, WHAT, "every rank must pass the same input and targets")
    shard_sizes = [row[6] for row in rows]
    rank = dist.get_rank(group)
    loss = _VocabParallel.apply(
        input.reshape(-1, input.shape[-1]), weight, target.reshape(-1), sum(shard_sizes[:rank]),
        sum(shard_sizes), ce.class_index(ignore_index), reduction, group,
    )  # fmt: skip
    return loss.view(target.shape) if reduction == "none" else loss
