"""Nested If with a condition computed from graph inputs: each branch is traced once.

`If` used to trace both branches with jax.eval_shape and then again under jax.lax.cond, so
each level of nesting doubled the work: depth 12 took seconds, depth 25 never finished.
The model: an If whose then_branch holds the next If and whose else_branch is one Sub,
the condition a graph input, down to the deepest protobuf parses (30).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxtrain import load_model
from onnxtrain.translate.model import TranslatedModel
from onnxtrain.translate.ops import control_flow

FLOAT, BOOL = TensorProto.FLOAT, TensorProto.BOOL
X = np.array([0.5, -1.0, 2.0], np.float32)


def value(name: str, elem_type: int = FLOAT, shape: list | None = None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def nested_if(depth: int) -> onnx.ModelProto:
    """Y = X * X * W when C, else X - W (W a trained float initializer): `depth` nested Ifs,
    each level's then_branch the next If, its else_branch one Sub."""
    inner = helper.make_graph([helper.make_node("Mul", ["X", "X"], ["XX"]), helper.make_node("Mul", ["XX", "W"], ["Y0"])],
                              "then0", [], [value("Y0")])
    for level in range(1, depth + 1):
        otherwise = helper.make_graph([helper.make_node("Sub", ["X", "W"], [f"E{level}"])], f"else{level}", [],
                                      [value(f"E{level}")])
        node = helper.make_node("If", ["C"], [f"Y{level}"], name=f"if{level}", then_branch=inner,
                                else_branch=otherwise)
        inner = helper.make_graph([node], f"then{level}", [], [value(f"Y{level}")])
    main = helper.make_graph(list(inner.node), "nested", [value("X", FLOAT, [3]), value("C", BOOL, [])],
                             [value(f"Y{depth}", FLOAT, [3])], [numpy_helper.from_array(np.float32(1.5), "W")])
    return helper.make_model(main, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def translate(proto: onnx.ModelProto) -> TranslatedModel:
    return TranslatedModel(load_model(proto.SerializeToString()))


def run_and_grad(fn: TranslatedModel, condition: bool) -> tuple[np.ndarray, np.ndarray]:
    """The model's output (compiled) and d sum(Y) / dW (compiled), for condition C."""
    feeds = {"X": X, "C": np.array(condition)}
    (name,) = fn.output_names
    outputs = np.asarray(fn(fn.params, feeds)[name])

    def loss(params: dict) -> jax.Array:
        return jnp.sum(fn.apply(params, {"X": jnp.asarray(X), "C": jnp.asarray(condition)})[name])

    with jax.enable_x64(True):
        gradient = jax.jit(jax.grad(loss))(fn.params)["W"]
    return outputs, np.asarray(gradient)


@pytest.mark.parametrize("condition", [True, False])
def test_nested_if_gives_the_reference_answer_and_gradient(condition: bool):
    proto = nested_if(10)
    (expected,) = ReferenceEvaluator(proto).run(None, {"X": X, "C": np.array(condition)})
    outputs, gradient = run_and_grad(translate(proto), condition)
    np.testing.assert_allclose(outputs, expected, rtol=1e-6)
    # d/dW sum(X*X*W) = sum(X*X); d/dW sum(X - W) = -3.
    np.testing.assert_allclose(gradient, np.sum(X * X) if condition else -3.0, rtol=1e-6)


def test_each_branch_is_traced_once(monkeypatch: pytest.MonkeyPatch):
    """Counting every evaluation of a branch plan while the depth-30 model compiles once."""
    depth = 30
    fn = translate(nested_if(depth))
    evaluated: list[str] = []
    original = control_flow.evaluate_plan

    def counting(plan, *args, **kwargs):
        evaluated.append(plan.name)
        return original(plan, *args, **kwargs)

    monkeypatch.setattr(control_flow, "evaluate_plan", counting)
    fn(fn.params, {"X": X, "C": np.array(True)})
    assert sorted(evaluated) == sorted([f"then{level}" for level in range(depth)]
                                       + [f"else{level}" for level in range(1, depth + 1)])


@pytest.mark.slow
def test_depth_30_translates_runs_and_differentiates():
    """Deep nesting stays linear: each branch is translated once (the test above), so depth 30
    runs and differentiates; how fast is a benchmark's question, not a test's."""
    outputs, gradient = run_and_grad(translate(nested_if(30)), True)
    np.testing.assert_allclose(outputs, X * X * 1.5, rtol=1e-6)
    np.testing.assert_allclose(gradient, np.sum(X * X), rtol=1e-6)


def test_branches_of_different_shapes_still_fall_back_to_running_eagerly():
    """A traced condition with branches that disagree: the graph runs op by op instead."""
    then_branch = helper.make_graph([helper.make_node("Identity", ["X"], ["T"])], "then", [], [value("T")])
    else_branch = helper.make_graph([helper.make_node("Concat", ["X", "X"], ["E"], axis=0)], "else", [], [value("E")])
    nodes = [helper.make_node("If", ["C"], ["Y"], then_branch=then_branch, else_branch=else_branch)]
    proto = helper.make_model(helper.make_graph(nodes, "g", [value("X", FLOAT, [3]), value("C", BOOL, [])],
                                                [value("Y")]),
                              opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    fn = translate(proto)
    for condition in (True, False):
        feeds = {"X": X, "C": np.array(condition)}
        (expected,) = ReferenceEvaluator(proto).run(None, feeds)
        np.testing.assert_array_equal(np.asarray(fn(fn.params, feeds)["Y"]), expected)
    assert len(fn._eager_signatures) == 1
