"""The sweep (``tritonkit bench --sweep N``): the memory-bound families on N shapes drawn at random,
untuned, against their peers, and the worst of them.

A benchmark table holds the shapes its kernels were tuned on; a user's shapes are others. The sweep
draws (rows, row length) log-uniformly (rows 1 to 2^20, length 1 to 2^24, most not powers of two,
at most 2^28 elements so that a float64 check fits beside them) with a dtype each, the same shapes
for every family, and runs each family's fwd and bwd on them as a user's first call does: with
tuning off (``tuning.disabled()``: the shipped or cached winners where a key has one, else the
untuned default). torch.compile's peer is compiled once a family and serves the family's later
shapes through Dynamo's dynamic-shape graphs, as a model calling it on many shapes gets (the
benchmark tables compile afresh for each shape, a compile per shape and mode).

The summary a family gives: the share of its shapes at or past the best peer, its worst ratio, and
over the shapes that move at least 64 MB the least share of the measured copy bandwidth; then the
worst rows by each measure.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

# The memory-bound families whose shapes are (rows, row length)
WORKLOADS = ("softmax", "log_softmax", "layer_norm", "rms_norm", "add_rms_norm", "bias_gelu", "cross_entropy")
ROWS = (1, 2**20)
LENGTH = (1, 2**24)
MAX_ELEMENTS = 2**28
# the interpreter's sweep: shapes it runs in seconds
INTERPRETER_ROWS, INTERPRETER_LENGTH, INTERPRETER_MAX_ELEMENTS = (1, 64), (1, 4096), 2**13
DTYPES = ("fp32", "fp16", "bf16")
LARGE_BYTES = 64 * 2**20  # the shapes whose bandwidth is judged against the copy's
RECOMPILE_LIMIT = 64  # Dynamo recompiles for each dtype and for dims of 1; its default (8) is too few


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return min(high, max(low, round(math.exp(rng.uniform(math.log(low), math.log(high + 1))))))


def sample_shapes(
    count: int,
    seed: int = 0,
    rows: tuple[int, int] = ROWS,
    length: tuple[int, int] = LENGTH,
    max_elements: int = MAX_ELEMENTS,
) -> list[tuple[tuple[int, int], str]]:
    """``count`` distinct ((rows, length), dtype name) drawn log-uniformly, each at most
    ``max_elements`` (a draw past it is drawn again), the same for the same seed."""
    if count < 1:
        raise ValueError(f"a sweep draws at least one shape, got {count}")
    rng = random.Random(seed)
    shapes: dict[tuple, None] = {}
    for _ in range(1000 * count):
        if len(shapes) == count:
            break
        shape = (_log_uniform(rng, *rows), _log_uniform(rng, *length))
        if math.prod(shape) <= max_elements:
            shapes.setdefault((shape, rng.choice(DTYPES)))
    if len(shapes) < count:
        raise ValueError(f"{count} distinct shapes do not fit in rows {rows}, length {length}")
    return list(shapes)


def interpreter_shapes(count: int, seed: int = 0) -> list[tuple[tuple[int, int], str]]:
    return sample_shapes(count, seed, INTERPRETER_ROWS, INTERPRETER_LENGTH, INTERPRETER_MAX_ELEMENTS)


def shard(shapes: list, spec: str) -> list:
    """The shapes of shard ``"I/N"``: every N-th from the I-th (0 <= I < N), each with all its
    families and modes, so that N processes (one a GPU) run the sweep between them and ``merge``
    makes it one."""
    try:
        index, count = (int(part) for part in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard takes I/N (shard I of N, from 0), got {spec!r}") from None
    if not 0 <= index < count:
        raise ValueError(f"--shard I/N needs 0 <= I < N, got {spec!r}")
    return shapes[index::count]


def merge(folders: list[Path]) -> list[dict]:
    """The rows of shards' sweeps (each folder's ``<gpu>/sweep.json``, one GPU model), as one sweep,
    shard after shard. Refused: a folder without one, shards of different GPU models or commands
    (other than ``--shard`` and ``--out``), and any set of shards but every shard I/N of one N once
    (a shard given twice counted its shapes twice; a missing one passed for the whole sweep)."""
    import json

    rows, commands, shards = [], set(), []
    for folder in folders:
        found = sorted(Path(folder).glob("*/sweep.json"))
        if len(found) != 1:
            raise ValueError(f"{folder}: expected one <gpu>/sweep.json, found {len(found)}")
        shard_rows = json.loads(found[0].read_text())
        commands |= {_sweep_of(row.get("command", "")) for row in shard_rows}
        shards += sorted({_shard_of(row.get("command", "")) for row in shard_rows}, key=str)
        rows += shard_rows
    gpus = {row["gpu"] for row in rows}
    if len(gpus) != 1 or len(commands) != 1:
        raise ValueError(
            f"shards of one GPU model and sweep are merged, got {sorted(gpus)} and {sorted(commands)}"
        )
    counts = {spec[1] if spec else None for spec in shards}
    whole = len(counts) == 1 and None not in counts and sorted(i for i, _ in shards) == list(range(*counts))
    if not whole:
        given = ", ".join("unsharded" if spec is None else "/".join(map(str, spec)) for spec in shards)
        raise ValueError(f"--merge takes every shard I/N of one sweep once (I = 0 .. N - 1), got {given}")
    return rows


SHARD_FLAGS = ("--shard", "--out")  # what tells the shards of one sweep apart


def _flag_values(command: str) -> tuple[list[str], dict[str, str]]:
    """A command's words but SHARD_FLAGS, and their values (``--flag value`` or ``--flag=value``)."""
    words, kept, values = command.split(), [], {}
    pending = None
    for word in words:
        name, equals, value = word.partition("=")
        if pending is not None:
            values[pending], pending = word, None
        elif word in SHARD_FLAGS:
            pending = word
        elif equals and name in SHARD_FLAGS:
            values[name] = value
        else:
            kept.append(word)
    return kept, values


