"""Fingerprints of the SASS every op's benchmark launches compile to for sm_90, for comparing two
versions of the source without a GPU.

Run:  TRITONKIT_INTERPRET=0 PYTHONPATH=src python benchmarks/sass_fingerprints.py OUT.json [OP ...]
on each checkout (the default configs of each op's "quick" shapes, as `tritonkit inspect` compiles
them), then compare the two files. An edit whose launches all keep their fingerprint compiles to
the same kernels, so the tuning it ships still describes them. A fingerprint hashes the SASS
without its addresses, encodings, comments and file paths, which differ between checkouts.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys

import torch

from tritonkit.asm import compile_launch
from tritonkit.ops import get_op, op_names

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_COMMENT = re.compile(r"/\*.*?\*/")  # instruction offsets and encodings


def fingerprint(sass: str) -> str:
    """A short hash of the instructions alone."""
    lines = []
    for line in sass.splitlines():
        line = _COMMENT.sub("", line).strip()
        if line and not line.startswith("//") and ".file" not in line:
            lines.append(" ".join(line.split(";")[0].split()))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def main(out: str, names: list[str]) -> None:
    prints = {}
    for name in names or [n for n in op_names() if get_op(n).inspect is not None]:
        spec = get_op(name)
        for shape, dtype in spec.shape_list("quick"):
            for launch in spec.inspect(shape, DTYPES[dtype or "bf16"], None):
                report = compile_launch(launch, "sm_90")
                label = f"{name} {'x'.join(map(str, shape))} {dtype or 'bf16'} {report.name}"
                prints[label] = {"sass": fingerprint(report.asm["sass"]), "registers": report.registers}
                print(label, prints[label]["sass"], report.registers, flush=True)
    with open(out, "w") as f:
        json.dump(prints, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
