"""Element-wise, activation and matrix ops: behaviour the ONNX backend cases miss.

Oracles: onnx.reference.ReferenceEvaluator, numpy, hand-derived values, and
central finite differences in float64 for gradients.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from onnx.reference import ReferenceEvaluator

import onnxtrain
from onnxtrain.errors import ModelLoadError
from onnxtrain.translate.model import TranslatedModel
from support.op_testing import single_op_feeds, single_op_model

RNG = np.random.default_rng(0)






def run(op_type: str, inputs: list[np.ndarray | None], opset: int = 22, host: bool = False,
        **attributes) -> np.ndarray:
    fn = TranslatedModel(onnxtrain.load_model(single_op_model(op_type, inputs, opset, host, **attributes)))
    return np.asarray(fn(fn.params, {} if host else single_op_feeds(inputs))["Y0"])


def reference(op_type: str, inputs: list[np.ndarray | None], opset: int = 22,
              **attributes) -> np.ndarray:
    model = single_op_model(op_type, inputs, opset, **attributes)
    return ReferenceEvaluator(model).run(None, single_op_feeds(inputs))[0]


def assert_same(actual: np.ndarray, expected: np.ndarray, **tolerance) -> None:
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    np.testing.assert_allclose(actual, expected, **tolerance)


# --- legacy (opset < 7) broadcasting -------------------------------------------------------

@pytest.mark.parametrize("op_type, oracle", [("Add", np.add), ("Sub", np.subtract),
                                              ("Mul", np.multiply), ("Div", np.divide),
                                              ("Pow", np.power)])
def test_legacy_broadcast_aligns_b_at_axis(op_type, oracle):
    a = RNG.uniform(1, 2, (2, 3, 4, 5)).astype(np.float32)
    b = RNG.uniform(1, 2, (3, 4)).astype(np.float32)
    actual = run(op_type, [a, b], opset=6, broadcast=1, axis=1)
    assert_same(actual, oracle(a, b[None, :, :, None]), rtol=1e-6)


def test_legacy_broadcast_without_axis_aligns_the_suffix():
    a = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    b = RNG.standard_normal(4).astype(np.float32)
    assert_same(run("Sub", [a, b], opset=6, broadcast=1), a - b)


def test_legacy_comparison_and_logic_broadcast_at_axis():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([1, 4], np.float32)
    assert_same(run("Greater", [a, b], opset=1, broadcast=1, axis=0), a > b[:, None])
    x = np.array([[True, False, True], [False, True, True]])
    y = np.array([True, False])
    assert_same(run("Xor", [x, y], opset=1, broadcast=1, axis=0), x ^ y[:, None])


def test_legacy_broadcast_rejects_b_that_does_not_fit():
    a = np.ones((2, 3), np.float32)
    b = np.ones((3, 4), np.float32)
    with pytest.raises(ModelLoadError, match="does not fit"):
        run("Add", [a, b], opset=6, broadcast=1, axis=1)


# --- integer arithmetic ---------------------------------------------------------------------

@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64])
def test_integer_div_truncates_toward_zero(dtype, host):
    a = np.array([-7, 7, -7, 7, -1, 0], dtype)
    b = np.array([2, -2, -2, 2, 3, -5], dtype)
    assert_same(run("Div", [a, b], host=host), np.array([-3, -3, 3, 3, 0, 0], dtype))


def test_integer_arithmetic_wraps_on_overflow():
    a = np.array([127, -128], np.int8)
    b = np.array([1, -1], np.int8)
    assert_same(run("Add", [a, b]), np.array([-128, 127], np.int8))
    assert_same(run("Mul", [a, np.array([2, 2], np.int8)]), np.array([-2, 0], np.int8))


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64])
def test_integer_mod_sign_rules(dtype, fmod, host):
    a = np.array([-7, 7, -7, 7, 6, -6], dtype)
    b = np.array([3, -3, -3, 3, -3, 3], dtype)
    expected = np.fmod(a, b) if fmod else np.mod(a, b)  # dividend's sign / divisor's sign
    assert_same(run("Mod", [a, b], host=host, fmod=fmod), expected)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_float_floor_mod_gives_zero_the_divisor_sign(dtype):
    a = np.array([0.0, -0.0, 6.0, -6.0, 1.0, -1.0], dtype)
    b = np.array([-3.0, 3.0, -3.0, 3.0, -np.inf, np.inf], dtype)
    actual = run("Mod", [a, b], opset=28, fmod=0)
    np.testing.assert_array_equal(np.signbit(actual), [True, False, True, False, True, False])
    np.testing.assert_array_equal(actual, [0, 0, 0, 0, -np.inf, np.inf])


def test_mod_rejects_fmod_other_than_0_or_1():
    x = np.ones(2, np.int32)
    with pytest.raises(ModelLoadError, match="fmod must be 0 or 1"):
        run("Mod", [x, x], fmod=2)


# --- Pow with mixed types -------------------------------------------------------------------

@pytest.mark.parametrize("base_type, exponent_type", [
    (np.int32, np.float32), (np.int64, np.float64), (np.float16, np.float32),
    (np.float32, np.int64), (np.float64, np.uint8), (np.int64, np.int32)])
def test_pow_result_has_the_base_type(base_type, exponent_type):
    base = np.array([2, 3, -2, 5], base_type)
    exponent = np.array([3, 2, 3, 0], exponent_type)
    if np.issubdtype(exponent_type, np.floating):
        exponent = exponent + np.array([0.5, 0, 0, 0], exponent_type)
        base = np.abs(base)
    assert_same(run("Pow", [base, exponent], opset=15), reference("Pow", [base, exponent], opset=15),
                rtol=1e-3)


def test_integer_pow_is_exact():
    base = np.array([3, -7], np.int64)
    exponent = np.array([39, 21], np.int64)
    assert_same(run("Pow", [base, exponent], opset=15), np.array([3**39, (-7) ** 21], np.int64))


# --- bit shifts and bitwise ops -------------------------------------------------------------

@pytest.mark.parametrize("host", [False, True])
def test_bitshift_out_of_range_amounts_leave_the_sign_fill(host):
    x = np.array([-8, 8, -8, 8, -8, 64], np.int8)
    amount = np.array([8, 8, -1, -1, 2, 1], np.int8)
    right = run("BitShift", [x, amount], opset=28, host=host, direction="RIGHT")
    assert_same(right, np.array([-1, 0, -1, 0, -2, 32], np.int8))
    left = run("BitShift", [x, amount], opset=28, host=host, direction="LEFT")
    assert_same(left, np.array([0, 0, 0, 0, -32, -128], np.int8))


def test_bitshift_full_width_of_uint64():
    x = np.array([1, 1, 2**63], np.uint64)
    amount = np.array([63, 64, 63], np.uint64)
    assert_same(run("BitShift", [x, amount], opset=11, direction="LEFT"),
                np.array([2**63, 0, 0], np.uint64))
    assert_same(run("BitShift", [x, amount], opset=11, direction="RIGHT"),
                np.array([0, 0, 1], np.uint64))


def test_bitshift_rejects_unknown_direction():
    x = np.ones(2, np.uint8)
    with pytest.raises(ModelLoadError, match="direction"):
        run("BitShift", [x, x], direction="UP")


def test_bitwise_not_of_signed_and_unsigned():
    assert_same(run("BitwiseNot", [np.array([0, -1, 5], np.int16)]), np.array([-1, 0, -6], np.int16))
    assert_same(run("BitwiseNot", [np.array([0, 255], np.uint8)]), np.array([255, 0], np.uint8))


# --- other element-wise ops -----------------------------------------------------------------

@pytest.mark.parametrize("positive, negative", [(1, 0), (0, 1), (0, 0)])
def test_isinf_detection_flags(positive, negative):
    x = np.array([np.inf, -np.inf, np.nan, 1.0], np.float32)
    expected = np.array([bool(positive), bool(negative), False, False])
    assert_same(run("IsInf", [x], detect_positive=positive, detect_negative=negative), expected)


def test_round_halves_to_even():
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 2.4, 2.6], np.float16)
    assert_same(run("Round", [x]), np.array([-2, -2, -0, 0, 2, 2, 2, 3], np.float16))


def test_variadic_ops_broadcast_and_keep_the_type():
    a, b, c = [RNG.standard_normal(shape).astype(np.float16) for shape in [(3, 1), (1, 4), (4,)]]
    wide = [v.astype(np.float32) for v in (a, b, c)]
    expected = {"Max": np.maximum(np.maximum(a, b), c), "Min": np.minimum(np.minimum(a, b), c),
                "Sum": ((wide[0] + wide[1]) + wide[2]).astype(np.float16),
                "Mean": ((wide[0] + wide[1] + wide[2]) / 3).astype(np.float16)}
    for op_type, oracle in expected.items():
        assert_same(run(op_type, [a, b, c]), oracle, rtol=2e-3, atol=2e-3)


def test_max_and_min_propagate_nan():
    a = np.array([np.nan, 1.0], np.float32)
    b = np.array([0.0, np.nan], np.float32)
    assert np.isnan(run("Max", [a, b])).all() and np.isnan(run("Min", [a, b])).all()


def test_where_selects_strings_on_the_host():
    condition = np.array([True, False])
    x = np.array(["yes", "yes"], object)
    y = np.array(["no", "no"], object)
    np.testing.assert_array_equal(run("Where", [condition, x, y]), ["yes", "no"])


@pytest.mark.parametrize("host", [False, True])
def test_clip_with_attributes_before_opset_11(host):
    x = np.array([-2.0, 0.25, 3.0], np.float32)
    assert_same(run("Clip", [x], opset=6, host=host, min=-1.0, max=1.0), np.array([-1, 0.25, 1], np.float32))
    assert_same(run("Clip", [x], opset=6, host=host, max=0.0), np.array([-2, 0, 0], np.float32))


def test_clip_with_only_max_input_and_integer_type():
    x = np.array([-100, 0, 100], np.int8)
    assert_same(run("Clip", [x, None, np.array(7, np.int8)], opset=13), np.array([-100, 0, 7], np.int8))


def test_clip_rejects_non_scalar_bounds():
    x = np.ones(3, np.float32)
    with pytest.raises(ModelLoadError, match="must be a scalar"):
        run("Clip", [x, np.zeros(2, np.float32)], opset=13)


# --- activations ----------------------------------------------------------------------------

ACTIVATIONS = [
    ("Relu", {}), ("LeakyRelu", {"alpha": 0.2}), ("Elu", {"alpha": 0.7}), ("Selu", {}),
    ("Celu", {"alpha": 1.5}), ("ThresholdedRelu", {"alpha": 0.3}), ("Sigmoid", {}),
    ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}), ("HardSwish", {}), ("Softplus", {}),
    ("Softsign", {}), ("Mish", {}), ("Gelu", {}), ("Gelu", {"approximate": "tanh"}),
    ("Shrink", {"lambd": 0.4, "bias": 0.1}), ("Swish", {"alpha": 1.7}),
]


def _exact_float64(op_type: str, attributes: dict, x: np.ndarray) -> np.ndarray | None:
    """Float64 oracles where onnx's reference rounds its constants to float32."""
    if op_type == "HardSwish":
        return x * np.clip(x / 6 + 0.5, 0, 1)
    if op_type == "Gelu" and attributes.get("approximate") == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    if op_type == "Gelu":
        return 0.5 * x * np.array([math.erfc(-v / math.sqrt(2)) for v in x])
    return None


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("op_type, attributes", ACTIVATIONS)
def test_activation_matches_the_reference_and_keeps_the_type(op_type, attributes, dtype):
    x = np.concatenate([np.linspace(-6, 6, 49), [-30.0, 30.0]]).astype(dtype)
    opset = 24 if op_type == "Swish" else 22
    exact = _exact_float64(op_type, attributes, x) if dtype == np.float64 else None
    expected = reference(op_type, [x], opset=opset, **attributes) if exact is None else exact
    tolerance = {"rtol": 4e-3, "atol": 4e-3} if dtype == np.float16 else {"rtol": 1e-7, "atol": 1e-12}
    assert_same(run(op_type, [x], opset=opset, **attributes), expected, **tolerance)


