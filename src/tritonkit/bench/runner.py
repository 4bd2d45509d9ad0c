"""Sweeps: every (workload, shape, dtype, mode, provider) checked against the reference and timed.

On a GPU each row carries timings, rates, roofline percentages, host time per call and the
error against the float64 reference. Without one, the same sweep runs the interpreter on small
shapes as a correctness run and carries the analytic roofline prediction instead of timings.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from tritonkit import roofline, testing
from tritonkit._runtime import interpret
from tritonkit.bench import timing
from tritonkit.bench.providers import providers_for
from tritonkit.bench.report import OUT_OF_MEMORY, UNCHECKED
from tritonkit.dtypes import DTYPE_OF, NAME_OF
from tritonkit.ops import MODES, Workload, get_workload

SEED = 0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Case:
    workload: Workload
    shape: tuple
    dtype: torch.dtype
    mode: str


def dtype_name(dtype: torch.dtype) -> str:
    return NAME_OF[dtype]


@functools.cache
def provenance() -> dict:
    """Versions and the code's git sha (``TRITONKIT_GIT_SHA`` where there is no repository)."""
    import triton

    sha = os.environ.get("TRITONKIT_GIT_SHA")
    if not sha:
        try:
            here = Path(__file__).resolve().parent
            sha = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=here,
                capture_output=True,
                text=True,
                check=True,
                timeout=10,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            sha = "unknown"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "git_sha": sha}


def cases(
    names: Iterable[str],
    shapes: str | list[tuple[tuple, str | None]],
    dtypes: Iterable[torch.dtype] | None,
    modes: Iterable[str],
    only: Iterable[tuple] | None = None,
) -> list[Case]:
    """The sweep over the named workloads: each one's "quick" or "full" shapes (on the interpreter
    always the op's small 'interpreter' ones), or the given (shape, dtype name or None) list;
    ``only`` keeps the shapes it names (a ValueError where it names one that no workload has)."""
    names, out, seen = list(names), [], set()
    only = None if only is None else {tuple(shape) for shape in only}
    dtypes = list(dtypes) if dtypes else None
    for name in names:
        workload = get_workload(name)
        if dtypes and not set(dtypes) & set(workload.op.dtypes):
            continue  # named below
        if isinstance(shapes, str):
            shape_list = workload.shape_list("interpreter" if interpret() else shapes)
        else:
            shape_list = shapes
        seen |= {tuple(shape) for shape, _ in shape_list}
        if only is not None:
            shape_list = [(shape, dtype_name) for shape, dtype_name in shape_list if tuple(shape) in only]
        for shape, dtype_name in shape_list:
            for dtype in (DTYPE_OF[dtype_name],) if dtype_name else workload.op.dtypes:
                if dtypes and dtype not in dtypes:
                    continue
                for mode in modes:
                    if mode not in MODES:
                        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
                    out.append(Case(workload, shape, dtype, mode))
    missing = sorted(only - seen) if only is not None else []
    if missing:
        raise ValueError(
            f"--only {' '.join(shape_name(m) for m in missing)}: not among the shapes of "
            f"{', '.join(names)}: {' '.join(sorted(shape_name(s) for s in seen))}"
        )
    _say_which_take_no_dtype(names, dtypes, out)
    return out


def _say_which_take_no_dtype(names: list[str], dtypes: list[torch.dtype] | None, made: list) -> None:
    """A ValueError where no workload takes the asked dtypes; else one line naming those left out."""
    if not dtypes:
        return
    asked = ", ".join(NAME_OF[d] for d in dtypes)
    left_out = [
        f"{name} (takes {', '.join(NAME_OF[d] for d in get_workload(name).op.dtypes)})"
        for name in names
        if not set(dtypes) & set(get_workload(name).op.dtypes)
    ]
    if left_out and not made:
        raise ValueError(f"no case in {asked}: {'; '.join(left_out)}")
    if left_out:
        log.warning("left out, no kernel in %s: %s", asked, ", ".join(left_out))


