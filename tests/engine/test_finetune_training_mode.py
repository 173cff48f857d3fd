"""finetune() trains the way the recipe does: BatchNorm on batch statistics (its running
statistics updated as state and exported), Dropout active, unless asked otherwise.

Oracles: the recipe (make_training_model + Adam, run by Trainer) on the same data and epochs;
onnxruntime scoring the exported model; the running-statistics update rule of the ONNX
BatchNormalization spec (momentum 0.9 by default) recomputed in numpy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime
import optax
import pytest

import onnxtrain
from onnxtrain.demo import digits

MODEL = (Path(onnxtrain.__file__).parent / "models" / "digits_cnn.onnx").read_bytes()


def _split():
    images, labels = digits()
    order = np.random.default_rng(0).permutation(len(labels))
    train, test = order[:1408], order[1408:]
    batches = [{"x": images[train[i:i + 64]], "labels": labels[train[i:i + 64]]} for i in range(0, len(train), 64)]
    return batches, images[test], labels[test]


def _accuracy(logits, labels) -> float:
    return float(np.mean(np.asarray(logits).argmax(axis=1) == labels))


@pytest.mark.slow
def test_finetune_reaches_the_recipes_accuracy_on_the_digits_cnn(tmp_path):
    batches, test_images, test_labels = _split()
    recipe = onnxtrain.Trainer(onnxtrain.make_training_model(MODEL, loss="cross_entropy",
                                                             optimizer=onnxtrain.optim.Adam(lr=3e-3)), seed=0)
    recipe.initialize()
    recipe.fit(batches, epochs=6, progress=False)
    tuner = onnxtrain.finetune(MODEL, "cross_entropy", optax.adam(3e-3))
    tuner.fit(batches, epochs=6, progress=False)
    expected = _accuracy(recipe.infer({"x": test_images})["logits"], test_labels)
    reached = _accuracy(tuner.infer({"x": test_images})["logits"], test_labels)
    assert reached >= expected - 0.01, (reached, expected)
    tuner.export(tmp_path / "tuned.onnx")
    session = onnxruntime.InferenceSession(str(tmp_path / "tuned.onnx"), providers=["CPUExecutionProvider"])
    (served,) = session.run(["logits"], {"x": test_images})
    np.testing.assert_allclose(served, np.asarray(tuner.infer({"x": test_images})["logits"]), rtol=1e-4, atol=1e-4)


def _batchnorm_statistics(model: onnxtrain.proto.ModelProto) -> dict[str, np.ndarray]:
    from onnxtrain.translate.graph import iter_initializers

    names = {n.input[i] for n in model.graph.node if n.op_type == "BatchNormalization" for i in (3, 4)}
    return dict(iter_initializers(model.graph, names.__contains__))


@pytest.mark.slow
def test_one_step_updates_running_statistics_as_the_spec_says(tmp_path):
    """running = momentum * running + (1 - momentum) * batch statistic, per the ONNX spec (batch
    variance unbiased or not is the spec's; we check the mean, which is unambiguous)."""
    model = onnxtrain.load_model(MODEL)
    bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    momentum = next((a.f for a in bn.attribute if a.name == "momentum"), 0.9)
    before = _batchnorm_statistics(model)
    batches, _, _ = _split()
    tuner = onnxtrain.finetune(MODEL, "cross_entropy", optax.sgd(0.0))
    tuner.step(batches[0])
    tuner.export(tmp_path / "after.onnx")
    after = _batchnorm_statistics(onnxtrain.load_model(tmp_path / "after.onnx"))
    conv = next(n for n in model.graph.node if n.output[0] == bn.input[0])
    assert conv.op_type == "Conv"
    activations = onnxtrain.run(_truncated(model, bn.input[0]), {"x": batches[0]["x"]})[bn.input[0]]
    batch_mean = np.asarray(activations).mean(axis=(0, 2, 3))
    mean_name = bn.input[3]
    np.testing.assert_allclose(after[mean_name], momentum * before[mean_name] + (1 - momentum) * batch_mean,
                               rtol=1e-5, atol=1e-6)
    frozen = onnxtrain.finetune(MODEL, "cross_entropy", optax.sgd(0.0), freeze_batchnorm=True)
    frozen.step(batches[0])
    frozen.export(tmp_path / "frozen.onnx")
    kept = _batchnorm_statistics(onnxtrain.load_model(tmp_path / "frozen.onnx"))
    for name, value in before.items():
        np.testing.assert_array_equal(kept[name], value)


def _truncated(model, output: str):
    """The model up to `output` (an intermediate value), as a new model."""
    from onnxtrain.proto import ModelProto, ValueInfoProto

    result = ModelProto()
    result.CopyFrom(model)
    del result.graph.output[:]
    result.graph.output.append(ValueInfoProto(name=output))
    return result
