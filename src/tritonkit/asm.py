"""Compile an op's kernels for a chosen GPU without launching them, and read what they became.

``triton.compile`` with an explicit ``GPUTarget`` turns a kernel into PTX and a cubin on any
machine, GPU or not, and the ``cuobjdump`` inside Triton's wheel disassembles the cubin to SASS.
So registers, spills, shared memory, the instruction mix (tensor-core HGMMA/HMMA against FFMA),
TMA and the width of every global load and store can be read, and checked in CI, with no GPU.

Each op describes the launches it would make for a shape (``Op.inspect``) as :class:`Launch`
records built by its own launch code from ``meta`` tensors, so the arguments compiled here are the
ones the op passes. They are specialized the way Triton specializes a real launch: an integer equal
to 1 becomes a constant, integers and (16-byte aligned) pointers divisible by 16 carry that hint.

Compiling needs Triton's real JIT functions: the process must compile natively, not interpret
(``TRITONKIT_INTERPRET=0``, which ``tritonkit inspect`` sets for itself).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import hashlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch

from tritonkit._launch import LAUNCH_OPTIONS, Launch
from tritonkit.roofline import cache_dir

ARCHS = {"sm_80": 80, "sm_90": 90, "sm_100": 100}
IRS = ("ttir", "ttgir", "llir", "ptx", "sass")
_TRITON_DTYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
    torch.bool: "i1",
}
# Per-SM limits for the occupancy estimate (CUDA occupancy rules: registers are allocated per warp
# in units of 256, i.e. per thread in multiples of 8).
_SM_LIMITS = {  # arch -> (threads, blocks, registers, shared bytes usable by blocks)
    80: (2048, 32, 65536, 163 * 1024),
    90: (2048, 32, 65536, 227 * 1024),
    100: (2048, 32, 65536, 227 * 1024),
}
_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.MULTILINE)
MIX_OPCODES = (
    "HGMMA",
    "HMMA",
    "IMMA",
    "FFMA",
    "FMUL",
    "FADD",
    "HFMA2",
    "MUFU",
    "DADD",
    "DFMA",
    "UTMALDG",
    "UTMASTG",
    "LDGSTS",
    "LDS",
    "STS",
    "SHFL",
    "BAR",
)


@dataclass
class Report:
    """What one launch compiled to on one architecture."""

    name: str
    kernel: str
    arch: str
    config: dict
    num_warps: int
    registers: int
    stack_bytes: int
    local_bytes: int
    shared_bytes: int
    opcodes: collections.Counter  # SASS opcode (without modifiers) -> count
    loads: collections.Counter  # global load width in bits -> count
    stores: collections.Counter  # global store width in bits -> count
    occupancy: tuple[int, str]  # programs an SM can hold, and what limits it
    asm: dict  # ir name -> text
    # global-to-shared copy width in bits (cp.async, LDGSTS: loads Triton's pipeliner staged) -> count
    copies: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def spills(self) -> bool:
        """Stack or local memory, or local loads/stores in the code: the register file overflowed."""
        return bool(self.stack_bytes or self.local_bytes or self.opcodes["LDL"] or self.opcodes["STL"])

    @property
    def spills_in_loops(self) -> int:
        """Local loads and stores inside a loop of the SASS (between a backward branch's target and
        the branch): the spills a loop pays every step, where a value stored once at the kernel's
        entry and loaded once at its end costs nothing that matters."""
        code = _code(self.asm["sass"])
        loops = _backward_ranges(code)
        return sum(1 for at, text in code if _LOCAL.search(text) and any(lo <= at <= hi for lo, hi in loops))

    @property
    def loops(self) -> list[Loop]:
        """``innermost_loops`` of the kernel's SASS."""
        return innermost_loops(self.asm["sass"])


LOOP_MIN_INSTRUCTIONS = 16  # shorter innermost loops are waits' spins


