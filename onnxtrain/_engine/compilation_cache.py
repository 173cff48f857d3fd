"""JAX's persistent compilation cache, on by default, so a new process skips XLA compiles.

The cache lives in the user's cache folder (XDG_CACHE_HOME or ~/.cache, under
onnxtrain/xla). ONNXTRAIN_COMPILATION_CACHE=<folder> moves it, =off disables
it, and a cache folder the application configured in JAX itself is left alone.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

logger = logging.getLogger("onnxtrain")
ENVIRONMENT = "ONNXTRAIN_COMPILATION_CACHE"
_OFF = {"0", "off", "false", "no", "none"}
_configured = False


def default_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "onnxtrain" / "xla"


def enable_compilation_cache() -> Path | None:
    """Turn the persistent cache on (once per process); the folder used, or None."""
    global _configured
    configured = jax.config.jax_compilation_cache_dir
    if _configured or configured:
        return Path(configured) if configured else None
    _configured = True
    setting = os.environ.get(ENVIRONMENT, "").strip()
    if setting.lower() in _OFF:
        return None
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