def _sweep_of(command: str) -> str:
    """A shard's command without its SHARD_FLAGS and their values: the sweep it is part of."""
    return " ".join(_flag_values(command)[0])


def _shard_of(command: str) -> tuple[int, int] | None:
    """(I, N) of a command's ``--shard I/N``; None for an unsharded sweep."""
    spec = _flag_values(command)[1].get("--shard")
    return None if spec is None else tuple(int(part) for part in spec.split("/"))


def check_workloads(names: list[str]) -> list[str]:
    """The sweep's workloads: ``names``, or all of WORKLOADS; one outside them is refused."""
    outside = [name for name in names if name not in WORKLOADS]
    if outside:
        raise ValueError(f"--sweep runs the (rows, length) families {', '.join(WORKLOADS)}; not {outside}")
    return list(names) or list(WORKLOADS)


@contextlib.contextmanager
def untuned_calls() -> Iterator[None]:
    """What a sweep runs under: tuning off, and room for Dynamo's recompiles across shapes."""
    import torch._dynamo

    from tritonkit import tuning

    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
    try:
        with tuning.disabled():
            yield
    finally:
        torch._dynamo.config.recompile_limit = limit


# The sweep's timing protocol: memory-bound kernels of microseconds to a few milliseconds, whose
# power draw is expected (not yet measured) to stay under the cap that timing.WARMUP_MS (250 ms)
# waits out for large matmuls.
# 25 ms of warm-up and 50 of repetitions are hundreds of calls at every shape of the sweep but the
# largest (a 2^28-entry backward is about 1 ms); the case then costs about a quarter of the tables'.
SWEEP_WARMUP_MS, SWEEP_REP_MS = 25, 50


def sweep_timing() -> contextlib.AbstractContextManager:
    """The timing protocol a sweep's cases run under (SWEEP_WARMUP_MS, SWEEP_REP_MS)."""
    from tritonkit.bench import timing

    return timing.protocol(SWEEP_WARMUP_MS, SWEEP_REP_MS)


def copy_share(row: dict) -> float | None:
    """The row's bytes a second over the measured copy bandwidth, or None if it was not timed."""
    if "gbps" not in row or not row.get("measured_bandwidth"):
        return None
    return row["gbps"] * 1e9 / row["measured_bandwidth"]


def summary(rows: list[dict]) -> list[dict]:
    """Per (family, mode): shapes timed, the share of them at or past the best peer, the worst ratio
    (and its shape), and over shapes of LARGE_BYTES or more the least share of copy bandwidth."""
    ours = defaultdict(list)
    for row in rows:
        if row["provider"] == "tritonkit" and "ms" in row:
            ours[(row["op"], row["mode"])].append(row)
    out = []
    for (op, mode), group in ours.items():
        rated = [r for r in group if "speedup_vs_best_peer" in r]
        large = [r for r in group if r["bytes"] >= LARGE_BYTES]
        worst = min(rated, key=lambda r: r["speedup_vs_best_peer"], default=None)
        slowest = min(large, key=copy_share, default=None)
        out.append(
            {
                "op": op,
                "mode": mode,
                "shapes": len(group),
                "at_or_past_best_peer": (
                    sum(r["speedup_vs_best_peer"] >= 1.0 for r in rated) / len(rated) if rated else None
                ),
                "worst_vs_best_peer": worst and worst["speedup_vs_best_peer"],
                "worst_shape": worst and _label(worst),
                "large_shapes": len(large),
                "least_copy_share_large": slowest and copy_share(slowest),
                "least_copy_shape": slowest and _label(slowest),
            }
        )
    return out


