"""jax-handwritten: bench/models.train_step_jax, one jax.jit of value_and_grad and ONNX's
Adam per step with the state donated, the loss read back as a Python float."""

import sys
from pathlib import Path

import common

sys.path.insert(0, str(Path(__file__).parents[1]))
import models  # noqa: E402

task = common.job()
data = common.batches(task)
step = models.train_step_jax(models.JAX_FORWARD[task["model"]])
holder = {"state": models.adam_state_jax(common.weights(task))}


def run(batch):
    holder["state"], loss = step(holder["state"], batch["x"], batch["labels"])
    return float(loss)


common.report(**common.time_steps(run, data, task), versions=common.versions("jax", "jaxlib"))
