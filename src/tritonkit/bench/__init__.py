"""The benchmark harness: providers, timing protocol, sweeps and writers."""

from tritonkit.bench.report import add_peer_ratios, format_table, write_results
from tritonkit.bench.runner import run

__all__ = ["run", "format_table", "write_results", "add_peer_ratios"]
