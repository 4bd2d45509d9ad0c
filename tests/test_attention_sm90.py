"""The sm_90 Gluon attention forward (``ops/attention/fwd_sm90.py``): its SASS checked for Hopper
without a GPU (warp-specialized partitions with register budgets, the main loop's wgmma wait leaving
one group outstanding with the block's exponentials under it, HGMMA, no spills), and on the H200
(``gpu``) its output and lse against the float64 reference with the oracle's rule, over ragged
lengths, both causal alignments of Sq != Sk, GQA/MQA, fp16/bf16, D 64 and 128 and strided layouts.
Gluon kernels do not run in Triton's interpreter, so nothing here runs on the CPU but the compile."""

from __future__ import annotations

import itertools
import json
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
from tritonkit.ops.attention import fwd_sm90 as fwd

def numbers(pattern, text):
    return sorted(set(int(n) for n in re.findall(pattern, text)))

def descriptor(dtype, rows, head_dim):
    block = [1, 1, rows, head_dim]
    layout = gl.NVMMASharedLayout.get_default_for(block, {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype])
    return f"tensordesc<{dtype}[{','.join(map(str, block))}],{layout!r}>"

for dtype, head_dim, causal, persistent, pingpong, *switches in CASES:
    softcap, window, varlen = (bool(switches[i]) if len(switches) > i else False for i in range(3))
    tensor_d = switches[3] if len(switches) > 3 else head_dim  # packed: the tensors' D, padded below
    config = fwd.CONFIGS[head_dim]._replace(persistent=persistent, pingpong=pingpong)
    signature = {"q_desc": descriptor(dtype, fwd.SPLIT_M, head_dim),
                 "k_desc": descriptor(dtype, config.block_n, head_dim),
                 "v_desc": descriptor(dtype, config.block_n, head_dim),
                 "o_desc": descriptor(dtype, fwd.SPLIT_M, head_dim), "o_ptr": f"*{dtype}",
                 "stride_oh": "i64", "stride_os": "i64", "lse_ptr": "*fp32", "stride_lb": "i64",
                 "stride_lh": "i64", "HEADS": "i32", "BATCH_HEADS": "i32", "HEADS_PER_GROUP": "i32",
                 "GROUP": "i32", "SEQ_Q": "i32", "SEQ_K": "i32", "UPPER_OFFSET": "i32", "LOWER_OFFSET": "i32",
                 "cu_q_ptr": "*i32", "cu_k_ptr": "*i32",
                 "qk_scale": "fp32", "cap_log2": "fp32", "IS_CAUSAL": "constexpr", "NUM_STAGES": "constexpr",
                 "PIN_SOFTMAX": "constexpr", "PINGPONG": "constexpr", "CONSUMERS": "constexpr",
                 "CONSUMER_REGS": "constexpr", "PERSISTENT": "constexpr", "SOFTCAP": "constexpr",
                 "HAS_LOWER": "constexpr", "VARLEN": "constexpr", "TENSOR_D": "constexpr"}
    constants = {"IS_CAUSAL": causal, "NUM_STAGES": config.num_stages, "PIN_SOFTMAX": config.pin_softmax,
                 "PINGPONG": config.pingpong, "CONSUMERS": fwd.NUM_CONSUMERS,
                 "CONSUMER_REGS": fwd.CONSUMER_REGS, "PERSISTENT": persistent, "SOFTCAP": softcap,
                 "HAS_LOWER": window, "VARLEN": varlen, "TENSOR_D": tensor_d}
    kernel = triton.compile(GluonASTSource(fwd._attn_fwd_sm90_kernel, signature, constants),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": fwd.CONSUMER_WARPS.value})
    ptx, sass = kernel.asm["ptx"], _cuobjdump(kernel.asm["cubin"], "-sass")
    under, current = [], None  # MUFU.EX2 between each wait(1) and the next wait(0)
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            current = 0
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line and current is not None:
            under.append(current)
            current = None
        elif "MUFU.EX2" in line and current is not None:
            current += 1
    print(json.dumps({
        "case": f"{dtype} d{head_dim} {'causal' if causal else 'full'}{' persistent' if persistent else ''}"
                f"{' ping-pong' if pingpong else ''}{' softcap' if softcap else ''}"
                f"{' window' if window else ''}{' packed' if varlen else ''}"
                f"{f' of D {tensor_d}' if tensor_d != head_dim else ''}",
        "warps": kernel.metadata.num_warps, "shared": kernel.metadata.shared,
        "waits": numbers(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx),
        "setmaxnreg": numbers(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx),
        "hgmma": sass.count("HGMMA"), "hmma": sass.count(" HMMA"),
        "spills": sass.count("STL") + sass.count("LDL"),
        # the local loads and stores a step of an innermost loop repeats (the others run once a walk)
        "loop_spills": sum(loop.local_accesses for loop in innermost_loops(sass)),
        "single_conversions": sass.count("F2F.BF16.F32") + sass.count("F2F.F16.F32"),
        "swaps": sass.count("PRMT"),
        "tma_loads": ptx.count("cp.async.bulk.tensor.4d.shared"), "exps_under_pv": max(under or [0]),
        "block_exps": fwd.SPLIT_M * config.block_n // 128,
    }))
"""


# (dtype, D, causal, persistent, ping-pong[, softcap[, window[, packed[, the tensors' D]]]]): the default
# tile, persistent or not, the persistent one with ping-pong, with soft-capped scores, with a window's
# lower bound, D = 256, and a packed batch, at a padded head dim too, persistent and one tile a program
# (D = 256)
STATIC_CASES = [
    ("bf16", 128, False, False, False),
    ("bf16", 128, True, False, False),
    ("fp16", 64, True, False, False),
    ("bf16", 128, True, True, False),
    ("fp16", 64, False, True, False),
    ("bf16", 128, False, True, False),
    ("bf16", 128, True, True, True),
    ("bf16", 128, True, True, False, True),
    ("bf16", 64, False, True, False, True),
    ("bf16", 128, True, True, False, False, True),
    ("fp16", 64, False, False, False, False, True),
    ("bf16", 256, True, False, False),
    ("fp16", 256, False, False, False, True, True),
    ("bf16", 128, True, True, False, False, False, True),
    ("fp16", 64, False, True, False, False, True, True),
    ("bf16", 128, True, True, False, False, False, True, 96),
    ("bf16", 256, True, False, False, False, False, True),
    ("fp16", 256, True, False, False, True, True, True, 200),
]


# one case a test, so that the suite's workers share the compiles
@pytest.mark.parametrize("case", STATIC_CASES, ids=lambda case: "-".join(map(str, case)))
def test_the_kernel_compiles_for_hopper_warp_specialized_with_its_softmax_under_the_pv_product(case):
    rows = [json.loads(line) for line in sm90.run(f"CASES = {[case]!r}\n{_STATIC_CHECK}")]
    assert len(rows) == 1
    for row in rows:
        # two consumer warpgroups and the producer's warpgroup; budgets 240 and 24 (and Triton's steps)
        assert row["warps"] == 12 and {240, 24} <= set(row["setmaxnreg"]), row
        assert row["shared"] <= 227 * 1024, row
        assert row["waits"] == [0, 1], row  # the main loop waits for the older product only
        assert row["hgmma"] > 0 and row["hmma"] == 0 and row["tma_loads"] > 0, row
        # none, persistent too (the causal walk had 2: 32-bit lse strides), and none a step of the loops
        assert row["spills"] == 0 and row["loop_spills"] == 0, row
        # P and O convert to 16 bits in pairs (F2FP, on the ALU): a conversion a value (F2F) runs on
        # the MUFU's pipe, beside the exponentials (the backward's P does:
        # docs/perf-notes/attention-backward-sm90.md)
        assert row["single_conversions"] == 0, row
        # and in the order the PV product reads them: no PRMT swapping the halves of P's registers
        # (256 when P converted by .to(); a causal kernel keeps 2 on integers, not P's; a packed
        # batch's masked row stores of O take one a pair of columns, once a tile)
        head_dim = case[1]
        assert row["swaps"] <= 2 + (head_dim // 2 if "packed" in row["case"] else 0), row
        # a block's exponentials (64 a thread at 128 keys) run while the previous PV product does
        assert row["exps_under_pv"] >= row["block_exps"], row


def test_the_default_tile_is_persistent_over_few_keys():
    from tritonkit.ops.attention import fwd_sm90 as fwd

    most = fwd.PERSISTENT_MAX_KEYS
    for head_dim in (64, 128):
        persistent = fwd.CONFIGS[head_dim]._replace(persistent=True)
        assert fwd.default_config(head_dim, most) == persistent
        assert fwd.default_config(head_dim, 1) == persistent
        assert fwd.default_config(head_dim, most + 1) == fwd.CONFIGS[head_dim]
    assert all(config in fwd.CANDIDATES[d] for d in fwd.HEAD_DIMS for config in (fwd.default_config(d, 1),))
    # D = 256: one tile a program (the persistent tile's O buffers do not fit), and a persistent one refused
    assert fwd.default_config(256, 1) == fwd.default_config(256, most + 1) == fwd.CONFIGS[256]
    q = torch.empty(1, 2, 16, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="persistent"):
        fwd.launches(
            q, q, q, q, q[..., 0], scale=0.1, causal=True, config=fwd.CONFIGS[256]._replace(persistent=True)
        )
    assert fwd.order(True, 64) == fwd.CAUSAL_HEADS_PER_GROUP and fwd.order(True, 2) == 2
    assert fwd.order(True, 64, 256) == fwd.WIDE_CAUSAL_HEADS_PER_GROUP and fwd.order(True, 3, 256) == 3
    assert fwd.order(False, 64) == fwd.order(False, 64, 256) == 1


def test_the_launch_passes_the_kernels_parameters_in_order(monkeypatch):
    """The launcher passes runtime arguments by position and the constexprs as the kernel's trailing
    parameters: their counts and names must be the kernel's, dense, windowed and packed (which only
    a GPU run would otherwise tell)."""
    from tritonkit.ops.attention import fwd_sm90 as fwd
    from tritonkit.ops.attention.common import Packed

    monkeypatch.setattr(fwd, "sm_count", lambda device: 132)
    q = torch.empty(1, 4, 256, 128, dtype=torch.bfloat16)
    k = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16)
    lse = torch.empty(1, 4, 256)
    cu = torch.zeros(3, dtype=torch.int32)
    names = fwd._attn_fwd_sm90_kernel.arg_names
    for kwargs in (
        {"causal": True},
        {"causal": False, "lower_offset": -64, "softcap": 30.0},
        {"causal": True, "upper_offset": 0, "packed": Packed(cu, cu, 2, 200, 200)},
    ):
        (launch,) = fwd.launches(q, k, k, q, lse, scale=0.1, **kwargs)
        constexprs = [name for name in launch.meta if name != "num_warps"]
        assert names[len(launch.args) :] == constexprs, kwargs
        assert launch.meta["VARLEN"] == ("packed" in kwargs) and launch.meta["HAS_LOWER"] == (
            "lower_offset" in kwargs
        )


# ---------------------------------------------------------------- on the H200


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _fwd():
    from tritonkit.ops.attention import fwd_sm90

    return fwd_sm90


def _inputs(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((batch, heads_q, seq_q, head_dim), *((batch, heads_kv, seq_k, head_dim),) * 2)
    return tuple(torch.randn(shape, device="cuda", dtype=dtype, generator=g) for shape in shapes)


def _persistence(fwd, head_dim: int) -> tuple:
    """The tiles' ``persistent`` settings a head dim has (D = 256: one tile a program only)."""
    return (False, True) if head_dim in fwd.PERSISTENT_HEAD_DIMS else (False,)


