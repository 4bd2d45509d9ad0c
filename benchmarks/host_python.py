"""The Python share of an eager call's host time, measured without a GPU: every kernel launch is made a
no-op, while the ops' recorded launches (``_launch.Plan``) are recorded and replayed as on a GPU, so
a call costs exactly its Python (checks, keys, allocations, autograd) and nothing of the driver's.

    python benchmarks/host_python.py OUT.json

Inputs as ``host_calls.py`` (4 x 256 bf16 rows), on the CPU; the rotation and decode attention at
one new token of 4 sequences (8 query heads over 2, head dim 64, 128 cached tokens). Beside the ops:
an autograd.Function that only allocates its output and its inputs' gradients (what any op defined
in Python pays before its own work, autograd's engine included), ``torch.empty_like``, and a decode
step of a small transformers Llama patched by tritonkit (``_decode_step``). Each figure is the least
per-call time over REPEATS bursts of CALLS calls; the leaves' gradients are set to None before each
forward and backward (accumulating into them would time a CPU add). The outputs are garbage
(nothing runs): times only. A CPU's speed is its own; the split between the rows is what carries to
the H200's host (``host_calls.py`` times the whole call there).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import timeit

os.environ["TRITONKIT_INTERPRET"] = "1"  # the ops take their CPU paths; launches are faked below

import torch  # noqa: E402

import tritonkit  # noqa: E402
from tritonkit.bench.runner import provenance  # noqa: E402
from tritonkit.testing import launches_faked  # noqa: E402

ROWS, HIDDEN = 4, 256
HEADS, KV_HEADS, HEAD_DIM, CACHED = 8, 2, 64, 128  # the attention rows' (and the decode step's)
LAYERS = 4  # the transformers decode step's model: a Llama of HIDDEN, these heads and layers
CALLS, REPEATS = 2000, 7
COMMAND = "python benchmarks/host_python.py OUT.json"


class _Allocating(torch.autograd.Function):
    """The least a Python-defined op with a backward does: allocate its output, then its gradients."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.b_shape = b.shape
        return torch.empty_like(a)

    @staticmethod
    def backward(ctx, grad):
        return torch.empty_like(grad), grad.new_empty(ctx.b_shape)


