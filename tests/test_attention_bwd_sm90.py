"""The sm_90 Gluon attention backward (``ops/attention/bwd_sm90.py``): its SASS checked for Hopper
without a GPU (warp-specialized partitions with register budgets, HGMMA, the wgmma waits that leave
one product running, the TMA reduce-add of dQ, no spills) and its dispatch rule; on the H200
(``gpu``) dq, dk and dv against the float64 reference gradients with the oracle's rule, over ragged
lengths, both causal alignments of Sq != Sk, GQA/MQA, fp16/bf16, D 64 and 128, strided layouts,
both modes, and the deterministic mode's bits run to run. Gluon kernels do not run in Triton's
interpreter, so nothing here runs on the CPU but the compile and the dispatch rule."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

import sm90

pytestmark = pytest.mark.attention

_STATIC_CHECK = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from tritonkit.asm import _cuobjdump, innermost_loops
from tritonkit.ops.attention import bwd_sm90 as bwd

def numbers(pattern, text):
    return sorted(set(int(n) for n in re.findall(pattern, text)))

def descriptor(dtype, rows, cols, swizzle=None):  # as bwd_sm90._descriptor makes it
    block = [1, 1, rows, cols]
    element = {"bf16": gl.bfloat16, "fp16": gl.float16, "fp32": gl.float32}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block, element)
    if swizzle is not None:
        layout = gl.NVMMASharedLayout(swizzle, layout.element_bitwidth, rank=4)
    return f"tensordesc<{dtype}[{','.join(map(str, block))}],{layout!r}>"

for dtype, head_dim, causal, deterministic, shared_dq, _, *fields in CASES:
    # (a case without fields: a 64-row step, one value converted an instruction: the D = 128 free
    # default and deterministic candidate, the 64-row candidates at D = 64)
    fields = dict(*fields)
    softcap = fields.pop("softcap", False)  # (the kernel's SOFTCAP, not a Config field)
    window = fields.pop("window", False)  # (the kernel's HAS_LOWER: a window's left side, under causal)
    varlen = fields.pop("varlen", False)  # (the kernel's VARLEN: a packed batch)
    tensor_d = fields.pop("tensor_d", head_dim) if varlen else 0  # (its TENSOR_D: a padded head dim's)
    config = bwd.CONFIGS[head_dim]._replace(
        shared_dq=shared_dq, **({"block_m": bwd.BLOCK_M, "p_in_pairs": False} | fields)
    )
    shipped = bwd.default_config(head_dim, deterministic, False, causal)
    k_swizzle = 64 if shared_dq and head_dim == 64 else None
    rows = {"q_desc": config.block_m, "k_desc": bwd.SPLIT_N, "v_desc": bwd.SPLIT_N, "do_desc": config.block_m,
            "dk_desc": bwd.SPLIT_N, "dv_desc": bwd.SPLIT_N}
    signature = {name: descriptor(dtype, n, head_dim, k_swizzle if name in ("k_desc", "dk_desc") else None)
                 for name, n in rows.items()}
    signature |= {"dq_desc": descriptor("fp32", config.block_m, head_dim // 2 if shared_dq else head_dim),
                  "lse_ptr": "*fp32", "delta_ptr": "*fp32", "sem_ptr": "*i32", "dk_ptr": f"*{dtype}",
                  "dv_ptr": f"*{dtype}", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32"}
    for name in ("stride_lb", "stride_lh", "stride_db", "stride_dh", "stride_sb", "stride_sh", "stride_dkh",
                 "stride_dks", "stride_dvh", "stride_dvs", "HEADS_KV", "PAIRS", "PAIRS_PER_GROUP", "GROUP",
                 "SEQ_Q", "SEQ_K", "UPPER_OFFSET", "LOWER_OFFSET"):
        signature[name] = "i32"
    # KV_SHARE is 1 but per query head, and a launch specializes an int argument of 1 as a constant
    signature |= {"KV_SHARE": "constexpr"}
    signature |= {"qk_scale": "fp32", "cap_log2": "fp32", "scale": "fp32", "IS_CAUSAL": "constexpr",
                  "DETERMINISTIC": "constexpr", "NUM_STAGES": "constexpr", "ROTATE": "constexpr",
                  "OVERLAP_SDP": "constexpr", "SHARED_DQ": "constexpr", "ACQUIRE_FIRST": "constexpr",
                  "TURN_BLOCKS": "constexpr", "P_PAIRS": "constexpr", "SOFTCAP": "constexpr",
                  "HAS_LOWER": "constexpr", "VARLEN": "constexpr", "TENSOR_D": "constexpr"}
    constants = {"KV_SHARE": 1, "IS_CAUSAL": causal, "DETERMINISTIC": deterministic,
                 "NUM_STAGES": config.num_stages,
                 "OVERLAP_SDP": config.overlap_sdp, "SHARED_DQ": config.shared_dq,
                 "ACQUIRE_FIRST": shipped.acquire_first,
                 "TURN_BLOCKS": shipped.turn_blocks,
                 "P_PAIRS": config.p_in_pairs, "SOFTCAP": softcap, "HAS_LOWER": window, "VARLEN": varlen,
                 "TENSOR_D": tensor_d}
    constants["ROTATE"] = bwd.order(deterministic, causal, 64, 32, 132, config.rotate)[1]  # where it may be
    kernel = triton.compile(GluonASTSource(bwd._attn_bwd_sm90_kernel, signature, constants),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": bwd.CONSUMER_WARPS.value})
    ptx, sass = kernel.asm["ptx"], _cuobjdump(kernel.asm["cubin"], "-sass")
    print(json.dumps({
        "case": f"{dtype} d{head_dim} causal={causal} deterministic={deterministic} "
                f"shared_dq={shared_dq} {fields or ''}{' softcap' if softcap else ''}"
                f"{' window' if window else ''}{' packed' if varlen else ''}",
        "warps": kernel.metadata.num_warps, "shared": kernel.metadata.shared,
        "waits": numbers(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx),
        "setmaxnreg": numbers(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx),
        "hgmma": sass.count("HGMMA"), "hmma": sass.count(" HMMA"),
        "spills": sass.count("STL") + sass.count("LDL"),
        # the local loads and stores a step of an innermost loop repeats (the others run once a walk)
        "loop_spills": sum(loop.local_accesses for loop in innermost_loops(sass)),
        "single_conversions": sass.count("F2F.BF16.F32") + sass.count("F2F.F16.F32"),
        "swaps": sass.count("PRMT"),
        "reduces": sass.count("UTMAREDG"), "tma_loads": ptx.count("cp.async.bulk.tensor.4d.shared"),
        "tickets": ptx.count("ld.global.gpu.acquire"), "releases": ptx.count("atom.global.gpu.release.add"),
    }))
"""