def shape_name(shape: tuple) -> str:
    """A shape as the tables and --only write it: 8192x32000."""
    return "x".join(map(str, shape))


def _inputs(case: Case, device: str, seed: int, requires_grad: bool) -> tuple:
    """The case's inputs, drawn on ``device`` by its own seeded generator (on a GPU a large case's
    took a second or more drawn on the CPU and copied: the sweep's rows of 100 MB to 1 GB spent a
    median 1.1 s in setup at 6d3bd5f, against 0.4 s for the small ones)."""
    inputs = case.workload.op.make_inputs(case.shape, case.dtype, device, testing.generator(seed, device))
    if requires_grad:
        for i in case.workload.op.grad_inputs:
            inputs[i].requires_grad_(True)
    return inputs


def _call(fn: Callable, case: Case, inputs: tuple) -> Callable[[], object]:
    """A zero-argument call doing the case's mode on one input set."""
    grad_inputs = [inputs[i] for i in case.workload.op.grad_inputs]
    if case.mode == "fwd":
        return lambda: fn(*inputs)
    outputs = testing.as_tuple(fn(*inputs))
    grad_outputs = _grad_outputs(outputs)
    if case.mode == "bwd":
        return lambda: torch.autograd.grad(outputs, grad_inputs, grad_outputs, retain_graph=True)
    return lambda: torch.autograd.grad(testing.as_tuple(fn(*inputs)), grad_inputs, grad_outputs)


def _grad_outputs(outputs: tuple) -> list:
    """Random upstream gradients, one per output (add_rms_norm returns two), the same every run."""
    generator = testing.generator(SEED + 1, outputs[0].device)  # (drawn where the outputs are)
    return [testing.random_tensor(o.shape, o.dtype, o.device, generator=generator) for o in outputs]


def _check(fn: Callable, case: Case, inputs: tuple) -> dict:
    """The oracle on the mode's outputs and gradients: the largest error and the verdict."""
    with_grads, op = case.mode != "fwd", case.workload.op
    reference = functools.partial(op.reference, **case.workload.call_kwargs)
    grad_outputs = None
    if with_grads:
        detached = [x.detach() if isinstance(x, torch.Tensor) else x for x in inputs]  # shapes too
        grad_outputs = _grad_outputs(testing.as_tuple(reference(*detached)))
    comparisons = testing.compare_with_reference(
        fn,
        reference,
        inputs,
        grad_inputs=op.grad_inputs if with_grads else (),
        grad_outputs=grad_outputs,
    )
    if case.mode == "bwd":
        comparisons = [c for c in comparisons if c.name.startswith("grad")]
    failed = [c for c in comparisons if not c.passed]
    verdict = {"max_err": max(c.err_kernel for c in comparisons), "check": "FAIL" if failed else "pass"}
    if failed:  # which tensors, by how much, against what bound: what a reader of the row needs next
        verdict["error"] = "wrong output: " + "; ".join(map(str, failed))
    return verdict


def _free_device_memory() -> None:
    """Unreferenced tensors collected and the allocator's idle segments given back to the device
    (after an out-of-memory error, called outside its handler, whose traceback holds its frames)."""
    gc.collect()
    torch.cuda.empty_cache()


def _unchecked() -> dict:
    """A row whose float64 reference ran out of device memory: the largest cases' do not fit beside
    the provider's tensors on every card (8192 x 262144 logits are 16 GiB a float64 tensor, against
    80 GB on an H100). The row is timed unchecked and says so; the tests check the op's numerics."""
    _free_device_memory()
    return {"check": UNCHECKED, "error": "the float64 reference ran out of device memory"}


