"""Gradient written in domain ai.onnx.preview (as pytorch-pfn-extras's ppe.onnx.grad emits it)
is read as ai.onnx.preview.training::Gradient, with one log line.

Oracles: torch autograd for a real pytorch-pfn-extras export; for hand-built models, the same
model in the right domain and the hand-derived gradient.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.translate import registry

PREVIEW = "ai.onnx.preview"
RNG = np.random.default_rng(0)


def _in_domain(model: onnx.ModelProto, domain: str) -> onnx.ModelProto:
    """A copy of `model` with every Gradient node moved to `domain` (imported at version 1)."""
    moved = onnx.ModelProto.FromString(model.SerializeToString())
    graphs = [moved.graph, *(info.algorithm for info in moved.training_info)]
    for graph in graphs:
        for item in graph.node:
            if item.op_type == "Gradient":
                item.domain = domain
    if domain not in {o.domain for o in moved.opset_import}:
        moved.opset_import.append(helper.make_opsetid(domain, 1))
    return moved


def _sum_of_squares_gradient() -> onnx.ModelProto:
    """y = sum((x·w)²) and its Gradient with respect to x: 2·(x·w)·w, by hand."""
    nodes = [helper.make_node("Mul", ["x", "w"], ["h"]), helper.make_node("Mul", ["h", "h"], ["s"]),
             helper.make_node("ReduceSum", ["s"], ["y"], keepdims=0),
             helper.make_node("Gradient", ["x"], ["dx"], domain=PREVIEW, xs=["x"], y="y")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("dx", TensorProto.FLOAT, [3])],
                              [numpy_helper.from_array(np.array([0.5, -2.0, 3.0], np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(PREVIEW, 1)],
                             ir_version=9)


def test_hand_built_preview_gradient_matches_the_training_domain_and_the_hand_gradient(caplog):
    registry._log_alias.cache_clear()
    model = _sum_of_squares_gradient()
    x = np.array([1.0, 2.0, -1.5], np.float32)
    with caplog.at_level(logging.INFO, logger="onnxtrain"):
        preview = onnxtrain.run(model, {"x": x})
    right = onnxtrain.run(_in_domain(model, registry.TRAINING_DOMAIN), {"x": x})
    w = np.array([0.5, -2.0, 3.0], np.float32)
    np.testing.assert_allclose(preview["dx"], 2 * (x * w) * w, rtol=1e-6)
    np.testing.assert_array_equal(preview["dx"], right["dx"])
    lines = [r.getMessage() for r in caplog.records if "ai.onnx.preview.training" in r.getMessage()]
    assert len(lines) == 1 and "pytorch-pfn-extras" in lines[0]


def test_other_ops_of_the_preview_domain_are_not_aliased():
    assert registry.resolve(PREVIEW, "Adam", 1) is None
    assert registry.resolve(PREVIEW, "Gradient", 1) is registry.resolve(registry.TRAINING_DOMAIN, "Gradient", 1)


def test_training_model_with_a_preview_gradient_trains_as_the_standard_one():
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "linear",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
                              [numpy_helper.from_array(RNG.normal(size=(3, 2)).astype(np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    standard = onnxtrain.make_training_model(model, "mse", optimizer=onnxtrain.optim.SGD(lr=0.1))
    feeds = {"x": RNG.normal(size=(4, 3)).astype(np.float32), "labels": RNG.normal(size=(4, 2)).astype(np.float32)}
    trainers = [onnxtrain.Trainer(standard), onnxtrain.Trainer(_in_domain(standard, PREVIEW))]
    losses = [[float(t.step(feeds)["loss"]) for _ in range(3)] for t in trainers]
    assert losses[0] == losses[1]
    np.testing.assert_array_equal(trainers[0].state["W"], trainers[1].state["W"])


@pytest.mark.slow
def test_pytorch_pfn_extras_export_runs_and_matches_torch_autograd(tmp_path):
    torch = pytest.importorskip("torch")
    ppe_onnx = pytest.importorskip("pytorch_pfn_extras.onnx")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 2, 3)

        def forward(self, x):
            x.requires_grad_(True)
            y = torch.tanh(self.conv(x)).pow(2).sum()
            (dx,) = ppe_onnx.grad(y, (x,), retain_graph=True, create_graph=True)
            return y, dx

    torch.manual_seed(0)
    net, x = Net(), torch.randn(1, 1, 6, 6)
    path = tmp_path / "grad.onnx"
    ppe_onnx.export(net, (x.clone(),), str(path), input_names=["x"], output_names=["y", "dx"], opset_version=13,
                    do_constant_folding=False)
    model = onnxtrain.load_model(path)
    assert [(n.domain, n.op_type) for n in model.graph.node if n.op_type == "Gradient"] == [(PREVIEW, "Gradient")]
    out = onnxtrain.run(model, {"x": x.numpy()})
    leaf = x.clone().requires_grad_(True)
    expected = torch.tanh(net.conv(leaf)).pow(2).sum()
    (gradient,) = torch.autograd.grad(expected, (leaf,))
    np.testing.assert_allclose(out["y"], expected.item(), rtol=1e-5)
    np.testing.assert_allclose(out["dx"], gradient.numpy(), rtol=1e-5, atol=1e-6)
