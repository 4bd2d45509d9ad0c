"""softmax's split kernels with PREFETCH (the untuned default's pass 1 holding two chunks in flight):
rows of one to four segments of two chunks, ragged ends, against the float64 reference. Their sm_90
compile is checked in test_softmax_hw.py."""

from __future__ import annotations

import pytest

import test_softmax
import test_softmax_persistent
import tritonkit.ops.softmax.softmax as sm
from grids import case_id, in_turn
from test_softmax import BF16, F32, _check, _inputs, _variants, small_segments_config

pytestmark = pytest.mark.softmax
launches = test_softmax.launches  # the fixture recording each launch, shared


fresh_memos = test_softmax_persistent.fresh_memos  # (autouse) no earlier test's config or plan
small_segments = test_softmax.small_segments  # (autouse) the split default in small segments


@pytest.fixture(autouse=True)
def prefetching(monkeypatch):
    """test_softmax's small segments, with PREFETCH, and no tuning entry for any key: on a GPU the
    shipped configs answer for rows as long as 4100 (without PREFETCH) before the default is asked."""
    monkeypatch.setattr(
        test_softmax, "small_segments_config", lambda key: small_segments_config(key) | {"PREFETCH": True}
    )
    for tuned in sm._TUNED.values():
        monkeypatch.setattr(tuned, "entry", lambda key, problem: None)


SHAPES = [(3, 64), (5, 200), (1, 129), (7, 130), (2, 4100)]
CASES = in_turn(SHAPES, [F32, BF16], last=[False, True, True, False])


@pytest.mark.parametrize("shape, dtype, log", CASES, ids=map(case_id, CASES))
def test_prefetching_split_rows(shape, dtype, log, launches, monkeypatch, device):
    monkeypatch.setattr(sm, "sm_count", lambda device: 20)  # a program walks rows, as in test_softmax
    x, dy = _inputs(shape, dtype, device, seed=61 + shape[1])
    _check(x, dy, log=log, variant="split")
    assert _variants(launches) == {"fwd": {"split"}, "bwd": {"split"}}
    assert all(config.get("PREFETCH") for _, config in launches)
