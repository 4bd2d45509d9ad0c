"""The split launch's segments: the length that ends a round soonest (``softmax._even_segment``),
in place of the configs' powers of two, which left some SMs a program more than others; and rows
L2 cannot hold for pass 2 one at a time."""

from __future__ import annotations

import random

import pytest
import torch

import tritonkit.ops.softmax.softmax as sm
from test_softmax import F32, _check, _inputs
from tritonkit._launch import cdiv

pytestmark = pytest.mark.softmax


def _round(n: int, segment: int, groups: int, block_n: int, sms: int) -> int:
    """Chunks the busiest SM walks in a round: its programs times a segment's chunks."""
    return cdiv(groups * cdiv(n, segment), sms) * cdiv(segment, block_n)


def test_four_long_rows_fill_every_sm_evenly():
    """4 rows of 13795015 fp32, 2 at once, on 132 SMs of 4 programs: the config's 65536-entry
    segments (32 chunks) made 211 a row, 422 programs, 4 on 26 SMs and 3 on the rest; 26 chunks
    make 260 a row, 520 programs, 4 on 124 SMs: a round of 104 chunks, not 128."""
    even = sm._even_segment(13795015, 65536, 2, 528, 2048, 132)
    assert even == 26 * 2048 and 2 * cdiv(13795015, even) == 520
    assert (_round(13795015, 65536, 2, 2048, 132), _round(13795015, even, 2, 2048, 132)) == (128, 104)
    # 2 rows of 12291808 fp16: 16 chunks (376 programs, 3 an SM at most) end as soon as any: kept
    assert sm._even_segment(12291808, 65536, 2, 528, 4096, 132) == 65536


def test_segments_shorten_only_to_end_rounds_sooner(monkeypatch):
    """Over random rows: never more programs than fit, never under 4 chunks (or the config's own,
    if shorter), a round never longer than the config's segment's; switched off, the config's."""
    rng = random.Random(5)
    for _ in range(2000):
        block_n = rng.choice([1024, 2048, 4096])
        segment = block_n * rng.randint(1, 64)
        n = rng.randint(segment + 1, 600 * segment)
        sms, per_sm = rng.choice([(132, 4), (132, 2), (20, 4), (7, 3)])
        programs = sms * per_sm
        if cdiv(n, segment) > programs:
            continue
        groups = rng.randint(1, programs // cdiv(n, segment))
        even = sm._even_segment(n, segment, groups, programs, block_n, sms)
        assert even % block_n == 0 and min(segment, 4 * block_n) <= even <= segment
        assert groups * cdiv(n, even) <= programs
        assert _round(n, even, groups, block_n, sms) <= _round(n, segment, groups, block_n, sms)
    monkeypatch.setattr(sm, "SPLIT_EVEN_ROUNDS", False)
    assert sm._even_segment(13795015, 65536, 2, 528, 2048, 132) == 65536


def test_the_launch_takes_the_even_segment_and_stays_right(monkeypatch, device):
    """4 rows of 9000 fp32 on 11 SMs of 4 programs, a config of 4096-entry segments (3 a row: 12
    programs, 2 on one SM, a round of 32 chunks of 256): the launch takes 1280 (8 a row, 32 programs,
    3 an SM at most: 15 chunks), and the softmax and its backward still match the reference."""
    monkeypatch.setattr(sm, "sm_count", lambda device: 11)
    config = {"variant": "split", "SEGMENT": 4096, "BLOCK_N": 256, "num_warps": 4, "PER_SM": 4}
    views = tuple(torch.empty(1, 4, 9000, device=device) for _ in range(3))
    grid = sm._launches("bwd", config, False, views, sm._geometry(views))[0].grid
    assert grid == (4 * 8,) and sm._even_segment(9000, 4096, 4, 44, 256, 11) == 1280
    monkeypatch.setattr(sm, "SPLIT_EVEN_ROUNDS", False)
    assert sm._launches("bwd", config, False, views, sm._geometry(views))[0].grid == (4 * 3,)
    monkeypatch.setattr(sm, "SPLIT_EVEN_ROUNDS", True)
    x, dy = _inputs((4, 9000), F32, device, seed=9)
    _check(x, dy, log=False, variant="split")


def test_rows_past_l2_go_one_at_a_time(monkeypatch, device):
    """A row whose pass-2 bytes (y and dy backward: 9000 x 4 x 2) pass SPLIT_L2_BYTES goes one at a
    time over every program (9 segments of 1024 on 11 SMs), at that size or under it as before (4
    rows at once of 8); the backward still matches the reference."""
    monkeypatch.setattr(sm, "sm_count", lambda device: 11)
    config = {"variant": "split", "SEGMENT": 4096, "BLOCK_N": 256, "num_warps": 4, "PER_SM": 4}
    views = tuple(torch.empty(1, 4, 9000, device=device) for _ in range(3))
    grid = lambda: sm._launches("bwd", config, False, views, sm._geometry(views))[0].grid  # noqa: E731
    monkeypatch.setattr(sm, "SPLIT_L2_BYTES", 9000 * 4 * 2)
    assert grid() == (4 * 8,)
    monkeypatch.setattr(sm, "SPLIT_L2_BYTES", 9000 * 4 * 2 - 1)
    assert grid() == (9,)
    x, dy = _inputs((4, 9000), F32, device, seed=10)
    _check(x, dy, log=True, variant="split")


def test_rows_past_l2_split_in_two_launches(monkeypatch, device):
    """With SPLIT_TWO_LAUNCHES, rows past L2 take two launches, every row's pass 1 and then every pass
    2 (no cooperative wait), with as many rows at once as fit (4 of 8 segments on 11 SMs), where the
    default takes them one at a time in one launch; rows under L2 keep one launch on the GPU. The
    gradient still matches the reference."""
    monkeypatch.setattr(sm, "sm_count", lambda device: 11)
    monkeypatch.setattr(sm, "SPLIT_TWO_LAUNCHES", True)
    monkeypatch.setattr(sm, "interpret", lambda: False)
    config = {"variant": "split", "SEGMENT": 4096, "BLOCK_N": 256, "num_warps": 4, "PER_SM": 4}
    views = tuple(torch.empty(1, 4, 9000, device=device) for _ in range(3))
    geometry = sm._geometry(views)
    monkeypatch.setattr(sm, "SPLIT_L2_BYTES", 9000 * 4 * 2 - 1)
    launches = sm._launches("bwd", config, True, views, geometry)
    assert [launch.meta["PHASE"] for launch in launches] == [1, 2]
    assert [launch.grid for launch in launches] == [(4 * 8,)] * 2
    assert not any("launch_cooperative_grid" in launch.meta for launch in launches)
    monkeypatch.setattr(sm, "SPLIT_L2_BYTES", 9000 * 4 * 2)
    (launch,) = sm._launches("bwd", config, True, views, geometry)
    assert launch.meta["PHASE"] == 0 and launch.meta["launch_cooperative_grid"]
    monkeypatch.undo()
    monkeypatch.setattr(sm, "SPLIT_TWO_LAUNCHES", True)
    monkeypatch.setattr(sm, "SPLIT_L2_BYTES", 9000 * 4 * 2 - 1)
    x, dy = _inputs((4, 9000), F32, device, seed=11)
    _check(x, dy, log=True, variant="split")
