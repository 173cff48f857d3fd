"""Class labels: checked against the number of classes before a step, and ignore_index.

Oracles: hand-picked bad labels (the message must name the input, the value, its index and
the valid range, and no state may change); torch's cross_entropy(ignore_index=...) and its
autograd gradients on a PyTorch export of the same MLP; the written node against the standard
(onnx.reference evaluates SoftmaxCrossEntropyLoss with the attribute we write).
"""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import InputError, optim

RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 4)).astype(np.float32)


def _classifier(dropout: bool = False) -> onnx.ModelProto:
    """x [batch, 4] -> logits [batch, 3]; with Dropout, the recipe trains a renamed copy."""
    nodes = [helper.make_node("Gemm", ["x", "W", "B"], ["z"], transB=1)]
    nodes.append(helper.make_node("Dropout", ["z", "ratio"], ["logits"]) if dropout
                 else helper.make_node("Identity", ["z"], ["logits"]))
    initializers = [numpy_helper.from_array(RNG.normal(size=(3, 4)).astype(np.float32), "W"),
                    numpy_helper.from_array(np.zeros(3, np.float32), "B")]
    if dropout:
        initializers.append(numpy_helper.from_array(np.array(0.0, np.float32), "ratio"))
    graph = helper.make_graph(nodes, "classifier",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
                              initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _trainers(dropout: bool = False, **kwargs):
    optax = pytest.importorskip("optax")
    training = onnxtrain.make_training_model(_classifier(dropout), "cross_entropy", optimizer=optim.SGD(lr=0.1),
                                             **kwargs)
    return {"make_training_model": onnxtrain.Trainer(training),
            "finetune": onnxtrain.finetune(_classifier(dropout), "cross_entropy", optax.sgd(0.1), **kwargs)}


def _labels(*bad: tuple[int, int]) -> np.ndarray:
    labels = np.array([0, 1, 2, 0, 1, 2, 0, 1], np.int64)
    for index, value in bad:
        labels[index] = value
    return labels


@pytest.mark.parametrize("dropout", [False, True], ids=["forward", "training-mode copy"])
def test_a_label_of_the_class_count_or_more_is_refused_before_the_step(dropout):
    for kind, trainer in _trainers(dropout).items():
        before = {name: np.asarray(value) for name, value in trainer.state.items()}
        with pytest.raises(InputError) as error:
            trainer.step({"x": X, "labels": _labels((5, 3))})
        message = str(error.value)
        assert "input 'labels': label 3 at index 5" in message, kind
        assert "labels must be in 0..2" in message and "learning rate" not in message, kind
        for name, value in trainer.state.items():
            np.testing.assert_array_equal(np.asarray(value), before[name], err_msg=f"{kind}: {name}")


def test_a_negative_label_is_refused_and_the_message_points_to_ignore_index():
    for kind, trainer in _trainers().items():
        with pytest.raises(InputError, match=r"label -1 at index 2 .* 0\.\.2; .*ignore_index=") as error:
            trainer.step({"x": X, "labels": _labels((2, -1))})
        assert "'labels'" in str(error.value), kind


@pytest.mark.parametrize("batch", [1024, 1025, 5000], ids=["listed", "just past listed", "large"])
@pytest.mark.parametrize("bad", [3, -1, np.iinfo(np.int64).min], ids=["class count", "negative", "most negative"])
def test_a_bad_label_is_found_in_a_batch_of_any_size(batch, bad):
    """Short label arrays are checked as Python lists, long ones by numpy (labels.py): both
    find the one bad label, at either end of the range, wherever it sits."""
    trainer = _trainers()["make_training_model"]
    x = RNG.normal(size=(batch, 4)).astype(np.float32)
    labels = np.arange(batch, dtype=np.int64) % 3
    trainer.step({"x": x, "labels": labels})
    labels[batch - 2] = bad
    with pytest.raises(InputError, match=f"label {bad} at index {batch - 2} "):
        trainer.step({"x": x, "labels": labels})


def test_labels_are_checked_whatever_form_they_come_in():
    torch = pytest.importorskip("torch")
    trainer = _trainers()["make_training_model"]
    for labels in (torch.tensor(_labels((7, 9))), _labels((7, 9)).tolist()):
        with pytest.raises(InputError, match="label 9 at index 7"):
            trainer.step({"x": X, "labels": labels})
    with pytest.raises(InputError, match="label 4 at index 1"):
        trainer.fit([{"x": X, "labels": _labels()}, {"x": X, "labels": _labels((1, 4))}], progress=False)
    with pytest.raises(InputError, match="label 3 at index 0"):
        trainer.evaluate({"x": X, "labels": _labels((0, 3))})


def test_the_bundled_model_checks_its_labels_too():
    # Not made by make_training_model: the rule is read from its SoftmaxCrossEntropyLoss node.
    from onnxtrain.cli import demo_model_path

    trainer = onnxtrain.Trainer(demo_model_path())
    with pytest.raises(InputError, match=r"label 3 at index 1 is not a class of the SoftmaxCrossEntropyLoss "
                                         r"node 'loss': labels must be in 0\.\.2"):
        trainer.step({"X": np.zeros((2, 2), np.float32), "labels": np.array([0, 3])})


def test_ignore_index_skips_its_label_and_still_refuses_the_others():
    for kind, trainer in _trainers(ignore_index=-100).items():
        trainer.step({"x": X, "labels": _labels((0, -100), (4, -100))})
        with pytest.raises(InputError, match=r"label -1 at index 3 .* 0\.\.2 or -100 \(its ignore_index\)"):
            trainer.step({"x": X, "labels": _labels((0, -100), (3, -1))})
        with pytest.raises(InputError, match="label 3 at index 6"):
            trainer.step({"x": X, "labels": _labels((6, 3))})


def test_the_ignore_index_attribute_is_the_standard_one():
    from onnx.reference import ReferenceEvaluator

    model = onnxtrain.make_training_model(_classifier(), "cross_entropy", ignore_index=-100)
    (loss_node,) = [n for n in model.training_info[0].algorithm.node if n.op_type == "SoftmaxCrossEntropyLoss"]
    assert {a.name: a.i for a in loss_node.attribute if a.name == "ignore_index"} == {"ignore_index": -100}
    loss_only = helper.make_graph([onnx.NodeProto.FromString(loss_node.SerializeToString())], "loss",
                                  [helper.make_tensor_value_info(loss_node.input[0], TensorProto.FLOAT, None),
                                   helper.make_tensor_value_info(loss_node.input[1], TensorProto.INT64, None)],
                                  [helper.make_tensor_value_info(loss_node.output[0], TensorProto.FLOAT, None)])
    logits, labels = RNG.normal(size=(8, 3)).astype(np.float32), _labels((1, -100))
    (expected,) = ReferenceEvaluator(helper.make_model(loss_only)).run(
        None, {loss_node.input[0]: logits, loss_node.input[1]: labels})
    trainer = onnxtrain.Trainer(model)
    trainer.set_state("W", np.eye(3, 4, dtype=np.float32))
    x = np.concatenate([logits, np.zeros((8, 1), np.float32)], axis=1)   # W = [I 0]: logits pass through
    np.testing.assert_allclose(trainer.evaluate({"x": x, "labels": labels})["loss"], expected, rtol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    ({"loss": "mse", "ignore_index": -100}, "applies to loss='cross_entropy' or 'causal_lm' only, not 'mse'"),
    ({"loss": "cross_entropy", "ignore_index": "-100"}, "must be an int"),
    ({"loss": "cross_entropy", "ignore_index": True}, "must be an int"),
])
def test_ignore_index_mistakes_name_the_argument(kwargs, message):
    optax = pytest.importorskip("optax")
    with pytest.raises(InputError, match=message):
        onnxtrain.make_training_model(_classifier(), **kwargs)
    with pytest.raises(InputError, match=message):
        onnxtrain.finetune(_classifier(), optimizer=optax.sgd(0.1), **kwargs)


