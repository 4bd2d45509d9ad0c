"""Attention forward against the float64 reference: outputs and the log-sum-exp, with the oracle's
2x rule, over head dims, causal alignments, GQA and ragged lengths (CPU interpreter, small
shapes); the sm_90 code (HGMMA, no spills); larger shapes as gpu tests."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import tritonkit
from grids import in_turn
from tritonkit import testing
from tritonkit.ops.attention import attention as at
from tritonkit.ops.attention import common as ac
from tritonkit.ops.attention import fwd as af
from tritonkit.ops.attention.common import attention_reference
from tritonkit.ops.attention.merge import merge_attention

pytestmark = pytest.mark.attention


def qkv(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, dtype, device, seed=0, noncontiguous=False):
    g = testing.generator(seed)
    q = testing.random_tensor(
        (batch, heads_q, seq_q, head_dim), dtype, device, generator=g, noncontiguous=noncontiguous
    )
    k = testing.random_tensor(
        (batch, heads_kv, seq_k, head_dim), dtype, device, generator=g, noncontiguous=noncontiguous
    )
    v = testing.random_tensor(
        (batch, heads_kv, seq_k, head_dim), dtype, device, generator=g, noncontiguous=noncontiguous
    )
    return q, k, v


def finite_lse(fn):
    """fn's (output, lse) with a row that sees no key's lse (-inf) as 0, so that the oracle's
    differences stay finite; those rows are checked on their own below."""

    def run(*args, **kwargs):
        o, lse = fn(*args, **kwargs)
        return o, torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)

    return run


def check(q, k, v, grads=True, seed=100, **kwargs):
    """Output and lse, and (``grads``) the gradients of q, k and v under random upstream gradients
    of both: each against the float64 reference with the oracle's rule."""
    kernel = finite_lse(lambda *a: tritonkit.flash_attention(*a, return_lse=True, **kwargs))
    reference = finite_lse(lambda *a: attention_reference(*a, return_lse=True, **kwargs))
    g = testing.generator(seed)
    upstream = [
        testing.random_tensor(q.shape, q.dtype, q.device, generator=g),
        testing.random_tensor(q.shape[:3], torch.float32, q.device, generator=g),
    ]
    testing.check_against_reference(
        kernel, reference, (q, k, v), grad_inputs=(0, 1, 2) if grads else (), grad_outputs=upstream
    )


# (batch, Hq, Hkv, Sq, Sk, D): ragged lengths (not multiples of the interpreter's 16-row tiles),
# Sq < Sk and Sq > Sk (rows that see no key when causal), one query, GQA and MQA
SHAPES = [
    (1, 2, 2, 37, 37, 64),
    (2, 4, 2, 20, 29, 32),
    (1, 4, 1, 45, 20, 128),
    (1, 2, 2, 1, 33, 64),
    (1, 3, 3, 33, 1, 32),
    (1, 2, 2, 48, 48, 96),
]


BF16, FP16 = torch.bfloat16, torch.float16
# every shape with both masks, the dtype in turn: each shape, and each mask, meets both dtypes
# (tests/test_grids.py checks that every pair of values meets)
REFERENCE_GRID = in_turn(SHAPES, [False, True], last=[BF16, FP16, FP16, BF16])


def _reference_id(case):
    shape, causal, dtype = case
    return (
        f"{'x'.join(map(str, shape))}-{'causal' if causal else 'full'}-{'bf16' if dtype == BF16 else 'fp16'}"
    )


@pytest.mark.parametrize("shape, causal, dtype", REFERENCE_GRID, ids=map(_reference_id, REFERENCE_GRID))
def test_matches_the_reference(shape, causal, dtype, device):
    batch, heads_q, heads_kv, seq_q, seq_k, head_dim = shape
    check(*qkv(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, dtype, device), causal=causal)


def test_head_dim_256_and_a_scale(device):
    check(*qkv(1, 1, 1, 19, 23, 256, torch.bfloat16, device), causal=True, scale=0.3)


def test_strided_inputs(device):
    """Every other head dim of a wider tensor, and a (B, S, H, D) tensor seen as (B, H, S, D)."""
    check(*qkv(1, 2, 2, 21, 35, 64, torch.bfloat16, device, noncontiguous=True), causal=True)
    q, k, v = (
        t.transpose(1, 2).contiguous().transpose(1, 2)
        for t in qkv(2, 4, 2, 29, 29, 32, torch.float16, device, seed=1)
    )
    assert q.stride(1) == 32 and q.stride(2) == 4 * 32
    check(q, k, v)


