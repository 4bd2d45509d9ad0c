"""The MUFU's exponential throughput on the GPU, fp32 against 16-bit pairs.

    python benchmarks/exp2_throughput.py OUT.json

Attention's softmax is bound in part by MUFU.EX2, one exponential a score
(docs/perf-notes/attention-forward-sm90-loop.md, "The forward's pipes, counted"). PTX also has
``ex2.approx.f16x2``, two exponentials a register: if the hardware ran a pair at the rate of one fp32 value, a
16-bit P (which the PV product takes anyway) would halve that cost. ptxas lowers it for sm_90 as two
``MUFU.EX2.F16``, one a half, so the question is their rate. Each thread runs four independent chains of 1024
exponentials over 8 values each (enough in flight to keep the pipe busy), timed with
``triton.testing.do_bench``; OUT.json holds exponentials a second and a clock of an SM at the H200's 1.98 GHz
boost clock (an assumed clock: the ratio of the two rows is the result, not their absolute value).
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

ITERS = 1024  # exponentials a chain
CHAINS = 4  # independent chains a value
BLOCK = 2048  # values a program: 8 a thread at 8 warps
BOOST_GHZ = 1.98


@triton.jit
def _ex2(x):
    return tl.inline_asm_elementwise(
        "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _ex2_pairs(x):
    return tl.inline_asm_elementwise(
        "ex2.approx.f16x2 $0, $1;", "=r,r", [x], dtype=tl.float16, is_pure=True, pack=2
    )


@triton.jit
def _chains(x_ptr, y_ptr, ITERS: tl.constexpr, PAIRS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    if PAIRS:
        x = x.to(tl.float16)
    a, b, c, d = x, x + 1.0, x + 2.0, x + 3.0  # the values overflow to inf: the rate is the same
    for _ in range(ITERS):
        if PAIRS:
            a, b, c, d = _ex2_pairs(a), _ex2_pairs(b), _ex2_pairs(c), _ex2_pairs(d)
        else:
            a, b, c, d = _ex2(a), _ex2(b), _ex2(c), _ex2(d)
    tl.store(y_ptr + offs, (a + b + c + d).to(tl.float32))


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = sms * 8 * 1024 * 8
    x = -torch.rand(n, device="cuda")
    y = torch.empty_like(x)
    result = {"command": "python benchmarks/exp2_throughput.py OUT.json", "gpu": torch.cuda.get_device_name()}
    for name, pairs in (("f32", False), ("f16x2", True)):

        def call(pairs=pairs):
            _chains[(n // BLOCK,)](x, y, ITERS, pairs, BLOCK, num_warps=8)

        call()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(call, warmup=20, rep=200)
        exps = n * ITERS * CHAINS
        result[name] = {
            "ms": ms,
            "exp_per_s": exps / ms * 1e3,
            "exp_per_sm_per_clock_at_boost": exps / (ms * 1e-3) / sms / (BOOST_GHZ * 1e9),
        }
        print(name, json.dumps(result[name]))
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
