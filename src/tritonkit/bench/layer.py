"""One transformer decoder layer, timed as a training step: ``tritonkit bench layer``.

The layer (Llama's, without RoPE), on x of (B, S, d), with M = B * S tokens:
    h   = rms_norm(x) * w_attn_norm
    q, k, v = split(h Wqkv^T)                       Hq query heads, Hkv key/value heads of D
    a   = causal attention(q, k, v)                 GQA: Hq / Hkv query heads share a K/V head
    x2  = x + a Wo^T
    h2  = rms_norm(x2) * w_mlp_norm
    out = x2 + (silu(h2 Wg^T) * (h2 Wu^T)) Wd^T

Three providers compute it with the same weights:
- ``tritonkit``: the library's ops, eagerly: ``rms_norm``, ``linear`` for the fused QKV projection,
  ``flash_attention`` (causal, GQA), ``linear`` with its residual epilogue for the output and down
  projections (the residual add is never a pass of its own), ``gated_linear`` for SwiGLU (gate,
  up and the SiLU product in one kernel). The add of the usual add-RMSNorm is thus the output
  projection's epilogue, and the norm after it is ``add_rms_norm`` of the sum alone (a residual's
  terms would be read again): its second output, the sum itself as a view, carries the residual
  stream, whose gradient its backward adds to the norm's in one pass (autograd would sum the two in
  a pass of its own, as it does in the torch layer). What tritonkit lacks is composed: the heads are
  strided views of the QKV output, and the attention output, (B, Hq, S, D), is copied to (B, S, Hq D)
  for the output projection (a kernel writing that layout would save the copy).
- ``torch``: the same layer in plain PyTorch eager, attention by ``scaled_dot_product_attention``
  pinned to cuDNN (FlashAttention-2, then the efficient kernel, where cuDNN refuses the case: the
  row's ``attention`` field says which ran).
- ``torch.compile``: torch.compile of that function (Inductor, default mode, static shapes).

Modes: ``fwd+bwd`` is one training step without the optimizer: the forward, then the backward of
the loss sum(out * g) for a fixed random g (``out.backward(g)``), giving the gradients of x and of
every weight; ``fwd`` is that step's forward alone, with autograd recording as in training. Each
is timed eagerly, as a user runs a step: at these shapes a step keeps the GPU busy for milliseconds
while the host issues a few hundred launches, so host time hides behind it (CUDA graphs, which the
op benchmarks replay, would only hide it further). The providers' steps of a mode take turns, hot
(``time_in_turns``: HEAT_MS of steps to the power limit, then timing.ROUNDS turns each, rotated): a row's
``ms`` is the median of its turns, each ``triton.testing.do_bench``'s median over TURN_REP_MS after
TURN_WARMUP_MS, L2 flushed between steps, gradients set to None before each; ``ms_spread`` is the
range of its turns over that median.

FLOPs (the TFLOP/s column), matmuls and attention only; norms, SiLU and the adds, memory-bound and
under 1% of the work, are not counted. With M = B * S:
    forward  = 2 M d ((Hq + 2 Hkv) D + Hq D + 3 F)        QKV, output, gate, up, down projections
             + 4 B Hq S^2 D / 2                           causal attention: half the score matrix
    backward = 2 x the forward's matmuls (dX and dW of each)
             + 2.5 x the forward's attention               (FlashAttention's count: scores again,
                                                          dP, dV, dQ, dK: five matmuls to two)
Peak memory: ``torch.cuda.max_memory_allocated`` during one call minus what was allocated before it
(weights, x, g): the activations, gradients and workspaces the step itself adds.

Before timing, each provider's output and gradients (of x and every weight) are compared with the
torch layer's from the same weights and inputs: the relative error ||a - b|| / ||b|| of each tensor
must stay under REL_TOLERANCE, else the row is marked FAIL (and the command exits 1).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch.nn import functional

# (layer.kernel_profile, layer.host_ms and layer.kernel_kind are what the benchmark scripts call)
from tritonkit.bench.step_profile import (  # noqa: F401
    KERNEL_KINDS,
    PROFILE_STEPS,
    host_ms,
    kernel_kind,
    kernel_profile,
)
from tritonkit.bench.step_profile import clear_grads as _clear_grads

log = logging.getLogger("tritonkit")

OP = "layer"  # the rows' op name and the results' file name
MODES = ("fwd+bwd", "fwd")
PROVIDERS = ("tritonkit", "tritonkit[nondeterministic]", "torch", "torch.compile")
# tritonkit[nondeterministic]: the layer with flash_attention(deterministic=False), whose backward
# adds dq's partials in whatever order they finish, as cuDNN's and FlashAttention-2's do (torch's
# attention backward is not deterministic either). Its forward is the default's: a step only.
PROVIDER_MODES = {"tritonkit[nondeterministic]": ("fwd+bwd",)}
EPS = 1e-5  # Llama's RMSNorm epsilon, the same in every provider
SEED = 0
# Relative L2 error allowed of each output and gradient against torch's, both 16-bit. Measured on
# the tiny layer under the interpreter in bf16, against float64: torch 4e-3 to 6e-3, tritonkit 1.1e-2
# to 3.0e-2 (each op within the oracle's 2x of torch, compounding over the layer's ten). A GELU where
# the SiLU belongs gave 8e-2 to 0.18 against torch, attention without the causal mask 0.4 to 0.8.
REL_TOLERANCE = 5e-2
WARMUP_STEPS = 2  # untimed steps first: torch.compile compiles and tritonkit tunes in the first
# The providers' steps take turns (``time_in_turns``). The whole step reaches the H200's 700 W
# limit within about a second and then runs 12-16% slower than cool (perf notes, "The layer's step
# under sustained load": tritonkit 17.2-17.7 ms cool, 19.97 hot): HEAT_MS of steps first, so that
# every turn is timed at the clock a training run sustains, then timing.ROUNDS turns a provider of
# TURN_WARMUP_MS and TURN_REP_MS.
HEAT_MS = 2000
TURN_WARMUP_MS, TURN_REP_MS = 50, 250
SDPA_PREFERENCE = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")


@dataclass(frozen=True)
class LayerShape:
    """A decoder layer's sizes and the batch it runs: B sequences of S tokens of width d."""

    model: str
    batch: int
    seq: int
    dim: int
    heads: int  # query heads, Hq
    kv_heads: int  # key/value heads, Hkv (a divisor of Hq)
    head_dim: int  # D
    ffn: int  # F, the SwiGLU's hidden width

    def dims(self) -> list[int]:
        """The rows' ``shape``: [B, S, d, Hq, Hkv, D, F]."""
        return [self.batch, self.seq, self.dim, self.heads, self.kv_heads, self.head_dim, self.ffn]