def run_case(
    case: Case, provider_names: Iterable[str] | None, device: str, keep_going: bool = False
) -> list[dict]:
    """One row per provider for the case (unavailable providers give a row with the reason). An
    error of tritonkit's raises, or with ``keep_going`` is a failed row saying what it was."""
    rows = []
    for provider in providers_for(case.workload):
        if provider_names and provider.name not in provider_names:
            continue
        clock = _PhaseClock()
        if device == "cuda":
            _make_room(case)
        fn = provider.build(case.workload)
        row = _base_row(case, provider.name)
        if isinstance(fn, str):
            rows.append(row | {"unavailable": fn})
            continue
        needs_grad = case.mode != "fwd"
        inputs = _inputs(case, device, SEED, needs_grad)
        clock.lap("setup")
        out_of_memory = False
        try:
            row |= _check(fn, case, inputs)
        except torch.OutOfMemoryError:
            out_of_memory = True
        except (ValueError, RuntimeError, NotImplementedError) as error:
            if provider.name == "tritonkit":
                if not keep_going:
                    raise
                rows.append(row | {"check": "FAIL", "error": f"{type(error).__name__}: {error}"[:300]})
                continue
            # a peer that refuses the case (liger-kernel caps the row length) is a row saying why
            rows.append(row | {"unavailable": f"refused: {type(error).__name__}: {error}"[:200]})
            continue
        if out_of_memory:  # (out of the handler, whose traceback holds the reference's tensors)
            row |= _unchecked()
        clock.lap("check")
        if device == "cuda":
            reason = None
            try:
                row |= _measured(fn, case, inputs, provider.name, clock)
            except torch.OutOfMemoryError as error:
                # a peer's (eager torch's fp32 copies of the largest logits) is a row saying so; ours
                # is a finding, raised unless the run keeps going
                if provider.name == "tritonkit" and not keep_going:
                    raise
                reason = f"{OUT_OF_MEMORY}: {error}"[:200]
            if reason is not None:
                del inputs
                _free_device_memory()
                rows.append(row | {"unavailable": reason, "bench_s": clock.laps})
                continue
        rows.append(row | {"bench_s": clock.laps})
    return rows


def _measured(fn: Callable, case: Case, inputs: tuple, provider: str, clock: _PhaseClock) -> dict:
    """A checked call's measures on the GPU: its peak memory, kernel and eager times, host time."""
    row = _peak_extra(fn, case, inputs)
    clock.lap("peak")
    row |= _timings(fn, case, inputs, provider)
    clock.lap("timing")
    row |= _host_time(fn, case, provider)
    clock.lap("host")
    return row


# A row's device memory at most, in its op's bytes (Cost.bytes: inputs and outputs in their dtype):
# the float64 reference's copies of inputs, outputs and gradients at up to 4x their bytes each, the
# provider's own, and a second set of inputs for the timing's rotation
ROOM_FACTOR = 16


def _make_room(case: Case) -> None:
    """Before a provider's row: collect the garbage and give the caching allocator's idle segments
    back to the device, where the case could need more than the device has free (the float64
    reference of a large case wants 8 GB of logits at 8192 x 128256). Only there: a collection took
    0.45-0.56 s of each row's setup in a sweep on the H200 (its phase clock at 6d3bd5f and 3b3a420,
    a third of the row), and the allocator frees its idle segments itself before an allocation
    fails."""
    need = ROOM_FACTOR * case.workload.cost(case.shape, case.dtype, case.mode).bytes
    if need > torch.cuda.mem_get_info()[0]:
        _free_device_memory()


