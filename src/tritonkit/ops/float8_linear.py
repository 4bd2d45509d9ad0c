"""A linear layer in fp8: ``float8_linear(x, weight, bias, recipe)`` is ``F.linear(x, weight, bias)``
with each of its three matmuls (the forward's, dX's and dW's) run on fp8 operands quantized on the
fly by ``quantize_fp8`` and multiplied by ``scaled_mm``, the weight kept in its own dtype (fp32
master weights stay fp32; so do their gradients).

Maths. y = x W^T + b, dX = dY W, dW = dY^T x, db = sum over rows of dY. Each product A B (A (M, K),
B (K, N)) runs as scaled_mm(q(A), q(B), s(A), s(B)) with e4m3 values, the groups of each operand
along the product's K (so that a scale factors out of each partial sum):
- "rowwise" (torchao's rowwise recipe): a scale a row of A and a column of B. Forward: x's rows, W's
  rows; dX: dY's rows, W's columns (W^T's rows); dW: dY's columns, x's columns.
- "tensorwise": one scale an operand (the fastest to compute; an outlier sets the scale of all).
- "blockwise" (DeepSeek-V3's recipe): A in 1 x 128 runs along K, B in 128 x 128 blocks.
  Forward: x's runs along its rows, W's blocks; dX: dY's runs along its rows, W's blocks (the same
  groups, transposed: ``quantize_fp8(w, "block2d", transpose=True)`` makes both); dW: dY^T's runs
  along its rows (dY's columns), and x's blocks.
The matmuls sum in fp32 and round once to the output's dtype (y and dX in x's, dW in W's). On
Hopper the forward's product (rowwise, tensorwise) chains its steps in the tensor cores' fp8 sum
(``scaled_mm``'s use_fast_accum) and the gradients' promote every 128 of K to fp32, as torchao's
Float8Linear does by default (``FAST_FORWARD``).

Work. Three matmuls of 2 M N K FLOPs at Hopper's fp8 rate (twice bf16's), plus six quantizing
passes (x and W twice each, dY twice), each reading its operand once and writing it in one byte.
"""

from __future__ import annotations

import torch

from tritonkit.dtypes import FLOATS
from tritonkit.opdef import as_rows, check_tensor, first_derivative_only
from tritonkit.ops.quantize import quantize_fp8, quantize_fp8_reference, quantize_fp8_transposed
from tritonkit.ops.scaled_mm import scaled_mm, scaled_mm_reference

RECIPES = ("rowwise", "tensorwise", "blockwise")
# The forward's product sums its steps in the tensor cores' accumulator (scaled_mm's use_fast_accum),
# the gradients' products promote each step, as torchao's Float8Linear does by default: y feeds the
# next layer once, the gradients' sums run over many more terms (dW's over every token)
FAST_FORWARD = True
FP8 = torch.float8_e4m3fn


def _rowwise(a: torch.Tensor, b_t: torch.Tensor, quantize, matmul, out_dtype, bias=None, fast=False):
    """a (M, K) @ b (K, N) (+ bias), given b^T (N, K): a's rows and b's columns scaled; ``fast``:
    scaled_mm's use_fast_accum."""
    qa, sa = quantize(a, "row")
    qb, sb = quantize(b_t, "row")
    return matmul(qa, qb.t(), sa, sb.t(), out_dtype, bias, fast)


def _tensorwise(a, b_t, quantize, matmul, out_dtype, bias=None, fast=False):
    qa, sa = quantize(a, "tensor")
    qb, sb = quantize(b_t, "tensor")
    return matmul(qa, qb.t(), sa, sb, out_dtype, bias, fast)


def _blockwise(a, b_t, quantize, matmul, out_dtype, bias=None, fast=False):
    """a in 1 x 128 runs along K, b in 128 x 128 blocks (quantized as b^T: the same blocks). Its
    products promote every block by the recipe (``fast`` is never given)."""
    qa, sa = quantize(a, "block")
    qb, sb = quantize(b_t, "block2d")
    return matmul(qa, qb.t(), sa, sb.t(), out_dtype, bias, False)


PRODUCTS = {"rowwise": _rowwise, "tensorwise": _tensorwise, "blockwise": _blockwise}


# A transposed operand (x^T of a contiguous x: dX's W^T, dW's dY^T and x^T) is quantized from its
# storage, read in its own order, by a pass that stores q^T (quantize_fp8_transposed): x^T's rows are
# x's columns, its tensor x's. Quantizing the view itself walks x's columns with strided reads (the
# rowwise step quantized for 1.54 ms on the H200 that way, 0.65 this way), and a copy of q
# transposed by torch moved 0.34 TB/s (docs/perf-notes/fp8.md, "Float8Linear's quantizing passes"). x^T's
# 1 x 128 runs are x's runs of 128 down a column, its 128 x 128 blocks x's blocks.
TRANSPOSED_GROUPS = {"tensor": "tensor", "row": "column", "block": "column_block", "block2d": "block2d"}