# (dtype, D, causal, deterministic, Config.shared_dq, spills[, Config fields]): both head dims,
# both masks, both modes, both dQ splits, each with its default turns (the order of programs is a
# runtime argument: one compile serves all; a deterministic full mask compiles the rotated walk),
# and the local loads and stores in the SASS, which may not grow. At D = 128 a consumer's
# accumulators (dK and dV: 128 registers a thread, S^T and dP^T 64 more) leave ptxas short of 240
# for the rest: it keeps some values on the stack, a causal walk's bounds more; the tickets are the
# dQ warp's. The free mode's P, held in fp32 until dS, adds some where dQ is not split (27, from 6;
# the default at D = 128 splits it and stays at 52). fp16 keeps the 16-bit P (it converts in pairs
# either way): 13 at D = 128 causal, where the fp32 P spilled 52. Fewer is a next step
# (docs/perf-notes/attention-backward-sm90.md). Steps of 128 query rows at D = 64 (the default; a turn one
# step): the 16-bit P, 13-14 free (an fp32 P kept 118-226 values on the stack), 13 deterministic
# causal, 11 on the full mask's rotated walk (42 while the dQ warp's turns computed their rank's
# fixed part at each turn: bwd_sm90_dq._rotated_rank_base). The other cases at D = 64 are 64-row
# candidates. The deterministic D = 128 default converts its 16-bit P in pairs (the cases with
# p_in_pairs): 13 causal, 9 on the rotated walk (72 before _rotated_rank_base); with from_pairs's
# unpacking the one-value cases compile to pairs too (13, from 52-68). A soft cap (the field
# "softcap", the kernel's SOFTCAP): dS reads P (1 - tanh^2) made with P, in P's form; 28 and 52 at
# D = 128 causal, none a step; D = 64 takes 64-row steps with it (bwd_sm90.default_config). A
# window's left side (the field "window", the kernel's HAS_LOWER, under the causal bound): a third,
# masked loop for the rows past a key block's first key's reach (79 free at D = 128, one a step;
# 30-31 at D = 64, none a step), but in the deterministic mode at D = 128, where that loop put 45
# values a step on the stack, the window's rows masked in the second loop (21, none a step). A packed
# batch (the field "varlen", the kernel's VARLEN): dK and dV stored row by row, masked (a head dim's
# PRMT more), and the masks counting keys from the sequence's end (``_grad_partition``), with no
# more values a step on the stack than the dense kernel (3-10 a step at D = 128 with the sequence's
# length held in a register); at a padded head dim (the field "tensor_d") those stores masked by column
# too. The free mode's candidates (the fields "rotate", the full mask's rotated walk: 11 at both head
# dims; "p_in_pairs" at D = 128, the deterministic mode's 16-bit P: 9 full, 13 causal against the fp32
# P's 48).
STATIC_CASES = [
    ("bf16", 128, False, False, False, 27),
    ("bf16", 128, True, True, False, 13),
    ("fp16", 64, True, False, False, 0),
    ("bf16", 64, False, True, False, 0),
    ("bf16", 64, True, True, True, 0),
    ("bf16", 128, True, False, True, 52),
    ("bf16", 128, True, True, True, 13),
    ("fp16", 64, False, False, True, 0),
    ("bf16", 64, False, False, True, 0),
    ("fp16", 128, True, False, True, 13),
    ("bf16", 64, False, False, True, 14, {"block_m": 128}),
    ("bf16", 64, True, True, True, 13, {"block_m": 128}),
    ("bf16", 64, False, True, True, 11, {"block_m": 128}),
    ("fp16", 64, True, False, True, 13, {"block_m": 128}),
    ("bf16", 128, True, True, True, 13, {"p_in_pairs": True}),
    ("bf16", 128, False, True, True, 9, {"p_in_pairs": True}),
    ("bf16", 128, True, True, True, 28, {"p_in_pairs": True, "softcap": True}),
    ("bf16", 128, True, False, True, 52, {"softcap": True}),
    ("bf16", 64, False, False, True, 0, {"softcap": True}),
    ("bf16", 64, True, True, True, 13, {"turn_blocks": 2, "softcap": True}),
    ("bf16", 128, True, True, True, 21, {"p_in_pairs": True, "window": True}),
    ("bf16", 128, True, False, True, 79, {"window": True}),
    ("bf16", 64, True, True, True, 30, {"block_m": 128, "window": True}),
    ("bf16", 64, True, False, True, 31, {"block_m": 128, "window": True}),
    ("bf16", 128, True, True, True, 23, {"p_in_pairs": True, "softcap": True, "window": True}),
    ("bf16", 128, True, False, True, 47, {"varlen": True}),
    ("bf16", 128, False, False, True, 18, {"varlen": True}),
    ("bf16", 128, True, True, True, 14, {"p_in_pairs": True, "varlen": True}),
    ("bf16", 128, False, True, True, 7, {"p_in_pairs": True, "varlen": True}),
    ("bf16", 64, True, True, True, 14, {"block_m": 128, "varlen": True}),
    ("bf16", 64, False, False, True, 3, {"block_m": 128, "varlen": True}),
    ("bf16", 128, True, True, True, 26, {"p_in_pairs": True, "window": True, "varlen": True}),
    ("bf16", 128, True, False, True, 47, {"varlen": True, "tensor_d": 96}),
    ("bf16", 64, False, True, True, 3, {"block_m": 128, "varlen": True, "tensor_d": 40}),
    ("bf16", 128, False, False, True, 11, {"rotate": True}),
    ("bf16", 64, False, False, True, 11, {"block_m": 128, "rotate": True}),
    ("bf16", 128, False, False, True, 9, {"p_in_pairs": True}),
    ("bf16", 128, True, False, True, 13, {"p_in_pairs": True}),
    ("bf16", 128, False, False, True, 7, {"p_in_pairs": True, "rotate": True, "varlen": True}),
]


