"""Where a step's time goes: its GPU kernels by kind from torch.profiler, and the host's time to
issue it. ``bench layer``, ``bench model`` and the benchmark scripts profile their steps with these.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch


def clear_grads(tensors: Iterable[torch.Tensor]) -> None:
    """Set each tensor's .grad to None (a step's gradients start afresh, as do_bench's grad_to_none)."""
    for t in tensors:
        t.grad = None


# A kernel's kind, by the first pattern its lower-cased name contains (cuDNN's SDPA kernels, FA2's,
# tritonkit's attention kernels; cuBLAS's (nvjet, sm90_xmma), CUTLASS's, tritonkit's linear ones)
KERNEL_KINDS = {
    "attention": ("attn", "flash", "fmha", "sdpa", "cudnn"),
    "matmul": ("nvjet", "gemm", "xmma", "cutlass", "linear", "matmul", "mm_"),
    "other": ("",),
}


def kernel_kind(name: str) -> str:
    """Which of KERNEL_KINDS a GPU kernel of this name is."""
    lowered = name.lower()
    return next(kind for kind, patterns in KERNEL_KINDS.items() if any(p in lowered for p in patterns))


PROFILE_STEPS = 3  # steps the kernel profile averages over
# Steps run first, unprofiled: the H200 reaches its power cap after ~150 ms of a large step's
# work and then lowers its clock, so a profile of a cold GPU times every kernel ~10% short of the
# step's measured time (docs/perf-notes/linear.md, "the power limit")
PROFILE_WARMUP_STEPS = 15
PROFILE_TOP = 12  # kernels a row lists, by GPU time


def kernel_profile(call: Callable[[], object], grads_to_none: list[torch.Tensor]) -> dict:
    """Where a step's GPU time goes, from torch.profiler over PROFILE_STEPS steps: {"kernel_ms": the
    step's kernel time, summed, "profiled_span_ms": the steps' span on the GPU, "kernel_ms_by_kind",
    "kernels": the PROFILE_TOP longest kernels as {"name", "ms", "calls"} a step}. The span above
    kernel_ms is time the GPU waited (on the host, or between the steps)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    for _ in range(PROFILE_WARMUP_STEPS):  # back at the power cap the timing ran under
        clear_grads(grads_to_none)
        call()
    # a step profiled and dropped first: a process's first profiled step leaves the GPU idle while
    # the profiler starts (1.2-1.5 ms in the d64 layer's first profiled row, 0.05 in the rows after)
    steps = schedule(wait=0, warmup=1, active=PROFILE_STEPS, repeat=1)
    with profile(activities=[ProfilerActivity.CUDA], schedule=steps) as prof:
        for step in range(1 + PROFILE_STEPS):
            clear_grads(grads_to_none)
            call()
            if step in (0, PROFILE_STEPS):  # the dropped step's kernels and the last kept ones done
                torch.cuda.synchronize()
            prof.step()
    clear_grads(grads_to_none)
    totals: dict[str, list] = {}
    starts, ends = [], []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            total = totals.setdefault(event.name, [0.0, 0])
            total[0] += event.device_time_total / 1e3 / PROFILE_STEPS
            total[1] += 1
            starts.append(event.time_range.start)
            ends.append(event.time_range.end)
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])
    kinds = dict.fromkeys(KERNEL_KINDS, 0.0)
    for name, (ms, _) in totals.items():
        kinds[kernel_kind(name)] += ms
    return {
        "kernel_ms": sum(ms for ms, _ in totals.values()),
        # first kernel's start to last one's end, a step: above kernel_ms by the GPU's idle time
        "profiled_span_ms": (max(ends) - min(starts)) / 1e3 / PROFILE_STEPS if starts else 0.0,
        "kernel_ms_by_kind": kinds,
        "kernels": [
            {"name": name[:160], "ms": ms, "calls": calls / PROFILE_STEPS}
            for name, (ms, calls) in ranked[:PROFILE_TOP]
        ],
    }


HOST_STEPS = 5  # steps host_ms is the median of


def host_ms(call: Callable[[], object], grads_to_none: list[torch.Tensor]) -> float:
    """The host's time to issue one step (the call returning, the GPU idle before it): at or above
    the step's time, the step is bound by the host. The median of HOST_STEPS."""
    times = []
    for _ in range(HOST_STEPS):
        clear_grads(grads_to_none)
        torch.cuda.synchronize()
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1e3)
    torch.cuda.synchronize()
    clear_grads(grads_to_none)
    return sorted(times)[len(times) // 2]
