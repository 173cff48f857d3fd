"""Indexing: gathers and scatters, selections (Compress, NonZero, Unique, TopK, ArgMax/ArgMin),
masks (OneHot, Trilu), running totals (CumSum, CumProd) and ReverseSequence.

Negative indices count from the end of their axis. Index tensors known on the
host are range-checked (an invalid model is an error); traced ones cannot be,
and out-of-range entries then read or write nothing useful, as in XLA.
NonZero and Unique have data-dependent output shapes: traced inputs make the
model run op by op (NeedsHostValues).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from onnxtrain.translate.ops.common import host_ints, normalize_axis
from onnxtrain.translate.ops.shape import array_module, checked_axis
from onnxtrain.translate.registry import op
from onnxtrain.translate.values import NeedsHostValues, known_value


def wrap_indices(node: Any, indices: Any, dims: Any) -> Any:
    """Indices with negatives counted from the end of axes of size `dims` (broadcast).

    Known indices (see known_value) become numpy and must lie in [-dims, dims); traced ones
    are not checked.
    """
    known = known_value(indices)
    if known is not None:
        indices = known.astype(np.int64)
        outside = (indices < -np.asarray(dims)) | (indices >= np.asarray(dims))
        if np.any(outside):
            raise node.error(f"index {indices[outside][0]} is out of range for an axis of size "
                             f"{np.broadcast_to(dims, indices.shape)[outside][0]}")
        return np.where(indices < 0, indices + dims, indices)
    return jnp.where(indices < 0, indices + jnp.asarray(dims, indices.dtype), indices)


def _element_coordinates(indices: Any, axis: int) -> tuple:
    """Per-element coordinates of an index tensor: its own position, except `indices` on `axis`."""
    xp = np if isinstance(indices, np.ndarray) else jnp
    coordinates = list(xp.indices(np.shape(indices), sparse=True))
    coordinates[axis] = indices
    return tuple(coordinates)


def _single_int(node: Any, value: Any, what: str) -> int:
    values = host_ints(node, value, what)
    if len(values) != 1:
        raise node.error(f"{what} must be a single integer, got {values}")
    return values[0]


def _require_host(node: Any, value: Any, why: str) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise NeedsHostValues(node.label, why)
    return value


# --- Gathers ------------------------------------------------------------------------


@op("Gather", since=1)
def gather(node: Any, data: Any, indices: Any) -> Any:
    """Take entries of `data` along `axis` at `indices`; the output replaces that axis
    by the index tensor's shape."""
    axis = checked_axis(node, node.attr("axis", 0), np.ndim(data))
    indices = wrap_indices(node, indices, np.shape(data)[axis])
    return array_module(data).take(data, indices, axis=axis)


@op("GatherElements", since=11)
def gather_elements(node: Any, data: Any, indices: Any) -> Any:
    """out[i][j][k] = data[i][indices[i][j][k]][k] (for axis 1); the output has the indices' shape."""
    axis = checked_axis(node, node.attr("axis", 0), np.ndim(data))
    if np.ndim(indices) != np.ndim(data):
        raise node.error(f"indices shape {np.shape(indices)} and data shape {np.shape(data)} "
                         f"must have the same rank")
    indices = wrap_indices(node, indices, np.shape(data)[axis])
    return data[_element_coordinates(indices, axis)]


def _nd_coordinates(node: Any, data: Any, indices: Any, batch_dims: int) -> tuple:
    """Index tuple into `data` for GatherND/ScatterND: batch positions, then indices[..., j]."""
    depth = np.shape(indices)[-1]
    batch_shape = np.shape(indices)[:batch_dims]
    if batch_dims + depth > np.ndim(data) or batch_shape != np.shape(data)[:batch_dims]:
        raise node.error(f"indices shape {np.shape(indices)} does not index data shape "
                         f"{np.shape(data)} with batch_dims={batch_dims}")
    indices = wrap_indices(node, indices, np.array(np.shape(data)[batch_dims:batch_dims + depth]))
    xp = np if isinstance(indices, np.ndarray) else jnp
    batch = tuple(xp.indices(np.shape(indices)[:-1], sparse=True))[:batch_dims]
    return batch + tuple(indices[..., j] for j in range(depth))


@op("GatherND", since=11)
def gather_nd(node: Any, data: Any, indices: Any) -> Any:
    """Slices of `data` addressed by the last axis of `indices`; the first `batch_dims`
    (opset 12) axes of both are matched batch axes."""
    batch_dims = node.attr("batch_dims", 0)
    return data[_nd_coordinates(node, data, indices, batch_dims)]


# --- Scatters -----------------------------------------------------------------------

