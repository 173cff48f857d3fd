"""Cast, CastLike and BitCast: element type conversion with ONNX's rounding and saturation rules.

XLA converts between all numeric types onnxtrain meets with round-to-nearest-even
and, for the 8-bit floats, the non-saturating behaviour ONNX asks for when
`saturate=0`. What ONNX defines differently is done here: saturation to the
float8 range, float -> integer going through int64 so out-of-range values wrap
like a C cast (what the ONNX reference and onnxruntime do), and float8e8m0 with
its three rounding modes. Strings and the 6-bit floats have no XLA type: those
casts run on host values only (the model then runs op by op).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from onnxtrain.proto import TensorProto
from onnxtrain.translate.registry import op
from onnxtrain.translate.tensors import data_type_of, element_type
from onnxtrain.translate.values import NeedsHostValues

FLOAT8_TYPES = frozenset(np.dtype(t) for t in (
    ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz))
FLOAT6_TYPES = frozenset(np.dtype(t) for t in (ml_dtypes.float6_e2m3fn, ml_dtypes.float6_e3m2fn))
FLOAT8E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
# Floats XLA computes with; every narrower float converts to float32 exactly.
ARITHMETIC_FLOATS = frozenset(np.dtype(t) for t in
                              (np.float16, ml_dtypes.bfloat16, np.float32, np.float64))
_SUB_BYTE_INTEGERS = frozenset(np.dtype(t) for t in
                               (ml_dtypes.int2, ml_dtypes.uint2, ml_dtypes.int4, ml_dtypes.uint4))
_ROUND_MODES = ("up", "down", "nearest")
_E8M0_BIAS = 127
_E8M0_MAX_CODE = 254
_E8M0_NAN_CODE = 255


def is_text(dtype: np.dtype) -> bool:
    """True for the dtypes host string tensors come in (object, str, bytes)."""
    return np.dtype(dtype).kind in "OUS"


def is_integer(dtype: np.dtype) -> bool:
    """True for the integer element types, sub-byte ones included (bool is not one)."""
    dtype = np.dtype(dtype)
    return dtype.kind in "iu" or dtype in _SUB_BYTE_INTEGERS


def is_float(dtype: np.dtype) -> bool:
    """True for every floating element type: IEEE, bfloat16 and the 8/6/4-bit formats."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or (dtype.kind == "V" and dtype not in _SUB_BYTE_INTEGERS)


def target_dtype(node: Any, code: Any) -> np.dtype:
    """The numpy dtype of a `to`/`output_dtype` attribute: an element type code, or its name (Cast-1)."""
    if isinstance(code, str):
        try:
            code = TensorProto.DataType.Value(code.upper())
        except ValueError:
            raise node.error(f"'to' names no ONNX element type: {code!r}") from None
    return element_type(int(code), node.label).dtype


def convert(node: Any, x: Any, target: np.dtype, saturate: bool = True, round_mode: str = "up") -> Any:
    """x converted to `target` by the rules of ONNX Cast (see the module docstring)."""
    target = np.dtype(target)
    if is_text(target):
        return _to_text(node, x)
    if is_text(np.dtype(x.dtype)):
        x = _parse_text(node, x, target)
    if np.dtype(x.dtype) in FLOAT6_TYPES:
        x = np.asarray(x).astype(np.float32)
    if target in FLOAT6_TYPES:
        return to_float6(node, x, target)
    x = jnp.asarray(x)
    if x.dtype == target:
        return x
    if target == FLOAT8E8M0:
        return to_float8e8m0(node, x, saturate, round_mode)
    if target in FLOAT8_TYPES and saturate:
        return _saturating_float8(x, target)
    if is_integer(target) and is_float(x.dtype):
        return _float_to_integer(x, target)
    return x.astype(target)


def _saturating_float8(x: Any, target: np.dtype) -> Any:
    """Out-of-range values and infinities become the type's largest finite value; NaN stays NaN."""
    x = as_float(x)
    limit = float(ml_dtypes.finfo(target).max)
    return jnp.clip(x, -limit, limit).astype(target)


def _float_to_integer(x: Any, target: np.dtype) -> Any:
    """Truncation toward zero; narrower targets keep the low bits of the int64 (C cast semantics)."""
    if np.dtype(target).itemsize == 8:
        return x.astype(target)
    return x.astype(jnp.int64).astype(target)


def as_float(x: Any) -> Any:
    """x in a float type XLA computes with: float32 for narrow floats, float64 for integers."""
    dtype = np.dtype(x.dtype)
    if dtype in ARITHMETIC_FLOATS:
        return x
    return x.astype(jnp.float32 if is_float(dtype) or dtype == np.bool_ else jnp.float64)


