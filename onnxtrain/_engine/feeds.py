"""Check and convert feeds against a graph's declared inputs before anything compiles or changes.

Every feed of every entry point (Trainer and FineTuner's step, evaluate, infer and fit, and
onnxtrain.run) goes through `FeedChecker`, which applies one set of rules:

- Values with an element type of their own (numpy arrays and scalars, jax arrays, torch
  tensors, pandas columns, anything with `__array__` or `__dlpack__`) must carry the declared
  dtype exactly: a float64 array for a float32 input is an error, never a silent cast.
- Values without one (Python numbers and nested lists of them, object arrays of numbers) are
  converted to the declared dtype: floats round to the nearest value but must not overflow,
  integers and booleans must be represented exactly.
- A string input takes strings, and a numeric input never does.

A wrong feed fails here with an InputError naming the input, rather than as an XLA error from
deep inside a trace (or, worse, as a silent cast).
"""

from __future__ import annotations

import cmath
import itertools
import numbers
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from onnxtrain.errors import InputError
from onnxtrain.proto import TypeProto, ValueInfoProto
from onnxtrain.translate.tensors import element_type

# What reading a foreign object as an array may raise: torch refuses tensors that require
# grad (RuntimeError) or live on a GPU (TypeError), DLPack exporters raise BufferError.
_CONVERSION_ERRORS = (TypeError, ValueError, RuntimeError, BufferError, OverflowError)
# Python values without a dtype of their own, converted to the declared one.
_PYTHON_VALUES = (bool, int, float, complex, str, bytes, list, tuple)


def _expected_dtype(value_type: TypeProto, name: str) -> np.dtype | None:
    if not value_type.HasField("tensor_type") or not value_type.tensor_type.elem_type:
        return None
    return np.dtype(element_type(value_type.tensor_type.elem_type, f"input {name!r}").dtype)


def _is_tensor(value_type: TypeProto) -> bool:
    """Whether an input is a tensor (or undeclared, so taken for one): sequences, maps and
    optionals are passed to the translated graph as they are given."""
    return value_type.WhichOneof("value") in (None, "tensor_type", "sparse_tensor_type")


def owned(feeds: Mapping[str, Any]) -> dict[str, Any]:
    """The feeds with every numpy array copied. A step may return before the device has read
    its feeds, and JAX on CPU reads a host argument in place (or copies it later), so a caller
    refilling its batch buffer would otherwise change a step in flight."""
    return {name: np.array(value) if isinstance(value, np.ndarray) else value for name, value in feeds.items()}


def _live_jax_array(name: str, value: jax.Array) -> jax.Array:
    """`value`, unless it cannot be read: a tracer, or a buffer deleted or donated to an earlier call."""
    if isinstance(value, jax.core.Tracer):
        raise InputError(f"input {name!r} is a JAX tracer: call the trainer outside jax.jit, grad and vmap, "
                         "with concrete arrays")
    if value.is_deleted():
        raise InputError(f"input {name!r} is a jax.Array whose buffer was deleted (or donated to an earlier "
                         "call); pass a live array, e.g. a copy made before it was donated")
    return value


def _from_dlpack(name: str, value: Any) -> np.ndarray:
    """A numpy array of an object that exports DLPack: numpy's import where it can (host
    memory, numpy's dtypes), else a copy through JAX's, which also takes bfloat16 and device
    memory (with 64-bit types kept as they are)."""
    try:
        return np.from_dlpack(value)
    except _CONVERSION_ERRORS:
        pass
    try:
        with jax.enable_x64(True):
            return np.array(jax.dlpack.from_dlpack(value))
    except _CONVERSION_ERRORS as error:
        raise InputError(f"input {name!r}: a {type(value).__name__} cannot be read as an array ({error}); "
                         "pass a numpy array") from None


def _foreign_array(name: str, value: Any) -> np.ndarray:
    """A host numpy array holding `value`, an object of another library (torch, pandas...)."""
    if hasattr(value, "requires_grad") and callable(getattr(value, "detach", None)):
        value = value.detach()  # a torch tensor that requires grad refuses to become an array
    if hasattr(value, "__dlpack__") and not hasattr(value, "__array__"):
        return _from_dlpack(name, value)
    try:
        return np.asarray(value)
    except _CONVERSION_ERRORS as error:
        if hasattr(value, "__dlpack__"):
            return _from_dlpack(name, value)
        raise InputError(f"input {name!r}: a {type(value).__name__} cannot be read as an array ({error}); "
                         "pass a numpy array") from None


def _python_array(name: str, value: Any) -> np.ndarray:
    """A Python number or (nested) list as a numpy array of its natural dtype."""
    try:
        return np.asarray(value)
    except _CONVERSION_ERRORS as error:
        raise InputError(f"input {name!r}: a {type(value).__name__} that is not a rectangular array of "
                         f"numbers ({error})") from None


