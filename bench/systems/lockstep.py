"""lockstep: a resident onnxtrain worker that bench/ab.py drives one block at a time.

It builds the Trainer once and warms it up (compiling everything it will run), answers
{"ready": ...}, then serves requests from stdin: a line "N" runs N training steps (Trainer.step
per batch, the loss read back as a float; or, with "fit", Trainer.fit over N batches) and
answers {"seconds": ...}; an empty line or end of input answers with the peak RSS and the
compile count, and exits. The job adds "fit" (bool) and "nan_policy" to common.job()'s.

Two such workers, one per side, take turns on the CPU, so machine drift hits both alike.
"""

import itertools
import sys
import time
from pathlib import Path

import common
import onnxtrain

task = common.job()
trainer = onnxtrain.Trainer(Path(task["dir"]) / f"{task['model']}.training.onnx",
                            nan_policy=task.get("nan_policy", "raise"))
stream = itertools.cycle(common.batches(task))


def run(count: int) -> None:
    common.train(trainer, stream, count, bool(task.get("fit")))


run(task["warmup"])
common.report(ready=True, compilations=trainer.compilations)
for line in sys.stdin:
    if not line.strip():
        break
    start = time.perf_counter()
    run(int(line))
    common.report(seconds=time.perf_counter() - start)
common.report(compilations=trainer.compilations)
