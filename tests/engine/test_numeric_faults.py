"""nan_policy: a step producing NaN/Inf raises (or is skipped) and the state keeps its last good values.

Oracle: the same model stepped only on the good batches, compared bit for bit. Single checked
steps run both ways a StepProgram has: double-buffered (small states) and check-then-update
(large states; forced here by lowering the threshold).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
import onnxtrain._engine.strategies
from onnxtrain import NumericError

RNG = np.random.default_rng(0)


def _model():
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        [numpy_helper.from_array(RNG.normal(size=(3, 2)).astype(np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return onnxtrain.make_training_model(model, loss="mse", optimizer=onnxtrain.optim.Momentum(lr=0.1))


def _conv_model():
    """A 1-D convolution: fit runs its chunks as single-step calls, not one scan."""
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "K"], ["y"])], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, 1])],
        [numpy_helper.from_array(RNG.normal(size=(2, 3, 1)).astype(np.float32), "K")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return onnxtrain.make_training_model(model, loss="mse", optimizer=onnxtrain.optim.Momentum(lr=0.1))


def _untraceable_model():
    """MatMul plus zero times the count of non-zero inputs: NonZero's output shape depends on
    the data, so the steps run op by op."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("NonZero", ["x"], ["nonzero"]),
             helper.make_node("Shape", ["nonzero"], ["shape"]),
             helper.make_node("Cast", ["shape"], ["float_shape"], to=TensorProto.FLOAT),
             helper.make_node("ReduceSum", ["float_shape"], ["count"], keepdims=0),
             helper.make_node("Mul", ["count", "zero"], ["nothing"]), helper.make_node("Add", ["m", "nothing"], ["y"])]
    graph = helper.make_graph(
        nodes, "linear_with_nonzero", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        [numpy_helper.from_array(RNG.normal(size=(3, 2)).astype(np.float32), "W"),
         numpy_helper.from_array(np.float32(0), "zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return onnxtrain.make_training_model(model, loss="mse", optimizer=onnxtrain.optim.Momentum(lr=0.01))


def _batch(bad: bool = False, conv: bool = False):
    x = RNG.normal(size=(4, 3)).astype(np.float32)
    if bad:
        x[1, 2] = np.nan
    labels = RNG.normal(size=(4, 2)).astype(np.float32)
    return {"x": x[..., None], "labels": labels[..., None]} if conv else {"x": x, "labels": labels}


def _state(trainer):
    return {name: np.asarray(trainer.state[name]) for name in trainer.state_names}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.fixture(params=["double-buffered", "check-then-update"])
def strategy(request, monkeypatch):
    if request.param == "check-then-update":
        monkeypatch.setattr(onnxtrain._engine.strategies, "LARGE_STATE_BYTES", 0)
    return request.param


MODEL = _model()
GOOD, BAD = _batch(), _batch(bad=True)
# (model, convolves, large state: run_many steps one call at a time)
# (model, convolves, the state-size threshold set to 0 to make steps run checked one by one:
# a large state's, or one too big to select old-or-new on the device).
CHUNKED = {"scanned": (MODEL, False, None), "chained": (_conv_model(), True, None),
           "one by one": (MODEL, False, "LARGE_STATE_BYTES"),
           "one by one, no select": (MODEL, False, "LINKED_STATE_BYTES"),
           "chained, no select": (_conv_model(), True, "LINKED_STATE_BYTES")}
# The convolutional model's chains take seconds to compile: out of the quick run (-m "not slow").
CHUNKS = [pytest.param(name, marks=pytest.mark.slow) if CHUNKED[name][1] else name for name in CHUNKED]


def _chunked(chunks, monkeypatch):
    model, conv, threshold = CHUNKED[chunks]
    if threshold:
        monkeypatch.setattr(onnxtrain._engine.strategies, threshold, 0)
    return model, conv


def test_raise_names_the_values_and_keeps_the_state(strategy):
    trainer = onnxtrain.Trainer(MODEL)
    trainer.step(GOOD)
    before = _state(trainer)
    with pytest.raises(NumericError, match=r"training_info\[0\] step produced NaN or Inf in \[.*'W'.*'loss'"):
        trainer.step(BAD)
    _assert_same(_state(trainer), before)
    trainer.step(GOOD)
    assert np.isfinite(np.asarray(trainer.state["W"])).all()


def test_skip_logs_and_goes_on(caplog, strategy):
    skipping, reference = onnxtrain.Trainer(MODEL, nan_policy="skip"), onnxtrain.Trainer(MODEL)
    with caplog.at_level(logging.WARNING, logger="onnxtrain"):
        for feeds in (GOOD, BAD, GOOD):
            skipping.step(feeds)
    for feeds in (GOOD, GOOD):
        reference.step(feeds)
    _assert_same(_state(skipping), _state(reference))
    assert "skipped, state unchanged" in caplog.text


def test_inf_without_nan_is_caught_too(strategy):
    huge = {"x": np.full((4, 3), 1e20, np.float32), "labels": np.zeros((4, 2), np.float32)}
    unchecked = onnxtrain.Trainer(MODEL, nan_policy="ignore")
    unchecked.step(huge)
    weights = np.asarray(unchecked.state["W"])
    assert np.isinf(weights).any() and not np.isnan(weights).any()
    checked = onnxtrain.Trainer(MODEL)
    before = _state(checked)
    with pytest.raises(NumericError, match=r"'W'"):
        checked.step(huge)
    _assert_same(_state(checked), before)


def test_checked_steps_recycle_buffers_without_mixing_values(strategy):
    """Checked steps write into the buffers the step before replaced (or, after a fault,
    into the discarded result): many steps with faults in between must still equal plain
    in-place steps over the good batches, bit for bit."""
    good = [_batch() for _ in range(5)]
    checked, reference = onnxtrain.Trainer(MODEL, nan_policy="skip"), onnxtrain.Trainer(MODEL, nan_policy="ignore")
    for feeds in (good[0], good[1], BAD, good[2], BAD, BAD, good[3], good[4]):
        checked.step(feeds)
        _state(checked)
    for feeds in good:
        reference.step(feeds)
    _assert_same(_state(checked), _state(reference))
    single = checked._runners[0].plan(checked._store).single
    assert isinstance(single, onnxtrain._engine.strategies.CheckThenUpdate) == (strategy == "check-then-update")


def test_ignore_applies_the_faulty_step():
    trainer = onnxtrain.Trainer(MODEL, nan_policy="ignore")
    trainer.step(BAD)
    assert np.isnan(np.asarray(trainer.state["W"])).any()


@pytest.mark.parametrize("chunks", CHUNKS)
def test_a_faulty_step_inside_a_chunk_stops_at_the_last_good_state(chunks, monkeypatch):
    model, conv = _chunked(chunks, monkeypatch)
    scanned, reference = onnxtrain.Trainer(model), onnxtrain.Trainer(model)
    batches = [_batch(conv=conv), _batch(conv=conv), _batch(bad=True, conv=conv), _batch(conv=conv)]
    with pytest.raises(NumericError, match=r"step 2 of a 4-step call"):
        scanned.fit(batches, progress=False, steps_per_call=4)
    for feeds in batches[:2]:
        reference.step(feeds)
    _assert_same(_state(scanned), _state(reference))


@pytest.mark.parametrize("chunks", CHUNKS)
def test_fit_reads_faults_a_chunk_late_but_applies_nothing_after_one(chunks, monkeypatch):
    """fit dispatches the next chunk before reading the last one's faults; that chunk must
    then change nothing, and the error still names the faulty step."""
    model, conv = _chunked(chunks, monkeypatch)
    scanned, reference = onnxtrain.Trainer(model), onnxtrain.Trainer(model)
    batches = ([_batch(conv=conv) for _ in range(5)] + [_batch(bad=True, conv=conv)]
               + [_batch(conv=conv) for _ in range(6)])
    with pytest.raises(NumericError, match=r"step 1 of a 4-step call"):
        scanned.fit(batches, progress=False, steps_per_call=4)
    for feeds in batches[:5]:
        reference.step(feeds)
    _assert_same(_state(scanned), _state(reference))
    good = _batch(conv=conv)
    scanned.fit([good, good], progress=False, steps_per_call=2)
    reference.fit([good, good], progress=False, steps_per_call=2)
    _assert_same(_state(scanned), _state(reference))


@pytest.mark.parametrize("chunks", CHUNKS)
def test_fit_one_step_per_call_reads_faults_a_step_late_but_applies_nothing_after_one(chunks, monkeypatch):
    """With one step per call (fit's default) the host dispatches the next step before it
    reads a step's NaN/Inf check, except for large states, whose steps run checked one by
    one: which batch fit had taken when it raised shows which way it ran."""
    model, conv = _chunked(chunks, monkeypatch)
    late, reference = onnxtrain.Trainer(model), onnxtrain.Trainer(model)
    batches = [_batch(conv=conv) for _ in range(3)] + [_batch(bad=True, conv=conv)] + [
        _batch(conv=conv) for _ in range(3)]
    taken = []

    def feed():
        for number, feeds in enumerate(batches):
            taken.append(number)
            yield feeds

    with pytest.raises(NumericError, match=r"training_info\[0\] step produced NaN or Inf in \[") as raised:
        late.fit(feed, progress=False)
    assert "-step call" not in str(raised.value)
    assert taken[-1] == (3 if CHUNKED[chunks][2] else 4)
    for feeds in batches[:3]:
        reference.step(feeds)
    _assert_same(_state(late), _state(reference))
    good = _batch(conv=conv)
    late.fit([good, good], progress=False)
    reference.fit([good, good], progress=False)
    _assert_same(_state(late), _state(reference))


def test_fit_one_step_per_call_skips_faulty_steps_a_step_late(caplog):
    skipping, reference = onnxtrain.Trainer(MODEL, nan_policy="skip"), onnxtrain.Trainer(MODEL)
    batches = [_batch(), BAD, _batch(), BAD, _batch()]
    with caplog.at_level(logging.WARNING, logger="onnxtrain"):
        history = skipping.fit(batches, progress=False)
    assert sum("skipped" in record.getMessage() for record in caplog.records) == 2
    assert len(history["step_loss"]) == 5 and np.isnan(history["step_loss"][1]) and np.isnan(history["step_loss"][3])
    for feeds in batches[::2]:
        reference.step(feeds)
    _assert_same(_state(skipping), _state(reference))


@pytest.mark.slow
def test_fit_of_a_graph_that_runs_op_by_op_checks_every_step(caplog):
    model = _untraceable_model()
    eager, reference = onnxtrain.Trainer(model), onnxtrain.Trainer(model)
    batches = [_batch(), _batch(), BAD, _batch()]
    with caplog.at_level(logging.WARNING, logger="onnxtrain"), pytest.raises(
            NumericError, match=r"step produced NaN or Inf in \['W'"):
        eager.fit(batches, progress=False)
    # Said once for the feeds' shapes, not at every step.
    assert caplog.text.count("runs op by op") == 1
    for feeds in batches[:2]:
        reference.step(feeds)
    _assert_same(_state(eager), _state(reference))


def test_a_fault_left_unread_by_an_interrupted_fit_is_reported_by_the_next_step():
    scanned, reference = onnxtrain.Trainer(MODEL), onnxtrain.Trainer(MODEL)
    malformed = {"x": np.zeros((4, 5), np.float32), "labels": np.zeros((4, 2), np.float32)}
    batches = [_batch(), BAD, _batch(), _batch(), malformed]
    with pytest.raises(onnxtrain.InputError):
        scanned.fit(batches, progress=False, steps_per_call=4)
    reference.step(batches[0])
    _assert_same(_state(scanned), _state(reference))
    good = _batch()
    with pytest.raises(NumericError, match=r"step 1 of a 4-step call"):
        scanned.step(good)
    _assert_same(_state(scanned), _state(reference))
    scanned.step(good)
    reference.step(good)
    _assert_same(_state(scanned), _state(reference))


def test_unknown_policy_is_refused():
    with pytest.raises(onnxtrain.InputError, match="nan_policy"):
        onnxtrain.Trainer(MODEL, nan_policy="sometimes")