def test_outputs_and_gradients_follow_the_inputs_layout(device):
    """q, k and v split from one fused (B, S, (Hq + 2 Hkv) D) projection, as a decoder layer makes
    them: the output lies as (B, S, Hq, D) (its transpose back to (B, S, Hq D) is a view of it), each
    gradient lies as its input, and the projection's gradient matches the reference's; contiguous
    inputs keep contiguous outputs."""
    batch, seq, heads_q, heads_kv, head_dim = 2, 29, 4, 2, 32
    g = testing.generator(7)
    width = (heads_q + 2 * heads_kv) * head_dim
    qkv_proj = testing.random_tensor((batch, seq, width), BF16, device, generator=g).requires_grad_()

    def split(t):
        q, k, v = t.view(batch, seq, -1, head_dim).split([heads_q, heads_kv, heads_kv], dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    q, k, v = split(qkv_proj)
    o = tritonkit.flash_attention(q, k, v, causal=True)
    assert o.transpose(1, 2).is_contiguous()
    merged = o.transpose(1, 2).reshape(batch, seq, heads_q * head_dim)
    assert merged.data_ptr() == o.data_ptr()  # a view, no copy
    do = testing.random_tensor(merged.shape, BF16, device, generator=g)
    grads = torch.autograd.grad(o, (q, k, v), do.view(batch, seq, heads_q, head_dim).transpose(1, 2))
    for grad in grads:
        assert grad.transpose(1, 2).is_contiguous(), grad.stride()
    check(*split(qkv_proj.detach().requires_grad_()), causal=True)
    contiguous = [t.contiguous() for t in split(qkv_proj.detach())]
    assert tritonkit.flash_attention(*contiguous).is_contiguous()


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic-dq"])
@pytest.mark.parametrize("strided", ["k", "v"])
def test_k_and_v_in_different_layouts(strided, deterministic, device):
    """One of k and v a (B, H, S, D) view of (B, S, H, D) memory, the other contiguous: each gradient
    lies as its input and all match the reference (the dK/dV kernel writes both through one set of
    strides, which once put dv's values at dk's places)."""
    q, k, v = qkv(1, 2, 2, 40, 40, 32, BF16, device, seed=3)
    k, v = (
        t.transpose(1, 2).contiguous().transpose(1, 2) if name == strided else t
        for name, t in zip("kv", (k, v), strict=True)
    )
    check(q, k, v, causal=True, deterministic=deterministic)
    grads = torch.autograd.grad(
        tritonkit.flash_attention(*(t.requires_grad_() for t in (q, k, v))).sum(), (k, v)
    )
    assert [g.stride() for g in grads] == [k.stride(), v.stride()]


@pytest.mark.parametrize("window", [(2**31 - 1, -1), (-1, 2**31 - 1), (2**31 - 40, 2**31 - 13)])
def test_window_sides_past_every_key_are_unbounded(window, device):
    """A side no key lies beyond (here up to 2^31 - 1, which the kernels' 32-bit offsets once
    overflowed by adding a row to) gives the unbounded window's bits, outputs and gradients."""
    q, k, v = qkv(1, 2, 2, 40, 40, 32, BF16, device, seed=4)
    do = testing.random_tensor(q.shape, BF16, device, generator=testing.generator(5))
    results = []
    for sides in (window, (-1, -1)):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o = tritonkit.flash_attention(*leaves, window=sides)
        results.append((o, *torch.autograd.grad(o, leaves, do)))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


def test_scale_must_be_finite(device):
    q, k, v = qkv(1, 1, 1, 4, 4, 16, BF16, device)
    for scale in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be a finite number"):
            tritonkit.flash_attention(q, k, v, scale=scale)


def test_large_scores_stay_finite(device):
    """Scores near 100 in magnitude: the running max keeps every exp2 at or below 1."""
    q, k, v = qkv(1, 2, 2, 40, 40, 64, torch.bfloat16, device, seed=2)
    check(q * 12, k * 12, v, causal=True)


def test_rows_that_see_no_key_give_zero_and_minus_inf(device):
    q, k, v = qkv(1, 2, 1, 30, 12, 32, torch.bfloat16, device, seed=3)
    with testing.poisoned_outputs():
        o, lse = tritonkit.flash_attention(q, k, v, causal=True, return_lse=True)
    blind = 30 - 12  # bottom-right: query i sees keys j <= i - 18
    assert torch.equal(o[:, :, :blind], torch.zeros_like(o[:, :, :blind]))
    assert torch.isneginf(lse[:, :, :blind]).all() and torch.isfinite(lse[:, :, blind:]).all()
    assert torch.isfinite(o).all()


# (window, causal): each side alone, both, a side with causal (whose right side is 0), a window
# wider than the keys, and one narrow enough that some rows see no key (Sq > Sk, bottom-right)
WINDOWS = [
    ((5, -1), False),
    ((-1, 3), False),
    ((7, 2), False),
    ((6, 9), True),
    ((0, 0), False),
    ((100, -1), True),
    ((2, -1), True),
]


@pytest.mark.parametrize("window, causal", WINDOWS, ids=lambda x: str(x).replace(" ", ""))
def test_sliding_window_matches_the_reference(window, causal, device):
    """Outputs, lse and all gradients under a window, GQA, Sq != Sk both ways, ragged lengths."""
    # (a window masks rows and columns alike on every head: two query heads over one are GQA enough)
    check(*qkv(1, 2, 1, 37, 29, 32, torch.bfloat16, device, seed=30), causal=causal, window=window)
    check(*qkv(1, 2, 2, 21, 45, 64, torch.float16, device, seed=31), causal=causal, window=window)


def test_a_window_that_leaves_rows_without_keys(device):
    """Sq > Sk bottom-right with a left window of 2: rows before the keys see none (0 output, lse
    -inf, zero gradients), and no NaN anywhere."""
    q, k, v = qkv(1, 2, 1, 30, 12, 32, torch.bfloat16, device, seed=32)
    for t in (q, k, v):
        t.requires_grad_()
    with testing.poisoned_outputs():
        o, lse = tritonkit.flash_attention(q, k, v, window=(2, 0), return_lse=True)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    blind = 30 - 12  # query i sees keys i - 20 ... i - 18: none while i < 18
    assert torch.equal(o[:, :, :blind], torch.zeros_like(o[:, :, :blind]))
    assert torch.isneginf(lse[:, :, :blind]).all() and torch.isfinite(lse[:, :, blind:]).all()
    assert torch.equal(dq[:, :, :blind], torch.zeros_like(dq[:, :, :blind]))
    assert all(torch.isfinite(t).all() for t in (o, dq, dk, dv))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_matches_the_reference(causal, device):
    """softcap * tanh(s / softcap) on scores large enough that the cap bends them (|s| up to ~40
    against a cap of 10), with a window too: outputs, lse and all gradients."""
    q, k, v = qkv(1, 4, 2, 33, 40, 64, torch.bfloat16, device, seed=33)
    check(q * 4, k * 4, v, causal=causal, softcap=10.0)
    q, k, v = qkv(1, 2, 2, 25, 19, 32, torch.float16, device, seed=34)
    check(q, k, v, causal=causal, softcap=0.5, window=(6, 4))


def test_a_cap_far_above_the_scores(device):
    """A cap of 1e7 over scores near 1: tanh of about 1e-7, whose 1 - 2 / (e^2x + 1) form kept only 6e-8
    of absolute precision, 0.6 off once the cap multiplied it (outputs 0.7 off the reference)."""
    check(*qkv(1, 2, 2, 33, 45, 32, BF16, device, seed=2), causal=True, softcap=1e7)


# ---------------------------------------------------------------- packed variable-length batches


def packed(lengths, heads_q, heads_kv, head_dim, dtype, device, seed=50):
    """Random packed q, k, v for sequences of (query rows, keys) ``lengths``, and their cu_seqlens."""
    g = testing.generator(seed)
    cu = [
        torch.tensor([0, *itertools.accumulate(n[i] for n in lengths)], dtype=torch.int32, device=device)
        for i in (0, 1)
    ]
    q = testing.random_tensor((int(cu[0][-1]), heads_q, head_dim), dtype, device, generator=g)
    k, v = (
        testing.random_tensor((int(cu[1][-1]), heads_kv, head_dim), dtype, device, generator=g)
        for _ in range(2)
    )
    return q, k, v, {"cu_seqlens_q": cu[0], "cu_seqlens_k": cu[1]}


def check_packed(q, k, v, seed=101, **kwargs):
    """Output, lse (Hq, total_q) and all gradients of a packed batch against the float64 reference,
    which runs a sequence at a time."""
    kernel = finite_lse(lambda *a: tritonkit.flash_attention(*a, return_lse=True, **kwargs))
    reference = finite_lse(lambda *a: attention_reference(*a, return_lse=True, **kwargs))
    g = testing.generator(seed)
    upstream = [
        testing.random_tensor(q.shape, q.dtype, q.device, generator=g),
        testing.random_tensor((q.shape[1], q.shape[0]), torch.float32, q.device, generator=g),
    ]
    testing.check_against_reference(
        kernel, reference, (q, k, v), grad_inputs=(0, 1, 2), grad_outputs=upstream
    )


# sequences of (query rows, keys): ragged, Sq > Sk and Sq < Sk, one row, an empty query side, an
# empty key side (its rows see nothing), and ones longer than the interpreter's 16-row tiles (two
# blocks each way, both ragged: the grid's query blocks follow the longest sequence's)
LENGTHS = [(17, 17), (5, 30), (21, 9), (1, 1), (0, 7), (6, 0), (23, 26)]


@pytest.mark.parametrize(
    "causal, window, softcap",
    [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (True, (6, -1), 0.0), (False, (5, 3), 2.0)],
    ids=["full", "causal", "causal-window", "window-cap"],
)
def test_packed_batches_match_the_reference(causal, window, softcap, device):
    q, k, v, cu = packed(LENGTHS, 2, 1, 32, torch.bfloat16, device)  # GQA: two query heads a key head
    check_packed(q, k, v, causal=causal, window=window, softcap=softcap, **cu)


def test_packed_views_of_a_fused_projection(device):
    """q, k and v as views of one (T, 3, H, D) projection (row stride 3 H D), MQA, head dim 256 with
    a soft cap and a left window: what a packed attention layer passes."""
    lengths = [(14, 14), (3, 3), (20, 20)]
    _, _, _, cu = packed(lengths, 1, 1, 16, torch.bfloat16, device)
    g = testing.generator(53)
    qkv_rows = testing.random_tensor((37, 3, 2, 256), torch.bfloat16, device, generator=g)
    q, k, v = qkv_rows[:, 0], qkv_rows[:, 1, :1], qkv_rows[:, 2, :1]
    assert q.stride(0) == 3 * 2 * 256 and not q.is_contiguous()
    check_packed(q, k, v, causal=True, window=(5, -1), softcap=3.0, **cu)


def test_packed_batch_equals_each_sequence_alone(device):
    """The packed output, lse and gradients of each sequence are exactly the dense call's on it alone
    (same tiles, same order of sums)."""
    q, k, v, cu = packed([(9, 20), (23, 23), (0, 4)], 2, 1, 64, torch.float16, device, seed=51)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = tritonkit.flash_attention(*inputs, causal=True, return_lse=True, **cu)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, inputs, do)
    starts_q, starts_k = cu["cu_seqlens_q"].tolist(), cu["cu_seqlens_k"].tolist()
    bounds = list(zip(starts_q[:-1], starts_q[1:], starts_k[:-1], starts_k[1:], strict=True))
    for q0, q1, k0, k1 in bounds:
        alone = [
            t[a:b].transpose(0, 1).unsqueeze(0).detach().requires_grad_()
            for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1))
        ]
        o_b, lse_b = tritonkit.flash_attention(*alone, causal=True, return_lse=True)
        assert torch.equal(o[q0:q1], o_b[0].transpose(0, 1)) and torch.equal(lse[:, q0:q1], lse_b[0])
        if q1 > q0:
            grads_b = torch.autograd.grad(o_b, alone, do[q0:q1].transpose(0, 1).unsqueeze(0))
            rows = ((q0, q1), (k0, k1), (k0, k1))
            for packed_grad, grad_b, (a, b) in zip(grads, grads_b, rows, strict=True):
                assert torch.equal(packed_grad[a:b], grad_b[0].transpose(0, 1))


