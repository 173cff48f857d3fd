"""TensorProto <-> numpy for every ONNX element type.

ONNX stores tensor values either in `raw_data` (little-endian bytes, with
2/4/6-bit types packed into a little-endian bit stream) or in a typed field
whose meaning depends on the element type (int32_data carries bools, 8/16-bit
integers and the bit patterns of small floats). This module is the single
place that knows those rules, so every reader and writer agrees on them.
Types numpy lacks (bfloat16, the 8/6/4-bit floats, 2/4-bit integers) come from
ml_dtypes, which JAX uses too.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from onnxtrain._io import mapped
from onnxtrain.errors import ModelLoadError
from onnxtrain.proto import TensorProto


@dataclass(frozen=True)
class ElementType:
    """How one ONNX element type is held in numpy and in a TensorProto."""

    code: int
    name: str
    dtype: np.dtype
    bits: int
    # The typed field used when raw_data is absent.
    field: str

    @property
    def packed(self) -> bool:
        """True for types narrower than a byte, stored as a packed bit stream."""
        return self.bits < 8


def _element(code: int, dtype: object, bits: int, field: str) -> ElementType:
    return ElementType(code, TensorProto.DataType.Name(code), np.dtype(dtype), bits, field)


ELEMENT_TYPES: dict[int, ElementType] = {
    e.code: e
    for e in (
        _element(TensorProto.FLOAT, np.float32, 32, "float_data"),
        _element(TensorProto.UINT8, np.uint8, 8, "int32_data"),
        _element(TensorProto.INT8, np.int8, 8, "int32_data"),
        _element(TensorProto.UINT16, np.uint16, 16, "int32_data"),
        _element(TensorProto.INT16, np.int16, 16, "int32_data"),
        _element(TensorProto.INT32, np.int32, 32, "int32_data"),
        _element(TensorProto.INT64, np.int64, 64, "int64_data"),
        _element(TensorProto.STRING, object, 0, "string_data"),
        _element(TensorProto.BOOL, np.bool_, 8, "int32_data"),
        _element(TensorProto.FLOAT16, np.float16, 16, "int32_data"),
        _element(TensorProto.DOUBLE, np.float64, 64, "double_data"),
        _element(TensorProto.UINT32, np.uint32, 32, "uint64_data"),
        _element(TensorProto.UINT64, np.uint64, 64, "uint64_data"),
        _element(TensorProto.COMPLEX64, np.complex64, 64, "float_data"),
        _element(TensorProto.COMPLEX128, np.complex128, 128, "double_data"),
        _element(TensorProto.BFLOAT16, ml_dtypes.bfloat16, 16, "int32_data"),
        _element(TensorProto.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn, 8, "int32_data"),
        _element(TensorProto.FLOAT8E4M3FNUZ, ml_dtypes.float8_e4m3fnuz, 8, "int32_data"),
        _element(TensorProto.FLOAT8E5M2, ml_dtypes.float8_e5m2, 8, "int32_data"),
        _element(TensorProto.FLOAT8E5M2FNUZ, ml_dtypes.float8_e5m2fnuz, 8, "int32_data"),
        _element(TensorProto.FLOAT8E8M0, ml_dtypes.float8_e8m0fnu, 8, "int32_data"),
        _element(TensorProto.UINT4, ml_dtypes.uint4, 4, "int32_data"),
        _element(TensorProto.INT4, ml_dtypes.int4, 4, "int32_data"),
        _element(TensorProto.FLOAT4E2M1, ml_dtypes.float4_e2m1fn, 4, "int32_data"),
        _element(TensorProto.UINT2, ml_dtypes.uint2, 2, "int32_data"),
        _element(TensorProto.INT2, ml_dtypes.int2, 2, "int32_data"),
        _element(TensorProto.FLOAT6E2M3, ml_dtypes.float6_e2m3fn, 6, "int32_data"),
        _element(TensorProto.FLOAT6E3M2, ml_dtypes.float6_e3m2fn, 6, "int32_data"),
    )
}

_CODE_OF_DTYPE: dict[np.dtype, int] = {e.dtype: e.code for e in ELEMENT_TYPES.values()}


def element_type(code: int, where: str = "tensor") -> ElementType:
    """The ElementType of an ONNX data_type code; ModelLoadError for unknown codes."""
    try:
        return ELEMENT_TYPES[code]
    except KeyError:
        known = ", ".join(f"{e.code} ({e.name})" for e in ELEMENT_TYPES.values())
        raise ModelLoadError(
            f"{where}: data_type {code} is not an ONNX element type onnxtrain knows; "
            f"known types are {known}. The model may need a newer onnxtrain."
        ) from None


def data_type_of(dtype: np.dtype | type) -> int:
    """The ONNX data_type code for a numpy (or ml_dtypes) dtype."""
    dtype = np.dtype(dtype)
    if dtype.kind in "US":
        return TensorProto.STRING
    try:
        return _CODE_OF_DTYPE[dtype.newbyteorder("=")]
    except KeyError:
        raise TypeError(f"numpy dtype {dtype} has no ONNX element type") from None


# numpy and XLA hold at most this many dimensions.
MAX_RANK = 64
# The largest byte size an array can have: numpy and XLA count bytes in int64.
MAX_ARRAY_BYTES = 2**63 - 1


def shape_problem(dims: Sequence[int], itemsize: int) -> str | None:
    """Why no array of shape `dims` with `itemsize`-byte elements can exist, or None if one can.

    numpy's rule: at most MAX_RANK dims, none negative, and the product of the non-zero dims
    times the item size fits in int64 (so [0, 2**62] floats is refused like [1, 2**62]).
    """
    if len(dims) > MAX_RANK:
        return f"has {len(dims)} dimensions; numpy and XLA hold at most {MAX_RANK}"
    if any(d < 0 for d in dims):
        return f"dims {_shown(dims)} contain a negative size"
    size = max(itemsize, 1) * math.prod(d for d in dims if d)
    if size > MAX_ARRAY_BYTES:
        return (f"dims {_shown(dims)} would take {size} bytes (zero dims aside), more than any "
                f"array can hold ({MAX_ARRAY_BYTES})")
    return None


def _half_the_memory() -> int:
    """Half the machine's physical memory in bytes (16 GiB where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (AttributeError, ValueError, OSError):
        return 2**34


