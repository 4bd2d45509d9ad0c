"""Triton, imported the one way tritonkit may import it: after the GPU-or-interpreter choice.

``@triton.jit`` picks the interpreter when a kernel is defined, and Triton's own library functions
are decorated when ``triton`` is first imported, so :func:`tritonkit._runtime.interpret` must run
before that import (its docstring says why). Every module that defines kernels imports
``from tritonkit._triton import tl, triton`` instead of importing Triton itself. Under the
interpreter, importing it also makes the interpreter's fp32 to bf16 cast round to nearest even, as
the GPU's does (``_interpreter_rounding``).
"""

from tritonkit._runtime import interpret

interpret()

import triton  # noqa: E402  (after interpret(), which this module exists to order)
import triton.language as tl  # noqa: E402

if interpret():  # the interpreter's fp32 to bf16 cast made to round as the GPU's
    from tritonkit import _interpreter_rounding  # noqa: E402

    _interpreter_rounding.install()

__all__ = ["tl", "triton"]
