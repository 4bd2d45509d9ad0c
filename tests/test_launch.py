"""The lean launch path (``tritonkit._launch``): its specialization keys against Triton's, its call of
the compiled C launcher against Triton's own, and its launches against Triton's, bit for bit."""

from __future__ import annotations

import math
import random
import types

import pytest
import torch

from tritonkit._launch import specialization_key
from tritonkit.ops.bias_gelu import bias_gelu_reference
from tritonkit.testing import generator, random_tensor

pytestmark = pytest.mark.infra

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

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
    meta = {"APPROX_TANH": False, "BLOCK_M": 2, "BLOCK_N": 1024, "ALIGN": 1}
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
    meta = {"APPROX_TANH": True, "BLOCK_M": 4, "BLOCK_N": 64, "ALIGN": 1}
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
    metas = [
        {"APPROX_TANH": tanh, "BLOCK_M": m, "BLOCK_N": 64, "ALIGN": 1}
        for tanh in (True, False)
        for m in (4, 8)
    ]
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
            ALIGN=1,
        )


def test_a_grid_past_the_second_and_third_dimensions_limit_is_refused_by_name():
    """CUDA launches at most 65535 programs on a grid's second and third dimensions; past that a
    launch fails as "invalid argument" (bias_gelu's backward did, at 107774 column blocks): a Launch
    says which it is and why, before compiling anything; the first dimension holds 2^31 - 1."""
    from tritonkit._launch import GRID_YZ_MAX, Launch

    for grid in ((1, GRID_YZ_MAX + 1), (1, 1, GRID_YZ_MAX + 1)):
        with pytest.raises(ValueError, match=r"^bwd \(no_kernel\): grid .* more than 65535 programs"):
            Launch("bwd", "no_kernel", (), {}, grid=grid).run()
    assert GRID_YZ_MAX == 65535
