"""The command line: ``tritonkit info | bench | roofline | inspect | tune``."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

from tritonkit import __version__, roofline, tuning
from tritonkit.asm import ARCHS, IRS  # stdlib and torch only: no kernel is defined here
from tritonkit.bench.layer import CASES as LAYER_CASES  # likewise
from tritonkit.bench.model import CASES as MODEL_CASES  # likewise
from tritonkit.bench.sweep import WORKLOADS as SWEEP_WORKLOADS  # likewise
from tritonkit.cli_args import parse_shape, workload_dtype, workload_shape
from tritonkit.cli_tune import cmd_tune
from tritonkit.dtypes import DTYPE_OF
from tritonkit.ops import MODES, get_workload, workload_names

DTYPES = DTYPE_OF


# what README's "Install, versions, support" says the suite and the benchmarks ran on
TESTED = (
    "CI with Python 3.11, torch 2.13 (CPU build), Triton 3.6.0; "
    "an H200 or an H100 (sm_90) with torch 2.11, Triton 3.6.0"
)


def _spec_lines(spec: roofline.DeviceSpec) -> list[str]:
    peaks = ", ".join(f"{unit} {value / 1e12:.1f}" for unit, value in spec.peak_flops.items())
    return [f"  bandwidth: {spec.bandwidth / 1e12:.2f} TB/s", f"  peak TFLOP/s: {peaks}"]


def cmd_info(args) -> int:
    from tritonkit._runtime import interpret

    interpreted = interpret()
    named = roofline.device_spec(args.device) if args.device else None  # a bad name: the error alone
    import triton

    print(
        f"tritonkit {__version__}  torch {torch.__version__}  triton {triton.__version__}  "
        f"python {platform.python_version()}"
    )
    print(f"kernels: {'Triton interpreter on the CPU' if interpreted else 'compiled for the GPU'}")
    from tritonkit.integrations.transformers import TESTED_VERSIONS

    print(f"tested: {TESTED}; transformers {TESTED_VERSIONS}")

    print(f"tuning cache: {roofline.cache_dir() / tuning.SUBDIR} (TRITONKIT_CACHE_DIR moves it)")
    print(
        "tuning on a key's first call: "
        + (
            "off: the interpreter runs each kernel's default config"
            if interpreted
            else "on"
            if tuning.autotune_on()
            else "off: cached, shipped or default configs"
        )
        + f" ({tuning.AUTOTUNE_VARIABLE}=1 or `tritonkit tune` tunes)"
    )
    if not torch.cuda.is_available():
        print("device: no CUDA GPU")
        spec = named or roofline.device_spec("h200")
        print(f"datasheet ceilings of {spec.name} (dense, for `tritonkit roofline`):")
        print("\n".join(_spec_lines(spec)))
        return 0
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    print(
        f"device: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB, "
        f"L2 {props.L2_cache_size / 2**20:.0f} MiB, CUDA {torch.version.cuda}"
    )
    datasheet = named or roofline.device_spec(props.name)
    print(f"datasheet ceilings ({datasheet.name}, dense):")
    print("\n".join(_spec_lines(datasheet)))
    measured = roofline.measured_ceilings(refresh=args.refresh)
    print(f"measured ceilings (cached in {roofline.cache_dir() / roofline.CACHE_FILE}):")
    print(f"  copy bandwidth: {measured.bandwidth / 1e12:.2f} TB/s (device-to-device, read + write)")
    for unit in ("bf16", "fp16", "fp8"):
        if measured.peak_flops.get(unit) != datasheet.peak_flops.get(unit):
            print(
                f"  {unit} matmul: {measured.peak_flops[unit] / 1e12:.0f} TFLOP/s (cuBLAS, "
                f"{roofline.MATMUL_SIZE}^3)"
            )
    return 0


def cmd_roofline(args) -> int:
    if args.plot:
        from tritonkit.bench.report import plot_results

        datasheet = roofline.device_spec(args.device)
        measured = Path(args.results) / datasheet.slug
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        ops = plot_results(Path(args.results), datasheet, Path(args.plot))
        points = (
            f"benchmarked points from {measured}"
            if measured.is_dir()
            else f"no benchmarked points ({measured} does not exist: --results names a checkout's "
            "benchmarks/results)"
        )
        print(
            f"wrote {args.plot}: {datasheet.name} roofline, {points}, roofline positions of {', '.join(ops)}"
        )
        if not (args.op or args.shape):
            return 0
    if not (args.op and args.shape):
        raise ValueError("roofline needs an OP and --shape (or --plot alone)")
    workload = get_workload(args.op)
    shape = workload_shape(workload, args.shape, "roofline")
    dtype = workload_dtype(workload, args.dtype)
    cost = workload.cost(shape, dtype, args.mode)
    device = roofline.device_spec(args.device)
    unit = workload.flop_unit
    seconds = roofline.roofline_seconds(cost, device, unit)
    print(f"{args.op} {args.mode} {'x'.join(map(str, shape))} {args.dtype} on {device.name} (datasheet)")
    print(f"  bytes: {cost.bytes:.4g}   FLOPs: {cost.flops:.4g}   intensity: {cost.intensity:.3g} FLOP/B")
    bound = roofline.bound_by(cost, device, unit)
    print(f"  ridge point ({unit}): {device.ridge(unit):.3g} FLOP/B -> {bound}-bound")
    print(
        f"  memory time: {cost.bytes / device.bandwidth * 1e3:.4g} ms   "
        f"compute time: {cost.flops / device.peak(unit) * 1e3:.4g} ms"
    )
    print(
        f"  roofline: {seconds * 1e3:.4g} ms "
        f"({cost.bytes / seconds / 1e9:.0f} GB/s, {cost.flops / seconds / 1e12:.3g} TFLOP/s)"
    )
    return 0


def cmd_bench_layer(args) -> int:
    """``tritonkit bench layer``: the decoder layer's training step and forward (bench.layer)."""
    from tritonkit._runtime import interpret
    from tritonkit.bench import layer

    if args.ops != [layer.OP]:
        raise ValueError(f"layer is benchmarked on its own: `tritonkit bench layer`, not with {args.ops}")
    if unknown := [c for c in args.case or [] if c not in layer.CASES]:
        raise ValueError(f"bench layer's cases are {', '.join(layer.CASES)}, not {', '.join(unknown)}")
    modes = args.mode or list(layer.MODES)
    if "bwd" in modes:
        raise ValueError(f"the layer times {' and '.join(layer.MODES)} (a step and its forward), not bwd")
    dtypes = args.dtype or ["bf16"]
    if len(dtypes) != 1 or dtypes[0] not in ("bf16", "fp16"):
        raise ValueError(f"the layer runs in one of bf16 and fp16, got --dtype {' '.join(dtypes)}")
    if interpret():
        print("Correctness run in Triton's interpreter (no GPU): the tiny layer, checked, not timed")
        if args.case:
            print("--case does not apply: the interpreter runs the tiny layer")
    command = "tritonkit " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    out = Path(args.out)

    def save(rows: list[dict]) -> None:  # after every case: a run stopped later keeps the cases done
        if not interpret():
            layer.write_results([row | {"command": command} for row in rows], out)

    with tuning.enabled():  # tritonkit's rows with tuned configs, as the kernel tables'
        rows, not_run = _run_layer(args, layer, modes, dtypes, save)
    rows = [row | {"command": command} for row in rows]
    if rows:
        print(layer.markdown_table(rows))
    if rows and not interpret():
        for path in layer.write_results(rows, out):
            print(f"wrote {path}")
    if not_run:
        print(f"not run (past --time-limit {args.time_limit:g} s): {', '.join(not_run)}")
    failed = [r for r in rows if r.get("check") == "FAIL"]
    if failed:
        print(f"{len(failed)} layer rows FAILED the check against torch", file=sys.stderr)
    return 1 if failed else 0


