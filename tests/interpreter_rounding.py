"""The GPU's rounding of fp32 to bf16 for Triton's interpreter (3.6), installed by ``conftest``.

The interpreter casts fp32 to bf16 by dropping the low 16 bits of each value (``_convert_float``
shifts the significand: rounding toward zero), where the GPU rounds to nearest even
(``cvt.rn.bf16.f32``). A kernel's bf16 result written from fp32 then errs by up to a whole bf16 ulp
in the interpreter alone, where the oracle's bound, from torch's own rounded error, allows about
half of one. torch's own conversion rounds to nearest even, with NaN and infinities as the GPU has
them (``test_interpreter_rounding`` holds the two casts to each other).
"""

from __future__ import annotations

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

_interpreted_cast = interpreter.InterpreterBuilder.cast_impl


def fp32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """fp32 values as bf16 bit patterns (uint16), rounded to nearest even as the GPU rounds."""
    rounded = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16)
    return rounded.view(torch.int16).numpy().view(np.uint16).reshape(np.shape(values))


def cast_impl(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        return interpreter.TensorHandle(fp32_to_bf16_bits(src.data), dst_type.scalar)
    return _interpreted_cast(self, src, dst_type)


def install() -> None:
    interpreter.InterpreterBuilder.cast_impl = cast_impl
