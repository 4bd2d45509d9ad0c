"""The loss of an LM head without its logits: ``F.cross_entropy(F.linear(input, weight, bias),
target, ...)`` with the (N, V) logits never held whole, on tritonkit's matmul and cross-entropy
kernels.

Maths. z = x W^T + b (x: (N, H), W: (V, H)); the loss and its gradient dz are cross_entropy's
(``ops/cross_entropy.py``, whose docstring has them: class weights, ignore_index, smoothing, the
z-loss, the soft cap), and then
    dx = dz W,   dW = dz^T x,   db = sum over rows of dz.

Structure. The forward walks the tokens in chunks: a chunk's logits (rows x V, in the input's
dtype) by the matmul kernel, then cross_entropy's row kernel writes the chunk's losses and lse;
one sum kernel reduces them at the end. The gradients go one of two ways (ORDER):
- "tokens" (a sum or mean): in the same forward, chunk by chunk, cross_entropy's backward kernel
  turns the chunk's logits into dz in place (the gradient of the rows' summed losses), then dx's
  rows = dz W (each row by one matmul), dW += dz^T x into an fp32 (V, H) accumulator and db's
  column sums likewise; the backward only scales them by the upstream gradient (and a mean's
  divisor). Three matmuls, as torch's, and V x H x 4 bytes more memory.
- "vocab" (and always for reduction "none", whose upstream gradient weighs each row of dW's sum):
  the backward walks the vocabulary in blocks, so that dW needs no accumulator: a block's logits
  for every token again (N x Vb), dz in place from the forward's lse, then dW's rows of the block
  = dz^T x (written once, in W's dtype), db's = the column sums, and dx += dz W_block into an fp32
  (N, H) accumulator (the matmul's residual epilogue from the second block on). Four matmuls.
CHUNK_BYTES bounds what a chunk or block of logits takes, but where "tokens" sums dW over chunks:
those take at least SUM_MIN_TOKENS tokens (``_forward_chunk``).

Work. Three or four matmuls of 2 N V H FLOPs against three for torch (which keeps the logits).
Bytes besides the matmuls': the logits written and read by the cross-entropy kernels (once a
chunk forward, and a second pass for dz), and the fp32 accumulators read and written once a chunk
or block.
"""

from __future__ import annotations

import torch

from tritonkit._launch import Launch, cdiv
from tritonkit._runtime import empty_output, empty_output_like
from tritonkit._triton import tl, triton
from tritonkit.dtypes import HALVES
from tritonkit.opdef import as_rows, check_tensor, first_derivative_only, op
from tritonkit.ops import Op, Workload
from tritonkit.ops import cross_entropy as ce
from tritonkit.ops.linear.matmul import matmul, unit_stride_bias

DTYPES = HALVES  # the matmul kernels take fp16 and bf16 operands
CHUNK_BYTES = 256 * 2**20  # logits a chunk (forward) or block (backward) may hold
ROW_ALIGN = 64  # chunks and blocks a multiple of this many rows or classes (a matmul tile's)
# How a sum or mean gets its gradients: "tokens" computes them in the forward, chunk by chunk
# (three matmuls; dW summed over the chunks in fp32, unless one chunk takes every token), "vocab"
# recomputes the logits in the backward a block of the vocabulary at a time (four matmuls; no
# accumulator of W's size).
# reduction "none" always takes "vocab": its upstream gradients weigh each row of dW's sum. A call's
# ``order`` argument overrides it.
ORDERS = ("tokens", "vocab")
ORDER = "tokens"


