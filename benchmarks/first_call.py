"""A user's first call on a shape: how long it takes with tuning off (the default) and on, and how
much of it is Triton compiling.

    PYTHONPATH=src python benchmarks/first_call.py OUT.json [--shapes N] [--tuned-shapes M] [--deadline S]

For each family of the sweep (``tritonkit.bench.sweep.WORKLOADS``) and the first N shapes the
sweep draws (seed 1: shapes no table was tuned on, though a bucket may hold a shipped winner), in
one process: the wall time of the first forward call and then of the first backward (each to
``torch.cuda.synchronize``), and the compile time Triton reports meanwhile (its compilation
listener, over the kernels it compiled rather than found in its cache). Then, for the first M of
those shapes, new tensors of the same shapes under ``tuning.enabled()``: a first call that tunes
its key (the kernels of the default config are in Triton's cache by then; the other candidates
compile). The goal: a first call within 1 s plus its compile time. Runs stop past ``--deadline``
seconds; what ran is written.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from attention_bwd_sm90 import arguments, deadline, result_header

from tritonkit import testing, tuning
from tritonkit.bench import sweep
from tritonkit.dtypes import DTYPE_OF
from tritonkit.ops import get_workload


class CompileClock:
    """Seconds Triton spent compiling (cache misses) since the last :meth:`lap`."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit):
        if not cache_hit:
            self.seconds += times.total / 1e6

    def lap(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def first_calls(name: str, shape: tuple, dtype_name: str, clock: CompileClock) -> list[dict]:
    """The forward's and the backward's first call on new inputs: wall and compile seconds."""
    workload = get_workload(name)
    op = workload.op
    inputs = op.make_inputs(shape, DTYPE_OF[dtype_name], "cuda", testing.generator(0))
    for i in op.grad_inputs:
        inputs[i].requires_grad_(True)
    torch.cuda.synchronize()
    rows = []
    clock.lap()
    started = time.perf_counter()
    outputs = testing.as_tuple(op.fn(*inputs, **workload.call_kwargs))
    torch.cuda.synchronize()
    rows.append(("fwd", time.perf_counter() - started, clock.lap()))
    wanted = [inputs[i] for i in op.grad_inputs]
    if wanted:
        started = time.perf_counter()
        torch.autograd.grad(outputs, wanted, [torch.ones_like(o) for o in outputs])
        torch.cuda.synchronize()
        rows.append(("bwd", time.perf_counter() - started, clock.lap()))
    return [
        {
            "family": name,
            "shape": list(shape),
            "dtype": dtype_name,
            "mode": mode,
            "wall_s": wall,
            "compile_s": compiled,
            "beyond_compile_s": wall - compiled,
        }  # fmt: skip
        for mode, wall, compiled in rows
    ]


def main() -> None:
    from triton import knobs

    out = sys.argv[1]
    count = (arguments("--shapes", int) or [20])[0]
    tuned_count = (arguments("--tuned-shapes", int) or [1])[0]
    stop = deadline()
    clock = CompileClock()
    knobs.compilation.listener = clock
    shapes = sweep.sample_shapes(count, seed=1)
    result = result_header("first_call", "first_call.py", "wall time of a first call, to synchronize")
    result |= {"shapes": count, "tuned_shapes": tuned_count, "rows": []}
    for setting, picked in (("off", shapes), ("on", shapes[:tuned_count])):
        for name in sweep.WORKLOADS:
            for shape, dtype_name in picked:
                if time.time() > stop:
                    break
                with tuning.enabled() if setting == "on" else tuning.disabled():
                    rows = first_calls(name, shape, dtype_name, clock)
                for row in rows:
                    row["tuning"] = setting
                    print(
                        f"{setting:3} {name:13} {str(shape):18} {dtype_name} {row['mode']}: "
                        f"{row['wall_s']:7.3f} s, compiling {row['compile_s']:7.3f}",
                        flush=True,
                    )
                result["rows"] += rows
                with open(out, "w") as f:
                    json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
