"""The rotary kernel's launch swept at the issue's two shapes, Hugging Face's
``apply_rotary_pos_emb`` forward (q and k in one launch), beside torch.compile of the reference:
the tile (``rotary.TILE_ELEMENTS``, tokens x heads x rotary pairs a program, and
``rotary.NUM_WARPS``), or with ``--groups`` the programs' order (token blocks a group, each group's
head blocks one after another; a group as long as the sequence has each head block walk every
token), each size forced and then the size ``rotary._group`` picks, or with ``--heads`` the heads a
tile holds at most (``rotary.TILE_HEADS``) at the default tile: fewer heads, longer runs of tokens.

    python benchmarks/rotary_tiles.py OUT.json [--groups 1 4 16 64 1073741824 | --heads 1 2 4 8] [--flushed]
        [--shared-tables]

Times are CUDA-graph replays (``triton.testing.do_bench_cudagraph``, 200 ms), in us, the L2 kept
warm from one replay to the next; with ``--flushed``, the benchmark tables' protocol
(``tritonkit.bench.timing.kernel_ms``: the L2 flushed before each call). The cos and sin tables are
(B, S, D), Hugging Face's (a row a token of each sequence), or with ``--shared-tables`` (S, D), one
for every sequence, as the benchmark tables' inputs (``rotary._make_inputs``). Each variant's
launch is built anew (``rotary._launch``), not replayed from an earlier call's plan, which would
keep the first variant's.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton.testing

from tritonkit.bench import timing
from tritonkit.bench.runner import provenance
from tritonkit.ops import rotary

SHAPES = [(4, 32, 8, 4096, 128), (1, 32, 8, 32768, 128)]  # (B, Hq, Hkv, S, D), bf16
TILES = (2048, 4096, 8192, 16384)
WARPS = (4, 8)


FLUSHED = False  # --flushed: time as the tables do
SHARED_TABLES = False  # --shared-tables: (S, D) tables, as the tables' inputs


def _us(fn) -> float:
    if FLUSHED:
        (_, median, _), _ = timing.kernel_ms([lambda: fn])
        return median * 1e3
    return triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3


def _fixed_group(group: int, *rule_args) -> int:
    return group


def _forward(q, k, cos, sin):
    """The forward's launch with the module's current settings, and its outputs."""
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    views = [t.transpose(1, 2) for t in (q, q_out, k, k_out)]
    launch = rotary._launch(*views, rotary.Tables(cos, sin, True, False, 0, None, 0), conjugate=False)
    return launch, (q_out, k_out)


def _row(variants: dict, batch: int, heads_q: int, heads_kv: int, seq: int, head_dim: int) -> dict:
    """us of torch.compile and of each variant (name -> settings of the module) at one shape; each
    variant's outputs equal to the compiled reference's."""
    g = torch.Generator(device="cuda").manual_seed(0)
    table = (seq, head_dim) if SHARED_TABLES else (batch, seq, head_dim)
    shapes = ((batch, heads_q, seq, head_dim), (batch, heads_kv, seq, head_dim), table)
    q, k, cos, sin = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for shape in (*shapes, shapes[2])
    )
    compiled = torch.compile(rotary.rotary_pos_emb_reference)
    expected = compiled(q, k, cos, sin)
    us = {"torch.compile": _us(lambda: compiled(q, k, cos, sin))}
    for name, settings in variants.items():
        default = {key: getattr(rotary, key) for key in settings}
        for key, value in settings.items():
            setattr(rotary, key, value)
        launch, outputs = _forward(q, k, cos, sin)
        for key, value in default.items():
            setattr(rotary, key, value)
        launch.run()
        for got, want in zip(outputs, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=f"{name}: wrong output")
        us[name] = _us(launch.run)
    return us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    sweep = parser.add_mutually_exclusive_group()
    sweep.add_argument("--groups", type=int, nargs="+", help="sweep the order at the default tile")
    sweep.add_argument("--heads", type=int, nargs="+", help="sweep the heads a tile at the default tile")
    parser.add_argument("--flushed", action="store_true", help="flush the L2 before each call, as the tables")
    parser.add_argument("--shared-tables", action="store_true", help="(S, D) tables, as the tables' inputs")
    args = parser.parse_args()
    global FLUSHED, SHARED_TABLES
    FLUSHED, SHARED_TABLES = args.flushed, args.shared_tables
    if args.heads:
        variants = {f"{h} heads": {"TILE_HEADS": h} for h in args.heads}
    elif args.groups:
        # each group size forced over the rule (rotary._group), and the rule's own choice
        variants = {f"group {g}": {"_group": functools.partial(_fixed_group, g)} for g in args.groups}
        variants["the rule"] = {}
    else:
        variants = {f"{t}/{w}": {"TILE_ELEMENTS": t, "NUM_WARPS": w} for t in TILES for w in WARPS}
    command = "python benchmarks/rotary_tiles.py OUT.json"
    for flag, values in (("--groups", args.groups), ("--heads", args.heads)):
        command += f" {flag} " + " ".join(map(str, values)) if values else ""
    command += " --flushed" if args.flushed else ""
    command += " --shared-tables" if args.shared_tables else ""
    result = {"op": "rotary_tiles", "command": command, "gpu": torch.cuda.get_device_name()}
    result["method"] = "timing.kernel_ms (L2 flushed)" if args.flushed else "do_bench_cudagraph, 200 ms"
    result |= {"torch": torch.__version__, "triton": triton.__version__, "git": provenance()["git_sha"]}
    result["rows"] = []
    for shape in SHAPES:
        us = _row(variants, *shape)
        result["rows"].append({"shape": list(shape), "us": us})
        print(shape, {name: round(t, 1) for name, t in us.items()}, flush=True)
        with open(args.out, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