def _span(per_row_bytes: int, total: int) -> int:
    """Rows (or classes) a chunk takes: as many as CHUNK_BYTES holds, a multiple of ROW_ALIGN, at
    least one ROW_ALIGN, at most ``total``."""
    rows = max(ROW_ALIGN, CHUNK_BYTES // max(per_row_bytes, 1) // ROW_ALIGN * ROW_ALIGN)
    return max(1, min(rows, total))


# Tokens a chunk takes at least where the forward sums dW over chunks: each chunk reads and writes
# the V x H fp32 sum (8 V H bytes) beside its three products (6 c H V FLOPs), so the sum's share of
# the time is about 8 / 4.2 TB/s over 6 c / 700 TFLOP/s on the H200, 220 / c: 5% at 4096 tokens,
# 43% at the 512 that 256 MB of 256000-class logits hold (measured at f8304a1: 75.8 ms at 8192 x
# 2048 x 256000 against torch.compile's 46.0).
SUM_MIN_TOKENS = 4096


def _forward_chunk(n: int, vocab: int, hidden: int, size: int, sums_dw: bool) -> int:
    """Tokens a forward chunk takes: ``_span``'s, or every token where the forward computes dW
    (``sums_dw``) and their logits take no more memory than dW's fp32 sum beside a chunk would. Then
    dW is one product, rounded once to W's dtype, with no sum: the sum's traffic (a read and a write
    of V x H fp32 a chunk, 31 GB at 8192 x 4096 x 128256) took about 7.5 of the H200's 50 ms. Where
    the sum stays, chunks of at least SUM_MIN_TOKENS, as even as ROW_ALIGN allows."""
    if sums_dw and n * vocab * size <= vocab * hidden * 4 + CHUNK_BYTES:
        return max(n, 1)
    chunk = _span(vocab * size, n)
    if sums_dw and chunk < n:
        chunks = cdiv(n, max(chunk, SUM_MIN_TOKENS))
        chunk = min(n, cdiv(cdiv(n, chunks), ROW_ALIGN) * ROW_ALIGN)
    return chunk


# ---------------------------------------------------------------- the upstream gradient's scale

SCALE_BLOCK = 4096  # elements a program: 8 x 16 bytes a thread of 4 warps in 16-bit dtypes


@triton.jit
def _scale_kernel(
    x_ptr,  # a gradient of the summed losses, numel elements, contiguous
    out_ptr,  # x times the scale, in its own dtype (x_ptr itself where the dtypes agree)
    grad_ptr,  # the upstream gradient (one element)
    divisor_ptr,  # a mean's divisor, the weight of the rows not ignored (one fp32 element)
    numel,
    MEAN: tl.constexpr,  # scale = grad / divisor (0 where the divisor is 0), else grad
    BLOCK: tl.constexpr,
):
    scale = tl.load(grad_ptr).to(tl.float32)
    if MEAN:
        divisor = tl.load(divisor_ptr)
        # every row ignored: torch's zero gradients (the sums are 0); div_rn as torch divides
        scale = tl.where(divisor != 0, tl.math.div_rn(scale, divisor), 0.0)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, (x * scale).to(out_ptr.dtype.element_ty), mask=mask)


@op("linear_cross_entropy_scale", mutates=("dx", "dw", "db"))
def _scale(
    grad: torch.Tensor,
    divisor: torch.Tensor | None,
    dx: torch.Tensor | None,
    dw: torch.Tensor | None,
    db: torch.Tensor | None,
    dx_sum: torch.Tensor | None,
    dw_sum: torch.Tensor | None,
    db_sum: torch.Tensor | None,
) -> None:
    """Each of dx, dw and db that is given = its gradient of the summed losses times grad (over
    ``divisor`` where given): from its ``*_sum`` where that is given (another dtype), else in place.
    One pass that reads the sum and writes the output, the product in fp32 rounded once."""
    for out, summed in ((dx, dx_sum), (dw, dw_sum), (db, db_sum)):
        if out is None:
            continue
        x = out if summed is None else summed
        args = (x, out, grad, divisor if divisor is not None else grad, x.numel())
        meta = {"MEAN": divisor is not None, "BLOCK": SCALE_BLOCK, "num_warps": 4}
        Launch("scale", _scale_kernel, args, meta, grid=(cdiv(x.numel(), SCALE_BLOCK),)).run()


# ---------------------------------------------------------------- ops


