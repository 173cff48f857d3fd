"""A program whose every shape is valid but whose outputs no device holds is a ResourceError.

Translation bounds only shapes no array can have and arrays built on the host; a Tile of a
traced input to a valid but enormous shape is found out when XLA allocates it.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.errors import ResourceError

REPEATS = [2**20, 2**20]  # float32[2**21, 3 * 2**20]: about 26 TB


def _tiled_model():
    graph = helper.make_graph(
        [helper.make_node("Tile", ["x", "repeats"], ["y"], name="huge_tile")],
        "tiled", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(REPEATS, np.int64), "repeats")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_run_names_the_model_when_the_device_cannot_hold_the_outputs():
    with pytest.raises(ResourceError, match=r"model 'tiled'.*more memory than the device has"):
        onnxtrain.run(_tiled_model(), {"x": np.ones((2, 3), np.float32)})


def _trainable_tiled_model():
    """y = x @ W, trained on mse; the main graph's second output is the huge Tile of x."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="linear"),
         helper.make_node("Tile", ["x", "repeats"], ["tiled"], name="huge_tile")],
        "tiled_linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1]),
         helper.make_tensor_value_info("tiled", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ones((3, 1), np.float32), "W"),
         numpy_helper.from_array(np.array(REPEATS, np.int64), "repeats")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnxtrain.make_training_model(model, loss="mse", output="y")


def test_inference_of_a_trainer_names_the_program_and_keeps_the_state():
    trainer = onnxtrain.Trainer(_trainable_tiled_model())
    before = np.asarray(trainer.state["W"])
    with pytest.raises(ResourceError, match=r"inference \(main graph\).*more memory"):
        trainer.infer({"x": np.ones((2, 3), np.float32)})
    np.testing.assert_array_equal(np.asarray(trainer.state["W"]), before)


def test_other_runtime_errors_are_not_mistaken_for_memory():
    assert onnxtrain.errors.out_of_memory(RuntimeError("INVALID_ARGUMENT: bad"), "here") is None
    assert isinstance(onnxtrain.errors.out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: x"), "here"),
                      ResourceError)
