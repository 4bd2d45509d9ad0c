"""Replayed launches (``_launch.Plan`` and the ops that declare ``replay``): what a plan records of a
call, what it puts where on a later call, when it declines, and (on the GPU) that every replaying op
gives the bits its full path gives."""

from __future__ import annotations

import importlib
import types

import pytest
import torch

from tritonkit import _launch, opdef, tuning
from tritonkit.testing import generator, random_tensor

pytestmark = pytest.mark.infra

F32, BF16 = torch.float32, torch.bfloat16

# ---------------------------------------------------------------- the op's door: record once, then replay


class _FakePlan:
    def __init__(self, runs: bool = True):
        self.runs, self.replays = runs, []

    def run(self, args):
        self.replays.append(args)
        return self.runs


def _door(monkeypatch, plan: _FakePlan | None = None):
    """opdef's replay door on a counting function, with tuning possible and a recorder that keeps
    what it was given and answers ``plan``."""
    monkeypatch.setattr(tuning, "tuning_possible", lambda: True)
    recorded, ran = [], []

    def record(launches, args, scratch):
        recorded.append((launches, args, scratch))
        return plan

    monkeypatch.setattr(_launch.Plan, "record", staticmethod(record))
    plans: dict = {}

    def call(fn, *args, switches=()):
        ran.append(args)
        return opdef._replayed_or_run(fn, plans, (*args, *switches), args)

    return call, plans, recorded, ran


def test_an_op_replays_the_plan_its_first_call_of_a_signature_recorded(monkeypatch):
    plan = _FakePlan()
    call, plans, recorded, _ = _door(monkeypatch, plan)
    bodies = []
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    call(lambda *a: bodies.append(a), x, 2.0)
    assert len(bodies) == 1 and len(recorded) == 1 and recorded[0][1] == (x, 2.0)
    call(lambda *a: bodies.append(a), y, 2.0)  # the same signature: replayed over y
    assert len(bodies) == 1 and plan.replays == [(y, 2.0)]
    call(lambda *a: bodies.append(a), y, 3.0)  # another scalar: another signature
    call(lambda *a: bodies.append(a), y.t(), 2.0)  # other strides
    call(lambda *a: bodies.append(a), y, 2.0, switches=(False,))  # a module switch flipped
    assert len(bodies) == 4 and len(plans) == 4
    switches = (True, (128,), (64, 128))  # as the attention backward's: tuples of head dims
    call(lambda *a: bodies.append(a), y, 2.0, switches=switches)
    call(lambda *a: bodies.append(a), x, 2.0, switches=switches)
    assert len(bodies) == 5 and len(plans) == 5 and plan.replays[-1] == (x, 2.0)


def test_a_plan_that_declines_falls_back_to_the_op_and_records_nothing_more(monkeypatch):
    plan = _FakePlan(runs=False)  # (an alignment the recorded call did not have, a profiler...)
    call, _, recorded, _ = _door(monkeypatch, plan)
    bodies = []
    x = torch.randn(8)
    for _ in range(3):
        call(lambda *a: bodies.append(a), x)
    assert len(bodies) == 3 and len(recorded) == 1 and len(plan.replays) == 2


def test_a_torch_write_during_the_recorded_call_leaves_no_plan(monkeypatch):
    """A call that writes a tensor through torch as well as through kernels (an accumulator zeroed, a
    sum copied out) would lose those writes in a replay: it gets no plan, and runs in full each time."""
    call, plans, recorded, _ = _door(monkeypatch, _FakePlan())
    x = torch.randn(8)
    for _ in range(2):
        call(lambda t: t.zero_(), x)
    assert recorded == [] and list(plans.values()) == [None]


def test_no_plan_is_recorded_where_tuning_cannot_run_or_an_argument_cannot_key(monkeypatch):
    """Where tuning cannot run (a capture, tuning.disabled()), a config chosen now may be a stand-in:
    nothing is recorded, and a later call records. An unhashable argument just runs the op."""
    call, plans, recorded, _ = _door(monkeypatch, _FakePlan())
    monkeypatch.setattr(tuning, "tuning_possible", lambda: False)
    bodies = []
    call(lambda *a: bodies.append(a), torch.randn(2))
    call(lambda *a: bodies.append(a), torch.randn(2), [1, 2])
    assert len(bodies) == 2 and recorded == [] and plans == {}