def _run(q, k, v, scale, causal, config=None, **mask):
    """The kernel's (output, lse), written into NaN-filled buffers; ``mask``: bottom_right, window,
    softcap."""
    o = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:3], math.nan, device=q.device, dtype=torch.float32)
    _fwd().attention_fwd_sm90(q, k, v, o, lse, scale=scale, causal=causal, config=config, **mask)
    return o, lse


def check(q, k, v, causal: bool, scale: float | None = None, config=None, **mask):
    """The oracle on the output and the lse of the rows that see a key; those that see none give
    exactly 0 and lse -inf. ``mask``: bottom_right, window, softcap, as flash_attention's."""
    from tritonkit.ops.attention.common import attention_reference
    from tritonkit.oracle import compare

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, lse = _run(q, k, v, scale, causal, config, **mask)
    exact_o, exact_lse = attention_reference(
        q.double(), k.double(), v.double(), causal, scale, return_lse=True, **mask
    )
    torch_o, torch_lse = attention_reference(q, k, v, causal, scale, return_lse=True, **mask)
    seen = torch.isfinite(exact_lse)
    assert torch.equal(torch.isneginf(lse), ~seen) and (o[~seen] == 0).all()
    comparisons = [
        compare("output", o, torch_o, exact_o, q.dtype),
        compare("lse", lse[seen], torch_lse.float()[seen], exact_lse[seen], q.dtype),
    ]
    assert all(c.passed for c in comparisons), [str(c) for c in comparisons]


