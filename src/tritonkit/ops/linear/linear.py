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
every tile that reads it (docs/perf-notes/linear.md).

One kernel serves all the products: C = epilogue(A B^T) with A (M, K) and B (N, K) of any
strides. dx takes A = dz (M, N) and B = W^T (a (K, N) view); dW takes A = dz^T and B = x^T.
The kernels are in ``kernels.py``, the matmul's launches and tuning in ``matmul.py``; this file
holds the maths, the API, the autograd, the references and the costs.

Work. 2 M N K FLOPs a matmul (three in forward plus backward); bytes s (M K + N K + M N) plus the
epilogue's operands (b, the residual, z). At M, N, K in the thousands that is hundreds of FLOPs a
byte, past the ridge: compute-bound, so the roofline is the tensor cores' peak.
"""

from __future__ import annotations

import functools

import torch

from tritonkit._launch import Launch, call_signature, cdiv, scratch
from tritonkit._runtime import empty_output, empty_output_like, sm_count
from tritonkit.dtypes import HALVES
from tritonkit.opdef import as_rows, check_tensor, checked_once, first_derivative_only, op
from tritonkit.ops import Op, Workload
from tritonkit.ops.bias_gelu import NUM_WARPS, row_tiles_per_program, tile_shape
from tritonkit.ops.linear.kernels import (
    ACTIVATIONS,
    GATED_DX,
    GATED_FWD,
    _activation_backward_kernel,
    _gated_activation_kernel,
)
from tritonkit.ops.linear.matmul import (
    REFERENCE_ACTIVATIONS,
    matmul,
    matmul_launches,
    matmul_problem,
    tuning_key,
    unit_stride_bias,
    untuned_tile,
)
from tritonkit.ops.norm import normed
from tritonkit.ops.norm.norm import renormed
from tritonkit.partial_sums import sum_partials_launch
from tritonkit.roofline import Cost

DTYPES = HALVES


def _validate(input, weights: dict, activation, bias=None, residual=None) -> None:
    """Raise TypeError or ValueError naming the argument unless the kernels take the call: input fp16
    or bf16 with at least one dimension; each of ``weights`` (name -> tensor) (out_features,
    in_features); bias (out_features,) and residual (the output's shape) where given; all of input's
    dtype and on its device; an activation of ACTIVATIONS."""
    check_tensor("input", input, min_ndim=1)
    if input.dtype not in DTYPES:
        raise TypeError(f"input must be float16 or bfloat16, got {input.dtype}")
    for name, weight in weights.items():
        _check_operand(name, weight, input)
        if weight.dim() != 2 or weight.shape[1] != input.shape[-1]:
            raise ValueError(
                f"{name} must be (out_features, in_features) with in_features = input's last "
                f"dimension {input.shape[-1]}, got {tuple(weight.shape)}"
            )
    out_features = next(iter(weights.values())).shape[0]
    for name, value, shape in (
        ("bias", bias, (out_features,)),
        ("residual", residual, (*input.shape[:-1], out_features)),
    ):
        if value is not None:
            _check_operand(name, value, input)
            if tuple(value.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
    if activation not in ACTIVATIONS:
        names = ", ".join(repr(a) for a in ACTIVATIONS)
        raise ValueError(f"activation must be one of {names}, got {activation!r}")


def _check_operand(name: str, value, input: torch.Tensor) -> None:
    """A tensor of input's dtype on input's device, else TypeError or ValueError naming it."""
    check_tensor(name, value, device_of=("input", input))
    if value.dtype != input.dtype:
        raise TypeError(f"{name} must have input's dtype {input.dtype}, got {value.dtype}")


# ---------------------------------------------------------------- the backward's elementwise step


@functools.lru_cache(maxsize=1024)
def _elementwise_tiles(m: int, n: int, element_size: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, ROW_TILES) of the elementwise backward on (m, n) over ``sms`` SMs: bias_gelu's
    backward tiles, the same memory-bound pass."""
    block_m, block_n = tile_shape(max(n, 1), element_size)  # m or n = 0: a grid of no programs
    row_tiles = row_tiles_per_program(max(1, cdiv(m, block_m)), cdiv(max(n, 1), block_n), sms)
    return block_m, block_n, row_tiles


def _db_partial(dy: torch.Tensor) -> torch.Tensor:
    """db's fp32 partial sums: one row a program of the elementwise backward on dy's rows."""
    (m, n), device = dy.shape, dy.device
    block_m, _, row_tiles = _elementwise_tiles(m, n, dy.element_size(), sm_count(device))
    return scratch((cdiv(m, block_m * row_tiles), n), torch.float32, device)


def _elementwise_launches(dy, z, u, dz, du, db_partial, activation: int) -> list[Launch]:
    """The elementwise backward's launch on the rows (M, N) of dy: dz = dy * act'(z), or (dz None,
    no activation) db only; gated (u given), dg (into dz) and du; db's partial sums into
    ``db_partial`` where given (:func:`_db_partial`)."""
    (m, n), device = dy.shape, dy.device
    # the GPU's SMs (132 off CUDA), not the matmul's interpreter stand-in for persistent grids
    block_m, block_n, row_tiles = _elementwise_tiles(m, n, dy.element_size(), sm_count(device))
    args = (dy, z, u, dz, du, db_partial, m, n, *dy.stride())  # None where absent: flags leave them
    meta = {
        "ACTIVATION": activation,
        "GATED": u is not None,
        "STORE_DZ": dz is not None,
        "SUM_DB": db_partial is not None,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "ROW_TILES": row_tiles,
        "num_warps": NUM_WARPS,
    }
    name = "gated bwd dg du (elementwise)" if u is not None else "bwd dz (elementwise)"
    grid = (cdiv(m, block_m * row_tiles), cdiv(n, block_n))
    return [Launch(name, _activation_backward_kernel, args, meta, grid=grid)]


def _activation_backward(dy, z, activation: int, *, u=None, db=None, in_place: bool = False):
    """(dz, du) of the rows (M, N) of dy: dz = dy * act'(z), or dy itself when there is no
    activation; gated (u given), dz = dg = dy * u * act'(z) and du = dy * act(z); into ``db`` where
    given, the sums of dz over the rows (fp32 partials a program, then the norms' second stage,
    which casts as it stores: launches alone, so that the op replays). ``in_place``: dz (dg) into
    z's memory and du into u's (each element is read before it is written, by the same thread)."""
    gated, store = u is not None, bool(activation) or u is not None
    (m, n), device = dy.shape, dy.device
    dz = (z if in_place else scratch((m, n), dy.dtype, device)) if store else dy
    du = (u if in_place else scratch((m, n), dy.dtype, device)) if gated else None
    if not (store or db is not None):
        return dz, du
    db_partial = _db_partial(dy) if db is not None else None
    if m and n:
        for launch in _elementwise_launches(dy, z, u, dz if store else None, du, db_partial, activation):
            launch.run()
    if db is not None and n:  # (no rows: no partials, and the sum stores zeros)
        sum_partials_launch(None, db_partial, None, db).run()
    return dz, du


# ---------------------------------------------------------------- ops and autograd: linear


@op("linear", mutates=("y", "pre"), replay=True)
def _linear_forward(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    activation: str | None,
    y: torch.Tensor,
    pre: torch.Tensor | None,
) -> None:
    """y = act(input weight^T + bias) + residual into ``y`` (the output's shape, contiguous), and the
    pre-activation z = input weight^T + bias into ``pre`` where given (the backward reads it)."""
    matmul(
        as_rows(input),
        weight,
        as_rows(y),
        bias=bias,
        residual=None if residual is None else as_rows(residual),
        pre=None if pre is None else as_rows(pre),
        activation=ACTIVATIONS[activation],
    )


def _linear_backward_pass(grad_output, input, weight, pre, activation, dx, dw, db, in_place):
    """dx, dW and db of y = act(x W^T + b) + r, each into its tensor where given; ``pre`` is the
    forward's z (None without an activation), dz written over it where ``in_place``. dW before dx,
    which reads no x: dx may be x's own memory (a norm's output made again, ``_input_again``)."""
    code = ACTIVATIONS[activation]
    dz, _ = _activation_backward(
        as_rows(grad_output), as_rows(pre) if code else None, code, db=db, in_place=in_place
    )
    if dw is not None:  # dW = dz^T x: A = dz^T (N, M), B = x^T (K, M)
        matmul(dz.t(), as_rows(input).t(), dw)
    if dx is not None:  # dx = dz W: A = dz (M, N), B = W^T, a (K, N) view
        matmul(dz, weight.t(), as_rows(dx))


@op("linear_backward", mutates=("dx", "dw", "db"), replay=True)
def _linear_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    pre: torch.Tensor | None,
    activation: str | None,
    dx: torch.Tensor | None,
    dw: torch.Tensor | None,
    db: torch.Tensor | None,
) -> None:
    """linear's backward (``_linear_backward_pass``), pre left as it is."""
    _linear_backward_pass(grad_output, input, weight, pre, activation, dx, dw, db, False)


