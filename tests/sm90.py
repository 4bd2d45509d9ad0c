"""Compile kernels for Hopper (sm_90) on a machine without a GPU, and read their SASS.

Triton's wheel carries ptxas and cuobjdump, so a CPU-only CI can check what the GPU would run:
tensor-core instructions, 16-byte global accesses, registers and spills. The interpreter never
compiles, so compilation runs in a child process that chose native compilation before importing
triton. A test passes a script body that calls ``compile_kernel`` and prints what it checks.
"""

from __future__ import annotations

import os
import subprocess
import sys

PRELUDE = r'''
import os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def compile_kernel(kernel, signature, constexprs, num_warps, aligned=True):
    """(sass, resource usage) of ``kernel`` for sm_90. As Triton specializes a launch whose pointers
    are 16-byte aligned and whose integer arguments are multiples of 16 when ``aligned``."""
    signature = {name: "constexpr" if name in constexprs else signature[name] for name in kernel.arg_names}
    hints = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values())
             if t != "constexpr" and aligned}
    constants = {(kernel.arg_names.index(k),): v for k, v in constexprs.items()}
    compiled = triton.compile(ASTSource(kernel, signature, constants, hints),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    return sass, usage

def registers(usage):
    return int(re.search(r"REG:(\d+)", usage).group(1))

def spills(usage):
    return not ("STACK:0" in usage and "LOCAL:0" in usage)
'''


def run(body: str, timeout: int = 600) -> list[str]:
    """Run ``PRELUDE + body`` natively compiled; its stdout lines (AssertionError on failure)."""
    env = os.environ | {"TRITONKIT_INTERPRET": "0", "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True,
                            env=env, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()
