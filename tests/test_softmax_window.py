"""softmax's one-pass kernels over rows that start off their vectors' alignment (``WINDOW``): where
the launch takes windows (``_launch.row_window``), outputs and gradients through them against the
float64 reference (and bit for bit against the plain path's), and their accesses compiled for sm_90."""

from __future__ import annotations

import pytest
import torch

import sm90
import test_softmax
import test_softmax_persistent
import tritonkit.ops.softmax.softmax as sm
from grids import case_id, in_turn
from test_softmax import BF16, F16, F32, SMALL_CHUNKS, _check, _inputs
from tritonkit import tuning
from tritonkit._launch import row_window
from tritonkit.testing import generator, random_tensor

# the untuned launches these tests record: on a GPU, tuning on first use would time candidates through
# the recorded launcher and run its winner past it (the recordings then miss a direction, or hold the
# candidates' thousands)
pytestmark = [pytest.mark.softmax, pytest.mark.tuning_default]
launches = test_softmax.launches  # the fixture recording each launch, shared


fresh_memos = test_softmax_persistent.fresh_memos  # (autouse) no earlier test's config or plan


def _tensor(numel: int, dtype=BF16, offset: int = 0) -> torch.Tensor:
    """A tensor of ``numel`` entries starting ``offset`` entries into a 16-byte aligned allocation."""
    return torch.empty(numel + offset, dtype=dtype)[offset:]


def test_the_window_is_taken_where_rows_start_off_their_vectors_and_one_head_serves_all():
    x, y = _tensor(100 * 2901), _tensor(100 * 2901)
    assert row_window(2901, [(0, 2901), (0, 2901)], (x, y), 4096) == 8  # 8 bf16 entries: 16 bytes
    assert row_window(2901, [(0, 2901), (0, 2901)], (x, _tensor(100 * 2901, F32)), 4096) == 8
    assert row_window(2901, [(0, 2901)], (_tensor(2901, F32),), 4096) == 4
    assert row_window(2904, [(0, 2904), (0, 2904)], (x, y), 4096) == 0  # whole vectors: ALIGN's path
    assert row_window(2901, [(0, 2909), (0, 2901)], (x, y), 4096) == 8  # strides agree modulo 8
    assert row_window(2901, [(0, 2910), (0, 2901)], (x, y), 4096) == 0  # they do not: two heads
    assert row_window(2901, [(3, 2901), (5, 2901)], (x, y), 4096) == 0  # outer strides neither
    assert row_window(2901, [(0, 2901), (0, 2901)], (_tensor(2901, offset=1), y), 4096) == 0  # misaligned
    assert row_window(4093, [(0, 4093)], (x,), 4096) == 0  # the window (4093 + 7) would pass the tile
    assert row_window(4093, [(0, 4093)], (x,)) == 8  # a kernel in chunks: no tile bounds it


@pytest.fixture
def windows(monkeypatch):
    """The WINDOW of every one-pass and split launch the op builds, as (direction, WINDOW)."""
    build, seen = sm._launch_args, []

    def recording(direction, config, *args, **kwargs):
        grid, arguments, meta = build(direction, config, *args, **kwargs)
        if config["variant"] in ("one-pass", "split"):
            seen.append((direction, meta["WINDOW"]))
        return grid, arguments, meta

    monkeypatch.setattr(sm, "_launch_args", recording)
    return seen


@pytest.fixture
def online_windows(monkeypatch):
    """The online kernel's default in chunks of 64 (several a row), and the WINDOW of each of its
    launches, as (direction, WINDOW)."""
    for tuner in sm._TUNERS.values():
        default = tuner.default
        monkeypatch.setattr(
            tuner,
            "default",
            lambda key, default=default: SMALL_CHUNKS if key.get("variant") == "online" else default(key),
        )
    build, seen = sm._launch_args, []

    def recording(direction, config, *args, **kwargs):
        grid, arguments, meta = build(direction, config, *args, **kwargs)
        seen.append((direction, meta["WINDOW"]))
        return grid, arguments, meta

    monkeypatch.setattr(sm, "_launch_args", recording)
    return seen


# Row lengths whose rows start at every head; bf16/fp16 windows of 8 entries, fp32 of 4; rows of
# several vectors, of one interior vector or none (9 bf16 entries: a head and a tail vector only).
# Each also through the plain path (WINDOWS off), which odd rows took before.
WINDOW_SHAPES = [(13, 2901), (7, 121), (9, 9), (5, 1823), (16, 33), (3, 1001)]
WINDOWED = in_turn(WINDOW_SHAPES, [BF16, F32, F16], [True, False], last=[False, True])