def _torch_mlp():
    """A PyTorch MLP and its TorchScript export (initializers keep the parameter names)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    buffer = io.BytesIO()
    torch.onnx.export(module, (torch.zeros(2, 4),), buffer, dynamo=False, input_names=["x"],
                      output_names=["logits"], dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
                      opset_version=17)
    return torch, module, buffer.getvalue()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # the TorchScript exporter's notice
def test_ignore_index_loss_and_gradients_match_torch_on_an_export():
    optax = pytest.importorskip("optax")
    torch, module, exported = _torch_mlp()
    labels = np.array([0, -100, 2, 1, -100, 2, 1, 0], np.int64)
    x = torch.tensor(X, requires_grad=False)
    expected = torch.nn.functional.cross_entropy(module(x), torch.tensor(labels), ignore_index=-100)
    expected.backward()
    gradients = {name: p.grad.numpy() for name, p in module.named_parameters()}

    training = onnxtrain.make_training_model(exported, "cross_entropy", optimizer=optim.SGD(lr=1.0),
                                             ignore_index=-100)
    trainers = {"make_training_model": onnxtrain.Trainer(training),
                "finetune": onnxtrain.finetune(exported, "cross_entropy", optax.sgd(1.0), ignore_index=-100)}
    for kind, trainer in trainers.items():
        before = {name: np.asarray(trainer.state[name]) for name in gradients}
        loss = trainer.step({"x": X, "labels": labels})["loss"]
        np.testing.assert_allclose(loss, expected.item(), rtol=1e-5, err_msg=kind)
        for name, gradient in gradients.items():   # SGD with lr 1: the step is the gradient
            np.testing.assert_allclose(before[name] - np.asarray(trainer.state[name]), gradient,
                                       rtol=1e-4, atol=1e-6, err_msg=f"{kind}: {name}")
