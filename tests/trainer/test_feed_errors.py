"""Feeds are checked before anything compiles or changes.

A wrong feed must raise InputError naming the input, never a JAX tracing error and never
a silent cast (a float64 array for a float32 input is an error), and must leave the state
and the compilation count exactly as they were.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import onnxtrain
from support.training_models import LINREG_FEEDS, assert_state_equal, linreg_model, snapshot

X, Y = LINREG_FEEDS["X"], LINREG_FEEDS["Y"]

STEP_CASES = {
    "missing": ({"X": X}, "Y"),
    "unknown": ({"X": X, "Y": Y, "Z": X}, "Z"),
    "state_variable": ({"X": X, "Y": Y, "W": np.ones((1, 1), np.float32)}, "W"),
    "float64_for_float32": ({"X": X.astype(np.float64), "Y": Y}, "X"),
    "int_for_float": ({"X": X, "Y": Y.astype(np.int64)}, "Y"),
    "rank": ({"X": X[:, 0], "Y": Y}, "X"),
    "fixed_dim": ({"X": np.hstack([X, X]), "Y": Y}, "X"),
    "symbolic_dim_differs": ({"X": X, "Y": Y[:3]}, "Y"),  # N is 4 in X, 3 in Y
}
INFER_CASES = {
    "missing": ({}, "X"),
    "algorithm_input": ({"X": X, "Y": Y}, "Y"),
    "float64_for_float32": ({"X": X.astype(np.float64)}, "X"),
    "rank": ({"X": X[None]}, "X"),
    "fixed_dim": ({"X": np.hstack([X, X])}, "X"),
}


@pytest.fixture
def trained():
    """A trainer one step in, so its state differs from the initializers."""
    trainer = onnxtrain.Trainer(linreg_model())
    trainer.step(LINREG_FEEDS)
    trainer.infer({"X": X})
    return trainer


def assert_rejected(trainer, call, feeds, name):
    before, compiled = snapshot(trainer), trainer.compilations
    with pytest.raises(onnxtrain.InputError) as error:
        call(feeds)
    assert re.search(rf"\b{name}\b", str(error.value)), str(error.value)
    assert isinstance(error.value, onnxtrain.OnnxTrainError)
    assert_state_equal(trainer, before)
    assert trainer.compilations == compiled


@pytest.mark.parametrize("case", STEP_CASES)
def test_step_rejects_a_bad_feed_and_changes_nothing(trained, case):
    feeds, name = STEP_CASES[case]
    assert_rejected(trained, trained.step, feeds, name)


@pytest.mark.parametrize("case", INFER_CASES)
def test_infer_rejects_a_bad_feed_and_changes_nothing(trained, case):
    feeds, name = INFER_CASES[case]
    assert_rejected(trained, trained.infer, feeds, name)


def test_the_trainer_works_after_rejected_feeds(trained):
    for feeds, _ in STEP_CASES.values():
        with pytest.raises(onnxtrain.InputError):
            trained.step(feeds)
    trained.step(LINREG_FEEDS)
    assert int(trained.state["T"]) == 2