def test_a_recording_keeps_the_calls_launches_and_scratch_and_not_a_tuners(monkeypatch):
    monkeypatch.setattr(_launch, "launcher_of", lambda kernel: lambda grid, *args, **meta: None)
    launch = _launch.Launch("fwd", "kernel", (1,), {}, grid=(1,))
    with _launch.recording_launches() as recording:
        launch.run()
        work = _launch.scratch((3,), F32, "cpu")
        zeroed = _launch.scratch((2,), torch.int32, "cpu", zeroed=True)
        with _launch.unrecorded():  # a tuner's trials
            launch.run()
            _launch.scratch((5,), F32, "cpu")
            torch.zeros(2).fill_(1.0)
        launch.run()
    assert recording.launches == [launch, launch] and recording.writes == []
    assert recording.scratch == {id(work): False, id(zeroed): True} and torch.equal(zeroed, torch.zeros(2))


# ---------------------------------------------------------------- what a plan puts where


@pytest.fixture
def fake_gpu(monkeypatch):
    """Plan.record and Plan.run on CPU tensors: natively compiled, each launch's entry its kernel's
    name, device -1 current, and _run_entry keeping what it would pass to the C launcher."""
    calls = []
    monkeypatch.setattr(_launch, "interpret", lambda: False)
    monkeypatch.setattr(
        _launch,
        "launcher_of",
        lambda kernel: types.SimpleNamespace(entry=lambda args, meta: f"entry {kernel}"),
    )
    monkeypatch.setattr(
        _launch, "_run_entry", lambda entry, grid, stream, args: calls.append((entry, grid, args))
    )
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)  # (CPU builds lack them)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    return calls


def _calls_tensors(seed: int):
    g = generator(seed)
    return random_tensor((4, 2, 16, 64), BF16, "cpu", generator=g), random_tensor(
        (8, 16), F32, "cpu", generator=g
    )


def test_a_plan_passes_the_later_calls_addresses_views_descriptors_and_fresh_scratch(fake_gpu):
    from tritonkit.ops.attention.fwd_sm90 import descriptor

    x, y = _calls_tensors(1)
    work = torch.empty(5)
    launches = [
        _launch.Launch("a", "k1", (x, y[2:], 3, None, work), {}, grid=(2,)),
        _launch.Launch("b", "k2", (descriptor(x, 16), y.t(), 1.5), {}, grid=(1, 3)),
    ]
    plan = _launch.Plan.record(launches, (x, "option", y), {id(work): False})
    assert plan is not None
    x2, y2 = _calls_tensors(2)
    assert plan.run((x2, "option", y2)) and len(fake_gpu) == 2
    (entry_a, grid_a, args_a), (entry_b, grid_b, args_b) = fake_gpu
    assert (entry_a, grid_a, entry_b, grid_b) == ("entry k1", (2, 1, 1), "entry k2", (1, 3, 1))
    assert args_a[:4] == [x2.data_ptr(), y2.data_ptr() + 2 * 16 * 4, 3, None]
    assert isinstance(args_a[4], int) and args_a[4] not in (work.data_ptr(), x2.data_ptr())
    desc = args_b[0]
    assert (
        desc.base is x2 and desc.shape == x2.shape and desc.strides == x2.stride() and desc.padding == "zero"
    )
    assert args_b[1:] == [y2.data_ptr(), 1.5]


def test_a_plan_declines_a_call_whose_tensors_align_otherwise(fake_gpu):
    x, y = _calls_tensors(3)
    plan = _launch.Plan.record([_launch.Launch("a", "k", (x, y), {}, grid=(1,))], (x, y))
    storage = torch.empty(y.numel() + 1, dtype=F32)
    shifted = storage[1:].view(y.shape)  # 4 bytes past a 16-byte boundary
    assert not plan.run((x, shifted)) and fake_gpu == []
    with _launch.recording_launches():  # an op recording its call needs inner launches run as launches
        assert not plan.run((x, y))
    assert plan.run((x, y)) and len(fake_gpu) == 1


