"""Several TrainingInfoProtos, state kept in algorithm initializers, and when bound outputs land.

IR.md lets a runtime invoke any algorithm in any order (block coordinate descent is the
onnx.proto example), so interleavings must follow the numpy oracle step by step. A state
variable may live only in an algorithm's initializers (a counter, a learning-rate schedule),
and every bound output of one step is computed from the pre-step state, then assigned
together (§1.2).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import pytest
from onnx import helper

import onnxtrain
from support.training_models import (LABEL, algorithm_graph, assert_state_equal, f32, gradient, linreg_graph,
                                     linreg_loss_and_grads, make_training_model, mse_nodes, snapshot, tensor,
                                     value_info)

RATES = {"W": 0.05, "B": 0.2}


def sgd_info(xs: Sequence[str], zs: Sequence[str], rate: str, value: float) -> onnx.TrainingInfoProto:
    """Plain SGD on the linreg loss, x -= rate * dloss/dx, for each x in xs."""
    nodes = mse_nodes() + [gradient(xs, "loss", zs=zs)]
    for x in xs:
        nodes += [helper.make_node("Mul", [rate, f"d{x}"], [f"step_{x}"]),
                  helper.make_node("Sub", [x, f"step_{x}"], [f"{x}_new"])]
    algorithm = algorithm_graph(nodes, ["loss"] + [f"{x}_new" for x in xs], [LABEL], [tensor(rate, value)])
    return helper.make_training_info(algorithm, [(x, f"{x}_new") for x in xs], None, None)


def coordinate_descent_model():
    """TI0 updates only W (B held as a zs input), TI1 only B (W held)."""
    return make_training_model(linreg_graph(features=2, w0=[[0.5], [-0.5]]),
                               sgd_info(["W"], ["B", "X", "Y"], "LR_W", RATES["W"]),
                               sgd_info(["B"], ["W", "X", "Y"], "LR_B", RATES["B"]))


def regression_feeds() -> dict[str, np.ndarray]:
    X = np.random.default_rng(3).normal(size=(6, 2)).astype(np.float32)
    return {"X": X, "Y": X @ np.array([[2.0], [-1.0]], np.float32) + 3}


def test_algorithms_interleave_in_the_order_the_caller_chooses():
    feeds = regression_feeds()
    trainer = onnxtrain.Trainer(coordinate_descent_model())
    assert trainer.state_names == ("W", "B")
    assert set(trainer.hyperparameters) == {"LR_W", "LR_B"}

    state = {"W": np.array([[0.5], [-0.5]]), "B": np.zeros(1)}
    X, Y = (feeds[name].astype(np.float64) for name in "XY")
    for algorithm in (0, 1, 1, 0):
        loss, dW, dB = linreg_loss_and_grads(state["W"], state["B"], X, Y)
        name, grad = [("W", dW), ("B", dB)][algorithm]
        state[name] = state[name] - f32(RATES[name]) * grad
        out = trainer.step(feeds, algorithm=algorithm)
        assert set(out) == {"loss"}
        np.testing.assert_allclose(float(out["loss"]), loss, rtol=1e-5)
        for key, value in state.items():
            np.testing.assert_allclose(np.asarray(trainer.state[key]), value, rtol=1e-5, err_msg=key)


def test_initialize_without_initialization_graphs_changes_nothing():
    trainer = onnxtrain.Trainer(coordinate_descent_model())
    trainer.step(regression_feeds())
    before = snapshot(trainer)
    trainer.initialize()
    assert_state_equal(trainer, before)


def test_an_algorithm_index_out_of_range_is_an_error_that_changes_nothing():
    trainer = onnxtrain.Trainer(coordinate_descent_model())
    before = snapshot(trainer)
    with pytest.raises(onnxtrain.OnnxTrainError):
        trainer.step(regression_feeds(), algorithm=2)
    assert_state_equal(trainer, before)


def schedule_model():
    """SGD on linreg whose learning rate halves each step; LR and T exist only in the algorithm."""
    nodes = mse_nodes() + [gradient(["W", "B"], "loss", zs=["X", "Y"])]
    for name in "WB":
        nodes += [helper.make_node("Mul", ["LR", f"d{name}"], [f"step_{name}"]),
                  helper.make_node("Sub", [name, f"step_{name}"], [f"{name}_new"])]
    nodes += [helper.make_node("Mul", ["LR", "HALF"], ["LR_new"]), helper.make_node("Add", ["T", "ONE"], ["T_new"])]
    state = ["W", "B", "LR", "T"]
    algorithm = algorithm_graph(nodes, ["loss"] + [f"{s}_new" for s in state], [LABEL],
                                [tensor("LR", 0.04), tensor("HALF", 0.5), tensor("ONE", 1, np.int64),
                                 tensor("T", 0, np.int64)])
    info = helper.make_training_info(algorithm, [(s, f"{s}_new") for s in state], None, None)
    return make_training_model(linreg_graph(), info)


def test_state_kept_in_algorithm_initializers_follows_its_schedule():
    feeds = regression_feeds()
    feeds = {"X": feeds["X"][:, :1], "Y": feeds["Y"]}
    trainer = onnxtrain.Trainer(schedule_model())
    assert trainer.state_names == ("W", "B", "LR", "T")
    assert set(trainer.hyperparameters) == {"HALF", "ONE"}

    W, B, rate = np.array([[0.5]]), np.zeros(1), f32(0.04)
    X, Y = (feeds[name].astype(np.float64) for name in "XY")
    for step in range(1, 5):
        loss, dW, dB = linreg_loss_and_grads(W, B, X, Y)
        W, B, rate = W - rate * dW, B - rate * dB, rate / 2
        np.testing.assert_allclose(float(trainer.step(feeds)["loss"]), loss, rtol=1e-5)
        assert float(trainer.state["LR"]) == rate  # halving is exact in float32
        assert int(trainer.state["T"]) == step
        np.testing.assert_allclose(np.asarray(trainer.state["W"]), W, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(trainer.state["B"]), B, rtol=1e-5)


def test_bound_outputs_are_computed_from_the_pre_step_state_and_assigned_together():
    """A_new = B and B_new = A swap the two; sequential assignment would copy one into both."""
    main = helper.make_graph([helper.make_node("Add", ["A", "B"], ["S"])], "pair", [], [value_info("S", shape=[2])],
                             initializer=[tensor("A", [1.0, 2.0]), tensor("B", [3.0, 4.0])])
    algorithm = algorithm_graph([helper.make_node("Identity", ["B"], ["A_new"]),
                                 helper.make_node("Identity", ["A"], ["B_new"])], ["A_new", "B_new"])
    trainer = onnxtrain.Trainer(make_training_model(
        main, helper.make_training_info(algorithm, [("A", "A_new"), ("B", "B_new")], None, None)))
    assert trainer.step({}) == {}
    np.testing.assert_array_equal(np.asarray(trainer.state["A"]), [3.0, 4.0])
    np.testing.assert_array_equal(np.asarray(trainer.state["B"]), [1.0, 2.0])
    np.testing.assert_array_equal(np.asarray(trainer.infer({})["S"]), [4.0, 6.0])