@op("linear_backward_spending_pre", mutates=("pre", "dx", "dw", "db"), replay=True)
def _linear_backward_spending_pre(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    pre: torch.Tensor | None,
    activation: str | None,
    dx: torch.Tensor | None,
    dw: torch.Tensor | None,
    db: torch.Tensor | None,
) -> None:
    """linear's backward with dz written over the forward's saved pre-activation, which it leaves
    holding it: the eager backward's with an activation (one fewer (M, N) buffer at its peak)."""
    _linear_backward_pass(grad_output, input, weight, pre, activation, dx, dw, db, True)


def _linear(input, weight, bias, residual, activation: str | None, keep_pre: bool):
    """(y, z): the output, and its pre-activation where ``keep_pre`` and there is an activation
    (else None)."""
    out_shape = (*input.shape[:-1], weight.shape[0])
    y = empty_output(out_shape, input.dtype, input.device)
    pre = empty_output(out_shape, input.dtype, input.device) if keep_pre and activation is not None else None
    _linear_forward(input, weight, bias, residual, activation, y, pre)
    return y, pre


def _saved_input(ctx, input) -> tuple:
    """What a projection's forward saves for its input: the input, or where it is a tritonkit norm's
    output, how to make it again (``normed.recipe``: the norm's own saved input, weight and bias),
    so that the caller's dropping it frees it; eager calls only."""
    made = None if torch.compiler.is_compiling() else normed.recipe(input)
    ctx.normed = made and (made.eps, made.rms)
    return (input,) if made is None else made.tensors()


