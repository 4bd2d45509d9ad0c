"""The dtypes kernels take, and their short names (in tuning keys, benchmark rows and CLI flags)."""

from __future__ import annotations

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)  # what the memory-bound families take
HALVES = (torch.float16, torch.bfloat16)  # what the tensor-core families take
NAME_OF = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}  # dtype -> short name
DTYPE_OF = {name: dtype for dtype, name in NAME_OF.items()}  # short name -> dtype
