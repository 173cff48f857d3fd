"""The training loop of Trainer and FineTuner: epochs, progress bar, history, metrics, callbacks.

History is Keras-like, one value per epoch under each name:

- `history["loss"]` (and every other scalar step output, and each metric such as
  `history["accuracy"]`): the epoch's mean over its training steps, each step weighted by its
  batch size; metrics come from each step's own prediction, so they describe the model as it
  trained (Dropout active, BatchNorm on batch statistics), like Keras's;
- `history["val_loss"]`, `history["val_accuracy"]`: the same over eval_data after the epoch,
  with inference semantics (see Core.evaluate);
- `history["step_loss"]`, `history["step_accuracy"]`: one value per training step.

The logs a callback gets after each epoch hold the epoch's values ("loss", "val_loss", ...).
Callbacks (onnxtrain.callbacks) run at the start and end of training, of each epoch and of
each step; what fit prints follows Keras's verbose levels (onnxtrain._engine.progress).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from onnxtrain._engine.batches import StackBuilder
from onnxtrain._engine.faults import Stacked, Unsettled
from onnxtrain._engine.feeds import owned
from onnxtrain._engine.compiled import watching_compiles
from onnxtrain._engine.progress import Progress, verbosity
from onnxtrain.callbacks import CallbackLike, CallbackList
from onnxtrain.data import short_last, short_probe
from onnxtrain.errors import InputError
from onnxtrain.metrics import MetricSet, WeightedMeans, batch_size

Feeds = Mapping[str, Any]
Batches = Iterable[Feeds] | Callable[[], Iterable[Feeds]]
# A Callback object, or callback(epoch, logs) -> True to stop training after this epoch.
Callback = CallbackLike


def _scalars(outputs: Mapping[str, Any], skip: Container[str] = ()) -> dict[str, float]:
    return {name: float(np.asarray(value)) for name, value in outputs.items()
            if np.size(value) == 1 and name not in skip}


def per_step_scalars(parts: Sequence[Mapping[str, Any]], skip: Container[str] = ()) -> list[dict[str, float]]:
    """Scalar outputs of each step (but those named in `skip`), from one step's outputs or
    Stacked ones per part (one transfer per stacked array, however many steps it holds)."""
    steps = []
    for part in parts:
        if not isinstance(part, Stacked):
            steps.append(_scalars(part, skip))
            continue
        host = {name: np.asarray(value) for name, value in part.items() if name not in skip}
        count = len(next(iter(host.values()))) if host else 0
        steps += [{name: float(value[i]) for name, value in host.items() if value[i].size == 1}
                  for i in range(count)]
    return steps


def per_step_values(parts: Sequence[Mapping[str, Any]], name: str) -> list[np.ndarray]:
    """Output `name` of each step, on the host."""
    values: list[np.ndarray] = []
    for part in parts:
        value = np.asarray(part[name])
        values += list(value) if isinstance(part, Stacked) else [value]
    return values


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


def _prepared(batches: Iterable[Feeds], prepare: Callable[[Feeds], Feeds], drop_last: bool,
              probe: bool, ahead: Callable[[list[Feeds]], None] | None = None) -> Iterator[Feeds]:
    """Each batch through prepare. Under drop_last, a last batch whose batch size differs from
    the first's is left out even where prepare refuses it (a model exported for one batch
    size); refused anywhere else, it raises. With probe and without drop_last, a short last
    batch known ahead (see onnxtrain.data.short_probe) is checked with the first batch, so a
    step that refuses it fails before any step has run, not at the end of an epoch; then,
    with probe, ahead(the first batch and that short one, checked) runs before the first yield."""
    first_rows, refused = None, None
    for feeds in batches:
        if refused is not None:
            raise refused
        try:
            checked = prepare(feeds)
        except InputError as error:
            if not (drop_last and first_rows is not None and _other_rows(feeds, first_rows)):
                raise
            refused = error
            continue
        if first_rows is None:
            first_rows = _rows(checked)
            short = _check_short_last(batches, feeds, prepare) if probe and not drop_last else None
            if probe and ahead is not None:
                ahead([checked] if short is None else [checked, short])
        yield checked


def _check_short_last(batches: Iterable[Feeds], first: Feeds, prepare: Callable[[Feeds], Feeds]) -> Feeds | None:
    """prepare() on `first` cut to the rows of the short batch known to end each epoch, if any:
    what it returns."""
    found = short_probe(batches, first)
    if found is None:
        return None
    rows, probe = found
    try:
        return prepare(probe)
    except InputError as error:
        raise InputError(f"every epoch ends in a batch of {rows} rows, which the training step refuses "
                         f"(found before the first step; nothing has trained): {error}") from None


def _compiling(display: Progress, ahead: Callable[[list[Feeds]], None], known: list[Feeds]) -> None:
    with display.compiling("fit"):
        ahead(known)


def _other_rows(feeds: Feeds, rows: list[tuple[int, ...]]) -> bool:
    """Whether a batch not yet checked has batch sizes other than `rows`."""
    try:
        return _rows(feeds) != rows
    except ValueError:  # a ragged nested list has no shape
        return False


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


def evaluate_batches(evaluate: Callable[[Feeds], tuple[Mapping[str, Any], Mapping[str, Any]]],
                     batches: Batches, metrics: MetricSet | None = None) -> dict[str, float]:
    """Scalar outputs and metrics over `batches`, each batch weighted by its batch size.

    evaluate(feeds) returns (outputs, the feeds as checked); metrics compare
    outputs[metrics.prediction] with the checked feeds[metrics.label].
    """
    means = WeightedMeans()
    skip = () if metrics is None or metrics.prediction is None else (metrics.prediction,)
    for feeds in _epoch_batches(batches):
        outputs, checked = evaluate(feeds)
        values = _scalars(outputs, skip)
        if metrics:
            values.update(metrics(outputs[metrics.prediction], checked[metrics.label]))
        means.add(values, batch_size(checked))
    return means.result()


def fit(run_steps: Callable[[list[Feeds]], Sequence[Mapping[str, Any]]],
        batches: Batches, epochs: int = 1, progress: bool | None = None, callbacks: Sequence[Callback] = (),
        evaluate: Callable[[Feeds], tuple[Mapping[str, Any], Mapping[str, Any]]] | None = None,
        eval_data: Batches | None = None, steps_per_call: int = 1, drop_last: bool = False,
        prepare: Callable[[Feeds], Feeds] = lambda feeds: feeds, metrics: MetricSet | None = None, *,
        verbose: int | str | None = None, trainer: Any = None,
        ahead: Callable[[list[Feeds]], None] | None = None) -> dict[str, list[float]]:
    """Run `run_steps` over `batches`, `steps_per_call` batches at a time, for `epochs` epochs.

    run_steps(chunk) runs one step per batch of the chunk and returns their outputs, as parts
    (see per_step_scalars). Values come back to the host one chunk late, and so do the NaN/Inf
    checks of Unsettled parts (their `settle`), so the host prepares the next chunk while the
    device computes this one, never waiting for a progress-bar update. drop_last skips an
    epoch's last batch when its batch size differs from the first's. prepare(feeds) checks and
    converts each batch as it arrives, before a chunk holds it. evaluate(feeds) returns
    (outputs, checked feeds) for one batch of eval_data (see evaluate_batches). metrics:
    computed from each step's output metrics.prediction and feed metrics.label. verbose
    (progress=False is 0): see onnxtrain._engine.progress. callbacks: Callback objects or
    functions (epoch, logs) -> True to stop; `trainer` is what their on_train_begin receives.
    ahead(batches) gets the programs ready that the first epoch will run, given its first
    batch and the short last one known ahead (checked), before the first step; the bar says
    "compiling" meanwhile.
    A stop asked for by a step hook ends the epoch after the chunk already dispatched.

    Returns:
        The history (see the module docstring).
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
    skip = () if metrics is None or metrics.prediction is None else (metrics.prediction,)
    history: dict[str, list[float]] = {}
    logs: dict[str, float] = {}
    shown_ahead = None if ahead is None else functools.partial(_compiling, display, ahead)
    hooks.train_begin()
    # A compile shows on the bar as such, not as a slow step.
    with watching_compiles(display):
        for epoch in range(epochs):
            epoch_batches = _epoch_batches(batches)
            total = len(epoch_batches) if hasattr(epoch_batches, "__len__") else None
            if total and drop_last and short_last(epoch_batches) is not None:
                total -= 1
            hooks.epoch_begin(epoch, total)
            display.epoch_begin(epoch, total)
            recent: dict[str, list[float]] = {}
            means = WeightedMeans()

            def record(outputs: Any, labels: list[np.ndarray], sizes: list[int]) -> None:
                for part in outputs:
                    if isinstance(part, Unsettled):
                        part.settle()
                steps = per_step_scalars(outputs, skip)
                if metrics:
                    for step, prediction, label in zip(steps, per_step_values(outputs, metrics.prediction), labels):
                        step.update(metrics(prediction, label))
                for step, size in zip(steps, sizes):
                    means.add(step, size)
                    for name, value in step.items():
                        history.setdefault(f"step_{name}", []).append(value)
                        recent.setdefault(name, []).append(value)
                    hooks.step_end(step)
                display.advance(len(steps), recent)

            pending = None
            # Each batch checked and converted as it arrives, so what a chunk holds is what runs.
            steps = _prepared(epoch_batches, prepare, drop_last, probe=epoch == 0, ahead=shown_ahead)
            for chunk in _chunks(_without_short_last(steps) if drop_last else steps, steps_per_call):
                # Labels are copied now: a loader may refill their buffer before the outputs come back.
                labels = [np.array(feeds[metrics.label]) for feeds in chunk] if metrics else []
                sizes = [batch_size(feeds) if isinstance(feeds, Mapping) else 1 for feeds in chunk]
                outputs = run_steps(chunk)
                if pending is not None:
                    record(*pending)
                pending = (outputs, labels, sizes)
                if hooks.stop:
                    break
            if pending is not None:
                record(*pending)
            logs = means.result()
            if eval_data is not None:
                evaluated = evaluate_batches(evaluate, eval_data, metrics)
                logs.update({f"val_{name}": value for name, value in evaluated.items()})
            for name, value in logs.items():
                history.setdefault(name, []).append(value)
            display.epoch_end(epoch, logs)
            if hooks.epoch_end(epoch, logs):
                break
    hooks.train_end(logs)
    return history
