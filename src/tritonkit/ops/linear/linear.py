"""Linear layers with fused epilogues: ``y = act(x W^T + b) + residual`` in one matmul kernel.

Maths. With z = x W^T + b (x: (M, K), W: (N, K), b: (N,)) and y = act(z) + r:
    dz = dy * act'(z),   dx = dz W,   dW = dz^T x,   db = sum over rows of dz,   dr = dy.
act is one of gelu (erf), gelu_tanh, silu (z * sigmoid z), relu, relu2 (relu squared), or none.

The forward stores z beside y when a gradient is wanted (one more M x N write in the epilogue);
the backward reads it back. Recomputing z instead would cost a third matmul of 2 M N K FLOPs, 50%
more backward work, to save M N elements of traffic that a matmul of K >= 64 hides. The backward
makes dz in one memory-bound pass (read dy and z, write dz, sum db: 3 M N elements) and then runs
two plain matmuls on it, as torch does. Applying act'(z) in the matmuls' prologues instead, so that
dz is never written, measured 2.8-3.0x (dx) and 7.6x (dW) slower on the H200: the elementwise work on
the loaded tiles stalled the pipelined loads of every k-step, and each dz entry was recomputed by
every tile that reads it (docs/perf-notes.md).

One kernel serves all the products: C = epilogue(A B^T) with A (M, K) and B (N, K) of any
strides. dx takes A = dz (M, N) and B = W^T (a (K, N) view); dW takes A = dz^T and B = x^T.
The kernel, its launcher and its tuning are in ``kernels.py``; this file holds the maths,
the API, the autograd, the references and the costs.

Work. 2 M N K FLOPs a matmul (three in forward plus backward); bytes s (M K + N K + M N) plus the
epilogue's operands (b, the residual, z). At M, N, K in the thousands that is hundreds of FLOPs a
byte, past the ridge: compute-bound, so the roofline is the tensor cores' peak.
"""

from __future__ import annotations

import math

import torch

from tritonkit._launch import Launch
from tritonkit._runtime import check_device, empty_output
from tritonkit.dtypes import HALVES
from tritonkit.ops.linear.kernels import (
    _REFERENCE_ACTIVATIONS,
    ACTIVATIONS,
    GATED_DX,
    GATED_FWD,
    NOT_GATED,
    _activation_backward,
    _activation_backward_args,
    _activation_backward_kernel,
    _default_config,
    _linear_kernel,
    _matmul,
    _matmul_args,
)

DTYPES = HALVES


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
    _matmul(x, weight, _rows(y), bias=bias,
            residual=_rows(residual) if residual is not None else None,
            pre=_rows(pre) if keep else None, activation=ACTIVATIONS[activation])
    return y, pre


def _linear_bwd(grad_output, input, weight, pre, has_bias: bool, activation: str | None, needs: list[bool]):
    """(dx, dW, db) of y = act(x W^T + b) + r, each None where ``needs`` (x, W, b) says not wanted."""
    code = ACTIVATIONS[activation]
    dy, x = _rows(grad_output), _rows(input)
    want_db = has_bias and needs[2]
    dz, _, db = _activation_backward(dy, _rows(pre) if code else None, code, sum_db=want_db)
    dx = dw = None
    if needs[0]:  # dx = dz W: A = dz (M, N), B = W^T, a (K, N) view
        dx = empty_output(input.shape, input.dtype, input.device)
        _matmul(dz, weight.t(), _rows(dx))
    if needs[1]:  # dW = dz^T x: A = dz^T (N, M), B = x^T (K, M)
        dw = empty_output(weight.shape, weight.dtype, weight.device)
        _matmul(dz.t(), x.t(), dw)
    return dx, dw, db.to(weight.dtype) if want_db else None


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


# ---------------------------------------------------------------- gated_linear


def _validate_gated(input, weight_gate, weight_up, activation) -> None:
    _validate(input, weight_gate, None, activation, None)
    _validate(input, weight_up, None, activation, None)
    if weight_up.shape != weight_gate.shape:
        raise ValueError(f"weight_up must have weight_gate's shape {tuple(weight_gate.shape)}, "
                         f"got {tuple(weight_up.shape)}")


def _same_strides(weight_gate, weight_up):
    """The two weights in one layout (the kernel reads both through one pair of strides): contiguous
    copies where their strides differ."""
    if weight_gate.stride() == weight_up.stride():
        return weight_gate, weight_up
    return weight_gate.contiguous(), weight_up.contiguous()


