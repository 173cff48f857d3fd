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
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
import onnxtrain._engine.strategies as strategies
from onnxtrain._engine.compiled import ProgramLimit
from onnxtrain.translate.compiler_options import jit_with_options
from support.model_factory import conv_classifier

pytestmark = pytest.mark.slow  # each test compiles training steps to read their optimized HLO

RNG = np.random.default_rng(0)
# Three input channels: a 1-channel conv would run as shifted slices, not a convolution op;
# 9x9 images: a conv with few output positions would run as a matrix product.
WEIGHTS = {"C": RNG.normal(size=(4, 3, 3, 3)).astype(np.float32), "W": RNG.normal(size=(324, 5)).astype(np.float32)}
OPS = ("dot", "convolution", "exponential", "log")


def _counts(hlo: str) -> dict[str, int]:
    return {op: len(re.findall(rf"= \S+ {op}\(", hlo)) for op in OPS}


def _onnx_model():
    model = conv_classifier(WEIGHTS["C"], WEIGHTS["W"], activation="Tanh", size=9)
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


def _step_hlo(trainer: onnxtrain.Trainer, feeds: dict) -> str:
    """The optimized HLO of the trainer's step. Trainers here use nan_policy "ignore": the
    hand-written step has no NaN/Inf check, whose zero matrix-vector products add dots."""
    return trainer.lowered(feeds).compile().as_text()


def test_forward_pass_is_computed_once_per_step():
    x = RNG.normal(size=(8, 3, 9, 9)).astype(np.float32)
    labels = RNG.integers(0, 5, 8).astype(np.int64)
    ours = _step_hlo(onnxtrain.Trainer(_onnx_model(), nan_policy="ignore"), {"x": x, "labels": labels})
    expected = _counts(_hand_written_hlo(jnp.asarray(x), jnp.asarray(labels, jnp.int32)))
    # Conv: forward + kernel gradient; MatMul: forward + weight and input gradients; one softmax.
    assert expected == {"convolution": 2, "dot": 3, "exponential": 1, "log": 1}
    assert _counts(ours) == expected


LN_WEIGHTS = {"W1": RNG.normal(size=(8, 16)).astype(np.float32), "g": RNG.normal(size=16).astype(np.float32),
              "b": RNG.normal(size=16).astype(np.float32), "W2": RNG.normal(size=(16, 5)).astype(np.float32)}


def _layer_norm_model():
    """x[batch, 4, 8] -> MatMul -> LayerNormalization -> Relu -> MatMul -> mean over axis 1. The
    axes Constant comes after the second MatMul, as exporters often place constants."""
    node = helper.make_node
    graph = helper.make_graph(
        [node("MatMul", ["x", "W1"], ["h"]),
         node("LayerNormalization", ["h", "g", "b"], ["n", "mean", "inv_std"], axis=-1, epsilon=1e-5),
         node("Relu", ["n"], ["r"]), node("MatMul", ["r", "W2"], ["s"]),
         node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array([1], np.int64), "axes")),
         node("ReduceMean", ["s", "axes"], ["logits"], keepdims=0)],
        "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 5])],
        [numpy_helper.from_array(v, k) for k, v in LN_WEIGHTS.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    return onnxtrain.make_training_model(model, loss="cross_entropy", optimizer=onnxtrain.optim.SGD(lr=0.1))


def _layer_norm_step(params, x, labels):
    def loss(params):
        h = x @ params["W1"]
        mean = h.mean(-1, keepdims=True)
        n = (h - mean) / jnp.sqrt(jnp.square(h - mean).mean(-1, keepdims=True) + 1e-5) * params["g"] + params["b"]
        logits = (jnp.maximum(n, 0) @ params["W2"]).mean(1)
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)
        return -jnp.mean(picked)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


def test_forward_pass_through_layer_normalization_is_computed_once():
    """XLA does not merge a replayed LayerNormalization with the forward one (its 1/sqrt
    simplifies differently in each copy), so this holds only if the Gradient node reuses the
    forward values; the step must also match the hand-written one."""
    x = RNG.normal(size=(6, 4, 8)).astype(np.float32)
    labels = RNG.integers(0, 5, 6).astype(np.int64)
    trainer = onnxtrain.Trainer(_layer_norm_model(), nan_policy="ignore")
    ours = _step_hlo(trainer, {"x": x, "labels": labels})
    params = {k: jnp.asarray(v) for k, v in LN_WEIGHTS.items()}
    step = jax.jit(_layer_norm_step)
    expected = _counts(step.lower(params, jnp.asarray(x), jnp.asarray(labels, jnp.int32)).compile().as_text())
    # Forward: two matmuls; gradient: W2's, r's and W1's (x is not differentiated).
    assert expected["dot"] == 5
    assert _counts(ours) == expected
    loss = trainer.step({"x": x, "labels": labels})["loss"]
    new_params, expected_loss = step(params, jnp.asarray(x), jnp.asarray(labels, jnp.int32))
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for name, value in new_params.items():
        np.testing.assert_allclose(trainer.state[name], value, rtol=1e-4, atol=1e-6)