def _strings(name: str, array: np.ndarray) -> np.ndarray:
    """`array` as the object array of str/bytes a string input takes."""
    if array.dtype.kind in "US":
        return array.astype(object)
    if array.dtype.kind == "O" and all(isinstance(item, (str, bytes)) for item in array.flat):
        return array
    raise InputError(f"input {name!r} is a string tensor; got {array.dtype} values")


def _not_numbers(array: np.ndarray) -> list[Any]:
    """The first item of an object array that is not a number, in a list; else an empty list."""
    return list(itertools.islice((item for item in array.flat if not isinstance(item, (numbers.Number, np.bool_))), 1))


def _infinite(array: np.ndarray) -> np.ndarray:
    """Which items of a numeric or object-of-numbers array are infinite."""
    if array.dtype.kind in "fc":
        return np.isinf(array)
    if array.dtype.kind == "O":
        return np.array([isinstance(item, (float, complex, np.inexact)) and cmath.isinf(item)
                         for item in array.flat], dtype=bool).reshape(array.shape)
    return np.zeros(array.shape, bool)


def _fits(array: np.ndarray, converted: np.ndarray) -> bool:
    """Whether `converted` holds the numbers of `array`: a float within its range (rounding
    allowed), an integer or boolean exactly."""
    target = converted.dtype
    if target.kind in "fc":
        overflowed = np.isinf(converted) & ~_infinite(array)
        dropped_imaginary = target.kind == "f" and np.iscomplexobj(array) and bool(np.any(array.imag != 0))
        return not overflowed.any() and not dropped_imaginary
    if target.kind in "iu" and array.size and array.dtype.kind in "iub":
        # A cast between signed and unsigned wraps around and casts back unchanged: compare the range.
        info = np.iinfo(target)
        if array.min() < info.min or array.max() > info.max:
            return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(np.all(converted.astype(array.dtype) == array))