_REDUCTIONS = {"none": "set", "add": "add", "mul": "multiply", "max": "max", "min": "min"}


def _scatter(node: Any, data: Any, coordinates: tuple, updates: Any) -> jax.Array:
    """A copy of `data` with `updates` written (or combined by `reduction`) at `coordinates`."""
    reduction = node.attr("reduction", "none")
    if reduction not in _REDUCTIONS:
        raise node.error(f"reduction {reduction!r} is not one of {sorted(_REDUCTIONS)}")
    data = jnp.asarray(data)
    # JAX differentiates a multiplying scatter only when told the indices are unique;
    # host-known indices can be checked.
    unique = reduction == "mul" and _unique_host_coordinates(coordinates)
    return getattr(data.at[coordinates], _REDUCTIONS[reduction])(
        jnp.asarray(updates, data.dtype), **({"unique_indices": True} if unique else {}))


def _unique_host_coordinates(coordinates: tuple) -> bool:
    if not coordinates or not all(isinstance(c, np.ndarray) for c in coordinates):
        return False
    shape = np.broadcast_shapes(*[c.shape for c in coordinates])
    stacked = np.stack([np.broadcast_to(c, shape).ravel() for c in coordinates], axis=1)
    return len(np.unique(stacked, axis=0)) == len(stacked)


@op("Scatter", since=9)
@op("ScatterElements", since=11)
def scatter_elements(node: Any, data: Any, indices: Any, updates: Any) -> jax.Array:
    """data with data[i][indices[i][j][k]][k] = updates[i][j][k] (for axis 1), or combined by
    `reduction` add/mul (opset 16), max/min (opset 18). Scatter is its deprecated name."""
    axis = checked_axis(node, node.attr("axis", 0), np.ndim(data))
    if np.shape(indices) != np.shape(updates) or np.ndim(indices) != np.ndim(data):
        raise node.error(f"indices {np.shape(indices)} and updates {np.shape(updates)} must have "
                         f"one shape, of the rank of data {np.shape(data)}")
    indices = wrap_indices(node, indices, np.shape(data)[axis])
    return _scatter(node, data, _element_coordinates(indices, axis), updates)


@op("ScatterND", since=11)
def scatter_nd(node: Any, data: Any, indices: Any, updates: Any) -> jax.Array:
    """data with the slices addressed by the last axis of `indices` replaced by `updates`,
    or combined by `reduction` add/mul (opset 16), max/min (opset 18)."""
    coordinates = _nd_coordinates(node, data, indices, 0)
    expected = np.shape(indices)[:-1] + np.shape(data)[np.shape(indices)[-1]:]
    if np.shape(updates) != expected:
        raise node.error(f"updates shape {np.shape(updates)} should be {expected}")
    return _scatter(node, data, coordinates, updates)


@op("TensorScatter", since=24)
def tensor_scatter(node: Any, past_cache: Any, update: Any, write_indices: Any = None) -> jax.Array:
    """The cache with `update` written along the sequence `axis` from write_indices[batch]
    (default 0) on; mode 'circular' wraps positions modulo the cache length."""
    rank = np.ndim(past_cache)
    axis = checked_axis(node, node.attr("axis", -2), rank)
    mode = node.attr("mode", "linear")
    if axis == 0:
        raise node.error("axis cannot be 0, the batch axis")
    if mode not in ("linear", "circular"):
        raise node.error(f"mode {mode!r} is not 'linear' or 'circular'")
    cache_shape, update_shape = np.shape(past_cache), np.shape(update)
    if (np.ndim(update) != rank or update_shape[axis] > cache_shape[axis]
            or any(u != c for i, (u, c) in enumerate(zip(update_shape, cache_shape)) if i != axis)):
        raise node.error(f"update shape {update_shape} does not fit cache shape {cache_shape} "
                         f"along axis {axis}")
    if write_indices is None:
        write_indices = np.zeros(cache_shape[0], np.int64)
    known = known_value(write_indices)
    if mode == "linear" and known is not None and np.any(known + update_shape[axis] > cache_shape[axis]):
        raise node.error(f"write_indices {known.tolist()} plus {update_shape[axis]} new "
                         f"entries overrun the cache length {cache_shape[axis]} in linear mode")
    coordinates = list(jnp.indices(update_shape, sparse=True))
    starts = jnp.reshape(write_indices, (-1,) + (1,) * (rank - 1))
    positions = starts + coordinates[axis]
    if mode == "circular":
        positions = positions % cache_shape[axis]
    coordinates[axis] = positions
    return jnp.asarray(past_cache).at[tuple(coordinates)].set(update)


# --- Masks: OneHot, Trilu ---------------------------------------------------------------