def innermost_loops(sass: str) -> list[Loop]:
    """The innermost loops of a SASS listing of at least LOOP_MIN_INSTRUCTIONS (a backward branch's
    range that holds no other such range): what a kernel runs a step of its main loops, opcode by
    opcode. A wait's spin, a branch back over a few instructions, is no loop here, and does not
    hide the loop around it."""
    code = _code(sass)
    offsets = [at for at, _ in code]
    # (a wait's spin inside a loop does not hide the loop: spins are dropped before nesting counts)
    ranges = [
        (lo, hi)
        for lo, hi in _backward_ranges(code)
        if bisect.bisect_right(offsets, hi) - bisect.bisect_left(offsets, lo) >= LOOP_MIN_INSTRUCTIONS
    ]
    innermost = [
        (lo, hi)
        for lo, hi in ranges
        if not any((lo, hi) != inner and lo <= inner[0] and inner[1] <= hi for inner in ranges)
    ]
    loops = []
    for lo, hi in sorted(set(innermost)):
        body = [text for at, text in code if lo <= at <= hi]
        mix = collections.Counter(_opcode(text) for text in body)
        loops.append(Loop(lo, hi, len(body), mix, sum(1 for text in body if _LOCAL.search(text))))
    return loops


_LOCAL = re.compile(r"\b(LDL|STL)\b")


@dataclass(frozen=True)
class Loop:
    """An innermost loop of a kernel's SASS: its first and last instruction's offsets, the
    instructions between them and their opcodes' counts (a step's, where the loop holds no branch
    around part of its body: a flattened loop's epilogue, run every few steps, counts too), and its
    local loads and stores (spills paid every step)."""

    start: int
    end: int
    instructions: int
    mix: collections.Counter
    local_accesses: int

    def summary(self, top: int = 10) -> str:
        ops = " ".join(f"{op} {n}" for op, n in self.mix.most_common(top))
        return (
            f"loop {self.start:#x}-{self.end:#x}: {self.instructions} instructions, "
            f"LDL/STL {self.local_accesses}: {ops}"
        )


