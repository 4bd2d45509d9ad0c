"""LayerNorm and RMSNorm (and their add_ forms): outputs and every gradient against the float64
reference, awkward shapes, parameters absent or in fp32, constant rows, errors, custom ops, compile,
the modules' state_dict, and on the H200 a tensor past 2^31 elements."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

import sm90
import tritonkit
from tritonkit import tuning
from tritonkit._runtime import current_device, sm_count
from tritonkit.ops import get_op
from tritonkit.ops.norm import OPS
from tritonkit.ops.norm import kernels as nk
from tritonkit.ops.norm import norm as nm
from tritonkit.ops.norm import split as ns
from tritonkit.oracle import compare
from tritonkit.testing import (
    check_against_reference,
    compare_with_reference,
    generator,
    poisoned_outputs,
    random_tensor,
)

pytestmark = pytest.mark.norm

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
KINDS = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"]
# the main kernel of each (direction, looped), by which tests tell the launches apart
KERNELS = {
    nk._norm_fwd_kernel: ("fwd", False),
    nk._norm_fwd_looped_kernel: ("fwd", True),
    nk._norm_bwd_kernel: ("bwd", False),
    nk._norm_bwd_looped_kernel: ("bwd", True),
}


def _case(
    kind: str, shape, dtype, device, seed, *, weight=True, bias=True, param_dtype=None, noncontiguous=False
):
    """(kernel, reference, inputs, grad_inputs, grad_outputs) for one call of ``kind``."""
    g = generator(seed)
    n, residual, rms = shape[-1], kind.startswith("add_"), "rms" in kind
    x = random_tensor(shape, dtype, device, generator=g, scale=2.0, noncontiguous=noncontiguous).add_(0.5)
    inputs = [x] + ([random_tensor(shape, dtype, device, generator=g)] if residual else [])
    params = [("weight", weight), ("bias", bias and not rms)]
    inputs += [random_tensor((n,), param_dtype or dtype, device, generator=g) for _, on in params if on]
    names = [name for name, on in params if on]
    eps = torch.finfo(dtype).eps if rms else 1e-5

    def split(args):
        head = 2 if residual else 1
        return list(args[:head]) + [(n,)], dict(zip(names, args[head:], strict=True)) | {"eps": eps}

    def kernel(*args):
        positional, kwargs = split(args)
        return getattr(tritonkit, kind)(*positional, **kwargs)

    def reference(*args):
        positional, kwargs = split(args)
        return getattr(nm, f"{kind}_reference")(*positional, **kwargs)

    grads = [
        random_tensor(shape, dtype, device, generator=g, noncontiguous=not noncontiguous)
        for _ in range(2 if residual else 1)
    ]
    return kernel, reference, inputs, tuple(range(len(inputs))), grads


@pytest.mark.parametrize("kind", ["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_rms_eps_default_is_torchs(kind, dtype, device):
    # torch computes 16-bit inputs in fp32 and takes fp32's epsilon when eps is None; rows with a
    # mean square near bf16's epsilon (7.8e-3) show the difference at once
    g = generator(5)
    residual = kind.startswith("add_")
    inputs = [random_tensor((6, 300), dtype, device, generator=g, scale=0.05)]
    inputs += [random_tensor((6, 300), dtype, device, generator=g, scale=0.05)] if residual else []
    inputs += [random_tensor((300,), dtype, device, generator=g)]
    head = 2 if residual else 1

    def kernel(*args):
        return getattr(tritonkit, kind)(*args[:head], (300,), *args[head:])

    def reference(*args):
        return getattr(nm, f"{kind}_reference")(*args[:head], (300,), *args[head:])

    assert nm.rms_eps(None, dtype) == torch.finfo(F32).eps and nm.rms_eps(0.5, dtype) == 0.5
    grads = [random_tensor((6, 300), dtype, device, generator=g) for _ in range(head)]
    check_against_reference(
        kernel, reference, inputs, grad_inputs=tuple(range(len(inputs))), grad_outputs=grads
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(7, 1000), (3, 5, 64), (1, 7), (9, 1), (2, 4097)], ids=str)
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_matches_reference(kind, shape, dtype, device):
    kernel, reference, inputs, grad_inputs, grads = _case(kind, shape, dtype, device, seed=sum(shape))
    check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "weight, bias, param_dtype", [(False, False, None), (True, False, None), (True, True, F32)], ids=str
)
def test_parameters_absent_or_fp32(kind, weight, bias, param_dtype, device):
    kernel, reference, inputs, grad_inputs, grads = _case(
        kind, (5, 96), BF16, device, seed=1, weight=weight, bias=bias, param_dtype=param_dtype
    )
    check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("param_dtype", [F16], ids=str)
def test_fp32_input_with_16_bit_parameters(kind, param_dtype, device):
    """An fp32 input with 16-bit weight and bias (a 16-bit model fed fp32 activations): fp32 outputs
    and input gradients, parameter gradients in the parameters' dtype, as torch's promotion gives
    them (once refused). (fp16 here: the interpreter truncates to bf16 where the GPU rounds, which
    doubles a bf16 gradient's error; the kernels take any of the two alike.)"""
    kernel, reference, inputs, grad_inputs, grads = _case(
        kind, (5, 96), F32, device, seed=7, param_dtype=param_dtype
    )
    assert inputs[-1].dtype == param_dtype
    check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_strided_weight_and_bias(kind, dtype, device):
    """Parameters that are views with stride 2 (every other entry of a longer tensor) are read as
    the values they hold, and get their gradients."""
    kernel, reference, inputs, grad_inputs, grads = _case(kind, (7, 1000), dtype, device, seed=44)
    head = 2 if kind.startswith("add_") else 1
    strided = [
        random_tensor((2 * p.shape[0],), p.dtype, device, generator=generator(45 + i))[::2]
        for i, p in enumerate(inputs[head:])
    ]
    assert strided and all(p.stride() == (2,) for p in strided)
    check_against_reference(
        kernel, reference, inputs[:head] + strided, grad_inputs=grad_inputs, grad_outputs=grads
    )


@pytest.fixture
def looped(monkeypatch):
    """Rows longer than 64 entries go through the looped kernels, in chunks of 32 (the few rows of
    these tests make backward programs of 4 rows, not one a program: 9 rows end in a partial group)."""
    monkeypatch.setattr(nm, "MAX_BLOCK_N", {"fwd": 64, "bwd": 64})
    monkeypatch.setattr(nk, "LOOP_BLOCK_N", 32)
    monkeypatch.setattr(ns, "SPLIT_PER_SM", 0)  # few rows stay a program each (test_norm_split.py: split)
    monkeypatch.setattr(nk, "BWD_LOOPED_ROW_A_PROGRAM", 0)
    for tuned in nm._TUNED.values():
        monkeypatch.setattr(tuned, "_chosen", {})  # configs chosen under the usual limits
    seen, run = [], nm._run

    def recording(launches):
        seen.extend(KERNELS[launch.kernel] for launch in launches if launch.kernel in KERNELS)
        run(launches)

    monkeypatch.setattr(nm, "_run", recording)
    return seen


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(7, 200), (3, 65), (9, 97)], ids=str)  # 9 rows: a partial row group
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_long_rows_go_through_the_looped_kernels(kind, shape, dtype, looped, device):
    kernel, reference, inputs, grad_inputs, grads = _case(kind, shape, dtype, device, seed=sum(shape) + 1)
    check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)
    assert set(looped) == {("fwd", True), ("bwd", True)}


