"""The initialization step: random weights from the trainer's PRNG key, counters reset.

IR.md: state starts at its initializer values; initialize() evaluates the initialization
graph and assigns its outputs per initialization_binding. Random ops cannot match other
runtimes bit for bit (the ONNX `seed` attribute is not honoured), so the oracle is the
distribution (moments, bounds, shape, dtype) plus reproducibility: the same trainer seed
gives the same state, another seed or a second initialize() gives new draws.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import onnxtrain
from support.training_models import (INT64, LABEL, algorithm_graph, constant, linreg_graph, make_training_model,
                                     mse_nodes, snapshot, tensor, value_info)

STATE = ["W", "B", "T"]
FEEDS = {"X": np.random.default_rng(5).normal(size=(3, 64)).astype(np.float32)}


def random_init_model():
    """Y = X W + B; initialization draws W ~ N(1, 0.5^2), B ~ U[-2, -1) and resets T (7 in the
    model) to 0; each step halves W and B, counts T and reports mean(Y)."""
    main = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["XW"]), helper.make_node("Add", ["XW", "B"], ["Y"])],
        "dense", [value_info("X", shape=["N", 64])], [value_info("Y", shape=["N", 32])],
        initializer=[tensor("W", np.full((64, 32), 0.25)), tensor("B", np.zeros(32))])
    algorithm = algorithm_graph(
        [helper.make_node("ReduceMean", ["Y"], ["mean"], keepdims=0), helper.make_node("Mul", ["W", "HALF"], ["W_new"]),
         helper.make_node("Mul", ["B", "HALF"], ["B_new"]), helper.make_node("Add", ["T", "ONE"], ["T_new"])],
        ["mean", "W_new", "B_new", "T_new"],
        initializer=[tensor("HALF", 0.5), tensor("ONE", 1, np.int64), tensor("T", 7, np.int64)])
    initialization = helper.make_graph(
        [helper.make_node("RandomNormal", [], ["W_init"], shape=[64, 32], mean=1.0, scale=0.5, seed=1.0),
         helper.make_node("RandomUniform", [], ["B_init"], shape=[32], low=-2.0, high=-1.0, dtype=TensorProto.FLOAT),
         constant("T_init", 0, np.int64)],
        "initialization", [], [value_info("W_init", shape=[64, 32]), value_info("B_init", shape=[32]),
                               value_info("T_init", INT64, [])])
    info = helper.make_training_info(algorithm, [(s, f"{s}_new") for s in STATE],
                                     initialization, [(s, f"{s}_init") for s in STATE])
    return make_training_model(main, info)


def test_state_holds_the_initializer_values_until_initialize():
    trainer = onnxtrain.Trainer(random_init_model(), seed=0)
    assert trainer.state_names == tuple(STATE)
    np.testing.assert_array_equal(np.asarray(trainer.state["W"]), np.full((64, 32), 0.25, np.float32))
    assert int(trainer.state["T"]) == 7


@pytest.mark.slow
def test_initialize_draws_from_the_declared_distributions_and_resets_the_counter():
    trainer = onnxtrain.Trainer(random_init_model(), seed=0)
    trainer.initialize()
    W, B, T = (np.asarray(trainer.state[name]) for name in STATE)
    assert (W.shape, W.dtype, B.shape, B.dtype, T.shape, T.dtype) == (
        (64, 32), np.float32, (32,), np.float32, (), np.int64)
    # 2048 normal draws: the sample mean is within 4 standard errors (0.5 / 45), the std within 5 %
    assert abs(W.mean() - 1.0) < 0.045 and abs(W.std() - 0.5) < 0.025
    assert len(np.unique(W)) == W.size
    # 32 uniform draws: all in [-2, -1), mean within 4 standard errors (0.289 / 5.7)
    assert B.min() >= -2 and B.max() < -1 and abs(B.mean() + 1.5) < 0.21
    assert T == 0


@pytest.mark.slow
def test_the_trainer_seed_fixes_the_draws():
    def initialized(seed):
        trainer = onnxtrain.Trainer(random_init_model(), seed=seed)
        trainer.initialize()
        return snapshot(trainer)

    first, again, other = initialized(3), initialized(3), initialized(4)
    for name in STATE:
        np.testing.assert_array_equal(first[name], again[name])
    assert not np.array_equal(first["W"], other["W"]) and not np.array_equal(first["B"], other["B"])


@pytest.mark.slow
def test_initialize_again_draws_anew_without_recompiling_and_resets_after_steps():
    trainer = onnxtrain.Trainer(random_init_model(), seed=0)
    trainer.initialize()
    first, compiled = snapshot(trainer), trainer.compilations

    out = trainer.step(FEEDS)
    np.testing.assert_allclose(float(out["mean"]), np.mean(FEEDS["X"] @ first["W"] + first["B"]), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(trainer.state["W"]), first["W"] * np.float32(0.5))
    trainer.step(FEEDS)
    assert int(trainer.state["T"]) == 2

    trainer.initialize()
    assert int(trainer.state["T"]) == 0
    second = snapshot(trainer)
    assert not np.array_equal(first["W"], second["W"]) and not np.array_equal(first["B"], second["B"])
    assert abs(second["W"].mean() - 1.0) < 0.045
    assert trainer.compilations == compiled + 1  # the step's program only


def test_initialization_graphs_run_in_model_order_so_the_last_binding_wins():
    """IR.md: the initialization step of each TrainingInfoProto is performed in order; keys are
    unique per binding list only, so two TrainingInfoProtos may both initialize W."""
    def info(value: float, keys: list[str]):
        initialization = helper.make_graph(
            [constant("W_init", [[value]]), constant("B_init", [value])], "initialization", [],
            [value_info("W_init", shape=[1, 1]), value_info("B_init", shape=[1])])
        return helper.make_training_info(algorithm_graph(mse_nodes(), ["loss"], [LABEL]), [],
                                         initialization, [(key, f"{key}_init") for key in keys])

    trainer = onnxtrain.Trainer(make_training_model(linreg_graph(), info(1.0, ["W", "B"]), info(2.0, ["W"])))
    assert trainer.state_names == ("W", "B")
    trainer.initialize()
    assert float(np.asarray(trainer.state["W"]).item()) == 2.0
    assert float(np.asarray(trainer.state["B"]).item()) == 1.0
