"""linear_cross_entropy against the float64 reference (F.linear, then cross_entropy's reference)
with the oracle's rule, the loss and the gradients of x, W and b: every reduction, class weights,
label smoothing with ignored rows, the z-loss, the soft cap, no bias, leading dims and int32
targets, logits over several forward chunks and backward vocabulary blocks (the class and target
of a row in another block than the first), every row ignored, and bad input refused by name. The
contract tests (tests/contract) add opcheck, compile, poisoning, empty input and the cost model."""

from __future__ import annotations

import pytest
import torch

import tritonkit
from grids import in_turn, pairs_not_met
from tritonkit import testing
from tritonkit.ops import linear_cross_entropy as lce
from tritonkit.oracle import compare

pytestmark = pytest.mark.cross_entropy

BF16, F16 = torch.bfloat16, torch.float16
# (tokens, hidden, vocabulary), whether the logits go in chunks of ROW_ALIGN = 16 tokens and blocks
# of 16 classes (three each here, the last ragged) instead of at once, and the order of the gradients
# (lce.ORDER: in the forward by chunks of tokens, or in the backward by blocks of the vocabulary;
# reduction "none" takes the blocks either way). Chunked, the forward's order sums dW over chunks
# only where the tokens' logits pass dW's fp32 size (tokens > 2 x hidden in 16 bits), as at 40 x 16.
LAYOUTS = [
    ((7, 16, 3), False, "tokens"),
    ((7, 16, 3), False, "vocab"),
    ((33, 32, 70), False, "tokens"),
    ((40, 16, 38), True, "tokens"),
    ((33, 32, 38), True, "vocab"),
]
# keyword arguments beyond the defaults; "class_weight" stands for random class weights
FEATURES = [
    {},
    {"reduction": "sum", "label_smoothing": 0.1},
    {"reduction": "none", "bias": False},
    {"class_weight": True, "label_smoothing": 0.2, "ignore_index": 2},
    {"z_loss": 1e-3, "softcap": 5.0, "reduction": "none"},
]
# each feature meets each layout, and each of them each dtype
GRID = in_turn(FEATURES, LAYOUTS, last=[BF16, F16])


def _inputs(size, dtype, device, seed: int = 0, ignore_index: int = -100, leading=None):
    tokens, hidden, vocab = size
    g = testing.generator(seed)
    x = testing.random_tensor((tokens, hidden), dtype, device, generator=g)
    w = testing.random_tensor((vocab, hidden), dtype, device, generator=g) * hidden**-0.5
    b = testing.random_tensor((vocab,), dtype, device, generator=g)
    target = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(seed)).to(device)
    target[::4] = ignore_index  # every fourth row ignored
    if leading is not None:
        x, target = x.view(*leading, hidden), target.view(leading)
    class_weight = torch.rand(vocab, generator=torch.Generator().manual_seed(seed + 1)).to(device) + 0.5
    return x, w, target, b, class_weight


def _check(x, w, target, b, **kwargs):
    reduction = kwargs.get("reduction", "mean")
    shape = target.shape if reduction == "none" else ()
    upstream = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(x)
    inputs, grad_inputs = (x, w, target) + ((b,) if b is not None else ()), (0, 1, 3)[: 2 + (b is not None)]
    testing.check_against_reference(
        lambda x, w, t, *b: tritonkit.linear_cross_entropy(x, w, t, *b, **kwargs),
        lambda x, w, t, *b: lce.linear_cross_entropy_reference(x, w, t, *b, **kwargs),
        inputs,
        grad_inputs=grad_inputs,
        grad_outputs=[upstream],
        dtype=x.dtype,
    )


def test_the_grid_meets_every_pair():
    assert not pairs_not_met(GRID)


def _case_id(i: int, case: tuple) -> str:
    _, (size, chunked, order), dtype = case
    chunks = "-chunked" if chunked else ""
    return f"{i}-{'x'.join(map(str, size))}{chunks}-{order}-{str(dtype).split('.')[-1]}"


