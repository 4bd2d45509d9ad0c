"""linear's and gated_linear's eager backwards write their elementwise gradients over the forward's
saved pre-activations (dz over z, dg and du over g and u): a second backward through retain_graph
recomputes them and gives the same bits, and on a GPU the backward allocates only its gradients."""

from __future__ import annotations

import pytest
import torch

import tritonkit
from tritonkit.testing import generator, random_tensor

pytestmark = pytest.mark.linear

BF16, F16 = torch.bfloat16, torch.float16
K, N = 33, 257  # in and out features, as test_linear's


def _inputs(leading, dtype, device, seed, gated=False):
    """x, the weights (one, or gate and up), a bias (not gated), a residual and dy."""
    g = generator(seed)
    x = random_tensor((*leading, K), dtype, device, generator=g)
    weights = [random_tensor((N, K), dtype, device, generator=g) for _ in range(2 if gated else 1)]
    b = None if gated else random_tensor((N,), dtype, device, generator=g)
    r, dy = (random_tensor((*leading, N), dtype, device, generator=g) for _ in range(2))
    return x, weights, b, r, dy


def test_linear_backward_spends_its_pre_activation_and_a_second_backward_recomputes_it(device):
    """With an activation the eager backward writes dz over the forward's saved z; a second backward
    through retain_graph finds it spent and recomputes it (bias included): the same bits both times."""
    x, (w,), b, r, dy = _inputs((33,), F16, device, seed=26)
    for t in (x, w, b):
        t.requires_grad_()
    y = tritonkit.linear(x, w, b, activation="gelu_tanh", residual=r)
    first = torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)
    pre = y.grad_fn.saved_tensors[3]
    assert not torch.equal(pre, torch.nn.functional.linear(x, w, b).detach())  # pre holds dz now
    second = torch.autograd.grad(y, (x, w, b), dy)
    assert all(torch.equal(a, c) for a, c in zip(first, second, strict=True))
    again = tritonkit.linear(x, w, b, activation="gelu_tanh", residual=r)
    third = torch.autograd.grad(again, (x, w, b), dy)
    assert all(torch.equal(a, c) for a, c in zip(first, third, strict=True))


def test_gated_linear_backward_spends_its_products_and_a_second_backward_recomputes_them(device):
    """The eager backward writes dg and du over the forward's saved g and u; a second backward
    through retain_graph finds them spent and recomputes them: the same bits both times."""
    x, (w_gate, w_up), _, _, dy = _inputs((33,), F16, device, seed=25, gated=True)
    for t in (x, w_gate, w_up):
        t.requires_grad_()
    y = tritonkit.gated_linear(x, w_gate, w_up)
    first = torch.autograd.grad(y, (x, w_gate, w_up), dy, retain_graph=True)
    _, g, u = y.grad_fn.saved_tensors[2:]
    assert not torch.equal(g, torch.nn.functional.linear(x, w_gate).detach())  # g holds dg now
    second = torch.autograd.grad(y, (x, w_gate, w_up), dy)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    again = tritonkit.gated_linear(x, w_gate, w_up)
    third = torch.autograd.grad(again, (x, w_gate, w_up), dy)
    assert all(torch.equal(a, b) for a, b in zip(first, third, strict=True))


@pytest.mark.gpu
def test_gpu_gated_linear_backward_allocates_only_its_gradients(device):
    """The eager backward's dg and du take the saved products' memory: past what is live before it,
    the backward allocates its three gradients (and a little), not two more (M, N) buffers."""
    from tritonkit import tuning

    g = generator(42)
    x = random_tensor((4096, 512), BF16, device, generator=g).requires_grad_()
    w_gate, w_up = (random_tensor((2048, 512), BF16, device, generator=g).requires_grad_() for _ in range(2))
    dy = random_tensor((4096, 2048), BF16, device, generator=g)
    with tuning.disabled():
        torch.autograd.grad(tritonkit.gated_linear(x, w_gate, w_up), (x, w_gate, w_up), dy)  # compiles
        y = tritonkit.gated_linear(x, w_gate, w_up)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        grads = torch.autograd.grad(y, (x, w_gate, w_up), dy)
        extra = torch.cuda.max_memory_allocated() - before
    needed = sum(t.numel() * t.element_size() for t in grads)  # 8 MiB; dg and du would add 32
    assert extra <= needed + (4 << 20), (extra, needed)
