"""The loss of an LM head without its logits: ``F.cross_entropy(F.linear(input, weight, bias),
target, ...)`` with the (N, V) logits never held whole, on tritonkit's matmul and cross-entropy
kernels.

Maths. z = x W^T + b (x: (N, H), W: (V, H)); the loss and its gradient dz are cross_entropy's
(``ops/cross_entropy.py``, whose docstring has them: class weights, ignore_index, smoothing, the
z-loss, the soft cap), and then
    dx = dz W,   dW = dz^T x,   db = sum over rows of dz.

Structure. The forward walks the tokens in chunks: a chunk's logits (rows x V, in the input's
dtype) by the matmul kernel, then cross_entropy's row kernel writes the chunk's losses and lse;
one sum kernel reduces them at the end. The backward walks the vocabulary in blocks, so that dW
needs no accumulator: a block's logits for every token again (N x Vb), cross_entropy's backward
kernel turns them into dz in place from the forward's lse, then dW's rows of the block = dz^T x
(written once, in W's dtype), db's = the column sums, and dx += dz W_block into an fp32 (N, H)
accumulator (the matmul's residual epilogue from the second block on: one rounding a block, to
fp32). CHUNK_BYTES bounds what a chunk or block of logits takes.

Work. Four matmuls of 2 N V H FLOPs (the forward's logits, the backward's again, dx, dW) against
three for torch (which keeps the logits): a third more arithmetic for memory that does not grow
with N V. Bytes besides the matmuls': the logits written and read by the cross-entropy kernels,
twice in the backward (2 + 3 N V s), and the fp32 dx accumulator read and written once a block.
"""

from __future__ import annotations

import torch

from tritonkit._runtime import empty_output
from tritonkit.dtypes import HALVES
from tritonkit.opdef import check_tensor, first_derivative_only, op
from tritonkit.ops import Op, Workload
from tritonkit.ops import cross_entropy as ce
from tritonkit.ops.linear.matmul import matmul

DTYPES = HALVES  # the matmul kernels take fp16 and bf16 operands
CHUNK_BYTES = 256 * 2**20  # logits a chunk (forward) or block (backward) may hold
ROW_ALIGN = 64  # chunks and blocks a multiple of this many rows or classes (a matmul tile's)


