"""float8_linear and nn.Float8Linear: each recipe's output and gradients against the same recipe in
plain PyTorch (the quantizers' fp32 reference, whose fp8 values the kernels match bit for bit, and
float64 products), and against the high-precision linear (the recipes' scales oriented along each
product's K: a scale along the wrong axis is off by far more); fp32 master weights keep fp32
gradients; the module over a Linear's own parameters and state_dict, and the model swap."""

from __future__ import annotations

import pytest
import torch

import tritonkit
from fp8_peer import scaled_mm_peer
from tritonkit import nn
from tritonkit._runtime import interpret
from tritonkit.ops import float8_linear as fl
from tritonkit.oracle import compare


def _device() -> str:
    return "cpu" if interpret() else "cuda"


def _inputs(seed=0, x_dtype=torch.bfloat16):
    """x (2, 9, 160) with rows of different magnitudes, fp32 master weights (70, 160), an fp32 bias
    and an upstream gradient: K over two 128-blocks, N over one, ragged."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 9, 160, generator=g) * torch.exp2(torch.randint(-3, 4, (2, 9, 1), generator=g).float())
    w = torch.randn(70, 160, generator=g) / 160**0.5
    b = torch.randn(70, generator=g)
    dy = torch.randn(2, 9, 70, generator=g)
    device = _device()
    return x.to(x_dtype).to(device), w.to(device), b.to(device), dy.to(x_dtype).to(device)


def _run(x, w, b, dy, recipe):
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    y = tritonkit.float8_linear(*leaves, recipe=recipe)
    return (y, *torch.autograd.grad(y, leaves, dy))


def _torch_matmul(qa, qb, sa, sb, out_dtype, bias, fast):
    return scaled_mm_peer(qa, qb, sa, sb, bias, out_dtype, fast)


@pytest.mark.parametrize("recipe", fl.RECIPES)
def test_matches_the_recipe_in_plain_pytorch(recipe):
    """The oracle, torch's error the recipe's products by torch (``fp8_peer``: torch._scaled_mm on
    the GPU, with the same fast accumulation in the forward; the maths in fp32 under the
    interpreter), rounded to each output's dtype (the fp8 operands are the same bits: only the sums
    and the roundings may differ)."""
    x, w, b, dy = _inputs()
    ours = _run(x, w, b, dy, recipe)
    exact = fl.float8_linear_reference(x, w, b, recipe, dy)
    in_fp32 = fl.float8_linear_reference(x, w, b, recipe, dy, torch.float32, matmul=_torch_matmul)
    for name, got, want, theirs in zip(("y", "dx", "dw", "db"), ours, exact, in_fp32, strict=True):
        assert got.shape == want.shape, name
        comparison = compare(name, got, theirs.to(got.dtype), want, got.dtype)
        assert comparison.passed, str(comparison)


@pytest.mark.parametrize("recipe", fl.RECIPES)
def test_close_to_the_linear_in_high_precision(recipe):
    """Within e4m3's few bits of F.linear's float64 output and gradients (relative norm under 8%;
    a scale taken along the wrong axis misses by over 30% on these rows of unequal size: the next
    test)."""
    x, w, b, dy = _inputs(seed=1)
    ours = _run(x, w, b, dy, recipe)
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    y = torch.nn.functional.linear(*leaves)
    exact = (y, *torch.autograd.grad(y, leaves, dy.double()))
    for name, got, want in zip(("y", "dx", "dw", "db"), ours, exact, strict=True):
        error = ((got.double() - want).norm() / want.norm()).item()
        assert error < 0.08, (name, error)


def test_a_scale_along_the_wrong_axis_misses_the_bound_by_far():
    """What the 8% bound above tells apart: x's rows quantized with per-column scales, used as if
    they were its rows' (the recipe's orientation swapped), miss F.linear by over 30% on these
    inputs, where the right orientation stays under 8%."""
    from tritonkit.ops.quantize import quantize_fp8_reference
    from tritonkit.ops.scaled_mm import scaled_mm_reference

    x, w, _, _ = _inputs(seed=1)
    x2 = x.reshape(-1, 160)
    exact = torch.nn.functional.linear(x2.double(), w.double())
    qw, sw = quantize_fp8_reference(w, "row")
    errors = {}
    for axis in ("row", "column"):
        qx, sx = quantize_fp8_reference(x2, axis)
        scale = sx if axis == "row" else sx.t()[: x2.shape[0]].contiguous()
        y = scaled_mm_reference(qx, qw.t(), scale, sw.t(), None, torch.float64)
        errors[axis] = ((y - exact).norm() / exact.norm()).item()
    assert errors["row"] < 0.08 < 0.3 < errors["column"], errors


def test_gradients_keep_their_tensors_dtypes():
    """fp32 master weights and bias get fp32 gradients, bf16 activations bf16 ones."""
    x, w, b, dy = _inputs(seed=2)
    y, dx, dw, db = _run(x, w, b, dy, "rowwise")
    assert (y.dtype, dx.dtype, dw.dtype, db.dtype) == (
        torch.bfloat16,
        torch.bfloat16,
        torch.float32,
        torch.float32,
    )


def test_a_second_derivative_raises_naming_the_op():
    """Its backward quantizes detached operands, so its gradients carry no graph of their own: under
    create_graph=True a gradient penalty through them once read as zero; now it raises."""
    x, w, b, dy = _inputs(seed=3)
    leaves = [t.detach().requires_grad_() for t in (x, w)]
    y = tritonkit.float8_linear(*leaves, b)
    (gx,) = torch.autograd.grad((y * dy).sum(), leaves[0], create_graph=True)
    with pytest.raises(RuntimeError, match="float8_linear has no second derivative"):
        torch.autograd.grad(gx.float().square().sum(), leaves[1])


def test_a_converted_model_with_an_in_place_activation_trains():
    """ReLU(inplace=True) after a swapped layer, 2-D and 3-D rows: its output was a view made inside
    the autograd function, which autograd refuses to let anything write."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(inplace=True), torch.nn.Linear(16, 8))
    nn.convert_to_float8(model.to(_device()))
    for shape in ((4, 32), (2, 3, 32)):
        model(torch.randn(shape, device=_device())).sum().backward()
    assert model[0].weight.grad is not None


