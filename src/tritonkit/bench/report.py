"""Writers for benchmark rows: console table, JSON, CSV and a roofline plot."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import re
from collections import Counter, defaultdict
from pathlib import Path

from tritonkit import roofline

TABLE_COLUMNS = [  # (header, row key, format)
    ("op", "op", "{}"),
    ("mode", "mode", "{}"),
    ("shape", "shape", "{}"),
    ("dtype", "dtype", "{}"),
    ("provider", "provider", "{}"),
    ("ms", "ms", "{:.4f}"),
    ("eager ms", "eager_ms", "{:.4f}"),
    ("GB/s", "gbps", "{:.0f}"),
    ("TFLOP/s", "tflops", "{:.2f}"),
    ("%roof", "pct_roofline", "{:.1f}"),
    ("%roof(ds)", "pct_roofline_datasheet", "{:.1f}"),
    ("%copy@size", "pct_copy_same_bytes", "{:.1f}"),
    ("host us", "host_us", "{:.1f}"),
    ("extra MiB", "peak_extra_mib", "{:.0f}"),
    ("vs best peer", "speedup_vs_best_peer", "{:.2f}x"),
    ("max err", "max_err", "{:.2e}"),
    ("check", "check", "{}"),
]
INTERPRETER_COLUMNS = [  # a correctness run: no timings, the analytic prediction instead
    ("op", "op", "{}"),
    ("mode", "mode", "{}"),
    ("shape", "shape", "{}"),
    ("dtype", "dtype", "{}"),
    ("provider", "provider", "{}"),
    ("max err", "max_err", "{:.2e}"),
    ("check", "check", "{}"),
    ("H200 roofline ms", "predicted_ms_h200", "{:.3g}"),
]


def add_peer_ratios(rows: list[dict]) -> None:
    """Give each timed tritonkit row the best peer's time over its own (>1: tritonkit is faster)."""
    groups = defaultdict(list)
    for row in rows:
        if "ms" in row:
            groups[(row["op"], row["mode"], tuple(row["shape"]), row["dtype"])].append(row)
    for group in groups.values():
        # peers only: tritonkit's named variants ("tritonkit[online]") are shown, not compared with
        peers = [r["ms"] for r in group if not r["provider"].startswith("tritonkit")]
        for row in group:
            if row["provider"] == "tritonkit" and peers:
                row["speedup_vs_best_peer"] = min(peers) / row["ms"]


def _cell(row: dict, key: str, fmt: str) -> str:
    if key not in row:
        return "-"
    value = row[key]
    if key == "shape":
        return "x".join(map(str, value))
    return fmt.format(value)


