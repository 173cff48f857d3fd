"""The ceiling of a channel-last translation (issue 36): SqueezeNet 1.1 and ResNet-18 written by
hand in JAX twice, the same but for the activations' layout (NCHW, as ONNX graphs have them, or
NHWC, as XLA:CPU's convolution works inside), stepped side by side in one process.

Both steps are one jitted value_and_grad of cross entropy plus an SGD update, with the
parameters donated and onnxtrain's compiler options. BatchNorm is left out, as the exporters
fold it. With --export, onnxtrain's step on that exported model (SGD, nan_policy="ignore")
joins the rotation, as a third system against the NCHW one.

Usage: python bench/channel_last.py [--model squeezenet1_1|resnet18] [--batch 32] [--size 64]
                                    [--rounds 8] [--calls 3] [--export model.onnx]
Prints each round's times and the medians of the per-round ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from onnxtrain.translate.compiler_options import jit_with_options

# SqueezeNet 1.1's Fire modules (input, squeeze, 1x1 expand, 3x3 expand channels), "pool"
# where a 3x3 stride-2 max pool sits between them.
FIRES = ((64, 16, 64, 64), (128, 16, 64, 64), "pool", (128, 32, 128, 128), (256, 32, 128, 128),
         "pool", (256, 48, 192, 192), (384, 48, 192, 192), (384, 64, 256, 256), (512, 64, 256, 256))
RESNET_WIDTHS = (64, 128, 256, 512)


def init_params(model: str, key: jax.Array) -> dict:
    """Random weights (LeCun normal, zero biases) keyed by layer name: convolutions as (w, b)."""
    params = {}

    def conv(name: str, cin: int, cout: int, kernel: int) -> None:
        nonlocal key
        key, sub = jax.random.split(key)
        w = jax.random.normal(sub, (cout, cin, kernel, kernel), jnp.float32) / np.sqrt(cin * kernel * kernel)
        params[name] = (w, jnp.zeros((cout,), jnp.float32))

    if model == "squeezenet1_1":
        conv("stem", 3, 64, 3)
        for i, fire in enumerate(FIRES):
            if fire != "pool":
                cin, squeeze, e1, e3 = fire
                conv(f"f{i}.squeeze", cin, squeeze, 1)
                conv(f"f{i}.expand1", squeeze, e1, 1)
                conv(f"f{i}.expand3", squeeze, e3, 3)
        conv("classifier", 512, 1000, 1)
        return params
    conv("stem", 3, 64, 7)
    cin = 64
    for stage, width in enumerate(RESNET_WIDTHS):
        for block in range(2):
            conv(f"s{stage}b{block}.c1", cin, width, 3)
            conv(f"s{stage}b{block}.c2", width, width, 3)
            if cin != width:
                conv(f"s{stage}b{block}.down", cin, width, 1)
            cin = width
    key, sub = jax.random.split(key)
    params["fc"] = (jax.random.normal(sub, (512, 1000), jnp.float32) / np.sqrt(512), jnp.zeros((1000,), jnp.float32))
    return params


def forward(model: str, layout: str) -> Callable:
    """The network's logits in `layout`: (params, images) -> (batch, 1000)."""
    channels = layout.index("C")
    spatial = tuple(i for i, axis in enumerate(layout) if axis in "HW")

    def conv(x, wb, stride=1, pad=0):
        w, b = wb
        y = lax.conv_general_dilated(x, w, (stride, stride), [(pad, pad)] * 2,
                                     dimension_numbers=(layout, "OIHW", layout))
        return y + b.reshape([-1 if axis == channels else 1 for axis in range(4)])

    def max_pool(x, pad, ceil_mode):
        window, strides, pads = [1] * 4, [1] * 4, [(0, 0)] * 4
        for axis in spatial:
            window[axis], strides[axis] = 3, 2
            # torch's ceil_mode: one more window where the last one would start inside.
            extra = (x.shape[axis] + 2 * pad - 3) % 2 if ceil_mode else 0
            pads[axis] = (pad, pad + extra)
        return lax.reduce_window(x, -jnp.inf, lax.max, window, strides, pads)

    def squeezenet(p, x):
        x = max_pool(jax.nn.relu(conv(x, p["stem"], 2)), 0, True)
        for i, fire in enumerate(FIRES):
            if fire == "pool":
                x = max_pool(x, 0, True)
                continue
            s = jax.nn.relu(conv(x, p[f"f{i}.squeeze"]))
            x = jnp.concatenate([jax.nn.relu(conv(s, p[f"f{i}.expand1"])),
                                 jax.nn.relu(conv(s, p[f"f{i}.expand3"], 1, 1))], axis=channels)
        return jax.nn.relu(conv(x, p["classifier"])).mean(axis=spatial)

    def resnet(p, x):
        x = max_pool(jax.nn.relu(conv(x, p["stem"], 2, 3)), 1, False)
        cin = 64
        for stage, width in enumerate(RESNET_WIDTHS):
            for block in range(2):
                name, stride = f"s{stage}b{block}", 2 if stage and not block else 1
                h = conv(jax.nn.relu(conv(x, p[f"{name}.c1"], stride, 1)), p[f"{name}.c2"], 1, 1)
                shortcut = conv(x, p[f"{name}.down"], stride) if cin != width else x
                x, cin = jax.nn.relu(h + shortcut), width
        w, b = p["fc"]
        return x.mean(axis=spatial) @ w + b

    return squeezenet if model == "squeezenet1_1" else resnet