def _two_conv_model():
    """x[batch, 3, 6, 6] -> Conv C1 (bias c1) -> Relu -> Conv C2 (bias c2) -> Relu -> Flatten
    -> MatMul W -> Add B: the backward pass reads C2 and W too (for the gradients below them)."""
    shapes = {"C1": (4, 3, 3, 3), "c1": (4,), "C2": (4, 4, 3, 3), "c2": (4,), "W": (144, 5), "B": (5,)}
    weights = {name: RNG.normal(size=shape).astype(np.float32) * 0.2 for name, shape in shapes.items()}
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "C1", "c1"], ["a1"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["a1"], ["r1"]),
         helper.make_node("Conv", ["r1", "C2", "c2"], ["a2"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["a2"], ["r2"]), helper.make_node("Flatten", ["r2"], ["f"]),
         helper.make_node("MatMul", ["f", "W"], ["l"]), helper.make_node("Add", ["l", "B"], ["logits"])],
        "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 6, 6])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 5])],
        [numpy_helper.from_array(value, name) for name, value in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return onnxtrain.make_training_model(model, loss="cross_entropy", optimizer=onnxtrain.optim.Adam(lr=1e-3))


def _two_conv_feeds(runner) -> dict:
    return runner.step.check_feeds({"x": RNG.normal(size=(8, 3, 6, 6)).astype(np.float32),
                                    "labels": RNG.integers(0, 5, 8).astype(np.int64)})


def test_fit_linked_steps_write_into_spare_buffers_and_need_less_scratch():
    """fit's steps (run ahead of the host reading their NaN/Inf checks) select old-or-new
    state into spare buffers and only read the old state. Donating the state instead keeps
    the new values in scratch memory until the select writes them over the old ones (measured
    in bench/RESULTS.md, "Design measurements")."""
    trainer = onnxtrain.Trainer(_two_conv_model())
    runner, store = trainer._runners[0], trainer._store
    linked, feeds = runner.plan(store).linked, _two_conv_feeds(runner)
    constants, accepting = runner.step.constants, runner.ledger.accepting

    def donated_link(state, key, constants, feeds, accepting):
        return strategies._selecting_step(linked, state, key, constants, feeds, accepting)

    with jax.enable_x64(True):
        ours = linked._run.lower(store.values, store.spares(runner.step.bound), None, constants, feeds,
                                 accepting).compile()
        theirs = jit_with_options(donated_link, donate_argnums=0).lower(
            store.values, None, constants, feeds, accepting).compile()
    assert ours.memory_analysis().temp_size_in_bytes < theirs.memory_analysis().temp_size_in_bytes
    assert any(alias for alias in re.findall(r"input_output_alias=\{([^}]*)\}", ours.as_text()))


def test_unchecked_steps_write_into_spare_buffers_and_need_less_scratch(monkeypatch):
    """Under nan_policy "ignore" a step (on a state of SMALL_STATE_BYTES or more) reads the
    state and writes the new values into spare buffers. Donating the state instead, XLA keeps
    copies of the weights the backward pass reads in scratch memory next to the gradients
    (measured in bench/RESULTS.md, "Design measurements")."""
    monkeypatch.setattr(strategies, "SMALL_STATE_BYTES", 0)
    trainer = onnxtrain.Trainer(_two_conv_model(), nan_policy="ignore")
    runner, store = trainer._runners[0], trainer._store
    feeds = _two_conv_feeds(runner)
    ours = trainer.lowered(feeds).compile()
    in_place = strategies.InPlace(runner.step, trainer._placement, runner.ledger, ProgramLimit())
    with jax.enable_x64(True):
        theirs = in_place._run.lower(store.values, None, runner.step.constants, feeds).compile()
    assert ours.memory_analysis().temp_size_in_bytes < theirs.memory_analysis().temp_size_in_bytes
    assert re.findall(r"copy\(%state__\w+__", theirs.as_text())
    assert not re.findall(r"copy\(%state__\w+__", ours.as_text())
