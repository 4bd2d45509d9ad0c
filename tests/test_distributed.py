"""The distributed ops on 3 CPU processes, and on a group of 2 of them (gloo, kernels in the
interpreter), all in one start of the processes. ring_attention: output, lse and gradients against
single-process flash_attention on the whole sequence and the float64 reference, causal
(load-balanced shards) and full, GQA; sharding round trips and their gradients; sequence lengths
that do not divide into the shards refused with the length to pad to (shard_sequence).
vocab_parallel_linear_cross_entropy: the loss and its gradients (the input's, and the weight's
shards gathered) against single-process linear_cross_entropy over the whole weight and the float64
reference, every reduction, shards of unequal sizes, an ignored target. Bad input raising the same
error on every rank, for both."""

from __future__ import annotations

import pytest
import torch

import gloo

pytestmark = pytest.mark.distributed

TIMEOUT_S = 240  # the whole run of one world; a hang fails the test rather than the suite
WORLD = 3
PAIR = [1, 2]  # the two-rank group: its ranks (0 and 1) are not the processes' own


def _whole(seq, seed, heads_kv=2):
    """q (twice ``heads_kv`` heads), k and v (``heads_kv``: GQA) and dO over the whole sequence, the
    same on every rank."""
    from tritonkit.testing import generator, random_tensor

    g = generator(seed)
    heads = [2 * heads_kv, heads_kv, heads_kv, 2 * heads_kv]
    shapes = [(1, h, seq, 16) for h in heads]
    return [random_tensor(shape, torch.bfloat16, "cpu", generator=g) for shape in shapes]


def _compare_with_one_process(causal: bool, heads_kv: int, group=None) -> list[dict]:
    """Ring output, lse and gradients over ``group``'s ranks (None: every process), gathered, against
    flash_attention on one process (the oracle's torch term) and the float64 reference."""
    import torch.distributed as dist

    import tritonkit
    from tritonkit.distributed import ring_attention, shard_sequence, unshard_sequence
    from tritonkit.ops.attention.common import attention_reference
    from tritonkit.testing import compare, poisoned_outputs

    seq = 4 * dist.get_world_size(group) * 2  # 2W chunks of 4 rows: causal shards hold two, each ragged
    q, k, v, do = _whole(seq, seed=7 + causal, heads_kv=heads_kv)
    shards = [shard_sequence(t, 2, group, causal).requires_grad_() for t in (q, k, v)]
    with poisoned_outputs():
        o, lse = ring_attention(*shards, causal=causal, group=group, return_lse=True)
        grads = torch.autograd.grad(o, shards, shard_sequence(do, 2, group, causal))
    ring = [unshard_sequence(t, 2, group, causal) for t in (o, lse, *grads)]
    single_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    single_o, single_lse = tritonkit.flash_attention(*single_inputs, causal=causal, return_lse=True)
    single = [single_o, single_lse, *torch.autograd.grad(single_o, single_inputs, do)]
    exact_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    exact_o, exact_lse = attention_reference(*exact_inputs, causal=causal, return_lse=True)
    exact = [exact_o, exact_lse, *torch.autograd.grad(exact_o, exact_inputs, do.double())]
    names = ["output", "lse", "dq", "dk", "dv"]
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16]
    comparisons = [compare(*args) for args in zip(names, ring, single, exact, dtypes, strict=True)]
    return [{"causal": causal, "name": c.name, "passed": c.passed, "text": str(c)} for c in comparisons]


