"""The op registry: each family module's ``OPS`` (name -> :class:`Op`, the contract the tests check)
and ``WORKLOADS`` (name -> :class:`Workload`, what the benchmarks run of an op).

An op is one variant of a public function that its contract covers: ``linear`` with bias and
activation and ``linear_bare`` without either are two (they take different inputs and launch
different kernels). A workload runs an op at GPU shapes against peers, with keyword arguments of its
own: ``attention`` and ``attention_causal`` are flash_attention's, full and causal. A workload's name
names its results file and its rows; ``tritonkit bench``, ``roofline``, ``inspect`` and ``tune`` take
workloads, the contract tests take ops.

The registry names modules rather than importing them, so that ``import tritonkit.ops`` defines no
kernel; :func:`get_op` and :func:`get_workload` import a family's module (deciding GPU or
interpreter first) on demand.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tritonkit._registry import OP_MODULES, WORKLOAD_MODULES
from tritonkit.roofline import Cost

MODES = ("fwd", "bwd", "fwd+bwd")


def _shape_list(entries: list[tuple]) -> list[tuple[tuple, str | None]]:
    """Entries that are a shape (run in every dtype) or a (shape, dtype name) pair (one dtype only),
    as (shape, dtype name), the name None where the shape runs in every dtype."""
    return [
        (tuple(e[0]), e[1]) if len(e) == 2 and isinstance(e[1], str) else (tuple(e), None) for e in entries
    ]


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one record per op
class Op:
    """An op's contract: what the contract tests check, and what every workload of it calls."""

    name: str
    family: str  # pytest marker of the op's family
    fn: Callable  # the tritonkit implementation (public function)
    reference: Callable  # plain PyTorch; also the "torch" (eager) provider
    # (shape, dtype, mode, **a workload's kwargs) -> Cost
    cost: Callable[..., Cost]
    make_inputs: Callable[..., tuple]  # (shape, dtype, device, generator) -> positional inputs
    grad_inputs: tuple[int, ...]  # positions of differentiable inputs
    # the interpreter's shapes (the contract tests', a CPU benchmark run's), each a shape (run in
    # every dtype) or a (shape, dtype name) pair: a shape checked in one dtype only
    shapes: list[tuple]
    dims: tuple[str, ...]  # what each dimension of those shapes is (the CLI's --shape, in its errors)
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
    kwargs: dict = field(default_factory=dict)  # the variant's keyword arguments to fn and reference
    # (shape, dtype, config or None, **a workload's kwargs) -> the Launch records the op makes
    inspect: Callable | None = None

    def shape_list(self) -> list[tuple[tuple, str | None]]:
        return _shape_list(self.shapes)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one record per workload
class Workload:
    """An op as the benchmarks run it: its GPU shapes, the peers it is timed against and the peak its
    FLOPs run on; ``tritonkit inspect`` and ``tune`` take its shapes too."""

    name: str  # the results file's name (benchmarks/results/<gpu>/<name>.json) and its rows' "op"
    op: Op
    flop_unit: str  # roofline peak key its FLOPs run on ("fp32" for CUDA-core math)
    shapes: dict[str, list[tuple]]  # "quick" and "full": entries as Op.shapes'
    tiny_shape: tuple  # for host overhead: the kernel is negligible, the host path is not
    # keyword arguments beyond the op's: to fn, reference, the peers, cost and inspect
    kwargs: dict = field(default_factory=dict)
    peers: dict[str, Callable] = field(default_factory=dict)  # extra providers: name -> factory(kwargs)

    @property
    def call_kwargs(self) -> dict:
        """What a call of the op takes besides its inputs: the op's keyword arguments and the workload's."""
        return self.op.kwargs | self.kwargs

    def shape_list(self, kind: str) -> list[tuple[tuple, str | None]]:
        """``shapes[kind]`` as (shape, dtype name); "interpreter": the op's."""
        return self.op.shape_list() if kind == "interpreter" else _shape_list(self.shapes[kind])

    def cost(self, shape: tuple, dtype: torch.dtype, mode: str = "fwd") -> Cost:
        return self.op.cost(shape, dtype, mode, **self.kwargs)

    def launches(self, shape: tuple, dtype: torch.dtype, config: dict | None = None) -> list:
        """What ``tritonkit inspect`` compiles (``Op.inspect`` with the workload's kwargs)."""
        return self.op.inspect(shape, dtype, config, **self.kwargs)


def op_names() -> list[str]:
    return list(OP_MODULES)


def workload_names() -> list[str]:
    return list(WORKLOAD_MODULES)


def get_op(name: str) -> Op:
    if name not in OP_MODULES:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(OP_MODULES)}")
    return importlib.import_module(OP_MODULES[name]).OPS[name]


def get_workload(name: str) -> Workload:
    if name not in WORKLOAD_MODULES:
        raise ValueError(f"unknown workload {name!r}; known workloads: {', '.join(WORKLOAD_MODULES)}")
    return importlib.import_module(WORKLOAD_MODULES[name]).WORKLOADS[name]
