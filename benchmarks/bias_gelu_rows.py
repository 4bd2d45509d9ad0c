"""bias_gelu's flat kernels (ops/bias_gelu.py): contiguous rows that start off their 16-byte vectors
in one run of 16-byte vectors (the forward at any row length, the backward up to FLAT_BWD_MAX_N
entries), against the same call in row tiles (``FLAT = False``, "tritonkit[rows]"), beside the
peers, in one run.

    python benchmarks/bias_gelu_rows.py OUT.json [--shape ROWSxN:DTYPE ...] [--deadline S]

For each case (the narrow rows backward, then every shape forward; --shape: forward alone), the
benchmark runner's rows (``tritonkit.bench.runner``: the error check against float64,
CUDA-graph-replayed median ms, eager ms, share of a copy of the same bytes) for every provider,
then tritonkit's under the row tiles (``tritonkit.bench.settings``).
"""

from __future__ import annotations

import functools
import sys

from tritonkit.bench import runner, settings
from tritonkit.ops import bias_gelu as bg

SHAPES = [
    ((327218, 5), "fp16"),  # the sweep's 0.64x (shard 7)
    ((327218, 5), "fp32"),
    ((1000000, 3), "bf16"),
    ((38788, 3027), "bf16"),  # odd rows: an entry at a time in row tiles
    ((38788, 3027), "fp32"),
    ((4096, 2900), "bf16"),  # 8-byte vectors in row tiles
    ((8192, 4101), "bf16"),
]
BACKWARD_SHAPES = [
    ((327218, 5), "fp16"),  # 0.81x torch in row tiles (shard 7 at 48bd8ac)
    ((107804, 3), "fp32"),  # 0.39x (shard 4)
    ((55993, 14), "fp32"),  # 0.59x (shard 2)
    ((1000000, 3), "bf16"),
]
SETTINGS = {"rows": (bg, "FLAT", False)}
REPORT = functools.partial(print, flush=True)  # a line a case, as it ends
COMMAND = "python benchmarks/bias_gelu_rows.py OUT.json"


def main() -> None:
    parser = settings.parser(__doc__)
    args = parser.parse_args()
    cases = runner.cases(["bias_gelu"], args.shape or SHAPES, None, ["fwd"])
    if not args.shape:
        cases = [*runner.cases(["bias_gelu"], BACKWARD_SHAPES, None, ["bwd"]), *cases]
    settings.compare(cases, SETTINGS, args.out, " ".join([COMMAND, *sys.argv[2:]]), REPORT, args.deadline)


if __name__ == "__main__":
    main()