def _pairs() -> dict:
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.bfloat16)

    x, w, b, wm = randn(ROWS, HIDDEN), randn(HIDDEN), randn(HIDDEN), randn(HIDDEN, HIDDEN) / HIDDEN**0.5
    wm2 = randn(HIDDEN, HIDDEN) / HIDDEN**0.5
    target = torch.randint(0, HIDDEN, (ROWS,), generator=g)
    # a decode step's attention inputs: ROWS sequences, HEADS query heads over KV_HEADS, CACHED tokens
    q, k = randn(ROWS, HEADS, 1, HEAD_DIM), randn(ROWS, KV_HEADS, 1, HEAD_DIM)
    cos, sin = randn(ROWS, 1, HEAD_DIM), randn(ROWS, 1, HEAD_DIM)
    q_new, k_new, v_new = q.transpose(1, 2), k.transpose(1, 2), randn(ROWS, 1, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (randn(ROWS, 2 * CACHED, KV_HEADS, HEAD_DIM) for _ in range(2))
    lengths = torch.full((ROWS,), CACHED, dtype=torch.int32)
    return {
        "softmax": ((x,), lambda x: tritonkit.softmax(x, -1)),
        "rms_norm": ((x, w), lambda x, w: tritonkit.rms_norm(x, HIDDEN, w)),
        "layer_norm": ((x, w, b), lambda x, w, b: tritonkit.layer_norm(x, HIDDEN, w, b)),
        "linear": ((x, wm), tritonkit.linear),
        "cross_entropy": ((x, target), tritonkit.cross_entropy),
        "bias_gelu": ((x, b), tritonkit.bias_gelu),
        # (no gradient: its input detached, the row times the forward alone)
        "quantize_fp8 tensorwise, transposed": (
            (x,),
            lambda x: tritonkit.quantize_fp8(x.detach(), "tensor", transpose=True)[0],
        ),
        # (cos and sin detached: the tables take no gradient)
        "apply_rotary_pos_emb, one new token": (
            (q, k, cos, sin),
            lambda q, k, cos, sin: tritonkit.apply_rotary_pos_emb(q, k, cos.detach(), sin.detach())[0],
        ),
        "gated_linear": ((x, wm, wm2), tritonkit.gated_linear),
        # (forward only: the caches detached, one new token appended in place at the same slot)
        "flash_attention_with_kvcache, one new token": (
            (q_new, k_cache, v_cache, k_new, v_new, lengths),
            lambda q, kc, vc, k, v, lengths: tritonkit.flash_attention_with_kvcache(
                q.detach(), kc.detach(), vc.detach(), k.detach(), v.detach(), cache_seqlens=lengths
            ),
        ),
        "autograd.Function allocating only": ((x, w), _Allocating.apply),
        "torch.empty_like (no backward)": ((x,), torch.empty_like),
    }


def _per_call_us(call, calls: int = CALLS) -> float:
    return min(timeit.repeat(call, number=calls, repeat=REPEATS)) / calls * 1e6


def _decode_step() -> dict | None:
    """One greedy decode step of a LAYERS-layer Llama patched by ``tritonkit.integrations.transformers``
    (HIDDEN wide, HEADS / KV_HEADS heads of HEAD_DIM, ROWS sequences of CACHED tokens): the model's
    forward on one new token a sequence, then the cache cropped back. tritonkit's launches are faked;
    torch's own ops (the projections, the cache's concatenation) run on the CPU, at tiny sizes. None
    without transformers."""
    try:
        import transformers
    except ImportError:
        return None
    from tritonkit.integrations import transformers as tk_hf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=HIDDEN, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=4 * CACHED,
    )  # fmt: skip
    model = tk_hf.apply(transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval())
    cache = transformers.DynamicCache(config=config)
    token = torch.ones(ROWS, 1, dtype=torch.long)
    position = torch.full((ROWS, 1), CACHED)
    with torch.no_grad():
        model(torch.ones(ROWS, CACHED, dtype=torch.long), cache=cache, use_cache=True)

    def step():
        with torch.no_grad():
            model(token, cache=cache, use_cache=True, position_ids=position)
        cache.crop(-1)  # (the step's token off again: every step attends to CACHED + 1 keys)

    for _ in range(3):
        step()
    return {"op": f"transformers decode step ({LAYERS} layers)", "forward_us": _per_call_us(step, 50),
            "forward_backward_us": None}  # fmt: skip


def _row(name: str, inputs: tuple, call) -> dict:
    leaves = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
    row = {"op": name, "forward_us": None, "forward_backward_us": None}
    for _ in range(3):  # the first call of a signature records its plan; later ones replay it
        call(*inputs)
    row["forward_us"] = _per_call_us(lambda: call(*inputs))
    out = call(*leaves)
    if out.requires_grad:
        grad = torch.randn_like(out)

        def forward_backward():
            for leaf in leaves:  # (accumulating into .grad would time a CPU add kernel)
                leaf.grad = None
            call(*leaves).backward(grad)

        for _ in range(3):
            forward_backward()
        row["forward_backward_us"] = _per_call_us(forward_backward)
    return row


def main() -> None:
    out = sys.argv[1]
    rows = []
    with launches_faked():
        for name, (inputs, call) in _pairs().items():
            rows.append(_row(name, inputs, call))
            both = rows[-1]["forward_backward_us"]
            print(f"{name:36s} forward {rows[-1]['forward_us']:6.1f} us  forward + backward "
                  + (f"{both:6.1f} us" if both is not None else "-"), flush=True)  # fmt: skip
        step = _decode_step()
        if step is not None:
            rows.append(step)
            print(f"{step['op']:36s} forward {step['forward_us']:6.1f} us", flush=True)
    result = {
        "command": COMMAND,
        "rows": rows,
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "shape": [ROWS, HIDDEN],
        **provenance(),
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