def test_packed_bounds_read_through_strided_views(device):
    """cu_seqlens given as every other entry of a longer tensor (filled with out-of-range values in
    between): the call reads their values, and gives the contiguous bounds' bits."""
    q, k, v, cu = packed([(4, 5), (3, 1), (3, 6)], 2, 1, 32, torch.bfloat16, device, seed=52)
    strided = {}
    for name, bounds in cu.items():
        spaced = torch.full((2 * bounds.shape[0],), 999, dtype=torch.int32, device=device)
        spaced[::2] = bounds
        strided[name] = spaced[::2]
    want = tritonkit.flash_attention(q, k, v, causal=True, **cu)
    assert torch.equal(tritonkit.flash_attention(q, k, v, causal=True, **strided), want)


def test_bad_packed_input_is_named(device):
    q, k, v, cu = packed([(3, 4), (5, 2)], 2, 2, 32, torch.bfloat16, device)
    fa = tritonkit.flash_attention
    cu_q, cu_k = cu["cu_seqlens_q"], cu["cu_seqlens_k"]
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        fa(q, k, v, cu_seqlens_q=cu_q.long(), cu_seqlens_k=cu_k)
    with pytest.raises(TypeError, match="cu_seqlens_k must be a torch.Tensor"):
        fa(q, k, v, cu_seqlens_q=cu_q)
    with pytest.raises(ValueError, match="must start at 0"):
        fa(q, k, v, cu_seqlens_q=cu_q + 1, cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="non-decreasing"):
        fa(q, k, v, cu_seqlens_q=cu_q[[0, 2, 1]], cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="must end at the packed tensor's 6 rows"):
        fa(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k[:2].contiguous())
    with pytest.raises(ValueError, match="one entry a sequence each"):
        fa(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=torch.tensor([0, 6], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="max_seqlen_q must be an int >= the longest sequence \\(5\\)"):
        fa(q, k, v, max_seqlen_q=4, **cu)
    with pytest.raises(ValueError, match="max_seqlen_k must be an int"):
        fa(q, k, v, max_seqlen_k=4.0, **cu)
    with pytest.raises(ValueError, match="max_seqlen_k is for packed batches"):
        fa(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), max_seqlen_k=4)
    with pytest.raises(ValueError, match="a packed k must be 3-D"):
        fa(q, k.unsqueeze(0), v, **cu)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        fa(q[:, :1].expand(-1, 3, -1), k, v, **cu)


