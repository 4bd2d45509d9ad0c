"""Compile kernels for Hopper (sm_90) on a machine without a GPU, and read their SASS.

Triton's wheel carries ptxas and cuobjdump, so a CPU-only CI can check what the GPU would run:
tensor-core instructions, 16-byte global accesses, registers and spills. The interpreter never
compiles, so compilation runs in a child process that chose native compilation before importing
triton. One such child serves every check of a test process (importing torch, triton and the
package once, and keeping Triton's in-memory caches warm between checks): a test passes a script
body, which runs after ``PRELUDE`` in a fresh namespace of that child, and gets its printed lines.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys

PRELUDE = r"""
import os
import re
from tritonkit.asm import compile_kernel  # (kernel, signature, constexprs, num_warps) -> Report
"""

# The child: reads a JSON line {"body": ...}, runs PRELUDE + body with its stdout captured, answers
# one JSON line {"ok": bool, "stdout": ..., "error": traceback}.
_SERVER = r"""
import contextlib, io, json, sys, traceback
answers = sys.stdout
for line in sys.stdin:
    body = json.loads(line)["body"]
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            exec(compile(PRELUDE + body, "<sm90 check>", "exec"), {"__name__": "__sm90__"})
        answer = {"ok": True, "stdout": captured.getvalue()}
    except BaseException:
        answer = {"ok": False, "stdout": captured.getvalue(), "error": traceback.format_exc()}
    answers.write(json.dumps(answer) + "\n")
    answers.flush()
"""

_child: subprocess.Popen | None = None


def _server() -> subprocess.Popen:
    global _child
    if _child is None or _child.poll() is not None:
        env = os.environ | {"TRITONKIT_INTERPRET": "0", "TRITON_INTERPRET": "0"}
        script = f"PRELUDE = {PRELUDE!r}\n{_SERVER}"
        _child = subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        atexit.register(_child.kill)
    return _child


def run(body: str, timeout: int = 600) -> list[str]:
    """Run ``PRELUDE + body`` natively compiled; its stdout lines (AssertionError on failure, or when
    no answer comes within ``timeout`` seconds, after which the child is ended and a new one serves
    the next check)."""
    child = _server()
    child.stdin.write(json.dumps({"body": body}) + "\n")
    child.stdin.flush()
    if not select.select([child.stdout], [], [], timeout)[0]:
        child.kill()
        raise AssertionError(f"the sm_90 check gave no answer in {timeout} s")
    line = child.stdout.readline()
    assert line, "the sm_90 compile process died"
    answer = json.loads(line)
    assert answer["ok"], answer["error"][-3000:]
    return answer["stdout"].splitlines()


_WIDTHS = r"""
import json, torch
from tritonkit import tuning
from tritonkit.asm import compile_launch
from tritonkit.ops import get_workload
with tuning.disabled():
    for shape in SHAPES:
        for launch in get_workload(NAME).op.inspect(tuple(shape), torch.bfloat16, None):
            r = compile_launch(launch, "sm_90")
            print(json.dumps({"shape": shape, "launch": launch.name,
                              "loads": dict(r.loads), "stores": dict(r.stores)}))
"""


def access_widths(workload: str, shapes: list[tuple[int, ...]]) -> list[dict]:
    """Each launch of ``workload``'s untuned bf16 calls at ``shapes``, compiled for sm_90: {"shape",
    "launch", "loads", "stores"}, the last two {width in bits: instructions} of its global accesses."""
    body = f"NAME = {workload!r}\nSHAPES = {[list(s) for s in shapes]!r}\n" + _WIDTHS
    rows = [json.loads(line) for line in run(body)]
    for row in rows:
        for kind in ("loads", "stores"):
            row[kind] = {int(width): count for width, count in row[kind].items()}
    return rows
