"""Forward pass of translated ONNX models versus hand-written jax.jit, side by side.

Targets (issue 3): the MLP (784-256-10, batch 64) per call within 1.2x of the
hand-written jitted function, compiling once; the CNN of performance-anchors.md
within 1.1x. Each round times both versions back to back, alternating which
goes first; the ratio reported is the median over rounds of per-round medians.

Usage: python bench/translate_forward.py [--rounds 5] [--calls 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import models  # noqa: E402

import onnxtrain  # noqa: E402


def _median_call_seconds(call, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(name: str, onnx_model, hand_written, weights, x, rounds: int, calls: int) -> float:
    translated, params = onnxtrain.translate_model(onnx_model)
    traces = []
    jitted = jax.jit(lambda p, v: (traces.append(1), hand_written(p, v))[1])
    hand_params = {k: jax.numpy.asarray(v) for k, v in weights.items()}
    ours = lambda: translated(params, {"x": x})["logits"]  # noqa: E731
    theirs = lambda: jitted(hand_params, x)  # noqa: E731
    np.testing.assert_allclose(np.asarray(ours()), np.asarray(theirs()), rtol=1e-4, atol=1e-4)
    for _ in range(50):
        ours(), theirs()
    compiles_before = translated._jitted._cache_size()
    ratios, our_times, their_times = [], [], []
    for index in range(rounds):
        pair = (ours, theirs) if index % 2 == 0 else (theirs, ours)
        measured = {id(f): _median_call_seconds(f, calls) for f in pair}
        our_times.append(measured[id(ours)])
        their_times.append(measured[id(theirs)])
        ratios.append(measured[id(ours)] / measured[id(theirs)])
    compiles = translated._jitted._cache_size()
    print(f"{name:<6} translated {statistics.median(our_times) * 1e3:7.3f} ms   "
          f"hand-written jit {statistics.median(their_times) * 1e3:7.3f} ms   "
          f"ratio {statistics.median(ratios):5.3f}   "
          f"compilations {compiles} (unchanged over {rounds * calls} timed calls: "
          f"{compiles == compiles_before})")
    return statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300)
    arguments = parser.parse_args()
    rng = np.random.default_rng(0)
    mlp = models.mlp_weights()
    compare("MLP", models.mlp_onnx(mlp), models.mlp_jax, mlp,
            rng.standard_normal((64, 784)).astype(np.float32), arguments.rounds, arguments.calls)
    cnn = models.cnn_weights()
    compare("CNN", models.cnn_onnx(cnn), models.cnn_jax, cnn,
            rng.standard_normal((64, 1, 28, 28)).astype(np.float32), arguments.rounds,
            max(arguments.calls // 10, 30))


if __name__ == "__main__":
    main()