def _converted(name: str, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`array`, whose values have no dtype of their own, as `dtype` if they fit it."""
    if array.dtype.kind in "USV":
        raise InputError(f"input {name!r} is numeric ({dtype}); got strings or bytes")
    if array.dtype.kind == "O":
        for item in _not_numbers(array):
            raise InputError(f"input {name!r} is numeric ({dtype}); got a {type(item).__name__} among its "
                             f"values ({str(item)[:40]!r})")
    if array.dtype == dtype:
        return array
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            converted = array.astype(dtype)
        except (OverflowError, TypeError, ValueError):
            converted = None
    if converted is None or not _fits(array, converted):
        raise InputError(f"input {name!r} is {dtype}, and the values given do not fit it (out of range, "
                         f"or not whole numbers for an integer input); check them, or pass a {dtype} array")
    return converted


def _untyped(name: str, array: Any) -> Any:
    """`array` for an input without a declared element type (a JAX loss function's label): any
    numbers XLA can take."""
    if np.dtype(array.dtype).kind not in "biufc" and not jax.dtypes.issubdtype(array.dtype, np.floating):
        raise InputError(f"input {name!r} takes numbers; got {array.dtype} values")
    return array


def _typed(name: str, array: np.ndarray | jax.Array, dtype: np.dtype | None, given: Any) -> Any:
    """`array`, which has a dtype of its own, if that is the declared one (see the module's rules)."""
    if dtype is None:
        return _untyped(name, array)
    if dtype.kind == "O":
        return _strings(name, np.asarray(array))
    if array.dtype == dtype:
        return array
    if array.dtype.kind == "O":
        return _converted(name, array, dtype)
    raise InputError(f"input {name!r} must be {dtype}, got a {array.dtype} {type(given).__name__}; "
                     f"convert it first, e.g. {_cast_hint(given, dtype)}")


def _cast_hint(given: Any, dtype: np.dtype) -> str:
    """How to convert `given` to `dtype`, in the words of its own library."""
    if type(given).__module__.split(".")[0] == "torch":
        return f"tensor.to(torch.{dtype.name})"
    return f"value.astype(np.{dtype.name})"


def as_array(name: str, value: Any, dtype: np.dtype | None) -> Any:
    """`value` as the array a compiled program takes for input `name` of `dtype` (None: any).

    numpy arrays and scalars and live jax arrays of the declared dtype come back as they are;
    everything else comes back as a new numpy array.

    Raises:
        InputError: `value` breaks the module's rules, or cannot be read as an array.
    """
    if type(value) is np.ndarray or isinstance(value, np.generic):
        return _typed(name, value, dtype, value)
    if isinstance(value, jax.Array):
        return _typed(name, _live_jax_array(name, value), dtype, value)
    if isinstance(value, _PYTHON_VALUES):
        array = _python_array(name, value)
        if dtype is None:
            return _untyped(name, array)
        return _strings(name, array) if dtype.kind == "O" else _converted(name, array, dtype)
    array = np.asarray(value) if isinstance(value, np.ndarray) else _foreign_array(name, value)
    return _typed(name, array, dtype, value)


def host_array(name: str, value: Any) -> Any:
    """`value` as an array of its own element type, for slicing into batches: numpy and live
    jax arrays as they are, torch tensors (detached), pandas columns and other array objects
    as numpy arrays, Python numbers and lists as numpy arrays of their natural dtype.

    Raises:
        InputError: `value` cannot be read as an array.
    """
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, jax.Array):
        return _live_jax_array(name, value)
    if isinstance(value, _PYTHON_VALUES):
        return _python_array(name, value)
    return _foreign_array(name, value)


# What to do when a model exported with a fixed batch size meets another one.
_FIXED_BATCH = (". If axis 0 is the batch, the model was exported for batches of exactly {size}: "
                "pass repair={{'relax_batch'}} to make_training_model or finetune, or re-export "
                "it with a dynamic batch axis, to take any batch size; or, in training, pass "
                "drop_last=True to fit to skip a short last batch")


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
            tensor_input = _is_tensor(info.type)
            self._inputs.append((info.name, _expected_dtype(info.type, info.name) if tensor_input else None,
                                 dims, tensor_input))
        # (type, shape, dtype) of each input of the last feeds the check returned unchanged (the
        # very objects given), and the positions of jax arrays among them (a jax array can be
        # deleted between calls): a training loop feeds the same signature every step, and then
        # nothing else needs checking. Feeds the check converts never take this path, so a
        # program is only ever handed what the check returned. One attribute, replaced whole,
        # so threads sharing the checker never see half of an update.
        self._passed: tuple[list[tuple], list[int]] = ([], [])

    def convert(self, name: str, value: Any) -> Any:
        """`value` for input `name` converted by as_array's rules against its declared dtype,
        without the shape check (a whole dataset converted once, before it is cut into batches).

        Raises:
            InputError: `name` is not an input, or `value` breaks as_array's rules.
        """
        for input_name, dtype, _, tensor_input in self._inputs:
            if input_name == name:
                return as_array(name, value, dtype) if tensor_input else value
        raise InputError(f"{self.where} takes inputs {self.names}, not {name!r}")

    def __call__(self, feeds: Mapping[str, Any], copy: bool = True) -> dict[str, Any]:
        """The feeds as arrays (see as_array), after checking names, dtypes, ranks and dims;
        numpy arrays copied (see owned) unless the caller copies them itself (copy=False)."""
        if not isinstance(feeds, Mapping):
            raise InputError(f"{self.where} takes a mapping of input name -> array, got "
                             f"{type(feeds).__name__}")
        if len(feeds) != len(self.names) or any(name not in feeds for name in self.names):
            self._name_error(feeds)
        values = [feeds[name] for name in self.names]
        signature = [(type(value), getattr(value, "shape", None), getattr(value, "dtype", None)) for value in values]
        passed, jax_positions = self._passed
        if signature != passed or (jax_positions and any(values[i].is_deleted() for i in jax_positions)):
            checked = self._checked(values)
            if all(new is old for new, old in zip(checked, values)):
                self._passed = (signature, [i for i, value in enumerate(checked) if isinstance(value, jax.Array)])
            else:
                self._passed = ([], [])
            values = checked
        checked = dict(zip(self.names, values))
        return owned(checked) if copy else checked

    def _checked(self, values: list[Any]) -> list[Any]:
        symbols: dict[str, tuple[int, str]] = {}
        checked = []
        for (name, dtype, dims, tensor_input), value in zip(self._inputs, values):
            if not tensor_input:
                checked.append(value)
                continue
            checked.append(as_array(name, value, dtype))
            if dims is not None:
                self._check_shape(name, np.shape(checked[-1]), dims, symbols)
        return checked

    def _name_error(self, feeds: Mapping[str, Any]) -> None:
        missing = [name for name in self.names if name not in feeds]
        unknown = sorted(map(str, set(feeds) - set(self.names)))
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
                                 f"(shape {declared()}), got shape {list(shape)}"
                                 + (_FIXED_BATCH.format(size=value) if axis == 0 else ""))
            if param:
                seen = symbols.setdefault(param, (size, name))
                if seen[0] != size:
                    raise InputError(
                        f"input {name!r} axis {axis} is {param!r} = {size}, but input "
                        f"{seen[1]!r} has {param!r} = {seen[0]}; they must agree")