# (B, Hq, Hkv, Sq, Sk, causal): single rows and keys, lengths off the 128-row and 128-key blocks, Sq != Sk
# both ways (causal with Sq > Sk leaves rows that see no key), B*H > 1, GQA 32/8 and MQA, diagonals on
# and off block edges
CASES = [
    (1, 1, 1, 1, 1, False),
    (1, 1, 1, 1, 1, True),
    (1, 2, 2, 1, 123, True),
    (1, 2, 2, 7, 7, True),
    (2, 3, 3, 123, 123, True),
    (1, 2, 2, 1000, 1000, False),
    (1, 2, 2, 1000, 1000, True),
    (1, 2, 2, 4097, 4097, True),
    (1, 2, 2, 100, 1000, True),
    (1, 2, 2, 1000, 100, True),
    (2, 3, 3, 257, 389, False),
    (2, 3, 3, 389, 257, True),
    (1, 32, 8, 500, 700, True),
    (2, 8, 1, 333, 333, True),
    (2, 8, 1, 1, 333, False),
    (1, 4, 4, 384, 512, True),
    (1, 4, 4, 512, 512, False),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:5])) + ("-causal" if c[5] else ""))
def test_gpu_matches_the_reference(case, head_dim, dtype):
    batch, heads_q, heads_kv, seq_q, seq_k, causal = case
    seed = 4 * CASES.index(case) + 2 * (head_dim == 128) + (dtype == torch.float16)
    check(*_inputs(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, dtype, seed), causal)