def _gated_fwd(input, weight_gate, weight_up, activation: str | None, save_pre: bool):
    """(y, g, u): y = act(g) * u with g = input Wg^T and u = input Wu^T; g and u are stored only
    when ``save_pre`` (else empty tensors)."""
    _validate_gated(input, weight_gate, weight_up, activation)
    n = weight_gate.shape[0]
    out_shape = (*input.shape[:-1], n)
    y = empty_output(out_shape, input.dtype, input.device)
    g, u = ((empty_output(out_shape, input.dtype, input.device) for _ in range(2)) if save_pre
            else (input.new_empty(0), input.new_empty(0)))
    kept = {"pre": _rows(g), "pre2": _rows(u)} if save_pre else {}
    weight_gate, weight_up = _same_strides(weight_gate, weight_up)
    _matmul(_rows(input), weight_gate, _rows(y), b2=weight_up, activation=ACTIVATIONS[activation],
            gated=GATED_FWD, **kept)
    return y, g, u


def _gated_bwd(grad_output, input, weight_gate, weight_up, g, u, activation: str | None, needs: list[bool]):
    """(dx, dWg, dWu), each None where ``needs`` says not wanted: dg = dy * u * act'(g) and
    du = dy * act(g) in one elementwise pass, then dx = dg Wg + du Wu (one kernel, one accumulator),
    dWg = dg^T x and dWu = du^T x."""
    dy, x = _rows(grad_output), _rows(input)
    dg, du, _ = _activation_backward(dy, _rows(g), ACTIVATIONS[activation], u=_rows(u))
    dx = dwg = dwu = None
    if needs[0]:
        dx = empty_output(input.shape, input.dtype, input.device)
        wg, wu = _same_strides(weight_gate, weight_up)
        _matmul(dg, wg.t(), _rows(dx), a2=du, b2=wu.t(), gated=GATED_DX)
    if needs[1]:
        dwg = empty_output(weight_gate.shape, weight_gate.dtype, weight_gate.device)
        _matmul(dg.t(), x.t(), dwg)
    if needs[2]:
        dwu = empty_output(weight_up.shape, weight_up.dtype, weight_up.device)
        _matmul(du.t(), x.t(), dwu)
    return dx, dwg, dwu


@torch.library.custom_op("tritonkit::gated_linear", mutates_args=())
def _gated_op(input: torch.Tensor, weight_gate: torch.Tensor, weight_up: torch.Tensor, activation: str,
              save_pre: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _gated_fwd(input, weight_gate, weight_up, _activation(activation), save_pre)


@_gated_op.register_fake
def _(input, weight_gate, weight_up, activation, save_pre):
    _validate_gated(input, weight_gate, weight_up, _activation(activation))
    out_shape = (*input.shape[:-1], weight_gate.shape[0])
    kept = out_shape if save_pre else (0,)
    return input.new_empty(out_shape), input.new_empty(kept), input.new_empty(kept)


@torch.library.custom_op("tritonkit::gated_linear_backward", mutates_args=())
def _gated_backward_op(grad_output: torch.Tensor, input: torch.Tensor, weight_gate: torch.Tensor,
                       weight_up: torch.Tensor, g: torch.Tensor, u: torch.Tensor, activation: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _gated_bwd(grad_output, input, weight_gate, weight_up, g, u, _activation(activation), [True] * 3)


@_gated_backward_op.register_fake
def _(grad_output, input, weight_gate, weight_up, g, u, activation):
    return input.new_empty(input.shape), weight_gate.new_empty(weight_gate.shape), weight_up.new_empty(
        weight_up.shape)


def _gated_setup_context(ctx, inputs, output) -> None:
    input, weight_gate, weight_up, activation, save_pre = inputs
    ctx.save_for_backward(input, weight_gate, weight_up, output[1], output[2])
    ctx.activation = activation


def _gated_backward_traced(ctx, grad_output, _grad_g, _grad_u):
    dx, dwg, dwu = _gated_backward_op(grad_output, *ctx.saved_tensors, ctx.activation)
    return dx, dwg, dwu, None, None


_gated_op.register_autograd(_gated_backward_traced, setup_context=_gated_setup_context)


class _GatedLinear(torch.autograd.Function):
    """Eager autograd without the custom-op dispatcher (the compiled path uses the custom op)."""

    @staticmethod
    def forward(ctx, input, weight_gate, weight_up, activation):
        y, g, u = _gated_fwd(input, weight_gate, weight_up, activation, save_pre=True)
        ctx.save_for_backward(input, weight_gate, weight_up, g, u)
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx, grad_output):
        needs = list(ctx.needs_input_grad[:3])
        dx, dwg, dwu = _gated_bwd(grad_output, *ctx.saved_tensors, ctx.activation, needs)
        return dx, dwg, dwu, None


def gated_linear(input: torch.Tensor, weight_gate: torch.Tensor, weight_up: torch.Tensor,
                 activation: str | None = "silu") -> torch.Tensor:
    """``act(input Wg^T) * (input Wu^T)`` in one kernel (SwiGLU with "silu", GeGLU with "gelu" or
    "gelu_tanh"): both products accumulate side by side and neither is written to memory, unless a
    gradient is wanted (the backward reads them). Weights are (out_features, in_features)."""
    if torch.compiler.is_compiling():
        return _gated_op(input, weight_gate, weight_up, activation or "none", True)[0]
    _validate_gated(input, weight_gate, weight_up, activation)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (input, weight_gate, weight_up)):
        return _GatedLinear.apply(input, weight_gate, weight_up, activation)
    return _gated_fwd(input, weight_gate, weight_up, activation, save_pre=False)[0]