@op("linear_cross_entropy", mutates=("out", "rows", "lse", "row_weight", "totals", "dx", "dw", "db"))
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
    dx: torch.Tensor | None,
    dw: torch.Tensor | None,
    db: torch.Tensor | None,
) -> None:
    """The loss into ``out`` (and the rows' losses, lse and sums, as cross_entropy's forward), a
    chunk of tokens at a time. Where any of dx, dw and db is given (ORDER "tokens", a sum or mean),
    by the same chunks the gradients of the rows' summed losses, which the backward scales by the
    upstream gradient (and a mean's divisor): dx (input's dtype, each row by one matmul), db (fp32,
    summed over the chunks) and dw (``_forward_chunk``: in W's dtype where one chunk takes every
    token, else fp32, summed over the chunks by the matmul's residual epilogue)."""
    options = (ignore_index, reduction, smoothing, z_loss, softcap)
    (n, _), vocab = input.shape, weight.shape[0]
    grads = dx is not None or dw is not None or db is not None
    if grads:
        summed = (ignore_index, "sum", smoothing, z_loss, softcap)  # dz of the rows' sum
        one = torch.ones(1, dtype=torch.float32, device=input.device)
        if class_weight is not None and smoothing > 0:  # the backward kernel's W = sum_c w_c, first
            weights_only = (ignore_index, "none", smoothing, z_loss, softcap)
            for launch in ce.sum_launches(
                class_weight, weights_only, (out, rows, lse, row_weight, totals), n, vocab
            ):
                launch.run()
        if n == 0:  # no token: dW and db sum over nothing
            for grad_of_param in (dw, db):
                if grad_of_param is not None:
                    grad_of_param.zero_()
    chunk = _forward_chunk(n, vocab, input.shape[1], input.element_size(), dw is not None)
    if dw is not None and chunk < n and dw.dtype != torch.float32:
        raise ValueError(f"dw is summed over {-(-n // chunk)} chunks: it must be float32, got {dw.dtype}")
    logits = empty_output((chunk, vocab), input.dtype, input.device)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        dz = logits[: end - start]
        matmul(input[start:end], weight, dz, bias=bias)
        sliced = (
            out[start:end] if reduction == "none" else out,
            None if rows is None else rows[start:end],
            lse[start:end],
            None if row_weight is None else row_weight[start:end],
            None,  # the sums after every chunk
        )
        tokens = target[start:end]
        for launch in ce._fwd_launches(dz, tokens, class_weight, options, sliced):
            launch.run()
        if not grads:
            continue
        for launch in ce._bwd_launches(
            one, None, dz, tokens, class_weight, lse[start:end], totals, summed, dz
        ):
            launch.run()
        if dx is not None:  # dx's rows = dz W: A = dz (rows, V), B = W^T (H, V)
            matmul(dz, weight.t(), dx[start:end])
        if dw is not None:  # dW (+)= dz^T x: A = dz^T (V, rows), B = x^T (H, rows)
            matmul(dz.t(), input[start:end].t(), dw, residual=dw if start else None)
        if db is not None:
            part = dz.sum(0, dtype=torch.float32)
            db.copy_(part) if start == 0 else db.add_(part)
    if totals is not None:
        for launch in ce.sum_launches(class_weight, options, (out, rows, lse, row_weight, totals), n, vocab):
            launch.run()


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
    first_class: int,
    classes: int,
) -> None:
    """dx, dW and db, each into its tensor where given, a block of the vocabulary at a time. The
    weight's rows are classes ``first_class`` on of ``classes`` (all of them, but for one shard of
    a vocabulary split across ranks: ``tritonkit.distributed.vocab_parallel_linear_cross_entropy``),
    and ``lse`` the rows' over every class."""
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
            grad, None, dz, target, class_weight, lse, totals, options, dz, col0=first_class + start,
            classes=classes,
        ):  # fmt: skip
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


def _outputs(
    input: torch.Tensor, reduction: str, sums: bool, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor | None, ...]:
    """(out, rows, lse, row_weight, totals), cross_entropy's kernels' outputs as separate tensors:
    the loss (in ``dtype``, else input's), the rows' fp32 losses a sum or mean reads, the lse, a
    mean's per-row divisor terms, and (``sums``, ``cross_entropy._needs_sums``) the totals; None
    where unused. (cross_entropy's own forward holds the fp32 ones but the lse in one workspace.)"""
    n, device = input.shape[0], input.device
    out = empty_output((n,) if reduction == "none" else (), dtype or input.dtype, device)
    rows = empty_output((n,), torch.float32, device) if reduction != "none" else None
    row_weight = empty_output((n,), torch.float32, device) if reduction == "mean" else None
    totals = empty_output((3,), torch.float32, device) if sums else None
    return out, rows, empty_output((n,), torch.float32, device), row_weight, totals


