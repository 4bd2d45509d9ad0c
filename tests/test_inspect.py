"""tritonkit inspect: kernels compiled for a GPU on a machine without one, and what the report reads.

Compilation runs in child processes (`tritonkit inspect`, natively compiled); specialization,
occupancy and the SASS parsing are checked here on their own. The static checks every op's
default configs must pass on sm_90 live here too: a codegen regression fails CI with no GPU.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import types

import pytest
import torch

import sm90
from tritonkit import asm
from tritonkit._launch import Launch
from tritonkit.ops import get_op, get_workload, workload_names

pytestmark = pytest.mark.infra


def _cli(*args: str, interpret: str | None = "0") -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if name != "TRITONKIT_INTERPRET"}
    env |= {} if interpret is None else {"TRITONKIT_INTERPRET": interpret}
    return subprocess.run(
        [sys.executable, "-m", "tritonkit.cli", "inspect", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_fingerprints_tell_which_launches_compile_differently(tmp_path):
    """Every launch of an op at its benchmark shapes, fingerprinted; against an earlier file whose
    entry for one launch differs, that launch is named and the exit code is 1."""
    earlier = {
        "bias_gelu 8192x4096 bf16 fwd": {"sass": "0" * 16, "registers": 0},  # a stand-in that cannot match
    }
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    out = tmp_path / "now.json"
    result = _cli("bias_gelu", "--fingerprints", str(out), "--against", str(tmp_path / "earlier.json"))
    assert result.returncode == 1, result.stderr
    prints = json.loads(out.read_text())
    # two shapes, fwd, bwd and the sum of db's partials
    assert "bias_gelu 8192x4096 bf16 bwd" in prints and len(prints) == 6
    assert all(len(p["sass"]) == 16 and p["registers"] > 0 for p in prints.values())
    assert "differs: bias_gelu 8192x4096 bf16 fwd" in result.stdout
    assert "0 of 6 launches compile as in" in result.stdout and "1 differ, 5 not there" in result.stdout


def test_cli_reports_each_launch():
    result = _cli("softmax", "--shape", "8192x4096", "--dtype", "bf16")
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert out.startswith("softmax 8192x4096 bf16 compiled for sm_90 (not launched)")
    for name in ("fwd one-pass: _softmax_fwd_kernel", "bwd one-pass: _softmax_bwd_kernel"):
        assert name in out
    assert out.count("spills none") == 2 and "global loads 128-bit x" in out and "occupancy:" in out


def test_cli_shows_a_planted_spill_and_the_diff():
    """The regression the static checks exist for: a config whose row no longer fits in registers."""
    fits = '{"variant": "online", "BLOCK_M": 1, "BLOCK_N": 4096, "num_warps": 8}'
    spills = '{"variant": "one-pass", "BLOCK_M": 1, "num_warps": 32}'
    result = _cli("softmax", "--shape", "64x65536", "--dtype", "fp32", "--config", fits, "--diff", spills)
    assert result.returncode == 0, result.stderr[-2000:]
    blocks = result.stdout.split("fwd one-pass:")
    assert "spills YES" not in blocks[0] and "spills YES" in blocks[1]
    assert "fwd online -> fwd one-pass: registers" in result.stdout and "spills none -> YES" in result.stdout


def test_cli_writes_the_irs(tmp_path):
    result = _cli("bias_gelu", "--shape", "64x256", "--dtype", "fp16", "--arch", "sm_80", "-o", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    launches = ("fwd", "bwd", "bwd-partial-sums")
    assert names == sorted(f"bias_gelu-{d}-sm_80.{ir}" for d in launches for ir in asm.IRS)
    assert ".target sm_80" in (tmp_path / "bias_gelu-fwd-sm_80.ptx").read_text()
    assert "HMMA" not in (tmp_path / "bias_gelu-fwd-sm_80.sass").read_text()  # elementwise: no matmul


BAD_WARPS = '{"variant": "one-pass", "BLOCK_M": 1, "num_warps": 3}'


def test_cli_compiles_without_being_told_not_to_interpret(tmp_path):
    """No TRITONKIT_INTERPRET: ``import tritonkit`` chooses the interpreter on a torch built without a
    GPU backend, and inspect once refused to run unless told =0; it compiles now. Its file errors and
    bad shapes are one line each, no traceback."""
    result = _cli("bias_gelu", "--shape", "64x256", "--dtype", "fp16", interpret=None)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "spills none" in result.stdout
    for args, message in [
        (("bias_gelu", "--shape", "0x96"), "needs dimensions >= 1"),
        (
            ("attention", "--shape", "1x2x128x64"),
            "5 dimensions (batch x query heads x key/value heads x sequence x head dim), like",
        ),
        (("softmax", "--shape", "4x96", "--config", '{"BLOCK_M": 4}'), "the config lacks 'variant'"),
        (("bias_gelu", "--fingerprints", str(tmp_path / "a"), "--against", "missing"), "no such file"),
        # each of these was a traceback, or a compile of a launch the op never makes
        (
            ("softmax", "--shape", "64x128", "--config", BAD_WARPS),
            "for sm_90 failed: num_warps must",
        ),
        (
            ("rms_norm", "--shape", "4x100", "--config", '{"BLOCK_M": "4", "num_warps": 4}'),
            "not one the kernels",
        ),
        (("linear", "--shape", "16x16x16", "--dtype", "fp32"), "linear takes fp16, bf16, not fp32"),
        (
            ("attention", "--shape", "1x4x3x128x64"),
            "query heads (4) must be a multiple of key/value heads (3)",
        ),
    ]:
        result = _cli_in_child(*args)
        assert result["code"] == 2 and message in result["stderr"] and not result["raised"], (args, result)


# the CLI's main in the natively compiling child of the sm_90 checks (no process started a case): its
# exit status, what it wrote to stderr, and any exception that escaped it (a traceback in a process)
_CLI_CASE = r"""
import contextlib, io, traceback
from tritonkit import cli
err, raised = io.StringIO(), ""
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    try:
        code = cli.main(["inspect", *ARGS])
    except SystemExit as exit:
        code = exit.code
    except BaseException:
        code, raised = None, traceback.format_exc()
