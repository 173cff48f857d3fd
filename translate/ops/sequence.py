"""Sequences and optionals.

An ONNX sequence is a Python list of tensors, so its length is always known
while tracing; positions (SequenceAt/Insert/Erase) are host constants, except
that SequenceAt also takes a traced position when all elements share one
shape and dtype. An empty optional is None; a full one is its value itself.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from onnxtrain.translate.node import Node
from onnxtrain.translate.ops.common import host_ints, normalize_axis
from onnxtrain.translate.registry import op
from onnxtrain.translate.values import known_value

# ---------------------------------------------------------------------------
# Positions


def _position(node: Node, value: Any, length: int, allow_end: bool) -> int:
    """A host position in [-length, length - 1] (or up to length when allow_end) as an index."""
    (position,) = host_ints(node, value, "position")
    end = length if allow_end else length - 1
    if not -length <= position <= end:
        raise node.error(f"position {position} is out of range for a sequence of length {length} "
                         f"(allowed: {-length}..{end})")
    return position + length if position < 0 else position


def _sequence(node: Node, value: Any) -> list:
    if not isinstance(value, list):
        raise node.error(f"expects a sequence, got {type(value).__name__}")
    return value


def _uniform(sequence: list) -> bool:
    """True when all elements share one shape and dtype (so they can be stacked)."""
    return len({(jnp.shape(v), jnp.result_type(v)) for v in sequence}) == 1


# ---------------------------------------------------------------------------
# Sequence ops


@op("SequenceConstruct", since=11)
def sequence_construct(node: Node, *tensors: Any) -> list:
    """A sequence of the input tensors, in order."""
    return list(tensors)


@op("SequenceEmpty", since=11)
def sequence_empty(node: Node) -> list:
    """An empty sequence (its `dtype` attribute is type information only)."""
    return []


@op("SequenceLength", since=11)
def sequence_length(node: Node, sequence: list) -> np.ndarray:
    """The number of elements, as an int64 scalar."""
    return np.array(len(_sequence(node, sequence)), np.int64)


@op("SequenceAt", since=11)
def sequence_at(node: Node, sequence: list, position: Any) -> Any:
    """The element at `position` (negative counts from the end)."""
    sequence = _sequence(node, sequence)
    known = known_value(position)
    if known is not None:
        return sequence[_position(node, known, len(sequence), allow_end=False)]
    if not sequence or not _uniform(sequence):
        raise node.error("needs its position known before running (a constant or computed from "
                         "shapes) unless all elements share one shape and dtype")
    index = jnp.reshape(position, ()).astype(jnp.int64)
    index = jnp.where(index < 0, index + len(sequence), index)
    return jax.lax.dynamic_index_in_dim(jnp.stack(sequence), index, keepdims=False)


@op("SequenceInsert", since=11, static_inputs=(2,))
def sequence_insert(node: Node, sequence: list, tensor: Any, position: Any = None) -> list:
    """A new sequence with `tensor` inserted before `position` (default: appended)."""
    sequence = _sequence(node, sequence)
    index = len(sequence) if position is None else _position(node, position, len(sequence),
                                                               allow_end=True)
    return [*sequence[:index], tensor, *sequence[index:]]


@op("SequenceErase", since=11, static_inputs=(1,))
def sequence_erase(node: Node, sequence: list, position: Any = None) -> list:
    """A new sequence without the element at `position` (default: the last)."""
    sequence = _sequence(node, sequence)
    if not sequence:
        raise node.error("cannot erase from an empty sequence")
    index = len(sequence) - 1 if position is None else _position(node, position, len(sequence),
                                                                   allow_end=False)
    return [*sequence[:index], *sequence[index + 1:]]


@op("ConcatFromSequence", since=11)
def concat_from_sequence(node: Node, sequence: list) -> Any:
    """The elements concatenated along `axis`, or stacked on a new `axis` when new_axis=1."""
    sequence = _sequence(node, sequence)
    if not sequence:
        raise node.error("cannot concatenate an empty sequence")
    new_axis = node.attr("new_axis", 0)
    rank = jnp.ndim(sequence[0]) + (1 if new_axis else 0)
    axis = node.attr("axis")
    if not -rank <= axis < rank:
        raise node.error(f"axis {axis} is out of range for rank {rank}")
    axis = normalize_axis(axis, rank)
    return jnp.stack(sequence, axis) if new_axis else jnp.concatenate(sequence, axis)


def _split_sizes(node: Node, split: Any, length: int) -> list[int] | None:
    """Chunk lengths along the axis; None for the default (chunks of one, keepdims applies)."""
    if split is None:
        return None
    sizes = host_ints(node, split, "split")
    if any(size <= 0 for size in sizes) and length > 0:
        raise node.error(f"split sizes must be positive, got {sizes}")
    if np.ndim(split) == 0:
        chunk = sizes[0]
        return [chunk] * (length // chunk) + ([length % chunk] if length % chunk else [])
    if sum(sizes) != length:
        raise node.error(f"split sizes {sizes} add up to {sum(sizes)}, "
                         f"not the axis length {length}")
    return sizes


@op("SplitToSequence", since=11, static_inputs=(1,))
def split_to_sequence(node: Node, tensor: Any, split: Any = None) -> list:
    """Chunks of `input` along `axis`: of the sizes in `split` (1-D), of size `split` (scalar,
    the last may be shorter), or of size 1 with the axis dropped when keepdims=0 (no split)."""
    rank = jnp.ndim(tensor)
    axis = node.attr("axis", 0)
    if not -rank <= axis < rank:
        raise node.error(f"axis {axis} is out of range for rank {rank}")
    axis = normalize_axis(axis, rank)
    length = jnp.shape(tensor)[axis]
    sizes = _split_sizes(node, split, length)
    if sizes is None:
        if node.attr("keepdims", 1):
            return [jax.lax.slice_in_dim(tensor, i, i + 1, axis=axis) for i in range(length)]
        return [jax.lax.index_in_dim(tensor, i, axis, keepdims=False) for i in range(length)]
    starts = np.cumsum([0, *sizes])
    return [jax.lax.slice_in_dim(tensor, int(start), int(start) + size, axis=axis)
            for start, size in zip(starts, sizes)]


# ---------------------------------------------------------------------------
# Optionals


@op("Optional", since=15)
def optional(node: Node, value: Any = None) -> Any:
    """An optional holding `input`, or an empty optional (None) without one."""
    return value


@op("OptionalHasElement", since=15)
def optional_has_element(node: Node, value: Any = None) -> np.ndarray:
    """True when the optional (or tensor/sequence) input is present and not empty."""
    return np.array(value is not None)


@op("OptionalGetElement", since=15)
def optional_get_element(node: Node, value: Any) -> Any:
    """The value an optional holds (a tensor or sequence input passes through)."""
    if value is None:
        raise node.error("the optional input is empty; check OptionalHasElement before "
                         "OptionalGetElement")
    return value
