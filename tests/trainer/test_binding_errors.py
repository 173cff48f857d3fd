"""Every TrainingInfoProto rule of §1.3, one broken model each.

No ONNX tool checks training_info (§0), so the engine is the only line of defence: each
violation must raise BindingError naming `training_info[i]` and the offending name. Each
case breaks one rule of §4.1's otherwise valid linreg model. A bound output whose shape
only turns out wrong at run time must fail the step without touching the state.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxtrain
from support.training_models import (LABEL, LINREG_FEEDS, algorithm_graph, assert_state_equal, constant, linreg_graph,
                                     linreg_model, make_training_model, mse_nodes, snapshot, tensor)


def binding(entries, key: str):
    return next(entry for entry in entries if entry.key == key)


def key_not_an_initializer(model: onnx.ModelProto) -> None:
    model.training_info[0].update_binding.add(key="NOPE", value="loss")


def key_of_another_algorithm(model: onnx.ModelProto) -> None:
    """TI1 binds LR, an initializer of TI0's algorithm (where it is no state variable)."""
    algorithm = algorithm_graph([constant("zero", 0.0)], ["zero"], name="other")
    model.training_info.append(helper.make_training_info(algorithm, [("LR", "zero")], None, None))


def duplicate_update_key(model: onnx.ModelProto) -> None:
    model.training_info[0].update_binding.add(key="W", value="W_new")


def duplicate_initialization_key(model: onnx.ModelProto) -> None:
    model.training_info[0].initialization_binding.add(key="B", value="B_init")


def initialization_value_not_an_output(model: onnx.ModelProto) -> None:
    binding(model.training_info[0].initialization_binding, "B").value = "B_missing"


def update_value_not_an_output(model: onnx.ModelProto) -> None:
    binding(model.training_info[0].update_binding, "W").value = "W_missing"


def update_value_an_internal_tensor(model: onnx.ModelProto) -> None:
    """dW is computed by the algorithm but is not one of its outputs."""
    binding(model.training_info[0].update_binding, "W").value = "dW"


def initialization_binding_without_graph(model: onnx.ModelProto) -> None:
    model.training_info[0].ClearField("initialization")


def algorithm_redefines_a_main_output(model: onnx.ModelProto) -> None:
    model.training_info[0].algorithm.node.insert(0, helper.make_node("Identity", ["XW"], ["Y_pred"]))


def algorithm_redefines_a_main_initializer(model: onnx.ModelProto) -> None:
    model.training_info[0].algorithm.initializer.append(tensor("W", [[1.0]]))


def algorithm_reads_a_later_name(model: onnx.ModelProto) -> None:
    nodes = model.training_info[0].algorithm.node
    nodes.insert(0, helper.make_node("Identity", ["later"], ["early"]))
    nodes.append(helper.make_node("Identity", ["loss"], ["later"]))


def algorithm_reads_an_undefined_name(model: onnx.ModelProto) -> None:
    model.training_info[0].algorithm.node.insert(0, helper.make_node("Identity", ["ghost"], ["ghost_copy"]))


@pytest.mark.parametrize("breaks, index, name", [
    (key_not_an_initializer, 0, "NOPE"),
    (key_of_another_algorithm, 1, "LR"),
    (duplicate_update_key, 0, "W"),
    (duplicate_initialization_key, 0, "B"),
    (initialization_value_not_an_output, 0, "B_missing"),
    (update_value_not_an_output, 0, "W_missing"),
    (update_value_an_internal_tensor, 0, "dW"),
    (initialization_binding_without_graph, 0, "initialization"),
    (algorithm_redefines_a_main_output, 0, "Y_pred"),
    (algorithm_redefines_a_main_initializer, 0, "W"),
    (algorithm_reads_a_later_name, 0, "later"),
    (algorithm_reads_an_undefined_name, 0, "ghost"),
], ids=lambda value: value.__name__ if callable(value) else None)
def test_a_broken_training_info_is_rejected_with_its_index_and_name(breaks: Callable, index: int, name: str):
    model = linreg_model()
    breaks(model)
    with pytest.raises(onnxtrain.BindingError) as error:
        onnxtrain.Trainer(model)
    message = str(error.value)
    assert f"training_info[{index}]" in message
    assert re.search(rf"\b{re.escape(name)}\b", message), message
    assert isinstance(error.value, onnxtrain.OnnxTrainError)


def test_an_update_value_may_be_a_main_graph_output():
    """onnx.proto: update_binding values are outputs of the algorithm or of ModelProto.graph."""
    main = linreg_graph()
    main.node.append(helper.make_node("Mul", ["W", "TWO"], ["W_doubled"]))
    main.initializer.append(tensor("TWO", 2.0))
    main.output.append(helper.make_tensor_value_info("W_doubled", TensorProto.FLOAT, [1, 1]))
    algorithm = algorithm_graph(mse_nodes(), ["loss"], [LABEL])
    trainer = onnxtrain.Trainer(make_training_model(
        main, helper.make_training_info(algorithm, [("W", "W_doubled")], None, None)))
    np.testing.assert_allclose(float(trainer.step(LINREG_FEEDS)["loss"]), 25.375, rtol=1e-6)
    trainer.step(LINREG_FEEDS)
    assert float(np.asarray(trainer.state["W"]).item()) == 2.0


def residual_bound_to_W(output_type: int = TensorProto.FLOAT):
    """W <- W + (Y_pred - Y): shape [N, 1], which fits the [1, 1] state only when N == 1."""
    nodes = [*mse_nodes(), helper.make_node("Add", ["W", "diff"], ["W_sum"])]
    if output_type == TensorProto.FLOAT:
        nodes.append(helper.make_node("Identity", ["W_sum"], ["W_new"]))
    else:
        nodes.append(helper.make_node("Cast", ["W_sum"], ["W_new"], to=output_type))
    algorithm = algorithm_graph(nodes, ["loss", "W_new"], [LABEL])
    return make_training_model(linreg_graph(), helper.make_training_info(algorithm, [("W", "W_new")], None, None))


def test_an_update_of_the_wrong_shape_fails_the_step_and_keeps_the_state():
    trainer = onnxtrain.Trainer(residual_bound_to_W())
    one_row = {name: value[:1] for name, value in LINREG_FEEDS.items()}
    trainer.step(one_row)  # W = 0.5 + (0.5 - 3) = -2
    assert float(np.asarray(trainer.state["W"]).item()) == -2.0
    before = snapshot(trainer)
    with pytest.raises(onnxtrain.BindingError) as error:
        trainer.step(LINREG_FEEDS)
    assert "training_info[0]" in str(error.value) and re.search(r"\bW\b", str(error.value))
    assert_state_equal(trainer, before)
    trainer.step(one_row)  # W = -2 + (-2 - 3)
    assert float(np.asarray(trainer.state["W"]).item()) == -7.0


def test_an_update_of_the_wrong_dtype_is_a_binding_error():
    """A float64 value bound to a float32 state variable must not be cast silently."""
    with pytest.raises(onnxtrain.BindingError, match=r"training_info\[0\]"):
        onnxtrain.Trainer(residual_bound_to_W(TensorProto.DOUBLE)).step(
            {name: value[:1] for name, value in LINREG_FEEDS.items()})