print(json.dumps({"code": code, "stderr": err.getvalue(), "raised": raised}))
"""


def _cli_in_child(*args: str) -> dict:
    return json.loads(sm90.run(f"import json\nARGS = {list(args)!r}\n" + _CLI_CASE)[-1])


def test_cli_refuses_to_inspect_interpreted_kernels():
    result = _cli("softmax", interpret="1")
    assert result.returncode == 2 and "TRITONKIT_INTERPRET" in result.stderr


def test_cli_rejects_a_malformed_config():
    """In this process (no child to start): the flag is refused before the command sets up compiling,
    as SystemExit, which exits a CLI process with status 1 and the message."""
    from tritonkit import cli

    with pytest.raises(SystemExit, match="--config takes a JSON object"):
        cli.main(["inspect", "softmax", "--config", "{BLOCK_M: 4}"])


def test_compiling_in_an_interpreting_process_says_how_to_fix_it():
    launch = get_op("softmax").inspect((8, 64), torch.float32, None)[0]
    with pytest.raises(RuntimeError, match="TRITONKIT_INTERPRET=0"):
        asm.compile_launch(launch)


# ---------------------------------------------------------------- the pieces, without compiling


def test_specialize_as_a_launch_does():
    kernel = types.SimpleNamespace(arg_names=["x_ptr", "one", "n", "m", "big", "BLOCK"], __name__="k")
    x = torch.empty(8, dtype=torch.bfloat16, device="meta")
    launch = Launch("fwd", kernel, (x, 1, 4096, 7, 2**31 + 16), {"BLOCK": 64, "num_warps": 8})
    signature, constants, attrs, options = asm.specialize(launch)
    assert signature == {
        "x_ptr": "*bf16",
        "one": "constexpr",
        "n": "i32",
        "m": "i32",
        "big": "i64",
        "BLOCK": "constexpr",
    }
    assert constants == {(1,): 1, (5,): 64}
    assert sorted(attrs) == [(0,), (2,), (4,)]  # the pointer and the multiples of 16
    assert options == {"num_warps": 8}
    with pytest.raises(TypeError, match="trailing parameters"):
        asm.specialize(Launch("fwd", kernel, (x, 1, 4096, 7), {"BLOCK": 64}))


def test_occupancy_by_the_cuda_rules():
    assert asm.occupancy(90, 4, 48, 1024) == (10, "registers")  # 48 x 128 threads: 6144 a program
    assert asm.occupancy(90, 8, 32, 1024) == (8, "threads")
    assert asm.occupancy(90, 4, 32, 100 * 1024) == (2, "shared memory")
    assert asm.occupancy(90, 4, 33, 0)[0] == 12  # 33 rounds up to 40 registers a thread


def test_sass_parsing():
    sass = """
        /*0090*/                   LDG.E.128 R4, desc[UR4][R2.64] ;           /* 0x000... */
        /*00a0*/              @!P0 LDG.E.U16 R8, desc[UR4][R6.64] ;
        /*00b0*/                   LDG.E.EL.128 R12, desc[UR4][R2.64] ;
        /*00c0*/                   STG.E.64 desc[UR4][R2.64], R4 ;
        /*00d0*/                   STG.E desc[UR4][R2.64], R4 ;
        /*00e0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
    """
    full = asm._SASS_LINE.findall(sass)
    assert [op.split(".")[0] for op in full] == ["LDG", "LDG", "LDG", "STG", "STG", "HGMMA"]
    assert asm._widths(full, "LDG") == collections.Counter({128: 2, 16: 1})
    assert asm._widths(full, "STG") == collections.Counter({64: 1, 32: 1})


def test_spills_in_loops_count_the_local_accesses_a_backward_branch_repeats():
    sass = """
        /*0010*/                   STL [R1], R8 ;
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   LDL R9, [R1+0x4] ;
        /*0040*/              @!P0 BRA 0x20 ;
        /*0050*/                   LDL.LU R0, [R1] ;
        /*0060*/                   EXIT ;
    """
    report = asm.Report("k", "k", "sm_90", {}, 4, 96, 8, 0, 0, collections.Counter(), collections.Counter(),
                        collections.Counter(), (1, ""), {"sass": sass})  # fmt: skip
    assert report.spills_in_loops == 1  # the load at 0x30, inside 0x20..0x40; not the entry's or the end's


def test_the_innermost_loops_are_reported_with_their_mix_and_spills():
    """An outer loop around an inner one reports the inner alone; a wait's spin of two instructions is
    no loop worth a line, and a spin inside a loop leaves that loop reported; a wait's retry past the
    last EXIT, branching back into the body, is no loop; a loop's local accesses are counted."""
    body = "\n".join(f"        /*{0x100 + 16 * i:04x}*/  FFMA R{i}, R1, R2, R{i} ;" for i in range(20))
    sass = f"""
        /*0010*/                   STL [R1], R8 ;
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*0030*/              @!P0 BRA 0x20 ;
        /*00f0*/                   LDL R9, [R1+0x4] ;
        /*00f8*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR4], R2 ;
        /*00fc*/              @!P3 BRA 0xf8 ;
{body}
        /*0300*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0310*/              @!P1 BRA 0xf0 ;
        /*0320*/                   FADD R0, R0, R1 ;
        /*0330*/              @!P2 BRA 0x10 ;
        /*0340*/                   EXIT ;
        /*0350*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P4, [UR4], R2 ;
        /*0360*/                   BRA 0x200 ;
    """
    report = asm.Report("k", "k", "sm_90", {}, 4, 96, 8, 0, 0, collections.Counter(), collections.Counter(),
                        collections.Counter(), (1, ""), {"sass": sass})  # fmt: skip
    (loop,) = report.loops
    assert (loop.start, loop.end, loop.instructions, loop.local_accesses) == (0xF0, 0x310, 25, 1)
    assert loop.mix == collections.Counter({"FFMA": 20, "LDL": 1, "HGMMA": 1, "BRA": 2, "SYNCS": 1})
    assert loop.summary().startswith("loop 0xf0-0x310: 25 instructions, LDL/STL 1: FFMA 20")


