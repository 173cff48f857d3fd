"""Casts and quantization: behaviour the ONNX backend cases miss.

Oracles: onnx.reference.ReferenceEvaluator, numpy/ml_dtypes, hand-derived
values, and central finite differences in float64 for gradients.
"""

from __future__ import annotations

import logging

import jax
import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import onnxtrain
from onnxtrain.errors import ModelLoadError
from onnxtrain.translate.model import TranslatedModel
from support.op_testing import single_op_feeds, single_op_model

RNG = np.random.default_rng(0)
FLOAT8 = [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz]






def run_all(op_type: str, inputs: list[np.ndarray | None], opset: int = 25, host: bool = False,
            outputs: int = 1, **attributes) -> list[np.ndarray]:
    model = single_op_model(op_type, inputs, opset, host, outputs, **attributes)
    fn = TranslatedModel(onnxtrain.load_model(model))
    result = fn(fn.params, {} if host else single_op_feeds(inputs))
    return [np.asarray(result[f"Y{i}"]) for i in range(outputs)]


def run(op_type: str, inputs: list[np.ndarray | None], opset: int = 25, host: bool = False,
        **attributes) -> np.ndarray:
    return run_all(op_type, inputs, opset, host, **attributes)[0]


def reference(op_type: str, inputs: list[np.ndarray | None], opset: int = 25, **attributes) -> np.ndarray:
    model = single_op_model(op_type, inputs, opset, **attributes)
    return ReferenceEvaluator(model).run(None, single_op_feeds(inputs))[0]


def assert_bits_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    """Same dtype and the same value in every element (NaN matches NaN, -0 differs from 0)."""
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape
    if expected.dtype.kind in "fV" and expected.dtype.itemsize <= 8:
        a, e = actual.astype(np.float64), expected.astype(np.float64)
        same = (np.isnan(a) & np.isnan(e)) | ((a == e) & (np.signbit(a) == np.signbit(e)))
        assert same.all(), f"differ at {np.argwhere(~same)[:5].tolist()}: {a[~same][:5]} != {e[~same][:5]}"
    else:
        np.testing.assert_array_equal(actual, expected)


def cast(x: np.ndarray, to: int, opset: int = 25, host: bool = False, **attributes) -> np.ndarray:
    return run("Cast", [x], opset, host, to=to, **attributes)


# --- Cast: numeric ---------------------------------------------------------------------------

def test_float_to_narrow_integers_wraps_like_a_c_cast():
    # ONNX leaves out-of-range float -> int undefined; onnxtrain truncates to int64 and keeps the
    # low bits, as onnxruntime (and numpy on x86) do, instead of XLA's saturation.
    x = np.array([200.7, -200.5, 300.0, -1.9, 2.0**40 + 5], np.float32)
    expected = np.array([200, -200, 300, -1, 2**40], np.int64)
    assert_bits_equal(cast(x, TensorProto.INT8), expected.astype(np.int8))
    assert_bits_equal(cast(x, TensorProto.UINT16), expected.astype(np.uint16))
    assert_bits_equal(cast(x, TensorProto.UINT32), expected.astype(np.uint32))
    assert_bits_equal(cast(x, TensorProto.INT4), expected.astype(np.int8).astype(ml_dtypes.int4))


def test_integer_narrowing_keeps_low_bits():
    x = np.array([200, -56, 70000, -1], np.int64)
    assert_bits_equal(cast(x, TensorProto.INT8), np.array([-56, -56, 112, -1], np.int8))
    assert_bits_equal(cast(x, TensorProto.UINT2), np.array([0, 0, 0, 3], np.uint8).astype(ml_dtypes.uint2))


@pytest.mark.parametrize("to", [TensorProto.BOOL, TensorProto.INT32, TensorProto.FLOAT16, TensorProto.UINT64])
def test_host_constants_and_device_values_cast_alike(to):
    x = np.array([0.0, -0.0, 2.5, -7.75, np.nan, 1e3], np.float32)
    if to in (TensorProto.INT32, TensorProto.UINT64):
        x = x[np.isfinite(x) & (x >= 0)]
    assert_bits_equal(cast(x, to, host=True), cast(x, to))


