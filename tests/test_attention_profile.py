"""``benchmarks/attention_profile.py``'s reader: the pipe shares
docs/perf-notes/attention-forward-sm90-loop.md cites ("The forward's pipes, counted") are what it reads from
the committed Nsight Compute export."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HISTORY = ROOT / "benchmarks" / "results" / "h200" / "history"


def test_the_reader_gives_each_kernels_time_clock_and_pipe_shares(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import attention_profile
    finally:
        sys.path.pop(0)
    attention_profile.read(str(HISTORY / "attention-fwd-ncu-raw-732e5f6.csv"))
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:4] == ["kernel", "us", "GHz", "cycles"]
    kernels = ["_attn_fwd_sm90_kernel", "cudnn_generated_fort_native_sdpa"] * 2  # D = 64, then 128
    assert [row.split()[0] for row in rows] == kernels
    ours_d64 = rows[0].split()
    # duration (us, from ncu's ms), clock, cycles, then tensor, MUFU, FMA, ALU and issue shares
    assert ours_d64[1:3] == ["1198.8", "1.85"] and ours_d64[4:6] == ["48.9%", "50.7%"], rows[0]
