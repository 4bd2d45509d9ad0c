"""LayerNorm and RMSNorm over the last dimension, with the residual add fused in, forward and backward.

Maths. For a row h of length N (h = x, or h = x + residual for the add_ forms):
    LayerNorm:  mean = sum(h) / N,  rstd = 1 / sqrt(sum((h - mean)^2) / N + eps),
                xhat = (h - mean) * rstd,  y = xhat * w + b
    RMSNorm:    rstd = 1 / sqrt(sum(h^2) / N + eps),  xhat = h * rstd,  y = xhat * w
VJP, with g = dy * w:
    LayerNorm:  dh = rstd * (g - mean(g) - xhat * mean(g * xhat))
    RMSNorm:    dh = rstd * (g - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat,  db = sum over rows of dy
The add_ forms also return h; its upstream gradient adds to dh, and dx = dresidual = dh.

Work. Forward reads x (and the residual) and writes y (and h): 2 M N s bytes (4 M N s with the
residual) plus the weights; backward reads h, dy (and dh) and writes dx: 3 M N s, plus the weights
and the fp32 partial sums of dw and db. A handful of FLOPs an element: memory-bound.

dw and db are reduced in two stages, never with float atomics, so results are deterministic: each
backward program sums its rows into fp32 partials, and a second pass sums the partials.
A row lives in registers up to ``MAX_BLOCK_N`` entries; longer rows go through looped kernels
that read each row twice (``kernels.py``), or, where too few to fill the SMs a row a program, through
split kernels that spread each row over programs side by side (``split.py``: the looped tuners'
default there). Rows a program, chunk sizes and warps come from accuracy-gated tuning
(``tritonkit.tuning``), each kernel with its own tuner and configs.
h = x + residual is added in fp32 and rounded to the input dtype before it is normalised, as
``norm(x + residual)`` is in PyTorch: the backward then recomputes xhat from the stored h exactly.

This file reads: launches, tuning (one ``tuning.Tuned`` a kernel pair), custom ops and autograd,
the public functions, reference and cost; ``spec.py`` has the registry's ops and workloads.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from tritonkit import tuning
from tritonkit._launch import Launch, call_signature, cdiv, next_power_of_2, row_align, scratch
from tritonkit._runtime import empty_output, empty_output_like, sm_count
from tritonkit.dtypes import DTYPE_OF, FLOATS, NAME_OF
from tritonkit.opdef import check_tensor, checked_once, finite, first_derivative_only, op
from tritonkit.ops.norm import normed
from tritonkit.ops.norm.kernels import (
    BWD_CONFIGS,
    BWD_LOOPED_CONFIGS,
    FWD_CONFIGS,
    FWD_LOOPED_CONFIGS,
    _bwd_default,
    _bwd_looped_default,
    _bwd_looped_prune,
    _bwd_prune,
    _fwd_default,
    _fwd_looped_default,
    _fwd_looped_prune,
    _fwd_prune,
    _norm_bwd_kernel,
    _norm_bwd_looped_kernel,
    _norm_fwd_kernel,
    _norm_fwd_looped_kernel,
)
from tritonkit.ops.norm.split import (
    _norm_bwd_columns_kernel,
    _norm_bwd_split_kernel,
    _norm_fwd_split_kernel,
    bwd_split_launches,
    fwd_split_launches,
)
from tritonkit.partial_sums import _sum_partials_kernel, sum_partials_launch
from tritonkit.roofline import Cost

DTYPES = FLOATS
# A row lives in registers: at 16 warps, 64 fp32 values a thread hold 32768 entries forward. The
# backward holds h and dy at once and sums dw (db) beside them: at 16384 entries (32 a thread each, 16
# warps) every norm's one-pass backward spilled in its row loop on sm_90 (rms_norm fp32: 434 local
# accesses in an 880-instruction loop; 14 x 12592 fp32 took 114 us, 0.15x the best peer, on an H100),
# and at 32 warps (64 registers a thread) still did; the looped backward compiles there without. Powers
# of two: a row is longer than one exactly when its power-of-two block is (the tuning key's "looped").
MAX_BLOCK_N = {"fwd": 32768, "bwd": 8192}
ROW_BLOCK_MIN = 2  # the one-pass backward's least row block (_bwd_launches says why)
CALIBRATION_ELEMENTS = 1 << 21  # cap on a calibration problem: its float64 reference stays small
BWD_CALIBRATION_EPS = 1e-5  # the backward's calibration forward (the backward is not given the op's eps)
# triton.next_power_of_2, memoized: it unwraps constexprs, microseconds from Python (as triton.cdiv
# does, which _launch.cdiv stands in for), and the launches below take it on every call


# ---------------------------------------------------------------- launches


def _unit_stride(param: torch.Tensor | None) -> torch.Tensor | None:
    """A weight or bias as the kernels read it, entry i at offset i (a strided view is copied)."""
    return param if param is None or param.stride() == (1,) else param.contiguous()


def _rows_2d(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as (rows, n) with unit column stride: a view where the strides allow, else a copy."""
    t = t.reshape(-1, n)
    return t if t.stride(1) == 1 or n == 1 else t.contiguous()


