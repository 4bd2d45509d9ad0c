"""Attention's public functions: ``flash_attention`` and ``scaled_dot_product_attention``, the
packed batches' and the window's argument checks, the forward and backward ops (destination-passing,
``tritonkit::attention_fwd`` and ``tritonkit::attention_bwd``) with the one autograd function over
them, the cost model, the launches ``tritonkit inspect`` compiles, and the registry's op and its
benchmark workloads. The forward's kernel, launch and tuning are in ``fwd``; the backward's kernels
in ``bwd_kernels``, their launches and tuning in ``bwd``; what both share (the scores' masks and
cap, the dense checks, the reference) is in ``common``.
"""

from __future__ import annotations

import functools
import numbers

import torch

from tritonkit.opdef import as_int, finite, first_derivative_only, op
from tritonkit.ops import Op, Workload
from tritonkit.ops.attention import bwd, fwd
from tritonkit.ops.attention.bwd import _inspect_launches as _inspect_bwd_launches
from tritonkit.ops.attention.bwd import attention_bwd_into
from tritonkit.ops.attention.bwd_kernels import KERNELS
from tritonkit.ops.attention.common import (
    DTYPES,
    Packed,
    Scores,
    attention_reference,
    benchmark_shape,
    check_window,
    empty_in_layout,
    softmax_scale,
    validate_qkv,
)
from tritonkit.ops.attention.fwd import _fwd_launches, _problem, attention_fwd_into, fwd_outputs

# ---------------------------------------------------------------- ops, autograd and public functions

NAMES = ("q", "k", "v")  # flash_attention's names of its tensors, which its errors call them by
# The ops take Scores' and Packed's fields one by one (a custom op's arguments are tensors and
# scalars); a dense call has no cu_seqlens.


@op("attention_fwd", mutates=("o", "lse"), replay=lambda: (fwd.SM90_FORWARD,))
def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    bottom_right: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    o: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Attention's output into ``o`` and its lse into ``lse`` (``fwd.fwd_outputs``' shapes)."""
    attention_fwd_into(
        q,
        k,
        v,
        o,
        lse,
        Scores(scale, causal, bottom_right, (window_left, window_right), softcap),
        _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
    )


@op(
    "attention_bwd",
    mutates=("dq", "dk", "dv"),
    replay=lambda: (bwd.SM90_BACKWARD, bwd.SM90_BACKWARD_DETERMINISTIC, bwd.SM90_BACKWARD_DETERMINISTIC_GQA),
)
def _backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    bottom_right: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """Attention's gradients into ``dq``, ``dk`` and ``dv`` (q's, k's and v's shapes)."""
    attention_bwd_into(
        do,
        q,
        k,
        v,
        o,
        lse,
        dlse,
        dq,
        dk,
        dv,
        Scores(scale, causal, bottom_right, (window_left, window_right), softcap),
        _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        deterministic,
    )


def _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int) -> Packed | None:
    """The ops' batch fields as the Packed they came from (None: a dense call)."""
    if cu_seqlens_q is None:
        return None
    return Packed(cu_seqlens_q, cu_seqlens_k, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k)


