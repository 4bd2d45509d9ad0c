"""softmax and log_softmax under torch.compile: one graph for both ops, outputs and gradients as
eager's bit for bit and against the float64 reference, and the tests' output poisoning no part of
a compiled graph."""

from __future__ import annotations

import pytest
import torch

import tritonkit
from tritonkit.ops.softmax.softmax import softmax_reference
from tritonkit.testing import check_against_reference, generator, poisoned_outputs, random_tensor

pytestmark = pytest.mark.softmax

F32, BF16 = torch.float32, torch.bfloat16


def test_compile_fullgraph(device):
    torch._dynamo.reset()

    def fn(input):
        return tritonkit.softmax(input, -1), tritonkit.log_softmax(input, 0, dtype=F32)

    compiled = torch.compile(fn, fullgraph=True)
    g = generator(50)
    x = random_tensor((6, 40), BF16, device, generator=g, scale=3.0)
    dys = tuple(random_tensor((6, 40), dtype, device, generator=g) for dtype in (BF16, F32))
    eager_x = x.clone().requires_grad_()
    eager = fn(eager_x)
    out = compiled(x.requires_grad_())
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    torch.testing.assert_close(
        torch.autograd.grad(out, x, dys), torch.autograd.grad(eager, eager_x, dys), rtol=0, atol=0
    )
    check_against_reference(
        lambda t: compiled(t)[0], softmax_reference, [x.detach()], grad_inputs=(0,), grad_outputs=[dys[0]]
    )


def test_poisoning_is_no_part_of_a_compiled_graph(device):
    """The tests' output poisoning fills eager calls' outputs only: a graph traced while it is on is
    the one users get, and turning it on compiles no second graph (on the GPU the poisoned graph's
    gradient was wrong: test_compile_fullgraph's 0.43 against a bound of 0.0098)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(lambda t: tritonkit.softmax(t, -1), backend=counter, fullgraph=True)
    x = random_tensor((6, 40), BF16, device, generator=generator(52))
    plain = compiled(x)
    with poisoned_outputs():
        poisoned = compiled(x)
    assert counter.frame_count == 1  # (2 where the flag was traced: a second graph, with the fills)
    torch.testing.assert_close(poisoned, plain, rtol=0, atol=0)