@pytest.mark.parametrize("shape, dtype, on, log", WINDOWED, ids=map(case_id, WINDOWED))
def test_windows_match_the_reference(shape, dtype, on, log, windows, monkeypatch, device):
    monkeypatch.setattr(sm, "WINDOWS", on)
    x, dy = _inputs(shape, dtype, device, seed=81 + shape[1])
    _check(x, dy, log=log)
    expected = (8 if dtype != F32 else 4) if on else 0
    assert {window for _, window in windows} == {expected} and len({d for d, _ in windows}) == 2, windows


def test_views_whose_heads_differ_take_the_plain_path(windows, device):
    """x a view of wider rows (stride 1002 against y's 1001: two heads), and x one entry into its
    storage (not 16-byte aligned): no window, and the oracle still holds."""
    wide = random_tensor((6, 1002), BF16, device, generator=generator(91), scale=3.0)[:, :1001]
    shifted = random_tensor((6 * 1001 + 1,), BF16, device, generator=generator(92), scale=3.0)[1:].view(
        6, 1001
    )
    for x in (wide, shifted):
        y = sm.softmax(x, -1)
        torch.testing.assert_close(y.double(), torch.softmax(x.double(), -1), rtol=0, atol=2**-7)
    assert windows == [("fwd", 0), ("fwd", 0)]


def test_windows_compile_to_vectors_inside_rows_and_single_entries_at_their_ends():
    """Compiled for sm_90: rows of 2901 bf16 entries (odd: no two rows share an alignment) load and
    store 16 bytes at a time inside each row and 2 bytes at its first and last vectors, forward and
    backward, and so do rows of 50257 through the online kernels' chunks and rows of 3738195 through
    the split kernels' segments (whose 4-byte loads read the segments' partials); without the window
    every entry moved alone."""
    shapes = [(4096, 2901), (1024, 50257), (32, 3738195)]  # one-pass; online (chunks); split
    rows = sm90.access_widths("softmax", shapes)
    launches = [row["launch"] for row in rows]
    assert len(rows) == 6 and {"fwd online", "bwd online", "fwd split", "bwd split"} <= set(launches), rows
    for row in rows:
        split = row["launch"].endswith("split")
        assert set(row["loads"]) == ({128, 16, 32} if split else {128, 16}), row
        assert {128, 16} <= set(row["stores"]) <= {128, 16, 32}, row
        # the 16-bit accesses are the edges' (2 x 8 entries a row, y and dy backward): few instructions,
        # in both passes of the split kernels
        assert row["loads"][16] <= 2 * 8 * (1 if row["launch"].startswith("fwd") else 2) * (1 + split), row


GPU_WINDOWED = [
    ((4099, 2901), BF16),
    ((1000, 9017), BF16),
    ((3, 16001), F32),
    ((50000, 77), F16),
    ((64, 300007), BF16),  # the split kernels
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape, dtype", GPU_WINDOWED, ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_windows_on_the_gpu(shape, dtype, log, windows, device):
    """Compiled: the vectors' masks, the ends' single entries, one-pass, online and split kernels alike."""
    with tuning.disabled():
        _check(*_inputs(shape, dtype, device, seed=93), log=log)
    assert {window for _, window in windows} == {4 if dtype == F32 else 8}, windows


# The online kernel over odd rows in chunks of 64: the edges, whole chunks, a ragged last one, rows
# of no interior vector; each also plain (WINDOWS off).
ONLINE_WINDOWED = in_turn(
    [(5, 201), (3, 65), (4, 9), (2, 1001)], [BF16, F32], [True, False], last=[False, True]
)


@pytest.mark.parametrize("shape, dtype, on, log", ONLINE_WINDOWED, ids=map(case_id, ONLINE_WINDOWED))
def test_online_windows_match_the_reference(shape, dtype, on, log, online_windows, monkeypatch, device):
    monkeypatch.setattr(sm, "WINDOWS", on)
    x, dy = _inputs(shape, dtype, device, seed=95 + shape[1])
    _check(x, dy, log=log, variant="online")
    expected = (8 if dtype != F32 else 4) if on else 0
    assert {window for _, window in online_windows} == {expected}, online_windows


@pytest.mark.parametrize("on", [True, False], ids=["windows", "plain"])
@pytest.mark.parametrize("variant", ["auto", "online"])
def test_fp32_log_softmax_gradient_over_a_large_sum_of_dy(variant, on, monkeypatch, device):
    """A row whose sum(dy) is -27: rounded to fp32 before dy - exp(y) sum(dy), it put the gradient at
    2.5e-6 against the oracle's 2.1e-6 (torch 5.8e-7), in every kernel (``kernels._input_grad``)."""
    monkeypatch.setattr(sm, "WINDOWS", on)
    x, dy = _inputs((2, 999), F32, device, seed=4)
    assert dy.double().sum(-1).abs().max() > 25
    _check(x, dy, log=True, variant=variant)