# one case a test, so that the suite's workers share the compiles
@pytest.mark.parametrize(
    "case",
    STATIC_CASES,
    ids=lambda case: "-".join([*map(str, case[:5]), *(f"{k}={v}" for c in case[6:] for k, v in c.items())]),
)
def test_the_kernel_compiles_for_hopper_warp_specialized_with_the_dq_reduce_off_the_registers(case):
    (row,) = [json.loads(line) for line in sm90.run(f"CASES = {[case]!r}\n{_STATIC_CHECK}")]
    _, head_dim, _, deterministic, _, spills, *fields = case
    window = any(field.get("window") for field in fields)
    varlen = any(field.get("varlen") for field in fields)
    # two consumer warpgroups, the producer's warp and the dQ warp; budgets 240 and 24 (and
    # Triton's steps)
    assert row["warps"] == 12 and {240, 24} <= set(row["setmaxnreg"]), row
    # one product left running under the exponentials and under dS, and full waits
    assert row["waits"] == [0, 1], row
    assert row["hgmma"] > 0 and row["hmma"] == 0 and row["tma_loads"] > 0, row
    assert row["reduces"] > 0, row  # dQ's partials go out by bulk reduce-add, not per element
    assert row["shared"] <= 227 * 1024, row
    # the deterministic mode waits for its turn (an acquiring load) and publishes its adds
    assert (row["tickets"] > 0) == (row["releases"] > 0) == deterministic, row
    assert row["spills"] <= spills, row
    # none a step in the step loops at D = 64; at D = 128 two or three, in the masked (causal
    # diagonal) step or the 64-key dQ partials' (the rotated rank's divisions had put 24 a step in
    # the deterministic full mask's loop: bwd_sm90_dq._rotated_rank_base)
    assert row["loop_spills"] <= (3 if head_dim == 128 else 0), row
    # P converted in pairs (F2FP, on the ALU: a conversion a value, F2F, runs on the MUFU's pipe
    # beside the exponentials), whether dS reads it in fp32 or in 16 bits, which ``from_pairs``
    # unpacks two instructions a pair (with ``.to()`` it took two PRMT and two shifts, and bf16's
    # ``.to()`` of a P read twice converted a value an instruction): no single conversions, and at
    # most 64 PRMT at D = 64 and 128 at D = 128 (beside dS^T's copies; 256-322 before; a causal
    # kernel may keep 2 more, on integers, a windowed one 4; a packed one's masked stores of dK
    # and dV a head dim more)
    swaps = head_dim + (4 if window else 2) + (head_dim if varlen else 0)
    assert row["single_conversions"] == 0 and row["swaps"] <= swaps, row


