"""make_training_model: the recipes it writes are valid ONNX and train as hand-derived numpy says.

Oracles: onnx's checker on the combined (main + algorithm) and initialization
graphs, numpy re-implementations of each loss and optimizer step, and the ONNX
BatchNormalization training-mode formulas.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import BindingError, optim
from support.onnx_checks import check_training_model

RNG = np.random.default_rng(0)
W = RNG.normal(size=(4, 3)).astype(np.float32)
B = RNG.normal(size=3).astype(np.float32)
X = RNG.normal(size=(16, 4)).astype(np.float32)


def _linear(extra_nodes=(), extra_initializers=(), opset=17, output="y"):
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "B"], ["y"]),
             *extra_nodes]
    graph = helper.make_graph(
        nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "B"), *extra_initializers])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


LOSSES = {
    "mse": (lambda p, t: np.mean((p - t) ** 2), lambda p, t: 2 * (p - t) / p.size),
    "l1": (lambda p, t: np.mean(np.abs(p - t)), lambda p, t: np.sign(p - t) / p.size),
    "bce_with_logits": (lambda p, t: np.mean(np.logaddexp(0, p) - p * t),
                        lambda p, t: (1 / (1 + np.exp(-p)) - t) / p.size),
}


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_elementwise_losses_and_sgd_step_match_numpy(loss):
    model = onnxtrain.make_training_model(_linear(), loss=loss, optimizer=optim.SGD(lr=0.1))
    check_training_model(model)
    target = RNG.uniform(size=(16, 3)).astype(np.float32)
    trainer = onnxtrain.Trainer(model)
    value, derivative = LOSSES[loss]
    prediction = X.astype(np.float64) @ W + B
    out = trainer.step({"x": X, "labels": target})
    np.testing.assert_allclose(out["loss"], value(prediction, target), rtol=1e-5)
    upstream = derivative(prediction, target)
    np.testing.assert_allclose(trainer.state["W"], W - 0.1 * X.T @ upstream, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trainer.state["B"], B - 0.1 * upstream.sum(0), rtol=1e-5, atol=1e-6)


def test_cross_entropy_with_adam_counts_from_one():
    labels = RNG.integers(0, 3, 16).astype(np.int64)
    model = onnxtrain.make_training_model(_linear(), loss="cross_entropy", optimizer=optim.Adam(lr=0.01))
    check_training_model(model)
    trainer = onnxtrain.Trainer(model)
    logits = X.astype(np.float64) @ W + B
    probabilities = np.exp(logits - logits.max(1, keepdims=True))
    probabilities /= probabilities.sum(1, keepdims=True)
    out = trainer.step({"x": X, "labels": labels})
    np.testing.assert_allclose(out["loss"], -np.mean(np.log(probabilities[np.arange(16), labels])), rtol=1e-5)
    upstream = (probabilities - np.eye(3)[labels]) / 16
    g = X.T @ upstream
    v, h = 0.1 * g, 0.001 * g * g
    rate = 0.01 * np.sqrt(1 - 0.999) / (1 - 0.9)   # bias correction at T = 1
    np.testing.assert_allclose(trainer.state["W"], W - rate * v / (np.sqrt(h) + 1e-8), rtol=1e-4)
    assert int(trainer.state["step"]) == 2


def test_learning_rate_is_state_and_changes_without_recompiling():
    model = onnxtrain.make_training_model(_linear(), loss="mse", optimizer=optim.SGD(lr=0.1))
    trainer = onnxtrain.Trainer(model)
    target = np.zeros((16, 3), np.float32)
    trainer.step({"x": X, "labels": target})
    compiled = trainer.compilations
    trainer.set_state("learning_rate", 0.0)
    before = np.asarray(trainer.state["W"])
    trainer.step({"x": X, "labels": target})
    np.testing.assert_array_equal(trainer.state["W"], before)
    assert trainer.compilations == compiled
    trainer.initialize()
    assert float(trainer.state["learning_rate"]) == pytest.approx(0.1)


@pytest.mark.slow
def test_batchnorm_trains_on_batch_statistics_and_updates_running_ones():
    channels = 3
    scale, bias = np.ones(channels, np.float32), np.zeros(channels, np.float32)
    mean, var = np.full(channels, 0.5, np.float32), np.full(channels, 2.0, np.float32)
    bn = helper.make_node("BatchNormalization", ["y", "s", "b", "m", "v"], ["z"], momentum=0.9)
    model = _linear([bn], [numpy_helper.from_array(a, n) for a, n in
                           ((scale, "s"), (bias, "b"), (mean, "m"), (var, "v"))], output="z")
    training = onnxtrain.make_training_model(model, loss="mse", optimizer=optim.SGD(lr=0.0))
    check_training_model(training)
    trainer = onnxtrain.Trainer(training)
    assert "m" in trainer.state_names and "m" not in [b.key for b in training.training_info[0].initialization_binding]
    target = np.zeros((16, 3), np.float32)
    out = trainer.step({"x": X, "labels": target})
    y = X.astype(np.float64) @ W + B
    batch_mean, batch_var = y.mean(0), y.var(0)
    normalized = (y - batch_mean) / np.sqrt(batch_var + 1e-5)
    np.testing.assert_allclose(out["loss"], np.mean(normalized ** 2), rtol=1e-4)
    np.testing.assert_allclose(trainer.state["m"], 0.9 * mean + 0.1 * batch_mean, rtol=1e-5)
    np.testing.assert_allclose(trainer.state["v"], 0.9 * var + 0.1 * batch_var, rtol=1e-5)
    inferred = np.asarray(trainer.infer({"x": X})["z"])
    running = (y - trainer.state["m"]) / np.sqrt(np.asarray(trainer.state["v"]) + 1e-5)
    np.testing.assert_allclose(inferred, running, rtol=1e-4, atol=1e-5)

    frozen = onnxtrain.Trainer(onnxtrain.make_training_model(model, loss="mse", optimizer=optim.SGD(lr=0.0),
                                                            freeze_batchnorm=True))
    assert "m" not in frozen.state_names
    frozen_loss = frozen.step({"x": X, "labels": target})["loss"]
    np.testing.assert_allclose(frozen_loss, np.mean(((y - mean) / np.sqrt(var + 1e-5)) ** 2), rtol=1e-4)


@pytest.mark.slow
def test_dropout_is_active_in_training_steps_only():
    dropout = helper.make_node("Dropout", ["y", "ratio"], ["z"])
    ratio = numpy_helper.from_array(np.array(0.5, np.float32), "ratio")
    model = onnxtrain.make_training_model(_linear([dropout], [ratio], output="z"), loss="mse",
                                          optimizer=optim.SGD(lr=0.0))
    trainer = onnxtrain.Trainer(model, seed=3)
    target = np.zeros((16, 3), np.float32)
    losses = {float(trainer.step({"x": X, "labels": target})["loss"]) for _ in range(3)}
    assert len(losses) == 3
    np.testing.assert_allclose(trainer.infer({"x": X})["z"], X @ W + B, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_trainable_selection_and_reinitialization():
    model = onnxtrain.make_training_model(_linear(), loss="mse", optimizer=optim.Momentum(lr=0.1),
                                          trainable=lambda name, value: value.ndim == 2, reinitialize=["W"])
    trainer = onnxtrain.Trainer(model, seed=1)
    assert "B" not in trainer.state_names and "W" in trainer.state_names
    trainer.step({"x": X, "labels": np.zeros((16, 3), np.float32)})
    np.testing.assert_array_equal(trainer.infer({"x": np.zeros((1, 4), np.float32)})["y"][0], B)
    trainer.initialize()
    redrawn = np.asarray(trainer.state["W"])
    assert not np.allclose(redrawn, W) and 0.3 < redrawn.std() < 1.3   # He scale sqrt(2/4)
    with pytest.raises(onnxtrain.InputError, match="names no initializer"):
        onnxtrain.make_training_model(_linear(), "mse", trainable=["nope"])


def test_user_loss_graph_is_inlined():
    loss_graph = helper.make_graph(
        [helper.make_node("Sub", ["p", "t"], ["d"]), helper.make_node("Abs", ["d"], ["a"]),
         helper.make_node("ReduceMax", ["a"], ["l"], keepdims=0)], "max_error",
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("t", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("l", TensorProto.FLOAT, [])])
    model = onnxtrain.make_training_model(_linear(), loss=loss_graph, optimizer=optim.SGD(lr=0.1))
    check_training_model(model)
    target = np.zeros((16, 3), np.float32)
    out = onnxtrain.Trainer(model).step({"x": X, "labels": target})
    np.testing.assert_allclose(out["loss"], np.abs(X @ W + B).max(), rtol=1e-6)


def test_folded_weights_warn_and_can_be_lifted():
    folded = helper.make_node("Constant", [], ["K"], value=numpy_helper.from_array(
        RNG.normal(size=(3, 64)).astype(np.float32)))
    matmul = helper.make_node("MatMul", ["y", "K"], ["k"])
    model = _linear([folded, matmul], output="k")
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 64
    with pytest.warns(UserWarning, match="look like weights an exporter folded"):
        kept = onnxtrain.make_training_model(model, "mse")
    assert "K" not in onnxtrain.Trainer(kept).state_names
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lifted = onnxtrain.make_training_model(model, "mse", lift_folded_weights=True)
    assert "K" in onnxtrain.Trainer(lifted).state_names


@pytest.mark.parametrize("kwargs, message", [
    ({"loss": "hinge"}, "not one of"),
    ({"output": "nope"}, "not an output"),
    ({"label": "x"}, "already a name"),
    ({"reinitialize": ["nope"]}, "not trainable weights"),
])
def test_builder_errors_name_the_problem(kwargs, message):
    with pytest.raises(BindingError, match=message):
        onnxtrain.make_training_model(_linear(), **{"loss": "mse", **kwargs})