@pytest.mark.parametrize("features, layout, dtype", GRID, ids=[_case_id(i, c) for i, c in enumerate(GRID)])
def test_matches_the_reference(features, layout, dtype, device, monkeypatch):
    size, chunked, order = layout
    monkeypatch.setattr(lce, "ORDER", order)
    if chunked:
        monkeypatch.setattr(lce, "ROW_ALIGN", 16)
        monkeypatch.setattr(lce, "CHUNK_BYTES", 1)
        monkeypatch.setattr(lce, "SUM_MIN_TOKENS", 1)
    kwargs = dict(features)
    x, w, target, b, class_weight = _inputs(
        size, dtype, device, ignore_index=kwargs.get("ignore_index", -100)
    )
    if kwargs.pop("class_weight", False):
        kwargs["class_weight"] = class_weight
    _check(x, w, target, b if kwargs.pop("bias", True) else None, **kwargs)


@pytest.mark.parametrize("order", ["tokens", "vocab"])
def test_a_second_derivative_of_a_mean_raises(order, device, monkeypatch):
    """The tokens order's gradients come from the forward, whose saved tensors once carried no
    graph: a gradient penalty through dx asked for W's gradient read None, silently."""
    monkeypatch.setattr(lce, "ORDER", order)
    x, w, target, _, _ = _inputs((10, 24, 37), BF16, device, seed=4)
    x, w = x.requires_grad_(), w.requires_grad_()
    (dx,) = torch.autograd.grad(tritonkit.linear_cross_entropy(x, w, target), [x], create_graph=True)
    with pytest.raises(RuntimeError, match="linear_cross_entropy has no second derivative"):
        torch.autograd.grad(dx.float().square().sum(), [w], allow_unused=True)


def test_class_weights_every_other_entry_of_a_longer_tensor(device):
    """Class weights of column stride 2, which the kernels once read as contiguous."""
    x, w, target, b, class_weight = _inputs((10, 24, 37), BF16, device, seed=3)
    spaced = torch.zeros(2 * class_weight.shape[0], device=device)
    spaced[::2] = class_weight
    _check(x, w, target, b, class_weight=spaced[::2], label_smoothing=0.1)


def test_the_forward_takes_every_token_at_once_where_that_costs_no_more_than_dws_fp32_sum():
    """At Llama-3-8B's LM head and 8192 tokens the logits (2.1 GB) take less than dW's fp32 sum beside a
    chunk (2.4 GB): one chunk, dW one product. Twice the tokens sum dW over chunks of SUM_MIN_TOKENS
    (each chunk reads and writes the sum), as even as the row alignment allows; no dW asked (a frozen
    head) takes chunks of CHUNK_BYTES."""
    one = lce._forward_chunk(8192, 128256, 4096, 2, sums_dw=True)
    assert one == 8192
    assert lce._forward_chunk(16384, 128256, 4096, 2, sums_dw=True) == 4096
    assert lce._forward_chunk(8192, 256000, 2048, 2, sums_dw=True) == 4096  # not 256 MB's 512
    assert lce._forward_chunk(10000, 256000, 2048, 2, sums_dw=True) == 3392  # three, not 4096 twice and 1808
    assert lce._forward_chunk(8192, 128256, 4096, 2, sums_dw=False) == 1024
    cost = lce.linear_cross_entropy_cost((8192, 4096, 128256), BF16, "bwd", reduction="mean")
    assert cost.bytes < 4 * 128256 * 4096 * 4  # no fp32 sum read and written


@pytest.mark.parametrize("order", ["tokens", "vocab"])
def test_an_fp32_loss_is_the_same_sum_unrounded(order, device, monkeypatch):
    """``loss_dtype=torch.float32`` (transformers' upcast loss): the sum the bf16 loss rounds (the
    same bits once rounded), as close to float64 as transformers' loss from bf16 logits upcast, and
    gradients in the parameters' dtypes equal to the bf16 loss's."""
    monkeypatch.setattr(lce, "ORDER", order)
    x, w, target, b, _ = _inputs((21, 16, 40), BF16, device, seed=9)
    exact = lce.linear_cross_entropy_reference(x.double(), w.double(), target, b.double())
    upcast = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, w, b).float(), target)
    losses, grads = [], []
    for dtype in (None, torch.float32):
        args = [t.detach().clone().requires_grad_(True) for t in (x, w, b)]
        losses.append(tritonkit.linear_cross_entropy(args[0], args[1], target, args[2], loss_dtype=dtype))
        losses[-1].backward()
        grads.append([t.grad for t in args])
    plain, full = losses
    assert full.dtype == torch.float32 and torch.equal(full.to(BF16), plain)
    assert compare("loss", full, upcast, exact, torch.float32).passed
    for rounded, unrounded in zip(*grads, strict=True):
        assert unrounded.dtype == BF16 and torch.equal(rounded, unrounded)
    with pytest.raises(ValueError, match="loss_dtype"):
        tritonkit.linear_cross_entropy(x, w, target, loss_dtype=torch.float16)