LLAMA3_8B = {"dim": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "ffn": 14336}
D64 = {"dim": 2048, "heads": 32, "kv_heads": 8, "head_dim": 64, "ffn": 8192}  # heads of 64
CASES = {  # in the order a run takes them: the first is the one the goals name
    "8b-4k": LayerShape("llama3-8b", 2, 4096, **LLAMA3_8B),
    "d64-4k": LayerShape("d64", 2, 4096, **D64),
    "8b-16k": LayerShape("llama3-8b", 1, 16384, **LLAMA3_8B),
}
# Under the interpreter: every kernel of the layer on a few blocks (GQA 2/1, a ragged head dim)
TINY = LayerShape("tiny", 1, 32, 64, 2, 1, 32, 128)


class Weights(NamedTuple):
    """The layer's parameters, (out_features, in_features) as torch.nn.Linear's."""

    attn_norm: torch.Tensor  # (d,)
    qkv: torch.Tensor  # ((Hq + 2 Hkv) D, d): the three projections stacked
    out: torch.Tensor  # (d, Hq D)
    mlp_norm: torch.Tensor  # (d,)
    gate: torch.Tensor  # (F, d)
    up: torch.Tensor  # (F, d)
    down: torch.Tensor  # (d, F)


def _randn(shape, dtype, device, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=generator, device=device) * scale).to(dtype)


def _generator(device, seed: int) -> torch.Generator:
    """A seeded generator on the tensors' device: the GPU draws its hundreds of MB of weights itself."""
    return torch.Generator(device=device).manual_seed(seed)


