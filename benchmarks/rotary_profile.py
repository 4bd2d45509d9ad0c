"""One forward of tritonkit's RoPE and of torch.compile's (Hugging Face's formula), between
cudaProfilerStart and cudaProfilerStop, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --metrics METRICS --csv \
        python benchmarks/rotary_profile.py B,Hq,Hkv,S,D

Each is called five times first, outside the profile (compiles and tuning). ncu flushes the caches
before each kernel it profiles, as the benchmark tables do between repetitions.
"""

from __future__ import annotations

import sys

import torch

from tritonkit.ops import rotary


def main() -> None:
    shape = tuple(int(n) for n in sys.argv[1].split(","))
    q, k, cos, sin = rotary._make_inputs(shape, torch.bfloat16, "cuda", torch.Generator().manual_seed(0))
    compiled = torch.compile(rotary.rotary_pos_emb_reference)
    calls = (lambda: rotary.apply_rotary_pos_emb(q, k, cos, sin), lambda: compiled(q, k, cos, sin))
    for _ in range(5):
        for call in calls:
            call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
