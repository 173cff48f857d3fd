"""make_training_model's optimizer argument: names, optimizers, and mistakes named as InputError.

Oracle: the optimizer node the written model holds (op type and attributes, read with onnx)
and the error messages, which must name the argument and the valid choices.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import InputError, optim

W = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
B = np.zeros(3, np.float32)


def _linear():
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "B"], ["y"])], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "B")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _optimizer_node(model):
    nodes = [n for n in model.training_info[0].algorithm.node
             if n.domain == "ai.onnx.preview.training" and n.op_type != "Gradient"]
    assert len(nodes) == 1
    return nodes[0]


def _learning_rate(model):
    return next(float(numpy_helper.to_array(t)) for t in model.training_info[0].algorithm.initializer
                if t.name == "learning_rate")


@pytest.mark.parametrize("name, op_type, lr, decays", [
    ("adam", "Adam", 1e-3, False), ("AdamW", "Adam", 1e-3, True), ("sgd", "Momentum", 1e-2, False),
    ("momentum", "Momentum", 1e-2, False), ("adagrad", "Adagrad", 1e-2, False),
])
def test_names_give_the_optimizer_with_its_defaults(name, op_type, lr, decays):
    model = onnxtrain.make_training_model(_linear(), "mse", optimizer=name)
    assert _optimizer_node(model).op_type == op_type
    assert _learning_rate(model) == pytest.approx(lr)
    assert any("weight_decay" in n.input for n in model.training_info[0].algorithm.node) == decays
    if name == "sgd":
        attributes = {a.name: a.f for a in _optimizer_node(model).attribute if a.name == "alpha"}
        assert attributes["alpha"] == 0.0


def test_default_and_get_with_options():
    assert _optimizer_node(onnxtrain.make_training_model(_linear(), "mse")).op_type == "Adam"
    assert optim.get("adam", lr=0.1) == optim.Adam(lr=0.1)
    assert optim.get(optim.SGD(lr=0.1), clip_norm=1.0) == optim.SGD(lr=0.1, clip_norm=1.0)
    model = onnxtrain.make_training_model(_linear(), "mse", optimizer=optim.get("momentum", lr=0.5))
    assert _learning_rate(model) == pytest.approx(0.5)


def test_a_name_trains():
    trainer = onnxtrain.Trainer(onnxtrain.make_training_model(_linear(), "mse", optimizer="sgd"))
    x = np.ones((2, 4), np.float32)
    trainer.step({"x": x, "labels": np.zeros((2, 3), np.float32)})
    # mse gradient of W is x.T @ 2 (xW + B) / 6; SGD's default lr 1e-2.
    expected = W - 1e-2 * x.T @ (2 * (x @ W + B) / 6)
    np.testing.assert_allclose(trainer.state["W"], expected, rtol=1e-6)


def test_an_optax_optimizer_points_to_finetune():
    optax = pytest.importorskip("optax")
    for transformation in (optax.adam(1e-3), optax.MultiSteps(optax.sgd(0.1), 2)):
        with pytest.raises(InputError, match=r"onnxtrain\.finetune") as caught:
            onnxtrain.make_training_model(_linear(), "mse", optimizer=transformation)
        assert "adamw" in str(caught.value)


@pytest.mark.parametrize("value, message", [
    ("rmsprop", r"'rmsprop' is not one of \['adagrad', 'adam', 'adamw', 'momentum', 'sgd'\]"),
    (3, r"optimizer=3 \(type int\) is not an optimizer; pass one of \['adagrad'"),
    ({"lr": 0.1}, r"is not an optimizer; pass one of"),
    (optim.Adam, r"is the class; pass an instance"),
])
def test_other_values_are_refused_with_the_choices(value, message):
    with pytest.raises(InputError, match=message):
        onnxtrain.make_training_model(_linear(), "mse", optimizer=value)


@pytest.mark.parametrize("build, message", [
    (lambda: optim.Adam(lr=-1.0), r"lr=-1.0 must be a finite number >= 0"),
    (lambda: optim.Adam(lr="fast"), r"lr='fast' must be a number"),
    (lambda: optim.SGD(clip_norm=0.0), r"clip_norm=0.0 must be a finite number > 0"),
    (lambda: optim.SGD(accumulate=0), r"accumulate=0 must be an integer >= 1"),
    (lambda: optim.SGD(accumulate=2.5), r"accumulate=2.5 must be an integer"),
    (lambda: optim.cosine(peak=0.1, steps=10, warmup=10), r"steps=10 must be greater than warmup=10: steps counts the whole schedule"),
    (lambda: optim.exponential(peak=0.1, rate=0.0, every=5), r"rate=0.0 must be a finite number > 0"),
    (lambda: optim.linear(peak=0.0, end=0.1, steps=5), r"peak=0 keeps start and end as fractions"),
    (lambda: optim.AdamW(mask="W"), r"one string; pass a list of weight names"),
    (lambda: optim.get("adam", learning_rate=0.1), r"optimizer 'adam': .*learning_rate"),
])
def test_bad_settings_are_input_errors(build, message):
    with pytest.raises(InputError, match=message):
        build()


def test_adamw_mask_must_name_trained_weights():
    with pytest.raises(InputError, match=r"mask names \['w'\], which are not trainable weights"):
        onnxtrain.make_training_model(_linear(), "mse", optimizer=optim.AdamW(mask=["w"]))
    model = onnxtrain.make_training_model(_linear(), "mse", optimizer=optim.AdamW(mask=["W"]))
    decayed = {n.input[1] for n in model.training_info[0].algorithm.node if n.output[0].endswith(".decay")}
    assert decayed == {"W"}


def test_plain_optimizer_writes_no_extra_nodes():
    """Without a schedule, clipping, decay or accumulation the update part is the optimizer node
    and the counter increment, as before these features."""
    model = onnxtrain.make_training_model(_linear(), "mse", optimizer=optim.Adam(lr=0.1))
    ops = [n.op_type for n in model.training_info[0].algorithm.node]
    # Adam, the counter's Add, and the Identity returning the step's prediction (for metrics).
    assert ops[ops.index("Gradient") + 1:] == ["Adam", "Add", "Identity"]
