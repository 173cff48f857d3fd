"""translate_model / run: one jit per signature, host folding, 64-bit, gradients, eager fallback.

Oracles: numpy re-computations, jax.grad of a hand-written function, and
onnxruntime.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import InputError, UnsupportedOpError
from onnxtrain.translate import registry
from onnxtrain.translate.model import TranslatedModel


def make_model(nodes, inputs, outputs, initializers=(), opset=21, functions=(), extra_opsets=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(
        graph, functions=list(functions),
        opset_imports=[helper.make_opsetid("", opset), *extra_opsets])


def tensor(name, elem_type, shape):
    return helper.make_tensor_value_info(name, elem_type, shape)


def mlp():
    rng = np.random.default_rng(0)
    weights = {"W1": rng.standard_normal((4, 8)).astype(np.float32),
               "B1": rng.standard_normal(8).astype(np.float32),
               "W2": rng.standard_normal((8, 3)).astype(np.float32)}
    model = make_model(
        [helper.make_node("MatMul", ["x", "W1"], ["h0"]),
         helper.make_node("Add", ["h0", "B1"], ["h1"]),
         helper.make_node("Relu", ["h1"], ["h"]),
         helper.make_node("MatMul", ["h", "W2"], ["y"])],
        [tensor("x", TensorProto.FLOAT, ["N", 4])], [tensor("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return model, weights


def test_three_unknown_ops_are_reported_together_before_compiling():
    model = make_model(
        [helper.make_node("Relu", ["x"], ["a"], name="fine"),
         helper.make_node("Frobnicate", ["a"], ["b"], name="first_unknown"),
         helper.make_node("Twiddle", ["b"], ["c"], name="second_unknown", domain="com.example"),
         helper.make_node("Relu", ["c"], ["d"], name="old_relu_is_fine"),
         helper.make_node("Quux", ["d"], ["y"], name="third_unknown")],
        [tensor("x", TensorProto.FLOAT, [2])], [tensor("y", TensorProto.FLOAT, [2])],
        extra_opsets=[helper.make_opsetid("com.example", 3)])
    with pytest.raises(UnsupportedOpError) as caught:
        onnxtrain.translate_model(model)
    message = str(caught.value)
    assert "3 operator(s)" in message
    for expected in ("ai.onnx::Frobnicate (opset 21): nodes first_unknown",
                     "com.example::Twiddle (opset 3): nodes second_unknown",
                     "ai.onnx::Quux (opset 21): nodes third_unknown"):
        assert expected in message


def test_dispatch_takes_the_newest_handler_not_newer_than_the_opset():
    calls = []
    registry.op("ZzTestOnly", since=1, domain="test.dispatch")(lambda node, x: calls.append(1))
    registry.op("ZzTestOnly", since=5, domain="test.dispatch")(lambda node, x: calls.append(5))
    assert registry.resolve("test.dispatch", "ZzTestOnly", 0) is None
    assert registry.resolve("test.dispatch", "ZzTestOnly", 4).since_version == 1
    assert registry.resolve("test.dispatch", "ZzTestOnly", 5).since_version == 5
    assert registry.resolve("test.dispatch", "ZzTestOnly", 99).since_version == 5
    assert registry.resolve("ai.onnx", "Relu", 21) is registry.resolve("", "Relu", 21)


def test_repeated_calls_compile_once_per_signature():
    model, _ = mlp()
    fn, params = onnxtrain.translate_model(model)
    x = np.ones((5, 4), np.float32)
    for _ in range(3):
        fn(params, {"x": x})
    assert fn._jitted._cache_size() == 1
    fn(params, {"x": np.ones((7, 4), np.float32)})
    assert fn._jitted._cache_size() == 2


@pytest.mark.slow
def test_translated_function_is_differentiable_like_the_hand_written_one():
    model, weights = mlp()
    fn, params = onnxtrain.translate_model(model)
    x = np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32)

    def ours(p):
        return jnp.sum(fn(p, {"x": x})["y"] ** 2)

    def theirs(p):
        h = jnp.maximum(x @ p["W1"] + p["B1"], 0)
        return jnp.sum((h @ p["W2"]) ** 2)

    expected = jax.grad(theirs)({k: jnp.asarray(v) for k, v in weights.items()})
    actual = jax.jit(jax.grad(ours))(params)
    for name in weights:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-5)


def test_shape_arithmetic_folds_on_the_host_under_jit():
    """Shape -> Gather -> Concat -> Reshape of a traced input stays static: no eager fallback."""
    model = make_model(
        [helper.make_node("Shape", ["x"], ["shape"]),
         helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
         helper.make_node("Unsqueeze", ["batch", "zero"], ["batch1"]),
         helper.make_node("Concat", ["batch1", "minus_one"], ["target"], axis=0),
         helper.make_node("Reshape", ["x", "target"], ["y"])],
        [tensor("x", TensorProto.FLOAT, ["N", 2, 3])], [tensor("y", TensorProto.FLOAT, ["N", 6])],
        [numpy_helper.from_array(np.array(0, np.int64), "zero"),
         numpy_helper.from_array(np.array([-1], np.int64), "minus_one")])
    fn, params = onnxtrain.translate_model(model)
    x = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
    np.testing.assert_array_equal(fn(params, {"x": x})["y"], x.reshape(4, 6))
    assert fn._jitted._cache_size() == 1 and not fn._eager_signatures


def test_int64_and_float64_keep_their_width():
    big = np.array([2**40, -(2**40) - 3], np.int64)
    model = make_model(
        [helper.make_node("Add", ["a", "a"], ["twice"]),
         helper.make_node("Slice", ["twice", "starts", "ends"], ["tail"]),
         helper.make_node("Mul", ["f", "f"], ["f2"])],
        [tensor("a", TensorProto.INT64, [2]), tensor("f", TensorProto.DOUBLE, [1])],
        [tensor("tail", TensorProto.INT64, [None]), tensor("f2", TensorProto.DOUBLE, [1])],
        [numpy_helper.from_array(np.array([1], np.int64), "starts"),
         numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), "ends")])
    precise = np.array([1 + 2**-40], np.float64)
    outputs = {k: np.asarray(v) for k, v in onnxtrain.run(model, {"a": big, "f": precise}).items()}
    assert outputs["tail"].dtype == np.int64 and outputs["tail"].tolist() == [2 * (-(2**40) - 3)]
    assert outputs["f2"].dtype == np.float64 and outputs["f2"][0] == precise[0] ** 2


def test_data_dependent_shapes_fall_back_to_eager_once_with_one_log_line(caplog):
    model = make_model(
        [helper.make_node("NonZero", ["x"], ["indices"], name="where_nonzero")],
        [tensor("x", TensorProto.FLOAT, [None])], [tensor("indices", TensorProto.INT64, [1, None])])
    fn, params = onnxtrain.translate_model(model)
    x = np.array([0, 3, 0, 5], np.float32)
    with caplog.at_level(logging.WARNING, logger="onnxtrain"):
        first = fn(params, {"x": x})["indices"]
        second = fn(params, {"x": x})["indices"]
    np.testing.assert_array_equal(first, np.nonzero(x))
    np.testing.assert_array_equal(second, first)
    warnings = [r for r in caplog.records if r.name == "onnxtrain"]
    assert len(warnings) == 1 and "where_nonzero" in warnings[0].getMessage()


def test_feeds_are_checked_by_name():
    model, _ = mlp()
    fn, params = onnxtrain.translate_model(model)
    with pytest.raises(InputError, match=r"missing \['x'\]"):
        fn(params, {})
    with pytest.raises(InputError, match=r"unknown \['z'\]"):
        fn(params, {"x": np.ones((1, 4), np.float32), "z": 1})


def test_local_function_with_attribute_defaults_and_references():
    leaky = helper.make_node("LeakyRelu", ["x"], ["leaky"])
    leaky.attribute.append(helper.make_attribute_ref("alpha", onnx.AttributeProto.FLOAT))
    function = helper.make_function(
        "custom", "ScaledLeaky", ["x"], ["y"],
        [leaky, helper.make_node("Mul", ["leaky", "x"], ["y"])],
        [helper.make_opsetid("", 21)], attributes=[], attribute_protos=[helper.make_attribute("alpha", 0.25)])
    model = make_model(
        [helper.make_node("ScaledLeaky", ["x"], ["default_alpha"], domain="custom"),
         helper.make_node("ScaledLeaky", ["x"], ["given_alpha"], domain="custom", alpha=0.5)],
        [tensor("x", TensorProto.FLOAT, [4])],
        [tensor("default_alpha", TensorProto.FLOAT, [4]), tensor("given_alpha", TensorProto.FLOAT, [4])],
        functions=[function], extra_opsets=[helper.make_opsetid("custom", 1)])
    model.ir_version = 10  # what onnxruntime 1.31 accepts
    x = np.array([-2, -1, 1, 2], np.float32)
    outputs = onnxtrain.run(model, {"x": x})
    # onnx.reference cannot resolve a referenced attribute's default; onnxruntime can.
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    np.testing.assert_allclose(outputs["default_alpha"], expected[0], rtol=1e-6)
    np.testing.assert_allclose(outputs["given_alpha"], expected[1], rtol=1e-6)
    np.testing.assert_allclose(outputs["default_alpha"], np.where(x > 0, x, 0.25 * x) * x)


def test_translated_model_can_be_built_from_any_source(tmp_path):
    model, _ = mlp()
    path = tmp_path / "mlp.onnx"
    onnx.save_model(model, path)
    x = np.ones((2, 4), np.float32)
    from_path = onnxtrain.run(path, {"x": x})["y"]
    from_bytes = onnxtrain.run(model.SerializeToString(), {"x": x})["y"]
    direct = TranslatedModel(onnxtrain.load_model(model))
    np.testing.assert_array_equal(from_path, from_bytes)
    np.testing.assert_array_equal(direct(direct.params, {"x": x})["y"], from_path)
