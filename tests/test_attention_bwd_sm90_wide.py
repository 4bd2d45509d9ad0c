"""The sm_90 Gluon attention backward at D = 256 (``ops/attention/bwd_sm90_wide.py``: two warpgroups
splitting a step's products). On the CPU: it compiles for sm_90 warp-specialized (no values on the
stack in the consumers' loops, a few of the dQ warp's with turns of two blocks, the dQ partials out
by bulk reduce-add, the deterministic mode's tickets), its launch passes the kernel's parameters in
order, its configs and what the dispatch gives it. On the H200 (``gpu``): dq, dk and dv against the
float64 reference gradients with the oracle's rule (full and causal masks of both alignments, Sq !=
Sk, single rows, GQA and MQA, the padded D = 200, fp16 and bf16, windows and soft caps, both modes,
GQA a program a query head), the deterministic mode's bits run to run (turns of several query blocks
too), and ``flash_attention`` on it."""

from __future__ import annotations

import itertools
import json
import logging

import pytest
import torch

import sm90
from test_attention_bwd_sm90 import (
    CASES,
    _case_id,
    _forward,
    _inputs,
    _run,
    _sm90,
    assert_oracle_passes,
    check,
    check_case,
)
from test_attention_bwd_sm90_windows import CASES as WINDOW_CASES
from test_attention_bwd_sm90_windows import _case_id as _window_case_id
from test_attention_bwd_sm90_windows import _check_window

pytestmark = pytest.mark.attention

_STATIC_CHECK = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from tritonkit.asm import _cuobjdump, innermost_loops
from tritonkit.ops.attention import bwd_sm90_wide as wide

def descriptor(dtype, rows, cols):
    block = [1, 1, rows, cols]
    element = {"bf16": gl.bfloat16, "fp16": gl.float16, "fp32": gl.float32}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block, element)
    return f"tensordesc<{dtype}[{','.join(map(str, block))}],{layout!r}>"

for dtype, causal, deterministic, stages, lower, softcap, *extra in CASES:
    extra = extra[0] if extra else {}
    keys = wide.KEYS.value
    rows = {"q_desc": wide.BLOCK_M, "k_desc": keys, "v_desc": keys, "do_desc": wide.BLOCK_M, "dk_desc": keys,
            "dv_desc": keys}
    signature = {name: descriptor(dtype, n, 256) for name, n in rows.items()}
    signature |= {"dq_desc": descriptor("fp32", wide.BLOCK_M, wide.DQ_COLS.value), "lse_ptr": "*fp32",
                  "delta_ptr": "*fp32", "sem_ptr": "*i32", "dk_ptr": f"*{dtype}", "dv_ptr": f"*{dtype}",
                  "cu_q_ptr": "*i32", "cu_k_ptr": "*i32"}
    for name in ("stride_lb", "stride_lh", "stride_db", "stride_dh", "stride_sb", "stride_sh", "stride_dkh",
                 "stride_dks", "stride_dvh", "stride_dvs", "HEADS_KV", "PAIRS", "PAIRS_PER_GROUP", "GROUP",
                 "SEQ_Q", "SEQ_K", "UPPER_OFFSET", "LOWER_OFFSET"):
        signature[name] = "i32"
    signature |= {"KV_SHARE": "constexpr", "qk_scale": "fp32", "cap_log2": "fp32", "scale": "fp32"}
    constants = {"KV_SHARE": 1, "IS_CAUSAL": causal, "DETERMINISTIC": deterministic, "NUM_STAGES": stages,
                 "ROTATE": deterministic and not causal, "ACQUIRE_FIRST": deterministic,
                 "TURN_BLOCKS": extra.get("turn_blocks", 1),
                 "HAS_LOWER": lower, "SOFTCAP": softcap, "DQ_BUFFERS": extra.get("dq_buffers", 1),
                 "VARLEN": extra.get("varlen", False), "TENSOR_D": extra.get("tensor_d", 0)}
    signature |= {name: "constexpr" for name in constants}
    kernel = triton.compile(GluonASTSource(wide._attn_bwd_sm90_wide_kernel, signature, constants),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx, sass = kernel.asm["ptx"], _cuobjdump(kernel.asm["cubin"], "-sass")
    budgets = r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)"
    print(json.dumps({
        "warps": kernel.metadata.num_warps, "shared": kernel.metadata.shared,
        "setmaxnreg": sorted({int(n) for n in re.findall(budgets, ptx)}),
        "hgmma": sass.count("HGMMA"), "hmma": sass.count(" HMMA"),
        "spills": sass.count("STL") + sass.count("LDL"),
        "loops": [[loop.mix["HGMMA"], loop.local_accesses] for loop in innermost_loops(sass)],
        "single_conversions": sass.count("F2F.BF16.F32") + sass.count("F2F.F16.F32"),
        "reduces": sass.count("UTMAREDG"), "tma_loads": ptx.count("cp.async.bulk.tensor.4d.shared"),
        "tickets": ptx.count("ld.global.gpu.acquire"), "releases": ptx.count("atom.global.gpu.release.add"),
    }))
