"""onnxtrain-step: onnxtrain.Trainer on the TrainingInfoProto model, one Trainer.step per
batch, the loss read back as a Python float; the job's "nan_policy" (default: the Trainer's,
"raise") says whether each step checks for NaN/Inf."""

import time
from pathlib import Path

import common
import onnxtrain

task = common.job()
data = common.batches(task)

start = time.perf_counter()
trainer = onnxtrain.Trainer(Path(task["dir"]) / f"{task['model']}.training.onnx",
                            nan_policy=task.get("nan_policy", "raise"))
setup_s = time.perf_counter() - start
result = common.time_steps(lambda batch: float(trainer.step(batch)["loss"]), data, task)
common.report(**result, setup_s=setup_s, compilations=trainer.compilations,
              versions=common.versions("onnxtrain", "jax", "jaxlib", "onnx", "numpy"))
