"""Training models built with onnx.helper, and the numpy oracles they are checked against.

The models follow shared/docs/training-semantics.md (§4.1 is the linear-regression
model). The oracles re-implement the spec in float64 numpy: forward and hand-derived
backward passes, and the optimizer formulas of `ai.onnx.preview.training` (§2.3-2.5).
They never reuse the engine, so a test that compares the two checks the engine.
Optimizer attributes are stored as float32 in ONNX, so the oracles round them the same way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import scipy
from onnx import TensorProto, helper, numpy_helper

TRAINING = "ai.onnx.preview.training"
FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64

# §4.4: X = [1, 2, 3, 4], Y = 2X + 1.
LINREG_X = np.array([[1.0], [2.0], [3.0], [4.0]], np.float32)
LINREG_FEEDS = {"X": LINREG_X, "Y": 2 * LINREG_X + 1}


# ---------------------------------------------------------------------------
# Building blocks


def tensor(name: str, value: Any, dtype: Any = np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def value_info(name: str, elem_type: int = FLOAT, shape: Sequence[Any] | None = None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def constant(name: str, value: Any, dtype: Any = np.float32) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=tensor(f"{name}_value", value, dtype))


def training_node(op_type: str, inputs: Sequence[str], outputs: Sequence[str], **attributes: Any) -> onnx.NodeProto:
    """A node of the ai.onnx.preview.training domain (Gradient, Adagrad, Momentum, Adam)."""
    return helper.make_node(op_type, list(inputs), list(outputs), domain=TRAINING, **attributes)


def gradient(xs: Sequence[str], y: str, zs: Sequence[str] = (), inputs: Sequence[str] | None = None,
             outputs: Sequence[str] | None = None) -> onnx.NodeProto:
    """Gradient of y w.r.t. xs, evaluated at `inputs` (default: the named tensors themselves)."""
    inputs = [*xs, *zs] if inputs is None else inputs
    outputs = [f"d{x}" for x in xs] if outputs is None else outputs
    attributes = {"zs": list(zs)} if zs else {}
    return training_node("Gradient", inputs, outputs, xs=list(xs), y=y, **attributes)


def mse_nodes(pred: str = "Y_pred", label: str = "Y", dropout: bool = False) -> list[onnx.NodeProto]:
    """loss = mean((pred - label)^2), a scalar; dropout=True first drops residuals with
    probability RATIO when TRAINING (both initializers of the caller's graph)."""
    nodes = [helper.make_node("Sub", [pred, label], ["diff"])]
    residual = "diff"
    if dropout:
        nodes.append(helper.make_node("Dropout", ["diff", "RATIO", "TRAINING"], ["kept", "mask"]))
        residual = "kept"
    return nodes + [helper.make_node("Mul", [residual, residual], ["sq"]),
                    helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]


def make_training_model(graph: onnx.GraphProto, *infos: onnx.TrainingInfoProto, opset: int = 18,
                        ir_version: int = 8) -> onnx.ModelProto:
    """A model importing the default and training domains; without `infos` it is a plain
    inference model (for Gradient in the main graph, run with onnxtrain.run)."""
    model = helper.make_model(graph, ir_version=ir_version,
                              opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(TRAINING, 1)])
    model.training_info.extend(infos)
    return model


def algorithm_graph(nodes: list[onnx.NodeProto], outputs: Sequence[str], inputs: Sequence[onnx.ValueInfoProto] = (),
                    initializer: Sequence[onnx.TensorProto] = (), name: str = "algorithm") -> onnx.GraphProto:
    return helper.make_graph(nodes, name, list(inputs), [value_info(o, TensorProto.UNDEFINED) for o in outputs],
                             initializer=list(initializer))


# ---------------------------------------------------------------------------
# Linear regression (§4.1): X[N,F] -> MatMul(W[F,1]) -> Add(B[1]) -> Y_pred[N,1]


