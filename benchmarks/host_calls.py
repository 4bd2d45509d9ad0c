"""The host time of an eager call of each op on a tiny input, beside torch's own op, in one process:
issue 27's host goals (softmax <= 10 us, rms_norm <= 25 us, linear <= 1.5x F.linear, attention
forward <= 30 us, each at most 1.5x torch's op, the backward likewise); and a decode step's two
per-layer calls, HF's rotation (beside its torch ops) and decode attention (forward only, beside
the new token's write into the cache and SDPA over it).

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
# a decode step's: ROWS sequences, HEADS query heads over KV_HEADS of HEAD_DIM, CACHED tokens
HEADS, KV_HEADS, HEAD_DIM, CACHED = 8, 2, 64, 128
FORWARD_ONLY = ("flash_attention_with_kvcache",)  # no gradient: the forward timed alone
GOALS_US = {"softmax": 10.0, "rms_norm": 25.0, "attention": 30.0}  # absolute forward goals


def _sdpa(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _hf_rotary(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb in torch ops: (x * cos + rotate_half(x) * sin) of each."""

    def rotated(x):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rotated(q), rotated(k)


def _sdpa_over_cache(q, k_cache, v_cache, k, v, lengths):
    """torch's decode step: the new keys written into the cache, SDPA over the cache's first
    CACHED + 1 positions (every sequence as long), the KV heads repeated for GQA."""
    k_cache[:, CACHED : CACHED + 1], v_cache[:, CACHED : CACHED + 1] = k, v
    keys, values = (c[:, : CACHED + 1].transpose(1, 2) for c in (k_cache, v_cache))
    return functional.scaled_dot_product_attention(q.transpose(1, 2), keys, values, enable_gqa=True)


def _pairs() -> dict:
    """op -> (inputs maker, tritonkit's call, torch's call), each call taking the inputs."""
    g = torch.Generator("cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    x, w, b, wm = randn(ROWS, HIDDEN), randn(HIDDEN), randn(HIDDEN), randn(HIDDEN, HIDDEN) / HIDDEN**0.5
    q, k, v = (randn(*ATTENTION) for _ in "qkv")
    q1, k1 = randn(ROWS, HEADS, 1, HEAD_DIM), randn(ROWS, KV_HEADS, 1, HEAD_DIM)
    cos, sin = randn(ROWS, 1, HEAD_DIM), randn(ROWS, 1, HEAD_DIM)
    caches = [randn(ROWS, 2 * CACHED, KV_HEADS, HEAD_DIM) for _ in "kv"]
    lengths = torch.full((ROWS,), CACHED, dtype=torch.int32, device="cuda")
    new_k, new_v = k1.transpose(1, 2), randn(ROWS, 1, KV_HEADS, HEAD_DIM)
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
        "apply_rotary_pos_emb": (
            (q1, k1, cos, sin),  # (the tables' gradients refused: detached)
            lambda q, k, cos, sin: tritonkit.apply_rotary_pos_emb(q, k, cos.detach(), sin.detach())[0],
            lambda q, k, cos, sin: _hf_rotary(q, k, cos.detach(), sin.detach())[0],
        ),
        "flash_attention_with_kvcache": (
            (q1.transpose(1, 2), *caches, new_k, new_v, lengths),
            lambda q, kc, vc, k, v, n: tritonkit.flash_attention_with_kvcache(
                q, kc, vc, k, v, cache_seqlens=n
            ),
            _sdpa_over_cache,
        ),
    }


def _timed(inputs: tuple, call, backward: bool = True) -> dict:
    """host_us of the forward alone and (``backward``) of a forward and backward."""
    if not backward:
        return {"forward": host_us(lambda: call(*inputs))}
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
        backward = op not in FORWARD_ONLY
        row = {
            "op": op,
            "tritonkit_us": _timed(inputs, ours, backward),
            "torch_us": _timed(inputs, theirs, backward),
        }
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
