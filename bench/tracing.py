"""Where tracing a training step goes (issue 60, point 5): for BERT-style encoder exports of
given depths (bench/startup.py builds them), the seconds JAX spends tracing and lowering one
checked step, the nested `jit` traces (jax.numpy's functions are jitted) counted by the line
of onnxtrain that called them, and what calling `lax` directly instead of jax.numpy would
save: the same element-wise chain traced both ways, plainly and under `jax.vjp` (how the
step's forward pass is traced).

Usage: python bench/tracing.py [--encoder-layers 12 24] [--exports /tmp/onnxtrain-zoo] [--lines 12]
Needs the test extras (torch, transformers, onnxscript) to export the encoders.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import pjit

sys.path.insert(0, str(Path(__file__).parent))

from startup import ENCODER_BATCH, ENCODER_LENGTH, encoder_export  # noqa: E402

import onnxtrain  # noqa: E402

ROOT = str(Path(__file__).resolve().parent.parent) + "/"
TRACE, LOWER = "/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration"


def nested_jits(path: Path, lines: int) -> tuple[dict[str, float], int, list[tuple[int, str]]]:
    """(JAX's trace and lower seconds, nested jit traces, the lines calling most of them) of
    one checked step of the encoder at `path`, traced and lowered once, not compiled."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, (ENCODER_BATCH, ENCODER_LENGTH)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids),
             "labels": rng.integers(0, 2, ENCODER_BATCH).astype(np.int64)}
    trainer = onnxtrain.Trainer(onnxtrain.make_training_model(str(path), loss="cross_entropy", output="logits"))
    seconds: collections.Counter = collections.Counter()
    listener = lambda event, duration, **_: seconds.update({event: duration})  # noqa: E731
    callers: collections.Counter = collections.Counter()
    infer_params = pjit._infer_params

    def counted(fun, *args, **kwargs):
        name = getattr(fun, "__name__", "?")
        for frame in reversed(traceback.extract_stack(limit=16)[:-1]):
            if frame.filename.startswith(ROOT) and "/.venv" not in frame.filename:
                callers[f"{name} at {frame.filename[len(ROOT):]}:{frame.lineno}"] += 1
                break
        else:
            callers[f"{name} (outside onnxtrain)"] += 1
        return infer_params(fun, *args, **kwargs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    pjit._infer_params = counted
    try:
        trainer.lowered(feeds)
    finally:
        pjit._infer_params = infer_params
        jax.monitoring.unregister_event_duration_listener(listener)
    return ({"trace s": seconds[TRACE], "lower s": seconds[LOWER]}, sum(callers.values()),
            [(count, where) for where, count in callers.most_common(lines)])


def chain_timings(length: int = 1000) -> dict[str, float]:
    """Seconds to trace `length` steps of x = s * x + x through jax.numpy and through lax,
    plainly and under jax.vjp; each function is new, so nothing comes from JAX's caches."""
    x, s = jnp.ones((64, 64), jnp.float32), jnp.float32(0.5)

    def through_numpy(x, s):
        for _ in range(length):
            x = s * x + x
        return x

    def through_lax(x, s):
        for _ in range(length):
            x = lax.add(lax.mul(lax.broadcast_in_dim(s, x.shape, ()), x), x)
        return x

    timings = {}
    for name, chain in (("jax.numpy", through_numpy), ("lax", through_lax)):
        start = time.perf_counter()
        jax.make_jaxpr(lambda x, s: chain(x, s))(x, s)
        timings[f"{name}, traced s"] = time.perf_counter() - start
        start = time.perf_counter()
        jax.make_jaxpr(lambda x, s: jax.vjp(lambda x: chain(x, s), x)[0])(x, s)
        timings[f"{name}, under vjp s"] = time.perf_counter() - start
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--encoder-layers", type=int, nargs="*", default=[12, 24])
    parser.add_argument("--exports", type=Path, default=Path("/tmp/onnxtrain-zoo"))
    parser.add_argument("--lines", type=int, default=12)
    arguments = parser.parse_args()
    arguments.exports.mkdir(parents=True, exist_ok=True)
    for layers in arguments.encoder_layers:
        seconds, total, top = nested_jits(encoder_export(layers, arguments.exports), arguments.lines)
        print(f"\n{layers} layers: trace {seconds['trace s']:.2f} s, lower {seconds['lower s']:.2f} s, "
              f"{total} nested jit traces; the lines calling most of them:")
        for count, where in top:
            print(f"  {count:5d}  {where}")
    print("\n| chain of 1000 x = s * x + x | seconds |\n|---|---|")
    for name, value in chain_timings().items():
        print(f"| {name} | {value:.3f} |")


if __name__ == "__main__":
    main()