def test_leading_dims_and_int32_targets(device):
    """x (2, 5, H) and targets (2, 5) int32: the loss of reduction "none" has the targets' shape."""
    x, w, target, b, _ = _inputs((10, 16, 40), BF16, device, seed=3, leading=(2, 5))
    _check(x, w, target.to(torch.int32), b, reduction="none")


@pytest.mark.parametrize("tokens", [5, 0], ids=["all-ignored", "no-token"])
@pytest.mark.parametrize("order", ["tokens", "vocab"])
def test_every_row_ignored_or_none_gives_torchs_nan_mean_and_zero_gradients(
    tokens, order, device, monkeypatch
):
    monkeypatch.setattr(lce, "ORDER", order)
    x, w, target, b, _ = _inputs((5, 16, 11), BF16, device, seed=4)
    x, target = x[:tokens], target[:tokens]
    args = [t.requires_grad_(True) for t in (x, w, b)]
    with testing.poisoned_outputs():
        loss = tritonkit.linear_cross_entropy(x, w, torch.full_like(target, -100), b)
        loss.backward()
    assert loss.isnan() and all(torch.equal(t.grad, torch.zeros_like(t)) for t in args)


@pytest.mark.parametrize("order", ["tokens", "vocab"])
def test_without_a_gradient_the_same_loss(order, device, monkeypatch):
    monkeypatch.setattr(lce, "ORDER", order)
    x, w, target, b, _ = _inputs((9, 16, 30), F16, device, seed=6)
    with torch.no_grad():
        plain = tritonkit.linear_cross_entropy(x, w, target, b, label_smoothing=0.1)
    tracked = tritonkit.linear_cross_entropy(x.requires_grad_(True), w, target, b, label_smoothing=0.1)
    assert torch.equal(plain, tracked.detach())


