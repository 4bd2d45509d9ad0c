"""Three experiments on one H200, run at 8398f24 (results in
benchmarks/results/h200/history/row-length-and-power-8398f24.json and power-8398f24.csv; the
measurements behind "A row length known when compiling" and "The GELU epilogue's fast form,
measured" in docs/perf-notes.md):

    PYTHONPATH=src python benchmarks/prototypes/row_length_and_power.py OUT_DIR

1. rms_norm's looped forward on rows that fit, at torch.compile's launch and others: N a run-time
   value (the kernel as it was at 8398f24), N a constexpr, and N a constexpr with an int32 row
   index, against torch.compile and tritonkit.rms_norm (CUDA-graph replays, median). The variants
   are made by editing the kernel's source text as it was at 8398f24 (from f491da9 the kernel takes
   the row length as a constexpr itself, ROW_LENGTH, and the script refuses to run).
2. The linear forward's epilogue by parts (bare, + bias, + relu, + gelu_tanh, + gelu) against
   cuBLAS and cuBLASLt's fused GELU, in 25 ms bursts (do_bench) and in CUDA-graph replays.
3. 3000 back-to-back calls of the GELU forward and of cuBLAS at 8192x4096x16384: each call's time,
   and nvidia-smi's SM clock, power and clock-event reasons every 100 ms (OUT_DIR/smi.csv).
The run at 8398f24 used an earlier layout of this script with the same measurements.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench, do_bench_cudagraph

import tritonkit
from tritonkit.ops import norm_kernels

RUNTIME_N = "    N,  # row length\n"
CONSTEXPR_N = "    N: tl.constexpr,  # row length\n"
ROW_LOOP = ("    for program_row in range(tl.program_id(0), M, tl.num_programs(0)):\n"
            "        _norm_fwd_looped_row(x_ptr, r_ptr, h_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr,\n"
            "                             tl.cast(program_row, tl.int64)")
ONE_ROW = ("    if True:\n"
           "        _norm_fwd_looped_row(x_ptr, r_ptr, h_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr,\n"
           "                             tl.program_id(0)")
NORM_SHAPES = ((16384, 8192), (32768, 4096), (65536, 1024))  # bf16 rows
LINEAR_SHAPES = ((8192, 4096, 16384), (4096, 4096, 4096))  # (M, K, N), bf16
NORM_LAUNCHES = ((2048, 16), (1024, 8), (2048, 8), (4096, 16))  # (chunk, warps); 2048 x 16: torch.compile's


def graph_ms(fn) -> float:
    return do_bench_cudagraph(fn, rep=200, return_mode="median")


def _variant(name: str, text: str, scratch: Path):
    """The looped forward kernel of ``text``, loaded as module ``name``."""
    path = scratch / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._norm_fwd_looped_kernel


def norm_kernels_variants(scratch: Path) -> dict:
    source = Path(norm_kernels.__file__).read_text()
    constexpr = source.replace(RUNTIME_N, CONSTEXPR_N, 1)
    one_row = constexpr.replace(ROW_LOOP, ONE_ROW, 1)
    if "ROW_LENGTH" in source or constexpr == source or one_row == constexpr:
        raise SystemExit("the looped forward is not 8398f24's: the variants do not apply")
    return {"runtime N": norm_kernels._norm_fwd_looped_kernel,
            "constexpr N": _variant("looped_constexpr_n", constexpr, scratch),
            "constexpr N, int32 row": _variant("looped_constexpr_n_int32", one_row, scratch)}


def time_norm_shape(m: int, n: int, kernels: dict) -> dict:
    rms_norm = torch.nn.functional.rms_norm
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y, rstd = torch.empty_like(x), torch.empty(m, device="cuda", dtype=torch.float32)
    reference = rms_norm(x.float(), (n,), w.float(), 1e-6)
    compiled = torch.compile(lambda x, w: rms_norm(x, (n,), w, 1e-6))
    row = {"shape": [m, n], "bytes": 2 * x.numel() * 2,
           "torch.compile": graph_ms(lambda: compiled(x, w)),
           "tritonkit": graph_ms(lambda: tritonkit.rms_norm(x, (n,), w, 1e-6))}
    launches = [(chunk, warps, evict) for chunk, warps in NORM_LAUNCHES if chunk <= n
                for evict in (False, True)]
    for (chunk, warps, evict), (label, kernel) in itertools.product(launches, kernels.items()):
        meta = {"RMS": True, "HAS_RESIDUAL": False, "HAS_WEIGHT": True, "HAS_BIAS": False,
                "STREAM": "evict_first" if evict else "", "KEEP": "evict_last" if evict else "",
                "BLOCK_N": chunk, "num_warps": warps}
        args = (x, x, y, y, w, w, rstd, rstd, m, n, x.stride(0), x.stride(0), 1e-6)

        def call(kernel=kernel, args=args, meta=meta):
            kernel[(m,)](*args, **meta)

        y.fill_(float("nan"))
        call()
        torch.cuda.synchronize()
        row[f"err {label} {chunk}x{warps}{evict}"] = (y.float() - reference).abs().max().item()
        row[f"{label} {chunk}x{warps}w{' evict' if evict else ''}"] = graph_ms(call)
    print(json.dumps(row), flush=True)
    return row


def time_linear_shape(m: int, k: int, n: int) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    calls = {"bare": lambda: tritonkit.linear(x, w),
             "bias": lambda: tritonkit.linear(x, w, b),
             "bias relu": lambda: tritonkit.linear(x, w, b, "relu"),
             "bias gelu_tanh": lambda: tritonkit.linear(x, w, b, "gelu_tanh"),
             "bias gelu": lambda: tritonkit.linear(x, w, b, "gelu"),
             "cublas bare": lambda: x @ w.T,
             "addmm gelu": lambda: torch._addmm_activation(b, x, w.T, use_gelu=True)}
    row = {"shape": [m, k, n]}
    for label, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        row[label + " short"] = do_bench(fn, warmup=5, rep=25, return_mode="median")
        row[label + " graph"] = graph_ms(fn)
    print(json.dumps(row), flush=True)
    return row


def _smi_reason_field() -> str:
    probe = ["nvidia-smi", "--query-gpu=clocks_event_reasons.active", "--format=csv"]
    ok = subprocess.run(probe, capture_output=True).returncode == 0
    return "clocks_event_reasons.active" if ok else "clocks_throttle_reasons.active"


def time_sustained(out_dir: Path) -> list[dict]:
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16) / 64
    b = torch.randn(16384, device="cuda", dtype=torch.bfloat16)
    fields = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,power.limit," + _smi_reason_field()
    with open(out_dir / "smi.csv", "w") as log:
        command = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader", "-lms", "100"]
        smi = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        time.sleep(1.5)
        runs = []
        for label, fn in (("tritonkit gelu_tanh", lambda: tritonkit.linear(x, w, b, "gelu_tanh")),
                          ("cublas bare", lambda: x @ w.T)):
            time.sleep(3)  # idle first: the clocks recover
            start = time.time()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(3000)]
            for begin, end in events:
                begin.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            ms = [begin.elapsed_time(end) for begin, end in events]
            runs.append({"label": label, "start_unix": start, "ms_first20": ms[:20],
                         "ms_by_100": [sorted(ms[i:i + 100])[50] for i in range(0, 3000, 100)]})
            print(label, [round(v, 3) for v in runs[-1]["ms_by_100"]], flush=True)
        time.sleep(1)
        smi.terminate()
    return runs


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    kernels = norm_kernels_variants(out_dir)
    results = {"norm": [time_norm_shape(m, n, kernels) for m, n in NORM_SHAPES],
               "linear_parts": [time_linear_shape(m, k, n) for m, k, n in LINEAR_SHAPES]}
    results["sustained"] = time_sustained(out_dir)
    (out_dir / "exp.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
