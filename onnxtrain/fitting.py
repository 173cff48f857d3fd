"""The training loop shared by Trainer and FineTuner: epochs, progress bar, history, callbacks.

History is Keras-like: `history[name]` lists every step's value of each scalar
output (e.g. "loss"), `history["epoch_" + name]` the per-epoch means, and
`history["val_" + name]` the per-epoch means over eval_data. The progress bar
comes from tqdm.auto, so it renders in Jupyter as well as in terminals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from onnxtrain.errors import InputError

Feeds = Mapping[str, Any]
Batches = Iterable[Feeds] | Callable[[], Iterable[Feeds]]
# callback(epoch, logs) -> True to stop training after this epoch.
Callback = Callable[[int, dict[str, float]], bool | None]


def _scalars(outputs: Mapping[str, Any]) -> dict[str, float]:
    return {name: float(np.asarray(value)) for name, value in outputs.items() if np.size(value) == 1}


def _epoch_batches(batches: Batches) -> Iterable[Feeds]:
    return batches() if callable(batches) else batches


def _mean_over(evaluate: Callable[[Feeds], Mapping[str, Any]], batches: Batches) -> dict[str, float]:
    totals: dict[str, list[float]] = {}
    for feeds in _epoch_batches(batches):
        for name, value in _scalars(evaluate(feeds)).items():
            totals.setdefault(name, []).append(value)
    return {name: float(np.mean(values)) for name, values in totals.items()}


def fit(step: Callable[[Feeds], Mapping[str, Any]], batches: Batches, epochs: int = 1,
        progress: bool = True, callbacks: Sequence[Callback] = (),
        evaluate: Callable[[Feeds], Mapping[str, Any]] | None = None,
        eval_data: Batches | None = None) -> dict[str, list[float]]:
    """Run `step` over `batches` for `epochs` epochs; the history (see module docstring)."""
    from tqdm.auto import tqdm

    if epochs > 1 and not callable(batches) and iter(batches) is batches:
        raise InputError("fit(epochs>1) needs batches it can iterate again: a list, a re-iterable "
                         "dataset, or a function returning a new iterator each epoch")
    if eval_data is not None and evaluate is None:
        raise InputError("eval_data needs an evaluation function")
    history: dict[str, list[float]] = {}
    for epoch in range(epochs):
        epoch_values: dict[str, list[float]] = {}
        bar = tqdm(_epoch_batches(batches), desc=f"epoch {epoch + 1}/{epochs}", disable=not progress,
                   leave=epoch == epochs - 1)
        for feeds in bar:
            values = _scalars(step(feeds))
            for name, value in values.items():
                history.setdefault(name, []).append(value)
                epoch_values.setdefault(name, []).append(value)
            bar.set_postfix({name: f"{np.mean(v[-20:]):.4g}" for name, v in epoch_values.items()},
                            refresh=False)
        logs = {f"epoch_{name}": float(np.mean(values)) for name, values in epoch_values.items()}
        if eval_data is not None:
            logs.update({f"val_{name}": value for name, value in _mean_over(evaluate, eval_data).items()})
        for name, value in logs.items():
            history.setdefault(name, []).append(value)
        if progress and logs:
            bar.write(f"epoch {epoch + 1}/{epochs}: " + ", ".join(f"{k} {v:.4g}" for k, v in logs.items()))
        if any(callback(epoch, logs) for callback in callbacks):
            break
    return history