def test_activation_defaults_are_float32_attribute_values():
    x = np.array([-1.0], np.float64)
    assert_same(run("LeakyRelu", [x]), np.array([-np.float64(np.float32(0.01))]))


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64])
def test_integer_relu_shrink_and_prelu(dtype):
    x = np.array([-3, -1, 0, 2, 5], dtype)
    assert_same(run("Relu", [x]), np.array([0, 0, 0, 2, 5], dtype))
    assert_same(run("Shrink", [x], lambd=1.5, bias=1.0), reference("Shrink", [x], lambd=1.5, bias=1.0))
    assert_same(run("PRelu", [x, np.array([2], dtype)], opset=16), np.array([-6, -2, 0, 2, 5], dtype))


def test_prelu_before_opset_7_broadcasts_slope_per_channel():
    x = RNG.standard_normal((2, 3, 3)).astype(np.float32)
    slope = np.array([0.1, 0.2, 0.3], np.float32)
    per_channel = np.where(x >= 0, x, x * slope[:, None])
    per_last_axis = np.where(x >= 0, x, x * slope)
    assert_same(run("PRelu", [x, slope], opset=6), per_channel)
    assert_same(run("PRelu", [x, slope], opset=9), per_last_axis)


def test_gelu_rejects_unknown_approximation():
    with pytest.raises(ModelLoadError, match="approximate"):
        run("Gelu", [np.ones(2, np.float32)], approximate="erf")


