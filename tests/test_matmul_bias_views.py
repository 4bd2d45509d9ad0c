"""The matmul family's bias as views: every other entry of a longer tensor, or one value expanded
over the columns (stride 0). The epilogue reads a bias at bias + j, so such a view once gave other
columns' entries, or read past its storage; each public op now takes it as its values. Outputs and
every gradient against the float64 reference with the oracle's rule (CPU interpreter)."""

from __future__ import annotations

import pytest
import torch

import tritonkit
from fp8_peer import scaled_mm_peer
from tritonkit._runtime import interpret
from tritonkit.ops import linear_cross_entropy as lce
from tritonkit.ops import scaled_mm as sm
from tritonkit.ops.linear import linear_reference
from tritonkit.oracle import compare
from tritonkit.testing import check_against_reference, generator, random_tensor

pytestmark = pytest.mark.linear

F16 = torch.float16
VIEWS = ["strided", "expanded"]


def _device() -> str:
    return "cpu" if interpret() else "cuda"


def _bias(view: str, n: int, dtype, seed: int) -> torch.Tensor:
    """(n,) bias values as the view ``view`` of other memory."""
    g = generator(seed)
    if view == "expanded":
        return random_tensor((1,), dtype, _device(), generator=g).expand(n)
    spaced = torch.zeros(2 * n, dtype=dtype, device=_device())
    spaced[::2] = random_tensor((n,), dtype, _device(), generator=g)
    return spaced[::2]


@pytest.mark.parametrize("view", VIEWS)
def test_linear(view):
    g = generator(1)
    x, w = (random_tensor(shape, F16, _device(), generator=g) for shape in ((5, 16), (24, 16)))
    dy = random_tensor((5, 24), F16, _device(), generator=g)
    check_against_reference(
        lambda x, w, b: tritonkit.linear(x, w, b, "gelu"),
        lambda x, w, b: linear_reference(x, w, b, "gelu"),
        [x, w, _bias(view, 24, F16, 2)],
        grad_inputs=(0, 1, 2),
        grad_outputs=[dy],
    )


@pytest.mark.parametrize("view", VIEWS)
def test_linear_cross_entropy(view):
    g = generator(3)
    x, w = (random_tensor(shape, F16, _device(), generator=g) for shape in ((10, 16), (37, 16)))
    target = torch.randint(0, 37, (10,), generator=torch.Generator().manual_seed(3)).to(_device())
    check_against_reference(
        lambda x, w, t, b: tritonkit.linear_cross_entropy(x, w, t, b),
        lambda x, w, t, b: lce.linear_cross_entropy_reference(x, w, t, b),
        [x, w * 0.25, target, _bias(view, 37, F16, 4)],
        grad_inputs=(0, 1, 3),
        grad_outputs=[torch.tensor(1.0, device=_device())],
        dtype=F16,
    )


@pytest.mark.parametrize("view", VIEWS)
def test_scaled_mm(view):
    """Rowwise fp8 product, fp32 output, against the float64 reference by the oracle's rule with a
    peer's fp32 product (torch's where it runs) beside it."""
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(9, 40, generator=g) * 4).to(torch.float8_e4m3fn).to(_device())
    b = (torch.randn(11, 40, generator=g) * 4).to(torch.float8_e4m3fn).to(_device()).t()
    scale_a, scale_b = (torch.rand(shape, generator=g).to(_device()) + 0.1 for shape in ((9, 1), (1, 11)))
    bias = _bias(view, 11, torch.float32, 6)
    out = tritonkit.scaled_mm(a, b, scale_a, scale_b, bias, torch.float32)
    exact = sm.scaled_mm_reference(a, b, scale_a, scale_b, bias, torch.float64)
    theirs = scaled_mm_peer(a, b, scale_a, scale_b, bias, torch.float32)
    comparison = compare("out", out, theirs, exact, torch.float32)
    assert comparison.passed, str(comparison)
