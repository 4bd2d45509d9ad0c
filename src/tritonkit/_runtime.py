"""GPU or interpreter: decided once, before any kernel is defined.

With a CUDA GPU, kernels compile and run natively on CUDA tensors. Without one, every kernel runs
through Triton's interpreter on CPU tensors: ``TRITON_INTERPRET=1`` must be in the environment
before ``@triton.jit`` runs, because the decorator picks the interpreter at definition time. So
Triton's own library functions (``tl.zeros``, ``tl.sum``) are decorated when ``triton`` is first
imported, so the choice must be made before that import: every tritonkit module that imports
triton calls :func:`interpret` first. ``import tritonkit`` queries no device and defines no kernel;
it decides only where no device need be asked (:func:`decide_early`), so that a first use under
``torch.compile``, which imports triton itself, finds the choice made.

``TRITONKIT_INTERPRET=1`` forces the interpreter (CUDA tensors are then copied to the host and
back by Triton); ``TRITONKIT_INTERPRET=0`` forces native compilation.
"""

from __future__ import annotations

import functools
import logging
import os
import sys

log = logging.getLogger("tritonkit")

OVERRIDE_ENV = "TRITONKIT_INTERPRET"
TRITON_ENV = "TRITON_INTERPRET"
_interpreting: bool | None = None  # interpret()'s answer once decided: a plain global torch.compile can read


@functools.cache
def interpret() -> bool:
    """True when kernels run in Triton's interpreter. Decided on first call, logged once."""
    override = os.environ.get(OVERRIDE_ENV)
    if override is not None:
        if override not in ("0", "1"):
            raise ValueError(f"{OVERRIDE_ENV} must be '0' or '1', got {override!r}")
        use_interpreter, reason = override == "1", f"{OVERRIDE_ENV}={override}"
    elif os.environ.get(TRITON_ENV) == "1":
        use_interpreter, reason = True, f"{TRITON_ENV}=1"
    else:
        import torch

        use_interpreter = not torch.cuda.is_available()
        reason = "no CUDA GPU found" if use_interpreter else "CUDA GPU found"
    # Triton reads this variable whenever a kernel is defined: it must agree with our choice.
    os.environ[TRITON_ENV] = "1" if use_interpreter else "0"
    if use_interpreter and _triton_imported_for_gpu():
        raise RuntimeError(
            "triton was imported before tritonkit chose the interpreter, so its library functions "
            "were built for the GPU: set TRITON_INTERPRET=1 in the environment before anything "
            "imports triton, or import tritonkit before triton (and before torch.compile runs)"
        )
    global _interpreting
    _interpreting = use_interpreter
    if use_interpreter:
        log.info("tritonkit: kernels run in Triton's interpreter on the CPU (%s)", reason)
    else:
        log.info("tritonkit: kernels compile for the GPU (%s)", reason)
    return use_interpreter


def decide_early() -> None:
    """Make :func:`interpret`'s choice now where it needs no device query: a forcing variable is set,
    or torch is built without a GPU backend (the interpreter, then). Called by ``import tritonkit``;
    not once triton is imported (the first op then says what went wrong, rather than the import)."""
    override = os.environ.get(OVERRIDE_ENV)
    # (an override that is neither 0 nor 1 is left for the first op to refuse by name)
    if "triton" in sys.modules or interpret.cache_info().currsize or override not in (None, "0", "1"):
        return
    forced = override is not None or os.environ.get(TRITON_ENV) == "1"
    if forced or not _torch_has_gpu_backend():
        interpret()


def _torch_has_gpu_backend() -> bool:
    import torch

    return torch.backends.cuda.is_built() or torch.version.hip is not None


def _triton_imported_for_gpu() -> bool:
    if "triton" not in sys.modules:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return not isinstance(sys.modules["triton"].language.standard.zeros, InterpretedFunction)


def check_device(name: str, tensor) -> None:
    """Natively, tensors must live on a CUDA device; the interpreter takes any device but meta. (Reads the
    decision as a global once made: torch.compile traces this, and cannot trace the deciding.)"""
    if tensor.is_meta:  # shapes only: a kernel (or the interpreter) would read memory that is not there
        raise ValueError(f"{name} is on the meta device, which holds no data: kernels need a CUDA tensor")
    if not tensor.is_cuda and not (_interpreting if _interpreting is not None else interpret()):
        raise ValueError(f"{name} must be a CUDA tensor, got one on {tensor.device}")


