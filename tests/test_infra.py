"""Infrastructure: roofline model, error oracle, GPU-or-interpreter runtime, launcher, lazy exports."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import tritonkit
from tritonkit import _runtime
from tritonkit._launch import specialization_key
from tritonkit._runtime import empty_output
from tritonkit.ops import get_op, get_workload, op_names, workload_names
from tritonkit.ops.bias_gelu import bias_gelu, bias_gelu_reference
from tritonkit.oracle import ATOL, INTERPRETER_BF16_ULP, Comparison, compare, max_abs_error
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


def test_interpreter_widens_bf16_bound_only(monkeypatch):
    reference, torch_value = _reference_and_torch()
    bounds = {}
    for interpreting in (False, True):
        monkeypatch.setattr(_runtime, "interpret", lambda interpreting=interpreting: interpreting)
        bounds[interpreting] = [
            compare("y", reference, torch_value, reference, dtype).tolerance for dtype in (BF16, F16)
        ]
    widening = INTERPRETER_BF16_ULP * reference.abs().max().item()
    assert bounds[True][0] == pytest.approx(bounds[False][0] + widening)
    assert bounds[True][1] == bounds[False][1]


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
    with pytest.raises(AttributeError, match="no_such_op"):
        _ = tritonkit.no_such_op


def test_op_registry():
    assert "bias_gelu" in op_names() and get_op("bias_gelu").fn is bias_gelu
    assert get_workload("attention_causal").op is get_op("flash_attention")
    with pytest.raises(ValueError, match="no_such_op"):
        get_op("no_such_op")
    with pytest.raises(ValueError, match="unknown workload 'flash_attention'"):
        get_workload("flash_attention")  # an op, benchmarked as attention and attention_causal


# ---------------------------------------------------------------- launcher keys


def test_specialization_key_tensors():
    base = random_tensor((64,), F32, "cpu", generator=generator(39))
    assert base.data_ptr() % 16 == 0
    assert specialization_key((base,)) == specialization_key((base[4:],))  # 16 bytes on: still aligned
    assert specialization_key((base,)) != specialization_key((base[1:],))  # 4 bytes on: not
    assert specialization_key((base,)) != specialization_key((base.to(F16),))


# Pairs Triton specializes differently: equal to 1, divisible by 16, i32/i64/u64, the type.
@pytest.mark.parametrize(
    "a, b",
    [
        (1, 2),
        (2, 16),
        (16, 17),
        (2**31 - 1, 2**31),
        (-(2**31), -(2**31) - 1),
        (2**63 - 1, 2**63),
        (True, 1),
        (1.0, 1),
        (None, 0),
    ],
    ids=str,
)
def test_specialization_key_distinguishes(a, b):
    assert specialization_key((a,)) != specialization_key((b,))


def test_specialization_key_keeps_positions_apart():
    t = random_tensor((8,), F32, "cpu", generator=generator(40))
    assert specialization_key((t, 16, 3)) != specialization_key((t, 3, 16))
    assert specialization_key((0.5, t)) == specialization_key((2.5, t))  # floats: the type only


def test_specialization_key_of_descriptors_refines_tritons():
    """Host TMA descriptors that share a key share Triton's specialization (its argument type), and
    descriptors of other addresses, shapes and strides do share keys: the launch passes those."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    from tritonkit.ops.attention.fwd_sm90 import descriptor

    g = generator(44)
    contiguous = random_tensor((2, 4, 256, 128), BF16, "cpu", generator=g)
    tensors = [
        contiguous,
        contiguous[:, :, 64:],
        random_tensor((2, 256, 4, 128), BF16, "cpu", generator=g).transpose(1, 2),
        random_tensor((1, 2, 320, 128), F16, "cpu", generator=g),
        random_tensor((2, 4, 256, 64), BF16, "cpu", generator=g),
    ]
    descriptors = [
        descriptor(t, rows, swizzle=swizzle) for t in tensors for rows in (64, 128) for swizzle in (None, 64)
    ]
    types_by_key, tensors_by_key = {}, {}
    for d in descriptors:
        key = specialization_key((d,))
        types_by_key.setdefault(key, set()).add(native_specialize_impl(CUDABackend, d, False, True, True)[0])
        tensors_by_key.setdefault(key, set()).add((d.base.data_ptr(), tuple(d.shape), tuple(d.strides)))
    assert all(len(types) == 1 for types in types_by_key.values()), types_by_key
    assert len(types_by_key) == len({next(iter(types)) for types in types_by_key.values()})  # no finer
    assert any(len(ts) > 1 for ts in tensors_by_key.values())  # different tensors did share keys


