"""Rotary embeddings against the float64 reference with the oracle's rule, outputs and gradients:
Hugging Face's form (q and k together, (B, S, D) and (S, D) tables, both layouts, strided views of
a fused QKV projection), flash-attn's (halves and interleaved pairs, a partial rotary dim, int and
per-sequence offsets, packed sequences, in place), and bad input refused by name. The contract
tests (tests/contract) add opcheck, compile, poisoning and the cost model for Hugging Face's, and
tests/test_inspect.py its sm_90 compile at the benchmark shapes (no spills, 16-byte accesses)."""

from __future__ import annotations

import pytest
import torch

import tritonkit
from tritonkit import opdef, testing
from tritonkit.ops import rotary

pytestmark = pytest.mark.rotary

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _tables(positions: int, columns: int, device, seed: int = 1):
    angles = torch.rand(positions, columns, generator=torch.Generator().manual_seed(seed)) * 6.0
    return angles.cos().to(device), angles.sin().to(device)


@pytest.mark.parametrize(
    "dtype, batch_table, unsqueeze_dim, fused",
    [(F32, False, 1, False), (BF16, True, 1, True), (F16, True, 2, False), (BF16, False, 2, True)],
    ids=["fp32-SD", "bf16-BSD-fused", "fp16-BSD-heads-third", "bf16-SD-heads-third-fused"],
)
def test_hugging_face_q_and_k(dtype, batch_table, unsqueeze_dim, fused, device):
    """GQA 6/2 over 11 tokens, D = 32; "fused": q and k strided views of one (B, S, (Hq + 2 Hkv) D)
    projection, as a model's attention has them."""
    g = testing.generator(0)
    batch, seq, heads_q, heads_kv, head_dim = 2, 11, 6, 2, 32
    if fused:
        qkv = testing.random_tensor(
            (batch, seq, heads_q + 2 * heads_kv, head_dim), dtype, device, generator=g
        )
        q, k, _ = qkv.split([heads_q, heads_kv, heads_kv], dim=2)
    else:
        q = testing.random_tensor((batch, seq, heads_q, head_dim), dtype, device, generator=g)
        k = testing.random_tensor((batch, seq, heads_kv, head_dim), dtype, device, generator=g)
    if unsqueeze_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = _tables(seq, head_dim, device)
    if batch_table:
        cos, sin = (torch.stack([t, t.flip(0)]).to(dtype) for t in (cos, sin))  # each sequence its own rows
    testing.check_against_reference(
        lambda q, k, c, s: tritonkit.apply_rotary_pos_emb(q, k, c, s, unsqueeze_dim=unsqueeze_dim),
        lambda q, k, c, s: rotary.rotary_pos_emb_reference(q, k, c, s, unsqueeze_dim=unsqueeze_dim),
        (q, k, cos, sin),
        grad_inputs=(0, 1),
        grad_outputs=[torch.randn(t.shape, generator=torch.Generator().manual_seed(2)).to(t) for t in (q, k)],
        dtype=dtype,
    )


FLASH_CASES = [
    (F32, {}),
    (BF16, {"interleaved": True}),
    (F16, {"seqlen_offsets": 5}),
    (BF16, {"seqlen_offsets": "tensor", "interleaved": True}),
    (F32, {"packed": True, "seqlen_offsets": 2}),
    (BF16, {"packed": True, "seqlen_offsets": "tensor", "interleaved": True}),
]


