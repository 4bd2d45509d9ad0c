"""The exact GELU's forms in fp32 arithmetic against float64, on the CPU: how many of 4M inputs in
[-14, 14] each form rounds away from the correctly rounded bf16 and fp16 value, and its largest
relative error above z = -5. ``jit.normal_cdf``'s form (Numerical Recipes' erfcc, divisions exact
here: on the GPU rsqrt and exp2 add a few fp32 ulps) beside fp32 ``0.5 z (1 + erf(z / sqrt 2))``,
torch's (and libdevice's) form, which cancels to -0 below about z = -5.5.

    python benchmarks/gelu_accuracy.py OUT.json
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import torch

from tritonkit.bench.runner import provenance
from tritonkit.jit import ERFC_P

POINTS, LOW, HIGH = 4_000_001, -14.0, 14.0


def _lower_tail_form(z: np.ndarray) -> np.ndarray:
    """z Phi(z) in fp32 as jit.normal_cdf computes it (P in base 2, the 1/2 folded in)."""
    f = np.float32
    log2e = math.log2(math.e)
    q = [f(log2e * c - (1.0 if k == 0 else 0.0)) for k, c in enumerate(ERFC_P)]
    t = f(1) / (f(1) + np.abs(z) * f(0.5 / math.sqrt(2)))
    p = q[-1]
    for c in reversed(q[:-1]):
        p = c + t * p
    h = t * np.exp2(p + z * (z * f(-0.5 * log2e)))
    return z * np.where(z > 0, f(1) - h, h)


def main() -> None:
    z32 = torch.linspace(LOW, HIGH, POINTS, dtype=torch.float32)
    exact = z32.double() * 0.5 * torch.erfc(-z32.double() / math.sqrt(2))
    forms = {
        "lower tail (jit.normal_cdf)": torch.from_numpy(_lower_tail_form(z32.numpy())),
        "0.5 z (1 + erf) in fp32 (torch)": torch.nn.functional.gelu(z32),
    }
    rows = []
    for name, value in forms.items():
        value = value.double()
        relative = (value - exact).abs() / exact.abs().clamp_min(1e-300)
        row = {"form": name, "relative_error_above_-5": relative[z32 > -5].max().item()}
        for dtype in (torch.bfloat16, torch.float16):
            row[f"off_{dtype}".replace("torch.", "")] = int((value.to(dtype) != exact.to(dtype)).sum())
        rows.append(row)
        print(row)
    with open(sys.argv[1], "w") as out:
        result = {"command": "python benchmarks/gelu_accuracy.py OUT.json", "points": POINTS, "rows": rows}
        json.dump(result | provenance(), out, indent=1)


if __name__ == "__main__":
    main()