@pytest.mark.parametrize("case", ["copy", "twice", "shared-view", "partial-descriptor", "none"])
def test_a_plan_is_not_recorded_where_a_replay_could_not_reproduce_the_call(fake_gpu, case):
    from tritonkit.ops.attention.fwd_sm90 import descriptor

    x, y = _calls_tensors(4)
    tensors, args = (x, y), (x, y)
    if case == "copy":  # a tensor the launch builder made: a later call's would differ
        args = (x, y.clone())
    elif case == "twice":  # one tensor in two places: a later call's two may differ
        tensors = (x, x)
    elif case == "shared-view":  # a view of memory two of the call's tensors share: whose?
        tensors, args = (y[:4], y[4:]), (y[1:3],)
    elif case == "partial-descriptor":
        args = (descriptor(x[:, :, :8], 8), y)
    launches = [] if case == "none" else [_launch.Launch("a", "k", args, {}, grid=(1,))]
    assert _launch.Plan.record(launches, tensors) is None


def _bias_gelu_call(seed: int, shape: tuple) -> None:
    import tritonkit

    g = generator(seed)
    x, b, dy = (random_tensor(s, BF16, "cpu", generator=g) for s in (shape, shape[-1:], shape))
    tritonkit.bias_gelu(x.requires_grad_(), b.requires_grad_()).backward(dy)


def _cross_entropy_call(seed: int, reduction: str) -> None:
    import tritonkit

    g = generator(seed)
    x = random_tensor((37, 300), BF16, "cpu", generator=g).requires_grad_()
    target = torch.randint(0, 300, (37,), generator=g)
    loss = tritonkit.cross_entropy(x, target, reduction=reduction)
    loss.backward(torch.ones_like(loss))


def _linear_call(seed: int, activation: str | None) -> None:
    import tritonkit

    g = generator(seed)
    x, w, b = (
        random_tensor(s, BF16, "cpu", generator=g).requires_grad_() for s in ((96, 64), (80, 64), (80,))
    )
    tritonkit.linear(x, w, b, activation).backward(random_tensor((96, 80), BF16, "cpu", generator=g))


def _quantize_call(seed: int, granularity: str) -> None:
    import tritonkit

    x = random_tensor((96, 256), BF16, "cpu", generator=generator(seed))
    tritonkit.quantize_fp8(x, granularity, transpose=granularity != "row")


@pytest.mark.tuning_default  # (the default, tuning off: the configs chosen are final, so plans record)
@pytest.mark.parametrize(
    "case",
    [
        "bias_gelu 96x500",
        "bias_gelu 8x256",
        "linear, bias",
        "linear, bias, gelu",
        "quantize tensor",
        "quantize row",
        "cross_entropy mean",
        "cross_entropy none",
    ],
)
def test_ops_made_of_launches_alone_record_and_replay_their_calls(case, launches_faked):
    """With launches faked as a GPU's (nothing runs), a second call of a signature replays the
    first's plan. bias_gelu's and linear's db is the norms' second stage (a launch), where a torch
    sum and copy after the kernel kept each backward from having a plan (bias_gelu at 96 x 500 the
    kernel then the sum, at 8 x 256 one program writing db itself); quantize_fp8's amax buffer is
    zeroed scratch, where a torch allocation the launches read kept it from one; cross_entropy's
    kernels read views of one workspace, the op's one argument (a mean's forward: the rows, then
    their sum)."""
    bias_gelu = importlib.import_module("tritonkit.ops.bias_gelu")
    linear = importlib.import_module("tritonkit.ops.linear.linear")
    quantize = importlib.import_module("tritonkit.ops.quantize")
    cross_entropy = importlib.import_module("tritonkit.ops.cross_entropy")
    for seed in (1, 2):
        if case.startswith("bias_gelu"):
            _bias_gelu_call(seed, tuple(int(n) for n in case.split()[1].split("x")))
        elif case.startswith("quantize"):
            _quantize_call(seed, case.split()[1])
        elif case.startswith("cross_entropy"):
            _cross_entropy_call(seed, case.split()[1])
        else:
            _linear_call(seed, "gelu" if case.endswith("gelu") else None)
    if case.startswith("bias_gelu"):
        ops, steps = (bias_gelu._forward, bias_gelu._backward), (2 if "96x500" in case else 1)
    elif case.startswith("quantize"):  # tensorwise: the amax pass, then q's and q^T's
        ops, steps = (quantize._quantize,), (3 if case.endswith("tensor") else 1)
    elif case.startswith("cross_entropy"):  # the forward's plan (the backward's is one launch)
        ops, steps = (cross_entropy._backward, cross_entropy._forward), (2 if case.endswith("mean") else 1)
    else:
        backward = linear._linear_backward_spending_pre if case.endswith("gelu") else linear._linear_backward
        ops, steps = (linear._linear_forward, backward), None
    for op in ops:
        (plan,) = op.plans.values()
        assert plan is not None, op.__name__
    assert steps is None or len(plan._steps) == steps


