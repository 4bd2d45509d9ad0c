"""The attention backward of a packed batch on the H200: the sm_90 Gluon kernel (``bwd_sm90``'s VARLEN)
against tritonkit's Triton kernels on the same call, both modes, bf16, causal; beside them, as the
rate to reach, cuDNN SDPA's and the Gluon kernel's dense backward over a batch of as many tokens in
sequences of one length.

    python benchmarks/attention_packed.py OUT.json [--rounds N] [--head-dim D ...]

The packed batch is LENGTHS (31,764 tokens, 300 to 6,000 a sequence), Hq 32 / Hkv 8; the dense batch
(8, 4096). The providers take turns, ``--rounds`` of them (``tritonkit.bench.timing.interleaved_turns``):
a time is the median of its turns, each ``triton.testing.do_bench``'s median over eager backward calls
(the delta pass and the finishing passes included), from saved forward outputs. TFLOP/s from 2.5 x 4 x
Hq x D x the pairs a causal mask leaves (S (S + 1) / 2 a sequence). Each packed provider's largest
gradient difference against the Triton kernels' deterministic ones is in the JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tritonkit.bench import runner, timing
from tritonkit.ops.attention import bwd, fwd
from tritonkit.ops.attention.common import Packed, Scores

LENGTHS = [5120, 3000, 1800, 700, 4096, 2500, 900, 6000, 300, 1500, 2048, 3800]
HEADS_Q, HEADS_KV, DENSE = 32, 8, (8, 4096)
COMMAND = "python benchmarks/attention_packed.py OUT.json"


def _packed_inputs(head_dim: int, g: torch.Generator) -> tuple:
    """q, k, v, dO (T, H, D) bf16, the forward's o and lse, and the Packed."""
    total = sum(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    packed = Packed(cu, cu, len(LENGTHS), max(LENGTHS), max(LENGTHS))
    q, do = (
        torch.randn(total, HEADS_Q, head_dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "qo"
    )
    k, v = (
        torch.randn(total, HEADS_KV, head_dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv"
    )
    o, lse = fwd.attention_fwd(q, k, v, Scores(head_dim**-0.5, True), packed=packed)
    return q, k, v, do, o, lse, packed


def _packed_call(inputs, deterministic: bool, gluon: bool):
    q, k, v, do, o, lse, packed = inputs
    scores = Scores(q.shape[-1] ** -0.5, True)

    def call():
        bwd.SM90_BACKWARD_PACKED = gluon
        try:
            return bwd.attention_bwd(
                do, q, k, v, o, lse, None, scores, packed=packed, deterministic=deterministic
            )
        finally:
            bwd.SM90_BACKWARD_PACKED = True

    return call


def _dense_calls(head_dim: int, g: torch.Generator) -> dict:
    """cuDNN's and the Gluon kernel's backward of the dense batch, causal."""
    batch, seq = DENSE
    q, do = (
        torch.randn(batch, HEADS_Q, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in "qo"
    )
    k, v = (
        torch.randn(batch, HEADS_KV, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in "kv"
    )
    scores = Scores(head_dim**-0.5, True)
    o, lse = fwd.attention_fwd(q, k, v, scores)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.autograd.grad(out, leaves, do, retain_graph=True)

    def gluon(deterministic):
        return lambda: bwd.attention_bwd(do, q, k, v, o, lse, None, scores, deterministic=deterministic)

    return {"cudnn dense": cudnn, "gluon dense": gluon(False), "gluon dense det": gluon(True)}


def _pairs(lengths) -> int:
    return sum(n * (n + 1) // 2 for n in lengths)


def row(head_dim: int, rounds: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    inputs = _packed_inputs(head_dim, g)
    calls = {
        "gluon packed": _packed_call(inputs, False, True),
        "triton packed": _packed_call(inputs, False, False),
        "gluon packed det": _packed_call(inputs, True, True),
        "triton packed det": _packed_call(inputs, True, False),
        **_dense_calls(head_dim, g),
    }
    reference = calls["triton packed det"]()
    errors = {}
    for name in ("gluon packed", "gluon packed det", "triton packed"):
        grads = calls[name]()
        errors[name] = max(
            (a.float() - b.float()).abs().max().item() for a, b in zip(grads, reference, strict=True)
        )
    ms, spread = timing.interleaved_ms(calls, rounds)
    flops = {name: 2.5 * 4 * HEADS_Q * head_dim for name in calls}
    for name in calls:
        flops[name] *= _pairs([DENSE[1]] * DENSE[0]) if "dense" in name else _pairs(LENGTHS)
    return {
        "head_dim": head_dim,
        "heads": [HEADS_Q, HEADS_KV],
        "lengths": LENGTHS,
        "dense": list(DENSE),
        "ms": ms,
        "spread": spread,
        "tflops": {name: flops[name] / ms[name] * 1e-9 for name in calls},
        "gluon_vs_triton": {
            "free": ms["triton packed"] / ms["gluon packed"],
            "deterministic": ms["triton packed det"] / ms["gluon packed det"],
        },
        "max_abs_diff_vs_triton_det": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-dim", type=int, action="append", choices=(64, 128))
    args = parser.parse_args()
    rows = []
    for head_dim in args.head_dim or [128, 64]:
        rows.append(row(head_dim, args.rounds))
        r = rows[-1]
        print(
            f"D={head_dim}: gluon/triton packed x{r['gluon_vs_triton']['free']:.2f} free, "
            f"x{r['gluon_vs_triton']['deterministic']:.2f} det; TFLOP/s "
            + ", ".join(f"{n} {t:.0f}" for n, t in r["tflops"].items()),
            flush=True,
        )
    result = {"command": COMMAND, **runner.provenance(), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
