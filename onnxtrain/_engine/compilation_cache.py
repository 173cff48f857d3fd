"""The caches that let a new process skip compiles, on by default.

JAX's persistent compilation cache lives in the user's cache folder (XDG_CACHE_HOME or
~/.cache, under onnxtrain/xla); onnxtrain's own executable cache (executable_cache.py) beside
it, under onnxtrain/executables. ONNXTRAIN_COMPILATION_CACHE=<folder> moves both (the
executables to <folder>/executables), =off disables both; ONNXTRAIN_EXECUTABLE_CACHE=off
disables only the executable cache. A cache folder the application configured in JAX itself
is left alone.
"""

from __future__ import annotations

import logging
import os
import functools
import hashlib
from pathlib import Path
from typing import Any

import jax

from onnxtrain._engine.executable_cache import ExecutableCache, ProgramCache
from onnxtrain._io.digest import model_digest
from onnxtrain.proto import ModelProto

logger = logging.getLogger("onnxtrain")
ENVIRONMENT = "ONNXTRAIN_COMPILATION_CACHE"
EXECUTABLES = "ONNXTRAIN_EXECUTABLE_CACHE"
_OFF = {"0", "off", "false", "no", "none"}
_configured = False


def default_folder() -> Path:
    return _user_folder() / "xla"


def _user_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "onnxtrain"


def _switched_off(variable: str) -> bool:
    return os.environ.get(variable, "").strip().lower() in _OFF


def enable_compilation_cache() -> Path | None:
    """Turn the persistent cache on (once per process); the folder used, or None."""
    global _configured
    configured = jax.config.jax_compilation_cache_dir
    if _configured or configured:
        return Path(configured) if configured else None
    _configured = True
    if _switched_off(ENVIRONMENT):
        return None
    setting = os.environ.get(ENVIRONMENT, "").strip()
    folder = Path(setting) if setting else default_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        logger.warning("compilation cache disabled: cannot create %s (%s); set %s to another "
                       "folder or to 'off'", folder, error, ENVIRONMENT)
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    # Keep every program, however small: JAX looks each one up anyway, and the small ones
    # (the host-side folding of shape-like values, state set-up) add up to a good part of a
    # warm start when they are compiled again.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return folder


@functools.cache
def executable_cache() -> ExecutableCache | None:
    """onnxtrain's executable cache for this process (see the module's docstring), or None
    where it is switched off or its folder is refused (said once in the log)."""
    if _switched_off(ENVIRONMENT) or _switched_off(EXECUTABLES):
        return None
    setting = os.environ.get(ENVIRONMENT, "").strip()
    return ExecutableCache.open(Path(setting) / "executables" if setting else _user_folder() / "executables")


def program_cache(model: ModelProto, **options: Any) -> ProgramCache | None:
    """The executable cache as a front end running `model` with `options` (plain values that
    change its programs) uses it, or None where the cache is off."""
    cache = executable_cache()
    if cache is None:
        return None
    front = hashlib.sha256(f"{model_digest(model)}|{sorted(options.items())!r}".encode()).hexdigest()
    return ProgramCache(cache, front)
