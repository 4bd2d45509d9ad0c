"""fp32 log_softmax's forward row sum: in fp32 by default, in fp64 with ``softmax.LOG_FWD_SUM_FP64`` on
(``softmax/kernels._row_sum`` says why); the backward's in fp64 either way; both against the float64
reference."""

from __future__ import annotations

import pytest
import torch

import tritonkit.ops.softmax.softmax as sm
from test_softmax import _check, _inputs
from tritonkit.opdef import forget_plans

pytestmark = pytest.mark.softmax


@pytest.mark.parametrize("fp64", [True, False], ids=["fp64-sum", "fp32-sum"])
def test_fp32_log_softmax_row_sums_either_way(fp64, monkeypatch, device):
    """fp32 log_softmax's forward sums its rows in fp32, or in fp64 with ``LOG_FWD_SUM_FP64`` on
    (``kernels._row_sum``), its backward in fp64: both within the oracle's rule,
    forward and backward, over one-pass, online and split rows, and the switch reaches the launch."""
    monkeypatch.setattr(sm, "LOG_FWD_SUM_FP64", fp64)
    forget_plans()
    config = {"variant": "one-pass", "BLOCK_M": 1, "num_warps": 4}
    views = (torch.empty(4, 8), torch.empty(4, 8))
    geometry = (1, 4, 8, (0, 8, 1, 0, 8, 1))
    assert sm._launch_args("fwd", config, True, views, geometry)[2]["SUM_FP64"] is fp64
    assert sm._launch_args("bwd", config, True, views, geometry)[2]["SUM_FP64"] is True
    for variant, shape in (("one-pass", (5, 300)), ("online", (3, 700)), ("split", (2, 1500))):
        x, dy = _inputs(shape, torch.float32, device, seed=41)
        _check(x, dy, log=True, variant=variant)
    forget_plans()
