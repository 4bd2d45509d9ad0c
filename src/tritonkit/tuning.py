"""Accuracy-gated autotuning with an on-disk cache, shared by every kernel family.

A config is a dict of kernel meta-parameters (``{"BLOCK_M": 4, "num_warps": 8}``). Speed alone
would pick a config that skips work, so each candidate is first run on a calibration input and
admitted only if its output matches the reference within the test oracle's tolerance; the
fastest admitted config wins. Winners are cached on disk, one JSON file per tuner, key, device,
Triton version and kernel-source hash, so an edited kernel or a new Triton tunes afresh. Winners
exported from the H200 (``tritonkit tune --export``) ship with the package in ``tuned/*.json``:
where this machine's cache has no entry, a shipped one for the same setting is used.

Tuning is opt-in: a key with no cached or shipped winner runs the tuner's default at once, unless
tuning is turned on (the environment variable TRITONKIT_AUTOTUNE=1, :func:`enabled`, or
``tritonkit tune``), when its first call tunes it. A tuning compiles every candidate (a tenth of
a second to over a second each, on all cores) and times each: seconds to tens of seconds a key,
which a first call should not stall on, and no bound of a few hundred milliseconds would leave
room to compare more than the default. Tuning launches and times kernels, which cannot happen
under the interpreter (one config is then always used and the disk cache is left alone), while
torch.compile traces, while a CUDA graph is being captured, or inside :func:`disabled`. In the
last three a cached winner is still used.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from tritonkit import kernel_sources
from tritonkit._runtime import interpret, with_autograd
from tritonkit.roofline import cache_dir

# What Triton prints to stdout when ptxas fails on a kernel, before it raises: a rule, the error, the
# whole PTX listing, a rule and a plea (triton/backends/nvidia/compiler.py, Triton 3.6)
_FAILURE_LISTING = re.compile(
    r"\n*={64}\n.*?please share the reproducer above with Triton project\.\n", re.DOTALL
)


@contextlib.contextmanager
def quiet_compile_failures() -> Iterator[None]:
    """Within this block Triton's listings of candidates that failed to compile stay off stdout (the
    tuner rejects each with a debug line); whatever else is printed meanwhile is passed on after it."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:  # (the rest is passed on even when the block raises)
        kept, dropped = _FAILURE_LISTING.subn("", captured.getvalue())
        if dropped:
            log.debug("tritonkit: %d listings of candidates that failed to compile left off stdout", dropped)
        if kept:
            sys.stdout.write(kept)


log = logging.getLogger("tritonkit")

FORMAT = 1  # bump when the file layout changes: older files are then ignored and rebuilt
SUBDIR = "tuning"
NAME_HASH_CHARS = 16  # 64 bits of sha256 in the file name: collisions are caught by the checks on read

_disabled_depth = 0  # > 0 inside disabled(); a counter so that nested blocks restore correctly
_enabled_depth = 0  # > 0 inside enabled()
AUTOTUNE_VARIABLE = "TRITONKIT_AUTOTUNE"  # "1": a key's first call tunes it (as enabled())
_unwritable_dirs: set[Path] = set()  # cache directories already warned about
_retuning = False  # True inside retuning(): stored winners are not read


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _single_config() -> bool:
    """Under the interpreter one config is always used: its timings say nothing about a GPU."""
    return interpret()


def autotune_on() -> bool:
    """Whether a key with no winner is tuned on its first call: inside :func:`enabled` or
    :func:`retuning`, or with TRITONKIT_AUTOTUNE on (1, true, on or yes; 0, false, off, no or empty:
    off; anything else raises, rather than count as on)."""
    return bool(_enabled_depth or _retuning) or _switch(AUTOTUNE_VARIABLE)


_ON, _OFF = ("1", "true", "on", "yes"), ("", "0", "false", "off", "no")


def _switch(variable: str) -> bool:
    """An on/off environment variable's value (unset: off); ValueError naming it where it is neither."""
    given = os.environ.get(variable, "")
    if given.strip().lower() not in _ON + _OFF:
        raise ValueError(f"{variable} must be 1 or 0 (true/false, on/off, yes/no), got {given!r}")
    return given.strip().lower() in _ON


