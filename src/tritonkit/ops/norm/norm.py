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
that read each row twice (``kernels.py``). Rows a program, chunk sizes and warps come from
accuracy-gated tuning (``tritonkit.tuning``), each kernel with its own tuner and configs.
h = x + residual is added in fp32 and rounded to the input dtype before it is normalised, as
``norm(x + residual)`` is in PyTorch: the backward then recomputes xhat from the stored h exactly.
"""

from __future__ import annotations

import functools
import math

import torch

from tritonkit import tuning
from tritonkit._launch import Launch, Launcher, cdiv, precompile
from tritonkit._runtime import check_device, current_device, empty_output, interpret, sm_count
from tritonkit.dtypes import DTYPE_OF, FLOATS, NAME_OF
from tritonkit.ops.norm.kernels import (
    _norm_bwd_kernel,
    _norm_bwd_looped_kernel,
    _norm_fwd_kernel,
    _norm_fwd_looped_kernel,
    _sum_partials_kernel,
)

DTYPES = FLOATS
# A row lives in registers: at 16 warps, 64 fp32 values a thread hold 32768 entries forward; the
# backward holds h and dy at once, hence half.
MAX_BLOCK_N = {"fwd": 32768, "bwd": 16384}

# Launch configs come from accuracy-gated tuning (tritonkit.tuning), one tuner per kernel: the
# forward one-pass kernel takes BLOCK_M rows a program, the backward one ROWS rows (summing their
# dw and db partials), the looped kernels walk rows in BLOCK_N chunks. The defaults below, used
# under the interpreter and wherever tuning cannot run, are the rules the kernels had before.
CONFIGS = {
    ("fwd", False): [{"BLOCK_M": m, "num_warps": w, **evict} for m in (1, 2, 4, 8, 16, 32) for w in (4, 8, 16)
                     for evict in ({}, {"EVICT": True})]
    # rows that fit in registers may still go faster through the looped kernel, one row a program
    # in chunks, read twice (the second time from cache), as torch.compile's kernels do
    + [{"BLOCK_N": n, "num_warps": w, **evict} for n in (1024, 2048, 4096) for w in (4, 8, 16)
       for evict in ({}, {"EVICT": True})],  # 1024 at 8 warps and 2048 at 16: torch.compile's 4 a thread
    ("fwd", True): [{"BLOCK_N": n, "num_warps": w} for n in (2048, 4096, 8192) for w in (4, 8, 16)]
    + [{"BLOCK_N": n, "num_warps": w, "PER_SM": p} for n in (4096, 8192) for w in (8, 16) for p in (1, 2, 4)]
    + [{"BLOCK_N": n, "num_warps": w, "EVICT": True, **per_sm} for n in (4096, 8192) for w in (8, 16)
       for per_sm in ({}, {"PER_SM": 1}, {"PER_SM": 2})]
    # chunks of 16-64K entries at 16-32 warps: one or two programs an SM, each with its whole row
    # (or half of it) in flight, so that pass 2 may find the row it has just read in L1 or L2
    + [{"BLOCK_N": n, "num_warps": w, **evict} for n in (16384, 32768, 65536) for w in (16, 32)
       for evict in ({}, {"EVICT": True})]
    # ... with pass 2 in smaller chunks, as it holds h, w and b together. LayerNorm's whole-row chunk
    # (65536 at 32 warps, sm_90) spilled 96 bytes; 56 with the smaller pass 2 alone, none once its
    # sums are also shifted by a sampled mean (kernels.SHIFT_SAMPLE)
    + [{"BLOCK_N": n, "OUT_BLOCK_N": out, "num_warps": w, **evict} for n in (32768, 65536)
       for out in (8192, 16384) for w in (16, 32) for evict in ({}, {"EVICT": True})],
    ("bwd", False): [{"ROWS": r, "num_warps": w, **prefetch} for r in (8, 16, 32, 64) for w in (2, 4, 8, 16)
                     for prefetch in ({}, {"PREFETCH": True})]
    # rows of up to 4096 entries (the prune's values a thread) also reduced BLOCK_M at a time: one
    # exchange between warps for the block, where each row had its own
    + [{"ROWS": r, "BLOCK_M": m, "num_warps": w, **prefetch} for r in (32, 64) for m in (2, 4) for w in (4, 8)
       for prefetch in ({}, {"PREFETCH": True})],
    ("bwd", True): [{"ROWS": r, "BLOCK_N": n, "num_warps": w} for r in (4, 8, 16) for n in (2048, 4096)
                    for w in (4, 8)],
}
# fp32 values a thread holds per tile (one-pass: the row tile, x or h and dy; looped: a chunk):
# past 64 the one-pass kernels spill, under 8 a program moves too little at once (the looped
# forward's pass 1 holds a chunk of 64 a thread at 32 warps in 64 registers, no spill on sm_90). A
# PREFETCH backward holds the next row's h and dy too: at most 32 a row.
PER_THREAD_RANGE = {False: (8, 64), True: (8, 64)}
PREFETCH_MAX_PER_THREAD = 32
LOOPED_MIN_PER_THREAD = 4  # looped forward on rows that fit: torch.compile's 2048-entry chunks, 16 warps
ROW_ELEMENTS = 8192  # default: elements a forward program takes at a time (rows of 1024 go 8 to one)
PER_THREAD = 16  # default: values a thread holds per row tile, four 16-byte fp32 vectors in flight
# Rows each backward program walks, summing its dw and db partials in registers (a power of two in
# this range; looped: finishing them chunk by chunk). Fewer rows a program cost partial traffic,
# 4 N bytes a program for each of dw and db, written and summed again; too few programs leave SMs
# idle: 8192 rows at 64 a program made 128 programs for 132 SMs.
BWD_ROWS_RANGE = {False: (8, 64), True: (4, 16)}  # one-pass, looped
BWD_PROGRAMS_PER_SM = 2  # default: what an SM holds of the one-pass backward (h and dy in registers)
LOOP_BLOCK_N = 4096  # default chunk of the looped kernels: 16 fp32 values a thread at 8 warps
LOOP_WARPS = 8
# The second stage, dw and db from their partials: about two programs an SM (columns a program
# within 8-64 fp32: a 32-byte sector to two 128-byte lines a partial row), each adding tiles of at
# most SUM_TILE values (32 a thread at 4 warps) a step, of both partials at once.
SUM_PROGRAMS = 256
SUM_TILE = 4096
SUM_WARPS = 4
CALIBRATION_ELEMENTS = 1 << 21  # cap on a calibration problem: its float64 reference stays small


# ---------------------------------------------------------------- launchers

_LAUNCHERS = {(direction, looped): Launcher(kernel) for (direction, looped), kernel in {
    ("fwd", False): _norm_fwd_kernel, ("fwd", True): _norm_fwd_looped_kernel,
    ("bwd", False): _norm_bwd_kernel, ("bwd", True): _norm_bwd_looped_kernel}.items()}
_SUM_PARTIALS = Launcher(_sum_partials_kernel)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _warps(elements: int) -> int:
    """Warps for a tile of ``elements`` fp32 values at PER_THREAD a thread, within 4..16."""
    return min(16, max(4, elements // (32 * PER_THREAD)))


def _bwd_rows_per_program(rows: int, device, looped: bool) -> int:
    """The most rows a backward program may walk while every SM still gets BWD_PROGRAMS_PER_SM
    programs, as a power of two within BWD_ROWS_RANGE."""
    low, high = BWD_ROWS_RANGE[looped]
    most = max(1, rows // (BWD_PROGRAMS_PER_SM * sm_count(device)))
    return min(high, max(low, 1 << (most.bit_length() - 1)))


# ---------------------------------------------------------------- tuning


def _tuning_key(direction: str, n: int, rows: int, dtype: torch.dtype, params: dict) -> dict:
    """The kernel (direction, looped), the shape bucket and what specialises the kernel: the dtype,
    RMS or not, the residual (backward: its gradient) and the parameters' dtypes."""
    block_n = _next_power_of_2(n)
    return {"direction": direction, "looped": block_n > MAX_BLOCK_N[direction], "block_n": block_n,
            "rows": _next_power_of_2(rows), "dtype": NAME_OF[dtype], **params}


