"""first-step: how long a new process takes from `import onnxtrain` to its first training
step's loss, on an exported inference model turned into a training model with
make_training_model (job: "path", "loss", optionally "output", and "feeds": an .npz of the
step's feeds, labels included).

Whether the step compiles or loads its program from JAX's persistent cache is the caller's
choice of ONNXTRAIN_COMPILATION_CACHE: an empty folder for a cold start, the same folder
again for a warm one. JAX's compile and cache-retrieval times come back beside the total.
"""

import collections
import time

start = time.perf_counter()

import common  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import onnxtrain  # noqa: E402

imported = time.perf_counter()
durations: dict[str, float] = collections.defaultdict(float)
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **_: durations.__setitem__(event, durations[event] + seconds))

task = common.job()
with np.load(task["feeds"]) as data:
    feeds = dict(data)
trainer = onnxtrain.Trainer(onnxtrain.make_training_model(task["path"], loss=task["loss"],
                                                          output=task.get("output")))
loss = float(trainer.step(feeds)["loss"])
done = time.perf_counter()
common.report(first_step_s=done - imported, import_s=imported - start, loss=loss,
              trace_s=durations["/jax/core/compile/jaxpr_trace_duration"],
              compile_s=durations["/jax/core/compile/backend_compile_duration"],
              cache_retrieval_s=durations["/jax/compilation_cache/cache_retrieval_time_sec"])
