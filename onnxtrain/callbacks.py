"""Callbacks: code fit runs at the start and end of training, of each epoch and of each step.

Subclass `Callback` and override the hooks you need, or pass a plain function
`callback(epoch, logs)` that fit calls after each epoch (returning True stops training).
Built-ins: `EarlyStopping`, `ModelCheckpoint`, `LearningRateScheduler`, `ReduceLROnPlateau`,
`CSVLogger` and `JSONLogger`.

`logs` is the dict fit records for an epoch (the training means and, with eval_data, the
`val_` values); callbacks read whatever keys it holds. Per-step logs reach `on_step_end` as
fit reads them back: a chunk of steps late, while the device already runs the next chunk, so
the hook never makes the host wait for the device. A change a step hook makes (a learning
rate, a stop) therefore applies from the next chunk fit dispatches, not from the very next step.

Example:
    >>> from onnxtrain.callbacks import EarlyStopping, ModelCheckpoint
    >>> trainer.fit(batches, epochs=50, eval_data=held_out,
    ...             callbacks=[EarlyStopping(patience=3), ModelCheckpoint("best.ckpt")])
"""

from __future__ import annotations

import csv
import inspect
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from onnxtrain.errors import InputError

Logs = dict[str, float]


class Callback:
    """Base class of fit's callbacks; every hook does nothing until overridden.

    Attributes:
        trainer: the Trainer or FineTuner being fitted (set before on_train_begin; None when
            onnxtrain.fitting.fit runs without one).
        params: {"epochs": ..., "verbose": ..., "steps": steps in the current epoch or None}.
        stop_training: set it to True to stop after the current step's chunk or epoch, as
            setting `trainer.stop_training` does.

    Example:
        >>> class PrintLoss(Callback):
        ...     def on_epoch_end(self, epoch, logs):
        ...         print(epoch, logs)
    """

    trainer: Any = None
    params: dict[str, Any] = {}
    stop_training: bool = False

    def on_train_begin(self, trainer: Any) -> None:
        """Called once before the first epoch with the trainer being fitted."""

    def on_epoch_begin(self, epoch: int) -> None:
        """Called before the steps of `epoch` (counted from 0) run."""

    def on_step_end(self, step: int, logs: Logs) -> None:
        """Called with each step's scalar outputs (e.g. {"loss": ...}) as fit reads them back.

        `step` counts the steps of this fit call from 0. fit reads values back a chunk of
        steps late (see the module docstring), so several calls may come at once.
        """

    def on_epoch_end(self, epoch: int, logs: Logs) -> bool | None:
        """Called after an epoch with its logs (training means, val_ values); a true return stops."""
        return None

    def on_train_end(self, logs: Logs) -> None:
        """Called once after the last epoch (also after a stop) with the last epoch's logs."""


CallbackLike = Callback | Callable[[int, Logs], bool | None]


class _EpochFunction(Callback):
    """A plain function callback(epoch, logs) run after each epoch."""

    def __init__(self, function: Callable[[int, Logs], bool | None]):
        self.function = function

    def on_epoch_end(self, epoch: int, logs: Logs) -> bool | None:
        return self.function(epoch, logs)


def _overrides(callback: Callback, hook: str) -> bool:
    return getattr(type(callback), hook) is not getattr(Callback, hook)


class CallbackList:
    """fit's side of the callbacks: runs each hook on every callback, in the order given."""

    def __init__(self, callbacks: Sequence[CallbackLike], trainer: Any, params: Mapping[str, Any]):
        """Raises InputError for an entry that is neither a Callback nor a callable."""
        if isinstance(callbacks, Callback) or (callable(callbacks) and not isinstance(callbacks, Sequence)):
            callbacks = [callbacks]
        self.callbacks: list[Callback] = []
        for index, callback in enumerate(callbacks):
            if isinstance(callback, Callback):
                self.callbacks.append(callback)
            elif callable(callback):
                self.callbacks.append(_EpochFunction(callback))
            else:
                raise InputError(f"callbacks[{index}] is a {type(callback).__name__}; pass Callback "
                                 "objects (onnxtrain.callbacks) or functions callback(epoch, logs)")
        self.trainer = trainer
        self.params = dict(params)
        # Only these run per step, so callbacks without a step hook cost nothing per step.
        self._step_hooks = [c for c in self.callbacks if _overrides(c, "on_step_end")]
        self._step = 0

    @property
    def stop(self) -> bool:
        """Whether a callback (or the trainer's stop_training) asked training to stop."""
        return bool(getattr(self.trainer, "stop_training", False)) or any(c.stop_training for c in self.callbacks)

    def train_begin(self) -> None:
        if self.trainer is not None and hasattr(self.trainer, "stop_training"):
            self.trainer.stop_training = False
        for callback in self.callbacks:
            callback.trainer, callback.params, callback.stop_training = self.trainer, dict(self.params), False
            callback.on_train_begin(self.trainer)

    def epoch_begin(self, epoch: int, steps: int | None) -> None:
        self.params["steps"] = steps
        for callback in self.callbacks:
            callback.params["steps"] = steps
            callback.on_epoch_begin(epoch)

    def step_end(self, logs: Logs) -> None:
        for callback in self._step_hooks:
            callback.on_step_end(self._step, logs)
        self._step += 1

    def epoch_end(self, epoch: int, logs: Logs) -> bool:
        """Run every callback's on_epoch_end (each sees the epoch, even after one said stop);
        whether training stops."""
        answers = [callback.on_epoch_end(epoch, logs) for callback in self.callbacks]
        return any(answers) or self.stop

    def train_end(self, logs: Logs) -> None:
        for callback in self.callbacks:
            callback.on_train_end(logs)


