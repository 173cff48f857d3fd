"""Small ONNX models built with the `onnx` package, for tests.

`onnx` is the independent oracle: models are made and checked with its
helpers and its own loader, then fed to onnxtrain.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def tensors_everywhere_model(size: int = 64) -> onnx.ModelProto:
    """A valid model with sizeable tensors in every place a tensor can hide.

    Main-graph initializers, a Constant attribute, an If branch's initializer,
    a function body's Constant, and training_info graphs' initializers.
    """
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.normal(size=(size, size)).astype(np.float32), "W")
    bias = numpy_helper.from_array(np.arange(size, dtype=np.float64), "B")
    branch_tensor = numpy_helper.from_array(np.ones((size, size), np.float32), "branch_w")
    then_graph = helper.make_graph(
        [helper.make_node("Add", ["mm", "branch_w"], ["then_out"])],
        "then_branch", [], [helper.make_tensor_value_info("then_out", TensorProto.FLOAT, None)],
        initializer=[branch_tensor],
    )
    else_graph = helper.make_graph(
        [helper.make_node("Identity", ["mm"], ["else_out"])],
        "else_branch", [], [helper.make_tensor_value_info("else_out", TensorProto.FLOAT, None)],
    )
    constant = helper.make_node(
        "Constant", [], ["offset"], name="offset_const",
        value=numpy_helper.from_array(np.full((size,), 0.5, np.float32), "offset_value"),
    )
    function = helper.make_function(
        "local", "Shift", ["x"], ["y"],
        [
            helper.make_node(
                "Constant", [], ["c"],
                value=numpy_helper.from_array(np.full((size,), 2.0, np.float32), "fn_c"),
            ),
            helper.make_node("Add", ["x", "c"], ["y"]),
        ],
        [helper.make_opsetid("", 17)],
    )
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["mm"], name="matmul"),
            helper.make_node("If", ["cond"], ["branched"], name="choose",
                             then_branch=then_graph, else_branch=else_graph),
            constant,
            helper.make_node("Add", ["branched", "offset"], ["shifted"], name="add_offset"),
            helper.make_node("Shift", ["shifted"], ["Y"], name="shift", domain="local"),
        ],
        "main",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", size]),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", size])],
        initializer=[weight, bias],
    )
    algorithm = helper.make_graph(
        [helper.make_node("Mul", ["W", "decay"], ["W_new"], name="decay_weights")],
        "algorithm", [], [helper.make_tensor_value_info("W_new", TensorProto.FLOAT, [size, size])],
        initializer=[numpy_helper.from_array(np.full((size, size), 0.99, np.float32), "decay")],
    )
    initialization = helper.make_graph(
        [helper.make_node("Identity", ["W_init"], ["W_start"], name="init_weights")],
        "initialization", [],
        [helper.make_tensor_value_info("W_start", TensorProto.FLOAT, [size, size])],
        initializer=[numpy_helper.from_array(np.zeros((size, size), np.float32), "W_init")],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
        functions=[function],
    )
    model.training_info.append(
        helper.make_training_info(algorithm, [("W", "W_new")], initialization, [("W", "W_start")])
    )
    onnx.checker.check_model(model)
    return model


def conv_classifier(kernel: np.ndarray, dense: np.ndarray, activation: str = "Relu", size: int = 6) -> onnx.ModelProto:
    """x[batch, channels, size, size] -> Conv (3x3, pads 1, no bias) -> activation -> Flatten ->
    MatMul, with `kernel` as initializer C and `dense` as W."""
    channels, classes = kernel.shape[1], dense.shape[1]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "C"], ["c"], pads=[1, 1, 1, 1]), helper.make_node(activation, ["c"], ["a"]),
         helper.make_node("Flatten", ["a"], ["f"]), helper.make_node("MatMul", ["f", "W"], ["logits"])],
        "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", channels, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        [numpy_helper.from_array(kernel, "C"), numpy_helper.from_array(dense, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
