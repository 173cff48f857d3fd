"""onnxtrain-fit: Trainer.fit(steps_per_call=common.STEPS_PER_CALL), which runs 8 steps per
compiled call (a lax.scan) and reads every step's loss back as a float, one chunk late; the
job's "steps_per_call" overrides that (onnxtrain-fit-k1: fit's default, one step per call,
each step's loss and NaN/Inf check read one step late), its "nan_policy" the Trainer's
default, "raise" (onnxtrain-fit-unchecked: "ignore").

One timed sample = one fit call (see common.time_calls). The first step's loss comes from
the warm-up fit call, so the process compiles only what fit runs."""

from pathlib import Path

import common
import onnxtrain

task = common.job()
trainer = onnxtrain.Trainer(Path(task["dir"]) / f"{task['model']}.training.onnx",
                            nan_policy=task.get("nan_policy", "raise"))


steps_per_call = task.get("steps_per_call", common.STEPS_PER_CALL)


def run(batches):
    return trainer.fit(batches, progress=False, steps_per_call=steps_per_call)["step_loss"]


common.report(**common.time_calls(run, common.batches(task), task, steps_per_call=steps_per_call),
              compilations=trainer.compilations)
