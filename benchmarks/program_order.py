"""The order of an attention launch's programs, simulated: no GPU needed.

    python benchmarks/program_order.py

One program an SM (the sm_90 kernels fill one each), 132 SMs, programs started in launch order as
SMs free up (a greedy list schedule), each taking the steps of its walk plus a fixed start. For the
backward a step is one 64-row query block of one query head against a program's 128 keys; for the
forward one 128-key block against a program's 128 rows. Causal masks give programs of unequal walks, so the
order decides how evenly the SMs finish: what ``bwd_sm90.FREE_CAUSAL_PAIRS_PER_GROUP`` and
``fwd_sm90.CAUSAL_HEADS_PER_GROUP`` were chosen from (docs/perf-notes/attention-backward-sm90.md, "The order
of the sm_90 programs"). Prints, per shape, the makespan in steps of each group size beside the even spread
(the total work over the SMs); for the forward also a persistent grid's (one program an SM, its tiles fixed
in advance): the stride walk (program p takes tiles p, p + 132, ...) by group size, and the stride over
pairs of a long and a short block (``fwd_sm90_kernels._walk``).
"""

from __future__ import annotations

import heapq

SMS = 132
GROUPS = (1, 2, 4, 8, 1 << 20)  # units (pairs or heads) a group; the last: all at once
PAIR_GROUPS = (2, 4)  # the persistent causal forward's heads a group of pairs


def makespan(walks: list[int], start: int) -> int:
    """Steps until the last SM finishes, programs started in order on the first free SM."""
    free = [0] * SMS
    for walk in walks:
        heapq.heapreplace(free, free[0] + walk + start)
    return max(free)


def grouped(units: int, blocks: int, walk, group: int) -> list[int]:
    """Walks in launch order: groups of ``group`` units, in a group the blocks slow, units fast."""
    order = []
    for first in range(0, units, group):
        order += [walk(block) for block in range(blocks) for _ in range(min(group, units - first))]
    return order


def backward(batch: int, heads_kv: int, group_size: int, seq: int) -> dict:
    """Causal, Sq = Sk: key block n of 128 keys walks the 64-row query blocks from its diagonal,
    for each of the group's query heads; the longest first in a group."""
    blocks = seq // 128
    return _row(batch * heads_kv, blocks, lambda n: group_size * (seq - 128 * n) // 64, start=3)


def forward(batch: int, heads: int, seq: int) -> dict:
    """Causal, Sq = Sk: query block m of 128 rows walks m + 1 key blocks; the longest first."""
    blocks = seq // 128
    return _row(batch * heads, blocks, lambda i: blocks - i, start=2)


def persistent(walks: list[int], start: int) -> int:
    """Steps until the busiest of SMS programs finishes its tiles: tile t to program t % SMS."""
    busy = [0] * SMS
    for tile, walk in enumerate(walks):
        busy[tile % SMS] += walk + start
    return max(busy)


def paired(units: int, blocks: int, walk, group: int) -> list[int]:
    """Pairs in ``fwd_sm90_kernels._walk``'s order, each the walk of its long and short block:
    groups of ``group`` units, in a group the pairs slow, units fast; an odd middle block alone."""
    order = []
    for first in range(0, units, group):
        heads = min(group, units - first)
        pairs = [
            walk(j) + walk(blocks - 1 - j) if 2 * j != blocks - 1 else walk(j)
            for j in range((blocks + 1) // 2)
        ]
        order += [pair for pair in pairs for _ in range(heads)]
    return order


def forward_persistent(batch: int, heads: int, seq: int) -> dict:
    """``forward``'s tiles on a persistent grid: single tiles in a stride by group size; the last
    columns, pairs of a long and a short block (the kernel's causal walk) in groups of 2 (the
    default, ``fwd_sm90.CAUSAL_HEADS_PER_GROUP``) and of 4."""
    blocks = seq // 128
    units, walk = batch * heads, lambda i: blocks - i
    row = {"even": sum(walk(b) + 2 for b in range(blocks)) * units / SMS}
    for group in GROUPS:
        row[group] = persistent(grouped(units, blocks, walk, group), 2)
    for group in PAIR_GROUPS:
        row[f"pairs, {group}"] = persistent(paired(units, blocks, walk, group), 4)
    return row


def _row(units: int, blocks: int, walk, start: int) -> dict:
    work = sum(walk(b) + start for b in range(blocks)) * units
    row = {"even": work / SMS}
    for group in GROUPS:
        row[group] = makespan(grouped(units, blocks, walk, group), start)
    return row


def main() -> None:
    label = {g: ("all" if g == GROUPS[-1] else str(g)) for g in GROUPS} | {
        f"pairs, {g}": f"pairs, {g}" for g in PAIR_GROUPS
    }
    forward_shapes = [(2, 32, 4096), (4, 32, 4096), (2, 16, 16384), (16, 16, 1024), (2, 32, 8192)]
    cases = [
        ("backward (B, Hkv, GQA group, S)", backward, [(2, 8, 4, 4096), (4, 32, 1, 4096), (2, 16, 1, 16384),
                                                       (16, 16, 1, 1024), (2, 8, 4, 8192)]),
        ("forward (B, H, S)", forward, forward_shapes),
        ("forward on a persistent grid (B, H, S)", forward_persistent, forward_shapes),
    ]  # fmt: skip
    for title, simulate, shapes in cases:
        print(f"{title}: makespan in steps, by group size (even: the work spread evenly)")
        for shape in shapes:
            row = simulate(*shape)
            cells = "  ".join(f"{label[g]}: {row[g]}" for g in row if g != "even")
            print(f"  {shape}  even: {row['even']:.0f}  {cells}")


if __name__ == "__main__":
    main()