def choices_settled() -> bool:
    """Whether a config chosen now is what later calls of its key get: tuning is off (a default
    stays until tuning is turned on, which forgets it), or it is on and can run now (a tuned or
    cached winner), not paused by a trace, a capture or :func:`disabled`."""
    return not autotune_on() or tuning_possible()


def tuning_possible() -> bool:
    """Whether kernels may be launched and timed now to pick a config."""
    if _single_config() or _disabled_depth or not autotune_on():
        return False
    # Tracing sees fake tensors, and a capturing stream records launches instead of running them.
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within this block nothing is tuned: cached winners are used, else each tuner's default."""
    global _disabled_depth
    _disabled_depth += 1
    try:
        yield
    finally:
        _disabled_depth -= 1


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """Within this block a key with no cached or shipped winner is tuned on its first call (and its
    winner cached on disk). The configs chosen for calls before it are looked up again."""
    global _enabled_depth
    forget_chosen()  # a default chosen while tuning was off would otherwise stay
    _enabled_depth += 1
    try:
        yield
    finally:
        _enabled_depth -= 1


@contextlib.contextmanager
def retuning() -> Iterator[None]:
    """Within this block each tuner tunes every key it meets once more, whatever this machine's cache
    or the shipped configs hold, and writes the new winner to the cache (``tritonkit tune --retune``)."""
    global _retuning
    previous, _retuning = _retuning, True
    for tuner in TUNERS.values():
        tuner.forget()
    forget_chosen()
    try:
        yield
    finally:
        _retuning = previous


def remember(memo: dict, signature, config: dict, limit: int) -> None:
    """Keep ``config`` as chosen for good for a call ``signature`` (an op's per-signature memo, which
    lets a repeated call skip its tuning key); the memo is emptied when ``limit`` have gathered."""
    if len(memo) >= limit:
        memo.clear()
    memo[signature] = config


TUNE_WARMUP_MS, TUNE_REP_MS = 5, 25  # per config: the median of do_bench's repetitions


def median_ms(call: Callable[[], object]) -> float:
    """Median ms of ``call()`` (one config on the real problem), the way every op's tuner times.
    Outputs it allocates are never NaN-filled while it is timed: a test's poisoning would time the
    fills."""
    import triton

    from tritonkit import _runtime

    previous, _runtime.poison_outputs = _runtime.poison_outputs, False
    try:
        return triton.testing.do_bench(call, warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS, return_mode="median")
    finally:
        _runtime.poison_outputs = previous


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _triton_version() -> str:
    interpret()  # decide before triton is imported
    import triton

    return triton.__version__


TUNERS: dict[str, Tuner] = {}  # the tuners defined so far, by name (each op module defines its own)