def _fwd_launches(
    input, residual, weight, bias, eps: float, rms: bool, y, h, mean, rstd, config: dict
) -> list[Launch]:
    """The forward's launch for a non-empty ``input``: y (and h, given a residual) and, where ``rstd``
    is given, the statistics a backward reads (mean: LayerNorm's). Without them the one-pass kernel
    stores none; the looped one stores them regardless, one pair a long row, into scratch."""
    n = input.shape[-1]
    rows = input.numel() // n
    block_n = next_power_of_2(n)
    looped = block_n > MAX_BLOCK_N["fwd"] or "BLOCK_N" in config  # looped configs name their chunk
    stats = rstd is not None
    if looped and not stats:
        mean = None if rms else scratch((rows,), torch.float32, input.device)
        rstd = scratch((rows,), torch.float32, input.device)
        stats = True
    x2 = _rows_2d(input, n)
    r2 = _rows_2d(residual, n) if residual is not None else None
    weight, bias = _unit_stride(weight), _unit_stride(bias)
    if config.get("SPLIT"):  # few long rows, each across programs side by side
        return fwd_split_launches(x2, r2, h, y, weight, bias, mean, rstd, eps, rms, config)
    # absent tensors go as None (the kernels' HAS_* and STATS flags leave them unread)
    args = (
        x2,
        r2,
        h,
        y,
        weight,
        bias,
        mean if stats else None,
        rstd if stats else None,
        rows,
        n,
        x2.stride(0),
        r2.stride(0) if r2 is not None else 0,
        float(eps),
    )
    # EVICT: L2 eviction hints, as torch.compile's kernels give them: evict_first on what is read for
    # the last time, evict_last on what is read again (the looped first pass, the weight and bias)
    evict = config.get("EVICT", False)
    flags = {
        "RMS": rms,
        "HAS_RESIDUAL": residual is not None,
        "HAS_WEIGHT": weight is not None,
        "HAS_BIAS": bias is not None,
    }
    options = {
        "num_warps": config["num_warps"],
        "EVICT_READ_ONCE": "evict_first" if evict else "",
        "EVICT_REREAD": "evict_last" if evict else "",
    }
    align = {"ALIGN": row_align((n, *args[10:12]), min(x2.element_size(), y.element_size()))}  # (last)
    if looped:
        # PER_SM: a persistent grid of that many programs an SM walks the rows
        programs = min(rows, config["PER_SM"] * sm_count(input.device)) if "PER_SM" in config else rows
        # rows that fit compile for their length (ROW_LENGTH), as the one-pass kernel does for its block
        row_length = n if block_n <= MAX_BLOCK_N["fwd"] else 0
        meta = (
            flags
            | options
            | {
                "BLOCK_N": config["BLOCK_N"],
                "ROW_LENGTH": row_length,
                "OUT_BLOCK_N": config.get("OUT_BLOCK_N", config["BLOCK_N"]),
            }
            | align
        )
        return [Launch("fwd", _norm_fwd_looped_kernel, args, meta, config, (programs,))]
    meta = flags | {"STATS": stats} | options | {"BLOCK_M": config["BLOCK_M"], "BLOCK_N": block_n} | align
    return [Launch("fwd", _norm_fwd_kernel, args, meta, config, (cdiv(rows, config["BLOCK_M"]),))]


