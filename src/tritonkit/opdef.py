"""The glue between a family's host code and torch: one custom-op helper and one tensor check.

A family writes each kernel's host side as a destination-passing function: ``_forward(x, b, y)``
writes the outputs its caller allocated and returns None. :func:`op` registers that function as a
``tritonkit::`` custom op whose fake does nothing (the outputs exist already, so there is no shape
to infer), and returns a callable that calls the function directly when eager, skipping the
dispatcher (tens of microseconds of host time a call), and the custom op while torch.compile
traces. A family's one ``torch.autograd.Function``, whose forward and backward allocate outputs and
call such ops, then serves eager calls and compiled graphs alike (the shape of quack's
``torch_library_op``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import operator
from collections.abc import Callable, Iterator, Sequence

import torch

from tritonkit import _launch, tuning
from tritonkit._runtime import check_device
from tritonkit.dtypes import NAME_OF

_recorders: list[list] = []  # open recording_calls() blocks


def first_derivative_only(name: str) -> Callable[[Callable], Callable]:
    """Decorate an ``autograd.Function``'s backward, which records no graph of its own: under
    ``create_graph=True`` its gradients still depend on the forward's inputs (through what the
    forward saved), so differentiating them again raises, naming the op, instead of giving a second
    derivative of zero. (torch's ``once_differentiable`` raises only where the incoming gradients
    require grad: a softmax's second derivative through its saved output would read as zero.)"""
    message = (
        f"tritonkit.{name} has no second derivative: its gradient was computed under "
        "create_graph=True, and differentiating it again is not supported"
    ).encode()

    def decorate(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            with torch.no_grad():
                outputs = backward(ctx, *grads)
            if not (torch.is_grad_enabled() and any(ctx.needs_input_grad)):
                return outputs
            many = isinstance(outputs, tuple)
            outputs = outputs if many else (outputs,)
            given = [t for t in outputs if t is not None]
            # what the gradients depend on: the saved tensors (the inputs, or outputs computed from
            # them) and the incoming gradients, where they carry a graph. A node fed by them, not by
            # fresh leaves, lies on every path from the gradients to the inputs, so that
            # autograd.grad(..., inputs), jvp and hvp raise too, rather than prune it and read zero
            anchors = [
                t for t in (*ctx.saved_tensors, *grads) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if anchors:  # (detached: a gradient passed on as it came is the caller's, not ours to mark)
                detached = [t.detach() for t in given]
                marked = iter(_NoSecondDerivative.apply(message.decode(), detached, *anchors))
            else:
                raising = torch._C._functions.DelayedError(message, len(given))
                delayed = raising(*(_requiring_grad(t) for t in given))
                marked = iter(delayed if isinstance(delayed, tuple) else (delayed,))
            marked = tuple(next(marked) if t is not None else None for t in outputs)  # Nones stay None
            return marked if many else marked[0]

        return wrapper

    return decorate


class _NoSecondDerivative(torch.autograd.Function):
    """Passes a backward's gradients on as functions of ``anchors`` (what they depend on), and
    raises ``message`` where anything differentiates through them."""

    @staticmethod
    def forward(ctx, message: str, gradients: list, *anchors):
        ctx.message = message
        return tuple(gradients)

    @staticmethod
    def backward(ctx, *unused):
        raise RuntimeError(ctx.message)


def _requiring_grad(t):
    if t is None:
        return None
    t = t.detach()
    t.requires_grad_(True)
    return t


@contextlib.contextmanager
def recording_calls() -> Iterator[list[tuple[object, tuple]]]:
    """Within this block, each eager call of an op is appended as (custom op, arguments): what
    ``torch.library.opcheck`` needs to check the op on real arguments."""
    calls: list[tuple[object, tuple]] = []
    _recorders.append(calls)
    try:
        yield calls
    finally:
        _recorders.remove(calls)


def op(
    name: str,
    *,
    mutates: Sequence[str],
    replay: bool | Callable[[], tuple] = False,
    in_place: Sequence[str] = (),
) -> Callable[[Callable], Callable]:
    """Register the decorated destination-passing function as the custom op ``tritonkit::name``,
    writing the arguments named in ``mutates``; its parameters need type annotations (the schema is
    read from them). The returned callable has the custom op as ``.custom_op`` (for opcheck).

    ``in_place``: those of ``mutates`` that are the caller's own tensors (not outputs allocated for
    the call), whose version counters an eager call increments, as the dispatcher would: a tensor
    autograd saved before the write then raises at the backward rather than read the new values.

    ``replay`` declares that what the function does is exactly the kernels it launches (over its
    arguments, views of them and ``_launch.scratch`` workspace), and that they follow from its
    arguments' shapes, strides, dtypes and devices and its other arguments' values, and from what
    ``replay()`` returns where it is a function (the module switches the dispatch reads): an eager
    call like one seen before then replays the first's launches (``_launch.Plan``), skipping the
    function's Python (tens of microseconds of host time a call: its checks, its dispatch, its
    launch building)."""

    def register(fn: Callable) -> Callable:
        custom = torch.library.custom_op(f"tritonkit::{name}", fn, mutates_args=tuple(mutates))
        parameters = list(inspect.signature(fn).parameters)
        written = tuple(parameters.index(name) for name in in_place)
        custom.register_fake(_writes_outputs_only)
        switches = replay if callable(replay) else tuple
        plans: dict = {}
        if replay:
            tuning.CALL_MEMOS.append(plans)  # retuning forgets them with the configs they hold
            _PLANS.append(plans)

        @functools.wraps(fn)
        def call(*args):
            if torch.compiler.is_compiling():
                return custom(*args)
            for calls in _recorders:
                calls.append((custom, args))
            if not replay:
                fn(*args)
            else:
                _replayed_or_run(fn, plans, (*args, *switches()), args)
            for position in written:
                if args[position] is not None:
                    torch.autograd.graph.increment_version(args[position])

        call.custom_op = custom
        call.plans = plans
        return call

    return register


MAX_PLANS = 1024  # call signatures whose launches an op keeps
_PLANS: list[dict] = []  # each replaying op's plans


def forget_plans() -> None:
    """Empty every op's plans: the next call of each signature runs (and records) afresh, seeing
    module settings changed since (a test's)."""
    for plans in _PLANS:
        plans.clear()


def _replayed_or_run(fn: Callable, plans: dict, fields: tuple, args: tuple) -> None:
    """Replay the launches of a call like this one (``fields``: its arguments and switches), or run
    ``fn`` on ``args``, recording its launches as the signature's plan the first time, where the
    configs chosen now are final (not a stand-in until a tuning: ``tuning.choices_settled``)."""
    try:
        key = tuple(
            (a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else a for a in fields
        )
        plan = plans.get(key, False)  # False: not seen; None: seen, and not replayable
    except TypeError:  # an argument that cannot key a dict
        return fn(*args)
    if plan and plan.run(args):
        return None
    if plan is not False or not tuning.choices_settled():
        return fn(*args)
    with _launch.recording_launches() as recording:
        fn(*args)
    # a tensor written by torch as well (a zeroed accumulator, a sum copied out): no plan
    plan = None if recording.writes else _launch.Plan.record(recording.launches, args, recording.scratch)
    tuning.remember(plans, key, plan, MAX_PLANS)
    return None


def _writes_outputs_only(*args, **kwargs) -> None:
    """The fake of a destination-passing op: it returns nothing, and its outputs exist already."""
    return None


MAX_CHECKED = 256  # call signatures each checked_once check remembers


def checked_once(check: Callable[..., None], signature: Callable[..., tuple | None]) -> Callable[..., None]:
    """``check(*args)`` (an input check that raises or returns None), skipped where a call of the
    same ``signature(*args)`` passed it before: a few microseconds of host time a call of a training
    loop or a decode step. The signature holds everything the check reads: the tensors' geometry
    (``_launch.call_signature``), the options, and any flag it reads off a tensor (requires_grad).
    A signature that is None (``call_signature`` under torch.compile), unhashable or that fails on
    a bad argument checks the call, so that the check raises its own error. The returned function's
    ``passed`` holds the signatures seen (a test empties it)."""
    passed: dict = {}

    @functools.wraps(check)
    def checked(*args) -> None:
        try:
            key = signature(*args)
            if key is not None and key in passed:
                return
        except (AttributeError, TypeError):  # a non-tensor, an unhashable option: the check says
            key = None
        check(*args)
        if key is not None:
            if len(passed) >= MAX_CHECKED:
                passed.clear()
            passed[key] = True

    checked.passed = passed
    return checked


def finite(value) -> bool:
    """Whether a number is finite: ``math.isfinite``'s answer, in a form torch.compile can trace
    where it makes the number symbolic (``dynamic=True``), which math.isfinite breaks the graph on."""
    return value - value == 0  # NaN - NaN and inf - inf are NaN


def as_int(value) -> int | None:
    """``value`` as an int where it is an integer (an int, or a numpy or torch integer), else None:
    ``operator.index``'s answer, a float (which ``int`` would truncate) and a bool refused."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """(rows, last dim) view of t (a copy only where the strides allow no view); no -1, which a
    last dim of 0 leaves ambiguous (a reshape(-1, 0) raises). A 2-d tensor is its own: reshape
    would cost ~2 us of host time for the same view."""
    return t if t.dim() == 2 else t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def check_tensor(
    name: str,
    value,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    min_ndim: int = 0,
    device_of: tuple[str, torch.Tensor] | None = None,
) -> None:
    """Raise TypeError or ValueError naming ``name`` unless ``value`` is a tensor of one of ``dtypes``,
    with ``ndim`` (or at least ``min_ndim``) dimensions, on a device kernels run on, and on the device
    of ``device_of`` = (its name, the tensor) when given."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        allowed = ", ".join(NAME_OF.get(d, str(d)) for d in dtypes)
        raise TypeError(f"{name} must be one of {allowed}, got {value.dtype}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if value.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(value.shape)}")
    if device_of is not None:
        other, tensor = device_of
        if value.device != tensor.device:
            raise ValueError(f"{name} must be on {other}'s device {tensor.device}, got {value.device}")
    else:
        check_device(name, value)