# ---------------------------------------------------------------- static checks on every op (CI)

PER_ROW_STATISTICS = {"norm", "attention"}  # families that store or load an fp32 per row (32-bit accesses)
_STATIC_CHECKS = r"""
import json, torch
from tritonkit.asm import compile_launch, specialize
from tritonkit.ops import get_workload
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
compiled = {}
for name in json.loads(NAMES):
    workload = get_workload(name)
    for shape, dtype in workload.shape_list("quick"):
        dtype = dtype or "bf16"
        for launch in workload.launches(shape, DTYPES[dtype], None):
            # shapes that specialize a kernel alike compile to one binary: compile it once
            key = (launch.name, launch.kernel.__name__, repr(specialize(launch)))
            r = compiled[key] = compiled.get(key) or compile_launch(launch, "sm_90")
            print(json.dumps({"op": name, "shape": shape, "dtype": dtype, "launch": r.name,
                              "spills": r.spills, "loads": sorted(r.loads), "stores": sorted(r.stores),
                              "copies": sorted(r.copies),
                              "hgmma": r.opcodes["HGMMA"], "hmma": r.opcodes["HMMA"],
                              "f2f16": sum(r.asm["sass"].count(f"F2F.{t}.F32") for t in ("BF16", "F16"))}))
"""