def _bwd_launches(
    grad_y, grad_h, h, weight, bias, mean, rstd, rms: bool, dx, dw, db, config: dict
) -> list[Launch]:
    """The backward's launches for a non-empty ``h``: the main kernel, writing dx and each program's
    fp32 partial sums of dw and db (workspace allocated here), then, with a weight or a bias, the
    second stage that sums the partials into ``dw`` and ``db``; a launch of one program writes
    ``dw`` and ``db`` itself (its sums cast as it stores them), with no second stage. Absent
    statistics are stood in for by empty ones (for inspect); absent tensors go as None (the
    kernels' flags leave them unread)."""
    n = h.shape[-1]
    rows = h.numel() // n
    # At least two entries a row block: with one, Triton folds a row's sums to the entry itself, and
    # the GPU's compiler fuses dy * w into dx's subtraction of mean(dy * w), leaving the product's
    # rounding error where LayerNorm's dx is exactly 0 (rstd times it: 2.8e-6 at eps 1e-5)
    block_n = max(ROW_BLOCK_MIN, next_power_of_2(n))
    looped = block_n > MAX_BLOCK_N["bwd"]
    rstd = rstd if rstd is not None else scratch((rows,), torch.float32, h.device)
    if mean is None and not rms:
        mean = scratch((rows,), torch.float32, h.device)
    h2, dy2 = _rows_2d(h, n), _rows_2d(grad_y.to(h.dtype), n)
    dh2 = _rows_2d(grad_h.to(h.dtype), n) if grad_h is not None else None
    if config.get("SPLIT"):  # few long rows, each across programs side by side
        split = bwd_split_launches(
            dy2, dh2, h2, _unit_stride(weight), bias, mean, rstd, rms, dx, dw, db, config
        )
        launches, dw_partial, db_partial = split
        if dw_partial is None and db_partial is None:
            return launches
        return [*launches, sum_partials_launch(dw_partial, db_partial, dw, db)]
    programs = cdiv(rows, config["ROWS"])
    alone = programs == 1 and all(g is None or g.is_contiguous() for g in (dw, db))
    dw_partial = _partials(weight, dw, programs, alone)
    db_partial = _partials(bias, db, programs, alone)
    stats = (_unit_stride(weight), mean, rstd)
    tail = (
        dx,
        dw_partial,
        db_partial,
        rows,
        n,
        dy2.stride(0),
        dh2.stride(0) if dh2 is not None else 0,
        h2.stride(0),
    )
    meta = {
        "RMS": rms,
        "HAS_DH": grad_h is not None,
        "HAS_WEIGHT": weight is not None,
        "HAS_BIAS": bias is not None,
        "ROWS": config["ROWS"],
        "num_warps": config["num_warps"],
    }
    align = {"ALIGN": row_align((n, *tail[-3:]), h.element_size())}  # the kernels' last constexpr
    block_m = config.get("BLOCK_M", 1)  # rows the one-pass backward reduces together
    if block_m > 1 and looped or config["ROWS"] % block_m:
        raise ValueError(f"BLOCK_M must divide ROWS, and the looped backward takes rows singly: {config}")
    if looped:
        sums = scratch((rows, 2), torch.float32, h.device)  # per-row scratch
        main = Launch(
            "bwd",
            _norm_bwd_looped_kernel,
            (dy2, dh2, h2, *stats, sums, *tail),
            meta | {"BLOCK_N": config["BLOCK_N"]} | align,
            config,
            (programs,),
        )
    else:
        meta |= {"BLOCK_M": block_m, "BLOCK_N": block_n, "PREFETCH": config.get("PREFETCH", False)} | align
        main = Launch("bwd", _norm_bwd_kernel, (dy2, dh2, h2, *stats, *tail), meta, config, (programs,))
    if alone or dw_partial is None and db_partial is None:
        return [main]
    return [main, sum_partials_launch(dw_partial, db_partial, dw, db)]


def _partials(param, grad, programs: int, alone: bool) -> torch.Tensor | None:
    """Where the backward's programs store their sums of ``param``'s gradient: None without the
    parameter, ``grad`` itself from a launch of one program (``alone``), else a (programs, N) fp32
    workspace."""
    if param is None:
        return None
    if alone and grad is not None:
        return grad
    return scratch((programs, param.shape[-1]), torch.float32, param.device)


def _run(launches: list[Launch]) -> None:
    """Run an op call's launches: the op path's one door to the GPU (the tuner runs its candidates
    through its Tuned)."""
    for launch in launches:
        launch.run()


# ---------------------------------------------------------------- tuning


def _tuning_key(direction: str, n: int, rows: int, dtype: torch.dtype, params: dict) -> dict:
    """The kernel (direction, looped), the shape bucket and what specialises the kernel: the dtype,
    RMS or not, the residual (backward: its gradient) and the parameters' dtypes."""
    block_n = next_power_of_2(n)
    return {
        "direction": direction,
        "looped": block_n > MAX_BLOCK_N[direction],
        "block_n": block_n,
        "rows": next_power_of_2(rows),
        "dtype": NAME_OF[dtype],
        **params,
    }


