"""Peak memory of loading one checkpoint, for tests/state/test_hostile_checkpoints.py (a script).

    python tests/state/checkpoint_memory_probe.py CHECKPOINT

Runs in a fresh process so that the figure is the load's alone (support.peak_memory): after
warming up (imports, a small checkpoint loaded once) it loads CHECKPOINT and prints one JSON
line: the peak RSS growth in bytes, the seconds taken, what loaded (name ->
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
from support.peak_memory import peak_growth


def _load(path: str) -> tuple[dict[str, list[int]] | None, str | None, float]:
    """(name -> shape of what loaded, the error raised, seconds taken)."""
    start = time.perf_counter()
    try:
        values, _, _ = load_checkpoint(path)
        return {name: list(value.shape) for name, value in values.items()}, None, time.perf_counter() - start
    except Exception as caught:  # noqa: BLE001 - the test checks which error it was
        return None, f"{type(caught).__name__}: {caught}", time.perf_counter() - start


def main(path: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        warm = Path(folder) / "warm.ckpt"
        save_checkpoint(warm, {"W": np.ones(4, np.float32)}, jax.random.key(0))
        load_checkpoint(warm)
    growth, (loaded, error, seconds) = peak_growth(lambda: _load(path))
    print(json.dumps({"peak_growth": growth, "seconds": round(seconds, 3), "loaded": loaded, "error": error}))


if __name__ == "__main__":
    main(sys.argv[1])