class _PhaseClock:
    """Wall seconds of a row's phases, where a long run's time goes: setup (the garbage collection
    and the inputs), check (the first calls, so their compiles, and the float64 reference), peak
    (one call under the memory counter), timing (capture, warm-up and repetitions; the copy's
    ceiling the first time a size is seen) and host (the tiny shape's host time, once a key)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps[phase] = round(now - self._last, 3)
        self._last = now


def _base_row(case: Case, provider: str) -> dict:
    cost = case.workload.cost(case.shape, case.dtype, case.mode)
    h200 = roofline.device_spec("h200")
    return {
        "op": case.workload.name,
        "provider": provider,
        "mode": case.mode,
        "shape": list(case.shape),
        "dtype": dtype_name(case.dtype),
        "flops": cost.flops,
        "bytes": cost.bytes,
        "predicted_ms_h200": roofline.roofline_seconds(cost, h200, case.workload.flop_unit) * 1e3,
    }


@functools.cache
def _ceilings() -> tuple[roofline.DeviceSpec, roofline.DeviceSpec]:
    """(measured, datasheet) of this GPU, read once per process rather than once per row."""
    return roofline.measured_ceilings(), roofline.device_spec()


@functools.cache
def _copy_ms(total_bytes: int) -> float:
    """Median time of a device copy moving ``total_bytes`` (half read, half written), timed like
    the ops: the speed of light at this size, where launch and tail effects weigh on small shapes.
    The copy is an elementwise kernel (torch.neg into another buffer), not ``copy_``: captured in a
    CUDA graph, ``copy_`` becomes a memcpy node, which ran at about 2.7 TB/s on the H200 on large
    buffers (fp32 or uint8 alike) where kernels stream at 4.2, and made this ceiling too low."""
    src = torch.randn(max(1, total_bytes // 8), device="cuda")
    dst = torch.empty_like(src)
    (_, median, _), _ = timing.kernel_ms([lambda: lambda: torch.neg(src, out=dst)])
    return median


def _peak_extra(fn: Callable, case: Case, inputs: tuple) -> dict:
    """The memory one call holds at its peak beyond its inputs and the gradients it returns (a
    backward's forward included: what it saves counts), in MiB: the extra memory a user pays, as
    the cross-entropy issue's bound on linear_cross_entropy counts it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = _call(fn, case, inputs)()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    returned = 0
    if case.mode != "fwd":  # the gradients are the call's results, not its overhead
        returned = sum(inputs[i].numel() * inputs[i].element_size() for i in case.workload.op.grad_inputs)
    del result
    return {"peak_extra_mib": max(peak - returned, 0) / 2**20}


# (workload, provider) pairs whose call failed CUDA-graph capture in this run, and why: timed eagerly
# from then on, never captured again (``timing.capture`` says why a failed capture costs the rest
# of the process its freed memory).
_uncapturable: dict[tuple[str, str], str] = {}


def _timings(fn: Callable, case: Case, inputs: tuple, provider: str) -> dict:
    cost = case.workload.cost(case.shape, case.dtype, case.mode)
    input_bytes = sum(x.numel() * x.element_size() for x in inputs if isinstance(x, torch.Tensor))
    sets = [inputs] + [
        _inputs(case, "cuda", SEED + 10 + i, case.mode != "fwd")
        for i in range(timing.rotation_count(input_bytes) - 1)
    ]
    calls = [functools.partial(_call, fn, case, s) for s in sets]
    pair = (case.workload.name, provider)
    (p20, median, p80), method = timing.kernel_ms(calls, eager_because=_uncapturable.get(pair))
    if "capture failed (" in method:
        _uncapturable[pair] = "capture failed at an earlier case " + method[method.index("(") :]
    eager = median if method.startswith("eager") else timing.eager_ms(calls[0]())
    seconds = median * 1e-3
    measured, datasheet = _ceilings()
    unit = case.workload.flop_unit
    return {
        "ms_p20": p20,
        "ms": median,
        "ms_p80": p80,
        "eager_ms": eager,
        "timing": method,
        "gbps": cost.bytes / seconds / 1e9,
        "tflops": cost.flops / seconds / 1e12,
        "pct_roofline": roofline.pct_of_roofline(cost, seconds, measured, unit),
        "pct_roofline_datasheet": roofline.pct_of_roofline(cost, seconds, datasheet, unit),
        "pct_copy_same_bytes": 100 * _copy_ms(cost.bytes) / median,
        "measured_bandwidth": measured.bandwidth,
        "measured_peak": measured.peak(unit),
    }


# Host time is measured on the workload's tiny shape, the same for every shape of a sweep: once per
# (workload, provider, mode, dtype) a run. (Measured per case it also made torch.compile recompile the
# tiny shape after every reset.)
_host_times: dict[tuple, float] = {}


def _host_time(fn: Callable, case: Case, provider: str) -> dict:
    key = (case.workload.name, provider, case.mode, case.dtype)
    if key not in _host_times:
        tiny = Case(case.workload, case.workload.tiny_shape, case.dtype, case.mode)
        _host_times[key] = timing.host_us(_call(fn, tiny, _inputs(tiny, "cuda", SEED, case.mode != "fwd")))
    return {"host_us": _host_times[key], "host_shape": list(case.workload.tiny_shape)}


def case_id(case: Case) -> tuple:
    """What names a case in its rows: (op, mode, shape, dtype), "op" the workload's name."""
    return case.workload.name, case.mode, tuple(case.shape), dtype_name(case.dtype)


def row_case_id(row: dict) -> tuple:
    return row["op"], row["mode"], tuple(row["shape"]), row["dtype"]


def case_label(case: Case) -> str:
    return f"{case.workload.name} {case.mode} {shape_name(case.shape)} {dtype_name(case.dtype)}"


def run(
    names: Iterable[str],
    *,
    shapes: str | list[tuple[tuple, str | None]] = "quick",
    dtypes=None,
    modes=MODES,
    providers: Iterable[str] | None = None,
    progress: bool = True,
    done: Iterable[dict] = (),
    on_case: Callable[[list[dict]], None] | None = None,
    report: Callable[[str], None] | None = None,
    compile_per_shape: bool = True,
    keep_going: bool = False,
    only: Iterable[tuple] | None = None,
) -> list[dict]:
    """Run the sweep over the named workloads and return its rows (each with provenance), in sweep order.

    Cases that already have rows in ``done`` (an interrupted run's) are not run again: their rows
    are kept. ``on_case`` receives each case's rows as soon as the case finishes, and ``report`` a
    line saying which case finished and how long it took (where a log shows a long run's progress).
    ``compile_per_shape`` compiles torch.compile's peer afresh for each shape; without it, once a
    workload, which then serves the workload's later shapes as Dynamo's dynamic-shape graphs do.
    ``keep_going``: an error of tritonkit's on a case is a failed row, and the run goes on.
    ``only``: the shapes to keep (``cases``).
    """
    from tqdm import tqdm

    device = "cpu" if interpret() else "cuda"
    sweep = cases(names, shapes, dtypes, modes, only)
    order = {case_id(case): index for index, case in enumerate(sweep)}
    _host_times.clear()  # a new run measures host time afresh
    rows = [row for row in done if row_case_id(row) in order]
    finished = {row_case_id(row) for row in rows}
    todo = [case for case in sweep if case_id(case) not in finished]
    bar = tqdm(todo, desc="bench", unit="case", disable=not progress)
    compiled_for = None
    for index, case in enumerate(bar):
        bar.set_postfix_str(case_label(case))
        compile_key = (
            (case.workload.name, case.shape, case.dtype) if compile_per_shape else case.workload.name
        )
        if device == "cuda" and compiled_for != compile_key:
            # torch.compile's peer compiles each shape afresh, all through one wrapper: past
            # config.recompile_limit (8) Dynamo would quietly run it eagerly, and from a second
            # shape on it would compile for dynamic shapes. The modes of one shape share graphs.
            torch._dynamo.reset()
            compiled_for = compile_key
        started = time.perf_counter()
        case_rows = [row | provenance() for row in run_case(case, providers, device, keep_going)]
        rows.extend(case_rows)
        if on_case is not None:
            on_case(case_rows)
        if report is not None:
            report(
                f"bench [{index + 1}/{len(todo)}] {case_label(case)}: {len(case_rows)} rows in "
                f"{time.perf_counter() - started:.1f} s"
            )
    return sorted(rows, key=lambda row: order[row_case_id(row)])
