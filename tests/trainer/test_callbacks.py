"""The built-in callbacks on a real training model (a small MLP from make_training_model).

The oracle is a reference trainer driven by hand: fit one epoch at a time, save a checkpoint
after each, call set_state where a callback would. Same model, seed and batches give the same
numbers, so the callbacks' runs must match it exactly.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

import onnxtrain
from onnxtrain import InputError
from onnxtrain.callbacks import (
    Callback,
    CSVLogger,
    EarlyStopping,
    JSONLogger,
    LearningRateScheduler,
    ModelCheckpoint,
    ReduceLROnPlateau,
)

EPOCHS = 12


def _mlp():
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W1", "B1"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
         helper.make_node("Gemm", ["t", "W2", "B2"], ["logits"])], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 5])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array((rng.normal(size=shape) * 0.5).astype(np.float32), name)
         for name, shape in (("W1", (5, 16)), ("B1", (16,)), ("W2", (16, 3)), ("B2", (3,)))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.fixture(scope="module")
def training_model():
    return onnxtrain.make_training_model(_mlp(), loss="cross_entropy", optimizer=onnxtrain.optim.Adam(lr=0.05))


def _data(seed: int, rows: int, noise: float):
    """Labels from a fixed linear rule, a `noise` share of them replaced at random: on few
    rows the MLP learns the rule, then memorizes the noise, so the clean validation loss
    falls and then rises."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 5)).astype(np.float32)
    labels = np.argmax(x @ np.random.default_rng(99).normal(size=(5, 3)), axis=1).astype(np.int64)
    flip = rng.random(rows) < noise
    labels[flip] = rng.integers(0, 3, int(flip.sum()))
    return x, labels


@pytest.fixture(scope="module")
def batches():
    x, y = _data(1, 32, 0.45)
    return [{"x": x[i:i + 16], "labels": y[i:i + 16]} for i in (0, 16)]


@pytest.fixture(scope="module")
def held_out():
    x, y = _data(2, 64, 0.0)
    return [{"x": x, "labels": y}]


def _trainer(model):
    trainer = onnxtrain.Trainer(model, seed=0)
    trainer.initialize()
    return trainer


@pytest.fixture(scope="module")
def reference(training_model, batches, held_out, tmp_path_factory):
    """The hand-driven run: each epoch's validation loss and a checkpoint after each epoch."""
    folder = tmp_path_factory.mktemp("reference")
    trainer = _trainer(training_model)
    val_losses, checkpoints = [], []
    for epoch in range(EPOCHS):
        history = trainer.fit(batches, eval_data=held_out, verbose=0)
        val_losses.append(history["val_loss"][-1])
        checkpoints.append(folder / f"epoch{epoch}.zip")
        trainer.save_checkpoint(checkpoints[-1])
    return {"val_loss": val_losses, "checkpoints": checkpoints}


def _state_at(model, checkpoint: Path) -> dict[str, np.ndarray]:
    trainer = _trainer(model)
    trainer.load_checkpoint(checkpoint)
    return {name: np.asarray(trainer.state[name]) for name in trainer.state_names}


def _assert_state(trainer, expected: dict[str, np.ndarray]) -> None:
    assert set(trainer.state_names) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(np.asarray(trainer.state[name]), value, err_msg=name)


def _expected_stop(val_losses: list[float], patience: int) -> tuple[int, int]:
    """(best epoch, stop epoch) by Keras's rule, derived by hand from the reference losses."""
    best, best_epoch, wait = float("inf"), 0, 0
    for epoch, value in enumerate(val_losses):
        if value < best:
            best, best_epoch, wait = value, epoch, 0
            continue
        wait += 1
        if wait >= patience:
            return best_epoch, epoch
    return best_epoch, len(val_losses) - 1


