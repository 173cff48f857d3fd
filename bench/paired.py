"""Side-by-side timing in one process, shared by the real-model benchmarks (exported_cnn.py,
zoo.py): round after round, each system runs a few calls back to back, the order reversed
every other round; a ratio is the median over rounds of the per-round ratio of median call
times, so the machine's drift cancels out."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import run


def median_seconds(call: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired(systems: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, list[float]]:
    """Median seconds per call of every system in every round, the order reversed each round."""
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    for number in range(rounds):
        order = list(systems) if number % 2 == 0 else list(reversed(systems))
        for name in order:
            seconds[name].append(median_seconds(systems[name], calls))
    return seconds


def ratio(seconds: dict[str, list[float]], top: str, bottom: str) -> float:
    return statistics.median(a / b for a, b in zip(seconds[top], seconds[bottom]))


def print_table(rows: dict[str, dict[str, float | str]], key_header: str) -> None:
    """Rows (name -> column -> value, "" where there is none) as a markdown table."""
    columns = list(next(iter(rows.values())))
    print(f"| {key_header} | " + " | ".join(columns) + " |")
    print("|" + "---|" * (key_header.count("|") + 1 + len(columns)))
    for key, row in rows.items():
        print(f"| {key} | " + " | ".join(f"{row[c]:.2f}" if row[c] != "" else "" for c in columns) + " |")


def torch_step(model, inputs: list[np.ndarray], labels: np.ndarray, loss: str) -> Callable[[], float]:
    """One torch training step of `model` (in whatever train/eval modes the caller set):
    forward, the loss ("cross_entropy" on class indices or "mse"), backward, Adam."""
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    args, target = [torch.from_numpy(x) for x in inputs], torch.from_numpy(labels)
    objective = F.cross_entropy if loss == "cross_entropy" else F.mse_loss

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        value = objective(model(*args), target)
        value.backward()
        optimizer.step()
        return float(value)

    return step


def torch_compiled_step(model, inputs: list[np.ndarray], labels: np.ndarray,
                        loss: str) -> tuple[Callable[[], float] | None, float | str]:
    """torch_step on torch.compile(model) (default mode), its first call made: (the step,
    seconds the first call took, compiling included), or (None, why) where compiling fails."""
    import torch

    step = torch_step(torch.compile(model), inputs, labels, loss)
    start = time.perf_counter()
    try:
        step()
    except Exception as error:  # noqa: BLE001 - inductor's failures have no common base
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    return step, time.perf_counter() - start


def first_steps(job: dict, feeds: dict[str, np.ndarray]) -> dict[str, float]:
    """Seconds from `import onnxtrain` to the first step's loss in a new process
    (bench/systems/first_step.py running `job` on `feeds`, labels included): cold with an
    empty compilation cache, then warm with the cache the cold run filled."""
    seconds = {}
    with tempfile.TemporaryDirectory(prefix="onnxtrain-first-step-") as folder:
        path, cache = Path(folder) / "feeds.npz", Path(folder) / "cache"
        np.savez(path, **feeds)
        for start in ("cold", "warm"):
            result = run.run_script(Path(sys.executable), "first_step.py", {**job, "feeds": str(path)},
                                    {"ONNXTRAIN_COMPILATION_CACHE": str(cache)})
            if "unavailable" in result:
                raise RuntimeError(f"{job['path']}, {start} first step: {result['unavailable']}")
            seconds[f"{start} s"] = result["first_step_s"]
    return seconds
