"""Reductions: ReduceSum/Mean/Max/Min/Prod/L1/L2/LogSum/LogSumExp/SumSquare.

Up to opset 12 (17 for all but ReduceSum) the reduced axes are an attribute;
from ReduceSum-13 and the other Reduce*-18 on they are an optional input,
and `noop_with_empty_axes` turns "no axes" from "all axes" into "no axes".
Composite reductions still apply their element-wise steps on a no-op (so
ReduceSumSquare squares, ReduceLogSum takes the log).

16-bit floats are reduced in float32 and cast back: ONNX's reference
tolerances assume a wide accumulator. Results always keep the input dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp
from jax.typing import ArrayLike
from numpy.typing import DTypeLike

from onnxtrain.translate.node import Node
from onnxtrain.translate.ops.common import host_ints
from onnxtrain.translate.registry import op

Axes = tuple[int, ...]
Reduction = Callable[[jax.Array, Axes, bool], jax.Array]

_HALF_FLOATS = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def compute_dtype(dtype: DTypeLike, float_math: bool = False) -> np.dtype:
    """The dtype to compute in: float32 for 16-bit floats; float64 for integers
    when the computation needs real arithmetic (`float_math`); else `dtype`."""
    dtype = np.dtype(dtype)
    if dtype in _HALF_FLOATS:
        return np.dtype(np.float32)
    if float_math and dtype.kind in "iub":
        return np.dtype(np.float64)
    return dtype


def widened(x: ArrayLike) -> jax.Array:
    """x in its compute dtype (float32 for 16-bit floats, unchanged otherwise)."""
    x = jnp.asarray(x)
    return x.astype(compute_dtype(x.dtype))


def reduction_axes(node: Node, data: ArrayLike, axes: ArrayLike | None) -> Axes:
    """The normalized axes a Reduce* node reduces over.

    `axes` is the axes input (None when omitted); older opsets use the `axes`
    attribute instead. No axes means every axis, or none at all when
    noop_with_empty_axes is set.
    """
    rank = jnp.ndim(data)
    listed = node.attr("axes", None) if axes is None else host_ints(node, axes, "axes")
    if not listed:
        return () if node.attr("noop_with_empty_axes", 0) else tuple(range(rank))
    if any(not -rank <= a < rank for a in listed):
        raise node.error(f"axes {listed} are out of range for an input of rank {rank}")
    normalized = tuple(sorted(a % rank for a in listed))
    if len(set(normalized)) != len(normalized):
        raise node.error(f"axes {listed} name the same axis twice")
    return normalized


def _reduce(node: Node, data: ArrayLike, axes: ArrayLike | None, reduction: Reduction,
            float_math: bool = False) -> jax.Array:
    """Apply `reduction(x, axes, keepdims)` in the compute dtype; cast back to data's dtype."""
    x = jnp.asarray(data)
    dims = reduction_axes(node, x, axes)
    keepdims = bool(node.attr("keepdims", 1))
    result = reduction(x.astype(compute_dtype(x.dtype, float_math)), dims, keepdims)
    return result.astype(x.dtype)


def _lowest(dtype: np.dtype) -> bool | float | int:
    """The identity of max: -inf, the smallest integer, or False."""
    if dtype == np.bool_:
        return False
    return -np.inf if dtype.kind == "f" else np.iinfo(dtype).min


def _highest(dtype: np.dtype) -> bool | float | int:
    """The identity of min: +inf, the largest integer, or True."""
    if dtype == np.bool_:
        return True
    return np.inf if dtype.kind == "f" else np.iinfo(dtype).max


def _sum(x: jax.Array, axes: Axes, keepdims: bool) -> jax.Array:
    return jnp.sum(x, axis=axes, keepdims=keepdims, dtype=x.dtype)


def _mean(x: jax.Array, axes: Axes, keepdims: bool) -> jax.Array:
    return jnp.mean(x, axis=axes, keepdims=keepdims)


def _max(x: jax.Array, axes: Axes, keepdims: bool) -> jax.Array:
    return jnp.max(x, axis=axes, keepdims=keepdims, initial=_lowest(x.dtype))


def _min(x: jax.Array, axes: Axes, keepdims: bool) -> jax.Array:
    return jnp.min(x, axis=axes, keepdims=keepdims, initial=_highest(x.dtype))