# ---------------------------------------------------------------- reference and cost


def linear_reference(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch; pass float64 tensors for the oracle's reference."""
    y = _REFERENCE_ACTIVATIONS[activation](torch.nn.functional.linear(input, weight, bias))
    return y if residual is None else y + residual


def gated_linear_reference(input: torch.Tensor, weight_gate: torch.Tensor, weight_up: torch.Tensor,
                           activation: str | None = "silu") -> torch.Tensor:
    """Plain PyTorch, the eager form the issue compares with: act(x Wg^T) * (x Wu^T)."""
    linear = torch.nn.functional.linear
    return _REFERENCE_ACTIVATIONS[activation](linear(input, weight_gate)) * linear(input, weight_up)


def linear_cost(shape: tuple, dtype: torch.dtype, mode: str = "fwd", bias: bool = True):
    """(M, K, N): 2 M N K FLOPs a matmul (two more backward); the bytes of the operands and output
    (backward: dy and z read, x and W read, dx and dW written, db)."""
    from tritonkit.roofline import Cost

    m, k, n = shape
    size = torch.finfo(dtype).bits // 8
    fwd = Cost(2 * m * n * k, size * (m * k + n * k + m * n + bias * n))
    bwd = Cost(4 * m * n * k, size * (2 * m * n + 2 * m * k + 2 * n * k + bias * n))
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def gated_linear_cost(shape: tuple, dtype: torch.dtype, mode: str = "fwd"):
    """(M, K, N): two products, 4 M N K FLOPs forward and 8 backward; bytes: x, Wg, Wu and y
    (backward: dy, g, u, x, Wg and Wu read, dx, dWg and dWu written)."""
    from tritonkit.roofline import Cost

    m, k, n = shape
    size = torch.finfo(dtype).bits // 8
    fwd = Cost(4 * m * n * k, size * (m * k + 2 * n * k + m * n))
    bwd = Cost(8 * m * n * k, size * (3 * m * n + 2 * m * k + 4 * n * k))
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def _inspect_launches(shape: tuple, dtype: torch.dtype, config: dict | None = None,
                      activation: str | None = "gelu_tanh", forms: tuple = ("linear", "gated")) -> list:
    """The launches of a training step at (M, K, N): linear's forward with bias, ``activation`` and a
    residual (storing z), its backward's elementwise pass (dz, db) and plain dx and dW matmuls
    (without an activation: a bare matmul, dx and dW), then gated_linear's forward, elementwise
    pass (dg, du) and dx (dW as linear's); ``forms`` picks which. ``config`` tiles the matmuls."""

    m, k, n = shape
    code = ACTIVATIONS[activation]
    x, w = torch.empty((m, k), dtype=dtype, device="meta"), torch.empty((n, k), dtype=dtype, device="meta")
    y, b = torch.empty((m, n), dtype=dtype, device="meta"), torch.empty((n,), dtype=dtype, device="meta")
    fwd = (x, w, y, {"bias": b, "residual": y, "pre": y, "activation": code} if code else {})
    matmuls = {"linear": {"fwd": fwd, "bwd dx": (y, w.t(), x, {}), "bwd dw": (y.t(), x.t(), w, {})},
               "gated": {"gated fwd": (x, w, y, {"b2": w, "pre": y, "pre2": y, "activation": code,
                                                 "gated": GATED_FWD}),
                         "gated bwd dx": (y, w.t(), x, {"a2": y, "b2": w.t(), "gated": GATED_DX})}}
    gate = code or ACTIVATIONS["silu"]
    elementwise = {"linear": ("bwd dz (elementwise)", (y, y, None, y if code else None, None, code, True)),
                   "gated": ("gated bwd dg du (elementwise)", (y, y, y, y, y, gate, False))}
    launches = []
    for form in forms:
        for name, (a, b_, out, operands) in matmuls[form].items():
            form_config = config or _default_config(operands.get("gated", NOT_GATED))
            _, args, meta = _matmul_args(a, b_, out, config=form_config, **operands)
            launches.append(Launch(name, _linear_kernel, args, meta, form_config))
        if form == "linear" and not code:
            continue  # the bare matmul's backward has no elementwise pass (no bias: no db)
        name, call = elementwise[form]
        _, args, meta = _activation_backward_args(*call)
        launches.append(Launch(name, _activation_backward_kernel, args, meta))
    return launches


# ---------------------------------------------------------------- benchmark registration


def _make_inputs(shape: tuple, dtype: torch.dtype, device, generator: torch.Generator, operands: int = 3):
    """(M, K, N): x (M, K), then W (N, K) and b (N,) (``operands`` 3), W alone (2), or Wg and Wu
    ("gated")."""
    from tritonkit.testing import random_tensor

    m, k, n = shape
    x = random_tensor((m, k), dtype, device, generator=generator)
    if operands == "gated":
        return x, *(random_tensor((n, k), dtype, device, generator=generator) for _ in range(2))
    w = random_tensor((n, k), dtype, device, generator=generator)
    return (x, w, random_tensor((n,), dtype, device, generator=generator)) if operands == 3 else (x, w)


def _addmm_gelu(kwargs: dict):
    """A peer: torch._addmm_activation, cuBLASLt's matmul with bias and its GELU epilogue (tanh)."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (cuBLASLt)"
    return lambda x, w, b: torch._addmm_activation(b, x, w.t(), use_gelu=True)


# (M, K, N), bf16: the MLP's up- and down-projections, a square one, and decode-like rows
BENCH_SHAPES = [((8192, 4096, 16384), "bf16"), ((8192, 16384, 4096), "bf16"), ((4096, 4096, 4096), "bf16"),
                ((16, 4096, 16384), "bf16"), ((128, 4096, 16384), "bf16")]


def _spec(name: str):
    import functools

    from tritonkit.ops import OpSpec

    gated = name == "gated_linear"
    bare = name == "linear_bare"
    activation = "silu" if gated else None if bare else "gelu_tanh"
    return OpSpec(
        name=name,
        family="linear",
        fn=gated_linear if gated else linear,
        reference=gated_linear_reference if gated else linear_reference,
        cost=(gated_linear_cost if gated else functools.partial(linear_cost, bias=not bare)),
        make_inputs=functools.partial(_make_inputs, operands="gated" if gated else 2 if bare else 3),
        grad_inputs=(0, 1) if bare else (0, 1, 2),
        flop_unit="bf16",
        shapes={"interpreter": [((17, 33, 257), "fp16")], "quick": BENCH_SHAPES, "full": BENCH_SHAPES},
        tiny_shape=(4, 64, 64),
        dtypes=DTYPES,
        # linear: with bias and the tanh GELU, against cuBLASLt's fused epilogue; linear_bare: the
        # bare matmul, whose "torch" provider is cuBLAS; gated_linear: SwiGLU
        kwargs={"activation": activation},
        peers={} if gated or bare else {"addmm-gelu": _addmm_gelu},
        inspect=functools.partial(_inspect_launches, activation=activation,
                                  forms=("gated",) if gated else ("linear",)),
    )


SPECS = {name: _spec(name) for name in ("linear", "linear_bare", "gated_linear")}
