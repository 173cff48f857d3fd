"""expand_gradients on whole training models from make_training_model: the expanded backward,
run by stock onnxruntime, against onnxtrain's own Gradient (jax.vjp), at two batch sizes
from one expanded graph."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
from support.portable_training import tiny_bert_model
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain._portable.backward import expand_gradients
from onnxtrain._recipe.builder import make_training_model
from onnxtrain.errors import ExportError
from support.bench_modules import bench_module
from support.portable_graphs import (assert_close, combined, compare_expansion, expanded_model, gradient_model,
                                     run_onnxruntime, run_onnxtrain)

models = bench_module("models")


def _classifier_feeds(x_shape: tuple[int, ...], classes: int):
    def feeds(batch: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(batch)
        return {"x": rng.standard_normal((batch, *x_shape)).astype(np.float32),
                "labels": rng.integers(0, classes, batch).astype(np.int64)}
    return feeds


def _check_training_model(training, feeds, also: tuple[str, ...] = ()) -> None:
    """loss, the Gradient's outputs and `also` (e.g. BatchNorm running statistics) agree; the
    main graph stays as exported (keep_first), as a portable export needs."""
    nodes, initializers, inputs, opset = combined(training)
    (gradient,) = [n for n in nodes if n.op_type == "Gradient"]
    outputs = ["loss", *gradient.output, *also]
    compare_expansion(nodes, initializers, inputs, opset, outputs, feeds, keep_first=len(training.graph.node))


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
    nodes = [helper.make_node("Atan", ["w"], ["c"], name="my_atan"),
             helper.make_node("ReduceSum", ["c"], ["y"], keepdims=0),
             helper.make_node("Gradient", ["w"], ["dw"], domain="ai.onnx.preview.training", xs=["w"], y="y")]
    with pytest.raises(ExportError, match=r"my_atan.*Atan.*portable export does not support"):
        expanded_model(nodes, {"w": np.ones(3, np.float32)}, [], 21, ["dw"], {})


@pytest.fixture(scope="session")
def tiny_bert() -> onnx.ModelProto:
    """support.portable_training's tiny BERT (dynamo export, dynamic batch; inputs
    input_ids, attention_mask)."""
    return tiny_bert_model()


@pytest.mark.slow
def test_tiny_bert_backward_matches_onnxtrain_gradient_in_onnxruntime(tiny_bert):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter merged equal weights: not what is tested here
        training = make_training_model(tiny_bert.SerializeToString(), loss="cross_entropy")

    def feeds(batch: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(batch)
        mask = np.ones((batch, 8), np.int64)
        mask[0, 5:] = 0  # padding: the attention mask's Where is on the path
        return {"input_ids": rng.integers(0, 100, (batch, 8)), "attention_mask": mask,
                "labels": rng.integers(0, 3, batch)}

    _check_training_model(training, feeds)


def _small_graph_parts():
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])]
    forward = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
               helper.make_node("Tanh", ["h"], ["t"], name="tanh"),
               helper.make_node("Mul", ["t", "t"], ["sq"], name="square"),
               helper.make_node("ReduceSum", ["sq"], ["y"], name="total", keepdims=0)]
    weights = {"w": np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32),
               "unused": np.ones(2, np.float32)}
    return inputs, forward, weights


def _x(batch: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(batch).standard_normal((batch, 3)).astype(np.float32)}


def test_pytorch_pfn_extras_gradient_in_ai_onnx_preview_with_identity_copies():
    # ppe.onnx.grad names each x by an Identity copy of the Gradient's input.
    inputs, forward, weights = _small_graph_parts()
    nodes = [helper.make_node("Identity", ["w"], ["w_copy"]), *forward,
             helper.make_node("Gradient", ["w", "x"], ["dw", "dx"], domain="ai.onnx.preview",
                              xs=["w_copy", "x"], y="y")]
    compare_expansion(nodes, weights, inputs, 21, ["dw", "dx"], _x)


def test_x_that_y_does_not_read_gets_zeros_and_two_gradient_nodes_expand():
    inputs, forward, weights = _small_graph_parts()
    nodes = [*forward,
             helper.make_node("Gradient", ["w", "unused", "x"], ["dw", "d_unused"], domain="ai.onnx.preview.training",
                              xs=["w", "unused"], zs=["x"], y="y"),
             helper.make_node("Gradient", ["x", "w"], ["dx_t"], domain="ai.onnx.preview.training",
                              xs=["x"], zs=["w"], y="t")]
    compare_expansion(nodes, weights, inputs, 21, ["dw", "d_unused", "dx_t"], _x)


def test_sparse_initializers_are_accepted():
    inputs, forward, weights = _small_graph_parts()
    sparse = onnx.SparseTensorProto(values=numpy_helper.from_array(np.array([2.0], np.float32), "w"),
                                    indices=numpy_helper.from_array(np.array([1], np.int64)), dims=[3, 2])
    nodes = [*forward, helper.make_node("Gradient", ["w", "x"], ["dw"], domain="ai.onnx.preview.training",
                                        xs=["w"], zs=["x"], y="y")]
    new_nodes, _ = expand_gradients(nodes, {"w": sparse}, inputs, 21, _x(4))
    assert not any(n.op_type == "Gradient" for n in new_nodes)


def test_example_feed_of_size_one_along_an_open_axis_is_refused():
    inputs, forward, weights = _small_graph_parts()
    nodes = [*forward, helper.make_node("Gradient", ["w", "x"], ["dw"], domain="ai.onnx.preview.training",
                                        xs=["w"], zs=["x"], y="y")]
    with pytest.raises(ExportError, match=r"input 'x' has size 1 along axis 0"):
        expand_gradients(nodes, weights, inputs, 21, _x(1))


def test_old_opset_and_gradient_at_other_inputs_raise_export_error():
    inputs, forward, weights = _small_graph_parts()
    gradient = helper.make_node("Gradient", ["w", "x"], ["dw"], domain="ai.onnx.preview.training",
                                xs=["w"], zs=["x"], y="y")
    with pytest.raises(ExportError, match="opset 16"):
        expand_gradients([*forward, gradient], weights, inputs, 15, _x(4))
    elsewhere = helper.make_node("Gradient", ["unused", "x"], ["dw"], domain="ai.onnx.preview.training",
                                 xs=["w"], zs=["x"], y="y", name="odd")
    with pytest.raises(ExportError, match=r"'odd'.*inputs must be the tensors its xs and zs name"):
        expand_gradients([*forward, elsewhere], weights, inputs, 21, _x(4))


def test_backward_node_names_say_what_they_compute():
    inputs, forward, weights = _small_graph_parts()
    nodes = [*forward, helper.make_node("Gradient", ["w", "x"], ["dw"], domain="ai.onnx.preview.training",
                                        xs=["w"], zs=["x"], y="y")]
    new_nodes, _ = expand_gradients(nodes, weights, inputs, 21, _x(4))
    names = [n.name for n in new_nodes[len(forward):]]
    assert "grad/fc/dB" in names and "grad/tanh/dX" in names and names[-1] == "grad/w/out"
    assert len(set(names)) == len(names)


def _tiny_mlp() -> onnx.ModelProto:
    """x[batch, 4] -> Gemm 8 -> Sigmoid -> MatMul 3 -> Add: small enough for quick tests."""
    rng = np.random.default_rng(1)
    weights = {"W1": rng.standard_normal((8, 4)), "B1": rng.standard_normal(8) * 0.1,
               "W2": rng.standard_normal((8, 3)) * 0.5, "B2": rng.standard_normal(3) * 0.1}
    nodes = [helper.make_node("Gemm", ["x", "W1", "B1"], ["h"], name="fc1", transB=1),
             helper.make_node("Sigmoid", ["h"], ["s"], name="act"),
             helper.make_node("MatMul", ["s", "W2"], ["m"], name="fc2"),
             helper.make_node("Add", ["m", "B2"], ["prediction"], name="fc2_bias")]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("prediction", TensorProto.FLOAT, ["batch", 3])],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("loss", ["mse", "l1", "bce_with_logits", "cross_entropy"])
@pytest.mark.slow
def test_make_training_model_losses_expand(loss):
    training = make_training_model(_tiny_mlp().SerializeToString(), loss=loss, optimizer="sgd")

    def feeds(batch: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(batch)
        x = rng.standard_normal((batch, 4)).astype(np.float32)
        if loss == "cross_entropy":
            return {"x": x, "labels": rng.integers(0, 3, batch).astype(np.int64)}
        labels = rng.random((batch, 3)).astype(np.float32)
        return {"x": x, "labels": (labels > 0.5).astype(np.float32) if loss == "bce_with_logits" else labels}

    _check_training_model(training, feeds)


def test_dropout_in_training_mode_uses_its_own_mask():
    # Random in both runtimes, so the oracle is the mask itself: d_a = cotangent * mask / (1 - ratio).
    nodes = [helper.make_node("Constant", [], ["ratio"], value=helper.make_tensor("ratio", TensorProto.FLOAT, [], [0.25])),
             helper.make_node("Constant", [], ["train"], value=helper.make_tensor("train", TensorProto.BOOL, [], [True])),
             helper.make_node("Dropout", ["a", "ratio", "train"], ["out"], name="drop"),
             helper.make_node("Mul", ["out", "cotangent"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["y"], keepdims=0),
             helper.make_node("Gradient", ["a", "cotangent"], ["d_a"], domain="ai.onnx.preview.training",
                              xs=["a"], zs=["cotangent"], y="y")]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 50]) for n in ("a", "cotangent")]
    rng = np.random.default_rng(0)
    example = {n: rng.standard_normal((4, 50)).astype(np.float32) + 3 for n in ("a", "cotangent")}
    model = expanded_model(nodes, {}, inputs, 21, ["d_a", "out"], example, {"d_a": 2, "out": 2})
    for batch in (4, 7):
        feeds = {n: rng.standard_normal((batch, 50)).astype(np.float32) + 3 for n in ("a", "cotangent")}
        gradient, out = run_onnxruntime(model, feeds)
        kept = out != 0
        assert 0 < kept.mean() < 1
        np.testing.assert_allclose(gradient, np.where(kept, feeds["cotangent"] / 0.75, 0), rtol=1e-6)
        np.testing.assert_allclose(out[kept], feeds["a"][kept] / 0.75, rtol=1e-6)


def test_keep_first_leaves_the_main_graph_as_exported():
    # The tiny MLP has no training-mode copy: its Gemm on the path lies in the main graph.
    training = make_training_model(_tiny_mlp().SerializeToString(), loss="mse", optimizer="sgd")
    nodes, initializers, inputs, opset = combined(training)
    main = len(training.graph.node)
    (gradient,) = [n for n in nodes if n.op_type == "Gradient"]
    outputs = ["loss", *gradient.output]

    def feeds(batch: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(batch)
        return {"x": rng.standard_normal((batch, 4)).astype(np.float32),
                "labels": rng.standard_normal((batch, 3)).astype(np.float32)}

    new_nodes, new_initializers = expand_gradients(nodes, initializers, inputs, opset, feeds(4), keep_first=main)
    assert [n.SerializeToString() for n in new_nodes[:main]] == [n.SerializeToString() for n in nodes[:main]]
    assert "Gemm" not in {n.op_type for n in new_nodes[main:]}
    model = gradient_model(new_nodes, initializers, inputs, opset, outputs, new_initializers,
                           {name: 0 if name == "loss" else (2 if name.startswith("W") else 1) for name in outputs})
    onnx.checker.check_model(model, full_check=True)
    reference = gradient_model(nodes, initializers, inputs, opset, outputs)
    for batch in (4, 7):
        assert_close(run_onnxruntime(model, feeds(batch)), run_onnxtrain(reference, feeds(batch)), outputs)


def test_second_gradient_after_a_decomposed_node_keeps_topological_order():
    # SoftmaxCrossEntropyLoss after the first Gradient is decomposed (taking Shape(t)); the
    # first Gradient's backward needs Shape(t) too and must not read the later node.
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
              helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch"])]
    weights = {"w": np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["t"], name="fc"),
             helper.make_node("ReduceSum", ["t"], ["y1"], keepdims=0),
             helper.make_node("Gradient", ["w", "x"], ["dw1"], domain="ai.onnx.preview.training", xs=["w"], zs=["x"],
                              y="y1"),
             helper.make_node("SoftmaxCrossEntropyLoss", ["t", "labels"], ["loss"]),
             helper.make_node("Gradient", ["w", "x", "labels"], ["dw2"], domain="ai.onnx.preview.training",
                              xs=["w"], zs=["x", "labels"], y="loss")]

    def feeds(batch: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(batch)
        return {"x": rng.standard_normal((batch, 4)).astype(np.float32),
                "labels": rng.integers(0, 3, batch).astype(np.int64)}

    compare_expansion(nodes, weights, inputs, 21, ["dw1", "dw2"], feeds)
