"""§4.1's linear regression, trained through the Trainer API.

The first step must reproduce the semantics doc's hand-checked numbers (§4.4); later steps,
where T and the optimizer state start to matter (Adagrad's decay, Momentum's beta), must
follow the float64 numpy oracle. Around the step: what the state and hyperparameter views
show, inference on the trained state, fit's history, and changing a hyperparameter without
recompiling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import onnxtrain
from support.training_models import LINREG_FEEDS, assert_state_equal, linreg_model, linreg_oracle, snapshot

STEPS = 6


def assert_state_matches(trainer: onnxtrain.Trainer, expected: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for name, value in expected.items():
        np.testing.assert_allclose(np.asarray(trainer.state[name]), value, rtol=rtol, atol=atol, err_msg=name)


def test_state_starts_at_the_initializers_and_hyperparameters_are_the_other_scalars():
    trainer = onnxtrain.Trainer(linreg_model())
    assert trainer.state_names == ("W", "B", "H_W", "H_B", "T")
    assert list(trainer.state) == list(trainer.state_names)
    expected = {"W": np.array([[0.5]], np.float32), "B": np.zeros(1, np.float32), "H_W": np.zeros((1, 1), np.float32),
                "H_B": np.zeros(1, np.float32), "T": np.array(0, np.int64)}
    assert_state_equal(trainer, expected)
    assert set(trainer.hyperparameters) == {"LR", "ONE"}
    assert np.asarray(trainer.hyperparameters["LR"]).dtype == np.float32
    assert float(trainer.hyperparameters["LR"]) == np.float32(0.1)


def test_state_and_hyperparameter_views_are_read_only():
    trainer = onnxtrain.Trainer(linreg_model())
    before = snapshot(trainer)
    for view, name in ((trainer.state, "W"), (trainer.hyperparameters, "LR")):
        with pytest.raises(TypeError):
            view[name] = np.zeros_like(view[name])
        with pytest.raises(TypeError):
            del view[name]
    assert_state_equal(trainer, before)


@pytest.mark.parametrize("decay_factor", [0.0, 0.5])
def test_adagrad_first_step_matches_the_doc_then_follows_the_oracle(decay_factor):
    trainer = onnxtrain.Trainer(linreg_model("adagrad", decay_factor=decay_factor))
    out = trainer.step(LINREG_FEEDS)
    assert set(out) == {"loss"}
    np.testing.assert_allclose(np.asarray(out["loss"]), 25.375, rtol=1e-6)
    assert_state_matches(trainer, {"W": [[0.6]], "B": [0.1], "H_W": [[756.25]], "H_B": [90.25]}, rtol=1e-6)
    assert np.asarray(trainer.state["T"]).dtype == np.int64 and int(trainer.state["T"]) == 1

    losses, states = linreg_oracle("adagrad", [LINREG_FEEDS] * STEPS, decay_factor=decay_factor)
    for loss, state in zip(losses[1:], states[1:]):
        np.testing.assert_allclose(np.asarray(trainer.step(LINREG_FEEDS)["loss"]), loss, rtol=1e-5)
        assert_state_matches(trainer, state)
    assert int(trainer.state["T"]) == STEPS


@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_momentum_first_step_matches_the_doc_then_follows_the_oracle(beta):
    trainer = onnxtrain.Trainer(linreg_model("momentum", beta=beta))
    np.testing.assert_allclose(np.asarray(trainer.step(LINREG_FEEDS)["loss"]), 25.375, rtol=1e-6)
    assert_state_matches(trainer, {"W": [[3.25]], "B": [0.95], "V_W": [[-27.5]], "V_B": [-9.5]}, rtol=1e-6)

    losses, states = linreg_oracle("momentum", [LINREG_FEEDS] * STEPS, beta=beta)
    for loss, state in zip(losses[1:], states[1:]):
        np.testing.assert_allclose(np.asarray(trainer.step(LINREG_FEEDS)["loss"]), loss, rtol=1e-5)
        assert_state_matches(trainer, state)


def test_state_arrays_handed_out_stay_valid_after_later_steps():
    """A step must not donate or overwrite buffers a caller still holds."""
    trainer = onnxtrain.Trainer(linreg_model())
    held = [trainer.state["W"]]
    for _ in range(2):
        trainer.step(jax.tree.map(jnp.asarray, LINREG_FEEDS))
        held.append(trainer.state["W"])
    _, states = linreg_oracle("adagrad", [LINREG_FEEDS] * 2)
    np.testing.assert_allclose([np.asarray(w).item() for w in held],
                               [0.5] + [state["W"].item() for state in states], rtol=1e-6)


def test_infer_reads_the_trained_state_and_changes_nothing():
    trainer = onnxtrain.Trainer(linreg_model())
    for _ in range(3):
        trainer.step(LINREG_FEEDS)
    _, states = linreg_oracle("adagrad", [LINREG_FEEDS] * 3)
    before, compiled = snapshot(trainer), trainer.compilations
    X = np.array([[-1.0], [0.5], [10.0]], np.float32)
    prediction = trainer.infer({"X": X})
    assert set(prediction) == {"Y_pred"}
    np.testing.assert_allclose(np.asarray(prediction["Y_pred"]), X @ states[-1]["W"] + states[-1]["B"], rtol=1e-5)
    assert_state_equal(trainer, before)
    assert trainer.compilations == compiled + 1
    trainer.infer({"X": X + 1})
    assert trainer.compilations == compiled + 1


def test_steps_compile_once_per_input_signature():
    trainer = onnxtrain.Trainer(linreg_model())
    trainer.step(LINREG_FEEDS)
    compiled = trainer.compilations
    assert compiled >= 1
    trainer.step(LINREG_FEEDS)
    trainer.step({name: value * 2 for name, value in LINREG_FEEDS.items()})
    assert trainer.compilations == compiled
    half = {name: value[:2] for name, value in LINREG_FEEDS.items()}
    trainer.step(half)
    compiled = trainer.compilations
    trainer.step(half)
    assert trainer.compilations == compiled


def test_fit_runs_every_batch_each_epoch_and_records_the_unbound_outputs():
    """history["step_loss"] has one value per step; history["loss"] the mean of each epoch."""
    batches = [{name: value[:2] for name, value in LINREG_FEEDS.items()},
               {name: value[2:] for name, value in LINREG_FEEDS.items()}]
    trainer = onnxtrain.Trainer(linreg_model())
    history = trainer.fit(batches, epochs=2, progress=False)
    losses, states = linreg_oracle("adagrad", batches * 2)
    assert set(history) == {"step_loss", "loss"}
    assert all(isinstance(loss, float) for loss in history["step_loss"])
    np.testing.assert_allclose(history["step_loss"], losses, rtol=1e-5)
    np.testing.assert_allclose(history["loss"], np.mean(np.reshape(losses, (2, 2)), axis=1), rtol=1e-5)
    assert_state_matches(trainer, states[-1])


def test_setting_the_learning_rate_between_steps_takes_effect_without_recompiling():
    trainer = onnxtrain.Trainer(linreg_model())
    trainer.step(LINREG_FEEDS)
    compiled = trainer.compilations
    rates = [0.1, 0.5, 0.02]
    _, states = linreg_oracle("adagrad", [LINREG_FEEDS] * 3, rates=rates)
    for rate, state in zip(rates[1:], states[1:]):
        trainer.set_state("LR", rate)
        assert np.asarray(trainer.hyperparameters["LR"]).dtype == np.float32
        assert float(trainer.hyperparameters["LR"]) == np.float32(rate)
        trainer.step(LINREG_FEEDS)
        assert_state_matches(trainer, state)
    trainer.set_state("ONE", 2)  # an int64 hyperparameter: T now counts in twos
    trainer.step(LINREG_FEEDS)
    assert int(trainer.state["T"]) == 5
    assert trainer.compilations == compiled


def test_setting_a_state_variable_is_seen_by_infer_and_step():
    trainer = onnxtrain.Trainer(linreg_model())
    trainer.step(LINREG_FEEDS)
    compiled = trainer.compilations
    trainer.set_state("W", np.array([[2.0]], np.float32))
    trainer.set_state("B", [1.0])
    np.testing.assert_allclose(np.asarray(trainer.infer({"X": LINREG_FEEDS["X"]})["Y_pred"]), LINREG_FEEDS["Y"])
    assert float(trainer.step(LINREG_FEEDS)["loss"]) == 0.0
    assert trainer.compilations == compiled + 1  # infer's first compilation only


@pytest.mark.parametrize("name, value", [
    ("W", np.zeros((2, 1), np.float32)),  # wrong shape
    ("LR", np.array([0.1], np.float32)),  # a scalar stays a scalar
    ("T", 1.5),                           # not an int64 value
    ("Y_pred", np.zeros((4, 1), np.float32)),  # neither state nor hyperparameter
])
def test_set_state_rejects_values_that_do_not_fit_and_keeps_the_state(name, value):
    trainer = onnxtrain.Trainer(linreg_model())
    trainer.step(LINREG_FEEDS)
    before, hyperparameters = snapshot(trainer), dict(trainer.hyperparameters)
    with pytest.raises(onnxtrain.OnnxTrainError, match=name):
        trainer.set_state(name, value)
    assert_state_equal(trainer, before)
    assert float(trainer.hyperparameters["LR"]) == float(hyperparameters["LR"])


def test_a_float64_model_trains_and_initializes_in_float64():
    feeds = {name: value.astype(np.float64) for name, value in LINREG_FEEDS.items()}
    trainer = onnxtrain.Trainer(linreg_model("momentum", dtype=np.float64, beta=0.5))
    losses, states = linreg_oracle("momentum", [feeds] * STEPS, dtype=np.float64, beta=0.5)
    for loss, state in zip(losses, states):
        out = trainer.step(feeds)
        assert np.asarray(out["loss"]).dtype == np.float64
        np.testing.assert_allclose(np.asarray(out["loss"]), loss, rtol=1e-12)
        for name in ("W", "B", "V_W", "V_B"):
            assert np.asarray(trainer.state[name]).dtype == np.float64
        assert_state_matches(trainer, state, rtol=1e-12, atol=1e-12)
    trainer.initialize()
    assert np.asarray(trainer.state["W"]).dtype == np.float64


@pytest.mark.slow
def test_a_model_may_be_given_as_proto_bytes_or_path(tmp_path):
    model = linreg_model()
    path = tmp_path / "linreg.onnx"
    path.write_bytes(model.SerializeToString())
    trainers = [onnxtrain.Trainer(source) for source in (model, model.SerializeToString(), path, str(path))]
    for trainer in trainers:
        assert trainer.state_names == ("W", "B", "H_W", "H_B", "T")
        np.testing.assert_allclose(np.asarray(trainer.step(LINREG_FEEDS)["loss"]), 25.375, rtol=1e-6)
