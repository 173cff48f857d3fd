"""The `trainable=` and `loss=` arguments of make_training_model and finetune.

A single string is one name (not its characters); a name that matches nothing is an
InputError listing the closest names; the loss has no default anywhere. Oracle: which state
variables a step changes, and the messages.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import BindingError, InputError, optim

RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 4)).astype(np.float32)
LABELS = np.array([0, 1, 2, 0, 1, 2, 0, 1], np.int64)


def _model() -> onnx.ModelProto:
    """x -> body (Gemm) -> head (Gemm) -> logits, with torch-style dotted names and an int64 shape."""
    nodes = [helper.make_node("Gemm", ["x", "body.weight", "body.bias"], ["h"], transB=1),
             helper.make_node("Reshape", ["h", "shape"], ["flat"]),
             helper.make_node("Gemm", ["flat", "head.weight", "head.bias"], ["logits"], transB=1)]
    initializers = {"body.weight": RNG.normal(size=(5, 4)), "body.bias": np.zeros(5),
                    "head.weight": RNG.normal(size=(3, 5)), "head.bias": np.zeros(3)}
    tensors = [numpy_helper.from_array(v.astype(np.float32), n) for n, v in initializers.items()]
    tensors.append(numpy_helper.from_array(np.array([-1, 5], np.int64), "shape"))
    graph = helper.make_graph(nodes, "two_layers",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])], tensors)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _changed_by_a_step(trainer, folder) -> set[str]:
    """The initializers of the exported inference model that one step changes."""
    def exported(name: str) -> dict[str, np.ndarray]:
        trainer.export(folder / name, training=False)
        return {t.name: numpy_helper.to_array(t) for t in onnx.load(folder / name).graph.initializer}

    before = exported("before.onnx")
    trainer.step({"x": X, "labels": LABELS})
    after = exported("after.onnx")
    return {name for name, value in before.items() if not np.array_equal(value, after[name])}


def test_a_single_string_is_one_name(tmp_path):
    optax = pytest.importorskip("optax")
    training = onnxtrain.make_training_model(_model(), "cross_entropy", optimizer=optim.SGD(lr=0.1),
                                             trainable="head.weight")
    weights = {"body.weight", "body.bias", "head.weight", "head.bias"}
    assert [b.key for b in training.training_info[0].update_binding if b.key in weights] == ["head.weight"]
    tuner = onnxtrain.finetune(_model(), "cross_entropy", optax.sgd(0.1), trainable="head.weight")
    assert _changed_by_a_step(onnxtrain.Trainer(training), tmp_path) == {"head.weight"}
    assert _changed_by_a_step(tuner, tmp_path) == {"head.weight"}


@pytest.mark.parametrize("trainable, message", [
    ("head.weigth", "trainable='head.weigth' names no initializer of the main graph; did you mean "
                    "'head.weight'"),
    (["body.weight", "Head.Bias"], "trainable='Head.Bias' names no initializer .* 'head.bias'"),
    ("zzz", r"trainable='zzz' names no initializer of the main graph; the initializers are \['body.weight'"),
    ("bias", "trainable='bias' names no initializer .*; did you mean 'body.bias', 'head.bias'\\?"),
    ([3], "takes initializer names .* int 3"),
])
def test_a_name_that_matches_nothing_lists_close_names(trainable, message):
    optax = pytest.importorskip("optax")
    with pytest.raises(InputError, match=message):
        onnxtrain.make_training_model(_model(), "cross_entropy", trainable=trainable)
    with pytest.raises(InputError, match=message):
        onnxtrain.finetune(_model(), "cross_entropy", optax.sgd(0.1), trainable=trainable)


def test_an_initializer_that_cannot_train_stays_a_binding_error():
    with pytest.raises(BindingError, match=r"\['shape'\] are not float weights"):
        onnxtrain.make_training_model(_model(), "cross_entropy", trainable="shape")


def test_the_loss_is_required_everywhere():
    with pytest.raises(TypeError, match="loss"):
        onnxtrain.make_training_model(_model())
    with pytest.raises(TypeError, match="loss"):
        onnxtrain.finetune(_model())