def _params_key(residual: bool, weight, bias, rms: bool) -> dict:
    """What specialises a kernel beyond its shape: RMS or not, a residual (backward: the gradient of
    h, which the add_ forms' dx takes in) and the parameters' dtypes."""
    name = lambda t: NAME_OF[t.dtype] if t is not None else None  # noqa: E731
    return {"rms": rms, "residual": residual, "weight": name(weight), "bias": name(bias)}


_DEFAULTS = {
    ("fwd", False): _fwd_default,
    ("fwd", True): _fwd_looped_default,
    ("bwd", False): _bwd_default,
    ("bwd", True): _bwd_looped_default,
}


def _default(key: dict) -> dict:
    """The untuned config of the key's kernel: its fixed rule, defined above it in kernels.py."""
    return _DEFAULTS[key["direction"], key["looped"]](key)


# A call as its Tuned sees it: the arguments of _fwd_launches and _bwd_launches, by name. The
# backward's calibration also holds the forward's input, residual and eps, whose gradients its
# reference takes.
_FWD_NAMES = ("input", "residual", "weight", "bias", "eps", "rms", "y", "h", "mean", "rstd")
_BWD_NAMES = ("grad_y", "grad_h", "h", "weight", "bias", "mean", "rstd", "rms", "dx", "dw", "db")


def _problem(names: tuple, *values) -> dict:
    """A problem from a builder's arguments, named by ``names``."""
    return dict(zip(names, values, strict=True))


def _problem_launches(launches: Callable, names: tuple, problem: dict, config: dict) -> list[Launch]:
    """What ``launches`` (a builder) returns for a problem's arguments, ``names`` in order."""
    return launches(*(problem[name] for name in names), config)


