"""The registry's records of the norm ops: each op's contract (``tritonkit.ops.Op``: inputs, the
launches ``tritonkit inspect`` compiles) and its benchmark workload (``tritonkit.ops.Workload``:
shapes and the peers it is measured against)."""

from __future__ import annotations

import functools
import math

import torch

from tritonkit._launch import Launch
from tritonkit.ops import Op, Workload
from tritonkit.ops.norm.norm import (
    _bwd_launches,
    _default,
    _forward_outputs,
    _fwd_launches,
    _params_key,
    _tuning_key,
    add_layer_norm,
    add_layer_norm_reference,
    add_rms_norm,
    add_rms_norm_reference,
    layer_norm,
    layer_norm_reference,
    norm_cost,
    rms_eps,
    rms_norm,
    rms_norm_reference,
)


def _make_inputs(residual: bool, bias: bool):
    def make(shape: tuple, dtype: torch.dtype, device, generator: torch.Generator) -> tuple:
        from tritonkit.testing import random_tensor

        x = random_tensor(shape, dtype, device, generator=generator)
        extra = (random_tensor(shape, dtype, device, generator=generator),) if residual else ()
        params = tuple(
            random_tensor(shape[-1:], dtype, device, generator=generator) for _ in range(2 if bias else 1)
        )
        return (x, *extra, (shape[-1],), *params)

    return make


def _liger(rms: bool, residual: bool):
    def factory(kwargs: dict):
        if residual and rms:
            from liger_kernel.transformers.functional import liger_fused_add_rms_norm

            return lambda x, r, shape, w, eps=None: liger_fused_add_rms_norm(
                x, r, w, rms_eps(eps, x.dtype), in_place=False
            )
        if residual:
            return "has no fused add + LayerNorm"
        if rms:
            from liger_kernel.transformers.functional import liger_rms_norm

            return lambda x, shape, w, eps=None: liger_rms_norm(x, w, rms_eps(eps, x.dtype), in_place=False)
        from liger_kernel.transformers.functional import liger_layer_norm

        return lambda x, shape, w, b, eps=1e-5: liger_layer_norm(x, w, b, eps)

    return factory


# What a config given to `tritonkit inspect` may set of each kernel beyond the keys of its default
# (BLOCK_N, given for a row that fits in registers, sends the forward through the looped kernel)
_INSPECT_EXTRAS = {
    ("fwd", False): ("EVICT", "BLOCK_N", "OUT_BLOCK_N", "PER_SM"),
    ("fwd", True): ("EVICT", "BLOCK_N", "OUT_BLOCK_N", "PER_SM", "SEGMENT"),
    ("bwd", False): ("PREFETCH", "BLOCK_M"),
    ("bwd", True): ("PREFETCH", "SEGMENT"),
}


def _inspected(key: dict, config: dict | None) -> dict:
    """The config inspect compiles the key's kernel with: its default, with what ``config`` sets of
    the default's keys and of _INSPECT_EXTRAS."""
    default = _default(key)
    extras = _INSPECT_EXTRAS[key["direction"], key["looped"]]
    chosen = default | {k: v for k, v in (config or {}).items() if k in default or k in extras}
    if "BLOCK_N" in chosen:
        chosen.pop("BLOCK_M", None)  # a looped forward
    return chosen


def _inspect_launches(
    residual: bool, rms: bool, bias: bool, shape: tuple, dtype: torch.dtype, config: dict | None = None
) -> list[Launch]:
    """The forward's and the backward's launches for ``shape`` (with its second stage, the partial
    sums, on its own fixed tile), each kernel with its default config and what ``config`` sets of it:
    what ``tritonkit inspect`` compiles."""
    x = torch.empty(shape, dtype=dtype, device="meta")
    w = torch.empty(shape[-1:], dtype=dtype, device="meta")
    r, b = x if residual else None, w if bias else None
    n, rows = shape[-1], math.prod(shape[:-1])
    params = _params_key(residual, w, b, rms)
    fwd, bwd = (_inspected(_tuning_key(d, n, rows, dtype, params), config) for d in ("fwd", "bwd"))
    y, h, mean, rstd = _forward_outputs(x, r, rms, stats=True)
    dw, db = torch.empty_like(w), torch.empty_like(w) if bias else None
    return [
        *_fwd_launches(x, r, w, b, 1e-5, rms, y, h, mean, rstd, fwd),
        *_bwd_launches(x, r, x, w, b, None, None, rms, torch.empty_like(x), dw, db, bwd),
    ]


_FUNCTIONS = {
    "layer_norm": (layer_norm, layer_norm_reference),
    "rms_norm": (rms_norm, rms_norm_reference),
    "add_layer_norm": (add_layer_norm, add_layer_norm_reference),
    "add_rms_norm": (add_rms_norm, add_rms_norm_reference),
}


def _op(name: str) -> Op:
    residual, rms = name.startswith("add_"), "rms" in name
    bias = not rms
    fn, reference = _FUNCTIONS[name]
    params = (2, 3) if bias else (2,)
    return Op(
        name=name,
        family="norm",
        fn=fn,
        reference=reference,
        cost=lambda shape, dtype, mode="fwd": norm_cost(shape, dtype, mode, residual=residual, bias=bias),
        make_inputs=_make_inputs(residual, bias),
        grad_inputs=(0, 1, *(p + 1 for p in params)) if residual else (0, *params),
        # the last: a row past MAX_BLOCK_N, which the looped kernels take (and their tuners)
        shapes=[(4, 96), (9, 1000), (1, 33000)],
        dims=("rows", "hidden size"),
        inspect=functools.partial(_inspect_launches, residual, rms, bias),
    )


def _workload(name: str) -> Workload:
    quick = [
        ((32768, 4096), "bf16"),
        ((16384, 8192), "bf16"),
        ((65536, 1024), "bf16"),
        ((4096, 65536), "bf16"),
        ((8192, 4096), "fp32"),
    ]
    return Workload(
        name=name,
        op=OPS[name],
        flop_unit="fp32",
        shapes={"quick": quick, "full": [*quick, ((4097, 1823), "bf16"), ((1024, 262144), "bf16")]},
        tiny_shape=(4, 256),
        peers={"liger": _liger("rms" in name, name.startswith("add_"))},
    )


OPS = {name: _op(name) for name in _FUNCTIONS}
WORKLOADS = {name: _workload(name) for name in _FUNCTIONS}