@pytest.mark.parametrize("dtype", FLOAT8, ids=lambda t: t.__name__)
def test_float8_saturation_from_integers_and_doubles(dtype):
    limit = float(ml_dtypes.finfo(dtype).max)
    doubles = np.array([1e300, -1e300, np.inf, -np.inf, limit * 1.01, 0.3], np.float64)
    expected = np.array([limit, -limit, limit, -limit, limit, 0.3]).astype(dtype)
    to = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    assert_bits_equal(cast(doubles, to), expected)
    integers = np.array([10**6, -10**6, 3], np.int32)
    assert_bits_equal(cast(integers, to), np.array([limit, -limit, 3]).astype(dtype))


@pytest.mark.parametrize("dtype", FLOAT8, ids=lambda t: t.__name__)
def test_float8_without_saturation_follows_the_onnx_table(dtype):
    x = np.array([np.inf, -np.inf, 1e6, -1e6, np.nan, -0.0, 1.0], np.float32)
    nan, zero = np.nan, 0.0
    table = {  # Cast's saturate=0 table: Inf, -Inf, [x] > max, [x] < -max, NaN, -0, 1
        ml_dtypes.float8_e4m3fn: [nan, nan, nan, nan, nan, -0.0, 1.0],
        ml_dtypes.float8_e4m3fnuz: [nan, nan, nan, nan, nan, zero, 1.0],
        ml_dtypes.float8_e5m2: [np.inf, -np.inf, np.inf, -np.inf, nan, -0.0, 1.0],
        ml_dtypes.float8_e5m2fnuz: [nan, nan, nan, nan, nan, zero, 1.0],
    }
    to = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    actual = cast(x, to, saturate=0)
    assert actual.dtype == dtype
    assert_bits_equal(actual.astype(np.float32), np.array(table[dtype], np.float32))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_float8_rounding_matches_the_reference_on_random_bits():
    x = RNG.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([x, RNG.standard_normal(4000).astype(np.float32) * 300])
    for dtype in FLOAT8:
        to = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        for saturate in (0, 1):
            expected = reference("Cast", [x], to=to, saturate=saturate)
            assert_bits_equal(cast(x, to, saturate=saturate), expected)


def test_cast_to_float16_is_differentiable():
    model = single_op_model("Cast", [np.zeros(3, np.float64)], 25, to=TensorProto.FLOAT)
    fn = TranslatedModel(onnxtrain.load_model(model))
    with jax.enable_x64(True):
        grad = jax.grad(lambda x: fn(fn.params, {"X0": x})["Y0"].sum())(np.arange(3.0))
    np.testing.assert_array_equal(np.asarray(grad), np.ones(3))


def test_opset_1_names_the_target_type():
    x = np.array([1.5, -2.0], np.float32)
    assert_bits_equal(cast(x, "DOUBLE", opset=1), x.astype(np.float64))


def test_unknown_target_type_is_reported():
    with pytest.raises(ModelLoadError, match="data_type 99"):
        cast(np.zeros(2, np.float32), 99)


# --- Cast: float8e8m0 ---------------------------------------------------------------------------

E8M0 = TensorProto.FLOAT8E8M0


def e8m0(values: list[float]) -> np.ndarray:
    return np.array(values, np.float32).astype(ml_dtypes.float8_e8m0fnu)


@pytest.mark.parametrize("round_mode, expected", [
    ("up", [0.25, 0.5, 0.5, 0.5, 1.0, 2.0**127]),
    ("down", [0.125, 0.25, 0.25, 0.25, 1.0, 2.0**127]),
    ("nearest", [0.25, 0.25, 0.5, 0.5, 1.0, 2.0**127]),
])
def test_e8m0_rounding_modes(round_mode, expected):
    # 0.2 = 1.6 * 2^-3, 0.3 = 1.2 * 2^-2, -0.4 = -1.6 * 2^-2 (the sign is ignored);
    # 0.375 = 1.5 * 2^-2 is the tie that `nearest` rounds up.
    x = np.array([0.2, 0.3, 0.375, -0.4, 1.0, 2.0**127], np.float32)
    assert_bits_equal(cast(x, E8M0, round_mode=round_mode), e8m0(expected))


def test_e8m0_matches_the_reference_for_normal_floats():
    x = np.exp2(RNG.uniform(-120, 120, 3000)).astype(np.float32)
    for mode in ("up", "down", "nearest"):
        expected = reference("Cast", [x], to=E8M0, round_mode=mode)
        assert_bits_equal(cast(x, E8M0, round_mode=mode), expected)


def test_e8m0_saturates_or_gives_nan_out_of_range():
    x = np.array([0.0, 2.0**-140, np.inf, 1.5 * 2.0**127, np.nan], np.float32)
    smallest, largest = 2.0**-127, 2.0**127
    assert_bits_equal(cast(x, E8M0), e8m0([smallest, smallest, largest, largest, np.nan]))
    assert np.isnan(cast(x, E8M0, saturate=0, round_mode="nearest").astype(np.float32)).all()


