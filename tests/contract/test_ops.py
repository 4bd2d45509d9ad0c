"""The contract every registered op keeps, checked once for all of them (``tritonkit.ops.op_names()``):
its custom ops pass ``torch.library.opcheck`` on the arguments a real call passes, a second
derivative raises instead of reading as zero, it compiles
without a graph break and gives eager's bits, every output comes from a kernel launch (an op whose
launches write nothing is caught by poisoning), empty and no-grad calls behave, a bad first
argument is refused by name, and its cost model counts the bytes its launches touch.

What is specific to a family (shape grids, invariants, kernel variants) stays in that family's tests.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from tritonkit import opdef
from tritonkit._launch import Launch
from tritonkit.dtypes import DTYPE_OF
from tritonkit.ops import get_op, op_names
from tritonkit.testing import as_tuple, generator, poisoned_outputs

OPS = op_names()
# Slack on the backward's cost: its bytes are the least it must move; its launches also touch
# workspaces (the fp32 partial sums of a reduction over rows), a large share at test shapes.
WORKSPACE_SHARE = 0.35


# opcheck and compile check the custom ops' schemas, fake tensors, autograd registration and graph
# breaks, none of which depends on the size: there the matmuls take 40 out features (two of the
# interpreter's 32-wide column tiles, the second ragged) instead of their interpreter shape's 257
# (nine), which cost those two tests most of their time
NARROW_OUT_FEATURES = {"linear": 40, "linear_bare": 40, "gated_linear": 40}


def _problem(
    name: str,
    device,
    seed: int = 0,
    first_dim: int | None = None,
    shape_index: int = 0,
    last_dim: int | None = None,
):
    """(op, inputs, shape, dtype) at one of the op's interpreter shapes (the first by default)."""
    op = get_op(name)
    shape, dtype_name = op.shape_list()[shape_index]
    if first_dim is not None:
        shape = (first_dim, *shape[1:])
    if last_dim is not None:
        shape = (*shape[:-1], last_dim)
    dtype = DTYPE_OF[dtype_name] if dtype_name else op.dtypes[0]
    inputs = op.make_inputs(shape, dtype, device, generator(seed))
    return op, list(inputs), shape, dtype


def _call(op, inputs):
    return as_tuple(op.fn(*inputs, **op.kwargs))


def _with_grad(op, inputs):
    return [
        t.detach().clone().requires_grad_(i in op.grad_inputs) if isinstance(t, torch.Tensor) else t
        for i, t in enumerate(inputs)
    ]


def _forward_and_backward(op, inputs, seed: int = 1):
    """Outputs and the gradients of the differentiable inputs for random upstream gradients."""
    args = _with_grad(op, inputs)
    outputs = _call(op, args)
    g = generator(seed)
    upstream = [torch.randn(o.shape, generator=g).to(o) for o in outputs]
    grads = torch.autograd.grad(outputs, [args[i] for i in op.grad_inputs], upstream)
    return outputs, grads


@pytest.mark.parametrize("name", OPS)
def test_the_shapes_dimensions_are_named_once_each(name):
    """``Op.dims`` names every dimension of the op's shapes and of each of its workloads' (the
    commands' shape errors say them), one distinct name each."""
    from tritonkit.ops import get_workload, workload_names

    op = get_op(name)
    workloads = [get_workload(w) for w in workload_names() if get_workload(w).op is op]
    shapes = [shape for shape, _ in op.shape_list()]
    shapes += [shape for w in workloads for kind in w.shapes for shape, _ in w.shape_list(kind)]
    assert workloads and len(set(op.dims)) == len(op.dims) > 0, op.dims
    assert all(len(shape) == len(op.dims) for shape in shapes), (op.dims, shapes)


@pytest.mark.parametrize("name", OPS)
def test_custom_ops_pass_opcheck_on_real_arguments(name, device):
    op, inputs, _, _ = _problem(name, device, last_dim=NARROW_OUT_FEATURES.get(name))
    with opdef.recording_calls() as calls:
        _forward_and_backward(op, inputs)
    assert calls, f"{name} calls no tritonkit custom op: it is not written on opdef.op"
    checked = set()
    for custom, args in calls:
        if custom._name in checked:
            continue
        checked.add(custom._name)
        detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(custom, detached)


