"""The interpreter speed-ups the suite installs (``fast_interpreter``): the pairwise reduce gives what
Triton's own element-by-element one gives, for tuple combines along each axis, the whole block and
kept dims; a launch patches the language once, and kernels calling helpers compute as before."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

import fast_interpreter
from fast_interpreter import _SEQUENTIAL, pairwise_reduce
from tritonkit._runtime import interpret

pytestmark = pytest.mark.skipif(not interpret(), reason="checks Triton's interpreter")


@triton.jit
def _sum_and_max(a_sum, a_max, b_sum, b_max):
    return a_sum + b_sum, tl.maximum(a_max, b_max)


@triton.jit
def _reduce_kernel(
    x_ptr, sum_ptr, max_ptr, AXIS: tl.constexpr, KEEP: tl.constexpr, M: tl.constexpr, N: tl.constexpr
):
    x = tl.load(x_ptr + tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :])
    if AXIS is None:
        total, top = tl.reduce((x, -x), None, _sum_and_max, keep_dims=KEEP)
        if KEEP:  # a (1, 1) block
            tl.store(sum_ptr + tl.zeros((1, 1), tl.int32), total)
            tl.store(max_ptr + tl.zeros((1, 1), tl.int32), top)
        else:
            tl.store(sum_ptr, total)
            tl.store(max_ptr, top)
    else:
        total, top = tl.reduce((x, -x), AXIS, _sum_and_max, keep_dims=KEEP)
        length: tl.constexpr = N if AXIS == 0 else M
        offsets = tl.arange(0, length)
        if KEEP:
            offsets = offsets[None, :] if AXIS == 0 else offsets[:, None]
        tl.store(sum_ptr + offsets, total)
        tl.store(max_ptr + offsets, top)


def _run(axis, keep) -> tuple[torch.Tensor, torch.Tensor]:
    x = _input()
    sums, maxes = torch.full((16,), -7, dtype=torch.int32), torch.full((16,), -7, dtype=torch.int32)
    _reduce_kernel[(1,)](x, sums, maxes, AXIS=axis, KEEP=keep, M=8, N=16)
    return sums, maxes


def _input() -> torch.Tensor:
    return torch.randint(-1000, 1000, (8, 16), generator=torch.Generator().manual_seed(3), dtype=torch.int32)


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
def test_pairwise_reduce_equals_the_sequential_one(axis, keep, monkeypatch):
    assert interpreter.ReduceOps.generic_reduce is pairwise_reduce, "conftest installs the pairwise reduce"
    pairwise = _run(axis, keep)
    monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce", _SEQUENTIAL)
    sequential = _run(axis, keep)
    for ours, theirs in zip(pairwise, sequential, strict=True):
        assert torch.equal(ours, theirs)
    assert (pairwise[0] != -7).any()  # written


@pytest.mark.parametrize("keep", [False, True])
def test_pairwise_reduce_over_the_whole_block(keep):
    """(Triton's own reduce fails here with a tuple: it flattens only the first of the tuple.)"""
    sums, maxes = _run(None, keep)
    x = _input()
    assert sums[0] == x.sum() and maxes[0] == (-x).max()


def test_a_launch_patches_the_language_once_and_its_helpers_still_compute(monkeypatch):
    patched = []
    real = fast_interpreter._PATCH_LANG
    monkeypatch.setattr(fast_interpreter, "_PATCH_LANG", lambda fn: patched.append(fn) or real(fn))
    sums, maxes = _run(1, False)  # tl.reduce calls the kernel's combine helper, log2(16) times
    x = _input()
    assert len(patched) == 1
    assert torch.equal(sums[:8], x.sum(1)) and torch.equal(maxes[:8], (-x).max(1).values)


def test_the_numpy_dtype_memo_answers_as_the_interpreter_does():
    types = [tl.float32, tl.bfloat16, tl.int1, tl.pointer_type(tl.float16)]
    types += [tl.block_type(tl.bfloat16, [4, 8]), tl.block_type(tl.pointer_type(tl.int8), [2])]
    for tt in types + types:  # the second time from the memo
        assert fast_interpreter.np_dtype(tt) == fast_interpreter._GET_NP_DTYPE(tt), tt


def test_the_tuple_type_memo_answers_as_triton_does():
    cases = [(4, 8), (tl.constexpr(4), 8), (True, 1), (1, 1), (), (2.5,), (tl.constexpr(3),)]
    for values in cases + cases:
        ours, theirs = fast_interpreter.tuple_type(list(values)), fast_interpreter._TUPLE_TYPE(list(values))
        assert ours.name == theirs.name and ours.types == theirs.types, values


def test_the_block_type_memo_answers_as_triton_does_and_still_refuses_bad_shapes():
    cases = [(tl.float32, [4, 8]), (tl.float32, [tl.constexpr(4), 8]), (tl.bfloat16, [4, 8]), (tl.int1, [1])]
    cases += [(tl.pointer_type(tl.float16), [2, 16]), (tl.pointer_type(tl.float16, const=True), [2, 16])]
    for element, shape in cases + cases:  # the second time from the memo
        ours, theirs = tl.block_type(element, shape), tl.block_type.__new__(tl.block_type)
        fast_interpreter._BLOCK_TYPE_INIT(theirs, element, shape)
        assert (ours.shape, ours.numel, ours.name, ours.element_ty) == (
            theirs.shape,
            theirs.numel,
            theirs.name,
            theirs.element_ty,
        )
    bad = [([3, 4], ValueError), ([], TypeError), ([4.0], TypeError), ((4, 8), AssertionError)]
    for shape, error in bad:  # (Triton's takes a list or a tl.tuple, not a Python tuple)
        for _ in range(2):
            with pytest.raises(error):
                tl.block_type(tl.float32, shape)


def test_tensors_of_one_shape_share_its_tuple_and_keep_theirs():
    a, b = (tl.tensor(None, tl.block_type(tl.float32, [4, 8])) for _ in range(2))
    c = tl.tensor(None, tl.block_type(tl.float16, [8]))
    scalar = tl.tensor(None, tl.float32)
    assert a.shape is b.shape and [d.value for d in a.shape] == [4, 8] and a.numel.value == 32
    assert [d.value for d in c.shape] == [8] and c.numel.value == 8 and c.dtype == tl.float16
    assert len(scalar.shape) == 0 and scalar.numel.value == 1 and scalar.type == tl.float32
