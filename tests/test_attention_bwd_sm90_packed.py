"""Packed batches on the sm_90 Gluon attention backward (``ops/attention/bwd_sm90.py``, VARLEN): on the
H200 (``gpu``) dq, dk and dv against the float64 reference gradients with the oracle's rule, each
sequence attending to its own keys (one row, ragged lengths, Sq > Sk and Sq < Sk, a sequence without
queries and one without keys), full and causal masks and a causal window aligned bottom-right for each
sequence's lengths, a soft cap, GQA, D 64, 128 and 256 and the padded 40, 96 and 200, both modes, the
deterministic mode's bits run to run, every row (and at a padded head dim every column) of every
gradient written (the buffers are NaN before) and ``flash_attention``'s backward
taking this kernel. The dispatch rule and the launch are tested on the CPU in test_attention_bwd_sm90,
and the kernel's compile for sm_90 with VARLEN is among its static cases."""

from __future__ import annotations

import itertools
import logging
import math

import pytest
import torch

from test_attention_bwd_sm90 import _sm90, assert_oracle_passes

pytestmark = pytest.mark.attention

# each sequence's (query rows, keys): as the forward's packed test, with a sequence of more than two key
# blocks and query blocks that end inside a 64-row step
LENGTHS = [(1, 1), (130, 130), (700, 300), (64, 900), (0, 7), (6, 0), (257, 257), (77, 333)]


def _packed_inputs(head_dim: int, dtype, seed: int):
    """(q, k, v, do, packed) over LENGTHS: (T, 4, D) queries and upstream gradient, (T, 2, D) keys and
    values (GQA), seeded."""
    from tritonkit.ops.attention.common import Packed

    g = torch.Generator(device="cuda").manual_seed(seed)
    cu_q, cu_k = (
        torch.tensor([0, *itertools.accumulate(n[i] for n in LENGTHS)], dtype=torch.int32, device="cuda")
        for i in (0, 1)
    )
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q, do = (torch.randn(total_q, 4, head_dim, device="cuda", dtype=dtype, generator=g) for _ in "qo")
    k, v = (torch.randn(total_k, 2, head_dim, device="cuda", dtype=dtype, generator=g) for _ in "kv")
    longest = [max(n[i] for n in LENGTHS) for i in (0, 1)]
    return q, k, v, do, Packed(cu_q, cu_k, len(LENGTHS), *longest)


def _check_packed(q, k, v, do, packed, scores, deterministic: bool, config=None) -> tuple:
    """The kernel's (dq, dk, dv) for ``scores`` over the packed batch (written into NaN-filled
    buffers; ``config`` the launch's, None for the default), held by the oracle to autograd through
    the reference in float64, torch's error from the reference run in the inputs' dtype; returned
    for the bits' check."""
    from tritonkit.ops.attention import bwd, bwd_sm90
    from tritonkit.ops.attention.common import attention_reference

    options = {"window": scores.window, "softcap": scores.softcap}
    options |= {"cu_seqlens_q": packed.cu_q.cpu(), "cu_seqlens_k": packed.cu_k.cpu()}
    o, lse = attention_reference(
        q.double(), k.double(), v.double(), scores.causal, scores.scale, return_lse=True, **options
    )
    o, lse = o.to(q.dtype), lse.float()  # (T, H, D) and (H, T)
    views = [t.transpose(0, 1).unsqueeze(0) for t in (do, q, k, v, o)]  # (1, H, T, D), as bwd makes them
    lse = lse.unsqueeze(0)
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    for launch in bwd._delta_launches(views[4], views[0], None, delta):
        launch.run()
    lengths = (packed.max_q, packed.max_k)
    (upper, lower, *_), flags = scores.within(*lengths).kernel_args(0, 0)  # each sequence aligns its own
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    bwd_sm90.attention_bwd_sm90(
        *views[:4], lse, delta, *(t.transpose(0, 1).unsqueeze(0) for t in grads), scale=scores.scale,
        causal=flags["IS_CAUSAL"], upper_offset=upper, lower_offset=lower if flags["HAS_LOWER"] else None,
        softcap=scores.softcap, deterministic=deterministic, packed=packed, config=config,
    )  # fmt: skip

    def reference(dtype):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = attention_reference(*inputs, scores.causal, scores.scale, **options)
        return torch.autograd.grad(out, inputs, do.to(dtype))

    assert_oracle_passes(grads, reference, q.dtype)
    return grads