def _force(monkeypatch, config: dict, direction: str = "fwd", looped: bool = True) -> list:
    """The kernel's tuner offers only ``config``; the returned list records each of the kernel's
    launches as (grid, constexprs and options)."""
    tuned = nm._TUNED[direction, looped]
    forced = tuning.Tuner(
        tuned.tuner.name, [config], sources=tuned.tuner.sources, default=lambda key: dict(config)
    )
    monkeypatch.setattr(tuned, "tuner", forced)
    monkeypatch.setattr(tuned, "_chosen", {})
    launches, run = [], nm._run

    def recording(calls):
        launches.extend((c.grid, c.meta) for c in calls if KERNELS.get(c.kernel) == (direction, looped))
        run(calls)

    monkeypatch.setattr(nm, "_run", recording)
    return launches


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_without_autograd_stores_no_statistics(kind, monkeypatch, device):
    """Without autograd the one-pass forward stores no mean or rstd (only a backward reads them);
    with it, it does. The outputs, and the gradients from the stored statistics, match."""
    launches = _force(monkeypatch, {"BLOCK_M": 2, "num_warps": 4}, looped=False)
    kernel, reference, inputs, grad_inputs, grads = _case(kind, (9, 97), BF16, device, seed=8)
    check_against_reference(kernel, reference, inputs)
    assert launches and not any(meta["STATS"] for _, meta in launches), launches
    launches.clear()
    check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)
    assert launches and all(meta["STATS"] for _, meta in launches), launches
    _, _, mean, rstd = nm._forward_outputs(inputs[0], None, "rms" in kind, stats=False)
    assert mean is None and rstd is None  # what the op is given without autograd


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prefetch", [False, True])
def test_backward_rows_reduced_in_blocks(kind, prefetch, monkeypatch, device):
    """The one-pass backward reducing BLOCK_M rows together: 11 rows at 8 a program make a program
    of two full blocks and one of a full block and a partial one; dx, dw and db match."""
    config = {"ROWS": 8, "BLOCK_M": 4, "num_warps": 4} | ({"PREFETCH": True} if prefetch else {})
    launches = _force(monkeypatch, config, direction="bwd", looped=False)
    kernel, reference, inputs, grad_inputs, grads = _case(kind, (11, 97), F32, device, seed=7)
    check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)
    assert launches and all(grid == (2,) and meta["BLOCK_M"] == 4 for grid, meta in launches), launches


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(21, 10), (29, 224)], ids=str)
def test_a_tiny_backward_is_one_launch(kind, dtype, shape, monkeypatch, device):
    """21 rows of 10, and 29 of 224 (a tile of 32 x 256: BWD_ONE_PROGRAM_ELEMENTS), untuned: one
    program reduces them as one block and writes dw and db itself (cast to the parameters' dtype as
    it stores them), no second launch; every gradient matches."""
    monkeypatch.setattr(nm._TUNED["bwd", False], "_chosen", {})
    launches, run = [], nm._run

    def recording(calls):
        launches.append([(c.name, c.grid, c.meta.get("BLOCK_M")) for c in calls])
        run(calls)

    monkeypatch.setattr(nm, "_run", recording)
    with tuning.disabled():
        kernel, reference, inputs, grad_inputs, grads = _case(kind, shape, dtype, device, seed=21)
        check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)
    assert [("bwd", (1,), 32)] in launches and not any("bwd partial sums" in str(c) for c in launches)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_many_tiny_rows_go_backward_many_to_a_tile(kind, dtype, monkeypatch, device):
    """4100 rows of 5 untuned (the bucket of 8192: 16 rows or more a program on 132 SMs): tiles of
    16 rows, a tile a program (257), where a program walked its 16 rows one at a time; every
    gradient matches."""
    monkeypatch.setattr(nm._TUNED["bwd", False], "_chosen", {})
    launches, run = [], nm._run

    def recording(calls):
        launches.extend((c.name, c.grid, c.meta.get("ROWS"), c.meta.get("BLOCK_M")) for c in calls)
        run(calls)

    monkeypatch.setattr(nm, "_run", recording)
    with tuning.disabled():
        kernel, reference, inputs, grad_inputs, grads = _case(kind, (4100, 5), dtype, device, seed=41)
        check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)
    assert ("bwd", (257,), 16, 16) in launches, launches


