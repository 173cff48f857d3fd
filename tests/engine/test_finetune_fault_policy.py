"""finetune(..., nan_policy=...) has the Trainer's semantics: "raise" raises NumericError naming
the faulty values and keeps the last good state, "skip" does not commit the step, "ignore"
commits it.

Oracle: a Trainer running make_training_model's SGD recipe on the same model and batches
(plain SGD is the same update in both, so losses and states agree exactly), and for "skip"
the same run without the faulty step.
"""

from __future__ import annotations

import logging

import numpy as np
import optax
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import NumericError

RNG = np.random.default_rng(0)
W = RNG.normal(size=(3, 2)).astype(np.float32)
GOOD = {"x": RNG.normal(size=(4, 3)).astype(np.float32), "labels": RNG.normal(size=(4, 2)).astype(np.float32)}
NAN_BATCH = {"x": np.where(np.arange(12).reshape(4, 3) == 0, np.nan, GOOD["x"]).astype(np.float32),
             "labels": GOOD["labels"]}
# A learning rate so large that the first update leaves the weights finite but the second
# step's loss overflows float32 to Inf.
HUGE_LR = 1e37


def _model():
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])], [numpy_helper.from_array(W, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _pair(policy: str, lr: float) -> list:
    """A FineTuner and a Trainer that train the same model with SGD at `lr`."""
    tuner = onnxtrain.finetune(_model(), "mse", optax.sgd(lr), nan_policy=policy)
    trainer = onnxtrain.Trainer(onnxtrain.make_training_model(_model(), "mse", optimizer=onnxtrain.optim.SGD(lr=lr)),
                                nan_policy=policy)
    return [tuner, trainer]


def _run(runner, batches) -> tuple[list, np.ndarray]:
    """Losses per step (the error's message for a raising step) and the final weights."""
    results = []
    for feeds in batches:
        try:
            results.append(float(runner.step(feeds)["loss"]))
        except NumericError as error:
            results.append(str(error))
    return results, np.asarray(runner.state["W"])


CASES = {"nan-batch": (0.1, [GOOD, NAN_BATCH, GOOD]), "huge-lr": (HUGE_LR, [GOOD, GOOD, GOOD])}


@pytest.mark.parametrize("case", ["nan-batch", pytest.param("huge-lr", marks=pytest.mark.slow)])
def test_raise_names_the_step_and_values_and_keeps_the_last_good_state(case):
    lr, batches = CASES[case]
    (tuned, tuned_w), (trained, trained_w) = (_run(r, batches) for r in _pair("raise", lr))
    faulty = 1
    for results in (tuned, trained):
        assert isinstance(results[faulty], str) and "NaN or Inf in ['W'" in results[faulty]
        assert "last good values" in results[faulty]
    assert "fine-tuning step" in tuned[faulty]
    np.testing.assert_array_equal(tuned_w, trained_w)
    assert np.all(np.isfinite(tuned_w))
    assert [r for r in tuned if not isinstance(r, str)] == [r for r in trained if not isinstance(r, str)]


def test_skip_does_not_commit_the_faulty_step(caplog):
    lr, batches = CASES["nan-batch"]
    with caplog.at_level(logging.WARNING, logger="onnxtrain"):
        runs = [_run(r, batches) for r in _pair("skip", lr)]
    (tuned, tuned_w), (trained, trained_w) = runs
    assert np.isnan(tuned[1]) and np.isnan(trained[1])
    np.testing.assert_array_equal(tuned_w, trained_w)
    clean, clean_w = _run(_pair("skip", lr)[0], [GOOD, GOOD])
    assert [tuned[0], tuned[2]] == clean and np.array_equal(tuned_w, clean_w)
    assert sum("skipped, state unchanged" in r.getMessage() for r in caplog.records) == 2


def test_ignore_commits_the_faulty_step():
    lr, batches = CASES["nan-batch"]
    (tuned, tuned_w), (trained, trained_w) = (_run(r, batches) for r in _pair("ignore", lr))
    assert np.isfinite(tuned[0]) and np.isnan(tuned[1]) and np.isnan(tuned[2])
    assert np.isnan(trained[2]) and np.all(np.isnan(tuned_w)) and np.all(np.isnan(trained_w))


@pytest.mark.slow
def test_fit_stops_at_the_faulty_step_as_the_trainer_does():
    lr, batches = CASES["nan-batch"]
    states = []
    for runner in _pair("raise", lr):
        with pytest.raises(NumericError, match="last good values"):
            runner.fit([*batches, GOOD], progress=False)
        states.append(np.asarray(runner.state["W"]))
    np.testing.assert_array_equal(*states)
    _, after_first = _run(_pair("raise", lr)[0], [GOOD])
    np.testing.assert_array_equal(states[0], after_first)
