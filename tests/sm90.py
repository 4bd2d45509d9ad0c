"""Compile kernels for Hopper (sm_90) on a machine without a GPU, and read their SASS.

Triton's wheel carries ptxas and cuobjdump, so a CPU-only CI can check what the GPU would run:
tensor-core instructions, 16-byte global accesses, registers and spills. The interpreter never
compiles, so compilation runs in a child process that chose native compilation before importing
triton. A test passes a script body that calls ``tritonkit.inspect.compile_kernel`` (imported by the
prelude) and prints what it checks from the returned report.
"""

from __future__ import annotations

import os
import subprocess
import sys

PRELUDE = r"""
import os
import re
from tritonkit.asm import compile_kernel  # (kernel, signature, constexprs, num_warps) -> Report
"""


def run(body: str, timeout: int = 600) -> list[str]:
    """Run ``PRELUDE + body`` natively compiled; its stdout lines (AssertionError on failure)."""
    env = os.environ | {"TRITONKIT_INTERPRET": "0", "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, "-c", PRELUDE + body], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()