def make_weights(shape: LayerShape, dtype: torch.dtype, device, seed: int = SEED) -> Weights:
    """Leaf weights requiring grad, each projection scaled by 1/sqrt(fan-in) so that activations stay of
    order one; norm weights near 1, not 1, so that their gradients are not of a constant weight."""
    g = _generator(device, seed)
    d, qkv = shape.dim, (shape.heads + 2 * shape.kv_heads) * shape.head_dim

    def proj(n_out: int, n_in: int) -> torch.Tensor:
        return _randn((n_out, n_in), dtype, device, g, 1 / math.sqrt(n_in))

    def norm() -> torch.Tensor:
        return (1 + _randn((d,), torch.float32, device, g, 0.1)).to(dtype)

    weights = Weights(
        attn_norm=norm(),
        qkv=proj(qkv, d),
        out=proj(d, shape.heads * shape.head_dim),
        mlp_norm=norm(),
        gate=proj(shape.ffn, d),
        up=proj(shape.ffn, d),
        down=proj(d, shape.ffn),
    )
    return Weights(*(w.requires_grad_() for w in weights))


def make_inputs(shape: LayerShape, dtype: torch.dtype, device, seed: int = SEED + 1) -> tuple:
    """(x requiring grad, g): the layer's input, as from a layer below, and the loss's upstream gradient."""
    g = _generator(device, seed)
    size = (shape.batch, shape.seq, shape.dim)
    return _randn(size, dtype, device, g).requires_grad_(), _randn(size, dtype, device, g)


# ---------------------------------------------------------------- the layer, two ways