@pytest.mark.gpu
@pytest.mark.hbm
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_large_and_repeatable(causal):
    """(2, 8, 8192, 128) bf16: many blocks a program; two runs give the same bits (no race)."""
    q, k, v = _inputs(2, 8, 8, 8192, 8192, 128, torch.bfloat16, seed=8192 + causal)
    check(q, k, v, causal)
    first, second = _run(q, k, v, 0.125, causal), _run(q, k, v, 0.125, causal)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_strided_layouts_and_scale(causal):
    """(B, S, H, D) tensors viewed as (B, H, S, D), a strided output and a scale of its own."""
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (
        torch.randn(2, s, h, 128, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        for s, h in ((301, 4), (517, 2), (517, 2))
    )
    assert _fwd().supports(q, k, v, causal=causal)
    check(q, k, v, causal, scale=0.3)
    o = torch.full((2, 301, 4, 128), math.nan, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    lse = torch.full((2, 4, 301), math.nan, device="cuda", dtype=torch.float32)
    _fwd().attention_fwd_sm90(q, k, v, o, lse, scale=0.3, causal=causal)
    assert torch.equal(o, _run(q.contiguous(), k.contiguous(), v.contiguous(), 0.3, causal)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_every_candidate_config(head_dim, causal):
    for i, config in enumerate(_fwd().CANDIDATES[head_dim]):
        check(*_inputs(2, 4, 2, 777, 901, head_dim, torch.bfloat16, seed=100 + i), causal, config=config)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_causal_aligned_top_left(head_dim, caplog):
    """``bottom_right=False``: query i sees keys j <= i (torch's ``is_causal``), one tile a program and
    persistent, Sq < Sk (keys past Sq never seen) and Sq > Sk (rows from Sk on see every key), lengths
    off the blocks; and scaled_dot_product_attention's is_causal, top-left, takes it."""
    import logging

    import tritonkit
    from tritonkit.oracle import compare

    fwd = _fwd()
    for seq_q, seq_k in ((200, 700), (700, 200), (1, 300), (300, 1)):
        q, k, v = _inputs(2, 4, 2, seq_q, seq_k, head_dim, torch.bfloat16, seed=seq_q * 7 + seq_k)
        for persistent in _persistence(fwd, head_dim):
            config = fwd.CONFIGS[head_dim]._replace(persistent=persistent)
            check(q, k, v, True, config=config, bottom_right=False)
    q, k, v = _inputs(1, 4, 4, 256, 640, head_dim, torch.bfloat16, seed=5)
    with caplog.at_level(logging.DEBUG, logger="tritonkit"):
        out = tritonkit.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert f"attention forward {tuple(q.shape)} on the sm_90 Gluon kernel" in caplog.text
    sdpa = torch.nn.functional.scaled_dot_product_attention
    exact = sdpa(q.double(), k.double(), v.double(), is_causal=True)
    assert compare("sdpa output", out, sdpa(q, k, v, is_causal=True), exact, q.dtype).passed


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_soft_capped_scores(head_dim, causal, caplog):
    """``softcap``: each score s becomes softcap * tanh(s / softcap) before the masks and the softmax:
    a cap that bites (30 at a scale that spreads the scores past it, and 0.5, where every tanh
    saturates), and one that barely does (1e7: the tanh's series near 0 carries the scores), one tile
    a program and persistent, Sq != Sk both ways (causal rows that see no key: 0, lse -inf), fp16 too;
    and flash_attention's soft cap takes this forward."""
    import logging

    import tritonkit

    fwd = _fwd()
    for seq_q, seq_k, cap, scale, dtype in (
        (300, 300, 30.0, 4.0, torch.bfloat16),
        (200, 520, 0.5, head_dim**-0.5, torch.bfloat16),
        (520, 200, 1e7, head_dim**-0.5, torch.float16),
    ):
        q, k, v = _inputs(2, 4, 2, seq_q, seq_k, head_dim, dtype, seed=seq_q + seq_k + causal)
        for persistent in _persistence(fwd, head_dim):
            config = fwd.CONFIGS[head_dim]._replace(persistent=persistent)
            check(q, k, v, causal, scale, config, softcap=cap)
    q, k, v = _inputs(1, 4, 4, 256, 256, head_dim, torch.bfloat16, seed=9)
    with caplog.at_level(logging.DEBUG, logger="tritonkit"):
        tritonkit.flash_attention(q, k, v, causal=causal, softcap=50.0)
    assert f"attention forward {tuple(q.shape)} on the sm_90 Gluon kernel" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_sliding_windows(head_dim):
    """``window`` = (left, right): a left side (a lower bound, the blocks before it never loaded, those
    it cuts masked), a right side without causal, both with causal (Mistral's local attention), a
    window narrower than a block, one wider than the keys, both alignments, Sq != Sk both ways (rows
    that see no key: 0, lse -inf), with a soft cap (Gemma 2's local layers), one tile a program and
    persistent."""
    fwd = _fwd()
    cases = [  # (Sq, Sk, causal, bottom_right, window, softcap)
        (700, 700, True, True, (64, 0), 0.0),
        (700, 700, True, True, (300, 0), 0.0),
        (700, 700, False, True, (100, 37), 0.0),
        (300, 900, False, True, (200, -1), 0.0),
        (900, 300, False, True, (-1, 50), 0.0),
        (900, 300, True, True, (130, 0), 0.0),
        (300, 900, True, False, (129, 0), 0.0),
        (520, 520, False, True, (0, 0), 0.0),
        (520, 520, True, True, (5000, 0), 0.0),
        (640, 640, True, True, (256, 0), 30.0),
    ]
    for seq_q, seq_k, causal, bottom_right, window, cap in cases:
        q, k, v = _inputs(2, 4, 2, seq_q, seq_k, head_dim, torch.bfloat16, seed=seq_q + window[0])
        for persistent in _persistence(fwd, head_dim):
            config = fwd.CONFIGS[head_dim]._replace(persistent=persistent)
            check(q, k, v, causal, config=config, bottom_right=bottom_right, window=window, softcap=cap)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [8, 40, 96, 192, 248])
def test_gpu_head_dims_between_the_kernels(head_dim):
    """A head dim that is a multiple of 8 but not 64, 128 or 256 runs the next kernel up, its boxes
    past D: the oracle on full and causal masks, Sq != Sk, both tiles where both fit, GQA, fp16 too,
    and the output's columns past D untouched (o is a view of a wider buffer)."""
    fwd = _fwd()
    for causal, dtype in ((False, torch.bfloat16), (True, torch.float16)):
        q, k, v = _inputs(2, 4, 2, 333, 517, head_dim, dtype, seed=head_dim + causal)
        for persistent in _persistence(fwd, fwd.kernel_head_dim(head_dim)):
            config = fwd.CONFIGS[fwd.kernel_head_dim(head_dim)]._replace(persistent=persistent)
            check(q, k, v, causal, config=config)
    # the output's rows are 16-byte aligned views into a wider buffer: the store drops the box's
    # columns past D, so the buffer's other columns keep their values
    q, k, v = _inputs(1, 2, 2, 100, 100, head_dim, torch.bfloat16, seed=3)
    wide = torch.full((1, 2, 100, head_dim + 8), 7.0, device="cuda", dtype=torch.bfloat16)
    o = wide[..., :head_dim]
    lse = torch.empty(1, 2, 100, device="cuda", dtype=torch.float32)
    fwd.attention_fwd_sm90(q, k, v, o, lse, scale=head_dim**-0.5, causal=True)
    assert (wide[..., head_dim:] == 7.0).all()


# a packed batch's (query rows, keys): one row, several blocks both ways and ragged, Sq > Sk and Sq < Sk,
# an empty query side and an empty key side (its rows see nothing)
PACKED_LENGTHS = [(1, 1), (130, 130), (700, 300), (64, 900), (0, 7), (6, 0), (257, 257)]


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128, 40, 96, 256, 200])
def test_gpu_packed_batches(head_dim, caplog):
    """A packed batch (``common.Packed``): each sequence's rows attend to its own keys, causal and
    windows aligned bottom-right for its lengths, GQA; rows past the last sequence are never written
    (O leaves by masked stores: a tile's box would reach the next sequence's rows), nor at a padded
    head dim the next head's columns; and flash_attention's cu_seqlens take this forward."""
    import logging

    import tritonkit
    from tritonkit.ops.attention.common import Packed, attention_reference
    from tritonkit.oracle import compare

    fwd = _fwd()
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    cu_q, cu_k = (
        torch.tensor([0, *itertools.accumulate(n[i] for n in PACKED_LENGTHS)], dtype=torch.int32)
        for i in (0, 1)
    )
    spare = 5  # rows past the last sequence
    total_q, total_k = int(cu_q[-1]) + spare, int(cu_k[-1])
    q = torch.randn(total_q, 4, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (
        torch.randn(total_k, 2, head_dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)
    )
    packed = Packed(cu_q.cuda(), cu_k.cuda(), len(PACKED_LENGTHS), max(n for n, _ in PACKED_LENGTHS),
                    max(n for _, n in PACKED_LENGTHS))  # fmt: skip
    for causal, window, cap in (
        (False, (-1, -1), 0.0),
        (True, (-1, -1), 0.0),
        (True, (100, 0), 0.0),
        (False, (50, 20), 30.0),
    ):
        mask = {"window": window, "softcap": cap, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
        real = q[:-spare]
        exact_o, exact_lse = attention_reference(
            real.double(), k.double(), v.double(), causal, return_lse=True, **mask
        )
        torch_o, torch_lse = attention_reference(real, k, v, causal, return_lse=True, **mask)
        o = torch.full_like(q, math.nan)
        lse = torch.full((4, total_q), math.nan, device="cuda", dtype=torch.float32)
        views = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v, o)]
        fwd.attention_fwd_sm90(*views, lse.unsqueeze(0), scale=head_dim**-0.5, causal=causal, window=window,
                               softcap=cap, packed=packed)  # fmt: skip
        case = (causal, window, cap)
        assert o[-spare:].isnan().all() and lse[:, -spare:].isnan().all(), case
        seen = torch.isfinite(exact_lse)
        assert torch.equal(torch.isneginf(lse[:, :-spare]), ~seen), case
        comparisons = [
            compare("output", o[:-spare], torch_o, exact_o, q.dtype),
            compare("lse", lse[:, :-spare][seen], torch_lse.float()[seen], exact_lse[seen], q.dtype),
        ]
        assert all(c.passed for c in comparisons), (case, [str(c) for c in comparisons])
    real = q[:-spare].contiguous()
    with caplog.at_level(logging.DEBUG, logger="tritonkit"):
        tritonkit.flash_attention(
            real, k, v, causal=True, cu_seqlens_q=cu_q.cuda(), cu_seqlens_k=cu_k.cuda(),
            max_seqlen_q=packed.max_q, max_seqlen_k=packed.max_k,
        )  # fmt: skip
    assert f"attention forward {tuple(real.shape)} on the sm_90 Gluon kernel" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