class Tuner:
    """Picks, per key, the fastest config whose output passes the accuracy gate."""

    def __init__(
        self,
        name: str,
        configs: Sequence[dict],
        *,
        sources: Sequence,
        default: Callable[[dict], dict],
        prune: Callable[[dict, dict], bool] | None = None,
    ):
        if not configs:
            raise ValueError(f"tuner {name!r} needs at least one config")
        self.name = name
        self.configs = [dict(c) for c in configs]
        self.sources = list(sources)
        self.default = default
        self.prune = prune
        self._memo: dict[str, dict] = {}  # canonical key -> entry (winner, timings, rejections)
        self._disk_checked: set[str] = set()  # keys whose cache file was already read (hit or miss)
        TUNERS.setdefault(name, self)  # the first of a name is the module's; later ones are copies

    @functools.cached_property
    def source_hash(self) -> str:
        """sha256 of the kernels with their jit closures (``kernel_sources.jit_closure``) and of the
        config list; read lazily, only when the disk is used."""
        digest = hashlib.sha256()
        texts = sorted({text for source in self.sources for text in kernel_sources.hashed_texts(source)})
        for text in texts + [_canonical(self.configs)]:
            digest.update(f"{len(text)}:{text}".encode())  # length prefix: no two splits hash alike
        return digest.hexdigest()

    def config(
        self,
        key: dict,
        *,
        admit: Callable[[dict], bool],
        time_ms: Callable[[dict], float],
        precompile: Callable[[list[dict]], None] | None = None,
    ) -> dict:
        """The config to launch with for ``key`` (a JSON-able dict: shape bucket and dtype): the tuned
        or cached winner, else (under the interpreter, or where tuning cannot run) the default."""
        entry = self.entry(key, admit=admit, time_ms=time_ms, precompile=precompile)
        return self.default(key) if entry is None else entry["config"]

    def entry(
        self,
        key: dict,
        *,
        admit: Callable[[dict], bool],
        time_ms: Callable[[dict], float],
        precompile: Callable[[list[dict]], None] | None = None,
    ) -> dict | None:
        """The tuning of ``key``: {"config": winner, "ms": canonical config -> ms or None (rejected),
        "rejected": canonical config -> reason, "error": canonical config -> error against the
        reference}, from the memo, the disk cache or a tuning run now;
        None under the interpreter, or where tuning cannot run and nothing is cached.

        ``admit(config)`` returns whether the config's output passes the gate: a bool, or a
        :class:`tritonkit.testing.Comparison`, whose error is then kept in the entry's "error".
        ``precompile(candidates)``, if given, is called once before the candidates are admitted and
        timed, to compile their kernels together rather than one at a time."""
        if _single_config():
            return None
        memo_key = _canonical(key)
        if memo_key in self._memo:
            return self._memo[memo_key]
        if memo_key not in self._disk_checked:
            self._disk_checked.add(memo_key)
            if (cached := self._read(key)) is not None:
                self._memo[memo_key] = cached
                return cached
        if not tuning_possible():
            return None
        entry = self._tune(key, admit, time_ms, precompile)
        self._write(key, entry)
        self._memo[memo_key] = entry
        return entry

    def forget(self) -> None:
        """Drop what this process remembers of its keys, so the next lookup reads or tunes again."""
        self._memo.clear()
        self._disk_checked.clear()

    def _identity(self, key: dict) -> dict:  # the fields of IDENTITY_FIELDS, in that order
        return {
            "tuner": self.name,
            "key": key,
            "device": _device_name(),
            "triton": _triton_version(),
            "source_hash": self.source_hash,
        }

    def _path(self, identity: dict) -> Path:
        return _entry_path(identity)

    def _candidates(self, key: dict) -> list[dict]:
        """The configs the prune function keeps, and the key's default whatever prune says (it is the
        fallback wherever tuning cannot run, so it must pass the gate too)."""
        default = dict(self.default(key))
        kept = [c for c in self.configs if c == default or not (self.prune and self.prune(c, key))]
        return kept if default in kept else [*kept, default]

    def _tune(self, key: dict, admit: Callable, time_ms: Callable, precompile: Callable | None) -> dict:
        with quiet_compile_failures():
            return self._tune_candidates(key, admit, time_ms, precompile)

    def _tune_candidates(
        self, key: dict, admit: Callable, time_ms: Callable, precompile: Callable | None
    ) -> dict:
        ms: dict[str, float | None] = {}
        rejected: dict[str, str] = {}
        errors: dict[str, float] = {}  # error against the reference, where admit reports one
        candidates = self._candidates(key)
        if precompile is not None:
            try:
                precompile(candidates)
            except Exception as error:  # only a speed-up: each candidate still compiles when it runs
                log.info(
                    "tritonkit: %s could not compile its candidates ahead (%s: %s)",
                    self.name,
                    type(error).__name__,
                    error,
                )
        for config in candidates:
            name = _canonical(config)
            ms[name] = None
            try:
                verdict = admit(config)
                if hasattr(verdict, "err_kernel"):  # a testing.Comparison: keep its error
                    errors[name] = float(verdict.err_kernel)
                if not (verdict.passed if hasattr(verdict, "passed") else verdict):
                    rejected[name] = "output does not match the reference"
                    continue
                elapsed = float(time_ms(config))
                if not math.isfinite(elapsed) or elapsed < 0:
                    raise ValueError(f"time_ms returned {elapsed}")
                ms[name] = elapsed
            except Exception as error:  # a compile error ("out of resources") rejects only this config
                rejected[name] = f"{type(error).__name__}: {error}"
            if name in rejected:
                log.debug("tritonkit: %s %s rejects %s: %s", self.name, key, name, rejected[name])
        timed = {name: t for name, t in ms.items() if t is not None}
        if not timed:
            reasons = "".join(f"\n  {name}: {reason}" for name, reason in rejected.items())
            raise RuntimeError(
                f"tuner {self.name!r}: no config admitted for key {key} "
                f"({len(self.configs) + 1 - len(candidates)} pruned):{reasons}"
            )
        best = min(timed, key=timed.__getitem__)
        winner = next(c for c in candidates if _canonical(c) == best)
        log.info(
            "tritonkit: tuned %s for %s: %s in %.4f ms (%d of %d configs rejected, %d pruned)",
            self.name,
            key,
            best,
            timed[best],
            len(rejected),
            len(candidates),
            len(self.configs) + 1 - len(candidates),
        )
        return {"config": winner, "ms": ms, "rejected": rejected, "error": errors}

    def _read(self, key: dict) -> dict | None:
        """The cached entry (winner, timings, errors, rejections) from this machine's cache, else from
        the configs the package ships; None when neither holds a usable one for this setting."""
        if _retuning:
            return None
        identity = self._identity(key)
        path = self._path(identity)
        candidates = self._candidates(key)
        for source, entry in (("cache", _load(path)), ("shipped", _shipped().get(path.name))):
            if entry is None:
                continue
            problem = _entry_problem(entry, identity, candidates)
            if problem:
                log.info("tritonkit: ignoring %s tuning entry %s: %s", source, path.name, problem)
                continue
            return {
                "config": next(c for c in candidates if c == entry["config"]),
                "ms": entry["ms"],
                "rejected": entry["rejected"],
                "error": entry.get("error", {}),
            }
        return None

    def _write(self, key: dict, result: dict) -> None:
        identity = self._identity(key)
        path = self._path(identity)
        try:
            _write_atomically(path, {"format": FORMAT, **identity, **result})
        except OSError as error:
            if path.parent not in _unwritable_dirs:
                _unwritable_dirs.add(path.parent)
                log.warning(
                    "tritonkit: cannot write the tuning cache in %s (%s); tuned configs are kept "
                    "in memory for this process only",
                    path.parent,
                    error,
                )