def test_e8m0_reads_float32_subnormals_exactly():
    # The smallest e8m0 value 2^-127 is a float32 subnormal, which XLA's CPU arithmetic flushes to 0.
    x = np.array([2.0**-127, 1.25 * 2.0**-127, 1.5 * 2.0**-127], np.float32)
    assert_bits_equal(cast(x, E8M0, round_mode="up"), e8m0([2.0**-127, 2.0**-126, 2.0**-126]))
    assert_bits_equal(cast(x, E8M0, round_mode="down"), e8m0([2.0**-127] * 3))
    assert_bits_equal(cast(x, E8M0, round_mode="nearest"), e8m0([2.0**-127, 2.0**-127, 2.0**-126]))


def test_e8m0_from_doubles_rounds_once():
    # 1 + 2^-40 is above 1, so rounding up gives 2; going through float32 first would give 1.
    assert_bits_equal(cast(np.array([1 + 2.0**-40]), E8M0), e8m0([2.0]))


def test_e8m0_rejects_an_unknown_round_mode():
    with pytest.raises(ModelLoadError, match="round_mode"):
        cast(np.ones(2, np.float32), E8M0, round_mode="sideways")


# --- Cast: strings and 6-bit floats (host only) ------------------------------------------------

def test_strings_to_numbers():
    words = np.array(["1.5", "+INF", "inf", "-Inf", "NaN", "1e-5", "-0", "100.5"], dtype=object)
    floats = cast(words, TensorProto.FLOAT)
    assert_bits_equal(floats, np.array([1.5, np.inf, np.inf, -np.inf, np.nan, 1e-5, -0.0, 100.5], np.float32))
    integers = cast(np.array(["100.5", "-7", "9223372036854775807", "300"], dtype=object), TensorProto.INT64)
    assert_bits_equal(integers, np.array([100, -7, 2**63 - 1, 300], np.int64))
    assert_bits_equal(cast(np.array(["300", "-1"], dtype=object), TensorProto.UINT8), np.array([44, 255], np.uint8))
    assert_bits_equal(cast(np.array(["0", "2.5"], dtype=object), TensorProto.BOOL), np.array([False, True]))


def test_numbers_to_strings_round_trip():
    x = np.array([0.1, -2.5e-7, 3.0, np.inf, -np.inf, np.nan, 1e20], np.float32)
    text = cast(x, TensorProto.STRING)
    assert list(text[3:6]) == ["INF", "-INF", "NaN"]
    back = cast(text.astype(object), TensorProto.FLOAT)
    assert_bits_equal(back, x)
    assert list(cast(np.array([True, False]), TensorProto.STRING)) == ["1", "0"]
    assert list(cast(np.array([-5, 2**62], np.int64), TensorProto.STRING)) == ["-5", str(2**62)]


def test_cast_to_string_of_a_device_value_runs_op_by_op(caplog):
    x = np.array([1.0, 2.5], np.float32)
    model = single_op_model("Mul", [x, x], 25)
    model.graph.node.append(helper.make_node("Cast", ["Y0"], ["Z"], to=TensorProto.STRING))
    model.graph.output.append(helper.make_tensor_value_info("Z", TensorProto.STRING, None))
    fn = TranslatedModel(onnxtrain.load_model(model))
    with caplog.at_level(logging.WARNING, logger="onnxtrain"):
        text = fn(fn.params, single_op_feeds([x, x]))["Z"]
    assert list(text) == ["1.0", "6.25"]
    assert "strings" in caplog.text


def test_non_numeric_string_is_an_error():
    with pytest.raises(ModelLoadError, match="'twelve'"):
        cast(np.array(["twelve"], dtype=object), TensorProto.FLOAT)


@pytest.mark.parametrize("code, dtype", [(TensorProto.FLOAT6E2M3, ml_dtypes.float6_e2m3fn),
                                         (TensorProto.FLOAT6E3M2, ml_dtypes.float6_e3m2fn)])
def test_float6_casts_on_host_values(code, dtype):
    x = np.array([0.3, -1e6, np.inf, 2.0], np.float32)
    six = cast(x, code, host=True)
    assert_bits_equal(six, x.astype(dtype))
    assert_bits_equal(cast(six, TensorProto.FLOAT16, host=True), x.astype(dtype).astype(np.float16))


