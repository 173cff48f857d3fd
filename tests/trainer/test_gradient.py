"""The Gradient operator, in the inference graph (onnxtrain.run) and in algorithm graphs.

§2.1: xs, zs and y name the differentiated function by tensor names; the node's inputs give
the point where it is evaluated; tensors y depends on outside xs and zs are constants at
their current values; a non-scalar y is summed (ones cotangent); a Gradient of a Gradient
output is a second derivative. Expected values are derived by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import onnxtrain
from support.training_models import (LABEL, adagrad, algorithm_graph, constant, f32, gradient, linreg_graph,
                                     linreg_loss_and_grads, linreg_model, make_training_model, mse_nodes, tensor,
                                     value_info)


def run(nodes, inputs: dict[str, np.ndarray], outputs: list[str], opset: int = 18, ir_version: int = 8) -> list[np.ndarray]:
    """Run a main graph (no training_info) whose inputs have the shapes and dtypes of `inputs`."""
    graph = helper.make_graph(nodes, "gradient", [value_info(name, shape=value.shape) for name, value in inputs.items()],
                              [value_info(name, TensorProto.UNDEFINED) for name in outputs])
    result = onnxtrain.run(make_training_model(graph, opset=opset, ir_version=ir_version), inputs)
    return [np.asarray(result[name]) for name in outputs]


SCALARS = {"a": np.array(1.0, np.float32), "b": np.array(2.0, np.float32)}


def test_backend_case_gradient_of_add():
    nodes = [helper.make_node("Add", ["a", "b"], ["c"]), gradient(["a", "b"], "c", outputs=["dc_da", "dc_db"])]
    c, dc_da, dc_db = run(nodes, SCALARS, ["c", "dc_da", "dc_db"], opset=12, ir_version=7)
    assert (float(c), float(dc_da), float(dc_db)) == (3.0, 1.0, 1.0)
    assert dc_da.shape == () and dc_da.dtype == np.float32


def test_backend_case_gradient_of_add_and_mul():
    """d = (a + b) a: dd/da = 2a + b = 4, dd/db = a = 1."""
    nodes = [helper.make_node("Add", ["a", "b"], ["c"]), helper.make_node("Mul", ["c", "a"], ["d"]),
             gradient(["a", "b"], "d", outputs=["dd_da", "dd_db"])]
    outputs = run(nodes, SCALARS, ["d", "dd_da", "dd_db"], opset=12, ir_version=7)
    assert [float(value) for value in outputs] == [3.0, 4.0, 1.0]


def test_an_empty_output_name_skips_that_gradient():
    nodes = [helper.make_node("Mul", ["a", "b"], ["c"]), gradient(["a", "b"], "c", outputs=["", "dc_db"])]
    (dc_db,) = run(nodes, SCALARS, ["dc_db"])
    assert float(dc_db) == 1.0


def cube_sum_nodes() -> list:
    """y = sum(x^3), so dy/dx = 3x^2 and d(sum dy/dx)/dx = 6x."""
    return [helper.make_node("Mul", ["x", "x"], ["x2"]), helper.make_node("Mul", ["x2", "x"], ["x3"]),
            helper.make_node("ReduceSum", ["x3"], ["y"], keepdims=0)]


X = np.array([-1.5, 0.5, 2.0], np.float32)


def test_the_node_inputs_are_the_point_of_evaluation():
    """Gradient(x + 1; xs=[x], y=y) is dy/dx evaluated at x + 1, not at x."""
    nodes = cube_sum_nodes() + [constant("one", 1.0), helper.make_node("Add", ["x", "one"], ["shifted"]),
                                gradient(["x"], "y", inputs=["shifted"], outputs=["g"])]
    (g,) = run(nodes, {"x": X}, ["g"])
    np.testing.assert_allclose(g, 3 * (X + 1) ** 2, rtol=1e-6)


def test_a_non_scalar_y_is_summed_and_broadcasting_is_undone():
    """y = x * w with w of shape [1]: d(sum y)/dx = w everywhere, d(sum y)/dw = [sum x]."""
    nodes = [helper.make_node("Mul", ["x", "w"], ["y"]), gradient(["x", "w"], "y")]
    dx, dw = run(nodes, {"x": X, "w": np.array([3.0], np.float32)}, ["dx", "dw"])
    np.testing.assert_allclose(dx, [3.0, 3.0, 3.0])
    assert dw.shape == (1,)
    np.testing.assert_allclose(dw, [X.sum()], rtol=1e-6)


def test_xs_may_name_an_intermediate_and_unconnected_xs_get_zeros():
    """h = x*x is a cut point: y = sum(h*h) gives dy/dh = 2h (not via x); y ignores b: dy/db = 0."""
    nodes = [helper.make_node("Mul", ["x", "x"], ["h"]), helper.make_node("Mul", ["h", "h"], ["h2"]),
             helper.make_node("ReduceSum", ["h2"], ["y"], keepdims=0), gradient(["h", "b"], "y")]
    dh, db = run(nodes, {"x": X, "b": np.ones((2, 2), np.float32)}, ["dh", "db"])
    np.testing.assert_allclose(dh, 2 * X ** 2, rtol=1e-6)
    np.testing.assert_array_equal(db, np.zeros((2, 2), np.float32))


def test_second_order_gradient_in_the_inference_graph():
    nodes = cube_sum_nodes() + [
        gradient(["x"], "y", outputs=["g"]),
        gradient(["x"], "g", outputs=["gg"]),                 # non-scalar y: d(sum g)/dx
        helper.make_node("ReduceSum", ["g"], ["g_sum"], keepdims=0),
        gradient(["x"], "g_sum", outputs=["gg_of_sum"]),
    ]
    g, gg, gg_of_sum = run(nodes, {"x": X}, ["g", "gg", "gg_of_sum"])
    np.testing.assert_allclose(g, 3 * X ** 2, rtol=1e-6)
    np.testing.assert_allclose(gg, 6 * X, rtol=1e-6)
    np.testing.assert_allclose(gg_of_sum, 6 * X, rtol=1e-6)


def test_gradient_in_a_loop_body_differentiates_each_iteration():
    # Loop body: s = 2c, y = sum(s^2), g = dy/ds = 2s = 4c, c <- c + g = 5c: after 3 rounds, 125x.
    body = helper.make_graph(
        [helper.make_node("Mul", ["c", "two"], ["s"]), helper.make_node("Mul", ["s", "s"], ["squares"]),
         helper.make_node("ReduceSum", ["squares"], ["y"], keepdims=0), gradient(["s"], "y", outputs=["g"]),
         helper.make_node("Add", ["c", "g"], ["c_next"]), helper.make_node("Identity", ["go"], ["go_next"])],
        "body", [value_info("i", TensorProto.INT64, []), value_info("go", TensorProto.BOOL, []),
                 value_info("c", shape=[2])],
        [value_info("go_next", TensorProto.BOOL, []), value_info("c_next", shape=[2])])
    nodes = [constant("two", 2.0), constant("rounds", 3, np.int64), constant("always", True, np.bool_),
             helper.make_node("Loop", ["rounds", "always", "x"], ["out"], body=body)]
    x = np.array([1.0, -0.5], np.float32)
    (out,) = run(nodes, {"x": x}, ["out"])
    np.testing.assert_allclose(out, 125 * x, rtol=1e-6)


def gradient_model(with_zs: bool):
    """SGD on W of a 2-feature linreg; the step also reports dW (and dB with zs).

    with_zs=False: Gradient(W; xs=[W], y=loss) without zs, although loss also depends on X,
    Y and B; B is state that grows by 1 each step, so its current value must be the one used.
    """
    if with_zs:
        nodes, outputs, bound = [gradient(["W", "B"], "loss", zs=["X", "Y"])], ["dW", "dB"], ["W"]
    else:
        nodes = [gradient(["W"], "loss"), helper.make_node("Add", ["B", "ONE"], ["B_new"])]
        outputs, bound = ["dW"], ["W", "B"]
    nodes = mse_nodes() + nodes + [helper.make_node("Mul", ["LR", "dW"], ["step_W"]),
                                   helper.make_node("Sub", ["W", "step_W"], ["W_new"])]
    algorithm = algorithm_graph(nodes, ["loss", *outputs, *[f"{b}_new" for b in bound]], [LABEL],
                                [tensor("LR", 0.05), tensor("ONE", 1.0)])
    info = helper.make_training_info(algorithm, [(b, f"{b}_new") for b in bound], None, None)
    return make_training_model(linreg_graph(features=2, w0=[[0.5], [-0.5]], b0=0.25), info)


@pytest.mark.parametrize("with_zs", [True, False])
def test_gradient_in_an_algorithm_with_and_without_zs(with_zs):
    rng = np.random.default_rng(4)
    feeds = {"X": rng.normal(size=(5, 2)).astype(np.float32), "Y": rng.normal(size=(5, 1)).astype(np.float32)}
    trainer = onnxtrain.Trainer(gradient_model(with_zs))
    W, B = np.array([[0.5], [-0.5]]), np.array([0.25])
    for _ in range(3):
        loss, dW, dB = linreg_loss_and_grads(W, B, feeds["X"].astype(np.float64), feeds["Y"].astype(np.float64))
        out = trainer.step(feeds)
        assert set(out) == ({"loss", "dW", "dB"} if with_zs else {"loss", "dW"})
        np.testing.assert_allclose(float(out["loss"]), loss, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(out["dW"]), dW, rtol=1e-5)
        if with_zs:
            np.testing.assert_allclose(np.asarray(out["dB"]), dB, rtol=1e-5)
        else:
            B = B + 1
        W = W - f32(0.05) * dW
        np.testing.assert_allclose(np.asarray(trainer.state["W"]), W, rtol=1e-5)


def newton_model():
    """Newton's method on loss = sum((X*W - Y)^4), which is separable in W, so the Hessian is
    diagonal and equals the gradient of sum(dloss/dW): W -= dW / d2W."""
    main = helper.make_graph([helper.make_node("Mul", ["X", "W"], ["P"])], "scale",
                             [value_info("X", shape=[2])], [value_info("P", shape=[2])],
                             initializer=[tensor("W", [0.5, -1.0])])
    nodes = [helper.make_node("Sub", ["P", "Y"], ["e"]), helper.make_node("Mul", ["e", "e"], ["e2"]),
             helper.make_node("Mul", ["e2", "e2"], ["e4"]), helper.make_node("ReduceSum", ["e4"], ["loss"], keepdims=0),
             gradient(["W"], "loss", zs=["X", "Y"], outputs=["dW"]),
             gradient(["W"], "dW", zs=["X", "Y"], outputs=["d2W"]),
             helper.make_node("Div", ["dW", "d2W"], ["newton"]), helper.make_node("Sub", ["W", "newton"], ["W_new"])]
    algorithm = algorithm_graph(nodes, ["loss", "dW", "d2W", "W_new"], [value_info("Y", shape=[2])])
    return make_training_model(main, helper.make_training_info(algorithm, [("W", "W_new")], None, None))


def test_second_order_gradient_in_an_algorithm_drives_newtons_method():
    feeds = {"X": np.array([2.0, 3.0], np.float32), "Y": np.array([3.0, 1.0], np.float32)}
    X, Y = (feeds[name].astype(np.float64) for name in "XY")
    trainer = onnxtrain.Trainer(newton_model())
    W = np.array([0.5, -1.0])
    for _ in range(3):
        e = X * W - Y
        out = trainer.step(feeds)
        np.testing.assert_allclose(float(out["loss"]), np.sum(e ** 4), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(out["dW"]), 4 * e ** 3 * X, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(out["d2W"]), 12 * e ** 2 * X ** 2, rtol=1e-5)
        W = W - e / (3 * X)
        np.testing.assert_allclose(np.asarray(trainer.state["W"]), W, rtol=1e-5)


def test_gradient_through_dropout_uses_the_forward_pass_mask():
    """loss = mean((2 m d)^2) for the Dropout mask m (ratio 0.5) and residual d, so
    dloss/dW = 8/N X^T (m d): the gradient must see the mask the loss saw."""
    X = np.linspace(-1, 2, 8, dtype=np.float32).reshape(8, 1)
    feeds = {"X": X, "Y": 2 * X + 1}
    trainer = onnxtrain.Trainer(linreg_model(dropout=True), seed=0)
    W, B, H_W, H_B = np.array([[0.5]]), np.zeros(1), np.zeros((1, 1)), np.zeros(1)
    kept = []
    for step in range(3):
        out = trainer.step(feeds)
        mask = np.asarray(out["mask"])
        assert mask.dtype == np.bool_ and mask.shape == (8, 1)
        kept.append(int(mask.sum()))
        masked = mask * (X.astype(np.float64) @ W + B - feeds["Y"])
        np.testing.assert_allclose(float(out["loss"]), np.mean((2 * masked) ** 2), rtol=1e-5)
        W, H_W = adagrad(f32(0.1), step, W, 8 * X.T @ masked / 8, H_W)
        B, H_B = adagrad(f32(0.1), step, B, 8 * masked.sum(axis=0) / 8, H_B)
        np.testing.assert_allclose(np.asarray(trainer.state["W"]), W, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(trainer.state["B"]), B, rtol=1e-5)
    assert any(0 < count < 8 for count in kept)