@pytest.mark.slow
def test_early_stopping_stops_at_the_right_epoch_and_restores_the_best_state(training_model, batches, held_out,
                                                                              reference):
    patience = 2
    best_epoch, stop_epoch = _expected_stop(reference["val_loss"], patience)
    assert 0 < best_epoch < stop_epoch < EPOCHS - 1, reference["val_loss"]   # the data makes a U-shaped curve
    trainer = _trainer(training_model)
    stopper = EarlyStopping(patience=patience)
    history = trainer.fit(batches, epochs=EPOCHS, eval_data=held_out, callbacks=[stopper], verbose=0)
    np.testing.assert_array_equal(history["val_loss"], reference["val_loss"][:stop_epoch + 1])
    assert (stopper.best_epoch, stopper.stopped_epoch) == (best_epoch, stop_epoch)
    # Weights, optimizer slots and step counter are those saved at the end of the best epoch.
    _assert_state(trainer, _state_at(training_model, reference["checkpoints"][best_epoch]))
    assert float(trainer.evaluate(held_out[0])["loss"]) == pytest.approx(reference["val_loss"][best_epoch], rel=1e-6)


@pytest.mark.slow
def test_early_stopping_without_restoring_keeps_the_last_state(training_model, batches, held_out, reference):
    _, stop_epoch = _expected_stop(reference["val_loss"], 2)
    trainer = _trainer(training_model)
    trainer.fit(batches, epochs=EPOCHS, eval_data=held_out, verbose=0,
                callbacks=[EarlyStopping(patience=2, restore_best_weights=False)])
    _assert_state(trainer, _state_at(training_model, reference["checkpoints"][stop_epoch]))


@pytest.mark.slow
def test_early_stopping_keeps_the_learning_rate_set_after_the_best_epoch(training_model, batches, held_out,
                                                                         reference):
    """Restoring puts back the state of the best epoch, but hyperparameters are the user's:
    a learning rate lowered since then (here as the last epoch ends) stays lowered."""
    best_epoch, stop_epoch = _expected_stop(reference["val_loss"], 2)

    class LowerAfterBest(Callback):
        def on_epoch_end(self, epoch, logs):
            if epoch == stop_epoch:
                self.trainer.set_state("learning_rate", 0.01)

    trainer = _trainer(training_model)
    trainer.fit(batches, epochs=EPOCHS, eval_data=held_out, verbose=0,
                callbacks=[EarlyStopping(patience=2), LowerAfterBest()])
    assert float(trainer.get_state("learning_rate")) == pytest.approx(0.01)
    expected = _state_at(training_model, reference["checkpoints"][best_epoch])
    _assert_state(trainer, {**expected, "learning_rate": np.float32(0.01)})


@pytest.mark.slow
def test_a_monitor_never_logged_is_refused_after_the_first_epoch_naming_the_logged_keys(training_model, batches,
                                                                                        tmp_path):
    trainer = _trainer(training_model)
    seen = []
    with pytest.raises(InputError, match=r"EarlyStopping\(monitor='val_loss'\): the first epoch logged "
                                         r"\['(epoch_)?loss'\], not 'val_loss' \(val_ values need eval_data\)"):
        trainer.fit(batches, epochs=3, callbacks=[lambda epoch, logs: seen.append(epoch), EarlyStopping()], verbose=0)
    assert seen == [0]   # refused as the first epoch ends
    with pytest.raises(InputError, match=r"ModelCheckpoint\(monitor='val_acc'\)"):
        trainer.fit(batches, epochs=3, callbacks=[ModelCheckpoint(tmp_path / "never.zip", monitor="val_acc")],
                    verbose=0)
    assert not (tmp_path / "never.zip").exists()