@pytest.mark.parametrize("dtype, options", FLASH_CASES, ids=[f"{i}" for i in range(len(FLASH_CASES))])
@pytest.mark.parametrize("rotary_dim", [24, 32], ids=["partial", "whole"])
def test_flash_attn_form(dtype, options, rotary_dim, device):
    """(B, S, H, D) = (3, 9, 4, 32), or the same tokens packed with lengths 9, 2 and 7."""
    g = testing.generator(3)
    options = dict(options)
    packed = options.pop("packed", False)
    if options.get("seqlen_offsets") == "tensor":
        options["seqlen_offsets"] = torch.tensor([0, 6, 3], dtype=torch.int32, device=device)
    if packed:
        x = testing.random_tensor((18, 4, 32), dtype, device, generator=g)
        options |= {
            "cu_seqlens": torch.tensor([0, 9, 11, 18], dtype=torch.int32, device=device),
            "max_seqlen": 9,
        }
    else:
        x = testing.random_tensor((3, 9, 4, 32), dtype, device, generator=g)
    cos, sin = _tables(16, rotary_dim // 2, device)
    testing.check_against_reference(
        lambda x, c, s: tritonkit.apply_rotary_emb(x, c, s, **options),
        lambda x, c, s: rotary.rotary_emb_reference(x, c, s, **options),
        (x, cos, sin),
        grad_inputs=(0,),
        grad_outputs=[testing.random_tensor(x.shape, dtype, device, generator=g, noncontiguous=True)],
        dtype=dtype,
    )


def test_in_place_writes_x_and_leaves_the_other_dims(device):
    """inplace=True returns x itself, rotated, its dims past the rotary ones bit for bit; its
    gradient is the out-of-place one's."""
    g = testing.generator(4)
    x = testing.random_tensor((2, 5, 3, 16), BF16, device, generator=g)
    cos, sin = _tables(5, 4, device)
    expected = tritonkit.apply_rotary_emb(x, cos, sin)
    leaf = x.clone().requires_grad_(True)
    y = leaf.clone()  # a non-leaf that autograd lets the call write
    out = tritonkit.apply_rotary_emb(y, cos, sin, inplace=True)
    assert out is y and torch.equal(y.detach(), expected)
    assert torch.equal(y.detach()[..., 8:], x[..., 8:])
    upstream = testing.random_tensor(x.shape, BF16, device, generator=g)
    out.backward(upstream)
    plain = x.clone().requires_grad_(True)
    tritonkit.apply_rotary_emb(plain, cos, sin).backward(upstream)
    assert torch.equal(leaf.grad, plain.grad)


def test_an_in_place_rotation_of_a_saved_tensor_fails_its_backward(device):
    """x rotated in place after autograd saved it (y = w * x): the backward raises, as after any
    in-place op (the eager call once skipped the version counter, and w's gradient read the rotated
    x)."""
    g = testing.generator(8)
    w = testing.random_tensor((1, 4, 2, 8), F32, device, generator=g).requires_grad_()
    x = testing.random_tensor((1, 4, 2, 8), F32, device, generator=g)
    y = w * x
    version = x._version
    tritonkit.apply_rotary_emb(x, *_tables(6, 4, device), inplace=True)
    assert x._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "in-place"])
def test_the_flash_attn_form_passes_opcheck_and_compiles_without_a_graph_break(inplace, device):
    """The contract's checks for the form it does not cover: opcheck on real arguments (packed,
    per-sequence offsets), and torch.compile(fullgraph=True) giving eager's bits."""
    g = testing.generator(5)
    x = testing.random_tensor((7, 2, 16), BF16, device, generator=g)
    cos, sin = _tables(9, 6, device)
    options = {
        "cu_seqlens": torch.tensor([0, 3, 7], dtype=torch.int32, device=device),
        "max_seqlen": 4,
        "seqlen_offsets": torch.tensor([2, 5], dtype=torch.int32, device=device),
        "inplace": inplace,
    }
    with opdef.recording_calls() as calls:
        eager = tritonkit.apply_rotary_emb(x.clone(), cos, sin, **options)
    ((custom, args),) = calls
    torch.library.opcheck(custom, tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: tritonkit.apply_rotary_emb(x, cos, sin, **options), fullgraph=True)
    assert torch.equal(compiled(x.clone()), eager)


