"""evaluate() and fit's eval_data give the loss and predictions the exported inference model gives.

Oracle: onnxruntime scoring the model Trainer.export(training=False) / FineTuner.export writes,
with the cross-entropy computed in numpy from its logits. The model has BatchNormalization and
Dropout, so the training step's dry run (what evaluation used to be) differs, and checking
that it does keeps the comparison from passing by accident.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain._recipe.evaluation import read
from onnxtrain.proto.metadata import EVALUATION_KEY
from support.training_models import linreg_model, LINREG_FEEDS

CLASSES = 5


def bn_dropout_cnn() -> onnx.ModelProto:
    """x [N, 3, 6, 6] -> Conv -> BatchNormalization -> Relu -> Dropout(0.3) -> Flatten -> Gemm -> logits [N, 5]."""
    rng = np.random.default_rng(0)

    def init(name, value):
        return numpy_helper.from_array(np.asarray(value, np.float32), name)

    initializers = [
        init("C", rng.normal(size=(4, 3, 3, 3)) * 0.3), init("Cb", rng.normal(size=4) * 0.1),
        init("gamma", 1 + 0.1 * rng.normal(size=4)), init("beta", 0.1 * rng.normal(size=4)),
        init("mean", 0.2 * rng.normal(size=4)), init("var", 1 + 0.2 * rng.random(4)),
        init("ratio", 0.3), init("W", rng.normal(size=(144, CLASSES)) * 0.1), init("B", np.zeros(CLASSES)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "C", "Cb"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["b"], name="bn"),
        helper.make_node("Relu", ["b"], ["r"]),
        helper.make_node("Dropout", ["r", "ratio"], ["d"], name="dropout"),
        helper.make_node("Flatten", ["d"], ["f"]),
        helper.make_node("Gemm", ["f", "W", "B"], ["logits"], name="fc"),
    ]
    graph = helper.make_graph(nodes, "bn_dropout_cnn",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 6, 6])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])],
                              initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def data(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.normal(1.0, 2.0, size=(count, 3, 6, 6)).astype(np.float32),
            rng.integers(0, CLASSES, count).astype(np.int64))


def batches(x: np.ndarray, labels: np.ndarray, size: int) -> list[dict[str, np.ndarray]]:
    return [{"x": x[i:i + size], "labels": labels[i:i + size]} for i in range(0, len(x), size)]


def served(path, x: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"x": x})[0]


def cross_entropy(logits: np.ndarray, labels: np.ndarray) -> float:
    logits = logits.astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    log_probabilities = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
    return float(-np.mean(log_probabilities[np.arange(len(labels)), labels]))


def trained_trainer() -> onnxtrain.Trainer:
    """A Trainer of the CNN after 6 steps, so the running statistics moved from their start."""
    training = onnxtrain.make_training_model(bn_dropout_cnn(), loss="cross_entropy",
                                             optimizer=onnxtrain.optim.Adam(lr=0.01))
    trainer = onnxtrain.Trainer(training, seed=0)
    trainer.initialize()
    x, labels = data(48, 1)
    trainer.fit(batches(x, labels, 8), progress=False)
    return trainer


@pytest.mark.slow
def test_validation_loss_is_the_exported_models_at_any_eval_batch_size(tmp_path):
    trainer = trained_trainer()
    x, labels = data(24, 2)
    train_x, train_labels = data(16, 4)
    # fit's eval_data is the same evaluation, after the epoch's steps.
    history = trainer.fit(batches(train_x, train_labels, 8), progress=False, eval_data=batches(x, labels, 7))
    trainer.export(tmp_path / "inference.onnx", training=False)
    assert not read(onnx.load(str(tmp_path / "inference.onnx")))   # no training_info for the names to describe
    logits = served(tmp_path / "inference.onnx", x)
    expected = cross_entropy(logits, labels)

    for size in (24, 5):    # one batch; batches of 5, the last one of 4
        scores = trainer.evaluate(batches(x, labels, size), metrics=["accuracy"])
        assert abs(scores["loss"] - expected) < 1e-5, (size, scores["loss"], expected)
        assert scores["accuracy"] == pytest.approx(np.mean(logits.argmax(axis=1) == labels), abs=1e-12)
    one = trainer.evaluate({"x": x, "labels": labels})
    np.testing.assert_allclose(np.asarray(one["prediction"]), logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(one["loss"]), expected, atol=1e-5)
    assert abs(history["val_loss"][0] - expected) < 1e-5

    # The training step's dry run (batch statistics, Dropout) is another number: the check above can fail.
    runner = trainer._runners[0]
    with trainer._store.transaction():
        dry = runner.evaluate(trainer._store, {"x": x, "labels": labels})
    assert abs(float(dry["loss"]) - expected) > 1e-3


@pytest.mark.slow
def test_the_recorded_names_survive_export_and_reload(tmp_path):
    trainer = trained_trainer()
    trainer.export(tmp_path / "training.onnx", training=True)
    model = onnx.load(str(tmp_path / "training.onnx"))
    [spec] = read(model).values()
    assert (spec.prediction, spec.label, spec.loss, spec.output) == ("logits", "labels", "loss", "prediction")
    assert spec.step_prediction != "logits"   # the training copy's prediction
    x, labels = data(10, 3)
    resumed = onnxtrain.Trainer(model)
    np.testing.assert_allclose(float(resumed.evaluate({"x": x, "labels": labels})["loss"]),
                               float(trainer.evaluate({"x": x, "labels": labels})["loss"]), rtol=1e-6)
    # step() returns the loss only; the prediction output is for fit's metrics.
    assert set(resumed.step({"x": x, "labels": labels})) == {"loss"}


@pytest.mark.slow
def test_finetune_evaluates_the_inference_program_with_its_loss(tmp_path):
    import optax

    tuner = onnxtrain.finetune(bn_dropout_cnn(), "cross_entropy", optax.adam(0.01))
    x, labels = data(48, 1)
    tuner.fit(batches(x, labels, 8), progress=False)
    x, labels = data(24, 2)
    tuner.export(tmp_path / "tuned.onnx")
    logits = served(tmp_path / "tuned.onnx", x)
    for size in (24, 5):
        scores = tuner.evaluate(batches(x, labels, size))
        assert abs(scores["loss"] - cross_entropy(logits, labels)) < 1e-5

    # A JAX loss function is applied to the inference program's prediction too.
    def mean_logit_error(prediction, label):
        return ((prediction - label[:, None]) ** 2).mean()

    custom = onnxtrain.finetune(bn_dropout_cnn(), mean_logit_error, optax.sgd(0.0))
    custom.export(tmp_path / "untouched.onnx")
    logits = served(tmp_path / "untouched.onnx", x)
    got = float(custom.evaluate({"x": x, "labels": labels.astype(np.float32)})["loss"])
    np.testing.assert_allclose(got, np.mean((logits - labels[:, None]) ** 2), rtol=1e-5)


def test_a_hand_written_recipe_falls_back_to_the_dry_run_and_says_so_once(caplog):
    trainer = onnxtrain.Trainer(linreg_model())
    with caplog.at_level(logging.INFO, logger="onnxtrain"):
        first = trainer.evaluate(LINREG_FEEDS)
        trainer.evaluate(LINREG_FEEDS)
    said = [r.getMessage() for r in caplog.records if "cannot be separated" in r.getMessage()]
    assert len(said) == 1
    # The dry run: what step() returns, without committing it (§4.4's first loss).
    np.testing.assert_allclose(float(first["loss"]), 25.375, rtol=1e-6)
    np.testing.assert_allclose(float(trainer.step(LINREG_FEEDS)["loss"]), 25.375, rtol=1e-6)
    with pytest.raises(onnxtrain.InputError, match="hand-written recipe"):
        trainer.evaluate(LINREG_FEEDS, metrics=["mae"])


def test_make_training_model_records_what_evaluation_needs():
    training = onnxtrain.make_training_model(bn_dropout_cnn(), loss="cross_entropy")
    [entry] = [e for e in training.metadata_props if e.key == EVALUATION_KEY]
    [spec] = read(training).values()
    algorithm = training.training_info[0].algorithm
    assert spec.output in {o.name for o in algorithm.output}
    assert spec.loss in {o.name for o in algorithm.output}
    assert spec.label in {i.name for i in algorithm.input}
    assert spec.step_prediction in {name for n in algorithm.node for name in n.output}
    # A model needing no training-mode copy: the loss reads the main output itself.
    plain = bn_dropout_cnn()
    del plain.graph.node[1:4]
    plain.graph.node[0].output[0] = "d"
    [spec] = read(onnxtrain.make_training_model(plain, loss="mse")).values()
    assert spec.step_prediction == spec.prediction == "logits"


def test_metadata_that_is_not_a_loss_description_is_ignored(caplog):
    training = onnxtrain.make_training_model(bn_dropout_cnn(), loss="cross_entropy")
    for entry in training.metadata_props:
        if entry.key == EVALUATION_KEY:
            entry.value = '[{"algorithm": "zero"}]'
    with caplog.at_level(logging.WARNING, logger="onnxtrain"):
        assert read(training) == {}
    assert "not a list of loss descriptions" in caplog.text