# Arrays built on the host from a shape alone (not from data a file holds: a sparse tensor's
# zeros, a ConstantOfShape folded while tracing) are refused beyond this many bytes, before
# any memory is taken: a small model must not make the process allocate (or be killed for
# allocating) more than the machine has.
MAX_HOST_BYTES = max(2**32, _half_the_memory())


def host_size_problem(dims: Sequence[int], itemsize: int) -> str | None:
    """Why an array of `dims` is too large to build on the host from its shape, or None."""
    size = max(itemsize, 1) * math.prod(dims)
    if size > MAX_HOST_BYTES:
        return (f"would make a {size}-byte array of shape {_shown(dims)}, over the "
                f"{MAX_HOST_BYTES} bytes onnxtrain builds on the host from a shape alone")
    return None


def _shown(dims: Sequence[int]) -> str:
    """dims for a message, cut short when there are many."""
    dims = list(dims)
    return str(dims) if len(dims) <= 16 else f"[{', '.join(map(str, dims[:8]))}, ... ({len(dims)} dims)]"


def element_count(tensor: TensorProto, where: str = "tensor") -> int:
    """Number of elements the tensor's dims declare (1 for a scalar); ModelLoadError for dims
    no array can have (see shape_problem)."""
    element = ELEMENT_TYPES.get(tensor.data_type)
    problem = shape_problem(tensor.dims, element.dtype.itemsize if element else 1)
    if problem:
        raise ModelLoadError(f"{where}: {problem}. The model file is corrupt or was written by a "
                             "faulty exporter; fix the tensor's dims.")
    return math.prod(tensor.dims)


