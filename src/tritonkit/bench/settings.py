"""The same call timed under another module setting, beside the default in one run: a kernel
family's dispatch switch (a split turned off, packing off, a rule's threshold) set for one case,
tritonkit's rows taken again under it as a provider of its own ("tritonkit[label]"), and a line
that puts every provider of a case side by side. For benchmarks that ask what a dispatch choice is
worth (benchmarks/norm_split_rows.py, benchmarks/cross_entropy_rows.py and the other *_rows.py)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from tritonkit import opdef, tuning
from tritonkit.bench import runner

# The sweep's few long rows, where a row a program left most SMs idle (the split kernels' shapes)
FEW_LONG_ROWS = [
    ((4, 13795015), "fp32"),
    ((2, 12291808), "fp16"),
    ((32, 3738195), "bf16"),
    ((100, 784772), "fp32"),
]


def forget() -> None:
    """Forget the replay plans and the configs chosen per call signature: the next call of each
    signature builds its launches and chooses its config again, under the settings of now."""
    opdef.forget_plans()
    tuning.forget_chosen()


def rows_under(case: runner.Case, label: str, module, name: str, value) -> list[dict]:
    """tritonkit's rows for ``case`` with ``module.name = value``, as provider "tritonkit[label]"; the
    setting put back after, and plans and chosen configs forgotten on both sides."""
    default = getattr(module, name)
    setattr(module, name, value)
    forget()
    try:
        rows = runner.run_case(case, ["tritonkit"], "cuda", keep_going=True)
    finally:
        setattr(module, name, default)
        forget()
    return [row | {"provider": f"tritonkit[{label}]"} for row in rows]


def parser(doc: str) -> argparse.ArgumentParser:
    """A row benchmark's command line (its docstring's first line as the description): OUT, the JSON
    to write; --shape ROWSxN:DTYPE, repeatable, in place of the script's shapes; --deadline S."""
    made = argparse.ArgumentParser(description=doc.splitlines()[0])
    made.add_argument("out")
    made.add_argument("--shape", type=shape_argument, action="append", help="ROWSxN:DTYPE (repeatable)")
    made.add_argument("--deadline", type=float, default=None, help="start no case after S seconds")
    return made


def shape_argument(text: str) -> tuple[tuple, str]:
    """A shape given as ROWSxN:DTYPE (a command line's), as runner.cases takes one."""
    dims, dtype = text.split(":")
    return tuple(int(d) for d in dims.split("x")), dtype


def line(case: runner.Case, rows: list[dict]) -> str:
    """One line for a case's rows: each provider's graph-replayed us and eager us, tritonkit against
    its best peer and against each setting ("x label": the setting's time over the default's), its
    share of the copy's bandwidth, and the providers whose check failed."""
    us = {r["provider"]: r["ms"] * 1e3 for r in rows if r.get("ms")}
    eager = {r["provider"]: r["eager_ms"] * 1e3 for r in rows if r.get("eager_ms")}
    ours = us.get("tritonkit")
    peers = [v for k, v in us.items() if not k.startswith("tritonkit")]
    copy = next((r.get("pct_copy_same_bytes") for r in rows if r["provider"] == "tritonkit"), None)
    failed = [r["provider"] for r in rows if r.get("check") == "FAIL"]
    shape = "x".join(map(str, case.shape))
    return " ".join(
        [
            f"{case.workload.name} {shape} {runner.dtype_name(case.dtype)} {case.mode}:",
            ", ".join(f"{k} {v:.1f}" for k, v in us.items()),
            f"us (eager: {', '.join(f'{k} {v:.1f}' for k, v in eager.items())});",
            f"x best peer {min(peers) / ours:.2f}" if ours and peers else "",
            *(f"x {k[10:-1]} {v / ours:.2f}" for k, v in us.items() if ours and k.startswith("tritonkit[")),
            f"{copy:.0f}% of copy" if copy else "",
            f"FAILED {failed}" if failed else "",
        ]
    )


def compare(
    cases,
    settings: dict,
    out: str,
    command: str,
    report: Callable[[str], None],
    deadline: float | None = None,
) -> list[dict]:
    """Each case's rows from every provider, then tritonkit's under each of ``settings`` (label ->
    (module, name, value)); a line a case to ``report`` (a benchmark script's print), and every row
    so far written to ``out`` as JSON with the command that made it after each case. No case starts
    past ``deadline`` seconds."""
    start, rows = time.time(), []
    for case in cases:
        if deadline is not None and time.time() - start > deadline:
            report(f"deadline: {case.workload.name} {case.shape} {case.mode} and later cases not run")
            break
        torch._dynamo.reset()  # torch.compile's peer compiled afresh for each case, as runner.run does
        got = runner.run_case(case, None, "cuda", keep_going=True)
        for label, (module, name, value) in settings.items():
            got += rows_under(case, label, module, name, value)
        rows += got
        report(line(case, got))
        with open(out, "w") as f:
            json.dump({"command": command, "rows": rows}, f, indent=1, default=str)
    return rows
