"""onnxtrain.metrics and fit's metrics=: built-in metrics against hand-derived values; training
metrics from each step's own prediction, weighted by batch size, against a reference that
infers before every step; validation metrics against onnxruntime on the exported model."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import InputError
from onnxtrain.metrics import MetricSet, accuracy, mae, mse, resolve, top_k_accuracy

CLASSES = 4


def test_built_in_metrics_on_hand_derived_values():
    logits = np.array([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.0], [1.0, 1.0, 5.0, 0.0]])
    labels = np.array([0, 3, 3])
    assert accuracy(logits, labels) == pytest.approx(1 / 3)
    assert accuracy(logits, np.eye(CLASSES)[labels]) == pytest.approx(1 / 3)    # one-hot labels
    assert top_k_accuracy(2)(logits, labels) == pytest.approx(2 / 3)   # row 1's label is second, row 2's last
    assert top_k_accuracy(1)(logits, labels) == pytest.approx(1 / 3)
    assert top_k_accuracy(1)(np.array([[1.0, 1.0]]), np.array([1])) == 1.0    # a tie counts for the label
    assert resolve(["top_k_accuracy"])["top_k_accuracy"](logits, labels) == 1.0    # k=5 > 4 classes
    # Per-pixel labels [N, H]: the class axis is 1, as for SoftmaxCrossEntropyLoss.
    maps = np.zeros((1, 3, 2)); maps[0, 2, 0] = maps[0, 1, 1] = 1
    assert accuracy(maps, np.array([[2, 0]])) == 0.5
    assert mae(np.array([[1.0], [2.0]]), np.array([0.0, 4.0])) == 1.5    # [N, 1] against [N]: no broadcast
    assert mse(np.array([[1.0], [2.0]]), np.array([0.0, 4.0])) == 2.5


def test_metric_mistakes_name_the_metric_and_the_choices():
    with pytest.raises(InputError, match=r"'acc' is not a built-in metric; choose from \['accuracy'"):
        resolve(["acc"])
    with pytest.raises(InputError, match="lambda .* dict"):
        resolve([lambda p, y: 0.0])
    assert list(resolve({"zero": lambda p, y: 0.0})) == ["zero"]
    with pytest.raises(InputError, match="'loss' .* clashes"):
        resolve({"loss": mae})
    with pytest.raises(InputError, match="positive integer"):
        top_k_accuracy(0)
    with pytest.raises(InputError, match=r"class indices of shape \[3\]"):
        accuracy(np.zeros((3, 4)), np.zeros((3, 2)))
    with pytest.raises(InputError, match="metric 'broken' failed on predictions of shape"):
        MetricSet({"broken": lambda p, y: 1 / 0}, "prediction", "labels", "step")(np.zeros(2), np.zeros(2))


def mlp() -> "onnxtrain.proto.ModelProto":
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W1", "B1"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
         helper.make_node("Gemm", ["t", "W2", "B2"], ["logits"])], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        [numpy_helper.from_array(rng.normal(size=shape).astype(np.float32), name)
         for name, shape in (("W1", (6, 8)), ("B1", (8,)), ("W2", (8, CLASSES)), ("B2", (CLASSES,)))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def feeds(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(n, 6)).astype(np.float32), "labels": rng.integers(0, CLASSES, n).astype(np.int64)}
            for n in sizes]


def reference_epoch(front, batches):
    """Step by step, inferring before each step: the step's own prediction, since the MLP has
    no Dropout or BatchNorm. (losses, accuracies) per step."""
    losses, accuracies = [], []
    for batch in batches:
        logits = np.asarray(front.infer({"x": batch["x"]})["logits"])
        accuracies.append(float(np.mean(logits.argmax(axis=1) == batch["labels"])))
        losses.append(float(front.step(batch)["loss"]))
    return losses, accuracies


def weighted(values, sizes):
    return float(np.dot(values, sizes) / np.sum(sizes))


@pytest.mark.slow
@pytest.mark.parametrize("steps_per_call", [1, 2])
def test_training_metrics_come_from_each_steps_prediction_weighted_by_batch_size(steps_per_call, tmp_path):
    sizes = [8, 8, 8, 3]
    batches, held_out = feeds(sizes), feeds([10, 10], seed=1)
    training = onnxtrain.make_training_model(mlp(), loss="cross_entropy", optimizer=onnxtrain.optim.Adam(lr=0.05))
    trainer, reference = onnxtrain.Trainer(training), onnxtrain.Trainer(training)
    history = trainer.fit(batches, epochs=2, progress=False, steps_per_call=steps_per_call,
                          metrics=["accuracy", top_k_accuracy(2)], eval_data=held_out)
    first = reference_epoch(reference, batches)
    second = reference_epoch(reference, batches)
    np.testing.assert_allclose(history["step_loss"], first[0] + second[0], rtol=1e-5)
    np.testing.assert_allclose(history["step_accuracy"], first[1] + second[1], atol=1e-12)
    np.testing.assert_allclose(history["loss"], [weighted(first[0], sizes), weighted(second[0], sizes)], rtol=1e-5)
    np.testing.assert_allclose(history["accuracy"], [weighted(first[1], sizes), weighted(second[1], sizes)],
                               atol=1e-12)
    assert len(history["top_2_accuracy"]) == len(history["val_top_2_accuracy"]) == 2
    assert "prediction" not in history and "step_prediction" not in history

    trainer.export(tmp_path / "mlp.onnx", training=False)
    session = onnxruntime.InferenceSession(str(tmp_path / "mlp.onnx"), providers=["CPUExecutionProvider"])
    x = np.concatenate([b["x"] for b in held_out])
    labels = np.concatenate([b["labels"] for b in held_out])
    (logits,) = session.run(["logits"], {"x": x})
    assert history["val_accuracy"][-1] == pytest.approx(np.mean(logits.argmax(axis=1) == labels), abs=1e-12)
    assert trainer.evaluate(held_out, metrics=["accuracy"])["accuracy"] == history["val_accuracy"][-1]


@pytest.mark.slow
def test_finetune_metrics_and_callable_metrics():
    import optax

    sizes = [6, 6, 5]
    batches = feeds(sizes, seed=2)
    tuner, reference = (onnxtrain.finetune(mlp(), "cross_entropy", optax.sgd(0.1)) for _ in range(2))

    def wrong(predictions, labels):
        return float(np.mean(predictions.argmax(axis=1) != labels))

    seen = []
    history = tuner.fit(batches, progress=False, metrics=["accuracy", wrong],
                        callbacks=[lambda epoch, logs: seen.append(dict(logs))])
    losses, accuracies = reference_epoch(reference, batches)
    np.testing.assert_allclose(history["accuracy"], [weighted(accuracies, sizes)], atol=1e-12)
    np.testing.assert_allclose(history["wrong"], [1 - weighted(accuracies, sizes)], atol=1e-12)
    np.testing.assert_allclose(history["loss"], [weighted(losses, sizes)], rtol=1e-5)
    assert seen == [{"loss": history["loss"][0], "accuracy": history["accuracy"][0], "wrong": history["wrong"][0]}]
    # step() keeps returning the loss alone.
    assert set(tuner.step(batches[0])) == {"loss"}
