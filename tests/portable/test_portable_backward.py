"""expand_gradients on whole training models from make_training_model: the expanded backward,
run by stock onnxruntime, against onnxtrain's own Gradient (jax.vjp), at two batch sizes
from one expanded graph."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

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


def _check_training_model(training, feeds, also: tuple[str, ...] = ()) -> None:
    """loss, the Gradient's outputs and `also` (e.g. BatchNorm running statistics) agree."""
    nodes, initializers, inputs, opset = combined(training)
    (gradient,) = [n for n in nodes if n.op_type == "Gradient"]
    outputs = ["loss", *gradient.output, *also]
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


@pytest.mark.slow
def test_bench_cnn_backward_matches_onnxtrain_gradient_in_onnxruntime():
    model = models.cnn_onnx(models.cnn_weights())
    training = make_training_model(model.SerializeToString(), loss="cross_entropy")
    dims = tuple(d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim[1:])
    _check_training_model(training, _classifier_feeds(dims, 10))


def _cnn_batchnorm() -> onnx.ModelProto:
    """Conv (bias, pads) - BatchNorm - Relu - MaxPool - Conv (stride 2, group 2) - BatchNorm -
    Relu - Flatten - Gemm (transB) on x[batch, 3, 8, 8]."""
    rng = np.random.default_rng(0)
    weights = {"C1": rng.standard_normal((4, 3, 3, 3)) * 0.3, "c1": rng.standard_normal(4) * 0.1,
               "s1": 1 + rng.standard_normal(4) * 0.1, "t1": rng.standard_normal(4) * 0.1,
               "m1": rng.standard_normal(4) * 0.1, "v1": 1 + rng.random(4),
               "C2": rng.standard_normal((6, 2, 3, 3)) * 0.3, "s2": 1 + rng.standard_normal(6) * 0.1,
               "t2": rng.standard_normal(6) * 0.1, "m2": np.zeros(6), "v2": np.ones(6),
               "W": rng.standard_normal((10, 24)) * 0.2, "B": rng.standard_normal(10) * 0.1}
    nodes = [
        helper.make_node("Conv", ["x", "C1", "c1"], ["a1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["a1", "s1", "t1", "m1", "v1"], ["b1"], name="bn1"),
        helper.make_node("Relu", ["b1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "C2"], ["a2"], name="conv2", pads=[1, 1, 1, 1], strides=[2, 2], group=2),
        helper.make_node("BatchNormalization", ["a2", "s2", "t2", "m2", "v2"], ["b2"], name="bn2"),
        helper.make_node("Relu", ["b2"], ["r2"], name="relu2"),
        helper.make_node("Flatten", ["r2"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "W", "B"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(nodes, "cnn_bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.slow
def test_cnn_with_batchnorm_training_mode_and_gemm_matches_in_onnxruntime():
    training = make_training_model(_cnn_batchnorm().SerializeToString(), loss="cross_entropy")
    _check_training_model(training, _classifier_feeds((3, 8, 8), 10),
                          also=("m1.new", "v1.new", "m2.new", "v2.new"))


def test_op_without_rule_raises_export_error_naming_the_node():
    nodes = [helper.make_node("Cos", ["w"], ["c"], name="my_cos"),
             helper.make_node("ReduceSum", ["c"], ["y"], keepdims=0),
             helper.make_node("Gradient", ["w"], ["dw"], domain="ai.onnx.preview.training", xs=["w"], y="y")]
    with pytest.raises(ExportError, match=r"my_cos.*Cos.*portable export does not support"):
        expanded_model(nodes, {"w": np.ones(3, np.float32)}, [], 21, ["dw"], {})
