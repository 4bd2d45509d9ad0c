"""Testing with the oracle: kernels compared with their plain-PyTorch reference in float64.

The rule (FlashAttention's): a kernel passes when, for its output and every gradient,

    err(kernel) <= 2 * err(torch in the same dtype) + ATOL[dtype]

where err is the largest absolute difference from the reference run in float64 on the same
inputs. The torch term scales the bound with what the dtype can do on this op; ATOL covers ops
where torch happens to be exact. NaN never passes. Outputs are NaN-poisoned before the kernel runs,
so an unwritten element fails, and inputs are fresh seeded random values, never zeros.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from tritonkit import _runtime
from tritonkit.oracle import ATOL, ORACLE_FACTOR, Comparison, compare, max_abs_error, worst  # noqa: F401


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Within this block every tritonkit output is allocated NaN-filled."""
    previous, _runtime.poison_outputs = _runtime.poison_outputs, True
    try:
        yield
    finally:
        _runtime.poison_outputs = previous


_NO_LAUNCH = (lambda *args: None, 0, False, False, None, (), None)  # a Launcher entry launching nothing


class _NoLauncher:
    """Every kernel's Launcher under :func:`launches_faked`: launches nothing, and gives plans an
    entry that launches nothing."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, grid, *args, **meta) -> None:
        return None

    def entry(self, args, meta):
        return _NO_LAUNCH

    def programs_per_sm(self, *args, **meta) -> int:
        return 1 << 30


@contextlib.contextmanager
def launches_faked() -> Iterator[None]:
    """Within this block ops run on CPU tensors as on a GPU (``_launch`` sees a native process on
    device -1) and every launch does nothing: their plans record and replay, so a call costs its
    Python alone (what it launches, not what it computes: the outputs are garbage)."""
    from tritonkit import _launch

    saved = [
        (_launch, "launcher_of", _NoLauncher),
        (_launch, "interpret", lambda: False),
        (torch._C, "_cuda_getDevice", lambda: -1),  # (CPU builds of torch lack these two)
        (torch._C, "_cuda_getCurrentRawStream", lambda device: 0),
    ]
    saved = [(owner, name, getattr(owner, name, None), fake) for owner, name, fake in saved]
    for owner, name, _, fake in saved:
        setattr(owner, name, fake)
    try:
        yield
    finally:
        for owner, name, previous, _ in saved:
            if previous is None:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)


def random_tensor(
    shape: Sequence[int],
    dtype: torch.dtype,
    device,
    *,
    generator: torch.Generator,
    scale: float = 1.0,
    noncontiguous: bool = False,
) -> torch.Tensor:
    """Standard-normal values (times ``scale``), never zeros; optionally a strided view. Drawn on the
    generator's device (a GPU's generator draws a benchmark's gigabyte on the GPU, where the CPU's
    took seconds), then moved to ``device``.

    The non-contiguous form is every other column of a tensor twice as wide, so its last-dim
    stride is 2 and its row stride is not the row length.
    """
    shape = tuple(shape)
    full = shape[:-1] + (2 * shape[-1],) if noncontiguous and shape else shape
    values = torch.randn(full, generator=generator, dtype=torch.float32, device=generator.device) * scale
    values = values.to(dtype=dtype, device=device)
    return values[..., ::2] if noncontiguous and shape else values


def generator(seed: int, device="cpu") -> torch.Generator:
    """A seeded generator on ``device`` (the CPU's by default: the tests' values, the same on any
    machine)."""
    return torch.Generator(device=device).manual_seed(seed)


def as_tuple(value) -> tuple:
    """An op's outputs as a tuple: one output or several."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _clone_inputs(inputs: Sequence, dtype: torch.dtype | None, requires_grad: Sequence[bool]) -> list:
    """Detached copies (floating ones upcast to ``dtype`` when given; integer ones, class
    indices say, kept) with each input's strides.

    An expanded input (stride 0) is copied compactly and expanded again, so the kernel still sees
    stride 0; gradients are then taken with respect to the expanded view.
    """
    cloned = []
    for value, wants_grad in zip(inputs, requires_grad, strict=True):
        if isinstance(value, torch.Tensor):
            base = value.detach()[tuple(slice(0, 1) if st == 0 else slice(None) for st in value.stride())]
            upcast = dtype if dtype is not None and value.is_floating_point() else value.dtype
            copy = torch.empty_strided(base.shape, base.stride(), dtype=upcast, device=value.device)
            copy.copy_(base)
            value = copy.requires_grad_(wants_grad).expand(value.shape)
        cloned.append(value)
    return cloned


def check_against_reference(
    kernel: Callable, reference: Callable, inputs: Sequence, **options
) -> list[Comparison]:
    """:func:`compare_with_reference`, raising AssertionError listing every comparison if any fails."""
    comparisons = compare_with_reference(kernel, reference, inputs, **options)
    if not all(c.passed for c in comparisons):
        raise AssertionError(
            "kernel differs from the float64 reference:\n  " + "\n  ".join(str(c) for c in comparisons)
        )
    return comparisons


def compare_with_reference(
    kernel: Callable,
    reference: Callable,
    inputs: Sequence,
    *,
    kwargs: dict | None = None,
    grad_inputs: Sequence[int] = (),
    grad_outputs: Sequence[torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> list[Comparison]:
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