"""

# (dtype, causal, deterministic, stages, lower, softcap[, {dq_buffers, varlen, tensor_d}]): both
# masks, both modes (a deterministic full mask compiles the rotated walk), fp16, three stages of Q and
# dO, a window's left side (a third, masked loop) in both modes, soft caps (warpgroup 0's tanh), with
# a window too, two dQ staging tiles a warpgroup, and packed batches (dK and dV stored row by row;
# at the padded D = 200 masked by column too)
STATIC_CASES = [
    ("bf16", True, False, 2, False, False),
    ("bf16", False, True, 2, False, False),
    ("fp16", True, True, 2, False, False),
    ("bf16", False, False, 3, False, False),
    ("bf16", True, False, 2, True, False),
    ("bf16", True, True, 2, True, False),
    ("bf16", False, False, 2, False, True),
    ("fp16", True, True, 2, True, True),
    ("bf16", True, True, 2, False, False, {"dq_buffers": 2}),
    ("bf16", False, True, 2, False, False, {"turn_blocks": 2}),
    ("bf16", True, True, 2, False, False, {"turn_blocks": 2}),
    ("bf16", True, False, 2, False, False, {"varlen": True, "tensor_d": 256}),
    ("fp16", True, True, 2, True, True, {"varlen": True, "tensor_d": 200}),
]


@pytest.mark.parametrize("case", STATIC_CASES, ids=lambda case: "-".join(map(str, case)))
def test_the_kernel_compiles_for_hopper_warp_specialized_without_spills(case):
    (row,) = [json.loads(line) for line in sm90.run(f"CASES = {[case]!r}\n{_STATIC_CHECK}")]
    deterministic = case[2]
    # two consumer warpgroups, the producer's warp and the dQ warp; budgets 240 and 24 (and Triton's)
    assert row["warps"] == 12 and {240, 24} <= set(row["setmaxnreg"]), row
    assert row["shared"] <= 227 * 1024, row
    assert row["hgmma"] > 0 and row["hmma"] == 0 and row["tma_loads"] > 0, row
    assert row["reduces"] > 0, row  # dQ's partials go out by bulk reduce-add
    assert (row["tickets"] > 0) == (row["releases"] > 0) == deterministic, row
    # dK or dV (128 registers a thread) and a step's 64 x 32 products: nothing on the stack in the
    # consumers' loops (those of the HGMMAs)
    assert all(local == 0 for hgmma, local in row["loops"] if hgmma), row
    if case[6:] and case[6].get("turn_blocks", 1) > 1:
        # the dQ warp (24 registers) holding a turn over several blocks keeps a few values on the
        # stack: 19 full, 10 causal at two blocks, at most 4 of them in a loop without HGMMAs
        assert row["spills"] <= 20 and all(local <= 4 for hgmma, local in row["loops"] if not hgmma), row
    else:
        assert row["spills"] == 0, row
    assert row["single_conversions"] == 0, row  # P and dS converted in pairs (F2FP)


def test_the_launch_passes_the_kernels_parameters_in_order(monkeypatch):
    """Runtime arguments by position, then the constexprs as the kernel's trailing parameters (only
    a GPU run would otherwise tell); a program a 64-key block of a (batch, key/value head), its boxes
    of 32 query rows, 64 keys and dQ's 128 columns a warpgroup; a packed batch's grid over its
    sequences and the longest one's key blocks, its cu_seqlens and dK's pointer passed."""
    from tritonkit.ops.attention import bwd_sm90
    from tritonkit.ops.attention.common import Packed

    monkeypatch.setattr(bwd_sm90, "sm_count", lambda device: 132)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    packed = Packed(cu, cu, 2, 200, 200)
    for heads_kv, deterministic, lower, softcap, pack in (
        (2, False, None, 0.0, None),
        (4, True, -100, 30.0, None),
        (2, True, None, 0.0, packed),
    ):
        q = torch.empty(1, 4, 300, 256, dtype=torch.bfloat16)
        k = torch.empty(1, heads_kv, 300, 256, dtype=torch.bfloat16)
        lse, acc, tickets = torch.empty(1, 4, 300), torch.empty(1, 4, 300, 256), torch.empty(1, 4, 10)
        config = bwd_sm90.default_config(256, deterministic, heads_kv != 4, True)
        (launch,) = bwd_sm90.launches(
            q, q, k, k, lse, lse, acc, tickets.int(), k, k, scale=0.1, causal=True, upper_offset=0,
            lower_offset=lower, softcap=softcap, deterministic=deterministic, config=config, packed=pack,
        )  # fmt: skip
        names = launch.kernel.arg_names
        constexprs = [name for name in launch.meta if name != "num_warps"]
        assert names[len(launch.args) :] == constexprs, names
        assert [arg.block_shape[2:] for arg in launch.args[:7]] == [[32, 256]] + [[64, 256]] * 2 + [
            [32, 256]
        ] + [[64, 256]] * 2 + [[32, 128]]
        # 5 key blocks of 64 over 300 keys, or over the longest sequence's 200 keys 4, a sequence each
        blocks = 5 if pack is None else 4 * 2
        assert launch.grid == (blocks * heads_kv,) and launch.meta["DETERMINISTIC"] == deterministic
        assert launch.meta["VARLEN"] == (pack is not None)
        assert launch.meta["TENSOR_D"] == (0 if pack is None else 256)
        if pack is not None:
            assert launch.args[names.index("cu_q_ptr")] is cu and launch.args[names.index("dk_ptr")] is k
        assert launch.meta["HAS_LOWER"] == (lower is not None)
        assert launch.args[names.index("LOWER_OFFSET")] == (lower or 0)
        assert launch.meta["SOFTCAP"] == bool(softcap)
        qk_scale, cap_log2 = launch.args[names.index("qk_scale")], launch.args[names.index("cap_log2")]
        log2e = 1.4426950408889634
        if softcap:
            assert qk_scale == pytest.approx(0.1 / 30.0) and cap_log2 == pytest.approx(30.0 * log2e)
        else:
            assert qk_scale == pytest.approx(0.1 * log2e) and cap_log2 == 1.0


def test_the_wide_configs_and_what_they_refuse():
    """D = 256 takes 32-row steps, one dQ tile a step and 2 or 3 stages (the deterministic mode its
    usual switches), two dQ staging tiles a warpgroup at two stages; anything else is refused before a
    launch, as are two dQ tiles below D = 256."""
    from tritonkit.ops.attention import bwd_sm90

    free = bwd_sm90.default_config(256, False)
    assert free == bwd_sm90.WIDE_CONFIG and free.block_m == 32 and free.shared_dq
    # the deterministic mode's turn covers two blocks (WIDE_TURN_BLOCKS), a mask and GQA or not; with
    # GQA a program a query head under either mask
    for gqa, causal in itertools.product((False, True), repeat=2):
        config = bwd_sm90.default_config(256, True, gqa, causal)
        assert config.turn_blocks == 2 and config.per_query_head == gqa
    assert bwd_sm90.default_config(128, True).turn_blocks == 1
    bwd_sm90.check_config(bwd_sm90.default_config(256, True, True, True), 256)
    bwd_sm90.check_config(free._replace(num_stages=3), 256)
    bwd_sm90.check_config(free._replace(dq_buffers=2), 256)
    for bad in (
        free._replace(num_stages=4),
        free._replace(block_m=64),
        free._replace(overlap_sdp=True),
        free._replace(num_stages=3, dq_buffers=2),  # 246 KB of shared memory
        free._replace(dq_buffers=3),
        free._replace(rotate=True),  # (the free mode's rotated walk is the D <= 128 kernel's)
    ):
        with pytest.raises(ValueError, match="D = 256"):
            bwd_sm90.check_config(bad, 256)
    with pytest.raises(ValueError, match="dq_buffers"):
        bwd_sm90.check_config(bwd_sm90.CONFIGS[128]._replace(dq_buffers=2), 128)
    assert tuple(range(136, 257, 8)) == bwd_sm90.WIDE_HEAD_DIMS


# ---------------------------------------------------------------- on the H200

WIDE_CASES = [CASES[i] for i in (0, 1, 4, 6, 9, 10, 11, 12, 13, 14)]


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "deterministic"])
@pytest.mark.parametrize("head_dim", [256, 200])
@pytest.mark.parametrize("case", WIDE_CASES, ids=_case_id)
def test_gpu_matches_the_reference(case, head_dim, deterministic):
    dtype = torch.float16 if WIDE_CASES.index(case) % 3 == 2 else torch.bfloat16
    seed = 300 + 4 * WIDE_CASES.index(case) + 2 * (head_dim == 200) + deterministic
    check_case(case, head_dim, dtype, deterministic, seed)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "deterministic"])
@pytest.mark.parametrize("head_dim", [256, 200])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_soft_capped_scores(causal, head_dim, deterministic):
    """Soft caps at D = 256 and the padded 200 (warpgroup 0's tanh, P^T (1 - tanh^2) handed over),
    GQA and Sq != Sk, a cap of 30 and one of 5 that bends most scores, against the float64 reference."""
    for cap, (seq_q, seq_k) in ((30.0, (700, 900)), (5.0, (333, 333))):
        seed = 900 + seq_q + 2 * causal + deterministic + (head_dim == 200)
        q, k, v, do = _inputs(2, 4, 2, seq_q, seq_k, head_dim, torch.bfloat16, seed=seed)
        check(q, k, v, do, causal, deterministic=deterministic, scale=head_dim**-0.5, softcap=cap)


# the windows' cases: causal windows on and off the blocks' edges, two-sided ones, either side alone,
# narrow ones, both alignments, GQA and MQA, soft caps beside a window
WIDE_WINDOW_CASES = WINDOW_CASES


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "deterministic"])
@pytest.mark.parametrize("case", WIDE_WINDOW_CASES, ids=_window_case_id)
def test_gpu_windows_match_the_reference(case, deterministic):
    """A window's left side (the third, masked loop) and its right side at D = 256, soft caps beside
    some, against the float64 reference; the deterministic mode's bits again."""
    from tritonkit.ops.attention.common import Scores

    batch, heads_q, heads_kv, seq_q, seq_k, causal, bottom_right, window, *cap = case
    dtype = torch.float16 if WIDE_WINDOW_CASES.index(case) % 3 == 1 else torch.bfloat16
    seed = 700 + 2 * WIDE_WINDOW_CASES.index(case) + deterministic
    q, k, v, do = _inputs(batch, heads_q, heads_kv, seq_q, seq_k, 256, dtype, seed)
    scores = Scores(256**-0.5, causal, bottom_right, window, *cap)
    grads = _check_window(q, k, v, do, scores, deterministic)
    if deterministic:
        again = _check_window(q, k, v, do, scores, deterministic)
        assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_deterministic_bits_and_three_stages(causal):
    """(2, 8/2, 1500, 256): the deterministic gradients (a program a query head under a causal mask)
    the same bits three runs over, with three stages of Q and dO and with two dQ staging tiles a
    warpgroup, passing the oracle, close to the free mode's."""
    from tritonkit.ops.attention import bwd_sm90

    q, k, v, do = _inputs(2, 8, 2, 1500, 1500, 256, torch.bfloat16, seed=1500 + causal)
    o, lse = _forward(q, k, v, causal, 0.1, True)
    config = bwd_sm90.default_config(256, True, True, causal)
    runs = [_run(q, k, v, do, o, lse, causal, 0.1, True, True, config=config) for _ in range(3)]
    runs.append(_run(q, k, v, do, o, lse, causal, 0.1, True, True, config=config._replace(num_stages=3)))
    runs.append(_run(q, k, v, do, o, lse, causal, 0.1, True, True, config=config._replace(dq_buffers=2)))
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))
    check(q, k, v, do, causal, deterministic=True, scale=0.1, config=config)
    free = _run(q, k, v, do, o, lse, causal, 0.1, True, False)
    for a, b in zip(free, runs[0], strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("turn_blocks", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_turns_of_several_query_blocks(causal, turn_blocks):
    """``Config.turn_blocks`` > 1 on the wide kernel (a turn of the dQ warp held over several 32-row
    query blocks): the gradients pass the oracle and are the same bits call after call; under a
    causal mask (key blocks descending from the group's last) they are the one-block turns' bits.
    Lengths that leave the last group short and start a causal walk inside a group, with GQA."""
    from tritonkit.ops.attention import bwd_sm90

    shipped = bwd_sm90.default_config(256, True, True, causal)
    single, grouped = shipped._replace(turn_blocks=1), shipped._replace(turn_blocks=turn_blocks)
    for seq_q, seq_k in ((1000, 1000), (900, 1000)):
        seed = seq_q + 2 * causal + turn_blocks
        q, k, v, do = _inputs(1, 4, 2, seq_q, seq_k, 256, torch.bfloat16, seed=seed)
        check(q, k, v, do, causal, deterministic=True, scale=0.1, config=grouped)
        o, lse = _forward(q, k, v, causal, 0.1, True)
        runs = [_run(q, k, v, do, o, lse, causal, 0.1, True, True, config=grouped) for _ in range(2)]
        if causal:
            runs.append(_run(q, k, v, do, o, lse, causal, 0.1, True, True, config=single))
        for other in runs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "deterministic"])
