"""The provider registry: tritonkit and each peer a user would otherwise reach for.

A provider turns a workload (an op and its keyword arguments) into a callable with the op's
positional inputs. Generic providers apply to every workload; op-specific peers (liger-kernel, SDPA
backends, cuBLASLt) come from ``Workload.peers``. A provider that is not installed, or that does not cover
an op, is reported as unavailable with the reason, never silently dropped.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tritonkit.ops import Workload


@dataclass(frozen=True)
class Provider:
    name: str
    description: str
    build: Callable[[Workload], Callable | str]  # a callable, or why it is unavailable


def _tritonkit(workload: Workload) -> Callable:
    return functools.partial(workload.op.fn, **workload.call_kwargs)


def _torch_eager(workload: Workload) -> Callable:
    return functools.partial(workload.op.reference, **workload.call_kwargs)


@functools.cache
def _compiled_reference(workload: Workload) -> Callable:
    return torch.compile(_torch_eager(workload))


def _torch_compile(workload: Workload) -> Callable | str:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (timings only)"
    # The backward is timed by replaying one graph (retain_graph=True), which a compiled backward
    # with donated buffers refuses; donation saves memory, not time, so the benchmark turns it off.
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    return _compiled_reference(workload)


def _peer(name: str, module: str | None) -> Callable[[Workload], Callable | str]:
    def build(workload: Workload) -> Callable | str:
        if module is not None and importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
        if name not in workload.peers:
            return f"has no {workload.name}"
        return workload.peers[name](workload.call_kwargs)

    return build


GENERIC = [
    Provider("tritonkit", "this library's Triton kernels", _tritonkit),
    Provider("torch", "PyTorch eager: the op's plain-PyTorch reference in the input dtype", _torch_eager),
    Provider("torch.compile", "torch.compile of the reference (Inductor)", _torch_compile),
    Provider("liger", "liger-kernel", _peer("liger", "liger_kernel")),
]


def providers_for(workload: Workload) -> list[Provider]:
    """Generic providers, then the op's own peers (cuDNN SDPA, FlexAttention, cuBLASLt...)."""
    named = {p.name for p in GENERIC}
    extra = [
        Provider(name, f"{name} (op-specific peer)", _peer(name, None))
        for name in workload.peers
        if name not in named
    ]
    return GENERIC + extra