class _LinearCrossEntropy(torch.autograd.Function):
    """One autograd function for eager calls and torch.compile (the ops skip the dispatcher eagerly)."""

    @staticmethod
    def forward(ctx, input, weight, bias, target, class_weight, loss_dtype, order, *options):
        reduction, smoothing = options[1], options[2]
        outputs = _outputs(input, reduction, ce._needs_sums(reduction, class_weight, smoothing), loss_dtype)
        ctx.options, ctx.in_forward = options, order == "tokens" and reduction != "none"
        ctx.scaled = False
        ctx.grad_dtypes = (input.dtype, weight.dtype, None if bias is None else bias.dtype)
        if ctx.in_forward:
            needs = ctx.needs_input_grad[:3]
            (n, hidden), vocab = input.shape, weight.shape[0]
            one_chunk = _forward_chunk(n, vocab, hidden, input.element_size(), needs[1]) >= n
            grads = (
                empty_output_like(input) if needs[0] else None,
                empty_output_like(weight, weight.dtype if one_chunk else torch.float32) if needs[1] else None,
                empty_output_like(bias, torch.float32) if needs[2] else None,
            )
            _forward(input, weight, bias, target, class_weight, *options, *outputs, *grads)
            # the inputs too, unread: what the gradients depend on (a second derivative then raises
            # however it is asked for) and version-checked at the backward
            ctx.save_for_backward(outputs[4], *grads, input, weight, bias)
        else:
            _forward(input, weight, bias, target, class_weight, *options, *outputs, None, None, None)
            ctx.save_for_backward(input, weight, bias, target, class_weight, outputs[2], outputs[4])
        return outputs[0]

    @staticmethod
    @first_derivative_only("linear_cross_entropy")
    def backward(ctx, grad):
        if ctx.in_forward:  # the forward's gradients of the summed losses, scaled
            return *_scaled(ctx, grad), None, None, None, None, None, None, None, None, None
        input, weight, bias, target, class_weight, lse, totals = ctx.saved_tensors
        needs_dx, needs_dw, needs_db = ctx.needs_input_grad[:3]
        grad = grad.expand(1) if grad.dim() == 0 else grad
        dx = empty_output_like(input) if needs_dx else None
        dw = empty_output_like(weight) if needs_dw else None
        db = empty_output_like(bias) if needs_db else None
        _backward(
            grad, input, weight, bias, target, class_weight, lse, totals, *ctx.options, dx, dw, db, 0,
            weight.shape[0],
        )  # fmt: skip
        return dx, dw, db, None, None, None, None, None, None, None, None, None


def _scaled(ctx, grad: torch.Tensor) -> list[torch.Tensor | None]:
    """The forward's gradients of the summed losses times the upstream ``grad`` (over a mean's
    divisor), each in its parameter's dtype: in place where it has that dtype already (one pass; a
    float copy, a product and a cast of dW took 4.4 ms and 4 GB at 128256 x 4096 on the H200), so
    the backward can run once only."""
    if ctx.scaled:
        raise RuntimeError(
            "linear_cross_entropy's backward ran already: its gradients, computed in the forward, "
            "were scaled in place (a second backward through retain_graph=True is not supported)"
        )
    ctx.scaled = True
    totals, *sums = ctx.saved_tensors[:4]
    outs, other_dtype = [], []
    for g, dtype in zip(sums, ctx.grad_dtypes, strict=True):
        in_place = g is None or g.dtype == dtype
        outs.append(g if in_place else torch.empty_like(g, dtype=dtype))
        other_dtype.append(None if in_place else g)
    divisor = totals[1:2] if ctx.options[1] == "mean" else None
    _scale(grad.reshape(1), divisor, *outs, *other_dtype)
    return outs


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
    loss_dtype: torch.dtype | None = None,
    order: str | None = None,
):
    """``F.cross_entropy(F.linear(input, weight, bias), target, class_weight, ignore_index=...,
    reduction=..., label_smoothing=...)`` without ever holding the (N, V) logits: ``input`` (..., H)
    fp16 or bf16, ``weight`` (V, H) and ``bias`` (V,) of its dtype, ``target`` of input's leading
    shape (int64 or int32 class indices). ``z_loss`` and ``softcap`` as :func:`tritonkit.cross_entropy`;
    the loss has input's dtype (or ``loss_dtype``: torch.float32 for the fp32 loss transformers'
    models return), and with reduction "none" target's shape. Gradients for input,
    weight and bias. A target outside 0..V-1 other than ignore_index gives its row (and a sum or
    mean) NaN rather than an error, as cross_entropy. ``order`` picks how a sum's or mean's
    gradients are computed (the module's ``ORDER`` where None): "tokens", in the forward a chunk of
    tokens at a time (three matmuls; the logits of every token held where they are no larger than
    dW in fp32), or "vocab", in the backward a block of the vocabulary at a time (four matmuls, a
    fraction of the memory); reduction "none" always takes "vocab"."""
    label_smoothing, z_loss = float(label_smoothing), float(z_loss)
    _validate(input, weight, target, bias, class_weight)
    bias = unit_stride_bias(bias)
    rows_in = as_rows(input)
    rows_target = target.reshape(-1)
    ce.validate_options(input, weight.shape[0], class_weight, reduction, label_smoothing, z_loss, softcap)
    class_weight = ce.class_weights(class_weight)
    options = (ce.class_index(ignore_index), reduction, label_smoothing, z_loss, float(softcap or 0.0))
    if loss_dtype not in (None, input.dtype, torch.float32):
        raise ValueError(f"loss_dtype must be None, input's dtype or torch.float32, got {loss_dtype}")
    order = ORDER if order is None else order
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS} (or None for ORDER), got {order!r}")
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias))
    if grads:
        loss = _LinearCrossEntropy.apply(
            rows_in, weight, bias, rows_target, class_weight, loss_dtype, order, *options
        )
    else:
        sums = ce._needs_sums(reduction, class_weight, label_smoothing)
        outputs = _outputs(rows_in, reduction, sums, loss_dtype)
        _forward(rows_in, weight, bias, rows_target, class_weight, *options, *outputs, None, None, None)
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