def _flash(q, c, **kwargs):
    return tritonkit.apply_rotary_emb(q.transpose(1, 2), c, c, **kwargs)  # (1, 5, 2, 8): S = 5


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda q, k, c: tritonkit.apply_rotary_pos_emb(q, k, c, c, position_ids=c),
            NotImplementedError,
            "deprec",
        ),
        (
            lambda q, k, c: tritonkit.apply_rotary_pos_emb(q, k, c, c, unsqueeze_dim=3),
            NotImplementedError,
            "unsqu",
        ),
        (lambda q, k, c: tritonkit.apply_rotary_pos_emb(q, k[..., :6], c, c), ValueError, "k must match"),
        (lambda q, k, c: tritonkit.apply_rotary_pos_emb(q, k, c[:3], c[:3]), ValueError, "cos must be"),
        (lambda q, k, c: _flash(q, c[:, :5]), ValueError, "rotary_dim <= 8"),
        (lambda q, k, c: _flash(q, c[:2, :2]), ValueError, "positions up to 4"),
        (
            lambda q, k, c: _flash(q[0], c[:, :2], cu_seqlens=q.new_zeros(2, dtype=torch.int32)),
            ValueError,
            "max_s",
        ),
        (
            lambda q, k, c: _flash(q, c[:, :2], seqlen_offsets=-1),
            ValueError,
            "seqlen_offsets must be an int >= 0",
        ),
        (
            lambda q, k, c: _flash(q, c[:, :2], seqlen_offsets=1.5),
            ValueError,
            "seqlen_offsets must be an int >= 0",
        ),
    ],
)
def test_bad_input_is_refused_by_name(call, error, message, device):
    q = torch.randn(1, 2, 5, 8, device=device)
    k = torch.randn(1, 1, 5, 8, device=device)
    with pytest.raises(error, match=message):
        call(q, k, torch.randn(5, 8, device=device))


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_positions_outside_the_tables_give_nan_and_read_nothing(packed, device):
    """Per-sequence offsets that put tokens below 0 or past the tables' 8 rows (which no host check
    reads): those tokens' outputs are NaN (they once read memory outside the tables), every other
    token's are what tables of 16 rows (the same first 8) give."""
    g = testing.generator(6)
    offsets = torch.tensor([0, -3, 6], dtype=torch.int32, device=device)  # 4 tokens each
    x = testing.random_tensor((3, 4, 2, 16), BF16, device, generator=g)
    kwargs = {"seqlen_offsets": offsets}
    if packed:
        x = x.flatten(0, 1)
        kwargs |= {
            "cu_seqlens": torch.tensor([0, 4, 8, 12], dtype=torch.int32, device=device),
            "max_seqlen": 4,
        }
    short, long = _tables(8, 8, device), _tables(16, 8, device)
    assert torch.equal(long[0][:8], short[0])
    out, wide = (
        tritonkit.apply_rotary_emb(x, *tables, **kwargs).view(3, 4, 2, 16) for tables in (short, long)
    )
    positions = offsets[:, None] + torch.arange(4, device=device)
    outside = (positions < 0) | (positions >= 8)
    assert torch.equal(out.isnan().all(-1).all(-1), outside) and not out[~outside].isnan().any()
    assert torch.equal(out[~outside], wide[~outside])


def test_offsets_and_bounds_read_through_strided_views(device):
    """seqlen_offsets and cu_seqlens as every other entry of longer tensors: their values are read
    (the kernel once read them as contiguous), the contiguous ones' bits."""
    g = testing.generator(7)
    x = testing.random_tensor((12, 2, 16), BF16, device, generator=g)
    cos, sin = _tables(16, 8, device)
    given = {
        "cu_seqlens": torch.tensor([0, 5, 7, 12], dtype=torch.int32, device=device),
        "seqlen_offsets": torch.tensor([3, 0, 9], dtype=torch.int32, device=device),
    }
    strided = {}
    for name, values in given.items():
        spaced = torch.full((2 * values.shape[0],), 1000, dtype=torch.int32, device=device)
        spaced[::2] = values
        strided[name] = spaced[::2]
    want = tritonkit.apply_rotary_emb(x, cos, sin, max_seqlen=5, **given)
    assert torch.equal(tritonkit.apply_rotary_emb(x, cos, sin, max_seqlen=5, **strided), want)


