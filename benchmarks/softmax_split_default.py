"""Softmax's untuned default on long rows: the split kernel against the online one and torch, fwd and
bwd, at the shapes where the untuned online kernel fell off (a row or a few hundred of 25K-12M
entries: the first `tritonkit bench --sweep` run on the H200), and at two tuned shapes.

    python benchmarks/softmax_split_default.py OUT.json

Every call runs untuned (``tritonkit.bench.sweep.untuned_calls``), as a first call does: "auto" is
the default's choice (``ops/softmax/configs._default``), "online" and "split" the named kernels at
their untuned configs. Times are CUDA-graph replays (``tritonkit.bench.timing.kernel_ms``, median);
GB/s from the bytes the op must move (fwd x and y, bwd y, dy and dx).
"""

from __future__ import annotations

import json
import sys

import torch

from tritonkit.bench.sweep import untuned_calls
from tritonkit.bench.timing import kernel_ms
from tritonkit.ops.softmax.configs import _default
from tritonkit.ops.softmax.softmax import _as_3d, _tuning_key, softmax_variant

SHAPES = [
    ((2, 12291808), torch.float16),
    ((32, 3738195), torch.bfloat16),
    ((100, 784772), torch.float32),
    ((17, 596536), torch.bfloat16),
    ((29, 192666), torch.float32),
    ((74, 187426), torch.bfloat16),
    ((227, 124588), torch.float16),
    ((516, 58896), torch.bfloat16),
    ((411, 25911), torch.float32),
    ((512, 524288), torch.float32),  # tuned: a split winner
    ((2048, 131072), torch.bfloat16),  # tuned: a split winner
]
VARIANTS = ("auto", "online", "split")
COMMAND = "python benchmarks/softmax_split_default.py OUT.json"


def _calls(shape, dtype, direction):
    """(provider, call maker) pairs: torch and each variant."""
    g = torch.Generator(device="cuda").manual_seed(shape[1])
    x = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    y = torch.softmax(x, -1)
    dy = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    dx = torch.empty_like(x)

    def torch_call():
        if direction == "fwd":
            return lambda: torch.softmax(x, -1)
        return lambda: torch._softmax_backward_data(dy, y, -1, dtype)

    def ours(variant):
        def make():
            if direction == "fwd":
                return lambda: softmax_variant(x, -1, variant=variant)
            return lambda: torch.ops.tritonkit.softmax_backward(dy, y, -1, False, variant, dx)

        return make

    return [("torch", torch_call)] + [(f"tritonkit[{v}]", ours(v)) for v in VARIANTS], x


def main() -> None:
    out = sys.argv[1]
    rows = []
    with untuned_calls():
        for shape, dtype in SHAPES:
            for direction in ("fwd", "bwd"):
                calls, x = _calls(shape, dtype, direction)
                views = (_as_3d(x, x.dim() - 1),) * (2 if direction == "fwd" else 3)
                key = _tuning_key(direction, views)
                moved = x.numel() * x.element_size() * (2 if direction == "fwd" else 3)
                row = {
                    "shape": list(shape),
                    "dtype": str(dtype).removeprefix("torch."),
                    "direction": direction,
                    "default": _default(key),
                    "ms": {},
                }
                # the default's output against torch's in fp32 (the test suite holds the oracle)
                if direction == "fwd":
                    error = softmax_variant(x, -1).float() - torch.softmax(x.float(), -1)
                    row["max_err_vs_torch_fp32"] = error.abs().max().item()
                    del error
                for name, make in calls:
                    try:
                        row["ms"][name] = kernel_ms([make])[0][1]
                    except Exception as error:  # a refused variant (a row too long for it) is a row
                        row["ms"][name] = None
                        row[f"{name}_error"] = str(error).splitlines()[0][:200]
                row["gbps"] = {n: moved / ms / 1e6 for n, ms in row["ms"].items() if ms}
                rows.append(row)
                rates = "  ".join(f"{n} {r:.0f}" for n, r in row["gbps"].items())
                print(f"{direction} {shape} {row['dtype']} GB/s: {rates}", flush=True)
                with open(out, "w") as f:
                    json.dump({"command": COMMAND, "rows": rows}, f, indent=1)
                del x, calls
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
