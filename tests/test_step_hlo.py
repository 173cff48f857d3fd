"""The compiled training step computes the forward pass once, like a hand-written value_and_grad.

The Gradient node re-derives y from xs under jax.vjp while the combined graph
also computes y (the loss output); the compiled program must not do that work
twice. Oracle: the op counts in the optimized HLO of a hand-written jax.jit of
jax.value_and_grad with the same update (matmuls, convolutions, exponentials).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from onnx import TensorProto, helper, numpy_helper

import onnxtrain

RNG = np.random.default_rng(0)
# Three input channels: a 1-channel conv would run as shifted slices, not a convolution op.
WEIGHTS = {"C": RNG.normal(size=(4, 3, 3, 3)).astype(np.float32), "W": RNG.normal(size=(144, 5)).astype(np.float32)}
OPS = ("dot", "convolution", "exponential", "log")


def _counts(hlo: str) -> dict[str, int]:
    return {op: len(re.findall(rf"= \S+ {op}\(", hlo)) for op in OPS}


def _onnx_model():
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "C"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Tanh", ["c"], ["t"]),
         helper.make_node("Flatten", ["t"], ["f"]), helper.make_node("MatMul", ["f", "W"], ["logits"])],
        "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 6, 6])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 5])],
        [numpy_helper.from_array(v, k) for k, v in WEIGHTS.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return onnxtrain.make_training_model(model, loss="cross_entropy", optimizer=onnxtrain.optim.SGD(lr=0.1))


def _hand_written_hlo(x, labels) -> str:
    def loss(params):
        c = jax.lax.conv_general_dilated(x, params["C"], (1, 1), [(1, 1), (1, 1)])
        logits = jnp.tanh(c).reshape(len(x), -1) @ params["W"]
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)
        return -jnp.mean(picked)

    def step(params):
        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    params = {k: jnp.asarray(v) for k, v in WEIGHTS.items()}
    return jax.jit(step, donate_argnums=0).lower(params).compile().as_text()


def test_forward_pass_is_computed_once_per_step():
    x = RNG.normal(size=(8, 3, 6, 6)).astype(np.float32)
    labels = RNG.integers(0, 5, 8).astype(np.int64)
    # "ignore": the hand-written step has no NaN/Inf check, whose zero matrix-vector products
    # would add dots of their own.
    trainer = onnxtrain.Trainer(_onnx_model(), nan_policy="ignore")
    program = trainer._steps[0]
    feeds = program.check_feeds({"x": x, "labels": labels})
    with jax.enable_x64(True):
        ours = program._jitted.lower(trainer._store.values, program._key(trainer._store), program.constants,
                                     feeds).compile().as_text()
    expected = _counts(_hand_written_hlo(jnp.asarray(x), jnp.asarray(labels, jnp.int32)))
    # Conv: forward + kernel gradient; MatMul: forward + weight and input gradients; one softmax.
    assert expected == {"convolution": 2, "dot": 3, "exponential": 1, "log": 1}
    assert _counts(ours) == expected
