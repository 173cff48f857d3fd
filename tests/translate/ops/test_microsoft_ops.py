"""com.microsoft contrib ops (translate/ops/microsoft*.py) against ONNX Runtime, their
gradients against the unfused ONNX formulation and finite differences.

Every value test runs one contrib node in onnxruntime (the oracle: it defines these ops) and
in onnxtrain on the same random inputs. Gradient tests differentiate the contrib node and the
standard-op subgraph ONNX Runtime's optimizer fuses into it, both translated by onnxtrain,
or (where no unfused form is short) compare with central differences in float64.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime
import pytest
from jax.test_util import check_grads
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.errors import UnsupportedOpError
from support.op_testing import translate

MS = "com.microsoft"
RNG = np.random.default_rng(33)


def rand(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (scale * RNG.standard_normal(shape)).astype(np.float32)


def contrib_model(op_type: str, inputs: dict[str, np.ndarray | None], outputs: int | list[str] = 1,
                  domain: str = MS, opset: int = 17, **attrs: Any) -> onnx.ModelProto:
    """One contrib node whose inputs are graph inputs (None leaves an optional input out)."""
    names = [name if value is not None else "" for name, value in inputs.items()]
    while names and not names[-1]:
        names.pop()
    out_names = [f"Y{i}" for i in range(outputs)] if isinstance(outputs, int) else outputs
    node = helper.make_node(op_type, names, out_names, domain=domain, name=f"the_{op_type}",
                            **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype),
                                                  v.shape)
                    for n, v in inputs.items() if v is not None]
    graph_outputs = [helper.make_empty_tensor_value_info(n)
                     for n in out_names if n]
    graph = helper.make_graph([node], op_type, graph_inputs, graph_outputs)
    return helper.make_model(graph, ir_version=8, opset_imports=[
        helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])


def feeds_of(inputs: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
    return {name: value for name, value in inputs.items() if value is not None}


def ours(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    fn = translate(model)
    result = fn(fn.params, feeds)
    return [np.asarray(result[name]) for name in fn.output_names]


def theirs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_matches_onnxruntime(op_type: str, inputs: dict[str, np.ndarray | None],
                               outputs: int | list[str] = 1, rtol: float = 1e-5,
                               atol: float = 1e-5, opset: int = 17, domain: str = MS,
                               **attrs: Any) -> list[np.ndarray]:
    model = contrib_model(op_type, inputs, outputs, domain=domain, opset=opset, **attrs)
    feeds = feeds_of(inputs)
    expected = theirs(model, feeds)
    actual = ours(model, feeds)
    assert len(actual) == len(expected)
    for index, (a, e) in enumerate(zip(actual, expected)):
        assert a.shape == e.shape, f"output {index}: shape {a.shape} vs {e.shape}"
        assert a.dtype == e.dtype, f"output {index}: dtype {a.dtype} vs {e.dtype}"
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"output {index}")
    return actual


# ---------------------------------------------------------------------------------------
# Normalizations


@pytest.mark.parametrize("skip_shape", [(2, 5, 8), (1, 5, 8), (5, 8)])
@pytest.mark.parametrize("with_beta, with_bias", [(True, True), (True, False), (False, False)])
def test_skip_layer_normalization_matches_onnxruntime(skip_shape, with_beta, with_bias):
    inputs = dict(x=rand(2, 5, 8), skip=rand(*skip_shape), gamma=rand(8),
                  beta=rand(8) if with_beta else None, bias=rand(8) if with_bias else None)
    assert_matches_onnxruntime("SkipLayerNormalization", inputs, ["Y0", "", "", "Y3"],
                               epsilon=1e-5)


def test_skip_layer_normalization_statistics_outputs():
    x, skip, gamma = rand(2, 3, 8), rand(2, 3, 8), rand(8)
    model = contrib_model("SkipLayerNormalization", dict(x=x, skip=skip, gamma=gamma), 4,
                          epsilon=1e-5)
    y, mean, inv_std, total = ours(model, dict(x=x, skip=skip, gamma=gamma))
    s = (x + skip).astype(np.float64)
    np.testing.assert_allclose(total, x + skip, rtol=1e-6)
    np.testing.assert_allclose(mean[..., 0], s.mean(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inv_std[..., 0], 1 / np.sqrt(s.var(-1) + 1e-5), rtol=1e-5)
    np.testing.assert_allclose(y, theirs(model, dict(x=x, skip=skip, gamma=gamma))[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_bias", [True, False])
def test_skip_simplified_layer_normalization_matches_onnxruntime(with_bias):
    inputs = dict(x=rand(2, 5, 8), skip=rand(2, 5, 8), gamma=rand(8),
                  bias=rand(8) if with_bias else None)
    assert_matches_onnxruntime("SkipSimplifiedLayerNormalization", inputs, ["Y0", "", "", "Y3"],
                               epsilon=1e-6)


@pytest.mark.parametrize("axis", [-1, 1])
def test_simplified_layer_normalization_default_domain_matches_onnxruntime(axis):
    inputs = dict(x=rand(2, 3, 8), scale=rand(*(3, 8) if axis == 1 else (8,)))
    assert_matches_onnxruntime("SimplifiedLayerNormalization", inputs, 1, domain="",
                               axis=axis, epsilon=1e-6)


def test_layer_normalization_before_opset_17_is_onnxruntime_s_contrib_op():
    inputs = dict(x=rand(2, 3, 8), scale=rand(8), bias=rand(8))
    assert_matches_onnxruntime("LayerNormalization", inputs, 1, domain="", opset=16,
                               epsilon=1e-5)


@pytest.mark.parametrize("segments, mask, position_ids", [
    (True, True, False), (False, False, False), (True, False, True), (False, True, True)])
def test_embed_layer_normalization_matches_onnxruntime(segments, mask, position_ids):
    batch, length, hidden = 2, 6, 8
    inputs = dict(
        input_ids=RNG.integers(0, 20, (batch, length)).astype(np.int32),
        segment_ids=RNG.integers(0, 2, (batch, length)).astype(np.int32) if segments else None,
        word=rand(20, hidden), position=rand(16, hidden),
        segment=rand(2, hidden) if segments else None, gamma=rand(hidden), beta=rand(hidden),
        mask=np.array([[1, 1, 1, 0, 0, 0], [1] * 6], np.int32) if mask else None,
        position_ids=(RNG.integers(0, 16, (batch, length)).astype(np.int32)
                      if position_ids else None))
    outputs = ["Y0", "Y1", "Y2"] if mask else ["Y0", "", "Y2"]
    actual = assert_matches_onnxruntime("EmbedLayerNormalization", inputs, outputs,
                                        epsilon=1e-12)
    if mask:
        np.testing.assert_array_equal(actual[1], [3, 6])


# ---------------------------------------------------------------------------------------
# Activations, BiasAdd, FusedMatMul


@pytest.mark.parametrize("op_type, inputs, attrs", [
    ("Gelu", dict(x=rand(3, 16, scale=3)), {}),
    ("BiasGelu", dict(x=rand(3, 16, scale=3), bias=rand(16)), {}),
    ("FastGelu", dict(x=rand(3, 16, scale=3)), {}),
    ("FastGelu", dict(x=rand(3, 16, scale=3), bias=rand(16)), {}),
    ("QuickGelu", dict(x=rand(3, 16, scale=3)), {}),
    ("QuickGelu", dict(x=rand(3, 16, scale=3)), dict(alpha=1.0)),
], ids=["gelu", "bias_gelu", "fast_gelu", "fast_gelu_bias", "quick_gelu", "quick_gelu_alpha"])
def test_elementwise_contrib_ops_match_onnxruntime(op_type, inputs, attrs):
    assert_matches_onnxruntime(op_type, inputs, 1, **attrs)


def test_bias_add_adds_bias_and_skip():
    # onnxruntime implements BiasAdd only on CUDA; the oracle is its definition.
    inputs = dict(x=rand(2, 4, 16), bias=rand(16), skip=rand(2, 4, 16))
    (y,) = ours(contrib_model("BiasAdd", inputs), inputs)
    np.testing.assert_allclose(y, inputs["x"] + inputs["bias"] + inputs["skip"], rtol=1e-6)


@pytest.mark.parametrize("a_shape, b_shape, attrs", [
    ((3, 4), (4, 5), dict(alpha=0.5)),
    ((4, 3), (5, 4), dict(transA=1, transB=1)),
    ((2, 3, 4), (2, 5, 4), dict(transB=1, alpha=0.125)),
    ((2, 3, 4), (4, 5), {}),
    ((3, 2, 4), (2, 4, 5), dict(transBatchA=1)),
    ((2, 3, 5), (5, 2, 4), dict(transBatchB=1)),
    ((3, 2, 4), (4, 2, 5), dict(transBatchA=1, transBatchB=1, alpha=2.0)),
    ((4, 2, 3), (5, 2, 4), dict(transBatchA=1, transA=1, transBatchB=1, transB=1)),
    ((3, 2, 2, 4), (2, 2, 4, 5), dict(transBatchA=1)),
])
def test_fused_matmul_matches_onnxruntime(a_shape, b_shape, attrs):
    assert_matches_onnxruntime("FusedMatMul", dict(a=rand(*a_shape), b=rand(*b_shape)), 1,
                               **attrs)