def _span(per_row_bytes: int, total: int) -> int:
    """Rows (or classes) a chunk takes: as many as CHUNK_BYTES holds, a multiple of ROW_ALIGN, at
    least one ROW_ALIGN, at most ``total``."""
    rows = max(ROW_ALIGN, CHUNK_BYTES // max(per_row_bytes, 1) // ROW_ALIGN * ROW_ALIGN)
    return max(1, min(rows, total))


# ---------------------------------------------------------------- ops


@op("linear_cross_entropy", mutates=("out", "rows", "lse", "row_weight", "totals"))
def _forward(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    smoothing: float,
    z_loss: float,
    softcap: float,
    out: torch.Tensor,
    rows: torch.Tensor | None,
    lse: torch.Tensor,
    row_weight: torch.Tensor | None,
    totals: torch.Tensor | None,
) -> None:
    """The loss into ``out`` (and the rows' losses, lse and sums, as cross_entropy's forward)."""
    options = (ignore_index, reduction, smoothing, z_loss, softcap)
    (n, _), vocab = input.shape, weight.shape[0]
    chunk = _span(vocab * input.element_size(), n)
    logits = empty_output((chunk, vocab), input.dtype, input.device)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        part = logits[: end - start]
        matmul(input[start:end], weight, part, bias=bias)
        sliced = (
            out[start:end] if reduction == "none" else out,
            None if rows is None else rows[start:end],
            lse[start:end],
            None if row_weight is None else row_weight[start:end],
            None,  # the sums after every chunk
        )
        for launch in ce._fwd_launches(part, target[start:end], class_weight, options, sliced):
            launch.run()
    if totals is not None:
        ce.sum_launch(class_weight, options, (out, rows, lse, row_weight, totals), n, vocab).run()


@op("linear_cross_entropy_backward", mutates=("dx", "dw", "db"))
def _backward(
    grad: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    lse: torch.Tensor,
    totals: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    smoothing: float,
    z_loss: float,
    softcap: float,
    dx: torch.Tensor | None,
    dw: torch.Tensor | None,
    db: torch.Tensor | None,
) -> None:
    """dx, dW and db, each into its tensor where given, a block of the vocabulary at a time."""
    options = (ignore_index, reduction, smoothing, z_loss, softcap)
    (n, hidden), vocab = input.shape, weight.shape[0]
    if n == 0:  # no token: no logits, and dW and db sum over nothing
        for grad_of_param in (dw, db):
            if grad_of_param is not None:
                grad_of_param.zero_()
        return
    block = _span(n * input.element_size(), vocab)
    buffer = empty_output((n * block,), input.dtype, input.device)
    dx_acc = empty_output((n, hidden), torch.float32, input.device) if dx is not None else None
    for start in range(0, vocab, block):
        end = min(start + block, vocab)
        dz = buffer[: n * (end - start)].view(n, end - start)
        w_block = weight[start:end]
        matmul(input, w_block, dz, bias=None if bias is None else bias[start:end])
        for launch in ce._bwd_launches(
            grad, None, dz, target, class_weight, lse, totals, options, dz, col0=start, classes=vocab
        ):
            launch.run()
        if dw is not None:  # dW's rows of the block = dz^T x: A = dz^T (Vb, N), B = x^T (H, N)
            matmul(dz.t(), input.t(), dw[start:end])
        if db is not None:
            db[start:end].copy_(dz.sum(0, dtype=torch.float32))
        if dx_acc is not None:  # dx (+)= dz W_block: A = dz (N, Vb), B = W_block^T (H, Vb)
            matmul(dz, w_block.t(), dx_acc, residual=dx_acc if start else None)
    if dx is not None:
        dx.copy_(dx_acc)


# ---------------------------------------------------------------- autograd and API


class _LinearCrossEntropy(torch.autograd.Function):
    """One autograd function for eager calls and torch.compile (the ops skip the dispatcher eagerly)."""

    @staticmethod
    def forward(ctx, input, weight, bias, target, class_weight, *options):
        # cross_entropy's outputs: its _outputs reads only N, the dtype and the device of its input
        outputs = ce._outputs(input, options[1], ce._needs_sums(options[1], class_weight, options[2]))
        _forward(input, weight, bias, target, class_weight, *options, *outputs)
        ctx.save_for_backward(input, weight, bias, target, class_weight, outputs[2], outputs[4])
        ctx.options = options
        return outputs[0]

    @staticmethod
    @first_derivative_only("linear_cross_entropy")
    def backward(ctx, grad):
        input, weight, bias, target, class_weight, lse, totals = ctx.saved_tensors
        needs_dx, needs_dw, needs_db = ctx.needs_input_grad[:3]
        grad = grad.expand(1) if grad.dim() == 0 else grad
        dx = empty_output(input.shape, input.dtype, input.device) if needs_dx else None
        dw = empty_output(weight.shape, weight.dtype, weight.device) if needs_dw else None
        db = empty_output(bias.shape, bias.dtype, bias.device) if needs_db else None
        _backward(grad, input, weight, bias, target, class_weight, lse, totals, *ctx.options, dx, dw, db)
        return dx, dw, db, None, None, None, None, None, None, None


def _validate(input, weight, target, bias, class_weight) -> None:
    check_tensor("input", input, dtypes=DTYPES, min_ndim=1)
    check_tensor("weight", weight, dtypes=(input.dtype,), ndim=2, device_of=("input", input))
    if weight.shape[1] != input.shape[-1]:
        raise ValueError(
            f"weight must be (V, {input.shape[-1]}) for input's last dim {input.shape[-1]}, got "
            f"{tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one row (class)")
    if bias is not None:
        check_tensor("bias", bias, dtypes=(input.dtype,), ndim=1, device_of=("input", input))
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must have V = {weight.shape[0]} entries, got {bias.shape[0]}")
    if isinstance(target, torch.Tensor) and target.is_floating_point():
        raise NotImplementedError(
            "linear_cross_entropy takes class indices as target; class probabilities are not supported"
        )
    check_tensor("target", target, dtypes=ce.TARGET_DTYPES, device_of=("input", input))
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(
            f"target must have input's leading shape {tuple(input.shape[:-1])}, got {tuple(target.shape)}"
        )
    if class_weight is not None and class_weight.requires_grad:
        raise NotImplementedError("linear_cross_entropy has no gradient for class_weight: pass it detached")


def linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    class_weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    softcap: float | None = None,
):
    """``F.cross_entropy(F.linear(input, weight, bias), target, class_weight, ignore_index=...,
    reduction=..., label_smoothing=...)`` without ever holding the (N, V) logits: ``input`` (..., H)
    fp16 or bf16, ``weight`` (V, H) and ``bias`` (V,) of its dtype, ``target`` of input's leading
    shape (int64 or int32 class indices). ``z_loss`` and ``softcap`` as :func:`tritonkit.cross_entropy`;
    the loss has input's dtype, and with reduction "none" target's shape. Gradients for input,
    weight and bias. A target outside 0..V-1 other than ignore_index gives its row (and a sum or
    mean) NaN rather than an error, as cross_entropy."""
    label_smoothing, z_loss = float(label_smoothing), float(z_loss)
    _validate(input, weight, target, bias, class_weight)
    rows_in = input.reshape(-1, input.shape[-1])
    rows_target = target.reshape(-1)
    logits_like = torch.empty((0, weight.shape[0]), dtype=input.dtype, device=input.device)
    ce._validate(logits_like, rows_target[:0], class_weight, reduction, label_smoothing, z_loss, softcap)
    options = (int(ignore_index), reduction, label_smoothing, z_loss, float(softcap or 0.0))
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias))
    if grads:
        loss = _LinearCrossEntropy.apply(rows_in, weight, bias, rows_target, class_weight, *options)
    else:
        outputs = ce._outputs(rows_in, reduction, ce._needs_sums(reduction, class_weight, label_smoothing))
        _forward(rows_in, weight, bias, rows_target, class_weight, *options, *outputs)
        loss = outputs[0]
    return loss.view(target.shape) if reduction == "none" else loss


