"""Linear layers with fused epilogues: ``y = act(x W^T + b) + residual`` in one matmul kernel.

Maths. With z = x W^T + b (x: (M, K), W: (N, K), b: (N,)) and y = act(z) + r:
    dz = dy * act'(z),   dx = dz W,   dW = dz^T x,   db = sum over rows of dz,   dr = dy.
act is one of gelu (erf), gelu_tanh, silu (z * sigmoid z), relu, relu2 (relu squared), or none.

The forward stores z beside y when a gradient is wanted (one more M x N write in the epilogue);
the backward reads it back. Recomputing z instead would cost a third matmul of 2 M N K FLOPs, 50%
more backward work, to save M N elements of traffic that a matmul of K >= 64 hides. act' is
applied where z is read: in the prologue of both backward matmuls, which load dy and z tiles and
multiply by act'(z) before the tensor cores see them, so dz is never written to memory; db is
summed in the same prologue of the dW matmul, by the programs of its first column of tiles.

One kernel serves all three products: C = epilogue(prologue(A) B^T) with A (M, K) and B (N, K)
of any strides. dx takes A = dy (M, N) and B = W^T (a (K, N) view); dW takes A = dy^T and B = x^T.

Work. 2 M N K FLOPs a matmul (three in forward plus backward); bytes s (M K + N K + M N) plus the
epilogue's operands (b, the residual, z). At M, N, K in the thousands that is hundreds of FLOPs a
byte, past the ridge: compute-bound, so the roofline is the tensor cores' peak.
"""

from __future__ import annotations

import math

import torch

from tritonkit._runtime import check_device, empty_output, interpret

interpret()  # choose GPU or interpreter before triton is imported and any kernel is defined

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tritonkit._launch import Launcher, cdiv  # noqa: E402
from tritonkit.ops.attention_bwd import _dot  # noqa: E402
from tritonkit.ops.bias_gelu import _gelu, _gelu_grad  # noqa: E402

DTYPES = (torch.float16, torch.bfloat16)
# activation name -> the kernel's ACTIVATION code (constexprs: kernels read globals only as such)
ACTIVATIONS = {None: 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "relu": 4, "relu2": 5}
NONE, GELU, GELU_TANH, SILU, RELU, RELU2 = (tl.constexpr(code) for code in ACTIVATIONS.values())


@triton.jit
def _activate(z, ACTIVATION: tl.constexpr):
    """act(z) in fp32."""
    if ACTIVATION == GELU:
        y = _gelu(z, False)
    elif ACTIVATION == GELU_TANH:
        y = _gelu(z, True)
    elif ACTIVATION == SILU:
        y = z / (1.0 + tl.exp(-z))
    elif ACTIVATION == RELU:
        y = tl.maximum(z, 0.0)
    elif ACTIVATION == RELU2:
        y = tl.maximum(z, 0.0) * tl.maximum(z, 0.0)
    else:
        y = z
    return y


@triton.jit
def _activation_grad(z, ACTIVATION: tl.constexpr):
    """act'(z) in fp32."""
    if ACTIVATION == GELU:
        g = _gelu_grad(z, False)
    elif ACTIVATION == GELU_TANH:
        g = _gelu_grad(z, True)
    elif ACTIVATION == SILU:
        sigmoid = 1.0 / (1.0 + tl.exp(-z))
        g = sigmoid * (1.0 + z * (1.0 - sigmoid))
    elif ACTIVATION == RELU:
        g = tl.where(z > 0.0, 1.0, 0.0)
    elif ACTIVATION == RELU2:
        g = 2.0 * tl.maximum(z, 0.0)
    else:
        g = tl.full(z.shape, 1.0, tl.float32)
    return g


# The untuned tiles: 128 x 128 outputs at 8 warps and 64-deep steps on the GPU (Triton's own
# Hopper matmul tutorial's tile); the interpreter runs each program in numpy, so small tiles keep
# several programs and k-steps in a test's odd shapes.
DEFAULT_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
                  "num_stages": 3}
INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4,
                      "num_stages": 1}


@triton.jit
def _linear_kernel(
    a_ptr,  # A, (M, K), strides (stride_am, stride_ak)
    b_ptr,  # B, (N, K), strides (stride_bn, stride_bk): C = A B^T
    c_ptr,  # output, (M, N), contiguous
    bias_ptr,  # HAS_BIAS: (N,), added to every row
    residual_ptr,  # HAS_RESIDUAL: (M, N), strides (stride_rm, stride_rn), added after the activation
    pre_ptr,  # STORE_PRE: the pre-activation out, (M, N), contiguous
    z_ptr,  # GRAD_ACTIVATION: the pre-activation at A's positions, (M, K), strides (stride_zm, stride_zk)
    row_sum_ptr,  # SUM_ROWS: fp32 out, (M,): the sums of A's rows after the prologue
    M,  # rows of A and C
    N,  # rows of B: columns of C
    K,  # the reduced dimension
    stride_am, stride_ak,  # elements between rows, columns of A
    stride_bn, stride_bk,  # ... of B
    stride_rm, stride_rn,  # ... of the residual
    stride_zm, stride_zk,  # ... of z
    ACTIVATION: tl.constexpr,  # epilogue: C = act(A B^T + bias) (+ residual); an ACTIVATIONS code
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr,  # also store A B^T + bias, the pre-activation
    GRAD_ACTIVATION: tl.constexpr,  # prologue: A's tiles times act'(z) (backward; an ACTIVATIONS code)
    SUM_ROWS: tl.constexpr,  # the programs of the first column of tiles store A's row sums
    EXACT_DOT_IN_FP32: tl.constexpr,  # multiply the 16-bit tiles as fp32 (the interpreter's path)
    BLOCK_M: tl.constexpr,  # rows of C a program computes
    BLOCK_N: tl.constexpr,  # columns of C a program computes
    BLOCK_K: tl.constexpr,  # depth of a step
    GROUP_M: tl.constexpr,  # row tiles a group walks before the next column of tiles (L2 reuse of B)
):
    # grouped order: consecutive programs share GROUP_M row tiles of A and one column tile of B
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group_first_m = pid // (GROUP_M * tiles_n) * GROUP_M
    group_rows = tl.minimum(tiles_m - group_first_m, GROUP_M)
    in_group = pid % (GROUP_M * tiles_n)
    pid_m = group_first_m + in_group % group_rows
    pid_n = in_group // group_rows
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: M * K may pass 2^31
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + depth
        a_mask = (rows[:, None] < M) & (ks[None, :] < K)
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak, mask=a_mask, other=0.0)
        if GRAD_ACTIVATION != NONE:  # dz = dy * act'(z), rounded to dy's dtype as torch's dz is
            z = tl.load(z_ptr + rows[:, None] * stride_zm + ks[None, :] * stride_zk, mask=a_mask, other=0.0)
            dz = a.to(tl.float32) * _activation_grad(z.to(tl.float32), GRAD_ACTIVATION)
            if SUM_ROWS:
                row_sum += tl.sum(dz, axis=1)
            a = dz.to(a_ptr.dtype.element_ty)
        elif SUM_ROWS:
            row_sum += tl.sum(a.to(tl.float32), axis=1)
        b_mask = (ks[:, None] < K) & (cols[None, :] < N)
        b = tl.load(b_ptr + cols[None, :] * stride_bn + ks[:, None] * stride_bk, mask=b_mask, other=0.0)
        acc += _dot(a, b, EXACT_DOT_IN_FP32)
    if SUM_ROWS:
        tl.store(row_sum_ptr + rows, row_sum, mask=(rows < M) & (pid_n == 0))
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if STORE_PRE:
        tl.store(pre_ptr + rows[:, None] * N + cols[None, :], acc.to(pre_ptr.dtype.element_ty), mask=mask)
    y = _activate(acc, ACTIVATION)
    if HAS_RESIDUAL:
        y += tl.load(residual_ptr + rows[:, None] * stride_rm + cols[None, :] * stride_rn, mask=mask,
                     other=0.0).to(tl.float32)
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], y.to(c_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- launcher

_launcher = Launcher(_linear_kernel)


def _config() -> dict:
    return dict(INTERPRETER_CONFIG if interpret() else DEFAULT_CONFIG)


def _matmul(a, b, out, **operands) -> None:
    """out = act(prologue(a) b^T + bias) + residual, into the contiguous ``out``; see the kernel and
    ``_matmul_args`` for the operands."""
    if a.shape[0] and b.shape[0]:
        grid, args, meta = _matmul_args(a, b, out, **operands)
        _launcher(grid, *args, **meta)


def _matmul_args(a, b, out, *, bias=None, residual=None, pre=None, activation=0, z=None, grad_activation=0,
                 row_sum=None, config: dict | None = None) -> tuple[tuple, tuple, dict]:
    """(grid, arguments, constexprs and options) of the kernel: a (M, K), b (N, K), out (M, N)."""
    (M, K), N = a.shape, b.shape[0]
    config = config or _config()
    unused = out  # a pointer the kernel never reads for an absent operand
    r, zz = (residual if residual is not None else out), (z if z is not None else a)
    args = (a, b, out, bias if bias is not None else unused, r, pre if pre is not None else unused, zz,
            row_sum if row_sum is not None else unused, M, N, K, *a.stride(), *b.stride(), *r.stride(),
            *zz.stride())
    meta = {"ACTIVATION": activation, "HAS_BIAS": bias is not None, "HAS_RESIDUAL": residual is not None,
            "STORE_PRE": pre is not None, "GRAD_ACTIVATION": grad_activation, "SUM_ROWS": row_sum is not None,
            "EXACT_DOT_IN_FP32": interpret(), **config}
    # K = 0: the loop takes no step and the epilogue still runs
    return (cdiv(M, config["BLOCK_M"]) * cdiv(N, config["BLOCK_N"]),), args, meta


def _validate(input, weight, bias, activation, residual) -> None:
    for name, value in (("input", input), ("weight", weight)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if input.dtype not in DTYPES:
        raise TypeError(f"input must be float16 or bfloat16, got {input.dtype}")
    if input.dim() == 0:
        raise ValueError("input must have at least one dimension (in_features, the last)")
    if weight.dim() != 2 or weight.shape[1] != input.shape[-1]:
        raise ValueError(f"weight must be (out_features, in_features) with in_features = input's last "
                         f"dimension {input.shape[-1]}, got {tuple(weight.shape)}")
    check_device("input", input)
    out_features = weight.shape[0]
    for name, value, shape in (("weight", weight, None), ("bias", bias, (out_features,)),
                               ("residual", residual, (*input.shape[:-1], out_features))):
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(value).__name__}")
        if value.dtype != input.dtype:
            raise TypeError(f"{name} must have input's dtype {input.dtype}, got {value.dtype}")
        if value.device != input.device:
            raise ValueError(f"{name} must be on input's device {input.device}, got {value.device}")
        if shape is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
    if activation not in ACTIVATIONS:
        names = ", ".join(repr(a) for a in ACTIVATIONS)
        raise ValueError(f"activation must be one of {names}, got {activation!r}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(rows, last dim) view of t (a copy only where the strides allow no view); no -1, which a
    last dim of 0 leaves ambiguous."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _linear_fwd(input, weight, bias, residual, activation: str | None, save_pre: bool):
    """(y, z): y = act(input weight^T + bias) + residual, and z = input weight^T + bias when
    ``save_pre`` and there is an activation (else an empty tensor)."""
    _validate(input, weight, bias, activation, residual)
    out_shape = (*input.shape[:-1], weight.shape[0])
    y = empty_output(out_shape, input.dtype, input.device)
    keep = save_pre and activation is not None
    pre = empty_output(out_shape, input.dtype, input.device) if keep else input.new_empty(0)
    x = _rows(input)
    _matmul(x, weight, y.view(-1, weight.shape[0]), bias=bias,
            residual=_rows(residual) if residual is not None else None,
            pre=pre.view(-1, weight.shape[0]) if keep else None, activation=ACTIVATIONS[activation])
    return y, pre


def _linear_bwd(grad_output, input, weight, pre, has_bias: bool, activation: str | None, needs: list[bool]):
    """(dx, dW, db) of y = act(x W^T + b) + r, each None where ``needs`` (x, W, b) says not wanted."""
    code = ACTIVATIONS[activation]
    dy, x = _rows(grad_output), _rows(input)
    z = _rows(pre) if code else None
    dx = dw = db = None
    if needs[0]:  # dx = dz W: A = dy (M, N), B = W^T, a (K, N) view
        dx = empty_output(input.shape, input.dtype, input.device)
        _matmul(dy, weight.t(), dx.view(-1, input.shape[-1]), z=z, grad_activation=code)
    if needs[1] or (has_bias and needs[2]):  # dW = dz^T x: A = dy^T (N, M), B = x^T (K, M)
        dw = empty_output(weight.shape, weight.dtype, weight.device)
        row_sum = empty_output((weight.shape[0],), torch.float32, weight.device) if has_bias else None
        _matmul(dy.t(), x.t(), dw, z=z.t() if z is not None else None, grad_activation=code, row_sum=row_sum)
        if has_bias and needs[2]:
            db = row_sum.to(weight.dtype)  # no rows: the kernel's sums over none, zeros
        if not needs[1]:
            dw = None
    return dx, dw, db


# ---------------------------------------------------------------- custom ops and autograd


@torch.library.custom_op("tritonkit::linear", mutates_args=())
def _linear_op(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor | None, activation: str, save_pre: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    return _linear_fwd(input, weight, bias, residual, _activation(activation), save_pre)


@_linear_op.register_fake
def _(input, weight, bias, residual, activation, save_pre):
    _validate(input, weight, bias, _activation(activation), residual)
    out_shape = (*input.shape[:-1], weight.shape[0])
    keep = save_pre and activation != "none"
    return input.new_empty(out_shape), input.new_empty(out_shape if keep else (0,))


@torch.library.custom_op("tritonkit::linear_backward", mutates_args=())
def _linear_backward_op(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
                        pre: torch.Tensor, has_bias: bool, activation: str
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = _linear_bwd(grad_output, input, weight, pre, has_bias, _activation(activation),
                             [True, True, has_bias])
    return dx, dw, db if db is not None else weight.new_empty(0)


@_linear_backward_op.register_fake
def _(grad_output, input, weight, pre, has_bias, activation):
    return input.new_empty(input.shape), weight.new_empty(weight.shape), weight.new_empty(
        (weight.shape[0],) if has_bias else (0,))


def _activation(name: str) -> str | None:
    """The custom ops' string ("none" for no activation) as the public argument."""
    return None if name == "none" else name


def _setup_context(ctx, inputs, output) -> None:
    input, weight, bias, residual, activation, save_pre = inputs
    ctx.save_for_backward(input, weight, output[1])
    ctx.activation, ctx.has_bias, ctx.has_residual = activation, bias is not None, residual is not None


def _backward_traced(ctx, grad_output, _grad_pre):
    input, weight, pre = ctx.saved_tensors
    dx, dw, db = _linear_backward_op(grad_output, input, weight, pre, ctx.has_bias, ctx.activation)
    return (dx, dw, db if ctx.has_bias else None, grad_output if ctx.has_residual else None, None, None)


_linear_op.register_autograd(_backward_traced, setup_context=_setup_context)


class _Linear(torch.autograd.Function):
    """Eager autograd without the custom-op dispatcher (the compiled path uses the custom op)."""

    @staticmethod
    def forward(ctx, input, weight, bias, residual, activation):
        y, pre = _linear_fwd(input, weight, bias, residual, activation, save_pre=True)
        ctx.save_for_backward(input, weight, pre)
        ctx.activation, ctx.has_bias, ctx.has_residual = activation, bias is not None, residual is not None
        return y

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, pre = ctx.saved_tensors
        needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        dx, dw, db = _linear_bwd(grad_output, input, weight, pre, ctx.has_bias, ctx.activation, needs)
        dr = grad_output if ctx.has_residual and ctx.needs_input_grad[3] else None
        return dx, dw, db, dr, None


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``act(F.linear(input, weight, bias)) + residual`` in one matmul: weight is (out_features,
    in_features) as in ``torch.nn.functional.linear``, input has any leading dimensions, the
    activation is one of None, "gelu", "gelu_tanh", "silu", "relu", "relu2" (squared ReLU), and
    the residual, of the output's shape, is added after it. fp16 or bf16; fp32 accumulation."""
    if torch.compiler.is_compiling():
        return _linear_op(input, weight, bias, residual, activation or "none", True)[0]
    _validate(input, weight, bias, activation, residual)
    tensors = (input, weight, bias, residual)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _Linear.apply(input, weight, bias, residual, activation)
    return _linear_fwd(input, weight, bias, residual, activation, save_pre=False)[0]


# ---------------------------------------------------------------- reference and cost

_REFERENCE_ACTIVATIONS = {
    None: lambda z: z,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda z: torch.nn.functional.gelu(z, approximate="tanh"),
    "silu": torch.nn.functional.silu,
    "relu": torch.nn.functional.relu,
    "relu2": lambda z: torch.nn.functional.relu(z).square(),
}


def linear_reference(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch; pass float64 tensors for the oracle's reference."""
    y = _REFERENCE_ACTIVATIONS[activation](torch.nn.functional.linear(input, weight, bias))
    return y if residual is None else y + residual


def linear_cost(shape: tuple, dtype: torch.dtype, mode: str = "fwd"):
    """(M, K, N): 2 M N K FLOPs a matmul (two more backward); bytes of the operands and output."""
    from tritonkit.roofline import Cost

    m, k, n = shape
    size = torch.finfo(dtype).bits // 8
    fwd = Cost(2 * m * n * k, size * (m * k + n * k + m * n + n))
    bwd = Cost(4 * m * n * k, size * (2 * m * n + 2 * m * k + 2 * n * k + n))
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]



def _inspect_launches(shape: tuple, dtype: torch.dtype, config: dict | None = None,
                      activation: str | None = "gelu_tanh") -> list:
    """The three matmuls of a training step at (M, K, N), with bias, ``activation`` and a residual:
    the forward (storing z), dx and dW (db summed in its prologue)."""
    from tritonkit.inspect import Launch

    m, k, n = shape
    code = ACTIVATIONS[activation]
    x, w = torch.empty((m, k), dtype=dtype, device="meta"), torch.empty((n, k), dtype=dtype, device="meta")
    y, b = torch.empty((m, n), dtype=dtype, device="meta"), torch.empty((n,), dtype=dtype, device="meta")
    row_sum = torch.empty((n,), dtype=torch.float32, device="meta")
    calls = {"fwd": (x, w, y, {"bias": b, "residual": y, "pre": y, "activation": code}),
             "bwd dx": (y, w.t(), x, {"z": y, "grad_activation": code}),
             "bwd dw": (y.t(), x.t(), w, {"z": y.t(), "grad_activation": code, "row_sum": row_sum})}
    launches = []
    for name, (a, b_, out, operands) in calls.items():
        _, args, meta = _matmul_args(a, b_, out, config=config or dict(DEFAULT_CONFIG), **operands)
        launches.append(Launch(name, _linear_kernel, args, meta))
    return launches