def test_the_module_over_a_linear_and_the_model_swap():
    linear = torch.nn.Linear(160, 70, device=_device())
    layer = nn.Float8Linear.from_linear(linear, recipe="tensorwise")
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert not nn.Float8Linear.from_linear(linear.eval()).training and layer.training
    assert layer.state_dict().keys() == linear.state_dict().keys()
    assert "recipe='tensorwise'" in repr(layer)
    x = torch.randn(4, 160, device=_device())
    assert torch.equal(layer(x), tritonkit.float8_linear(x, linear.weight, linear.bias, "tensorwise"))

    model = torch.nn.Sequential(torch.nn.Linear(160, 70), torch.nn.ReLU(), torch.nn.Linear(70, 10))
    nn.convert_to_float8(model, filter=lambda name, module: module.out_features > 10)
    assert [type(m).__name__ for m in model] == ["Float8Linear", "ReLU", "Linear"]
    shared = torch.nn.Linear(8, 8)  # one module in two places: both swapped, still one module
    model = nn.convert_to_float8(torch.nn.Sequential(shared, torch.nn.ReLU(), shared))
    assert type(model[0]) is nn.Float8Linear and model[2] is model[0]
    with pytest.raises(ValueError, match="is itself a torch.nn.Linear"):
        nn.convert_to_float8(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="recipe must be one of"):
        nn.Float8Linear.from_linear(linear, recipe="columnwise")
    with pytest.raises(ValueError, match="recipe must be one of"):
        tritonkit.float8_linear(x, linear.weight, recipe="columnwise")
    with pytest.raises(ValueError, match=r"weight must be \(N, 160\)"):
        tritonkit.float8_linear(x, linear.weight.t())
    with pytest.raises(ValueError, match="weight must have 2 dimensions"):
        tritonkit.float8_linear(x, linear.weight[0])
    with pytest.raises(TypeError, match="input must be one of"):
        tritonkit.float8_linear(x.double(), linear.weight)