def test_a_packed_call_given_both_longest_lengths_reads_no_bounds_on_the_host(device, monkeypatch):
    """Given max_seqlen_q and max_seqlen_k, the validation reads nothing of the cu_seqlens on the host
    (a sync that would keep the call out of a CUDA graph): their metadata is still checked, their
    values are the caller's; the same output as the checked call. Without both, it reads them."""
    from tritonkit.ops.attention import attention

    q, k, v, cu = packed([(3, 4), (5, 2)], 2, 2, 32, torch.bfloat16, device)
    want = tritonkit.flash_attention(q, k, v, causal=True, **cu)
    reads = []

    def refuse(name):
        def read(tensor, *args, **kwargs):
            reads.append(name)
            raise AssertionError(f"{name} read on the host")

        return read

    with monkeypatch.context() as patched:
        for name in ("cpu", "tolist", "item", "__int__", "__bool__", "numpy"):
            patched.setattr(torch.Tensor, name, refuse(name))
        got = attention._validate_packed(q, k, v, *cu.values(), 5, 4)
        with pytest.raises(AssertionError, match="read on the host"):
            attention._validate_packed(q, k, v, *cu.values(), 5, None)
    assert got.max_q == 5 and got.max_k == 4 and reads == ["cpu"]
    given = tritonkit.flash_attention(q, k, v, causal=True, max_seqlen_q=5, max_seqlen_k=4, **cu)
    assert torch.equal(given, want)
    with pytest.raises(ValueError, match="max_seqlen_k must be an int >= 0"):
        tritonkit.flash_attention(q, k, v, max_seqlen_q=5, max_seqlen_k=-1, **cu)
    with pytest.raises(ValueError, match="one entry a sequence each"):
        tritonkit.flash_attention(
            q, k, v, cu_seqlens_q=cu["cu_seqlens_q"], cu_seqlens_k=cu["cu_seqlens_k"][:2], max_seqlen_q=5,
            max_seqlen_k=4,
        )  # fmt: skip