def _needs_trainer(callback: Callback, trainer: Any) -> Any:
    if trainer is None:
        raise InputError(f"{type(callback).__name__} acts on a trainer: use it through Trainer.fit or "
                         "FineTuner.fit, not onnxtrain.fitting.fit alone")
    return trainer


class _Monitor(Callback):
    """A callback that follows one logged value and tells when it improves."""

    _LARGER_IS_BETTER = ("acc", "auc", "precision", "recall", "f1")

    def __init__(self, monitor: str, mode: str, min_delta: float):
        if mode not in ("auto", "min", "max"):
            raise InputError(f"mode={mode!r}: pass 'min' (smaller is better), 'max' or 'auto' "
                             "(max for accuracy-like names, else min)")
        if not isinstance(monitor, str) or not monitor:
            raise InputError(f"monitor={monitor!r}: pass the name of a logged value, e.g. 'val_loss'")
        if mode == "auto":
            mode = "max" if any(part in monitor.lower() for part in self._LARGER_IS_BETTER) else "min"
        self.monitor, self.mode, self.min_delta = monitor, mode, abs(float(min_delta))
        self.best: float | None = None
        self.best_epoch: int | None = None

    def _reset(self) -> None:
        self.best, self.best_epoch = None, None

    def _current(self, epoch: int, logs: Logs) -> float | None:
        """The monitored value of this epoch; None if this epoch did not log it.

        Raises:
            InputError: the first epoch's logs lack the monitored value.
        """
        if self.monitor in logs:
            return float(logs[self.monitor])
        if self.best is None and epoch == 0:
            hint = " (val_ values need eval_data)" if self.monitor.startswith("val_") else ""
            raise InputError(f"{type(self).__name__}(monitor={self.monitor!r}): the first epoch logged "
                             f"{sorted(logs)}, not {self.monitor!r}{hint}; pass one of those as monitor")
        return None

    def _improved(self, value: float) -> bool:
        """Whether `value` beats the best so far by more than min_delta (NaN never does)."""
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta


class EarlyStopping(_Monitor):
    """Stop when a logged value stops improving, and go back to the best epoch's state.

    Args:
        monitor: the logged value to follow (default "val_loss", which needs eval_data).
        patience: training stops after this many epochs in a row without improvement (as in
            Keras; 0 acts as 1).
        min_delta: how much a value must beat the best by to count as an improvement.
        mode: "min", "max", or "auto" (max for names with acc/auc/precision/recall/f1).
        restore_best_weights: when training ends, if the best epoch was not the last, put back
            the state of the end of the best epoch: weights, BatchNorm statistics, optimizer
            slots and step counter, and the PRNG key. The learning rate and other
            hyperparameters keep their current values. The best state is kept as a copy in
            host memory; no file is written.

    Attributes:
        stopped_epoch: the epoch training stopped after (None if it ran every epoch).
        best, best_epoch: the best monitored value and the epoch that logged it.

    Raises:
        InputError: a bad mode or patience; the first epoch's logs lack `monitor`.

    Example:
        >>> trainer.fit(batches, epochs=100, eval_data=held_out, callbacks=[EarlyStopping(patience=5)])
    """

    def __init__(self, monitor: str = "val_loss", patience: int = 0, min_delta: float = 0.0,
                 mode: str = "auto", restore_best_weights: bool = True):
        super().__init__(monitor, mode, min_delta)
        if not isinstance(patience, int) or patience < 0:
            raise InputError(f"patience={patience!r}: pass a whole number of epochs, 0 or more")
        self.patience, self.restore_best_weights = patience, restore_best_weights
        self.wait = 0
        self.stopped_epoch: int | None = None
        self._best_state: Any = None
        self._last_epoch: int | None = None

    def on_train_begin(self, trainer: Any) -> None:
        if self.restore_best_weights:
            _needs_trainer(self, trainer)
        self._reset()
        self.wait, self.stopped_epoch, self._best_state, self._last_epoch = 0, None, None, None

    def on_epoch_end(self, epoch: int, logs: Logs) -> bool | None:
        self._last_epoch = epoch
        value = self._current(epoch, logs)
        if value is None:
            return None
        if self._improved(value):
            self.best, self.best_epoch, self.wait = value, epoch, 0
            if self.restore_best_weights:
                self._best_state = self.trainer.snapshot(exclude=_hyperparameter_names(self.trainer))
            return None
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            return True
        return None

    def on_train_end(self, logs: Logs) -> None:
        if self._best_state is not None and self.best_epoch != self._last_epoch:
            self.trainer.restore_snapshot(self._best_state)
        self._best_state = None