def _run_layer(args, layer, modes: list[str], dtypes: list[str], save) -> tuple[list[dict], list[str]]:
    return layer.run(
        args.case or list(layer.CASES),
        dtype=DTYPES[dtypes[0]],
        providers=args.providers or layer.PROVIDERS,
        modes=modes,
        progress=not args.no_progress,
        report=functools.partial(print, file=sys.stderr, flush=True) if args.no_progress else None,
        on_case=save,
        time_limit=args.time_limit,
    )


def cmd_bench_model(args) -> int:
    """``tritonkit bench model``: a transformers model's training step and generation (bench.model)."""
    from tritonkit._runtime import interpret
    from tritonkit.bench import model

    if args.ops != [model.OP]:
        raise ValueError(f"the model is benchmarked on its own: `tritonkit bench model`, not with {args.ops}")
    if args.mode or args.dtype or args.shapes or args.time_limit is not None:
        raise ValueError(
            "bench model takes --case, --providers, --layers and --no-generate (bf16, its own modes)"
        )
    cases = args.case or list(model.CASES)
    if unknown := [c for c in cases if c not in model.CASES]:
        raise ValueError(f"bench model's cases are {', '.join(model.CASES)}, not {', '.join(unknown)}")
    if interpret():
        raise ValueError(
            "bench model times a model on a CUDA GPU; on the CPU, tests/test_transformers.py checks the "
            "patched models against the unpatched ones"
        )
    providers = args.providers or [p for p in model.PROVIDERS if model.available(p)]
    if unknown := [p for p in providers if p not in model.PROVIDERS]:
        raise ValueError(
            f"bench model's providers are {', '.join(model.PROVIDERS)}, not {', '.join(unknown)}"
        )
    providers = [p for p in model.PROVIDERS if p in providers]  # liger last: its patches are global
    command = "tritonkit " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    report = functools.partial(print, file=sys.stderr, flush=True)
    rows = []
    for case in cases:  # each case's rows written as it ends: a run stopped later keeps them
        with tuning.enabled():  # tritonkit's rows with tuned configs, as the kernel tables'
            rows += [
                row | {"command": command}
                for row in model.run_case(
                    case, args.layers or model.LAYERS, providers, report, generate=not args.no_generate
                )
            ]
        paths = model.write_results(rows, Path(args.out))
    print(model.markdown_table(rows))
    for path in paths:
        print(f"wrote {path}")
    return 0