# ---------------------------------------------------------------- reference


def linear_cross_entropy_reference(
    input, weight, target, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, *,
    class_weight=None, z_loss=0.0, softcap=None,
):  # fmt: skip
    """Plain PyTorch: the logits by ``F.linear``, then cross_entropy's reference; pass float64
    tensors for the oracle's reference."""
    logits = torch.nn.functional.linear(input.reshape(-1, input.shape[-1]), weight, bias)
    loss = ce.cross_entropy_reference(
        logits, target.reshape(-1), class_weight, ignore_index, reduction, label_smoothing, z_loss=z_loss,
        softcap=softcap,
    )  # fmt: skip
    return loss.view(target.shape) if reduction == "none" else loss


def linear_cross_entropy_cost(shape: tuple, dtype: torch.dtype, mode: str = "fwd", reduction: str = "mean"):
    """Bytes of the launches at ``shape`` = (N, H, V) (int64 targets, a bias, no class weights):
    the forward reads x, W and b once, writes and reads a chunk of logits, and writes the rows'
    losses, lse and divisor terms, then sums them; the backward reads x, W, b, the targets, lse,
    the upstream gradient and the sums, writes and reads a block of logits (dz in place), writes dW
    and adds into the fp32 dx accumulator. FLOPs: 2 N V H a matmul (one forward, three backward)."""
    from tritonkit.roofline import Cost

    n, hidden, vocab = shape
    size = torch.finfo(dtype).bits // 8
    params = (vocab * hidden + vocab) * size
    rows = {"none": n * size + 4 * n, "sum": 8 * n + size + 12, "mean": 12 * n + size + 12}[reduction]
    chunk = _span(vocab * size, n) if n else 0
    fwd = Cost(
        2 * n * vocab * hidden + 8 * n * vocab,
        n * hidden * size + params + chunk * vocab * size + 8 * n + rows,
    )
    block = _span(n * size, vocab)
    upstream = n * size if reduction == "none" else size
    sums = 0 if reduction == "none" else 12
    bwd_bytes = n * hidden * size + params + n * block * size + 8 * n + 4 * n + upstream + sums
    bwd_bytes += vocab * hidden * size + 4 * n * hidden  # dW, the dx accumulator
    bwd = Cost(6 * n * vocab * hidden + 8 * n * vocab, bwd_bytes)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def _make_inputs(shape: tuple, dtype: torch.dtype, device, generator: torch.Generator) -> tuple:
    """x (N, H), W (V, H) scaled so that the logits are O(1), targets (one in eight ignored), b."""
    from tritonkit.testing import random_tensor

    n, hidden, vocab = shape
    target = torch.randint(0, vocab, (n,), generator=generator).to(device)
    target[::8] = -100
    x = random_tensor((n, hidden), dtype, device, generator=generator)
    w = random_tensor((vocab, hidden), dtype, device, generator=generator) * hidden**-0.5
    return x, w, target, random_tensor((vocab,), dtype, device, generator=generator)


def _liger(kwargs: dict):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def run(input, weight, target, bias=None):
        return liger_fused_linear_cross_entropy(
            input, weight, target, bias, reduction=kwargs.get("reduction", "mean")
        )

    return run


OPS = {
    "linear_cross_entropy": Op(
        name="linear_cross_entropy",
        family="cross_entropy",
        fn=linear_cross_entropy,
        reference=linear_cross_entropy_reference,
        cost=linear_cross_entropy_cost,
        make_inputs=_make_inputs,
        grad_inputs=(0, 1, 3),
        # (N, H, V)
        shapes=[((9, 32, 70), "bf16"), ((5, 16, 40), "fp16")],
        dtypes=DTYPES,
    )
}
WORKLOADS = {
    "linear_cross_entropy": Workload(
        name="linear_cross_entropy",
        op=OPS["linear_cross_entropy"],
        flop_unit="bf16",
        # (tokens, hidden, vocabulary): Llama-3-8B's LM head at 8192 tokens, and smaller vocabularies
        shapes={
            "quick": [((8192, 4096, 128256), "bf16")],
            "full": [((8192, 4096, v), "bf16") for v in (32000, 128256, 262144)],
        },
        tiny_shape=(4, 64, 256),
        peers={"liger": _liger},
    )
}