@pytest.mark.parametrize("value", ["x", [1, 2], F32, object()], ids=lambda v: type(v).__name__)
def test_specialization_key_rejects_unknown_types(value):
    with pytest.raises(TypeError, match=type(value).__name__):
        specialization_key((1, value))


# ---------------------------------------------------------------- launcher on the GPU


def _fwd_arguments(x, b, y, rows, cols):
    return (x, b, y, rows, cols, cols, 1, 1)


def _triton_specialization(kernel, args, meta):
    import triton

    binder = kernel.device_caches[triton.runtime.driver.active.get_current_device()][4]
    return repr(binder(*args, **meta)[1])


@pytest.mark.gpu
def test_specialization_key_refines_triton_binder():
    """Argument tuples that share a key share Triton's specialization, so they may share a kernel."""
    from tritonkit.ops.bias_gelu import _bias_gelu_fwd_kernel as kernel

    g = torch.Generator("cuda").manual_seed(40)
    storage = torch.randn(4096, generator=g, device="cuda", dtype=BF16)
    tensors = [storage, storage[1:], storage[8:], storage[9:], storage.float(), storage.float()[3:]]
    ints = [1, 2, 3, 16, 17, 48, -16, 2**31 - 1, 2**31, 2**31 + 16, 2**32 + 1, 2**63 - 1, 2**63, 2**64 - 16]
    base = _fwd_arguments(storage, storage, storage, 64, 4096)
    variants = [
        base[:i] + (value,) + base[i + 1 :]
        for i, arg in enumerate(base)
        for value in (tensors if torch.is_tensor(arg) else ints)
    ]
    rng = random.Random(40)
    variants += [tuple(rng.choice(tensors if torch.is_tensor(a) else ints) for a in base) for _ in range(100)]
    meta = {"APPROX_TANH": False, "BLOCK_M": 2, "BLOCK_N": 1024}
    specs, pointers = {}, {}
    for args in variants:
        key = specialization_key(args)
        specs.setdefault(key, set()).add(_triton_specialization(kernel, args, meta))
        pointers.setdefault(key, set()).add(tuple(a.data_ptr() for a in args if torch.is_tensor(a)))
    assert all(len(s) == 1 for s in specs.values()), [s for s in specs.values() if len(s) > 1]
    assert any(len(p) > 1 for p in pointers.values())  # different tensors did share keys: a real check


@pytest.mark.gpu
def test_launcher_fast_path_matches_triton():
    from tritonkit._launch import Launcher
    from tritonkit.ops.bias_gelu import _bias_gelu_fwd_kernel as kernel

    g = generator(41)
    x, b = random_tensor((4, 64), F32, "cuda", generator=g), random_tensor((64,), F32, "cuda", generator=g)
    outputs = [torch.full_like(x, math.nan) for _ in range(4)]
    meta = {"APPROX_TANH": True, "BLOCK_M": 4, "BLOCK_N": 64}
    launcher = Launcher(kernel)
    launcher((1, 1), *_fwd_arguments(x, b, outputs[0], 4, 64), **meta)  # compiles through Triton
    launcher((1, 1), *_fwd_arguments(x, b, outputs[1], 4, 64), **meta)  # the cached fast path
    kernel[(1, 1)](*_fwd_arguments(x, b, outputs[2], 4, 64), **meta)
    assert [type(entry) for entry in launcher._compiled.values()] == [tuple]
    assert torch.equal(outputs[0], outputs[2]) and torch.equal(outputs[1], outputs[2])
    torch.testing.assert_close(outputs[1], bias_gelu_reference(x, b, "tanh"))
    launcher((1, 1), *_fwd_arguments(x, b, outputs[3], 4, 64), **{**meta, "APPROX_TANH": False})
    torch.testing.assert_close(outputs[3], bias_gelu_reference(x, b, "none"))  # constexprs are keyed