def _input_again(ctx, saved: tuple) -> torch.Tensor:
    """The projection's input in its backward, from what ``_saved_input`` saved."""
    return saved[0] if ctx.normed is None else renormed(*saved, *ctx.normed)


def _dx_for(ctx, input: torch.Tensor, needs_dx: bool) -> torch.Tensor | None:
    """The input's gradient's tensor: where the input was made again for this backward, its own
    memory (the passes compute the weights' gradients, the only readers of x, before dx), so that
    the remade input costs the backward's peak nothing; else a new one."""
    if not needs_dx:
        return None
    return input if ctx.normed is not None else empty_output_like(input)


class _Linear(torch.autograd.Function):
    """One autograd function for eager calls and torch.compile (the ops skip the dispatcher eagerly).

    forward takes ctx itself: a separate setup_context costs an inspect.signature bind per call.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, residual, activation):
        y, pre = _linear(input, weight, bias, residual, activation, keep_pre=True)
        # bias: a second backward's pre (below); a norm's output, how to make it again (normed.py)
        ctx.save_for_backward(*_saved_input(ctx, input), weight, bias, pre)
        ctx.activation = activation
        return y

    @staticmethod
    @first_derivative_only("linear")
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors
        input, (weight, bias, pre) = _input_again(ctx, saved[:-3]), saved[-3:]
        needs_dx, needs_dw, needs_db, needs_dr = ctx.needs_input_grad[:4]
        dx = _dx_for(ctx, input, needs_dx)
        dw = empty_output_like(weight) if needs_dw else None
        db = empty_output(weight.shape[:1], weight.dtype, weight.device) if needs_db else None
        if pre is None or torch.compiler.is_compiling():  # (compiled: the graph's buffers are its own)
            _linear_backward(grad_output, input, weight, pre, ctx.activation, dx, dw, db)
            return dx, dw, db, grad_output if needs_dr else None, None
        if getattr(ctx, "pre_spent", False):
            # a second backward (retain_graph): the first left its dz in pre
            _, pre = _linear(input, weight, bias, None, ctx.activation, keep_pre=True)
        ctx.pre_spent = True
        _linear_backward_spending_pre(grad_output, input, weight, pre, ctx.activation, dx, dw, db)
        return dx, dw, db, grad_output if needs_dr else None, None


def linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(F.linear(input, weight, bias)) + residual`` in one matmul: weight is (out_features,
    in_features) as in ``torch.nn.functional.linear``, input has any leading dimensions, the
    activation is one of None, "gelu", "gelu_tanh", "silu", "relu", "relu2" (squared ReLU), and
    the residual, of the output's shape, is added after it. fp16 or bf16; fp32 accumulation."""
    _validate(input, {"weight": weight}, activation, bias, residual)
    bias = unit_stride_bias(bias)
    tensors = (input, weight, bias, residual)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _Linear.apply(input, weight, bias, residual, activation)
    return _linear(input, weight, bias, residual, activation, keep_pre=False)[0]