def _errors_on_every_rank(group) -> list[str]:
    """Bad input on one rank or across the two ranks of ``group``: each raises on every rank, none
    hangs."""
    import torch.distributed as dist

    from tritonkit.distributed import ring_attention, shard_sequence, unshard_sequence

    rank = dist.get_rank(group)
    q, k, v, _ = _whole(24, seed=3)
    messages = []
    with pytest.raises(ValueError, match="must be a multiple of 4") as error:  # 23 over 2 ranks, causal
        shard_sequence(q[:, :, :23], 2, group, causal=True)
    messages.append(str(error.value))
    with pytest.raises(ValueError, match=r"dim must be an int in \[-4, 4\)") as error:
        shard_sequence(q, 5, group)
    messages.append(str(error.value))
    shards = [shard_sequence(t, 2, group) for t in (q, k, v)]
    longer = [torch.cat([t, t[:, :, :1]], 2) if rank == 1 else t for t in shards]
    with pytest.raises(ValueError, match="ranks disagree on the sequence shard") as error:
        ring_attention(*longer, group=group)
    messages.append(str(error.value))
    heads = [shards[0][:, :3] if rank == 0 else shards[0], *shards[1:]]  # 3 query heads over 2
    with pytest.raises(ValueError, match="rank 0: ValueError: query heads") as error:
        ring_attention(*heads, group=group)
    messages.append(str(error.value))
    # what once passed the check: bf16 against fp16 (one size), and keys longer on one rank alone
    # (gloo aborted a process); causal keys longer than the queries (a wrong mask)
    mixed = [t.half() if rank == 1 else t for t in shards]
    with pytest.raises(
        ValueError, match=r"disagree on the dtype: \['torch.bfloat16', 'torch.float16'\]"
    ) as error:
        ring_attention(*mixed, group=group)
    messages.append(str(error.value))
    keys = [shards[0], *(torch.cat([t, t[:, :, :4]], 2) if rank == 1 else t for t in shards[1:])]
    with pytest.raises(ValueError, match="ranks disagree on the key/value shard") as error:
        ring_attention(*keys, group=group)
    messages.append(str(error.value))
    longer_keys = [shards[0], *(torch.cat([t, t], 2) for t in shards[1:])]
    with pytest.raises(ValueError, match="causal shards of q and k must be as long") as error:
        ring_attention(*longer_keys, group=group, causal=True)
    messages.append(str(error.value))
    # keys laid out (B, S, H, D) on one rank alone: sent as their values (they were sent as they lie,
    # which gloo refused on that rank while the other waited)
    strided = [
        t.transpose(1, 2).contiguous().transpose(1, 2) if rank == 1 and i else t for i, t in enumerate(shards)
    ]
    assert torch.equal(ring_attention(*strided, group=group), ring_attention(*shards, group=group))
    with pytest.raises(ValueError, match="unshard_sequence: ranks disagree on the size of dim 2") as error:
        unshard_sequence(longer[0], 2, group)  # gloo aborted a process on it
    messages.append(str(error.value))
    # each of these raised on one rank alone (the other waited, or gathered garbage), or not at all
    with pytest.raises(ValueError, match="rank 0: ValueError: scale must be a finite number") as error:
        ring_attention(*shards, group=group, scale=float("nan") if rank == 0 else None)
    messages.append(str(error.value))
    with pytest.raises(ValueError, match="ranks disagree on the softmax scale") as error:
        ring_attention(*shards, group=group, scale=0.1 if rank == 0 else None)  # (each used its own)
    messages.append(str(error.value))
    counts = torch.arange(4).reshape(1, 4)
    nine_dims = counts.reshape([1] * 7 + [2, 2]) if rank == 0 else counts.reshape([1] * 8 + [4])
    for local, dim, pattern in [
        (counts.to(torch.int32 if rank == 0 else torch.int64), 1, r"dtype: \['torch.int32', 'torch.int64'\]"),
        (counts.tolist() if rank == 0 else counts, 1, "rank 0: TypeError: x must be a torch.Tensor"),
        (nine_dims, 8, "x must have at most 8 dims"),
        (counts, 5 if rank == 0 else 1, r"rank 0: ValueError: dim must be an int in \[-2, 2\)"),
    ]:
        with pytest.raises(ValueError, match=pattern) as error:
            unshard_sequence(local, dim, group)
        messages.append(str(error.value))
    # requiring grad on one rank only: that rank's backward would wait on the other's exchanges
    one_sided = [shards[0].detach().requires_grad_(rank == 1), *shards[1:]]
    with pytest.raises(ValueError, match=r"ranks disagree on the gradient \(any of q, k, v requiring grad\)"):
        ring_attention(*one_sided, group=group)
    with pytest.raises(ValueError, match=r"unshard_sequence: ranks disagree on the gradient"):
        unshard_sequence(one_sided[0], 2, group)
    leaves = [t.clone().requires_grad_() for t in shards]
    _, lse = ring_attention(*leaves, group=group, return_lse=True)
    with pytest.raises(NotImplementedError, match="no gradient through its lse"):  # was dropped silently
        lse.sum().backward()
    return messages


def _round_trip(group=None) -> bool:
    """unshard(shard(x)) is x, causal (load-balanced) and not; its gradient reaches each shard,
    summed over the ranks that used the gathered whole (each rank of ``group`` here)."""
    import torch.distributed as dist

    from tritonkit.distributed import shard_sequence, unshard_sequence

    world = dist.get_world_size(group)
    x = torch.arange(4.0 * world * 3).reshape(1, 2, -1, 3)
    weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    ok = True
    for causal in (True, False):
        shard = shard_sequence(x, 2, group, causal).requires_grad_()
        whole = unshard_sequence(shard, 2, group, causal)
        (grad,) = torch.autograd.grad((whole * weights).sum(), shard)
        expected = world * shard_sequence(weights, 2, group, causal)
        ok &= torch.equal(whole, x) and torch.allclose(grad, expected)
    return bool(ok)


# ---------------------------------------------------------------- the vocabulary split

