"""The decode-like backward's two matmuls, on tiles and launch forms the tuner does not offer yet,
timed the tuner's way (do_bench, L2 flushed between repetitions), against the shipped winners,
cuBLAS and the bandwidth floor of each:

- dW = dz^T x of M = 16 and 128 rows (out 16384 x 4096, 128 MB written; K of the matmul is M):
  shallow steps (16-128 deep, where the shipped tiles take 64-deep boxes of a 16-deep K), 1-3
  stages, pointers or TMA, one program a tile or a persistent grid of 1-2 programs an SM; and a
  kernel of this file's own that stores C through a tensor descriptor (TMA store) instead of the
  library's st.global epilogue. Floor: a 128 MB fill.
- dx = dz W of M = 16 and 128 rows (K = 16384, out M x 4096; reads W, 128 MB): split K in 2-8
  shares of 64-128-deep steps, and 16-row tiles split. Floor: a read of W.

Each config's output is poisoned (NaN), computed once and compared with the float64 product
before it is timed.

    PYTHONPATH=src python benchmarks/prototypes/decode_backward.py OUT.json
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
import time

import torch

from tritonkit import tuning
from tritonkit._launch import Launcher, ensure_allocator, precompile
from tritonkit.ops import linear_kernels as lk
from tritonkit.testing import compare

triton, tl = lk.triton, lk.tl  # imported after tritonkit chose the GPU or the interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter, a smoke test
IN_FEATURES, OUT_FEATURES = (4096, 16384) if DEVICE == "cuda" else (64, 96)
ROWS = (16, 128) if DEVICE == "cuda" else (5,)


@triton.jit
def _dw_tma_store_kernel(dz_ptr, x_ptr, dw_ptr, M, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    """dW (N, K) = dz^T x over dz (M, N) and x (M, K), both row-major: a persistent grid walks
    dW's tiles in grouped order; each tile loads its dz and x boxes through descriptors, reduces
    over M and stores through a descriptor (the copy engine writes the tile from shared memory)."""
    dz_desc = tl.make_tensor_descriptor(dz_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    dw_desc = tl.make_tensor_descriptor(dw_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    tiles_n, tiles_k = tl.cdiv(N, BLOCK_N), tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles_n * tiles_k, tl.num_programs(0), flatten=True):
        first_n = tile // (GROUP * tiles_k) * GROUP
        rows_in_group = tl.minimum(tiles_n - first_n, GROUP)
        pid_n = first_n + tile % rows_in_group
        pid_k = tile % (GROUP * tiles_k) // rows_in_group
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for m in range(0, M, BLOCK_M):
            a = dz_desc.load([m, pid_n * BLOCK_N])
            b = x_desc.load([m, pid_k * BLOCK_K])
            acc = tl.dot(tl.trans(a), b, acc)
        dw_desc.store([pid_n * BLOCK_N, pid_k * BLOCK_K], acc.to(dw_desc.dtype))


_dw_tma_store = Launcher(_dw_tma_store_kernel)


def dw_tma_store_args(dz, x, dw, config):
    (m, n), k = dz.shape, x.shape[1]
    tiles = triton.cdiv(n, config["BLOCK_N"]) * triton.cdiv(k, config["BLOCK_K"])
    sms = torch.cuda.get_device_properties(dz.device).multi_processor_count
    programs = min(tiles, config["per_sm"] * sms)
    meta = {name: config[name] for name in ("BLOCK_N", "BLOCK_K", "BLOCK_M")}
    return (programs,), (dz, x, dw, m, n, k), {**meta, "GROUP": 8, "num_warps": config["num_warps"],
                                               "num_stages": config["num_stages"]}


def tile(bm, bn, bk, stages, warps, **extra):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps,
            "num_stages": stages, **extra}


def fits(config):
    values = config["BLOCK_M"] * config["BLOCK_N"] / (32 * config["num_warps"])
    shared = config["num_stages"] * config["BLOCK_K"] * (config["BLOCK_M"] + config["BLOCK_N"]) * 2
    return values <= lk.MAX_ACC_VALUES and shared <= lk.SHARED_BYTES


# the tuner's winners at c6648ce (benchmarks/results/h200 ran on them), timed first
SHIPPED_DW = {16: tile(128, 256, 64, 3, 8, TMA=True, PERSISTENT=1),
              128: tile(128, 256, 64, 4, 8, TMA=True, PERSISTENT=1)}
SHIPPED_DX = {16: tile(16, 32, 256, 6, 4), 128: tile(64, 128, 64, 3, 4, SPLIT_K=4)}


def dw_configs(m):
    """The library kernel's tiles for dW (its M is out_features, its K the rows)."""
    depths = (16,) if m <= 16 else (32, 64, 128)
    tiles = ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 4), (128, 128, 8), (64, 256, 4),
             (128, 256, 8))
    forms = ({}, {"TMA": True}, {"TMA": True, "PERSISTENT": 1}, {"TMA": True, "PERSISTENT": 2},
             {"PERSISTENT": 2})
    found = [tile(bm, bn, bk, stages, warps, **form) for (bm, bn, warps), bk, stages, form
             in itertools.product(tiles, depths, (1, 3), forms)
             if not (warps == 8 and form.get("PERSISTENT") == 2)]
    return [SHIPPED_DW.get(m, SHIPPED_DW[16])] + [c for c in found if fits(c)]


def dw_store_configs(m):
    depth = 16 if m <= 16 else 64
    return [{"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_M": depth, "num_warps": warps, "num_stages": stages,
             "per_sm": per_sm}
            for bn, bk, warps in ((128, 128, 4), (128, 256, 8), (128, 128, 8), (64, 256, 4), (256, 128, 8))
            for stages in (2, 3) for per_sm in (1, 2) if not (warps == 8 and per_sm == 2)]


