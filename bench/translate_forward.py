"""Forward pass of translated ONNX models versus hand-written jax.jit, side by side.

Targets (issue 3): the MLP (784-256-10, batch 64) per call within 1.2x of the
hand-written jitted function, compiling once; the CNN of performance-anchors.md
within 1.1x. When onnxruntime is installed, its InferenceSession on the same
model is timed in the same rounds (issue 6 anchor: forward-only CNN within 1.5x
of it). Each round times every system back to back, reversing the order every
other round; a ratio reported is the median over rounds of per-round ratios.

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


def _onnxruntime(onnx_model, x):
    """A call of onnxruntime's InferenceSession on the model, or None without onnxruntime."""
    try:
        import onnxruntime
    except ImportError:
        return None
    session = onnxruntime.InferenceSession(onnx_model.SerializeToString(), providers=["CPUExecutionProvider"])
    return lambda: session.run(None, {"x": x})[0]


def compare(name: str, onnx_model, hand_written, weights, x, rounds: int, calls: int) -> float:
    translated, params = onnxtrain.translate_model(onnx_model)
    jitted = jax.jit(hand_written)
    hand_params = {k: jax.numpy.asarray(v) for k, v in weights.items()}
    systems = {"translated": lambda: translated(params, {"x": x})["logits"],
               "hand-written jit": lambda: jitted(hand_params, x)}
    if (onnxruntime_call := _onnxruntime(onnx_model, x)) is not None:
        systems["onnxruntime"] = onnxruntime_call
    for call in systems.values():
        np.testing.assert_allclose(np.asarray(call()), np.asarray(systems["translated"]()), rtol=1e-4, atol=1e-4)
    for _ in range(50):
        for call in systems.values():
            call()
    compiles_before = translated._jitted._cache_size()
    times: dict[str, list[float]] = {system: [] for system in systems}
    ratios: dict[str, list[float]] = {system: [] for system in systems}
    for index in range(rounds):
        order = list(systems) if index % 2 == 0 else list(systems)[::-1]
        measured = {system: _median_call_seconds(systems[system], calls) for system in order}
        for system, seconds in measured.items():
            times[system].append(seconds)
            ratios[system].append(measured["translated"] / seconds)
    compiles = translated._jitted._cache_size()
    others = "   ".join(f"{system} {statistics.median(times[system]) * 1e3:7.3f} ms "
                        f"(ratio {statistics.median(ratios[system]):5.3f})" for system in list(systems)[1:])
    print(f"{name:<6} translated {statistics.median(times['translated']) * 1e3:7.3f} ms   {others}   "
          f"compilations {compiles} (unchanged over {rounds * calls} timed calls: {compiles == compiles_before})")
    return statistics.median(ratios["hand-written jit"])


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