def _prod(x: jax.Array, axes: Axes, keepdims: bool) -> jax.Array:
    return jnp.prod(x, axis=axes, keepdims=keepdims, dtype=x.dtype)


def _l1(x: jax.Array, axes: Axes, keepdims: bool) -> jax.Array:
    return _sum(jnp.abs(x), axes, keepdims)


def _sum_square(x: jax.Array, axes: Axes, keepdims: bool) -> jax.Array:
    return _sum(x * x, axes, keepdims)


def _l2(x: jax.Array, axes: Axes, keepdims: bool) -> jax.Array:
    return jnp.sqrt(_sum_square(x, axes, keepdims))


def _log_sum(x: jax.Array, axes: Axes, keepdims: bool) -> jax.Array:
    return jnp.log(_sum(x, axes, keepdims))


def _log_sum_exp(x: jax.Array, axes: Axes, keepdims: bool) -> jax.Array:
    return logsumexp(x, axis=axes, keepdims=keepdims)


@op("ReduceSum", since=1)
@op("ReduceSum", since=13, static_inputs=(1,))
def reduce_sum(node: Node, data: ArrayLike, axes: ArrayLike | None = None) -> jax.Array:
    """Sum over the axes; an empty set sums to 0."""
    return _reduce(node, data, axes, _sum)


@op("ReduceMean", since=1)
@op("ReduceMean", since=18, static_inputs=(1,))
def reduce_mean(node: Node, data: ArrayLike, axes: ArrayLike | None = None) -> jax.Array:
    """Arithmetic mean over the axes (integers truncate toward zero); an empty set gives NaN."""
    return _reduce(node, data, axes, _mean, float_math=True)


@op("ReduceMax", since=1)
@op("ReduceMax", since=18, static_inputs=(1,))
def reduce_max(node: Node, data: ArrayLike, axes: ArrayLike | None = None) -> jax.Array:
    """Maximum over the axes (False < True); an empty set gives -inf or the dtype's minimum."""
    return _reduce(node, data, axes, _max)


@op("ReduceMin", since=1)
@op("ReduceMin", since=18, static_inputs=(1,))
def reduce_min(node: Node, data: ArrayLike, axes: ArrayLike | None = None) -> jax.Array:
    """Minimum over the axes; an empty set gives +inf or the dtype's maximum."""
    return _reduce(node, data, axes, _min)


@op("ReduceProd", since=1)
@op("ReduceProd", since=18, static_inputs=(1,))
def reduce_prod(node: Node, data: ArrayLike, axes: ArrayLike | None = None) -> jax.Array:
    """Product over the axes; an empty set gives 1."""
    return _reduce(node, data, axes, _prod)


@op("ReduceL1", since=1)
@op("ReduceL1", since=18, static_inputs=(1,))
def reduce_l1(node: Node, data: ArrayLike, axes: ArrayLike | None = None) -> jax.Array:
    """Sum of absolute values over the axes; an empty set gives 0."""
    return _reduce(node, data, axes, _l1)


@op("ReduceL2", since=1)
@op("ReduceL2", since=18, static_inputs=(1,))
def reduce_l2(node: Node, data: ArrayLike, axes: ArrayLike | None = None) -> jax.Array:
    """Euclidean norm sqrt(sum(x^2)) over the axes; an empty set gives 0."""
    return _reduce(node, data, axes, _l2, float_math=True)


@op("ReduceSumSquare", since=1)
@op("ReduceSumSquare", since=18, static_inputs=(1,))
def reduce_sum_square(node: Node, data: ArrayLike, axes: ArrayLike | None = None) -> jax.Array:
    """Sum of squares over the axes; an empty set gives 0."""
    return _reduce(node, data, axes, _sum_square)


@op("ReduceLogSum", since=1)
@op("ReduceLogSum", since=18, static_inputs=(1,))
def reduce_log_sum(node: Node, data: ArrayLike, axes: ArrayLike | None = None) -> jax.Array:
    """log(sum(x)) over the axes; an empty set gives -inf."""
    return _reduce(node, data, axes, _log_sum, float_math=True)


@op("ReduceLogSumExp", since=1)
@op("ReduceLogSumExp", since=18, static_inputs=(1,))
def reduce_log_sum_exp(node: Node, data: ArrayLike, axes: ArrayLike | None = None) -> jax.Array:
    """log(sum(exp(x))) over the axes, computed stably; an empty set gives -inf."""
    return _reduce(node, data, axes, _log_sum_exp, float_math=True)
