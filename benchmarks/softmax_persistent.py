"""Softmax's one-pass kernel, untuned as a first call runs it, against itself with each of its two
switches flipped: ``STAGES`` (persistent programs, the next row block copied to shared memory while
this one is reduced) and windows (rows that start off their vectors' alignment read as 16-byte
vectors from each row's rounded-down offset, ``softmax.WINDOWS``); and the split kernel's default
against it with PREFETCH flipped (pass 1 with two chunks in flight); and at tiny shapes the
one-pass default against its rows spread over every SM; forward and backward, beside torch and a
copy of as many bytes.

    python benchmarks/softmax_persistent.py OUT.json

Shapes: the first sweep's one-pass rows that moved at 34-57% of the copy (rows of 76-26350
entries), odd lengths (every row on another alignment), and tuned table shapes of 1024-32768
entries. Each call is captured in a CUDA graph and the replays take turns
(``timing.interleaved_ms``); "spread" is the range of a call's turns over its median. GB/s from the
bytes the op must move (fwd x and y, bwd y, dy and dx); "of_copy" against ``torch.neg`` into
another buffer of as many bytes, replayed in the same turns.
"""

from __future__ import annotations

import json
import sys

import torch

import tritonkit.ops.softmax.softmax as sm
from tritonkit.bench.sweep import untuned_calls
from tritonkit.bench.timing import capture, interleaved_ms
from tritonkit.ops.softmax.configs import _default

SHAPES = [
    ((17944, 9018), torch.bfloat16),  # 50% of copy in the first sweep
    ((5814, 26350), torch.float16),  # 52%
    ((21061, 2900), torch.bfloat16),  # 54%
    ((162064, 76), torch.bfloat16),  # 34%
    ((17944, 9017), torch.bfloat16),  # odd lengths: a window's head on every row
    ((21061, 2901), torch.bfloat16),
    ((63687, 195), torch.float32),  # 79% in the first sweep
    ((8192, 32768), torch.bfloat16),  # tuned: online won, one-pass 7% behind
    ((16384, 16384), torch.bfloat16),
    ((32768, 4096), torch.bfloat16),  # tuned: one-pass at 95% of copy
    ((65536, 1024), torch.bfloat16),
    ((32, 3738195), torch.bfloat16),  # split rows: 38% of copy in the first sweep
    ((21, 800692), torch.bfloat16),  # 39-42%
    ((100, 784772), torch.float32),  # 55-67%
    ((2, 12291808), torch.float16),  # 50-53%
    ((56, 23), torch.float32),  # tiny rows, 0.73-0.90x the best peer in the first sweep
    ((340, 74), torch.bfloat16),
    ((498, 4), torch.float16),
    ((1385, 50), torch.float32),
    ((883, 151), torch.float16),
    ((227, 472), torch.float32),
]
SMS = 132  # the H200's: where a default's programs are fewer, "spread" puts a row block on each
COMMAND = "python benchmarks/softmax_persistent.py OUT.json"


def _tensors(shape, dtype, direction) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(shape[1])
    x = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    if direction == "fwd":
        return x, torch.empty_like(x)
    dy = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    return torch.softmax(x, -1), dy, torch.empty_like(x)


def _flipped(config: dict, switch: str, on) -> dict:
    return {k: v for k, v in config.items() if k != switch} | ({} if config.get(switch) else {switch: on})


def _spread(config: dict, rows: int) -> dict | None:
    """The one-pass config with BLOCK_M cut to the largest power of two that still gives every SM a
    row block, where the default's programs are fewer than the SMs: the question for latency-bound
    shapes (the first sweep's tiny rows trailed the peers by 1-2 us). None where it does not apply."""
    if -(-rows // config["BLOCK_M"]) >= SMS or config["BLOCK_M"] == 1:
        return None
    return {**config, "BLOCK_M": 1 << max(0, (rows // SMS).bit_length() - 1)}


def _variants(default: dict, windowed: bool, rows: int) -> dict:
    """name -> (config, windows on): the default and each switch flipped (windows only where taken;
    a split default's switch is PREFETCH; rows spread over the SMs where the default's are not)."""
    if default["variant"] == "split":
        return {"default": (default, True), "PREFETCH flipped": (_flipped(default, "PREFETCH", True), True)}
    variants = {"default": (default, True), "STAGES flipped": (_flipped(default, "STAGES", 2), True)}
    if windowed:
        variants["no window"] = (default, False)
    spread = _spread(default, rows)
    if spread is not None:
        variants["spread"] = (spread, True)
    return variants


def _launcher(direction: str, config: dict, windows: bool, tensors: tuple):
    views = tuple(sm._as_3d(t, 1) for t in tensors)
    geometry = sm._geometry(views)

    def call():
        sm.WINDOWS = windows
        try:
            sm._launch(direction, config, False, views, geometry)
        finally:
            sm.WINDOWS = True

    return call


def _row(shape, dtype, direction) -> dict:
    tensors = _tensors(shape, dtype, direction)
    views = tuple(sm._as_3d(t, 1) for t in tensors)
    default = _default(sm._tuning_key(direction, views))
    if default["variant"] not in ("one-pass", "split"):
        raise ValueError(f"{shape} {direction}: the default is {default}, neither one-pass nor split")
    window = sm._launch_args(direction, default, False, views, sm._geometry(views))[2].get("WINDOW", 0)
    variants = _variants(default, bool(window), tensors[0].shape[0])
    out = tensors[-1]
    if direction == "fwd":
        expected = torch.softmax(tensors[0], -1).float()
    else:
        expected = torch._softmax_backward_data(tensors[1], tensors[0], -1, dtype).float()
    calls, errors = {}, {}
    for name, (config, windows) in variants.items():
        run = _launcher(direction, config, windows, tensors)
        out.fill_(float("nan"))
        run()
        errors[name] = (out.float() - expected).abs().max().item()  # against torch (tests hold the oracle)
        calls[name] = capture(lambda run=run: run)[0]
    moved = sum(t.numel() * t.element_size() for t in tensors)
    source = torch.empty(moved // 8, dtype=torch.float32, device="cuda")  # read moved / 2, write as much
    target = torch.empty_like(source)
    torch_call = (
        (lambda: torch.softmax(tensors[0], -1))
        if direction == "fwd"
        else (lambda: torch._softmax_backward_data(tensors[1], tensors[0], -1, dtype))
    )
    calls["torch"] = capture(lambda: torch_call)[0]
    calls["copy"] = capture(lambda: lambda: torch.neg(source, out=target))[0]
    ms, spread = interleaved_ms(calls)
    return {
        "shape": list(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "direction": direction,
        "variants": {name: {"config": c, "windows": w} for name, (c, w) in variants.items()},
        "window": window,
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