def _inspected() -> list[str]:
    """The workloads whose launches ``tritonkit inspect`` compiles."""
    return [name for name in workload_names() if get_workload(name).op.inspect is not None]


def test_every_family_has_workloads_inspected():
    some = {"softmax", "log_softmax", "bias_gelu", "layer_norm", "add_rms_norm", "linear", "attention"}
    assert some <= set(_inspected())


# a test a family, so that the suite's workers share the compiles
@pytest.mark.slow
@pytest.mark.parametrize("family", sorted({get_workload(name).op.family for name in _inspected()}))
def test_every_default_config_compiles_for_hopper_without_spills_and_with_wide_accesses(family):
    """Each op's untuned configs at each benchmark shape, compiled for sm_90: no spills, and 128-bit
    global loads and stores (every benchmark shape is contiguous with 16-aligned rows), besides the
    norms' fp32 per-row statistics and the few values their second stage writes, and the matmuls'
    operands and the persistent softmax rows, which cp.async stages (16 bytes a copy); the matmuls'
    products are wgmma (HGMMA); 16-bit results convert in pairs (F2FP, on the ALU), not a value at
    a time (F2F, on the MUFU's pipe at its rate)."""
    names = [name for name in _inspected() if get_workload(name).op.family == family]
    lines = sm90.run(f"NAMES = {json.dumps(json.dumps(names))}\n" + _STATIC_CHECKS)
    rows = [json.loads(line) for line in lines]
    assert {row["op"] for row in rows} == set(names)
    for row in rows:
        assert not row["spills"], row
        # A 16-bit value that is also widened again converts alone (LLVM splits the pair). The
        # activation backward's db sums dz as rounded (torch's db): 32 F2F a tile beside its 64 MUFU,
        # by the count under its memory time (3 such ops an element at 16 a clock an SM: about half
        # of it at 8192 x 16384; not measured). Any other is new (the sm_90 Gluon attention
        # backward's P does it: docs/perf-notes/attention-backward-sm90.md).
        assert not row["f2f16"] or row["launch"] == "bwd dz (elementwise)", row
        if row["launch"] == "bwd partial sums":
            # the norms' second stage reads (programs, N) fp32 partials and writes N values a call,
            # one or two bytes each after its sum across threads: only its loads need the width
            assert row["loads"] == [128], row
        elif get_workload(row["op"]).op.family == "linear" and row["launch"].endswith("(elementwise)"):
            assert row["loads"] == [128] and row["stores"] == [128], row  # dy, z (g, u); dz (dg, du), db
        elif get_workload(row["op"]).op.family == "linear":
            # the matmul's operands are staged by cp.async (LDGSTS, not LDG); the output tile moves in
            # 16-byte vectors; the bias (one 16-bit value a thread's column pair) is the 32-bit access
            assert 128 in row["stores"] and min(row["loads"] + row["stores"]) >= 32, row
            assert row["hgmma"] > 0 and row["hmma"] == 0, row  # wgmma, not Ampere's mma.sync
        elif row["launch"].endswith("split"):
            # a split row's programs exchange fp32 (fp64) partial sums, one a program, in 32-bit
            # (64-bit) accesses; the row itself moves in 16-byte vectors
            assert 128 in row["loads"] and 128 in row["stores"], row
            assert min(row["loads"] + row["stores"]) >= 32, row
        elif get_workload(row["op"]).op.family == "softmax" and row["copies"]:
            # a persistent one-pass default: its rows are staged by cp.async, a block ahead
            assert row["copies"] == [128] and row["loads"] == [] and row["stores"] == [128], row
        elif get_workload(row["op"]).op.family == "cross_entropy":
            # the logits move in 16-byte vectors (and dx); a row's target (int64) and its logit, and
            # the statistics a row (fp32) and the reduced loss (one 16-bit value), are single values
            assert 128 in row["loads"], row
            assert row["stores"] == [128] if row["launch"] == "bwd" else max(row["stores"]) <= 32, row
        elif get_workload(row["op"]).op.family == "rotary":
            # q and k move in 16-byte vectors; a tile's table rows, shared by its heads, in 8 bytes
            assert 128 in row["loads"] and min(row["loads"]) >= 64 and row["stores"] == [128], row
        elif get_workload(row["op"]).op.family in PER_ROW_STATISTICS:
            # the row data moves in 16-byte vectors; a row's mean and rstd (lse, delta) are one fp32 each
            assert 128 in row["loads"] and min(row["loads"] + row["stores"]) >= 32, row
            assert 128 in row["stores"] or row["stores"] == [32], row  # [32]: it writes statistics only
        else:
            assert row["loads"] == [128] and row["stores"] == [128], row


