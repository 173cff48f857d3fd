"""Check feeds against a graph's declared inputs before anything compiles or changes.

A wrong feed should fail here, with the input's name and what was expected,
rather than as an XLA shape error from deep inside a trace (or, worse, as a
silent cast). Arrays must carry the declared dtype exactly; Python scalars and
lists, which have no dtype of their own, are converted to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from onnxtrain.errors import InputError
from onnxtrain.proto import TypeProto, ValueInfoProto
from onnxtrain.translate.tensors import element_type


def _expected_dtype(value_type: TypeProto, name: str) -> np.dtype | None:
    if not value_type.HasField("tensor_type") or not value_type.tensor_type.elem_type:
        return None
    return np.dtype(element_type(value_type.tensor_type.elem_type, f"input {name!r}").dtype)


def _as_array(name: str, value: Any, dtype: np.dtype | None) -> Any:
    if isinstance(value, (np.ndarray, jax.Array, np.generic)):
        if dtype is not None and value.dtype != dtype:
            raise InputError(f"input {name!r} must be {dtype}, got a {value.dtype} array; "
                             f"convert it first, e.g. value.astype(np.{dtype.name})")
        return value
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as error:
        raise InputError(f"input {name!r}: {type(value).__name__} is not array-like ({error})") from None
    if dtype is None or array.dtype.kind in "OUS":
        return array
    converted = array.astype(dtype)
    if not np.array_equal(converted.astype(array.dtype), array):
        raise InputError(f"input {name!r} must be {dtype}; the values given do not fit it exactly")
    return converted


def check_feeds(declared: Sequence[ValueInfoProto], feeds: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The feeds as arrays, after checking names, dtypes, ranks and dims against `declared`."""
    if not isinstance(feeds, Mapping):
        raise InputError(f"{where} takes a mapping of input name -> array, got {type(feeds).__name__}")
    names = [info.name for info in declared]
    missing = [name for name in names if name not in feeds]
    unknown = sorted(set(feeds) - set(names))
    if missing or unknown:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])
        raise InputError(f"{where} takes inputs {names}: {'; '.join(parts)}")
    symbols: dict[str, tuple[int, str]] = {}
    checked = {}
    for info in declared:
        name = info.name
        array = _as_array(name, feeds[name], _expected_dtype(info.type, name))
        checked[name] = array
        if not info.type.HasField("tensor_type") or not info.type.tensor_type.HasField("shape"):
            continue
        dims = info.type.tensor_type.shape.dim
        shape = np.shape(array)
        declared_shape = [d.dim_param or (d.dim_value if d.HasField("dim_value") else "?") for d in dims]
        if len(shape) != len(dims):
            raise InputError(f"input {name!r} must have rank {len(dims)} (shape {declared_shape}), "
                             f"got shape {list(shape)}")
        for axis, (dim, size) in enumerate(zip(dims, shape)):
            if dim.HasField("dim_value") and dim.dim_value != size:
                raise InputError(f"input {name!r} must have size {dim.dim_value} on axis {axis} "
                                 f"(shape {declared_shape}), got shape {list(shape)}")
            if dim.dim_param:
                seen = symbols.setdefault(dim.dim_param, (size, name))
                if seen[0] != size:
                    raise InputError(
                        f"input {name!r} axis {axis} is {dim.dim_param!r} = {size}, but input "
                        f"{seen[1]!r} has {dim.dim_param!r} = {seen[0]}; they must agree")
    return checked
