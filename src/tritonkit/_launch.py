"""The lean launch path: one dictionary lookup and one driver call per launch.

``kernel[grid](...)`` spends most of a short kernel's host time outside the launch itself: it
binds arguments, builds a string key, evaluates the grid, assembles launch metadata and calls
profiler hooks. :class:`Launcher` keeps Triton for the first launch of each specialization (it
compiles and returns the ``CompiledKernel``) and afterwards calls the compiled launcher's C entry
point directly with the cached function handle.

Correctness rests on the key: two calls that share a key must get the same compiled kernel.
:func:`specialization_key` keys on facts at least as fine as Triton's specialization (the tests
check it against Triton's own binder on the GPU), plus the constexprs and launch options.
Under the interpreter, and whenever a profiler hook is registered, calls go through Triton.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from tritonkit._runtime import empty_output, interpret

# keyword arguments of a launch that are compile options, not constexprs
LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_cooperative_grid"})
MAX_KEYS = 4096  # distinct specializations cached per kernel before the cache starts afresh
MAX_COMPILE_THREADS = 16  # threads compiling a tuner's candidates together (see precompile)
# False sends every launch through Triton's own ``kernel[grid](...)``: what the lean path saves,
# measured in one process (benchmarks/layer_diagnostics.py's host mode), or a suspect ruled out
LEAN = True

log = logging.getLogger("tritonkit")


GRID_YZ_MAX = 65535  # programs a launch grid's second and third dimensions hold (CUDA's limit)


class Launch(NamedTuple):
    """One kernel launch: what an op runs, a tuner times and ``tritonkit inspect`` compiles, built by
    the op's own launch code. A tuple, because an op builds one or two on every call (a frozen
    dataclass costs about a microsecond more to build)."""

    name: str  # what it is in the op: "fwd one-pass"
    kernel: object  # the @triton.jit (or @gluon.jit) function
    args: tuple  # runtime arguments as the op passes them (tensors may be on the "meta" device)
    meta: dict  # constexpr arguments and launch options (num_warps, num_stages)
    config: dict = {}  # the tuning config behind it, for display (never mutated)
    grid: tuple = ()  # programs along each axis, where the launch is to run (empty for inspection only)

    def run(self) -> None:
        """Launch it, through the kernel's lean :class:`Launcher`; a ValueError naming it where its
        grid's second or third dimension passes what a GPU launches (CUDA's "invalid argument")."""
        if len(self.grid) > 1 and max(self.grid[1:]) > GRID_YZ_MAX:
            raise ValueError(
                f"{self.name} ({getattr(self.kernel, '__name__', self.kernel)}): grid {self.grid} has more "
                f"than {GRID_YZ_MAX} programs on its second or third dimension, which no GPU launches"
            )
        launcher_of(self.kernel)(self.grid, *self.args, **self.meta)
        for recording in _recordings:
            recording.launches.append(self)


def next_power_of_2(n: int) -> int:
    """The least power of two at least ``n`` (1 for n <= 1); ``triton.next_power_of_2`` costs
    microseconds from Python, which launch builders pay on every call."""
    return 1 << max(0, n - 1).bit_length()


TMA_ALIGN_BYTES = 16  # a TMA descriptor's base and every stride but the innermost: multiples of this


def tma_ready(t: torch.Tensor) -> bool:
    """Whether ``t`` can be read and written through a TMA descriptor over its dims as they are: a
    unit last stride, and the base and the other strides multiples of TMA_ALIGN_BYTES."""
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and t.data_ptr() % TMA_ALIGN_BYTES == 0
        and all(s * size % TMA_ALIGN_BYTES == 0 for s in t.stride()[:-1])
    )


VECTOR_BYTES = 16  # the widest global access a thread makes


def row_align(values: tuple, element_size: int) -> int:
    """The ALIGN a row kernel takes (``tritonkit.jit.aligned``): the largest power of two of entries,
    at most VECTOR_BYTES of ``element_size``, dividing every one of ``values`` (a row's length, its
    tensors' row and outer strides); 1 where Triton knows as much already, every value a multiple
    of 16 (which it specializes), so that such launches compile as they would without ALIGN."""
    if all(value % 16 == 0 for value in values):
        return 1
    align = VECTOR_BYTES // element_size
    for value in values:
        while value % align:
            align //= 2
    return align


def row_window(
    n: int, views: Sequence[tuple[int, int]], tensors: Sequence[torch.Tensor], block_n: int | None = None
) -> int:
    """The WINDOW a row kernel takes (``jit.window_base``): VECTOR_BYTES of the narrowest dtype's
    entries, where rows of ``n`` contiguous entries with ``views``' (outer, row) strides do not all
    start on a vector (else 0: ALIGN's path has them whole), every tensor starts VECTOR_BYTES
    aligned, the views' strides agree modulo WINDOW (one head serves every tensor), and a row's
    window, up to WINDOW - 1 entries before it, fits the ``block_n`` entries of its tile (a kernel
    that walks a row in chunks gives none)."""
    window = VECTOR_BYTES // min(t.element_size() for t in tensors)
    strides = [stride for view in views for stride in view]
    if (
        all(value % window == 0 for value in (n, *strides))
        or block_n is not None
        and n + window - 1 > block_n
    ):
        return 0
    if any(t.data_ptr() % VECTOR_BYTES for t in tensors):
        return 0
    outer, row = views[0]
    if any((o - outer) % window or (r - row) % window for o, r in views):
        return 0
    return window


def row_span(n: int, window: int) -> int:
    """The positions a row of ``n`` entries covers read in windows of ``window`` entries (0: none):
    up to window - 1 before its first entry (``jit.window_span`` in a kernel)."""
    return n + max(window - 1, 0)


def cdiv(a: int, b: int) -> int:
    """Ceiling division (``triton.cdiv`` costs microseconds from Python: it unwraps constexprs)."""
    return -(-a // b)


def specialization_key(args: tuple) -> tuple:
    """A key that determines Triton's specialization of the runtime arguments.

    Triton specializes a pointer on its dtype and 16-byte alignment, and an integer on being 1,
    being divisible by 16 and its width. Keying on each integer's value and each pointer's dtype
    and address mod 16 refines that (never merges two specializations) and is cheap to build. A host
    TMA descriptor is specialized on its element type, its box and (Gluon's) its shared layout, not
    on its address, shape or strides, which the launch passes as values.
    """
    key = []
    for arg in args:
        if type(arg) is int:
            key.append(arg)
        elif isinstance(arg, torch.Tensor):
            key.append(arg.dtype)
            key.append(arg.data_ptr() & 15)
        elif arg is None or type(arg) in (bool, float):
            key.append((type(arg), arg if arg is None else 0))  # specialized on type only
        elif type(arg).__name__ == "TensorDescriptor":
            key.append((arg.base.dtype, tuple(arg.block_shape), getattr(arg, "layout", None), arg.padding))
        else:
            raise TypeError(f"cannot launch with an argument of type {type(arg).__name__}")
    return tuple(key)


def _device_tensor(args: tuple) -> torch.Tensor:
    """The launch's first tensor: the first tensor argument or the first descriptor's base."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg
        if type(arg).__name__ == "TensorDescriptor":
            return arg.base
    raise TypeError("a launch needs a tensor or tensor descriptor argument")


_THROUGH_TRITON = "through-triton"  # cache entry of kernels that need Triton's own launcher


class Launcher:
    """Launches one ``@triton.jit`` kernel; keyword arguments are constexprs and launch options.

    ``launcher(grid, *args, **meta)`` behaves like ``kernel[grid](*args, **meta)`` where ``grid``
    is a tuple of up to three ints. The first tensor argument (or the first host TMA descriptor's
    tensor) is on the device to launch on.
    Keyword constexprs must be the kernel's trailing parameters, in order (checked on first use).
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: dict[tuple, tuple | str] = {}
        self._occupancy: dict[tuple, int] = {}

    def __call__(self, grid: Sequence[int], *args, **meta) -> None:
        if interpret():
            self.kernel[grid](*args, **meta)
            return
        if not LEAN or _profiler_listens():  # a profiler's hook: let Triton report the launch
            self.kernel[grid](*args, **meta)
            return
        device = _device_tensor(args).get_device()
        if device != torch._C._cuda_getDevice():  # CUDA is initialised: args[0] lives there
            with torch.cuda.device(device):
                return self(grid, *args, **meta)
        key = _launch_key(device, args, meta)
        entry = self._compiled.get(key)
        if entry is None:
            if len(self._compiled) >= MAX_KEYS:
                self._compiled.clear()
            self._compiled[key] = self._compile_and_launch(grid, args, meta)
            return
        if entry is _THROUGH_TRITON:
            self.kernel[grid](*args, **meta)
            return
        _run_entry(entry, (*grid, 1, 1)[:3], torch._C._cuda_getCurrentRawStream(device), args)

    def entry(self, args: tuple, meta: dict) -> tuple | None:
        """What a launch with these arguments runs through (see :class:`Plan`): None before their
        first launch, or where they go through Triton's own launcher."""
        entry = self._compiled.get(_launch_key(_device_tensor(args).get_device(), args, meta))
        return None if entry is None or entry is _THROUGH_TRITON else entry

    def programs_per_sm(self, *args, **meta) -> int:
        """Programs of this launch that one SM holds at once: CUDA's occupancy of the kernel compiled
        for these arguments (compiled here if need be). A cooperative launch of more programs than
        this times the SMs fails; registers decide it, which only the compile knows."""
        first = next(a for a in args if isinstance(a, torch.Tensor))
        if interpret() or not first.is_cuda:  # nothing runs (meta tensors: an inspection's launch)
            return 1 << 30
        device = first.get_device()
        key = _launch_key(device, args, meta)
        if key not in self._occupancy:
            with torch.cuda.device(device):
                compiled = self.kernel.warmup(*args, grid=(1,), **meta)
                compiled._init_handles()
                self._occupancy[key] = _max_active_blocks(
                    compiled.function, 32 * compiled.metadata.num_warps, compiled.metadata.shared
                )
        return self._occupancy[key]

    def _compile_and_launch(self, grid, args: tuple, meta: dict) -> tuple | str:
        """Launch through Triton (compiling if needed) and return what later launches need."""
        compiled = self.kernel[grid](*args, **meta)
        constexpr_names = tuple(name for name in meta if name not in LAUNCH_OPTIONS)
        trailing = tuple(self.kernel.arg_names[len(args) :])
        if trailing != constexpr_names:
            raise TypeError(
                f"{self.kernel.__name__}: keyword arguments {list(constexpr_names)} must be the "
                f"kernel's trailing parameters {list(trailing)}, in order"
            )
        runner = compiled.run  # the module is loaded on this device and the C launcher built
        if runner.profile_scratch_size > 0:
            return _THROUGH_TRITON  # profiling scratch: Triton's wrapper asks its own allocator
        # runner.launch is the C entry point, wrapped where the kernel takes host TMA descriptors:
        # the wrapper turns each into the CUtensorMap, shape and strides the kernel takes
        constexpr_values = tuple(meta[name] for name in constexpr_names)  # the same for the key
        # global scratch (tensor descriptors built on the device): bytes a program, and alignment
        scratch = (runner.global_scratch_size * runner.num_ctas, runner.global_scratch_align)
        return (
            runner.launch,
            compiled.function,
            runner.launch_cooperative_grid,
            runner.launch_pdl,
            compiled.packed_metadata,
            constexpr_values,
            scratch if runner.global_scratch_size > 0 else None,
        )


@functools.cache
def _launch_hooks() -> tuple:
    from triton import knobs

    return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook


def _profiler_listens() -> bool:
    """Whether a launch hook is registered (a profiler): launches then go through Triton, which calls it."""
    enter, leave = _launch_hooks()
    return bool(enter.calls or leave.calls)


def _launch_key(device: int, args: tuple, meta: dict) -> tuple:
    """The Launcher's key of a launch: what its compiled kernel and launcher entry follow from."""
    return (device, tuple(meta), *meta.values(), *specialization_key(args))


def _run_entry(entry: tuple, grid: tuple, stream: int, args) -> None:
    """Launch a compiled kernel through its cached entry (``Launcher._compile_and_launch``) on a grid
    of three ints."""
    launch, function, cooperative, pdl, packed_metadata, constexpr_values, scratch = entry
    workspace = None
    if scratch is not None:  # as Triton's launcher asks its allocator: per program, over the grid
        per_program, alignment = scratch
        workspace = _allocator().get()(grid[0] * grid[1] * grid[2] * per_program, alignment, stream)
    launch(*grid, stream, function, cooperative, pdl, workspace, None, packed_metadata, None, None, None,
           *args, *constexpr_values)  # fmt: skip


@functools.cache
def _allocator():
    """Triton's allocator of global scratch (a context variable: :func:`ensure_allocator` sets it)."""
    from triton.runtime import _allocation

    return _allocation._allocator


class Recording(NamedTuple):
    """What an op call did, for :meth:`Plan.record`: the launches it ran, in order; the workspace it
    took from :func:`scratch` (a tensor's id -> whether it was zeroed); and the torch functions that
    wrote into an existing tensor meanwhile (``zero_``, ``copy_``, ``out=``), which a plan would not
    replay. The launches hold the tensors, so the ids stay theirs while the recording lives."""

    launches: list
    scratch: dict
    writes: list


_recordings: list[Recording] = []  # open recording_launches() blocks


class _WriteWatch(torch.overrides.TorchFunctionMode):
    """Notes each torch function that writes into a tensor it is given, while a recording is open."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _recordings:
            name = getattr(func, "__name__", "")
            if (name.endswith("_") and not name.endswith("__")) or name == "__setitem__" or "out" in kwargs:
                for recording in _recordings:
                    recording.writes.append(name)
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording_launches() -> Iterator[Recording]:
    """Within this block, each launch run, each :func:`scratch` tensor taken and each torch function
    that writes into a tensor is recorded."""
    recording = Recording([], {}, [])
    _recordings.append(recording)
    try:
        with _WriteWatch():
            yield recording
    finally:
        _recordings.remove(recording)


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Within this block nothing is recorded (a tuner's trial launches are no part of the call's)."""
    kept = _recordings[:]
    _recordings.clear()
    try:
        yield
    finally:
        _recordings[:] = kept


def scratch(shape, dtype: torch.dtype, device, *, zeroed: bool = False) -> torch.Tensor:
    """A launch's workspace, empty (NaN while tests poison outputs) or zeroed: a :class:`Plan` that
    records it allocates its like afresh on each replay (an op's other allocations are no part of a
    plan, which then cannot be)."""
    with unrecorded():  # (the poisoning's fill is the allocation's, which a replay repeats)
        t = _workspace(shape, dtype, device, zeroed)
    for recording in _recordings:
        recording.scratch[id(t)] = zeroed
    return t


def _workspace(shape, dtype: torch.dtype, device, zeroed: bool) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device) if zeroed else empty_output(shape, dtype, device)


def call_signature(tensors: Sequence[torch.Tensor | None], *options) -> tuple | None:
    """What a memo of calls (validated inputs, a :class:`Plan`) is keyed by: each tensor's shape,
    strides, dtype and device (None where absent), then ``options``; None under torch.compile (the
    trace runs once) or where an argument is not a tensor (the input check says which)."""
    if torch.compiler.is_compiling():
        return None
    try:
        geometry = tuple((t.shape, t.stride(), t.dtype, t.device) if t is not None else None for t in tensors)
    except AttributeError:
        return None
    return (*geometry, *options)


class HostDescriptor(NamedTuple):
    """A host TMA descriptor over a whole tensor, as a replayed :class:`Plan` passes it: the fields
    Triton's launcher reads to fill the CUtensorMap (the box and shared layout are compiled into the
    kernel), without the Python checks of building Triton's own (about 2 us each)."""

    base: torch.Tensor
    shape: torch.Size
    strides: tuple
    padding: str


class Plan:
    """The launches of one call signature, replayed with each later call's tensors.

    An op whose launches follow from its call's signature alone (shapes, strides, dtypes, devices and
    options: every integer and float argument, every constexpr) records them after their first run;
    a later call of the signature puts its tensors' addresses in the recorded places (views of them
    at the recorded offsets, host TMA descriptors over them, fresh :func:`scratch` workspace where
    the call took some) and calls each compiled kernel's launcher at once, with no launch builder's
    Python and no Launcher key. Triton specializes a pointer on its 16-byte alignment, which a
    signature does not fix: where a tensor aligns otherwise than the recorded one, or a profiler
    listens, or another device is current, or the lean path is off, or an op is recording its call,
    :meth:`run` launches nothing and returns False, and the caller launches the ordinary way.
    """

    __slots__ = ("_alignments", "_device", "_scratch", "_steps")

    def __init__(self, device: int, alignments: tuple, scratch: tuple, steps: tuple):
        self._device, self._alignments, self._scratch, self._steps = device, alignments, scratch, steps

    @staticmethod
    def record(launches: Sequence[Launch], tensors: tuple, scratch: dict | None = None) -> Plan | None:
        """The plan of ``launches``, which have run, over the call's ``tensors`` (entries that are
        not tensors are skipped) and the ``scratch`` they took (a :class:`Recording`'s); None where
        it cannot be one: no launch, under the interpreter, one tensor given twice or two sharing
        memory where a launch reads a view of either, a launch reading a
        tensor that is neither among ``tensors`` nor scratch nor a view of one (a copy its builder
        made), a descriptor over part of one, or a launch through Triton's own launcher. It holds
        no tensor."""
        if interpret() or not launches:
            return None
        given = {i: t for i, t in enumerate(tensors) if isinstance(t, torch.Tensor)}
        if len({id(t) for t in given.values()}) < len(given) or not given:
            return None  # one tensor in two places: a later call's two may differ
        work = {id(t): t for launch in launches for t in _tensors_of(launch) if id(t) in (scratch or {})}
        bases = {**{id(t): i for i, t in given.items()}, **{k: len(tensors) + j for j, k in enumerate(work)}}
        memory = _storages({**{i: t for i, t in given.items()}, **{bases[k]: t for k, t in work.items()}})
        steps = []
        for launch in launches:
            entry = launcher_of(launch.kernel).entry(launch.args, launch.meta)
            if entry is None:
                return None
            args, places = list(launch.args), []
            for position, arg in enumerate(args):
                place = _place(arg, bases, memory, tensors, work)
                if place is False:
                    return None
                if place is not None:
                    places.append((position, *place))
                    args[position] = None
            steps.append((entry, (*launch.grid, 1, 1)[:3], tuple(args), tuple(places)))
        alignments = tuple((i, t.data_ptr() & 15) for i, t in given.items())
        workspace = tuple((tuple(t.shape), t.dtype, scratch[k]) for k, t in work.items())
        return Plan(next(iter(given.values())).get_device(), alignments, workspace, tuple(steps))

    def run(self, tensors: tuple) -> bool:
        """Launch the recorded kernels over ``tensors`` (in the recorded order); False, launching
        nothing, where they cannot be (the class's docstring says when)."""
        device = self._device
        if _recordings or not LEAN or _profiler_listens() or torch._C._cuda_getDevice() != device:
            return False  # (an op recording its call needs an inner op's launches run as launches)
        for i, alignment in self._alignments:
            if tensors[i].data_ptr() & 15 != alignment:
                return False
        if self._scratch:  # (no recording is open: a replay's workspace is no launch's to record)
            home = tensors[self._alignments[0][0]].device  # (the device as torch names it)
            work = (_workspace(shape, dtype, home, zeroed) for shape, dtype, zeroed in self._scratch)
            tensors = (*tensors, *work)
        stream = torch._C._cuda_getCurrentRawStream(device)
        for entry, grid, recorded, places in self._steps:
            args = list(recorded)
            for position, source, offset, padding in places:
                t = tensors[source]
                args[position] = (
                    t.data_ptr() + offset
                    if padding is None
                    else HostDescriptor(t, t.shape, t.stride(), padding)
                )
            _run_entry(entry, grid, stream, args)
        return True


def _tensors_of(launch: Launch) -> Iterator[torch.Tensor]:
    """The tensors a launch reads: its tensor arguments and its host descriptors' bases."""
    for arg in launch.args:
        if isinstance(arg, torch.Tensor):
            yield arg
        elif type(arg).__name__ == "TensorDescriptor":
            yield arg.base


def _storages(bases: dict) -> dict:
    """Each memory's address -> the one base (a call tensor's index or a workspace's) on it, or None
    where two share it (a view of either is then ambiguous)."""
    memory: dict = {}
    for source, t in bases.items():
        address = t.untyped_storage().data_ptr()
        memory[address] = None if address in memory else source
    return memory


def _place(arg, bases: dict, memory: dict, tensors: tuple, work: dict) -> tuple | bool | None:
    """Where a recorded launch argument comes from in a later call: (source, byte offset, None) for
    a pointer into a call tensor or a workspace (a view of it: its address at the offset), (source,
    0, padding) for a host descriptor over the whole of one, None for a value kept as recorded,
    False for what a plan cannot replay. Sources number the call's tensors, then the workspace."""
    if isinstance(arg, torch.Tensor):
        source = bases.get(id(arg))
        if source is None:
            source = memory.get(arg.untyped_storage().data_ptr())
            if source is None:
                return False  # a copy, or a view of memory two bases share
        return source, arg.data_ptr() - _base(source, tensors, work).data_ptr(), None
    if type(arg).__name__ != "TensorDescriptor":
        return None
    base, source = arg.base, bases.get(id(arg.base))
    whole = tuple(arg.shape) == tuple(base.shape) and tuple(arg.strides) == base.stride()
    return (source, 0, arg.padding) if whole and source is not None else False


def _base(source: int, tensors: tuple, work: dict) -> torch.Tensor:
    return tensors[source] if source < len(tensors) else list(work.values())[source - len(tensors)]


def _max_active_blocks(function: int, threads: int, shared_bytes: int) -> int:
    """cuOccupancyMaxActiveBlocksPerMultiprocessor of a loaded kernel (a CUfunction handle)."""
    blocks = ctypes.c_int()
    status = _libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(function), ctypes.c_int(threads), ctypes.c_size_t(shared_bytes)
    )
    if status != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed with CUDA error {status}")
    return blocks.value


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


@functools.cache
def launcher_of(kernel) -> Launcher:
    """The one :class:`Launcher` of a ``@triton.jit`` kernel, shared by every launch of it."""
    return Launcher(kernel)


def precompile(calls: Sequence[Launch]) -> None:
    """Compile the kernels of ``calls`` together, launching none.

    Triton compiles one kernel at a time on first launch, and a tuner's candidates each need their
    own compile (about half a second each for a softmax config). Triton's compiler releases the GIL
    in its passes and runs ptxas as a process, so threads overlap the compiles; later launches find
    the kernels in Triton's cache. Only a speed-up: a kernel that fails to compile here is compiled
    (and fails) again at its launch, where the caller sees the error.
    """
    workers = min(len(calls), os.cpu_count() or 1, MAX_COMPILE_THREADS)
    if interpret() or workers < 2:
        return
    from concurrent.futures import ThreadPoolExecutor

    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # a Triton without asynchronous compilation: kernels compile at launch
        return
    try:
        with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool, ignore_errors=True):
            for call in calls:
                call.kernel.warmup(*call.args, grid=call.grid, **call.meta)
    except Exception as error:  # noqa: BLE001 - compiling ahead is optional; the launch compiles too
        log.info(
            "tritonkit: compiling %d kernels ahead failed (%s: %s); each compiles at its launch",
            len(calls),
            type(error).__name__,
            error,
        )


def ensure_allocator() -> None:
    """Kernels that build tensor descriptors on the device need global scratch memory, which Triton
    asks an allocator for at launch: torch's caching allocator, unless the caller has set one."""
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")  # 256-byte aligned, as torch allocates
