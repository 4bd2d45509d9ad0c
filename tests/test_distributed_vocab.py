"""vocab_parallel_linear_cross_entropy on 3 CPU processes, and on a group of 2 of them (gloo, kernels
in the interpreter): the loss and its gradients (the input's, and the weight's shards gathered)
against single-process linear_cross_entropy over the whole weight and the float64 reference, every
reduction, shards of unequal sizes, an ignored target; bad input raising the same error on every
rank."""

from __future__ import annotations

import pytest
import torch

import gloo

pytestmark = pytest.mark.distributed

TIMEOUT_S = 240  # the whole run of one world; a hang fails the test rather than the suite
WORLD = 3
PAIR = [1, 2]  # a two-rank group whose ranks (0 and 1) are not the processes' own
SHARDS = [40, 24, 56]  # classes a rank holds (the pair's ranks hold the first two sizes)
TOKENS, HIDDEN = (2, 7), 32


def _whole(classes: int, seed: int):
    """input (2, 7, H), the whole weight (V, H), targets (2, 7) with one ignored, the same on every
    rank."""
    from tritonkit.testing import generator, random_tensor

    g = generator(seed)
    x = random_tensor((*TOKENS, HIDDEN), torch.bfloat16, "cpu", generator=g)
    w = random_tensor((classes, HIDDEN), torch.bfloat16, "cpu", generator=g)
    target = torch.randint(0, classes, TOKENS, generator=g)
    target[0, 3] = -100
    return x, w, target


def _compare_with_one_process(reduction: str, group=None) -> list[dict]:
    """The loss, dx and dW (each rank's shard gathered) over ``group`` (None: every process) against
    linear_cross_entropy on one process (the oracle's torch term) and the float64 reference."""
    import torch.distributed as dist

    import tritonkit
    from tritonkit.distributed import vocab_parallel_linear_cross_entropy
    from tritonkit.ops.linear_cross_entropy import linear_cross_entropy_reference
    from tritonkit.testing import compare, poisoned_outputs

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = SHARDS[:world]
    x, w, target = _whole(sum(sizes), seed=11 + world)
    first = sum(sizes[:rank])
    shard = w[first : first + sizes[rank]].clone().requires_grad_()
    mine = x.clone().requires_grad_()
    upstream = torch.randn(TOKENS if reduction == "none" else (), generator=torch.Generator().manual_seed(5))
    with poisoned_outputs():
        loss = vocab_parallel_linear_cross_entropy(mine, shard, target, group, reduction=reduction)
        dx, dw_shard = torch.autograd.grad(loss, [mine, shard], upstream.to(loss.dtype))
    shards = [None] * world  # of unequal sizes, which gloo's all_gather refuses
    dist.all_gather_object(shards, dw_shard, group=group)
    parallel = [loss, dx, torch.cat(shards)]
    single_inputs = [t.clone().requires_grad_() for t in (x, w)]
    single_loss = tritonkit.linear_cross_entropy(*single_inputs, target, reduction=reduction)
    single = [single_loss, *torch.autograd.grad(single_loss, single_inputs, upstream.to(single_loss.dtype))]
    exact_inputs = [t.double().requires_grad_() for t in (x, w)]
    exact_loss = linear_cross_entropy_reference(*exact_inputs, target, reduction=reduction)
    exact = [exact_loss, *torch.autograd.grad(exact_loss, exact_inputs, upstream.double())]
    names = [f"{reduction} loss", f"{reduction} dx", f"{reduction} dW"]
    comparisons = [
        compare(name, got, torch_term, ref, torch.bfloat16)
        for name, got, torch_term, ref in zip(names, parallel, single, exact, strict=True)
    ]
    return [{"name": c.name, "passed": c.passed, "text": str(c)} for c in comparisons]


def _errors_on_every_rank(group) -> list[str]:
    """Bad input on one rank (a reduction it alone gets wrong) and across the ranks (a hidden size
    only one has): each raises on every rank, none hangs."""
    import torch.distributed as dist

    from tritonkit.distributed import vocab_parallel_linear_cross_entropy

    rank = dist.get_rank(group)
    x, w, target = _whole(64, seed=3)
    messages = []
    with pytest.raises(ValueError, match="rank 0: ValueError: reduction must be one of") as error:
        vocab_parallel_linear_cross_entropy(x, w, target, group, reduction="avg" if rank == 0 else "mean")
    messages.append(str(error.value))
    narrow = (x[..., :16], w[:, :16]) if rank == 1 else (x, w)
    with pytest.raises(ValueError, match=r"ranks disagree on the hidden size: \[32, 16\]") as error:
        vocab_parallel_linear_cross_entropy(*narrow, target, group)
    messages.append(str(error.value))
    return messages


def _results(rank: int) -> dict:
    import torch.distributed as dist

    pair = dist.new_group(PAIR)  # every process takes part in making it
    # Three ranks: every reduction, the third shard's classes last; two of them, whose ranks in
    # their group are not their own: the mean and bad input.
    reductions = ("mean", "sum", "none")
    results = {"three": [r for reduction in reductions for r in _compare_with_one_process(reduction)]}
    results["two"] = []
    if rank in PAIR:
        results["two"] = [*_compare_with_one_process("mean", pair), {"errors": _errors_on_every_rank(pair)}]
    return results


@pytest.mark.slow
def test_the_vocabulary_split_across_ranks_equals_one_process(tmp_path):
    """Every rank's loss, dx and gathered dW pass the oracle against linear_cross_entropy over the
    whole weight: on three ranks with each reduction, on two of them with the mean, bad input
    raising the same error on both."""
    run = gloo.run_ranks(_results, WORLD, TIMEOUT_S, tmp_path, "vocab parallel loss")
    gloo.assert_comparisons_passed(run, lambda rank: {"three": 9, "two": 3 if rank in PAIR else 0})
    errors = [run[rank]["two"][-1]["errors"] for rank in PAIR]
    assert errors[0] == errors[1]  # the same messages on both ranks