def raw_size(element: ElementType, count: int) -> int:
    """Bytes that `count` elements take in raw_data (sub-byte types packed)."""
    return math.ceil(count * element.bits / 8)


def _typed_size(element: ElementType, count: int) -> int:
    """Entries `count` elements take in the element type's typed field."""
    if element.code in (TensorProto.COMPLEX64, TensorProto.COMPLEX128):
        return 2 * count
    if element.bits in (2, 4):
        # One packed byte per int32 entry, as the ONNX reference writes them.
        return raw_size(element, count)
    return count


def check_tensor_data(tensor: TensorProto, where: str = "tensor") -> None:
    """Fail when the stored values do not match the dims and element type.

    External tensors are checked by whoever reads their file; segmented
    tensors hold only part of the values and are left alone.
    """
    if tensor.data_location == TensorProto.EXTERNAL or tensor.HasField("segment"):
        return
    element = element_type(tensor.data_type, where)
    count = element_count(tensor, where)
    if tensor.HasField("raw_data") and element.code != TensorProto.STRING:
        have, need, unit = len(tensor.raw_data), raw_size(element, count), "bytes of raw_data"
    else:
        have, need = len(getattr(tensor, element.field)), _typed_size(element, count)
        unit = f"entries in {element.field}"
    if have != need:
        raise ModelLoadError(
            f"{where}: holds {have} {unit} but its dims {list(tensor.dims)} of "
            f"{element.name} need {need}. The model file is corrupt or was written "
            f"by a faulty exporter; re-export it."
        )


def _little_endian_unit(dtype: np.dtype) -> np.dtype:
    """The little-endian unsigned integer each scalar part of `dtype` is stored as."""
    size = dtype.itemsize // 2 if dtype.kind == "c" else dtype.itemsize
    return np.dtype(f"<u{size}")


def _from_little_endian(buffer: bytes, dtype: np.dtype) -> np.ndarray:
    if dtype.itemsize == 1:
        return np.frombuffer(buffer, dtype=dtype)
    unit = _little_endian_unit(dtype)
    return np.frombuffer(buffer, dtype=unit).astype(unit.newbyteorder("="), copy=False).view(dtype)


def _to_little_endian(array: np.ndarray) -> bytes:
    array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))
    if array.dtype.itemsize == 1:
        return array.tobytes()
    unit = _little_endian_unit(array.dtype)
    return array.view(unit.newbyteorder("=")).astype(unit, copy=False).tobytes()


def _group(bits: int) -> tuple[int, int]:
    """(values, bytes) of the smallest whole-byte group of `bits`-wide values."""
    values = math.lcm(bits, 8) // bits
    return values, values * bits // 8


def _pack_bits(codes: np.ndarray, bits: int) -> bytes:
    """Pack low `bits` of each uint8 code into a little-endian bit stream."""
    values, nbytes = _group(bits)
    count = codes.size
    padded = np.zeros(math.ceil(count / values) * values, dtype=np.uint32)
    padded[:count] = codes.ravel() & ((1 << bits) - 1)
    shifts = np.arange(values, dtype=np.uint32) * bits
    words = np.bitwise_or.reduce(padded.reshape(-1, values) << shifts, axis=1)
    stream = (words[:, None] >> (np.arange(nbytes, dtype=np.uint32) * 8)) & 0xFF
    return stream.astype(np.uint8).tobytes()[: math.ceil(count * bits / 8)]


