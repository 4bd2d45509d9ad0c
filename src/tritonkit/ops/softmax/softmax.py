"""Softmax and log-softmax along any dimension, forward and backward, at any row length.

Maths. For a row x of length N, with m = max(x) and s = sum(exp(x - m)):
    softmax:      y = exp(x - m) / s
    log_softmax:  y = (x - m) - log(s)
VJPs (y is the saved output, dy the upstream gradient):
    softmax:      dx = y * (dy - sum(dy * y))
    log_softmax:  dx = dy - exp(y) * sum(dy)
Subtracting m keeps exp from overflowing; a row of all -inf has m = -inf and gives NaN, as torch.

Layout. The input is viewed as (O, R, N): O outer slices of R rows, softmax along N, each with its
own stride, so the last dimension (O = 1, R = the leading dimensions) and any other dimension
(O = the dimensions before it, R = those after it, usually contiguous) run the same kernels without
a transpose copy. A program takes a (BLOCK_M, BLOCK_N) tile of BLOCK_M rows; Triton orders the tile
along whichever of its axes has stride 1.

Kernels, selectable by name (``VARIANTS``):
  one-pass  the row lives in registers: read x once, write y once. Short rows share a program
            (BLOCK_M > 1), so each program still moves a few kilobytes. With STAGES, persistent:
            as many programs as the SMs hold walk the row blocks, each block's load copied to
            shared memory while the one before is reduced (the untuned default on long rows).
            Rows that start off their 16-byte vectors (odd lengths) are read in windows from each
            row's rounded-down offset: the vectors inside a row whole, its ends an entry at a time
            (``WINDOWS``, ``_launch.row_window``).
  online    rows too long for registers: pass 1 reads the row in chunks keeping a running max and
            rescaled sum (Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018);
            pass 2 reads it again, backwards, and writes y. Walking backwards re-reads first the
            chunks pass 1 touched last, which are the likeliest to still be in L2.
  split     rows far longer than L2 can hold while they are in flight (hundreds of kilobytes and
            up): the programs of a row each take one segment, publish its partial (max, sum), wait
            for the row's other segments, combine them and normalise their own segment, which is
            still in L2. Needs every program resident at once: a cooperative launch.
The backward has the same kernels, with sum(dy * y) (or sum(dy)) in place of the max and sum.

Work. Forward reads x and writes y: 2 M N s bytes for M rows in dtype of s bytes; backward reads y
and dy and writes dx: 3 M N s. About 5 FLOPs an element forward (max, subtract, exp, sum, scale)
and 4 backward: at most 1.25 FLOP/byte, far under the fp32 ridge point (about 14 FLOP/byte on the
H200), so the roofline is the copy bandwidth. The online kernel reads x twice: 3 M N s bytes, unless
pass 2 finds its chunks in L2.

Launch parameters come from accuracy-gated autotuning (``tritonkit.tuning``) over every kernel
("auto"): each config below is admitted only if its output on a calibration input passes the test
oracle. Rows too long for registers leave the online and split kernels; the untuned default
splits them where few rows, or rows of many chunks, would leave the online kernel's one program a
row short of loads in flight (``configs.SPLIT_DEFAULT_MAX_ROWS``), and (``configs.SPLIT_ONE_WAVE``,
off until measured) where one wave of the online kernel's rows reads more than L2 holds for pass 2.
"""

from __future__ import annotations

import functools
import json
import math

import torch

from tritonkit import tuning
from tritonkit._launch import (
    Launch,
    call_signature,
    cdiv,
    launcher_of,
    next_power_of_2,
    row_align,
    row_span,
    row_window,
)
from tritonkit._runtime import check_device, empty_output_like, interpret, sm_count
from tritonkit.dtypes import FLOATS, NAME_OF
from tritonkit.opdef import first_derivative_only, op
from tritonkit.ops import Op, Workload
from tritonkit.ops.softmax.configs import CONFIGS, SPLIT_L2_BYTES, _default, _one_pass_fits, _prune
from tritonkit.ops.softmax.kernels import (
    _softmax_bwd_kernel,
    _softmax_bwd_online_kernel,
    _softmax_fwd_kernel,
    _softmax_fwd_online_kernel,
)
from tritonkit.ops.softmax.split_kernels import _softmax_bwd_split_kernel, _softmax_fwd_split_kernel
from tritonkit.split_rows import cooperative_programs

