"""Small helpers shared by op handlers: axes, dtypes, host values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from onnxtrain.translate.tensors import ELEMENT_TYPES, MAX_RANK, host_size_problem, shape_problem
from onnxtrain.translate.values import known_value


def numpy_dtype(onnx_type: int) -> np.dtype:
    """The numpy dtype of an ONNX element type code (TensorProto.DataType)."""
    return ELEMENT_TYPES[onnx_type].dtype


def normalize_axis(axis: int, rank: int) -> int:
    """ONNX axes may be negative (counted from the end)."""
    return axis + rank if axis < 0 else axis


def normalize_axes(axes: Sequence[int], rank: int) -> list[int]:
    return [normalize_axis(int(a), rank) for a in axes]


def float_attr(node: Any, name: str, default: float) -> float:
    """A float attribute; its default rounded to float32, as ONNX stores float attributes."""
    return float(node.attr(name, np.float32(default)))


def host_ints(node: Any, value: Any, what: str) -> list[int]:
    """A host-constant integer tensor as a list of Python ints (shapes, axes, pads...)."""
    known = known_value(value)
    if known is None:
        raise node.error(f"{what} must be known before running (a constant or computed from "
                         f"shapes), but it is computed from graph inputs")
    return [int(v) for v in known.reshape(-1)]


def shape_input(node: Any, value: Any, what: str) -> list[int]:
    """A host-constant shape (see host_ints) that a tensor can have: at most MAX_RANK entries
    and a size that fits int64 (its -1 and 0 entries, which Reshape resolves, aside).

    Raises:
        ModelLoadError (node.error): a shape no tensor can have.
    """
    dims = host_ints(node, value, what)
    problem = (f"has {len(dims)} entries; numpy and XLA hold at most {MAX_RANK} dimensions"
               if len(dims) > MAX_RANK else shape_problem([d for d in dims if d != -1], 1))
    if problem:
        raise node.error(f"{what} {problem}")
    return dims


def output_shape(node: Any, dims: Sequence[int], dtype: Any, on_host: bool) -> tuple[int, ...]:
    """`dims`, checked before the node builds a tensor of that shape and `dtype` from a shape
    alone: one that can exist, and when built `on_host` (folded while tracing, or eager), no
    larger than MAX_HOST_BYTES, so the check comes before any memory is taken.

    Raises:
        ModelLoadError (node.error): a shape no tensor can have.
        UnsupportedOpError (node.unsupported): a tensor too large to build on the host.
    """
    itemsize = np.dtype(dtype).itemsize
    problem = shape_problem(dims, itemsize)
    if problem:
        raise node.error(f"its output {problem}")
    problem = host_size_problem(dims, itemsize) if on_host else None
    if problem:
        raise node.unsupported(f"its output {problem}; it is computed while translating, from "
                               "constants. Make the shape smaller or compute it from graph inputs")
    return tuple(dims)


def optional_input(inputs: Sequence[Any], index: int) -> Any:
    """inputs[index], or None when the optional input is absent."""
    return inputs[index] if index < len(inputs) else None


def as_array(value: Any) -> Any:
    """numpy arrays stay numpy (host), anything else becomes a jnp array."""
    return value if isinstance(value, np.ndarray) else jnp.asarray(value)
