"""Small helpers shared by op handlers: axes, dtypes, host values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from onnxtrain.translate.tensors import ELEMENT_TYPES


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
    if not isinstance(value, np.ndarray):
        raise node.error(f"{what} must be known before running (a constant or computed from "
                         f"shapes), but it is computed from graph inputs")
    return [int(v) for v in np.asarray(value).reshape(-1)]


def optional_input(inputs: Sequence[Any], index: int) -> Any:
    """inputs[index], or None when the optional input is absent."""
    return inputs[index] if index < len(inputs) else None


def as_array(value: Any) -> Any:
    """numpy arrays stay numpy (host), anything else becomes a jnp array."""
    return value if isinstance(value, np.ndarray) else jnp.asarray(value)
