"""A classifier's Gemm after a global pool reads its left operand row-major.

XLA:CPU computes a 1x1 convolution as a product with the kernel on the left, so the pooled
features come out as (features, batch). Left to itself, XLA folds the move back to
(batch, features) into the classifier's product with the transposed weight (transB=1, as
torch exports nn.Linear): a product that contracts its left operand along the first axis
and its right operand along the last. YNNPACK does not take that form and XLA's fallback
kernel for it is many times slower (bench/RESULTS.md, "The classifier head's product").

Oracle: in the optimized HLO of the forward pass and of the training step, no product has
that form; the forward pass and the step's loss equal numpy's.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.translate.compiler_options import jit_with_options
from support.op_testing import translate

RNG = np.random.default_rng(0)
KERNEL = RNG.normal(size=(64, 16, 1, 1)).astype(np.float32) * 0.1
WEIGHT = RNG.normal(size=(10, 64)).astype(np.float32) * 0.1
BIAS = RNG.normal(size=10).astype(np.float32)
X = RNG.normal(size=(4, 16, 4, 4)).astype(np.float32)


def _head() -> onnx.ModelProto:
    """Conv 1x1 -> Relu -> GlobalAveragePool -> Flatten -> Gemm(transB=1)."""
    nodes = [helper.make_node("Conv", ["x", "k"], ["c"]), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["p"]), helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "w", "b"], ["y"], transB=1)]
    graph = helper.make_graph(
        nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(KERNEL, "k"), numpy_helper.from_array(WEIGHT, "w"),
         numpy_helper.from_array(BIAS, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _logits() -> np.ndarray:
    pooled = np.maximum(np.einsum("nchw,oc->nohw", X, KERNEL[:, :, 0, 0]), 0).mean(axis=(2, 3))
    return pooled @ WEIGHT.T + BIAS


def _both_transposed(hlo: str) -> list[str]:
    return [line.strip() for line in hlo.splitlines()
            if re.search(r" dot\(.*lhs_contracting_dims=\{0\}, rhs_contracting_dims=\{1\}", line)]


def test_the_forward_pass_reads_the_pooled_features_row_major():
    model = translate(_head())
    forward = jit_with_options(lambda params, inputs: model(params, inputs)["y"])
    assert _both_transposed(forward.lower(model.params, {"x": X}).compile().as_text()) == []
    np.testing.assert_allclose(np.asarray(forward(model.params, {"x": X})), _logits(), rtol=1e-5, atol=1e-6)


def test_the_training_step_reads_the_pooled_features_row_major():
    trainer = onnxtrain.Trainer(onnxtrain.make_training_model(_head(), loss="cross_entropy"))
    feeds = {"x": X, "labels": RNG.integers(0, 10, len(X))}
    assert _both_transposed(trainer.lowered(feeds).compile().as_text()) == []
    logits = _logits()
    shifted = logits - logits.max(axis=1, keepdims=True)
    picked = np.take_along_axis(shifted, feeds["labels"][:, None], axis=1)[:, 0]
    expected = np.mean(np.log(np.exp(shifted).sum(axis=1)) - picked)
    np.testing.assert_allclose(float(trainer.step(feeds)["loss"]), expected, rtol=1e-5)
