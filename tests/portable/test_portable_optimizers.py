"""Adam, Adagrad and Momentum written as standard ops (expand_optimizers), run by stock
onnxruntime, against three oracles: the ONNX backend test cases' expected values, onnx.reference's
kernels and onnxtrain's own ops (translate/ops/training.py), including T > 0, weight decay,
norm_coefficient_post, decay_factor and nesterov, which the backend cases leave out."""

from __future__ import annotations

import importlib

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from onnxtrain._portable.optimizers import expand_optimizers, is_optimizer
from onnxtrain.errors import ExportError
from onnxtrain.proto import NodeProto
from support.portable_graphs import assert_close, run_onnxruntime, run_onnxtrain

TRAINING = "ai.onnx.preview.training"


def _single_node_model(node: onnx.NodeProto, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for n, v in feeds.items()]
    outputs = []
    for name in node.output:
        value = feeds[_matching_input(node, name)]
        outputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape))
    graph = helper.make_graph([node], "optimizer", inputs, outputs)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                  helper.make_opsetid(TRAINING, 1)])


def _expanded(node: onnx.NodeProto, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The node's model with the optimizer replaced by standard ops; checked, no training domain."""
    ours = NodeProto.FromString(node.SerializeToString())
    nodes, constants = expand_optimizers([ours], {n: v.dtype for n, v in feeds.items()}, 21)
    model = _single_node_model(node, feeds)
    del model.graph.node[:]
    model.graph.node.extend(onnx.NodeProto.FromString(n.SerializeToString()) for n in nodes)
    model.graph.initializer.extend(onnx.TensorProto.FromString(t.SerializeToString()) for t in constants)
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("", 21))
    assert not any(n.domain for n in model.graph.node)
    onnx.checker.check_model(model, full_check=True)
    return model


def _matching_input(node: onnx.NodeProto, output: str) -> str:
    """The input an output updates (X_new <- X, V_new <- V...): same position past R and T."""
    return node.input[2 + list(node.output).index(output)]


def _backend_cases() -> list[tuple[str, onnx.NodeProto, list[np.ndarray], list[np.ndarray]]]:
    """Every node case of onnx's adam, adagrad and momentum modules: (name, node, inputs, outputs)."""
    found = []

    def expect(node, inputs, outputs, name, **_):
        found.append((name, node, list(inputs), list(outputs)))

    for family, cls in (("adam", "Adam"), ("adagrad", "Adagrad"), ("momentum", "Momentum")):
        module = importlib.import_module(f"onnx.backend.test.case.node.{family}")
        original, module.expect = module.expect, expect
        try:
            kind = getattr(module, cls)
            for attribute in dir(kind):
                if attribute.startswith("export"):
                    getattr(kind, attribute)()
        finally:
            module.expect = original
    return found


BACKEND = _backend_cases()


@pytest.mark.parametrize("case", BACKEND, ids=[case[0] for case in BACKEND])
def test_backend_case_expanded_in_onnxruntime(case):
    _, node, inputs, outputs = case
    feeds = dict(zip(node.input, inputs))
    actual = run_onnxruntime(_expanded(node, feeds), feeds)
    assert_close(actual, [np.asarray(o) for o in outputs], list(node.output))


def test_backend_cases_cover_every_optimizer_and_mode():
    kinds = {(n.op_type, helper.get_attribute_value(a).decode() if a.name == "mode" else "")
             for _, n, _, _ in BACKEND for a in [*n.attribute, helper.make_attribute("x", 0)]
             if a.name in ("mode", "x")}
    assert {("Adam", ""), ("Adagrad", ""), ("Momentum", "standard"), ("Momentum", "nesterov")} <= kinds


def _feeds(op: str, step: int, dtype, count: int = 2, seed: int = 0) -> tuple[list[str], dict[str, np.ndarray]]:
    """R, T and `count` tensors of different shapes with their gradients and state slots."""
    rng = np.random.default_rng(seed)
    shapes = [(3, 4), (5,), (2, 1, 3)][:count]
    slots = {"Adam": ["V", "H"], "Adagrad": ["H"], "Momentum": ["V"]}[op]
    feeds = {"R": np.asarray(0.05, dtype), "T": np.asarray(step, np.int64)}
    for block in ["X", "G", *slots]:
        for i, shape in enumerate(shapes):
            value = rng.standard_normal(shape)
            feeds[f"{block}{i}"] = (np.abs(value) if block == "H" else value).astype(dtype)
    outputs = [f"{block}{i}.new" for block in ["X", *slots] for i in range(len(shapes))]
    return outputs, feeds


SETTINGS = [
    ("Adam", {}),
    ("Adam", {"alpha": 0.8, "beta": 0.95, "epsilon": 1e-3, "norm_coefficient": 0.01, "norm_coefficient_post": 0.02}),
    ("Adagrad", {}),
    ("Adagrad", {"epsilon": 1e-4, "decay_factor": 0.3, "norm_coefficient": 0.05}),
    ("Momentum", {"alpha": 0.9, "beta": 0.5, "norm_coefficient": 0.0, "mode": "standard"}),
    ("Momentum", {"alpha": 0.7, "beta": 0.3, "norm_coefficient": 0.02, "mode": "nesterov"}),
]