class _Attention(torch.autograd.Function):
    """One autograd function for eager calls and torch.compile (the ops skip the dispatcher eagerly),
    differentiable in q, k, v and the lse. Its arguments after q, k and v are the ops' scores and
    batch fields, then ``deterministic`` (the backward's).

    forward takes ctx itself: a separate setup_context costs an inspect.signature bind per call.
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, *options):
        *scores, deterministic = options
        o, lse = fwd_outputs(q, cu_seqlens_q is not None)
        _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *scores, o, lse)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.options = options
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros to read
        return o, lse

    @staticmethod
    @first_derivative_only("flash_attention")
    def backward(ctx, do, dlse):
        q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        if do is None:  # only the lse was differentiated
            do = torch.zeros_like(o)
        dq, dk, dv = (empty_in_layout(t) for t in (q, k, v))  # each laid out as its input
        _backward(do, q, k, v, o, lse, dlse, cu_seqlens_q, cu_seqlens_k, *ctx.options, dq, dk, dv)
        return dq, dk, dv, *([None] * (2 + len(ctx.options)))


def _call(
    q, k, v, scores: Scores, packed: Packed | None = None, deterministic: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of validated inputs: through the autograd function where a gradient is wanted,
    else the forward op alone."""
    cu_q, cu_k, _, max_q, max_k = packed or (None, None, 0, 0, 0)
    scores = scores.within(*((max_q, max_k) if packed else (q.shape[2], k.shape[2])))
    fields = (max_q, max_k, scores.scale, scores.causal, scores.bottom_right, *scores.window, scores.softcap)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, cu_q, cu_k, *fields, bool(deterministic))
    o, lse = fwd_outputs(q, packed is not None)
    _forward(q, k, v, cu_q, cu_k, *fields, o, lse)
    return o, lse


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    deterministic: bool = True,
):
    """Attention over (B, H, S, D) fp16/bf16 tensors, FlashAttention's conventions: ``causal``
    aligned bottom-right when Sq != Sk; GQA/MQA when k and v have fewer heads (a divisor of q's);
    ``scale`` defaults to 1/sqrt(D). ``window`` = (left, right) lets query i see only the keys from
    i + Sk - Sq - left to i + Sk - Sq + right (-1: no bound on that side; causal sets right to 0).
    ``softcap`` > 0 caps each scaled score s as softcap * tanh(s / softcap). With ``return_lse``,
    also the fp32 log-sum-exp of each query row's scores, (B, Hq, Sq). A row that sees no key
    outputs 0, with lse -inf and zero gradients.

    Packed variable-length batches: q (total_q, Hq, D), k and v (total_k, Hkv, D), with int32
    ``cu_seqlens_q`` and ``cu_seqlens_k`` of B + 1 entries (sequence b is rows cu[b]:cu[b + 1];
    empty sequences allowed), masks aligned per sequence; the output is (total_q, Hq, D) and the lse
    (Hq, total_q). ``max_seqlen_q``/``max_seqlen_k`` (the longest sequences) are read from the
    cu_seqlens when not given, which waits for the GPU, and the cu_seqlens are then checked on the
    host (0 first, non-decreasing, the last the packed tensor's rows). Given both, nothing is read on
    the host (no sync: the call can be captured in a CUDA graph), and the cu_seqlens' values are the
    caller's to keep valid, as flash-attn's: a sequence longer than its max_seqlen has rows never
    computed, and bounds past the packed tensors' rows read and write past them.

    Differentiable in q, k, v (GQA gradients summed over each group) and in the lse. The backward
    is deterministic (the same inputs give the same bits); ``deterministic=False`` accumulates dq
    with fp32 atomics in the dK/dV kernel instead of a dQ kernel that recomputes the scores (two
    matmuls of seven fewer), and dq's last bits then vary from run to run."""
    window = check_window(window)
    softcap = float(softcap)
    if not finite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0: no cap), got {softcap}")
    if cu_seqlens_q is None and cu_seqlens_k is None:
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if value is not None:
                raise ValueError(f"{name} is for packed batches: pass cu_seqlens_q and cu_seqlens_k too")
        validate_qkv(q, k, v, names=NAMES)
        packed = None
    else:
        packed = _validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    scores = Scores(softmax_scale(scale, q.shape[-1]), bool(causal), True, window, softcap)
    o, lse = _call(q, k, v, scores, packed, deterministic)
    return (o, lse) if return_lse else o


def _validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Packed:
    """The packed batch's Packed, or a TypeError or ValueError naming what is wrong."""
    for name, tensor in zip(NAMES, (q, k, v), strict=True):
        if isinstance(tensor, torch.Tensor) and tensor.dim() != 3:
            raise ValueError(
                f"a packed {name} must be 3-D (total tokens, heads, head dim), got shape "
                f"{tuple(tensor.shape)}"
            )
    validate_qkv(
        *(t.transpose(0, 1).unsqueeze(0) if isinstance(t, torch.Tensor) else t for t in (q, k, v)),
        names=NAMES,
    )
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (pass both cu_seqlens), got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be 1-D with B + 1 entries, got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on the tensors' device {q.device}, got {cu.device}")
    if max_seqlen_q is not None and max_seqlen_k is not None:  # the cu_seqlens' values not read: no sync
        _check_one_entry_a_sequence_each(cu_seqlens_q, cu_seqlens_k)
        longest = _given_longest(max_seqlen_q, max_seqlen_k)
    else:
        longest = _longest_on_the_host(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    # the kernels read a sequence's bounds at cu + b: entries one after another
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    return Packed(cu_seqlens_q, cu_seqlens_k, cu_seqlens_q.shape[0] - 1, *longest)


def _check_one_entry_a_sequence_each(cu_seqlens_q, cu_seqlens_k) -> None:
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have one entry a sequence each, got "
            f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}"
        )


def _given_longest(max_seqlen_q, max_seqlen_k) -> list[int]:
    """The given longest lengths as ints (numpy's and torch's integers too), or ValueError."""
    longest = []
    for name, given in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        length = as_int(given)
        if length is None or length < 0:
            raise ValueError(f"{name} must be an int >= 0, got {given!r}")
        longest.append(length)
    return longest