def dx_configs(m):
    rows = (16, 64) if m <= 16 else (64, 128)
    found = [tile(bm, bn, bk, stages, 4, **({"SPLIT_K": split} if split > 1 else {}), **tma)
             for bm in rows for bn in (32, 64, 128) for bk in (64, 128, 256) for stages in (4, 6)
             for split in ((1, 2, 4, 8) if m <= 16 else (1, 2, 3, 4, 8)) for tma in ({}, {"TMA": True})
             if (bm, bn) != (128, 128) and not (tma and bm < 64)]
    found = [c for c in found if fits(c) and c["BLOCK_N"] * c["BLOCK_K"] <= 128 * 256]
    return [SHIPPED_DX.get(m, SHIPPED_DX[16])] + found


def run_configs(label, configs, launch_args, launcher, call, exact, out, torch_value):
    """Compile every config at once, then check (the oracle: within twice torch's error against
    float64) and time each; returns rows."""
    configs = configs if DEVICE == "cuda" else configs[:2]  # the interpreter: a smoke test
    calls = []
    for config in configs:
        with contextlib.suppress(ValueError):  # a config the launcher refuses: its launch says why
            calls.append((launcher, *launch_args(config)))
    precompile(calls)
    rows = []
    for config in configs:
        out.fill_(float("nan"))
        try:
            call(config)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - a tile the compiler refuses: say so, go on
            rows.append({"config": config, "error": repr(error)[:300]})
            continue
        checked = compare("output", out, torch_value, exact, out.dtype)  # NaN left in out fails
        ms = time_ms(lambda config=config: call(config)) if checked.passed else None
        rows.append({"config": config, "ms": ms, "max_err": checked.err_kernel,
                     "check": "pass" if checked.passed else "FAIL"})
    print(label, len(rows), "configs", flush=True)
    return rows


def time_ms(call):
    return tuning.median_ms(call) if DEVICE == "cuda" else None


def dw_rows(m):
    g = torch.Generator(device=DEVICE).manual_seed(m)
    dz = torch.randn(m, OUT_FEATURES, device=DEVICE, dtype=torch.bfloat16, generator=g)
    x = torch.randn(m, IN_FEATURES, device=DEVICE, dtype=torch.bfloat16, generator=g)
    dw = torch.empty(OUT_FEATURES, IN_FEATURES, device=DEVICE, dtype=torch.bfloat16)
    exact = dz.double().t() @ x.double()
    torch_value = torch.mm(dz.t(), x)
    row = {"form": "dw", "rows": m, "shape": [OUT_FEATURES, m, IN_FEATURES], "bytes written": dw.numel() * 2,
           "cublas ms": time_ms(lambda: torch.mm(dz.t(), x, out=dw)),
           "fill ms": time_ms(lambda: dw.fill_(1.0))}
    a, b = dz.t(), x.t()
    row["library"] = run_configs(f"dw {m} library", dw_configs(m),
                                 lambda c: lk._matmul_args(a, b, dw, config=dict(c)), lk._launcher,
                                 lambda c: lk._launch(a, b, dw, dict(c), {}), exact, dw, torch_value)
    if DEVICE == "cuda":  # the descriptor store: the GPU only

        def store(config):
            grid, args, meta = dw_tma_store_args(dz, x, dw, config)
            _dw_tma_store(grid, *args, **meta)

        ensure_allocator()
        row["tma store"] = run_configs(f"dw {m} tma store", dw_store_configs(m),
                                       lambda c: dw_tma_store_args(dz, x, dw, c), _dw_tma_store, store,
                                       exact, dw, torch_value)
    return row


def dx_rows(m):
    g = torch.Generator(device=DEVICE).manual_seed(m + 1)
    dz = torch.randn(m, OUT_FEATURES, device=DEVICE, dtype=torch.bfloat16, generator=g)
    w = torch.randn(OUT_FEATURES, IN_FEATURES, device=DEVICE, dtype=torch.bfloat16, generator=g)
    dx = torch.empty(m, IN_FEATURES, device=DEVICE, dtype=torch.bfloat16)
    exact = dz.double() @ w.double()
    torch_value = torch.mm(dz, w)
    row = {"form": "dx", "rows": m, "shape": [m, OUT_FEATURES, IN_FEATURES], "bytes read": w.numel() * 2,
           "cublas ms": time_ms(lambda: torch.mm(dz, w, out=dx)),
           "read W ms": time_ms(lambda: w.sum(dtype=torch.float32))}
    b = w.t()
    row["library"] = run_configs(f"dx {m} library", dx_configs(m),
                                 lambda c: lk._matmul_args(dz, b, dx, config=dict(c)), lk._launcher,
                                 lambda c: lk._launch(dz, b, dx, dict(c), {}), exact, dx, torch_value)
    return row


def summary(row):
    timed = [(r["ms"], r["config"]) for key in ("library", "tma store") for r in row.get(key, [])
             if r.get("ms") is not None]
    if timed:
        ms, config = min(timed, key=lambda t: t[0])
        baseline = {k: round(v * 1e3, 1) for k, v in row.items() if k.endswith(" ms") and v is not None}
        print(row["form"], row["rows"], f"best {ms * 1e3:.1f} us {config}", baseline, flush=True)


def main():
    start, rows = time.time(), []
    for m in ROWS:
        for make in (dw_rows, dx_rows):
            rows.append(make(m))
            summary(rows[-1])
            with open(sys.argv[1], "w") as f:
                gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
                json.dump({"gpu": gpu, "seconds": time.time() - start, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
