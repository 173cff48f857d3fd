"""jax-handwritten: bench/models.train_step_jax, one jax.jit of value_and_grad and ONNX's
Adam per step with the state donated, the loss read back as a Python float. With "guarded"
in the job (jax-handwritten-guarded): train_step_jax_guarded, which also checks the new state
and the loss for NaN/Inf and keeps the old state on a fault; the host reads the flag with the
loss and raises, as onnxtrain's default nan_policy does."""

import sys
from pathlib import Path

import common

sys.path.insert(0, str(Path(__file__).parents[1]))
import jax  # noqa: E402
import models  # noqa: E402

task = common.job()
data = common.batches(task)
guarded = task.get("guarded", False)
forward = models.JAX_FORWARD[task["model"]]
step = models.train_step_jax_guarded(forward) if guarded else models.train_step_jax(forward)
holder = {"state": models.adam_state_jax(common.weights(task))}


def run(batch):
    if not guarded:
        holder["state"], loss = step(holder["state"], batch["x"], batch["labels"])
        return float(loss)
    holder["state"], loss, finite = step(holder["state"], batch["x"], batch["labels"])
    loss, finite = jax.device_get((loss, finite))
    if not finite:
        raise FloatingPointError("NaN or Inf in the step: the state is kept")
    return float(loss)


common.report(**common.time_steps(run, data, task), versions=common.versions("jax", "jaxlib"))
