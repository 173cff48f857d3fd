"""Peak memory of loading one checkpoint, for tests/state/test_hostile_checkpoints.py (a script).

    python tests/state/checkpoint_memory_probe.py CHECKPOINT

Runs in a fresh process so that the figure is the load's alone: after warming up (imports,
a small checkpoint loaded once) it resets the kernel's peak-RSS mark, loads CHECKPOINT, and
prints one JSON line: the peak RSS growth in bytes, the seconds taken, what loaded (name ->
shape) and the error raised, if any.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from onnxtrain.state.checkpoint import load_checkpoint, save_checkpoint


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def _reset_peak() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def main(path: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        warm = Path(folder) / "warm.ckpt"
        save_checkpoint(warm, {"W": np.ones(4, np.float32)}, jax.random.key(0))
        load_checkpoint(warm)
    _reset_peak()
    before, start, loaded, error = _status("VmRSS"), time.perf_counter(), None, None
    try:
        values, _, _ = load_checkpoint(path)
        loaded = {name: list(value.shape) for name, value in values.items()}
    except Exception as caught:  # noqa: BLE001 - the test checks which error it was
        error = f"{type(caught).__name__}: {caught}"
    seconds = time.perf_counter() - start
    print(json.dumps({"peak_growth": _status("VmHWM") - before, "seconds": round(seconds, 3),
                      "loaded": loaded, "error": error}))


if __name__ == "__main__":
    main(sys.argv[1])