def sgd_step(model: str, layout: str) -> Callable:
    """(params, images, labels) -> (new params, loss), jitted with the params donated."""
    logits_of = forward(model, layout)

    def loss(params, x, labels):
        logits = jax.nn.log_softmax(logits_of(params, x))
        return -jnp.take_along_axis(logits, labels[:, None], 1).mean()

    def step(params, x, labels):
        value, grads = jax.value_and_grad(loss)(params, x, labels)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), value

    return jit_with_options(step, donate_argnums=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("squeezenet1_1", "resnet18"), default="squeezenet1_1")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--export", help="the same model exported to ONNX, for onnxtrain's step beside them")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    images = rng.standard_normal((args.batch, 3, args.size, args.size)).astype(np.float32)
    labels = rng.integers(0, 1000, args.batch)
    systems = {}
    for layout in ("NCHW", "NHWC"):
        state = {"params": init_params(args.model, jax.random.key(0))}
        x = jnp.asarray(images if layout == "NCHW" else images.transpose(0, 2, 3, 1))
        step = sgd_step(args.model, layout)

        def run(state=state, x=x, step=step, y=jnp.asarray(labels, jnp.int32)):
            state["params"], loss = step(state["params"], x, y)
            return float(loss)
        systems[layout] = run
    if args.export:
        import onnxtrain

        trainer = onnxtrain.Trainer(onnxtrain.make_training_model(args.export, loss="cross_entropy", optimizer="sgd"),
                                    nan_policy="ignore")
        feeds = dict(zip(trainer.step_inputs(), [images, labels.astype(np.int64)]))
        systems["onnxtrain"] = lambda: float(trainer.step(feeds)["loss"])
    for run in systems.values():
        for _ in range(3):
            run()

    times = {name: [] for name in systems}
    names = list(systems)
    for round_ in range(args.rounds):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            start = time.perf_counter()
            for _ in range(args.calls):
                systems[name]()
            times[name].append((time.perf_counter() - start) / args.calls * 1e3)
        print(f"round {round_}: " + "  ".join(f"{n} {times[n][-1]:.1f} ms" for n in names), flush=True)
    for name in names[1:]:
        ratios = [a / b for a, b in zip(times[name], times["NCHW"])]
        print(f"{args.model} batch {args.batch}: {name} / NCHW {statistics.median(ratios):.3f} "
              f"(rounds {min(ratios):.2f}-{max(ratios):.2f}); {name} {statistics.median(times[name]):.1f} ms, "
              f"NCHW {statistics.median(times['NCHW']):.1f} ms")


if __name__ == "__main__":
    main()
