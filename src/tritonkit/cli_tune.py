"""``tritonkit tune``: tune ops' shape buckets on this GPU, import and export the cache, print
tuned entries, and move the shipped entries onto edited kernels (``--rekey``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from tritonkit import roofline, tuning
from tritonkit.cli_args import workload_shape
from tritonkit.dtypes import DTYPE_OF as DTYPES
from tritonkit.ops import get_op, get_workload, op_names


def cmd_tune(args) -> int:
    from tritonkit._runtime import interpret

    if args.show is not None:
        if args.ops or args.import_file or args.export_file:
            raise ValueError("--show prints tuned entries; it takes no ops, --import or --export")
        return _show_tuning(args)
    if args.tuner or args.where:
        raise ValueError("--tuner and --where filter what --show prints")
    if args.rekey:
        if args.ops or args.import_file or args.export_file:
            raise ValueError("--rekey rewrites the shipped configs; it takes no ops, --import or --export")
        return _rekey(args.rekey)
    if args.import_file:
        if not Path(args.import_file).is_file():
            raise ValueError(f"--import {args.import_file}: no such file (a `tritonkit tune --export` file)")
        print(
            f"imported {tuning.import_cache(Path(args.import_file))} tuned configs into "
            f"{roofline.cache_dir() / tuning.SUBDIR}"
        )
    if args.ops and interpret():
        raise ValueError("tune times kernels: it needs a CUDA GPU (this process interprets them)")
    with tuning.retuning() if args.retune else tuning.enabled():
        for name in args.ops:
            _tune(get_workload(name), args)
    if args.export_file:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.all_devices else None
        count = tuning.export_cache(Path(args.export_file), device)
        print(f"exported {count} tuned configs{f' of {device}' if device else ''} to {args.export_file}")
    if not (args.ops or args.import_file or args.export_file):
        raise ValueError("name ops to tune, or --import / --export a cache")
    return 0


# what tuning.tuner_identities() returns, written out so that it runs on versions that predate it
_IDENTITIES = """
import importlib, json, sys
from tritonkit import ops, tuning
for name in ops.op_names():
    importlib.import_module(ops.OP_MODULES[name])
canonical = lambda value: json.dumps(value, sort_keys=True, separators=(",", ":"))
json.dump({name: {"source_hash": t.source_hash, "configs": canonical(t.configs)}
           for name, t in tuning.TUNERS.items()}, sys.stdout)