# --- CastLike, BitCast ----------------------------------------------------------------------------

def test_cast_like_takes_the_type_of_its_second_input():
    x = np.array([1e6, -3.3], np.float32)
    like = np.zeros(1, ml_dtypes.float8_e5m2)
    assert_bits_equal(run("CastLike", [x, like]), np.array([57344.0, -3.3]).astype(ml_dtypes.float8_e5m2))
    assert_bits_equal(run("CastLike", [x, like], saturate=0), x.astype(ml_dtypes.float8_e5m2))
    text = run("CastLike", [np.array([2, 3], np.int32), np.array(["a"], dtype=object)])
    assert list(text) == ["2", "3"]


def bit_sample(dtype: type) -> np.ndarray:
    """Six values of `dtype` with varied bit patterns (bools and bytes that are valid bools)."""
    if np.dtype(dtype) == np.complex64:
        return (RNG.standard_normal(6) + 1j * RNG.standard_normal(6)).astype(np.complex64)
    if np.dtype(dtype) == np.bool_:
        return np.array([True, False, True, True, False, False])
    return RNG.integers(0, 200, 6).astype(np.int64).astype(dtype)


@pytest.mark.parametrize("source, target", [
    (np.complex64, np.int64), (np.int64, np.complex64), (np.complex64, np.float64),
    (np.bool_, np.int8), (ml_dtypes.int4, ml_dtypes.float4_e2m1fn), (ml_dtypes.uint2, ml_dtypes.int2),
    (np.uint8, ml_dtypes.float8_e8m0fnu), (np.float16, ml_dtypes.bfloat16),
], ids=str)
def test_bitcast_reinterprets_little_endian_bits(source, target):
    x = bit_sample(source)
    to = helper.np_dtype_to_tensor_dtype(np.dtype(target))
    assert_bits_equal(run("BitCast", [x], opset=26, to=to), x.view(target))


def test_bitcast_bytes_to_bool():
    x = np.array([0, 1, 1, 0], np.uint8)
    assert_bits_equal(run("BitCast", [x], opset=26, to=TensorProto.BOOL), x.view(np.bool_))


def test_bitcast_needs_equal_widths():
    with pytest.raises(ModelLoadError, match="one width"):
        run("BitCast", [np.zeros(2, np.float32)], opset=26, to=TensorProto.INT64)


# --- QuantizeLinear / DequantizeLinear ---------------------------------------------------------

def test_quantize_blocked_with_a_partial_last_block_matches_reference():
    x = RNG.standard_normal((3, 7)).astype(np.float32) * 10
    scale = RNG.uniform(0.05, 0.5, (3, 3)).astype(np.float32)
    zero_point = RNG.integers(-20, 20, (3, 3)).astype(np.int8)
    inputs = [x, scale, zero_point]
    attributes = dict(axis=-1, block_size=3)
    assert_bits_equal(run("QuantizeLinear", inputs, **attributes), reference("QuantizeLinear", inputs, **attributes))
    q = run("QuantizeLinear", inputs, **attributes)
    assert_bits_equal(run("DequantizeLinear", [q, scale, zero_point], **attributes),
                      reference("DequantizeLinear", [q, scale, zero_point], **attributes))


def test_quantize_per_axis_with_negative_axis():
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32) * 50
    scale = np.array([0.5, 1.0, 2.0], np.float32)
    zero_point = np.array([0, 10, 250], np.uint8)
    expected = np.clip(np.rint(x / scale[:, None]) + zero_point[:, None], 0, 255).astype(np.uint8)
    assert_bits_equal(run("QuantizeLinear", [x, scale, zero_point], axis=-2), expected)


@pytest.mark.parametrize("code", [TensorProto.INT4, TensorProto.UINT2, TensorProto.INT16,
                                  TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT4E2M1])
def test_quantize_output_dtype_without_zero_point(code):
    x = np.array([-1000.0, -3.4, -0.5, 0.5, 1.5, 2.5, 7.0, 1000.0], np.float32)
    scale = np.array(0.5, np.float32)
    assert_bits_equal(run("QuantizeLinear", [x, scale], output_dtype=code),
                      reference("QuantizeLinear", [x, scale], output_dtype=code))


def test_quantize_rounds_half_to_even_and_saturates():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 1e9, -1e9], np.float32)
    y = run("QuantizeLinear", [x, np.float32(1.0), np.int8(0)])
    assert_bits_equal(y, np.array([0, 2, 2, 0, -2, 127, -128], np.int8))