def _longest_on_the_host(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> list[int]:
    """The longest lengths, the cu_seqlens read on the host (a sync) and checked there: 0 first,
    non-decreasing, the last the packed tensor's rows, no sequence longer than a given max_seqlen."""
    lengths = {}
    for name, cu, tensor in (("cu_seqlens_q", cu_seqlens_q, q), ("cu_seqlens_k", cu_seqlens_k, k)):
        host = cu.cpu()
        if host[0] != 0:
            raise ValueError(f"{name} must start at 0, got {int(host[0])}")
        steps = host.diff()
        if (steps < 0).any():
            raise ValueError(f"{name} must be non-decreasing, got {host.tolist()}")
        if host[-1] != tensor.shape[0]:
            raise ValueError(
                f"{name} must end at the packed tensor's {tensor.shape[0]} rows, got {int(host[-1])}"
            )
        lengths[name] = int(steps.max()) if steps.numel() else 0
    _check_one_entry_a_sequence_each(cu_seqlens_q, cu_seqlens_k)
    longest = []
    for name, given, found in (
        ("max_seqlen_q", max_seqlen_q, lengths["cu_seqlens_q"]),
        ("max_seqlen_k", max_seqlen_k, lengths["cu_seqlens_k"]),
    ):
        length = as_int(given)  # (a numpy or torch integer too)
        if given is not None and (length is None or length < found):
            raise ValueError(f"{name} must be an int >= the longest sequence ({found}), got {given!r}")
        longest.append(found if given is None else length)
    return longest


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` on (B, H, S, D) fp16/bf16 tensors, with its
    semantics: ``is_causal`` aligned top-left when Sq != Sk, fewer key/value heads only with
    ``enable_gqa``. A dense ``attn_mask`` and ``dropout_p > 0`` raise NotImplementedError."""
    if attn_mask is not None:
        raise NotImplementedError(
            "scaled_dot_product_attention: attn_mask is not supported (use is_causal, "
            "or flash_attention's window)"
        )
    if not (
        isinstance(dropout_p, numbers.Real) and 0 <= dropout_p <= 1
    ):  # (numpy's floats too; as torch's, no tensor)
        raise ValueError(
            f"scaled_dot_product_attention: dropout_p must be a number in [0, 1], got {dropout_p!r}"
        )
    if dropout_p:
        raise NotImplementedError("scaled_dot_product_attention: dropout_p > 0 is not supported")
    validate_qkv(query, key, value)
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(
            f"query has {query.shape[1]} heads and key/value {key.shape[1]}: pass "
            "enable_gqa=True for grouped-query attention, as torch requires"
        )
    o, _ = _call(query, key, value, Scores(softmax_scale(scale, query.shape[-1]), bool(is_causal), False))
    return o


# ---------------------------------------------------------------- cost and inspection


def attention_cost(shape: tuple, dtype: torch.dtype, mode: str = "fwd", causal: bool = False):
    """FLOPs and minimal bytes of attention over a benchmark shape (B, Hq, Hkv, S, D), Sq = Sk = S:
    forward 4 B Hq S^2 D FLOPs (half when causal), backward 2.5x that; the forward reads q, k and v
    once and writes o and the lse, the backward also reads o, dO and the lse and writes dq, dk, dv."""
    from tritonkit.roofline import Cost

    batch, heads_q, heads_kv, seq, head_dim = benchmark_shape(shape)
    size = torch.finfo(dtype).bits // 8
    flops = 4 * batch * heads_q * seq * seq * head_dim / (2 if causal else 1)
    q_bytes, kv_bytes = batch * heads_q * seq * head_dim * size, batch * heads_kv * seq * head_dim * size
    lse_bytes = 4 * batch * heads_q * seq
    fwd = Cost(flops, 2 * q_bytes + 2 * kv_bytes + lse_bytes)
    bwd = Cost(2.5 * flops, 4 * q_bytes + 4 * kv_bytes + lse_bytes)  # q, o, dO, dq; k, v, dk, dv; the lse
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def _inspect_launches(
    shape: tuple, dtype: torch.dtype, config: dict | None = None, causal: bool = False
) -> list:
    """The forward's launch and the backward's three for a benchmark shape (B, Hq, Hkv, S, D): what
    ``tritonkit inspect`` compiles. A ``config`` sets the forward's tile, and under "dkdv" and "dq"
    the backward kernels' (over their defaults)."""
    batch, heads_q, heads_kv, seq, head_dim = benchmark_shape(shape)
    q = torch.empty((batch, heads_q, seq, head_dim), dtype=dtype, device="meta")
    kv = torch.empty((batch, heads_kv, seq, head_dim), dtype=dtype, device="meta")
    lse = torch.empty((batch, heads_q, seq), dtype=torch.float32, device="meta")
    fwd_config = {name: value for name, value in (config or {}).items() if name not in KERNELS}
    bwd_config = {name: value for name, value in (config or {}).items() if name in KERNELS}
    scores = Scores(softmax_scale(None, head_dim), causal)
    return [
        *_fwd_launches(_problem(q, kv, kv, q, lse, scores), fwd_config or None),
        *_inspect_bwd_launches(shape, dtype, bwd_config, scores),
    ]


# ---------------------------------------------------------------- the op, its peers and workloads


def _sdpa_backend(backend: str):
    """A peer: torch's scaled_dot_product_attention pinned to one backend (FLASH_ATTENTION, CUDNN_ATTENTION,
    EFFICIENT_ATTENTION); a backend that cannot take a case raises, and the harness reports it."""

    def factory(kwargs: dict):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        chosen = getattr(SDPBackend, backend)

        def run(q, k, v):
            with sdpa_kernel(chosen):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=kwargs.get("causal", False), enable_gqa=q.shape[1] != k.shape[1]
                )

        return run

    return factory


def _flex(kwargs: dict):
    """A peer: compiled FlexAttention, with a causal block mask built once per sequence length."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not torch.cuda.is_available():
        return "needs a CUDA GPU (timings only)"
    compiled = torch.compile(flex_attention)

    @functools.cache
    def causal_mask(seq_q: int, seq_k: int):
        return create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, None, None, seq_q, seq_k)

    def run(q, k, v):
        mask = causal_mask(q.shape[2], k.shape[2]) if kwargs.get("causal") else None
        return compiled(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    return run


def _make_inputs(shape: tuple, dtype: torch.dtype, device, generator: torch.Generator) -> tuple:
    from tritonkit.testing import random_tensor

    batch, heads_q, heads_kv, seq, head_dim = shape
    return (
        random_tensor((batch, heads_q, seq, head_dim), dtype, device, generator=generator),
        random_tensor((batch, heads_kv, seq, head_dim), dtype, device, generator=generator),
        random_tensor((batch, heads_kv, seq, head_dim), dtype, device, generator=generator),
    )


# The contract runs full attention, as a plain call does: the causal mask changes none of its checks
# (the same custom ops, the same tensors read and written). The causal kernels' outputs, gradients
# and poisoned rows are checked in tests/test_attention.py, their gates under each mask in
# tests/test_attention_tuning.py; the attention_causal workload runs them at the benchmark's shapes.
OPS = {
    "flash_attention": Op(
        name="flash_attention",
        family="attention",
        fn=flash_attention,
        reference=attention_reference,
        cost=attention_cost,
        make_inputs=_make_inputs,
        grad_inputs=(0, 1, 2),
        # (B, Hq, Hkv, S, D)
        shapes=[((1, 2, 1, 40, 64), "bf16"), ((1, 2, 2, 33, 32), "fp16")],
        dims=("batch", "query heads", "key/value heads", "sequence", "head dim"),
        dtypes=DTYPES,
        inspect=_inspect_launches,
    )
}


def _workload(causal: bool) -> Workload:
    return Workload(
        name="attention_causal" if causal else "attention",
        op=OPS["flash_attention"],
        flop_unit="bf16",
        # (B, Hq, Hkv, S, D): the shapes; GQA at Hq 32, Hkv 8; fp16 at the first
        shapes={
            "quick": [
                ((4, 32, 32, 4096, 128), "bf16"),
                ((2, 16, 16, 16384, 128), "bf16"),
                ((4, 32, 32, 4096, 64), "bf16"),
                ((16, 16, 16, 1024, 128), "bf16"),
                ((4, 32, 32, 4096, 128), "fp16"),
                ((4, 32, 8, 4096, 128), "bf16"),
            ],
            "full": [
                ((4, 32, 32, 4096, 128), "bf16"),
                ((2, 16, 16, 16384, 128), "bf16"),
                ((4, 32, 32, 4096, 64), "bf16"),
                ((16, 16, 16, 1024, 128), "bf16"),
                ((4, 32, 32, 4096, 128), "fp16"),
                ((4, 32, 8, 4096, 128), "bf16"),
                ((1, 32, 32, 8192, 256), "bf16"),
                ((8, 16, 16, 2048, 96), "bf16"),
            ],
        },
        tiny_shape=(1, 1, 1, 128, 64),
        kwargs={"causal": causal},
        # tritonkit[atomic-dq]: the backward with deterministic=False, shown beside the default
        peers={
            "tritonkit[atomic-dq]": lambda kwargs: functools.partial(
                flash_attention, **kwargs, deterministic=False
            ),
            "sdpa-flash": _sdpa_backend("FLASH_ATTENTION"),
            "sdpa-cudnn": _sdpa_backend("CUDNN_ATTENTION"),
            "sdpa-efficient": _sdpa_backend("EFFICIENT_ATTENTION"),
            "flex": _flex,
        },
    )


WORKLOADS = {"attention": _workload(False), "attention_causal": _workload(True)}