SHARDS = [40, 24, 56]  # classes a rank holds (the pair's ranks hold the first two sizes)
TOKENS, HIDDEN = (2, 7), 32


def _head(classes: int, seed: int):
    """input (2, 7, H), the whole weight (V, H), targets (2, 7) with one ignored, the same on every
    rank."""
    from tritonkit.testing import generator, random_tensor

    g = generator(seed)
    x = random_tensor((*TOKENS, HIDDEN), torch.bfloat16, "cpu", generator=g)
    w = random_tensor((classes, HIDDEN), torch.bfloat16, "cpu", generator=g)
    target = torch.randint(0, classes, TOKENS, generator=g)
    target[0, 3] = -100
    return x, w, target


def _compare_vocab_split(reduction: str, group=None) -> list[dict]:
    """The loss, dx and dW (each rank's shard gathered) over ``group`` (None: every process) against
    linear_cross_entropy on one process (the oracle's torch term) and the float64 reference."""
    import torch.distributed as dist

    import tritonkit
    from tritonkit.distributed import vocab_parallel_linear_cross_entropy
    from tritonkit.ops.linear_cross_entropy import linear_cross_entropy_reference
    from tritonkit.testing import compare, poisoned_outputs

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = SHARDS[:world]
    x, w, target = _head(sum(sizes), seed=11 + world)
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


def _vocab_errors_on_every_rank(group) -> list[str]:
    """Bad input on one rank (a reduction it alone gets wrong) and across the ranks (a hidden size
    only one has): each raises on every rank, none hangs."""
    import torch.distributed as dist

    from tritonkit.distributed import vocab_parallel_linear_cross_entropy

    rank = dist.get_rank(group)
    x, w, target = _head(64, seed=3)
    messages = []
    with pytest.raises(ValueError, match="rank 0: ValueError: reduction must be one of") as error:
        vocab_parallel_linear_cross_entropy(x, w, target, group, reduction="avg" if rank == 0 else "mean")
    messages.append(str(error.value))
    narrow = (x[..., :16], w[:, :16]) if rank == 1 else (x, w)
    with pytest.raises(ValueError, match=r"ranks disagree on the hidden size: \[32, 16\]") as error:
        vocab_parallel_linear_cross_entropy(*narrow, target, group)
    messages.append(str(error.value))
    mixed = (x.half(), w.half()) if rank == 1 else (x, w)  # one size, two dtypes: once accepted
    with pytest.raises(
        ValueError, match=r"disagree on the dtype: \['torch.bfloat16', 'torch.float16'\]"
    ) as error:
        vocab_parallel_linear_cross_entropy(*mixed, target, group)
    messages.append(str(error.value))
    # input requiring grad on one rank only: its backward's all-reduce of dx would wait forever
    one_sided = x.detach().requires_grad_(rank == 0)
    with pytest.raises(
        ValueError, match=r"ranks disagree on the input's gradient \(requires_grad\): \[1, 0\]"
    ):
        vocab_parallel_linear_cross_entropy(one_sided, w, target, group)
    # a column-major shard (its values the same): its dW was written as if row-major, scrambled
    grads = []
    for shard in (w, w.t().contiguous().t()):
        leaf = shard.detach().requires_grad_()
        vocab_parallel_linear_cross_entropy(x, leaf, target, group).backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1])
    return messages


def _results(rank: int) -> dict:
    import torch.distributed as dist

    pair = dist.new_group(PAIR)  # every process takes part in making it
    # Three ranks reach what two cannot: a ring whose next and previous ranks differ (blocks sent
    # the wrong way round, or their owners counted so, pass on two), gradient sums received and
    # sent on unfinished, and a rank that meets both lower and higher ranks' blocks. There the
    # causal mask, whose load-balanced shards the full mask does not use, with one key head (on
    # the CI machine's two cores, three processes). Two ranks, within the same processes (one
    # start of Python and torch, not two): both masks, two key heads (GQA's mapping of query
    # heads to key heads), and bad input.
    results = {"three": _compare_with_one_process(True, heads_kv=1), "two": []}
    results["three"].append({"round trip": _round_trip()})
    if rank in PAIR:
        results["two"] = [
            *_compare_with_one_process(True, heads_kv=2, group=pair),
            *_compare_with_one_process(False, heads_kv=2, group=pair),
            {"round trip": _round_trip(pair)},
            {"errors": _errors_on_every_rank(pair)},
        ]
    # The vocabulary split: on three ranks every reduction, the third shard's classes last; on the
    # two, the mean and bad input.
    reductions = ("mean", "sum", "none")
    results["vocab three"] = [r for reduction in reductions for r in _compare_vocab_split(reduction)]
    results["vocab two"] = []
    if rank in PAIR:
        results["vocab two"] = [
            *_compare_vocab_split("mean", pair),
            {"errors": _vocab_errors_on_every_rank(pair)},
        ]
    return results