def test_quantize_to_float8_without_saturation():
    x = np.array([1e6, -1e6, 3.0], np.float32)
    zero_point = np.zeros((), ml_dtypes.float8_e4m3fn)
    y = run("QuantizeLinear", [x, np.float32(1.0), zero_point], saturate=0)
    assert np.isnan(y[:2].astype(np.float32)).all() and y[2] == 3.0
    y = run("QuantizeLinear", [x, np.float32(1.0), zero_point])
    assert_bits_equal(y, np.array([448, -448, 3], np.float32).astype(ml_dtypes.float8_e4m3fn))


def test_quantize_precision_attribute_sets_the_division_type():
    # 2049 and 4099 are not float16 numbers: divided in float16 they become 2048 and 4100.
    inputs = [np.array([2049.0, 4099.0], np.float32), np.array(1.0, np.float32), np.array(0, np.int16)]
    assert_bits_equal(run("QuantizeLinear", inputs), np.array([2049, 4099], np.int16))
    in_float16 = run("QuantizeLinear", inputs, precision=TensorProto.FLOAT16)
    assert_bits_equal(in_float16, np.array([2048, 4100], np.int16))
    assert_bits_equal(in_float16, reference("QuantizeLinear", inputs, precision=TensorProto.FLOAT16))


def test_quantize_errors():
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(ModelLoadError, match="differs from the zero point"):
        run("QuantizeLinear", [x, np.float32(1), np.int8(0)], output_dtype=TensorProto.UINT8)
    with pytest.raises(ModelLoadError, match="blocked"):
        run("QuantizeLinear", [x, np.ones((2, 3), np.float32)], axis=1, block_size=2)
    with pytest.raises(ModelLoadError, match="neither a scalar"):
        run("QuantizeLinear", [x, np.ones(3, np.float32)], axis=1)
    with pytest.raises(ModelLoadError, match="not a quantized type"):
        run("QuantizeLinear", [x, np.float32(1)], output_dtype=TensorProto.FLOAT)


def test_dequantize_output_dtype_and_e8m0_scale():
    x = np.array([[-8, 7], [3, 0]], ml_dtypes.int4)
    scale = e8m0([0.25, 4.0])
    y = run("DequantizeLinear", [x, scale], axis=0, output_dtype=TensorProto.BFLOAT16)
    expected = (x.astype(np.float32) * np.array([[0.25], [4.0]], np.float32)).astype(ml_dtypes.bfloat16)
    assert_bits_equal(y, expected)


def test_dequantize_is_differentiable_in_the_scale():
    x = np.array([-100, 3, 27, 127], np.int8)
    zero_point = np.array([1, -2], np.int8)
    model = single_op_model("DequantizeLinear", [x.reshape(2, 2), np.ones(2, np.float32), zero_point], 21, axis=0)
    fn = TranslatedModel(onnxtrain.load_model(model))

    def loss(scale):
        return (fn(fn.params, {"X0": x.reshape(2, 2), "X1": scale, "X2": zero_point})["Y0"] ** 2).sum()

    scale = np.array([0.3, 0.7], np.float32)
    grad = np.asarray(jax.grad(loss)(scale))
    step = 1e-3
    numeric = [(loss(scale + step * e) - loss(scale - step * e)) / (2 * step) for e in np.eye(2, dtype=np.float32)]
    np.testing.assert_allclose(grad, np.asarray(numeric), rtol=1e-3)


def test_opset_10_takes_only_scalar_parameters():
    with pytest.raises(ModelLoadError, match="scalar"):
        run("QuantizeLinear", [np.zeros((2, 2), np.float32), np.ones(2, np.float32)], opset=10)


def test_float6_quantization_on_host_values():
    x = np.array([0.3, 100.0, -2.0], np.float32)
    zero_point = np.zeros((), ml_dtypes.float6_e3m2fn)
    y = run("QuantizeLinear", [x, np.float32(0.5), zero_point], opset=28, host=True)
    assert_bits_equal(y, (x / 0.5).astype(ml_dtypes.float6_e3m2fn))
    back = run("DequantizeLinear", [y, np.float32(0.5)], opset=28, host=True)
    assert_bits_equal(back, y.astype(np.float32) * np.float32(0.5))


def test_dynamic_quantize_of_zeros_uses_unit_range():
    y, scale, zero_point = run_all("DynamicQuantizeLinear", [np.zeros(4, np.float32)], opset=11, outputs=3)
    assert_bits_equal(scale, np.array(1 / 255, np.float32))
    assert_bits_equal(zero_point, np.array(0, np.uint8))
    assert_bits_equal(y, np.zeros(4, np.uint8))


