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


# Values checked as they are; anything else is converted to the declared dtype.
_ARRAYS = (np.ndarray, jax.Array, np.generic)


def owned(feeds: Mapping[str, Any]) -> dict[str, Any]:
    """The feeds with every numpy array copied. A step may return before the device has read
    its feeds, and JAX on CPU reads a host argument in place (or copies it later), so a caller
    refilling its batch buffer would otherwise change a step in flight."""
    return {name: np.array(value) if isinstance(value, np.ndarray) else value for name, value in feeds.items()}


def _as_array(name: str, value: Any, dtype: np.dtype | None) -> Any:
    """`value` as an array: arrays as they are (after checking their dtype), anything else
    converted to the declared dtype if it fits exactly."""
    if isinstance(value, _ARRAYS):
        if dtype is not None and value.dtype != dtype:
            raise InputError(f"input {name!r} must be {dtype}, got a {value.dtype} array; "
                             f"convert it first, e.g. value.astype(np.{dtype.name})")
        return value
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as error:
        raise InputError(f"input {name!r}: {type(value).__name__} is not array-like ({error})") from None
    if dtype is None or array.dtype.kind in "OUS":
        return np.array(array)
    converted = array.astype(dtype)
    if not np.array_equal(converted.astype(array.dtype), array):
        raise InputError(f"input {name!r} must be {dtype}; the values given do not fit it exactly")
    return converted


class FeedChecker:
    """Checks feeds against declared inputs; the declarations are digested once, so a
    training loop pays only for the comparisons."""

    def __init__(self, declared: Sequence[ValueInfoProto], where: str):
        self.where = where
        self.names = [info.name for info in declared]
        self._inputs = []
        for info in declared:
            dims = None
            tensor = info.type.tensor_type
            if info.type.HasField("tensor_type") and tensor.HasField("shape"):
                dims = [(d.dim_value if d.HasField("dim_value") else None, d.dim_param) for d in tensor.shape.dim]
            self._inputs.append((info.name, _expected_dtype(info.type, info.name), dims))
        # (type, shape, dtype) of each input of the last feeds that passed as they were: a
        # training loop feeds the same signature every step, and then nothing else needs checking.
        self._passed: list[tuple] | None = None

    def __call__(self, feeds: Mapping[str, Any], copy: bool = True) -> dict[str, Any]:
        """The feeds as arrays (see _as_array), after checking names, dtypes, ranks and dims;
        numpy arrays copied (see owned) unless the caller copies them itself (copy=False)."""
        if not isinstance(feeds, Mapping):
            raise InputError(f"{self.where} takes a mapping of input name -> array, got "
                             f"{type(feeds).__name__}")
        if len(feeds) != len(self.names) or any(name not in feeds for name in self.names):
            self._name_error(feeds)
        values = [feeds[name] for name in self.names]
        signature = [(type(value), getattr(value, "shape", None), getattr(value, "dtype", None)) for value in values]
        if signature != self._passed:
            values = self._checked(values)
            if all(isinstance(value, _ARRAYS) for value in values):
                self._passed = signature
        checked = dict(zip(self.names, values))
        return owned(checked) if copy else checked

    def _checked(self, values: list[Any]) -> list[Any]:
        symbols: dict[str, tuple[int, str]] = {}
        checked = []
        for (name, dtype, dims), value in zip(self._inputs, values):
            checked.append(_as_array(name, value, dtype))
            if dims is not None:
                self._check_shape(name, np.shape(checked[-1]), dims, symbols)
        return checked

    def _name_error(self, feeds: Mapping[str, Any]) -> None:
        missing = [name for name in self.names if name not in feeds]
        unknown = sorted(set(feeds) - set(self.names))
        parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])
        raise InputError(f"{self.where} takes inputs {self.names}: {'; '.join(parts)}")

    @staticmethod
    def _check_shape(name: str, shape: tuple[int, ...], dims: list[tuple[int | None, str]],
                     symbols: dict[str, tuple[int, str]]) -> None:
        def declared() -> list[int | str]:
            return [param or (value if value is not None else "?") for value, param in dims]

        if len(shape) != len(dims):
            raise InputError(f"input {name!r} must have rank {len(dims)} (shape {declared()}), "
                             f"got shape {list(shape)}")
        for axis, ((value, param), size) in enumerate(zip(dims, shape)):
            if value is not None and value != size:
                raise InputError(f"input {name!r} must have size {value} on axis {axis} "
                                 f"(shape {declared()}), got shape {list(shape)}")
            if param:
                seen = symbols.setdefault(param, (size, name))
                if seen[0] != size:
                    raise InputError(
                        f"input {name!r} axis {axis} is {param!r} = {size}, but input "
                        f"{seen[1]!r} has {param!r} = {seen[0]}; they must agree")
