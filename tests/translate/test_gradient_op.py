"""The Gradient operator's edges: random ops replayed, refused paths, bad names, evaluation point."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain import ModelLoadError

TRAINING = "ai.onnx.preview.training"


def _model(nodes, inputs, outputs, opset=18):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                   helper.make_opsetid(TRAINING, 1)])


@pytest.mark.slow
def test_dropout_mask_is_the_one_the_loss_saw():
    # y = sum(Dropout(x) * x): with mask m and scale s, dy/dx = 2 * s * m * x, and
    # the forward output d reveals the mask the gradient must use.
    nodes = [
        helper.make_node("Constant", [], ["ratio"], value=helper.make_tensor("r", TensorProto.FLOAT, [], [0.5])),
        helper.make_node("Constant", [], ["train"], value=helper.make_tensor("t", TensorProto.BOOL, [], [True])),
        helper.make_node("Dropout", ["x", "ratio", "train"], ["d"]),
        helper.make_node("Mul", ["d", "x"], ["p"]),
        helper.make_node("ReduceSum", ["p"], ["y"], keepdims=0),
        helper.make_node("Gradient", ["x"], ["dx"], domain=TRAINING, xs=["x"], y="y"),
    ]
    model = _model(nodes, [("x", [64])], ["d", "dx"])
    x = np.linspace(1, 2, 64).astype(np.float32)
    for seed in range(3):
        out = onnxtrain.run(model, {"x": x}, key=jax.random.key(seed))
        mask = np.asarray(out["d"]) != 0
        assert 0 < mask.sum() < 64
        np.testing.assert_allclose(out["dx"], np.where(mask, 2 * 2 * x, 0), rtol=1e-6)


def test_gradient_is_taken_at_the_node_inputs_not_the_current_values():
    # y = x * x; Gradient fed with z = 3 * x evaluates dy/dx at x := z, i.e. 2 * z.
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["y"]),
        helper.make_node("Constant", [], ["three"], value=helper.make_tensor("c", TensorProto.FLOAT, [], [3.0])),
        helper.make_node("Mul", ["x", "three"], ["z"]),
        helper.make_node("Gradient", ["z"], ["dx"], domain=TRAINING, xs=["x"], y="y"),
    ]
    x = np.array([1.0, -2.0], np.float32)
    out = onnxtrain.run(_model(nodes, [("x", [2])], ["dx"]), {"x": x})
    np.testing.assert_allclose(out["dx"], 2 * 3 * x)


def test_zs_computed_from_the_differentiated_values_stay_constants():
    # y = sum(a * h) with a = W * x and h = tanh(a) named in zs: h is held constant, so
    # dy/dW = x * h. h is computed from the forward pass the Gradient differentiates, so
    # that pass cannot run as one group ahead of h: the Gradient node replays it instead.
    nodes = [
        helper.make_node("Mul", ["W", "x"], ["a"]),
        helper.make_node("Tanh", ["a"], ["h"]),
        helper.make_node("Mul", ["a", "h"], ["p"]),
        helper.make_node("ReduceSum", ["p"], ["y"], keepdims=0),
        helper.make_node("Gradient", ["W", "x", "h"], ["dW"], domain=TRAINING, xs=["W"], zs=["x", "h"], y="y"),
    ]
    w, x = np.array([0.5, -1.0, 2.0], np.float32), np.array([1.5, 0.25, -0.75], np.float32)
    out = onnxtrain.run(_model(nodes, [("W", [3]), ("x", [3])], ["y", "dW"]), {"W": w, "x": x})
    np.testing.assert_allclose(out["y"], np.sum(w * x * np.tanh(w * x)), rtol=1e-6)
    np.testing.assert_allclose(out["dW"], x * np.tanh(w * x), rtol=1e-6)


def test_non_differentiable_op_on_the_path_is_named():
    nodes = [
        helper.make_node("Constant", [], ["one"], value=helper.make_tensor("c", TensorProto.FLOAT, [], [1.0])),
        helper.make_node("Less", ["x", "one"], ["below"]),
        helper.make_node("Cast", ["below"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["f", "x"], ["m"]),
        helper.make_node("EyeLike", ["m"], ["e"], name="eye"),
        helper.make_node("ReduceSum", ["e"], ["y"], keepdims=0),
        helper.make_node("Gradient", ["x"], ["dx"], domain=TRAINING, xs=["x"], y="y"),
    ]
    model = _model(nodes, [("x", [3, 3])], ["dx"])
    with pytest.raises(ModelLoadError, match=r"node 'eye' \(EyeLike\) in main graph, which has no gradient"):
        onnxtrain.run(model, {"x": np.ones((3, 3), np.float32)})


def test_path_through_comparisons_is_zero_not_an_error():
    nodes = [
        helper.make_node("Constant", [], ["one"], value=helper.make_tensor("c", TensorProto.FLOAT, [], [1.0])),
        helper.make_node("Less", ["x", "one"], ["below"]),
        helper.make_node("Cast", ["below"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["f", "x"], ["m"]),
        helper.make_node("ReduceSum", ["m"], ["y"], keepdims=0),
        helper.make_node("Gradient", ["x"], ["dx"], domain=TRAINING, xs=["x"], y="y"),
    ]
    x = np.array([0.5, 2.0], np.float32)
    out = onnxtrain.run(_model(nodes, [("x", [2])], ["dx"]), {"x": x})
    np.testing.assert_array_equal(out["dx"], [1.0, 0.0])


@pytest.mark.parametrize("attributes, inputs, message", [
    ({"xs": ["x"], "y": "nowhere"}, ["x"], "y='nowhere' is not computed"),
    ({"xs": ["x"], "zs": ["w"], "y": "y"}, ["x"], "has 1 inputs but xs and zs name 2"),
    # Attributes of the wrong type (a fuzzed model's FLOATS y raised a bare TypeError).
    ({"xs": ["x"], "y": [0.5]}, ["x"], r"attribute 'y' must name the tensor to differentiate \(type STRING\)"),
    ({"xs": ["x"]}, ["x"], "required attribute 'y' is missing"),
    ({"xs": 1.5, "y": "y"}, ["x"], r"attribute 'xs' must list tensor names \(type STRINGS\), not 1.5"),
    ({"xs": ["x"], "zs": [1, 2], "y": "y"}, ["x"], r"attribute 'zs' must list tensor names"),
])
def test_bad_gradient_nodes_name_the_problem(attributes, inputs, message):
    nodes = [helper.make_node("Mul", ["x", "x"], ["y"]),
             helper.make_node("Gradient", inputs, ["dx"], domain=TRAINING, **attributes)]
    with pytest.raises(ModelLoadError, match=message):
        onnxtrain.run(_model(nodes, [("x", [2])], ["dx"]), {"x": np.ones(2, np.float32)})


def test_integer_xs_are_refused():
    graph = helper.make_graph(
        [helper.make_node("Cast", ["i"], ["y"], to=TensorProto.FLOAT),
         helper.make_node("Gradient", ["i"], ["di"], domain=TRAINING, xs=["i"], y="y")],
        "g", [helper.make_tensor_value_info("i", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("di", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(TRAINING, 1)])
    with pytest.raises(ModelLoadError, match="only float tensors can be differentiated"):
        onnxtrain.run(model, {"i": np.array([1, 2], np.int64)})