@pytest.mark.parametrize(
    "kind, seed", [("rms_norm", 8), ("rms_norm", 10), ("layer_norm", 5), ("layer_norm", 18)]
)
def test_fp32_weight_gradients_of_a_tiny_input_stay_within_the_oracle(kind, seed, monkeypatch, device):
    """64 rows of 64 fp32 untuned: one program summing dw down all 64 rows erred past the oracle's
    bound at these seeds (a chain past FP32_SUM_CHAIN_MAX); fp32 tiles stop at 32 rows."""
    monkeypatch.setattr(nm._TUNED["bwd", False], "_chosen", {})
    with tuning.disabled():
        kernel, reference, inputs, grad_inputs, grads = _case(kind, (64, 64), F32, device, seed=seed)
        check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_of_one_entry_go_backward_in_blocks_of_two(kind, monkeypatch, device):
    """A row of one entry goes backward as a block of two, the second masked: a block of one let the
    GPU's compiler cancel mean(dy * w) against an unrounded dy * w (dx 2.8e-6, not 0, at fp32 on an
    H100; the interpreter computes 0 either way, so `test_gpu_rows_of_one_entry` checks the values)."""
    launches = _force(monkeypatch, {"ROWS": 8, "num_warps": 4}, "bwd", looped=False)
    kernel, reference, inputs, grad_inputs, grads = _case(kind, (9, 1), F32, device, seed=9)
    check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)
    blocks = [meta["BLOCK_N"] for _, meta in launches]
    assert blocks and all(block == nm.ROW_BLOCK_MIN == 2 for block in blocks), launches


def test_backward_blocks_must_divide_the_rows_a_program():
    """A BLOCK_M that does not divide ROWS, or one given to the looped backward, is refused."""
    for n, config in [
        (64, {"ROWS": 8, "BLOCK_M": 3, "num_warps": 4}),
        (65536, {"ROWS": 8, "BLOCK_M": 2, "BLOCK_N": 4096, "num_warps": 4}),
    ]:
        h = torch.empty((16, n), dtype=F32)
        with pytest.raises(ValueError, match="BLOCK_M must divide ROWS"):
            nm._bwd_launches(h, None, h, h[0], None, None, h[:, 0], True, h, h[0], None, config)