@pytest.mark.slow
def test_model_checkpoint_saves_only_improvements_and_the_file_holds_the_best(training_model, batches, held_out,
                                                                              reference, tmp_path):
    val = reference["val_loss"]
    improving = [epoch for epoch in range(EPOCHS) if val[epoch] < min(val[:epoch], default=np.inf)]
    trainer = _trainer(training_model)
    numbered = ModelCheckpoint(tmp_path / "numbered-{epoch:02d}.zip")
    best = ModelCheckpoint(tmp_path / "best.zip")
    trainer.fit(batches, epochs=EPOCHS, eval_data=held_out, callbacks=[numbered, best], verbose=0)
    assert sorted(p.name for p in tmp_path.glob("numbered-*")) == [f"numbered-{e + 1:02d}.zip" for e in improving]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["best.zip", *(p.name for p in numbered.saved)])
    assert best.saved == [tmp_path / "best.zip"] * len(improving)
    expected = _state_at(training_model, reference["checkpoints"][int(np.argmin(val))])
    restored = _trainer(training_model)
    restored.load_checkpoint(tmp_path / "best.zip")
    _assert_state(restored, expected)


@pytest.mark.slow
def test_model_checkpoint_never_leaves_a_partial_file(training_model, batches, held_out, reference, tmp_path,
                                                      monkeypatch):
    """The second save dies half-way through writing: the first save stays whole, no
    temporary is left, and fit reports the failure."""
    from onnxtrain.errors import ExportError
    from onnxtrain.state import checkpoint as checkpoint_module

    written = checkpoint_module._write_zip
    saves = []

    def dies_on_second_save(file, *args):
        saves.append(file)
        if len(saves) == 1:
            return written(file, *args)
        file.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "_write_zip", dies_on_second_save)
    trainer = _trainer(training_model)
    path = tmp_path / "best.zip"
    with pytest.raises(ExportError, match="No space left"):
        trainer.fit(batches, epochs=EPOCHS, eval_data=held_out, callbacks=[ModelCheckpoint(path, save_best_only=False)],
                    verbose=0)
    assert [p.name for p in tmp_path.iterdir()] == ["best.zip"]
    monkeypatch.undo()
    restored = _trainer(training_model)
    restored.load_checkpoint(path)
    _assert_state(restored, _state_at(training_model, reference["checkpoints"][0]))