def _code(sass: str) -> list[tuple[int, str]]:
    """(offset, instruction) of each SASS line."""
    return [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def _backward_ranges(code: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(target, offset) of every branch to an earlier instruction: the loops. Not those past the
    kernel's last EXIT: ptxas places a wait's retry there, a branch out of the body to a spin and
    back in, which would read as a loop around whatever lies between."""
    exits = [at for at, text in code if re.match(r"(@!?U?P\w+\s+)?EXIT\b", text)]
    last_exit = max(exits, default=max((at for at, _ in code), default=0))
    return [
        (int(target, 16), at)
        for at, text in code
        for target in re.findall(r"\bBRA (?:`\()?(0x[0-9a-f]+)", text)
        if int(target, 16) < at <= last_exit
    ]


def _opcode(text: str) -> str:
    """An instruction's opcode without its predicate and modifiers."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TRITON_DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot describe an argument of type {type(value).__name__}")


def _divisible_by_16(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_meta or value.data_ptr() % 16 == 0  # meta tensors stand for fresh allocations
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def specialize(launch: Launch) -> tuple[dict, dict, dict, dict]:
    """(signature, constants, attributes, options) for ``triton.compile``, as a launch specializes."""
    names = launch.kernel.arg_names
    constexprs = {k: v for k, v in launch.meta.items() if k not in LAUNCH_OPTIONS}
    if tuple(names[len(launch.args) :]) != tuple(constexprs):
        raise TypeError(
            f"{launch.kernel.__name__}: {list(constexprs)} must be its trailing parameters "
            f"{list(names[len(launch.args) :])}, in order"
        )
    signature, constants, attrs = {}, {}, {}
    for index, (name, value) in enumerate(zip(names, launch.args, strict=False)):
        if type(value) is int and value == 1 or value is None:  # Triton makes a 1 and None constants
            signature[name], constants[(index,)] = "constexpr", value
            continue
        signature[name] = _arg_type(value)
        if _divisible_by_16(value):
            attrs[(index,)] = [["tt.divisibility", 16]]
    for name, value in constexprs.items():
        signature[name], constants[(names.index(name),)] = "constexpr", value
    options = {k: launch.meta[k] for k in LAUNCH_OPTIONS if k in launch.meta}
    return signature, constants, attrs, options


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """``cuobjdump flag`` of a cubin (Triton's own copy of the tool), remembered on disk by the
    cubin's hash and Triton's version: a call takes about 0.3 s, 94% of a static check's time once
    Triton's cache holds the compile itself, and the same cubin always reads the same."""
    import triton

    key = hashlib.sha256(cubin + f"|{flag}|{triton.__version__}".encode()).hexdigest()
    remembered = cache_dir() / "cuobjdump" / f"{key}.txt"
    if remembered.is_file():
        return remembered.read_text()
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    remembered.parent.mkdir(parents=True, exist_ok=True)
    partial = remembered.with_suffix(f".{os.getpid()}.partial")  # whole files only, also when racing
    partial.write_text(text)
    os.replace(partial, remembered)
    return text


def _usage(text: str, field_name: str) -> int:
    match = re.search(rf"\b{field_name}:(\d+)", text)
    return int(match.group(1)) if match else 0


def _widths(opcodes_full: list[str], prefix: str) -> collections.Counter:
    """Global access widths in bits: LDG.E.128 -> 128, LDG.E.U16 -> 16, LDG.E -> 32."""
    widths = collections.Counter()
    for op in opcodes_full:
        if op.split(".")[0] == prefix:
            sizes = [int(m) for m in re.findall(r"\.U?S?(\d+)\b", op[len(prefix) :]) if int(m) >= 8]
            widths[sizes[-1] if sizes else 32] += 1
    return widths


def occupancy(arch: int, num_warps: int, registers: int, shared_bytes: int) -> tuple[int, str]:
    """Programs one SM holds at once and the resource that stops more, by CUDA's occupancy rules."""
    threads, blocks, register_file, shared = _SM_LIMITS[arch]
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    limits = {
        "threads": threads // (32 * num_warps),
        "blocks": blocks,
        "registers": register_file // (per_warp * num_warps),
        "shared memory": shared // shared_bytes if shared_bytes else blocks,
    }
    limiter = min(limits, key=limits.get)
    return limits[limiter], limiter


def compile_launch(launch: Launch, arch: str = "sm_90") -> Report:
    """Compile ``launch`` for ``arch`` (no GPU needed) and report what it became."""
    if not hasattr(launch.kernel, "arg_names") or type(launch.kernel).__name__ != "JITFunction":
        raise RuntimeError(
            "kernels are interpreted in this process; inspect needs TRITONKIT_INTERPRET=0 "
            "set before tritonkit is first used"
        )
    signature, constants, attrs, options = specialize(launch)
    return _compile(launch.kernel, signature, constants, attrs, options, arch, launch.name, launch.config)


def compile_kernel(
    kernel, signature: dict, constexprs: dict, num_warps: int, arch: str = "sm_90", aligned: bool = True
) -> Report:
    """Compile ``kernel`` from an explicit signature (argument name -> Triton type) and constexprs;
    with ``aligned``, every pointer and integer argument carries the divisible-by-16 hint."""
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else signature[n] for n in names}
    constants = {(names.index(n),): v for n, v in constexprs.items()}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, t in enumerate(signature.values())
        if aligned and t != "constexpr"
    }
    return _compile(kernel, signature, constants, attrs, {"num_warps": num_warps}, arch, kernel.__name__, {})


def _compile(kernel, signature, constants, attrs, options, arch, name, config) -> Report:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    compiled = triton.compile(
        ASTSource(kernel, signature, constants, attrs),
        target=GPUTarget("cuda", ARCHS[arch], 32),
        options=options,
    )
    sass = _cuobjdump(compiled.asm["cubin"], "-sass")
    usage = _cuobjdump(compiled.asm["cubin"], "-res-usage")
    full = _SASS_LINE.findall(sass)
    num_warps = options.get("num_warps", 4)
    registers = _usage(usage, "REG")
    shared = max(_usage(usage, "SHARED"), compiled.metadata.shared)  # dynamic shared memory too
    return Report(
        name=name,
        kernel=kernel.__name__,
        arch=arch,
        config=dict(config),
        num_warps=num_warps,
        registers=registers,
        stack_bytes=_usage(usage, "STACK"),
        local_bytes=_usage(usage, "LOCAL"),
        shared_bytes=shared,
        opcodes=collections.Counter(op.split(".")[0] for op in full),
        loads=_widths(full, "LDG"),
        stores=_widths(full, "STG"),
        occupancy=occupancy(ARCHS[arch], num_warps, registers, shared),
        asm={ir: compiled.asm[ir] for ir in IRS if ir in compiled.asm} | {"sass": sass},
        copies=_widths(full, "LDGSTS"),
    )


_SASS_COMMENT = re.compile(r"/\*.*?\*/")  # instruction offsets and encodings


def fingerprint(sass: str) -> str:
    """A short hash of a kernel's SASS instructions alone (no addresses, encodings, comments or file
    paths, which differ between checkouts): two versions of a kernel's source that keep it compile
    to the same code."""
    lines = []
    for line in sass.splitlines():
        line = _SASS_COMMENT.sub("", line).strip()
        if line and not line.startswith("//") and ".file" not in line:
            lines.append(" ".join(line.split(";")[0].split()))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _widths_text(widths: collections.Counter) -> str:
    return " ".join(f"{bits}-bit x{n}" for bits, n in sorted(widths.items(), reverse=True)) or "-"


def format_reports(reports: list[Report]) -> str:
    """One block of lines per report: resources, occupancy, access widths and instruction mix."""
    lines = []
    for r in reports:
        mix = " ".join(f"{op} {r.opcodes[op]}" for op in MIX_OPCODES if r.opcodes[op]) or "-"
        lines += [
            f"{r.name}: {r.kernel} on {r.arch}  config {r.config}",
            f"  registers {r.registers}/thread  warps {r.num_warps}  shared {r.shared_bytes} B  "
            f"spills {'YES' if r.spills else 'none'} (stack {r.stack_bytes} B, local {r.local_bytes} B, "
            f"LDL {r.opcodes['LDL']}, STL {r.opcodes['STL']})",
            f"  occupancy: {r.occupancy[0]} per SM (programs; limited by {r.occupancy[1]})",
            f"  global loads {_widths_text(r.loads)}   stores {_widths_text(r.stores)}"
            f"   copies to shared {_widths_text(r.copies)}",
            f"  mix {mix}",
            *(f"  {loop.summary()}" for loop in r.loops),
        ]
    return "\n".join(lines)


DIFF_FIELDS = [  # (label, value of a report)
    ("registers", lambda r: r.registers),
    ("spills", lambda r: "YES" if r.spills else "none"),
    ("shared bytes", lambda r: r.shared_bytes),
    ("warps", lambda r: r.num_warps),
    ("programs/SM", lambda r: r.occupancy[0]),
    ("128-bit loads", lambda r: r.loads[128]),
    ("narrower loads", lambda r: sum(n for bits, n in r.loads.items() if bits < 128)),
    ("128-bit stores", lambda r: r.stores[128]),
    ("narrower stores", lambda r: sum(n for bits, n in r.stores.items() if bits < 128)),
    ("copies to shared", lambda r: sum(r.copies.values())),
    ("instructions", lambda r: sum(r.opcodes.values())),
]


def format_diff(first: list[Report], second: list[Report]) -> str:
    """Launch by launch, the numbers that differ between two configs' reports."""
    lines = ["differences (first config -> second):"]
    for a, b in zip(first, second, strict=True):
        changed = [f"{label} {get(a)} -> {get(b)}" for label, get in DIFF_FIELDS if get(a) != get(b)]
        lines.append(f"  {a.name} -> {b.name}: " + ("; ".join(changed) or "no difference"))
    return "\n".join(lines)
