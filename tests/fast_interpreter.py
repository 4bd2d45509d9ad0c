"""Six speed-ups of Triton's interpreter (3.6) for the test run, installed by ``conftest``; the kernels
compute what they compute without them (``test_fast_interpreter`` compares).

A pairwise ``tl.reduce``. The interpreter reduces with a combine function of the kernel's own
(anything but sum, min, max and the arg-reductions) one element at a time in Python: LayerNorm's
backward, which takes both of its row sums in one ``tl.reduce``, spent 22 of a test's 26 s there
on a row of 4097 entries. This one combines the two halves of the reduced axis as whole tensors
until one entry is left: log2(n) calls of the combine function, each vectorised over the block,
in the order a GPU's tree reduction takes (pairs of entries apart by a power of two) rather than
the interpreter's left to right.

One patching of the language a launch. The interpreter replaces every builtin of ``triton.language``
with an interpreted one when a launch starts, and again, from scratch, at every call of a jit helper
inside it (about 1.4 ms each): a norm's tuner test spent 17 of its 52 s there. Every helper sees the
same language modules, so inside a launch a helper's call patches only modules not patched yet.

A memo of the type of a tuple of integers. Every tensor the interpreter makes stores its shape as a
``tl.tuple`` of constexprs, whose type Triton builds anew (a type a value and a name string): 13%
of a softmax test's time under the profiler, 5% measured without it. Tuples of integers (shapes)
now share their types.

A memo of the numpy dtype of each Triton type. The interpreter builds a table of nineteen dtypes
to look one up, at every tensor it makes (about 16 us each; 7-23% of a kernel test's time under
the profiler).

A memo of a tensor's shape. Every tensor the interpreter makes (one an operation) turns its block
type's shape into a ``tl.tuple`` of constexprs and its element count into a constexpr, anew; tensors
of one shape now share them (nothing changes a tensor's shape in place).

A memo of a block type's shape checks. Each operation's result type is a new ``tl.block_type``,
whose shape Triton unwraps, checks (integers, powers of two, under the element limit) and names
again; a shape and element type checked once are now taken as checked. With the shape's memo,
test_softmax.py and test_attention.py on two workers took 58 s against 65.
"""

from __future__ import annotations

import math

import numpy as np
import triton.language as tl
from triton.runtime import interpreter

_SEQUENTIAL = interpreter.ReduceOps.generic_reduce  # kept for the test that compares the two


def pairwise_reduce(self, input):
    original_axis, axis = self.axis, 0 if self.axis is None else self.axis
    dtypes = [arg.dtype for arg in input]
    # the whole block when axis is None (Triton's own ``unravel`` flattens only a tuple's first)
    data = [arg.handle.data if self.axis is not None else arg.handle.data.ravel() for arg in input]
    while data[0].shape[axis] > 1:
        half = data[0].shape[axis] // 2
        low = [self.to_tensor(np.take(d, range(half), axis), t) for d, t in zip(data, dtypes, strict=True)]
        high = [
            self.to_tensor(np.take(d, range(half, 2 * half), axis), t)
            for d, t in zip(data, dtypes, strict=True)
        ]
        combined = self.combine_fn.fn(*low, *high)
        combined = combined if isinstance(combined, tuple) else (combined,)
        odd = [np.take(d, range(2 * half, d.shape[axis]), axis) for d in data]  # one entry or none
        data = [
            np.concatenate(
                [np.broadcast_to(c.handle.data, o.shape[:axis] + (half,) + o.shape[axis + 1 :]), o], axis
            ).astype(d.dtype)
            for c, o, d in zip(combined, odd, data, strict=True)
        ]
    results = []
    for d, t in zip(data, dtypes, strict=True):
        d = np.take(d, 0, axis)
        if self.keep_dims:
            d = np.expand_dims(d, axis) if original_axis is not None else d.reshape((1,))
        elif original_axis is None:
            d = d.item()
        results.append(self.to_tensor(d, t))
    return results


_PATCH_LANG = interpreter._patch_lang
_RUN_GRID = interpreter.GridExecutor.__call__
_launch = {"running": False, "patched": frozenset()}  # ids of the language modules patched so far