@pytest.mark.slow
def test_ring_attention_and_the_vocabulary_split_equal_one_process(tmp_path):
    """One start of the processes for both ops (a test each would start them twice, on two xdist
    workers). Ring attention: every rank's gathered output, lse and gradients pass the oracle
    against flash_attention on the whole sequence, on three ranks causal (GQA: 2 query heads over
    1), on two of them, whose ranks in their group are not their own, causal and full (4 query heads
    over 2). The vocabulary split: every rank's loss, dx and gathered dW pass the oracle against
    linear_cross_entropy over the whole weight, on three ranks with each reduction, on two with the
    mean. Bad input raises the same error on both ranks of the pair, for each op."""
    run = gloo.run_ranks(_results, WORLD, TIMEOUT_S, tmp_path, "distributed ops")
    counts = {"three": 5, "vocab three": 9}
    gloo.assert_comparisons_passed(
        run, lambda rank: counts | {"two": 10 if rank in PAIR else 0, "vocab two": 3 if rank in PAIR else 0}
    )
    for rank, results in enumerate(run):
        assert {"round trip": True} in results["three"]
        assert ({"round trip": True} in results["two"]) == (rank in PAIR)
    ring_errors, vocab_errors = (
        [run[rank][key][-1]["errors"] for rank in PAIR] for key in ("two", "vocab two")
    )
    assert ring_errors[0][1:] == ring_errors[1][1:]  # the same message on both ranks
    assert vocab_errors[0] == vocab_errors[1]


def _dry_run(script: str, out) -> None:
    """``benchmarks/SCRIPT OUT --dry-run`` (two CPU processes on gloo), failing with its stderr."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = os.environ | {"PYTHONPATH": str(root / "src")}
    run = subprocess.run(
        [sys.executable, str(root / "benchmarks" / script), str(out), "--dry-run"],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.slow
def test_the_fsdp_step_benchmark_runs_and_its_sharded_loss_is_the_whole_batchs(tmp_path):
    """``benchmarks/fsdp_step.py --dry-run`` (a tiny patched Llama under fully_shard): its rows, and
    the sharded first loss (the mean over the ranks) against the unsharded model's on every rank's
    batch at once, to within bf16's rounding of a loss."""
    import json

    _dry_run("fsdp_step.py", tmp_path / "fsdp.json")
    one, sharded = json.loads((tmp_path / "fsdp.json").read_text())["rows"]
    assert (one["world"], sharded["world"]) == (1, 2)
    assert sharded["tokens_per_s_per_gpu"] > 0 and sharded["share_of_one_gpu"] > 0
    whole = one["loss_on_every_batch"]
    assert abs(sharded["first_loss"] - whole) <= 2.0**-7 * abs(whole)


@pytest.mark.slow
def test_the_ring_attention_benchmark_runs(tmp_path):
    """``benchmarks/ring_attention.py --dry-run`` (its tiny cases): every provider's row of each mode,
    and the ring's output within bf16's rounding of one-process attention (what runs on the GPUs of
    a host, whose kind is not always lent: a rename in the package broke this script unseen once)."""
    import json

    _dry_run("ring_attention.py", tmp_path / "ring.json")
    rows = json.loads((tmp_path / "ring.json").read_text())
    providers = {row["provider"] for row in rows}
    assert {"tritonkit ring", "tritonkit one GPU", "ring exchanges only", "ring input check"} <= providers
    assert all(row["max_err_vs_one_gpu"] <= 2.0**-5 for row in rows if row["provider"] == "tritonkit ring")


def _aborts_at_exit(rank: int, when: str) -> dict:
    """A rank's results, and an abort of rank 0 as its process exits ("exit": after every rank's
    results are written, as gloo's teardown once aborted one) or before its results ("early")."""
    import atexit
    import os

    if rank == 0 and when == "early":
        os.abort()
    if rank == 0:
        atexit.register(os.abort)
    return {"rank": rank}


def test_an_abort_as_a_rank_exits_keeps_the_results_one_before_them_fails(tmp_path):
    """``gloo.run_ranks``: a SIGABRT after every rank wrote its results (the teardown's) leaves them
    standing; one before a rank's results fails the test."""
    import functools

    ranks = gloo.run_ranks(functools.partial(_aborts_at_exit, when="exit"), 2, TIMEOUT_S, tmp_path, "exit")
    assert ranks == [{"rank": 0}, {"rank": 1}]
    early = tmp_path / "early"
    early.mkdir()
    with pytest.raises(torch.multiprocessing.ProcessExitedException, match="SIGABRT"):
        gloo.run_ranks(functools.partial(_aborts_at_exit, when="early"), 2, TIMEOUT_S, early, "early")
