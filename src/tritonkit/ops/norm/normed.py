"""A norm's output made again in the backward of the projection that reads it, rather than saved.

In a decoder layer each norm's output y feeds one projection (``linear``: the fused QKV;
``gated_linear``: the MLP), whose backward needs y for the weight's gradient. Saved, y is a
(tokens, d) activation held from the forward to the backward (64 MiB at 8192 tokens of d = 4096),
beside the norm's own input, which the norm's backward saves anyway. torch.compile's partitioner
saves the input alone and recomputes y in the backward. The eager ops do the same here: the norm
marks its output with how it was made (``mark``), and a projection given such an output saves that
recipe in its place (``recipe``) and makes y again in its backward (``norm.renormed``), bit for bit:
the forward's own launch over the same input. The cost is one more pass of the norm a projection's
backward (it reads x and writes y: a few tens of microseconds at those sizes).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Whether ``linear`` and ``gated_linear`` save a tritonkit norm's output's recipe in the output's
# place (eager calls only: under torch.compile the partitioner decides)
RECOMPUTE = True

_ATTRIBUTE = "_tritonkit_normed"


class Normed(NamedTuple):
    """How a norm's output was made: the tensor normalised (the norm's input, which its backward
    saves), its weight and bias, eps and kind, and the versions of that tensor and of the output
    then (a later in-place write to either voids the recipe)."""

    source: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float
    rms: bool
    versions: tuple[int, int]

    def tensors(self) -> tuple:
        """What a projection saves in the output's place (its backward's ``norm.renormed`` arguments)."""
        return self.source, self.weight, self.bias


def mark(y: torch.Tensor, source: torch.Tensor, weight, bias, eps: float, rms: bool) -> None:
    """Record on the norm's output ``y`` how it was made from ``source`` (the norm without a
    residual: with one, y's recompute from the rounded sum would take another kernel's launch)."""
    setattr(y, _ATTRIBUTE, Normed(source, weight, bias, eps, rms, (source._version, y._version)))


def recipe(t: torch.Tensor) -> Normed | None:
    """``t``'s recipe where a projection may save it in t's place: t is a tritonkit norm's output,
    unchanged since (as is what it was made from), and RECOMPUTE is on; else None."""
    made = getattr(t, _ATTRIBUTE, None)
    if not RECOMPUTE or made is None or (made.source._version, t._version) != made.versions:
        return None
    return made