def test_the_order_of_the_gradients_in_the_forward_passes_opcheck_and_compiles(device):
    """ORDER "tokens" (the contract's variant, reduction "none", takes the other): its custom op on
    the arguments a real call passes, and torch.compile's bits against eager's."""
    from tritonkit import opdef

    x, w, target, b, _ = _inputs((9, 16, 30), BF16, device, seed=8)
    leaves = [t.requires_grad_(True) for t in (x, w, b)]
    with opdef.recording_calls() as calls:
        loss = tritonkit.linear_cross_entropy(x, w, target, b, label_smoothing=0.1)
        eager = (loss, *torch.autograd.grad(loss, leaves))
    # the forward's call that also computes the gradients (its dx, dw and db given)
    (custom, args) = next(
        (c, a) for c, a in calls if c._name.endswith("linear_cross_entropy") and a[-1] is not None
    )
    torch.library.opcheck(custom, tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    # and the backward's, which scales those gradients by the upstream one in place
    (custom, args) = next((c, a) for c, a in calls if c._name.endswith("linear_cross_entropy_scale"))
    torch.library.opcheck(custom, tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x, w, t, b: tritonkit.linear_cross_entropy(x, w, t, b, label_smoothing=0.1), fullgraph=True
    )
    loss = compiled(x, w, target, b)
    for got, want in zip((loss, *torch.autograd.grad(loss, leaves)), eager, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_calls_order_overrides_the_modules(device, monkeypatch):
    """order= gives the bits of the module's ORDER set to it: "vocab" over ORDER "tokens" (its
    backward's blocks: a second backward runs) and "tokens" over ORDER "vocab" (the forward's
    chunks, scaled in place: a second backward is refused)."""
    x, w, target, b, _ = _inputs((9, 16, 30), BF16, device, seed=9)
    leaves = [t.requires_grad_(True) for t in (x, w, b)]

    def loss_and_grads(**kwargs):
        loss = tritonkit.linear_cross_entropy(x, w, target, b, **kwargs)
        return loss, [loss.detach(), *torch.autograd.grad(loss, leaves, retain_graph=True)]

    for module, call in (("tokens", "vocab"), ("vocab", "tokens")):
        monkeypatch.setattr(lce, "ORDER", call)
        _, want = loss_and_grads()
        monkeypatch.setattr(lce, "ORDER", module)
        loss, got = loss_and_grads(order=call)
        for g, e in zip(got, want, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
        if call == "vocab":
            torch.autograd.grad(loss, leaves)
        else:
            with pytest.raises(RuntimeError, match="backward ran already"):
                torch.autograd.grad(loss, leaves)


def test_a_second_backward_of_the_forwards_gradients_is_refused(device, monkeypatch):
    """ORDER "tokens" scales the forward's gradients in place: a second backward through the same
    graph (retain_graph=True) would scale them again, so it raises instead."""
    monkeypatch.setattr(lce, "ORDER", "tokens")
    x, w, target, b, _ = _inputs((9, 16, 30), BF16, device, seed=9)
    leaves = [t.requires_grad_(True) for t in (x, w, b)]
    loss = tritonkit.linear_cross_entropy(x, w, target, b)
    torch.autograd.grad(loss, leaves, retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran already"):
        torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda a: a.update(input=a["input"].float()), TypeError, "input must be one of"),
        (lambda a: a.update(weight=a["weight"][:, :7]), ValueError, "weight must be \\(V, 8\\)"),
        (lambda a: a.update(weight=a["weight"].half()), TypeError, "weight must be one of"),
        (lambda a: a.update(bias=a["bias"][:3]), ValueError, "bias must have V = 5"),
        (lambda a: a.update(target=a["target"].float()), NotImplementedError, "class probabilities"),
        (lambda a: a.update(target=a["target"][:3]), ValueError, "target must have input's leading shape"),
        (lambda a: a.update(reduction="avg"), ValueError, "reduction must be"),
        (lambda a: a.update(label_smoothing=1.5), ValueError, "label_smoothing must be in"),
        (lambda a: a.update(softcap=0.0), ValueError, "softcap must be None or"),
        (
            lambda a: a.update(class_weight=torch.ones(6, device=a["input"].device)),
            ValueError,
            "weight must have C = 5",
        ),
        (lambda a: a.update(order="classes"), ValueError, "order must be one of"),
    ],
)
def test_bad_input_is_refused_by_name(change, error, message, device):
    args = {
        "input": torch.randn(4, 8, device=device, dtype=BF16),
        "weight": torch.randn(5, 8, device=device, dtype=BF16),
        "target": torch.tensor([0, 1, 2, 3], device=device),
        "bias": torch.randn(5, device=device, dtype=BF16),
    }
    change(args)
    with pytest.raises(error, match=message):
        tritonkit.linear_cross_entropy(**args)


# ---------------------------------------------------------------- on the H200


@pytest.mark.gpu
@pytest.mark.parametrize(
    "size, dtype, features",
    [
        ((1024, 1024, 32000), BF16, {}),
        ((777, 512, 50304), F16, {"softcap": 30.0, "reduction": "sum", "label_smoothing": 0.1}),
        ((2048, 4096, 128256), BF16, {"z_loss": 1e-4, "reduction": "none"}),
    ],
)
def test_gpu_vocabulary_sized_heads_match_the_reference(size, dtype, features, device):
    """Chunks and blocks as the shapes make them (several of each at 128256 classes)."""
    x, w, target, b, _ = _inputs(size, dtype, device, seed=11)
    _check(x, w, target, b, **features)


def test_no_hidden_features_give_uniform_logits(device):
    """A hidden size of 0: every logit is 0, so the loss is log(V) (F.cross_entropy of F.linear's
    zeros); the rows' reshape(-1, 0) raised (its -1 ambiguous)."""
    hidden = torch.randn(3, 4, 0, dtype=torch.bfloat16, device=device, requires_grad=True)
    weight = torch.randn(12, 0, dtype=torch.bfloat16, device=device, requires_grad=True)
    target = torch.randint(0, 12, (3, 4), device=device)
    loss = tritonkit.linear_cross_entropy(hidden, weight, target, loss_dtype=torch.float32)
    torch.testing.assert_close(loss, torch.tensor(12.0, device=device).log())
    loss.backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape
