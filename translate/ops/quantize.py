"""Linear quantization: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear and the
integer products MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv.

Scales and zero points are per tensor (a scalar), per axis (a 1-D tensor along
`axis`) or blocked (the input's shape with `axis` divided into blocks of
`block_size`); they are expanded to broadcast against the input. Integer
products accumulate exactly in int32 (wrapping only where ONNX allows it, in
the 32-bit accumulator); requantization rounds half to even and saturates to
the output type. The 8/6/4-bit float outputs follow Cast's conversion rules.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from onnxtrain.translate.ops.cast import (
    ARITHMETIC_FLOATS,
    FLOAT6_TYPES,
    FLOAT8_TYPES,
    convert,
    is_integer,
    target_dtype,
)
from onnxtrain.translate.ops.common import normalize_axis
from onnxtrain.translate.ops.conv_pool import check_groups, kernel_from_weights, window_of
from onnxtrain.translate.registry import op

_QUANTIZED_INTEGERS = frozenset(np.dtype(t) for t in (
    np.int8, np.uint8, np.int16, np.uint16, ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.int2, ml_dtypes.uint2))
_QUANTIZED_FLOATS = FLOAT8_TYPES | FLOAT6_TYPES | {np.dtype(ml_dtypes.float4_e2m1fn)}


def _integer_range(dtype: np.dtype) -> tuple[int, int]:
    info = ml_dtypes.iinfo(dtype)
    return int(info.min), int(info.max)


# --- scale and zero point layouts ------------------------------------------------------------


def _broadcastable(node: Any, param: Any, shape: tuple[int, ...], axis: int, block_size: int,
                   what: str) -> Any:
    """A scale or zero point reshaped (per axis) or repeated (blocked) to broadcast against `shape`."""
    if param is None:
        return None
    param = _computable(param)
    param_shape = tuple(param.shape)
    if math.prod(param_shape) == 1 and len(param_shape) <= 1:
        return jnp.reshape(jnp.asarray(param), ())
    rank = len(shape)
    if not -rank <= axis < rank:
        raise node.error(f"axis {axis} is out of range for a rank-{rank} input")
    axis = normalize_axis(axis, rank)
    if block_size > 0:
        return _blocked(node, param, shape, axis, block_size, what)
    if len(param_shape) != 1 or param_shape[0] != shape[axis]:
        raise node.error(f"{what} of shape {list(param_shape)} is neither a scalar nor a 1-D tensor of "
                         f"the input's axis {axis} length {shape[axis]} (set block_size for blocked "
                         f"quantization)")
    return jnp.reshape(jnp.asarray(param), tuple(-1 if i == axis else 1 for i in range(rank)))


def _blocked(node: Any, param: Any, shape: tuple[int, ...], axis: int, block_size: int, what: str) -> Any:
    """Each entry of a blocked scale/zero point repeated over its block of `block_size` along `axis`."""
    blocks = -(-shape[axis] // block_size)
    expected = shape[:axis] + (blocks,) + shape[axis + 1:]
    if tuple(param.shape) != expected:
        raise node.error(f"{what} of shape {list(param.shape)} does not fit blocked quantization of an "
                         f"input of shape {list(shape)} along axis {axis} with block_size {block_size}: "
                         f"shape {list(expected)} expected")
    repeated = jnp.repeat(jnp.asarray(param), block_size, axis=axis, total_repeat_length=blocks * block_size)
    return lax.slice_in_dim(repeated, 0, shape[axis], axis=axis)


def _layout(node: Any) -> tuple[int, int]:
    """(axis, block_size) of a Q/DQ node; opset 10 knows only per-tensor parameters."""
    if node.opset < 13:
        return 1, 0
    block_size = node.attr("block_size", 0)
    if block_size < 0:
        raise node.error(f"block_size must be positive (or 0 for no blocking), got {block_size}")
    return node.attr("axis", 1), block_size


def _check_per_tensor(node: Any, *params: Any) -> None:
    """Opset 10 has no axis attribute: its scales and zero points are scalars."""
    if node.opset < 13 and any(p is not None and np.size(p) != 1 for p in params):
        raise node.error("opset 10 QuantizeLinear/DequantizeLinear take only scalar scales and zero points")


def _computable(value: Any) -> Any:
    """Host 6-bit floats (no XLA type) as float32 numpy, which holds them exactly; others as given."""
    if np.dtype(value.dtype) in FLOAT6_TYPES:
        return np.asarray(value).astype(np.float32)
    return value


def _as_float32(x: Any) -> Any:
    return jnp.asarray(_computable(x)).astype(jnp.float32)


# --- QuantizeLinear ------------------------------------------------------------------------


def _quantized_type(node: Any, zero_point: Any) -> np.dtype:
    """The output type: the zero point's, else output_dtype, else uint8."""
    declared = node.attr("output_dtype", 0)
    if zero_point is not None:
        dtype = np.dtype(zero_point.dtype)
        if declared and target_dtype(node, declared) != dtype:
            raise node.error(f"output_dtype {target_dtype(node, declared).name} differs from the zero "
                             f"point's type {dtype.name}")
    else:
        dtype = target_dtype(node, declared) if declared else np.dtype(np.uint8)
    if dtype not in _QUANTIZED_INTEGERS | _QUANTIZED_FLOATS:
        raise node.error(f"{dtype.name} is not a quantized type")
    return dtype


def _division_dtype(node: Any, x: Any, scale: Any) -> np.dtype:
    """The precision attribute's type, else the wider float of x and the scale (float32 otherwise)."""
    precision = node.attr("precision", 0)
    if precision:
        dtype = target_dtype(node, precision)
        if dtype not in ARITHMETIC_FLOATS:
            raise node.error(f"precision must be a float type, not {dtype.name}")
        return dtype
    floats = [np.dtype(v.dtype) for v in (x, scale) if np.dtype(v.dtype) in ARITHMETIC_FLOATS]
    return jnp.promote_types(*floats) if len(floats) == 2 else (floats[0] if floats else np.dtype(np.float32))


def quantize(node: Any, scaled: Any, zero_point: Any, dtype: np.dtype, saturate: bool = True) -> Any:
    """saturate(round(scaled) + zero_point) for integer types; Cast's rules for float types."""
    if dtype in _QUANTIZED_INTEGERS:
        low, high = _integer_range(dtype)
        rounded = jnp.rint(scaled).astype(jnp.float32)
        if zero_point is not None:
            rounded = rounded + _as_float32(zero_point)
        return jnp.clip(rounded, low, high).astype(dtype)
    if zero_point is not None:
        scaled = scaled.astype(jnp.float32) + _as_float32(zero_point)
    return convert(node, scaled, dtype, saturate=saturate)


@op("QuantizeLinear", since=10, differentiable=False)
@op("QuantizeLinear", since=13, differentiable=False)
@op("QuantizeLinear", since=19, differentiable=False)
@op("QuantizeLinear", since=21, differentiable=False)
@op("QuantizeLinear", since=23, differentiable=False)
def quantize_linear(node: Any, x: Any, y_scale: Any, y_zero_point: Any = None) -> Any:
    """y = saturate(round_half_even(x / y_scale) + y_zero_point): per tensor, per axis (13) or blocked (21)."""
    _check_per_tensor(node, y_scale, y_zero_point)
    axis, block_size = _layout(node)
    dtype = _quantized_type(node, y_zero_point)
    shape = tuple(x.shape)
    scale = _broadcastable(node, y_scale, shape, axis, block_size, "y_scale")
    zero_point = _broadcastable(node, y_zero_point, shape, axis, block_size, "y_zero_point")
    precision = _division_dtype(node, x, y_scale)
    scaled = jnp.asarray(x).astype(precision) / scale.astype(precision)
    return quantize(node, scaled, zero_point, dtype, saturate=bool(node.attr("saturate", 1)))


# --- DequantizeLinear -------------------------------------------------------------------


def _centered(x: Any, zero_point: Any) -> Any:
    """x - zero_point as float32, subtracted exactly in int32 for integer types."""
    if zero_point is None:
        return _as_float32(x)
    if is_integer(x.dtype):
        return (jnp.asarray(x).astype(jnp.int32) - zero_point.astype(jnp.int32)).astype(jnp.float32)
    return _as_float32(x) - _as_float32(zero_point)


@op("DequantizeLinear", since=10)
@op("DequantizeLinear", since=13)
@op("DequantizeLinear", since=21)
@op("DequantizeLinear", since=23)
def dequantize_linear(node: Any, x: Any, x_scale: Any, x_zero_point: Any = None) -> Any:
    """y = (x - x_zero_point) * x_scale in float32, output as output_dtype (23) or the scale's type."""
    _check_per_tensor(node, x_scale, x_zero_point)
    axis, block_size = _layout(node)
    declared = node.attr("output_dtype", 0)
    dtype = target_dtype(node, declared) if declared else np.dtype(x_scale.dtype)
    if dtype not in ARITHMETIC_FLOATS:
        raise node.error(f"the output type {dtype.name} is not float, float16 or bfloat16; "
                         f"set output_dtype when the scale is float8e8m0")
    shape = tuple(x.shape)
    scale = _broadcastable(node, x_scale, shape, axis, block_size, "x_scale")
    zero_point = _broadcastable(node, x_zero_point, shape, axis, block_size, "x_zero_point")
    return (_centered(x, zero_point) * _as_float32(scale)).astype(dtype)


# --- DynamicQuantizeLinear --------------------------------------------------------------


@op("DynamicQuantizeLinear", since=11, differentiable=False)
def dynamic_quantize_linear(node: Any, x: Any) -> tuple[Any, Any, Any]:
    """uint8 quantization of x over the range [min(x, 0), max(x, 0)]: (y, y_scale, y_zero_point)."""
    x = jnp.asarray(x)
    low = jnp.min(x, initial=0.0)
    high = jnp.max(x, initial=0.0)
    width = jnp.where(high == low, jnp.float32(1), high - low)
    scale = (width / jnp.float32(255)).astype(x.dtype)
    zero_point = jnp.rint(jnp.clip(-low / scale, 0, 255))
    y = jnp.clip(jnp.rint(x / scale) + zero_point, 0, 255)
    return y.astype(jnp.uint8), scale, zero_point.astype(jnp.uint8)


# --- integer matrix products ------------------------------------------------------------


def _per_row(value: Any, a: Any) -> Any:
    """A 1-D per-row scale or zero point of matrix `a` ([M, K]) as a column [M, 1]; others as given."""
    value = jnp.asarray(value)
    if value.ndim == 1 and value.shape[0] != 1 and a.ndim >= 2:
        return value.reshape(-1, 1)
    return value


def _integer_centered(x: Any, zero_point: Any) -> Any:
    """x - zero_point in int32 (exact for every 8/16-bit operand)."""
    x = jnp.asarray(x).astype(jnp.int32)
    return x if zero_point is None else x - jnp.asarray(zero_point).astype(jnp.int32)


def _integer_matmul(a: Any, b: Any) -> Any:
    return jnp.matmul(a, b, preferred_element_type=jnp.int32)


@op("MatMulInteger", since=10, differentiable=False)
def matmul_integer(node: Any, a: Any, b: Any, a_zero_point: Any = None, b_zero_point: Any = None) -> Any:
    """int32 (a - a_zero_point) @ (b - b_zero_point); zero points per tensor, per row of a, per column of b."""
    a_zero_point = None if a_zero_point is None else _per_row(a_zero_point, a)
    return _integer_matmul(_integer_centered(a, a_zero_point), _integer_centered(b, b_zero_point))


def _requantize(node: Any, accumulated: Any, multiplier: Any, zero_point: Any) -> Any:
    """accumulated * multiplier (float32), rounded half to even, plus the zero point, saturated."""
    if zero_point is None:
        raise node.error("the output zero point is required (its type is the output type)")
    scaled = accumulated.astype(jnp.float32) * multiplier
    return quantize(node, scaled, jnp.asarray(zero_point), np.dtype(zero_point.dtype))


@op("QLinearMatMul", since=10, differentiable=False)
@op("QLinearMatMul", since=21, differentiable=False)
def qlinear_matmul(node: Any, a: Any, a_scale: Any, a_zero_point: Any, b: Any, b_scale: Any,
                   b_zero_point: Any, y_scale: Any, y_zero_point: Any) -> Any:
    """Quantized a @ b requantized to y's scale and zero point; float8 inputs (21) multiply in float32."""
    multiplier = (_as_float32(_per_row(a_scale, a)) * _as_float32(b_scale)) / _as_float32(y_scale)
    a_zero_point, b_zero_point = _per_row(a_zero_point, a), jnp.asarray(b_zero_point)
    if is_integer(a.dtype) and is_integer(b.dtype):
        product = _integer_matmul(_integer_centered(a, a_zero_point), _integer_centered(b, b_zero_point))
    else:
        product = jnp.matmul(_centered(a, a_zero_point), _centered(b, b_zero_point),
                             preferred_element_type=jnp.float32)
    return _requantize(node, product, multiplier, y_zero_point)