# the op tables' options (bench OP ...), by the attribute each sets: the layer's and the model's
# runs take none (a stopped layer run given --resume started over, silently)
_OP_TABLE_FLAGS = {"--resume": "resume", "--only": "only", "--shapes": "shapes", "--sweep": "sweep"}


def _refuse_op_table_flags(args, what: str) -> None:
    given = [
        flag
        for flag, attribute in _OP_TABLE_FLAGS.items()
        if getattr(args, attribute) not in (None, False, [])
    ]
    if given:
        raise ValueError(f"{', '.join(given)}: the op tables' options, not `tritonkit bench {what}`'s")


def cmd_bench(args) -> int:
    from tritonkit._runtime import interpret
    from tritonkit.bench import add_peer_ratios, format_table, run, write_results
    from tritonkit.bench import sweep as bench_sweep
    from tritonkit.bench.providers import providers_for
    from tritonkit.bench.report import UNCHECKED, append_checkpoint, checkpoint_path, read_checkpoint
    from tritonkit.bench.runner import provenance

    if args.merge:  # shards' sweeps as one: the rows are written as they are
        rows = bench_sweep.merge([Path(folder) for folder in args.merge])
        print(
            bench_sweep.markdown(rows),
            *(f"wrote {p}" for p in bench_sweep.write(rows, Path(args.out))),
            sep="\n",
        )
        return 0
    if (args.shard or args.seed is not None) and args.sweep is None:
        raise ValueError("--shard and --seed are a sweep's (its shapes' split and draw): give --sweep N too")
    if "layer" in args.ops:
        if args.layers is not None or args.no_generate:
            raise ValueError("--layers and --no-generate are the model benchmark's: `tritonkit bench model`")
        _refuse_op_table_flags(args, "layer")
        return cmd_bench_layer(args)
    if "model" in args.ops:
        _refuse_op_table_flags(args, "model")
        return cmd_bench_model(args)
    if args.layers is not None or args.no_generate:
        raise ValueError("--layers and --no-generate are the model benchmark's: `tritonkit bench model`")
    if args.case:
        raise ValueError("--case is the layer's and the model's: `tritonkit bench layer` or `bench model`")
    if args.time_limit is not None:
        raise ValueError("--time-limit is the layer's: `tritonkit bench layer`")
    # Read by torch's CUDA allocator when it starts (nothing here has used CUDA yet). The float64
    # reference of the 262144-class cross-entropy backward asked for 16 GB and ran out of memory
    # beside 79 GB reserved in pieces too small for it, with the caching allocator's fixed segments.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sweep = args.sweep is not None
    if sweep:
        if args.shapes is not None or args.only:
            raise ValueError("--shapes and --only do not apply to --sweep: it draws its own shapes")
        names = bench_sweep.check_workloads(args.ops)
        draw = bench_sweep.interpreter_shapes if interpret() else bench_sweep.sample_shapes
        shapes = draw(args.sweep, args.seed or 0)
        shapes = bench_sweep.shard(shapes, args.shard) if args.shard else shapes
        if not shapes:
            raise ValueError(f"shard {args.shard} of a sweep of {args.sweep} shapes has no shapes")
    else:
        names, shapes = args.ops or workload_names(), args.shapes or "quick"
    known = {p.name for name in names for p in providers_for(get_workload(name))}  # unknown names fail here
    unknown = sorted(set(args.providers or ()) - known)
    if unknown:
        raise ValueError(f"unknown providers {unknown}; known: {sorted(known)}")
    if interpret() and not sweep and shapes != "quick":
        print(f"--shapes {shapes} does not apply: the interpreter runs each op's small shapes")
    dtypes = [DTYPES[d] for d in args.dtype] if args.dtype else None
    providers = args.providers
    if sweep and providers is None:  # the peers; tritonkit's named variants are diagnostics
        providers = sorted(known - {name for name in known if name.startswith("tritonkit[")})
    command = "tritonkit " + " ".join(shlex.quote(a) for a in sys.argv[1:] if a != "--resume")
    checkpoint, done = None, []
    if interpret():
        if args.resume:
            print("--resume does not apply: an interpreter run keeps no checkpoint")
    else:
        checkpoint = checkpoint_path(Path(args.out), provenance()["gpu"], command)
        if args.resume:
            done, left_out = read_checkpoint(checkpoint, {"command": command, **provenance()})
            print(
                f"resuming from {checkpoint}: {len(done)} rows kept"
                + (f", {left_out} of another command, commit or version left out" if left_out else "")
            )
        else:
            checkpoint.unlink(missing_ok=True)

    def save(case_rows: list[dict]) -> None:
        append_checkpoint(checkpoint, [row | {"command": command} for row in case_rows])

    with (
        # the tables are of tuned configs (tuned here where nothing is cached or shipped); the sweep's
        # of untuned calls, as a user's first call runs
        bench_sweep.untuned_calls() if sweep else tuning.enabled(),
        bench_sweep.sweep_timing() if sweep else contextlib.nullcontext(),
    ):
        rows = run(
            names,
            shapes=shapes,
            dtypes=dtypes,
            modes=args.mode or (["fwd", "bwd"] if sweep else list(MODES)),
            providers=providers,
            progress=not args.no_progress,
            done=done,
            on_case=save if checkpoint else None,
            report=functools.partial(print, file=sys.stderr, flush=True) if args.no_progress else None,
            compile_per_shape=not sweep,
            keep_going=sweep,
            only=[parse_shape([shape], "--only") for shape in args.only] if args.only else None,
        )
    for row in rows:
        row["command"] = command
    failed = [r for r in rows if r.get("check") == "FAIL"]
    if interpret():
        print(
            "Correctness run in Triton's interpreter (no GPU): errors against the float64 "
            "reference, and the analytic H200 roofline time, not timings."
        )
        print(format_table(rows, interpreter=True))
    else:
        add_peer_ratios(rows)
        print(bench_sweep.markdown(rows) if sweep else format_table(rows))
        if sweep:
            paths = bench_sweep.write(rows, Path(args.out))
        else:  # some shapes of a table (--only): their rows replace theirs, the table's others stay
            paths = write_results(rows, Path(args.out), merge=bool(args.only))
        for path in paths:
            print(f"wrote {path}" + (" (the table's other shapes kept)" if args.only else ""))
        checkpoint.unlink(missing_ok=True)  # the results hold every row now
    if failed:
        print(f"{len(failed)} rows FAILED the error check", file=sys.stderr)
    unchecked = [r for r in rows if r.get("check") == UNCHECKED]
    if unchecked:  # timed, but their float64 reference did not fit in the device's memory
        print(f"{len(unchecked)} rows not checked: {unchecked[0]['error']}", file=sys.stderr)
    return 1 if failed else 0