def test_packed_longest_lengths_as_numpy_integers(device):
    """max_seqlen_q and max_seqlen_k as numpy integers (what a data loader's arrays hold) are taken
    as ints: the same output as without them."""
    import numpy as np

    q, k, v, cu = packed([(3, 4), (5, 2)], 2, 2, 32, torch.bfloat16, device)
    want = tritonkit.flash_attention(q, k, v, causal=True, **cu)
    got = tritonkit.flash_attention(
        q, k, v, causal=True, max_seqlen_q=np.int64(5), max_seqlen_k=np.int32(4), **cu
    )
    assert torch.equal(got, want)


def test_lse_merges_attention_over_two_halves_of_the_keys(device):
    """What ring attention relies on: attention over keys A and B is attention over A and over B,
    weighted by exp(lse_A - lse) and exp(lse_B - lse) with lse = logaddexp(lse_A, lse_B)."""
    q, k, v = qkv(1, 2, 2, 24, 40, 64, torch.float16, device, seed=4)
    o_a, lse_a = tritonkit.flash_attention(q, k[:, :, :17], v[:, :, :17], return_lse=True)
    o_b, lse_b = tritonkit.flash_attention(q, k[:, :, 17:], v[:, :, 17:], return_lse=True)
    o, lse = tritonkit.flash_attention(q, k, v, return_lse=True)
    merged_lse = torch.logaddexp(lse_a, lse_b)
    merged = (
        o_a.float() * (lse_a - merged_lse).exp()[..., None]
        + o_b.float() * (lse_b - merged_lse).exp()[..., None]
    )
    torch.testing.assert_close(merged_lse, lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged, o.float(), atol=2e-3, rtol=2e-3)


def test_merge_attention_folds_parts_over_disjoint_keys_into_the_whole(device):
    """merge_attention, in place from (zeros, -inf): a part that saw no key (o 0, lse -inf) first,
    then two halves of the keys, give attention over all of them; rows stay 0 and -inf until a
    part that saw keys comes."""
    q, k, v = qkv(1, 2, 2, 24, 40, 64, torch.float16, device, seed=5)  # fp16: parts rounded finely
    o, lse = tritonkit.flash_attention(q, k, v, return_lse=True)
    merged = torch.zeros(q.shape, dtype=torch.float32, device=device)
    merged_lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=device)
    none, none_lse = tritonkit.flash_attention(q, k[:, :, :0], v[:, :, :0], return_lse=True)
    merge_attention(merged, merged_lse, none, none_lse)
    assert torch.equal(merged, torch.zeros_like(merged)) and torch.isneginf(merged_lse).all()
    for keys in (slice(0, 17), slice(17, 40)):
        part, part_lse = tritonkit.flash_attention(q, k[:, :, keys], v[:, :, keys], return_lse=True)
        merge_attention(merged, merged_lse, part.transpose(1, 2).contiguous().transpose(1, 2), part_lse)
    torch.testing.assert_close(merged_lse, lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged, o.float(), atol=2e-3, rtol=2e-3)


