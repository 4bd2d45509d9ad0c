"""The timing protocol.

Kernel time: ``triton.testing.do_bench`` asked for the median and p20/p80 explicitly (its default
is the mean), a warm-up long enough to reach the sustained clock (below) outside the timing, L2
flushed between repetitions (do_bench writes a 256 MB buffer before each; do_bench_cudagraph does
not), and inputs rotated when one set fits in L2 so that no repetition reads what the previous one
left there. Each call is captured once in a
CUDA graph and the graph is replayed: an eager backward spends 100-200 us of host time in the
autograd engine, more than the kernels take at the benchmark shapes, and timing it would measure
the host instead of the GPU. A call that cannot be captured is timed eagerly and says so.

Host time: the wall-clock time to issue one call on a tiny input, over short bursts of calls that
cannot fill the GPU's launch queue, so the host never waits for the GPU and the figure is the
host path alone (the eager cost a small shape pays).
"""

from __future__ import annotations

import contextlib
import cProfile
import functools
import io
import itertools
import math
import pstats
import time
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch

from tritonkit._runtime import interpret

QUANTILES = (0.5, 0.2, 0.8)  # median first, then p20 and p80
# Warm-up: the H200 boosts to 1980 MHz and, under a large matmul, reaches its 700 W limit after about
# 100 calls of 1.45 ms (8192x4096x16384), its clock then settling at 1425-1575 MHz. With 25 ms of
# warm-up that onset fell inside the 100 ms of repetitions for some providers and not others: at
# that shape the median sat 14-15% above p20 for ours and eager torch and 0-1% for the two other
# providers in one run, and for cuBLASLt's GELU alone in the next. 250 ms puts every provider's
# repetitions past the onset, each timed at the clock it sustains.
WARMUP_MS = 250
REP_MS = 100
_TABLES_PROTOCOL = (WARMUP_MS, REP_MS)  # what a method string leaves unsaid
MAX_ROTATION = 8  # input sets; more only costs memory once sets are twice the L2
HOST_CALLS = 100  # calls per burst: a few hundred launches, under the launch queue's ~1000
HOST_REPEATS = 21  # host time is the median over this many bursts
GRAPH_WARMUP_CALLS = 3  # on a side stream before capture, as CUDA graphs require


@contextlib.contextmanager
def protocol(warmup_ms: float, rep_ms: float) -> Iterator[None]:
    """Within this block kernels are timed after ``warmup_ms`` of warm-up over ``rep_ms`` of
    repetitions, in place of WARMUP_MS and REP_MS."""
    global WARMUP_MS, REP_MS
    previous = WARMUP_MS, REP_MS
    WARMUP_MS, REP_MS = warmup_ms, rep_ms
    try:
        yield
    finally:
        WARMUP_MS, REP_MS = previous


def rotation_count(input_bytes: int) -> int:
    """Input sets to cycle so that the sets together are at least twice the L2 cache."""
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    if input_bytes <= 0 or input_bytes >= l2_bytes:
        return 1
    return min(MAX_ROTATION, math.ceil(2 * l2_bytes / input_bytes))