def _unpack_bits(buffer: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of _pack_bits: `count` uint8 codes from a packed byte buffer."""
    values, nbytes = _group(bits)
    groups = math.ceil(count / values)
    padded = np.zeros(groups * nbytes, dtype=np.uint32)
    padded[: buffer.size] = buffer[: groups * nbytes]
    words = np.bitwise_or.reduce(
        padded.reshape(-1, nbytes) << (np.arange(nbytes, dtype=np.uint32) * 8), axis=1
    )
    codes = (words[:, None] >> (np.arange(values, dtype=np.uint32) * bits)) & ((1 << bits) - 1)
    return codes.astype(np.uint8).ravel()[:count]


def _decode_string(value: bytes) -> str | bytes:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value


def tensor_to_numpy(tensor: TensorProto, where: str | None = None) -> np.ndarray:
    """The values of an in-memory TensorProto as a numpy array of its dims.

    Arrays decoded from raw_data are read-only views of the message's bytes, and those of
    tensors load_model mapped are read-only views of their side file (see _io/mapped.py).
    Strings decode to `str` where they are valid UTF-8 and stay `bytes`
    otherwise. External tensors must be loaded first (load_model does that).
    """
    where = where or f"tensor {tensor.name!r}"
    stored: bytes | np.ndarray | None = None
    if tensor.data_location == TensorProto.EXTERNAL:
        if not mapped.is_mapped(tensor):
            raise ModelLoadError(
                f"{where}: values are in an external file that was not loaded; "
                f"load the model with onnxtrain.load_model from its path."
            )
        element = element_type(tensor.data_type, where)
        mapped.check(tensor, raw_size(element, element_count(tensor, where)), where)
        stored = mapped.payload(tensor, where)
    if tensor.HasField("segment"):
        raise ModelLoadError(f"{where}: segmented tensors are not supported; merge the segments.")
    check_tensor_data(tensor, where)
    element = ELEMENT_TYPES[tensor.data_type]
    dims = tuple(tensor.dims)
    count = math.prod(dims)
    if stored is None and tensor.HasField("raw_data"):
        stored = tensor.raw_data

    if element.code == TensorProto.STRING:
        strings = np.empty(count, dtype=object)
        strings[:] = [_decode_string(s) for s in tensor.string_data]
        return strings.reshape(dims)

    if stored is not None:
        if element.packed:
            codes = _unpack_bits(np.frombuffer(stored, dtype=np.uint8), element.bits, count)
            return codes.view(element.dtype).reshape(dims)
        return _from_little_endian(stored, element.dtype).reshape(dims)

    typed = getattr(tensor, element.field)
    if element.field == "int32_data" and element.code != TensorProto.INT32:
        # Narrow types: each int32 entry holds one value's bit pattern, or one
        # packed byte of 2/4-bit values.
        patterns = np.array(typed, dtype=np.int64)
        if element.bits in (2, 4):
            codes = _unpack_bits(patterns.astype(np.uint8), element.bits, count)
            return codes.view(element.dtype).reshape(dims)
        if element.code == TensorProto.BOOL:
            return (patterns != 0).reshape(dims)
        if element.bits == 6:
            patterns &= 0x3F
        unit = np.dtype(f"u{element.dtype.itemsize}")
        return patterns.astype(unit).view(element.dtype).reshape(dims)
    if element.dtype.kind == "c":
        parts = np.array(typed, dtype=np.float32 if element.bits == 64 else np.float64)
        return parts.view(element.dtype).reshape(dims)
    return np.array(typed, dtype=element.dtype).reshape(dims)


def array_bytes(array: np.ndarray) -> bytes:
    """The raw_data encoding of a numeric array: little-endian, sub-byte types packed."""
    element = ELEMENT_TYPES[data_type_of(array.dtype)]
    if element.packed:
        return _pack_bits(np.ascontiguousarray(array).view(np.uint8), element.bits)
    return _to_little_endian(array)


def numpy_to_tensor(array: object, name: str = "") -> TensorProto:
    """A TensorProto holding `array` (raw_data for numbers, string_data for text)."""
    array = np.asarray(array)
    tensor = TensorProto(name=name, dims=array.shape, data_type=data_type_of(array.dtype))
    if tensor.data_type == TensorProto.STRING:
        for value in array.ravel():
            if isinstance(value, str):
                value = value.encode("utf-8")
            elif not isinstance(value, bytes):
                raise TypeError(
                    f"string tensor {name!r}: element {value!r} is {type(value).__name__}, "
                    f"not str or bytes"
                )
            tensor.string_data.append(value)
    else:
        tensor.raw_data = array_bytes(array)
    return tensor