def test_gpu_flash_attention_takes_the_wide_backward(deterministic, monkeypatch, caplog):
    """With ``bwd.SM90_BACKWARD_WIDE`` on, ``flash_attention``'s backward at D = 256 runs this kernel
    (its debug line says so) and its gradients pass the oracle; a soft cap and a window take it too."""
    import tritonkit
    from tritonkit.ops.attention import bwd
    from tritonkit.ops.attention.common import attention_reference

    monkeypatch.setattr(bwd, "SM90_BACKWARD_WIDE", True)
    q, k, v, do = _inputs(2, 8, 4, 700, 700, 256, torch.bfloat16, 500 + deterministic)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with caplog.at_level(logging.DEBUG, logger="tritonkit"):
        grads = torch.autograd.grad(
            tritonkit.flash_attention(*leaves, causal=True, deterministic=deterministic), leaves, do
        )
        assert "backward (2, 8, 700, 256) on the sm_90 Gluon kernel" in caplog.text, caplog.text
        caplog.clear()
        for options in ({"softcap": 30.0}, {"window": (300, 0)}):
            caplog.clear()
            out = tritonkit.flash_attention(*leaves, causal=True, deterministic=deterministic, **options)
            torch.autograd.grad(out, leaves, do)
            assert "backward (2, 8, 700, 256) on the sm_90 Gluon kernel" in caplog.text, options

    def reference(dtype):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(attention_reference(*inputs, True, 256**-0.5), inputs, do.to(dtype))

    assert_oracle_passes(grads, reference, torch.bfloat16)