def test_gpu_empty_keyless_and_refusals():
    fwd = _fwd()
    o, lse = _run(*_inputs(1, 2, 2, 0, 5, 64, torch.bfloat16, seed=1), 0.125, True)
    assert o.shape == (1, 2, 0, 64)
    o, lse = _run(*_inputs(1, 2, 2, 5, 0, 64, torch.bfloat16, seed=2), 0.125, False)
    assert (o == 0).all() and torch.isneginf(lse).all()
    q, k, v = _inputs(1, 2, 2, 16, 16, 128, torch.bfloat16, seed=3)
    o, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
    assert fwd.supports(q, k, v, causal=True)
    assert fwd.supports(q, k, v, causal=False, window=(4, 0))
    assert fwd.supports(q, k, v, causal=False, softcap=30.0)
    assert not fwd.supports(q, k, v, causal=False, softcap=-1.0)
    assert not fwd.supports(q, k, v, causal=False, softcap=math.inf)
    assert fwd.supports(q, k, v, causal=False, packed=True)
    assert not fwd.supports(q.float(), k.float(), v.float(), causal=False)
    q96, k96, v96 = _inputs(1, 2, 2, 16, 16, 96, torch.bfloat16, seed=4)
    assert fwd.supports(q96, k96, v96, causal=False)
    assert fwd.supports(q96, k96, v96, causal=False, packed=True)
    q136 = _inputs(1, 2, 2, 16, 16, 136, torch.bfloat16, seed=6)
    assert fwd.supports(*q136, causal=False, packed=True)  # (the D = 256 tile, one a program)
    assert not fwd.supports(*_inputs(1, 2, 2, 16, 16, 264, torch.bfloat16, seed=5), causal=False)
    for window in ((-2, 0), (4,), (1.5, 0)):
        with pytest.raises(ValueError, match="window"):
            fwd.attention_fwd_sm90(q, k, v, o, lse, scale=0.1, causal=False, window=window)
    for cap in (-1.0, math.nan):
        with pytest.raises(ValueError, match="softcap"):
            fwd.attention_fwd_sm90(q, k, v, o, lse, scale=0.1, causal=False, softcap=cap)