VARIANTS = ("auto", "one-pass", "online", "split")
DTYPES = FLOATS


# ---------------------------------------------------------------- launching and tuning

CALIBRATION_ELEMENTS = 1 << 22  # cap on a calibration input: the float64 reference stays small


def _as_3d(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` viewed as (O, R, N) with ``dim`` as N; a copy only where the dimensions cannot merge."""
    shape = t.shape
    outer, n = math.prod(shape[:dim]), shape[dim]
    if dim == t.dim() - 1:
        return t.reshape(1, outer, n)
    return t.reshape(outer, n, math.prod(shape[dim + 1 :])).transpose(1, 2)


def _layout(view: torch.Tensor) -> str:
    """'cols' when rows, not row entries, are the contiguous axis (softmax over a leading dim)."""
    _, stride_r, stride_n = view.stride()
    return "cols" if stride_r == 1 and stride_n != 1 and view.shape[1] > 1 else "rows"


# hashed with the kernels: an edit retunes
_LAUNCHERS = {
    ("fwd", "one-pass"): launcher_of(_softmax_fwd_kernel),
    ("fwd", "online"): launcher_of(_softmax_fwd_online_kernel),
    ("fwd", "split"): launcher_of(_softmax_fwd_split_kernel),
    ("bwd", "one-pass"): launcher_of(_softmax_bwd_kernel),
    ("bwd", "online"): launcher_of(_softmax_bwd_online_kernel),
    ("bwd", "split"): launcher_of(_softmax_bwd_split_kernel),
}
_TUNERS = {
    direction: tuning.Tuner(
        f"softmax_{direction}",
        CONFIGS,
        default=_default,
        prune=_prune,
        sources=tuple(_LAUNCHERS[direction, v].kernel for v in VARIANTS if v != "auto"),
    )
    for direction in ("fwd", "bwd")
}


def _geometry(views: tuple) -> tuple:
    """(O, R, N) and every view's strides: all a launch needs of the views beyond their pointers."""
    return (*views[0].shape, tuple(s for v in views for s in v.stride()))


def _align(tensors: tuple, geometry: tuple) -> int:
    """The kernels' ALIGN (``_launch.row_align`` of N and every view's outer and row strides, in the
    narrowest dtype's entries) where every view's entries are contiguous; else 1."""
    _, _, n, strides = geometry
    views = [strides[i : i + 3] for i in range(0, len(strides), 3)]
    if any(view[2] != 1 for view in views):
        return 1
    values = (n, *(stride for view in views for stride in view[:2]))
    return row_align(values, min(t.element_size() for t in tensors))


# Whether fp32 log_softmax's forward sums its rows in fp64 (``kernels._row_sum`` says why) or in fp32, as
# softmax does. fp32: on an H100 (docs/perf-notes/sweep.md, "The fp32 row sum, measured") 45.9 us against
# 54.6 at 63687 x 195 (torch 39.2), level or up to 6% faster at longer rows, its errors 1.0-1.1x torch's
# (fp64: 0.9-1.1x); both held to the oracle by the tests. The backward's sum of dy is fp64 regardless
# (``sums_in_fp64``).
LOG_FWD_SUM_FP64 = False


def sums_in_fp64(direction: str, log: bool, dtype: torch.dtype) -> bool:
    """Whether a launch sums its rows in fp64: fp32 log_softmax's backward always (in fp32 its gradient
    erred past the oracle over split rows of 130 in the interpreter: 1.7e-6 against a bound of 1.5e-6),
    its forward by LOG_FWD_SUM_FP64; softmax and 16-bit inputs never."""
    return log and dtype == torch.float32 and (direction == "bwd" or LOG_FWD_SUM_FP64)


# Whether the kernels read rows that start off their vectors' alignment in windows (``_window``: the
# one-pass, the online without PREFETCH, and the split kernels); False keeps them on ALIGN's narrower
# accesses (what a test compares them with).
WINDOWS = True
# False keeps the split configs' own segments (``_even_segment``) and rows at once (a benchmark's
# comparison)
SPLIT_EVEN_ROUNDS = True
# True splits rows past L2 in two launches, every segment's pass 1 of every row in flight and then every
# pass 2 (the kernels' PHASE 1 and 2, as the interpreter runs them), where the default launch takes such
# rows one at a time, each waiting on its pass 1 in one cooperative launch. Off until timed: a row past L2
# is read again from memory either way, and one launch leaves no gap between the passes, but each row's
# wait drains every program before its pass 2 starts.
SPLIT_TWO_LAUNCHES = False


def _window(tensors: tuple, geometry: tuple, block_n: int | None) -> int:
    """The one-pass kernels' WINDOW (``_launch.row_window``) where every view's entries are contiguous
    (rows layout); else 0. Over one outer slice the outer strides play no part."""
    outer, _, n, strides = geometry
    views = [strides[i : i + 3] for i in range(0, len(strides), 3)]
    if not WINDOWS or any(view[2] != 1 for view in views):
        return 0
    return row_window(n, [(view[0] if outer > 1 else 0, view[1]) for view in views], tensors, block_n)


def _launch_args(
    direction: str, config: dict, log: bool, tensors: tuple, geometry: tuple, phase: int = 0
) -> tuple[tuple, tuple, dict]:
    """(grid, arguments, constexprs and options) of one kernel: ``tensors`` are (x, y) forward or
    (y, dy, dx) backward (or anything with their data pointers), ``geometry`` their (O, R, N) views'.
    ``phase`` is the split kernels' PHASE."""
    outer, rows, n, strides = geometry
    sum_fp64 = sums_in_fp64(direction, log, tensors[0 if direction == "fwd" else 1].dtype)
    if config["variant"] == "split":
        return _split_launch_args(direction, config, log, sum_fp64, tensors, geometry, phase)
    block_n = config.get("BLOCK_N", next_power_of_2(n))
    row_blocks = cdiv(rows, config["BLOCK_M"])
    meta = {
        "LOG": log,
        "SUM_FP64": sum_fp64,
        "BLOCK_M": config["BLOCK_M"],
        "BLOCK_N": block_n,
        "num_warps": config["num_warps"],
    }
    if config["variant"] == "online":
        meta["PREFETCH"] = config.get("PREFETCH", False)
    meta["ALIGN"] = _align(tensors, geometry)
    blocks = outer * row_blocks
    if config["variant"] == "online":  # in chunks: no tile bounds a row's window; PREFETCH stays plain
        meta["WINDOW"] = 0 if meta["PREFETCH"] else _window(tensors, geometry, None)
        if meta["WINDOW"]:
            meta["ALIGN"] = 1
        return (blocks,), (*tensors, rows, n, row_blocks, *strides), meta
    meta["STAGES"] = stages = config.get("STAGES", 0)
    meta["WINDOW"] = _window(tensors, geometry, block_n)
    if meta["WINDOW"]:
        meta["ALIGN"] = 1  # (the windows' bases carry the alignment)
    args = (*tensors, rows, n, row_blocks, *strides, blocks)
    if not stages:
        return (blocks,), args, meta
    per_sm = _LAUNCHERS[direction, "one-pass"].programs_per_sm(*args, **meta)
    return (min(blocks, per_sm * sm_count(tensors[0].device)),), args, meta


def _split_launch_args(
    direction: str, config: dict, log: bool, sum_fp64: bool, tensors: tuple, geometry: tuple, phase: int
) -> tuple[tuple, tuple, dict]:
    """The split kernels' launch: as many rows at once as PER_SM programs an SM allow (fewer where
    the compiled kernel's registers fit fewer), each row's segments side by side, of the length
    that ends a round soonest (``_even_segment``); the partial-result workspace and the zeroed
    per-row counters."""
    outer, rows, n, _ = geometry
    total, segment = outer * rows, config["SEGMENT"]
    window = _window(tensors, geometry, None)
    span = row_span(n, window)
    launch = functools.partial(
        _split_launch, direction, config, log, sum_fp64, tensors, geometry, phase, window
    )
    programs = launch(segment, probe=True)[2]
    groups = max(1, min(total, programs // cdiv(span, segment)))
    if SPLIT_EVEN_ROUNDS and _past_l2(direction, tensors, geometry) and not SPLIT_TWO_LAUNCHES:
        # L2 holds none of such a row for pass 2 either way; one at a time over every program took
        # 0.91x the time of two at once (log_softmax's backward at 4 x 13795015 fp32 on an H100,
        # 0.95-0.96x the forwards), four at once 1.11-1.14x (docs/perf-notes/softmax.md)
        groups = 1
    even = _even_segment(span, segment, groups, programs, config["BLOCK_N"], sm_count(tensors[0].device))
    # (the kernel compiled for more segments may fit fewer programs at once)
    if even != segment and groups * cdiv(span, even) <= launch(even, probe=True)[2]:
        segment = even
    args, meta, _ = launch(segment)
    return (groups * cdiv(span, segment),), args, meta


def _past_l2(direction: str, tensors: tuple, geometry: tuple) -> bool:
    """Whether what pass 2 reads of a row (x forward, y and dy backward) is more than L2 holds."""
    return geometry[2] * tensors[0].element_size() * (1 if direction == "fwd" else 2) > SPLIT_L2_BYTES


def _even_segment(n: int, segment: int, groups: int, programs: int, block_n: int, sms: int) -> int:
    """The segment (a multiple of ``block_n``, at least the smaller of ``segment`` and 4 chunks) whose
    ``groups`` rows at once of cdiv(n, segment) programs fit ``programs`` and end soonest: a round
    takes the programs its busiest SM runs times a segment's chunks. The configs' power-of-two
    segments left SMs uneven: 4 rows of 13795015 fp32 in 2 rows at once of 211 segments ran 422
    programs where 528 fit, 4 on some SMs and 3 on others (26 chunks a segment: 520, 4 on each),
    which measured 0.97-0.99x the time on an H100: less than the count predicts, as programs share
    the memory's rate wherever they sit. SPLIT_EVEN_ROUNDS False keeps ``segment``."""
    if not SPLIT_EVEN_ROUNDS:
        return segment
    chunks = cdiv(segment, block_n)
    fewest = min(chunks, 4)

    def round_time(c: int) -> int:  # (chunks a segment: rounds of programs on the busiest SM x c)
        return cdiv(groups * cdiv(n, c * block_n), sms) * c

    fitting = [c for c in range(fewest, chunks + 1) if groups * cdiv(n, c * block_n) <= programs]
    return min(fitting, key=lambda c: (round_time(c), -c), default=chunks) * block_n


def _split_launch(
    direction: str,
    config: dict,
    log: bool,
    sum_fp64: bool,
    tensors: tuple,
    geometry: tuple,
    phase: int,
    window: int,
    segment: int,
    probe: bool = False,
) -> tuple[tuple, dict, int]:
    """(arguments, constexprs and options, programs that run at once) of a split launch of ``segment``
    positions a program, rows read in windows of ``window`` entries (0: from their starts);
    ``probe``: one-entry stand-ins for the workspace (no allocation, no zeroing), for the programs
    alone."""
    outer, rows, n, strides = geometry
    device, total = tensors[0].device, outer * rows
    segments = cdiv(row_span(n, window), segment)
    _check_segments(n, segment, segments, config["PER_SM"] * sm_count(device))
    partials = 1 if probe else total * segments
    sums = torch.empty(partials, dtype=torch.float64 if sum_fp64 else torch.float32, device=device)
    counters = total if phase == 0 and not probe else 1
    arrived = (torch.empty if probe else torch.zeros)(counters, dtype=torch.int32, device=device)
    if direction == "fwd":
        maxima = torch.empty(partials, dtype=torch.float32, device=device)
        workspace = (maxima, sums, arrived)
    else:
        workspace = (sums, arrived)
    meta = {
        "LOG": log,
        "SUM_FP64": sum_fp64,
        "BLOCK_N": config["BLOCK_N"],
        "SEGMENTS": next_power_of_2(segments),
        "PHASE": phase,
        "ALIGN": 1 if window else _align(tensors, geometry),  # (the windows' bases carry the alignment)
        "PREFETCH": config.get("PREFETCH", False),
        "WINDOW": window,
        "num_warps": config["num_warps"],
    }
    if phase == 0:
        meta["launch_cooperative_grid"] = True  # the launch fails, not hangs, if they cannot all run
    args = (*tensors, *workspace, rows, n, total, segments, segment, *strides)
    programs = cooperative_programs(_LAUNCHERS[direction, "split"], config["PER_SM"], args, meta, device)
    if not probe:
        _check_segments(n, segment, segments, programs)
    return args, meta, programs


def _check_segments(n: int, segment: int, segments: int, programs: int) -> None:
    if segments > programs:
        raise ValueError(
            f"split softmax: rows of {n} entries make {segments} segments of {segment}, "
            f"more than the {programs} programs that run at once"
        )


def _launches(direction: str, config: dict, log: bool, tensors: tuple, geometry: tuple) -> list[Launch]:
    """The launches of one call: one kernel, or the split kernels' two passes, pass 1 for every segment
    and then pass 2 through one workspace: under the interpreter (it runs programs one after another,
    so none may wait for another) and for rows past L2 with ``SPLIT_TWO_LAUNCHES``."""
    kernel = _LAUNCHERS[direction, config["variant"]].kernel
    name = f"{direction} {config['variant']}"
    in_two = interpret() or (SPLIT_TWO_LAUNCHES and _past_l2(direction, tensors, geometry))
    if config["variant"] == "split" and in_two:
        grid, args, meta = _launch_args(direction, config, log, tensors, geometry, phase=1)
        second = {**meta, "PHASE": 2}
        return [
            Launch(name, kernel, args, meta, config, grid),
            Launch(name, kernel, args, second, config, grid),
        ]
    grid, args, meta = _launch_args(direction, config, log, tensors, geometry)
    return [Launch(name, kernel, args, meta, config, grid)]


def _launch(direction: str, config: dict, log: bool, tensors: tuple, geometry: tuple) -> None:
    """Run one call's launches (the op's path; the tuner runs its candidates through _TUNED)."""
    for launch in _launches(direction, config, log, tensors, geometry):
        launch.run()


def _tuning_key(direction: str, views: tuple) -> dict:
    """The shape bucket, layout and dtypes a config is tuned for (over every variant: a named
    variant takes its own fastest config from the same tuning)."""
    outer, rows, n = views[0].shape
    layout = _layout(views[0])
    return {
        "direction": direction,
        "layout": layout,
        "block_n": next_power_of_2(n),
        "rows": next_power_of_2(outer * rows if layout == "rows" else rows),
        "dtype": f"{NAME_OF[views[0].dtype]}>{NAME_OF[views[-1].dtype]}",
    }


def _check_fits(config: dict, key: dict) -> None:
    if config["variant"] == "one-pass" and not _one_pass_fits(key):
        raise ValueError(
            f"variant 'one-pass' holds a row in registers: rows of up to {key['block_n']} "
            f"entries ({key['layout']} layout, {key['direction']}) are too long; use the "
            "'online' variant"
        )


def _config(direction: str, variant: str, log: bool, views: tuple) -> tuple[dict, bool]:
    """The tuned (or, where tuning cannot run, default) launch config for these views, and whether
    it is final (tuned or cached; under the interpreter the default is)."""
    key = _tuning_key(direction, views)
    _check_fits({"variant": variant}, key)
    tuned = _TUNED[direction]
    return tuned.choose(
        key,
        _problem(direction, log, views),
        signature=(variant, *key.values()),
        pick=lambda entry: _pick(tuned.tuner, entry, key, variant),
    )


def _pick(tuner: tuning.Tuner, entry: dict | None, key: dict, variant: str) -> dict:
    """The config of ``variant`` from a tuning entry (None: the tuner's default for the variant)."""
    if entry is None:
        return tuner.default({**key, "variant": variant})
    if variant == "auto":
        return entry["config"]
    config = tuning.fastest(entry, lambda c: c["variant"] == variant)
    if config is not None:
        return config
    reasons = {c: why for c, why in entry["rejected"].items() if json.loads(c)["variant"] == variant}
    if reasons:
        raise RuntimeError(
            f"no {variant} config passed the accuracy gate for {key}: "
            + "; ".join(f"{c}: {why}" for c, why in reasons.items())
        )
    return tuner.default({**key, "variant": variant})  # none was a candidate for this shape


def _calibration_shape(views: tuple, config: dict) -> tuple[int, int, int]:
    """(O, R, N) of the calibration input: a partial last row block, within CALIBRATION_ELEMENTS."""
    outer, rows, n = views[0].shape
    outer, rows = min(outer, 2), min(rows, 2 * config.get("BLOCK_M", 1) + 1)
    return outer, max(1, min(rows, CALIBRATION_ELEMENTS // (outer * n))), n


def _problem(direction: str, log: bool, tensors: tuple) -> dict:
    """A call as the tuning layer sees it: (x, y) forward, (y, dy, dx) backward, by name."""
    names = ("x", "y") if direction == "fwd" else ("y", "dy", "dx")
    return {"log": log, **dict(zip(names, tensors, strict=True))}


def _tensors(direction: str, problem: dict) -> tuple:
    names = ("x", "y") if direction == "fwd" else ("y", "dy", "dx")
    return tuple(problem[name] for name in names)


def _calibration(direction: str, problem: dict, config: dict) -> dict:
    """Seeded random inputs in the layout of the call's views with a partial last row block; for the
    backward, y a genuine forward output. Outputs are allocated (the gate poisons them)."""
    from tritonkit.testing import generator, random_tensor

    views = _tensors(direction, problem)
    outer, rows, n = _calibration_shape(views, config)
    cols = _layout(views[0]) == "cols"

    def make(dtype, seed):
        if cols:
            return random_tensor(
                (outer, n, rows), dtype, views[0].device, generator=generator(seed), scale=3.0
            ).transpose(1, 2)
        return random_tensor((outer, rows, n), dtype, views[0].device, generator=generator(seed), scale=3.0)

    first = make(views[0].dtype, 1)
    if direction == "fwd":
        return _problem(direction, problem["log"], (first, make(views[1].dtype, 0)))
    first.copy_(_reference(first.double(), 2, problem["log"]))
    return _problem(direction, problem["log"], (first, make(views[1].dtype, 2), make(views[2].dtype, 0)))


def _problem_reference(direction: str, problem: dict) -> dict:
    """The output in plain PyTorch (in y's dtype forward, as torch.softmax's dtype argument gives)."""
    if direction == "fwd":
        return {"y": _reference(problem["x"], 2, problem["log"], dtype=problem["y"].dtype)}
    return {"dx": _vjp_reference(problem["y"], problem["dy"], 2, problem["log"])}


def _problem_launches(direction: str, problem: dict, config: dict) -> list[Launch]:
    tensors = _tensors(direction, problem)
    return _launches(direction, config, problem["log"], tensors, _geometry(tensors))


_TUNED = {
    direction: tuning.Tuned(
        _TUNERS[direction],
        launches=functools.partial(_problem_launches, direction),
        calibrate=functools.partial(_calibration, direction),
        reference=functools.partial(_problem_reference, direction),
        outputs=("y",) if direction == "fwd" else ("dx",),
    )
    for direction in ("fwd", "bwd")
}


def _validate(input, dim, dtype, variant: str = "auto") -> int:
    """Check the arguments; return ``dim`` as a non-negative index."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if input.dtype not in DTYPES:
        raise TypeError(f"input must be float16, bfloat16 or float32, got {input.dtype}")
    if dtype is not None and dtype not in DTYPES:
        raise TypeError(f"dtype must be None, torch.float16, torch.bfloat16 or torch.float32, got {dtype}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    ndim = max(1, input.dim())
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim {dim} is out of range for a tensor of {input.dim()} dimensions")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    check_device("input", input)
    return dim % ndim


# Plans of calls seen before: a call with the same shapes, strides, dtypes and arguments as one
# already launched with a final config skips validation, the views and the tuning lookup (about
# 10 us of Python a call), passing its tensors' pointers with the stored geometry.
MAX_PLANS = 4096
_plans: dict[tuple, tuple] = {}  # call signature -> (config, geometry, output dtype)
tuning.CALL_MEMOS.append(_plans)


def _plan(key: tuple, config: dict, final: bool, tensors: tuple, views: tuple, out_dtype) -> None:
    """Keep the call's plan when its config is final and every view aliases its tensor (no copy)."""
    if final and all(v.data_ptr() == t.data_ptr() for v, t in zip(views, tensors, strict=True)):
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[key] = (config, _geometry(views), out_dtype)


@op("softmax", mutates=("y",), replay=lambda: (WINDOWS,))
def _forward(input: torch.Tensor, dim: int, log: bool, variant: str, y: torch.Tensor) -> None:
    """y = softmax(input) (or log_softmax) along ``dim``, into ``y`` (input's shape, contiguous)."""
    key = call_signature((input,), "fwd", dim, y.dtype, log, variant)
    plan = _plans.get(key)
    if plan is not None:
        config, geometry, _ = plan
        _launch("fwd", config, log, (input, y), geometry)
        return
    if y.numel() == 0:
        return
    x = input.reshape(1) if input.dim() == 0 else input
    dim %= x.dim()
    views = (_as_3d(x, dim), _as_3d(y.view(x.shape), dim))
    config, final = _config("fwd", variant, log, views)
    _launch("fwd", config, log, views, _geometry(views))
    _plan(key, config, final, (input, y), views, y.dtype)


@op("softmax_backward", mutates=("dx",), replay=lambda: (WINDOWS,))
def _backward(
    grad_output: torch.Tensor, output: torch.Tensor, dim: int, log: bool, variant: str, dx: torch.Tensor
) -> None:
    """dx, the input gradient of softmax (or log_softmax) from its output and grad_output, into ``dx``."""
    key = call_signature((output, grad_output), "bwd", dim, dx.dtype, log, variant)
    plan = _plans.get(key)
    if plan is not None:
        config, geometry, _ = plan
        _launch("bwd", config, log, (output, grad_output, dx), geometry)
        return
    if grad_output.shape != output.shape or grad_output.device != output.device:
        raise ValueError(
            f"grad_output must match output: {tuple(output.shape)} on {output.device}, "
            f"got {tuple(grad_output.shape)} on {grad_output.device}"
        )
    if dx.numel() == 0:
        return
    shape = (1,) if output.dim() == 0 else output.shape
    dim %= len(shape)
    views = tuple(_as_3d(t.reshape(shape), dim) for t in (output, grad_output.to(output.dtype), dx))
    config, final = _config("bwd", variant, log, views)
    _launch("bwd", config, log, views, _geometry(views))
    _plan(key, config, final, (output, grad_output, dx), views, dx.dtype)


def _softmax(input, dim, dtype, log: bool, variant: str) -> torch.Tensor:
    """The forward: validated unless a stored plan says a call like it was seen (about 10 us of
    host time a call), then one op. Plans are keyed by ``dim`` as given."""
    out_dtype = dtype or input.dtype
    planned = call_signature((input,), "fwd", dim, out_dtype, log, variant) in _plans
    if torch.compiler.is_compiling() or not planned:
        _validate(input, dim, dtype, variant)
    y = empty_output_like(input, out_dtype)
    _forward(input, dim, log, variant, y)
    return y


class _Softmax(torch.autograd.Function):
    """One autograd function for eager calls and torch.compile (the ops skip the dispatcher eagerly).

    forward takes ctx itself: a separate setup_context costs an inspect.signature bind per call.
    """

    @staticmethod
    def forward(ctx, input, dim, dtype, log, variant):
        output = _softmax(input, dim, dtype, log, variant)
        ctx.save_for_backward(output)
        ctx.dim, ctx.input_dtype, ctx.log, ctx.variant = dim, input.dtype, log, variant
        return output

    @staticmethod
    @first_derivative_only("softmax / log_softmax")
    def backward(ctx, grad_output):
        (output,) = ctx.saved_tensors
        dx = empty_output_like(output, ctx.input_dtype)
        _backward(grad_output, output, ctx.dim, ctx.log, ctx.variant, dx)
        return dx, None, None, None, None


def _dispatch(input, dim, dtype, log: bool, variant: str) -> torch.Tensor:
    try:
        needs_grad = torch.is_grad_enabled() and input.requires_grad
    except AttributeError:  # not a tensor: let validation say so
        _validate(input, dim, dtype, variant)
        raise
    if needs_grad:
        return _Softmax.apply(input, dim, dtype, log, variant)
    return _softmax(input, dim, dtype, log, variant)


def softmax(input: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.nn.functional.softmax``: exp(x) / sum(exp(x)) along ``dim``, accumulated in fp32.

    The output is contiguous, in ``dtype`` if given, else in input's dtype.
    """
    return _dispatch(input, dim, dtype, False, "auto")


def log_softmax(input: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.nn.functional.log_softmax``: x - log(sum(exp(x))) along ``dim``, accumulated in fp32."""
    return _dispatch(input, dim, dtype, True, "auto")


def softmax_variant(
    input: torch.Tensor,
    dim: int = -1,
    dtype: torch.dtype | None = None,
    *,
    log: bool = False,
    variant: str = "auto",
) -> torch.Tensor:
    """Softmax (or log_softmax) through a named kernel variant: ``VARIANTS``; for benchmarks."""
    return _dispatch(input, dim, dtype, log, variant)


# ---------------------------------------------------------------- reference and cost


def _reference(input: torch.Tensor, dim: int, log: bool, dtype=None) -> torch.Tensor:
    fn = torch.log_softmax if log else torch.softmax
    return fn(input, dim, dtype=dtype)


def _vjp_reference(output: torch.Tensor, grad_output: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    if log:
        return grad_output - output.exp() * grad_output.sum(dim, keepdim=True)
    return output * (grad_output - (grad_output * output).sum(dim, keepdim=True))


def softmax_reference(input: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain PyTorch; pass float64 inputs for the oracle's reference."""
    return torch.softmax(input, dim, dtype=dtype)


def log_softmax_reference(
    input: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None
) -> torch.Tensor:
    return torch.log_softmax(input, dim, dtype=dtype)


# FLOPs per element: forward max, subtract, exp, sum, scale; backward multiply, sum, subtract, multiply.
FWD_FLOPS_PER_ELEMENT = 5
BWD_FLOPS_PER_ELEMENT = 4


def softmax_cost(shape: tuple, dtype: torch.dtype, mode: str = "fwd"):
    """Minimal traffic: forward reads x and writes y; backward reads y and dy and writes dx."""
    from tritonkit.roofline import Cost

    elements, size = math.prod(shape), torch.finfo(dtype).bits // 8
    fwd = Cost(FWD_FLOPS_PER_ELEMENT * elements, 2 * size * elements)
    bwd = Cost(BWD_FLOPS_PER_ELEMENT * elements, 3 * size * elements)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def _inspect_launches(log: bool, shape: tuple, dtype: torch.dtype, config: dict | None = None) -> list:
    """The forward and backward launches for a contiguous ``shape`` (softmax over the last dim), with
    the default configs or ``config``: what ``tritonkit inspect`` compiles."""

    launches = []
    x = torch.empty(shape, dtype=dtype, device="meta")
    for direction, tensors in (("fwd", (x, x)), ("bwd", (x, x, x))):
        views = tuple(_as_3d(t, len(shape) - 1) for t in tensors)
        chosen = config or _default(_tuning_key(direction, views))  # any config: spills show
        _, args, meta = _launch_args(direction, chosen, log, views, _geometry(views))
        kernel = _LAUNCHERS[direction, chosen["variant"]].kernel
        launches.append(Launch(f"{direction} {chosen['variant']}", kernel, args, meta, chosen))
    return launches


def _make_inputs(shape: tuple, dtype: torch.dtype, device, generator: torch.Generator) -> tuple:
    from tritonkit.testing import random_tensor

    return (random_tensor(shape, dtype, device, generator=generator, scale=3.0),)


def _liger(kwargs: dict):
    if kwargs.get("dim", -1) != -1 or kwargs.get("dtype") is not None:
        return "covers dim=-1 without dtype only"
    from liger_kernel.transformers.functional import liger_softmax

    return liger_softmax


def _variant_peer(log: bool, variant: str):
    return lambda kwargs: functools.partial(softmax_variant, **kwargs, log=log, variant=variant)


OPS = {
    name: Op(
        name=name,
        family="softmax",
        fn=fn,
        reference=reference,
        cost=softmax_cost,
        make_inputs=_make_inputs,
        grad_inputs=(0,),
        shapes=[(4, 96), (37, 1823)],
        dims=("rows", "row length"),
        inspect=functools.partial(_inspect_launches, name == "log_softmax"),
    )
    for name, fn, reference in (
        ("softmax", softmax, softmax_reference),
        ("log_softmax", log_softmax, log_softmax_reference),
    )
}
QUICK_SHAPES = [
    ((4096, 4096), "fp16"),
    ((32768, 4096), "bf16"),
    ((65536, 1024), "bf16"),
    ((262144, 256), "bf16"),
    ((8192, 32768), "bf16"),
    ((2048, 131072), "bf16"),
    ((512, 524288), "fp32"),
    ((256, 4194304), "fp32"),
]


def _workload(name: str) -> Workload:
    log = name == "log_softmax"
    peers = {f"tritonkit[{v}]": _variant_peer(log, v) for v in VARIANTS if v != "auto"}
    return Workload(
        name=name,
        op=OPS[name],
        flop_unit="fp32",
        shapes={
            "quick": QUICK_SHAPES,
            "full": [
                *QUICK_SHAPES,
                ((16384, 1823), "bf16"),
                ((32768, 4096), "fp32"),
                ((32768, 4096), "fp16"),
            ],
        },
        tiny_shape=(4, 256),
        peers=peers if log else {"liger": _liger, **peers},
    )


WORKLOADS = {name: _workload(name) for name in OPS}
