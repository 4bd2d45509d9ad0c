"""The interpreter's fp32 to bf16 cast as tritonkit installs it (``_interpreter_rounding``) when it
chooses the interpreter: rounded to nearest even as the GPU rounds, ties, NaN, infinities,
subnormals and overflow as torch has them, where Triton's own cast drops the low bits."""

from __future__ import annotations

import pytest
import torch
from triton.runtime import interpreter

from tritonkit import _interpreter_rounding
from tritonkit._runtime import interpret
from tritonkit._triton import tl, triton  # as every kernel module imports triton: this installs the cast

pytestmark = pytest.mark.skipif(not interpret(), reason="checks Triton's interpreter")

# ties at 1 + 2^-8 (to even: down) and 1 + 3 x 2^-8 (up), values just past a tie, the special values
VALUES = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8 + 2**-20), 3.0000002, -3.0000002,
          float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 3.4e38, 0.0, -0.0]  # fmt: skip


@triton.jit
def _to_bf16(x_ptr, y_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets).to(tl.bfloat16))


def _cast(values: torch.Tensor) -> torch.Tensor:
    padded = torch.zeros(16, dtype=torch.float32)
    padded[: len(values)] = values
    out = torch.full((16,), 7.0, dtype=torch.bfloat16)
    _to_bf16[(1,)](padded, out, N=16)
    return out[: len(values)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_the_cast_rounds_to_nearest_even_as_torch_does():
    values = torch.tensor(VALUES, dtype=torch.float32)
    assert torch.equal(_bits(_cast(values)), _bits(values.to(torch.bfloat16)))


def test_random_values_round_as_torch_does():
    values = torch.randn(16, generator=torch.Generator().manual_seed(5)) * 100
    assert torch.equal(_bits(_cast(values)), _bits(values.to(torch.bfloat16)))


def test_tritons_own_cast_truncates(monkeypatch):
    """Why the cast is installed: without it 1 + 3 x 2^-8 (a tie, to even: up) comes out 1 + 2^-7."""
    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", _interpreter_rounding._interpreted_cast)
    value = torch.tensor([1 + 3 * 2**-8], dtype=torch.float32)
    assert _cast(value).item() == 1 + 2**-7 != value.to(torch.bfloat16).item()


def test_choosing_the_interpreter_installs_the_cast_once():
    """Importing triton as tritonkit's kernel modules do (``tritonkit._triton``) put the cast in, and
    installing again keeps Triton's own cast as the one it falls back to."""
    assert interpreter.InterpreterBuilder.cast_impl is _interpreter_rounding._cast_impl
    own = _interpreter_rounding._interpreted_cast
    _interpreter_rounding.install()
    assert interpreter.InterpreterBuilder.cast_impl is _interpreter_rounding._cast_impl
    assert _interpreter_rounding._interpreted_cast is own is not _interpreter_rounding._cast_impl
