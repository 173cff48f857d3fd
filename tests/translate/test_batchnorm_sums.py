"""Training-mode BatchNormalization takes its sums in one pass over large batches.

A training-mode BatchNorm sums per channel over the batch and spatial positions twice
forward (for the mean and the variance) and twice backward (the output's gradient, and that
gradient times the normalized input). From ONE_PASS_POSITIONS positions per channel each pair
is one reduction with two results: one pass, and not XLA:CPU's library reductions, which read
transposed copies. The forward pair sums x and x * x shifted by one sample per channel, so a
large mean does not cancel the variance away. Below the threshold: two reductions each
(bench/RESULTS.md, "BatchNorm's sums in one pass").

Oracles: torch autograd of torch.nn.functional.batch_norm in training mode, on both sides of
the threshold, and numpy's float64 statistics of data with a large mean; the jaxpr of the
gradient shows which way the sums were taken.
"""

from __future__ import annotations

import jax
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.translate.ops.normalization import ONE_PASS_POSITIONS
from support.op_testing import jaxpr_equations, translate

EPSILON, MOMENTUM = 1e-5, 0.9


def _batch_norm(channels: int) -> onnx.ModelProto:
    rng = np.random.default_rng(channels)
    statistics = {"scale": rng.uniform(0.5, 1.5, channels), "bias": rng.normal(size=channels),
                  "mean": np.zeros(channels), "var": np.ones(channels)}
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"],
                            ["y", "running_mean", "running_var"], epsilon=EPSILON, momentum=MOMENTUM,
                            training_mode=1)
    graph = helper.make_graph(
        [node], "bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in node.output],
        [numpy_helper.from_array(value.astype(np.float32), name) for name, value in statistics.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])


def _gradients(shape: tuple[int, ...]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list[str]]:
    """(onnxtrain's gradients of sum(y * r), torch's, the primitives of onnxtrain's gradient)."""
    rng = np.random.default_rng(1)
    x = rng.normal(2.0, 3.0, size=shape).astype(np.float32)
    r = rng.normal(size=shape).astype(np.float32)
    model = translate(_batch_norm(shape[1]))
    params = {name: model.params[name] for name in ("scale", "bias")}

    def loss(x, params):
        return (model({**model.params, **params}, {"x": x})["y"] * r).sum()

    gradient = jax.grad(loss, argnums=(0, 1))
    with jax.enable_x64(True):
        d_x, d_params = gradient(x, params)
        primitives = [e.primitive.name for e in jaxpr_equations(jax.make_jaxpr(gradient)(x, params).jaxpr)]
    ours = {"x": np.asarray(d_x), **{name: np.asarray(value) for name, value in d_params.items()}}

    tx = torch.tensor(x, requires_grad=True)
    scale = torch.tensor(np.asarray(params["scale"]), requires_grad=True)
    bias = torch.tensor(np.asarray(params["bias"]), requires_grad=True)
    y = torch.nn.functional.batch_norm(tx, torch.zeros(shape[1]), torch.ones(shape[1]), scale, bias,
                                       training=True, momentum=1 - MOMENTUM, eps=EPSILON)
    (y * torch.tensor(r)).sum().backward()
    theirs = {"x": tx.grad.numpy(), "scale": scale.grad.numpy(), "bias": bias.grad.numpy()}
    return ours, theirs, primitives


@pytest.mark.parametrize("shape, one_pass", [((4, 8, 6, 6), True), ((4, 16, 2, 2), False), ((64, 3), True)])
def test_batchnorm_gradients_match_torch_on_both_sides_of_the_threshold(shape, one_pass):
    positions = shape[0] * int(np.prod(shape[2:]))
    assert (positions >= ONE_PASS_POSITIONS) == one_pass
    ours, theirs, primitives = _gradients(shape)
    for name in theirs:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=2e-5, atol=2e-5, err_msg=name)
    # One reduction with two results (the generic `reduce`) exactly when the sums take one pass.
    assert ("reduce" in primitives) == one_pass


def test_one_pass_statistics_keep_the_variance_of_data_with_a_large_mean():
    rng = np.random.default_rng(2)
    x = (1e4 + rng.normal(size=(8, 4, 5, 5)) * np.array([1e-3, 1, 10, 100])[:, None, None]).astype(np.float32)
    model = translate(_batch_norm(4))
    with jax.enable_x64(True):
        outputs = model(model.params, {"x": x})
    mean, var = x.astype(np.float64).mean(axis=(0, 2, 3)), x.astype(np.float64).var(axis=(0, 2, 3))
    np.testing.assert_allclose(np.asarray(outputs["running_mean"]), (1 - MOMENTUM) * mean, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(outputs["running_var"]), MOMENTUM + (1 - MOMENTUM) * var, rtol=1e-5)
    scale, bias = (np.asarray(model.params[name])[None, :, None, None] for name in ("scale", "bias"))
    # y subtracts the mean as float32 holds it, as torch's does: near 1e4 that rounds by up to 5e-4.
    centered = x - mean.astype(np.float32)[None, :, None, None]
    expected = centered / np.sqrt(var[None, :, None, None] + EPSILON) * scale + bias
    np.testing.assert_allclose(np.asarray(outputs["y"]), expected, rtol=1e-4, atol=1e-4)
