"""Where a training step's device time goes, kernel by kernel: Trainer.step against the
hand-written JAX step of the same benchmark model, each read from JAX's profiler.

The timed rows of bench/run.py say how far apart two systems are; this says where. For each
system it prints the mean time per step of every XLA:CPU kernel (fusions, dots,
convolutions, host-to-device copies), the largest first, and their total. Kernel names are
XLA's own, so the two lists do not line up name by name: compare the big entries and the
totals. Device time excludes Python and dispatch, which are the rest of a step's wall time.
One process profiles both systems, one after the other; the machine's noise applies, so
repeat a run before trusting a difference of a few percent.

Usage: python bench/kernel_times.py [--model mlp|cnn|transformer] [--nan-policy raise|ignore]
                               [--steps 100] [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "systems"))

import common  # noqa: E402
import models  # noqa: E402
import run  # noqa: E402

import onnxtrain  # noqa: E402

WARMUP = 20
# Events of XLA:CPU's executor and thread pool that wrap or mark kernels rather than being one.
_BOOKKEEPING = ("ThunkExecutor", "ThreadpoolListener", "SlinkyThreadPool", "end: ")

Batch = common.Batch


def kernel_times(step: Callable[[Batch], float], batches: list[Batch], steps: int,
                 folder: Path) -> dict[str, float]:
    """Mean seconds per step of each kernel over `steps` profiled steps (after a warm-up)."""
    for number in range(WARMUP):
        step(batches[number % len(batches)])
    with jax.profiler.trace(str(folder)):
        for number in range(steps):
            step(batches[number % len(batches)])
    totals: dict[str, float] = collections.defaultdict(float)
    for trace in folder.rglob("*.xplane.pb"):
        for plane in jax.profiler.ProfileData.from_file(str(trace)).planes:
            for line in plane.lines:
                if line.name == "python":
                    continue
                for event in line.events:
                    if not event.name.startswith(_BOOKKEEPING):
                        totals[event.name] += event.duration_ns * 1e-9 / steps
    return dict(totals)


def report(name: str, times: dict[str, float], top: int) -> str:
    ranked = sorted(times.items(), key=lambda item: -item[1])
    lines = [f"{name}: {sum(times.values()) * 1e6:.0f} us of kernels per step ({len(times)} kernels)"]
    lines += [f"  {seconds * 1e6:9.1f} us  {kernel}" for kernel, seconds in ranked[:top]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", choices=sorted(run.MODELS))
    parser.add_argument("--nan-policy", default="raise", choices=("raise", "ignore"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--top", type=int, default=15)
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        run.prepare(arguments.model, folder)
        task = {"dir": folder, "model": arguments.model}
        batches = common.batches(task)
        trainer = onnxtrain.Trainer(folder / f"{arguments.model}.training.onnx", nan_policy=arguments.nan_policy)
        hand_step = models.train_step_jax(models.JAX_FORWARD[arguments.model])
        holder = {"state": models.adam_state_jax(common.weights(task))}

        def hand_written(batch: Batch) -> float:
            holder["state"], loss = hand_step(holder["state"], batch["x"], batch["labels"])
            return float(loss)

        systems = {f"onnxtrain Trainer.step (nan_policy={arguments.nan_policy!r})":
                   lambda batch: float(trainer.step(batch)["loss"]),
                   "hand-written JAX": hand_written}
        for index, (name, step) in enumerate(systems.items()):
            times = kernel_times(step, batches, arguments.steps, folder / f"trace{index}")
            print(report(name, times, arguments.top))
    print(f"model {arguments.model}, batch {run.BATCH}, {arguments.steps} profiled steps after {WARMUP} "
          f"warm-up steps; {run.machine()}")


if __name__ == "__main__":
    main()