@pytest.mark.parametrize("dtype", [np.float32, pytest.param(np.float64, marks=pytest.mark.slow)])
@pytest.mark.parametrize("step", [pytest.param(0, marks=pytest.mark.slow), 1, pytest.param(7, marks=pytest.mark.slow)])
@pytest.mark.parametrize("op, attributes", SETTINGS, ids=[f"{op}-{i}" for i, (op, _) in enumerate(SETTINGS)])
def test_expanded_optimizer_matches_onnxtrain_and_onnx_reference(op, attributes, step, dtype):
    outputs, feeds = _feeds(op, step, dtype, seed=step)
    node = helper.make_node(op, list(feeds), outputs, name=f"my_{op.lower()}", domain=TRAINING, **attributes)
    expanded = _expanded(node, feeds)
    actual = run_onnxruntime(expanded, feeds)
    ours = run_onnxtrain(_single_node_model(node, feeds), feeds)
    reference = ReferenceEvaluator(_single_node_model(node, feeds)).run(None, feeds)
    rtol = 1e-6 if dtype == np.float32 else 1e-12
    assert_close(actual, ours, outputs, rtol=rtol, atol=rtol)
    assert_close(actual, [np.asarray(r, dtype) for r in reference], outputs, rtol=max(rtol, 1e-6), atol=1e-6)
    assert all(a.dtype == dtype for a in actual)
    # The expansion runs in onnxtrain too, with the same values.
    assert_close(run_onnxtrain(expanded, feeds), ours, outputs, rtol=rtol, atol=rtol)


def test_nodes_are_named_after_the_optimizer_and_tensor():
    outputs, feeds = _feeds("Adam", 3, np.float32)
    node = helper.make_node("Adam", list(feeds), outputs, name="adam", domain=TRAINING)
    nodes, _ = expand_optimizers([NodeProto.FromString(node.SerializeToString())],
                                 {n: v.dtype for n, v in feeds.items()}, 21)
    assert not any(is_optimizer(n) for n in nodes)
    assert {n.name for n in nodes} >= {"adam/X0/x_new", "adam/X1/h_new", "adam/R_bias_corrected"}
    assert all(n.name.startswith("adam/") for n in nodes)
    # One shared bias correction, then a fixed number of element-wise nodes per tensor.
    per_tensor = [n for n in nodes if n.name.startswith("adam/X1/")]
    assert len(per_tensor) <= 12


def test_other_nodes_pass_through_unchanged():
    relu = NodeProto.FromString(helper.make_node("Relu", ["a"], ["b"]).SerializeToString())
    nodes, constants = expand_optimizers([relu], {}, 21)
    assert nodes == [relu] and constants == []


@pytest.mark.parametrize("node, match", [
    (helper.make_node("Adam", ["R", "T", "X", "G", "V"], ["X.new", "V.new"], domain=TRAINING, name="bad_adam"),
     r"bad_adam.*4 blocks"),
    (helper.make_node("Momentum", ["R", "T", "X", "G", "V"], ["X.new", "V.new"], domain=TRAINING, name="odd",
                      alpha=0.9, beta=1.0, norm_coefficient=0.0, mode="heavy_ball"), r"odd.*mode.*heavy_ball"),
    (helper.make_node("Adagrad", ["R", "T", "X", "G", "H"], ["X.new"], domain=TRAINING, name="short"),
     r"short.*2 outputs"),
])
def test_malformed_optimizer_raises_export_error_naming_the_node(node, match):
    with pytest.raises(ExportError, match=match):
        expand_optimizers([NodeProto.FromString(node.SerializeToString())], {"X": np.float32}, 21)


def test_unknown_dtype_raises_export_error_naming_the_tensor():
    node = helper.make_node("Adagrad", ["R", "T", "W", "G", "H"], ["W.new", "H.new"], domain=TRAINING, name="ada")
    with pytest.raises(ExportError, match=r"ada.*'W'.*dtype"):
        expand_optimizers([NodeProto.FromString(node.SerializeToString())], {}, 21)


@pytest.mark.parametrize("op", ["Adam", "Adagrad", "Momentum"])
def test_r_and_t_of_shape_one_and_a_scalar_tensor(op):
    outputs, feeds = _feeds(op, 2, np.float32, count=1)
    feeds = {k: (v.reshape(1) if k in ("R", "T") else v.ravel()[:1].reshape(())) for k, v in feeds.items()}
    attributes = {"mode": "standard", "alpha": 0.9, "beta": 0.5, "norm_coefficient": 0.0} if op == "Momentum" else {}
    node = helper.make_node(op, list(feeds), outputs, name="opt", domain=TRAINING, **attributes)
    actual = run_onnxruntime(_expanded(node, feeds), feeds)
    assert all(a.shape == () for a in actual)
    assert_close(actual, run_onnxtrain(_single_node_model(node, feeds), feeds), outputs, rtol=1e-6, atol=1e-6)
