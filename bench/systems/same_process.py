"""same_process: both sides of `bench/ab.py --same-process` in one process.

The base checkout's packages are importable under another top-level name (ab.py writes a
renamed copy and passes its folder and name), so this process holds this checkout's Trainer
and the base's side by side on the same files, and times blocks of steps on each in turn,
the order alternating from pair to pair. Whatever speed the process started with (where the
allocator and the loader put things) it shares between the two sides. The job adds
"base_path", "base_package", "pairs", "block_s", "row_s", "min_pairs" and "warmup_s" to
lockstep.py's; the answer is one line: each side's seconds per step, block by block.
"""

import importlib
import itertools
import sys
import time
from pathlib import Path

import common

task = common.job()
sys.path.insert(0, task["base_path"])
modules = {"this": importlib.import_module("onnxtrain"), "base": importlib.import_module(task["base_package"])}
model = Path(task["dir"]) / f"{task['model']}.training.onnx"
trainers = {side: module.Trainer(model, nan_policy=task.get("nan_policy", "raise")) for side, module in modules.items()}
streams = {side: itertools.cycle(common.batches(task)) for side in trainers}
unit = common.STEPS_PER_CALL if task.get("fit") else 1


def run(side: str, count: int) -> float:
    """Seconds for `count` steps on `side` (as lockstep.py runs them)."""
    start = time.perf_counter()
    common.train(trainers[side], streams[side], count, bool(task.get("fit")))
    return time.perf_counter() - start


for side in trainers:
    run(side, max(unit, task["warmup"] // unit * unit))
compiled = {side: trainer.compilations for side, trainer in trainers.items()}
# Blocks sized from the warm speed of the faster side, in whole fit calls.
size, start = unit, time.perf_counter()
while time.perf_counter() - start < task["warmup_s"]:
    seconds = max(min(run(side, size) for side in trainers), 1e-6)
    size = max(unit, round(size * task["block_s"] / seconds / unit) * unit)
times, start = {side: [] for side in trainers}, time.perf_counter()
for index in range(task["pairs"]):
    if index >= task["min_pairs"] and time.perf_counter() - start > task["row_s"]:
        break
    for side in (["this", "base"] if index % 2 == 0 else ["base", "this"]):
        times[side].append(run(side, size) / size)
common.report(steps=size, times=times,
              recompiled={side: trainer.compilations - compiled[side] for side, trainer in trainers.items()})
