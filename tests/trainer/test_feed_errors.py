"""Feeds are checked before anything compiles or changes.

A wrong feed must raise InputError naming the input, never a JAX tracing error and never
a silent cast (a float64 array for a float32 input is an error), and must leave the state
and the compilation count exactly as they were.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

import onnxtrain
from support.foreign_arrays import ArrayLike, DLPackOnly, FakeTensor
from support.training_models import (LINREG_FEEDS, assert_state_equal, linreg_graph, linreg_model,
                                     make_training_model, snapshot)

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


# ---------------------------------------------------------------------------
# Every kind of feed, through every entry point: one conversion, one set of dtype rules.


def _deleted(array):
    value = jnp.asarray(array)
    value.delete()
    return value


# A bad value for X, built at call time (a deleted array cannot be built ahead).
BAD_X = {
    "strings": lambda: [["a"]] * 4,
    "overflows_float32": lambda: [[10**39]] * 4,
    "int_beyond_any_float": lambda: [[10**400]] * 4,
    "none_in_list": lambda: [[1.0], [None], [2.0], [3.0]],
    "ragged_list": lambda: [[1.0], [2.0, 3.0], [4.0], [5.0]],
    "deleted_jax_array": lambda: _deleted(X),
    "float64_tensor": lambda: FakeTensor(X.astype(np.float64), requires_grad=True),
    "float64_array_like": lambda: ArrayLike(X.astype(np.float64)),
    "plain_object": lambda: object(),
}


@pytest.mark.parametrize("case", BAD_X)
# All entry points share one conversion: the quick run checks it through step().
@pytest.mark.parametrize("entry", ["step", *(pytest.param(entry, marks=pytest.mark.slow)
                                             for entry in ("evaluate", "infer", "fit"))])
def test_every_entry_point_rejects_a_bad_value_naming_the_input(trained, entry, case):
    feeds = {"X": BAD_X[case]()} if entry == "infer" else {"X": BAD_X[case](), "Y": Y}
    call = {"step": trained.step, "evaluate": trained.evaluate, "infer": trained.infer,
            "fit": lambda feeds: trained.fit([feeds], progress=False)}[entry]
    assert_rejected(trained, call, feeds, "X")


@pytest.mark.parametrize("case", BAD_X)
def test_run_rejects_a_bad_value_naming_the_input(case):
    with pytest.raises(onnxtrain.InputError, match=r"\bX\b"):
        onnxtrain.run(make_training_model(linreg_graph()), {"X": BAD_X[case]()})


# Ways to feed LINREG_FEEDS other than float32 numpy arrays, each the same numbers.
GOOD = {
    "lists": lambda a: a.tolist(),
    "jax": lambda a: jnp.asarray(a),
    "tensor": lambda a: FakeTensor(a),
    "tensor_requiring_grad": lambda a: FakeTensor(a, requires_grad=True),
    "tensor_not_contiguous": lambda a: FakeTensor(np.ascontiguousarray(a.T).T),
    "dlpack_only": lambda a: DLPackOnly(a.copy()),
    "array_like": lambda a: ArrayLike(a),
}


@pytest.mark.parametrize("kind", [pytest.param(kind, marks=[] if kind == "tensor" else [pytest.mark.slow])
                                  for kind in GOOD])   # two trainers each, fitting too
def test_every_kind_of_feed_trains_exactly_as_numpy_arrays_do(kind):
    """Twice in a row (a tensor used to pass the check once, then crash), then through fit."""
    make = GOOD[kind]
    reference, trainer = onnxtrain.Trainer(linreg_model()), onnxtrain.Trainer(linreg_model())
    for _ in range(2):
        expected = reference.step(LINREG_FEEDS)
        got = trainer.step({name: make(value) for name, value in LINREG_FEEDS.items()})
        assert np.array_equal(np.asarray(got["loss"]), np.asarray(expected["loss"]))
        assert_state_equal(trainer, snapshot(reference))
    for steps_per_call in (1, 2):
        reference.fit([LINREG_FEEDS] * 2, progress=False, steps_per_call=steps_per_call)
        trainer.fit([{name: make(value) for name, value in LINREG_FEEDS.items()}] * 2, progress=False,
                    steps_per_call=steps_per_call)
        assert_state_equal(trainer, snapshot(reference))
    assert np.array_equal(np.asarray(trainer.infer({"X": make(X)})["Y_pred"]),
                          np.asarray(reference.infer({"X": X})["Y_pred"]))
    assert np.array_equal(np.asarray(trainer.evaluate({"X": make(X), "Y": make(Y)})["loss"]),
                          np.asarray(reference.evaluate(LINREG_FEEDS)["loss"]))


def test_run_converts_python_values_as_a_trainer_does():
    model = make_training_model(linreg_graph())
    expected = onnxtrain.run(model, {"X": X})["Y_pred"]
    for value in (X.tolist(), FakeTensor(X, requires_grad=True), jnp.asarray(X)):
        assert np.array_equal(np.asarray(onnxtrain.run(model, {"X": value})["Y_pred"]), np.asarray(expected))


@pytest.mark.slow  # two fine-tuners
def test_fine_tuning_converts_and_rejects_feeds_the_same_way():
    import optax

    model = make_training_model(linreg_graph())
    reference = onnxtrain.finetune(model, "mse", optax.sgd(0.1), label="Y")
    tuner = onnxtrain.finetune(model, "mse", optax.sgd(0.1), label="Y")
    for _ in range(2):
        expected = reference.step(LINREG_FEEDS)["loss"]
        got = tuner.step({"X": FakeTensor(X, requires_grad=True), "Y": Y.tolist()})["loss"]
        assert np.array_equal(np.asarray(got), np.asarray(expected))
    for case in ("strings", "overflows_float32", "deleted_jax_array", "float64_tensor"):
        before = snapshot(tuner)
        with pytest.raises(onnxtrain.InputError, match=r"\bX\b"):
            tuner.step({"X": BAD_X[case](), "Y": Y})
        with pytest.raises(onnxtrain.InputError, match=r"\bY\b"):
            tuner.step({"X": X, "Y": BAD_X[case]()})
        assert_state_equal(tuner, before)


@pytest.mark.slow  # two trainers
@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_fit_copies_tensors_a_loader_refills(steps_per_call):
    """A loader that refills one tensor for every batch: each step must see its own batch."""
    batches = [{"X": X + i, "Y": Y - i} for i in range(4)]
    reference = onnxtrain.Trainer(linreg_model())
    reference.fit(batches, progress=False, steps_per_call=steps_per_call)

    def refilled():
        x, y = np.empty_like(X), np.empty_like(Y)
        for batch in batches:
            x[...], y[...] = batch["X"], batch["Y"]
            yield {"X": FakeTensor(x), "Y": FakeTensor(y)}

    trainer = onnxtrain.Trainer(linreg_model())
    trainer.fit(refilled, progress=False, steps_per_call=steps_per_call)
    assert_state_equal(trainer, snapshot(reference))


def test_real_torch_tensors_train_exactly_as_numpy_arrays_do():
    """The issue's case with torch itself, where installed: tensors passed the check on the
    first call and crashed the second."""
    torch = pytest.importorskip("torch")
    reference, trainer = onnxtrain.Trainer(linreg_model()), onnxtrain.Trainer(linreg_model())
    x = torch.tensor(X.T.copy(), requires_grad=True).T          # requires grad, not contiguous
    for _ in range(3):
        expected = reference.step(LINREG_FEEDS)["loss"]
        got = trainer.step({"X": x, "Y": torch.from_numpy(Y)})["loss"]
        assert np.array_equal(np.asarray(got), np.asarray(expected))
    assert_state_equal(trainer, snapshot(reference))
    with pytest.raises(onnxtrain.InputError, match=r"input 'X' must be float32"):
        trainer.step({"X": x.double(), "Y": torch.from_numpy(Y)})