def _format_path(path: str | os.PathLike, epoch: int, logs: Logs) -> Path:
    """`path` with {epoch} (counted from 1, as fit prints it) and {log name} filled in."""
    text = os.fspath(path)
    if "{" not in text:
        return Path(text)
    try:
        return Path(text.format(epoch=epoch + 1, **logs))
    except (KeyError, IndexError, ValueError) as error:
        raise InputError(f"ModelCheckpoint path {text!r} cannot be filled in ({error}); it may name "
                         f"{{epoch}} and the logged values {sorted(logs)}") from None


class ModelCheckpoint(_Monitor):
    """Save the trainer after epochs: after every epoch, or only when `monitor` improves.

    Each file is written atomically (to a temporary file in the same folder, then renamed over
    the target): a failure or kill while saving leaves the previous file whole.

    Args:
        path: the file to write; may contain {epoch} (from 1) and logged names, e.g.
            "ckpt-{epoch:03d}-{val_loss:.3f}.zip". A fixed path keeps only the latest save,
            which with save_best_only is the best epoch's.
        monitor: the logged value that decides "best" (default "val_loss").
        save_best_only: save only when `monitor` improves on the best so far.
        mode: "min", "max" or "auto", as for EarlyStopping.
        what: "checkpoint" (trainer.save_checkpoint: every state variable, optimizer slot,
            hyperparameter and the PRNG key, for load_checkpoint), "inference"
            (trainer.export(path, training=False): a model for ONNX Runtime) or "training"
            (trainer.export(path, training=True): a Trainer resumes from it; Trainer only).

    Attributes:
        saved: the paths written, in order.

    Raises:
        InputError: a bad `what` or mode, "training" with a FineTuner, or the first epoch's
            logs lack `monitor` (with save_best_only).
        ExportError: a file cannot be written (the previous one stays as it was).

    Example:
        >>> trainer.fit(batches, epochs=20, eval_data=held_out,
        ...             callbacks=[ModelCheckpoint("best.onnx", what="inference")])
    """

    _WHAT = ("checkpoint", "inference", "training")

    def __init__(self, path: str | os.PathLike, monitor: str = "val_loss", save_best_only: bool = True,
                 mode: str = "auto", what: str = "checkpoint"):
        super().__init__(monitor, mode, 0.0)
        if what not in self._WHAT:
            raise InputError(f"what={what!r}: pass one of {list(self._WHAT)}")
        self.path, self.save_best_only, self.what = path, save_best_only, what
        self.saved: list[Path] = []

    def on_train_begin(self, trainer: Any) -> None:
        _needs_trainer(self, trainer)
        if self.what == "training" and hasattr(trainer, "learning_rate_names"):
            raise InputError("ModelCheckpoint(what='training'): a FineTuner's optax optimizer has no ONNX "
                             "form; pass what='checkpoint' (resumable) or what='inference'")
        self._reset()
        self.saved = []

    def on_epoch_end(self, epoch: int, logs: Logs) -> bool | None:
        if self.save_best_only:
            value = self._current(epoch, logs)
            if value is None or not self._improved(value):
                return None
            self.best, self.best_epoch = value, epoch
        path = _format_path(self.path, epoch, logs)
        if self.what == "checkpoint":
            self.trainer.save_checkpoint(path)
        else:
            self.trainer.export(path, training=self.what == "training")
        self.saved.append(path)
        return None


