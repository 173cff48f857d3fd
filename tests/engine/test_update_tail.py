"""The update tail (onnxtrain._engine.update_tail), the checked step that recomputes it in place, and
which unchecked steps update the state in place rather than double-buffer it.

Oracles: the structure of the graphs (which node is the optimizer, which values are the
Gradient node's outputs); the double-buffered checked step, which computes every new value
once; JAX's record of donated (deleted) buffers.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
import onnxtrain._engine.strategies as strategies
from onnxtrain.translate.model import TranslatedModel
from onnxtrain._engine.update_tail import update_tail

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
    step = onnxtrain.Trainer(model)._runners[0].step
    plan = step.translated.plan
    assert sorted(plan.nodes[i].proto.op_type for i in step.tail.nodes) == sorted([optimizer, "Add"])
    gradient = next(spec for spec in plan.nodes if spec.proto.op_type == "Gradient")
    assert sorted(step.tail_inputs) == sorted(gradient.proto.output)


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


def _large(trainer):
    """`trainer`, its steps planned as for a large state (see LARGE_STATE_BYTES) whatever its
    size; other trainers keep the real threshold."""
    trainer._runners[0].plan_as(strategies.LARGE_STATE_BYTES)
    return trainer


def _plan(trainer):
    return trainer._runners[0].plan(trainer._store)


def _trainers(model, feeds):
    """A Trainer whose checked steps double-buffer and one that checks, then updates in place,
    each after a step on `feeds`."""
    double_buffered, lean = onnxtrain.Trainer(model, seed=5), _large(onnxtrain.Trainer(model, seed=5))
    first = float(double_buffered.step(feeds)["loss"])
    np.testing.assert_allclose(float(lean.step(feeds)["loss"]), first, rtol=1e-6)
    assert isinstance(_plan(lean).single, strategies.CheckThenUpdate)
    assert isinstance(_plan(double_buffered).single, strategies.DoubleBuffered)
    assert _plan(lean).single.compilations() == 2
    return double_buffered, lean


@pytest.mark.slow
def test_check_then_update_follows_the_double_buffered_step_with_random_ops():
    """Same losses (dropout masks included) and state; the recomputed tail may round in a
    different fusion, hence the tolerance of a few float32 ulps."""
    model = onnxtrain.make_training_model(_inference_model(dropout=True), loss="mse",
                                          optimizer=onnxtrain.optim.Adam(lr=0.05))
    batches = _feeds(6)
    double_buffered, lean = _trainers(model, batches[0])
    assert lean._runners[0].step.random
    for feeds in batches[1:]:
        np.testing.assert_allclose(float(lean.step(feeds)["loss"]), float(double_buffered.step(feeds)["loss"]),
                                   rtol=1e-6)
    for name in lean.state_names:
        np.testing.assert_allclose(np.asarray(lean.state[name]), np.asarray(double_buffered.state[name]),
                                   rtol=1e-6, atol=1e-7, err_msg=name)
    assert isinstance(_plan(double_buffered).single, strategies.DoubleBuffered)


@pytest.mark.slow
def test_check_then_update_writes_in_place_and_compiles_once():
    model = onnxtrain.make_training_model(_inference_model(), loss="mse", optimizer=onnxtrain.optim.Adam(lr=0.05))
    feeds = _feeds(4)
    _, trainer = _trainers(model, feeds[0])
    single = _plan(trainer).single
    for batch in feeds[1:]:
        before = dict(trainer._store.values)
        gradients = dict(single._scratch)
        trainer.step(batch)
        assert all(before[name].is_deleted() for name in trainer._runners[0].step.bound)
        assert all(value.is_deleted() for value in gradients.values())
    assert (single._check.compilations(), single._update.compilations()) == (1, 1)


@pytest.mark.slow
@pytest.mark.parametrize("nan_policy", ["raise", "ignore"])
def test_fit_on_a_large_state_steps_one_call_at_a_time(nan_policy):
    """No scan (it would hold the state twice); the same history as single steps."""
    model = onnxtrain.make_training_model(_inference_model(), loss="mse", optimizer=onnxtrain.optim.Adam(lr=0.05))
    batches = _feeds(6)
    single = onnxtrain.Trainer(model, nan_policy=nan_policy)
    losses = [float(single.step(feeds)["loss"]) for feeds in batches]
    chunked = _large(onnxtrain.Trainer(model, nan_policy=nan_policy))
    history = chunked.fit(batches, progress=False, steps_per_call=4)
    np.testing.assert_allclose(history["step_loss"], losses, rtol=1e-6)
    assert _plan(chunked).multi is None


@pytest.mark.slow
def test_unchecked_steps_double_buffer_or_update_in_place_with_the_same_history():
    """Under "ignore" a double-buffered step only reads the state and writes the new values
    into the buffers the step before replaced; an in-place one (this small state's) updates
    the donated state."""
    model = onnxtrain.make_training_model(_inference_model(), loss="mse", optimizer=onnxtrain.optim.Adam(lr=0.05))
    double_buffered = onnxtrain.Trainer(model, nan_policy="ignore")
    double_buffered._runners[0].plan_as(strategies.SMALL_STATE_BYTES)
    in_place = onnxtrain.Trainer(model, nan_policy="ignore")
    bound = double_buffered._runners[0].step.bound
    replaced = {}
    for feeds in _feeds(5):
        before, before_in_place = dict(double_buffered._store.values), dict(in_place._store.values)
        np.testing.assert_allclose(float(double_buffered.step(feeds)["loss"]), float(in_place.step(feeds)["loss"]),
                                   rtol=1e-6)
        assert not any(before[name].is_deleted() for name in bound)
        assert all(value.is_deleted() for value in replaced.values())
        assert all(before_in_place[name].is_deleted() for name in bound)
        replaced = {name: before[name] for name in bound}
    for name in double_buffered.state_names:
        np.testing.assert_allclose(np.asarray(in_place.state[name]), np.asarray(double_buffered.state[name]),
                                   rtol=1e-6, atol=1e-7, err_msg=name)
    assert isinstance(_plan(double_buffered).single, strategies.DoubleBuffered)
    assert isinstance(_plan(in_place).single, strategies.InPlace)
    assert _plan(double_buffered).single.compilations() == _plan(in_place).single.compilations() == 1


@pytest.mark.parametrize("nan_policy", ["ignore", "raise"])
def test_unchecked_steps_update_small_and_large_states_in_place(nan_policy):
    """Below SMALL_STATE_BYTES and from LARGE_STATE_BYTES of bound state on, an unchecked step
    updates in place, double-buffers between; a checked one never updates in place."""
    model = onnxtrain.make_training_model(_inference_model(), loss="mse", optimizer=onnxtrain.optim.Adam(lr=0.05))
    runner = onnxtrain.Trainer(model, nan_policy=nan_policy)._runners[0]
    for size, in_place in ((strategies.SMALL_STATE_BYTES - 1, True), (strategies.SMALL_STATE_BYTES, False),
                           (strategies.LARGE_STATE_BYTES - 1, False), (strategies.LARGE_STATE_BYTES, True)):
        single = runner.plan_as(size).single
        assert isinstance(single, strategies.InPlace) == (in_place and nan_policy == "ignore"), size


def test_a_checked_step_on_a_large_state_has_no_single_program_to_lower():
    """lowered() refuses it rather than lower a program the step does not run; an unchecked
    step on a large state lowers its in-place program."""
    model = onnxtrain.make_training_model(_inference_model(), loss="mse", optimizer=onnxtrain.optim.Adam(lr=0.05))
    feeds = _feeds(1)[0]
    checked, unchecked = (_large(onnxtrain.Trainer(model, nan_policy=policy)) for policy in ("raise", "ignore"))
    with pytest.raises(onnxtrain.InputError, match=r"training_info\[0\]: a checked step on a state this large runs as "
                                                    r"two programs"):
        checked.lowered(feeds)
    hlo = unchecked.lowered(feeds).as_text()
    assert isinstance(_plan(unchecked).single, strategies.InPlace) and "jit__call" in hlo


@pytest.mark.slow
def test_check_then_update_translates_the_graph_once_per_feed_signature():
    """The scratch's shapes and the program come from one trace of the step (a trace of an
    exported CNN takes seconds), also for a second batch size; nothing of it is kept after."""
    model = onnxtrain.make_training_model(_inference_model(), loss="mse", optimizer=onnxtrain.optim.Adam(lr=0.05))
    trainer = _large(onnxtrain.Trainer(model, seed=5))
    translated = trainer._runners[0].step.translated
    traces = []
    apply_keeping = translated.apply_keeping
    translated.apply_keeping = lambda *args, **kwargs: (traces.append(args[1]["x"].shape), apply_keeping(*args, **kwargs))[1]
    small = {name: value[:3] for name, value in _feeds(1)[0].items()}
    for feeds in [*_feeds(2), small, small]:
        trainer.step(feeds)
    single = _plan(trainer).single
    assert isinstance(single, strategies.CheckThenUpdate)
    assert traces == [(6, 4), (3, 4)]
    assert single._check.compilations() == 2
    assert single._traced._cache_size() == 0
