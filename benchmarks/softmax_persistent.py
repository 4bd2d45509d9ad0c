"""Softmax's one-pass kernel with a row block a program against the same config persistent
(``STAGES`` 2: the next block copied to shared memory while this one is reduced), forward and
backward, untuned configs as a first call runs them, beside torch and a copy of as many bytes.

    python benchmarks/softmax_persistent.py OUT.json

Shapes: the first sweep's one-pass rows that moved at 50-57% of the copy (rows of 2900-26350
entries), tuned table shapes of 4096-32768 entries, and short rows. The calls take turns
(``timing.interleaved_ms``); "spread" is the range of a call's turns over its median. GB/s from
the bytes the op must move (fwd x and y, bwd y, dy and dx); "of copy" against ``torch.neg`` into
another buffer of as many bytes, timed in the same turns.
"""

from __future__ import annotations

import json
import sys

import torch

import tritonkit.ops.softmax.softmax as sm
from tritonkit.bench.sweep import untuned_calls
from tritonkit.bench.timing import interleaved_ms
from tritonkit.ops.softmax.kernels import _default

SHAPES = [
    ((17944, 9018), torch.bfloat16),  # 50% of copy in the first sweep
    ((5814, 26350), torch.float16),  # 52%
    ((21061, 2900), torch.bfloat16),  # 54%
    ((8192, 32768), torch.bfloat16),  # tuned: online won, one-pass 7% behind
    ((16384, 16384), torch.bfloat16),
    ((4096, 16384), torch.float32),
    ((32768, 4096), torch.bfloat16),  # tuned: one-pass at 95% of copy
    ((65536, 1024), torch.bfloat16),
    ((162064, 76), torch.bfloat16),  # 34% of copy in the first sweep
]
COMMAND = "python benchmarks/softmax_persistent.py OUT.json"


def _row(shape, dtype, direction) -> dict:
    g = torch.Generator(device="cuda").manual_seed(shape[1])
    x = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    tensors = (x, torch.empty_like(x))
    if direction == "bwd":
        tensors = (
            torch.softmax(x, -1),
            torch.randn(shape, device="cuda", dtype=dtype, generator=g),
            tensors[1],
        )
    views = tuple(sm._as_3d(t, 1) for t in tensors)
    geometry = sm._geometry(views)
    default = _default(sm._tuning_key(direction, views))
    if default["variant"] != "one-pass":
        raise ValueError(f"{shape} {direction}: the default is {default}, not the one-pass kernel")
    plain = {k: v for k, v in default.items() if k != "STAGES"}
    configs = {"one-pass": plain, "persistent": {**plain, "STAGES": 2}}
    moved = x.numel() * x.element_size() * len(tensors)
    copy_src = torch.empty(moved // 8, dtype=torch.float32, device="cuda")  # read moved / 2, write as much
    copy_dst = torch.empty_like(copy_src)
    calls = {
        name: (lambda c=config: sm._launch(direction, c, False, views, geometry))
        for name, config in configs.items()
    }
    calls["torch"] = (
        (lambda: torch.softmax(x, -1))
        if direction == "fwd"
        else (lambda: torch._softmax_backward_data(tensors[1], tensors[0], -1, dtype))
    )
    calls["copy"] = lambda: torch.neg(copy_src, out=copy_dst)
    errors = {}
    for name in configs:  # each kernel's output against torch's, in fp32 (the tests hold the oracle)
        views[-1].fill_(float("nan"))
        calls[name]()
        expected = calls["torch"]().float()
        errors[name] = (tensors[-1].float() - expected).abs().max().item()
    ms, spread = interleaved_ms(calls)
    return {
        "shape": list(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "direction": direction,
        "default": default,
        "max_err_vs_torch": errors,
        "ms": ms,
        "spread": spread,
        "gbps": {name: moved / t / 1e6 for name, t in ms.items()},
        "of_copy": {name: ms["copy"] / t for name, t in ms.items()},
    }


def main() -> None:
    out, rows = sys.argv[1], []
    with untuned_calls():
        for shape, dtype in SHAPES:
            for direction in ("fwd", "bwd"):
                try:
                    row = _row(shape, dtype, direction)
                except ValueError as error:  # a default past the one-pass kernel: said, not timed
                    print(error, flush=True)
                    continue
                rows.append(row)
                shares = "  ".join(f"{n} {r:.2f}" for n, r in row["of_copy"].items() if n != "copy")
                print(f"{direction} {shape} {row['dtype']} of copy: {shares}", flush=True)
                with open(out, "w") as f:
                    json.dump({"command": COMMAND, "rows": rows}, f, indent=1)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