def _hyperparameter_names(trainer: Any) -> tuple[str, ...]:
    """The store names that hold hyperparameters: a Trainer's (and its learning rate, which
    make_training_model's initialization binds, so it is a state variable too), or a
    FineTuner's injected ones."""
    names = (*getattr(trainer, "hyperparameter_names", ()), *getattr(trainer, "injected_hyperparameters", ()))
    try:
        return (*names, learning_rate_name(trainer))
    except InputError:
        return names


def learning_rate_name(trainer: Any) -> str:
    """The name of the state entry that holds `trainer`'s learning rate (for set_state).

    A Trainer: the variable make_training_model names "learning_rate" (or the one state
    variable or hyperparameter whose name starts so). A FineTuner: the learning rate of an
    optimizer made with optax.inject_hyperparams.

    Raises:
        InputError: there is none, or several, naming what to do.

    Example:
        >>> trainer.set_state(learning_rate_name(trainer), 1e-4)
    """
    if hasattr(trainer, "learning_rate_names"):
        names = trainer.learning_rate_names
        if len(names) == 1:
            return names[0]
        if not names:
            raise InputError("this FineTuner's optax learning rate is a constant of the optimizer, not "
                             "state; build the optimizer with optax.inject_hyperparams, e.g. "
                             "finetune(..., optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=1e-3))")
        raise InputError(f"this FineTuner's optimizer injects several learning rates ({list(names)}); "
                         "pass name= to say which one to change")
    names = (*getattr(trainer, "state_names", ()), *getattr(trainer, "hyperparameter_names", ()))
    if "learning_rate" in names:
        return "learning_rate"
    candidates = [name for name in names if name.startswith("learning_rate")]
    if len(candidates) == 1:
        return candidates[0]
    raise InputError(f"cannot tell which state variable or hyperparameter is the learning rate among "
                     f"{list(names)}; pass name= (one of trainer.state_names or trainer.hyperparameter_names)")


class _LearningRate(Callback):
    """A callback that reads and sets the trainer's learning-rate state (no recompilation)."""

    def __init__(self, name: str | None):
        self.name = name

    def on_train_begin(self, trainer: Any) -> None:
        _needs_trainer(self, trainer)
        self._name = self.name if self.name is not None else learning_rate_name(trainer)

    @property
    def learning_rate(self) -> float:
        """The learning rate now in the trainer's state."""
        return float(self.trainer.get_state(self._name))

    def _set(self, value: float) -> None:
        self.trainer.set_state(self._name, np.asarray(value))


class LearningRateScheduler(_LearningRate):
    """Set the learning rate at the start of every epoch from `schedule`.

    Args:
        schedule: schedule(epoch) -> learning rate, or schedule(epoch, current_lr) -> learning
            rate (epochs counted from 0).
        name: the state entry to set (default: found by learning_rate_name).

    Raises:
        InputError: the trainer has no learning-rate state (see learning_rate_name), or the
            schedule returns a value the state cannot hold (NaN, Inf).

    Example:
        >>> trainer.fit(batches, epochs=10, callbacks=[LearningRateScheduler(lambda e: 1e-3 * 0.9 ** e)])
    """

    def __init__(self, schedule: Callable[..., float], name: str | None = None):
        super().__init__(name)
        if not callable(schedule):
            raise InputError(f"schedule is a {type(schedule).__name__}; pass a function epoch -> learning rate")
        self.schedule = schedule
        self._two_arguments = _positional_count(schedule) >= 2

    def on_epoch_begin(self, epoch: int) -> None:
        value = self.schedule(epoch, self.learning_rate) if self._two_arguments else self.schedule(epoch)
        self._set(float(value))


def _positional_count(function: Callable[..., Any]) -> int:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return 2
    return sum(p.kind in kinds for p in parameters)