@pytest.mark.parametrize("kind", KINDS)
def test_a_persistent_looped_forward_walks_every_row(kind, looped, monkeypatch, device):
    """A PER_SM config launches fewer programs than rows (two for 9 rows, on one SM), and each
    walks its share: every row's output, statistics and gradients match the reference."""
    monkeypatch.setattr(nm, "sm_count", lambda device: 1)
    launches = _force(monkeypatch, {"BLOCK_N": 32, "num_warps": 4, "PER_SM": 2})
    kernel, reference, inputs, grad_inputs, grads = _case(kind, (9, 97), BF16, device, seed=5)
    check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)
    assert launches and all(grid == (2,) for grid, _ in launches), launches


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, out_block", [(100, 64), (20000, 4096)])
def test_a_chunk_past_8192_with_a_smaller_second_pass(kind, n, out_block, looped, monkeypatch, device):
    """Chunks past 8192 entries shift LayerNorm's sums by the mean of the row's first entries (all
    of them at 100, fewer than SHIFT_SAMPLE), pass 2 walks chunks of OUT_BLOCK_N: rows far from
    zero still match, and every entry of y is written. The outputs only: y carries the mean and
    rstd the backward reuses, and the looped backward's own tests cover the gradients."""
    config = {"BLOCK_N": 16384, "OUT_BLOCK_N": out_block, "num_warps": 4}
    launches = _force(monkeypatch, config)
    kernel, reference, inputs, _, _ = _case(kind, (3, n), F32, device, seed=n)
    inputs[0] += 1000.0
    check_against_reference(kernel, reference, inputs)
    assert launches and all(m["BLOCK_N"] == 16384 and m["OUT_BLOCK_N"] == out_block for _, m in launches)


@pytest.mark.parametrize("kind", KINDS)
def test_few_long_rows_go_one_a_program_backward(kind, looped, monkeypatch, tmp_path, device):
    """Up to BWD_LOOPED_ROW_A_PROGRAM long rows, the looped backward's default takes one a program
    (ten rows: ten programs, where four a program made three); the gradients match. The default
    itself: an empty tuning cache (on a GPU an earlier test's tuning of this key is cached, and
    ``tuning.disabled()`` still takes a cached winner)."""
    monkeypatch.setattr(nk, "BWD_LOOPED_ROW_A_PROGRAM", 32)
    monkeypatch.setenv("TRITONKIT_CACHE_DIR", str(tmp_path))
    for tuned in nm._TUNED.values():
        tuned.tuner.forget()
    launches = []
    run = nm._run

    def recording(calls):
        launches.extend((c.grid, c.meta["ROWS"]) for c in calls if c.kernel is nk._norm_bwd_looped_kernel)
        run(calls)

    monkeypatch.setattr(nm, "_run", recording)
    with tuning.disabled():
        kernel, reference, inputs, grad_inputs, grads = _case(kind, (10, 97), F32, device, seed=10)
        check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)
    assert launches and all(launch == ((10,), 1) for launch in launches), launches


def test_backward_rows_per_program_keep_every_sm_busy():
    """Two programs an SM where rows allow (8192 rows at 64 a program were 128 programs for 132 SMs),
    at most 64 rows a program (16 looped), at least 8 (4 looped)."""
    sms = sm_count(current_device())  # the H200's 132 without a GPU
    for rows, looped, expected in [
        (8192, False, 16),
        (32768, False, 64),
        (65536, False, 64),
        (16384, False, 32),
        (4096, True, 8),
        (1024, True, 4),
        (9, False, 8),
    ]:
        per_program = nk._bwd_rows_per_program(rows, current_device(), looped)
        if sms == 132:
            assert per_program == expected, (rows, looped)
        low, high = nk.BWD_ROWS_RANGE[looped]
        assert low <= per_program <= high and per_program & (per_program - 1) == 0
        assert per_program == low or -(-rows // per_program) >= nk.BWD_PROGRAMS_PER_SM * sms


@pytest.mark.parametrize("kind", KINDS)
def test_rows_of_131072_at_the_real_chunk_size(kind, device):
    kernel, reference, inputs, grad_inputs, grads = _case(kind, (2, 131072), F32, device, seed=16)
    check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)


def test_looped_layer_norm_keeps_a_large_mean_from_cancelling(looped, device):
    """Rows far from zero: merged chunk statistics keep the variance that sum(h^2) - N mean^2 loses."""
    x = (random_tensor((4, 300), F32, device, generator=generator(14)) + 1000.0).requires_grad_()
    check_against_reference(
        lambda t: tritonkit.layer_norm(t, 300),
        lambda t: nm.layer_norm_reference(t, (300,)),
        [x.detach()],
        grad_inputs=(0,),
        grad_outputs=[random_tensor((4, 300), F32, device, generator=generator(15))],
    )


