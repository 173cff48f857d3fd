"""Data-parallel scaling: Trainer(mesh=...) step time on 1, 2 and 4 simulated CPU devices.

Strong scaling: the same global batch (64, float32) and model (the MLP and CNN of
shared/docs/performance-anchors.md with Adam, bench/models.py) on a 1-axis "batch" mesh of
N devices, each N in its own process (XLA_FLAGS=--xla_force_host_platform_device_count=N,
fixed when JAX starts). Reported per N: the median step time (one Trainer.step, loss read
back), the speed-up t1/tN, the scaling efficiency t1/(N·tN), and the bytes that cross
devices per step: the operands of every all-reduce, reduce-scatter, all-gather and
all-to-all in the compiled step's HLO (with replicated Adam state, the gradients: about the
parameter count x 4 bytes). That is the operand size per device, not the wire traffic (a ring
all-reduce sends about 2(N-1)/N of it from each device).

Simulated devices share the machine's cores (2 here), so more devices add partitioning and
all-reduce work without adding compute: expect efficiency well below 1. The figure measures
the overhead of the sharded program, not the speed-up real devices would give.
A run takes about 20 seconds on 2 cores.

Usage: python bench/scaling.py [--devices 1 2 4] [--models mlp cnn] [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCH = 64
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2,
          "u16": 2, "s8": 1, "u8": 1, "pred": 1}


def communication_bytes(hlo: str) -> int:
    """Bytes of the results of every collective in an HLO module's text (its operands' size for
    all-reduce; asynchronous pairs are counted once, at their -start)."""
    total = 0
    pattern = rf"= (\([^()]*\)|\S+) (?:{'|'.join(COLLECTIVES)})(?:-start)?\("
    for shape in re.findall(pattern, hlo):
        for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape):
            count = 1
            for dim in filter(None, dims.split(",")):
                count *= int(dim)
            total += _BYTES.get(dtype, 4) * count
    return total


def measure(model_name: str, steps: int) -> dict:
    """Runs in a process whose device count is the one measured."""
    import jax
    import numpy as np

    sys.path.insert(0, str(Path(__file__).parent))
    import models

    import onnxtrain

    build = {"mlp": (models.mlp_onnx, models.mlp_weights, (784,)),
             "cnn": (models.cnn_onnx, models.cnn_weights, (1, 28, 28))}
    onnx_of, weights_of, sample = build[model_name]
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((BATCH, *sample)).astype(np.float32),
                "labels": rng.integers(0, 10, BATCH).astype(np.int64)} for _ in range(4)]
    mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    trainer = onnxtrain.Trainer(models.training_onnx(onnx_of(weights_of())), mesh=mesh, nan_policy="ignore")
    for batch in batches * 5:
        float(trainer.step(batch)["loss"])
    times = []
    for index in range(steps):
        start = time.perf_counter()
        float(trainer.step(batches[index % len(batches)])["loss"])
        times.append(time.perf_counter() - start)
    hlo = trainer.lowered(batches[0]).compile().as_text()
    return {"devices": jax.device_count(), "step_seconds": statistics.median(times),
            "communication_bytes": communication_bytes(hlo)}


def _in_process(devices: int, model_name: str, steps: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, __file__, "--worker", model_name, "--steps", str(steps)],
                          env=env, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        print(json.dumps(measure(arguments.worker, arguments.steps)))
        return
    print(f"global batch {BATCH}; {os.cpu_count()} CPU cores shared by every simulated device\n")
    print("| model | devices | step (ms) | speed-up | efficiency | bytes across devices / step |")
    print("|---|---|---|---|---|---|")
    for model_name in arguments.models:
        base = None
        for devices in arguments.devices:
            result = _in_process(devices, model_name, arguments.steps)
            seconds = result["step_seconds"]
            if devices == 1:
                base = seconds
            speedup = base / seconds if base else float("nan")
            print(f"| {model_name} | {devices} | {seconds * 1e3:.2f} | {speedup:.2f}x | "
                  f"{speedup / devices:.0%} | {result['communication_bytes']:,} |", flush=True)


if __name__ == "__main__":
    main()