class ReduceLROnPlateau(_LearningRate, _Monitor):
    """Multiply the learning rate by `factor` when `monitor` stops improving.

    Args:
        monitor: the logged value to follow (default "val_loss").
        factor: the multiplier, between 0 and 1.
        patience: the learning rate drops after this many epochs in a row without improvement
            (as in Keras; 0 acts as 1).
        min_delta: how much a value must beat the best by to count as an improvement.
        mode: "min", "max" or "auto", as for EarlyStopping.
        cooldown: epochs to wait after a reduction before counting again.
        min_lr: the learning rate never goes below this.
        name: the state entry to set (default: found by learning_rate_name).

    Raises:
        InputError: bad arguments, no learning-rate state, or the first epoch's logs lack `monitor`.

    Example:
        >>> trainer.fit(batches, epochs=30, eval_data=held_out,
        ...             callbacks=[ReduceLROnPlateau(factor=0.5, patience=2, min_lr=1e-5)])
    """

    def __init__(self, monitor: str = "val_loss", factor: float = 0.1, patience: int = 10,
                 min_delta: float = 1e-4, mode: str = "auto", cooldown: int = 0, min_lr: float = 0.0,
                 name: str | None = None):
        _LearningRate.__init__(self, name)
        _Monitor.__init__(self, monitor, mode, min_delta)
        if not 0.0 < factor < 1.0:
            raise InputError(f"factor={factor!r}: pass a number between 0 and 1 (the learning rate is "
                             "multiplied by it)")
        for argument, value in (("patience", patience), ("cooldown", cooldown)):
            if not isinstance(value, int) or value < 0:
                raise InputError(f"{argument}={value!r}: pass a whole number of epochs, 0 or more")
        if min_lr < 0:
            raise InputError(f"min_lr={min_lr!r}: pass 0 or more")
        self.factor, self.patience, self.cooldown, self.min_lr = float(factor), patience, cooldown, float(min_lr)
        self.wait = self._cooling = 0

    def on_train_begin(self, trainer: Any) -> None:
        _LearningRate.on_train_begin(self, trainer)
        self._reset()
        self.wait = self._cooling = 0

    def on_epoch_end(self, epoch: int, logs: Logs) -> bool | None:
        value = self._current(epoch, logs)
        if value is None:
            return None
        if self._cooling > 0:
            self._cooling -= 1
            self.wait = 0
        if self._improved(value):
            self.best, self.best_epoch, self.wait = value, epoch, 0
            return None
        if self._cooling > 0:
            return None
        self.wait += 1
        if self.wait >= self.patience:
            current = self.learning_rate
            reduced = max(current * self.factor, self.min_lr)
            if reduced < current:
                self._set(reduced)
            self.wait, self._cooling = 0, self.cooldown
        return None


def _plain(value: Any) -> float | None:
    """A logged value as JSON holds it: a float, or null for NaN and Inf (not valid JSON)."""
    number = float(value)
    return number if math.isfinite(number) else None


class CSVLogger(Callback):
    """Write one row per epoch to a CSV file: `epoch` (from 0) and the epoch's logs.

    The columns are the first epoch's logs; a later epoch's missing value is left empty.
    Each row is flushed as its epoch ends, so a stopped run keeps the rows of its epochs.

    Args:
        path: the CSV file.
        append: add rows to an existing file (no second header) instead of replacing it.
        separator: the field separator.

    Example:
        >>> trainer.fit(batches, epochs=5, callbacks=[CSVLogger("history.csv")])
    """

    def __init__(self, path: str | os.PathLike, append: bool = False, separator: str = ","):
        self.path, self.append, self.separator = Path(path), append, separator
        self._columns: list[str] | None = None

    def on_train_begin(self, trainer: Any) -> None:
        self._columns = None
        self._header = not (self.append and self.path.exists() and self.path.stat().st_size > 0)
        if not self.append:
            self.path.write_text("")

    def on_epoch_end(self, epoch: int, logs: Logs) -> bool | None:
        if self._columns is None:
            self._columns = list(logs)
        with open(self.path, "a", newline="") as handle:
            writer = csv.writer(handle, delimiter=self.separator)
            if self._header:
                writer.writerow(["epoch", *self._columns])
                self._header = False
            writer.writerow([epoch, *(repr(float(logs[c])) if c in logs else "" for c in self._columns)])
        return None


class JSONLogger(Callback):
    """Write one JSON object per epoch, one per line (JSON Lines): {"epoch": 0, "loss": ...}.

    NaN and Inf are written as null, which JSON can hold. Each line is flushed as its epoch
    ends.

    Args:
        path: the file.
        append: add lines to an existing file instead of replacing it.

    Example:
        >>> trainer.fit(batches, epochs=5, callbacks=[JSONLogger("history.jsonl")])
    """

    def __init__(self, path: str | os.PathLike, append: bool = False):
        self.path, self.append = Path(path), append

    def on_train_begin(self, trainer: Any) -> None:
        if not self.append:
            self.path.write_text("")

    def on_epoch_end(self, epoch: int, logs: Logs) -> bool | None:
        row = {"epoch": epoch, **{name: _plain(value) for name, value in logs.items()}}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(row, allow_nan=False) + "\n")
        return None


__all__ = ["CSVLogger", "Callback", "EarlyStopping", "JSONLogger", "LearningRateScheduler", "ModelCheckpoint",
           "ReduceLROnPlateau", "learning_rate_name"]
