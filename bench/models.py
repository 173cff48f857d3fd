"""The benchmark models of shared/docs/performance-anchors.md, as ONNX and as hand-written JAX.

Both versions share the same weights so their outputs can be checked equal
before anything is timed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def mlp_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "W1": (rng.standard_normal((784, 256)) * np.sqrt(2 / 784)).astype(np.float32),
        "B1": np.zeros(256, np.float32),
        "W2": (rng.standard_normal((256, 10)) * np.sqrt(2 / 256)).astype(np.float32),
        "B2": np.zeros(10, np.float32),
    }


def mlp_onnx(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """784-256-10 MLP: Linear-ReLU-Linear on x[batch, 784]."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W1"], ["h0"]),
            helper.make_node("Add", ["h0", "B1"], ["h1"]),
            helper.make_node("Relu", ["h1"], ["h"]),
            helper.make_node("MatMul", ["h", "W2"], ["l0"]),
            helper.make_node("Add", ["l0", "B2"], ["logits"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 784])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def mlp_jax(params: dict, x: jax.Array) -> jax.Array:
    hidden = jnp.maximum(x @ params["W1"] + params["B1"], 0)
    return hidden @ params["W2"] + params["B2"]


def cnn_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "C1": (rng.standard_normal((16, 1, 3, 3)) * np.sqrt(2 / 9)).astype(np.float32),
        "c1": np.zeros(16, np.float32),
        "C2": (rng.standard_normal((32, 16, 3, 3)) * np.sqrt(2 / 144)).astype(np.float32),
        "c2": np.zeros(32, np.float32),
        "W": (rng.standard_normal((1568, 10)) * np.sqrt(2 / 1568)).astype(np.float32),
        "B": np.zeros(10, np.float32),
    }


def cnn_onnx(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """conv(1->16,3x3,pad 1)-ReLU-maxpool2 -> conv(16->32)-ReLU-maxpool2 -> flatten -> Linear(1568->10)."""
    pads = [1, 1, 1, 1]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "C1", "c1"], ["a1"], pads=pads, kernel_shape=[3, 3]),
            helper.make_node("Relu", ["a1"], ["r1"]),
            helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
            helper.make_node("Conv", ["p1", "C2", "c2"], ["a2"], pads=pads, kernel_shape=[3, 3]),
            helper.make_node("Relu", ["a2"], ["r2"]),
            helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
            helper.make_node("Flatten", ["p2"], ["f"], axis=1),
            helper.make_node("MatMul", ["f", "W"], ["l0"]),
            helper.make_node("Add", ["l0", "B"], ["logits"]),
        ],
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, 28, 28])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _max_pool_2x2(x: jax.Array) -> jax.Array:
    return jnp.maximum(jnp.maximum(x[:, :, 0::2, 0::2], x[:, :, 0::2, 1::2]),
                       jnp.maximum(x[:, :, 1::2, 0::2], x[:, :, 1::2, 1::2]))


def _conv(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
    out = jax.lax.conv_general_dilated(x, kernel, (1, 1), ((1, 1), (1, 1)),
                                       dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return out + bias[None, :, None, None]


def cnn_jax(params: dict, x: jax.Array) -> jax.Array:
    """The same CNN by hand, NCHW like ONNX, max-pool as the max of strided slices."""
    h = _max_pool_2x2(jnp.maximum(_conv(x, params["C1"], params["c1"]), 0))
    h = _max_pool_2x2(jnp.maximum(_conv(h, params["C2"], params["c2"]), 0))
    return h.reshape(h.shape[0], -1) @ params["W"] + params["B"]