# --- matrix math ----------------------------------------------------------------------------

@pytest.mark.parametrize("trans_a, trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm_without_c(trans_a, trans_b):
    a = RNG.standard_normal((4, 3) if trans_a else (3, 4)).astype(np.float32)
    b = RNG.standard_normal((5, 4) if trans_b else (4, 5)).astype(np.float32)
    expected = 0.5 * ((a.T if trans_a else a) @ (b.T if trans_b else b))
    assert_same(run("Gemm", [a, b], opset=13, transA=trans_a, transB=trans_b, alpha=0.5),
                expected, rtol=1e-5)


def test_gemm_integer_with_scales_and_row_bias():
    a = np.array([[1, 2], [3, 4]], np.int32)
    b = np.array([[5, 6], [7, 8]], np.int32)
    c = np.array([[10], [20]], np.int32)
    assert_same(run("Gemm", [a, b, c], opset=13, alpha=2.0, beta=3.0), 2 * (a @ b) + 3 * c)


def test_gemm_opset_6_broadcast_attribute():
    a = RNG.standard_normal((2, 3)).astype(np.float32)
    b = RNG.standard_normal((3, 4)).astype(np.float32)
    c = RNG.standard_normal(4).astype(np.float32)
    assert_same(run("Gemm", [a, b, c], opset=6, broadcast=1, beta=2.0), a @ b + 2 * c, rtol=1e-5)


def test_gemm_rejects_non_matrices():
    with pytest.raises(ModelLoadError, match="must be matrices"):
        run("Gemm", [np.ones((2, 2, 2), np.float32), np.ones((2, 2), np.float32)], opset=13)


@pytest.mark.parametrize("shape_a, shape_b", [((3,), (3,)), ((2, 1, 3, 4), (5, 4, 2)), ((4,), (2, 4, 3))])
def test_matmul_integer_and_broadcast_shapes(shape_a, shape_b):
    a = RNG.integers(-5, 5, shape_a).astype(np.int64)
    b = RNG.integers(-5, 5, shape_b).astype(np.int64)
    assert_same(run("MatMul", [a, b], opset=13), np.matmul(a, b))


@pytest.mark.parametrize("equation, shapes", [
    ("...ij, ...jk", [(2, 3, 4), (2, 4, 5)]),
    ("ij,jk", [(3, 4), (4, 5)]),
    ("i i", [(4, 4)]),
    ("bij -> b", [(2, 3, 4)]),
])
def test_einsum_implicit_output_spaces_and_ellipsis(equation, shapes):
    operands = [RNG.standard_normal(s) for s in shapes]
    expected = np.einsum(equation.replace(" ", ""), *operands)
    assert_same(run("Einsum", operands, opset=12, equation=equation), np.asarray(expected), rtol=1e-12)


def test_einsum_reports_a_mismatched_equation():
    with pytest.raises(ModelLoadError, match="does not fit"):
        run("Einsum", [np.ones((2, 3), np.float32)], opset=12, equation="ijk->i")


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_det_of_a_batch_keeps_the_type(dtype):
    x = RNG.standard_normal((2, 3, 3, 3)).astype(dtype)
    expected = np.linalg.det(x.astype(np.float64)).astype(dtype)
    assert_same(run("Det", [x], opset=22), expected, rtol=5e-3 if dtype == np.float16 else 1e-5)


def test_det_rejects_non_square_input():
    with pytest.raises(ModelLoadError, match="square"):
        run("Det", [np.ones((2, 3), np.float32)], opset=22)


# --- gradients ------------------------------------------------------------------------------

GRADIENT_CASES = [
    ("Elu", [(2, 5)], {"alpha": 0.8}), ("Selu", [(2, 5)], {}), ("Celu", [(2, 5)], {"alpha": 1.3}),
    ("Gelu", [(2, 5)], {}), ("Gelu", [(2, 5)], {"approximate": "tanh"}), ("Mish", [(2, 5)], {}),
    ("Softplus", [(2, 5)], {}), ("Softsign", [(2, 5)], {}), ("Sigmoid", [(2, 5)], {}),
    ("HardSwish", [(2, 5)], {}), ("LeakyRelu", [(2, 5)], {}), ("PRelu", [(2, 5), (5,)], {}),
    ("Tanh", [(2, 5)], {}), ("Erf", [(2, 5)], {}), ("Atan", [(2, 5)], {}), ("Sin", [(2, 5)], {}),
    ("Div", [(2, 5), (2, 5)], {}), ("Pow", [(2, 5), (2, 5)], {}), ("Mod", [(2, 5), (2, 5)], {"fmod": 1}),
    ("Mean", [(2, 5), (5,)], {}), ("Max", [(2, 5), (2, 5)], {}),
    ("MatMul", [(2, 3, 4), (4, 2)], {}), ("Gemm", [(3, 4), (2, 4), (2,)], {"transB": 1, "alpha": 0.7}),
    ("Einsum", [(3, 4), (4, 2)], {"equation": "ij,jk->ik"}), ("Det", [(2, 3, 3)], {}),
]


def _gradient_inputs(op_type: str, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    values = [RNG.uniform(-2, 2, shape) for shape in shapes]
    if op_type in ("Pow", "Div", "Mod"):  # keep away from 0 and integral exponents' kinks
        values = [np.abs(v) + 0.5 for v in values]
    # Step functions (LeakyRelu, PRelu, Max) have kinks at 0 and at ties: move off them.
    return [np.where(np.abs(v) < 0.1, v + 0.3, v) for v in values]


@pytest.mark.slow   # two jitted calls per input element; the quick run has these ops in test_gradients_fd.py
@pytest.mark.parametrize("op_type, shapes, attributes", GRADIENT_CASES,
                         ids=[f"{c[0]}-{c[2]}" if c[2] else c[0] for c in GRADIENT_CASES])
def test_gradient_matches_central_differences(op_type, shapes, attributes):
    values = _gradient_inputs(op_type, shapes)
    opset = 12 if op_type == "Einsum" else 22
    fn = TranslatedModel(onnxtrain.load_model(single_op_model(op_type, values, opset, **attributes)))
    with jax.enable_x64(True):
        weights = jnp.asarray(RNG.standard_normal(np.shape(fn.apply(fn.params, single_op_feeds(values))["Y0"])))

        @jax.jit
        def loss(*arrays):
            return jnp.sum(fn.apply(fn.params, single_op_feeds(list(arrays)))["Y0"] * weights)

        gradients = jax.grad(loss, argnums=tuple(range(len(values))))(*map(jnp.asarray, values))
        step = 1e-6
        for index, (value, gradient) in enumerate(zip(values, gradients)):
            numeric = np.zeros_like(value)
            for position in np.ndindex(value.shape):
                shifted = [v.copy() for v in values]
                shifted[index][position] += step
                up = float(loss(*shifted))
                shifted[index][position] -= 2 * step
                numeric[position] = (up - float(loss(*shifted))) / (2 * step)
            np.testing.assert_allclose(np.asarray(gradient), numeric, rtol=1e-5, atol=1e-6,
                                       err_msg=f"d loss / d input {index}")


@pytest.mark.parametrize("op_type", ["Elu", "Selu", "Celu", "Softplus", "Mish", "Sigmoid", "Swish"])
def test_gradients_stay_finite_for_large_inputs(op_type):
    x = np.array([-1000.0, -80.0, 80.0, 1000.0], np.float32)
    opset = 24 if op_type == "Swish" else 22
    fn = TranslatedModel(onnxtrain.load_model(single_op_model(op_type, [x], opset)))
    gradient = jax.grad(lambda v: jnp.sum(fn.apply(fn.params, {"X0": v})["Y0"]))(jnp.asarray(x))
    assert np.isfinite(np.asarray(gradient)).all(), gradient
