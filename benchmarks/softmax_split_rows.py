"""Softmax and log_softmax over few long rows, split across programs (ops/softmax/split_kernels.py),
beside the peers, in one run.

    python benchmarks/softmax_split_rows.py OUT.json [--ops softmax log_softmax] [--deadline S]
        [--shape ROWSxN:DTYPE ...] [--modes fwd bwd] [--settings configs one-wave entries two-launches]

For each op, shape and mode, the benchmark runner's rows (``tritonkit.bench.runner``: the error check
against float64, CUDA-graph-replayed median ms, eager ms, share of a copy of the same bytes) for
every provider, then tritonkit again with ``softmax.SPLIT_EVEN_ROUNDS = False`` as
"tritonkit[configs]": the split configs' own power-of-two segments and rows at once, where the
launch otherwise takes the segments that end a round soonest and one row at a time for rows L2 does
not hold (``softmax._split_launch_args``); with ``--settings one-wave`` (or as well), tritonkit again
with ``configs.SPLIT_ONE_WAVE = True`` as "tritonkit[one-wave]": the split kernel for one wave of
rows past L2, which the default leaves to the online kernel; with ``entries``, ``softmax.WINDOWS =
False``: rows that start off 16 bytes an entry at a time, not in windows; with ``two-launches``,
``softmax.SPLIT_TWO_LAUNCHES = True``: rows past L2 split in two launches (every row's pass 1, then
every pass 2), not one at a time in one cooperative launch. Untuned calls: tuning is opt-in.
"""

from __future__ import annotations

import functools
import sys

from tritonkit.bench import runner, settings
from tritonkit.ops.softmax import configs, softmax

SHAPES = settings.FEW_LONG_ROWS
SETTINGS = {  # label -> (module, name, value): tritonkit again with module.name = value
    "configs": (softmax, "SPLIT_EVEN_ROUNDS", False),
    "one-wave": (configs, "SPLIT_ONE_WAVE", True),
    "entries": (softmax, "WINDOWS", False),
    "two-launches": (softmax, "SPLIT_TWO_LAUNCHES", True),
}
REPORT = functools.partial(print, flush=True)  # a line a case, as it ends
COMMAND = "python benchmarks/softmax_split_rows.py OUT.json"


def main() -> None:
    parser = settings.parser(__doc__)
    parser.add_argument("--ops", nargs="+", default=["softmax", "log_softmax"])
    parser.add_argument("--modes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--settings", nargs="+", default=["configs"], choices=sorted(SETTINGS))
    args = parser.parse_args()
    options = {label: SETTINGS[label] for label in args.settings}
    cases = runner.cases(args.ops, args.shape or SHAPES, None, args.modes)
    settings.compare(cases, options, args.out, " ".join([COMMAND, *sys.argv[2:]]), REPORT, args.deadline)


if __name__ == "__main__":
    main()