def test_merge_attention_refuses_what_it_cannot_update_in_place(device):
    o = torch.zeros((1, 2, 8, 16), dtype=torch.float32, device=device)
    lse = torch.full(o.shape[:3], -math.inf, dtype=torch.float32, device=device)
    part, part_lse = o.to(torch.bfloat16), lse.clone()
    with pytest.raises(TypeError, match="must be float32"):
        merge_attention(o.to(torch.bfloat16), lse, part, part_lse)
    with pytest.raises(ValueError, match="must be contiguous"):
        merge_attention(o.transpose(1, 2), lse, part.transpose(1, 2), part_lse)
    with pytest.raises(ValueError, match="part o's shape"):
        merge_attention(o, lse, part[:, :, :7], part_lse)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_has_torch_semantics(causal, device):
    """Top-left causal alignment when Sq != Sk, GQA only with enable_gqa: as torch's SDPA."""
    q, k, v = qkv(1, 4, 2, 19, 33, 64, torch.bfloat16, device, seed=5)
    ours = tritonkit.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=True
    )
    in_dtype = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    comparison = testing.compare("output", ours, in_dtype, theirs, q.dtype)
    assert comparison.passed, comparison
    with pytest.raises(ValueError, match="enable_gqa=True"):
        tritonkit.scaled_dot_product_attention(q, k, v)


def test_empty_inputs(device):
    q, k, v = qkv(1, 2, 2, 5, 7, 32, torch.bfloat16, device)
    o, lse = tritonkit.flash_attention(q[:, :, :0], k, v, return_lse=True)
    assert o.shape == (1, 2, 0, 32) and lse.shape == (1, 2, 0)
    o, lse = tritonkit.flash_attention(q, k[:, :, :0], v[:, :, :0], return_lse=True)  # no keys at all
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    assert tritonkit.flash_attention(q[:0], k[:0], v[:0]).shape == (0, 2, 5, 32)


def test_bad_input_is_named(device):
    q, k, v = qkv(1, 4, 2, 8, 8, 32, torch.bfloat16, device)
    fa = tritonkit.flash_attention
    with pytest.raises(TypeError, match="^q must be one of fp16, bf16"):
        fa(q.float(), k.float(), v.float())
    with pytest.raises(TypeError, match="share a dtype"):
        fa(q, k.half(), v.half())
    with pytest.raises(ValueError, match="4-D"):
        fa(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="head dim 32"):
        fa(q, k[..., :16], v[..., :16])
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        fa(q[:, :3], k, v)
    with pytest.raises(ValueError, match="v must have k's shape"):
        fa(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="batch size"):
        fa(q, torch.cat([k, k]), torch.cat([v, v]))
    with pytest.raises(TypeError, match="^k must be a torch.Tensor"):
        fa(q, None, v)
    with pytest.raises(TypeError, match="^key must be a torch.Tensor"):  # torch's name for it
        tritonkit.scaled_dot_product_attention(q, None, v)
    for window, problem in (
        ((-2, 0), "left side"),
        ((0, 1.5), "right side"),
        ((True, 3), "left side"),
        (4, "a pair"),
        ((1, 2, 3), "a pair"),
    ):
        with pytest.raises(ValueError, match=f"window.*{problem}"):
            fa(q, k, v, window=window)
    for softcap in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
            fa(q, k, v, softcap=softcap)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        tritonkit.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        tritonkit.scaled_dot_product_attention(q, k, v, dropout_p=0.1, enable_gqa=True)
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\], got -0.1"):
        tritonkit.scaled_dot_product_attention(q, k, v, dropout_p=-0.1, enable_gqa=True)
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\], got tensor"):
        tritonkit.scaled_dot_product_attention(q, k, v, dropout_p=torch.tensor(0.0), enable_gqa=True)


