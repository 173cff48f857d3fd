"""What fit prints: Keras-like verbosity levels and one number format.

    0  silent
    1  a progress bar per epoch, kept once the epoch ends, showing the epoch's logs
    2  one summary line per epoch

The bars are tqdm's text bars written to stdout, not notebook widgets: a saved notebook keeps
a widget's first rendering (an empty `0%|` bar) as its text, while text bars leave their
final state, one line per epoch, as Keras does.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from statistics import fmean
from typing import Any

from onnxtrain.errors import InputError

# How many of the latest steps the running value on a bar averages over.
RUNNING_WINDOW = 20

# Open bars and the thread drawing each. One a fit left open when it raised mid-epoch stays
# alive with the traceback, and tqdm would draw the next bar below it, so the next epoch the
# same thread starts closes it; other threads' bars belong to fits still running.
_OPEN_BARS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def format_number(value: float) -> str:
    """A logged value as fit prints it everywhere: 4 significant digits."""
    return f"{value:.4g}"


def verbosity(verbose: int | str | None, progress: bool | None) -> int:
    """The verbosity level from fit's `verbose` and its older alias `progress`.

    Args:
        verbose: 0, 1, 2, "auto" (1) or None (decided by `progress`, else 1).
        progress: True (1) or False (0); None when not given.

    Returns:
        0, 1 or 2.

    Raises:
        InputError: an unknown level, or `progress` and `verbose` that disagree.
    """
    if verbose == "auto":
        verbose = 1
    if verbose is not None and (isinstance(verbose, bool) or verbose not in (0, 1, 2)):
        raise InputError(f"verbose={verbose!r}: pass 0 (silent), 1 (a progress bar per epoch), "
                         "2 (one line per epoch) or 'auto'")
    if progress is None:
        return 1 if verbose is None else verbose
    if verbose is None:
        return 1 if progress else 0
    if bool(progress) != bool(verbose):
        raise InputError(f"progress={progress!r} and verbose={verbose!r} disagree; progress is an "
                         "older name for verbose, so pass only verbose")
    return verbose


class Progress:
    """fit's display: a bar per epoch (level 1), a line per epoch (level 2) or nothing (0)."""

    def __init__(self, level: int, epochs: int):
        self._level, self._epochs = level, epochs
        self._bar: Any = None
        self._steps, self._started, self._compiling = 0, 0.0, 0.0
        self._label = ""

    @contextmanager
    def compiling(self, where: str) -> Iterator[None]:
        """A program compiles (or loads) before a call runs: the bar says so meanwhile, and
        its time per step leaves that time out; the epoch's line counts it apart."""
        start = time.perf_counter()
        if self._bar is not None:
            self._bar.set_description(f"{self._label} (compiling)", refresh=True)
        try:
            yield
        finally:
            self._compiling += time.perf_counter() - start
            if self._bar is not None:
                self._bar.set_description(self._label, refresh=False)
                self._bar.unpause()   # the clock restarts from the last drawing, before the compile

    def epoch_begin(self, epoch: int, total: int | None) -> None:
        """A new epoch of `total` steps (None: unknown)."""
        self._steps, self._started, self._compiling = 0, time.perf_counter(), 0.0
        self._label = f"epoch {epoch + 1}/{self._epochs}"
        thread = threading.get_ident()
        for abandoned in [bar for bar, owner in list(_OPEN_BARS.items()) if owner == thread]:
            # Erased: its last drawing is already shown above the traceback of its fit.
            _OPEN_BARS.pop(abandoned, None)
            abandoned.leave = False
            abandoned.close()
        if self._level == 1:
            from tqdm import tqdm

            # Written to stdout as Keras does; a notebook shows stderr as a warning.
            self._bar = tqdm(total=total, desc=self._label, unit="step",
                             file=sys.stdout, leave=True)
            _OPEN_BARS[self._bar] = thread

    def advance(self, steps: int, values: Mapping[str, Sequence[float]]) -> None:
        """`steps` more steps were read back; `values` holds every value of the epoch so far."""
        self._steps += steps
        if self._bar is not None:
            self._bar.update(steps)
            # fmean, not np.mean: converting the list to an array shows in a small model's step time.
            self._bar.set_postfix({name: format_number(fmean(v[-RUNNING_WINDOW:]))
                                   for name, v in values.items() if v}, refresh=False)

    def epoch_end(self, epoch: int, logs: Mapping[str, float]) -> None:
        """Close the epoch's bar showing its logs, or print its summary line."""
        if self._bar is not None:
            self._bar.set_postfix({name: format_number(value) for name, value in logs.items()}, refresh=False)
            self.close()
        elif self._level == 2:
            seconds = time.perf_counter() - self._started
            compiled = [f"of which compiling {self._compiling:.1f}s"] if self._compiling >= 0.05 else []
            parts = [self._label, f"{self._steps} steps", f"{seconds:.1f}s", *compiled,
                     *(f"{name}: {format_number(value)}" for name, value in logs.items())]
            print(" - ".join(parts), file=sys.stdout, flush=True)

    def close(self) -> None:
        """Close the epoch's bar, leaving its final state drawn."""
        if self._bar is not None:
            _OPEN_BARS.pop(self._bar, None)
            self._bar.close()
            self._bar = None