def linreg_graph(features: int = 1, w0: Any = 0.5, b0: Any = 0.0, dtype: Any = np.float32) -> onnx.GraphProto:
    elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["XW"]), helper.make_node("Add", ["XW", "B"], ["Y_pred"])],
        "linreg", [value_info("X", elem_type, ["N", features])], [value_info("Y_pred", elem_type, ["N", 1])],
        initializer=[tensor("W", np.broadcast_to(w0, (features, 1)), dtype),
                     tensor("B", np.broadcast_to(b0, (1,)), dtype)])


LABEL = value_info("Y", FLOAT, ["N", 1])

# name -> (op type, prefix of its per-tensor state, §4.1's attributes)
LINREG_OPTIMIZERS = {
    "adagrad": ("Adagrad", "H", {}),
    "momentum": ("Momentum", "V", dict(alpha=0.9, beta=1.0, norm_coefficient=0.0, mode="standard")),
}


def linreg_model(optimizer: str = "adagrad", dropout: bool = False, dtype: Any = np.float32,
                 **attributes: Any) -> onnx.ModelProto:
    """§4.1's model: W, B trained by Adagrad (state H_W, H_B) or Momentum (V_W, V_B), T counted.

    The initialization graph draws W ~ N(0, 0.1^2) and zeroes B, the optimizer state and T.
    dropout=True drops half of the residuals before squaring them (a random algorithm graph)
    and outputs the Dropout mask. `dtype` is that of every float tensor.
    """
    elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    op_type, slot, defaults = LINREG_OPTIMIZERS[optimizer]
    W_slot, B_slot = f"{slot}_W", f"{slot}_B"
    nodes = mse_nodes(dropout=dropout) + [
        gradient(["W", "B"], "loss", zs=["X", "Y"]),
        training_node(op_type, ["LR", "T", "W", "B", "dW", "dB", W_slot, B_slot],
                      ["W_new", "B_new", f"{W_slot}_new", f"{B_slot}_new"], **{**defaults, **attributes}),
        helper.make_node("Add", ["T", "ONE"], ["T_new"]),
    ]
    initializer = [tensor("LR", 0.1, dtype), tensor("ONE", 1, np.int64), tensor(W_slot, [[0.0]], dtype),
                   tensor(B_slot, [0.0], dtype), tensor("T", 0, np.int64)]
    outputs = ["loss"]
    if dropout:
        initializer += [tensor("RATIO", 0.5, dtype), tensor("TRAINING", True, np.bool_)]
        outputs.append("mask")
    state = ["W", "B", W_slot, B_slot, "T"]
    algorithm = algorithm_graph(nodes, outputs + [f"{s}_new" for s in state],
                                [value_info("Y", elem_type, ["N", 1])], initializer)
    initialization = helper.make_graph(
        [helper.make_node("RandomNormal", [], ["W_init"], shape=[1, 1], scale=0.1, seed=0.0, dtype=elem_type),
         constant("B_init", [0.0], dtype), constant(f"{W_slot}_init", [[0.0]], dtype),
         constant(f"{B_slot}_init", [0.0], dtype), constant("T_init", 0, np.int64)],
        "initialization", [], [value_info(f"{s}_init", TensorProto.UNDEFINED) for s in state])
    info = helper.make_training_info(algorithm, [(s, f"{s}_new") for s in state],
                                     initialization, [(s, f"{s}_init") for s in state])
    return make_training_model(linreg_graph(dtype=dtype), info)


# ---------------------------------------------------------------------------
# numpy oracles


def f32(value: float) -> float:
    """An attribute value as ONNX stores it (float32), widened back to float64."""
    return float(np.float32(value))