# ---------------------------------------------------------------- the dispatch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("cols, swizzle", [(None, None), (32, None), (None, 64)])
def test_the_cached_shared_layouts_give_the_descriptors_built_afresh(cols, swizzle, dtype):
    """``fwd_sm90.descriptor`` computes a box's shared layout once (host time a call): the descriptor
    it gives is field for field the one built without the cache."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from tritonkit.ops.attention.fwd_sm90 import descriptor

    t = torch.randn(2, 3, 100, 64, dtype=dtype)
    block = [1, 1, 64, cols or 64]
    layout = gl.NVMMASharedLayout.get_default_for(
        block, {torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[dtype]
    )
    if swizzle is not None:
        layout = gl.NVMMASharedLayout(swizzle, layout.element_bitwidth, rank=4)
    for _ in range(2):  # computed, then cached
        assert descriptor(t, 64, cols, swizzle) == TensorDescriptor.from_tensor(t, block, layout)


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_launch_names_the_kernels_constexprs_in_its_order(deterministic):
    """The launcher passes the constexprs as the kernel's trailing parameters, by position: their
    names must be those parameters, in order, for every candidate."""
    from tritonkit.ops.attention import bwd_sm90

    for head_dim, candidates in bwd_sm90.CANDIDATES.items():
        for config in candidates + [bwd_sm90.default_config(head_dim, deterministic)]:
            meta = bwd_sm90.kernel_meta(config, True, deterministic, False)
            names = [name for name in meta if name != "num_warps"]
            assert bwd_sm90._attn_bwd_sm90_kernel.arg_names[-len(names) :] == names


def test_the_launch_passes_the_kernels_runtime_arguments_in_order(monkeypatch):
    """The runtime arguments go by position, before the constexprs: as many as the kernel's leading
    parameters, with and without a soft cap, dense and packed (only a GPU run would otherwise tell)."""
    from tritonkit.ops.attention import bwd_sm90
    from tritonkit.ops.attention.common import Packed

    monkeypatch.setattr(bwd_sm90, "sm_count", lambda device: 132)
    q, k = (
        torch.empty(1, 4, 256, 128, dtype=torch.bfloat16),
        torch.empty(1, 2, 256, 128, dtype=torch.bfloat16),
    )
    lse, acc, tickets = (
        torch.empty(1, 4, 256),
        torch.empty(1, 4, 256, 128),
        torch.empty(1, 4, 4, dtype=torch.int32),
    )
    names = bwd_sm90._attn_bwd_sm90_kernel.arg_names
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    for softcap, packed in ((0.0, None), (30.0, None), (0.0, Packed(cu, cu, 2, 156, 156))):
        config = bwd_sm90.default_config(128, True, True, True, bool(softcap))
        (launch,) = bwd_sm90.launches(
            q, q, k, k, lse, lse, acc, tickets, k, k, scale=0.1, causal=True, upper_offset=0,
            deterministic=True, config=config, softcap=softcap, packed=packed,
        )  # fmt: skip
        constexprs = [name for name in launch.meta if name != "num_warps"]
        assert names[len(launch.args) :] == constexprs and launch.meta["SOFTCAP"] == bool(softcap)
        assert launch.meta["VARLEN"] == (packed is not None)
        # a program a key block of a (batch or sequence, key/value head), over the longest keys
        assert launch.grid == ((2 * 2 * 2,) if packed else (1 * 2 * 2,)), launch.grid


def test_a_full_mask_walks_rotated_deterministic_where_a_group_runs_at_once_free_where_asked(monkeypatch):
    """The rotated walk's turns are cyclic (a key block waits on blocks launched after it), so the
    deterministic mode takes it only where a group's programs all fit on the GPU at once; the free
    mode where Config.rotate asks, whatever the grid; never causal."""
    from tritonkit.ops.attention import bwd_sm90

    assert bwd_sm90.order(True, False, 64, 132, 132) == (1, True)
    assert bwd_sm90.order(True, False, 64, 133, 132) == (1, False)
    assert not bwd_sm90.order(True, True, 64, 32, 132)[1]
    assert not bwd_sm90.order(False, False, 64, 32, 132)[1]
    assert bwd_sm90.order(False, False, 64, 500, 132, True) == (1, True)
    assert bwd_sm90.order(False, True, 64, 32, 132, True) == (4, False)
    assert bwd_sm90.order(True, False, 64, 133, 132, True) == (1, False)
    monkeypatch.setattr(bwd_sm90, "DETERMINISTIC_PAIRS_PER_GROUP", None)  # every pair at once
    assert bwd_sm90.order(True, False, 4, 33, 132) == (4, True)
    assert bwd_sm90.order(True, False, 4, 34, 132) == (4, False)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_default_config_by_mode_mask_and_grouping(head_dim):
    """The free mode takes CONFIGS' tile as it is; the deterministic mode one ticketed add a step
    (shared_dq), and with GQA a program a query head under a causal mask (its walks differ in
    length) but the group's under a full one (they end together); at D = 64 steps of 128 query rows
    (a turn of the dQ warp one step), at D = 128 of 64, its 16-bit P converted in pairs. Every
    candidate is one the kernel takes."""
    from tritonkit.ops.attention import bwd_sm90

    tile = bwd_sm90.CONFIGS[head_dim]
    assert tile.block_m == (128 if head_dim == 64 else 64) and tile.turn_blocks == 1
    for config in bwd_sm90.CANDIDATES[head_dim]:
        bwd_sm90.check_config(config, head_dim)
    assert len(set(bwd_sm90.CANDIDATES[head_dim])) == len(bwd_sm90.CANDIDATES[head_dim]) > 3
    for gqa in (False, True):
        for causal in (False, True):
            assert bwd_sm90.default_config(head_dim, False, gqa, causal) == tile
            deterministic = bwd_sm90.default_config(head_dim, True, gqa, causal)
            assert deterministic == tile._replace(
                shared_dq=True,
                per_query_head=gqa and causal,
                acquire_first=True,
                p_in_pairs=True,
            )


def test_the_gluon_backward_takes_every_window_on_sm90_alone(device):
    """A causal mask and windows of any width (narrow ones, a left side alone), over a packed batch's
    longest lengths too, take it on an sm_90 GPU; nothing does under the interpreter or off an sm_90
    GPU (Gluon kernels do not run there)."""
    from tritonkit.ops.attention import bwd
    from tritonkit.ops.attention.common import Packed, Scores

    q = torch.randn(1, 2, 16, 64, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 24, 64, device=device, dtype=torch.bfloat16)
    cu = torch.tensor([0, 16], dtype=torch.int32, device=device)
    packed = Packed(cu, cu, 1, 16, 24)
    for scores in (Scores(0.125, causal=True), Scores(0.125, window=(4, 0)), Scores(0.125, window=(3, -1))):
        for pack in (None, packed):
            for deterministic in (False, True):
                takes = bwd.sm90_takes(q, k, k, scores, pack, deterministic)
                assert takes == _sm90(), (scores, pack, deterministic)


@pytest.mark.parametrize("head_dim", [40, 64, 96, 128])
def test_the_finishing_passes_convert_dq_and_sum_the_shares_in_order(head_dim, device):
    """dq = scale * its fp32 accumulator, and each group's dK and dV shares summed in fp32 and
    rounded once, into gradients laid out as (B, S, H, D) memory (what a decoder layer's q, k and v
    give; at padded head dims a head's columns end where the next head's begin), at a length that
    leaves the last program part-filled; against the same values in float64
    to within the one rounding to bf16 (a unit in its last place: the interpreter truncates where
    the GPU rounds to nearest)."""
    from tritonkit import testing
    from tritonkit._launch import LAUNCH_OPTIONS
    from tritonkit.ops.attention import bwd_sm90 as bwd

    batch, heads_q, heads_kv, seq = 2, 6, 2, bwd.FINISH_ROWS + 13
    g = testing.generator(11)
    acc = testing.random_tensor((batch, heads_q, seq, head_dim), torch.float32, device, generator=g)
    shares = [
        testing.random_tensor((batch, heads_q, seq, head_dim), torch.bfloat16, device, generator=g)
        for _ in "kv"
    ]

    def laid_out(heads):
        return torch.full(
            (batch, seq, heads, head_dim), math.nan, dtype=torch.bfloat16, device=device
        ).transpose(1, 2)

    dq, grads = laid_out(heads_q), [laid_out(heads_kv) for _ in "kv"]
    for launch in bwd.finish_launches(acc, dq, 0.3, grads, shares):
        # the GPU's lean launcher takes the constexprs as the kernel's trailing parameters, in order
        constexprs = [name for name in launch.meta if name not in LAUNCH_OPTIONS]
        assert constexprs == launch.kernel.arg_names[len(launch.args) :], launch.name
        launch.run()
    one_rounding = {"rtol": 2**-7, "atol": 0.0}
    torch.testing.assert_close(dq.double(), acc.double() * 0.3, **one_rounding)
    for grad, share in zip(grads, shares, strict=True):
        summed = share.double().view(batch, heads_kv, -1, seq, head_dim).sum(2)
        torch.testing.assert_close(grad.double(), summed, **one_rounding)


# ---------------------------------------------------------------- on the H200


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _inputs(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, dtype, seed):
    """q, k, v and dO, seeded."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(batch, heads_q, seq_q, head_dim), *((batch, heads_kv, seq_k, head_dim),) * 2]
    shapes.append(shapes[0])
    return tuple(torch.randn(shape, device="cuda", dtype=dtype, generator=g) for shape in shapes)


