"""Decode-like linear tiles: the shipped kernel on tiles the tuner does not offer yet (16 and 32
rows, mma.sync; 128 and 256 deep; more stages), against the shipped winners and cuBLAS, at
M = 16 and 128, K = 4096, N = 16384 (forward: bare, and bias + gelu_tanh) and the dx form
(M rows, K = 16384, N = 4096). CUDA-graph replays, median; each result checked against float64.
Also the time to read W once (a sum over it) as the bandwidth such a matmul can reach.

Unlike the benchmark and the tuner (triton's do_bench, which writes 256 MB between repetitions),
the replays here do not flush L2, so part of W's 128 MB is still there from the previous call: its
times ran 13-33% below the tuner's for the same tiles (at 71895ba,
benchmarks/results/h200/history/decode-tiles-71895ba.json), and its ranking overstated the deep
64-row TMA tiles. The tiles it found were added to the tuner, which chose among them with L2 flushed.

    PYTHONPATH=src python benchmarks/prototypes/decode_tiles.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch
from triton.testing import do_bench_cudagraph

from tritonkit.ops import linear_kernels as lk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter, a smoke test
SHAPES = [("fwd", 16, 4096, 16384), ("fwd", 128, 4096, 16384),
          ("dx", 16, 16384, 4096), ("dx", 128, 16384, 4096)]


def tile(bm, bn, bk, stages, warps=4, **extra):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps,
            "num_stages": stages, **extra}


def candidates(m):
    shipped = [tile(64, 64, 64, 4), tile(64, 128, 64, 4, 8), tile(128, 64, 64, 4, 8),
               tile(64, 64, 64, 3)]
    small = [tile(bm, bn, bk, stages) for bm in ((16, 32) if m <= 16 else (32, 64))
             for bn, bk, stages in ((64, 128, 6), (64, 128, 8), (64, 256, 4), (128, 128, 4), (128, 128, 5),
                                    (32, 256, 6), (64, 64, 8))]
    rows = 16 if m <= 16 else 64
    tma = [tile(rows, 64, 128, 6, TMA=True), tile(rows, 128, 128, 4, TMA=True)]
    return shipped + small + tma


def fits(config):
    rows = config["BLOCK_M"] + config["BLOCK_N"]
    return config["num_stages"] * config["BLOCK_K"] * rows * 2 <= lk.SHARED_BYTES


def problem(form, m, k, n):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16, generator=g) / k ** 0.5
    if form == "dx":  # dx = dz W: A = dz (M, N_out), B = W^T viewed (K_in, N_out) -> here w is (n, k)
        w = torch.randn(k, n, device=DEVICE, dtype=torch.bfloat16, generator=g).t() / k ** 0.5  # n-major B
    b = torch.randn(n, device=DEVICE, dtype=torch.bfloat16, generator=g)
    return x, w, b


def time_one(x, w, operands, config):
    out = torch.empty(x.shape[0], w.shape[0], device=DEVICE, dtype=torch.bfloat16)
    out.fill_(float("nan"))
    lk._launch(x, w, out, config, operands)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    upcast = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in operands.items()}
    exact = lk._matmul_reference(x.double(), w.double(), **upcast)
    err = (out.double() - exact).abs().max().item()
    ms = do_bench_cudagraph(lambda: lk._launch(x, w, out, config, operands), rep=200, return_mode="median")
    return ms, err


def main():
    rows = []
    for form, m, k, n in SHAPES:
        x, w, b = problem(form, m, k, n)
        read_w = do_bench_cudagraph(lambda w=w: w.sum(dtype=torch.float32), rep=200, return_mode="median")
        cublas = do_bench_cudagraph(lambda x=x, w=w: x @ w.T, rep=200, return_mode="median")
        epilogues = {"bare": {}}
        if form == "fwd":
            epilogues["bias gelu_tanh"] = {"bias": b, "activation": lk.ACTIVATIONS["gelu_tanh"]}
            def fused_gelu(b=b, x=x, w=w):
                return torch._addmm_activation(b, x, w.T, use_gelu=True)
            addmm = do_bench_cudagraph(fused_gelu, rep=200, return_mode="median")
        for label, operands in epilogues.items():
            row = {"form": form, "shape": [m, k, n], "epilogue": label, "cublas bare ms": cublas,
                   "read W once ms": read_w, "W bytes": w.numel() * 2, "configs": []}
            if label != "bare":
                row["addmm gelu ms"] = addmm
            splits = ([tile(64, bn, 64, 3, SPLIT_K=s) for bn in (64, 128) for s in (2, 4, 8)]
                      if label == "bare" else [])
            for config in candidates(m) + splits:
                if not fits(config):
                    continue
                try:
                    ms, err = time_one(x, w, operands, dict(config))
                except Exception as error:  # a tile the compiler refuses: say so, go on
                    row["configs"].append({"config": config, "error": repr(error)[:300]})
                    continue
                row["configs"].append({"config": config, "ms": ms, "max_err": err})
            best = min((c for c in row["configs"] if "ms" in c), key=lambda c: c["ms"])
            print(form, m, k, n, label, f"cublas {cublas * 1e3:.1f} us, read W {read_w * 1e3:.1f} us, "
                  f"best {best['ms'] * 1e3:.1f} us {best['config']}", flush=True)
            rows.append(row)
            with open(sys.argv[1], "w") as f:
                gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
                json.dump({"gpu": gpu, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
