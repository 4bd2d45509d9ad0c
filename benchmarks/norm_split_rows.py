"""The norms over few long rows: each row split across programs side by side (ops/norm/split.py)
against one program a row (the looped kernels, the split turned off), beside the peers, in one run.

    python benchmarks/norm_split_rows.py OUT.json [--ops layer_norm rms_norm] [--deadline S]
        [--shape ROWSxN:DTYPE ...] [--per-sm K] [--unroll K] [--entries] [--modes fwd bwd]

The shapes are the sweep's few-long-rows cliffs (the norms at 1-20% of the copy rate there), or
those given. For each op, shape and mode (fwd, bwd), the benchmark runner's rows
(``tritonkit.bench.runner``: the error check against float64, CUDA-graph-replayed median ms, eager
ms, share of a copy of the same bytes) for every provider, then tritonkit again with
``split.SPLIT_PER_SM = 0`` as "tritonkit[unsplit]", with ``split.COLUMNS_ROWS_MAX = 0`` as
"tritonkit[row-major]" (the split backward a row at a time, never by columns), and with ``--per-sm
K`` once more at ``SPLIT_PER_SM = K`` as "tritonkit[split<K]": the split taken up to K programs an
SM's rows (``tritonkit.bench.settings``: the replay plans and the configs chosen per call signature
are forgotten around each, since a signature replays what it recorded and keeps the config chosen
at its first call); with ``--entries``, ``split.SPLIT_WINDOWS = False`` as "tritonkit[entries]":
rows off 16 bytes an entry at a time, not in windows.
"""

from __future__ import annotations

import functools
import sys

from tritonkit.bench import runner, settings
from tritonkit.ops.norm import split

SHAPES = [
    *settings.FEW_LONG_ROWS,
    ((1, 83572), "bf16"),
    ((74, 187426), "bf16"),
    ((10, 72384), "fp32"),
    ((97, 11079), "fp16"),
    ((14, 12592), "fp32"),
]
REPORT = functools.partial(print, flush=True)  # a line a case, as it ends
COMMAND = "python benchmarks/norm_split_rows.py OUT.json"


def main() -> None:
    parser = settings.parser(__doc__)
    parser.add_argument("--ops", nargs="+", default=["layer_norm", "rms_norm", "add_rms_norm"])
    parser.add_argument("--per-sm", type=int, default=None, help="also time SPLIT_PER_SM = K")
    parser.add_argument("--unroll", type=int, default=None, help="also time SPLIT_PASS1_UNROLL = K")
    parser.add_argument("--entries", action="store_true", help="also time SPLIT_WINDOWS = False")
    parser.add_argument("--modes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    args = parser.parse_args()
    options = {"unsplit": (split, "SPLIT_PER_SM", 0), "row-major": (split, "COLUMNS_ROWS_MAX", 0)}
    if args.per_sm is not None:
        options[f"split<{args.per_sm}"] = (split, "SPLIT_PER_SM", args.per_sm)
    if args.unroll is not None:
        options[f"unroll {args.unroll}"] = (split, "SPLIT_PASS1_UNROLL", args.unroll)
    if args.entries:
        options["entries"] = (split, "SPLIT_WINDOWS", False)
    cases = runner.cases(args.ops, args.shape or SHAPES, None, args.modes)
    settings.compare(cases, options, args.out, " ".join([COMMAND, *sys.argv[2:]]), REPORT, args.deadline)


if __name__ == "__main__":
    main()