def capture(make_call: Callable[[], Callable[[], object]]) -> tuple[Callable[[], object], str]:
    """(replay, "cuda-graph") of the call ``make_call`` builds, or (call, "eager: why") if capture fails.

    The call is built (running any forward a backward needs), warmed up and captured on one side
    stream: the autograd engine runs a backward on its forward's stream, which must be the one
    being captured. A call that synchronizes with the host (liger-kernel's ``.item()``) cannot be
    captured; its last warm-up runs under torch's sync debug mode, which raises at the sync, so
    that no capture is begun for it: by torch 2.11's source a failed capture leaves the caching
    allocator believing a capture still runs, so that ``empty_cache`` frees nothing (the likely
    cause of the 125 GB the cross-entropy table's sixth case found reserved and idle). A capture
    that fails for another reason still can.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call = make_call()
        for _ in range(GRAPH_WARMUP_CALLS - 1):
            call()
        synced = _host_sync(call)
    torch.cuda.current_stream().wait_stream(side)
    if synced is not None:
        torch.cuda.synchronize()
        return call, f"eager: capture failed (synchronizes with the host: {synced})"
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, stream=side):
            call()
    except RuntimeError as error:
        # torch.cuda.graph leaves the capture's stream current when its end raises
        torch.cuda.set_stream(stream)
        torch.cuda.synchronize()
        return call, f"eager: capture failed ({str(error).splitlines()[0][:120]})"
    # The graph's kernels read tensors that only `call` holds (a backward's saved forward output and
    # its upstream gradient): the replay keeps `call` alive, or their memory would be reused while
    # the graph still reads and writes it (an illegal address on the H200).
    return functools.partial(_replay, graph, call), "cuda-graph"


SYNC_ERROR = "called a synchronizing CUDA operation"  # what torch raises in sync debug mode "error"


def _host_sync(call: Callable[[], object]) -> str | None:
    """Run ``call`` once with torch's synchronizing operations raising: None if none ran, else what
    torch said at the first. Any other error is the call's own, and raises."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # that the mode is a prototype, on every call
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    except RuntimeError as error:
        if SYNC_ERROR not in str(error):
            raise
        return str(error).splitlines()[0][:80]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return None


def _replay(graph: torch.cuda.CUDAGraph, call_kept_alive: Callable[[], object]) -> None:
    graph.replay()


def kernel_ms(
    call_makers: Sequence[Callable[[], Callable[[], object]]], eager_because: str | None = None
) -> tuple[tuple[float, float, float], str]:
    """((p20, median, p80) in ms, method) of the calls taken in turn, one input set each; the
    method names a protocol other than WARMUP_MS and REP_MS (``protocol``). ``eager_because``: time
    the calls eagerly, for this reason, without trying to capture them."""
    interpret()  # decide before triton is imported
    from triton.testing import do_bench

    if eager_because is None:
        captured = [capture(make_call) for make_call in call_makers]
    else:
        captured = [(make_call(), f"eager: {eager_because}") for make_call in call_makers]
    methods = {method for _, method in captured}
    method = methods.pop() if len(methods) == 1 else "mixed: " + "; ".join(sorted(methods))
    cycle = itertools.cycle([run for run, _ in captured])
    median, p20, p80 = do_bench(
        lambda: next(cycle)(), warmup=WARMUP_MS, rep=REP_MS, quantiles=list(QUANTILES)
    )
    if (WARMUP_MS, REP_MS) != _TABLES_PROTOCOL:
        method += f" (warm-up {WARMUP_MS:g} ms, repetitions {REP_MS:g} ms)"
    return (p20, median, p80), method


# Candidates compared in one process (``interleaved_ms``): each call takes ROUNDS turns of
# ROUND_REP_MS, after ROUND_WARMUP_MS of warm-up a turn.
ROUNDS = 5
ROUND_WARMUP_MS, ROUND_REP_MS = 5, 25


def interleaved_ms(
    calls: dict[str, Callable[[], object]], rounds: int = ROUNDS, **options
) -> tuple[dict[str, float], dict[str, float]]:
    """({name: median ms}, {name: spread}) of calls that take turns (``interleaved_turns``, which
    takes ``options``): a call's time is the median of its rounds (``median_of``), its spread
    their range over it (``spread_of``)."""
    turns = interleaved_turns(calls, rounds, **options)
    return {name: median_of(ms) for name, ms in turns.items()}, {
        name: spread_of(ms) for name, ms in turns.items()
    }