def _quantize(x: torch.Tensor, granularity: str):
    """x (R, K) in fp8, contiguous, with its groups along K; x^T of a contiguous x through
    TRANSPOSED_GROUPS. The bits are the same either way."""
    x = x.detach()
    if not x.is_contiguous() and x.t().is_contiguous() and granularity in TRANSPOSED_GROUPS:
        return quantize_fp8_transposed(x.t(), TRANSPOSED_GROUPS[granularity], dtype=FP8)
    return quantize_fp8(x, granularity, dtype=FP8)


def _matmul(qa, qb, sa, sb, out_dtype, bias, fast):
    return scaled_mm(qa, qb, sa, sb, bias, out_dtype=out_dtype, use_fast_accum=fast)


def _output(x2, w, bias, recipe: str, quantize, matmul) -> torch.Tensor:
    """y = x W^T + b of one recipe, on the given quantize and matmul (the kernels', or the
    references'); its steps chained in the tensor cores' sum where the recipe allows it."""
    return PRODUCTS[recipe](x2, w, quantize, matmul, x2.dtype, bias, fast=FAST_FORWARD)


def _gradients(x2, w, dy2, recipe: str, quantize, matmul, needs=(True, True)) -> tuple:
    """(dX, dW) of one recipe, each where ``needs`` asks for it (else None)."""
    product = PRODUCTS[recipe]
    # dY (M, N) @ W (N, K): W^T's rows; dY^T (N, M) @ x (M, K): x^T's rows
    dx = product(dy2, w.t(), quantize, matmul, x2.dtype) if needs[0] else None
    dw = product(dy2.t(), x2.t(), quantize, matmul, w.dtype) if needs[1] else None
    return dx, dw


class _Float8Linear(torch.autograd.Function):
    """Over 2-D rows: the caller reshapes, so that the output is no view made inside the function
    (which autograd would refuse to let a ReLU(inplace=True) after it write)."""

    @staticmethod
    def forward(ctx, x2, weight, bias, recipe):
        y = _output(x2, weight, None if bias is None else bias.detach(), recipe, _quantize, _matmul)
        ctx.save_for_backward(x2, weight)
        ctx.recipe, ctx.bias_dtype = recipe, None if bias is None else bias.dtype
        return y

    @staticmethod
    @first_derivative_only("float8_linear")
    def backward(ctx, dy2):
        x2, weight = ctx.saved_tensors
        db = None
        dx, dw = _gradients(x2, weight, dy2, ctx.recipe, _quantize, _matmul, ctx.needs_input_grad[:2])
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None


def float8_linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, recipe: str = "rowwise"
) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` with its forward and backward matmuls in fp8 (the module
    docstring): input (..., K), weight (N, K) and bias (N,), each fp32, fp16 or bf16 (their own);
    the output in input's dtype, the gradients in their tensors' dtypes."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    check_tensor("input", input, dtypes=FLOATS, min_ndim=1)
    check_tensor("weight", weight, dtypes=FLOATS, ndim=2, device_of=("input", input))
    if input.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be (N, {input.shape[-1]}), got {tuple(weight.shape)}")
    y2 = _Float8Linear.apply(as_rows(input), weight, bias, recipe)
    return y2.view(*input.shape[:-1], weight.shape[0])


def float8_linear_reference(
    x, weight, bias=None, recipe="rowwise", dy=None, compute_dtype=torch.float64, matmul=None
) -> tuple:
    """(y, dX, dW, db) of the same recipe in plain PyTorch: ``quantize_fp8_reference``'s fp8 values
    and scales, ``scaled_mm_reference``'s products in ``compute_dtype`` (float64: exact but for
    the scales' roundings; float32: torch's arithmetic), or ``matmul(qa, qb, sa, sb, out_dtype,
    bias, fast)``'s where given (a peer's); dy None: the forward alone."""

    def quantize(t, granularity):
        return quantize_fp8_reference(t.detach(), granularity, dtype=FP8)

    def exact(qa, qb, sa, sb, out_dtype, bias, fast):
        return scaled_mm_reference(qa, qb, sa, sb, bias, compute_dtype, compute_dtype)

    matmul = matmul or exact

    x2 = as_rows(x)
    dy2 = None if dy is None else as_rows(dy)
    y = _output(x2, weight, bias, recipe, quantize, matmul)
    dx, dw = (None, None) if dy2 is None else _gradients(x2, weight, dy2, recipe, quantize, matmul)
    db = None if dy2 is None or bias is None else dy2.to(compute_dtype).sum(0)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y, None if dx is None else dx.reshape(x.shape), dw, db


# No op contract (its matmuls' and quantizers' own tests hold them; tests/test_float8_linear.py the
# recipes) and no workload yet
OPS: dict = {}
WORKLOADS: dict = {}
