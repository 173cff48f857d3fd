"""expand_gradients on whole training models from make_training_model: the expanded backward,
run by stock onnxruntime, against onnxtrain's own Gradient (jax.vjp), at two batch sizes
from one expanded graph."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from onnxtrain._recipe.builder import make_training_model
from onnxtrain.errors import ExportError
from support.portable_graphs import (assert_close, combined, expanded_model, gradient_model, run_onnxruntime,
                                     run_onnxtrain)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import models  # noqa: E402  (bench/models.py: the benchmark models)


def _classifier_feeds(x_shape: tuple[int, ...], classes: int):
    def feeds(batch: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(batch)
        return {"x": rng.standard_normal((batch, *x_shape)).astype(np.float32),
                "labels": rng.integers(0, classes, batch).astype(np.int64)}
    return feeds


def _check_training_model(training, feeds) -> None:
    nodes, initializers, inputs, opset = combined(training)
    (gradient,) = [n for n in nodes if n.op_type == "Gradient"]
    outputs = ["loss", *gradient.output]
    expanded = expanded_model(nodes, initializers, inputs, opset, outputs, feeds(4))
    reference = gradient_model(nodes, initializers, inputs, opset, outputs)
    for batch in (4, 7):
        expected = run_onnxtrain(reference, feeds(batch))
        assert_close(run_onnxruntime(expanded, feeds(batch)), expected, outputs)
        # The portable graph in onnxtrain itself gives the same values.
        assert_close(run_onnxtrain(expanded, feeds(batch)), expected, outputs)


@pytest.mark.slow
def test_mlp_backward_matches_onnxtrain_gradient_in_onnxruntime():
    model = models.mlp_onnx(models.mlp_weights())
    training = make_training_model(model.SerializeToString(), loss="cross_entropy")
    _check_training_model(training, _classifier_feeds((model.graph.input[0].type.tensor_type.shape.dim[1].dim_value,), 10))


def test_op_without_rule_raises_export_error_naming_the_node():
    from onnx import helper, TensorProto
    nodes = [helper.make_node("Cos", ["w"], ["c"], name="my_cos"),
             helper.make_node("ReduceSum", ["c"], ["y"], keepdims=0),
             helper.make_node("Gradient", ["w"], ["dw"], domain="ai.onnx.preview.training", xs=["w"], y="y")]
    with pytest.raises(ExportError, match=r"my_cos.*Cos.*portable export does not support"):
        expanded_model(nodes, {"w": np.ones(3, np.float32)}, [], 21, ["dw"], {})