# ---------------------------------------------------------------- on the GPU: the full path's bits


def _twice(call, make_inputs):
    """The outputs (and gradients) of ``call``: recorded on one set of inputs, then replayed on
    another of the same signature, then through the full path (the lean path off: no plan runs) on
    a copy of that set."""
    results = []
    for lean, seed in ((True, 100), (True, 200), (False, 200)):
        _launch.LEAN = lean
        try:
            results.append(call(*make_inputs(seed)))
        finally:
            _launch.LEAN = True
    torch.cuda.synchronize()
    return results


def _attention(q, k, v, do):
    import tritonkit

    out = tritonkit.flash_attention(q, k, v, causal=True)
    out.backward(do)
    return [out, q.grad, k.grad, v.grad]


def _norm_mlp_rope(x, w, wg, wu, wd, bd, cos, sin, dy):
    import tritonkit

    h = tritonkit.rms_norm(x, (x.shape[-1],), w, eps=1e-6)
    q, k = tritonkit.apply_rotary_pos_emb(h[:, None], h[:, None], cos, sin)
    y = tritonkit.gated_linear(q[:, 0] + k[:, 0], wg, wu)
    out = tritonkit.linear(y, wd, bd, "gelu")
    out.backward(dy)
    return [h, q, y, out, x.grad, w.grad, wg.grad, wu.grad, wd.grad, bd.grad]


def _layer_norm_gelu_softmax_loss(x, w, b, dy):
    import tritonkit

    h = tritonkit.layer_norm(x, x.shape[-1], w, b)
    p = tritonkit.softmax(tritonkit.bias_gelu(h, b), -1)
    target = torch.arange(x.shape[0], device=x.device) % x.shape[-1]
    loss = tritonkit.cross_entropy(h, target)
    (loss + (p * dy).sum()).backward()
    return [h, p, loss, x.grad, w.grad, b.grad]


def _scaled_mm(*operands):
    import tritonkit

    outs = []
    for a, b, scale_a, scale_b in zip(*[iter(operands)] * 4, strict=True):
        outs.append(tritonkit.scaled_mm(a, b, scale_a, scale_b))  # promoted, bf16
        outs.append(tritonkit.scaled_mm(a, b, scale_a, scale_b, None, torch.float32, use_fast_accum=True))
    return outs


def _quantized(x):
    import tritonkit

    outs = []
    for granularity in ("tensor", "row", "column", "block2d"):
        for t in tritonkit.quantize_fp8(x, granularity, transpose=granularity != "row"):
            outs.append(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)
    return outs