@pytest.mark.parametrize("scratch", [None, (256, 128)], ids=["no-scratch", "scratch"])
@pytest.mark.parametrize("descriptors", [False, True], ids=["pointers", "descriptors"])
def test_the_lean_launch_calls_the_c_launcher_as_tritons_launcher_does(scratch, descriptors, monkeypatch):
    """_run_entry against Triton's own CudaLauncher.__call__ on the same compiled launch (a fake C
    entry point records its arguments): the same arguments in the same order, global scratch asked
    of the same allocator for the same bytes (per program, over the grid) where the kernel has any,
    and host TMA descriptors expanded by the C launcher's wrapper into the same arguments."""
    import triton
    from triton.backends.nvidia.driver import CudaLauncher, wrap_handle_tensordesc
    from triton.runtime import _allocation

    from tritonkit import _launch
    from tritonkit.ops.attention.fwd_sm90 import descriptor

    asked, calls = [], []

    def allocator(size, alignment, stream):
        asked.append((size, alignment, stream))
        return f"buffer of {size}"

    def c_launch(*args):
        calls.append(args)

    args, launch = ("x", 5, None), c_launch
    if descriptors:  # (desc, int, desc, constexpr): the wrapper Triton's CudaLauncher builds
        tensor = random_tensor((1, 2, 64, 64), BF16, "cpu", generator=generator(45))
        args = (descriptor(tensor, 64), 5, descriptor(tensor[:, :, 32:], 32))
        signature = {"a": "tensordesc<bf16[1, 1, 64, 64]>", "n": "i32", "b": "tensordesc<bf16[1, 1, 32, 64]>",
                     "BLOCK": "constexpr"}  # fmt: skip
        launch = wrap_handle_tensordesc(c_launch, signature, None)
    previous = _allocation._allocator.get()
    triton.set_allocator(allocator)
    try:
        per_program, alignment = scratch or (0, 1)
        runner = types.SimpleNamespace(
            launch=launch, num_ctas=1, global_scratch_size=per_program, global_scratch_align=alignment,
            profile_scratch_size=0, profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=True,
        )  # fmt: skip
        grid, stream, constexprs = (3, 2, 1), 99, (64,)
        # Triton's launch of a compiled kernel: the metadata, no launch hooks, then the arguments
        metadata_and_hooks = ("packed", None, None, None)
        CudaLauncher.__call__(runner, *grid, stream, "function", *metadata_and_hooks, *args, *constexprs)
        entry = (launch, "function", False, True, "packed", constexprs, scratch)
        _launch._run_entry(entry, grid, stream, args)
    finally:
        triton.set_allocator(previous)
    assert len(calls) == 2 and all(
        type(a) is type(b) and a is b or a == b for a, b in zip(*calls, strict=True)
    )
    if descriptors:  # each descriptor became its tensor, shape, strides and padding, twice
        assert len(calls[0]) == 13 + 2 * (1 + 4 + 4 + 1 + 4 + 4) + 2
    assert asked == ([(6 * 256, 128, 99)] * 2 if scratch else [])


