"""Prototypes of the online softmax loop over long rows, forward and backward, timed on the H200
(the measurements behind "Long rows: what the loop keeps in flight" in docs/perf-notes.md; results
in benchmarks/results/h200/history/).

    PYTHONPATH=src python benchmarks/prototypes/online_loops.py --set measured --out DIR
    PYTHONPATH=src python benchmarks/prototypes/online_loops.py --set next --out DIR

One program a row, the row length a runtime value, N a multiple of BLOCK_N. By name in the JSON:
    f_cur, b_cur  the row's max and sum (backward: its dot) reduced across the program every chunk,
                  as the shipped online kernels do
    f_lane, b_lane  a running max and sum (dot) per lane, reduced once after the loop
    f_vec  a running max and sum per 16-byte group of entries (one rescaling exp a group)
    f_three  a max pass, a sum pass and an output pass
    f_db, b_db  the next chunk loaded at the top of the loop, before this chunk is reduced
    f_unroll  the chunk loop unrolled UNROLL times (tl.range's loop_unroll_factor)
"measured" times the first six; "next" the shipped loop against the last three.
Timing: tritonkit.bench.timing.kernel_ms (CUDA graphs, do_bench median, L2 flushed); GB/s of the
minimal bytes, 2 M N s forward and 3 M N s backward.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from tritonkit.bench import timing

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def f_cur(x_ptr, y_ptr, N, BLOCK_N: tl.constexpr):
    # chunk-wise row max/sum (a cross-warp reduction per chunk)
    row = tl.program_id(0).to(tl.int64) * N
    offs = tl.arange(0, BLOCK_N)
    m = tl.full([1], -float("inf"), tl.float32)
    s = tl.zeros([1], tl.float32)
    for start in range(0, N, BLOCK_N):
        x = tl.load(x_ptr + row + start + offs, eviction_policy="evict_last").to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp2((m - m_new) * LOG2E) + tl.sum(tl.exp2((x - m_new) * LOG2E), axis=0)
        m = m_new
    inv = 1.0 / s
    chunks = N // BLOCK_N
    for i in range(chunks):
        cols = (chunks - 1 - i) * BLOCK_N + offs
        x = tl.load(x_ptr + row + cols, eviction_policy="evict_first").to(tl.float32)
        tl.store(y_ptr + row + cols, (tl.exp2((x - m) * LOG2E) * inv).to(y_ptr.dtype.element_ty))


@triton.jit
def f_lane(x_ptr, y_ptr, N, BLOCK_N: tl.constexpr):
    # lane-wise running max/sum, one reduction at the end (two exps an element in pass 1)
    row = tl.program_id(0).to(tl.int64) * N
    offs = tl.arange(0, BLOCK_N)
    m = tl.full([BLOCK_N], -float("inf"), tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, N, BLOCK_N):
        x = tl.load(x_ptr + row + start + offs, eviction_policy="evict_last").to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp2((m - m_new) * LOG2E) + tl.exp2((x - m_new) * LOG2E)
        m = m_new
    m_row = tl.max(m, axis=0)
    s_row = tl.sum(s * tl.exp2((m - m_row) * LOG2E), axis=0)
    inv = 1.0 / s_row
    chunks = N // BLOCK_N
    for i in range(chunks):
        cols = (chunks - 1 - i) * BLOCK_N + offs
        x = tl.load(x_ptr + row + cols, eviction_policy="evict_first").to(tl.float32)
        tl.store(y_ptr + row + cols, (tl.exp2((x - m_row) * LOG2E) * inv).to(y_ptr.dtype.element_ty))


@triton.jit
def f_vec(x_ptr, y_ptr, N, BLOCK_N: tl.constexpr, VEC: tl.constexpr):
    # running max/sum per group of VEC contiguous entries (one thread's 16-byte load): the group's max
    # needs no shuffle, the rescale costs one exp per group
    row = tl.program_id(0).to(tl.int64) * N
    offs = tl.arange(0, BLOCK_N // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    m = tl.full([BLOCK_N // VEC], -float("inf"), tl.float32)
    s = tl.zeros([BLOCK_N // VEC], tl.float32)
    for start in range(0, N, BLOCK_N):
        x = tl.load(x_ptr + row + start + offs, eviction_policy="evict_last").to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        s = s * tl.exp2((m - m_new) * LOG2E) + tl.sum(tl.exp2((x - m_new[:, None]) * LOG2E), axis=1)
        m = m_new
    m_row = tl.max(m, axis=0)
    s_row = tl.sum(s * tl.exp2((m - m_row) * LOG2E), axis=0)
    inv = 1.0 / s_row
    flat = tl.arange(0, BLOCK_N)
    chunks = N // BLOCK_N
    for i in range(chunks):
        cols = (chunks - 1 - i) * BLOCK_N + flat
        x = tl.load(x_ptr + row + cols, eviction_policy="evict_first").to(tl.float32)
        tl.store(y_ptr + row + cols, (tl.exp2((x - m_row) * LOG2E) * inv).to(y_ptr.dtype.element_ty))


@triton.jit
def f_three(x_ptr, y_ptr, N, BLOCK_N: tl.constexpr):
    # lane-wise max pass, lane-wise sum pass, output pass: one exp an element in each of the last two
    row = tl.program_id(0).to(tl.int64) * N
    offs = tl.arange(0, BLOCK_N)
    m = tl.full([BLOCK_N], -float("inf"), tl.float32)
    for start in range(0, N, BLOCK_N):
        x = tl.load(x_ptr + row + start + offs, eviction_policy="evict_last").to(tl.float32)
        m = tl.maximum(m, x)
    m_row = tl.max(m, axis=0)
    s = tl.zeros([BLOCK_N], tl.float32)
    chunks = N // BLOCK_N
    for i in range(chunks):
        cols = (chunks - 1 - i) * BLOCK_N + offs
        x = tl.load(x_ptr + row + cols, eviction_policy="evict_last").to(tl.float32)
        s += tl.exp2((x - m_row) * LOG2E)
    inv = 1.0 / tl.sum(s, axis=0)
    for start in range(0, N, BLOCK_N):
        x = tl.load(x_ptr + row + start + offs, eviction_policy="evict_first").to(tl.float32)
        tl.store(y_ptr + row + start + offs, (tl.exp2((x - m_row) * LOG2E) * inv).to(y_ptr.dtype.element_ty))


@triton.jit
def b_cur(y_ptr, dy_ptr, dx_ptr, N, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * N
    offs = tl.arange(0, BLOCK_N)
    dot = tl.zeros([1], tl.float32)
    for start in range(0, N, BLOCK_N):
        y = tl.load(y_ptr + row + start + offs, eviction_policy="evict_last")
        dy = tl.load(dy_ptr + row + start + offs, eviction_policy="evict_last")
        dot += tl.sum(y.to(tl.float32) * dy.to(tl.float32), axis=0)
    chunks = N // BLOCK_N
    for i in range(chunks):
        cols = (chunks - 1 - i) * BLOCK_N + offs
        y = tl.load(y_ptr + row + cols, eviction_policy="evict_first")
        dy = tl.load(dy_ptr + row + cols, eviction_policy="evict_first")
        dx = y.to(tl.float32) * (dy.to(tl.float32) - dot)
        tl.store(dx_ptr + row + cols, dx.to(dx_ptr.dtype.element_ty))


@triton.jit
def b_lane(y_ptr, dy_ptr, dx_ptr, N, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * N
    offs = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, N, BLOCK_N):
        y = tl.load(y_ptr + row + start + offs, eviction_policy="evict_last")
        dy = tl.load(dy_ptr + row + start + offs, eviction_policy="evict_last")
        acc += y.to(tl.float32) * dy.to(tl.float32)
    dot = tl.sum(acc, axis=0)
    chunks = N // BLOCK_N
    for i in range(chunks):
        cols = (chunks - 1 - i) * BLOCK_N + offs
        y = tl.load(y_ptr + row + cols, eviction_policy="evict_first")
        dy = tl.load(dy_ptr + row + cols, eviction_policy="evict_first")
        dx = y.to(tl.float32) * (dy.to(tl.float32) - dot)
        tl.store(dx_ptr + row + cols, dx.to(dx_ptr.dtype.element_ty))


@triton.jit
def f_db(x_ptr, y_ptr, N, BLOCK_N: tl.constexpr):
    # per-chunk row reduction with the next chunk's load issued before this chunk is reduced
    row = tl.program_id(0).to(tl.int64) * N
    offs = tl.arange(0, BLOCK_N)
    m = tl.full([1], -float("inf"), tl.float32)
    s = tl.zeros([1], tl.float32)
    x_next = tl.load(x_ptr + row + offs, mask=offs < N, other=-float("inf"), eviction_policy="evict_last")
    for start in range(0, N, BLOCK_N):
        x = x_next.to(tl.float32)
        cols = start + BLOCK_N + offs
        x_next = tl.load(x_ptr + row + cols, mask=cols < N, other=-float("inf"), eviction_policy="evict_last")
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp2((m - m_new) * LOG2E) + tl.sum(tl.exp2((x - m_new) * LOG2E), axis=0)
        m = m_new
    inv = 1.0 / s
    chunks = N // BLOCK_N
    for i in range(chunks):
        cols = (chunks - 1 - i) * BLOCK_N + offs
        x = tl.load(x_ptr + row + cols, eviction_policy="evict_first").to(tl.float32)
        tl.store(y_ptr + row + cols, (tl.exp2((x - m) * LOG2E) * inv).to(y_ptr.dtype.element_ty))


@triton.jit
def f_unroll(x_ptr, y_ptr, N, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * N
    offs = tl.arange(0, BLOCK_N)
    m = tl.full([1], -float("inf"), tl.float32)
    s = tl.zeros([1], tl.float32)
    for start in tl.range(0, N, BLOCK_N, loop_unroll_factor=UNROLL):
        x = tl.load(x_ptr + row + start + offs, eviction_policy="evict_last").to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp2((m - m_new) * LOG2E) + tl.sum(tl.exp2((x - m_new) * LOG2E), axis=0)
        m = m_new
    inv = 1.0 / s
    chunks = N // BLOCK_N
    for i in tl.range(0, chunks, loop_unroll_factor=UNROLL):
        cols = (chunks - 1 - i) * BLOCK_N + offs
        x = tl.load(x_ptr + row + cols, eviction_policy="evict_first").to(tl.float32)
        tl.store(y_ptr + row + cols, (tl.exp2((x - m) * LOG2E) * inv).to(y_ptr.dtype.element_ty))


@triton.jit
def b_db(y_ptr, dy_ptr, dx_ptr, N, BLOCK_N: tl.constexpr):
    # lane-wise dot with the next chunk's loads issued before this chunk is used
    row = tl.program_id(0).to(tl.int64) * N
    offs = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], tl.float32)
    y_next = tl.load(y_ptr + row + offs, mask=offs < N, other=0.0, eviction_policy="evict_last")
    dy_next = tl.load(dy_ptr + row + offs, mask=offs < N, other=0.0, eviction_policy="evict_last")
    for start in range(0, N, BLOCK_N):
        y = y_next
        dy = dy_next
        cols = start + BLOCK_N + offs
        y_next = tl.load(y_ptr + row + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
        dy_next = tl.load(dy_ptr + row + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
        acc += y.to(tl.float32) * dy.to(tl.float32)
    dot = tl.sum(acc, axis=0)
    chunks = N // BLOCK_N
    for i in range(chunks):
        cols = (chunks - 1 - i) * BLOCK_N + offs
        y = tl.load(y_ptr + row + cols, eviction_policy="evict_first")
        dy = tl.load(dy_ptr + row + cols, eviction_policy="evict_first")
        dx = y.to(tl.float32) * (dy.to(tl.float32) - dot)
        tl.store(dx_ptr + row + cols, dx.to(dx_ptr.dtype.element_ty))


SHAPES = ((8192, 32768, torch.bfloat16), (2048, 131072, torch.bfloat16), (512, 524288, torch.float32))
SETS = {"measured": (("f_cur", "f_lane", "f_vec", "f_three"), ("b_cur", "b_lane")),
        "next": (("f_cur", "f_db", "f_unroll2", "f_unroll4"), ("b_cur", "b_lane", "b_db"))}


def _ms(launch) -> float:
    (_, median, _), _ = timing.kernel_ms([lambda: launch])
    return median


def _forward(name, x, y, bn, w):
    """A launch of forward prototype ``name`` (f_unroll2: f_unroll with UNROLL 2)."""
    extra = {"VEC": 16 // x.element_size()} if name == "f_vec" else {}
    if name.startswith("f_unroll"):
        extra, name = {"UNROLL": int(name[-1])}, "f_unroll"
    kernel = globals()[name]
    return lambda: kernel[(x.shape[0],)](x, y, x.shape[1], BLOCK_N=bn, num_warps=w, **extra)


def _time_all(res, label, names, make, reference, out, nbytes):
    for name in names:
        for bn in (4096, 8192):
            for w in (8, 16):
                row = f"{label} {name}/{bn}/w{w}"
                launch = make(name, bn, w)
                try:
                    out.fill_(float("nan"))
                    launch()
                    err = (out.double() - reference).abs().max().item()
                    res[row] = [round(nbytes / _ms(launch) / 1e6), err]
                except Exception as e:  # a prototype that does not compile is a row saying why
                    res[row] = repr(e)[:150]
                print(row, res[row], flush=True)


def _shape(m, n, dtype, forward_names, backward_names) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(m, n, device="cuda", generator=g) * 3).to(dtype)
    res = {}
    y = torch.empty_like(x)
    _time_all(res, "fwd", forward_names, lambda name, bn, w: _forward(name, x, y, bn, w),
              torch.softmax(x.double(), -1), y, 2 * x.numel() * x.element_size())
    yy = torch.softmax(x.float(), -1).to(dtype)
    dy = torch.randn(m, n, device="cuda", generator=g).to(dtype)
    y64, dy64 = yy.double(), dy.double()
    reference = y64 * (dy64 - (y64 * dy64).sum(-1, keepdim=True))
    dx = torch.empty_like(x)
    _time_all(res, "bwd", backward_names,
              lambda name, bn, w: lambda: globals()[name][(m,)](yy, dy, dx, n, BLOCK_N=bn, num_warps=w),
              reference, dx, 3 * x.numel() * x.element_size())
    return res


def _copy_gbps() -> float:
    """copy_ under a CUDA graph: a memcpy node, well below what kernels stream (kept as it ran)."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _ms(lambda: dst.copy_(src)) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=sorted(SETS), default="measured")
    parser.add_argument("--out", default=".", help="folder for online_loops-<set>.json")
    args = parser.parse_args()
    out = {"copy_gbps": _copy_gbps()}
    for m, n, dtype in SHAPES:
        out[f"{m}x{n} {dtype}"] = _shape(m, n, dtype, *SETS[args.set])
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"online_loops-{args.set}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