def _compile_natively() -> None:
    """inspect compiles real kernels: choose native compilation before anything imports triton."""
    from tritonkit import _runtime

    if _runtime.OVERRIDE_ENV not in os.environ and "triton" not in sys.modules:
        # compiling needs no GPU, only Triton's compiler; ``import tritonkit`` chose the interpreter
        # on a torch without a GPU backend, a choice nothing has acted on until triton is imported
        os.environ[_runtime.OVERRIDE_ENV] = "0"
        _runtime.interpret.cache_clear()
    if _runtime.interpret():
        raise ValueError(
            f"inspect compiles kernels, which {_runtime.OVERRIDE_ENV}=1 (or triton imported for the "
            "interpreter) forbids: run it in a process of its own, without TRITONKIT_INTERPRET=1"
        )


def _parse_config(text: str | None, flag: str) -> dict | None:
    if text is None:
        return None
    try:
        config = json.loads(text)
    except ValueError:
        raise SystemExit(
            f'{flag} takes a JSON object like \'{{"BLOCK_M": 4, "num_warps": 8}}\', got {text}'
        ) from None
    if not isinstance(config, dict):
        raise SystemExit(f"{flag} takes a JSON object, got {text}")
    return config


def cmd_inspect(args) -> int:
    # malformed flags refused before the process is set up to compile (or imports Triton)
    configs = [_parse_config(args.config, "--config")]
    if args.diff:
        configs.append(_parse_config(args.diff, "--diff"))
    _compile_natively()
    from tritonkit import asm

    if args.fingerprints:
        return _fingerprints(args)
    if args.op is None or args.against:
        raise ValueError("name an op to inspect (or write --fingerprints, optionally --against another file)")
    workload = get_workload(args.op)
    if workload.op.inspect is None:
        raise ValueError(f"{args.op} does not describe its launches for inspect")
    default_shape, default_dtype = workload.shape_list("quick")[0]
    shape = workload_shape(workload, args.shape, "inspect") if args.shape else default_shape
    dtype_name = args.dtype or default_dtype or "bf16"
    dtype = workload_dtype(workload, dtype_name)
    print(f"{args.op} {'x'.join(map(str, shape))} {dtype_name} compiled for {args.arch} (not launched)")
    reports = []
    for config in configs:
        try:
            launches = workload.launches(shape, dtype, config)
        except KeyError as missing:
            raise ValueError(
                f"the config lacks {missing}: give a whole config (`tritonkit tune --show` lists tuned ones)"
            ) from None
        except TypeError as error:  # a value of the wrong type (a tile size as a string)
            if config is None:
                raise
            given = json.dumps(config)
            raise ValueError(f"the config {given} is not one the kernels take: {error}") from None
        reports.append([_compile(asm, launch, args.arch, config) for launch in launches])
        print(asm.format_reports(reports[-1]))
    if args.diff:
        print(asm.format_diff(reports[0], reports[1]))
    for report in reports[0] if args.ir or args.out else ():
        irs = [args.ir] if args.ir else list(IRS)
        for ir in irs:
            if args.out:
                path = Path(args.out) / f"{args.op}-{report.name.replace(' ', '-')}-{args.arch}.{ir}"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(report.asm[ir])
                print(f"wrote {path}")
            else:
                print(f"---- {report.name}: {ir} ----\n{report.asm[ir]}")
    return 0