def to_float8e8m0(node: Any, x: Any, saturate: bool, round_mode: str) -> Any:
    """Powers of two 2^-127..2^127 (the sign is ignored), rounded up, down or to the nearest.

    `nearest` rounds |x| >= 1.5 * 2^e up (ties up). Values beyond the range,
    zero and infinities saturate to the extreme codes, or become NaN when
    saturate=0; NaN stays NaN.
    """
    if round_mode not in _ROUND_MODES:
        raise node.error(f"round_mode must be one of {', '.join(_ROUND_MODES)}, not {round_mode!r}")
    parts = _binary_parts(x)
    code = parts.exponent + _E8M0_BIAS
    if round_mode == "up":
        code = code + (parts.fraction > 0)
    elif round_mode == "nearest":
        code = code + (parts.fraction >= parts.half)
    low = (code < 0) | parts.zero
    high = (code > _E8M0_MAX_CODE) | parts.infinite
    if saturate:
        code = jnp.where(low, 0, jnp.where(high, _E8M0_MAX_CODE, code))
    else:
        code = jnp.where(low | high, _E8M0_NAN_CODE, code)
    code = jnp.where(parts.nan, _E8M0_NAN_CODE, code)
    return lax.bitcast_convert_type(code.astype(jnp.uint8), FLOAT8E8M0)


@dataclass(frozen=True)
class _BinaryParts:
    """|x| = (1 + fraction / 2^m) * 2^exponent for finite nonzero x, with flags for the rest."""

    exponent: Any
    fraction: Any
    half: int
    zero: Any
    infinite: Any
    nan: Any


_FLOAT_BITS = {np.dtype(np.float32): (jnp.uint32, 23, 127), np.dtype(np.float64): (jnp.uint64, 52, 1023)}


def _binary_parts(x: Any) -> _BinaryParts:
    """Exponent and fraction read from the bits, so subnormals come out exact.

    XLA's CPU arithmetic flushes subnormals to zero, and float8e8m0's smallest
    value 2^-127 is a float32 subnormal; integer operations on the bits are exact.
    """
    x = as_float(x)
    if x.dtype != jnp.float64:
        x = x.astype(jnp.float32)
    unsigned, mantissa_bits, bias = _FLOAT_BITS[np.dtype(x.dtype)]
    width = np.dtype(unsigned).itemsize * 8
    bits = lax.bitcast_convert_type(x, unsigned) & ((1 << (width - 1)) - 1)
    field = (bits >> mantissa_bits).astype(jnp.int32)
    mask = (1 << mantissa_bits) - 1
    mantissa = bits & mask
    # A subnormal's leading one moves to the implicit bit's place.
    shift = (mantissa_bits + 1 - (width - lax.clz(mantissa))).astype(unsigned)
    subnormal = field == 0
    exponent = jnp.where(subnormal, 1 - bias - shift.astype(jnp.int32), field - bias)
    fraction = jnp.where(subnormal, (mantissa << shift) & mask, mantissa)
    special = field == (1 << (width - 1 - mantissa_bits)) - 1
    return _BinaryParts(exponent, fraction, 1 << (mantissa_bits - 1), zero=bits == 0,
                        infinite=special & (mantissa == 0), nan=special & (mantissa != 0))


def _host_only(node: Any, x: Any, why: str) -> np.ndarray:
    """x as numpy; NeedsHostValues when it is computed on the device."""
    if not isinstance(x, np.ndarray):
        raise NeedsHostValues(node.label, why)
    return x


def to_float6(node: Any, x: Any, target: np.dtype) -> np.ndarray:
    """6-bit floats saturate (they have no infinity or NaN); XLA has no such type, so numpy does it.

    Not even a host constant of such a type may enter a jit trace, so the model runs op by op.
    """
    if not node.evaluation.eager:
        raise NeedsHostValues(node.label, f"produces {target.name}, a type XLA cannot hold")
    x = np.asarray(x)
    return x.astype(np.float32 if is_float(x.dtype) else np.float64).astype(target)


def _to_text(node: Any, x: Any) -> np.ndarray:
    """Numbers as decimal strings: shortest round-trip form, 'NaN', 'INF', '-INF', bools as 1/0."""
    x = _host_only(node, x, "casts to strings, which only exist on the host")
    if is_text(x.dtype):
        return x.astype(object)
    if x.dtype == np.bool_:
        x = x.astype(np.uint8)
    if is_float(x.dtype) and x.dtype not in ARITHMETIC_FLOATS:
        x = x.astype(np.float32)
    text = np.empty(x.shape, dtype=object)
    text.reshape(-1)[:] = [_number_text(value) for value in x.reshape(-1)]
    return text


def _number_text(value: Any) -> str:
    if is_integer(np.dtype(type(value))):
        return str(int(value))
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "INF" if value > 0 else "-INF"
    return str(value)