def _languages(fn) -> frozenset:
    """The language modules the interpreter patches for ``fn``: ``triton.language`` and its ``core``,
    where ``fn``'s module refers to them (a helper of Triton's own reaches ``core`` its kernel may not)."""
    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def patch_lang_once(fn):
    """``interpreter._patch_lang``, but only for language modules the running launch has not patched
    yet: other calls get None (which the interpreter's device-function call discards)."""
    languages = _languages(fn)
    if _launch["running"] and languages <= _launch["patched"]:
        return None
    scope = _PATCH_LANG(fn)
    if _launch["running"]:
        _launch["patched"] |= languages
    return scope


def run_grid(self, *args, **kwargs):
    _launch.update(running=True, patched=frozenset())
    try:
        return _RUN_GRID(self, *args, **kwargs)
    finally:
        _launch.update(running=False, patched=frozenset())


_GET_NP_DTYPE = interpreter._get_np_dtype
_np_dtypes: dict = {}


def np_dtype(tt_dtype):
    """``interpreter._get_np_dtype``, remembered by Triton type; a block's is its element's (block
    types are not hashable)."""
    if isinstance(tt_dtype, tl.block_type):
        tt_dtype = tt_dtype.element_ty
    try:
        return _np_dtypes[tt_dtype]
    except KeyError:
        found = _np_dtypes[tt_dtype] = _GET_NP_DTYPE(tt_dtype)
        return found
    except TypeError:  # a type that cannot be hashed: asked anew
        return _GET_NP_DTYPE(tt_dtype)


_TUPLE_TYPE = tl.core._type_for_tuple_values
_tuple_types: dict = {}


def tuple_type(values, fields=None):
    """``tl.core._type_for_tuple_values``, remembered for tuples of integers (constexpr or not; the
    key keeps bools apart from ints) and no field names; anything else is typed anew."""
    key = []
    for value in values:
        value = value.value if isinstance(value, tl.constexpr) else value
        if type(value) not in (int, bool):
            return _TUPLE_TYPE(values, fields)
        key.append((type(value), value))
    if fields is not None:
        return _TUPLE_TYPE(values, fields)
    key = tuple(key)
    found = _tuple_types.get(key)
    if found is None:
        found = _tuple_types[key] = _TUPLE_TYPE(values, fields)
    return found


_tensor_shapes: dict = {}


def tensor_init(self, handle, type):
    """``tl.tensor.__init__``, its shape tuple and element count shared by the tensors of a shape."""
    self.handle = handle
    self.type = type
    self.dtype = type.scalar
    dims = type.shape if type.is_block() else ()
    found = _tensor_shapes.get(dims)
    if found is None:
        found = _tensor_shapes[dims] = (
            tl.tuple([tl.constexpr(d) for d in dims]),
            tl.constexpr(math.prod(dims)),
        )
    self.shape, self.numel = found


_BLOCK_TYPE_INIT = tl.block_type.__init__
_block_shapes: dict = {}


def block_type_init(self, element_ty, shape):
    """``tl.block_type.__init__``, its shape's unwrapping, checks and name remembered by element type and
    shape: a list or ``tl.tuple`` (what Triton's takes) of integers; anything else, and an element type
    that cannot be hashed, goes through Triton's."""
    key = _block_key(element_ty, shape)
    found = _block_shapes.get(key) if key is not None else None
    if found is None:
        _BLOCK_TYPE_INIT(self, element_ty, shape)
        if key is not None:
            _block_shapes[key] = (self.shape, self.numel, self.name)
        return
    self.element_ty = element_ty
    self.shape, self.numel, self.name = found


def _block_key(element_ty, shape) -> tuple | None:
    if not isinstance(shape, (list, tl.tuple)):
        return None
    dims = tuple(d.value if isinstance(d, tl.constexpr) else d for d in shape)
    if not dims or any(type(d) is not int for d in dims):
        return None
    try:
        hash(element_ty)
    except TypeError:
        return None
    return element_ty, dims


def install() -> None:
    tl.tensor.__init__ = tensor_init
    tl.block_type.__init__ = block_type_init
    tl.core._type_for_tuple_values = tuple_type
    interpreter._get_np_dtype = np_dtype
    interpreter.ReduceOps.generic_reduce = pairwise_reduce
    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = run_grid
