"""Handing the C heap's free pages back to the system once a long compilation ends.

XLA's compiler takes its scratch memory from malloc, and glibc keeps the chunks it frees in
its arenas, so after a large program compiles, memory the process no longer uses stays
resident and the program's first run allocates its buffers on top of it: that run sets the
process's peak. glibc's malloc_trim(0) returns the free pages. It runs after each
compilation that took at least TRIM_AFTER_S (a trim costs little next to such a
compilation), hooked on JAX's backend-compile event, which fires after the compiler returns
and before the program first runs. Where the C library has no malloc_trim (macOS, musl) this
does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

from jax import monitoring

# Compilations shorter than this rarely leave much behind, and tests compile thousands of them.
TRIM_AFTER_S = 1.0
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()
_installed = False


def _after_compile(event: str, duration: float, **_: Any) -> None:
    if event == _COMPILE_EVENT and duration >= TRIM_AFTER_S:
        _TRIM(0)


def trim_after_long_compilations() -> None:
    """Install the trim on JAX's compile event, once per process (no-op without malloc_trim)."""
    global _installed
    if _installed or _TRIM is None:
        return
    _TRIM.argtypes, _TRIM.restype = [ctypes.c_size_t], ctypes.c_int
    monitoring.register_event_duration_secs_listener(_after_compile)
    _installed = True