def test_opcheck(device):
    """The forward and backward ops on real arguments: schemas, the no-op fakes (the outputs exist
    already), mutation of exactly the outputs; masks, a window, a soft cap, dlse, a packed batch."""
    q, k, v = qkv(1, 2, 1, 17, 23, 32, torch.bfloat16, device)
    dense = (None, None, 0, 0)
    for scores in ((0.2, True, True, -1, -1, 0.0), (0.2, False, True, 5, 3, 4.0)):
        o, lse = af.fwd_outputs(q)
        torch.library.opcheck(at._forward.custom_op, (q, k, v, *dense, *scores, o, lse))
    o, lse = af.attention_fwd(q, k, v, ac.Scores(0.2, True, True))
    grads = [torch.empty_like(t) for t in (q, k, v)]
    args = (torch.randn_like(o), q, k, v, o, lse)
    torch.library.opcheck(
        at._backward.custom_op, (*args, None, *dense, 0.2, True, True, -1, -1, 0.0, True, *grads)
    )
    dlse = torch.randn_like(lse)
    torch.library.opcheck(
        at._backward.custom_op, (*args, dlse, *dense, 0.2, False, False, 4, -1, 2.0, False, *grads)
    )
    # a packed batch: (T, H, D) tensors, a (H, T) lse
    pq, pk, pv, cu = packed([(5, 9), (12, 3)], 2, 1, 32, torch.bfloat16, device)
    varlen = (cu["cu_seqlens_q"], cu["cu_seqlens_k"], 12, 9)
    po, plse = af.fwd_outputs(pq, packed=True)
    assert plse.shape == (2, 17)
    torch.library.opcheck(
        at._forward.custom_op, (pq, pk, pv, *varlen, 0.2, True, True, -1, -1, 0.0, po, plse)
    )
    grads = [torch.empty_like(t) for t in (pq, pk, pv)]
    args = (torch.randn_like(po), pq, pk, pv, po, plse, torch.randn_like(plse))
    torch.library.opcheck(
        at._backward.custom_op, (*args, *varlen, 0.2, True, True, 3, -1, 0.0, False, *grads)
    )


def test_expanded_upstream_gradients(device):
    """The gradients of o.sum() and lse.sum(): upstream gradients with stride 0 everywhere (Sq <= Sk:
    every row sees a key, so the lse goes to the oracle as it is)."""
    q, k, v = qkv(1, 2, 1, 21, 30, 32, torch.float16, device, seed=14)
    kernel = lambda *a: tritonkit.flash_attention(*a, return_lse=True, causal=True)  # noqa: E731
    reference = lambda *a: attention_reference(*a, return_lse=True, causal=True)  # noqa: E731
    upstream = [
        torch.ones((), dtype=q.dtype, device=device).expand(q.shape),
        torch.full((), -0.5, device=device).expand(q.shape[:3]),
    ]
    testing.check_against_reference(
        kernel, reference, (q, k, v), grad_inputs=(0, 1, 2), grad_outputs=upstream
    )


def test_sdpa_gradients_with_top_left_causal(device):
    q, k, v = qkv(1, 4, 2, 19, 33, 64, torch.bfloat16, device, seed=10)
    do = testing.random_tensor(q.shape, q.dtype, device, generator=testing.generator(11))
    testing.check_against_reference(
        lambda *a: tritonkit.scaled_dot_product_attention(*a, is_causal=True, enable_gqa=True),
        lambda *a: attention_reference(*a, causal=True, bottom_right=False),
        (q, k, v),
        grad_inputs=(0, 1, 2),
        grad_outputs=[do],
    )


@pytest.mark.parametrize(
    "causal, window, softcap", [(True, (-1, -1), 0.0), (False, (7, 2), 3.0)], ids=["causal", "window-cap"]
)
def test_atomic_dq_matches_the_reference(causal, window, softcap, device):
    """deterministic=False: dq accumulated with atomics in the dK/dV kernel, GQA, ragged lengths,
    and a packed batch."""
    check(
        *qkv(1, 4, 2, 37, 29, 32, torch.bfloat16, device, seed=60),
        causal=causal,
        window=window,
        softcap=softcap,
        deterministic=False,
    )
    q, k, v, cu = packed(LENGTHS, 2, 1, 64, torch.float16, device, seed=61)
    check_packed(q, k, v, causal=causal, window=window, softcap=softcap, deterministic=False, **cu)


def test_backward_is_deterministic_and_zero_for_rows_that_see_no_key(device):
    q, k, v = (t.requires_grad_() for t in qkv(1, 4, 2, 40, 24, 32, torch.bfloat16, device, seed=12))
    do = testing.random_tensor(q.shape, q.dtype, device, generator=testing.generator(13))
    grads = []
    for _ in range(2):
        with testing.poisoned_outputs():
            o = tritonkit.flash_attention(q, k, v, causal=True)
            grads.append(torch.autograd.grad(o, (q, k, v), do))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))  # the same bits
    dq = grads[0][0]
    blind = 40 - 24  # bottom-right: query i sees keys j <= i - 16
    assert torch.equal(dq[:, :, :blind], torch.zeros_like(dq[:, :, :blind]))
    assert all(torch.isfinite(g).all() for g in grads[0])


