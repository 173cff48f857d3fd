"""The benchmark scripts' modules, for tests that reuse them (bench/models.py's models).

Each is loaded from its file under the name bench_<name>: bench/ is not a package and stays off
sys.path, where a script named like an installed package would shadow it for every test after
(bench/kernels.py once hid the `kernels` package transformers imports).
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from support import paths


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py as module bench_<name>, loaded once."""
    qualified = f"bench_{name}"
    if qualified not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualified, paths.REPO / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        spec.loader.exec_module(module)
    return sys.modules[qualified]
