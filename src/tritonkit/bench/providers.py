"""The provider registry: tritonkit and each peer a user would otherwise reach for.

A provider turns an op (and its keyword arguments) into a callable with the op's positional
inputs. Generic providers apply to every op; op-specific peers (liger-kernel, SDPA backends,
cuBLASLt) come from ``OpSpec.peers``. A provider that is not installed, or that does not cover
an op, is reported as unavailable with the reason, never silently dropped.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tritonkit.ops import OpSpec


@dataclass(frozen=True)
class Provider:
    name: str
    description: str
    build: Callable[[OpSpec, dict], Callable | str]  # a callable, or why it is unavailable


def _tritonkit(spec: OpSpec, kwargs: dict) -> Callable:
    return functools.partial(spec.fn, **kwargs)


def _torch_eager(spec: OpSpec, kwargs: dict) -> Callable:
    return functools.partial(spec.reference, **kwargs)


@functools.cache
def _compiled_reference(spec: OpSpec, kwargs_items: tuple) -> Callable:
    return torch.compile(functools.partial(spec.reference, **dict(kwargs_items)))


def _torch_compile(spec: OpSpec, kwargs: dict) -> Callable | str:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (timings only)"
    # The backward is timed by replaying one graph (retain_graph=True), which a compiled backward
    # with donated buffers refuses; donation saves memory, not time, so the benchmark turns it off.
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    return _compiled_reference(spec, tuple(sorted(kwargs.items())))


def _peer(name: str, module: str | None) -> Callable[[OpSpec, dict], Callable | str]:
    def build(spec: OpSpec, kwargs: dict) -> Callable | str:
        if module is not None and importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
        if name not in spec.peers:
            return f"has no {spec.name}"
        return spec.peers[name](kwargs)

    return build


GENERIC = [
    Provider("tritonkit", "this library's Triton kernels", _tritonkit),
    Provider("torch", "PyTorch eager: the op's plain-PyTorch reference in the input dtype", _torch_eager),
    Provider("torch.compile", "torch.compile of the reference (Inductor)", _torch_compile),
    Provider("liger", "liger-kernel", _peer("liger", "liger_kernel")),
]


def providers_for(spec: OpSpec) -> list[Provider]:
    """Generic providers, then the op's own peers (cuDNN SDPA, FlexAttention, cuBLASLt...)."""
    named = {p.name for p in GENERIC}
    extra = [
        Provider(name, f"{name} (op-specific peer)", _peer(name, None))
        for name in spec.peers
        if name not in named
    ]
    return GENERIC + extra
