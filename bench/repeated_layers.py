"""What compiling a stack of identical layers once could give on this backend (issue 60,
point 1), measured on a hand-written JAX encoder so that nothing of onnxtrain's translation
is in the figures.

A BERT-style stack (hidden 128, 2 heads, feed-forward 512, batch 8 x 64 tokens; LayerNorm,
softmax attention, GELU), its loss's value and gradients and an SGD update as one jitted
step, lowered four ways:
- unrolled: every layer traced and compiled on its own (what onnxtrain's translation does now);
- nested jit: each layer a call of one jitted function (traced once; XLA inlines the calls);
- scan: the layers' weights stacked, the layer the body of a lax.scan (compiled once);
- scan, unroll 2: the same with two layers per loop iteration.
Each row: seconds to trace and lower, seconds to compile (JAX's persistent cache off), and
the step's median time over 7 rounds of 10 calls, the four variants taking turns.

Usage: python bench/repeated_layers.py [--layers 12 24]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

HIDDEN, HEADS, FEED, BATCH, LENGTH = 128, 2, 512, 8, 64


def layer_weights(rng: np.random.Generator) -> dict[str, jax.Array]:
    shapes = {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, HIDDEN), "v": (HIDDEN, HIDDEN), "o": (HIDDEN, HIDDEN),
              "f1": (HIDDEN, FEED), "f2": (FEED, HIDDEN), "bf": (FEED,),
              "g1": (HIDDEN,), "b1": (HIDDEN,), "g2": (HIDDEN,), "b2": (HIDDEN,)}
    return {name: jnp.asarray(rng.normal(size=shape).astype(np.float32) * 0.05) for name, shape in shapes.items()}


def norm(x: jax.Array, scale: jax.Array, shift: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-12) * scale + shift


def layer(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    def heads(y: jax.Array) -> jax.Array:
        return y.reshape(BATCH, LENGTH, HEADS, -1).transpose(0, 2, 1, 3)

    q, k, v = heads(x @ w["q"]), heads(x @ w["k"]), heads(x @ w["v"])
    attended = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / 8.0, -1) @ v
    x = norm(x + attended.transpose(0, 2, 1, 3).reshape(BATCH, LENGTH, HIDDEN) @ w["o"], w["g1"], w["b1"])
    return norm(x + jax.nn.gelu(x @ w["f1"] + w["bf"]) @ w["f2"], w["g2"], w["b2"])


def variants(layers: list[dict]) -> dict[str, tuple]:
    stacked = jax.tree.map(lambda *ws: jnp.stack(ws), *layers)
    shared = jax.jit(layer)

    def unrolled(ws, x):
        for w in ws:
            x = layer(x, w)
        return (x ** 2).mean()

    def nested(ws, x):
        for w in ws:
            x = shared(x, w)
        return (x ** 2).mean()

    def scanned(unroll):
        def loss(ws, x):
            x, _ = jax.lax.scan(lambda x, w: (layer(x, w), None), x, ws, unroll=unroll)
            return (x ** 2).mean()
        return loss

    return {"unrolled": (unrolled, layers), "nested jit": (nested, layers),
            "scan": (scanned(1), stacked), "scan, unroll 2": (scanned(2), stacked)}


def sgd_step(loss):
    @jax.jit
    def step(ws, x):
        value, grads = jax.value_and_grad(loss)(ws, x)
        return jax.tree.map(lambda w, g: w - 1e-3 * g, ws, grads), value
    return step


def measure(depth: int, rounds: int = 7, calls: int = 10) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(BATCH, LENGTH, HIDDEN)).astype(np.float32))
    compiled, rows = {}, {}
    for name, (loss, weights) in variants([layer_weights(rng) for _ in range(depth)]).items():
        start = time.perf_counter()
        lowered = sgd_step(loss).lower(weights, x)
        traced = time.perf_counter()
        compiled[name] = (lowered.compile(), weights)
        rows[name] = {"trace+lower s": traced - start, "compile s": time.perf_counter() - traced}
    times: dict[str, list[float]] = {name: [] for name in compiled}
    for _ in range(rounds):
        for name, (step, weights) in compiled.items():
            start = time.perf_counter()
            for _ in range(calls):
                out = step(weights, x)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / calls)
    base = statistics.median(times["unrolled"])
    for name in rows:
        rows[name]["step ms"] = statistics.median(times[name]) * 1e3
        rows[name]["step / unrolled"] = statistics.median(times[name]) / base
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="*", default=[12, 24])
    arguments = parser.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    print("| layers | lowering | trace+lower s | compile s | step ms | step / unrolled |\n|---|---|---|---|---|---|")
    for depth in arguments.layers:
        for name, row in measure(depth).items():
            print(f"| {depth} | {name} | {row['trace+lower s']:.2f} | {row['compile s']:.2f} | "
                  f"{row['step ms']:.1f} | {row['step / unrolled']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
