"""The op registry: one :class:`OpSpec` per public op, in its module's ``SPECS`` (name -> spec).

The registry names modules rather than importing them, so that ``import tritonkit.ops`` defines
no kernel; :func:`get_op` imports an op's module (deciding GPU or interpreter first) on demand.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tritonkit._registry import SPEC_MODULES
from tritonkit.roofline import Cost

OP_MODULES = SPEC_MODULES  # spec name -> the module whose SPECS hold it (tritonkit._registry)
MODES = ("fwd", "bwd", "fwd+bwd")


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one spec per op
class OpSpec:
    """Everything the tests, the harness and the CLI need to know about one op."""

    name: str
    family: str  # pytest marker of the op's family
    fn: Callable  # the tritonkit implementation (public function)
    reference: Callable  # plain PyTorch; also the "torch" (eager) provider
    cost: Callable[[tuple, torch.dtype, str], Cost]  # (shape, dtype, mode) -> Cost
    make_inputs: Callable[..., tuple]  # (shape, dtype, device, generator) -> positional inputs
    grad_inputs: tuple[int, ...]  # positions of differentiable inputs
    flop_unit: str  # roofline peak key its FLOPs run on ("fp32" for CUDA-core math)
    # "quick", "full" (GPU) and "interpreter" lists of shapes, each either a shape (run in every
    # dtype) or a (shape, dtype name) pair: a shape measured in one dtype only
    shapes: dict[str, list[tuple]]
    tiny_shape: tuple  # for host overhead: the kernel is negligible, the host path is not
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
    kwargs: dict = field(default_factory=dict)
    peers: dict[str, Callable] = field(default_factory=dict)  # extra providers: name -> factory
    # (shape, dtype, config or None) -> the inspect.Launch records the op makes (tritonkit inspect)
    inspect: Callable | None = None

    def shape_list(self, kind: str) -> list[tuple[tuple, str | None]]:
        """``shapes[kind]`` as (shape, dtype name), the name None where the shape runs in every dtype."""
        return [
            (tuple(e[0]), e[1]) if len(e) == 2 and isinstance(e[1], str) else (tuple(e), None)
            for e in self.shapes[kind]
        ]


def op_names() -> list[str]:
    return list(OP_MODULES)


def get_op(name: str) -> OpSpec:
    if name not in OP_MODULES:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(OP_MODULES)}")
    return importlib.import_module(OP_MODULES[name]).SPECS[name]