def _split_heads(qkv: torch.Tensor, shape: LayerShape) -> tuple:
    """q (B, Hq, S, D), k and v (B, Hkv, S, D): strided views of the QKV projection's output."""
    heads = qkv.view(shape.batch, shape.seq, shape.heads + 2 * shape.kv_heads, shape.head_dim)
    q, k, v = heads.split([shape.heads, shape.kv_heads, shape.kv_heads], dim=2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _merge_heads(o: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) -> (B, S, H D), a copy unless o already lies as (B, S, H, D)."""
    batch, heads, seq, head_dim = o.shape
    return o.transpose(1, 2).reshape(batch, seq, heads * head_dim)


def torch_layer(x: torch.Tensor, w: Weights, shape: LayerShape) -> torch.Tensor:
    """The layer in plain PyTorch: the reference and the eager and compiled peers."""
    d = (shape.dim,)
    q, k, v = _split_heads(functional.linear(functional.rms_norm(x, d, w.attn_norm, EPS), w.qkv), shape)
    a = functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=shape.heads != shape.kv_heads
    )
    x2 = x + functional.linear(_merge_heads(a), w.out)
    h2 = functional.rms_norm(x2, d, w.mlp_norm, EPS)
    return x2 + functional.linear(
        functional.silu(functional.linear(h2, w.gate)) * functional.linear(h2, w.up), w.down
    )


def tritonkit_layer(
    x: torch.Tensor, w: Weights, shape: LayerShape, deterministic: bool = True
) -> torch.Tensor:
    """The layer from tritonkit's ops (see the module docstring for what is fused where);
    ``deterministic`` is the attention backward's."""
    import tritonkit

    d = (shape.dim,)
    # (the residual stream through the norm's pair: its gradient joins the norm's backward pass)
    h, x = tritonkit.add_rms_norm(x, None, d, w.attn_norm, EPS)
    q, k, v = _split_heads(tritonkit.linear(h, w.qkv), shape)
    a = tritonkit.flash_attention(q, k, v, causal=True, deterministic=deterministic)
    x2 = tritonkit.linear(_merge_heads(a), w.out, residual=x)
    h2, x2 = tritonkit.add_rms_norm(x2, None, d, w.mlp_norm, EPS)
    return tritonkit.linear(tritonkit.gated_linear(h2, w.gate, w.up, "silu"), w.down, residual=x2)


# ---------------------------------------------------------------- FLOPs


def layer_flops(shape: LayerShape, mode: str) -> dict[str, float]:
    """{"matmul", "attention", "total"}: the FLOPs of the mode, counted as the module docstring says."""
    if mode not in (*MODES, "bwd"):
        raise ValueError(f"mode must be one of {MODES} or bwd, got {mode!r}")
    from tritonkit.ops.attention.attention import attention_cost

    tokens, d, dh = shape.batch * shape.seq, shape.dim, shape.head_dim
    widths = (shape.heads + 2 * shape.kv_heads) * dh + shape.heads * dh + 3 * shape.ffn
    matmul_fwd = 2 * tokens * d * widths
    matmul = {"fwd": matmul_fwd, "bwd": 2 * matmul_fwd, "fwd+bwd": 3 * matmul_fwd}[mode]
    attention_shape = (shape.batch, shape.heads, shape.kv_heads, shape.seq, dh)
    attention = attention_cost(attention_shape, torch.bfloat16, mode, causal=True).flops
    return {"matmul": float(matmul), "attention": float(attention), "total": float(matmul + attention)}


# ---------------------------------------------------------------- providers


def sdpa_backend(shape: LayerShape, dtype: torch.dtype, device) -> str | None:
    """The first of SDPA_PREFERENCE that runs this layer's attention forward and backward (its q, k and
    v strided as the layer's are), or None (SDPA's own choice: the CPU's)."""
    if torch.device(device).type != "cuda":
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qkv_width = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    qkv = torch.randn(shape.batch, shape.seq, qkv_width, dtype=dtype, device=device, requires_grad=True)
    for name in SDPA_PREFERENCE:
        try:
            with sdpa_kernel(getattr(SDPBackend, name)):
                o = functional.scaled_dot_product_attention(
                    *_split_heads(qkv, shape), is_causal=True, enable_gqa=shape.heads != shape.kv_heads
                )
            o.backward(torch.ones_like(o))
            torch.cuda.synchronize()
            return name
        except RuntimeError as error:  # "No available kernel", or the backend's own refusal
            log.info("tritonkit: SDPA %s refuses the layer's attention: %s", name, str(error)[:200])
        finally:
            qkv.grad = None
    return None


def _pinned(fn: Callable, backend: str | None) -> Callable:
    """``fn`` run with SDPA pinned to ``backend``: the forward chooses the kernel, whose backward the
    autograd engine then runs (it needs no pinning); torch.compile traces inside the pin."""
    if backend is None:
        return fn
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(x, w):
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return fn(x, w)

    return run


def build(provider: str, shape: LayerShape, backend: str | None) -> Callable | str:
    """The provider's layer as fn(x, weights), or why it cannot run here."""
    if provider == "tritonkit":
        return functools.partial(tritonkit_layer, shape=shape)
    if provider == "tritonkit[nondeterministic]":
        return functools.partial(tritonkit_layer, shape=shape, deterministic=False)
    if provider == "torch":
        return _pinned(functools.partial(torch_layer, shape=shape), backend)
    if provider == "torch.compile":
        if not torch.cuda.is_available():
            return "needs a CUDA GPU (timings only)"
        torch._dynamo.reset()  # each case compiles afresh, for its static shapes

        def layer(x, w):
            return torch_layer(x, w, shape)

        return _pinned(torch.compile(layer, dynamic=False), backend)
    raise ValueError(f"unknown layer provider {provider!r}; known: {', '.join(PROVIDERS)}")


# ---------------------------------------------------------------- check, time, measure


TENSOR_NAMES = ("output", "x.grad", *(f"{name}.grad" for name in Weights._fields))


def outputs_and_grads(fn: Callable, x: torch.Tensor, w: Weights, grad: torch.Tensor) -> list[torch.Tensor]:
    """[output, x.grad, each weight's grad] of one step (TENSOR_NAMES' order)."""
    _clear_grads((x, *w))
    out = fn(x, w)
    out.backward(grad)
    results = [out.detach(), x.grad, *(p.grad for p in w)]
    _clear_grads((x, *w))
    return results


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """||value - reference|| / ||reference|| in fp32; inf where value is not finite or missing."""
    if value is None or not torch.isfinite(value).all():
        return math.inf
    reference = reference.float()
    return float((value.float() - reference).norm() / reference.norm().clamp_min(1e-30))


def check(values: list[torch.Tensor], reference: list[torch.Tensor]) -> dict:
    """The worst relative error over the output and gradients, which tensor it is, and the verdict."""
    errors = {name: relative_error(v, r) for name, v, r in zip(TENSOR_NAMES, values, reference, strict=True)}
    worst = max(errors, key=errors.get)
    passed = all(e <= REL_TOLERANCE for e in errors.values())
    return {"max_rel_err": errors[worst], "worst_tensor": worst, "check": "pass" if passed else "FAIL"}


def time_in_turns(
    calls: dict[str, Callable[[], object]], grads_to_none: list[torch.Tensor]
) -> tuple[dict, dict]:
    """({provider: median ms}, {provider: spread}) of the providers' steps taking turns, hot (the
    module docstring: the protocol)."""
    from tritonkit.bench import timing

    return timing.interleaved_ms(
        calls, heat_ms=HEAT_MS, warmup_ms=TURN_WARMUP_MS, rep_ms=TURN_REP_MS, grad_to_none=grads_to_none
    )


def peak_bytes(call: Callable[[], object], grads_to_none: list[torch.Tensor]) -> int:
    """Bytes allocated at the peak of one call, over what was allocated before it."""
    _clear_grads(grads_to_none)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    _clear_grads(grads_to_none)
    return peak


def _mode_call(fn: Callable, mode: str, x: torch.Tensor, w: Weights, grad: torch.Tensor) -> Callable:
    if mode == "fwd":
        return lambda: fn(x, w)
    return lambda: fn(x, w).backward(grad)


def measure(call: Callable[[], object], tensors: list[torch.Tensor]) -> dict:
    """The memory, host and kernel-profile fields of one provider's row in one mode (its time comes
    from ``time_in_turns``)."""
    peak = peak_bytes(call, tensors)
    measured = {"peak_bytes": peak, "peak_gib": peak / 2**30, "host_ms": host_ms(call, tensors)}
    try:
        return measured | kernel_profile(call, tensors)
    except Exception as error:  # a diagnostic: the timing stands without it
        log.warning("tritonkit: bench layer's kernel profile failed: %s", error)
        return measured


# ---------------------------------------------------------------- one case, a run


def _base_row(case: str, shape: LayerShape, dtype: torch.dtype, provider: str, mode: str) -> dict:
    from tritonkit.dtypes import NAME_OF

    flops = layer_flops(shape, mode)
    return {
        "op": OP,
        "case": case,
        "model": shape.model,
        "provider": provider,
        "mode": mode,
        "shape": shape.dims(),
        "dtype": NAME_OF[dtype],
        "flops": flops["total"],
        "flops_matmul": flops["matmul"],
        "flops_attention": flops["attention"],
    }


def _attention_kernel(provider: str, backend: str | None) -> str:
    if provider == "tritonkit":
        return "tritonkit.flash_attention"
    if provider == "tritonkit[nondeterministic]":
        return "tritonkit.flash_attention(deterministic=False)"
    return f"sdpa {backend.removesuffix('_ATTENTION').lower()}" if backend else "sdpa (its own choice)"


def _failed(provider: str, rows: list[dict], error: Exception) -> list[dict]:
    """The rows of a provider that raised: tritonkit's FAIL, a peer's unavailable, saying why."""
    why = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
    if provider == "tritonkit":
        return [row | {"check": "FAIL", "error": why} for row in rows]
    return [row | {"unavailable": f"failed: {why}"} for row in rows]


def _checked_rows(
    provider: str, fn: Callable | str, case: str, shape: LayerShape, inputs: tuple, reference: list, modes
) -> list[dict]:
    """The provider's rows, one a mode, checked against torch's ``reference``, and on a GPU warmed
    up (WARMUP_STEPS a mode: compiles and tuning). A peer that fails says why in its rows; tritonkit
    failing is a FAIL."""
    x, w, grad, backend = inputs
    modes = [mode for mode in modes if mode in PROVIDER_MODES.get(provider, MODES)]
    rows = [_base_row(case, shape, x.dtype, provider, mode) for mode in modes]
    if isinstance(fn, str):
        return [row | {"unavailable": fn} for row in rows]
    rows = [row | {"attention": _attention_kernel(provider, backend)} for row in rows]
    try:
        verdict = (
            {"check": "reference", "max_rel_err": 0.0}
            if provider == "torch"
            else check(outputs_and_grads(fn, x, w, grad), reference)
        )
        if x.is_cuda:
            for mode in modes:
                call = _mode_call(fn, mode, x, w, grad)
                for _ in range(WARMUP_STEPS):
                    _clear_grads([x, *w])
                    call()
            _clear_grads([x, *w])  # no gradients held while the next provider is checked
            torch.cuda.synchronize()
    except Exception as error:  # one provider failing must not lose a long GPU run's other rows
        log.exception("tritonkit: bench layer %s %s failed", case, provider)
        return _failed(provider, rows, error)
    return [row | verdict for row in rows]


def _time_rows(built: dict[str, Callable], rows: list[dict], inputs: tuple) -> None:
    """Time the rows of the providers in ``built`` in place, a mode at a time: their steps in
    turns, then each one's memory, host time and kernel profile."""
    x, w, grad = inputs
    tensors = [x, *w]
    for mode in MODES:
        timed = {row["provider"]: row for row in rows if row["mode"] == mode and row["provider"] in built}
        if not timed:
            continue
        calls = {provider: _mode_call(built[provider], mode, x, w, grad) for provider in timed}
        try:
            medians, spreads = time_in_turns(calls, tensors)
        except Exception:  # one provider failing (out of memory) must not lose the others' rows
            log.exception("tritonkit: bench layer's turns failed; each provider is timed alone")
            medians, spreads = _alone(calls, tensors, timed)
        for provider, row in timed.items():
            if provider in medians:
                row.update(
                    ms=medians[provider], ms_spread=spreads[provider], **measure(calls[provider], tensors)
                )
                row["tflops"] = row["flops"] / (row["ms"] * 1e-3) / 1e12
        _profile_reversed({p: calls[p] for p in reversed(timed) if p in medians}, timed, tensors)


def _profile_reversed(calls: dict[str, Callable], rows: dict[str, dict], tensors: list[torch.Tensor]) -> None:
    """Each provider's kernels profiled again, in the reverse order: ``kernel_ms_reversed`` and
    ``kernel_ms_by_kind_reversed``. The first provider profiled has read its kernels faster than the
    same kernels profiled later (docs/perf-notes/layer-and-model.md): a second pass in the other
    order tells the profile's order from the provider."""
    for provider, call in calls.items():
        try:
            again = kernel_profile(call, tensors)
        except Exception as error:  # a diagnostic: the rows stand without it
            log.warning("tritonkit: bench layer's second kernel profile failed: %s", error)
            return
        rows[provider]["kernel_ms_reversed"] = again["kernel_ms"]
        rows[provider]["kernel_ms_by_kind_reversed"] = again["kernel_ms_by_kind"]


def _alone(calls: dict, tensors: list[torch.Tensor], rows: dict[str, dict]) -> tuple[dict, dict]:
    """Each provider's step in turns of its own; one that raises gets its row marked (``_failed``)."""
    medians, spreads = {}, {}
    for provider, call in calls.items():
        try:
            median, spread = time_in_turns({provider: call}, tensors)
        except Exception as error:
            rows[provider].update(_failed(provider, [{}], error)[0])
            continue
        medians[provider], spreads[provider] = median[provider], spread[provider]
    return medians, spreads


def run_case(
    case: str,
    shape: LayerShape,
    dtype: torch.dtype,
    providers: Iterable[str],
    modes: Iterable[str],
    device,
    on_provider: Callable[[str, float], None] | None = None,
) -> list[dict]:
    """Every provider's rows of one layer case (the torch layer is the reference, run in any case);
    ``on_provider`` gets each provider's name and seconds (compiling and tuning included) as it ends."""
    x, grad = make_inputs(shape, dtype, device)
    w = make_weights(shape, dtype, device)
    backend = sdpa_backend(shape, dtype, device)
    reference = outputs_and_grads(build("torch", shape, backend), x, w, grad)
    rows, built = [], {}
    for provider in providers:
        started = time.perf_counter()
        fn = build(provider, shape, backend)
        checked = _checked_rows(provider, fn, case, shape, (x, w, grad, backend), reference, list(modes))
        rows += checked
        if all("unavailable" not in row and "error" not in row for row in checked):
            built[provider] = fn  # timed below, in turns with the others
        if on_provider is not None:
            on_provider(provider, time.perf_counter() - started)
    del reference
    if x.is_cuda:
        started = time.perf_counter()
        _time_rows(built, rows, (x, w, grad))
        if on_provider is not None:
            on_provider("timing, in turns", time.perf_counter() - started)
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """On each timed tritonkit row: the peers' time over its own (above 1: tritonkit is faster) and its
    peak memory over theirs (below 1: tritonkit holds less), peers of the same case and mode."""
    by_key = {(r["case"], r["mode"], r["provider"]): r for r in rows if "ms" in r}
    for (case, mode, provider), ours in by_key.items():
        if not provider.startswith("tritonkit"):
            continue
        for peer, label in (("torch", "torch"), ("torch.compile", "compile")):
            theirs = by_key.get((case, mode, peer))
            if theirs is not None:
                ours[f"vs_{label}"] = theirs["ms"] / ours["ms"]
                ours[f"memory_vs_{label}"] = ours["peak_bytes"] / max(theirs["peak_bytes"], 1)


def run(
    cases: Iterable[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    providers: Iterable[str] = PROVIDERS,
    modes: Iterable[str] = MODES,
    progress: bool = True,
    report: Callable[[str], None] | None = None,
    on_case: Callable[[list[dict]], None] | None = None,
    time_limit: float | None = None,
) -> tuple[list[dict], list[str]]:
    """(rows, cases not run). Under the interpreter only the tiny layer runs, as a correctness run.

    With ``time_limit``, a case starts only if the run, at the pace of its longest case so far, would
    end within that many seconds of its start: the others are returned as not run, so that a run under
    a deadline ends with every case it started complete. ``on_case`` gets the rows so far after each
    case; ``report`` a line per provider and case with the seconds it took."""
    from tqdm import tqdm

    from tritonkit._runtime import interpret
    from tritonkit.bench.runner import provenance

    interpreted = interpret()
    device = "cpu" if interpreted else "cuda"
    chosen = {"tiny": TINY} if interpreted else {name: CASES[name] for name in cases}
    providers, modes = list(providers), list(modes)
    for name in (*providers, *modes):
        if name not in (*PROVIDERS, *MODES):
            raise ValueError(f"the layer runs providers {PROVIDERS} in modes {MODES}, not {name!r}")
    started, longest, rows, not_run = time.perf_counter(), 0.0, [], []
    bar = tqdm(total=len(chosen) * len(providers), desc="bench layer", unit="run", disable=not progress)
    for name, shape in chosen.items():
        if time_limit is not None and time.perf_counter() - started + longest > time_limit:
            not_run.append(name)
            continue
        case_started = time.perf_counter()

        def provider_done(provider: str, seconds: float, name=name) -> None:
            bar.update()
            if report is not None:
                report(f"bench layer {name} {provider}: {seconds:.1f} s")

        bar.set_postfix_str(f"{name} {'x'.join(map(str, shape.dims()))}")
        case_rows = run_case(name, shape, dtype, providers, modes, device, provider_done)
        rows += [row | provenance() for row in case_rows]
        longest = max(longest, time.perf_counter() - case_started)
        if on_case is not None:
            on_case(rows)
    bar.close()
    return rows, not_run


# ---------------------------------------------------------------- tables and files


def _case_label(row: dict) -> str:
    batch, seq, dim, heads, kv_heads, head_dim, ffn = row["shape"]
    return f"{row['model']} (d {dim}, {heads}/{kv_heads} heads of {head_dim}, F {ffn}), B={batch}, S={seq}"


def _triple(by_provider: dict, ours: str, key: str, fmt: str) -> str:
    cells = []
    for provider in ("torch", "torch.compile", ours):
        row = by_provider.get(provider)
        cells.append(fmt.format(row[key]) if row is not None and key in row else "-")
    return " / ".join(cells)


def _ratio(row: dict | None, key: str) -> str:
    return f"{row[key]:.2f}x" if row is not None and key in row else "-"


def _check_cell(row: dict | None) -> str:
    if row is None or "check" not in row:
        return "-"
    if "error" in row:
        return f"FAIL ({row['error'][:80]})"
    return f"{row['check']} ({row['max_rel_err']:.1e})"


def markdown_table(rows: list[dict]) -> str:
    """The table of docs/layer.md and the README: per case and mode, and for each tritonkit provider
    that ran it, each provider's step time, TFLOP/s and peak memory (torch / torch.compile /
    tritonkit), tritonkit's time ratios (above 1: faster) and its check."""
    groups: dict[tuple, dict] = {}
    for row in rows:
        groups.setdefault((_case_label(row), row["mode"], row["dtype"]), {})[row["provider"]] = row
    header = [
        "layer",
        "mode",
        "ms: eager / compile / tritonkit",
        "TFLOP/s",
        "peak GiB",
        "tritonkit vs eager",
        "vs compile",
        "check (rel. err)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (label, mode, dtype), by_provider in groups.items():
        for name in (p for p in PROVIDERS if p.startswith("tritonkit") and p in by_provider):
            ours = by_provider[name]
            variant = name.removeprefix("tritonkit")
            cells = [
                f"{label}, {dtype}",
                f"{mode} {variant}".strip(),
                _triple(by_provider, name, "ms", "{:.2f}"),
                _triple(by_provider, name, "tflops", "{:.0f}"),
                _triple(by_provider, name, "peak_gib", "{:.2f}"),
                _ratio(ours, "vs_torch"),
                _ratio(ours, "vs_compile"),
                _check_cell(ours),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    skipped = {
        (r["case"], r["provider"]): r["unavailable"]
        for r in rows
        if "unavailable" in r and r["mode"] == MODES[0]
    }
    lines += [f"\nnot run: {case} {provider} ({why})" for (case, provider), why in skipped.items()]
    return "\n".join(lines)


def profile_table(rows: list[dict]) -> str:
    """Where each provider's step goes: GPU time a step by kernel kind (``kernel_profile``) and the
    rest of the step's time, in which the GPU waited on the host. Empty without profiled rows."""
    profiled = [r for r in rows if "kernel_ms_by_kind" in r]
    if not profiled:
        return ""
    header = [
        "layer",
        "mode",
        "provider",
        "step ms",
        "host ms",
        *(f"{kind} ms" for kind in KERNEL_KINDS),
        "GPU idle ms",
    ]
    reversed_pass = any("kernel_ms_reversed" in r for r in profiled)
    if reversed_pass:  # (``_profile_reversed``)
        header.append("kernels ms: first pass / reversed")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in profiled:
        kinds = [f"{row['kernel_ms_by_kind'][kind]:.2f}" for kind in KERNEL_KINDS]
        idle = f"{max(row['profiled_span_ms'] - row['kernel_ms'], 0.0):.2f}"
        host = f"{row['host_ms']:.2f}" if "host_ms" in row else "-"
        cells = [row["case"], row["mode"], row["provider"], f"{row['ms']:.2f}", host, *kinds, idle]
        if reversed_pass:
            again = f"{row['kernel_ms_reversed']:.2f}" if "kernel_ms_reversed" in row else "-"
            cells.append(f"{row['kernel_ms']:.2f} / {again}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def provenance_line(rows: list[dict], command: str = "tritonkit bench layer") -> str:
    """The GPU, the versions, the commit and the command (``command`` where the rows have none); rows
    from several runs (cases measured at different commits) name each run, in the rows' order."""
    first = rows[0]
    runs = dict.fromkeys((row["git_sha"], row.get("command", command)) for row in rows)
    return f"{first['gpu']}, torch {first['torch']}, triton {first['triton']}, " + "; ".join(
        f"at {sha}: `{run}`" for sha, run in runs
    )


def with_other_cases(json_path: Path, rows: list[dict]) -> list[dict]:
    """``rows`` after the rows of other cases already in ``json_path`` at the same commit: a case can
    take a run of its own (each runs for minutes) into the same folder; rows of another commit go."""
    if not json_path.exists():
        return rows
    cases = {row["case"] for row in rows}
    kept = [
        row
        for row in json.loads(json_path.read_text())
        if row["case"] not in cases and row.get("git_sha") == rows[0]["git_sha"]
    ]
    return kept + rows


def write_results(rows: list[dict], out_dir: Path) -> list[Path]:
    """``<out>/<gpu-slug>/layer.json`` (the rows, after ``with_other_cases``) and ``layer.md`` (their
    table, under its provenance)."""
    from tritonkit.bench.report import gpu_slug

    folder = out_dir / gpu_slug(rows[0]["gpu"])
    folder.mkdir(parents=True, exist_ok=True)
    json_path, md_path = folder / f"{OP}.json", folder / f"{OP}.md"
    rows = with_other_cases(json_path, rows)
    json_path.write_text(json.dumps(rows, indent=1) + "\n")
    profile = profile_table(rows)
    profile = (
        f"\nGPU time a step by kernel kind (torch.profiler, {PROFILE_STEPS} steps):\n\n{profile}\n"
        if profile
        else ""
    )
    md_path.write_text(f"{provenance_line(rows)}\n\n{markdown_table(rows)}\n{profile}")
    return [json_path, md_path]
