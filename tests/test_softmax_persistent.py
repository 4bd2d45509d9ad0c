"""softmax's persistent one-pass kernels (``STAGES``): where the untuned default takes them, which
candidates the tuner keeps, and their outputs and gradients when a program walks several row blocks.
Their SASS (asynchronous copies to shared memory) is checked in test_softmax_hw.py."""

from __future__ import annotations

import pytest
import torch

import test_softmax
import tritonkit.ops.softmax.configs as sk
import tritonkit.ops.softmax.softmax as sm
from grids import case_id, in_turn
from test_softmax import BF16, F16, F32, _check, _inputs, _key
from tritonkit import opdef, tuning

pytestmark = pytest.mark.softmax
launches = test_softmax.launches  # the fixture recording each launch, shared


@pytest.fixture(autouse=True)
def fresh_memos(monkeypatch):
    """No config or plan chosen by an earlier test of the process stands in for this one's."""
    monkeypatch.setattr(sm, "_plans", {})
    for tuned in sm._TUNED.values():
        monkeypatch.setattr(tuned, "_chosen", {})
    opdef.forget_plans()  # (recorded launches replay on a GPU whatever the default says now)
    yield
    opdef.forget_plans()


@pytest.fixture
def persistent_default(monkeypatch):
    """The rule's persistent default switched on (off since the H200 measured it slower)."""
    monkeypatch.setattr(sk, "PERSISTENT_DEFAULT", True)


def test_the_default_persists_only_where_switched_on():
    """Measured slower on the H200 wherever the rule took it (configs.PERSISTENT_DEFAULT's comment):
    off, no untuned default persists."""
    assert not sk.PERSISTENT_DEFAULT
    assert "STAGES" not in sm._default(_key("fwd", sk.PERSISTENT_MIN_ENTRIES, dtype="bf16>bf16"))
    assert "STAGES" not in sm._default(_key("bwd", sk.ONE_PASS_MAX_BLOCK_N, dtype="bf16>bf16"))


