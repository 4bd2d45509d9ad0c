"""The host time of an eager call of each op on a tiny input, beside torch's own op, in one process:
issue 27's host goals (softmax <= 10 us, rms_norm <= 25 us, linear <= 1.5x F.linear, attention
forward <= 30 us, each at most 1.5x torch's op, the backward likewise).

Run on a GPU:  PYTHONPATH=src python benchmarks/host_calls.py OUT.json [PROFILE.txt]
Each figure is tritonkit.bench.timing.host_us: the median over bursts of calls of the time to issue
one (the bursts never fill the launch queue, so the host never waits for the GPU). "forward" calls
the op on inputs that want no gradient; "forward + backward" calls it on leaves that want one and
backpropagates a fixed upstream gradient (torch's autograd engine included). A call after the first
of a signature replays its recorded launches (``_launch.Plan``), as a training loop's calls do.
The host's speed moves between runs and machines (by 2x on the H200's hosts): the ratios are what a
run says, the microseconds only of that host. PROFILE.txt gets cProfile's view of each of our ops'
forward (its top entries by own time: the launchers' and torch's C calls among them).
"""

from __future__ import annotations

import json
import sys

import torch
from torch.nn import functional
from torch.nn.attention import SDPBackend, sdpa_kernel

import tritonkit
from tritonkit.bench.runner import provenance
from tritonkit.bench.timing import host_us, profile_calls

ROWS, HIDDEN = 4, 256  # the tiny input: (ROWS, HIDDEN) bf16
ATTENTION = (1, 1, 128, 64)  # (B, H, S, D), causal
GOALS_US = {"softmax": 10.0, "rms_norm": 25.0, "attention": 30.0}  # absolute forward goals


def _sdpa(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _pairs() -> dict:
    """op -> (inputs maker, tritonkit's call, torch's call), each call taking the inputs."""
    g = torch.Generator("cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    x, w, b, wm = randn(ROWS, HIDDEN), randn(HIDDEN), randn(HIDDEN), randn(HIDDEN, HIDDEN) / HIDDEN**0.5
    q, k, v = (randn(*ATTENTION) for _ in "qkv")
    target = torch.randint(0, HIDDEN, (ROWS,), generator=g, device="cuda")
    return {
        "softmax": ((x,), lambda x: tritonkit.softmax(x, -1), lambda x: torch.softmax(x, -1)),
        "rms_norm": (
            (x, w),
            lambda x, w: tritonkit.rms_norm(x, HIDDEN, w),
            lambda x, w: functional.rms_norm(x, (HIDDEN,), w),
        ),
        "layer_norm": (
            (x, w, b),  # (one tensor as both weight and bias would keep its launches from replaying)
            lambda x, w, b: tritonkit.layer_norm(x, HIDDEN, w, b),
            lambda x, w, b: functional.layer_norm(x, (HIDDEN,), w, b),
        ),
        "linear": ((x, wm), tritonkit.linear, functional.linear),
        "cross_entropy": ((x, target), tritonkit.cross_entropy, functional.cross_entropy),
        "attention": (
            (q, k, v),
            lambda q, k, v: tritonkit.flash_attention(q, k, v, causal=True),
            _sdpa,
        ),
    }


def _timed(inputs: tuple, call) -> dict:
    """host_us of the forward alone and of a forward and backward."""
    leaves = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
    out = call(*leaves)
    grad = torch.randn_like(out)

    def forward_backward():
        call(*leaves).backward(grad)

    return {"forward": host_us(lambda: call(*inputs)), "forward + backward": host_us(forward_backward)}


def main() -> None:
    result = provenance() | {
        "command": "python benchmarks/host_calls.py OUT.json",
        "method": "tritonkit.bench.timing.host_us: median over bursts of the host time to issue one call",
        "rows": [],
    }
    for op, (inputs, ours, theirs) in _pairs().items():
        row = {"op": op, "tritonkit_us": _timed(inputs, ours), "torch_us": _timed(inputs, theirs)}
        row["ratio"] = {mode: row["tritonkit_us"][mode] / row["torch_us"][mode] for mode in row["torch_us"]}
        if op in GOALS_US:
            row["forward_goal_us"] = GOALS_US[op]
        result["rows"].append(row)
        ours, theirs = row["tritonkit_us"], row["torch_us"]
        print(op, {mode: f"{ours[mode]:.1f} vs {theirs[mode]:.1f} us" for mode in row["ratio"]}, flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)
    if len(sys.argv) > 2:
        calls = [(f"{op} forward", lambda ours=ours, inputs=inputs: ours(*inputs), 2000)
                 for op, (inputs, ours, _) in _pairs().items()]  # fmt: skip
        with open(sys.argv[2], "w") as f:
            f.write(profile_calls(calls))


if __name__ == "__main__":
    main()
