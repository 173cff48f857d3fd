"""A 4-16-3 ReLU network trained with Adam on Iris, against a float64 numpy re-implementation.

This is the realistic case: a softmax cross-entropy loss, a Gradient over four weight
tensors with the data as zs, Adam's 12 state tensors and a 1-based T (as Adam needs for the
paper's bias correction, §2.5). The oracle's backward pass is derived by hand, so a wrong
Gradient slice, a wrong variadic layout or a wrong bias correction all show.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import onnxtrain
from support.training_models import (INT64, adam, algorithm_graph, gradient, iris, make_training_model, tensor,
                                     training_node, value_info)

HIDDEN, CLASSES, BATCH, STEPS = 16, 3, 30, 5
WEIGHTS = ["W1", "b1", "W2", "b2"]
ADAM = dict(alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=1e-3, norm_coefficient_post=1e-4)
RATE = 0.05


def initial_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"W1": (rng.normal(size=(4, HIDDEN)) * 0.7).astype(np.float32),
            "b1": (rng.normal(size=HIDDEN) * 0.1).astype(np.float32),
            "W2": (rng.normal(size=(HIDDEN, CLASSES)) * 0.35).astype(np.float32),
            "b2": np.zeros(CLASSES, np.float32)}


def mlp_model(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    main = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W1"], ["XW1"]), helper.make_node("Add", ["XW1", "b1"], ["hidden"]),
         helper.make_node("Relu", ["hidden"], ["active"]), helper.make_node("MatMul", ["active", "W2"], ["AW2"]),
         helper.make_node("Add", ["AW2", "b2"], ["logits"])],
        "mlp", [value_info("X", shape=["N", 4])], [value_info("logits", shape=["N", CLASSES])],
        initializer=[tensor(name, value) for name, value in weights.items()])
    moments = [f"{m}_{w}" for m in "VH" for w in WEIGHTS]
    state = WEIGHTS + moments + ["T"]
    nodes = [
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], reduction="mean"),
        gradient(WEIGHTS, "loss", zs=["X", "labels"]),
        training_node("Adam", ["LR", "T", *WEIGHTS, *[f"d{w}" for w in WEIGHTS], *moments],
                      [f"{s}_new" for s in WEIGHTS + moments], **ADAM),
        helper.make_node("Add", ["T", "ONE"], ["T_new"]),
    ]
    initializer = ([tensor("LR", RATE), tensor("ONE", 1, np.int64)]
                   + [tensor(f"{m}_{w}", np.zeros_like(weights[w])) for m in "VH" for w in WEIGHTS]
                   + [tensor("T", 1, np.int64)])
    algorithm = algorithm_graph(nodes, ["loss"] + [f"{s}_new" for s in state],
                                [value_info("labels", INT64, ["N"])], initializer)
    return make_training_model(main, helper.make_training_info(algorithm, [(s, f"{s}_new") for s in state], None, None))


def loss_and_gradients(w: dict[str, np.ndarray], X: np.ndarray, labels: np.ndarray) -> tuple[float, dict, float]:
    """Softmax cross-entropy of the MLP, its hand-derived gradients, and the smallest |pre-ReLU|
    (kept away from 0 so float32 and float64 agree on which units are active)."""
    hidden = X @ w["W1"] + w["b1"]
    active = np.maximum(hidden, 0)
    logits = active @ w["W2"] + w["b2"]
    logits -= logits.max(axis=1, keepdims=True)
    probabilities = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    rows = np.arange(len(labels))
    loss = -np.mean(np.log(probabilities[rows, labels]))
    d_logits = probabilities
    d_logits[rows, labels] -= 1
    d_logits /= len(labels)
    d_hidden = (d_logits @ w["W2"].T) * (hidden > 0)
    grads = {"W1": X.T @ d_hidden, "b1": d_hidden.sum(0), "W2": active.T @ d_logits, "b2": d_logits.sum(0)}
    return loss, grads, np.abs(hidden).min()


@pytest.mark.slow
def test_mlp_with_adam_on_iris_matches_numpy():
    X, labels = iris()
    order = np.random.default_rng(0).permutation(len(labels))
    batches = [{"X": X[chunk], "labels": labels[chunk]} for chunk in np.split(order[:BATCH * STEPS], STEPS)]
    weights = initial_weights()
    trainer = onnxtrain.Trainer(mlp_model(weights))

    w = {name: value.astype(np.float64) for name, value in weights.items()}
    v = {name: np.zeros_like(value) for name, value in w.items()}
    h = {name: np.zeros_like(value) for name, value in w.items()}
    for t, batch in enumerate(batches, start=1):
        loss, grads, margin = loss_and_gradients(w, batch["X"].astype(np.float64), batch["labels"])
        assert margin > 1e-5
        for name in WEIGHTS:
            w[name], v[name], h[name] = adam(float(np.float32(RATE)), t, w[name], grads[name], v[name], h[name], **ADAM)

        out = trainer.step(batch)
        assert set(out) == {"loss"}
        np.testing.assert_allclose(float(out["loss"]), loss, rtol=1e-5)
        for name in WEIGHTS:
            for key, expected in ((name, w[name]), (f"V_{name}", v[name]), (f"H_{name}", h[name])):
                actual = np.asarray(trainer.state[key])
                assert actual.dtype == np.float32
                np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(), err_msg=key)
        assert int(trainer.state["T"]) == t + 1
    assert loss < np.log(CLASSES)  # it learns