# ---------------------------------------------------------------- the dispatch


def test_calls_the_gluon_forward_cannot_take_go_to_the_triton_kernel(device):
    """Narrow windows (``fwd.narrow_window_keys``) never take it (wider windows, soft caps, causal
    masks of either alignment, head dims between the kernels' and packed batches do); and nothing
    does under the interpreter (Gluon kernels do not run there)."""
    from tritonkit.ops.attention import fwd
    from tritonkit.ops.attention.common import Packed, Scores

    def views(head_dim):  # a packed batch's (1, H, T, D) views, as attention_fwd_into makes them
        q = torch.randn(1, 2, 16, head_dim, device=device, dtype=torch.bfloat16)
        return q, torch.randn(1, 2, 24, head_dim, device=device, dtype=torch.bfloat16)

    cu = torch.tensor([0, 16], dtype=torch.int32, device=device)
    packed = Packed(cu, cu, 1, 16, 24)
    for head_dim in (136, 256, 96, 64):
        q, k = views(head_dim)
        assert fwd.sm90_takes(q, k, k, Scores(0.125), packed) == _sm90()
    for scores in (
        Scores(0.125, causal=True),
        Scores(0.125, causal=True, bottom_right=False),
        Scores(0.125, softcap=30.0),
    ):
        assert fwd.sm90_takes(q, k, k, scores, None) == _sm90(), scores
    keys = torch.randn(1, 2, 2048, 64, device=device, dtype=torch.bfloat16)
    assert fwd.sm90_takes(q, keys, keys, Scores(0.125, window=(1000, 0)), None) == _sm90()
    assert not fwd.sm90_takes(q, keys, keys, Scores(0.125, window=(500, 11)), None)  # 512 keys: narrow
    q, k = views(96)
    assert fwd.sm90_takes(q, k, k, Scores(0.125), None) == _sm90()


