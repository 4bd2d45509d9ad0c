"""Head dims between the sm_90 Gluon attention backward's own (``bwd_sm90.PADDED_HEAD_DIMS``: a multiple
of 8 up to 128), run by the kernel of the next head dim up with its TMA boxes past the tensors' D. On
the CPU: such a launch is that kernel's (the same signature and constexprs: nothing new compiles) and
only its boxes reach past D; a packed batch keeps the kernel's own head dims. On the H200 (``gpu``): dq,
dk and dv against the float64 reference gradients with the oracle's rule at D 8 to 120, both modes,
masks, Sq != Sk, GQA, a soft cap, strided (B, S, H, D) views, every column of every gradient written
(the buffers are NaN before), and ``flash_attention``'s backward on this kernel once
``bwd.SM90_BACKWARD_PADDED`` names its head dim."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from test_attention_bwd_sm90 import CASES, _case_id, _inputs, _sm90, assert_oracle_passes, check, check_case

pytestmark = pytest.mark.attention


def _launch(head_dim: int, deterministic: bool, gqa: bool = False):
    """The kernel's launch over (1, 4, 256, head_dim) inputs (CPU tensors: it is built, not run)."""
    from tritonkit.ops.attention import bwd_sm90

    q = torch.empty(1, 4, 256, head_dim, dtype=torch.bfloat16)
    k = torch.empty(1, 2 if gqa else 4, 256, head_dim, dtype=torch.bfloat16)
    lse, acc = torch.empty(1, 4, 256), torch.empty(1, 4, 256, head_dim)
    tickets = torch.empty(1, 4, 4, dtype=torch.int32)
    config = bwd_sm90.default_config(bwd_sm90.kernel_head_dim(head_dim), deterministic, gqa)
    (launch,) = bwd_sm90.launches(
        q, q, k, k, lse, lse, acc, tickets, k, k, scale=0.1, causal=True, upper_offset=0,
        deterministic=deterministic, config=config,
    )  # fmt: skip
    return launch