def test_gpu_default_config_runs_in_the_interpreter(device):
    """The GPU's tile (128 query rows, 64 keys) is not what the interpreter picks by default: run it
    once here, with a row block the ragged lengths split."""
    q, k, v = qkv(1, 2, 2, 130, 70, 64, torch.bfloat16, device, seed=6)
    config = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    with testing.poisoned_outputs():
        o, lse = af.attention_fwd(q, k, v, ac.Scores(0.125, True, True), config=config)
    ref_o, ref_lse = attention_reference(
        q.double(), k.double(), v.double(), causal=True, scale=0.125, return_lse=True
    )
    torch_o = attention_reference(q, k, v, causal=True, scale=0.125)
    comparison = testing.compare("output", o, torch_o, ref_o, q.dtype)
    assert comparison.passed, comparison
    seen = torch.isfinite(ref_lse)
    assert torch.isneginf(lse[~seen]).all()
    torch.testing.assert_close(lse[seen], ref_lse[seen].float(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    "seq_q, seq_k, scores",
    [
        (70, 150, ac.Scores(0.125, False)),
        (70, 150, ac.Scores(0.125, True, True)),
        (150, 70, ac.Scores(0.125, True, False)),
        (90, 200, ac.Scores(0.2, False, True, (40, 10), 5.0)),
        (40, 33, ac.Scores(0.125, False)),
    ],
    ids=["full", "causal", "causal-top-left", "window-cap", "one-block"],
)
def test_a_block_ahead_gives_the_same_bits(seq_q, seq_k, scores, device):
    """LOOKAHEAD reorders the unmasked loop (the next block's scores before this one's softmax) but
    not its arithmetic: the same output and lse bits as the plain loop (the config the interpreter
    runs, whose answers test_matches_the_reference checks), GQA, ragged lengths, inner ranges of
    zero, one and several blocks."""
    q, k, v = qkv(1, 2, 1, seq_q, seq_k, 32, torch.bfloat16, device, seed=7)
    plain = dict(af.INTERPRETER_CONFIG)
    with testing.poisoned_outputs():
        o, lse = af.attention_fwd(q, k, v, scores, config=plain)
        o_ahead, lse_ahead = af.attention_fwd(q, k, v, scores, config=plain | {"LOOKAHEAD": True})
    assert torch.equal(o, o_ahead) and torch.equal(lse, lse_ahead)
    assert torch.isfinite(o).all()  # not a poisoned output matched by another


def test_a_block_ahead_gives_the_same_bits_on_a_packed_batch(device):
    """The same for a packed batch: each sequence's inner range is its own."""
    # two query heads a key head, as the dense cases above: LOOKAHEAD reorders a program's loop over
    # keys, whatever its head, so more heads would only add programs for the interpreter to run
    q, k, v, cu = packed([(70, 150), (0, 20), (33, 1), (50, 64)], 2, 1, 32, torch.bfloat16, device, seed=8)
    scores = ac.Scores(0.125, True, True)
    sequences = ac.Packed(cu["cu_seqlens_q"], cu["cu_seqlens_k"], 4, 70, 150)
    plain = dict(af.INTERPRETER_CONFIG)
    with testing.poisoned_outputs():
        o, lse = af.attention_fwd(q, k, v, scores, config=plain, packed=sequences)
        o_ahead, lse_ahead = af.attention_fwd(
            q, k, v, scores, config=plain | {"LOOKAHEAD": True}, packed=sequences
        )
    assert torch.equal(o, o_ahead) and torch.equal(lse, lse_ahead)


def test_cost():
    full = at.attention_cost((4, 32, 32, 4096, 128), torch.bfloat16)
    assert full.flops == 4 * 4 * 32 * 4096**2 * 128
    assert at.attention_cost((4, 32, 32, 4096, 128), torch.bfloat16, causal=True).flops == full.flops / 2
    tensor = 4 * 32 * 4096 * 128 * 2
    assert full.bytes == 4 * tensor + 4 * 4 * 32 * 4096  # q, k, v in, o out, the fp32 lse
    gqa = at.attention_cost((4, 32, 8, 4096, 128), torch.bfloat16)
    assert gqa.flops == full.flops and gqa.bytes == full.bytes - 2 * tensor * 3 // 4
    backward = at.attention_cost((4, 32, 32, 4096, 128), torch.bfloat16, "bwd")
    assert math.isclose(backward.flops, 2.5 * full.flops)
    assert backward.bytes == 8 * tensor + 4 * 4 * 32 * 4096  # q, k, v, o, dO in, dq, dk, dv out, the lse


def test_the_reference_in_chunks_is_the_reference_whole(monkeypatch):
    """Outputs, lse and gradients: the chunks (checkpointed) give what the whole problem gives."""
    q, k, v = (t.double().requires_grad_() for t in qkv(1, 2, 1, 37, 29, 32, torch.float32, "cpu", seed=8))
    do = torch.randn(q.shape, dtype=torch.float64, generator=testing.generator(15))

    def run():
        o, lse = attention_reference(q, k, v, causal=True, return_lse=True)
        return (o, lse, *torch.autograd.grad((o * do).sum() + lse[lse.isfinite()].sum(), (q, k, v)))

    whole = run()
    monkeypatch.setattr(ac, "REFERENCE_SCORE_BYTES", 2 * 29 * 8 * 5)  # five query rows a chunk
    torch.testing.assert_close(run(), whole, rtol=0, atol=1e-12)