# ---------------------------------------------------------------- on the H200


@pytest.mark.gpu
def test_gpu_llama_shaped_q_and_k(device):
    """The benchmark's (4, 32/8, 4096, 128) bf16, q and k views of one fused projection."""
    q, k, cos, sin = rotary._make_inputs((4, 32, 8, 4096, 128), BF16, device, testing.generator(6))
    qkv = torch.cat([q, k, k], dim=1).transpose(1, 2).contiguous()  # (B, S, 48, D)
    q, k = qkv[:, :, :32].transpose(1, 2), qkv[:, :, 32:40].transpose(1, 2)
    upstream = [testing.random_tensor(t.shape, BF16, device, generator=testing.generator(7)) for t in (q, k)]
    testing.check_against_reference(
        tritonkit.apply_rotary_pos_emb, rotary.rotary_pos_emb_reference, (q, k, cos, sin), grad_inputs=(0, 1),
        grad_outputs=upstream,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.hbm
def test_gpu_tokens_past_2_to_the_31_elements(device):
    """x (2, 65537, 128, 128) bf16 in flash-attn's form: the last tokens' offsets need 64 bits;
    the first and last tokens against the reference on them alone."""
    x = testing.random_tensor((2, 65537, 128, 128), BF16, device, generator=testing.generator(8))
    assert x.numel() > 2**31
    cos, sin = _tables(65537 + 5, 64, device)
    offsets = torch.tensor([0, 5], dtype=torch.int32, device=device)
    with testing.poisoned_outputs():
        out = tritonkit.apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets)
    for b, tokens in ((0, slice(0, 3)), (1, slice(65534, 65537))):
        part = x[b : b + 1, tokens].double()
        first = tokens.start + int(offsets[b])
        expected = rotary.rotary_emb_reference(part, cos.double(), sin.double(), seqlen_offsets=first)
        torch.testing.assert_close(out[b : b + 1, tokens].double(), expected, atol=2e-2, rtol=1e-2)


def test_program_groups_follow_what_a_head_blocks_pass_moves():
    """One group (each head block over every token) where a head block's pass fits in half the L2,
    else TOKEN_GROUP token blocks a group: the two shapes the order was measured at."""
    assert rotary._group(256, 18 * 2**20, "cpu") == 256  # (4, 32/8, 4096, 128)
    assert rotary._group(2048, 144 * 2**20, "cpu") == rotary.TOKEN_GROUP  # (1, 32/8, 32768, 128)


def test_tile_heads_bounds_a_tiles_heads(monkeypatch, device):
    """rotary.TILE_HEADS caps the heads a tile holds (the tile's other axes take the room): GQA 6/2
    at the default, one head a tile at TILE_HEADS = 1, outputs equal to the reference either way
    (two lengths, so that the second call cannot replay the first's launch on a GPU)."""
    g = testing.generator(0)
    for heads, block_h, seq in ((None, 2, 9), (1, 1, 10)):
        monkeypatch.setattr(rotary, "TILE_HEADS", heads)
        q = testing.random_tensor((2, 6, seq, 32), F32, device, generator=g)
        k = testing.random_tensor((2, 2, seq, 32), F32, device, generator=g)
        cos, sin = _tables(seq, 32, device)
        [fwd, _] = rotary._inspect_launches((2, 6, 2, seq, 32), F32)
        assert fwd.meta["BLOCK_H"] == block_h
        got = tritonkit.apply_rotary_pos_emb(q, k, cos, sin)
        for out, want in zip(got, rotary.rotary_pos_emb_reference(q, k, cos, sin), strict=True):
            torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
