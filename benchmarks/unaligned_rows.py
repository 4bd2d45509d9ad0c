"""Rows that do not start on 16 bytes: is that what holds the norms at a third of the copy rate, and
does reading a group of rows as one aligned run fix it? (The sweep's first shard on the H200 had
layer_norm, rms_norm and add_rms_norm at 33-59% of the copy at 38788 x 3027 bf16, and the peers as
slow: a row of 3027 bf16 starts 6054 bytes after the last, so no load of a row can be 128-bit.)

    python benchmarks/unaligned_rows.py OUT.json
    TRITONKIT_INTERPRET=1 python benchmarks/unaligned_rows.py --check   # the prototype's values, CPU

For each shape, rms_norm's forward (weight, eps 1e-6): tritonkit's untuned call, the prototype
below, torch's ``F.rms_norm``, and a copy of x (``x.clone()``: the rate a pass over these bytes can
reach), CUDA-graph replays (``tritonkit.bench.timing.kernel_ms``, median), GB/s of x read and y
written. Beside 3027 the aligned widths around it (3024, 3032), and the sweep's rows of 195 fp32.

The prototype (``_rms_fwd_grouped_kernel``): a program takes G rows whose flat run starts on 16
bytes (G a multiple of 16 / gcd(N x element size, 16): eight rows of 3027 bf16 are 48,432 bytes) and
reads it in chunks of BLOCK entries along the flat run, 128-bit loads and stores; a chunk's entries
belong to at most SPAN rows, each row's sum of squares taken under its mask. A second pass over the
run (from L1 or L2) writes y, each entry scaled by its row's rstd and its column's weight (gathered:
the weight is small and cached). Rows past the last whole group take the shipped kernel.
"""

from __future__ import annotations

import json
import math
import sys

import torch

from tritonkit._triton import tl, triton

SHAPES = [
    ((38788, 3027), torch.bfloat16),
    ((38788, 3024), torch.bfloat16),
    ((38788, 3032), torch.bfloat16),
    ((63687, 195), torch.float32),
    ((63687, 196), torch.float32),
]
EPS = 1e-6
COMMAND = "python benchmarks/unaligned_rows.py OUT.json"


@triton.jit
def _rms_fwd_grouped_kernel(
    x_ptr,  # (M, N) contiguous; rows [0, programs x G) are read here
    w_ptr,  # (N,)
    y_ptr,  # (M, N) contiguous
    N,
    eps,
    G: tl.constexpr,  # rows a program: their flat run starts and ends on 16 bytes
    BLOCK: tl.constexpr,  # entries a chunk of the flat run
    SPAN: tl.constexpr,  # rows a chunk can touch: cdiv(BLOCK - 1, N) + 1, at most G
    VEC: tl.constexpr,  # entries in 16 bytes
):
    length = G * N  # a multiple of VEC, by the choice of G
    length = tl.multiple_of(length, VEC)
    base = tl.program_id(0).to(tl.int64) * length
    offs = tl.arange(0, BLOCK)
    rows = tl.arange(0, G)
    sums = tl.zeros([G], tl.float32)
    for start in range(0, length, BLOCK):
        i = start + offs
        x = tl.load(x_ptr + base + i, mask=i < length, other=0.0, eviction_policy="evict_last")
        squares = x.to(tl.float32) * x.to(tl.float32)
        first_row = start // N
        for j in tl.static_range(SPAN):
            row = first_row + j
            lo = row * N - start  # the row's entries in the chunk: offs in [lo, lo + N)
            part = tl.sum(tl.where((offs >= lo) & (offs < lo + N), squares, 0.0), axis=0)
            sums += tl.where(rows == row, part, 0.0)
    rstd = 1.0 / tl.sqrt(sums / N + eps)
    for start in range(0, length, BLOCK):
        i = start + offs
        mask = i < length
        x = tl.load(x_ptr + base + i, mask=mask, other=0.0, eviction_policy="evict_first")
        first_row = start // N
        scale = tl.zeros([BLOCK], tl.float32)
        col = offs + start
        for j in tl.static_range(SPAN):
            row = first_row + j
            lo = row * N - start
            in_row = (offs >= lo) & (offs < lo + N)
            row_rstd = tl.sum(tl.where(rows == row, rstd, 0.0), axis=0)
            scale = tl.where(in_row, row_rstd, scale)
            col = tl.where(in_row, offs - lo, col)
        w = tl.load(w_ptr + col, mask=mask, other=0.0)
        y = x.to(tl.float32) * scale * w.to(tl.float32)
        tl.store(y_ptr + base + i, y.to(y_ptr.dtype.element_ty), mask=mask)