"""


def _tuner_identities_at(revision: str) -> dict:
    """:func:`tuning.tuner_identities` of the package as committed at ``revision`` (a git worktree of
    it, imported in a child process that interprets kernels, so no GPU is needed)."""
    import subprocess
    import tempfile

    found = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if found.returncode:
        raise ValueError("--rekey reads the earlier kernels from git: run it inside a checkout of tritonkit")
    root = Path(found.stdout.strip())
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "tree"
        subprocess.run(
            ["git", "-C", str(root), "worktree", "add", "--detach", "-q", str(tree), revision], check=True
        )
        try:
            env = {**os.environ, "PYTHONPATH": str(tree / "src"), "TRITONKIT_INTERPRET": "1"}
            child = subprocess.run(
                [sys.executable, "-c", _IDENTITIES], capture_output=True, text=True, env=env, cwd=scratch
            )
            if child.returncode:
                raise ValueError(f"importing the package at {revision} failed:\n{child.stderr[-2000:]}")
            return json.loads(child.stdout)
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)], check=False)


def _rekey(revision: str) -> int:

    for name in op_names():
        get_op(name)  # defines every tuner
    moved = tuning.rekey_shipped(_tuner_identities_at(revision))
    for tuner, count in sorted(moved.items()):
        print(f"{tuner}: {count} shipped entries re-keyed from {revision}")
    left = tuning.stale_shipped()
    print(
        f"re-keyed {sum(moved.values())} entries; {len(left)} shipped entries are stale"
        + "".join(f"\n  {line}" for line in left[:20])
    )
    return 0


def _show_tuning(args) -> int:
    """Print the entries of an export (or of the cache and the shipped exports) that the filters keep."""

    wanted = {}
    for condition in args.where:
        field, equals, value = condition.partition("=")
        if not (field and equals):
            raise ValueError(f"--where takes FIELD=VALUE, got {condition!r}")
        wanted[field] = value
    if args.show:
        if not Path(args.show).is_file():
            raise ValueError(f"--show {args.show}: no such file (an export of `tritonkit tune --export`)")
        sources = {args.show: tuning.read_export(Path(args.show))}
    else:
        sources = {
            str(roofline.cache_dir() / tuning.SUBDIR): tuning.cached_entries(),
            **{f"shipped {name}": entries for name, entries in tuning.shipped_exports().items()},
        }
    shown, by_tuner = 0, {}
    for source, entries in sources.items():
        kept = [
            e
            for e in entries
            if (args.tuner in (None, e["tuner"]))
            and all(_key_text(e["key"].get(f)) == v for f, v in wanted.items())
        ]
        if kept:
            print(
                f"{source}: {len(kept)} of {len(entries)} entries ({kept[0]['device']}, "
                f"triton {kept[0]['triton']})"
            )
            print(format_tuning(kept))
            shown += len(kept)
            for entry in kept:
                by_tuner[entry["tuner"]] = by_tuner.get(entry["tuner"], 0) + 1
    if shown:
        counts = ", ".join(f"{tuner} {count}" for tuner, count in sorted(by_tuner.items()))
        print(f"{shown} entries shown: {counts} (narrow with --tuner NAME and --where FIELD=VALUE)")
    else:
        print(
            "no tuned entries match"
            + (f" in {args.show}" if args.show else " in this machine's cache or the shipped configs")
        )
    return 0


def _key_text(value) -> str:
    """A key field as typed on the command line: strings as they are, the rest as JSON (null, true)."""
    return value if isinstance(value, str) else json.dumps(value)


def _tune(workload, args) -> None:
    """Run the workload's op on each shape, forward and backward, so each tuner picks its config;
    print them."""
    import time

    from tqdm import tqdm

    from tritonkit import testing

    started = time.time()
    backward = "bwd" in args.mode
    op = workload.op
    shapes = (
        [(workload_shape(workload, [s], "tune"), None) for s in args.shape]
        if args.shape
        else workload.shape_list("quick")
    )
    for shape, dtype_name in tqdm(shapes, desc=f"tune {workload.name}", unit="shape"):
        dtype = DTYPES[args.dtype or dtype_name or "bf16"]
        inputs = op.make_inputs(shape, dtype, "cuda", testing.generator(0))
        for i in op.grad_inputs:
            inputs[i].requires_grad_(backward)
        outputs = testing.as_tuple(op.fn(*inputs, **workload.call_kwargs))  # a bucket's first call tunes
        if backward:
            torch.autograd.grad(
                outputs, [inputs[i] for i in op.grad_inputs], [torch.ones_like(o) for o in outputs]
            )
    torch.cuda.synchronize()
    fresh = tuning.cached_entries(since=started)
    if not fresh:
        print(
            f"{workload.name}: nothing tuned: every shape bucket had a winner, cached in "
            f"{roofline.cache_dir() / tuning.SUBDIR} or shipped with tritonkit (--retune tunes "
            "them again; tune --show prints them)"
        )
    else:
        print(format_tuning(fresh))


def format_tuning(entries: list[dict]) -> str:
    """Each tuning entry: its winner, every admitted config's time and error, each rejection."""
    lines = []
    for entry in entries:
        errors = entry.get("error", {})
        lines.append(f"{entry['tuner']} {entry['key']}: {entry['config']}")
        for ms, config in sorted((ms, c) for c, ms in entry["ms"].items() if ms is not None):
            error = f"err {errors[config]:.2e}" if config in errors else ""
            lines.append(f"  {ms * 1e3:9.1f} us  {error:>12}  {config}")
        for config, reason in entry["rejected"].items():
            error = f" (err {errors[config]:.2e})" if config in errors else ""
            lines.append(f"  rejected   {config}: {reason}{error}")
    return "\n".join(lines)