def test_the_sm90_compile_process_reports_a_failing_check_and_serves_the_next():
    with pytest.raises(AssertionError, match="ValueError: no such kernel"):
        sm90.run("print('before')\nraise ValueError('no such kernel')")
    assert sm90.run("print(1 + 1)") == ["2"]


def test_the_disassembly_of_a_cubin_is_remembered(tmp_path, monkeypatch):
    """cuobjdump runs once a (cubin, flag): the second ask reads the file the first wrote."""
    monkeypatch.setenv("TRITONKIT_CACHE_DIR", str(tmp_path))
    runs = []

    def cuobjdump(command, **_):
        runs.append(command[1])
        return types.SimpleNamespace(stdout=f"listing {len(runs)} {command[1]}")

    monkeypatch.setattr(asm.subprocess, "run", cuobjdump)
    first = asm._cuobjdump(b"cubin one", "-sass")
    assert asm._cuobjdump(b"cubin one", "-sass") == first == "listing 1 -sass"
    assert asm._cuobjdump(b"cubin one", "-res-usage") == "listing 2 -res-usage"
    assert asm._cuobjdump(b"cubin two", "-sass") == "listing 3 -sass"
    assert runs == ["-sass", "-res-usage", "-sass"]
    assert len(list((tmp_path / "cuobjdump").glob("*.txt"))) == 3
