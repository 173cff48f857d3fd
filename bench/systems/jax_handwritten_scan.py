"""jax-handwritten-scan: bench/models.train_steps_jax, common.STEPS_PER_CALL (8) steps per
jax.jit call (a lax.scan over that many stacked batches) with the state donated; every
step's loss read back as a float, one call late, so the host stacks the next batches while
the device computes. The reference for onnxtrain-fit (see common.time_calls)."""

import sys
from pathlib import Path

import numpy as np

import common

sys.path.insert(0, str(Path(__file__).parents[1]))
import models  # noqa: E402

task = common.job()
steps = models.train_steps_jax(models.JAX_FORWARD[task["model"]])
holder = {"state": models.adam_state_jax(common.weights(task))}


def run(batches):
    losses, pending = [], None
    for start in range(0, len(batches), common.STEPS_PER_CALL):
        part = batches[start:start + common.STEPS_PER_CALL]
        xs, labels = (np.stack([batch[name] for batch in part]) for name in ("x", "labels"))
        holder["state"], step_losses = steps(holder["state"], xs, labels)
        if pending is not None:
            losses += np.asarray(pending).tolist()
        pending = step_losses
    return losses + np.asarray(pending).tolist()


common.report(**common.time_calls(run, common.batches(task), task),
              versions=common.versions("jax", "jaxlib"))