def _parse_text(node: Any, x: np.ndarray, target: np.dtype) -> np.ndarray:
    """Strings as numbers: float64 for float and bool targets, int64/uint64 bit patterns for integers."""
    words = [_decoded(node, value) for value in np.asarray(x).reshape(-1)]
    if is_integer(target):
        codes = np.array([_parse_integer(node, word) % 2**64 for word in words], dtype=np.uint64)
        signed = ml_dtypes.iinfo(target).min < 0
        return (codes.view(np.int64) if signed else codes).reshape(x.shape)
    values = np.array([_parse_float(node, word) for word in words], dtype=np.float64)
    return (values != 0 if target == np.bool_ else values).reshape(x.shape)


def _decoded(node: Any, value: Any) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise node.error(f"cannot cast {value!r}, which is not UTF-8 text, to a number") from None
    return str(value)


def _parse_float(node: Any, word: str) -> float:
    """Decimal or scientific notation; INF, +INF, -INF and NaN in any letter case."""
    try:
        return float(word)
    except ValueError:
        raise node.error(f"cannot cast the string {word!r} to a number") from None


def _parse_integer(node: Any, word: str) -> int:
    """An integer literal exactly; other numbers truncated toward zero ('100.5' -> 100)."""
    try:
        return int(word)
    except ValueError:
        value = _parse_float(node, word)
    if not math.isfinite(value):
        raise node.error(f"cannot cast the string {word!r} to an integer")
    return int(value)


# --- Cast, CastLike ---------------------------------------------------------------------


@op("Cast", since=1)
def cast_1(node: Any, x: Any) -> Any:
    """x converted to the element type `to` names (a string such as 'FLOAT' in opset 1)."""
    return convert(node, x, target_dtype(node, node.attr("to")))


@op("Cast", since=6)
@op("Cast", since=19)
@op("Cast", since=24)
def cast(node: Any, x: Any) -> Any:
    """x converted to element type `to`; float8 saturation (opset 19) and float8e8m0 rounding (opset 24)."""
    return convert(node, x, target_dtype(node, node.attr("to")),
                   saturate=bool(node.attr("saturate", 1)), round_mode=node.attr("round_mode", "up"))


@op("CastLike", since=15)
@op("CastLike", since=19)
@op("CastLike", since=24)
def cast_like(node: Any, x: Any, like: Any) -> Any:
    """x converted to the element type of `like`, by Cast's rules."""
    return convert(node, x, np.dtype(like.dtype), saturate=bool(node.attr("saturate", 1)),
                   round_mode=node.attr("round_mode", "up"))


# --- BitCast ----------------------------------------------------------------------------


@op("BitCast", since=26, differentiable=False)
def bit_cast(node: Any, x: Any) -> Any:
    """The bits of x reinterpreted as element type `to` of the same width (little endian)."""
    target = element_type(int(node.attr("to")), node.label)
    source = element_type(data_type_of(x.dtype), node.label)
    if TensorProto.STRING in (source.code, target.code):
        raise node.error("BitCast does not take strings")
    if {source.dtype, target.dtype} & FLOAT6_TYPES:
        raise node.error("BitCast does not take the 6-bit float types")
    if source.bits != target.bits:
        raise node.error(f"BitCast needs types of one width, but {source.name} has {source.bits} bits "
                         f"and {target.name} has {target.bits}")
    x = jnp.asarray(x)
    if source.dtype == target.dtype:
        return x
    return _from_unsigned(_to_unsigned(x, source.bits), target.dtype)


def _unsigned_of_width(bits: int) -> np.dtype:
    return {2: np.dtype(ml_dtypes.uint2), 4: np.dtype(ml_dtypes.uint4)}.get(bits) or np.dtype(f"uint{bits}")


def _to_unsigned(x: Any, bits: int) -> Any:
    """The bit pattern of x as an unsigned integer of its width (complex64: imaginary part high)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    if x.dtype == jnp.complex64:
        real = lax.bitcast_convert_type(jnp.real(x), jnp.uint32).astype(jnp.uint64)
        imag = lax.bitcast_convert_type(jnp.imag(x), jnp.uint32).astype(jnp.uint64)
        return real | (imag << 32)
    return lax.bitcast_convert_type(x, _unsigned_of_width(bits))


def _from_unsigned(bits: Any, dtype: np.dtype) -> Any:
    """The inverse of _to_unsigned: an unsigned bit pattern read as `dtype`."""
    if dtype == np.bool_:
        return bits != 0
    if dtype == np.complex64:
        real = lax.bitcast_convert_type((bits & 0xFFFFFFFF).astype(jnp.uint32), jnp.float32)
        imag = lax.bitcast_convert_type((bits >> 32).astype(jnp.uint32), jnp.float32)
        return lax.complex(real, imag)
    return lax.bitcast_convert_type(bits, dtype)
