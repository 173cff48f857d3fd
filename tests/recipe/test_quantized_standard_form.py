"""MatMulNBits rewritten as DequantizeLinear -> Transpose -> MatMul (so that LoRA sees a
quantized base): the same outputs in onnxruntime, the integers unchanged in width."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import onnxtrain
from onnxtrain._recipe.quantized import standardize_matmul_nbits
from onnxtrain.translate.model import TranslatedModel
from support.quantized_models import float_mlp, onnxruntime_outputs, quantized

pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")


@pytest.mark.parametrize("bits, symmetric", [(8, False), (8, True), (4, False), (4, True)])
@pytest.mark.slow
def test_standard_form_computes_what_matmul_nbits_computes(bits, symmetric):
    """K = 48: three blocks of 16, an odd count, so 4-bit zero points are repacked per row."""
    base = quantized(float_mlp(k=48, n=32), bits, symmetric)
    standard = onnxtrain.load_model(base.SerializeToString())
    assert standardize_matmul_nbits(standard) == 2
    converted = onnx.ModelProto.FromString(standard.SerializeToString())
    assert {n.op_type for n in converted.graph.node} >= {"DequantizeLinear", "Transpose", "MatMul"}
    assert "MatMulNBits" not in {n.op_type for n in converted.graph.node}
    expected_type = onnx.TensorProto.UINT8 if bits == 8 else onnx.TensorProto.UINT4
    stored = {t.name: t for t in converted.graph.initializer}
    for node in converted.graph.node:
        if node.op_type == "DequantizeLinear":
            assert stored[node.input[0]].data_type == expected_type
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 48)).astype(np.float32)}
    (expected,) = onnxruntime_outputs(base, feeds, optimized=False)
    (actual,) = onnxruntime_outputs(converted, feeds, optimized=False)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    fn = TranslatedModel(standard)
    ours = np.asarray(fn(fn.params, feeds)["y"])
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_weights_that_are_not_whole_blocks_stay_matmul_nbits():
    """K = 40 with blocks of 16: the last block is padded, which DequantizeLinear's blocks
    cannot say without a Slice that LoRA would not see through; the node stays as it is."""
    base = quantized(float_mlp(k=40, n=24), 8, False)
    standard = onnxtrain.load_model(base.SerializeToString())
    assert standardize_matmul_nbits(standard) == 0
    assert [n.op_type for n in standard.graph.node] == [n.op_type for n in base.graph.node]
