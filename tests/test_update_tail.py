"""The update tail (onnxtrain.update_tail) and the checked step that recomputes it in place.

Oracles: the structure of the graphs (which node is the optimizer, which values are the
Gradient node's outputs); the double-buffered checked step, which computes every new value
once; JAX's record of donated (deleted) buffers.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
import onnxtrain.programs
from onnxtrain.translate.model import TranslatedModel
from onnxtrain.update_tail import update_tail

RNG = np.random.default_rng(7)


def _inference_model(dropout: bool = False):
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["a1"]),
             helper.make_node("Relu", ["a1"], ["h1"])]
    if dropout:
        nodes.append(helper.make_node("Dropout", ["h1"], ["d1"], seed=3))
    nodes.append(helper.make_node("MatMul", ["d1" if dropout else "h1", "W2"], ["y"]))
    weights = [numpy_helper.from_array(RNG.normal(size=shape).astype(np.float32) * 0.5, name)
               for name, shape in (("W1", (4, 8)), ("b1", (8,)), ("W2", (8, 2)))]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _feeds(count: int):
    return [{"x": RNG.normal(size=(6, 4)).astype(np.float32), "labels": RNG.normal(size=(6, 2)).astype(np.float32)}
            for _ in range(count)]


OPTIMIZERS = {"Adam": onnxtrain.optim.Adam(lr=0.05), "Momentum": onnxtrain.optim.Momentum(lr=0.05),
              "Adagrad": onnxtrain.optim.Adagrad(lr=0.05)}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_built_models_tail_is_its_optimizer_and_step_counter_fed_by_the_gradients(optimizer):
    model = onnxtrain.make_training_model(_inference_model(), loss="mse", optimizer=OPTIMIZERS[optimizer])
    program = onnxtrain.Trainer(model)._steps[0]
    plan = program.translated.plan
    assert sorted(plan.nodes[i].proto.op_type for i in program.tail.nodes) == sorted([optimizer, "Add"])
    gradient = next(spec for spec in plan.nodes if spec.proto.op_type == "Gradient")
    assert sorted(program._tail_inputs) == sorted(gradient.proto.output)


def test_values_something_else_uses_stay_out_of_the_tail():
    """W.new = W - lr * g is the tail unless lr * g is also returned (then only the Sub is),
    and a reduction is never in it."""
    nodes = [helper.make_node("Mul", ["g", "lr"], ["delta"]), helper.make_node("Sub", ["W", "delta"], ["W.new"]),
             helper.make_node("ReduceSum", ["g"], ["g.sum"]), helper.make_node("Add", ["n", "g.sum"], ["n.new"])]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
              for name, shape in (("W", [3]), ("g", [3]), ("lr", []), ("n", [1]))]

    def tail(outputs, bound):
        graph = helper.make_graph(nodes, "update", inputs,
                                  [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
        return update_tail(TranslatedModel(model).plan, bound)

    alone = tail(["W.new", "n.new"], {"W.new", "n.new"})
    assert alone.nodes == (0, 1, 3)
    assert alone.reads == ("W", "g", "g.sum", "lr", "n")
    shared = tail(["W.new", "delta", "n.new"], {"W.new", "n.new"})
    assert shared.nodes == (1, 3)
    assert shared.reads == ("W", "delta", "g.sum", "n")


def _trainers(monkeypatch, model, feeds):
    """A Trainer whose checked steps double-buffer and one that checks, then updates in place
    (a program picks its way at its first step), each after a step on `feeds`."""
    double_buffered = onnxtrain.Trainer(model, seed=5)
    first = float(double_buffered.step(feeds)["loss"])
    monkeypatch.setattr(onnxtrain.programs, "LARGE_STATE_BYTES", 0)
    lean = onnxtrain.Trainer(model, seed=5)
    np.testing.assert_allclose(float(lean.step(feeds)["loss"]), first, rtol=1e-6)
    assert lean._steps[0]._check_pass._cache_size() == 1
    assert double_buffered._steps[0]._check_pass._cache_size() == 0
    return double_buffered, lean


def test_check_then_update_follows_the_double_buffered_step_with_random_ops(monkeypatch):
    """Same losses (dropout masks included) and state; the recomputed tail may round in a
    different fusion, hence the tolerance of a few float32 ulps."""
    model = onnxtrain.make_training_model(_inference_model(dropout=True), loss="mse",
                                          optimizer=onnxtrain.optim.Adam(lr=0.05))
    batches = _feeds(6)
    double_buffered, lean = _trainers(monkeypatch, model, batches[0])
    assert lean._steps[0].random
    for feeds in batches[1:]:
        np.testing.assert_allclose(float(lean.step(feeds)["loss"]), float(double_buffered.step(feeds)["loss"]),
                                   rtol=1e-6)
    for name in lean.state_names:
        np.testing.assert_allclose(np.asarray(lean.state[name]), np.asarray(double_buffered.state[name]),
                                   rtol=1e-6, atol=1e-7, err_msg=name)


def test_check_then_update_writes_in_place_and_compiles_once(monkeypatch):
    model = onnxtrain.make_training_model(_inference_model(), loss="mse", optimizer=onnxtrain.optim.Adam(lr=0.05))
    feeds = _feeds(4)
    _, trainer = _trainers(monkeypatch, model, feeds[0])
    program = trainer._steps[0]
    for batch in feeds[1:]:
        before = dict(trainer._store.values)
        gradients = dict(program._spare_tail_inputs)
        trainer.step(batch)
        assert all(before[name].is_deleted() for name, _ in program.bindings)
        assert all(value.is_deleted() for value in gradients.values())
    assert program._check_pass._cache_size() == 1 and program._update_pass._cache_size() == 1
    assert program._jitted._cache_size() == 0


@pytest.mark.parametrize("nan_policy", ["raise", "ignore"])
def test_fit_on_a_large_state_steps_one_call_at_a_time(monkeypatch, nan_policy):
    """No scan (it would hold the state twice); the same history as single steps."""
    model = onnxtrain.make_training_model(_inference_model(), loss="mse", optimizer=onnxtrain.optim.Adam(lr=0.05))
    batches = _feeds(6)
    single = onnxtrain.Trainer(model, nan_policy=nan_policy)
    losses = [float(single.step(feeds)["loss"]) for feeds in batches]
    monkeypatch.setattr(onnxtrain.programs, "LARGE_STATE_BYTES", 0)
    chunked = onnxtrain.Trainer(model, nan_policy=nan_policy)
    history = chunked.fit(batches, progress=False, steps_per_call=4)
    np.testing.assert_allclose(history["loss"], losses, rtol=1e-6)
    assert chunked._steps[0]._scanned._cache_size() == 0