NOMINAL_SMS = 132  # the H200's SMs: what grids are sized for where no GPU says (interpreter, inspect)
NOMINAL_L2_BYTES = 50 * 2**20  # the H200's L2, likewise


@functools.cache
def capability(index: int) -> tuple[int, int]:
    """(major, minor) compute capability of CUDA device ``index``, queried once (launch paths ask on
    every call)."""
    import torch

    return torch.cuda.get_device_capability(index)


def sm_count(device) -> int:
    """Streaming multiprocessors of a torch device; NOMINAL_SMS off CUDA."""
    return _device_property(device, "multi_processor_count", NOMINAL_SMS)


def l2_bytes(device) -> int:
    """The L2 cache of a torch device, in bytes; NOMINAL_L2_BYTES off CUDA."""
    return _device_property(device, "L2_cache_size", NOMINAL_L2_BYTES)


def _device_property(device, name: str, nominal: int) -> int:
    import torch

    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda":
        return nominal
    return _cuda_property(torch.cuda.current_device() if device.index is None else device.index, name)


@functools.cache
def _cuda_property(index: int, name: str) -> int:
    """Asked once a GPU: the properties' lookup costs microseconds that ops pay on every call."""
    import torch

    return getattr(torch.cuda.get_device_properties(index), name)


NOMINAL_SHARED_BYTES = 227 * 1024  # the H200's shared memory a program may opt into, where no GPU says


@functools.cache
def shared_memory_bytes(device) -> int:
    """Shared memory one program may use on a torch device (its opt-in limit); NOMINAL_SHARED_BYTES off
    CUDA. What a tile prune compares a config's shared memory against."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return NOMINAL_SHARED_BYTES
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def current_device():
    """The current CUDA device, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Set only by tritonkit.testing.poisoned_outputs(): outputs start as NaN so that an element the
# kernel forgets to write fails the comparison instead of passing on leftover memory. Eager calls
# only (``_poisoning``): under torch.compile the flag would be traced into the graph, a second graph
# compiled for it, and that graph is not the one users run. On the GPU it was wrong besides: the
# fill on the outputs of the softmax ops' autograd function had AOTAutograd trace their backward
# into the forward graph with zero tangents (docs/perf-notes/softmax.md).
poison_outputs = False


def _poisoning() -> bool:
    import torch

    return not torch.compiler.is_compiling() and poison_outputs


def empty_output(shape, dtype, device):
    """Allocate a kernel's output (NaN-filled while tests poison eager calls' outputs)."""
    import torch

    out = torch.empty(shape, dtype=dtype, device=device)
    if _poisoning():
        out.fill_(float("nan"))
    return out


def empty_output_like(t, dtype=None):
    """``empty_output_like(t, dtype or t.dtype)``, contiguous, in about half its host time:
    ``torch.empty_like`` parses no shape and no device (0.8 against 1.6 us a call on a CPU)."""
    import torch

    out = torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format)
    if _poisoning():
        out.fill_(float("nan"))
    return out


def with_autograd(fn, *args):
    """``fn(*args)`` where autograd records. A tuner's reference takes its gradients by autograd, and
    inside a torch.library custom op's kernel (a call through ``torch.ops``: torch.compile's graphs,
    opcheck) the dispatcher has turned autograd off for the thread, which ``torch.enable_grad`` does
    not undo: outputs come out with no grad_fn. So ``fn`` runs with the dispatch keys a new thread
    starts with excluded, no others, in this thread. Not in a thread of its own: a backward's tuning
    on a GPU runs in autograd's CUDA worker thread, and another thread's gradients of CUDA tensors
    queue for that worker, which would be waiting on them (the gpu tests hung there)."""
    import torch

    include = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(include, _new_thread_exclude_set()), torch.enable_grad():
        return fn(*args)


@functools.cache
def _new_thread_exclude_set():
    """The dispatch keys a new thread starts with excluded (autocast's; autograd's are not)."""
    import concurrent.futures

    import torch

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(torch._C._dispatch_tls_local_exclude_set).result()