def group_rows(n: int, dtype: torch.dtype, least_bytes: int = 32768) -> int:
    """Rows a program: the fewest whose flat run is a multiple of 16 bytes, times the least power of
    two that makes the run at least ``least_bytes`` (a program's work past its fixed costs)."""
    size = torch.empty((), dtype=dtype).element_size()
    g = 16 // math.gcd(n * size, 16)
    while g * n * size < least_bytes:
        g *= 2
    return g


def rms_norm_grouped(
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float = EPS,
    block: int = 2048,
    warps: int = 8,
    least_bytes=32768,
    y: torch.Tensor | None = None,
):
    """The prototype's rms_norm forward of a contiguous (M, N) x into ``y`` (a new tensor if None):
    whole groups here, the rest of the rows on tritonkit's kernel."""
    import tritonkit

    m, n = x.shape
    g = group_rows(n, x.dtype, least_bytes)
    y = torch.empty_like(x) if y is None else y
    programs = m // g
    if programs:
        vec = 16 // x.element_size()
        span = min(g, triton.cdiv(block - 1, n) + 1)
        _rms_fwd_grouped_kernel[(programs,)](
            x, w, y, n, eps, G=g, BLOCK=block, SPAN=span, VEC=vec, num_warps=warps
        )
    if programs * g < m:
        y[programs * g :] = tritonkit.rms_norm(x[programs * g :], n, w, eps)
    return y


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from tritonkit.ops.norm.norm import rms_norm_reference

    return rms_norm_reference(x.double(), (x.shape[1],), w.double(), EPS)


def check(device: str = "cpu") -> list[dict]:
    """The prototype against the float64 reference by the oracle's rule (``oracle.compare``: torch in
    the inputs' dtype sets the bound), its output NaN-filled first, at shapes that leave a tail of
    rows, span several rows a chunk and split rows across chunks."""
    from tritonkit import oracle

    rows = []
    cases = [((37, 27), torch.bfloat16, 64), ((21, 13), torch.float32, 32), ((9, 300), torch.bfloat16, 128),
             ((19, 195), torch.float32, 256)]  # fmt: skip
    for (m, n), dtype, block in cases:
        g = torch.Generator(device=device).manual_seed(m * n)
        x = torch.randn(m, n, dtype=dtype, device=device, generator=g) * 3
        w = torch.randn(n, dtype=dtype, device=device, generator=g)
        poisoned = torch.full_like(x, math.nan)
        ours = rms_norm_grouped(x, w, block=block, warps=4, least_bytes=64, y=poisoned)
        theirs = torch.nn.functional.rms_norm(x, (n,), w, EPS)
        comparison = oracle.compare(f"{m}x{n} {dtype}", ours, theirs, _reference(x, w), dtype)
        rows.append({"block": block, "group": group_rows(n, dtype, 64), "check": str(comparison)})
        assert comparison.passed, comparison
    return rows


def _row(shape: tuple, dtype: torch.dtype) -> dict:
    import tritonkit
    from tritonkit.bench.sweep import untuned_calls
    from tritonkit.bench.timing import kernel_ms
    from tritonkit.oracle import max_abs_error

    m, n = shape
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(shape, dtype=dtype, device="cuda", generator=g)
    w = torch.randn(n, dtype=dtype, device="cuda", generator=g)
    calls = {
        "copy": lambda: x.clone,
        "torch": lambda: lambda: torch.nn.functional.rms_norm(x, (n,), w, EPS),
        "tritonkit": lambda: lambda: tritonkit.rms_norm(x, n, w, EPS),
        "grouped": lambda: lambda: rms_norm_grouped(x, w),
    }
    reference = _reference(x, w)
    errors = {name: max_abs_error(make()(), reference) for name, make in calls.items() if name != "copy"}
    gigabytes = 2 * x.numel() * x.element_size() / 1e9
    ms = {}
    with untuned_calls():
        for name, make in calls.items():
            (_, median, _), _ = kernel_ms([make])
            ms[name] = median
    return {
        "shape": list(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "group": group_rows(n, dtype),
        "ms": ms,
        "gbps": {name: gigabytes / t * 1e3 for name, t in ms.items()},
        "share_of_copy": {name: ms["copy"] / t for name, t in ms.items()},
        "max_abs_err": errors,
    }


def main() -> None:
    if sys.argv[1:] == ["--check"]:
        for row in check():
            print(row)
        return
    from tritonkit.bench.runner import provenance

    rows = []
    for shape, dtype in SHAPES:
        rows.append(_row(shape, dtype))
        shares = "  ".join(f"{k} {v:.0%}" for k, v in rows[-1]["share_of_copy"].items() if k != "copy")
        print(
            f"{shape} {rows[-1]['dtype']}: copy {rows[-1]['gbps']['copy']:.0f} GB/s; of it {shares}",
            flush=True,
        )
    with open(sys.argv[1], "w") as f:
        json.dump({"command": COMMAND, "rows": rows, **provenance()}, f, indent=1)


if __name__ == "__main__":
    main()