# ---------------------------------------------------------------- ops and autograd: gated_linear


def _validate_gated(input, weight_gate, weight_up, activation) -> None:
    """:func:`_validate` for gated_linear's two weights, which must also share one shape."""
    _validate(input, {"weight_gate": weight_gate, "weight_up": weight_up}, activation)
    if weight_up.shape != weight_gate.shape:
        raise ValueError(
            f"weight_up must have weight_gate's shape {tuple(weight_gate.shape)}, "
            f"got {tuple(weight_up.shape)}"
        )


_validate_gated_once = checked_once(
    _validate_gated,
    lambda input, weight_gate, weight_up, activation: call_signature(
        (input, weight_gate, weight_up), activation
    ),
)


def _same_strides(weight_gate, weight_up):
    """The two weights in one layout (the kernel reads both through one pair of strides): contiguous
    copies where their strides differ."""
    if weight_gate.stride() == weight_up.stride():
        return weight_gate, weight_up
    return weight_gate.contiguous(), weight_up.contiguous()


GATED_BLOCK = 4096  # elements a program of the act(g) * u pass: 8 x 16 bytes a thread of 4 warps (16-bit)
# Rows from which the forward is two plain matmuls and an elementwise act(g) * u, with or without a
# gradient (the same values either way), rather than one kernel: measured faster at 8192 and 16384
# rows of the layers' MLPs on the H200 (4-9%; docs/perf-notes/linear.md, "The gated forward as two
# matmuls"), not measured below. Without a gradient it holds g and u for the pass: 2 M N elements.
# The backward's dx, dg Wg + du Wu, is one kernel at every row count: its two products take turns, a
# tile of A and of B a step, on a plain matmul's stages. At 8192 rows of Llama-3-8B's MLP on the
# H200, hot, 2.75 ms on 128 x 256 tiles against two plain matmuls' 2.87-2.91 (the second adding the
# first's C as its residual) and cuBLAS's mm and addmm 2.77-2.86 (docs/perf-notes/linear.md, "The
# gated dx's products in turn").
SPLIT_ROWS = 8192


def _gated_activation_launch(g, u, y, activation: int) -> Launch:
    """y = act(g) * u, element by element, over three contiguous tensors of one shape."""
    numel = g.numel()
    meta = {"ACTIVATION": activation, "BLOCK": GATED_BLOCK, "num_warps": NUM_WARPS}
    grid = (cdiv(numel, GATED_BLOCK),)
    args = (g, u, y, numel)
    return Launch("gated fwd act(g) * u (elementwise)", _gated_activation_kernel, args, meta, grid=grid)


@op("gated_linear", mutates=("y", "g", "u"), replay=True)
def _gated_forward(
    input: torch.Tensor,
    weight_gate: torch.Tensor,
    weight_up: torch.Tensor,
    activation: str | None,
    y: torch.Tensor,
    g: torch.Tensor | None,
    u: torch.Tensor | None,
) -> None:
    """y = act(g) * u with g = input Wg^T and u = input Wu^T into ``y``, and g and u into theirs
    where given (the backward reads them).

    Below SPLIT_ROWS rows, one kernel: both products accumulated side by side, stored only where
    given. From SPLIT_ROWS, two plain matmuls and an elementwise pass: the one kernel's two
    accumulators and the activation's temporaries (255 registers a thread) leave no room to overlap a
    tile's epilogue with the next tile's loads, which the plain matmul's persistent tile does."""
    x, code = as_rows(input), ACTIVATIONS[activation]
    if x.shape[0] < SPLIT_ROWS:
        weight_gate, weight_up = _same_strides(weight_gate, weight_up)
        pre, pre2 = (None, None) if g is None else (as_rows(g), as_rows(u))
        matmul(x, weight_gate, as_rows(y), b2=weight_up, activation=code, gated=GATED_FWD, pre=pre, pre2=pre2)
        return
    if g is None:
        g, u = (scratch(y.shape, y.dtype, y.device) for _ in range(2))
    matmul(x, weight_gate, as_rows(g))
    matmul(x, weight_up, as_rows(u))
    if y.numel():
        _gated_activation_launch(g, u, y, code).run()