@op("OneHot", since=9, static_inputs=(1,))
def one_hot(node: Any, indices: Any, depth: Any, values: Any) -> jax.Array:
    """values[1] where the new `axis` position equals the index (negatives count from
    `depth`), values[0] elsewhere; out-of-range (or fractional) indices give all-off rows."""
    size = _single_int(node, depth, "depth")
    if np.size(values) != 2:
        raise node.error(f"values must hold [off_value, on_value], got {np.size(values)} elements")
    axis = normalize_axis(node.attr("axis", -1), np.ndim(indices) + 1)
    if not 0 <= axis <= np.ndim(indices):
        raise node.error(f"axis {node.attr('axis', -1)} out of range for rank {np.ndim(indices) + 1}")
    # Compared exactly, as onnxruntime does: a fractional index matches no position.
    positions = jnp.asarray(indices)
    positions = positions.astype(np.int64 if jnp.issubdtype(positions.dtype, jnp.integer) else np.float64)
    positions = jnp.where(positions < 0, positions + size, positions)
    hot = jnp.expand_dims(positions, axis) == jnp.expand_dims(
        jnp.arange(size), tuple(i for i in range(np.ndim(indices) + 1) if i != axis))
    off, on = jnp.reshape(values, (2,))
    return jnp.where(hot, on, off)


@op("Trilu", since=14, static_inputs=(1,))
def trilu(node: Any, x: Any, k: Any = None) -> jax.Array:
    """Keep the upper (upper=1) or lower triangle of the last two axes from diagonal `k`;
    zero the rest."""
    diagonal = 0 if k is None else _single_int(node, k, "k")
    if np.ndim(x) < 2:
        raise node.error(f"input must have rank >= 2, got shape {np.shape(x)}")
    return jnp.triu(x, diagonal) if node.attr("upper", 1) else jnp.tril(x, diagonal)


# --- Running totals: CumSum, CumProd ------------------------------------------------------


def _cumulative(node: Any, x: Any, axis: Any, accumulate: Callable, identity: int) -> jax.Array:
    """Running `accumulate` along `axis`; `reverse` runs from the end, `exclusive` leaves out
    each element itself (the first result is `identity`)."""
    axis = checked_axis(node, _single_int(node, axis, "axis"), np.ndim(x))
    reverse = bool(node.attr("reverse", 0))
    x = jnp.asarray(x)
    total = accumulate(x, axis=axis, reverse=reverse)
    length = x.shape[axis]
    if not node.attr("exclusive", 0) or length == 0:
        return total
    edge = jnp.full_like(lax.slice_in_dim(total, 0, 1, axis=axis), identity)
    if reverse:
        return jnp.concatenate([lax.slice_in_dim(total, 1, length, axis=axis), edge], axis=axis)
    return jnp.concatenate([edge, lax.slice_in_dim(total, 0, length - 1, axis=axis)], axis=axis)


@op("CumSum", since=11, static_inputs=(1,))
def cumsum(node: Any, x: Any, axis: Any) -> jax.Array:
    """Running sum along `axis` (a scalar input); attributes `exclusive`, `reverse`."""
    return _cumulative(node, x, axis, lax.cumsum, 0)


@op("CumProd", since=26, static_inputs=(1,))
def cumprod(node: Any, x: Any, axis: Any) -> jax.Array:
    """Running product along `axis` (a scalar input); attributes `exclusive`, `reverse`."""
    return _cumulative(node, x, axis, lax.cumprod, 1)


@op("ReverseSequence", since=10)
def reverse_sequence(node: Any, x: Any, sequence_lens: Any) -> Any:
    """For each batch entry b, reverse the first sequence_lens[b] steps along `time_axis`."""
    time_axis = node.attr("time_axis", 0)
    batch_axis = node.attr("batch_axis", 1)
    if {time_axis, batch_axis} != {0, 1} or np.ndim(x) < 2:
        raise node.error(f"time_axis {time_axis} and batch_axis {batch_axis} must be 0 and 1 "
                         f"of an input of rank >= 2")
    xp = array_module(x)
    shape = np.shape(x)
    steps = xp.arange(shape[time_axis]).reshape([-1 if i == time_axis else 1 for i in range(len(shape))])
    lengths = xp.reshape(sequence_lens, [-1 if i == batch_axis else 1 for i in range(len(shape))])
    sources = xp.where(steps < lengths, lengths - 1 - steps, steps)
    return xp.take_along_axis(x, xp.broadcast_to(sources, shape), axis=time_axis)


# --- Selections: Compress, NonZero, Unique --------------------------------------------------


