"""What every worker shares: its job (argv[1], JSON), the model's weights and batches as
bench/run.py wrote them, the timing loop, and the one JSON line it prints last.

numpy and the standard library only, so it runs in the ONNX Runtime venv too.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

Batch = dict[str, np.ndarray]
# Steps per compiled call of the multi-step systems (onnxtrain-fit, jax-handwritten-scan).
STEPS_PER_CALL = 8


def job() -> dict:
    """{"model", "dir", "warmup", "steps"} (+ "prepare" for ort_training.py)."""
    return json.loads(sys.argv[1])


def weights(task: dict) -> dict[str, np.ndarray]:
    with np.load(Path(task["dir"]) / f"{task['model']}.weights.npz") as data:
        return dict(data)


def batches(task: dict) -> list[Batch]:
    with np.load(Path(task["dir"]) / f"{task['model']}.batches.npz") as data:
        return [{"x": x, "labels": labels} for x, labels in zip(data["x"], data["labels"])]


def time_steps(step: Callable[[Batch], float], data: list[Batch], task: dict) -> dict:
    """`warmup` untimed steps, then `steps` timed ones, cycling through the batches.

    step(batch) runs one training step and returns its loss as a Python float. Returns the
    first step's loss (from the initial weights: equal across systems) and its time (includes
    compiling), and the timed steps' seconds."""
    start = time.perf_counter()
    first_loss = step(data[0])
    first_s = time.perf_counter() - start
    for index in range(1, task["warmup"]):
        step(data[index % len(data)])
    done, times = max(task["warmup"], 1), []
    for index in range(done, done + task["steps"]):
        start = time.perf_counter()
        step(data[index % len(data)])
        times.append(time.perf_counter() - start)
    return {"first_loss": first_loss, "first_s": first_s, "times": times}


def time_calls(run_call: Callable[[list[Batch]], list[float]], data: list[Batch], task: dict,
               size: int = 64, steps_per_call: int = STEPS_PER_CALL) -> dict:
    """Per-step times of calls that each run several steps, `steps_per_call` per compiled
    call (Trainer.fit, a hand-written scan).

    run_call(batches) runs one step per batch (len(batches) is a multiple of STEPS_PER_CALL)
    and returns their losses as Python floats. The warm-up call covers the warm-up steps
    (rounded to that multiple) from data[0] on, so its first loss is the first step's,
    comparable across systems. Each timed call covers `size` batches (fewer if `steps` is
    smaller); its wall time / its length is one sample."""
    k = STEPS_PER_CALL
    size = min(size, max(k, task["steps"] // k * k))
    stream = itertools.cycle(data)
    warmup = [next(stream) for _ in range(max(k, task["warmup"] // k * k))]
    start = time.perf_counter()
    first_loss = run_call(warmup)[0]
    first_s = time.perf_counter() - start
    times = []
    for _ in range(max(1, task["steps"] // size)):
        chunk = [next(stream) for _ in range(size)]
        start = time.perf_counter()
        run_call(chunk)
        times.append((time.perf_counter() - start) / size)
    return {"first_loss": first_loss, "first_s": first_s, "times": times,
            "note": f"K={steps_per_call}, {size} steps per call"}


def train(trainer: Any, stream: Iterator[Batch], count: int, fit: bool) -> None:
    """`count` training steps of an onnxtrain Trainer on batches from `stream`, each read back
    to the host: Trainer.step per batch, or one Trainer.fit over them (STEPS_PER_CALL per
    compiled call). The last loss is read from the history as "step_loss" (per-epoch
    histories) or "loss" (older onnxtrain, which an A/B base may be)."""
    if fit:
        chunk = [next(stream) for _ in range(count)]
        history = trainer.fit(chunk, progress=False, steps_per_call=STEPS_PER_CALL)
        float(history.get("step_loss", history.get("loss"))[-1])
    else:
        for _ in range(count):
            float(trainer.step(next(stream))["loss"])


def versions(*packages: str) -> dict[str, str]:
    found = {}
    for package in packages:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    return found


def report(**fields) -> None:
    """Print the result line, with this process's peak resident set size: VmHWM (Linux), the
    high-water mark of this program's own memory. getrusage's ru_maxrss is never below the
    parent's resident set at the fork that started this process (Linux carries it over exec):
    150-190 MB for bench/run.py, which has imported JAX, more than ONNX Runtime's whole process."""
    status = Path("/proc/self/status").read_text()
    fields["peak_rss_mb"] = int(status.split("VmHWM:")[1].split()[0]) / 1024
    print(json.dumps(fields), flush=True)


def unavailable(reason: str) -> None:
    report(unavailable=reason)
    sys.exit(0)