# ops whose outputs are linear in their differentiable inputs (a rotation): their gradients are the
# upstream gradient's image alone, so a second derivative with respect to the inputs is zero
LINEAR_IN_THEIR_INPUTS = {"rotary_pos_emb"}


@pytest.mark.parametrize("name", OPS)
def test_a_second_derivative_raises_naming_the_op(name, device):
    """Gradients taken with create_graph=True work, and differentiating them again raises a clear
    error, where a backward that records no graph would otherwise give a silent zero (a gradient
    penalty dropped)."""
    op, inputs, _, _ = _problem(name, device)
    args = _with_grad(op, inputs)
    outputs = _call(op, args)
    g = generator(1)
    upstream = [torch.randn(o.shape, generator=g).to(o) for o in outputs]  # constants: no grad
    grads = torch.autograd.grad(outputs, [args[i] for i in op.grad_inputs], upstream, create_graph=True)
    assert all(grad.requires_grad for grad in grads), name
    assert not any(u.requires_grad for u in upstream), name  # the caller's gradients are not marked
    penalty = sum(grad.float().square().sum() for grad in grads)
    with pytest.raises(RuntimeError, match="has no second derivative"):
        penalty.backward(retain_graph=True)
    if name in LINEAR_IN_THEIR_INPUTS:  # the gradients do not depend on the inputs: zero is exact
        return
    # asked for the inputs' gradients alone (autograd.grad, as jvp, hvp and gradient penalties
    # take them), the node that raises once sat off their paths and was pruned: a silent zero
    with pytest.raises(RuntimeError, match="has no second derivative"):
        torch.autograd.grad(penalty, [args[i] for i in op.grad_inputs], allow_unused=True)


