"""Where the host time of a tiny attention call goes, layer by layer, on the H200 (sm_90: the Gluon
kernels), beside cuDNN's SDPA in the same process.

Run on a GPU:  PYTHONPATH=src python benchmarks/attention_host.py OUT.json [PROFILE.txt]
Each figure is tritonkit.bench.timing.host_us at (1, 1, 128, 64) bf16, causal: the median over
bursts of calls of the time to issue one (the bursts never fill the launch queue). From the
innermost layer out: the outputs' allocation, one TMA descriptor, the launch's build
(``fwd_sm90.launches``), its launch through the lean path and through Triton's own (``_launch.LEAN``),
``attention_fwd_sm90`` (its checks, the build and the launch), ``attention_fwd_into`` (the dispatch
too), the forward op as a call like one before replays it (``_launch.Plan``: none of the above but
the launch), the public call without and with a gradient wanted, and a forward and backward. PROFILE.txt
gets cProfile's view of the public forward and of a forward and backward.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.nn import functional
from torch.nn.attention import SDPBackend, sdpa_kernel

import tritonkit
from tritonkit import _launch
from tritonkit.bench.runner import provenance
from tritonkit.bench.timing import host_us, profile_calls
from tritonkit.ops.attention import attention, fwd_sm90
from tritonkit.ops.attention.common import Scores
from tritonkit.ops.attention.fwd import attention_fwd_into, fwd_outputs

SHAPE = (1, 1, 128, 64)
SCALE = SHAPE[-1] ** -0.5


def _inputs(requires_grad: bool = False) -> list[torch.Tensor]:
    g = torch.Generator("cuda").manual_seed(0)
    return [
        torch.randn(SHAPE, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_(requires_grad)
        for _ in range(3)
    ]


def _through_triton(launch: _launch.Launch) -> None:
    _launch.LEAN = False
    try:
        launch.run()
    finally:
        _launch.LEAN = True


def measure() -> dict[str, float]:
    q, k, v = _inputs()
    qg, kg, vg = _inputs(requires_grad=True)
    do = torch.randn_like(q)
    o, lse = fwd_outputs(q)
    scores = Scores(scale=SCALE, causal=True)
    launch = fwd_sm90.launches(q, k, v, o, lse, scale=SCALE, causal=True)[0]

    def ours(query, key, value):
        return tritonkit.flash_attention(query, key, value, causal=True)

    def sdpa(query, key, value):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return functional.scaled_dot_product_attention(query, key, value, is_causal=True)

    cases = {
        "o and lse allocated (fwd_outputs)": lambda: fwd_outputs(q),
        "one TMA descriptor": lambda: fwd_sm90.descriptor(q, 128),
        "the launch built (fwd_sm90.launches)": lambda: fwd_sm90.launches(
            q, k, v, o, lse, scale=SCALE, causal=True
        ),
        "the launch, lean path": launch.run,
        "the launch, through Triton (_launch.LEAN = False)": lambda: _through_triton(launch),
        "attention_fwd_sm90 (checks, build, launch)": lambda: fwd_sm90.attention_fwd_sm90(
            q, k, v, o, lse, scale=SCALE, causal=True
        ),
        "attention_fwd_into (the dispatch too)": lambda: attention_fwd_into(q, k, v, o, lse, scores),
        "the attention_fwd op, replayed (its Plan)": lambda: attention._forward(
            q, k, v, None, None, 0, 0, SCALE, True, True, -1, -1, 0.0, o, lse
        ),
        "tritonkit.flash_attention, no gradient": lambda: ours(q, k, v),
        "tritonkit.flash_attention, gradient wanted": lambda: ours(qg, kg, vg),
        "tritonkit forward + backward": lambda: ours(qg, kg, vg).backward(do),
        "cuDNN SDPA, no gradient": lambda: sdpa(q, k, v),
        "cuDNN SDPA, gradient wanted": lambda: sdpa(qg, kg, vg),
        "cuDNN SDPA forward + backward": lambda: sdpa(qg, kg, vg).backward(do),
    }
    results = {}
    for name, call in cases.items():
        for t in (qg, kg, vg):
            t.grad = None
        results[name] = host_us(call)
        print(f"{results[name]:8.2f} us  {name}", flush=True)
    return results


def profile(path: str) -> None:
    """cProfile of 2000 public forwards and 500 forwards and backwards, top entries by own time."""
    q, k, v = _inputs(requires_grad=True)
    do = torch.randn_like(q)
    text = profile_calls(
        (
            ("forward, gradient wanted", lambda: tritonkit.flash_attention(q, k, v, causal=True), 2000),
            ("forward + backward", lambda: tritonkit.flash_attention(q, k, v, causal=True).backward(do), 500),
        ),
        top=30,
    )
    with open(path, "w") as f:
        f.write(text)


def main() -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("attention_host.py times the sm_90 Gluon kernels' host path: it needs an sm_90 GPU")
    record = {
        "shape": list(SHAPE),
        "dtype": "bf16",
        "causal": True,
        "host_us": measure(),
        "command": "PYTHONPATH=src python benchmarks/attention_host.py OUT.json",
    } | provenance()
    Path(sys.argv[1]).write_text(json.dumps(record, indent=1))
    if len(sys.argv) > 2:
        profile(sys.argv[2])


if __name__ == "__main__":
    main()