def linear_cross_entropy_cost(shape: tuple, dtype: torch.dtype, mode: str = "fwd", reduction: str = "none"):
    """Bytes of the launches at ``shape`` = (N, H, V) (int64 targets, a bias, no class weights).
    The forward reads x, W and b once, writes and reads a chunk of logits, and writes the rows'
    losses, lse and divisor terms, then sums them. The gradients, by ORDER "vocab" (and always for
    reduction "none"): the backward reads x, W, b, the targets, lse, the upstream gradient and the
    sums, writes and reads a block of logits (dz in place), writes dW and adds into the fp32 dx
    accumulator; by ORDER "tokens" they are the forward's with-gradient work beyond the plain
    forward (the chunk's dz pass, dx written, W and x read again, the fp32 dW and db sums read and
    written each chunk). FLOPs: 2 N V H a matmul (one forward, three or two more for the gradients)."""
    from tritonkit.roofline import Cost

    n, hidden, vocab = shape
    size = torch.finfo(dtype).bits // 8
    params = (vocab * hidden + vocab) * size
    rows = {"none": n * size + 4 * n, "sum": 8 * n + size + 12, "mean": 12 * n + size + 12}[reduction]
    chunk = _span(vocab * size, n) if n else 0
    logits = chunk * vocab * size
    fwd = Cost(2 * n * vocab * hidden + 8 * n * vocab, n * hidden * size + params + logits + 8 * n + rows)
    if reduction != "none" and ORDER == "tokens":
        chunk = _forward_chunk(n, vocab, hidden, size, True) if n else 0
        chunks = -(-n // chunk) if n else 0
        if chunks > 1:  # dW and db summed in fp32, read and written each chunk
            sums = 2 * chunks * (vocab * hidden + vocab) * 4
        else:  # one product: dW written once in W's dtype, db in fp32
            sums = vocab * hidden * size + vocab * 4
        logits = chunk * vocab * size
        bwd = Cost(4 * n * vocab * hidden + 8 * n * vocab, 2 * logits + 2 * n * hidden * size + params + sums)
    else:
        block = _span(n * size, vocab)
        upstream = n * size if reduction == "none" else size
        totals = 0 if reduction == "none" else 12
        bwd_bytes = n * hidden * size + params + n * block * size + 8 * n + 4 * n + upstream + totals
        bwd_bytes += vocab * hidden * size + 4 * n * hidden  # dW, the dx accumulator
        bwd = Cost(6 * n * vocab * hidden + 8 * n * vocab, bwd_bytes)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def _make_inputs(shape: tuple, dtype: torch.dtype, device, generator: torch.Generator) -> tuple:
    """x (N, H), W (V, H) scaled so that the logits are O(1), targets (one in eight ignored), b."""
    from tritonkit.testing import random_tensor

    n, hidden, vocab = shape
    target = torch.randint(0, vocab, (n,), generator=generator, device=generator.device).to(device)
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


def _vocab_order(kwargs: dict):
    """tritonkit with order "vocab", shown beside the default so that one run times both."""

    def run(*args):
        return linear_cross_entropy(*args, **kwargs, order="vocab")

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
        dims=("tokens", "hidden size", "vocabulary"),
        dtypes=DTYPES,
        # the variant whose gradients the backward's launches compute (ORDER "vocab"), so that the
        # contract's cost check sees them; the benchmark's workload takes the mean
        kwargs={"reduction": "none"},
    )
}
WORKLOADS = {
    "linear_cross_entropy": Workload(
        name="linear_cross_entropy",
        op=OPS["linear_cross_entropy"],
        flop_unit="bf16",
        # (tokens, hidden, vocabulary): Llama-3-8B's LM head at 8192 tokens, a 2048-wide model's over
        # a 256000-class vocabulary (Gemma's), and smaller vocabularies
        shapes={
            "quick": [((8192, 4096, 128256), "bf16"), ((8192, 2048, 256000), "bf16")],
            "full": [((8192, 4096, v), "bf16") for v in (32000, 128256, 262144)],
        },
        tiny_shape=(4, 64, 256),
        kwargs={"reduction": "mean"},
        peers={"tritonkit[vocab-order]": _vocab_order, "liger": _liger},
    )
}
