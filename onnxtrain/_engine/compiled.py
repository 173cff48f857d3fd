"""Compiled programs kept per jitted function: one per feed signature, at most a limit of them.

jax.jit keeps every program it compiles for as long as its function lives, so a model fed a
new batch size every call would grow by a program per size without end. `Compiled` gives
each feed signature (the feeds' shapes and dtypes) its own jax.jit of a fresh wrapper of the
function: evicting the least recently used signature drops its wrapper, and with it the
trace, the lowering and the executable that JAX's caches hold only as long as the wrapper
lives. A training loop feeding one signature pays a dictionary look-up per call.

Where the front end has an executable cache (executable_cache.py) and the function an
identity, a signature's program is looked up there at its first call, before any tracing, and
compiled explicitly and stored there on a miss.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np

from onnxtrain._engine.executable_cache import ProgramCache, fresh_compiles, program_name
from onnxtrain._engine.heap import trim_after_long_compilations
from onnxtrain.errors import InputError, out_of_memory
from onnxtrain.translate.compiler_options import jit_with_options

logger = logging.getLogger("onnxtrain")

# Programs a jitted function keeps by default: room for a training shape, a short last batch,
# evaluation and inference shapes, with a margin, yet a bound on memory when shapes churn.
DEFAULT_MAX_PROGRAMS = 16
# Sizes one axis past the batch may take before the front end says each compiles a program:
# training and evaluation lengths, or text padded to a few buckets, are normal; every length is not.
VARYING_SIZES = 8

Signature = tuple[tuple[tuple[int, ...], Any], ...]


class ProgramLimit:
    """How many programs each jitted function of one front end keeps, the executable cache they
    are kept in across processes (None: JAX's caches only), and the warning, given once per
    front end, that its feeds keep changing shape."""

    def __init__(self, max_programs: int = DEFAULT_MAX_PROGRAMS, cache: ProgramCache | None = None):
        """Raises InputError unless max_programs is a positive integer."""
        if isinstance(max_programs, bool) or not isinstance(max_programs, int) or max_programs < 1:
            raise InputError(f"max_programs must be a positive integer (programs kept per compiled "
                             f"function), got {max_programs!r}")
        self.max_programs = max_programs
        self.cache = cache
        self.warned = False
        self.warned_varying = False

    def varying(self, where: str, name: str, axis: int, sizes: list[int]) -> None:
        """Say, once, that an input's axis past the batch keeps taking new sizes, each of which
        compiles a program, and how to pad it to a few."""
        if self.warned_varying:
            return
        self.warned_varying = True
        logger.warning(
            "%s: input %r has taken %d sizes on axis %d (%s), and each new size compiles a program, which "
            "takes seconds. Pad to a few lengths: onnxtrain.data.padded_batches(examples, batch_size, "
            "multiple_of=16) for fit, or onnxtrain.data.Padding(multiple_of=16) as a DataLoader's collate_fn.",
            where, name, len(sizes), axis, ", ".join(map(str, sizes)))

    def churn(self, where: str, names: list[str], previous: Signature, current: Signature, stacked: bool) -> None:
        """Warn, once, that `where` evicts a program because its feeds keep changing shape."""
        if self.warned:
            return
        self.warned = True
        logger.warning(
            "%s: %s, and each new feed shape compiles a new program; only the %d most recently used "
            "are kept (max_programs), so shapes that keep changing recompile without end. Feed a few "
            "fixed shapes: fit(drop_last=True) skips a short last batch, and onnxtrain.data.padded_batches "
            "(or onnxtrain.data.Padding as a DataLoader's collate_fn) pads text to a few lengths; or raise "
            "max_programs.",
            where, _change(names, previous, current, stacked), self.max_programs)


def _change(names: list[str], previous: Signature, current: Signature, stacked: bool) -> str:
    """What differs between two feed signatures, by input and axis."""
    for name, (old_shape, old_dtype), (new_shape, new_dtype) in zip(names, previous, current):
        if old_dtype != new_dtype:
            return f"input {name!r} changes dtype ({old_dtype}, then {new_dtype})"
        if len(old_shape) != len(new_shape):
            return f"input {name!r} changes rank ({len(old_shape) - stacked}, then {len(new_shape) - stacked})"
        for axis, (old, new) in enumerate(zip(old_shape, new_shape)):
            if old != new:
                if stacked and axis == 0:
                    return f"the number of batches per call changes ({old}, then {new})"
                return f"input {name!r} changes size on axis {axis - stacked} ({old}, then {new})"
    return "the feeds' signature changes"


def signature(feeds: Mapping[str, Any]) -> Signature:
    """Shapes and dtypes of checked feeds, in order: what selects a program."""
    try:
        return tuple([(value.shape, value.dtype) for value in feeds.values()])
    except AttributeError:
        # A sequence, map or optional input: its structure and leaves select the program.
        return tuple([(np.shape(value), getattr(value, "dtype", None)) if isinstance(value, (np.ndarray, jax.Array))
                      else (_structure(value), None) for value in feeds.values()])


def _structure(value: Any) -> tuple:
    leaves, tree = jax.tree.flatten(value)
    return (str(tree), *((np.shape(leaf), str(getattr(leaf, "dtype", type(leaf)))) for leaf in leaves))


@dataclass(frozen=True)
class Memo:
    """What tracing a function leaves on the host that running its program relies on (the
    layout of a checked step's fault evidence), as JSON values: stored with a cached
    executable, and put back when one is loaded instead of traced."""

    save: Callable[[], Any]
    restore: Callable[[Any], None]


@dataclass(frozen=True)
class Job:
    """Getting one program ready, on any thread (XLA loads and compiles without the GIL):
    loading it from the executable cache, or compiling it once traced."""

    run: Callable[[], None]
    loads: bool = False

    def __call__(self) -> None:
        self.run()


class _Jitted:
    """One signature's program, traced, lowered and compiled by jax.jit at its first call (or
    ahead of it, by prepare)."""

    def __init__(self, jitted: Any):
        self._jitted = jitted
        self._ahead = False   # compiled by prepare, not yet called

    def __call__(self, *args: Any) -> Any:
        self._ahead = False
        return self._jitted(*args)

    def lower(self, *args: Any) -> Any:
        return self._jitted.lower(*args)

    def prepare(self, args: tuple) -> Job | None:
        """Trace and lower for `args` now; return the compile, or None when there is nothing
        to compile."""
        if self.ready():
            return None
        lowered = self._jitted.lower(*args)

        def compile_ahead() -> None:
            lowered.compile()   # jax.jit's next call with these arguments finds it compiled
            self._ahead = True

        return Job(compile_ahead)

    def ready(self) -> bool:
        """Whether a call runs without compiling first."""
        return self._ahead or self._jitted._cache_size() > 0

    def callable(self) -> Callable:
        """What later calls may call directly, once one call has succeeded."""
        return self._jitted

    def count(self) -> int:
        return max(self._jitted._cache_size(), int(self._ahead))

    def clear(self) -> None:
        self._ahead = False
        self._jitted._clear_cache()


class _Cached(_Jitted):
    """One signature's program, loaded from the executable cache at its first call, or else
    compiled explicitly and stored there."""

    def __init__(self, jitted: Any, cache: ProgramCache, name: str, memo: Memo | None):
        super().__init__(jitted)
        self._cache, self._name, self._memo = cache, name, memo
        self._executable: Any = None

    def __call__(self, *args: Any) -> Any:
        if self._executable is None:
            job = self.prepare(args)
            if job is not None:
                job()
            if self._executable is None:   # its entry was refused on loading (said once): compile
                self._lowered(args, self._cache.parts(self._name, args))()
        try:
            return self._executable(*args)
        except TypeError as error:
            # Arguments past the feeds of other types than the program was made for (JAX checks
            # them before running anything): jax.jit traces and compiles for them instead.
            logger.debug("executable cache: a program refused its arguments (%s)", error)
            return self._jitted(*args)

    def prepare(self, args: tuple) -> Job | None:
        """A stored program's load, or else its compile after tracing now."""
        if self._executable is not None:
            return None
        parts = self._cache.parts(self._name, args)
        if self._cache.cache.holds(parts):
            return Job(lambda: self._load(parts), loads=True)
        return self._lowered(args, parts)

    def _load(self, parts: dict[str, str]) -> None:
        entry = self._cache.cache.load(parts)
        if entry is not None:
            if self._memo is not None:
                self._memo.restore(entry.memo)
            self._executable = entry.executable

    def _lowered(self, args: tuple, parts: dict[str, str]) -> Job:
        lowered = self._jitted.lower(*args)
        # Taken now: tracing another program before this one compiles would leave its memo instead.
        memo = None if self._memo is None else self._memo.save()
        return Job(lambda: self._compile(lowered, parts, memo))

    def _compile(self, lowered: Any, parts: dict[str, str], memo: Any) -> None:
        with fresh_compiles():
            executable = lowered.compile()
        self._cache.cache.store(parts, executable, memo)
        self._executable = executable

    def ready(self) -> bool:
        return self._executable is not None

    def callable(self) -> Callable:
        return self._executable

    def count(self) -> int:
        return int(self._executable is not None)

    def clear(self) -> None:
        self._executable = None


class CompileWatcher(Protocol):
    """Told of every program a call on this thread compiles (or loads) before it runs."""

    def compiling(self, where: str) -> AbstractContextManager[None]: ...


_watching = threading.local()


@contextmanager
def watching_compiles(watcher: CompileWatcher) -> Iterator[None]:
    """Within this block, this thread's calls that compile a program first do it inside
    watcher.compiling(where) (fit's progress bar says "compiling" and leaves the time out)."""
    previous = getattr(_watching, "watcher", None)
    _watching.watcher = watcher
    try:
        yield
    finally:
        _watching.watcher = previous


class Compiled:
    """`function` jitted (with onnxtrain's compiler options and `options`), keeping the programs
    of the `limit.max_programs` most recently used feed signatures; its feeds are argument
    `feeds_argnum`, a dict of arrays (stacked: with a leading axis of steps).

    identity: what names the function's programs in the front end's executable cache (unique
    within the front end; None keeps them out of it); memo: what its tracing leaves behind."""

    def __init__(self, function: Callable, where: str, limit: ProgramLimit, feeds_argnum: int,
                 stacked: bool = False, identity: str | None = None, memo: Memo | None = None, **options: Any):
        self._function = function
        self._where = where
        self._limit = limit
        self._feeds_argnum = feeds_argnum
        self._stacked = stacked
        self._options = options
        self._cache_name = None if identity is None else program_name(identity, function, options)
        self._memo = memo
        self._programs: OrderedDict[Signature, _Jitted] = OrderedDict()
        self._retired = 0  # programs compiled by evicted signatures' jits
        self._sizes: dict[tuple[str, int], list[int]] = {}  # (input, axis past the batch) -> sizes seen
        # The signature selected last and its program, and the signature called last and what
        # JAX runs for it (None until a call has succeeded).
        self._last: tuple[Signature, _Jitted] | None = None
        self._ready: tuple[Signature, Callable] | None = None
        trim_after_long_compilations()

    def __call__(self, *args: Any) -> Any:
        feeds = args[self._feeds_argnum]
        try:
            ready = self._ready
            if ready is not None and ready[0] == signature(feeds):
                try:
                    return ready[1](*args)   # a training loop's every call after the first: straight to JAX
                except TypeError:
                    self._ready = None   # other argument types than before: the program's own call decides
            program = self._program(feeds)
            watcher = getattr(_watching, "watcher", None)
            if watcher is None or program.ready():
                result = program(*args)
            else:
                with watcher.compiling(self._where):
                    result = program(*args)
            self._ready = (self._last[0], program.callable())
            return result
        except jax.errors.JaxRuntimeError as error:
            exhausted = out_of_memory(error, self._where)
            if exhausted is None:
                raise
            raise exhausted from None

    def lower(self, *args: Any) -> Any:
        """The program for these arguments, lowered but not compiled."""
        return self._program(args[self._feeds_argnum]).lower(*args)

    def prepare(self, *args: Any) -> list[Job]:
        """Get the program for these arguments ready without running it: its load from the
        executable cache, or its compile once traced now (a list of at most one job, for the
        caller to run on any thread)."""
        job = self._program(args[self._feeds_argnum]).prepare(args)
        return [] if job is None else [job]

    def compilations(self) -> int:
        """Programs compiled so far, evicted ones included."""
        return self._retired + self.kept()

    def kept(self) -> int:
        """Programs held now: at most limit.max_programs signatures' worth."""
        return sum(program.count() for program in self._programs.values())

    def _program(self, feeds: Mapping[str, Any]) -> _Jitted:
        key, last = signature(feeds), self._last
        if last is not None and last[0] == key:
            return last[1]
        program = self._programs.get(key)
        if program is None:
            program = self._add(key, feeds)
        else:
            self._programs.move_to_end(key)
        self._last = (key, program)
        return program

    def _add(self, key: Signature, feeds: Mapping[str, Any]) -> _Jitted:
        self._note_sizes(list(feeds), key)
        if len(self._programs) >= self._limit.max_programs:
            previous = next(reversed(self._programs))
            _, evicted = self._programs.popitem(last=False)
            self._retired += evicted.count()
            evicted.clear()
            self._ready = None
            self._limit.churn(self._where, list(feeds), previous, key, self._stacked)

        # A fresh function object per signature: JAX's trace and lowering caches are keyed on it
        # weakly, so they let go of this signature's program when the eviction drops the wrapper.
        @functools.wraps(self._function)
        def fresh(*args: Any, **kwargs: Any) -> Any:
            return self._function(*args, **kwargs)

        jitted = jit_with_options(fresh, **self._options)
        cache = self._limit.cache
        program = (_Jitted(jitted) if cache is None or self._cache_name is None
                   else _Cached(jitted, cache, self._cache_name, self._memo))
        self._programs[key] = program
        return program

    def _note_sizes(self, names: list[str], key: Signature) -> None:
        """Record the sizes of each input's axes past the batch; warn when one keeps changing."""
        first = 1 + self._stacked  # axis 0 holds the batch (the steps, then the batch, when stacked)
        for name, (shape, _) in zip(names, key):
            if not isinstance(shape, tuple) or not all(isinstance(size, int) for size in shape):
                continue  # a sequence or map input: its structure, not an array's shape
            for axis in range(first, len(shape)):
                sizes = self._sizes.setdefault((name, axis), [])
                if shape[axis] not in sizes:
                    sizes.append(shape[axis])
                    if len(sizes) >= VARYING_SIZES:
                        self._limit.varying(self._where, name, axis - self._stacked, sizes)