def _problem_key(direction: str, rows_like: torch.Tensor, has_residual: bool, problem: dict) -> dict:
    """The tuning key of a problem whose rows are like ``rows_like`` (input forward, h backward)."""
    n = rows_like.shape[-1]
    params = _params_key(has_residual, problem["weight"], problem["bias"], problem["rms"])
    return _tuning_key(direction, n, rows_like.numel() // n, rows_like.dtype, params)


def _calibration_inputs(key: dict, n: int, config: dict, device, grads: bool) -> dict:
    """Seeded random inputs of the key's kind with a partial last row group: input, residual,
    weight and bias, with ``grads`` grad_y and grad_h too (each None where the key has none)."""
    from tritonkit.testing import generator, random_tensor

    per_program = config.get("ROWS", config.get("BLOCK_M", 1))
    rows = max(1, min(key["rows"], 2 * per_program + 1, CALIBRATION_ELEMENTS // max(1, n)))
    g = generator(11)
    make = lambda shape, name: random_tensor(shape, DTYPE_OF[name], device, generator=g)  # noqa: E731
    inputs = {
        "input": make((rows, n), key["dtype"]).mul_(2.0).add_(0.5),  # off zero: the mean matters
        "residual": make((rows, n), key["dtype"]) if key["residual"] else None,
        "weight": make((n,), key["weight"]) if key["weight"] else None,
        "bias": make((n,), key["bias"]) if key["bias"] else None,
    }
    if grads:
        inputs |= {
            "grad_y": make((rows, n), key["dtype"]),
            "grad_h": make((rows, n), key["dtype"]) if key["residual"] else None,
        }
    return inputs


def _fwd_calibration(problem: dict, config: dict) -> dict:
    """A small forward problem of the call's kind, storing its statistics as a backward's would."""
    key = _problem_key("fwd", problem["input"], problem["residual"] is not None, problem)
    cal = _calibration_inputs(key, problem["input"].shape[-1], config, problem["input"].device, grads=False)
    x, residual, rms = cal["input"], cal["residual"], problem["rms"]
    outputs = _forward_outputs(x, residual, rms, stats=True)
    return _problem(_FWD_NAMES, x, residual, cal["weight"], cal["bias"], problem["eps"], rms, *outputs)


def _bwd_calibration(problem: dict, config: dict) -> dict:
    """A small backward problem of the call's kind, from its forward run with the default config."""
    key = _problem_key("bwd", problem["h"], problem["grad_h"] is not None, problem)
    cal = _calibration_inputs(key, problem["h"].shape[-1], config, problem["h"].device, grads=True)
    x, residual, weight, bias, rms = cal["input"], cal["residual"], cal["weight"], cal["bias"], problem["rms"]
    y, h, mean, rstd = _forward_outputs(x, residual, rms, stats=True)
    fwd_key = _tuning_key(
        "fwd", x.shape[-1], x.shape[0], x.dtype, {k: key[k] for k in ("rms", "residual", "weight", "bias")}
    )
    for launch in _fwd_launches(
        x, residual, weight, bias, BWD_CALIBRATION_EPS, rms, y, h, mean, rstd, _default(fwd_key)
    ):
        launch.run()
    h = h if h is not None else x
    dx = empty_output_like(h)
    dw, db = (empty_output_like(t) if t is not None else None for t in (weight, bias))
    backward = _problem(
        _BWD_NAMES, cal["grad_y"], cal["grad_h"], h, weight, bias, mean, rstd, rms, dx, dw, db
    )
    return backward | {"input": x, "residual": residual, "eps": BWD_CALIBRATION_EPS}


def _forward_reference(input, residual, weight, bias, eps: float, rms: bool) -> tuple:
    """(y, h or None) of the op in plain PyTorch (the references below)."""
    shape = (input.shape[-1],)
    if residual is not None:
        if rms:
            return add_rms_norm_reference(input, residual, shape, weight, eps)
        return add_layer_norm_reference(input, residual, shape, weight, bias, eps)
    if rms:
        return rms_norm_reference(input, shape, weight, eps), None
    return layer_norm_reference(input, shape, weight, bias, eps), None


def _fwd_problem_reference(problem: dict) -> dict:
    """y and h (None without a residual) of a forward problem, in plain PyTorch."""
    inputs = ("input", "residual", "weight", "bias", "eps", "rms")
    y, h = _forward_reference(*(problem[name] for name in inputs))
    return {"y": y, "h": h}


def _bwd_problem_reference(problem: dict) -> dict:
    """dx, dw and db by autograd through the forward's reference, whatever the caller's grad mode
    (the gate runs inside the backward op, where autograd records nothing)."""
    leaf = lambda t, grad: t.detach().requires_grad_(grad) if t is not None else None  # noqa: E731
    with torch.enable_grad():
        # the residual's gradient is x's, dx
        x, residual = leaf(problem["input"], True), leaf(problem["residual"], False)
        weight, bias = leaf(problem["weight"], True), leaf(problem["bias"], True)
        y, h = _forward_reference(x, residual, weight, bias, problem["eps"], problem["rms"])
        outputs, upstream = (
            ([y, h], [problem["grad_y"], problem["grad_h"]]) if h is not None else ([y], [problem["grad_y"]])
        )
        wanted = [t for t in (x, weight, bias) if t is not None]
        grads = iter(torch.autograd.grad(outputs, wanted, upstream))
    return {
        "dx": next(grads),
        "dw": next(grads) if weight is not None else None,
        "db": next(grads) if bias is not None else None,
    }


def _tuned(direction: str, looped: bool, configs: list, prune: Callable, kernels: tuple) -> tuning.Tuned:
    """The Tuned of one kernel pair; ``kernels``: those its timings run (its source hash covers them)."""
    name = f"norm_{direction}{'_looped' if looped else ''}"
    tuner = tuning.Tuner(name, configs, sources=kernels, default=_DEFAULTS[direction, looped], prune=prune)
    fwd = direction == "fwd"
    return tuning.Tuned(
        tuner,
        launches=functools.partial(
            _problem_launches, *((_fwd_launches, _FWD_NAMES) if fwd else (_bwd_launches, _BWD_NAMES))
        ),
        calibrate=_fwd_calibration if fwd else _bwd_calibration,
        reference=_fwd_problem_reference if fwd else _bwd_problem_reference,
        outputs=("y", "h") if fwd else ("dx", "dw", "db"),
    )


# One tuner a kernel pair (direction, looped). The one-pass forward's looped candidates run the looped
# kernel; the backward's timings include its second stage.
_TUNED = {
    ("fwd", False): _tuned(
        "fwd", False, FWD_CONFIGS, _fwd_prune, (_norm_fwd_kernel, _norm_fwd_looped_kernel)
    ),
    ("fwd", True): _tuned(
        "fwd", True, FWD_LOOPED_CONFIGS, _fwd_looped_prune, (_norm_fwd_looped_kernel, _norm_fwd_split_kernel)
    ),
    ("bwd", False): _tuned("bwd", False, BWD_CONFIGS, _bwd_prune, (_norm_bwd_kernel, _sum_partials_kernel)),
    ("bwd", True): _tuned(
        "bwd",
        True,
        BWD_LOOPED_CONFIGS,
        _bwd_looped_prune,
        (_norm_bwd_looped_kernel, _norm_bwd_split_kernel, _norm_bwd_columns_kernel, _sum_partials_kernel),
    ),
}


def _config(
    direction: str, h: torch.Tensor, has_residual: bool, weight, bias, rms: bool, problem: Callable[[], dict]
) -> dict:
    """The tuned (or default) config of the kernel for rows like ``h``: for a call signature (shape,
    dtypes, device, what is present) seen before, the one its Tuned chose, without building the
    tuning key (some microseconds a call); else the Tuned's choice, tuned on ``problem()`` if need be."""
    n = h.shape[-1]
    signature = (
        h.shape,
        h.dtype,
        h.device,
        has_residual,
        weight.dtype if weight is not None else None,
        bias.dtype if bias is not None else None,
        rms,
    )

    # the key costs microseconds to build: Tuned.choose builds it only when its memo does not answer
    # (MAX_BLOCK_N holds powers of two, so n > MAX_BLOCK_N is the key's "looped")
    def key():
        return _tuning_key(
            direction, n, h.numel() // n, h.dtype, _params_key(has_residual, weight, bias, rms)
        )

    return _TUNED[direction, n > MAX_BLOCK_N[direction]].choose(key, problem, signature=signature)[0]


# ---------------------------------------------------------------- validation, custom ops and autograd


def _check_normalized_shape(input, normalized_shape, first: str) -> int:
    """N, the last dimension, which ``normalized_shape`` must name (the only form supported)."""
    shape = (normalized_shape,) if isinstance(normalized_shape, (int, torch.SymInt)) else normalized_shape
    if isinstance(shape, torch.Tensor) or not all(isinstance(d, (int, torch.SymInt)) for d in shape):
        raise TypeError(
            f"normalized_shape must be an int or a sequence of ints, as torch.nn.functional's norms "
            f"take it (the weight comes after it), got {type(normalized_shape).__name__}"
        )
    shape = tuple(shape)
    if len(shape) != 1:
        raise NotImplementedError(f"normalized_shape over more than the last dimension: {shape}")
    n = input.shape[-1]
    if shape[0] != n:
        raise ValueError(f"normalized_shape {shape} must match {first}'s last dimension {n}")
    return n


def _validate(input, normalized_shape, weight, bias, residual) -> None:
    """Raise TypeError, ValueError or NotImplementedError naming the argument that is not one the
    kernels take; once a call, in the public function. The first tensor is ``input``, or ``x`` in
    the fused residual forms (their signatures' names)."""
    first = "input" if residual is None else "x"
    check_tensor(first, input, dtypes=DTYPES, min_ndim=1)
    n = _check_normalized_shape(input, normalized_shape, first)
    for name, param in (("weight", weight), ("bias", bias)):
        if param is None:
            continue
        check_tensor(name, param, device_of=(first, input))
        if param.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(param.shape)}")
        # (an fp32 input takes 16-bit parameters: torch's result is fp32 then too)
        allowed = DTYPES if input.dtype == torch.float32 else (input.dtype, torch.float32)
        if param.dtype not in allowed:
            names = ", ".join(str(dtype).removeprefix("torch.") for dtype in allowed)
            raise TypeError(f"{name} must be one of {names} for {first} in {input.dtype}, got {param.dtype}")
    if residual is not None:
        check_tensor("residual", residual, device_of=(first, input))
        if residual.shape != input.shape or residual.dtype != input.dtype:
            raise ValueError(
                f"residual must match {first}: {tuple(input.shape)} {input.dtype}, got "
                f"{tuple(residual.shape)} {residual.dtype}"
            )


def _forward_outputs(input, residual, rms: bool, stats: bool) -> tuple:
    """(y, h, mean, rstd) allocated for the forward: h None without a residual; mean and rstd (fp32,
    one a row) only with ``stats``, for a backward, and mean only for LayerNorm."""
    n = input.shape[-1]
    rows = input.numel() // n if n else 0
    y = empty_output_like(input)
    h = empty_output_like(input) if residual is not None else None
    mean = empty_output((rows,), torch.float32, input.device) if stats and not rms else None
    rstd = empty_output((rows,), torch.float32, input.device) if stats else None
    return y, h, mean, rstd


@op("norm", mutates=("y", "h", "mean", "rstd"), replay=True)
def _forward(
    input: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    y: torch.Tensor,
    h: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor | None,
) -> None:
    """y = norm(input (+ residual)) into ``y``, the sum into ``h`` given a residual, and the row
    statistics into ``mean`` (LayerNorm) and ``rstd`` where they are given (for a backward)."""
    if input.numel() == 0:
        return
    config = _config(
        "fwd",
        input,
        residual is not None,
        weight,
        bias,
        rms,
        lambda: _problem(_FWD_NAMES, input, residual, weight, bias, eps, rms, y, h, mean, rstd),
    )
    _run(_fwd_launches(input, residual, weight, bias, eps, rms, y, h, mean, rstd, config))


@op("norm_backward", mutates=("dx", "dw", "db"), replay=True)
def _backward(
    grad_y: torch.Tensor,
    grad_h: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    rms: bool,
    dx: torch.Tensor,
    dw: torch.Tensor | None,
    db: torch.Tensor | None,
) -> None:
    """dx (also the residual's gradient in the add_ forms) into ``dx``, and dw and db into ``dw`` and
    ``db`` where given, from the upstream gradients and what the forward saved."""
    if h.numel() == 0:
        for grad in (dw, db):
            if grad is not None:
                grad.zero_()  # a sum over no rows
        return
    config = _config(
        "bwd",
        h,
        grad_h is not None,
        weight,
        bias,
        rms,
        lambda: _problem(_BWD_NAMES, grad_y, grad_h, h, weight, bias, mean, rstd, rms, dx, dw, db),
    )
    _run(_bwd_launches(grad_y, grad_h, h, weight, bias, mean, rstd, rms, dx, dw, db, config))


def renormed(source: torch.Tensor, weight, bias, eps: float, rms: bool) -> torch.Tensor:
    """A norm's output again (``normed``): its forward's launch, statistics included, so that the
    config and the bits are the forward's, over the same ``source``."""
    y, _, mean, rstd = _forward_outputs(source, None, rms, stats=True)
    _forward(source, None, weight, bias, eps, rms, y, None, mean, rstd)
    return y


class _Norm(torch.autograd.Function):
    """One autograd function for eager calls and torch.compile (the ops skip the dispatcher eagerly);
    returns y, or (y, h) with a residual.

    forward takes ctx itself: a separate setup_context costs an inspect.signature bind per call.
    """

    @staticmethod
    def forward(ctx, input, residual, weight, bias, eps, rms, pair):
        y, h, mean, rstd = _forward_outputs(input, residual, rms, stats=True)
        _forward(input, residual, weight, bias, eps, rms, y, h, mean, rstd)
        ctx.save_for_backward(h if residual is not None else input, weight, bias, mean, rstd)
        ctx.rms, ctx.has_residual = rms, residual is not None
        ctx.set_materialize_grads(False)  # an unused y passes None, not zeros: see backward
        if residual is None:
            if not torch.compiler.is_compiling():  # a projection of y may save this in y's place
                normed.mark(y, input, weight, bias, eps, rms)
            # pair: the sum is x itself, handed on as a view whose gradient (x's other uses', a
            # residual's) comes back here and is added in the norm's backward pass, not by autograd
            return (y, input.view_as(input)) if pair else y
        return y, h

    @staticmethod
    @first_derivative_only("layer_norm / rms_norm")
    def backward(ctx, grad_y, grad_h=None):
        if grad_y is None:  # only the sum h was used: nothing reached the norm, so its weight
            # and bias get None, as in torch's composition (an optimizer skips them; zeros it would not)
            return grad_h, grad_h if ctx.has_residual else None, None, None, None, None, None
        h, weight, bias, mean, rstd = ctx.saved_tensors
        dx = empty_output_like(h)
        dw, db = (empty_output_like(t) if t is not None else None for t in (weight, bias))
        _backward(grad_y, grad_h, h, weight, bias, mean, rstd, ctx.rms, dx, dw, db)
        return dx, dx if ctx.has_residual else None, dw, db, None, None, None


# (normalized_shape given as a list: no key, checked every call)
_validate_once = checked_once(
    _validate,
    lambda input, normalized_shape, weight, bias, residual: call_signature(
        (input, residual, weight, bias), normalized_shape
    ),
)


def _norm(input, residual, normalized_shape, weight, bias, eps, rms: bool, pair: bool = False):
    """The public functions' one body: y, or (y, h) with a residual or ``pair`` (``eps`` None:
    RMSNorm's default for the dtype)."""
    _validate_once(input, normalized_shape, weight, bias, residual)
    if rms:
        eps = rms_eps(eps, input.dtype)
    _check_eps(eps, "rms_norm" if rms else "layer_norm")
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (input, residual, weight, bias)
    ):
        return _Norm.apply(input, residual, weight, bias, eps, rms, pair)
    # no backward will follow: the statistics are not stored
    y, h, _, _ = _forward_outputs(input, residual, rms, stats=False)
    _forward(input, residual, weight, bias, eps, rms, y, h, None, None)
    if residual is None:
        return (y, input) if pair else y
    return y, h


def _check_eps(eps, name: str) -> None:
    """Raise naming ``eps`` unless it is a finite real number >= 0 (LayerNorm has no default
    for None, as F.layer_norm has none)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{name}: eps must be a real number >= 0, got {eps!r}")
    if not (finite(eps) and eps >= 0):
        raise ValueError(f"{name}: eps must be a finite number >= 0, got {eps!r}")


def rms_eps(eps: float | None, dtype: torch.dtype) -> float:
    """F.rms_norm's default eps: the machine epsilon of the type it computes in, fp32 for 16-bit
    inputs (1.2e-7, not bf16's 7.8e-3, which shifts outputs of small rows by several percent)."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps if eps is None else eps


def layer_norm(
    input: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` over the last dimension, statistics in fp32."""
    return _norm(input, None, normalized_shape, weight, bias, eps, rms=False)


def rms_norm(
    input: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None, eps: float | None = None
) -> torch.Tensor:
    """``torch.nn.functional.rms_norm`` over the last dimension, statistics in fp32."""
    return _norm(input, None, normalized_shape, weight, None, eps, rms=True)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(x + residual), x + residual)`` in one pass; with ``residual`` None (a first
    layer's), ``(layer_norm(x), x)``: x itself, or where autograd records, a view of x whose
    gradient the norm's backward adds to x's in its own pass (autograd would sum the two apart)."""
    return _norm(x, residual, normalized_shape, weight, bias, eps, rms=False, pair=True)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    normalized_shape,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass; with ``residual`` None (a first
    layer's), ``(rms_norm(x), x)``: x itself, or where autograd records, a view of x whose
    gradient the norm's backward adds to x's in its own pass (autograd would sum the two apart)."""
    return _norm(x, residual, normalized_shape, weight, None, eps, rms=True, pair=True)


# ---------------------------------------------------------------- reference and cost


def layer_norm_reference(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Plain PyTorch; pass float64 inputs for the oracle's reference. Parameters of another dtype than
    the input (fp32 weights of a bf16 model: the kernels take them) are computed with in fp32, the
    result rounded to the input's dtype, as the kernels do: torch's CUDA layer_norm takes one dtype."""
    params = [p for p in (weight, bias) if p is not None]
    if any(p.dtype != input.dtype for p in params) and input.dtype != torch.float64:
        wide = lambda t: t.float() if t is not None else None  # noqa: E731
        out = torch.nn.functional.layer_norm(input.float(), normalized_shape, wide(weight), wide(bias), eps)
        return out.to(input.dtype)
    return torch.nn.functional.layer_norm(input, normalized_shape, weight, bias, eps)


def rms_norm_reference(input, normalized_shape, weight=None, eps=None):
    return torch.nn.functional.rms_norm(input, normalized_shape, weight, eps)


def add_layer_norm_reference(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    h = x + residual
    return layer_norm_reference(h, normalized_shape, weight, bias, eps), h


def add_rms_norm_reference(x, residual, normalized_shape, weight=None, eps=None):
    h = x + residual
    return torch.nn.functional.rms_norm(h, normalized_shape, weight, eps), h


def norm_cost(
    shape: tuple, dtype: torch.dtype, mode: str = "fwd", *, residual: bool = False, bias: bool = True
) -> Cost:
    """Minimal traffic with a weight (and bias) in the input dtype. Forward reads x (and the
    residual), writes y (and h), reads the parameters; backward reads h and dy (and dh), writes dx
    (the residual's gradient is the same tensor), reads the weight and writes dw (and db)."""
    n, elements = shape[-1], math.prod(shape)
    size, params = torch.finfo(dtype).bits // 8, 2 if bias else 1
    fwd = Cost(FWD_FLOPS_PER_ELEMENT * elements, size * ((4 if residual else 2) * elements + params * n))
    bwd = Cost(
        BWD_FLOPS_PER_ELEMENT * elements, size * ((4 if residual else 3) * elements + (1 + params) * n)
    )
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


# FLOPs an element, each add, multiply and reduction step counted once: forward the sums, centring,
# scaling, weight and bias; backward g, the two row sums, the combination and the dw/db sums.
FWD_FLOPS_PER_ELEMENT = 7
BWD_FLOPS_PER_ELEMENT = 10
