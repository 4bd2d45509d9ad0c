"""The error oracle: kernels are compared with their plain-PyTorch reference in float64.

The rule (FlashAttention's): a kernel passes when, for its output and every gradient,

    err(kernel) <= 2 * err(torch in the same dtype) + ATOL[dtype]

where err is the largest absolute difference from the reference run in float64 on the same
inputs. The torch term scales the bound with what the dtype can do on this op; ATOL covers ops
where torch happens to be exact. NaN never passes. Outputs are NaN-poisoned before the kernel runs,
so an unwritten element fails, and inputs are fresh seeded random values, never zeros.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from tritonkit import _runtime

# One unit in the last place at magnitude 1 (fp16, bf16); for fp32, eight such units, since two
# correct fp32 implementations of a transcendental may differ by a few ulps.
ATOL = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-20}
ORACLE_FACTOR = 2.0
# Triton 3.6's interpreter converts fp32 to bf16 by truncation where the GPU rounds to nearest
# even: up to one bf16 ulp (2^-7 relative) where the GPU errs by half of one. Under the
# interpreter only, bf16 bounds grow by that ulp at the reference's largest magnitude; the GPU
# tests keep the plain rule.
INTERPRETER_BF16_ULP = 2.0**-7


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Within this block every tritonkit output is allocated NaN-filled."""
    previous, _runtime.poison_outputs = _runtime.poison_outputs, True
    try:
        yield
    finally:
        _runtime.poison_outputs = previous


def random_tensor(shape: Sequence[int], dtype: torch.dtype, device, *, generator: torch.Generator,
                  scale: float = 1.0, noncontiguous: bool = False) -> torch.Tensor:
    """Standard-normal values (times ``scale``), never zeros; optionally a strided view.

    The non-contiguous form is every other column of a tensor twice as wide, so its last-dim
    stride is 2 and its row stride is not the row length.
    """
    shape = tuple(shape)
    full = shape[:-1] + (2 * shape[-1],) if noncontiguous and shape else shape
    values = torch.randn(full, generator=generator, dtype=torch.float32) * scale
    values = values.to(dtype=dtype, device=device)
    return values[..., ::2] if noncontiguous and shape else values


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


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
        return (f"{self.name}: err {self.err_kernel:.3e} vs bound {self.tolerance:.3e} "
                f"(torch err {self.err_torch:.3e}) {verdict}")


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


def compare(name: str, kernel_value: torch.Tensor, torch_value: torch.Tensor,
            reference_value: torch.Tensor, dtype: torch.dtype) -> Comparison:
    err_torch = max_abs_error(torch_value, reference_value)
    tolerance = ORACLE_FACTOR * err_torch + ATOL[dtype]
    if dtype == torch.bfloat16 and _runtime.interpret() and reference_value.numel():
        tolerance += INTERPRETER_BF16_ULP * reference_value.detach().abs().max().item()
    return Comparison(name, max_abs_error(kernel_value, reference_value), err_torch, tolerance)


def as_tuple(value) -> tuple:
    """An op's outputs as a tuple: one output or several."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _clone_inputs(inputs: Sequence, dtype: torch.dtype | None, requires_grad: Sequence[bool]) -> list:
    """Detached copies (upcast to ``dtype`` when given) with each input's strides.

    An expanded input (stride 0) is copied compactly and expanded again, so the kernel still sees
    stride 0; gradients are then taken with respect to the expanded view.
    """
    cloned = []
    for value, wants_grad in zip(inputs, requires_grad, strict=True):
        if isinstance(value, torch.Tensor):
            base = value.detach()[tuple(slice(0, 1) if st == 0 else slice(None) for st in value.stride())]
            copy = torch.empty_strided(base.shape, base.stride(), dtype=dtype or value.dtype,
                                       device=value.device)
            copy.copy_(base)
            value = copy.requires_grad_(wants_grad).expand(value.shape)
        cloned.append(value)
    return cloned


def check_against_reference(kernel: Callable, reference: Callable, inputs: Sequence, **options
                            ) -> list[Comparison]:
    """:func:`compare_with_reference`, raising AssertionError listing every comparison if any fails."""
    comparisons = compare_with_reference(kernel, reference, inputs, **options)
    if not all(c.passed for c in comparisons):
        raise AssertionError("kernel differs from the float64 reference:\n  "
                             + "\n  ".join(str(c) for c in comparisons))
    return comparisons


def compare_with_reference(kernel: Callable, reference: Callable, inputs: Sequence, *,
                           kwargs: dict | None = None, grad_inputs: Sequence[int] = (),
                           grad_outputs: Sequence[torch.Tensor] | None = None,
                           dtype: torch.dtype | None = None) -> list[Comparison]:
    """Compare ``kernel(*inputs)`` and its gradients with ``reference`` in float64.

    ``grad_inputs`` are the positions of inputs to differentiate; ``grad_outputs`` (one per output,
    any strides) are the upstream gradients. Inputs are copied, so the caller's stay untouched.
    """
    kwargs = kwargs or {}
    dtype = dtype or next(v.dtype for v in inputs if isinstance(v, torch.Tensor))
    wants_grad = [i in grad_inputs for i in range(len(inputs))]

    def run(fn, upcast: torch.dtype | None, poison: bool):
        args = _clone_inputs(inputs, upcast, wants_grad)
        with poisoned_outputs() if poison else contextlib.nullcontext():
            outputs = as_tuple(fn(*args, **kwargs))
        grads = ()
        if grad_inputs:
            upstream = [g.to(upcast) if upcast else g for g in grad_outputs]
            with poisoned_outputs() if poison else contextlib.nullcontext():
                grads = torch.autograd.grad(outputs, [args[i] for i in grad_inputs], upstream)
        return outputs, grads

    ref_out, ref_grads = run(reference, torch.float64, poison=False)
    torch_out, torch_grads = run(reference, None, poison=False)
    kernel_out, kernel_grads = run(kernel, None, poison=True)

    names = [f"output[{i}]" for i in range(len(ref_out))] + [f"grad input[{i}]" for i in grad_inputs]
    triples = zip(kernel_out + kernel_grads, torch_out + torch_grads, ref_out + ref_grads, strict=True)
    return [compare(name, k, t, r, dtype) for name, (k, t, r) in zip(names, triples, strict=True)]