# --- integer products -------------------------------------------------------------------------------

def test_matmul_integer_with_per_row_and_per_column_zero_points():
    a = RNG.integers(0, 255, (2, 3, 4)).astype(np.uint8)
    b = RNG.integers(-128, 127, (4, 5)).astype(np.int8)
    a_zero_point = RNG.integers(0, 255, (2, 3, 1)).astype(np.uint8)
    b_zero_point = RNG.integers(-128, 127, 5).astype(np.int8)
    expected = (a.astype(np.int32) - a_zero_point) @ (b.astype(np.int32) - b_zero_point)
    assert_bits_equal(run("MatMulInteger", [a, b, a_zero_point, b_zero_point], opset=10), expected)
    a2 = a[0]
    row_zero_point = a_zero_point[0, :, 0]
    assert_bits_equal(run("MatMulInteger", [a2, b, row_zero_point], opset=10),
                      (a2.astype(np.int32) - row_zero_point[:, None]) @ b.astype(np.int32))


def test_qlinear_matmul_per_row_and_per_column_scales():
    a = RNG.integers(0, 255, (3, 4)).astype(np.uint8)
    b = RNG.integers(-128, 127, (4, 2)).astype(np.int8)
    a_scale, a_zero_point = np.array([0.01, 0.02, 0.03], np.float32), np.array([100, 120, 128], np.uint8)
    b_scale, b_zero_point = np.array([0.05, 0.1], np.float32), np.array([3, -4], np.int8)
    y_scale, y_zero_point = np.array(0.2, np.float32), np.array(10, np.int8)
    inputs = [a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point]
    real = ((a.astype(np.float64) - a_zero_point[:, None]) * a_scale[:, None]) @ \
        ((b.astype(np.float64) - b_zero_point) * b_scale)
    expected = np.clip(np.rint(real / 0.2) + 10, -128, 127).astype(np.int8)
    assert_bits_equal(run("QLinearMatMul", inputs, opset=21), expected)


def test_qlinear_matmul_on_float8():
    a = np.array([[1.0, -2.0], [0.5, 4.0]], np.float32).astype(ml_dtypes.float8_e4m3fn)
    b = np.array([[3.0, 1.0], [1.0, 100.0]], np.float32).astype(ml_dtypes.float8_e4m3fn)
    zero = np.zeros((), ml_dtypes.float8_e4m3fn)
    one = np.array(1.0, np.float32)
    inputs = [a, one, zero, b, np.array(2.0, np.float32), zero, np.array(0.5, np.float32), zero]
    expected = np.clip(a.astype(np.float32) @ b.astype(np.float32) * 4, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    assert_bits_equal(run("QLinearMatMul", inputs, opset=21), expected)


def conv_case(groups: int = 1):
    x = RNG.integers(0, 255, (1, 2 * groups, 5, 6)).astype(np.uint8)
    w = RNG.integers(-128, 127, (3 * groups, 2, 3, 2)).astype(np.int8)
    return x, w


def test_conv_integer_per_channel_weight_zero_point_groups_and_same_padding():
    x, w = conv_case(groups=2)
    x_zero_point = np.array(128, np.uint8)
    w_zero_point = RNG.integers(-5, 5, 6).astype(np.int8)
    attributes = dict(group=2, auto_pad="SAME_UPPER", strides=[2, 1], dilations=[1, 2])
    inputs = [x, w, x_zero_point, w_zero_point]
    assert_bits_equal(run("ConvInteger", inputs, opset=10, **attributes),
                      reference("ConvInteger", inputs, opset=10, **attributes))


def test_qlinear_conv_with_bias_and_per_channel_scales():
    x, w = conv_case()
    w_scale = np.array([0.01, 0.02, 0.005], np.float32)
    w_zero_point = np.array([0, 0, 0], np.int8)
    bias = RNG.integers(-1000, 1000, 3).astype(np.int32)
    inputs = [x, np.array(0.05, np.float32), np.array(120, np.uint8), w, w_scale, w_zero_point,
              np.array(0.7, np.float32), np.array(-5, np.int8), bias]
    attributes = dict(pads=[1, 0, 1, 1])
    assert_bits_equal(run("QLinearConv", inputs, opset=10, **attributes),
                      reference("QLinearConv", inputs, opset=10, **attributes))
