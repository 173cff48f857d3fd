"""Fine-tuning models PyTorch exported, checked against PyTorch's own training numbers.

make_training_model turns each exported fixture (MLP, CNN with BatchNorm,
transformer encoder) into a standard training model; its first step's
gradients and a 20-step SGD trajectory must match what torch autograd computed
on the same weights and batches (tests/fixtures/torch, written by
scripts/make_torch_fixtures.py). Train mode: BatchNorm on batch statistics;
freeze_batchnorm: on running statistics (torch's eval mode).
"""

from __future__ import annotations

import functools

import numpy as np
import onnxruntime
import optax
import pytest

import onnxtrain
import onnxtrain._engine.strategies as strategies
from onnxtrain import optim
from onnxtrain.proto import ValueInfoProto
from support import paths

FIXTURES = paths.FIXTURES / "torch"
MODELS = ["mlp", "cnn", "transformer"]
# The CNN and the transformer take seconds to compile and train; the MLP stays in the quick run.
SLOW_MODELS = {"cnn", "transformer"}


def _param(name: str, *values, label: str) -> object:
    return pytest.param(name, *values, id=label, marks=[pytest.mark.slow] if name in SLOW_MODELS else [])


@functools.cache
def fixture(name: str) -> tuple[bytes, dict[str, np.ndarray]]:
    with np.load(FIXTURES / f"{name}_oracle.npz") as oracle:
        return (FIXTURES / f"{name}.onnx").read_bytes(), dict(oracle)


def _trainer(name: str, frozen: bool) -> onnxtrain.Trainer:
    """An SGD training model whose steps also return every weight's gradient."""
    model, oracle = fixture(name)
    training = onnxtrain.make_training_model(model, loss="cross_entropy", freeze_batchnorm=frozen,
                                             optimizer=optim.SGD(lr=float(oracle["sgd_lr"])))
    algorithm = training.training_info[0].algorithm
    (gradient,) = [n for n in algorithm.node if n.op_type == "Gradient"]
    algorithm.output.extend(ValueInfoProto(name=name) for name in gradient.output)
    return onnxtrain.Trainer(training)


def _close(actual, expected, rtol):
    """Relative to the tensor's largest magnitude, as gradient comparisons need. The 1e-6 floor
    covers gradients that are zero in exact arithmetic (a conv bias right before a train-mode
    BatchNorm), where both sides hold only float32 rounding noise of ~5e-7."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.max(np.abs(actual - expected)) <= rtol * np.max(np.abs(expected)) + 1e-6


@pytest.mark.parametrize("name, frozen", [*[_param(name, False, label=name) for name in MODELS],
                                         _param("cnn", True, label="cnn-frozen-batchnorm")])
def test_first_gradients_and_sgd_trajectory_match_pytorch(name, frozen):
    _, oracle = fixture(name)
    prefix, losses_key = ("evalgrad__", "sgd_losses_eval") if frozen else ("grad__", "sgd_losses")
    trainer = _trainer(name, frozen)
    losses = []
    for step in range(20):
        out = trainer.step({"x": oracle["batches_x"][step], "labels": oracle["batches_y"][step]})
        losses.append(float(out["loss"]))
        if step == 0:
            grads = {key[len(prefix):] for key in oracle if key.startswith(prefix)}
            assert {k[:-len(".grad")] for k in out if k.endswith(".grad")} == grads
            for weight in grads:
                _close(out[f"{weight}.grad"], oracle[prefix + weight], 1e-5)
    np.testing.assert_allclose(losses, oracle[losses_key], rtol=1e-4)
    if not frozen:
        for key in (k for k in oracle if k.startswith("final__")):
            _close(trainer.state[key[len("final__"):]], oracle[key], 1e-4)


@pytest.mark.parametrize("name", [_param(name, label=name) for name in MODELS])
def test_fine_tuned_exports_serve_in_onnxruntime(name, tmp_path):
    _, oracle = fixture(name)
    trainer = _trainer(name, frozen=False)
    for step in range(3):
        trainer.step({"x": oracle["batches_x"][step], "labels": oracle["batches_y"][step]})
    trainer.export(tmp_path / "tuned.onnx", training=False)
    x = oracle["batches_x"][5]
    session = onnxruntime.InferenceSession(str(tmp_path / "tuned.onnx"), providers=["CPUExecutionProvider"])
    (served,) = session.run(["logits"], {"x": x})
    np.testing.assert_allclose(served, trainer.infer({"x": x})["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_optax_adamw_with_cosine_schedule_fine_tunes_the_cnn_without_recompiling():
    model, _ = fixture("cnn")
    with np.load(paths.FIXTURES / "digits.npz") as digits:
        images, labels = digits["images"], digits["labels"]
    schedule = optax.cosine_decay_schedule(3e-3, decay_steps=60)
    tuner = onnxtrain.finetune(model, "cross_entropy", optax.adamw(schedule, weight_decay=1e-2))
    batches = [{"x": images[i:i + 64], "labels": labels[i:i + 64]} for i in range(0, 64 * 20, 64)]
    before = float(tuner.evaluate(batches[0])["loss"])
    tuner.step(batches[0])
    tuner.fit(batches[:1], progress=False)   # fit's steps, which run ahead of the host, are a program of their own
    compiled = tuner.compilations
    history = tuner.fit(batches, epochs=3, progress=False)
    assert tuner.compilations == compiled
    assert history["loss"][-1] < 0.5 * before
    assert len(history["step_loss"]) == 60 and compiled == 3


@pytest.mark.slow
def test_fine_tuning_double_buffers_the_state_or_updates_it_in_place():
    """A fine-tuning step only reads the weights and optimizer state and writes the new values
    into the buffers the step before replaced; a large or small state (this one, unless the
    threshold is lowered) is donated and updated in place instead (see onnxtrain._engine.strategies).
    Oracles: each other's losses and weights, and the donated buffers JAX deleted."""
    model, _ = fixture("cnn")
    with np.load(paths.FIXTURES / "digits.npz") as digits:
        batches = [{"x": digits["images"][i:i + 16], "labels": digits["labels"][i:i + 16]} for i in range(0, 64, 16)]
    in_place, double_buffered = (onnxtrain.finetune(model, "cross_entropy", optax.adam(1e-3), nan_policy="ignore")
                                 for _ in range(2))
    double_buffered._runners[0].plan_as(strategies.SMALL_STATE_BYTES)
    replaced = []
    for batch in batches:
        before, before_in_place = list(double_buffered._store.values.values()), list(in_place._store.values.values())
        np.testing.assert_allclose(float(double_buffered.step(batch)["loss"]), float(in_place.step(batch)["loss"]),
                                   rtol=1e-6)
        assert not any(value.is_deleted() for value in before)
        assert all(value.is_deleted() for value in replaced)
        assert all(value.is_deleted() for value in before_in_place)
        replaced = before
    for name in double_buffered.state_names:
        np.testing.assert_allclose(np.asarray(in_place.state[name]), np.asarray(double_buffered.state[name]),
                                   rtol=1e-5, atol=1e-6, err_msg=name)
    assert isinstance(double_buffered._runners[0].plan(double_buffered._store).single, strategies.DoubleBuffered)
    assert isinstance(in_place._runners[0].plan(in_place._store).single, strategies.InPlace)