def test_compiles_whole_with_the_same_bits():
    """torch.compile(fullgraph=True) of the function, forward and backward: eager's bits (its
    quantizers and matmuls are custom ops, so the graph does not break at them)."""
    x, w, b, dy = _inputs(seed=3)
    eager = _run(x, w, b, dy, "blockwise")
    torch._dynamo.reset()
    compiled = torch.compile(lambda *t: tritonkit.float8_linear(*t, recipe="blockwise"), fullgraph=True)
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    y = compiled(*leaves)
    for got, want in zip((y, *torch.autograd.grad(y, leaves, dy)), eager, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen-weight"])
def test_a_step_runs_one_matmul_a_product_it_needs(frozen):
    """The forward's matmul once, then dX's, and dW's only where the weight takes a gradient: three
    scaled_mm calls a training step, two with the weight frozen (the backward recomputes nothing)."""
    from tritonkit import opdef

    x, w, b, dy = _inputs(seed=4)
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_(not frozen)
    with opdef.recording_calls() as calls:
        tritonkit.float8_linear(x, w, b).backward(dy)
    matmuls = [c for c, _ in calls if c._name.endswith("scaled_mm")]
    assert len(matmuls) == (2 if frozen else 3)
    assert x.grad is not None and (w.grad is None) == frozen


@pytest.mark.parametrize("recipe", fl.RECIPES)
def test_every_transposed_operand_is_quantized_from_its_storage(recipe, monkeypatch):
    """A backward's transposed operands (dX's W^T, dW's dY^T and x^T) go through the pass that reads
    their storage in its own order and stores q^T (``quantize_fp8_transposed``), in every recipe:
    blockwise's x^T runs are x's runs down its columns ("column_block"), its blocks x's blocks.
    Quantizing the strided view instead is no quantize_fp8 call on a non-contiguous tensor."""
    transposed, strided = [], []
    pass_t, plain = fl.quantize_fp8_transposed, fl.quantize_fp8

    def through_storage(x, granularity, **kwargs):
        transposed.append(granularity)
        return pass_t(x, granularity, **kwargs)

    def direct(x, granularity, **kwargs):
        if not x.is_contiguous():
            strided.append(granularity)
        return plain(x, granularity, **kwargs)

    monkeypatch.setattr(fl, "quantize_fp8_transposed", through_storage)
    monkeypatch.setattr(fl, "quantize_fp8", direct)
    x, w, b, dy = _inputs(seed=5)
    _run(x, w.to(x.dtype), b, dy, recipe)
    expected = {
        "rowwise": ["column"] * 3,
        "tensorwise": ["tensor"] * 3,
        "blockwise": ["block2d", "column_block", "block2d"],
    }[recipe]
    assert sorted(transposed) == sorted(expected) and not strided


@pytest.mark.parametrize("recipe", fl.RECIPES)
def test_no_input_features_give_the_bias(recipe, device):
    """in_features 0: F.linear gives the bias broadcast over the rows (the product of nothing is 0);
    the rows' reshape(-1, 0) raised (its -1 ambiguous)."""
    x = torch.randn(2, 3, 0, device=device, requires_grad=True)
    weight = torch.randn(12, 0, device=device, requires_grad=True)
    bias = torch.randn(12, device=device, requires_grad=True)
    y = tritonkit.float8_linear(x, weight, bias, recipe)
    assert y.shape == (2, 3, 12) and torch.equal(y, bias.detach().expand(2, 3, 12))
    y.sum().backward()
    assert x.grad.shape == x.shape and weight.grad.shape == weight.shape
    assert torch.equal(bias.grad, torch.full_like(bias, 6.0))
