"""The timing protocol.

Kernel time: ``triton.testing.do_bench`` asked for the median and p20/p80 explicitly (its default
is the mean), warm-up outside the timing, L2 flushed between repetitions (do_bench writes a
256 MB buffer; do_bench_cudagraph does not), and inputs rotated when one set fits in L2 so that
no repetition reads what the previous one left there.

Host time: wall-clock time per call over many back-to-back calls on a tiny input, where the GPU
finishes each kernel before the host issues the next, so the figure is the host path alone.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence

import torch

from tritonkit._runtime import interpret

QUANTILES = (0.5, 0.2, 0.8)  # median first, then p20 and p80
WARMUP_MS = 25
REP_MS = 100
MAX_ROTATION = 8  # input sets; more only costs memory once sets are twice the L2
HOST_CALLS = 2000  # calls per host-time measurement: ~40 ms at 20 us a call
HOST_REPEATS = 5  # host time is the median of this many measurements


def rotation_count(input_bytes: int) -> int:
    """Input sets to cycle so that the sets together are at least twice the L2 cache."""
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    if input_bytes <= 0 or input_bytes >= l2_bytes:
        return 1
    return min(MAX_ROTATION, math.ceil(2 * l2_bytes / input_bytes))


def kernel_ms(calls: Sequence[Callable[[], object]]) -> tuple[float, float, float]:
    """(p20, median, p80) in ms of the calls, taken in turn, one input set each."""
    interpret()  # decide before triton is imported
    from triton.testing import do_bench

    cycle = itertools.cycle(calls)
    median, p20, p80 = do_bench(lambda: next(cycle)(), warmup=WARMUP_MS, rep=REP_MS,
                                quantiles=list(QUANTILES))
    return p20, median, p80


def host_us(call: Callable[[], object]) -> float:
    """Median host wall time per call, in microseconds."""
    for _ in range(100):  # compile, allocate and settle outside the timing
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(HOST_REPEATS):
        start = time.perf_counter()
        for _ in range(HOST_CALLS):
            call()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / HOST_CALLS * 1e6)
    return sorted(samples)[len(samples) // 2]
