"""tritonkit: hand-written Triton kernels with references, cost models and benchmarks.

Importing the package defines no kernel and queries no device: each public op is imported on
first use, and that first import decides once whether kernels compile for the GPU or run in
Triton's interpreter on the CPU (see ``tritonkit._runtime``), unless the import could decide
without asking a device (a CPU-only torch, or a forcing variable).
"""

from __future__ import annotations

import importlib

from tritonkit import _runtime as _runtime
from tritonkit._registry import PUBLIC as _PUBLIC  # public name -> module that defines it

_runtime.decide_early()

__version__ = "0.1.0"

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name in _PUBLIC:
        module = importlib.import_module(_PUBLIC[name])
        value = module if module.__name__ == f"tritonkit.{name}" else getattr(module, name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'tritonkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