# (causal, window, softcap): each sequence's bounds aligned bottom-right for its own lengths
MASKS = [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (True, (200, 0), 0.0), (False, (-1, -1), 30.0)]


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "deterministic"])
# (40, 96 and 200: padded, dK and dV masked by column; 256 and 200 the wide kernel's, bwd_sm90_wide)
@pytest.mark.parametrize("head_dim", [64, 128, 40, 96, 256, 200])
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"causal={m[0]}-window{m[1][0]},{m[1][1]}-cap{m[2]:g}")
def test_gpu_packed_batches_match_the_reference(mask, head_dim, deterministic):
    from tritonkit.ops.attention.common import Scores

    causal, window, cap = mask
    dtype = torch.float16 if MASKS.index(mask) == 1 else torch.bfloat16
    q, k, v, do, packed = _packed_inputs(head_dim, dtype, seed=4 * MASKS.index(mask) + head_dim // 64)
    scores = Scores(head_dim**-0.5, causal, True, window, cap)
    grads = _check_packed(q, k, v, do, packed, scores, deterministic)
    if deterministic:  # the same bits again
        again = _check_packed(q, k, v, do, packed, scores, deterministic)
        assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_a_rotated_free_walk_over_packed_sequences(head_dim):
    """``Config.rotate`` in the free mode (each sequence's key block n starting at its query block
    n * Mb / Nb, wrapping), with the 16-bit P at D = 128: a full mask over the ragged sequences."""
    from tritonkit.ops.attention import bwd_sm90
    from tritonkit.ops.attention.common import Scores

    config = bwd_sm90.default_config(head_dim, False)._replace(rotate=True, p_in_pairs=head_dim == 128)
    q, k, v, do, packed = _packed_inputs(head_dim, torch.bfloat16, seed=50 + head_dim)
    _check_packed(q, k, v, do, packed, Scores(head_dim**-0.5, False, True, (-1, -1), 0.0), False, config)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
def test_gpu_a_packed_call_checks_its_views_and_cu_seqlens():
    from tritonkit.ops.attention import bwd_sm90
    from tritonkit.ops.attention.common import Packed

    q, k, v, do, packed = _packed_inputs(64, torch.bfloat16, seed=1)
    views = [t.transpose(0, 1).unsqueeze(0) for t in (do, q, k, v)]
    lse = torch.zeros(1, 4, q.shape[0], device="cuda")
    grads = [torch.empty_like(t) for t in views[1:]]
    call = {"scale": 0.125, "causal": True, "upper_offset": 0}
    wrong = [
        (packed._replace(cu_q=packed.cu_q.long()), "cu_q must be int32"),
        (packed._replace(cu_k=packed.cu_k[:-1]), "cu_k must be int32"),
        (Packed(packed.cu_q.cpu(), packed.cu_k, *packed[2:]), "cu_q must be int32"),
    ]
    for bad, message in wrong:
        with pytest.raises(ValueError, match=message):
            bwd_sm90.attention_bwd_sm90(*views, lse, lse, *grads, packed=bad, **call)
    two = [torch.cat([t, t]) for t in views]  # two batch slots: not a packed batch's views
    with pytest.raises(ValueError, match=r"\(1, H, T, D\) views"):
        bwd_sm90.attention_bwd_sm90(*two, lse, lse, *grads, packed=packed, **call)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_flash_attention_backward_takes_the_gluon_kernel_packed(deterministic, head_dim, caplog):
    """flash_attention's cu_seqlens go to this kernel in the backward (its debug line), its gradients
    within the oracle's rule against float64."""
    import tritonkit
    from tritonkit.ops.attention.common import attention_reference

    q, k, v, do, packed = _packed_inputs(head_dim, torch.bfloat16, seed=9)
    call = {"cu_seqlens_q": packed.cu_q, "cu_seqlens_k": packed.cu_k, "causal": True}
    call |= {"max_seqlen_q": packed.max_q, "max_seqlen_k": packed.max_k, "deterministic": deterministic}
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with caplog.at_level(logging.DEBUG, logger="tritonkit"):
        grads = torch.autograd.grad(tritonkit.flash_attention(*leaves, **call), leaves, do)
    assert f"attention backward {tuple(q.shape)} on the sm_90 Gluon kernel" in caplog.text, caplog.text

    def reference(dtype):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        options = {"cu_seqlens_q": packed.cu_q.cpu(), "cu_seqlens_k": packed.cu_k.cpu()}
        return torch.autograd.grad(attention_reference(*inputs, True, **options), inputs, do.to(dtype))

    assert_oracle_passes(grads, reference, q.dtype)