# --- integer convolutions ---------------------------------------------------------------


def _per_channel(node: Any, value: Any, channels: int, trailing: int, what: str) -> Any:
    """A scalar, or a 1-D tensor with one value per output channel shaped (channels, 1 x trailing)."""
    value = jnp.asarray(value)
    if value.size == 1:
        return value.reshape(())
    if value.ndim != 1 or value.shape[0] != channels:
        raise node.error(f"{what} must be a scalar or hold one value per output channel ({channels}), "
                         f"got shape {list(value.shape)}")
    return value.reshape((channels,) + (1,) * trailing)


def _integer_conv(node: Any, x: Any, w: Any) -> Any:
    """Grouped N-D cross-correlation of int32 tensors, accumulated in int32, with ONNX padding."""
    if x.ndim < 3:
        raise node.error(f"the input must be (N, C, spatial...), got shape {list(x.shape)}")
    group = node.attr("group", 1)
    check_groups(node, x.shape[1], w.shape[1], group)
    window = window_of(node, x.shape[2:], kernel_from_weights(node, w))
    return lax.conv_general_dilated(x, w, window.strides, window.pads, rhs_dilation=window.dilations,
                                    feature_group_count=group, preferred_element_type=jnp.int32)


def _centered_weights(node: Any, w: Any, zero_point: Any) -> Any:
    """w - w_zero_point in int32, the zero point per tensor or per output channel."""
    w = jnp.asarray(w).astype(jnp.int32)
    if zero_point is None:
        return w
    zero_point = _per_channel(node, zero_point, w.shape[0], w.ndim - 1, "w_zero_point")
    return w - zero_point.astype(jnp.int32)


def _check_scalar(node: Any, value: Any, what: str) -> None:
    """Only the weights of a convolution may be quantized per channel."""
    if value is not None and np.size(value) != 1:
        raise node.error(f"{what} must be a scalar (per-tensor), got shape {list(np.shape(value))}")


@op("ConvInteger", since=10, differentiable=False)
def conv_integer(node: Any, x: Any, w: Any, x_zero_point: Any = None, w_zero_point: Any = None) -> Any:
    """int32 convolution of (x - x_zero_point) with (w - w_zero_point); w's zero point may be per channel."""
    _check_scalar(node, x_zero_point, "x_zero_point")
    x = _integer_centered(x, None if x_zero_point is None else jnp.reshape(x_zero_point, ()))
    return _integer_conv(node, x, _centered_weights(node, w, w_zero_point))


@op("QLinearConv", since=10, differentiable=False)
def qlinear_conv(node: Any, x: Any, x_scale: Any, x_zero_point: Any, w: Any, w_scale: Any,
                 w_zero_point: Any, y_scale: Any, y_zero_point: Any, bias: Any = None) -> Any:
    """Quantized convolution plus int32 bias, requantized to y's scale and zero point (w per channel)."""
    for value, what in ((x_scale, "x_scale"), (x_zero_point, "x_zero_point"),
                        (y_scale, "y_scale"), (y_zero_point, "y_zero_point")):
        _check_scalar(node, value, what)
    x = _integer_centered(x, jnp.reshape(x_zero_point, ()))
    accumulated = _integer_conv(node, x, _centered_weights(node, w, w_zero_point))
    rank = accumulated.ndim - 2
    if bias is not None:
        accumulated = accumulated + jnp.asarray(bias).astype(jnp.int32).reshape((1, -1) + (1,) * rank)
    w_scale = _per_channel(node, w_scale, w.shape[0], rank, "w_scale")
    multiplier = _as_float32(x_scale).reshape(()) * _as_float32(w_scale) / _as_float32(y_scale).reshape(())
    return _requantize(node, accumulated, multiplier, jnp.reshape(jnp.asarray(y_zero_point), ()))
