"""Peak memory of one piece of work, measured in a probe process of its own (Linux only: it
reads /proc/self/status and resets the peak mark through /proc/self/clear_refs).

A test runs a probe script with run_probe; the script warms up (imports, a small case), then
reports peak_growth of the work under test as one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

Result = TypeVar("Result")
# Whether this kernel can reset the peak-RSS mark (Linux >= 4.0).
AVAILABLE = Path("/proc/self/clear_refs").exists()
TESTS = Path(__file__).resolve().parents[1]


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def peak_growth(work: Callable[[], Result]) -> tuple[int, Result]:
    """(bytes the process's peak RSS grew by while `work` ran, work's result)."""
    # Writing 5 to clear_refs resets VmHWM to the current RSS.
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = _status("VmRSS")
    result = work()
    return _status("VmHWM") - before, result


def run_probe(script: Path, *arguments: str) -> dict[str, Any]:
    """The JSON line a probe script prints last, run in a fresh process with tests/ on its path."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(script), *arguments], capture_output=True, text=True,
                            env=environment, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])