def test_launcher_goes_through_triton_when_the_lean_path_is_off(monkeypatch):
    """_launch.LEAN = False sends a launch through the kernel's own ``kernel[grid](...)``, keys and
    caches untouched (the host benchmark's comparison, or a suspect ruled out)."""
    from tritonkit import _launch

    launched = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: launched.append((grid, args, meta))

    monkeypatch.setattr(_launch, "interpret", lambda: False)
    monkeypatch.setattr(_launch, "LEAN", False)
    launcher = _launch.Launcher(Kernel())
    launcher((4, 1), "x", 3, BLOCK=64)
    assert launched == [((4, 1), ("x", 3), {"BLOCK": 64})] and not launcher._compiled


@pytest.mark.gpu
def test_launcher_fast_path_allocates_global_scratch():
    """A kernel that builds tensor descriptors on the device (the linear kernel's TMA tile) needs
    global scratch memory: the fast path asks Triton's allocator for it, as Triton's launcher does,
    and computes what Triton's own launch computes."""
    from tritonkit._launch import launcher_of
    from tritonkit.ops.linear import matmul as mm

    g = generator(43)
    a = random_tensor((300, 256), torch.bfloat16, "cuda", generator=g)
    b = random_tensor((200, 256), torch.bfloat16, "cuda", generator=g)
    config = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3,
              "TMA": True, "PERSISTENT": 1}  # fmt: skip
    outputs = [torch.full((300, 200), math.nan, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    launches = [mm.matmul_launches(mm.matmul_problem(a, b, out), config)[0] for out in outputs]
    launches[0].run()  # compiles through Triton (or finds the kernel a test before compiled)
    launches[1].run()  # the cached fast path
    entry = launcher_of(launches[1].kernel).entry(launches[1].args, launches[1].meta)
    assert entry is not None and entry[-1] is not None  # launched directly, with its scratch
    launches[2].kernel[launches[2].grid](*launches[2].args, **launches[2].meta)
    assert torch.equal(outputs[0], outputs[2]) and torch.equal(outputs[1], outputs[2])
    torch.testing.assert_close(outputs[1].float(), a.float() @ b.float().t(), atol=0.25, rtol=2**-7)


@pytest.mark.gpu
def test_launcher_fast_path_passes_host_tma_descriptors():
    """A Gluon kernel over host TMA descriptors (the sm_90 attention forward) launches through the
    lean path once compiled, and computes what Triton's own launch computes, bit for bit."""
    from tritonkit._launch import launcher_of
    from tritonkit.ops.attention import fwd_sm90
    from tritonkit.ops.attention.common import attention_reference

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon attention forward needs an sm_90 GPU")
    g = generator(46)
    q, k, v = (random_tensor((2, 4, 200, 128), BF16, "cuda", generator=g) for _ in range(3))
    outputs = [
        (torch.full_like(q, math.nan), torch.full(q.shape[:3], math.nan, device="cuda")) for _ in range(3)
    ]
    launches = [fwd_sm90.launches(q, k, v, o, lse, scale=0.1, causal=True)[0] for o, lse in outputs]
    launches[0].run()  # compiles through Triton (or finds the kernel a test before compiled)
    launches[1].run()  # the cached fast path
    assert launcher_of(launches[1].kernel).entry(launches[1].args, launches[1].meta) is not None
    launches[2].kernel[launches[2].grid](*launches[2].args, **launches[2].meta)
    for o, lse in outputs[:2]:
        assert torch.equal(o, outputs[2][0]) and torch.equal(lse, outputs[2][1])
    reference = attention_reference(q.double(), k.double(), v.double(), causal=True, scale=0.1)
    torch.testing.assert_close(outputs[1][0].double(), reference, atol=2e-2, rtol=2e-2)


def test_precompile_submits_every_call_to_a_thread_pool_and_survives_failures(monkeypatch, caplog):
    import threading

    from triton.runtime import _async_compile

    from tritonkit import _launch

    monkeypatch.setattr(_launch, "interpret", lambda: False)  # the path a GPU takes
    monkeypatch.setattr(_launch.os, "cpu_count", lambda: 4)
    threads, seen = set(), []

    class Kernel:
        def warmup(self, *args, grid, **meta):
            mode = _async_compile.active_mode.get()  # Triton's compile-in-the-background switch
            assert mode is not None
            seen.append((grid, args, meta))

            def compile_one():
                threads.add(threading.current_thread().name)
                return "compiled"

            mode.submit(len(seen), compile_one, lambda kernel: None)

    kernel = Kernel()
    calls = [_launch.Launch("fwd", kernel, (i,), {"BLOCK": 16 * i}, grid=(i, 1)) for i in range(1, 7)]
    _launch.precompile(calls)
    assert seen == [(call.grid, call.args, call.meta) for call in calls] and len(threads) >= 1
    assert all(name != threading.current_thread().name for name in threads)

    class Broken:
        def warmup(self, *args, grid, **meta):
            raise RuntimeError("no driver")

    with caplog.at_level("INFO", logger="tritonkit"):
        _launch.precompile([_launch.Launch("fwd", Broken(), (), {}, grid=(1,))] * 2)  # logged, not raised
    assert "no driver" in caplog.text and "compiles at its launch" in caplog.text
    _launch.precompile(calls[:1])  # one call: nothing to overlap, compiled at its launch
    assert len(seen) == len(calls)


@pytest.mark.gpu
def test_precompile_fills_tritons_cache_before_the_first_launch():
    import triton

    from tritonkit._launch import Launch, Launcher, precompile
    from tritonkit.ops.bias_gelu import _bias_gelu_fwd_kernel

    kernel = triton.jit(_bias_gelu_fwd_kernel.fn)  # a fresh JITFunction: its caches start empty
    g = generator(43)
    x, b = random_tensor((8, 64), F32, "cuda", generator=g), random_tensor((64,), F32, "cuda", generator=g)
    metas = [{"APPROX_TANH": tanh, "BLOCK_M": m, "BLOCK_N": 64} for tanh in (True, False) for m in (4, 8)]
    launcher = Launcher(kernel)
    arguments = _fwd_arguments(x, b, torch.empty_like(x), 8, 64)
    precompile([Launch("fwd", kernel, arguments, m, grid=(2, 1)) for m in metas])
    compiled = kernel.device_caches[torch.cuda.current_device()][0]
    assert len(compiled) == len(metas)
    for meta in metas:
        y = torch.full_like(x, math.nan)
        launcher((8 // meta["BLOCK_M"], 1), *_fwd_arguments(x, b, y, 8, 64), **meta)
        expected = bias_gelu_reference(x, b, "tanh" if meta["APPROX_TANH"] else "none")
        torch.testing.assert_close(y, expected)
    assert len(compiled) == len(metas)  # the launches found every kernel compiled


@pytest.mark.gpu
def test_launcher_rejects_constexprs_out_of_order():
    from tritonkit._launch import Launcher
    from tritonkit.ops.bias_gelu import _bias_gelu_fwd_kernel as kernel

    g = generator(42)
    x, b = random_tensor((4, 64), F32, "cuda", generator=g), random_tensor((64,), F32, "cuda", generator=g)
    with pytest.raises(TypeError, match="trailing parameters"):
        Launcher(kernel)(
            (1, 1),
            *_fwd_arguments(x, b, torch.empty_like(x), 4, 64),
            APPROX_TANH=False,
            BLOCK_N=64,
            BLOCK_M=4,
        )


def test_worst_is_the_comparison_nearest_its_bound():
    from tritonkit.testing import Comparison, worst

    close = Comparison("y", err_kernel=0.9e-3, err_torch=1e-3, tolerance=1e-3)
    far_but_loose = Comparison("dw", err_kernel=0.5, err_torch=0.4, tolerance=1.0)
    assert worst([far_but_loose, close]) is close  # 90% of its bound against 50%
    broken = Comparison("dx", err_kernel=math.nan, err_torch=1e-3, tolerance=1e-3)
    assert worst([close, broken, far_but_loose]) is broken and not broken.passed
