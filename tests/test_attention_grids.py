"""Attention calls of more batch x heads than a launch grid's second dimension holds (65535: 2048
sequences of 32 heads), launched in runs of batches, here with the limit made small: the Triton
forward and backward kernels and the delta kernel, dense (MHA and GQA) and packed, against the
float64 reference; the runs themselves."""

from __future__ import annotations

import pytest
import torch

from test_attention import check, check_packed, packed, qkv
from tritonkit.ops.attention import bwd as ab
from tritonkit.ops.attention import common as ac

pytestmark = pytest.mark.attention

BF16 = torch.bfloat16


@pytest.fixture
def small_grids(monkeypatch):
    """A grid's second dimension of 4 programs: 3 batches of 2 heads are two runs."""
    monkeypatch.setattr(ac, "GRID_Y_MAX", 4)


def test_batch_runs_cover_the_batches_within_the_limit():
    assert ac.batch_runs(2048, 32) == [(0, 2047), (2047, 2048)]  # 65535 // 32 = 2047 a run
    assert ac.batch_runs(2047, 32) == [(0, 2047)] and ac.batch_runs(0, 32) == [(0, 0)]
    assert ac.batch_runs(5, 70000) == [(b, b + 1) for b in range(5)]  # past the limit alone: a batch a run


@pytest.mark.parametrize("heads_q, heads_kv", [(2, 2), (4, 2)], ids=["mha", "gqa"])
def test_runs_of_batches_match_the_reference(heads_q, heads_kv, small_grids, device):
    q, k, v = qkv(3, heads_q, heads_kv, 20, 27, 32, BF16, device, seed=3)
    launches = ab._inspect_launches((3, heads_q, heads_kv, 20, 32), BF16, None, ac.Scores(0.125, causal=True))
    runs = 2 if heads_q == 2 else 3  # 4 // heads_q batches a run
    assert sum(launch.name == "bwd delta" for launch in launches) == runs
    assert sum(launch.name == "bwd dq" for launch in launches) == runs
    assert all(launch.grid[1] <= 4 for launch in launches), [launch.grid for launch in launches]
    check(q, k, v, causal=True)


def test_runs_of_packed_sequences_match_the_reference(small_grids, device):
    """5 sequences of 2 query heads: runs of 2 sequences, their cu_seqlens sliced."""
    q, k, v, cu = packed([(9, 9), (4, 11), (13, 6), (1, 1), (7, 7)], 2, 1, 32, BF16, device)
    check_packed(q, k, v, causal=True, **cu)