@pytest.mark.parametrize("path", ["one-pass", "looped"])
def test_layer_norm_rows_far_from_zero_err_a_twentieth_of_torchs(path, request, device):
    """Rows at 100 with a spread of 0.005: the fp32 mean's rounding, one shift of every centred value,
    is much of that spread. torch's forward and backward carry it (its backward multiplies it up); the
    one-pass forward takes it out (the corrected two-pass variance) and every backward centres xhat by
    its own mean (``terms.layer_norm_terms``): each err at most a twentieth of torch's against the
    float64 reference (on the CPU 0.003x, 0.003x and, looped, 0.001x; before: the forward 4.6x torch's,
    the backward 0.63x and 0.09x). The looped forward's y keeps the mean's own rounding, as torch's
    does."""
    if path == "looped":
        request.getfixturevalue("looped")
    x = random_tensor((4, 300), F32, device, generator=generator(21), scale=0.005) + 100.0
    w, b, dy = (random_tensor(shape, F32, device, generator=generator(22 + i)) for i, shape in
                enumerate([(300,), (300,), (4, 300)]))  # fmt: skip
    comparisons = compare_with_reference(
        lambda *t: tritonkit.layer_norm(t[0], 300, t[1], t[2]),
        lambda *t: nm.layer_norm_reference(t[0], (300,), t[1], t[2]),
        [x, w, b],
        grad_inputs=(0, 1, 2),
        grad_outputs=[dy],
    )
    for c in comparisons:
        assert c.passed, c
    output, dx = comparisons[0], comparisons[1]
    assert dx.err_kernel <= dx.err_torch / 20, dx
    if path == "one-pass":
        assert output.err_kernel <= output.err_torch / 20, output


def test_layer_norm_rows_of_two(device):
    """Rows of two entries, xhat +-1 up to eps: the gradient is all cancellation. The sweep's case
    (its inputs and upstream gradient): the backward at 44 x 2 fp32 erred 2.2x torch's before it
    centred xhat."""
    op = get_op("layer_norm")
    inputs = op.make_inputs((44, 2), F32, device, generator(0))
    grads = [random_tensor((44, 2), F32, device, generator=generator(1))]
    check_against_reference(op.fn, op.reference, inputs, grad_inputs=op.grad_inputs, grad_outputs=grads)


@pytest.mark.parametrize("kind", KINDS)
def test_noncontiguous_input_and_gradient(kind, device):
    kernel, reference, inputs, grad_inputs, grads = _case(
        kind, (6, 200), F32, device, seed=2, noncontiguous=True
    )
    assert not inputs[0].is_contiguous() and grads[0].is_contiguous()
    check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)


