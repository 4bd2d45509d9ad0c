"""A norm's output made again in its projection's backward (``ops/norm/normed.py``): ``linear`` and
``gated_linear`` given a tritonkit norm's output save the norm's input in its place, their
gradients (and the norm's) the same bits as with the output saved, a second backward through
retain_graph too, dx written over the remade input; an output written in place since, or what it was
made from, is saved as before; the benchmark's decoder layer holds two activations fewer."""

from __future__ import annotations

import importlib

import pytest
import torch

import tritonkit
from tritonkit.ops.norm import normed
from tritonkit.testing import generator, random_tensor

pytestmark = pytest.mark.norm

D, N = 96, 80  # the norm's width (the projection's in features) and the projection's out features


def _inputs(device, seed, gated=False):
    """x (5, 7, D) bf16, the norm's weight, the projection's weight(s), and dy; all but dy leaves."""
    g = generator(seed)
    x = random_tensor((5, 7, D), torch.bfloat16, device, generator=g)
    norm_weight = random_tensor((D,), torch.bfloat16, device, generator=g)
    weights = [random_tensor((N, D), torch.bfloat16, device, generator=g) for _ in range(2 if gated else 1)]
    dy = random_tensor((5, 7, N), torch.bfloat16, device, generator=g)
    return [t.requires_grad_() for t in (x, norm_weight, *weights)], dy


# (name, the norm, the projection over its output)
CASES = [
    ("rms_norm-linear", lambda x, w: tritonkit.rms_norm(x, (D,), w), lambda h, ws: tritonkit.linear(h, *ws)),
    (
        "layer_norm-linear-gelu",
        lambda x, w: tritonkit.layer_norm(x, (D,), w),
        lambda h, ws: tritonkit.linear(h, *ws, activation="gelu_tanh"),
    ),
    (
        "add_rms_norm-pair-gated_linear",
        lambda x, w: tritonkit.add_rms_norm(x, None, (D,), w)[0],
        lambda h, ws: tritonkit.gated_linear(h, *ws, "silu"),
    ),
]


def _saved_pointers(call) -> tuple:
    """(the call's output, the data pointers of every tensor autograd saved during it)."""
    pointers = []

    def pack(t):
        pointers.append(t.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return call(), pointers


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_the_projection_saves_the_norms_input_and_its_gradients_keep_their_bits(case, device, monkeypatch):
    name, norm, project = case
    runs = {}
    for recompute in (False, True):
        monkeypatch.setattr(normed, "RECOMPUTE", recompute)
        (x, norm_weight, *weights), dy = _inputs(device, seed=7, gated="gated" in name)
        held = {}

        def forward(x=x, norm_weight=norm_weight, weights=weights, held=held):
            held["h"] = norm(x, norm_weight)
            return project(held["h"], weights)

        y, pointers = _saved_pointers(forward)
        # the norm's output among what was saved exactly where the projection saves it itself
        assert (held["h"].data_ptr() in pointers) != recompute, pointers
        leaves = (x, norm_weight, *weights)
        first = torch.autograd.grad(y, leaves, dy, retain_graph=True)
        second = torch.autograd.grad(y, leaves, dy)
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
        runs[recompute] = (y, *first)
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True], strict=True))


def test_an_output_written_in_place_or_a_changed_input_is_saved_itself(device):
    """The recipe holds only while the output and what it was made from are unchanged, and on the
    output itself: a view of it is saved as it is (as docs/ops/norms.md says)."""
    (x, norm_weight, w), _ = _inputs(device, seed=8)
    h = tritonkit.rms_norm(x, (D,), norm_weight)
    assert normed.recipe(h) is not None
    view = h.view(35, D)
    assert normed.recipe(view) is None
    y, pointers = _saved_pointers(lambda: tritonkit.linear(view, w))
    assert view.data_ptr() in pointers and y.shape == (35, N)
    h2 = tritonkit.rms_norm(x, (D,), norm_weight)
    with torch.no_grad():
        h2.mul_(2)
    assert normed.recipe(h2) is None
    source = x.detach().clone().requires_grad_()
    h3 = tritonkit.rms_norm(source, (D,), norm_weight)
    with torch.no_grad():
        source.add_(1)
    assert normed.recipe(h3) is None
    y, pointers = _saved_pointers(lambda: tritonkit.linear(h2, w))
    assert h2.data_ptr() in pointers and y.shape == (5, 7, N)


def test_a_norm_with_a_residual_or_without_a_gradient_leaves_no_recipe(device):
    """With a residual the output's recompute would take another kernel's launch; without a
    gradient nothing is saved at all."""
    (x, norm_weight, _), _ = _inputs(device, seed=9)
    y, _ = tritonkit.add_rms_norm(x, x.detach() * 0.5, (D,), norm_weight)
    assert normed.recipe(y) is None
    with torch.no_grad():
        assert normed.recipe(tritonkit.rms_norm(x, (D,), norm_weight)) is None


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_the_inputs_gradient_takes_the_remade_inputs_memory(case, device, monkeypatch):
    """dx is written over the input the backward made again (its weights' gradients, which read it,
    come first): the gradient reaching the norm's output is that tensor's memory."""
    projections = importlib.import_module("tritonkit.ops.linear.linear")  # (the package's `linear` is the op)
    name, norm, project = case
    remade = []
    renormed = projections.renormed

    def recording(*args):
        remade.append(renormed(*args))
        return remade[-1]

    monkeypatch.setattr(projections, "renormed", recording)
    (x, norm_weight, *weights), dy = _inputs(device, seed=10, gated="gated" in name)
    h = norm(x, norm_weight)
    reached = []
    h.register_hook(lambda grad: reached.append(grad.data_ptr()))
    torch.autograd.grad(project(h, weights), (x, norm_weight, *weights), dy)
    assert len(remade) == 1 and reached == [remade[0].data_ptr()]


def test_the_layers_forward_holds_two_activations_fewer(device, monkeypatch):
    """``tritonkit bench layer``'s tritonkit layer (at ``layer.TINY``): its forward saves two d-wide
    activations fewer with the recompute on (the two norms' outputs), counted as the unique storages
    autograd saved."""
    from tritonkit.bench import layer

    shape = layer.TINY
    weights = layer.make_weights(shape, torch.bfloat16, device)
    x = layer.make_inputs(shape, torch.bfloat16, device)[0]
    saved = {}
    for recompute in (False, True):
        monkeypatch.setattr(normed, "RECOMPUTE", recompute)
        storages = {}

        def pack(t, storages=storages):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer.tritonkit_layer(x, weights, shape)
        saved[recompute] = sum(storages.values())
    activation = shape.batch * shape.seq * shape.dim * 2  # bf16
    assert saved[False] - saved[True] == 2 * activation, saved


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing_gives_the_same_bits(reentrant, device):
    """Under ``torch.utils.checkpoint`` (the forward first without a gradient, so nothing is marked,
    then again in the backward, where the projection saves the recipe) the gradients are the plain
    call's bits."""
    from torch.utils.checkpoint import checkpoint

    grads = []
    for checkpointed in (False, True):
        (x, norm_weight, w), dy = _inputs(device, seed=11)

        def layer(x, norm_weight, w):
            return tritonkit.linear(tritonkit.rms_norm(x, (D,), norm_weight), w)

        y = (
            checkpoint(layer, x, norm_weight, w, use_reentrant=reentrant)
            if checkpointed
            else layer(x, norm_weight, w)
        )
        y.backward(dy)  # (reentrant checkpointing takes no torch.autograd.grad)
        grads.append([t.grad for t in (x, norm_weight, w)])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