def _forward(q, k, v, causal, scale, bottom_right, softcap=0.0):
    """o (in q's dtype) and the fp32 lse, from the float64 reference."""
    from tritonkit.ops.attention.common import attention_reference

    o, lse = attention_reference(
        q.double(), k.double(), v.double(), causal, scale, bottom_right=bottom_right, return_lse=True,
        softcap=softcap,
    )  # fmt: skip
    return o.to(q.dtype), lse.float()


def _run(
    q, k, v, do, o, lse, causal, scale, bottom_right, deterministic, grads=None, config=None, softcap=0.0
):
    """The kernel's (dq, dk, dv), written into NaN-filled buffers (or into ``grads``)."""
    from tritonkit.ops.attention import bwd, bwd_sm90

    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    for launch in bwd._delta_launches(o, do, None, delta):
        launch.run()
    dq, dk, dv = grads or tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    offset = q.shape[2] - k.shape[2]
    bwd_sm90.attention_bwd_sm90(
        do, q, k, v, lse, delta, dq, dk, dv, scale=scale, causal=causal,
        upper_offset=-offset if bottom_right else 0, softcap=softcap, deterministic=deterministic,
        config=config,
    )  # fmt: skip
    return dq, dk, dv


def assert_oracle_passes(grads, reference, dtype) -> None:
    """The oracle on (dq, dk, dv): against ``reference(torch.float64)``'s gradients, torch's error from
    ``reference(dtype)``'s."""
    from tritonkit.oracle import compare

    exact, in_dtype = reference(torch.float64), reference(dtype)
    comparisons = [
        compare(name, grad, torch_grad, exact_grad, dtype)
        for name, grad, torch_grad, exact_grad in zip(("dq", "dk", "dv"), grads, in_dtype, exact, strict=True)
    ]
    assert all(c.passed for c in comparisons), [str(c) for c in comparisons]


def check(q, k, v, do, causal, *, deterministic, scale=None, bottom_right=True, config=None, softcap=0.0):
    """The oracle on dq, dk and dv against autograd through the reference in float64, torch's error
    from the same reference run in the inputs' dtype."""
    from tritonkit.ops.attention.common import attention_reference

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, lse = _forward(q, k, v, causal, scale, bottom_right, softcap)
    grads = _run(
        q, k, v, do, o, lse, causal, scale, bottom_right, deterministic, config=config, softcap=softcap
    )

    def reference(dtype):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = attention_reference(*inputs, causal, scale, bottom_right=bottom_right, softcap=softcap)
        return torch.autograd.grad(out, inputs, do.to(dtype))

    assert_oracle_passes(grads, reference, q.dtype)


# (B, Hq, Hkv, Sq, Sk, causal, bottom_right): single rows and keys, lengths off the 64-row and
# 128-key blocks, Sq != Sk both ways and both alignments (causal with Sq > Sk bottom-right leaves
# rows that see no key), GQA 32/8 and MQA, diagonals on and off block edges
CASES = [
    (1, 1, 1, 1, 1, False, True),
    (1, 1, 1, 1, 1, True, True),
    (1, 2, 2, 1, 123, True, True),
    (1, 2, 2, 7, 7, True, True),
    (2, 3, 3, 123, 123, True, True),
    (1, 2, 2, 1000, 1000, False, True),
    (1, 2, 2, 1000, 1000, True, True),
    (1, 2, 2, 100, 1000, True, True),
    (1, 2, 2, 1000, 100, True, True),
    (1, 2, 2, 100, 1000, True, False),
    (1, 2, 2, 1000, 100, True, False),
    (2, 3, 3, 257, 389, False, True),
    (2, 3, 3, 389, 257, True, True),
    (1, 32, 8, 500, 700, True, True),
    (2, 8, 1, 333, 333, True, True),
    (2, 8, 1, 1, 333, False, True),
    (1, 4, 4, 384, 512, True, True),
    (1, 4, 4, 512, 512, False, True),
    (1, 1, 1, 100, 17000, False, True),  # more key blocks than the H200's SMs: no rotated walk
]


def _case_id(case) -> str:
    shape = "x".join(map(str, case[:5]))
    return shape + ("-causal" + ("" if case[6] else "-topleft") if case[5] else "")


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gpu_matches_the_reference(case, head_dim, dtype, deterministic):
    seed = 8 * CASES.index(case) + 4 * (head_dim == 128) + 2 * (dtype == torch.float16) + deterministic
    check_case(case, head_dim, dtype, deterministic, seed)


def check_case(case, head_dim: int, dtype, deterministic: bool, seed: int) -> None:
    """``check`` at one of CASES' shapes and masks, the inputs at ``head_dim`` seeded."""
    batch, heads_q, heads_kv, seq_q, seq_k, causal, bottom_right = case
    inputs = _inputs(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, dtype, seed)
    check(*inputs, causal, deterministic=deterministic, bottom_right=bottom_right)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "deterministic"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_soft_capped_scores(causal, head_dim, deterministic, caplog):
    """``softcap``: the gradients through softcap * tanh(s / softcap) (dS times 1 - tanh^2): a cap
    that bites (10, on scores spread past it), one where every tanh saturates (0.5), and one that
    barely does (1e7: the tanh's series near 0), GQA, ragged, Sq != Sk, fp16 too; and
    flash_attention's softcap takes this backward."""
    import logging

    import tritonkit

    for cap, spread, dtype in (
        (10.0, 4.0, torch.bfloat16),
        (0.5, 1.0, torch.bfloat16),
        (1e7, 1.0, torch.float16),
    ):
        q, k, v, do = _inputs(2, 4, 2, 333, 517, head_dim, dtype, seed=int(cap) % 97 + head_dim + causal)
        check(q * spread, k, v, do, causal, deterministic=deterministic, softcap=cap)
    q, k, v, _ = _inputs(1, 4, 4, 256, 256, head_dim, torch.bfloat16, seed=7)
    q.requires_grad_()
    with caplog.at_level(logging.DEBUG, logger="tritonkit"):
        tritonkit.flash_attention(
            q, k, v, causal=causal, softcap=30.0, deterministic=deterministic
        ).sum().backward()
    assert f"attention backward {tuple(q.shape)} on the sm_90 Gluon kernel" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_every_candidate_config(causal, head_dim):
    """Each candidate in both modes (GQA, ragged, Sq != Sk)."""
    from tritonkit.ops.attention import bwd_sm90

    for i, config in enumerate(bwd_sm90.CANDIDATES[head_dim]):
        for deterministic in (False, True):
            inputs = _inputs(2, 4, 2, 777, 901, head_dim, torch.bfloat16, seed=100 + i)
            check(*inputs, causal, deterministic=deterministic, config=config)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gpu_steps_of_128_query_rows_match_the_reference(case, dtype, deterministic):
    """``Config.block_m = 128`` at D = 64 (a step's S^T 64 x 128 a warpgroup, the 16-bit P), every
    case of the reference grid in both modes; deterministic, the same bits twice."""
    from tritonkit.ops.attention import bwd_sm90

    batch, heads_q, heads_kv, seq_q, seq_k, causal, bottom_right = case
    config = bwd_sm90.default_config(64, deterministic, heads_q != heads_kv, causal)._replace(
        block_m=128, turn_blocks=1
    )
    inputs = _inputs(batch, heads_q, heads_kv, seq_q, seq_k, 64, dtype, seed=128 + CASES.index(case))
    check(*inputs, causal, deterministic=deterministic, bottom_right=bottom_right, config=config)
    if deterministic:
        q, k, v, do = inputs
        scale = 1 / math.sqrt(64)
        o, lse = _forward(q, k, v, causal, scale, bottom_right)
        runs = [_run(q, k, v, do, o, lse, causal, scale, bottom_right, True, config=config) for _ in "ab"]
        assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_steps_of_128_query_rows_only_where_they_fit():
    """block_m = 128 takes D = 64 with shared_dq and without overlap_sdp; anything else raises
    before a launch (it would need more shared memory or registers than a program has)."""
    from tritonkit.ops.attention import bwd_sm90

    base = bwd_sm90.CONFIGS[64]._replace(block_m=128)
    bwd_sm90.check_config(base, 64)
    refused = [(128, bwd_sm90.CONFIGS[128]._replace(block_m=128)), (64, base._replace(shared_dq=False)),
               (64, base._replace(overlap_sdp=True)), (64, base._replace(block_m=96))]  # fmt: skip
    for head_dim, config in refused:
        q, k, v, do = (torch.randn(1, 1, 8, head_dim) for _ in range(4))
        with pytest.raises(ValueError, match="block_m"):
            bwd_sm90.attention_bwd_sm90(
                do,
                q,
                k,
                v,
                torch.zeros(1, 1, 8),
                torch.zeros(1, 1, 8),
                q,
                k,
                v,
                scale=0.1,
                causal=False,
                upper_offset=0,
                config=config,
            )


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_a_16_bit_p_converted_in_pairs_gives_the_same_bits(causal, heads):
    """``Config.p_in_pairs``: the deterministic mode's 16-bit P and dS at D = 128 converted two values
    an instruction rather than one, both rounding to nearest even: the same gradients, bit for bit,
    which pass the oracle."""
    from tritonkit.ops.attention import bwd_sm90

    q, k, v, do = _inputs(2, *heads, 1500, 1400, 128, torch.bfloat16, seed=1400 + causal)
    o, lse = _forward(q, k, v, causal, 0.1, True)
    paired = bwd_sm90.default_config(128, True, heads[0] != heads[1], causal)
    assert paired.p_in_pairs  # the deterministic default, against one value an instruction
    single = paired._replace(p_in_pairs=False)
    runs = [_run(q, k, v, do, o, lse, causal, 0.1, True, True, config=c) for c in (paired, single)]
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    check(q, k, v, do, causal, deterministic=True, scale=0.1, config=paired)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_strided_layouts_and_scale(causal):
    """(B, S, H, D) tensors viewed as (B, H, S, D), a dO whose last dim is strided (TMA cannot read
    it: copied), strided gradients and a scale of its own."""
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (
        torch.randn(2, s, h, 128, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        for s, h in ((301, 4), (517, 2), (517, 2))
    )
    do = torch.randn(2, 4, 128, 301, device="cuda", dtype=torch.bfloat16, generator=g).transpose(2, 3)
    check(q, k, v, do, causal, deterministic=True, scale=0.3)
    o, lse = _forward(q, k, v, causal, 0.3, True)
    grads = tuple(torch.full_like(t.transpose(1, 2), math.nan).transpose(1, 2) for t in (q, k, v))
    _run(q, k, v, do, o, lse, causal, 0.3, True, True, grads)
    # the same dO (the delta kernel's order of summation follows its strides): the same bits
    dense = _run(q.contiguous(), k.contiguous(), v.contiguous(), do, o, lse, causal, 0.3, True, True)
    assert all(torch.equal(a, b) for a, b in zip(grads, dense, strict=True))


# (DETERMINISTIC_PAIRS_PER_GROUP, Config.shared_dq, Config.per_query_head), by name; a program a
# query head is GQA's alone (without GQA a program takes one query head already)
ORDERS = {
    "turns-slow": (None, False, False),
    "key-major": (1, False, False),
    "groups-of-3": (3, False, False),
    "key-major-shared-dq": (1, True, False),
    "groups-of-3-shared-dq": (3, True, False),
    "key-major-per-query-head": (1, True, True),
    "groups-of-3-per-query-head": (3, True, True),
}
BITS_CASES = [
    pytest.param(heads, *order, id=f"{kind}-{name}")
    for kind, heads in (("mha", (8, 8)), ("gqa", (8, 2)))
    for name, order in ORDERS.items()
    if heads[0] != heads[1] or not order[2]
]


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("heads, group, shared_dq, per_query_head", BITS_CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_deterministic_mode_gives_the_same_bits(
    causal, heads, group, shared_dq, per_query_head, monkeypatch
):
    """(2, H, 2048 + 77, 128) bf16, many key blocks adding into each dq block: the deterministic
    mode's three gradients are the same bits run after run, in every order of programs
    (``bwd_sm90.DETERMINISTIC_PAIRS_PER_GROUP``; 3 leaves a smaller last group, and all pairs at
    once walks a full mask unrotated), both dQ splits and GQA's programs of a group or of a query
    head, which pass the oracle, and close to the free mode's (whose P reaches dS in fp32, where
    the deterministic mode's is rounded to 16 bits first: not the same bits)."""
    from tritonkit.ops.attention import bwd_sm90

    monkeypatch.setattr(bwd_sm90, "DETERMINISTIC_PAIRS_PER_GROUP", group)
    config = bwd_sm90.CONFIGS[128]._replace(
        shared_dq=shared_dq, per_query_head=per_query_head, acquire_first=True
    )
    q, k, v, do = _inputs(2, *heads, 2125, 2125, 128, torch.bfloat16, seed=2125 + causal)
    check(q, k, v, do, causal, deterministic=True, scale=0.1, config=config)
    o, lse = _forward(q, k, v, causal, 0.1, True)
    runs = [_run(q, k, v, do, o, lse, causal, 0.1, True, True, config=config) for _ in range(3)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))
    free = _run(q, k, v, do, o, lse, causal, 0.1, True, False, config=config)
    for a, b in zip(free, runs[0], strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_polling_acquiring_first_keeps_the_deterministic_bits(causal, heads, head_dim):
    """``Config.acquire_first`` changes how the dQ warp polls its turn, not the order of the adds:
    the deterministic gradients are the same bits with it and without, and pass the oracle."""
    from tritonkit.ops.attention import bwd_sm90

    q, k, v, do = _inputs(2, *heads, 1500, 1500, head_dim, torch.bfloat16, seed=1500 + causal)
    o, lse = _forward(q, k, v, causal, 0.1, True)
    shipped = bwd_sm90.default_config(head_dim, True, heads[0] != heads[1], causal)
    plain = shipped._replace(acquire_first=False)
    polled = plain._replace(acquire_first=True)
    runs = [_run(q, k, v, do, o, lse, causal, 0.1, True, True, config=c) for c in (polled, plain)]
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    check(q, k, v, do, causal, deterministic=True, scale=0.1, config=polled)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    "heads, rotate", [((4, 4), True), ((8, 2), True), ((4, 4), False)], ids=["mha", "gqa", "unrotated"]
)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_turns_of_two_query_blocks_keep_the_order_of_the_adds(
    causal, heads, rotate, head_dim, monkeypatch
):
    """``Config.turn_blocks`` = 2 (a turn of the dQ warp held over two query blocks): where the
    groups of query blocks leave the order of the adds as it was (a causal mask always, descending
    key blocks; a full mask's rotated walk where its starts fall on groups, as at Sq = Sk; its
    unrotated walk, ascending, always) the gradients are the one-block turns' bits; where they do
    not (a rotated walk at Sq = 1400, Sk = 1500: two key blocks start on one group, the second
    waiting on the first's two blocks), the same bits call after call; and both pass the oracle, at
    lengths that leave the last group one block and a causal walk starting inside a group (Sk - Sq
    not a multiple of two blocks)."""
    from tritonkit.ops.attention import bwd_sm90

    if not rotate:  # a full mask's walk from query block 0 for every key block
        order = bwd_sm90.order
        monkeypatch.setattr(bwd_sm90, "order", lambda *args, **kwargs: (order(*args, **kwargs)[0], False))
    shipped = bwd_sm90.default_config(head_dim, True, heads[0] != heads[1], causal)
    single, paired = shipped._replace(turn_blocks=1), shipped._replace(turn_blocks=2)
    for seq_q, seq_k in ((1500, 1500), (100, 100), (1400, 1500), (1500, 1400)):
        q, k, v, do = _inputs(2, *heads, seq_q, seq_k, head_dim, torch.bfloat16, seed=seq_q + causal)
        check(q, k, v, do, causal, deterministic=True, scale=0.1, config=paired)
        o, lse = _forward(q, k, v, causal, 0.1, True)
        runs = [_run(q, k, v, do, o, lse, causal, 0.1, True, True, config=paired) for _ in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
        # at Sq = Sk a key block of BLOCK_N keys starts its rotated walk on a group of two 64-row
        # query blocks; a block of 128 rows, BLOCK_N's own, starts one block on (a group split)
        if causal or not rotate or (seq_q == seq_k and shipped.block_m * 2 == bwd_sm90.BLOCK_N):
            runs.append(_run(q, k, v, do, o, lse, causal, 0.1, True, True, config=single))
            assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[-1], strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "deterministic"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_gpu_flash_attention_backward_runs_the_gluon_kernel(heads, deterministic, caplog):
    """Through the public function with the shipped switches, D = 64 takes the Gluon backward in
    both modes, with GQA and without: the debug line names it, and its gradients pass the oracle
    (causal, Sq != Sk)."""
    import tritonkit
    from tritonkit.ops.attention import bwd
    from tritonkit.ops.attention.common import Scores

    q, k, v, do = _inputs(2, *heads, 300, 450, 64, torch.bfloat16, seed=7)
    assert bwd.sm90_takes(q, k, v, Scores(64**-0.5, True), None, deterministic)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    with caplog.at_level(logging.DEBUG, logger="tritonkit"):
        out = tritonkit.flash_attention(*inputs, causal=True, deterministic=deterministic)
        grads = torch.autograd.grad(out, inputs, do)
    assert any("backward" in r.message and "sm_90 Gluon" in r.message for r in caplog.records)
    o, lse = _forward(q, k, v, True, 64**-0.5, True)
    mine = _run(q, k, v, do, o, lse, True, 64**-0.5, True, deterministic)
    for a, b in zip(grads, mine, strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    check(q, k, v, do, True, deterministic=deterministic)
