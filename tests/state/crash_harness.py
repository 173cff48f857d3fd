"""Kill-at-random-points harness for tests/state/test_crash_safety.py (run as a script).

    python tests/state/crash_harness.py model|checkpoint FOLDER KILLS

Writers run in child processes forked from a server that has imported
onnxtrain (each start is cheap) and rewrite one file in a loop, each version
holding a tensor filled with its version number. The harness SIGKILLs each
writer a random moment after it is ready, then reads the file back. It prints
one JSON line: the kills, how many replaced the file, every read that failed
or mixed versions, and the files besides the target left in the folder (each
save clears the temporaries of writers killed before it). It is a script, not
test code, because multiprocessing children must not re-import a pytest
process's main module.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np

SIZE = 1 << 19   # 2 MiB of float32: long enough a write that kills can land inside it


def _model(version: int):
    from onnxtrain.proto import GraphProto, ModelProto
    from onnxtrain.translate.tensors import numpy_to_tensor

    graph = GraphProto(name="g", initializer=[numpy_to_tensor(np.full(SIZE, version, np.float32), "W")])
    return ModelProto(ir_version=9, graph=graph)


def _save_model(path: str, version: int) -> None:
    from onnxtrain._io.model import save_model

    save_model(_model(version), path)


@functools.cache
def _key():
    """The checkpoints' PRNG key; the first call starts JAX, which takes far longer than a save."""
    import jax

    return jax.random.key(0)


def _save_checkpoint(path: str, version: int) -> None:
    from onnxtrain.state.checkpoint import save_checkpoint

    save_checkpoint(path, {"W": np.full(SIZE, version, np.float32), "T": np.array(version)}, _key())


def _write(kind: str, path: str, version: int, ready) -> None:
    """Save versions version, version + 1, ... until killed, once the one-time costs are paid."""
    save, _, warm_up = KINDS[kind]
    warm_up()
    ready.set()
    while True:
        save(path, version)
        version += 1


def _read_model(path: str) -> set[float]:
    from onnxtrain._io.model import load_model
    from onnxtrain.translate.tensors import tensor_to_numpy

    return set(np.unique(tensor_to_numpy(load_model(path).graph.initializer[0])).tolist())


def _read_checkpoint(path: str) -> set[float]:
    from onnxtrain.state.checkpoint import load_checkpoint

    values, _, _ = load_checkpoint(path)
    assert values["W"].shape == (SIZE,)
    return set(np.unique(values["W"]).tolist()) | {float(values["T"])}


# kind: (save one version, read the file back, pay one-time costs before the kill clock starts)
KINDS = {"model": (_save_model, _read_model, lambda: None),
         "checkpoint": (_save_checkpoint, _read_checkpoint, _key)}


def main(kind: str, folder: str, kills: int) -> None:
    save, read, _ = KINDS[kind]
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["onnxtrain._io.model", "onnxtrain.state.checkpoint"])
    path = str(Path(folder) / "target")
    # Kills spread over about three saves, however fast this machine saves just now, so they
    # land before, during and after a write.
    save(path, 0)
    started = time.perf_counter()
    save(path, 0)
    window = 3 * (time.perf_counter() - started)
    rng = random.Random(0)
    replaced, broken, previous = 0, [], None
    for kill in range(1, kills + 1):
        ready = context.Event()
        writer = context.Process(target=_write, args=(kind, path, kill * 1000, ready))
        writer.start()
        ready.wait(timeout=60)
        time.sleep(rng.uniform(0.0, window))
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        try:
            values = read(path)
        except Exception as error:  # noqa: BLE001 - any failure to read is what we count
            broken.append(f"kill {kill}: {type(error).__name__}: {error}")
            continue
        if len(values) != 1:
            broken.append(f"kill {kill}: torn file mixes versions {sorted(values)}")
        replaced += previous is not None and values != previous
        previous = values
    leftovers = sorted(entry.name for entry in Path(folder).iterdir() if entry.name != "target")
    print(json.dumps({"kills": kills, "replaced": replaced, "broken": broken, "leftovers": leftovers}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
