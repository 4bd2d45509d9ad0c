"""The reduced test grids (``grids.in_turn``) still meet every pair of values."""

from __future__ import annotations

import pytest

import test_attention as ta
import test_softmax as ts
from grids import pairs_not_met

GRIDS = {
    "attention matches the reference": ta.REFERENCE_GRID,
    "softmax matches the reference": ts.MATCHES_REFERENCE,
    "softmax layouts": ts.LAYOUT_GRID,
    "softmax dtype argument": ts.DTYPE_ARGUMENTS,
    "softmax non-finite rows": ts.NONFINITE,
    "softmax masked rows": ts.MASKED_ROWS,
    "softmax split rows": ts.SPLIT_ROWS,
    "softmax online chunks": ts.ONLINE,
    "softmax poisoning": ts.POISONING,
}


@pytest.mark.parametrize("name", list(GRIDS))
def test_reduced_grids_meet_every_pair(name):
    assert pairs_not_met(GRIDS[name]) == []


def test_a_grid_that_misses_a_pair_is_caught():
    # the log switch alternating over two dtypes in product order: each dtype meets one value only
    assert pairs_not_met([(1, "a", False), (1, "b", True), (2, "a", False), (2, "b", True)]) != []
