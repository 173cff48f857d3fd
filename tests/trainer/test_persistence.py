"""Stopping and resuming: export(training=True), checkpoints, and export for inference.

Resuming must be bitwise identical to never stopping, even with Dropout in the algorithm
graph: the PRNG key travels with the exported model (so Trainer(exported) with seed=None
resumes it) and with the checkpoint. export(training=False) must be a plain inference model
that onnxruntime runs, agreeing with trainer.infer.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import numpy_helper

import onnxtrain
from support.training_models import assert_state_equal, linreg_model, snapshot

pytestmark = pytest.mark.slow  # several trainers and exports per test, each compiling its steps

X = np.linspace(-1, 2, 8, dtype=np.float32).reshape(8, 1)
FEEDS = {"X": X, "Y": 2 * X + 1}
BEFORE, AFTER = 3, 3


def dropout_trainer(seed: int = 0) -> onnxtrain.Trainer:
    trainer = onnxtrain.Trainer(linreg_model(dropout=True), seed=seed)
    trainer.initialize()
    return trainer


def run_steps(trainer: onnxtrain.Trainer, steps: int) -> list[np.ndarray]:
    return [np.asarray(trainer.step(FEEDS)["loss"]) for _ in range(steps)]


def assert_same_run(losses, trainer, expected_losses, expected_trainer) -> None:
    for loss, expected in zip(losses, expected_losses, strict=True):
        assert np.array_equal(loss, expected)
    assert_state_equal(trainer, snapshot(expected_trainer))


def test_dropout_draws_a_new_mask_every_step_from_the_trainer_key():
    """Guards the resume tests below against passing vacuously: the seed matters, and the
    same state stepped twice (key advanced in between) drops differently."""
    first, second = (onnxtrain.Trainer(linreg_model(dropout=True), seed=seed) for seed in (1, 2))
    assert not np.array_equal(run_steps(first, 2), run_steps(second, 2))

    trainer = dropout_trainer()
    start = snapshot(trainer)
    losses = []
    for _ in range(3):
        for name, value in start.items():
            trainer.set_state(name, value)
        losses += run_steps(trainer, 1)
    assert len({float(loss) for loss in losses}) > 1


def test_export_for_training_then_resume_equals_an_uninterrupted_run(tmp_path):
    """The learning rate is changed before the export: the exported model must carry it too."""
    uninterrupted = dropout_trainer()
    run_steps(uninterrupted, BEFORE)
    uninterrupted.set_state("LR", 0.05)
    expected = run_steps(uninterrupted, AFTER)

    interrupted = dropout_trainer()
    run_steps(interrupted, BEFORE)
    interrupted.set_state("LR", 0.05)
    path = tmp_path / "trained.onnx"
    interrupted.export(path, training=True)

    exported = onnx.load(path)
    algorithm = {t.name: numpy_helper.to_array(t) for t in exported.training_info[0].algorithm.initializer}
    main = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    for name, value in snapshot(interrupted).items():
        written = main.get(name, algorithm.get(name))
        assert written.dtype == value.dtype and np.array_equal(written, value), name
    assert algorithm["LR"] == np.float32(0.05)
    assert len(exported.training_info[0].update_binding) == 5

    resumed = onnxtrain.Trainer(path)
    assert_state_equal(resumed, snapshot(interrupted))
    assert_same_run(run_steps(resumed, AFTER), resumed, expected, uninterrupted)
    # neither exporting nor inference disturbs the exporter's own run (state and key)
    interrupted.infer({"X": X})
    assert_same_run(run_steps(interrupted, AFTER), interrupted, expected, uninterrupted)


def test_checkpoint_restores_state_and_key_exactly(tmp_path):
    uninterrupted = dropout_trainer()
    expected = run_steps(uninterrupted, BEFORE + AFTER)[BEFORE:]

    trainer = dropout_trainer()
    run_steps(trainer, BEFORE)
    saved = snapshot(trainer)
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    assert_same_run(run_steps(trainer, AFTER), trainer, expected, uninterrupted)

    trainer.load_checkpoint(path)
    assert_state_equal(trainer, saved)
    assert_same_run(run_steps(trainer, AFTER), trainer, expected, uninterrupted)

    stranger = onnxtrain.Trainer(linreg_model(dropout=True), seed=99)
    stranger.load_checkpoint(path)
    assert_same_run(run_steps(stranger, AFTER), stranger, expected, uninterrupted)


def test_export_for_inference_runs_in_onnxruntime(tmp_path):
    trainer = dropout_trainer()
    run_steps(trainer, BEFORE)
    path = tmp_path / "inference.onnx"
    trainer.export(path, training=False)

    exported = onnx.load(path)
    assert len(exported.training_info) == 0
    weights = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    for name in ("W", "B"):
        assert np.array_equal(weights[name], np.asarray(trainer.state[name])), name

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (prediction,) = session.run(["Y_pred"], {"X": X})
    np.testing.assert_allclose(prediction, np.asarray(trainer.infer({"X": X})["Y_pred"]), rtol=1e-5, atol=1e-6)
