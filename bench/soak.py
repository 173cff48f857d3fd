"""Soak: many training steps of the PyTorch-exported MLP fixture, watching the process's RSS.

A long run must not grow: no per-step caches, leaked buffers or history kept
on the device. Records RSS every `--every` steps; reports growth after the
warm-up (the first record) as a percentage (target < 5 %).

Usage: python bench/soak.py [--steps 10000] [--every 500]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import onnxtrain

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "torch" / "mlp.onnx"


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS"))


def soak(steps: int, every: int) -> list[tuple[int, float]]:
    """(step, RSS MiB) every `every` steps of Adam on random batches of 32."""
    model = onnxtrain.make_training_model(FIXTURE.read_bytes(), loss="cross_entropy",
                                          optimizer=onnxtrain.optim.Adam(lr=1e-3))
    trainer = onnxtrain.Trainer(model)
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(32, 20)).astype(np.float32),
                "labels": rng.integers(0, 5, 32).astype(np.int64)} for _ in range(16)]
    records = []
    for step in range(1, steps + 1):
        float(trainer.step(batches[step % len(batches)])["loss"])
        if step % every == 0:
            records.append((step, rss_mib()))
    return records


def growth(records: list[tuple[int, float]]) -> float:
    """Percent RSS growth from the first record (after warm-up) to the largest later one."""
    first = records[0][1]
    return 100 * (max(rss for _, rss in records[1:]) - first) / first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=500)
    arguments = parser.parse_args()
    start = time.perf_counter()
    records = soak(arguments.steps, arguments.every)
    for step, rss in records:
        print(f"step {step:>6}  RSS {rss:7.1f} MiB")
    print(f"{arguments.steps} steps in {time.perf_counter() - start:.0f} s; RSS growth after warm-up "
          f"{growth(records):+.2f} % (target < 5 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
