"""The oracle's rule, shared by the tests and the tuners' accuracy gate.

A kernel's output (or gradient) passes when

    err(kernel) <= 2 * err(torch in the same dtype) + ATOL[dtype]

where err is the largest absolute difference from the reference run in float64 on the same
inputs (FlashAttention's rule). The torch term scales the bound with what the dtype can do on this
op; ATOL covers ops where torch happens to be exact. NaN never passes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# One unit in the last place at magnitude 1 (fp16, bf16); for fp32, eight such units, since two
# correct fp32 implementations of a transcendental may differ by a few ulps.
ATOL = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-20}
ORACLE_FACTOR = 2.0


@dataclass(frozen=True)
class Comparison:
    """One output or gradient compared with the float64 reference."""

    name: str
    err_kernel: float
    err_torch: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return math.isfinite(self.err_kernel) and self.err_kernel <= self.tolerance

    def __str__(self) -> str:
        verdict = "ok" if self.passed else "FAIL"
        return (
            f"{self.name}: err {self.err_kernel:.3e} vs bound {self.tolerance:.3e} "
            f"(torch err {self.err_torch:.3e}) {verdict}"
        )


def worst(comparisons: Sequence[Comparison]) -> Comparison:
    """The comparison with the largest error for its bound (a failing one if any fails); a
    non-finite error is the worst. What a tuner's gate reports for an op with several outputs."""

    def share_of_bound(c: Comparison) -> float:
        if not math.isfinite(c.err_kernel):
            return math.inf
        return c.err_kernel / c.tolerance if c.tolerance > 0 else (0.0 if c.err_kernel == 0 else math.inf)

    return max(comparisons, key=share_of_bound)


def max_abs_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest |value - reference| in float64; inf when value has a NaN or the shapes differ."""
    if value.shape != reference.shape:
        return math.inf
    if value.numel() == 0:
        return 0.0
    # on the reference's device: on the host, a billion-entry output would cross as 8 GB of float64
    reference = reference.detach().to(torch.float64)
    diff = (value.detach().to(reference.device, torch.float64) - reference).abs_()
    largest = diff.max().item()  # a NaN anywhere makes the max NaN
    return math.inf if math.isnan(largest) else largest


def compare(
    name: str,
    kernel_value: torch.Tensor,
    torch_value: torch.Tensor,
    reference_value: torch.Tensor,
    dtype: torch.dtype,
) -> Comparison:
    err_torch = max_abs_error(torch_value, reference_value)
    tolerance = ORACLE_FACTOR * err_torch + ATOL[dtype]
    return Comparison(name, max_abs_error(kernel_value, reference_value), err_torch, tolerance)
