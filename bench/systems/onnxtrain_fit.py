"""onnxtrain-fit: Trainer.fit(steps_per_call=8), which runs 8 steps per compiled call (a
lax.scan) and reads every step's loss back as a float, one chunk late.

One timed sample = one fit call over CALL batches; its per-step time is the call's wall
time / CALL. The warm-up fit compiles the 8-step call (and the first step's loss comes from
a plain Trainer.step, so it is comparable across systems)."""

import itertools
import time
from pathlib import Path

import common
import onnxtrain

K, CALL = 8, 64

task = common.job()
data = common.batches(task)

trainer = onnxtrain.Trainer(Path(task["dir"]) / f"{task['model']}.training.onnx")
first_loss = float(trainer.step(data[0])["loss"])
call = min(CALL, max(K, task["steps"] // K * K))
stream = itertools.islice(itertools.cycle(data), 1, None)
warmup = [next(stream) for _ in range(max(K, task["warmup"] // K * K))]
trainer.fit(warmup, progress=False, steps_per_call=K)
times = []
for _ in range(max(1, task["steps"] // call)):
    chunk = [next(stream) for _ in range(call)]
    start = time.perf_counter()
    trainer.fit(chunk, progress=False, steps_per_call=K)
    times.append((time.perf_counter() - start) / call)
common.report(first_loss=first_loss, times=times, note=f"K={K}, {call} steps per fit call",
              compilations=trainer.compilations)