@op("Compress", since=9, static_inputs=(1,))
def compress(node: Any, x: Any, condition: Any) -> Any:
    """The slices along `axis` (the flattened input when absent) whose condition is true;
    a condition shorter than the axis drops the remaining slices."""
    keep = np.flatnonzero(np.asarray(condition).reshape(-1))
    xp = array_module(x)
    if node.has_attr("axis"):
        axis = checked_axis(node, node.attr("axis"), np.ndim(x))
    else:
        x, axis = xp.reshape(x, (-1,)), 0
    if keep.size and keep[-1] >= np.shape(x)[axis]:
        raise node.error(f"condition selects slice {keep[-1]} of an axis of size {np.shape(x)[axis]}")
    return xp.take(x, keep, axis=axis)


@op("NonZero", since=9, differentiable=False)
def non_zero(node: Any, x: Any) -> np.ndarray:
    """int64 coordinates of the non-zero elements, shape (rank, count), in row-major order;
    a scalar counts as a one-element vector."""
    x = _require_host(node, x, "has an output shape that depends on the input values")
    return np.array(np.nonzero(np.atleast_1d(x)), dtype=np.int64)


@op("Unique", since=11, differentiable=False)
def unique(node: Any, x: Any) -> tuple:
    """Distinct elements (or slices along `axis`), sorted or in order of first occurrence,
    with first-occurrence indices, inverse indices and counts (all int64)."""
    x = _require_host(node, x, "has an output shape that depends on the input values")
    if node.has_attr("axis"):
        axis = checked_axis(node, node.attr("axis"), x.ndim)
    else:
        x, axis = x.reshape(-1), 0
    values, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True,
                                               return_counts=True, axis=axis)
    inverse = inverse.reshape(-1)
    if not node.attr("sorted", 1):
        order = np.argsort(first, kind="stable")
        values, first, counts = np.take(values, order, axis=axis), first[order], counts[order]
        inverse = np.argsort(order)[inverse]
    return values, first.astype(np.int64), inverse.astype(np.int64), counts.astype(np.int64)


# --- TopK, ArgMax, ArgMin -----------------------------------------------------------------


def _descending_key(x: jax.Array) -> jax.Array:
    """An order-reversing map: the largest key marks the smallest element."""
    return jnp.invert(x) if jnp.issubdtype(x.dtype, jnp.integer) else -x


def _top_k(node: Any, x: Any, k: int) -> tuple:
    axis = checked_axis(node, node.attr("axis", -1), np.ndim(x))
    if not 0 <= k <= np.shape(x)[axis]:
        raise node.error(f"k={k} is outside [0, {np.shape(x)[axis]}] for axis {axis}")
    moved = jnp.moveaxis(jnp.asarray(x), axis, -1)
    keys = moved if node.attr("largest", 1) else _descending_key(moved)
    _, positions = lax.top_k(keys, k)
    values = jnp.take_along_axis(moved, positions, axis=-1)
    return jnp.moveaxis(values, -1, axis), jnp.moveaxis(positions.astype(np.int64), -1, axis)


@op("TopK", since=1)
def top_k_v1(node: Any, x: Any) -> tuple:
    """The `k` (attribute) largest values along `axis` and their int64 indices, sorted."""
    return _top_k(node, x, node.attr("k"))


@op("TopK", since=10, static_inputs=(1,))
def top_k(node: Any, x: Any, k: Any) -> tuple:
    """The K largest (or, largest=0 from opset 11, smallest) values along `axis` and their
    int64 indices, sorted; ties keep the lower index first."""
    return _top_k(node, x, _single_int(node, k, "K"))


def _arg_extreme(node: Any, data: Any, pick: Callable) -> jax.Array:
    """int64 position of the extreme along `axis`; the last one with select_last_index=1."""
    axis = checked_axis(node, node.attr("axis", 0), np.ndim(data))
    keepdims = bool(node.attr("keepdims", 1))
    data = jnp.asarray(data)
    if node.attr("select_last_index", 0):
        position = data.shape[axis] - 1 - pick(jnp.flip(data, axis), axis=axis, keepdims=keepdims)
    else:
        position = pick(data, axis=axis, keepdims=keepdims)
    return position.astype(np.int64)


@op("ArgMax", since=1, differentiable=False)
def arg_max(node: Any, data: Any) -> jax.Array:
    """Index of the largest element along `axis` (first one, or last with select_last_index)."""
    return _arg_extreme(node, data, jnp.argmax)


@op("ArgMin", since=1, differentiable=False)
def arg_min(node: Any, data: Any) -> jax.Array:
    """Index of the smallest element along `axis` (first one, or last with select_last_index)."""
    return _arg_extreme(node, data, jnp.argmin)
