"""A first look at the sm_90 Gluon backward on the H200: one call per mode on a small GQA causal
problem, errors against cuDNN's gradients printed (no oracle; the tests have it).

    python benchmarks/smoke_attention_bwd_sm90.py [deterministic]
"""

import sys

import torch

from tritonkit.ops.attention import bwd, fwd
from tritonkit.ops.attention.common import Scores

deterministic = "deterministic" in sys.argv[1:]
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16, generator=g)
k, v = (torch.randn(2, 2, 1100, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv")
do = torch.randn_like(q)
for causal in (False, True):
    scores = Scores(128**-0.5, causal)
    o, lse = fwd.attention_fwd(q, k, v, scores)
    mine = bwd.attention_bwd(do, q, k, v, o, lse, None, scores, deterministic=deterministic)
    switches = bwd.SM90_BACKWARD, bwd.SM90_BACKWARD_DETERMINISTIC, bwd.SM90_BACKWARD_DETERMINISTIC_GQA
    bwd.SM90_BACKWARD = bwd.SM90_BACKWARD_DETERMINISTIC = bwd.SM90_BACKWARD_DETERMINISTIC_GQA = False
    theirs = bwd.attention_bwd(do, q, k, v, o, lse, None, scores, deterministic=True)
    bwd.SM90_BACKWARD, bwd.SM90_BACKWARD_DETERMINISTIC, bwd.SM90_BACKWARD_DETERMINISTIC_GQA = switches
    torch.cuda.synchronize()
    errors = [(a.float() - b.float()).abs().max().item() for a, b in zip(mine, theirs, strict=True)]
    print(
        f"deterministic={deterministic} causal={causal}: max |gluon - triton| dq, dk, dv = {errors}",
        flush=True,
    )
