"""Per-element helpers of the sm_90 attention kernels (``fwd_sm90_kernels``, ``bwd_sm90_kernels``),
each one asm block an element or a pair, where what the compiler made of the plain expression cost
instructions or predicate registers (the perf notes of each say how many).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def to_pairs(x, dtype: gl.constexpr):
    """``x`` (fp32) in ``dtype`` (bf16 or fp16), two values an instruction, element 0 in the low
    half. ``x.to(dtype)`` emits one cvt a value; ptxas pairs them into F2FP in the other order and
    swaps the halves of each register with a PRMT before a wgmma reads it
    (docs/perf-notes/attention-forward.md)."""
    if dtype == gl.bfloat16:
        pairs = gl.inline_asm_elementwise(
            "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.bfloat16, is_pure=True, pack=2
        )
    else:
        pairs = gl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.float16, is_pure=True, pack=2
        )
    return pairs


@gluon.jit
def from_pairs(x):
    """``x`` (bf16) in fp32, a pair a register: a bf16 is the top half of its fp32, so element 0 (the
    low half) shifts up and element 1 keeps its half, two instructions a pair. ``x.to()`` compiled
    to two PRMT and two shifts a pair in the backward's dS
    (docs/perf-notes/attention-backward-sm90-steps.md)."""
    return gl.inline_asm_elementwise(
        "{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }",
        "=r,=r,r",
        [x],
        dtype=gl.float32,
        is_pure=True,
        pack=2,
    )


@gluon.jit
def hide_past(s, index, bound):
    """``s`` where ``index`` < ``bound`` (int32, broadcast to s's shape), -inf elsewhere: a compare
    and a select an element in one asm block, so that the compare, which reads ``s``, comes after
    the product's wait and its predicate lives one instruction. As ``gl.where`` of a mask, the 64
    compares a thread ran ahead of the wait and outlived the seven predicate registers: ptxas packed
    them into bits and unpacked them, about 230 instructions a masked block
    (docs/perf-notes/attention-forward-sm90-loop.md)."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.lt.s32 p, $2, $3; selp.f32 $0, $1, 0fFF800000, p; }",
        "=r,r,r,r",
        [s, index, bound],
        dtype=gl.float32,
        is_pure=True,
        pack=1,
    )


@gluon.jit
def softcapped_tanh(s, arg_scale, exp_scale):
    """tanh(s * arg_scale) of raw scores (arg_scale = scale / softcap; exp_scale = 2 log2(e) arg_scale),
    as the Triton kernels' ``common._exponent``: 1 - 2 / (e^2x + 1), which saturates to +-1 cleanly
    (e^2x + 1 >= 1, and 1 / inf = 0, so ``rcp.approx`` serves), and near 0 (|x| < 1/16) x - x^3 / 3 +
    2 x^5 / 15, where the first keeps only 1's absolute precision (6e-8), which the cap multiplies.
    One asm block an element, so that each compare feeds its select at once: as ``gl.where``, ptxas
    held the block's 64 predicates in packed bits (LOP3, SHF and SEL, as the masks did before
    ``hide_past``). Per score two MUFU operations (an exponential, a reciprocal) beside the softmax's
    exponential, and ten on the FMA and ALU pipes."""
    return gl.inline_asm_elementwise(
        """{
        .reg .f32 x, e, r, x2, q, t;
        .reg .pred small;
        mul.f32 x, $1, $2;
        mul.f32 e, $1, $3;
        ex2.approx.ftz.f32 e, e;
        add.f32 e, e, 0f3F800000;
        rcp.approx.ftz.f32 r, e;
        fma.rn.f32 t, r, 0fC0000000, 0f3F800000;
        mul.f32 x2, x, x;
        fma.rn.f32 q, x2, 0f3E088889, 0fBEAAAAAB;
        mul.f32 q, q, x2;
        fma.rn.f32 q, q, x, x;
        abs.f32 e, x;
        setp.lt.f32 small, e, 0f3D800000;
        selp.f32 $0, q, t, small;
        }""",
        "=r,r,r,r",
        [s, arg_scale, exp_scale],
        dtype=gl.float32,
        is_pure=True,
        pack=1,
    )


@gluon.jit
def hide_outside(s, index, lower, upper):
    """``s`` where ``lower`` <= ``index`` < ``upper``, -inf elsewhere: ``hide_past`` with a window's
    lower bound, both compares and the select in one asm block."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.lt.s32 p, $2, $4; setp.ge.and.s32 p, $2, $3, p;"
        " selp.f32 $0, $1, 0fFF800000, p; }",
        "=r,r,r,r,r",
        [s, index, lower, upper],
        dtype=gl.float32,
        is_pure=True,
        pack=1,
    )