def _default(key: dict) -> dict:
    """The untuned config: the kernels' fixed rules before tuning."""
    block_n, rows = key["block_n"], key["rows"]
    if key["direction"] == "fwd":
        if key["looped"]:
            return {"BLOCK_N": LOOP_BLOCK_N, "num_warps": LOOP_WARPS}
        block_m = max(1, min(rows, ROW_ELEMENTS // block_n))
        return {"BLOCK_M": block_m, "num_warps": _warps(block_m * block_n)}
    per_program = _bwd_rows_per_program(rows, current_device(), key["looped"])
    if key["looped"]:
        return {"ROWS": per_program, "BLOCK_N": LOOP_BLOCK_N, "num_warps": LOOP_WARPS}
    return {"ROWS": per_program, "num_warps": _warps(block_n)}


def _prune(config: dict, key: dict) -> bool:
    """True drops the config: fp32 values a thread outside PER_THREAD_RANGE (past
    PREFETCH_MAX_PER_THREAD where the next block is loaded ahead), rows a program beyond the
    problem, or so many backward rows a program that SMs would sit idle (the fewest rows a program
    of BWD_ROWS_RANGE always stays)."""
    tile = config.get("BLOCK_N", key["block_n"]) * config.get("BLOCK_M", 1)
    tiles = 2 if key["direction"] == "bwd" and not key["looped"] else 1  # h and dy
    low, high = PER_THREAD_RANGE[key["looped"]]
    if not key["looped"] and "BLOCK_N" in config:  # a looped config for a one-pass key
        low = LOOPED_MIN_PER_THREAD
    per_thread = tile * tiles / (32 * config["num_warps"])
    if not low <= per_thread <= high or config.get("PREFETCH") and per_thread > PREFETCH_MAX_PER_THREAD:
        return True
    if config.get("BLOCK_M", 1) > max(1, key["rows"]):
        return True
    if not key["looped"] and config.get("BLOCK_N", 0) > key["block_n"]:  # a looped chunk past the row
        return True
    rows = config.get("ROWS")
    return (rows is not None and rows > BWD_ROWS_RANGE[key["looped"]][0]
            and cdiv(key["rows"], rows) < sm_count(current_device()))


# the other kernels a tuner's timings depend on (each kernel's jit helpers are found by the tuner):
# the one-pass forward's looped candidates, and the backward's second stage, which each timing includes
_ALSO_TIMED = {("fwd", False): (_norm_fwd_looped_kernel,), ("bwd", False): (_sum_partials_kernel,),
               ("bwd", True): (_sum_partials_kernel,)}
_TUNERS = {
    (direction, looped): tuning.Tuner(f"norm_{direction}{'_looped' if looped else ''}", configs,
                                      default=_default, prune=_prune,
                                      sources=(_LAUNCHERS[direction, looped].kernel,
                                               *_ALSO_TIMED.get((direction, looped), ())))
    for (direction, looped), configs in CONFIGS.items()
}


def _params_key(residual: bool, weight, bias, rms: bool) -> dict:
    """What specialises a kernel beyond its shape: RMS or not, a residual (backward: the gradient of
    h, which the add_ forms' dx takes in) and the parameters' dtypes."""
    name = lambda t: NAME_OF[t.dtype] if t is not None else None  # noqa: E731
    return {"rms": rms, "residual": residual, "weight": name(weight), "bias": name(bias)}


def _calibration(key: dict, n: int, config: dict, device) -> dict:
    """Seeded random inputs of the key's kind with a partial last row group: x, residual, weight,
    bias, dy and dh (each None where the key has none)."""
    from tritonkit.testing import generator, random_tensor

    per_program = config.get("ROWS", config.get("BLOCK_M", 1))
    rows = max(1, min(key["rows"], 2 * per_program + 1, CALIBRATION_ELEMENTS // max(1, n)))
    g = generator(11)
    make = lambda shape, name: random_tensor(shape, DTYPE_OF[name], device, generator=g)  # noqa: E731
    x = make((rows, n), key["dtype"]).mul_(2.0).add_(0.5)  # off zero: the mean matters
    return {"x": x, "residual": make((rows, n), key["dtype"]) if key["residual"] else None,
            "weight": make((n,), key["weight"]) if key["weight"] else None,
            "bias": make((n,), key["bias"]) if key["bias"] else None,
            "dy": make((rows, n), key["dtype"]),
            "dh": make((rows, n), key["dtype"]) if key["residual"] else None}


def _reference_fn(key: dict, eps: float):
    """The key's op (its reference below) as a function of (x, residual, weight, bias), returning
    (y, h or None)."""
    def run(x, residual, weight, bias):
        shape = (x.shape[-1],)
        if residual is not None:
            if key["rms"]:
                return add_rms_norm_reference(x, residual, shape, weight, eps)
            return add_layer_norm_reference(x, residual, shape, weight, bias, eps)
        if key["rms"]:
            return rms_norm_reference(x, shape, weight, eps), None
        return layer_norm_reference(x, shape, weight, bias, eps), None
    return run


def _admit(key: dict, n: int, eps: float, device, config: dict):
    """``config``'s results on a calibration problem against the oracle, y (and h) forward, dx, dw
    and db backward: the comparison nearest its bound (a failing one, if any fails)."""
    from tritonkit.testing import compare, worst

    cal = _calibration(key, n, config, device)
    inputs = (cal["x"], cal["residual"], cal["weight"], cal["bias"])
    reference = _reference_fn(key, eps)
    if key["direction"] == "fwd":
        y, h, _, _ = _norm_fwd(*inputs, eps, key["rms"], config=config)
        exact = reference(*(t.double() if t is not None else None for t in inputs))
        in_dtype = reference(*inputs)
        pairs = [(y, in_dtype[0], exact[0])] + ([(h, in_dtype[1], exact[1])] if h is not None else [])
        return worst([compare("output", *pair, cal["x"].dtype) for pair in pairs])
    fwd_key = _tuning_key("fwd", n, cal["x"].shape[0], cal["x"].dtype,
                          {k: key[k] for k in ("rms", "residual", "weight", "bias")})
    y, h, mean, rstd = _norm_fwd(*inputs, eps, key["rms"], config=_default(fwd_key))
    grads = _norm_bwd(cal["dy"], cal["dh"], h if h is not None else cal["x"], cal["weight"], cal["bias"],
                      mean, rstd, key["rms"], config=config)
    wanted = [0] + [i for i in (2, 3) if inputs[i] is not None]  # x (= residual), weight, bias

    def reference_grads(upcast: bool):
        args = [t.double() if upcast and t is not None else t for t in inputs]
        args = [t.detach().requires_grad_(i in wanted) if t is not None else None for i, t in enumerate(args)]
        y_ref, h_ref = reference(*args)
        outs, upstream = [y_ref], [cal["dy"]]
        if h_ref is not None:
            outs, upstream = [y_ref, h_ref], [cal["dy"], cal["dh"]]
        upstream = [u.double() if upcast else u for u in upstream]
        return torch.autograd.grad(outs, [args[i] for i in wanted], upstream)

    with torch.enable_grad():
        exact, in_dtype = reference_grads(True), reference_grads(False)
    ours = [grads[0]] + [g for g in grads[1:] if g is not None]
    return worst([compare("grad", o, t, e, o.dtype) for o, t, e in zip(ours, in_dtype, exact, strict=True)])


def _time_ms(run, config: dict) -> float:
    """Median ms of ``run(config)``: the real problem with the config."""
    return tuning.median_ms(lambda: run(config))


# Configs once chosen for good, by call signature (shape, dtypes, device, what is present): a call
# seen before skips the tuning key. Cleared when MAX_CHOSEN signatures have gathered.
MAX_CHOSEN = 4096
_chosen: dict[tuple, dict] = {}


def _precompile(key: dict, n: int, device, launch_args, configs: list[dict]) -> None:
    """Compile every candidate for its calibration problem and the real one (they specialise apart)
    at once, on threads: tuning then spends its time timing. ``launch_args(config)`` gives the real
    problem's (outputs, launcher, grid, arguments, meta)."""
    calls = []
    for config in configs:
        cal = _calibration(key, n, config, device)
        inputs = (cal["x"], cal["residual"], cal["weight"], cal["bias"])
        if key["direction"] == "fwd":
            calibration = _fwd_launch_args(*inputs, 1e-5, key["rms"], config)
        else:  # statistics default to empty ones: nothing is launched
            calibration = _bwd_launch_args(cal["dy"], cal["dh"], cal["x"], cal["weight"], cal["bias"],
                                           key["rms"], config)
        calls += [launch[1:] for launch in (calibration, launch_args(config))]
    precompile(calls)


def _config(direction: str, h: torch.Tensor, has_residual: bool, weight, bias, rms: bool, eps: float, run,
            launch_args) -> dict:
    """The tuned (or default) config of the kernel for rows like ``h``; ``run(config)`` is the real
    problem and ``launch_args(config)`` its launch."""
    param_dtypes = tuple(t.dtype if t is not None else None for t in (weight, bias))
    signature = (direction, h.shape, h.dtype, h.device, has_residual, param_dtypes, rms)
    config = _chosen.get(signature)
    if config is None:
        n = h.shape[-1]
        key = _tuning_key(direction, n, h.numel() // n, h.dtype, _params_key(has_residual, weight, bias, rms))
        tuner = _TUNERS[key["direction"], key["looped"]]
        entry = tuner.entry(key, admit=functools.partial(_admit, key, n, eps, h.device),
                            time_ms=functools.partial(_time_ms, run),
                            precompile=functools.partial(_precompile, key, n, h.device, launch_args))
        config = tuner.default(key) if entry is None else entry["config"]
        if entry is not None or interpret():  # final: tuned, cached, or the interpreter's one config
            tuning.remember(_chosen, signature, config, MAX_CHOSEN)
    return config


def _unit_stride(param: torch.Tensor | None) -> torch.Tensor | None:
    """A weight or bias as the kernels read it, entry i at offset i (a strided view is copied)."""
    return param if param is None or param.stride() == (1,) else param.contiguous()


def _rows_2d(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as (rows, n) with unit column stride: a view where the strides allow, else a copy."""
    t = t.reshape(-1, n)
    return t if t.stride(1) == 1 or n == 1 else t.contiguous()


def _check_normalized_shape(input, normalized_shape) -> int:
    """N, the last dimension, which ``normalized_shape`` must name (the only form supported)."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1:
        raise NotImplementedError(f"normalized_shape over more than the last dimension: {shape}")
    n = input.shape[-1]
    if shape[0] != n:
        raise ValueError(f"normalized_shape {shape} must match input's last dimension {n}")
    return n


def _validate(input, normalized_shape, weight, bias, residual=None) -> int:
    """Check the arguments; return N, the normalised length."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if input.dtype not in DTYPES:
        raise TypeError(f"input must be float16, bfloat16 or float32, got {input.dtype}")
    if input.dim() == 0:
        raise ValueError("input must have at least one dimension")
    n = _check_normalized_shape(input, normalized_shape)
    for name, param in (("weight", weight), ("bias", bias)):
        if param is None:
            continue
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(param).__name__}")
        if param.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(param.shape)}")
        if param.dtype not in (input.dtype, torch.float32):
            raise TypeError(f"{name} must be float32 or input's dtype {input.dtype}, got {param.dtype}")
        if param.device != input.device:
            raise ValueError(f"{name} must be on input's device {input.device}, got {param.device}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
        if residual.shape != input.shape or residual.dtype != input.dtype:
            raise ValueError(f"residual must match input: {tuple(input.shape)} {input.dtype}, got "
                             f"{tuple(residual.shape)} {residual.dtype}")
        if residual.device != input.device:
            raise ValueError(f"residual must be on input's device {input.device}")
    check_device("input", input)
    return n


def _norm_fwd(input, residual, weight, bias, eps: float, rms: bool, config: dict | None = None,
              validated: bool = False, stats: bool = True):
    """(y, h or None, mean or None, rstd or None): h = input + residual when a residual is given.
    Without ``config``, the tuned one for the shape; ``validated``: the public function checked the
    arguments; ``stats``: the mean and rstd are wanted (for a backward)."""
    if not validated:
        _validate(input, input.shape[-1:], weight, bias, residual)
    if input.numel() and config is None:
        config = _config("fwd", input, residual is not None, weight, bias, rms, eps,
                         lambda c: _norm_fwd(input, residual, weight, bias, eps, rms, config=c, stats=stats),
                         lambda c: _fwd_launch_args(input, residual, weight, bias, eps, rms, c, stats))
    outputs, launcher, grid, args, meta = _fwd_launch_args(input, residual, weight, bias, eps, rms, config,
                                                           stats)
    if input.numel():
        launcher(grid, *args, **meta)
    return outputs


def _fwd_launch_args(input, residual, weight, bias, eps: float, rms: bool, config: dict | None,
                     stats: bool = True):
    """((y, h, mean, rstd), launcher, grid, arguments, constexprs and options) of the forward, with
    the outputs allocated (h None without a residual, mean None for RMSNorm). Without ``stats`` the
    one-pass kernel stores no mean or rstd (they are None); the looped one stores them regardless,
    one pair a long row."""
    n = input.shape[-1]
    rows = input.numel() // n if n else 0
    block_n = _next_power_of_2(n)
    looped = block_n > MAX_BLOCK_N["fwd"] or "BLOCK_N" in (config or {})  # looped configs name their chunk
    stats = stats or looped
    y = empty_output(input.shape, input.dtype, input.device)
    h = empty_output(input.shape, input.dtype, input.device) if residual is not None else None
    mean = empty_output((rows,), torch.float32, input.device) if stats and not rms else None
    rstd = empty_output((rows,), torch.float32, input.device) if stats else None
    outputs = (y, h, mean, rstd)
    if input.numel() == 0:
        return outputs, None, None, None, None
    x2 = _rows_2d(input, n)
    r2 = _rows_2d(residual, n) if residual is not None else x2
    weight, bias = _unit_stride(weight), _unit_stride(bias)
    stats_args = (mean if mean is not None else rstd, rstd) if stats else (y, y)  # unused without stats
    args = (x2, r2, h if h is not None else y, y, weight if weight is not None else y,
            bias if bias is not None else y, *stats_args, rows, n, x2.stride(0), r2.stride(0), float(eps))
    # EVICT: L2 eviction hints, as torch.compile's kernels give them: evict_first on what is read for
    # the last time, evict_last on what is read again (the looped first pass, the weight and bias)
    evict = config.get("EVICT", False)
    flags = {"RMS": rms, "HAS_RESIDUAL": residual is not None, "HAS_WEIGHT": weight is not None,
             "HAS_BIAS": bias is not None}
    options = {"num_warps": config["num_warps"], "STREAM": "evict_first" if evict else "",
               "KEEP": "evict_last" if evict else ""}
    if looped:
        # PER_SM: a persistent grid of that many programs an SM walks the rows, so that fewer rows
        # are between their two passes at once (the second pass is to find its row in L2)
        programs = min(rows, config["PER_SM"] * sm_count(input.device)) if "PER_SM" in config else rows
        # rows that fit compile for their length (ROW_LENGTH), as the one-pass kernel does for its block
        row_length = n if block_n <= MAX_BLOCK_N["fwd"] else 0
        return (outputs, _LAUNCHERS["fwd", True], (programs,), args,
                flags | options | {"BLOCK_N": config["BLOCK_N"], "ROW_LENGTH": row_length,
                                   "OUT_BLOCK_N": config.get("OUT_BLOCK_N", config["BLOCK_N"])})
    meta = flags | {"STATS": stats} | options | {"BLOCK_M": config["BLOCK_M"], "BLOCK_N": block_n}
    return outputs, _LAUNCHERS["fwd", False], (cdiv(rows, config["BLOCK_M"]),), args, meta


def _norm_bwd(grad_y, grad_h, h, weight, bias, mean, rstd, rms: bool, config: dict | None = None):
    """(dx, dw or None, db or None); dx is also the residual's gradient in the add_ forms. Without
    ``config``, the tuned one for the shape."""
    if h.numel() and config is None:
        config = _config("bwd", h, grad_h is not None, weight, bias, rms, 1e-5,
                         lambda c: _norm_bwd(grad_y, grad_h, h, weight, bias, mean, rstd, rms, config=c),
                         lambda c: _bwd_launch_args(grad_y, grad_h, h, weight, bias, rms, c, mean, rstd))
    (dx, dw_partial, db_partial), launcher, grid, args, meta = _bwd_launch_args(
        grad_y, grad_h, h, weight, bias, rms, config, mean, rstd)
    if h.numel() == 0:
        n = h.shape[-1]
        zeros = lambda param: torch.zeros(n, dtype=param.dtype, device=h.device)  # noqa: E731
        return dx, zeros(weight) if weight is not None else None, zeros(bias) if bias is not None else None
    launcher(grid, *args, **meta)
    if weight is None and bias is None:
        return dx, None, None
    # the second stage of the two-stage reduction: deterministic, no atomics
    dw, db, (launcher, grid, args, meta) = _sum_partials_launch(dw_partial, db_partial, weight, bias)
    launcher(grid, *args, **meta)
    return dx, dw, db


def _bwd_launch_args(grad_y, grad_h, h, weight, bias, rms: bool, config: dict | None, mean=None, rstd=None):
    """((dx, dw partials, db partials), launcher, grid, arguments, constexprs and options) of the
    backward, with its outputs allocated (statistics default to empty ones, for inspect)."""
    n = h.shape[-1]
    rows = h.numel() // n if n else 0
    dx = empty_output(h.shape, h.dtype, h.device)
    if h.numel() == 0:
        return (dx, None, None), None, None, None, None
    block_n = _next_power_of_2(n)
    looped = block_n > MAX_BLOCK_N["bwd"]
    programs = cdiv(rows, config["ROWS"])
    rstd = rstd if rstd is not None else torch.empty(rows, dtype=torch.float32, device=h.device)
    if mean is None and not rms:
        mean = torch.empty(rows, dtype=torch.float32, device=h.device)
    dw_partial = empty_output((programs, n), torch.float32, h.device) if weight is not None else rstd
    db_partial = empty_output((programs, n), torch.float32, h.device) if bias is not None else rstd
    outputs = (dx, dw_partial, db_partial)
    h2, dy2 = _rows_2d(h, n), _rows_2d(grad_y.to(h.dtype), n)
    dh2 = _rows_2d(grad_h.to(h.dtype), n) if grad_h is not None else dy2
    weight = _unit_stride(weight)
    stats = (weight if weight is not None else rstd, mean if mean is not None else rstd, rstd)
    tail = (dx, dw_partial, db_partial, rows, n, dy2.stride(0), dh2.stride(0), h2.stride(0))
    meta = {"RMS": rms, "HAS_DH": grad_h is not None, "HAS_WEIGHT": weight is not None,
            "HAS_BIAS": bias is not None, "ROWS": config["ROWS"], "num_warps": config["num_warps"]}
    block_m = config.get("BLOCK_M", 1)  # rows the one-pass backward reduces together
    if block_m > 1 and looped or config["ROWS"] % block_m:
        raise ValueError(f"BLOCK_M must divide ROWS, and the looped backward takes rows singly: {config}")
    if looped:
        sums = torch.empty((rows, 2), dtype=torch.float32, device=h.device)  # per-row scratch
        meta |= {"BLOCK_N": config["BLOCK_N"]}
        return outputs, _LAUNCHERS["bwd", True], (programs,), (dy2, dh2, h2, *stats, sums, *tail), meta
    meta |= {"BLOCK_M": block_m, "BLOCK_N": block_n, "PREFETCH": config.get("PREFETCH", False)}
    return outputs, _LAUNCHERS["bwd", False], (programs,), (dy2, dh2, h2, *stats, *tail), meta


def _sum_partials_launch(dw_partial, db_partial, weight, bias) -> tuple:
    """(dw or None, db or None, (launcher, grid, arguments, constexprs and options)) of the second
    stage, which sums the (programs, N) fp32 partials of dw and db into the weight's and the bias's
    dtype. One launch for both: as two torch sums, two casts and a memset it took 23 of the 234 us
    of LayerNorm's backward at 32768x4096 bf16 on the H200."""
    partials = dw_partial if weight is not None else db_partial
    programs, n = partials.shape
    dw = empty_output(weight.shape, weight.dtype, weight.device) if weight is not None else None
    db = empty_output(bias.shape, bias.dtype, bias.device) if bias is not None else None
    block_cols = min(64, max(8, 1 << max(0, (n // SUM_PROGRAMS).bit_length() - 1)))
    block_p = min(SUM_TILE // block_cols, _next_power_of_2(programs))
    args = (dw_partial if weight is not None else partials, db_partial if bias is not None else partials,
            dw if dw is not None else partials, db if db is not None else partials, programs, n)
    meta = {"HAS_WEIGHT": weight is not None, "HAS_BIAS": bias is not None, "BLOCK_P": block_p,
            "BLOCK_COLS": block_cols, "num_warps": SUM_WARPS}
    return dw, db, (_SUM_PARTIALS, (cdiv(n, block_cols),), args, meta)


# ---------------------------------------------------------------- custom ops and autograd

def _absent(t, like):
    """An absent output of a custom op (they return tensors only) is an empty tensor."""
    return t if t is not None else like.new_empty(0)


def _present(t):
    return t if t is not None and t.numel() else None


@torch.library.custom_op("tritonkit::norm", mutates_args=())
def _norm_op(input: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
             bias: torch.Tensor | None, eps: float,
             rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    y, h, mean, rstd = _norm_fwd(input, residual, weight, bias, eps, rms)
    return y, _absent(h, y), _absent(mean, rstd), rstd


@_norm_op.register_fake
def _(input, residual, weight, bias, eps, rms):
    _validate(input, input.shape[-1:], weight, bias, residual)
    rows = input.numel() // max(1, input.shape[-1])
    stats = input.new_empty((rows,), dtype=torch.float32)
    return (input.new_empty(input.shape), input.new_empty(input.shape if residual is not None else (0,)),
            stats if not rms else input.new_empty((0,), dtype=torch.float32), stats.new_empty((rows,)))


@torch.library.custom_op("tritonkit::norm_backward", mutates_args=())
def _norm_backward_op(grad_y: torch.Tensor, grad_h: torch.Tensor | None, h: torch.Tensor,
                      weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor,
                      rstd: torch.Tensor, rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = _norm_bwd(grad_y, grad_h, h, weight, bias, _present(mean), rstd, rms)
    return dx, _absent(dw, rstd), _absent(db, rstd)


@_norm_backward_op.register_fake
def _(grad_y, grad_h, h, weight, bias, mean, rstd, rms):
    return (h.new_empty(h.shape), weight.new_empty(weight.shape) if weight is not None else rstd.new_empty(0),
            bias.new_empty(bias.shape) if bias is not None else rstd.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    input, residual, weight, bias, _, rms = inputs
    _, h, mean, rstd = output
    ctx.save_for_backward(h if residual is not None else input, weight, bias, mean, rstd)
    ctx.rms, ctx.has_residual = rms, residual is not None


def _backward_traced(ctx, grad_y, grad_h, _grad_mean, _grad_rstd):
    h, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = _norm_backward_op(grad_y, grad_h if ctx.has_residual else None, h, weight, bias, mean, rstd,
                                   ctx.rms)
    return (dx, dx if ctx.has_residual else None, _present(dw) if weight is not None else None,
            _present(db) if bias is not None else None, None, None)


_norm_op.register_autograd(_backward_traced, setup_context=_setup_context)


class _Norm(torch.autograd.Function):
    """Eager autograd without the custom-op dispatcher; returns y, or (y, h) with a residual."""

    @staticmethod
    def forward(ctx, input, residual, weight, bias, eps, rms):
        y, h, mean, rstd = _norm_fwd(input, residual, weight, bias, eps, rms, validated=True)
        ctx.save_for_backward(h if residual is not None else input, weight, bias, mean, rstd)
        ctx.rms, ctx.has_residual = rms, residual is not None
        return (y, h) if residual is not None else y

    @staticmethod
    def backward(ctx, grad_y, grad_h=None):
        h, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = _norm_bwd(grad_y, grad_h, h, weight, bias, mean, rstd, ctx.rms)
        return dx, dx if ctx.has_residual else None, dw, db, None, None


def _norm(input, residual, normalized_shape, weight, bias, eps, rms: bool):
    if torch.compiler.is_compiling():  # the fake implementation validates, on fake tensors
        _check_normalized_shape(input, normalized_shape)
        y, h, _, _ = _norm_op(input, residual, weight, bias, eps, rms)
        return (y, h) if residual is not None else y
    _validate(input, normalized_shape, weight, bias, residual)
    tensors = [t for t in (input, residual, weight, bias) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _Norm.apply(input, residual, weight, bias, eps, rms)
    # no backward will follow: the statistics are not stored
    y, h, _, _ = _norm_fwd(input, residual, weight, bias, eps, rms, validated=True, stats=False)
    return (y, h) if residual is not None else y


def rms_eps(eps: float | None, dtype: torch.dtype) -> float:
    """F.rms_norm's default eps: the machine epsilon of the type it computes in, fp32 for 16-bit
    inputs (1.2e-7, not bf16's 7.8e-3, which shifts outputs of small rows by several percent)."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps if eps is None else eps


def layer_norm(input: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` over the last dimension, statistics in fp32."""
    return _norm(input, None, normalized_shape, weight, bias, eps, rms=False)


def rms_norm(input: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """``torch.nn.functional.rms_norm`` over the last dimension, statistics in fp32."""
    return _norm(input, None, normalized_shape, weight, None, rms_eps(eps, input.dtype), rms=True)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, normalized_shape,
                   weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                   eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(x + residual), x + residual)`` in one pass."""
    return _norm(x, residual, normalized_shape, weight, bias, eps, rms=False)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, normalized_shape,
                 weight: torch.Tensor | None = None,
                 eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass."""
    return _norm(x, residual, normalized_shape, weight, None, rms_eps(eps, x.dtype), rms=True)


# ---------------------------------------------------------------- reference and cost


def layer_norm_reference(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Plain PyTorch; pass float64 inputs for the oracle's reference."""
    return torch.nn.functional.layer_norm(input, normalized_shape, weight, bias, eps)


def rms_norm_reference(input, normalized_shape, weight=None, eps=None):
    return torch.nn.functional.rms_norm(input, normalized_shape, weight, eps)


def add_layer_norm_reference(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    h = x + residual
    return torch.nn.functional.layer_norm(h, normalized_shape, weight, bias, eps), h


def add_rms_norm_reference(x, residual, normalized_shape, weight=None, eps=None):
    h = x + residual
    return torch.nn.functional.rms_norm(h, normalized_shape, weight, eps), h


def norm_cost(shape: tuple, dtype: torch.dtype, mode: str = "fwd", *, residual: bool = False,
              bias: bool = True):
    """Minimal traffic with a weight (and bias) in the input dtype. Forward reads x (and the
    residual), writes y (and h), reads the parameters; backward reads h and dy (and dh), writes dx
    (the residual's gradient is the same tensor), reads the weight and writes dw (and db)."""
    from tritonkit.roofline import Cost

    n, elements = shape[-1], math.prod(shape)
    size, params = torch.finfo(dtype).bits // 8, 2 if bias else 1
    fwd = Cost(FWD_FLOPS_PER_ELEMENT * elements, size * ((4 if residual else 2) * elements + params * n))
    bwd = Cost(BWD_FLOPS_PER_ELEMENT * elements,
               size * ((4 if residual else 3) * elements + (1 + params) * n))
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


# FLOPs an element, each add, multiply and reduction step counted once: forward the sums, centring,
# scaling, weight and bias; backward g, the two row sums, the combination and the dw/db sums.
FWD_FLOPS_PER_ELEMENT = 7
BWD_FLOPS_PER_ELEMENT = 10


def _make_inputs(residual: bool, bias: bool):
    def make(shape: tuple, dtype: torch.dtype, device, generator: torch.Generator) -> tuple:
        from tritonkit.testing import random_tensor

        x = random_tensor(shape, dtype, device, generator=generator)
        extra = (random_tensor(shape, dtype, device, generator=generator),) if residual else ()
        params = tuple(random_tensor(shape[-1:], dtype, device, generator=generator)
                       for _ in range(2 if bias else 1))
        return (x, *extra, (shape[-1],), *params)

    return make


def _liger(rms: bool, residual: bool):
    def factory(kwargs: dict):
        if residual and rms:
            from liger_kernel.transformers.functional import liger_fused_add_rms_norm

            return lambda x, r, shape, w, eps=None: liger_fused_add_rms_norm(
                x, r, w, rms_eps(eps, x.dtype), in_place=False)
        if residual:
            return "has no fused add + LayerNorm"
        if rms:
            from liger_kernel.transformers.functional import liger_rms_norm

            return lambda x, shape, w, eps=None: liger_rms_norm(x, w, rms_eps(eps, x.dtype), in_place=False)
        from liger_kernel.transformers.functional import liger_layer_norm

        return lambda x, shape, w, b, eps=1e-5: liger_layer_norm(x, w, b, eps)

    return factory


def _inspect_launches(residual: bool, rms: bool, bias: bool, shape: tuple, dtype: torch.dtype,
                      config: dict | None = None) -> list:
    """The forward and backward launches for ``shape``: what ``tritonkit inspect`` compiles. Each
    takes its default config, with what ``config`` sets of it (BLOCK_M is the one-pass forward's and
    the one-pass backward's rows reduced together, EVICT either forward's, PER_SM the looped
    forward's persistent grid, ROWS and PREFETCH the backward's, BLOCK_N the looped kernels' (given for a row
    that fits in registers, it sends the forward through the looped kernel), OUT_BLOCK_N the looped
    forward's pass 2 chunk, num_warps every kernel's); then the backward's second stage, the
    partial sums, on its own fixed tile."""

    x = torch.empty(shape, dtype=dtype, device="meta")
    w = torch.empty(shape[-1:], dtype=dtype, device="meta")
    n, rows = shape[-1], math.prod(shape[:-1])
    params = _params_key(residual, w, w if bias else None, rms)
    b = w if bias else None
    launches = []
    for direction in ("fwd", "bwd"):
        key = _tuning_key(direction, n, rows, dtype, params)
        default = _default(key)
        optional = (("EVICT", "BLOCK_N", "OUT_BLOCK_N", "PER_SM") if direction == "fwd"
                    else ("PREFETCH",) + (() if key["looped"] else ("BLOCK_M",)))
        chosen = default | {k: v for k, v in (config or {}).items() if k in default or k in optional}
        if "BLOCK_N" in chosen:
            chosen.pop("BLOCK_M", None)  # a looped forward
        if direction == "fwd":
            _, kernel, _, args, meta = _fwd_launch_args(x, x if residual else None, w, b, 1e-5, rms, chosen)
        else:
            _, kernel, _, args, meta = _bwd_launch_args(x, x if residual else None, x, w, b, rms, chosen)
        launches.append(Launch(direction, kernel.kernel, args, meta, chosen))
    partials = torch.empty((cdiv(rows, launches[-1].meta["ROWS"]), n), dtype=torch.float32, device="meta")
    *_, (sums, _, args, meta) = _sum_partials_launch(partials, partials, w, b)
    launches.append(Launch("bwd partial sums", sums.kernel, args, meta))
    return launches


def _spec(name: str, residual: bool, rms: bool):
    from tritonkit.ops import OpSpec

    bias = not rms
    fns = {"layer_norm": (layer_norm, layer_norm_reference), "rms_norm": (rms_norm, rms_norm_reference),
           "add_layer_norm": (add_layer_norm, add_layer_norm_reference),
           "add_rms_norm": (add_rms_norm, add_rms_norm_reference)}
    fn, reference = fns[name]
    params = (2, 3) if bias else (2,)
    return OpSpec(
        name=name,
        family="norm",
        fn=fn,
        reference=reference,
        cost=lambda shape, dtype, mode="fwd": norm_cost(shape, dtype, mode, residual=residual, bias=bias),
        make_inputs=_make_inputs(residual, bias),
        grad_inputs=(0, 1, *(p + 1 for p in params)) if residual else (0, *params),
        flop_unit="fp32",
        shapes={
            "interpreter": [(4, 96), (9, 1000)],
            "quick": [((32768, 4096), "bf16"), ((16384, 8192), "bf16"), ((65536, 1024), "bf16"),
                      ((4096, 65536), "bf16"), ((8192, 4096), "fp32")],
            "full": [((32768, 4096), "bf16"), ((16384, 8192), "bf16"), ((65536, 1024), "bf16"),
                     ((4096, 65536), "bf16"), ((8192, 4096), "fp32"), ((4097, 1823), "bf16"),
                     ((1024, 262144), "bf16")],
        },
        tiny_shape=(4, 256),
        peers={"liger": _liger(rms, residual)},
        inspect=functools.partial(_inspect_launches, residual, rms, bias),
    )


SPECS = {name: _spec(name, residual=name.startswith("add_"), rms="rms" in name)
         for name in ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")}
