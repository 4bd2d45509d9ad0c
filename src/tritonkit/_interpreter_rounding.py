"""The GPU's rounding of fp32 to bf16 in Triton's interpreter (3.6), installed when tritonkit chooses
the interpreter (``tritonkit._triton``, which every kernel module imports).

The interpreter casts fp32 to bf16 by dropping the low 16 bits of each value (``_convert_float``
shifts the significand: rounding toward zero), where the GPU rounds to nearest even
(``cvt.rn.bf16.f32``). A kernel's bf16 result written from fp32 would then err by up to a whole bf16
ulp on the CPU alone (a softmax of bf16 logits, a norm's bf16 output), where the GPU's and torch's
err by half of one. torch's own conversion rounds to nearest even, with NaN and infinities as the
GPU has them (``tests/test_interpreter_rounding.py`` holds the two casts to each other).

The interpreter is process-wide (``TRITON_INTERPRET``, which tritonkit sets when it chooses it), so
the cast is too: other Triton kernels interpreted in the process round as on the GPU as well.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger("tritonkit")

_interpreted_cast = None  # Triton's own cast_impl, once replaced


def fp32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """fp32 values as bf16 bit patterns (uint16), rounded to nearest even as the GPU rounds."""
    rounded = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16)
    return rounded.view(torch.int16).numpy().view(np.uint16).reshape(np.shape(values))


def _cast_impl(self, src, dst_type):
    import triton.language as tl
    from triton.runtime import interpreter

    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        return interpreter.TensorHandle(fp32_to_bf16_bits(src.data), dst_type.scalar)
    return _interpreted_cast(self, src, dst_type)


def install() -> None:
    """Replace the interpreter's cast (once). A Triton whose interpreter has no ``cast_impl`` keeps
    its own, with a debug line: its bf16 results may then differ from the GPU's by an ulp."""
    global _interpreted_cast
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    current = getattr(builder, "cast_impl", None)
    if current is None:
        log.debug("tritonkit: this Triton's interpreter has no cast_impl; its fp32 to bf16 cast is its own")
        return
    if current is not _cast_impl:
        _interpreted_cast = current
        builder.cast_impl = _cast_impl