def _label(row: dict) -> str:
    return f"{'x'.join(map(str, row['shape']))} {row['dtype']}"


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def markdown(rows: list[dict], worst: int = 10) -> str:
    """The summary table, then the ``worst`` rows by ratio to the best peer and by copy share."""
    header = ["family", "mode", "shapes", ">= best peer", "worst x best peer", "at"]
    header += ["shapes >= 64 MB", "least % copy", "at"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in summary(rows):
        lines.append(
            f"| {s['op']} | {s['mode']} | {s['shapes']} | {_fmt(s['at_or_past_best_peer'], '{:.0%}')} | "
            f"{_fmt(s['worst_vs_best_peer'], '{:.2f}x')} | {s['worst_shape'] or '-'} | {s['large_shapes']} | "
            f"{_fmt(s['least_copy_share_large'], '{:.0%}')} | {s['least_copy_shape'] or '-'} |"
        )
    ours = [r for r in rows if r["provider"] == "tritonkit" and "ms" in r]
    by_ratio = sorted(
        (r for r in ours if "speedup_vs_best_peer" in r), key=lambda r: r["speedup_vs_best_peer"]
    )
    by_copy = sorted((r for r in ours if r["bytes"] >= LARGE_BYTES), key=copy_share)
    for title, picked in (
        ("x the best peer", by_ratio[:worst]),
        ("share of copy bandwidth, >= 64 MB", by_copy[:worst]),
    ):
        lines += [
            "",
            f"Worst {len(picked)} by {title}:",
            "",
            "| family | mode | shape | ms | GB/s | % copy | x best peer |",
        ]
        lines.append("|---|---|---|---|---|---|---|")
        for r in picked:
            lines.append(
                f"| {r['op']} | {r['mode']} | {_label(r)} | {r['ms']:.4f} | {r['gbps']:.0f} | "
                f"{_fmt(copy_share(r), '{:.0%}')} | {_fmt(r.get('speedup_vs_best_peer'), '{:.2f}x')} |"
            )
    failed = [r for r in rows if r.get("check") == "FAIL"]
    if failed:
        lines += ["", f"Failed ({len(failed)}):", ""]
        lines += [
            f"- {r['op']} {r['mode']} {_label(r)} {r['provider']}: {r.get('error', 'wrong output')}"
            for r in failed
        ]
    return "\n".join(lines)


def write(rows: list[dict], out_dir: Path) -> list[Path]:
    """``<out>/<gpu-slug>/sweep.json`` (every row), ``sweep.md`` (the summary and the worst rows) and
    ``sweep.png``; the benchmark tables (``<op>.json``) are left as they are."""
    import json

    from tritonkit.bench.report import gpu_slug

    if not rows:
        raise ValueError("the sweep ran no case: nothing to write")
    folder = out_dir / gpu_slug(rows[0]["gpu"])
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"sweep.{ext}" for ext in ("json", "md", "png")]
    paths[0].write_text(json.dumps(rows, indent=1) + "\n")
    paths[1].write_text(markdown(rows) + "\n")
    plot(rows, paths[2])
    return [path for path in paths if path.exists()]


def plot(rows: list[dict], path: Path) -> None:
    """Per family and mode, tritonkit's ratio to the best peer against the bytes a shape moves
    (log scale), the line at 1.0x: where the cliffs are."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [r for r in rows if r["provider"] == "tritonkit" and "speedup_vs_best_peer" in r]
    ops = list(dict.fromkeys(r["op"] for r in ours))
    modes = list(dict.fromkeys(r["mode"] for r in ours))
    if not ours:  # (tritonkit or its peers alone: no ratio to plot)
        path.unlink(missing_ok=True)
        return
    fig, axes = plt.subplots(len(ops), len(modes), figsize=(5 * len(modes), 3 * len(ops)), squeeze=False)
    for (i, op), (j, mode) in ((a, b) for a in enumerate(ops) for b in enumerate(modes)):
        ax = axes[i, j]
        picked = [r for r in ours if r["op"] == op and r["mode"] == mode]
        for k, dtype in enumerate(DTYPES):
            these = [r for r in picked if r["dtype"] == dtype]
            ax.scatter(
                [r["bytes"] for r in these],
                [r["speedup_vs_best_peer"] for r in these],
                s=10,
                label=dtype,
                color=f"C{k}",
            )
        ax.axhline(1.0, color="black", lw=1)
        ax.set(xscale="log", title=f"{op} {mode}", xlabel="bytes moved", ylabel="x best peer")
        ax.grid(True, alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
