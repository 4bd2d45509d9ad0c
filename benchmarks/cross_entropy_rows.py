"""cross_entropy's row layouts: many short rows packed a program (ops/cross_entropy_packed.py), few
long rows split into segments (ops/cross_entropy_split.py), the mean's sum in spans, each the
default where it applies, against the same call without it (``PACKED = False``, ``SPLIT_PER_SM =
0``, ``SUM_SPAN = 0``), beside the peers, in one run.

    python benchmarks/cross_entropy_rows.py OUT.json [--shape ROWSxC:DTYPE ...] [--deadline S]

For each shape and mode (fwd, bwd), the benchmark runner's rows (``tritonkit.bench.runner``: the
error check against float64, CUDA-graph-replayed median ms, eager ms, share of a copy of the same
bytes) for every provider, then tritonkit again under each setting as "tritonkit[rows]",
"tritonkit[one-sum]" and "tritonkit[unsplit]" (``tritonkit.bench.settings``: the replay plans
forgotten before and after, since a call signature replays the launches it recorded).
"""

from __future__ import annotations

import functools
import sys

from tritonkit.bench import runner, settings
from tritonkit.ops import cross_entropy as ce
from tritonkit.ops import cross_entropy_packed as packed
from tritonkit.ops import cross_entropy_split as split

SHAPES = [
    ((162064, 76), "bf16"),  # the sweep's 0.26x
    ((65536, 10), "fp32"),
    ((8192, 1000), "fp32"),
    ((100000, 300), "bf16"),
    ((32768, 1024), "bf16"),
    ((8192, 32000), "bf16"),  # a vocabulary: not packed, its sum one program's: the control
    ((16384, 32000), "bf16"),  # its sum over spans
]
SETTINGS = {
    "rows": (packed, "PACKED", False),
    "one-sum": (ce, "SUM_SPAN", 0),
    "unsplit": (split, "SPLIT_PER_SM", 0),
}
REPORT = functools.partial(print, flush=True)  # a line a case, as it ends
COMMAND = "python benchmarks/cross_entropy_rows.py OUT.json"


def main() -> None:
    parser = settings.parser(__doc__)
    args = parser.parse_args()
    cases = runner.cases(["cross_entropy"], args.shape or SHAPES, None, ["fwd", "bwd"])
    settings.compare(cases, SETTINGS, args.out, " ".join([COMMAND, *sys.argv[2:]]), REPORT, args.deadline)


if __name__ == "__main__":
    main()
