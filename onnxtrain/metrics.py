"""Metrics for fit() and evaluate(): numbers computed from a batch's predictions and labels.

A metric is a function (predictions, labels) -> float over one batch, both numpy arrays:
predictions as the model outputs them (logits [N, C, ...] for a classifier), labels as the
step takes them (class indices [N, ...], or values shaped like the predictions). fit and
evaluate average each metric over batches weighted by batch size, so a metric that is a mean
over a batch's samples (every built-in one is) comes out as its mean over all samples.

Built-in names: "accuracy", "top_k_accuracy" (k=5), "mae", "mse"; `top_k_accuracy(k)` makes
one for another k. Any function (predictions, labels) -> float may stand beside them; it is
logged under its __name__ (pass a dict {name: function} to choose the name).

Example:
    >>> history = trainer.fit(batches, epochs=3, eval_data=held_out,
    ...                       metrics=["accuracy", onnxtrain.metrics.top_k_accuracy(3)])
    >>> history["val_accuracy"][-1], history["top_3_accuracy"][-1]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Union

import numpy as np

from onnxtrain.errors import InputError

Metric = Callable[[np.ndarray, np.ndarray], float]
MetricsArgument = Union[Sequence[Union[str, Metric]], Mapping[str, Metric], None]


def _classes(predictions: np.ndarray, labels: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-class scores [N, C, ...] and integer class indices [N, ...] for a classification metric.

    Labels shaped like the predictions are one-hot (or class probabilities) and become their
    argmax; labels with one axis fewer are class indices, as SoftmaxCrossEntropyLoss takes them.
    """
    if predictions.ndim < 2:
        raise InputError(f"metric {name!r}: predictions of shape {list(predictions.shape)} have no class "
                         "axis; it needs per-class scores [batch, classes, ...] (for one score per sample, "
                         "use a regression metric or a function of your own)")
    if labels.shape == predictions.shape:
        labels = np.argmax(labels, axis=1)
    expected = predictions.shape[:1] + predictions.shape[2:]
    if labels.shape != expected:
        raise InputError(f"metric {name!r}: predictions of shape {list(predictions.shape)} (class axis 1) "
                         f"need class indices of shape {list(expected)} or one-hot labels of shape "
                         f"{list(predictions.shape)}; got labels of shape {list(labels.shape)}")
    return predictions, labels.astype(np.int64, copy=False)


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    """The fraction of samples whose highest-scoring class (axis 1) is the label.

    Example:
        >>> accuracy(np.array([[2.0, 1.0], [0.0, 3.0]]), np.array([0, 0]))
        0.5
    """
    scores, classes = _classes(predictions, labels, "accuracy")
    return float(np.mean(np.argmax(scores, axis=1) == classes))