def _compile(asm, launch, arch: str, config: dict | None):
    """``launch`` compiled for ``arch``; a config the command line gave that Triton cannot compile
    (a num_warps not a power of two, a tile of a string) is one line of error, not a traceback."""
    if config is None:
        return asm.compile_launch(launch, arch)
    try:
        return asm.compile_launch(launch, arch)
    except Exception as error:  # Triton's compiler raises assertions, type and compilation errors
        first = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise ValueError(f"compiling the config {json.dumps(config)} for {arch} failed: {first}") from None


def _fingerprints(args) -> int:
    """Write the SASS fingerprint of every launch the workloads make at their shapes with their
    untuned configs (all workloads, or the one named) to a JSON file; with --against, compare it with an
    earlier one (1 if any launch compiles differently). What shows that a source-only change kept
    every kernel, so its shipped tunings still describe them (tune --rekey)."""
    from tritonkit import asm

    if args.against and not Path(args.against).is_file():  # before the compiles, not after
        raise ValueError(f"--against {args.against}: no such file (an earlier --fingerprints file)")
    names = [args.op] if args.op else [n for n in workload_names() if get_workload(n).op.inspect is not None]
    prints = {}
    for name in names:
        workload = get_workload(name)
        for shape, dtype in workload.shape_list("quick"):
            for launch in workload.launches(shape, DTYPES[dtype or "bf16"], None):
                report = asm.compile_launch(launch, args.arch)
                label = f"{name} {'x'.join(map(str, shape))} {dtype or 'bf16'} {report.name}"
                prints[label] = {"sass": asm.fingerprint(report.asm["sass"]), "registers": report.registers}
    Path(args.fingerprints).parent.mkdir(parents=True, exist_ok=True)
    Path(args.fingerprints).write_text(json.dumps(prints, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(prints)} launch fingerprints ({args.arch}) to {args.fingerprints}")
    if not args.against:
        return 0
    earlier = json.loads(Path(args.against).read_text())
    differ = [label for label in prints if label in earlier and earlier[label] != prints[label]]
    missing = [label for label in prints if label not in earlier]
    for label in differ:
        print(f"  differs: {label}: {earlier[label]} -> {prints[label]}")
    print(
        f"{len(prints) - len(differ) - len(missing)} of {len(prints)} launches compile as in {args.against}"
        f" ({len(differ)} differ, {len(missing)} not there)"
    )
    return 1 if differ else 0


def build_parser() -> argparse.ArgumentParser:
    description = (
        "tritonkit's kernels from the command line: check and time them, their rooflines, their "
        "compiled code, their tuning. `tritonkit COMMAND --help` says more."
    )
    parser = argparse.ArgumentParser(prog="tritonkit", description=description, allow_abbrev=False)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what tritonkit decides")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", allow_abbrev=False, help="device, versions, ceilings and interpreter mode")
    info.add_argument("--device", help="datasheet to show (h200, h100, a100); default: this GPU")
    info.add_argument("--refresh", action="store_true", help="measure the ceilings again")
    info.set_defaults(func=cmd_info)

    bench = sub.add_parser("bench", allow_abbrev=False, help="check and time ops against their peers")
    bench.add_argument(
        "ops",
        nargs="*",
        metavar="OP",
        help=f"workloads (default all: {', '.join(workload_names())}), or `layer`: a decoder layer's "
        "training step, or `model`: a transformers model's training step and generation",
    )
    bench.add_argument(
        "--mode", nargs="+", choices=MODES, help="default: every mode (the layer: fwd+bwd, fwd)"
    )
    bench.add_argument("--dtype", nargs="+", choices=sorted(DTYPES))
    bench.add_argument(
        "--shapes", choices=("quick", "full"), help="the workloads' shape lists (default quick)"
    )
    bench.add_argument(
        "--only",
        nargs="+",
        metavar="SHAPE",
        help="run only the cases of these shapes of the shape list (AxB..., as the tables write "
        "them: 8192x262144), e.g. a case to measure again in a process of its own; their rows "
        "replace those cases' rows in the table already in --out, whose other shapes stay",
    )
    bench.add_argument(
        "--sweep",
        type=int,
        metavar="N",
        help=f"N shapes drawn log-uniformly for each of {', '.join(SWEEP_WORKLOADS)}, fwd and "
        "bwd, untuned as a first call runs; writes <out>/<gpu>/sweep.{json,md,png}",
    )
    bench.add_argument("--seed", type=int, help="with --sweep: the draw's seed (default 0)")
    bench.add_argument("--shard", metavar="I/N", help="with --sweep: its shapes I, I + N, ... (a GPU each)")
    bench.add_argument("--merge", nargs="+", metavar="DIR", help="shards' --out folders: one sweep, to --out")
    bench.add_argument("--providers", nargs="+", help="providers to run (default: all available)")
    bench.add_argument("--out", default="benchmarks/results", help="results folder (GPU runs)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar: a line per case instead")
    bench.add_argument(
        "--resume",
        action="store_true",
        help="go on with an interrupted GPU run of the same command: the cases in its "
        "checkpoint (<out>/<gpu>/bench-checkpoint-<hash of the command>.jsonl) are not run again",
    )
    bench.add_argument(
        "--case",
        nargs="+",
        choices=list(LAYER_CASES) + list(MODEL_CASES),
        help=f"with layer: the layer shapes ({', '.join(LAYER_CASES)}); with model: the models "
        f"({', '.join(MODEL_CASES)}); default all",
    )
    bench.add_argument(
        "--layers", type=int, metavar="N", help="with model: the decoder layers a model keeps (default 4)"
    )
    bench.add_argument("--no-generate", action="store_true", help="with model: the training step only")
    bench.add_argument(
        "--time-limit",
        type=float,
        metavar="S",
        help="with layer: start a case only if, at the pace of the longest case so far, the run "
        "would end within S seconds; the cases left are listed as not run",
    )
    bench.set_defaults(func=cmd_bench)

    roof = sub.add_parser(
        "roofline", allow_abbrev=False, help="analytic roofline prediction for one op and shape"
    )
    roof.add_argument("op", nargs="?", choices=workload_names())
    roof.add_argument("--shape", nargs="+", help="e.g. 8192x4096 or 8192 4096")
    roof.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    roof.add_argument("--mode", choices=MODES, default="fwd")
    roof.add_argument("--device", default="h200", help="datasheet: h200, h100, a100, a100-40gb")
    roof.add_argument(
        "--plot",
        metavar="PNG",
        help="draw the device's roofline with every op's latest benchmarked points and roofline positions",
    )
    roof.add_argument("--results", default="benchmarks/results", help="with --plot: the results folder")
    roof.set_defaults(func=cmd_roofline)

    insp = sub.add_parser(
        "inspect",
        allow_abbrev=False,
        help="compile an op's kernels for a GPU without one: registers, spills, "
        "access widths, instruction mix, IR",
    )
    insp.add_argument("op", nargs="?", choices=workload_names())
    insp.add_argument("--shape", nargs="+", help="e.g. 8192x4096 (default: the op's first benchmark shape)")
    insp.add_argument("--dtype", choices=sorted(DTYPES), help="default: the shape's benchmark dtype")
    insp.add_argument("--arch", choices=sorted(ARCHS), default="sm_90")
    insp.add_argument("--config", help="a tuning config as JSON (default: the untuned config)")
    insp.add_argument("--diff", help="a second config as JSON, compared with --config")
    insp.add_argument("--ir", choices=IRS, help="print this IR of each kernel (with -o: write only it)")
    insp.add_argument("-o", "--out", help="write the IRs to this folder instead of printing them")
    insp.add_argument(
        "--fingerprints",
        metavar="FILE",
        help="write each launch's SASS fingerprint (every workload, or OP) at its shapes",
    )
    insp.add_argument("--against", metavar="FILE", help="with --fingerprints: compare with an earlier file")
    insp.set_defaults(func=cmd_inspect)

    tune = sub.add_parser(
        "tune",
        allow_abbrev=False,
        help="tune ops on this GPU (accuracy-gated); move the cache between machines of one GPU model",
    )
    tune.add_argument(
        "ops", nargs="*", metavar="OP", help=f"ops to tune, by workload ({', '.join(workload_names())})"
    )
    tune.add_argument(
        "--shapes",
        "--shape",
        dest="shape",
        nargs="+",
        help="shapes like 8192x4096 (default: the op's benchmark shapes)",
    )
    tune.add_argument("--dtype", choices=sorted(DTYPES), help="default: each benchmark shape's dtype")
    tune.add_argument("--mode", nargs="+", choices=("fwd", "bwd"), default=["fwd", "bwd"])
    tune.add_argument("--export", dest="export_file", metavar="FILE", help="write the cache to FILE")
    tune.add_argument("--all-devices", action="store_true", help="with --export: every GPU's entries")
    tune.add_argument("--import", dest="import_file", metavar="FILE", help="add FILE's entries to the cache")
    tune.add_argument(
        "--retune",
        action="store_true",
        help="tune every bucket again, even where the cache or shipped configs hold a winner",
    )
    tune.add_argument(
        "--rekey",
        metavar="REV",
        help="move the shipped configs tuned on the kernels as committed at REV to these, "
        "where only their source text changed (check that the SASS did not)",
    )
    tune.add_argument(
        "--show",
        nargs="?",
        const="",
        metavar="FILE",
        help="print tuned winners with every config's time and error: FILE's (an export), "
        "else this machine's cache and the configs the package ships; needs no GPU",
    )
    tune.add_argument("--tuner", help="with --show: only this tuner's entries (softmax_fwd, norm_bwd, ...)")
    tune.add_argument(
        "--where",
        nargs="+",
        default=[],
        metavar="FIELD=VALUE",
        help="with --show: only entries whose key has these values, e.g. block_n=131072",
    )
    tune.set_defaults(func=cmd_tune)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.func(args)
    except (ValueError, OSError) as error:  # bad input, or a file that cannot be read or written
        print(f"tritonkit: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