@pytest.mark.slow
def test_model_checkpoint_exports_an_inference_model_onnxruntime_scores_as_the_best_epoch(
        training_model, batches, held_out, reference, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    trainer = _trainer(training_model)
    trainer.fit(batches, epochs=EPOCHS, eval_data=held_out, verbose=0,
                callbacks=[ModelCheckpoint(tmp_path / "best.onnx", what="inference")])
    best = _trainer(training_model)
    best.load_checkpoint(reference["checkpoints"][int(np.argmin(reference["val_loss"]))])
    session = ort.InferenceSession(str(tmp_path / "best.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], {"x": held_out[0]["x"]})[0]
    np.testing.assert_allclose(logits, np.asarray(best.infer({"x": held_out[0]["x"]})["logits"]), rtol=1e-5,
                               atol=1e-6)


def _learning_rates(trainer):
    """A callback recording the learning rate each epoch ran with."""
    seen = []

    class Record(Callback):
        def on_epoch_end(self, epoch, logs):
            seen.append(float(self.trainer.get_state("learning_rate")))

    return Record(), seen


@pytest.mark.slow
def test_learning_rate_scheduler_matches_set_state_by_hand_without_compiling_again(training_model, batches):
    schedule = [0.05, 0.02, 0.005]
    scheduled, plain, by_hand = (_trainer(training_model) for _ in range(3))
    record, seen = _learning_rates(scheduled)
    history = scheduled.fit(batches, epochs=3, verbose=0,
                            callbacks=[LearningRateScheduler(lambda epoch: schedule[epoch]), record])
    expected = []
    for rate in schedule:
        by_hand.set_state("learning_rate", rate)
        expected += by_hand.fit(batches, verbose=0)["loss"]
    unscheduled = plain.fit(batches, epochs=3, verbose=0)["loss"]
    assert seen == pytest.approx(schedule)
    np.testing.assert_array_equal(history["loss"], expected)
    assert not np.allclose(history["loss"], unscheduled)   # the schedule changed the run
    _assert_state(scheduled, {name: np.asarray(by_hand.state[name]) for name in by_hand.state_names})
    assert scheduled.compilations == plain.compilations == by_hand.compilations


@pytest.mark.slow
def test_a_two_argument_schedule_gets_the_current_learning_rate(training_model, batches):
    trainer = _trainer(training_model)
    record, seen = _learning_rates(trainer)
    trainer.fit(batches, epochs=3, verbose=0,
                callbacks=[LearningRateScheduler(lambda epoch, rate: rate * 0.5), record])
    assert seen == pytest.approx([0.025, 0.0125, 0.00625])


@pytest.mark.slow
def test_reduce_lr_on_plateau_lowers_the_state_as_set_state_by_hand_would(training_model, batches, held_out):
    """min_delta is so large that only the first epoch counts as an improvement: with
    patience 1 the rate halves after epochs 1, 2, 3... down to min_lr."""
    reducer = ReduceLROnPlateau(factor=0.5, patience=1, min_delta=100.0, min_lr=0.01)
    reduced, plain, by_hand = (_trainer(training_model) for _ in range(3))
    record, seen = _learning_rates(reduced)
    history = reduced.fit(batches, epochs=5, eval_data=held_out, callbacks=[reducer, record], verbose=0)
    rates = [0.05, 0.05, 0.025, 0.0125, 0.01]
    expected = []
    for epoch, rate in enumerate(rates):
        by_hand.set_state("learning_rate", rate)
        expected += by_hand.fit(batches, eval_data=held_out, verbose=0)["loss"]
    plain.fit(batches, epochs=5, eval_data=held_out, verbose=0)
    assert seen == pytest.approx([0.05, 0.025, 0.0125, 0.01, 0.01])   # read after each epoch's reduction
    np.testing.assert_array_equal(history["loss"], expected)
    assert reduced.compilations == plain.compilations == by_hand.compilations


@pytest.mark.slow
def test_csv_and_json_loggers_write_one_row_per_epoch(training_model, batches, held_out, tmp_path):
    trainer = _trainer(training_model)
    seen = []
    trainer.fit(batches, epochs=3, eval_data=held_out, verbose=0,
                callbacks=[lambda epoch, logs: seen.append(dict(logs)), CSVLogger(tmp_path / "log.csv"),
                           JSONLogger(tmp_path / "log.jsonl")])
    names = list(seen[0])
    assert "val_loss" in names and len(names) >= 2
    with open(tmp_path / "log.csv", newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["epoch", *names]
    assert [[int(row[0]), *map(float, row[1:])] for row in rows[1:]] == [[e, *seen[e].values()] for e in range(3)]
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert lines == [{"epoch": e, **seen[e]} for e in range(3)]
    # A second fit replaces both files unless append=True.
    trainer.fit(batches, epochs=1, verbose=0, callbacks=[CSVLogger(tmp_path / "log.csv"),
                                                         JSONLogger(tmp_path / "log.jsonl", append=True)])
    assert len((tmp_path / "log.csv").read_text().splitlines()) == 2
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 4


def _finetune_batches():
    x, y = _data(1, 32, 0.0)
    return [{"x": x[i:i + 16], "labels": y[i:i + 16]} for i in (0, 16)]


@pytest.mark.slow
def test_finetuner_learning_rate_callbacks_need_an_injected_learning_rate():
    optax = pytest.importorskip("optax")
    batches = _finetune_batches()
    constant = onnxtrain.finetune(_mlp(), "cross_entropy", optax.sgd(0.1))
    with pytest.raises(InputError, match="inject_hyperparams"):
        constant.fit(batches, callbacks=[LearningRateScheduler(lambda epoch: 0.1)], verbose=0)
    with pytest.raises(InputError, match="no ONNX form"):
        constant.fit(batches, callbacks=[ModelCheckpoint("x.onnx", what="training")], verbose=0)

    def injected():
        return onnxtrain.finetune(_mlp(), "cross_entropy", optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))

    scheduled, by_hand = injected(), injected()
    (name,) = scheduled.learning_rate_names
    history = scheduled.fit(batches, epochs=3, verbose=0,
                            callbacks=[LearningRateScheduler(lambda epoch: 0.1 / (epoch + 1))])
    expected = []
    for epoch in range(3):
        by_hand.set_state(name, 0.1 / (epoch + 1))
        expected += by_hand.fit(batches, verbose=0)["step_loss"]
    np.testing.assert_allclose(history["step_loss"], expected, rtol=1e-6)
    assert float(scheduled.get_state(name)) == pytest.approx(0.1 / 3)
    assert scheduled.compilations == by_hand.compilations
    # Plain SGD by hand: the third epoch's steps use a third of the first's rate.
    reference = onnxtrain.finetune(_mlp(), "cross_entropy", optax.sgd(0.1))
    losses = reference.fit(batches, epochs=3, verbose=0)["step_loss"]
    assert losses[:2] == pytest.approx(history["step_loss"][:2], rel=1e-6)
    assert not np.allclose(losses[2:], history["step_loss"][2:])


def test_callbacks_that_need_a_trainer_say_so_when_fit_has_none():
    from onnxtrain.fitting import fit

    with pytest.raises(InputError, match="acts on a trainer"):
        fit(lambda chunk: [{"loss": 1.0} for _ in chunk], [{}], callbacks=[LearningRateScheduler(lambda e: 0.1)],
            verbose=0)


@pytest.mark.parametrize("make, match", [
    (lambda: EarlyStopping(mode="largest"), "mode='largest'"),
    (lambda: EarlyStopping(patience=-1), "patience=-1"),
    (lambda: ReduceLROnPlateau(factor=2.0), "factor=2.0"),
    (lambda: ModelCheckpoint("x", what="weights"), "what='weights'.*checkpoint"),
    (lambda: LearningRateScheduler(0.1), "schedule is a float"),
])
def test_bad_arguments_are_refused_with_the_valid_choices(make, match):
    with pytest.raises(InputError, match=match):
        make()


@pytest.mark.slow
def test_early_stopping_restores_a_finetuners_weights_and_slots_but_not_its_injected_learning_rate(batches, held_out):
    optax = pytest.importorskip("optax")
    tuner = onnxtrain.finetune(_mlp(), "cross_entropy", optax.inject_hyperparams(optax.adam)(learning_rate=0.05))
    (rate,) = tuner.learning_rate_names
    slots = [name for name in tuner._store.values
             if name.startswith("optimizer/") and name not in tuner.injected_hyperparameters]
    saved = []

    class Record(Callback):
        """Each epoch's weights and optimizer slots, read as the epoch ends."""

        def on_epoch_end(self, epoch, logs):
            saved.append({name: tuner.get_state(name) for name in [*tuner.state_names, *slots]})
            if epoch == stopper.stopped_epoch:
                tuner.set_state(rate, 0.001)

    stopper = EarlyStopping(patience=2)
    history = tuner.fit(batches, epochs=EPOCHS, eval_data=held_out, callbacks=[stopper, Record()], verbose=0)
    assert 0 < stopper.best_epoch < stopper.stopped_epoch == len(history["val_loss"]) - 1 < EPOCHS - 1
    for name, value in saved[stopper.best_epoch].items():
        np.testing.assert_array_equal(tuner.get_state(name), value, err_msg=name)
    assert float(tuner.get_state(rate)) == pytest.approx(0.001)
    assert float(tuner.evaluate(held_out[0])["loss"]) == pytest.approx(history["val_loss"][stopper.best_epoch],
                                                                       rel=1e-6)
