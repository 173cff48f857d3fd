"""The training loop of Trainer and FineTuner: epochs, progress bar, history, callbacks.

History is Keras-like: `history[name]` lists every step's value of each scalar
output (e.g. "loss"), `history["epoch_" + name]` the per-epoch means, and
`history["val_" + name]` the per-epoch means over eval_data. Callbacks (onnxtrain.callbacks)
run at the start and end of training, of each epoch and of each step; what fit prints
follows Keras's verbose levels (onnxtrain._engine.progress).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from onnxtrain._engine.batches import StackBuilder
from onnxtrain._engine.faults import Stacked, Unsettled
from onnxtrain._engine.feeds import owned
from onnxtrain._engine.progress import Progress, verbosity
from onnxtrain.callbacks import CallbackLike, CallbackList
from onnxtrain.errors import InputError

Feeds = Mapping[str, Any]
Batches = Iterable[Feeds] | Callable[[], Iterable[Feeds]]
# A Callback object, or callback(epoch, logs) -> True to stop training after this epoch.
Callback = CallbackLike


def _scalars(outputs: Mapping[str, Any]) -> dict[str, float]:
    return {name: float(np.asarray(value)) for name, value in outputs.items() if np.size(value) == 1}


def per_step_scalars(parts: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """Scalar outputs of each step, from one step's outputs or Stacked ones per part (one
    transfer per stacked array, however many steps it holds)."""
    steps = []
    for part in parts:
        if not isinstance(part, Stacked):
            steps.append(_scalars(part))
            continue
        host = {name: np.asarray(value) for name, value in part.items()}
        count = len(next(iter(host.values()))) if host else 0
        steps += [{name: float(value[i]) for name, value in host.items() if value[i].size == 1}
                  for i in range(count)]
    return steps


def _epoch_batches(batches: Batches) -> Iterable[Feeds]:
    return batches() if callable(batches) else batches


def _rows(feeds: Feeds) -> list[tuple[int, ...]]:
    """Each feed's batch size (its axis 0; none for a scalar)."""
    return [np.shape(value)[:1] for value in feeds.values()] if isinstance(feeds, Mapping) else []


def _held(feeds: Feeds) -> Feeds:
    return owned(feeds) if isinstance(feeds, Mapping) else feeds


def _without_short_last(batches: Iterable[Feeds]) -> Iterator[Feeds]:
    """`batches` without the last one if its batch size differs from the first's (drop_last).
    Each batch is copied while the next is read: a loader may refill one buffer for all."""
    iterator = iter(batches)
    try:
        first = previous = _held(next(iterator))
    except StopIteration:
        return
    for feeds in iterator:
        yield previous
        previous = _held(feeds)
    if previous is first or _rows(previous) == _rows(first):
        yield previous


def _chunks(batches: Iterable[Feeds], size: int) -> Iterable[list[Feeds]]:
    """Lists of `size` batches. A chunk holds batches while the loader makes the next ones, and
    a loader may refill one buffer for every batch, so each batch of a chunk is copied: into
    the next row of a stacked buffer when it can be (see batch_stacks), else on its own."""
    chunk: list[Feeds] = []
    builder: StackBuilder | None = None
    for feeds in batches:
        if size > 1 and isinstance(feeds, Mapping):
            if builder is None or not builder.accepts(feeds):
                builder = StackBuilder(feeds, size - len(chunk)) if StackBuilder.stackable(feeds) else None
            feeds = builder.add(feeds) if builder is not None else owned(feeds)
        chunk.append(feeds)
        if len(chunk) == size:
            yield chunk
            chunk, builder = [], None
    if chunk:
        yield chunk


def _mean_over(evaluate: Callable[[Feeds], Mapping[str, Any]], batches: Batches) -> dict[str, float]:
    totals: dict[str, list[float]] = {}
    for feeds in _epoch_batches(batches):
        for name, value in _scalars(evaluate(feeds)).items():
            totals.setdefault(name, []).append(value)
    return {name: float(np.mean(values)) for name, values in totals.items()}


def fit(run_steps: Callable[[list[Feeds]], Sequence[Mapping[str, Any]]],
        batches: Batches, epochs: int = 1, progress: bool | None = None, callbacks: Sequence[Callback] = (),
        evaluate: Callable[[Feeds], Mapping[str, Any]] | None = None,
        eval_data: Batches | None = None, steps_per_call: int = 1, drop_last: bool = False,
        prepare: Callable[[Feeds], Feeds] = lambda feeds: feeds, *, verbose: int | str | None = None,
        trainer: Any = None) -> dict[str, list[float]]:
    """Run `run_steps` over `batches`, `steps_per_call` batches at a time, for `epochs` epochs.

    run_steps(chunk) runs one step per batch of the chunk and returns their outputs, as parts
    (see per_step_scalars). Values come back to the host one chunk late, and so do the NaN/Inf
    checks of Unsettled parts (their `settle`), so the host prepares the next chunk while the
    device computes this one, never waiting for a progress-bar update. drop_last skips an
    epoch's last batch when its batch size differs from the first's. prepare(feeds) checks and
    converts each batch as it arrives, before a chunk holds it. verbose (progress=False is 0):
    see onnxtrain._engine.progress. callbacks: Callback objects or functions (epoch, logs) ->
    True to stop; `trainer` is what their on_train_begin receives. A stop asked for by a step
    hook ends the epoch after the chunk already dispatched.
    """
    if epochs > 1 and not callable(batches) and iter(batches) is batches:
        raise InputError("fit(epochs>1) needs batches it can iterate again: a list, a re-iterable "
                         "dataset, or a function returning a new iterator each epoch")
    if eval_data is not None and evaluate is None:
        raise InputError("eval_data needs an evaluation function")
    if steps_per_call < 1:
        raise InputError(f"steps_per_call must be at least 1, got {steps_per_call}")
    level = verbosity(verbose, progress)
    hooks = CallbackList(callbacks, trainer, {"epochs": epochs, "verbose": level})
    display = Progress(level, epochs)
    history: dict[str, list[float]] = {}
    logs: dict[str, float] = {}
    hooks.train_begin()
    for epoch in range(epochs):
        epoch_batches = _epoch_batches(batches)
        total = len(epoch_batches) if hasattr(epoch_batches, "__len__") else None
        hooks.epoch_begin(epoch, total)
        display.epoch_begin(epoch, total)
        epoch_values: dict[str, list[float]] = {}

        def record(outputs: Any) -> None:
            for part in outputs:
                if isinstance(part, Unsettled):
                    part.settle()
            steps = per_step_scalars(outputs)
            for step in steps:
                for name, value in step.items():
                    history.setdefault(name, []).append(value)
                    epoch_values.setdefault(name, []).append(value)
                hooks.step_end(step)
            display.advance(len(steps), epoch_values)

        pending = None
        # Each batch checked and converted as it arrives, so what a chunk holds is what runs.
        steps = map(prepare, epoch_batches)
        for chunk in _chunks(_without_short_last(steps) if drop_last else steps, steps_per_call):
            outputs = run_steps(chunk)
            if pending is not None:
                record(pending)
            pending = outputs
            if hooks.stop:
                break
        if pending is not None:
            record(pending)
        logs = {f"epoch_{name}": float(np.mean(values)) for name, values in epoch_values.items()}
        if eval_data is not None:
            logs.update({f"val_{name}": value for name, value in _mean_over(evaluate, eval_data).items()})
        for name, value in logs.items():
            history.setdefault(name, []).append(value)
        display.epoch_end(epoch, logs)
        if hooks.epoch_end(epoch, logs):
            break
    hooks.train_end(logs)
    return history