def median_of(values: Sequence[float]) -> float:
    """The middle value (of an even count, the upper of the two middle ones)."""
    return sorted(values)[len(values) // 2]


def spread_of(values: Sequence[float]) -> float:
    """(largest - smallest) / ``median_of``: how far apart two measurements must be to differ."""
    return (max(values) - min(values)) / median_of(values)


def round_ratios(turns: dict[str, list[float]], reference: str) -> dict[str, list[float]]:
    """{name: reference's ms / name's ms, round by round} of ``interleaved_turns``' turns: each
    call's speed against ``reference``'s, the two timed within a second of each other in each round,
    so that a clock that drifts between rounds moves both sides of a ratio alike."""
    return {
        name: [ref / ms for ref, ms in zip(turns[reference], times, strict=True)]
        for name, times in turns.items()
    }


def interleaved_turns(
    calls: dict[str, Callable[[], object]],
    rounds: int = ROUNDS,
    *,
    heat_ms: float | None = None,
    warmup_ms: float = ROUND_WARMUP_MS,
    rep_ms: float = ROUND_REP_MS,
    grad_to_none: list[torch.Tensor] | None = None,
) -> dict[str, list[float]]:
    """{name: its ms in each round} of calls that take turns: ``heat_ms`` (WARMUP_MS unless given)
    of the first call brings the GPU to the clock it sustains under its power limit, then every
    round times each call (do_bench's median over ``rep_ms`` after ``warmup_ms``, L2 flushed,
    ``grad_to_none``'s gradients set to None before each call), the order rotated a place each
    round.

    Timed one after another with 25 ms of warm-up each, the same attention kernel's median moved
    by up to 10% between processes on the H200, more than its candidates differed; the likely
    cause (inferred, not measured apart) is the clock's fall to its power-limited level part way
    through a run (WARMUP_MS). Taking turns puts that drift on every call alike, and the spread
    says how far apart two calls must be to differ."""
    interpret()  # decide before triton is imported
    from triton.testing import do_bench

    if rounds < 1 or not calls:
        raise ValueError(f"interleaved_turns needs calls and at least one round, got {len(calls)}, {rounds}")
    names = list(calls)
    heat_ms = WARMUP_MS if heat_ms is None else heat_ms
    do_bench(calls[names[0]], warmup=heat_ms, rep=rep_ms, grad_to_none=grad_to_none)
    turns: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        start = round_ % len(names)
        for name in names[start:] + names[:start]:
            ms = do_bench(
                calls[name], warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median"
            )
            turns[name].append(ms)
    return turns


def eager_ms(call: Callable[[], object]) -> float:
    """Median ms of ``call`` run eagerly, as a user calls it (the host's path included where it is
    longer than the GPU's), L2 flushed between calls: the column beside the graph-replayed time. The
    GPU is already at its sustained clock from the replays timed before it (``kernel_ms``), so a
    short warm-up (ROUND_WARMUP_MS) suffices."""
    interpret()  # decide before triton is imported
    from triton.testing import do_bench

    return do_bench(call, warmup=ROUND_WARMUP_MS, rep=REP_MS, return_mode="median")


def call_ms(call: Callable[[], object], device) -> float:
    """Milliseconds of one call: CUDA events around it on a GPU (synchronized after), the host's
    wall clock on the CPU (a distributed benchmark's dry run)."""
    if torch.device(device).type != "cuda":
        began = time.perf_counter()
        call()
        return (time.perf_counter() - began) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def host_us(call: Callable[[], object]) -> float:
    """Median host time to issue one call, in microseconds."""
    for _ in range(HOST_CALLS):  # compile, allocate and settle outside the timing
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(HOST_REPEATS):
        start = time.perf_counter()
        for _ in range(HOST_CALLS):
            call()
        samples.append((time.perf_counter() - start) / HOST_CALLS * 1e6)
        torch.cuda.synchronize()  # outside the timed burst: drain the queue before the next
    return sorted(samples)[len(samples) // 2]


def profile_calls(calls: Sequence[tuple[str, Callable[[], object], int]], top: int = 25) -> str:
    """cProfile of each (title, call, count): the call run count times, its top entries by own time."""
    out = io.StringIO()
    for title, call, count in calls:
        call()  # compile and allocate outside the profile
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(count):
            call()
        profiler.disable()
        torch.cuda.synchronize()
        out.write(f"==== {title}: {count} calls\n")
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()