def linreg_loss_and_grads(W: np.ndarray, B: np.ndarray, X: np.ndarray, Y: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """mean((XW + B - Y)^2) and its gradients w.r.t. W and B, by hand."""
    diff = X @ W + B - Y
    return float(np.mean(diff ** 2)), 2 * X.T @ diff / diff.size, 2 * diff.sum(axis=0) / diff.size


def adagrad(r, t, x, g, h, norm_coefficient=0.0, decay_factor=0.0, epsilon=1e-6):
    """§2.3: (x_new, h_new)."""
    g_reg = f32(norm_coefficient) * x + g
    h_new = h + g_reg * g_reg
    rate = r / (1 + t * f32(decay_factor))
    return x - rate * g_reg / (np.sqrt(h_new) + f32(epsilon)), h_new


def momentum(r, t, x, g, v, alpha, beta, norm_coefficient, mode):
    """§2.4: (x_new, v_new); beta applies from T > 0 on."""
    g_reg = f32(norm_coefficient) * x + g
    v_new = f32(alpha) * v + (f32(beta) if t > 0 else 1.0) * g_reg
    direction = v_new if mode == "standard" else g_reg + f32(alpha) * v_new
    return x - r * direction, v_new


def adam(r, t, x, g, v, h, alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.0, norm_coefficient_post=0.0):
    """§2.5: (x_new, v_new, h_new); bias correction only for T > 0."""
    alpha, beta = f32(alpha), f32(beta)
    g_reg = f32(norm_coefficient) * x + g
    v_new = alpha * v + (1 - alpha) * g_reg
    h_new = beta * h + (1 - beta) * g_reg * g_reg
    rate = r * np.sqrt(1 - beta ** t) / (1 - alpha ** t) if t > 0 else r
    x_new = x - rate * v_new / (np.sqrt(h_new) + f32(epsilon))
    return (1 - f32(norm_coefficient_post)) * x_new, v_new, h_new


def iris() -> tuple[np.ndarray, np.ndarray]:
    """The 150 Iris samples (standardized float32 features, int64 labels).

    scipy (a jax dependency) ships the features as test data, 50 rows per species in the
    canonical order setosa, versicolor, virginica, so the label of row i is i // 50.
    """
    path = os.path.join(os.path.dirname(scipy.__file__), "spatial", "tests", "data", "iris.txt")
    features = np.loadtxt(path)
    features = (features - features.mean(axis=0)) / features.std(axis=0)
    return features.astype(np.float32), np.arange(150, dtype=np.int64) // 50


# ---------------------------------------------------------------------------
# Trainer state helpers


def snapshot(trainer: Any) -> dict[str, np.ndarray]:
    """A copy of every state array, to compare against later."""
    return {name: np.array(value) for name, value in trainer.state.items()}


def assert_state_equal(trainer: Any, expected: Mapping[str, np.ndarray]) -> None:
    """Same names, dtypes, shapes and bits as `expected`."""
    actual = snapshot(trainer)
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype, name
        assert np.array_equal(actual[name], value), name


def linreg_oracle(optimizer: str, batches: Sequence[Mapping[str, np.ndarray]], rates: Sequence[float] | None = None,
                  dtype: Any = np.float32, **attributes: Any) -> tuple[list[float], list[dict[str, Any]]]:
    """(losses, states after each step) of linreg_model(optimizer, dtype=dtype, **attributes)
    trained on `batches` in float64, one step each, with learning rate rates[i] (default the
    model's 0.1) as the model stores it (in `dtype`)."""
    _, slot, defaults = LINREG_OPTIMIZERS[optimizer]
    update = {"adagrad": adagrad, "momentum": momentum}[optimizer]
    attributes = {**defaults, **attributes}
    state = {"W": np.array([[0.5]]), "B": np.array([0.0]), f"{slot}_W": np.zeros((1, 1)), f"{slot}_B": np.zeros(1), "T": 0}
    losses, states = [], []
    for batch, rate in zip(batches, rates or [0.1] * len(batches)):
        loss, dW, dB = linreg_loss_and_grads(state["W"], state["B"], *(batch[n].astype(np.float64) for n in "XY"))
        for name, grad in (("W", dW), ("B", dB)):
            state[name], state[f"{slot}_{name}"] = update(
                float(np.asarray(rate, dtype)), state["T"], state[name], grad, state[f"{slot}_{name}"], **attributes)
        state["T"] += 1
        losses.append(loss)
        states.append(dict(state))
    return losses, states
