"""Infrastructure: roofline model, error oracle, GPU-or-interpreter runtime, lazy exports (the
launcher's tests: test_launch.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tritonkit
from tritonkit import _runtime
from tritonkit._runtime import empty_output
from tritonkit.ops import get_op, get_workload, op_names, workload_names
from tritonkit.ops.bias_gelu import bias_gelu, bias_gelu_reference
from tritonkit.oracle import ATOL, Comparison, compare, max_abs_error
from tritonkit.roofline import (
    Cost,
    DeviceSpec,
    bound_by,
    cache_dir,
    device_spec,
    pct_of_roofline,
    roofline_seconds,
)
from tritonkit.testing import check_against_reference, generator, poisoned_outputs, random_tensor

pytestmark = pytest.mark.infra

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# ---------------------------------------------------------------- roofline


def test_cost_addition_and_intensity():
    assert Cost(1.0, 2.0) + Cost(30.0, 40.0) == Cost(31.0, 42.0)
    assert Cost(12.0, 4.0).intensity == 3.0
    assert Cost(5.0, 0.0).intensity == math.inf


def test_h200_datasheet():
    h200 = device_spec("h200")
    assert h200.bandwidth == pytest.approx(4.8e12, rel=1e-12)
    assert h200.peak("bf16") == pytest.approx(989e12, rel=1e-12)
    assert h200.peak("fp8") == pytest.approx(1979e12, rel=1e-12)
    assert device_spec("h100").bandwidth == pytest.approx(3.35e12, rel=1e-12)


@pytest.mark.parametrize(
    "cuda_name, slug",
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ],
)
def test_device_spec_by_cuda_name(cuda_name, slug):
    assert device_spec(cuda_name).slug == slug


@pytest.mark.parametrize("cuda_name", ["NVIDIA GeForce RTX 4090", "NVIDIA H100 PCIe", "NVIDIA H200 NVL"])
def test_unknown_device_raises(cuda_name):
    with pytest.raises(ValueError, match=cuda_name):
        device_spec(cuda_name)


def test_no_device_named_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device"):
        device_spec()


# A made-up device with round numbers: 1 TB/s and 10 TFLOP/s, so the ridge point is 10 FLOP/byte.
TOY = DeviceSpec("toy", "toy", bandwidth=1e12, peak_flops={"fp32": 1e13})


def test_device_spec_passes_a_spec_through():
    assert device_spec(TOY) is TOY
    assert TOY.ridge("fp32") == 10.0
    with pytest.raises(ValueError, match="bf16"):
        TOY.peak("bf16")


def test_roofline_compute_bound():
    cost = Cost(flops=2e13, bytes=1e12)  # 2 s of compute, 1 s of memory
    assert roofline_seconds(cost, TOY, "fp32") == 2.0
    assert bound_by(cost, TOY, "fp32") == "compute"
    assert pct_of_roofline(cost, 4.0, TOY, "fp32") == 50.0


def test_roofline_memory_bound():
    cost = Cost(flops=1e12, bytes=3e12)  # 0.1 s of compute, 3 s of memory
    assert roofline_seconds(cost, TOY, "fp32") == 3.0
    assert bound_by(cost, TOY, "fp32") == "memory"
    assert pct_of_roofline(cost, 3.75, TOY, "fp32") == 80.0
    assert roofline_seconds(Cost(0.0, 5e11), TOY, "fp32") == 0.5


@pytest.mark.parametrize("seconds", [0.0, -1.0])
def test_pct_of_roofline_rejects_non_positive_time(seconds):
    with pytest.raises(ValueError, match="seconds"):
        pct_of_roofline(Cost(1.0, 1.0), seconds, TOY, "fp32")


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITONKIT_CACHE_DIR", str(tmp_path / "here"))
    assert cache_dir() == tmp_path / "here"
    monkeypatch.delenv("TRITONKIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "tritonkit"


# ---------------------------------------------------------------- oracle: comparisons


def _reference_and_torch(seed=30):
    g = generator(seed)
    reference = random_tensor((4, 5), torch.float64, "cpu", generator=g)
    return reference, reference + 1e-3  # torch errs by 1e-3 everywhere


def test_compare_passes_within_twice_torch_error():
    reference, torch_value = _reference_and_torch()
    comparison = compare("y", reference + 1.5e-3, torch_value, reference, F32)
    assert comparison.passed and comparison.tolerance == pytest.approx(2e-3 + ATOL[F32])
    assert str(comparison).endswith(" ok")


def test_compare_fails_beyond_twice_torch_error():
    reference, torch_value = _reference_and_torch()
    comparison = compare("y", reference - 2.5e-3, torch_value, reference, F32)
    assert not comparison.passed and comparison.err_kernel == pytest.approx(2.5e-3)
    assert str(comparison).endswith(" FAIL")


def test_nan_never_passes():
    reference, _ = _reference_and_torch()
    with_nan = reference.clone()
    with_nan[1, 2] = math.nan
    assert not compare("y", with_nan, with_nan, reference, F32).passed  # even with an infinite bound
    assert not Comparison("y", err_kernel=math.nan, err_torch=0.0, tolerance=math.inf).passed


def test_max_abs_error():
    g = generator(31)
    value = random_tensor((3, 4), F32, "cpu", generator=g)
    reference = value.double()
    reference[2, 1] += 0.25
    assert max_abs_error(value, reference) == 0.25
    assert max_abs_error(value.to(BF16), value.double()) <= 2.0**-8 * value.abs().max().item()
    assert max_abs_error(value[:0], reference[:0]) == 0.0


def test_max_abs_error_is_infinite_for_nan_and_shape_mismatch():
    value = random_tensor((3, 4), F32, "cpu", generator=generator(32))
    with_nan = value.clone()
    with_nan[0, 3] = math.nan
    assert max_abs_error(with_nan, value.double()) == math.inf
    assert max_abs_error(value, value.double().t()) == math.inf
    assert max_abs_error(value[:, :3], value.double()) == math.inf


# ---------------------------------------------------------------- oracle: check_against_reference


def _oracle_inputs(dtype=F32, seed=33):
    g = generator(seed)
    x, b = random_tensor((6, 20), dtype, "cpu", generator=g), random_tensor((20,), dtype, "cpu", generator=g)
    return [x, b], random_tensor((6, 20), dtype, "cpu", generator=g)


def _check(kernel, dtype=F32, grad_inputs=(0, 1)):
    inputs, dy = _oracle_inputs(dtype)
    return check_against_reference(
        kernel, bias_gelu_reference, inputs, grad_inputs=grad_inputs, grad_outputs=[dy]
    )


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_oracle_passes_a_correctly_rounded_kernel(dtype):
    def rounded(x, b):  # the float64 result rounded once: as good as a kernel can be
        return bias_gelu_reference(x.double(), b.double()).to(x.dtype)

    comparisons = _check(rounded, dtype)
    assert [c.name for c in comparisons] == ["output[0]", "grad input[0]", "grad input[1]"]
    assert all(c.passed for c in comparisons)


@pytest.mark.parametrize(
    "wrong",
    [
        lambda x, b: 1.01 * bias_gelu_reference(x, b),
        lambda x, b: torch.nn.functional.gelu(x + b, approximate="tanh"),
    ],
    ids=["scaled by 1.01", "tanh form for the exact one"],
)
def test_oracle_fails_a_wrong_kernel(wrong):
    with pytest.raises(AssertionError, match=r"output\[0\]: .* FAIL"):
        _check(wrong, grad_inputs=())


def _leaves_last_element_unwritten(x, b):
    y = empty_output(x.shape, x.dtype, x.device)
    y.view(-1)[:-1] = bias_gelu_reference(x, b).reshape(-1)[:-1]
    return y


def test_oracle_fails_an_unwritten_element():
    with pytest.raises(AssertionError, match=r"output\[0\]: err inf .* FAIL"):
        _check(_leaves_last_element_unwritten, grad_inputs=())


class _OffBiasGradient(torch.autograd.Function):
    """Right output and input gradient, bias gradient 0.1% too large."""

    @staticmethod
    def forward(ctx, x, b):
        ctx.save_for_backward(x, b)
        return bias_gelu_reference(x, b)

    @staticmethod
    def backward(ctx, dy):
        x, b = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            dx, db = torch.autograd.grad(bias_gelu_reference(x, b), (x, b), dy)
        return dx, 1.001 * db


def test_oracle_fails_a_wrong_gradient():
    with pytest.raises(AssertionError) as failure:
        _check(_OffBiasGradient.apply)
    message = str(failure.value)
    assert "grad input[1]" in message and "FAIL" in message.split("grad input[1]")[1]
    assert "FAIL" not in message.split("grad input[1]")[0]


def test_oracle_accepts_expanded_inputs(device):
    g = generator(34)
    row, b = random_tensor((1, 20), F32, device, generator=g), random_tensor((20,), F32, device, generator=g)
    dy = random_tensor((6, 20), F32, device, generator=g)
    check_against_reference(
        bias_gelu, bias_gelu_reference, [row.expand(6, -1), b], grad_inputs=(0, 1), grad_outputs=[dy]
    )


def test_poisoned_outputs_are_nan_and_restored():
    assert _runtime.poison_outputs is False
    with pytest.raises(RuntimeError, match="inside"), poisoned_outputs():
        assert _runtime.poison_outputs and torch.isnan(empty_output((4, 3), F16, "cpu")).all()
        raise RuntimeError("inside")
    assert _runtime.poison_outputs is False


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_random_tensor(dtype):
    a = random_tensor((64, 257), dtype, "cpu", generator=generator(35))
    assert a.shape == (64, 257) and a.dtype == dtype and a.is_contiguous()
    assert (a != 0).all()
    assert torch.equal(a, random_tensor((64, 257), dtype, "cpu", generator=generator(35)))
    assert not torch.equal(a, random_tensor((64, 257), dtype, "cpu", generator=generator(36)))


def test_random_tensor_noncontiguous_and_scaled():
    strided = random_tensor((5, 7), F32, "cpu", generator=generator(37), noncontiguous=True)
    assert strided.shape == (5, 7) and strided.stride() == (14, 2) and not strided.is_contiguous()
    scaled = random_tensor((5, 7), F32, "cpu", generator=generator(38), scale=3.0)
    torch.testing.assert_close(scaled, 3.0 * random_tensor((5, 7), F32, "cpu", generator=generator(38)))


# ---------------------------------------------------------------- runtime (fresh processes)

# Prepended to each snippet: collect 'tritonkit' log messages; report facts as JSON on the last line.
PRELUDE = """
import json, logging, os, sys
messages = []
class _Keep(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
logging.getLogger("tritonkit").addHandler(_Keep())
logging.getLogger("tritonkit").setLevel(logging.INFO)
def error_of(fn):
    try:
        fn()
    except Exception as e:
        return [type(e).__name__, str(e)]
def report(**facts):
    print(json.dumps(facts))
"""


def _run_python(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter with neither INTERPRET variable set unless given."""
    environ = {k: v for k, v in os.environ.items() if k not in (_runtime.TRITON_ENV, _runtime.OVERRIDE_ENV)}
    result = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_has_no_side_effects():
    """Importing loads no op and triton, initialises no CUDA; it decides GPU or interpreter only
    where no device need be asked: a torch built without a GPU backend (the CI machine's) gets the
    interpreter at once, a CUDA build decides at the first op."""
    facts = _run_python("""
        import torch
        import tritonkit, tritonkit.ops, tritonkit.roofline, tritonkit.testing, tritonkit._launch
        report(env=os.environ.get("TRITON_INTERPRET"), triton="triton" in sys.modules,
               op_loaded="tritonkit.ops.bias_gelu" in sys.modules, cuda=torch.cuda.is_initialized(),
               decided=tritonkit._runtime.interpret.cache_info().currsize, messages=messages,
               gpu_backend=torch.backends.cuda.is_built() or torch.version.hip is not None)
    """)
    decided = {"env": "1", "decided": 1, "messages": [INTERPRETER_LINE]}
    undecided = {"env": None, "decided": 0, "messages": []}
    assert facts == {
        "triton": False,
        "op_loaded": False,
        "cuda": False,
        "gpu_backend": facts["gpu_backend"],
        **(undecided if facts["gpu_backend"] else decided),
    }


INTERPRETER_LINE = "tritonkit: kernels run in Triton's interpreter on the CPU (no CUDA GPU found)"


@pytest.mark.slow
def test_torch_compile_as_the_first_use_finds_the_choice_made():
    """torch.compile imports triton itself before tracing the first op: on a CPU-only torch the
    import has chosen the interpreter already, and the traced op (its device check, which would
    otherwise decide, and write the environment, while traced) compiles without a graph break."""
    facts = _run_python("""
        import torch, tritonkit
        x, b = torch.randn(4, 64), torch.randn(64)
        if torch.backends.cuda.is_built():
            x, b = x.cuda(), b.cuda()
        fn = torch.compile(lambda x, b: tritonkit.bias_gelu(x, b), fullgraph=True)
        report(close=bool(torch.allclose(fn(x, b), tritonkit.bias_gelu(x, b))))
    """)
    assert facts == {"close": True}


def test_forced_interpreter_logged_once():
    facts = _run_python(
        """
        import torch, tritonkit
        torch.manual_seed(0)
        x, b = torch.randn(3, 8), torch.randn(8)
        first, second = tritonkit.bias_gelu(x, b), tritonkit.bias_gelu(x, b)
        report(env=os.environ.get("TRITON_INTERPRET"), messages=messages, same=torch.equal(first, second),
               op_loaded="tritonkit.ops.bias_gelu" in sys.modules)
    """,
        TRITONKIT_INTERPRET="1",
    )
    assert facts["env"] == "1" and facts["same"] and facts["op_loaded"]
    assert len(facts["messages"]) == 1, facts["messages"]
    assert "interpreter" in facts["messages"][0] and "TRITONKIT_INTERPRET=1" in facts["messages"][0]


def test_invalid_override_raises():
    facts = _run_python(
        """
        import tritonkit
        report(error=error_of(lambda: tritonkit.bias_gelu))
    """,
        TRITONKIT_INTERPRET="maybe",
    )
    assert facts["error"][0] == "ValueError"
    assert "TRITONKIT_INTERPRET" in facts["error"][1] and "'maybe'" in facts["error"][1]


def test_triton_imported_first_is_refused_for_the_interpreter():
    facts = _run_python(
        """
        import triton, tritonkit
        report(error=error_of(lambda: tritonkit.bias_gelu))
    """,
        TRITONKIT_INTERPRET="1",
    )
    assert facts["error"][0] == "RuntimeError"
    assert "triton was imported before tritonkit" in facts["error"][1]


def test_triton_imported_first_with_triton_interpret_works():
    facts = _run_python(
        """
        import torch, triton, tritonkit
        torch.manual_seed(0)
        x, b = torch.randn(3, 8), torch.randn(8)
        err = (tritonkit.bias_gelu(x, b).double() - tritonkit.ops.bias_gelu.bias_gelu_reference(
            x.double(), b.double())).abs().max().item()
        report(err=err, messages=messages)
    """,
        TRITON_INTERPRET="1",
    )
    assert facts["err"] < 1e-5
    assert len(facts["messages"]) == 1 and "TRITON_INTERPRET=1" in facts["messages"][0]


def test_forced_native_rejects_cpu_tensors():
    facts = _run_python(
        """
        import torch, tritonkit
        torch.manual_seed(0)
        report(error=error_of(lambda: tritonkit.bias_gelu(torch.randn(3, 8), torch.randn(8))),
               env=os.environ.get("TRITON_INTERPRET"))
    """,
        TRITONKIT_INTERPRET="0",
    )
    assert facts["env"] == "0"
    assert facts["error"] == ["ValueError", "input must be a CUDA tensor, got one on cpu"]


# ---------------------------------------------------------------- lazy exports and registry


def test_the_registry_is_the_one_list_of_ops():
    """Each family's module defines exactly the ops, workloads and public functions the registry lists
    for it, each under its own name, and its workloads run its own ops."""
    import importlib

    from tritonkit import _registry

    for module_name, family in _registry.FAMILIES.items():
        module = importlib.import_module(module_name)
        assert list(module.OPS) == list(family["ops"]), module_name
        assert list(module.WORKLOADS) == list(family["workloads"]), module_name
        assert all(name == op.name for name, op in module.OPS.items()), module_name
        assert all(name == w.name for name, w in module.WORKLOADS.items()), module_name
        assert {id(w.op) for w in module.WORKLOADS.values()} <= {id(op) for op in module.OPS.values()}
        for name in family["public"]:
            assert getattr(tritonkit, name) is getattr(module, name), name
    assert op_names() == list(_registry.OP_MODULES) and workload_names() == list(_registry.WORKLOAD_MODULES)


def test_lazy_public_names():
    assert "bias_gelu" in dir(tritonkit) and "bias_gelu" in tritonkit.__all__
    assert tritonkit.bias_gelu is bias_gelu
    assert tritonkit.tuning.enabled and "tuning" in dir(tritonkit)  # as the README's `tuning.enabled()`
    with pytest.raises(AttributeError, match="no_such_op"):
        _ = tritonkit.no_such_op


def test_op_registry():
    assert "bias_gelu" in op_names() and get_op("bias_gelu").fn is bias_gelu
    assert get_workload("attention_causal").op is get_op("flash_attention")
    with pytest.raises(ValueError, match="no_such_op"):
        get_op("no_such_op")
    with pytest.raises(ValueError, match="unknown workload 'flash_attention'"):
        get_workload("flash_attention")  # an op, benchmarked as attention and attention_causal


def test_worst_is_the_comparison_nearest_its_bound():
    from tritonkit.testing import Comparison, worst

    close = Comparison("y", err_kernel=0.9e-3, err_torch=1e-3, tolerance=1e-3)
    far_but_loose = Comparison("dw", err_kernel=0.5, err_torch=0.4, tolerance=1.0)
    assert worst([far_but_loose, close]) is close  # 90% of its bound against 50%
    broken = Comparison("dx", err_kernel=math.nan, err_torch=1e-3, tolerance=1e-3)
    assert worst([close, broken, far_but_loose]) is broken and not broken.passed


def test_as_int_takes_integers_of_any_kind_and_refuses_the_rest():
    import numpy as np

    from tritonkit.opdef import as_int

    assert [as_int(v) for v in (3, -2, np.int64(7), torch.tensor(5))] == [3, -2, 7, 5]
    assert [as_int(v) for v in (True, 2.0, "3", None, torch.tensor(1.5))] == [None] * 5