def _gated_backward_pass(
    grad_output, input, weight_gate, weight_up, g, u, activation, dx, dwg, dwu, in_place
):
    """dx, dWg and dWu, each into its tensor where given: dg = dy * u * act'(g) and du = dy * act(g)
    in one elementwise pass (into g's and u's memory where ``in_place``), then dx = dg Wg + du Wu
    (one kernel, one accumulator), dWg = dg^T x
    and dWu = du^T x. The weights' before dx, which reads no x: dx may be x's own memory (a norm's
    output made again, ``_input_again``)."""
    dg, du = _activation_backward(
        as_rows(grad_output), as_rows(g), ACTIVATIONS[activation], u=as_rows(u), in_place=in_place
    )
    x = as_rows(input) if dwg is not None or dwu is not None else None  # a copy where no view will do
    if dwg is not None:
        matmul(dg.t(), x.t(), dwg)
    if dwu is not None:
        matmul(du.t(), x.t(), dwu)
    if dx is not None:
        wg, wu = _same_strides(weight_gate, weight_up)
        matmul(dg, wg.t(), as_rows(dx), a2=du, b2=wu.t(), gated=GATED_DX)


@op("gated_linear_backward", mutates=("dx", "dwg", "dwu"), replay=True)
def _gated_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight_gate: torch.Tensor,
    weight_up: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    activation: str | None,
    dx: torch.Tensor | None,
    dwg: torch.Tensor | None,
    dwu: torch.Tensor | None,
) -> None:
    """gated_linear's backward (``_gated_backward_pass``), g and u left as they are."""
    _gated_backward_pass(grad_output, input, weight_gate, weight_up, g, u, activation, dx, dwg, dwu, False)


@op("gated_linear_backward_spending_products", mutates=("g", "u", "dx", "dwg", "dwu"), replay=True)
def _gated_backward_spending_products(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight_gate: torch.Tensor,
    weight_up: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    activation: str | None,
    dx: torch.Tensor | None,
    dwg: torch.Tensor | None,
    dwu: torch.Tensor | None,
) -> None:
    """gated_linear's backward with dg and du written over g and u, which it leaves holding them:
    the eager backward's (the products are the forward's saved tensors, read by nothing after it);
    two fewer (M, N) buffers at the backward's peak, 448 MiB at a Llama-3-8B MLP's 8192 tokens."""
    _gated_backward_pass(grad_output, input, weight_gate, weight_up, g, u, activation, dx, dwg, dwu, True)


def _gated_linear(input, weight_gate, weight_up, activation: str | None, keep_products: bool):
    """(y, g, u): the output, and the two products where ``keep_products`` (else None)."""
    out_shape = (*input.shape[:-1], weight_gate.shape[0])
    y = empty_output(out_shape, input.dtype, input.device)
    g, u = (
        (empty_output(out_shape, input.dtype, input.device) for _ in range(2))
        if keep_products
        else (None, None)
    )
    _gated_forward(input, weight_gate, weight_up, activation, y, g, u)
    return y, g, u


class _GatedLinear(torch.autograd.Function):
    """One autograd function for eager calls and torch.compile (the ops skip the dispatcher eagerly)."""

    @staticmethod
    def forward(ctx, input, weight_gate, weight_up, activation):
        y, g, u = _gated_linear(input, weight_gate, weight_up, activation, keep_products=True)
        ctx.save_for_backward(*_saved_input(ctx, input), weight_gate, weight_up, g, u)
        ctx.activation = activation
        return y

    @staticmethod
    @first_derivative_only("gated_linear")
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors
        input, (weight_gate, weight_up, g, u) = _input_again(ctx, saved[:-4]), saved[-4:]
        needs_dx, needs_dwg, needs_dwu = ctx.needs_input_grad[:3]
        dx = _dx_for(ctx, input, needs_dx)
        dwg = empty_output_like(weight_gate) if needs_dwg else None
        dwu = empty_output_like(weight_up) if needs_dwu else None
        backward = _gated_backward_spending_products
        if torch.compiler.is_compiling():  # the graph's buffers are the compiler's to reuse
            backward = _gated_backward
        elif getattr(ctx, "products_spent", False):
            # a second backward (retain_graph): the first left its gradients in g and u
            _, g, u = _gated_linear(input, weight_gate, weight_up, ctx.activation, keep_products=True)
        ctx.products_spent = True
        backward(grad_output, input, weight_gate, weight_up, g, u, ctx.activation, dx, dwg, dwu)
        return dx, dwg, dwu, None


def gated_linear(
    input: torch.Tensor, weight_gate: torch.Tensor, weight_up: torch.Tensor, activation: str | None = "silu"
) -> torch.Tensor:
    """``act(input Wg^T) * (input Wu^T)`` (SwiGLU with "silu", GeGLU with "gelu" or "gelu_tanh"):
    below SPLIT_ROWS rows in one kernel, both products accumulated side by side and written to memory
    only when a gradient is wanted (the backward reads them); from SPLIT_ROWS rows two matmuls and an
    elementwise act(g) * u. Weights are (out_features, in_features)."""
    _validate_gated_once(input, weight_gate, weight_up, activation)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (input, weight_gate, weight_up)):
        return _GatedLinear.apply(input, weight_gate, weight_up, activation)
    return _gated_linear(input, weight_gate, weight_up, activation, keep_products=False)[0]


# ---------------------------------------------------------------- reference and cost


