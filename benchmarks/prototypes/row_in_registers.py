"""Prototypes of a softmax backward that holds a whole row of 32768 16-bit entries, timed on the
H200 against the online kernel and liger-kernel (the measurements behind "The backward at
8192x32768" in docs/perf-notes.md; results in benchmarks/results/h200/history/).

    PYTHONPATH=src python benchmarks/prototypes/row_in_registers.py --out DIR  # liger optional

One program a row, N == BLOCK_N. The kernels, by name in the JSON:
    k_a  y and dy widened to fp32 once, for the dot and for dx
    k_b  16-bit products, as liger-kernel computes them
    k_e  the dot's widening through inline PTX, dx's through .to(tl.float32)
    k_g  the dot from the row in registers, dx from y and dy read again
    k_h  the row in CHUNK-entry chunks with a per-lane running dot, the trip count a constant
The shipped kernel (tritonkit.ops.softmax_kernels._softmax_bwd_kernel) took the route these led to.
Timing: triton's do_bench_cudagraph, the same input every call; GB/s of 3 M N 2 bytes.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

import tritonkit.ops.softmax as sm


@triton.jit
def k_a(y_ptr, dy_ptr, dx_ptr, N, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    y = tl.load(y_ptr + row + cols, mask=mask, other=0.0)
    dy = tl.load(dy_ptr + row + cols, mask=mask, other=0.0)
    dot = tl.sum(y.to(tl.float32) * dy.to(tl.float32), axis=0)
    dx = y.to(tl.float32) * (dy.to(tl.float32) - dot)
    tl.store(dx_ptr + row + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def k_b(y_ptr, dy_ptr, dx_ptr, N, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    y = tl.load(y_ptr + row + cols, mask=mask, other=0.0)
    dy = tl.load(dy_ptr + row + cols, mask=mask, other=0.0)
    dot = tl.sum(y * dy, axis=0)  # 16-bit products, as liger
    dx = y * (dy - dot)
    tl.store(dx_ptr + row + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _widen_asm(v):
    # opaque conversion: not merged with .to(tl.float32) elsewhere
    if v.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("cvt.f32.bf16 $0, $1;", "=r,h", [v], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("cvt.f32.f16 $0, $1;", "=r,h", [v], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def k_e(y_ptr, dy_ptr, dx_ptr, N, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    y = tl.load(y_ptr + row + cols, mask=mask, other=0.0)
    dy = tl.load(dy_ptr + row + cols, mask=mask, other=0.0)
    dot = tl.sum(_widen_asm(y) * _widen_asm(dy), axis=0)
    dx = y.to(tl.float32) * (dy.to(tl.float32) - dot)
    tl.store(dx_ptr + row + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def k_g(y_ptr, dy_ptr, dx_ptr, N, BLOCK_N: tl.constexpr):
    # whole row for the dot, then read again (from L1/L2) for dx
    row = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    y = tl.load(y_ptr + row + cols, mask=mask, other=0.0, eviction_policy="evict_last")
    dy = tl.load(dy_ptr + row + cols, mask=mask, other=0.0, eviction_policy="evict_last")
    dot = tl.sum(y.to(tl.float32) * dy.to(tl.float32), axis=0)
    y = tl.load(y_ptr + row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    dy = tl.load(dy_ptr + row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    dx = y.to(tl.float32) * (dy.to(tl.float32) - dot)
    tl.store(dx_ptr + row + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def k_h(y_ptr, dy_ptr, dx_ptr, N, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    # online-style, chunks of CHUNK: pass 1 sum, pass 2 reversed
    row = tl.program_id(0).to(tl.int64) * N
    offs = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.float32)
    for i in tl.range(0, BLOCK_N // CHUNK):
        cols = i * CHUNK + offs
        mask = cols < N
        y = tl.load(y_ptr + row + cols, mask=mask, other=0.0, eviction_policy="evict_last")
        dy = tl.load(dy_ptr + row + cols, mask=mask, other=0.0, eviction_policy="evict_last")
        acc += y.to(tl.float32) * dy.to(tl.float32)
    dot = tl.sum(acc, axis=0)
    for i in tl.range(0, BLOCK_N // CHUNK):
        cols = (BLOCK_N // CHUNK - 1 - i) * CHUNK + offs
        mask = cols < N
        y = tl.load(y_ptr + row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
        dy = tl.load(dy_ptr + row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
        dx = y.to(tl.float32) * (dy.to(tl.float32) - dot)
        tl.store(dx_ptr + row + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


M, N = 8192, 32768


def _bench(fn) -> float:
    return do_bench_cudagraph(fn, rep=100, return_mode="median")


def _run_dtype(dtype) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, N, device="cuda", dtype=dtype, generator=g) * 3
    y = torch.softmax(x.float(), -1).to(dtype)
    dy = torch.randn(M, N, device="cuda", dtype=dtype, generator=g)
    y64, dy64 = y.double(), dy.double()
    ref = y64 * (dy64 - (y64 * dy64).sum(-1, keepdim=True))
    torch_dx = torch._softmax_backward_data(dy, y, -1, dtype)
    res = {"torch_err": (torch_dx.double() - ref).abs().max().item()}
    nbytes = 3 * M * N * 2

    def record(name, fn):
        dx = torch.full_like(y, float("nan"))
        fn(dx)
        err = (dx.double() - ref).abs().max().item()
        t = _bench(lambda: fn(dx))
        res[name] = {"ms": t, "gbps": nbytes / t / 1e6, "err": err}
        print(dtype, name, res[name], flush=True)

    record("torch", lambda dx: dx.copy_(torch._softmax_backward_data(dy, y, -1, dtype)))
    for name, kernel in (("k_a", k_a), ("k_b", k_b), ("k_e", k_e), ("k_g", k_g)):
        for w in (16, 32):
            try:
                record(f"{name}/w{w}",
                       lambda dx, k=kernel, w=w: k[(M,)](y, dy, dx, N, BLOCK_N=N, num_warps=w))
            except Exception as e:  # a prototype that does not compile is a row saying why
                res[f"{name}/w{w}"] = repr(e)[:200]
    for chunk in (4096, 8192):
        for w in (8, 16):
            for st in (1, 2, 3):
                record(f"k_h/c{chunk}/w{w}/s{st}", lambda dx, chunk=chunk, w=w, st=st: k_h[(M,)](
                    y, dy, dx, N, BLOCK_N=N, CHUNK=chunk, num_warps=w, num_stages=st))
    views = tuple(sm._as_3d(t, 1) for t in (y, dy, y))
    online = {"variant": "online", "BLOCK_M": 1, "BLOCK_N": 8192, "num_warps": 16}

    def run_online(dx):
        v = (views[0], views[1], sm._as_3d(dx, 1))
        sm._launch("bwd", online, False, v, sm._geometry(v))

    record("tk-online-8192-16", run_online)
    try:  # liger's backward returns a new tensor: this row also times a copy (not comparable)
        from liger_kernel.ops.softmax import _softmax_backward
        from liger_kernel.ops.utils import calculate_settings
        bs, nw = calculate_settings(N)
        res["liger_settings"] = [bs, nw]
        record("liger", lambda dx: dx.copy_(_softmax_backward(dy, y, bs, nw, False)))
    except Exception as e:
        res["liger"] = repr(e)[:300]
    return res


def _copy_gbps() -> float:
    """copy_ under a CUDA graph: a memcpy node, well below what kernels stream (kept as it ran)."""
    src = torch.empty(M * N * 2, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _bench(lambda: dst.copy_(src)) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for row_in_registers.json")
    args = parser.parse_args()
    out = {"copy_gbps": _copy_gbps()}
    for dtype in (torch.bfloat16, torch.float16):
        out[str(dtype)] = _run_dtype(dtype)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "row_in_registers.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