@pytest.mark.parametrize("kind", KINDS)
def test_empty_input(kind, device):
    kernel, _, inputs, _, _ = _case(kind, (0, 64), F32, device, seed=3)
    inputs = [t.requires_grad_() for t in inputs]
    outputs = kernel(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    assert all(o.shape == (0, 64) for o in outputs)
    grads = torch.autograd.grad(outputs, inputs, [torch.ones_like(o) for o in outputs])
    assert [g.shape for g in grads] == [t.shape for t in inputs]
    assert all(not g.numel() or not g.any() for g in grads[1 + kind.startswith("add_") :])  # no rows: zeros


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_constant_rows_stay_finite(kind, device):
    """Variance 0 (LayerNorm) or an all-zero row (RMSNorm): eps keeps every output finite."""
    x = torch.full((4, 128), 3.0 if kind == "layer_norm" else 0.0, device=device).requires_grad_()
    with poisoned_outputs():
        y = getattr(tritonkit, kind)(x, 128)
        (grad,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.isfinite(y).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(y, getattr(nm, f"{kind}_reference")(x.detach(), (128,)))


@pytest.mark.parametrize("kind", ["add_layer_norm", "add_rms_norm"])
@pytest.mark.parametrize("used", ["y", "h"])
def test_an_unused_output_gets_torchs_gradients(kind, used, device):
    """Only one of (y, h) reaching the loss: the gradients torch's composition gives, None for the
    weight and bias where only the sum h is used (an optimizer skips a None; zeros it would decay)."""
    kernel, reference, inputs, _, _ = _case(kind, (5, 48), F32, device, seed=6)
    results = []
    for fn in (kernel, reference):
        args = [t.detach().clone().requires_grad_() for t in inputs]
        y, h = fn(*args)
        (y if used == "y" else h).square().sum().backward()
        results.append([a.grad for a in args])
    for got, expected in zip(*results, strict=True):
        if expected is None:
            assert got is None
        else:
            torch.testing.assert_close(got, expected.to(got.dtype), rtol=1e-4, atol=1e-4)


def test_weight_gradients_are_deterministic(device):
    """Two-stage sums, no atomics: the same inputs give bit-identical dw and db. 75 rows: untuned,
    ten backward programs of 8 rows (the last one's ragged), whose partial sums the second stage adds."""
    kernel, _, inputs, _, grads = _case("layer_norm", (75, 64), BF16, device, seed=4)
    runs = []
    for _ in range(2):
        args = [t.detach().clone().requires_grad_() for t in inputs]
        runs.append(torch.autograd.grad(kernel(*args), args, grads))
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)  # (the interpreter truncates to bf16)
def test_add_forms_return_the_sum(dtype, device):
    x, r = (random_tensor((3, 40), dtype, device, generator=generator(5 + i)) for i in range(2))
    for fn in (tritonkit.add_layer_norm, tritonkit.add_rms_norm):
        _, h = fn(x, r, 40)
        torch.testing.assert_close(h, x + r, rtol=0, atol=0)  # one rounding of the fp32 sum, as torch
    # without a residual (a first layer's): still the documented pair, the norm of x and x itself
    for fn, plain in (
        (tritonkit.add_layer_norm, tritonkit.layer_norm),
        (tritonkit.add_rms_norm, tritonkit.rms_norm),
    ):
        y, h = fn(x, None, 40)
        assert h is x
        torch.testing.assert_close(y, plain(x, 40), rtol=0, atol=0)


@pytest.mark.parametrize("used", ["both", "sum only", "norm only"])
@pytest.mark.parametrize("kind", ["add_layer_norm", "add_rms_norm"])
def test_without_a_residual_the_sums_gradient_joins_the_norms_backward(kind, used, device):
    """With autograd recording, ``add_*_norm(x, None)``'s sum is a view of x whose gradient (a
    residual's, downstream) the norm's backward adds to x's in its own pass: one node for both
    outputs, so autograd sums nothing apart, and x's and the weight's gradients pass the oracle
    against the float64 reference of norm(x) and x used as the outputs are."""
    fn, reference = getattr(tritonkit, kind), getattr(nm, f"{kind}_reference")
    x = random_tensor((5, 40), F32, device, generator=generator(11)).requires_grad_()
    w = random_tensor((40,), F32, device, generator=generator(12)).requires_grad_()
    g_y, g_h = (random_tensor((5, 40), F32, device, generator=generator(13 + i)) for i in range(2))
    y, h = fn(x, None, 40, w)
    assert h.grad_fn is y.grad_fn and h.data_ptr() == x.data_ptr() and h is not x
    weights = {"both": (1, 1), "sum only": (0, 1), "norm only": (1, 0)}[used]

    def loss(y, h):
        return sum(c * (out * g).sum() for c, out, g in zip(weights, (y, h), (g_y, g_h), strict=True) if c)

    grads = torch.autograd.grad(loss(y, h), (x, w), allow_unused=True)
    wide = [t.detach().double().requires_grad_() for t in (x, w)]
    exact = torch.autograd.grad(loss(*reference(wide[0], torch.zeros_like(wide[0]), (40,), wide[1])), wide,
                                allow_unused=True)  # fmt: skip
    same_dtype = [t.detach().clone().requires_grad_() for t in (x, w)]
    in_dtype = torch.autograd.grad(
        loss(*reference(same_dtype[0], torch.zeros_like(same_dtype[0]), (40,), same_dtype[1])), same_dtype,
        allow_unused=True,
    )  # fmt: skip
    for name, grad, torch_grad, exact_grad in zip(("dx", "dw"), grads, in_dtype, exact, strict=True):
        if exact_grad is None:  # the sum alone: the weight gets None, as in torch's composition
            assert grad is None, name
            continue
        result = compare(name, grad, torch_grad, exact_grad, F32)
        assert result.passed, str(result)


BAD_ARGUMENTS = [  # (call on a (4, 8) fp32 input, exception, pattern of its message)
    pytest.param(lambda x: tritonkit.layer_norm(x.tolist(), 8), TypeError, "^input ", id="list input"),
    pytest.param(lambda x: tritonkit.rms_norm(x.double(), 8), TypeError, "^input .*float64", id="float64"),
    pytest.param(
        lambda x: tritonkit.layer_norm(x, (4, 8)),
        NotImplementedError,
        "more than the last",
        id="two normalized dims",
    ),
    pytest.param(lambda x: tritonkit.layer_norm(x, 7), ValueError, "^normalized_shape", id="wrong length"),
    pytest.param(
        lambda x: tritonkit.add_rms_norm(x, None, x[0]),
        TypeError,
        "^normalized_shape must be an int",
        id="weight for shape",
    ),
    pytest.param(
        lambda x: tritonkit.layer_norm(x, 8, x[0, :4]),
        ValueError,
        "^weight must have shape",
        id="weight shape",
    ),
    pytest.param(
        lambda x: tritonkit.layer_norm(x.bfloat16(), 8, None, x[0, :8].half()),  # (fp32 x takes it)
        TypeError,
        "^bias must be",
        id="bias dtype",
    ),
    pytest.param(  # (an fp32 input takes 16-bit parameters, but no other dtype: was a KeyError)
        lambda x: tritonkit.layer_norm(x, 8, x[0].double()),
        TypeError,
        "^weight must be one of float16, bfloat16, float32 for input in torch.float32, got torch.float64",
        id="fp32 input, float64 weight",
    ),
    pytest.param(
        lambda x: tritonkit.add_rms_norm(x, x, 8, x[0].long()), TypeError, "^weight must be", id="int weight"
    ),
    pytest.param(
        lambda x: tritonkit.add_rms_norm(x, x[:2], 8), ValueError, "^residual must match", id="residual shape"
    ),
    pytest.param(
        lambda x: tritonkit.layer_norm(x, 8, eps=None), TypeError, "^layer_norm: eps ", id="eps None"
    ),
    pytest.param(lambda x: tritonkit.rms_norm(x, 8, eps=-1e-6), ValueError, "^rms_norm: eps ", id="eps < 0"),
]


@pytest.mark.parametrize("call, error, pattern", BAD_ARGUMENTS)
def test_bad_arguments(call, error, pattern, device):
    with pytest.raises(error, match=pattern):
        call(random_tensor((4, 8), F32, device, generator=generator(6)))


def test_a_call_signature_that_passed_the_checks_is_not_checked_again(monkeypatch, device):
    checked = []  # (a check of the input's tensor opens each _validate)
    check = nm.check_tensor
    monkeypatch.setattr(
        nm, "check_tensor", lambda name, *a, **k: checked.append(name) or check(name, *a, **k)
    )
    nm._validate_once.passed.clear()
    g = generator(8)
    x, w = (random_tensor(shape, F32, device, generator=g) for shape in ((4, 8), (8,)))
    for _ in range(3):
        tritonkit.rms_norm(x, 8, w)
    assert checked.count("input") == 1
    tritonkit.rms_norm(x[:2], 8, w)  # another shape: checked
    for _ in range(2):
        tritonkit.rms_norm(x, [8], w)  # normalized_shape as a list keys nothing: checked each time
    assert checked.count("input") == 4
    with pytest.raises(ValueError, match="^weight must have shape"):
        tritonkit.rms_norm(x, 8, w[:4])  # a bad call after good ones of its input still raises


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("residual", [False, True], ids=["", "residual"])
def test_opcheck(rms, residual, device):
    g = generator(7)
    x = random_tensor((5, 40), BF16, device, generator=g).requires_grad_()
    r = random_tensor((5, 40), BF16, device, generator=g).requires_grad_() if residual else None
    w = random_tensor((40,), F32, device, generator=g).requires_grad_()
    b = None if rms else random_tensor((40,), F32, device, generator=g).requires_grad_()
    y, h, mean, rstd = nm._forward_outputs(x, r, rms, stats=True)
    torch.library.opcheck(torch.ops.tritonkit.norm.default, (x, r, w, b, 1e-5, rms, y, h, mean, rstd))
    with torch.no_grad():  # the backward op's own inputs need no gradient
        torch.ops.tritonkit.norm(x, r, w, b, 1e-5, rms, y, h, mean, rstd)
    dy = random_tensor((5, 40), BF16, device, generator=g)
    saved = [t.detach() if t is not None else None for t in (h if residual else x, w, b)]
    grads = [torch.empty_like(t) if t is not None else None for t in saved]  # dx, dw, db
    torch.library.opcheck(
        torch.ops.tritonkit.norm_backward.default,
        (dy, dy if residual else None, *saved, mean, rstd, rms, *grads),
    )


def test_compile_fullgraph(device):
    torch._dynamo.reset()

    def fn(x, r, w, b):
        normed, h = tritonkit.add_layer_norm(x, r, 64, w, b)
        return tritonkit.rms_norm(normed, 64, w), h

    g = generator(8)
    args = [random_tensor(s, F32, device, generator=g) for s in ((6, 64), (6, 64), (64,), (64,))]
    compiled = torch.compile(fn, fullgraph=True)
    eager_args = [a.clone().requires_grad_() for a in args]
    args = [a.requires_grad_() for a in args]
    out, eager = compiled(*args), fn(*eager_args)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    upstream = [torch.ones_like(o) for o in out]
    torch.testing.assert_close(
        torch.autograd.grad(out, args, upstream),
        torch.autograd.grad(eager, eager_args, upstream),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize(
    "module, torch_module", [("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm)]
)
def test_modules_take_torch_state_dicts(module, torch_module, device):
    theirs = torch_module(96).to(device)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(random_tensor(p.shape, p.dtype, device, generator=generator(9)))
    ours = getattr(tritonkit.nn, module)(96).to(device)
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = random_tensor((7, 96), F32, device, generator=generator(10))
    torch.testing.assert_close(ours(x), theirs(x), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("name", KINDS)
def test_op_is_registered_and_its_shapes_pass(name, device):
    op = get_op(name)
    assert op is OPS[name] and op.family == "norm" and op.inspect is not None
    for shape, dtype in itertools.product(op.shapes, (F32,)):
        inputs = op.make_inputs(shape, dtype, device, generator(11))
        outputs = op.reference(*[t.double() if isinstance(t, torch.Tensor) else t for t in inputs])
        grads = [
            random_tensor(o.shape, dtype, device, generator=generator(12))
            for o in (outputs if isinstance(outputs, tuple) else (outputs,))
        ]
        check_against_reference(op.fn, op.reference, inputs, grad_inputs=op.grad_inputs, grad_outputs=grads)


def test_cost(device):
    cost = nm.norm_cost((1024, 4096), BF16, "fwd", residual=False, bias=True)
    assert cost.bytes == 2 * (2 * 1024 * 4096 + 2 * 4096)
    cost = nm.norm_cost((1024, 4096), BF16, "bwd", residual=True, bias=False)
    assert cost.bytes == 2 * (4 * 1024 * 4096 + 2 * 4096)


# ---------------------------------------------------------------- the H200


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(2, 1), (9, 1), (3, 3)], ids=str)
def test_gpu_rows_of_one_entry(kind, shape):
    """Rows of one entry in fp32 on the GPU: xhat is 0, so LayerNorm's dx is exactly 0 (it was 2.8e-6
    at eps 1e-5 on an H100 with a row block of one, where torch's error is 0)."""
    kernel, reference, inputs, grad_inputs, grads = _case(kind, shape, F32, "cuda", seed=sum(shape))
    check_against_reference(kernel, reference, inputs, grad_inputs=grad_inputs, grad_outputs=grads)


@pytest.mark.gpu
@pytest.mark.hbm
def test_past_2_31_elements():
    shape = (2**16 + 3, 2**15 + 1)
    assert math.prod(shape) > 2**31
    g = torch.Generator("cuda").manual_seed(13)
    x = torch.randn(shape, generator=g, device="cuda", dtype=BF16)
    w = torch.randn(shape[-1], generator=g, device="cuda", dtype=BF16)
    with poisoned_outputs():
        y = tritonkit.rms_norm(x, shape[-1], w)
    rows = torch.tensor([0, 2**31 // shape[-1], 2**31 // shape[-1] + 1, shape[0] - 1], device="cuda")
    expected = nm.rms_norm_reference(x[rows].double(), (shape[-1],), w.double(), torch.finfo(BF16).eps)
    torch.testing.assert_close(y[rows].double(), expected, rtol=2**-7, atol=2**-7)


def test_rows_of_any_length_move_as_wide_as_their_alignment_allows():
    """Compiled for sm_90: rows of 2900 bf16 entries (a multiple of 4, not of 16) load in 8-byte
    vectors, of 2904 (a multiple of 8) in 16-byte ones, forward and backward, and nothing moves an
    entry at a time, as it did where Triton alone, which specializes multiples of 16 only, saw
    these rows (``_launch.row_align``)."""
    import sm90

    shapes = [(4096, 2900), (4096, 2904)]
    rows = [row for name in ("rms_norm", "add_layer_norm") for row in sm90.access_widths(name, shapes)]
    rows = [row for row in rows if row["launch"] != "bwd partial sums"]
    assert len(rows) == 8, rows
    for row in rows:  # (32 bits: the fp32 statistics a row; 128 stored at 2900: the fp32 dw partials)
        assert max(row["loads"]) == (128 if row["shape"][1] == 2904 else 64), row
        assert min([*row["loads"], *row["stores"]]) >= 32, row  # no entry moved alone


_LONG_ROW_BACKWARDS = r"""
import json, torch
from tritonkit.asm import compile_launch
from tritonkit.ops import get_workload
for name in ("layer_norm", "rms_norm"):
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((8192, 8192), (8192, 12592), (14, 12592)):
            for launch in get_workload(name).launches(shape, dtype, None):
                if launch.name in ("bwd", "bwd split"):
                    spills = compile_launch(launch, "sm_90").spills
                    case = f"{name} {shape} {dtype}"
                    print(json.dumps({"case": case, "kernel": launch.kernel.__name__, "spills": spills}))
"""


@pytest.mark.slow
def test_backwards_of_long_rows_compile_for_hopper_without_spills():
    """The untuned backward at the last one-pass row block (8192) and past it (12592 entries: the
    looped kernel since 16384-entry rows spilled one-pass, or over 14 rows the split one), compiled
    for sm_90: no values spilled."""
    rows = [json.loads(line) for line in sm90.run(_LONG_ROW_BACKWARDS)]
    assert len(rows) == 12, rows
    expected = {"(8192, 8192)": "_norm_bwd_kernel", "(8192, 12592)": "looped", "(14, 12592)": "split"}
    for row in rows:
        assert not row["spills"], row
        shape = row["case"].split(" torch")[0].split(" ", 1)[1]
        assert expected[shape] in row["kernel"], row
