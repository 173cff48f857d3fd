"""Losses: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

Both take scores shaped (N, C) or (N, C, d1, ..., dk) and integer targets
shaped (N) or (N, d1, ..., dk). Targets equal to `ignore_index` contribute
nothing, not even to the weight total that `mean` divides by; an optional
per-class weight (C) scales each element's loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from onnxtrain.translate.node import Node
from onnxtrain.translate.ops.reduce import widened
from onnxtrain.translate.registry import op

_REDUCTIONS = ("none", "sum", "mean")


def _check_shapes(node: Node, scores: jax.Array, target: jax.Array) -> None:
    if scores.ndim < 2:
        raise node.error(f"input must have shape (N, C, ...), got {tuple(scores.shape)}")
    expected = (scores.shape[0],) + tuple(scores.shape[2:])
    if tuple(target.shape) != expected:
        raise node.error(f"target has shape {tuple(target.shape)}, expected {expected} for "
                         f"input of shape {tuple(scores.shape)}")


def _reduction(node: Node) -> str:
    reduction = node.attr("reduction", "mean")
    if reduction not in _REDUCTIONS:
        raise node.error(f"reduction must be one of {', '.join(_REDUCTIONS)}, not {reduction!r}")
    return reduction


def _negative_log_likelihood(node: Node, log_prob: jax.Array, target: ArrayLike,
                             weight: ArrayLike | None) -> jax.Array:
    """-log_prob[n, target[n, d...], d...] * weight[target], reduced as `reduction` says.

    log_prob is already in the compute dtype; ignored targets weigh 0 and never index.
    """
    target = jnp.asarray(target)
    _check_shapes(node, log_prob, target)
    ignore_index = node.attr("ignore_index", None)
    kept = jnp.ones(target.shape, bool) if ignore_index is None else target != ignore_index
    safe_target = jnp.where(kept, target, 0)
    picked = jnp.take_along_axis(log_prob, jnp.expand_dims(safe_target, 1), axis=1).squeeze(1)
    element_weight = kept.astype(log_prob.dtype)
    if weight is not None:
        element_weight = element_weight * widened(weight)[safe_target]
    loss = -picked * element_weight
    reduction = _reduction(node)
    if reduction == "sum":
        return jnp.sum(loss)
    if reduction == "mean":
        return jnp.sum(loss) / jnp.sum(element_weight)
    return loss


@op("NegativeLogLikelihoodLoss", since=12)
def negative_log_likelihood_loss(node: Node, log_prob: ArrayLike, target: ArrayLike,
                                 weight: ArrayLike | None = None) -> jax.Array:
    """loss = -log_prob[n, target[n, d...], d...] * weight[target[n, d...]]; reduction
    none/sum/mean (mean divides by the total weight of the counted targets)."""
    log_prob = jnp.asarray(log_prob)
    return _negative_log_likelihood(node, widened(log_prob), target, weight).astype(log_prob.dtype)


@op("SoftmaxCrossEntropyLoss", since=12)
def softmax_cross_entropy_loss(node: Node, scores: ArrayLike, labels: ArrayLike,
                               weights: ArrayLike | None = None) -> tuple[jax.Array, jax.Array]:
    """NegativeLogLikelihoodLoss of LogSoftmax(scores) over the class axis 1; the
    second output is that log-probability tensor."""
    scores = jnp.asarray(scores)
    log_prob = jax.nn.log_softmax(widened(scores), axis=1)
    loss = _negative_log_likelihood(node, log_prob, labels, weights)
    return loss.astype(scores.dtype), log_prob.astype(scores.dtype)
