"""The benchmark models of shared/docs/performance-anchors.md, as ONNX and as hand-written JAX
(inference, and training with cross-entropy + Adam).

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


# ---------------------------------------------------------------------------
# Training: mean softmax cross-entropy + Adam (the spec's, ai.onnx.preview.training)

TRAINING_DOMAIN = "ai.onnx.preview.training"
ADAM = {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-8}
LEARNING_RATE = 1e-3


def training_onnx(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` (input x, output logits [batch, classes]) with a TrainingInfoProto.

    Algorithm: labels (int64 [batch]) -> SoftmaxCrossEntropyLoss(mean) -> Gradient over
    every initializer of the main graph (zs = x, labels) -> Adam(R, T, W..., G..., V..., H...)
    with R = LEARNING_RATE and a 1-based int64 step counter T (T_new = T + 1). Every weight,
    its V and H moments and T are bound by update_binding; `loss` is the step's output.
    """
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    names = list(weights)
    moments = [f"{m}_{w}" for m in "VH" for w in names]
    state = [*names, *moments, "T"]
    nodes = [
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], reduction="mean"),
        helper.make_node("Gradient", [*names, "x", "labels"], [f"d_{w}" for w in names],
                         domain=TRAINING_DOMAIN, xs=names, zs=["x", "labels"], y="loss"),
        helper.make_node("Adam", ["R", "T", *names, *[f"d_{w}" for w in names], *moments],
                         [f"{s}_new" for s in [*names, *moments]], domain=TRAINING_DOMAIN, **ADAM),
        helper.make_node("Add", ["T", "ONE"], ["T_new"]),
    ]
    initializer = ([numpy_helper.from_array(np.array(LEARNING_RATE, np.float32), "R"),
                    numpy_helper.from_array(np.array(1, np.int64), "ONE"),
                    numpy_helper.from_array(np.array(1, np.int64), "T")]
                   + [numpy_helper.from_array(np.zeros_like(weights[w]), f"{m}_{w}")
                      for m in "VH" for w in names])
    shapes = {**{w: v.shape for w, v in weights.items()},
              **{f"{m}_{w}": v.shape for m in "VH" for w, v in weights.items()}}
    outputs = ([helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
               + [helper.make_tensor_value_info(f"{s}_new", TensorProto.FLOAT, list(shapes[s]))
                  for s in [*names, *moments]]
               + [helper.make_tensor_value_info("T_new", TensorProto.INT64, [])])
    algorithm = helper.make_graph(
        nodes, "adam_step", [helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch"])],
        outputs, initializer=initializer)
    training = helper.make_model(
        model.graph, ir_version=10,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(TRAINING_DOMAIN, 1)])
    training.training_info.append(
        helper.make_training_info(algorithm, [(s, f"{s}_new") for s in state], None, None))
    return training


def cross_entropy_jax(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of logits [batch, classes] against class indices [batch]."""
    log_prob = jax.nn.log_softmax(logits, axis=1)
    return -jnp.mean(jnp.take_along_axis(log_prob, labels[:, None], axis=1))


def adam_state_jax(weights: dict[str, np.ndarray]) -> dict:
    """The state of train_step_jax: weights, V and H moments (zeros), 1-based counter t."""
    return {"params": {k: jnp.array(v) for k, v in weights.items()},
            "v": {k: jnp.zeros(v.shape, v.dtype) for k, v in weights.items()},
            "h": {k: jnp.zeros(v.shape, v.dtype) for k, v in weights.items()},
            "t": jnp.asarray(1, jnp.int32)}


def train_step_jax(forward):
    """The training step of training_onnx by hand: one jax.jit around jax.value_and_grad and
    the spec's Adam (norm coefficients 0), state donated. step(state, x, labels) -> (state, loss).

    Adam of ai.onnx.preview.training: v = a*v + (1-a)*g; h = b*h + (1-b)*g^2;
    r' = r*sqrt(1-b^T)/(1-a^T) if T > 0 else r; x -= r' * v / (sqrt(h) + eps).
    Coefficients are those the ONNX attributes store (float32).
    """
    alpha, beta, epsilon = (float(np.float32(ADAM[k])) for k in ("alpha", "beta", "epsilon"))
    rate = float(np.float32(LEARNING_RATE))

    def loss_fn(params, x, labels):
        return cross_entropy_jax(forward(params, x), labels)

    def step(state, x, labels):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, labels)
        t = state["t"].astype(jnp.float32)
        corrected = jnp.where(t > 0, rate * jnp.sqrt(1 - beta ** t) / (1 - alpha ** t), rate)
        v = jax.tree.map(lambda v, g: alpha * v + (1 - alpha) * g, state["v"], grads)
        h = jax.tree.map(lambda h, g: beta * h + (1 - beta) * g * g, state["h"], grads)
        params = jax.tree.map(lambda p, v, h: p - corrected * v / (jnp.sqrt(h) + epsilon),
                              state["params"], v, h)
        return {"params": params, "v": v, "h": h, "t": state["t"] + 1}, loss

    return jax.jit(step, donate_argnums=0)