@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "deterministic"])
@pytest.mark.parametrize("head_dim", [8, 40, 56, 72, 96, 120])
def test_a_padded_head_dim_launches_the_next_kernel_up(head_dim, deterministic, monkeypatch):
    """The launch at D is the launch at the next kernel head dim up, but for the tensors' own shapes:
    the same signature (every descriptor's box and shared layout, the other arguments' types) and
    constexprs, so the compiled kernel is the one the static checks read; every box spans the
    kernel's columns, dq's half of them where a step adds one shared dq tile."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from tritonkit.ops.attention import bwd_sm90

    monkeypatch.setattr(bwd_sm90, "sm_count", lambda device: 132)
    kernel_dim = 64 if head_dim <= 64 else 128
    assert bwd_sm90.kernel_head_dim(head_dim) == kernel_dim
    for gqa in (False, True):
        padded, exact = _launch(head_dim, deterministic, gqa), _launch(kernel_dim, deterministic, gqa)
        assert padded.meta == exact.meta and padded.grid == exact.grid
        descriptors = [i for i, arg in enumerate(exact.args) if isinstance(arg, TensorDescriptor)]
        assert descriptors == list(range(7))
        for ours, theirs in zip(padded.args, exact.args, strict=True):
            assert type(ours) is type(theirs)
            if isinstance(ours, TensorDescriptor):  # a descriptor's type: its box and shared layout
                assert (ours.block_shape, ours.layout) == (theirs.block_shape, theirs.layout)
                assert ours.shape[3] == head_dim
        dq_cols = kernel_dim // 2 if padded.config["shared_dq"] else kernel_dim
        assert [arg.block_shape[3] for arg in padded.args[:7]] == [kernel_dim] * 6 + [dq_cols]


def test_the_kernel_takes_padded_head_dims_dense_and_packed(monkeypatch):
    """``supports``: D a multiple of 8 up to 256 (past 128 the wide kernel's, ``bwd_sm90_wide``),
    dense and packed (dK and dV leave a packed program row by row, masked by the tensors' columns
    too); nothing else."""
    from tritonkit.ops.attention import bwd_sm90, fwd_sm90
    from tritonkit.ops.attention.common import Packed

    monkeypatch.setattr(fwd_sm90, "capability", lambda index: fwd_sm90.SM90)

    class _OnGPU(torch.Tensor):  # a CPU tensor that says it is on the GPU: the rule reads shapes only
        is_cuda = True

    def tensors(head_dim):
        return [torch.empty(1, 2, 16, head_dim, dtype=torch.bfloat16).as_subclass(_OnGPU) for _ in "qkv"]

    cu = torch.tensor([0, 16], dtype=torch.int32)
    packed = Packed(cu, cu, 1, 16, 16)
    for head_dim in (4, 8, 60, 64, 96, 100, 128, 136, 250, 256, 264):
        dense = head_dim % 8 == 0 and head_dim <= 256
        assert bwd_sm90.supports(*tensors(head_dim)) == dense, head_dim
        assert bwd_sm90.supports(*tensors(head_dim), packed) == dense, head_dim


def test_a_packed_launch_names_its_tensors_head_dim(monkeypatch):
    """A packed batch's row stores (the forward's O, the backward's dK and dV) keep to the tensors' D,
    the kernels' TENSOR_D, under the boxes' columns at a padded head dim; a dense launch passes 0
    (unused there), so that a padded head dim's is the next one's up, compiled once."""
    from tritonkit.ops.attention import bwd_sm90, fwd_sm90
    from tritonkit.ops.attention.common import Packed

    monkeypatch.setattr(bwd_sm90, "sm_count", lambda device: 132)
    monkeypatch.setattr(fwd_sm90, "sm_count", lambda device: 132)
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    for head_dim in (40, 64, 96, 128):
        q = torch.empty(1, 4, 256, head_dim, dtype=torch.bfloat16)
        lse, acc = torch.empty(1, 4, 256), torch.empty(1, 4, 256, head_dim)
        tickets = torch.empty(1, 4, 4, dtype=torch.int32)
        config = bwd_sm90.default_config(bwd_sm90.kernel_head_dim(head_dim), True)
        for packed in (None, Packed(cu, cu, 2, 156, 156)):
            (backward,) = bwd_sm90.launches(
                q, q, q, q, lse, lse, acc, tickets, q, q, scale=0.1, causal=True, upper_offset=0,
                deterministic=True, config=config, packed=packed,
            )  # fmt: skip
            (forward,) = fwd_sm90.launches(
                q, q, q, q, lse, scale=0.1, causal=True, upper_offset=0, packed=packed
            )
            expected = head_dim if packed else 0
            assert backward.meta["TENSOR_D"] == forward.meta["TENSOR_D"] == expected, (head_dim, packed)


_FINISH_WIDTHS = r"""
import json, torch
from tritonkit.asm import compile_launch
from tritonkit.ops.attention import bwd_sm90

for head_dim in HEAD_DIMS:  # dq and, per query head, dK's and dV's shares over a group of 4 heads
    acc, shares = torch.empty(2, 8, 300, head_dim), [torch.empty(2, 8, 300, head_dim, dtype=torch.bfloat16)]
    dq = torch.empty(2, 300, 8, head_dim, dtype=torch.bfloat16).transpose(1, 2)  # (B, S, H, D) memory
    grads = [torch.empty(2, 300, 2, head_dim, dtype=torch.bfloat16).transpose(1, 2)]
    for launch in bwd_sm90.finish_launches(acc, dq, 0.5, grads, shares):
        r = compile_launch(launch, "sm_90")
        print(json.dumps({"group": launch.meta["GROUP"], "spills": r.spills, "loads": dict(r.loads),
                          "stores": dict(r.stores)}))
"""


def test_the_finishing_passes_at_a_padded_head_dim_compile_without_spills_to_16_byte_accesses():
    """The passes after the kernel at D = 96 (a 128-column tile, the last 32 masked), compiled for
    sm_90: no spills, and every global load and store 16 bytes wide (a row of D = 96 in (B, S, H, D)
    memory starts on 16 bytes)."""
    import sm90

    rows = [json.loads(line) for line in sm90.run(f"HEAD_DIMS = [96]\n{_FINISH_WIDTHS}")]
    assert sorted(row["group"] for row in rows) == [1, 4]
    for row in rows:
        assert not row["spills"], row
        assert set(row["loads"]) == set(row["stores"]) == {"128"}, row


# ---------------------------------------------------------------- on the H200

# head dims of both kernels' padding, each with a few of the dense cases (single rows, ragged lengths,
# full and causal masks, Sq != Sk both alignments, GQA and MQA)
PADDED = [8, 40, 72, 96, 120]
PADDED_CASES = [CASES[i] for i in (0, 4, 7, 10, 11, 13, 14)]


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "deterministic"])
@pytest.mark.parametrize("head_dim", PADDED)
@pytest.mark.parametrize("case", PADDED_CASES, ids=_case_id)
def test_gpu_padded_head_dims_match_the_reference(case, head_dim, deterministic):
    dtype = torch.float16 if head_dim == 96 else torch.bfloat16
    seed = 100 + 16 * PADDED_CASES.index(case) + 2 * PADDED.index(head_dim) + deterministic
    check_case(case, head_dim, dtype, deterministic, seed)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "deterministic"])
@pytest.mark.parametrize("head_dim", [40, 96])
def test_gpu_padded_head_dims_with_a_soft_cap(head_dim, deterministic):
    inputs = _inputs(1, 4, 2, 300, 500, head_dim, torch.bfloat16, 200 + head_dim + deterministic)
    check(*inputs, True, deterministic=deterministic, softcap=20.0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [80, 96])
def test_gpu_padded_head_dims_of_strided_views(head_dim):
    """q, k and v as views of one (B, S, 3 x H x D) projection and dO's (B, S, H, D) memory seen as
    (B, H, S, D): rows of H x D elements, so the boxes' columns past D are the next head's in
    memory, which the loads must not read and the stores must not write."""
    g = torch.Generator(device="cuda").manual_seed(300 + head_dim)
    batch, seq, heads = 2, 333, 4
    qkv = torch.randn(batch, seq, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    do = torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    for deterministic in (False, True):
        check(q, k, v, do.transpose(1, 2), True, deterministic=deterministic, scale=0.3)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "deterministic"])
def test_gpu_flash_attention_takes_the_gluon_backward_at_a_padded_head_dim(
    deterministic, monkeypatch, caplog
):
    """With D = 96 in ``bwd.SM90_BACKWARD_PADDED``, ``flash_attention``'s backward there runs this kernel
    (its debug line says so) and its gradients pass the oracle against the float64 reference."""
    import tritonkit
    from tritonkit.ops.attention import bwd
    from tritonkit.ops.attention.common import attention_reference

    monkeypatch.setattr(bwd, "SM90_BACKWARD_PADDED", (96,))
    q, k, v, do = _inputs(2, 8, 2, 700, 700, 96, torch.bfloat16, 400 + deterministic)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with caplog.at_level(logging.DEBUG, logger="tritonkit"):
        out = tritonkit.flash_attention(*leaves, causal=True, deterministic=deterministic)
        grads = torch.autograd.grad(out, leaves, do)
    assert any("backward" in r.message and "sm_90 Gluon" in r.message for r in caplog.records)

    def reference(dtype):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(attention_reference(*inputs, True, 96**-0.5), inputs, do.to(dtype))

    assert_oracle_passes(grads, reference, torch.bfloat16)
