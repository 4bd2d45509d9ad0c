"""Rows that start off their 16-byte vectors, read in windows (``softmax.WINDOWS``,
``cross_entropy.WINDOWS``) against the same kernels with windows off (ALIGN's narrower accesses,
an entry at a time for odd lengths), beside torch; untuned, as a first call runs.

    python benchmarks/windows.py OUT.json

softmax forward and backward at odd row lengths held in registers and one over GPT-2's 50257
classes (the online kernels, in chunks), cross_entropy forward and backward at 50257 classes and
another odd vocabulary. Each call is captured in a CUDA graph
and the replays take turns (``timing.interleaved_ms``); GB/s from the bytes each must move.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.nn import functional

import tritonkit
import tritonkit.ops.cross_entropy as ce
import tritonkit.ops.softmax.softmax as sm
from tritonkit.bench.sweep import untuned_calls
from tritonkit.bench.timing import capture, interleaved_ms

COMMAND = "python benchmarks/windows.py OUT.json"
SOFTMAX = [
    ((17944, 9017), torch.bfloat16),
    ((21061, 2901), torch.bfloat16),
    ((63687, 195), torch.float32),
    ((162063, 77), torch.float16),
    ((4096, 16001), torch.float32),
    ((2048, 50257), torch.bfloat16),
]  # fmt: skip (the last through the online kernels)
CROSS_ENTROPY = [((8192, 50257), torch.bfloat16), ((8192, 32001), torch.float32)]


def _switched(module, on: bool, call):
    """``call`` with ``module.WINDOWS`` set to ``on`` while it builds its launches."""

    def run():
        module.WINDOWS = on
        try:
            return call()
        finally:
            module.WINDOWS = True

    return run


def _softmax_calls(shape, dtype, direction):
    g = torch.Generator(device="cuda").manual_seed(shape[1])
    x = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    if direction == "fwd":
        return (
            (lambda: tritonkit.softmax(x, -1)),
            (lambda: torch.softmax(x, -1)),
            2 * x.numel() * x.element_size(),
        )
    y, dy = torch.softmax(x, -1), torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    dx = torch.empty_like(x)
    ours = lambda: torch.ops.tritonkit.softmax_backward(dy, y, -1, False, "auto", dx)  # noqa: E731
    theirs = lambda: torch._softmax_backward_data(dy, y, -1, dtype)  # noqa: E731
    return ours, theirs, 3 * x.numel() * x.element_size()


def _cross_entropy_calls(shape, dtype, direction):
    g = torch.Generator(device="cuda").manual_seed(shape[1])
    x = torch.randn(shape, device="cuda", dtype=dtype, generator=g).requires_grad_(direction != "fwd")
    target = torch.randint(0, shape[1], (shape[0],), device="cuda", generator=g)
    moved = x.numel() * x.element_size() * (1 if direction == "fwd" else 3)

    def make(fn):
        if direction == "fwd":
            return lambda: fn(x.detach(), target)
        return lambda: torch.autograd.grad(fn(x, target), x)

    return make(tritonkit.cross_entropy), make(functional.cross_entropy), moved


def _row(family: str, module, shape, dtype, direction, make_calls) -> dict:
    ours, theirs, moved = make_calls(shape, dtype, direction)
    calls = {
        "windows": capture(lambda: _switched(module, True, ours))[0],
        "no windows": capture(lambda: _switched(module, False, ours))[0],
        "torch": capture(lambda: theirs)[0],
    }
    ms, spread = interleaved_ms(calls)
    return {
        "family": family,
        "shape": list(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "direction": direction,
        "ms": ms,
        "spread": spread,
        "gbps": {name: moved / t / 1e6 for name, t in ms.items()},
    }


def main() -> None:
    out, rows = sys.argv[1], []
    cases = [("softmax", sm, shape, dtype, _softmax_calls) for shape, dtype in SOFTMAX]
    cases += [("cross_entropy", ce, shape, dtype, _cross_entropy_calls) for shape, dtype in CROSS_ENTROPY]
    with untuned_calls():
        for family, module, shape, dtype, make_calls in cases:
            for direction in ("fwd", "fwd+bwd" if family == "cross_entropy" else "bwd"):
                rows.append(_row(family, module, shape, dtype, direction, make_calls))
                rates = "  ".join(f"{n} {r:.0f}" for n, r in rows[-1]["gbps"].items())
                print(f"{family} {direction} {shape} {rows[-1]['dtype']} GB/s: {rates}", flush=True)
                with open(out, "w") as f:
                    json.dump({"command": COMMAND, "rows": rows}, f, indent=1)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