IDENTITY_FIELDS = ("tuner", "key", "device", "triton", "source_hash")  # what names an entry's file
SHIPPED_DIR = Path(__file__).resolve().parent / "tuned"  # pre-tuned exports shipped with the package


def _entry_path(identity: dict) -> Path:
    digest = hashlib.sha256(_canonical(identity).encode()).hexdigest()[:NAME_HASH_CHARS]
    return cache_dir() / SUBDIR / f"{identity['tuner']}-{digest}.json"


def _load(path: Path):
    """A cache file's JSON, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:  # ValueError covers bad JSON and bad UTF-8
        log.info("tritonkit: ignoring unreadable tuning cache %s (%s)", path, error)
        return None


@functools.cache
def _shipped() -> dict[str, dict]:
    """The pre-tuned entries the package ships (exports in SHIPPED_DIR), by cache file name: a first
    call on a GPU they were tuned on (same device, Triton and kernel sources) tunes nothing."""
    return {
        _entry_path({f: entry[f] for f in IDENTITY_FIELDS}).name: entry
        for listed in shipped_exports().values()
        for entry in listed
    }


def stale_shipped() -> list[str]:
    """Why each shipped entry of a defined tuner would be ignored on its own device and Triton (a
    kernel or the config list changed since it was tuned), as "file: tuner key: problem" lines."""
    problems = []
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        listed = _export_entries(_load(path))
        if listed is None:
            problems.append(f"{path.name}: not a format-{FORMAT} tuning export")
            continue
        for index, entry in enumerate(listed):
            tuner = TUNERS.get(entry.get("tuner")) if isinstance(entry, dict) else None
            if tuner is None:
                problems.append(f"{path.name}: entry {index} names no defined tuner")
                continue
            identity = tuner._identity(entry.get("key")) | {f: entry.get(f) for f in ("device", "triton")}
            problem = _entry_problem(entry, identity, tuner._candidates(entry["key"]))
            if problem:
                problems.append(f"{path.name}: {tuner.name} {_canonical(entry['key'])}: {problem}")
    return problems


def tuner_identities() -> dict[str, dict]:
    """Each defined tuner's source hash and canonical config list, by name: what :func:`rekey_shipped`
    compares between two versions of the package."""
    return {
        name: {"source_hash": tuner.source_hash, "configs": _canonical(tuner.configs)}
        for name, tuner in TUNERS.items()
    }


def rekey_shipped(before: dict[str, dict]) -> dict[str, int]:
    """Move the shipped entries tuned on an earlier version of the kernels onto this one, where the
    two versions differ in source text only (a rename, a helper moved, formatting): ``before`` is
    :func:`tuner_identities` of the earlier version. An entry is re-keyed only where its tuner's
    config list is the same in both and it carries the earlier hash; that the compiled kernels are
    the same is the caller's to show (``tritonkit inspect``'s SASS). Returns entries re-keyed per tuner."""
    moved: dict[str, int] = {}
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        bundle = _load(path)
        changed = False
        for entry in _export_entries(bundle) or []:
            tuner, earlier = TUNERS.get(entry.get("tuner")), before.get(entry.get("tuner"))
            if tuner is None or earlier is None or earlier["configs"] != _canonical(tuner.configs):
                continue
            if entry.get("source_hash") == earlier["source_hash"] != tuner.source_hash:
                entry["source_hash"] = tuner.source_hash
                moved[tuner.name] = moved.get(tuner.name, 0) + 1
                changed = True
        if changed:
            _write_atomically(path, bundle)
    _shipped.cache_clear()
    return moved


def _write_atomically(path: Path, entry: dict) -> None:
    """A reader sees the old file or the whole new one, never a part (OSError if it cannot)."""
    tmp_name = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", delete=False, dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
        ) as tmp:
            tmp_name = tmp.name
            json.dump(entry, tmp, indent=1, sort_keys=True)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)  # atomic on POSIX: concurrent tuners each land a whole file
        tmp_name = None
    finally:
        if tmp_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)


def _is_entry(entry) -> bool:
    """A whole current-format entry, as the tuner writes it: identity, winner, and every config's
    time (or None), rejection and error (an import lacking them broke every later tune --show)."""

    def table(name: str, *types: type) -> bool:  # (type(v) in types: a bool is no time)
        field = entry.get(name, {})
        return isinstance(field, dict) and all(
            isinstance(c, str) and type(v) in types for c, v in field.items()
        )

    return (
        isinstance(entry, dict)
        and entry.get("format") == FORMAT
        and all(isinstance(entry.get(f), str) for f in IDENTITY_FIELDS if f != "key")
        and isinstance(entry.get("key"), dict) and isinstance(entry.get("config"), dict)
        and "ms" in entry and "rejected" in entry
        and table("ms", int, float, type(None)) and table("rejected", str) and table("error", int, float)
    )  # fmt: skip


def cached_entries(since: float | None = None) -> list[dict]:
    """Every readable current-format entry in the cache (damaged files are skipped, as on lookup);
    with ``since`` (a time.time()), only those written since."""
    entries = []
    for path in sorted((cache_dir() / SUBDIR).glob("*.json")):
        try:
            if since is not None and path.stat().st_mtime < since:
                continue
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _is_entry(entry):
            entries.append(entry)
    return entries


def export_cache(path: Path, device: str | None = None) -> int:
    """Write the cached winners (of ``device`` only, if given) to one file; the number written."""
    entries = [e for e in cached_entries() if device is None or e["device"] == device]
    _write_atomically(Path(path), {"format": FORMAT, "entries": entries})
    return len(entries)


def read_export(path: Path) -> list[dict]:
    """The entries of the export at ``path``; ValueError naming the problem if it is not one."""
    try:
        bundle = json.loads(Path(path).read_text())
    except ValueError as error:
        raise ValueError(f"{path} is not a tuning export: {error}") from None
    entries = _export_entries(bundle)
    if entries is None:
        raise ValueError(f"{path} is not a format-{FORMAT} tuning export")
    for index, entry in enumerate(entries):
        if not _is_entry(entry):
            raise ValueError(f"{path}: entry {index} is not a format-{FORMAT} tuning entry")
    return entries


def shipped_exports() -> dict[str, list[dict]]:
    """The well-formed entries of each export the package ships, by file name."""
    exports = {}
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        listed = _export_entries(_load(path))
        if listed is None:
            log.warning("tritonkit: ignoring %s: not a format-%d tuning export", path, FORMAT)
            continue
        exports[path.name] = [e for e in listed if _is_entry(e)]
    return exports


def shipped_records(tuner: str) -> list[dict]:
    """The shipped entries of ``tuner``: each holds every candidate's time at its key, a record of
    how far any config (a default rule's, say) ran from that key's fastest."""
    return [e for entries in shipped_exports().values() for e in entries if e["tuner"] == tuner]


def time_over_fastest(entry: dict, config: dict) -> float | None:
    """``config``'s time in a tuning entry over the entry's fastest config; None where it was not timed."""
    times = [t for t in entry["ms"].values() if t]
    timed = entry["ms"].get(_canonical(config))
    return timed / min(times) if timed and times else None


def import_cache(path: Path) -> int:
    """Add the winners exported to ``path`` to this machine's cache; the number added. Entries keep
    their device, Triton version and kernel-source hash: they are used only where all three match."""
    entries = read_export(path)
    for entry in entries:
        _write_atomically(_entry_path({f: entry[f] for f in IDENTITY_FIELDS}), entry)
    return len(entries)


def _export_entries(bundle) -> list | None:
    """The entries of a tuning export (what export_cache writes), or None if it is not one."""
    entries = bundle.get("entries") if isinstance(bundle, dict) and bundle.get("format") == FORMAT else None
    return entries if isinstance(entries, list) else None


def _entry_problem(entry, identity: dict, configs: list[dict]) -> str | None:
    """Why a cache entry cannot be used, or None when it can."""
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        return f"not a format-{FORMAT} entry"
    for field, expected in identity.items():
        if _canonical(entry.get(field)) != _canonical(expected):
            return f"stored {field} {entry.get(field)!r} differs from {expected!r}"
    if entry.get("config") not in configs:
        return f"config {entry.get('config')!r} is not one of the current candidates"
    timings, rejected = entry.get("ms"), entry.get("rejected")
    if not (
        isinstance(timings, dict)
        and isinstance(rejected, dict)
        and all(ms is None or isinstance(ms, (int, float)) for ms in timings.values())
    ):
        return "its timings are not a map of configs to milliseconds"
    if _canonical(entry["config"]) not in timings:
        return "its winner has no timing"
    return None


def fastest(entry: dict, accept: Callable[[dict], bool]) -> dict | None:
    """The fastest admitted config of a tuning ``entry`` that ``accept`` takes, or None: one tuning
    over a family's configs answers for any subset of them (softmax's named kernel variants)."""
    timed = [(ms, json.loads(name)) for name, ms in entry["ms"].items() if ms is not None]
    accepted = [(ms, config) for ms, config in timed if accept(config)]
    return min(accepted, key=lambda pair: pair[0])[1] if accepted else None


# ---------------------------------------------------------------- a family's tuned kernel

Problem = dict  # a call's named tensors (inputs and outputs) and the scalars its launches need
TUNED: list[Tuned] = []  # every Tuned defined so far (retuning() empties their memos)
# Memos a family keeps of whole calls beside its Tuned (softmax's plans: the config and geometry of
# a call signature), registered so that forget_chosen() empties them with the Tuned memos.
CALL_MEMOS: list[dict] = []


def forget_chosen() -> None:
    """Empty every memo of chosen configs, so the next call of each op looks its config up again."""
    for tuned in TUNED:
        tuned.forget()
    for memo in CALL_MEMOS:
        memo.clear()


MAX_CHOSEN = 4096  # call signatures whose configs a Tuned keeps, so a repeated call skips its key


class Tuned:
    """One tuned kernel of a family: the accuracy gate, timing, ahead-of-time compiles and the memo of
    chosen configs, written once. The family supplies only what it knows:

    - ``tuner``: the configs, prune and default, defined beside the kernel;
    - ``launches(problem, config) -> [Launch]``: the launches that compute the problem's outputs with
      ``config`` (grids included; any workspace allocated inside);
    - ``calibrate(problem, config) -> Problem``: a small seeded problem of the same kind as ``problem``
      (dtypes, layout, flags) whose shape exercises the config's edges, such as a partial last block;
    - ``reference(problem) -> {name: tensor}``: the outputs in plain PyTorch. The gate calls it on the
      calibration problem with every floating tensor upcast to float64, and as it is (torch's own
      error in the dtype), and compares each output with the oracle's rule, keeping the worst;
    - ``outputs``: the names of the problem's outputs (an output that is None is skipped).
    """

    def __init__(
        self,
        tuner: Tuner,
        *,
        launches: Callable,
        calibrate: Callable,
        reference: Callable,
        outputs: Sequence[str],
    ):
        self.tuner = tuner
        self.launches = launches
        self.calibrate = calibrate
        self.reference = reference
        self.outputs = tuple(outputs)
        self._chosen: dict = {}  # call signature -> config chosen for good
        TUNED.append(self)

    def choose(
        self,
        key: dict | Callable[[], dict],
        problem: Problem | Callable[[], Problem],
        *,
        signature=None,
        pick: Callable[[dict | None], dict] | None = None,
    ) -> tuple[dict, bool]:
        """(config, final) for a call: the memo's answer for ``signature`` (default: the key's values),
        else the tuning of ``key`` (from the cache, the shipped configs or a tuning run on ``problem``),
        through ``pick`` (tuning entry or None -> config; default: the winner, else the tuner's default).
        Final configs (tuned, cached, or any under the interpreter) are remembered. ``key`` and
        ``problem`` may be functions that build them, called only when the memo does not answer (a
        key can cost more than the rest of a call's host path); ``signature`` is then required."""
        if signature is None:
            if callable(key):
                raise TypeError("a key given as a function needs a signature")
            signature = tuple(key.values())
        config = self._chosen.get(signature)
        if config is not None:
            return config, True
        key = key() if callable(key) else key
        problem = problem() if callable(problem) else problem
        entry = self.entry(key, problem)
        if pick is not None:
            config = pick(entry)
        else:
            config = self.tuner.default(key) if entry is None else entry["config"]
        final = entry is not None or _single_config() or not autotune_on()
        if final:
            remember(self._chosen, signature, config, MAX_CHOSEN)
        # once a signature (the memo answers the next calls): which config a new key's call runs
        log.debug(
            "tritonkit: %s %s runs %s (%s)",
            self.tuner.name,
            key,
            config,
            "no tuned entry: the default" if entry is None else "tuned",
        )
        return config, final

    def entry(self, key: dict, problem: Problem) -> dict | None:
        """The tuner's entry for ``key`` (see :meth:`Tuner.entry`), tuned on ``problem`` if need be
        (the trial launches are no part of the call's recorded plan)."""
        from tritonkit._launch import unrecorded

        with unrecorded():
            return self.tuner.entry(
                key,
                admit=functools.partial(self.admit, problem),
                time_ms=functools.partial(self.time_ms, problem),
                precompile=functools.partial(self.precompile, problem),
            )

    def forget(self) -> None:
        self._chosen.clear()

    def run(self, problem: Problem, config: dict) -> None:
        for launch in self.launches(problem, config):
            launch.run()

    def admit(self, problem: Problem, config: dict):
        """The worst of the oracle's comparisons of ``config``'s outputs on a calibration problem."""
        from tritonkit.oracle import compare, worst

        calibration = self.calibrate(problem, config)
        outputs = {name: calibration[name] for name in self.outputs if calibration.get(name) is not None}
        for value in outputs.values():
            value.fill_(float("nan"))  # an element the kernel leaves unwritten fails
        self.run(calibration, config)
        upcast = {name: _float64(value) for name, value in calibration.items()}
        # where autograd records: a backward's reference takes its gradients by autograd, and the gate
        # may run inside a custom op's kernel, where it records nothing (``_runtime.with_autograd``)
        exact, in_dtype = with_autograd(lambda: (self.reference(upcast), self.reference(calibration)))
        return worst(
            [
                compare(name, value, in_dtype[name].to(value.dtype), exact[name], value.dtype)
                for name, value in outputs.items()
            ]
        )

    def time_ms(self, problem: Problem, config: dict) -> float:
        """Median ms of ``config`` on the call's own inputs, into scratch outputs (tuning never writes
        the caller's outputs)."""
        scratch = {
            **problem,
            **{
                name: torch.empty_like(problem[name])
                for name in self.outputs
                if problem.get(name) is not None
            },
        }
        return median_ms(lambda: self.run(scratch, config))

    def precompile(self, problem: Problem, configs: list[dict]) -> None:
        """Compile every candidate's launches for the calibration problem and for ``problem`` at once
        (the two specialize apart): tuning then spends its time timing, not compiling."""
        from tritonkit._launch import precompile

        precompile(
            [
                launch
                for config in configs
                for case in (self.calibrate(problem, config), problem)
                for launch in self.launches(case, config)
            ]
        )


def _float64(value):
    return value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value
