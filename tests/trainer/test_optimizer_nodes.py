"""The three optimizer ops on their own, at T > 0, which no official ONNX test reaches.

The official node tests all use T = 0, so they exercise neither Adagrad's rate decay, nor
Momentum's beta, nor Adam's bias correction. Expected values are the semantics doc's
§2.6 references and hand-derived numbers; float64 inputs must stay float64 and match the
float64 numpy formulas to rounding.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from onnx import TensorProto, helper

import onnxtrain
from onnxtrain.translate.model import TranslatedModel
from support.op_testing import jaxpr_equations
from support.training_models import adagrad, adam, make_training_model, momentum, training_node, value_info

X = np.array([1.0, -2.0], np.float32)
G = np.array([0.5, -1.5], np.float32)
V = np.array([0.2, 0.3], np.float32)


def optimizer_model(op_type: str, feeds: dict[str, np.ndarray], outputs: list[str], **attributes):
    """A model of one optimizer node fed from graph inputs."""
    graph = helper.make_graph(
        [training_node(op_type, list(feeds), outputs, **attributes)], op_type,
        [value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape) for name, value in feeds.items()],
        [value_info(name, TensorProto.UNDEFINED) for name in outputs])
    return make_training_model(graph)


def run_optimizer(op_type: str, feeds: dict[str, np.ndarray], outputs: list[str], **attributes) -> list[np.ndarray]:
    """One optimizer node fed from graph inputs, run with onnxtrain.run."""
    result = onnxtrain.run(optimizer_model(op_type, feeds, outputs, **attributes), feeds)
    return [np.asarray(result[name]) for name in outputs]


def scalars(rate: float, step: int, dtype=np.float32) -> dict[str, np.ndarray]:
    return {"R": np.array(rate, dtype), "T": np.array(step, np.int64)}


@pytest.mark.parametrize("step, expected", [(0, [0.924814, -1.905922]), (1, [0.931649, -1.914475]),
                                            (3, [0.942165, -1.927632])])
def test_adagrad_divides_the_rate_by_one_plus_t_times_decay(step, expected):
    feeds = {**scalars(0.1, step), "X": X, "G": G, "H": np.array([0.2, 0.3], np.float32)}
    x_new, h_new = run_optimizer("Adagrad", feeds, ["X_new", "H_new"], decay_factor=0.1, norm_coefficient=0.01)
    np.testing.assert_allclose(x_new, expected, rtol=1e-5)
    # h += (G + 0.01 X)^2 = [0.51^2, 1.52^2]
    np.testing.assert_allclose(h_new, [0.2 + 0.2601, 0.3 + 2.3104], rtol=1e-6)


@pytest.mark.parametrize("step, expected", [(0, [0.733246, -1.975083]), (1, [0.881457, -1.923743])])
def test_adam_bias_corrects_the_rate_only_from_t_1(step, expected):
    feeds = {**scalars(0.1, step), "X": X, "G": G, "V": V, "H": np.array([0.01, 0.02], np.float32)}
    x_new, v_new, _ = run_optimizer("Adam", feeds, ["X_new", "V_new", "H_new"], alpha=0.9, beta=0.999,
                                    norm_coefficient=0.01, norm_coefficient_post=0.05)
    np.testing.assert_allclose(x_new, expected, rtol=1e-5)
    np.testing.assert_allclose(v_new, [0.9 * 0.2 + 0.1 * 0.51, 0.9 * 0.3 - 0.1 * 1.52], rtol=1e-6)


@pytest.mark.parametrize("step, mode, expected_x, expected_v", [
    # T = 0: V = 0.9 V + G (beta ignored); X -= 0.1 V
    (0, "standard", [0.932, -1.877], [0.68, -1.23]),
    # T = 2: V = 0.9 V + 0.5 G = [0.43, -0.48]
    (2, "standard", [0.957, -1.952], [0.43, -0.48]),
    # nesterov: X -= 0.1 (G + 0.9 V)
    (2, "nesterov", [0.9113, -1.8068], [0.43, -0.48]),
])
def test_momentum_scales_the_gradient_by_beta_only_from_t_1(step, mode, expected_x, expected_v):
    feeds = {**scalars(0.1, step), "X": X, "G": G, "V": V}
    x_new, v_new = run_optimizer("Momentum", feeds, ["X_new", "V_new"], alpha=0.9, beta=0.5,
                                 norm_coefficient=0.0, mode=mode)
    np.testing.assert_allclose(x_new, expected_x, rtol=1e-6)
    np.testing.assert_allclose(v_new, expected_v, rtol=1e-6)


def test_adam_updates_each_of_several_tensors_on_its_own():
    """Variadic layout R, T, X1, X2, G1, G2, V1, V2, H1, H2 -> X1', X2', V1', V2', H1', H2'."""
    rng = np.random.default_rng(0)
    x1, g1, v1, h1 = rng.normal(size=(4, 3)).astype(np.float32)
    x2, g2, v2, h2 = rng.normal(size=(4, 2, 2)).astype(np.float32)
    h1, h2 = np.abs(h1), np.abs(h2)
    feeds = {**scalars(0.05, 3), "X1": x1, "X2": x2, "G1": g1, "G2": g2, "V1": v1, "V2": v2, "H1": h1, "H2": h2}
    outputs = run_optimizer("Adam", feeds, ["X1_new", "X2_new", "V1_new", "V2_new", "H1_new", "H2_new"],
                            alpha=0.8, beta=0.9, epsilon=1e-3)
    first = adam(np.float32(0.05), 3, x1, g1, v1, h1, alpha=0.8, beta=0.9, epsilon=1e-3)
    second = adam(np.float32(0.05), 3, x2, g2, v2, h2, alpha=0.8, beta=0.9, epsilon=1e-3)
    for actual, expected in zip(outputs, [first[0], second[0], first[1], second[1], first[2], second[2]]):
        np.testing.assert_allclose(actual, expected, rtol=1e-5)


def test_optimizers_keep_float64_and_its_precision():
    rng = np.random.default_rng(1)
    x, g, v = rng.normal(size=(3, 5))
    h = np.abs(rng.normal(size=5))
    base = {**scalars(0.1, 2, np.float64), "X": x, "G": g}
    cases = [
        ("Adagrad", {"H": h}, dict(decay_factor=0.3, norm_coefficient=0.01),
         adagrad(0.1, 2, x, g, h, norm_coefficient=0.01, decay_factor=0.3)),
        ("Momentum", {"V": v}, dict(alpha=0.9, beta=0.3, norm_coefficient=0.01, mode="nesterov"),
         momentum(0.1, 2, x, g, v, 0.9, 0.3, 0.01, "nesterov")),
        ("Adam", {"V": v, "H": h}, dict(alpha=0.8, beta=0.99, norm_coefficient_post=0.01),
         adam(0.1, 2, x, g, v, h, alpha=0.8, beta=0.99, norm_coefficient_post=0.01)),
    ]
    for op_type, slots, attributes, expected in cases:
        outputs = run_optimizer(op_type, {**base, **slots}, [f"out{i}" for i in range(len(expected))], **attributes)
        for actual, wanted in zip(outputs, expected):
            assert actual.dtype == np.float64, op_type
            np.testing.assert_allclose(actual, wanted, rtol=1e-12, err_msg=op_type)


@pytest.mark.parametrize("op_type, slots, defaults", [
    ("Adagrad", ["H"], dict(epsilon=1e-6, decay_factor=0.0, norm_coefficient=0.0)),
    ("Adam", ["V", "H"], dict(alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.0, norm_coefficient_post=0.0)),
])
def test_omitted_attributes_equal_the_float32_schema_defaults(op_type, slots, defaults):
    """A default is a FLOAT AttributeProto in the schema (alpha 0.9 is 0.899999976), so leaving an
    attribute out must give the same bits as writing its default, even in float64."""
    rng = np.random.default_rng(2)
    feeds = {**scalars(0.1, 2, np.float64), "X": rng.normal(size=4), "G": rng.normal(size=4),
             **{slot: np.abs(rng.normal(size=4)) for slot in slots}}
    outputs = [f"out{i}" for i in range(len(slots) + 1)]
    for omitted, explicit in zip(run_optimizer(op_type, feeds, outputs), run_optimizer(op_type, feeds, outputs, **defaults)):
        assert np.array_equal(omitted, explicit)


@pytest.mark.parametrize("op_type, slots, attributes, primitive, per_weight", [
    ("Adam", ["V", "H"], {}, "pow", 0),  # alpha^T and beta^T, for the bias correction
    ("Momentum", ["V"], dict(alpha=0.9, beta=0.5, norm_coefficient=0.0, mode="standard"), "gt", 0),  # T > 0
    ("Adagrad", ["H"], {}, "div", 1),  # R / (1 + T decay) once; G / root per weight
])
def test_optimizers_derive_their_scalar_coefficients_once_per_node(op_type, slots, attributes, primitive,
                                                                    per_weight):
    """Over many weights, the coefficients that depend only on R and T are traced once, not
    once per weight: a weight adds only its element-wise update to the program."""
    def count(weights: int) -> int:
        rng = np.random.default_rng(3)
        tensors = {f"{slot}{i}": np.abs(rng.normal(size=i + 2)).astype(np.float32)
                   for slot in ["X", "G", *slots] for i in range(weights)}
        feeds = {**scalars(0.1, 2), **tensors}
        outputs = [f"out{i}" for i in range(weights * (1 + len(slots)))]
        translated = TranslatedModel(optimizer_model(op_type, feeds, outputs, **attributes))
        with jax.enable_x64(True):
            jaxpr = jax.make_jaxpr(lambda values: translated({}, values, None))(feeds)
        return sum(str(equation.primitive) == primitive for equation in jaxpr_equations(jaxpr.jaxpr))

    assert count(12) - count(1) == 11 * per_weight