def test_narrow_windows_keep_the_triton_forward():
    """A window's span in keys (``fwd.window_keys``), which sends windows of at most
    NARROW_WINDOW_KEYS keys to the Triton forward (``sm90_takes``)."""
    from tritonkit.ops.attention import fwd
    from tritonkit.ops.attention.common import Scores

    assert fwd.window_keys(Scores(0.1, causal=True, window=(255, 0)), 4096, 4096) == 256
    assert fwd.window_keys(Scores(0.1, causal=True, window=(255, -1)), 4096, 4096) == 256  # causal: right 0
    assert fwd.window_keys(Scores(0.1, window=(100, 27)), 300, 4096) == 128
    assert fwd.window_keys(Scores(0.1, window=(255, -1)), 4096, 4096) is None  # no right side
    assert fwd.window_keys(Scores(0.1, causal=True), 4096, 4096) is None
    assert fwd.window_keys(Scores(0.1, causal=True, window=(4096, 0)), 4096, 4096) is None  # cuts nothing
    assert fwd.window_keys(Scores(0.1, causal=True, window=(1024, 0)), 4096, 4096) > fwd.NARROW_WINDOW_KEYS
    # uncapped at the D = 128 kernel, no bound: every window takes the Gluon kernel there
    uncapped, capped = (
        Scores(0.1, causal=True, window=(255, 0)),
        Scores(0.1, causal=True, window=(255, 0), softcap=30.0),
    )
    assert fwd.narrow_window_keys(uncapped, 128) == fwd.narrow_window_keys(uncapped, 72) == 0  # none
    assert (
        fwd.narrow_window_keys(uncapped, 64)
        == fwd.narrow_window_keys(uncapped, 256)
        == fwd.NARROW_WINDOW_KEYS
    )
    assert fwd.narrow_window_keys(capped, 128) == fwd.NARROW_WINDOW_KEYS


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
def test_gpu_flash_attention_runs_the_gluon_forward_where_it_applies(caplog):
    """flash_attention on sm_90 takes the Gluon forward (the log says so) and matches the reference
    with its gradients, which the Triton backward computes from the Gluon forward's lse; a window of
    more than NARROW_WINDOW_KEYS keys, an uncapped narrow one at D = 128 and a head dim between the
    kernels' (96) take it too, a capped narrow window the Triton forward."""
    import logging

    import tritonkit
    from tritonkit.ops.attention.common import attention_reference
    from tritonkit.testing import check_against_reference

    q, k, v = _inputs(2, 4, 2, 300, 500, 128, torch.bfloat16, seed=21)
    dy = torch.randn(
        q.shape, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(1)
    )
    with caplog.at_level(logging.DEBUG, logger="tritonkit"):
        check_against_reference(
            tritonkit.flash_attention,
            attention_reference,
            [q, k, v],
            kwargs={"causal": True},
            grad_inputs=(0, 1, 2),
            grad_outputs=[dy],
        )
    # (the backward's tuner may run the Triton forward on its own small calibration problems)
    # (the forward's lines only: "attention backward ... on the Triton kernels" is the backward's)
    forward = f"attention forward {tuple(q.shape)}"
    assert f"{forward} on the sm_90 Gluon kernel" in caplog.text
    assert f"{forward} on the Triton kernel" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="tritonkit"):
        tritonkit.flash_attention(q, k, v, causal=True, window=(64, 0), softcap=30.0)
    assert f"{forward} on the Triton kernel" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="tritonkit"):
        tritonkit.flash_attention(q, k, v, causal=True, window=(64, 0))
    assert f"{forward} on the sm_90 Gluon kernel" in caplog.text
    caplog.clear()
    q_long, k_long, v_long = _inputs(1, 2, 2, 1200, 1200, 128, torch.bfloat16, seed=23)
    with caplog.at_level(logging.DEBUG, logger="tritonkit"):
        tritonkit.flash_attention(q_long, k_long, v_long, causal=True, window=(600, 0))
    assert f"attention forward {tuple(q_long.shape)} on the sm_90 Gluon kernel" in caplog.text
    caplog.clear()
    q96, k96, v96 = _inputs(2, 4, 2, 300, 500, 96, torch.bfloat16, seed=22)
    with caplog.at_level(logging.DEBUG, logger="tritonkit"):
        tritonkit.flash_attention(q96, k96, v96, causal=True)
    assert f"attention forward {tuple(q96.shape)} on the sm_90 Gluon kernel" in caplog.text