def top_k_accuracy(k: int = 5) -> Metric:
    """A metric: the fraction of samples whose label is among the k highest-scoring classes.

    Args:
        k: how many of the top classes count (at least 1).

    Returns:
        The metric function, named "top_{k}_accuracy".

    Raises:
        InputError: k is not a positive integer.

    Example:
        >>> top_k_accuracy(2)(np.array([[3.0, 2.0, 1.0]]), np.array([1]))
        1.0
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InputError(f"top_k_accuracy(k={k!r}): k must be a positive integer")
    name = f"top_{k}_accuracy"

    def metric(predictions: np.ndarray, labels: np.ndarray) -> float:
        scores, classes = _classes(predictions, labels, name)
        label_scores = np.take_along_axis(scores, np.expand_dims(classes, 1), axis=1)
        # A label counts when fewer than k classes score strictly higher (ties favour the label).
        higher = np.sum(scores > label_scores, axis=1)
        return float(np.mean(higher < k))

    metric.__name__ = metric.__qualname__ = name
    return metric


def _same_shape(predictions: np.ndarray, labels: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    if labels.shape != predictions.shape:
        # [N] labels against [N, 1] predictions: the same values, never broadcast to [N, N].
        if labels.size != predictions.size:
            raise InputError(f"metric {name!r} compares predictions of shape {list(predictions.shape)} with "
                             f"labels of the same shape; got labels of shape {list(labels.shape)}")
        labels = labels.reshape(predictions.shape)
    return predictions.astype(np.float64), labels.astype(np.float64)


def mae(predictions: np.ndarray, labels: np.ndarray) -> float:
    """The mean absolute error over every element.

    Example:
        >>> mae(np.array([1.0, 2.0]), np.array([0.0, 4.0]))
        1.5
    """
    predictions, labels = _same_shape(predictions, labels, "mae")
    return float(np.mean(np.abs(predictions - labels)))


def mse(predictions: np.ndarray, labels: np.ndarray) -> float:
    """The mean squared error over every element.

    Example:
        >>> mse(np.array([1.0, 2.0]), np.array([0.0, 4.0]))
        2.5
    """
    predictions, labels = _same_shape(predictions, labels, "mse")
    return float(np.mean((predictions - labels) ** 2))


BUILT_IN: dict[str, Metric] = {"accuracy": accuracy, "top_k_accuracy": top_k_accuracy(5), "mae": mae, "mse": mse}
# Names a metric may not take: they would overwrite the step's own outputs in the logs.
_RESERVED = ("loss",)


def resolve(metrics: MetricsArgument) -> dict[str, Metric]:
    """Metric names and functions from fit's or evaluate's `metrics` argument.

    Args:
        metrics: None, a list of built-in names and functions, or a dict {name: function}.

    Returns:
        {name: function}, in the order given.

    Raises:
        InputError: an unknown name, something neither a name nor a function, a function
            without a usable name (a lambda outside a dict), or a name given twice.
    """
    if metrics is None:
        return {}
    if isinstance(metrics, str) or callable(metrics):
        metrics = [metrics]
    items: Iterable[tuple[Any, Any]]
    if isinstance(metrics, Mapping):
        items = metrics.items()
    else:
        items = [(entry, entry) for entry in metrics]
    resolved: dict[str, Metric] = {}
    for name, entry in items:
        if isinstance(entry, str):
            if entry not in BUILT_IN:
                raise InputError(f"metrics: {entry!r} is not a built-in metric; choose from {sorted(BUILT_IN)} "
                                 "or pass a function (predictions, labels) -> float")
            function = BUILT_IN[entry]
            name = entry if name is entry else name
        elif callable(entry):
            function = entry
            if name is entry:
                name = getattr(entry, "__name__", None)
                if not name or name == "<lambda>":
                    raise InputError("metrics: a lambda or callable object has no name to log it under; "
                                     "pass a dict {name: function} instead")
        else:
            raise InputError(f"metrics: {entry!r} is neither a metric name ({sorted(BUILT_IN)}) nor a "
                             "function (predictions, labels) -> float")
        if not isinstance(name, str) or not name:
            raise InputError(f"metrics: the name {name!r} is not a non-empty string")
        if name in resolved or name in _RESERVED or name.startswith(("val_", "step_")):
            raise InputError(f"metrics: the name {name!r} is given twice or clashes with a logged value "
                             f"(loss, val_*, step_*); pass a dict {{name: function}} to rename it")
        resolved[name] = function
    return resolved


class MetricSet:
    """The metrics of one fit or evaluate call, and where a step's outputs and feeds hold the
    predictions and labels they compare.

    Args:
        metrics: as `resolve` takes it.
        prediction: the step output (and evaluation output) holding the predictions, or None
            when the model does not say which it is.
        label: the feed holding the labels.
        where: names the model part in errors.

    Raises:
        InputError: as `resolve`; or metrics were asked for where prediction or label is unknown.
    """

    def __init__(self, metrics: MetricsArgument, prediction: str | None, label: str | None, where: str):
        self.metrics = resolve(metrics)
        self.prediction, self.label, self.where = prediction, label, where
        if self.metrics and (prediction is None or label is None):
            raise InputError(
                f"{where}: metrics={list(self.metrics)} need the model's predictions and labels, but this "
                "training model does not name them (models built by make_training_model or finetune do; "
                "a hand-written recipe does not); call infer() on held-out data and compute them yourself")

    def __bool__(self) -> bool:
        return bool(self.metrics)

    def __call__(self, predictions: Any, labels: Any) -> dict[str, float]:
        """Each metric's value on one batch."""
        predictions, labels = np.asarray(predictions), np.asarray(labels)
        values = {}
        for name, metric in self.metrics.items():
            try:
                values[name] = float(metric(predictions, labels))
            except InputError:
                raise
            except Exception as error:
                raise InputError(f"{self.where}: metric {name!r} failed on predictions of shape "
                                 f"{list(predictions.shape)} and labels of shape {list(labels.shape)}: "
                                 f"{type(error).__name__}: {error}") from error
        return values


class WeightedMeans:
    """Running means of named values, each batch weighted by its batch size."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._weights: dict[str, float] = {}

    def add(self, values: Mapping[str, float], weight: float) -> None:
        """Count `values` of one batch of `weight` samples."""
        for name, value in values.items():
            self._sums[name] = self._sums.get(name, 0.0) + weight * value
            self._weights[name] = self._weights.get(name, 0.0) + weight

    def result(self) -> dict[str, float]:
        """Each value's weighted mean so far."""
        return {name: total / self._weights[name] if self._weights[name] else float("nan")
                for name, total in self._sums.items()}


def batch_size(feeds: Mapping[str, Any]) -> int:
    """A batch's size: axis 0 of its first feed with an axis (1 when every feed is a scalar)."""
    for value in feeds.values():
        shape = np.shape(value) if isinstance(value, (np.ndarray, np.generic)) or hasattr(value, "shape") else ()
        if shape:
            return int(shape[0])
    return 1


__all__ = ["Metric", "MetricSet", "WeightedMeans", "accuracy", "batch_size", "mae", "mse", "resolve",
           "top_k_accuracy"]