def test_the_default_persists_where_a_program_holds_a_long_row(persistent_default):
    """Switched on: from PERSISTENT_MIN_ENTRIES held a program (the forward's row, the backward's y
    and dy), rows layout only, within the shared-memory budget; shorter rows keep a row block a
    program."""
    entries = sk.PERSISTENT_MIN_ENTRIES
    assert sm._default(_key("fwd", entries, dtype="bf16>bf16"))["STAGES"] == 2
    assert sm._default(_key("fwd", sk.ONE_PASS_MAX_BLOCK_N, dtype="fp32>fp32"))["STAGES"] == 2
    assert sm._default(_key("bwd", entries // 2, dtype="fp32>fp32"))["STAGES"] == 2
    assert "STAGES" not in sm._default(_key("fwd", entries // 2, dtype="bf16>bf16"))
    assert sm._default(_key("fwd", entries // 2 + 1))["STAGES"] == 2  # the tile held, padded, counts
    assert "STAGES" not in sm._default(_key("fwd", 1024, "cols", dtype="bf16>bf16"))
    # the packed bf16 backward holds 32768 entries twice: 128 KB staged, within the budget
    assert sm._default(_key("bwd", sk.ONE_PASS_MAX_BLOCK_N, dtype="bf16>bf16"))["STAGES"] == 2


def test_persistent_configs_stay_within_shared_memory(persistent_default):
    """A persistent default stages its blocks within STAGED_MAX_SHARED_BYTES; the tuner times it beside
    the plain one-pass candidates (the only STAGES config it holds)."""
    config = {"variant": "one-pass", "BLOCK_M": 2, "num_warps": 16, "STAGES": 2}
    assert sk._staged_fits(config, _key("fwd", 16384, dtype="fp32>fp32"))  # 128 KB
    assert not sk._staged_fits(config, _key("fwd", 32768, dtype="fp32>fp32"))  # 256 KB
    assert not sk._staged_fits(config, _key("bwd", 16384, dtype="fp32>fp32"))  # y and dy: 256 KB
    assert not sk._staged_fits(config, _key("fwd", 64, "cols"))
    key = {**_key("fwd", 32768, rows=8192, dtype="bf16>bf16"), "variant": "auto"}
    candidates = sm._TUNERS["fwd"]._candidates(key)
    assert [c for c in candidates if c.get("STAGES")] == [sm._default(key)]
    assert any(c["variant"] == "one-pass" and not c.get("STAGES") for c in candidates)


# Rows in blocks of 1-2 a program, walked by 3 programs: each walks several blocks, the last ragged.
PERSISTENT_SHAPES = [(7, 123), (10, 1), (5, 1823), (2, 5, 65)]
PERSISTENT = in_turn(PERSISTENT_SHAPES, [F32, BF16, F16], last=[False, True])


@pytest.fixture
def three_programs(monkeypatch, launches):
    """Every one-pass default config becomes persistent (STAGES 2, BLOCK_M 2 where the default holds
    several rows) and the grid three programs, so that each walks several row blocks; returns the launches."""
    for tuner in sm._TUNERS.values():
        default = tuner.default

        def persistent(key, default=default):
            config = default(key)
            if config["variant"] != "one-pass" or key["layout"] != "rows":
                return config
            return {**config, "BLOCK_M": min(config["BLOCK_M"], 2), "STAGES": 2}

        monkeypatch.setattr(tuner, "default", persistent)
    for launcher in (sm._LAUNCHERS["fwd", "one-pass"], sm._LAUNCHERS["bwd", "one-pass"]):
        monkeypatch.setattr(launcher, "programs_per_sm", lambda *args, **meta: 1)
    monkeypatch.setattr(sm, "sm_count", lambda device: 3)
    return launches


@pytest.mark.parametrize("shape, dtype, log", PERSISTENT, ids=map(case_id, PERSISTENT))
def test_persistent_programs_walk_every_row_block(shape, dtype, log, three_programs, device):
    x, dy = _inputs(shape, dtype, device, seed=71 + shape[-1])
    _check(x, dy, log=log)
    staged = [config for _, config in three_programs if config.get("STAGES")]
    assert {d for d, config in three_programs if config.get("STAGES")} == {"fwd", "bwd"}
    rows = x.numel() // shape[-1]
    assert all(-(-rows // config["BLOCK_M"]) > 3 for config in staged)  # blocks past the 3 programs


def test_persistent_grid_is_what_the_sms_hold(three_programs, device):
    """The launch: min(row blocks, programs an SM holds x SMs) programs, all row blocks as ``blocks``."""
    x = torch.randn(11, 40, device=device)
    config = {"variant": "one-pass", "BLOCK_M": 2, "num_warps": 4, "STAGES": 2}
    views = (sm._as_3d(x, 1), sm._as_3d(torch.empty_like(x), 1))
    grid, args, meta = sm._launch_args("fwd", config, False, views, sm._geometry(views))
    assert grid == (3,) and args[-1] == 6 and meta["STAGES"] == 2
    grid, args, meta = sm._launch_args("fwd", {**config, "STAGES": 0}, False, views, sm._geometry(views))
    assert grid == (6,) and args[-1] == 6 and meta["STAGES"] == 0


# On the GPU the pipeliner runs for real: the blocks' copies to shared memory a block ahead.
GPU_WALKED = [((1000, 3000), BF16), ((37, 4097), F32), ((4099, 65), F16)]
# (64 rows of 32768 fp16 backward: the rule splits rows that few over the SMs, as the H200 run of
# this test showed; its values passed)
GPU_DEFAULTS = [((300, 20000), BF16), ((257, 9000), F32)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape, dtype", GPU_WALKED, ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_persistent_blocks_on_the_gpu(shape, dtype, log, three_programs, device):
    """Three programs walk hundreds of row blocks, each block's copy issued while the last is reduced."""
    with tuning.disabled():
        _check(*_inputs(shape, dtype, device, seed=73), log=log)
    assert {d for d, config in three_programs if config.get("STAGES")} == {"fwd", "bwd"}


@pytest.mark.gpu
@pytest.mark.hbm
@pytest.mark.parametrize("shape, dtype", GPU_DEFAULTS, ids=str)
def test_persistent_defaults_on_the_gpu(shape, dtype, launches, device, persistent_default):
    """Untuned long rows: the default persists (as many programs as the SMs hold), both ways."""
    with tuning.disabled():
        _check(*_inputs(shape, dtype, device, seed=74))
    assert {d for d, config in launches if config.get("STAGES")} == {"fwd", "bwd"}
