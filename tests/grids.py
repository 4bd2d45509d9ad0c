"""Smaller test grids that still meet every pair of values: the product of some axes, with the values
of one more axis taken in turn instead of each with every case."""

from __future__ import annotations

import itertools


def in_turn(*axes, last: list) -> list:
    """The cases of the product of ``axes``, each with the next value of ``last`` in turn, instead of
    with every one: where the axes' sizes make it so (check with :func:`pairs_not_met`), every value
    of an axis still meets every value of every other axis, ``last``'s included, in some case. For
    a switch that the other axes meet independently (softmax's log epilogue, say): the grid runs
    once, not once a value."""
    return [(*case, last[i % len(last)]) for i, case in enumerate(itertools.product(*axes))]


def pairs_not_met(grid: list[tuple]) -> list[tuple]:
    """(axis, axis, value, value) for each pair of values of two axes that no case of ``grid`` holds."""
    columns = list(zip(*[[repr(v) for v in case] for case in grid], strict=True))
    missing = []
    for a, b in itertools.combinations(range(len(columns)), 2):
        met = set(zip(columns[a], columns[b], strict=True))
        missing += [
            (a, b, *pair) for pair in itertools.product(set(columns[a]), set(columns[b])) if pair not in met
        ]
    return missing


def case_id(case: tuple) -> str:
    """A case's test id: its values joined, a bool as softmax's log switch."""
    return "-".join(("log_softmax" if v else "softmax") if isinstance(v, bool) else str(v) for v in case)