def format_table(rows: list[dict], interpreter: bool = False) -> str:
    """Measured rows as aligned columns; providers that did not run listed once below."""
    columns = INTERPRETER_COLUMNS if interpreter else TABLE_COLUMNS
    ran = [row for row in rows if "unavailable" not in row]
    cells = [[header for header, _, _ in columns]]
    cells += [[_cell(row, key, fmt) for _, key, fmt in columns] for row in ran]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = [
        "  ".join(
            cell.rjust(width) if i >= 4 else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        )
        for line in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    skipped = {row["provider"]: row["unavailable"] for row in rows if "unavailable" in row}
    lines += [f"not run: {name} ({reason})" for name, reason in skipped.items()]
    return "\n".join(lines)


def gpu_slug(gpu_name: str) -> str:
    """``h200`` for the H200; other known parts by datasheet key; else the name, simplified."""
    try:
        return roofline.slug_for_device_name(gpu_name)
    except ValueError:
        return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") or "unknown"


def write_results(
    rows: list[dict],
    out_dir: Path,
    ceilings: tuple[roofline.DeviceSpec, roofline.DeviceSpec] | None = None,
    merge: bool = False,
) -> list[Path]:
    """``<out>/<gpu-slug>/<op>.json`` (and .csv, .png) for each op in the rows.

    ``ceilings`` (datasheet, measured) for the plot default to this GPU's. ``merge`` (a run of
    some of a table's shapes, ``--only``): the rows replace their cases' rows in the table already
    there, whose other cases stay; the .md says so where the rows come from more than one commit.
    """
    written = []
    by_op = defaultdict(list)
    for row in rows:
        by_op[(gpu_slug(row["gpu"]), row["op"])].append(row)
    for (slug, op), op_rows in by_op.items():
        folder = out_dir / slug
        folder.mkdir(parents=True, exist_ok=True)
        json_path, csv_path, md_path, png_path = (
            folder / f"{op}.{ext}" for ext in ("json", "csv", "md", "png")
        )
        if merge and json_path.exists():
            op_rows = merged_rows(json.loads(json_path.read_text()), op_rows)
        json_path.write_text(json.dumps(op_rows, indent=1) + "\n")
        _write_csv(op_rows, csv_path)
        md_path.write_text(markdown_table(op_rows) + "\n" + _commits_line(op_rows))
        written += [json_path, csv_path, md_path]
        if any("tflops" in r for r in op_rows):
            datasheet, measured = ceilings or (
                roofline.device_spec(op_rows[0]["gpu"]),
                roofline.measured_ceilings(),
            )
            plot_roofline(op_rows, png_path, datasheet, measured)
            bandwidth_path = folder / f"{op}-bandwidth.png"
            plot_bandwidth(op_rows, bandwidth_path, measured)
            written += [png_path, bandwidth_path]
    return written


def _case(row: dict) -> tuple:
    return row["mode"], tuple(row["shape"]), row["dtype"]


def merged_rows(table: list[dict], rows: list[dict]) -> list[dict]:
    """``table`` with ``rows`` in place of the rows of their cases (mode, shape, dtype), where the
    first of them stood; cases the table lacks go at its end."""
    fresh = defaultdict(list)
    for row in rows:
        fresh[_case(row)].append(row)
    merged = []
    for row in table:
        case = _case(row)
        if case not in fresh:
            merged.append(row)
        elif fresh[case]:  # the first of the case's old rows: all its new ones, once
            merged += fresh[case]
            fresh[case] = []
    return merged + [row for case_rows in fresh.values() for row in case_rows]


def _commits_line(rows: list[dict]) -> str:
    """Below a table whose rows come from more than one commit, which and how many (each row's
    JSON has its command); else nothing."""
    commits = Counter(str(r.get("git_sha", "?"))[:7] for r in rows)
    if len(commits) < 2:
        return ""
    runs = ", ".join(f"{sha} ({n} rows)" for sha, n in commits.items())
    return f"\nRows from more than one run: {runs}.\n"


CHECKPOINT = "bench-checkpoint-{}.jsonl"  # a GPU run's rows so far, beside its results
PROVENANCE_FIELDS = ("command", "gpu", "torch", "triton", "git_sha")  # what a resumed run must share


def checkpoint_path(out: Path, gpu: str, command: str) -> Path:
    """Where a GPU run of ``command`` keeps its rows so far: one file a command (named by a hash
    of it), so that starting one command does not discard another's stopped run."""
    return out / gpu_slug(gpu) / CHECKPOINT.format(hashlib.sha1(command.encode()).hexdigest()[:10])


def append_checkpoint(path: Path, rows: list[dict]) -> None:
    """Add a finished case's rows to the run's checkpoint (JSON lines, synced): a run stopped at
    any moment loses at most the case in flight, and ``tritonkit bench --resume`` goes on from it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
        out.flush()
        os.fsync(out.fileno())


def read_checkpoint(path: Path, provenance: dict) -> tuple[list[dict], int]:
    """(rows whose PROVENANCE_FIELDS equal ``provenance``'s, rows left out): another command,
    commit or version is not resumed, and a line cut short by a stop is skipped."""
    kept, left_out = [], 0
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return [], 0
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            left_out += 1
            continue
        same = isinstance(row, dict) and all(row.get(f) == provenance.get(f) for f in PROVENANCE_FIELDS)
        if same:
            kept.append(row)
        else:
            left_out += 1
    return kept, left_out


def _compute_bound(row: dict) -> bool:
    """True when the row's FLOPs a byte pass the measured ridge point: its ceiling is the FLOP rate."""
    if not (row.get("flops") and row.get("bytes") and row.get("measured_peak")):
        return False
    return row["flops"] / row["bytes"] > row["measured_peak"] / row["measured_bandwidth"]


UNCHECKED = "unchecked"  # a row's check when its float64 reference could not run (out of device memory)
# how the reason of a row whose provider ran out of device memory while timed (not in its check) starts
OUT_OF_MEMORY = "out of device memory while timed"


def _not_timed_cell(row: dict | None) -> str:
    """A table's cell for a provider with no rate in a case: none run ("-"), out of memory, refused."""
    if row is None:
        return "-"
    return "out of memory" if row.get("unavailable", "").startswith(OUT_OF_MEMORY) else "refused"


def markdown_table(rows: list[dict]) -> str:
    """Each provider's rate per case, tritonkit's share of its ceiling and its ratio to the best peer:
    the table the docs show. Rates are GB/s, or TFLOP/s for an op whose tritonkit rows are
    compute-bound (attention, matmul), against the measured peak. Failed checks are marked;
    providers that refused say so."""
    timed = [r for r in rows if "gbps" in r]
    if not timed:
        return "(no timed rows: a correctness run)"
    ours_timed = [r for r in timed if r["provider"] == "tritonkit"] or timed
    compute = all(_compute_bound(r) for r in ours_timed)
    unit, rate_key = ("TFLOP/s", "tflops") if compute else ("GB/s", "gbps")
    ours_columns = (
        [("tritonkit %peak", "pct_roofline")]
        if compute
        else [("tritonkit %copy", "pct_roofline"), ("tritonkit %copy@size", "pct_copy_same_bytes")]
    )
    ours_columns += [
        ("tritonkit ms", "ms"),
        ("tritonkit eager ms", "eager_ms"),
        ("vs best peer", "speedup_vs_best_peer"),
    ]
    providers = list(dict.fromkeys(r["provider"] for r in rows if "gbps" in r or "unavailable" in r))
    cases = defaultdict(dict)
    for r in rows:
        if "gbps" in r or "unavailable" in r:
            cases[(r["mode"], "x".join(map(str, r["shape"])), r["dtype"])][r["provider"]] = r
    header = ["mode", "shape", "dtype", *[f"{p} {unit}" for p in providers], *[h for h, _ in ours_columns]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (mode, shape, dtype), by_provider in cases.items():
        cells = [mode, shape, dtype]
        for provider in providers:
            row = by_provider.get(provider)
            if row is None or rate_key not in row:
                cells.append(_not_timed_cell(row))
            else:
                mark = {"pass": "", UNCHECKED: f" ({UNCHECKED})"}.get(row.get("check"), " (FAIL)")
                cells.append(f"{row[rate_key]:.0f}" + mark)
        ours = by_provider.get("tritonkit", {})
        for _, key in ours_columns:
            value = ours.get(key)
            if value is None:
                cells.append("-")
            else:
                cells.append(_ours_cell(key, value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ours_cell(key: str, value: float) -> str:
    if key.startswith("speedup"):
        return f"{value:.2f}x"
    return f"{value:.4f}" if key.endswith("ms") else f"{value:.1f}"


def _case_label(row: dict) -> str:
    return "x".join(map(str, row["shape"])) + "\n" + row["dtype"]


def plot_bandwidth(rows: list[dict], path: Path, measured: roofline.DeviceSpec) -> None:
    """GB/s of each provider per case, one panel per mode, under the measured copy bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if "gbps" in r]
    modes = list(dict.fromkeys(r["mode"] for r in timed))
    providers = list(dict.fromkeys(r["provider"] for r in timed))
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 3.6 * len(modes)), squeeze=False)
    width = 0.8 / len(providers)
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        in_mode = [r for r in timed if r["mode"] == mode]
        cases = list(dict.fromkeys(_case_label(r) for r in in_mode))
        gbps = {(_case_label(r), r["provider"]): r["gbps"] for r in in_mode}
        for i, provider in enumerate(providers):
            heights = [gbps.get((case, provider), 0.0) for case in cases]
            ax.bar([c + i * width for c in range(len(cases))], heights, width, label=provider, color=f"C{i}")
        copy = measured.bandwidth / 1e9
        ax.axhline(copy, color="black", lw=1, label=f"measured copy {copy:.0f} GB/s")
        ax.axhline(0.9 * copy, color="black", lw=1, ls="--", label="90% of copy")
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))], cases, fontsize=7)
        ax.set(ylabel="GB/s", ylim=(0, 1.3 * copy), title=f"{timed[0]['op']} {mode} on {timed[0]['gpu']}")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0, 0].legend(fontsize=7, ncol=len(providers) + 2, loc="upper center")  # above the copy line
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _write_csv(rows: list[dict], path: Path) -> None:
    flat = [_flat(row) for row in rows]
    keys = list(dict.fromkeys(key for row in flat for key in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(flat)


def _flat(row: dict) -> dict:
    """A row as CSV cells: the shape as AxB, a dict's entries as columns of their own (bench_s.check)."""
    cells = {}
    for key, value in row.items():
        if isinstance(value, dict):
            cells |= {f"{key}.{inner}": v for inner, v in value.items()}
        else:
            cells[key] = "x".join(map(str, value)) if key == "shape" else value
    return cells


def plot_roofline(
    rows: list[dict], path: Path, datasheet: roofline.DeviceSpec, measured: roofline.DeviceSpec
) -> None:
    """Each measured point (intensity, TFLOP/s) under the device's measured and datasheet roofs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tritonkit.ops import get_workload

    timed = [r for r in rows if "tflops" in r]
    unit = get_workload(timed[0]["op"]).flop_unit
    intensities = [r["flops"] / r["bytes"] for r in timed]
    lo, hi = min(intensities) / 8, max(max(intensities) * 8, datasheet.ridge(unit) * 4)
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for spec, style in ((datasheet, "--"), (measured, "-")):
        roof = [min(spec.peak(unit), x * spec.bandwidth) / 1e12 for x in xs]
        ax.plot(
            xs,
            roof,
            style,
            color="black",
            lw=1,
            label=f"{spec.source} roof: {spec.bandwidth / 1e12:.2f} TB/s, {spec.peak(unit) / 1e12:.0f} "
            f"TFLOP/s {unit}",
        )
    markers = {"fwd": "o", "bwd": "s", "fwd+bwd": "^"}
    colors = {}
    for row, x in zip(timed, intensities, strict=True):
        color = colors.setdefault(row["provider"], f"C{len(colors)}")
        ax.scatter(x, row["tflops"], color=color, marker=markers[row["mode"]], s=28, alpha=0.8)
    for provider, color in colors.items():
        ax.scatter([], [], color=color, label=provider)
    for mode, marker in markers.items():
        ax.scatter([], [], color="gray", marker=marker, label=mode)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="arithmetic intensity (FLOP/byte)",
        ylabel="achieved TFLOP/s",
        title=f"{timed[0]['op']} on {timed[0]['gpu']}",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _predicted(name: str, datasheet: roofline.DeviceSpec) -> list[tuple[float, float]]:
    """(FLOP/byte, TFLOP/s) where the roofline puts the workload's forward at each of its shapes."""
    from tritonkit.dtypes import DTYPE_OF
    from tritonkit.ops import get_workload

    workload, points = get_workload(name), []
    for shape, dtype_name in workload.shape_list("quick"):
        for dtype in (DTYPE_OF[dtype_name],) if dtype_name else workload.op.dtypes:
            cost = workload.cost(shape, dtype, "fwd")
            seconds = roofline.roofline_seconds(cost, datasheet, workload.flop_unit)
            points.append((cost.flops / cost.bytes, cost.flops / seconds / 1e12))
    return points


def _intensity_axis(intensities: list[float], ridge: float) -> list[float]:
    """Log-spaced FLOP/byte from a decade under the lowest point to a decade past the highest point
    or the ridge, whichever is further: the points spread over the plot rather than bunch."""
    low = 10 ** math.floor(math.log10(min(intensities)) - 1)
    high = 10 ** math.ceil(math.log10(max(*intensities, ridge)) + 1)
    steps = round(40 * math.log10(high / low))
    return [low * 10 ** (k / 40) for k in range(steps + 1)]


def plot_results(results: Path, datasheet: roofline.DeviceSpec, path: Path) -> list[str]:
    """The device's roofline with tritonkit's latest benchmarked points of every op found under
    ``results/<slug>/`` (filled), and each op's analytic roofline position at its benchmark shapes
    (hollow: where the roof allows it to be). Returns the ops plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tritonkit.ops import get_workload, workload_names

    rows = []
    for file in sorted((results / datasheet.slug).glob("*.json")):
        data = json.loads(file.read_text())
        if isinstance(data, list):  # a benchmark's rows (other files hold other measurements)
            # an op's rows; the decoder layer's (layer.json) have FLOPs but no bytes: no roofline point
            rows += [r for r in data if r.get("provider") == "tritonkit" and "tflops" in r and "bytes" in r]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    units = sorted({get_workload(name).flop_unit for name in workload_names()})
    intensities = [r["flops"] / r["bytes"] for r in rows]
    intensities += [x for name in workload_names() for x, _ in _predicted(name, datasheet)]
    xs = _intensity_axis(intensities, max(datasheet.peak(unit) for unit in units) / datasheet.bandwidth)
    for unit, style in zip(units, ("-", "--", ":", "-."), strict=False):
        ax.plot(
            xs,
            [min(datasheet.peak(unit), x * datasheet.bandwidth) / 1e12 for x in xs],
            style,
            color="black",
            lw=1,
            label=f"{datasheet.name} datasheet roof ({unit})",
        )
    measured = [r for r in rows if "measured_bandwidth" in r]
    if measured:
        bandwidth = measured[-1]["measured_bandwidth"]
        peaks = [r["measured_peak"] for r in measured if "measured_peak" in r]  # matmul rates measured
        peak = max(peaks) if peaks else max(datasheet.peak(unit) for unit in units)  # the highest roof
        label = f"measured roof: copy {bandwidth / 1e12:.2f} TB/s" + (
            f", matmul {peak / 1e12:.0f} TFLOP/s" if peaks else ""
        )
        ax.plot(xs, [min(peak, x * bandwidth) / 1e12 for x in xs], color="gray", lw=1, label=label)
    plotted = []
    for index, name in enumerate(workload_names()):
        color = f"C{index}"
        ours = [r for r in rows if r["op"] == name]
        if ours:
            ax.scatter(
                [r["flops"] / r["bytes"] for r in ours],
                [r["tflops"] for r in ours],
                color=color,
                s=24,
                label=f"{name} (measured)",
            )
        ax.scatter(
            *zip(*_predicted(name, datasheet), strict=True),
            facecolors="none",
            edgecolors=color,
            s=40,
            label=f"{name} (roofline, fwd)",
        )
        plotted.append(name)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="arithmetic intensity (FLOP/byte)",
        ylabel="TFLOP/s",
        title=f"tritonkit on {datasheet.name}",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return plotted
