"""Where the decoder layer's training step (``tritonkit bench layer``'s 8b-4k) leaves the GPU idle,
and what the host does meanwhile, on the H200.

    python benchmarks/layer_idle.py OUT_DIR

For tritonkit's layer, deterministic, then ``deterministic=False``, then deterministic again: 15
steps, then two steps under torch.profiler (CPU and CUDA activities), once plain and once
``with_stack`` (Python frames). Each trace is saved as OUT_DIR/trace-*.json.gz (chrome://tracing,
Perfetto) and read back: the kernels' busy time and span, and every gap over 15 us between two
kernels, with the launch that ended it (matched by correlation id), how long after the gap began
the host issued it, and the host's operations that started in the gap. OUT_DIR/idle.json holds
them, by provider and run.
"""

from __future__ import annotations

import gzip
import json
import os
import sys

import torch
from attention_bwd_sm90 import result_header
from torch.profiler import ProfilerActivity, profile

from tritonkit import tuning
from tritonkit.bench import layer

SHAPE = layer.CASES["8b-4k"]
GAP_US = 15  # gaps shorter than this are launch spacing, not idle
WARM_STEPS, TRACED_STEPS = 15, 2


def _gap(before: dict, after: dict, launches: dict, host: list) -> dict:
    """One idle gap: the kernels around it, the launch that ended it and the host's work in it."""
    idle_from = before["ts"] + before["dur"]
    launch = launches.get(after["args"].get("correlation"))
    issued = launch["ts"] if launch else after["ts"]
    return {
        "gap_us": after["ts"] - idle_from,
        "prev": before["name"][:80],
        "next": after["name"][:80],
        "launch_after_prev_end_us": issued - idle_from if launch else None,
        "launch_name": launch["name"] if launch else None,
        "launch_dur_us": launch["dur"] if launch else None,
        # the host's operations open at the launch (the innermost last), and those begun in the gap
        "host_stack_at_launch": [
            op["name"][:90] for op in host if launch and op["ts"] <= issued <= op["ts"] + op["dur"]
        ][-12:],
        "host_ops_in_gap": [
            (round(op["ts"] - idle_from), round(op["dur"]), op["name"][:80])
            for op in host
            if idle_from <= op["ts"] < issued and op["dur"] > 10
        ][:40],
    }


def analyse(path: str) -> dict:
    """The trace at ``path``: kernels, span, busy time, idle over GAP_US and its 30 largest gaps."""
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")), key=lambda e: e["ts"]
    )
    launches = {
        e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime" and "args" in e
    }
    host = sorted((e for e in events if e.get("cat") in ("python_function", "cpu_op")), key=lambda e: e["ts"])
    gaps = [
        _gap(a, b, launches, host)
        for a, b in zip(kernels, kernels[1:], strict=False)
        if b["ts"] - (a["ts"] + a["dur"]) > GAP_US
    ]
    gaps.sort(key=lambda g: -g["gap_us"])
    runtime = {}  # runtime call: [calls, us, longest us]
    for call in launches.values():
        entry = runtime.setdefault(call["name"], [0, 0.0, 0.0])
        entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + call["dur"], max(entry[2], call["dur"])
    return {
        "kernels": len(kernels),
        "span_us": kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"],
        "busy_us": sum(k["dur"] for k in kernels),
        "idle_over_15us": sum(g["gap_us"] for g in gaps),
        "gaps": gaps[:30],
        "runtime": sorted(runtime.items(), key=lambda item: -item[1][1])[:25],
    }


def _traced(step, stack: bool, path: str) -> dict:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stack) as prof:
        for _ in range(TRACED_STEPS):
            step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path[: -len(".gz")])
    with open(path[: -len(".gz")], "rb") as raw, gzip.open(path, "wb") as packed:
        packed.write(raw.read())
    os.remove(path[: -len(".gz")])
    return analyse(path)


def main() -> None:
    out = sys.argv[1]
    x, g = layer.make_inputs(SHAPE, torch.bfloat16, "cuda")
    w = layer.make_weights(SHAPE, torch.bfloat16, "cuda")
    result = result_header("layer", "layer_idle.py", "torch.profiler traces, two steps each") | {"rows": {}}
    for provider in ("tritonkit", "tritonkit[nondeterministic]", "tritonkit"):
        fn = layer.build(provider, SHAPE, None)

        def step(fn=fn):
            for t in (x, *w):
                t.grad = None
            fn(x, w).backward(g)

        for _ in range(WARM_STEPS):
            step()
        torch.cuda.synchronize()
        for stack in (False, True):
            run = f"{provider} {'stack' if stack else 'plain'} {len(result['rows'])}"
            row = _traced(step, stack, f"{out}/trace-{len(result['rows'])}.json.gz")
            result["rows"][run] = row
            print(
                run,
                "span",
                row["span_us"],
                "busy",
                row["busy_us"],
                "idle>15us",
                row["idle_over_15us"],
                flush=True,
            )
    with open(f"{out}/idle.json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    with tuning.enabled():  # tritonkit as tuned (where nothing is cached or shipped, tuned here)
        main()