def _fp8_operands(seed: int) -> list:
    """Row-scaled e4m3 operands of a product the sm_90 Gluon kernel takes (many tiles) and of one the
    Triton kernel's small tile takes."""
    g, operands = generator(seed), []
    for m, k, n in ((1536, 512, 2304), (96, 384, 200)):
        a = random_tensor((m, k), BF16, "cuda", generator=g).to(torch.float8_e4m3fn)
        b = random_tensor((n, k), BF16, "cuda", generator=g).to(torch.float8_e4m3fn).t()
        scales = [
            random_tensor(shape, torch.float32, "cuda", generator=g).abs() + 0.1 for shape in ((m, 1), (1, n))
        ]
        operands += [a, b, *scales]
    return operands


@pytest.mark.gpu
@pytest.mark.parametrize(
    "family",
    [
        "attention",
        "norm, rope, mlp, linear",
        "layer_norm, bias_gelu, softmax, cross_entropy",
        "scaled_mm",
        "quantize_fp8",
    ],
)
def test_replayed_ops_give_the_bits_of_their_full_path(family):
    from tritonkit.ops import cross_entropy, rotary
    from tritonkit.ops.attention import attention

    linear = importlib.import_module("tritonkit.ops.linear.linear")  # (the package's `linear`: the function)
    from tritonkit.ops.norm import norm

    def leaves(seed: int, shapes: list, grads: int):
        g = generator(seed)
        tensors = [random_tensor(shape, BF16, "cuda", generator=g) for shape in shapes]
        return [t.requires_grad_() if i < grads else t for i, t in enumerate(tensors)]

    if family == "scaled_mm":
        from tritonkit.ops import scaled_mm

        call, ops, make = _scaled_mm, (scaled_mm._scaled_mm,), _fp8_operands
    elif family == "quantize_fp8":
        quantize = importlib.import_module("tritonkit.ops.quantize")
        call, ops = _quantized, (quantize._quantize,)
        make = lambda seed: [random_tensor((384, 512), BF16, "cuda", generator=generator(seed))]  # noqa: E731
    elif family == "attention":
        call, ops = _attention, (attention._forward, attention._backward)
        shapes = [(2, 4, 300, 128), (2, 2, 300, 128), (2, 2, 300, 128), (2, 4, 300, 128)]
        make = lambda seed: leaves(seed, shapes, 3)  # noqa: E731
    elif family == "layer_norm, bias_gelu, softmax, cross_entropy":
        softmax = importlib.import_module("tritonkit.ops.softmax.softmax")
        call = _layer_norm_gelu_softmax_loss
        bias_gelu = importlib.import_module("tritonkit.ops.bias_gelu")
        ops = (norm._forward, norm._backward, softmax._forward, softmax._backward,
               cross_entropy._forward, cross_entropy._backward, bias_gelu._forward,
               bias_gelu._backward)  # fmt: skip
        make = lambda seed: leaves(seed, [(96, 500), (500,), (500,), (96, 500)], 3)  # noqa: E731
    else:
        call = _norm_mlp_rope
        ops = (norm._forward, norm._backward, rotary._rotary, linear._gated_forward,
               linear._gated_backward_spending_products, linear._linear_forward,
               linear._linear_backward_spending_pre)  # fmt: skip
        shapes = [(2, 96, 512), (512,), (384, 512), (384, 512), (512, 384), (512,), (96, 512), (96, 512)]
        make = lambda seed: leaves(seed, [*shapes, (2, 96, 512)], 6)  # noqa: E731
    recorded, replayed, full = _twice(call, make)
    for op in ops:
        assert any(plan is not None for plan in op.plans.values()), op.__name__
    for a, b in zip(replayed, full, strict=True):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(recorded, replayed, strict=True))  # other inputs


@pytest.mark.gpu
def test_an_op_that_writes_through_torch_too_is_never_replayed():
    """The free-mode Triton backward (a window keeps it off the sm_90 kernel) zeroes its dq
    accumulator and copies dq out through torch: its calls get no plan."""
    import tritonkit
    from tritonkit.ops.attention import attention

    g = generator(7)
    q, k, v = (random_tensor((1, 2, 128, 64), BF16, "cuda", generator=g).requires_grad_() for _ in range(3))
    for _ in range(2):
        tritonkit.flash_attention(q, k, v, window=(16, 0), deterministic=False).sum().backward()
    assert list(attention._backward.plans.values()) == [None]