def linear_reference(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch; pass float64 tensors for the oracle's reference."""
    y = REFERENCE_ACTIVATIONS[activation](torch.nn.functional.linear(input, weight, bias))
    return y if residual is None else y + residual


def gated_linear_reference(
    input: torch.Tensor, weight_gate: torch.Tensor, weight_up: torch.Tensor, activation: str | None = "silu"
) -> torch.Tensor:
    """Plain PyTorch, the eager form the issue compares with: act(x Wg^T) * (x Wu^T)."""
    linear = torch.nn.functional.linear
    return REFERENCE_ACTIVATIONS[activation](linear(input, weight_gate)) * linear(input, weight_up)


def linear_cost(
    shape: tuple, dtype: torch.dtype, mode: str = "fwd", bias: bool = True, activation: bool = True
):
    """(M, K, N): 2 M N K FLOPs a matmul (two more backward); the bytes of the operands and output
    (backward: dy read, and the pre-activation z where there is an activation, x and W read, dx
    and dW written, db)."""
    m, k, n = shape
    size = torch.finfo(dtype).bits // 8
    fwd = Cost(2 * m * n * k, size * (m * k + n * k + m * n + bias * n))
    bwd = Cost(4 * m * n * k, size * ((1 + activation) * m * n + 2 * m * k + 2 * n * k + bias * n))
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def gated_linear_cost(shape: tuple, dtype: torch.dtype, mode: str = "fwd"):
    """(M, K, N): two products, 4 M N K FLOPs forward and 8 backward; bytes: x, Wg, Wu and y
    (backward: dy, g, u, x, Wg and Wu read, dx, dWg and dWu written)."""
    m, k, n = shape
    size = torch.finfo(dtype).bits // 8
    fwd = Cost(4 * m * n * k, size * (m * k + 2 * n * k + m * n))
    bwd = Cost(8 * m * n * k, size * (3 * m * n + 2 * m * k + 4 * n * k))
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def _inspect_launches(
    shape: tuple,
    dtype: torch.dtype,
    config: dict | None = None,
    activation: str | None = "gelu_tanh",
    forms: tuple = ("linear", "gated"),
) -> list[Launch]:
    """The launches of a training step at (M, K, N): linear's forward with bias, ``activation`` and a
    residual (storing z), its backward's elementwise pass (dz, db) and plain dx and dW matmuls
    (without an activation: a bare matmul, dx and dW), then gated_linear's forward (one kernel
    storing g and u; from SPLIT_ROWS rows linear's matmuls and the act(g) * u pass), its backward's
    elementwise pass (dg, du) and dx (one kernel; dW as linear's); ``forms`` picks which. ``config``
    tiles the matmuls (default: each form's untuned tile). What ``tritonkit inspect`` compiles."""
    m, k, n = shape
    code = ACTIVATIONS[activation]
    x, w = torch.empty((m, k), dtype=dtype, device="meta"), torch.empty((n, k), dtype=dtype, device="meta")
    y, b = torch.empty((m, n), dtype=dtype, device="meta"), torch.empty((n,), dtype=dtype, device="meta")
    epilogue = {"bias": b, "residual": y, "pre": y, "activation": code} if code else {}
    matmuls = {
        "linear": {
            "fwd": matmul_problem(x, w, y, **epilogue),
            "bwd dx": matmul_problem(y, w.t(), x),
            "bwd dw": matmul_problem(y.t(), x.t(), w),
        },
        "gated": {
            "gated fwd": matmul_problem(x, w, y, b2=w, pre=y, pre2=y, activation=code, gated=GATED_FWD),
            "gated bwd dx": matmul_problem(y, w.t(), x, a2=y, b2=w.t(), gated=GATED_DX),
        },
    }
    gate = code or ACTIVATIONS["silu"]
    elementwise = {
        "linear": (y, y, None, y, None, _db_partial(y), code),  # dy, z, u, dz, du, db, act
        "gated": (y, y, y, y, y, None, gate),
    }
    launches = []
    for form in forms:
        for name, problem in matmuls[form].items():
            tile = config or untuned_tile(tuning_key(problem))
            launches += [launch._replace(name=name) for launch in matmul_launches(problem, tile)]
        if form == "gated":  # from SPLIT_ROWS rows: g and u by linear's plain matmuls, then act(g) * u
            launches.append(_gated_activation_launch(y, y, y, gate))
        if form == "linear" and not code:
            continue  # the bare matmul's backward has no elementwise pass (no bias: no db)
        launches += _elementwise_launches(*elementwise[form])
    return launches


# ---------------------------------------------------------------- the registry's ops and workloads


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
BENCH_SHAPES = [
    ((8192, 4096, 16384), "bf16"),
    ((8192, 16384, 4096), "bf16"),
    ((4096, 4096, 4096), "bf16"),
    ((16, 4096, 16384), "bf16"),
    ((128, 4096, 16384), "bf16"),
]


def _op(name: str) -> Op:
    """linear: with bias and the tanh GELU; linear_bare: the bare matmul (no bias, no activation: its
    backward has no elementwise pass); gated_linear: SwiGLU."""
    gated = name == "gated_linear"
    bare = name == "linear_bare"
    activation = "silu" if gated else None if bare else "gelu_tanh"
    return Op(
        name=name,
        family="linear",
        fn=gated_linear if gated else linear,
        reference=gated_linear_reference if gated else linear_reference,
        cost=(
            gated_linear_cost if gated else functools.partial(linear_cost, bias=not bare, activation=not bare)
        ),
        make_inputs=functools.partial(_make_inputs, operands="gated" if gated else 2 if bare else 3),
        grad_inputs=(0, 1) if bare else (0, 1, 2),
        shapes=[((17, 33, 257), "fp16")],
        dims=("rows M", "in features K", "out features N"),
        dtypes=DTYPES,
        kwargs={"activation": activation},
        inspect=functools.partial(
            _inspect_launches, activation=activation, forms=("gated",) if gated else ("linear",)
        ),
    )


OPS = {name: _op(name) for name in ("linear", "linear_bare", "gated_linear")}
# linear against cuBLASLt's fused epilogue; linear_bare's "torch" provider is cuBLAS
WORKLOADS = {
    name: Workload(
        name=name,
        op=OPS[name],
        flop_unit="bf16",
        shapes={"quick": BENCH_SHAPES, "full": BENCH_SHAPES},
        tiny_shape=(4, 64, 64),
        peers={"addmm-gelu": _addmm_gelu} if name == "linear" else {},
    )
    for name in OPS
}