@pytest.mark.parametrize("name", OPS)
def test_compiles_without_a_graph_break_and_matches_eager(name, device):
    op, inputs, _, _ = _problem(name, device, seed=2, last_dim=NARROW_OUT_FEATURES.get(name))
    torch._dynamo.reset()
    compiled = torch.compile(lambda *args: op.fn(*args, **op.kwargs), fullgraph=True)
    eager_out, eager_grads = _forward_and_backward(op, inputs)
    args = _with_grad(op, inputs)
    out = as_tuple(compiled(*args))
    g = generator(1)
    upstream = [torch.randn(o.shape, generator=g).to(o) for o in out]
    grads = torch.autograd.grad(out, [args[i] for i in op.grad_inputs], upstream)
    for got, want in zip((*out, *grads), (*eager_out, *eager_grads), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_float_options_compile_with_dynamic_shapes(device):
    """torch.compile(dynamic=True) makes float arguments symbolic, which math.isfinite in the ops'
    checks broke the graph on (a default eps, a z_loss, a scale and a soft cap): they compile now,
    and give eager's values."""
    import tritonkit

    g = generator(3)
    x = torch.randn(3, 16, generator=g).to(device)
    q = torch.randn(1, 1, 3, 16, generator=g).to(device, torch.bfloat16)
    target = torch.tensor([1, 2, 3], device=device)
    calls = [  # each float an argument of the compiled function (a constant in it is not symbolic)
        (tritonkit.nn.LayerNorm(16).to(device), (x,)),  # its eps, a module attribute
        (lambda eps: tritonkit.layer_norm(x, (16,), eps=eps), (1e-5,)),
        (lambda z: tritonkit.cross_entropy(x, target, z_loss=z), (1e-3,)),
        (lambda scale, cap: tritonkit.flash_attention(q, q, q, scale=scale, softcap=cap), (0.3, 5.0)),
    ]
    for call, args in calls:
        torch._dynamo.reset()
        compiled = torch.compile(call, fullgraph=True, dynamic=True)
        torch.testing.assert_close(compiled(*args), call(*args), rtol=0, atol=0)


@pytest.mark.parametrize("name", OPS)
def test_poisoning_catches_launches_that_write_nothing(name, device, monkeypatch):
    """With every launch skipped, each output and gradient of a poisoned call is NaN: outputs are
    allocated through tritonkit (so poisoning reaches them) and only kernels write them."""
    op, inputs, _, _ = _problem(name, device, seed=3)
    monkeypatch.setattr(Launch, "run", lambda self: None)
    with poisoned_outputs():
        outputs, grads = _forward_and_backward(op, inputs)
    for index, value in enumerate((*outputs, *grads)):
        if value.is_floating_point() and value.numel():
            assert torch.isnan(value).any(), f"{name}: value {index} was written without a launch"


@pytest.mark.parametrize("name", OPS)
def test_empty_input_gives_empty_outputs_and_gradients(name, device):
    op, inputs, _, _ = _problem(name, device, seed=4, first_dim=0)
    outputs, grads = _forward_and_backward(op, inputs)
    reference_out = as_tuple(op.reference(*_with_grad(op, inputs), **op.kwargs))
    assert [(o.shape, o.dtype) for o in outputs] == [(o.shape, o.dtype) for o in reference_out]
    for index, grad in zip(op.grad_inputs, grads, strict=True):
        assert grad.shape == inputs[index].shape and not torch.isnan(grad).any()


@pytest.mark.parametrize("name", OPS)
def test_no_grad_builds_no_graph_and_gives_the_same_values(name, device):
    op, inputs, _, _ = _problem(name, device, seed=5)
    args = _with_grad(op, inputs)
    with torch.no_grad():
        plain = _call(op, args)
    tracked = _call(op, args)
    assert all(o.grad_fn is None and not o.requires_grad for o in plain)
    assert any(o.grad_fn is not None for o in tracked)
    for got, want in zip(plain, tracked, strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("name", OPS)
def test_a_first_argument_that_is_not_a_tensor_is_refused_by_name(name, device):
    op, inputs, _, _ = _problem(name, device, seed=6)
    first = next(iter(inspect.signature(op.fn).parameters))
    with pytest.raises(TypeError, match=rf"^{first}\b"):
        op.fn(inputs[0].tolist(), *inputs[1:], **op.kwargs)


@pytest.mark.parametrize("name", OPS)
def test_inputs_on_the_meta_device_are_refused_by_name(name, device):
    """Meta tensors have shapes and no data: refused before any kernel would read them."""
    op, inputs, _, _ = _problem(name, device, seed=6)
    first = next(iter(inspect.signature(op.fn).parameters))
    meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs]
    with pytest.raises(ValueError, match=rf"^{first} is on the meta device"):
        op.fn(*meta, **op.kwargs)


def _bytes_touched(launches: list[Launch]) -> int:
    """Bytes of the distinct tensors the launches pass (each address once, at its largest view: the
    parts of one workspace at their own offsets count apart)."""
    sizes: dict[int, int] = {}
    for launch in launches:
        for arg in launch.args:
            if isinstance(arg, torch.Tensor):
                key = arg.data_ptr()
                sizes[key] = max(sizes.get(key, 0), arg.numel() * arg.element_size())
    return sum(sizes.values())


@pytest.mark.parametrize("mode", ["fwd", "bwd"])
@pytest.mark.parametrize("name", OPS)
def test_cost_counts_the_bytes_the_launches_touch(name, mode, device, monkeypatch):
    """The forward's cost is exactly the bytes of the tensors its launches read and write; the
    backward's is at most that and not far under it. A cost that forgot a tensor, or counted one the
    kernels never touch, fails."""
    op, inputs, shape, dtype = _problem(name, device, seed=7)
    args = _with_grad(op, inputs)
    outputs = _call(op, args) if mode == "bwd" else None
    run, launched = Launch.run, []
    monkeypatch.setattr(Launch, "run", lambda self: (launched.append(self), run(self))[1])
    if mode == "fwd":
        with torch.no_grad():
            _call(op, args)
    else:
        upstream = [torch.ones_like(o) for o in outputs]
        torch.autograd.grad(outputs, [args[i] for i in op.grad_inputs], upstream)
    touched, cost = _bytes_touched(launched), op.cost(shape, dtype, mode).bytes
    if mode == "fwd":
        assert touched == cost
    else:
        assert cost <= touched <= math.ceil(cost * (1 + WORKSPACE_SHARE)), (touched, cost)
