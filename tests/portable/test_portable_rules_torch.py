"""The composite ops' expanded backward, run by stock onnxruntime, against torch autograd: an
oracle that shares no code with onnxtrain's translator (which the other tests compare with)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from support.portable_graphs import assert_close, expanded_model, run_onnxruntime

torch = pytest.importorskip("torch")
F = torch.nn.functional
TRAINING = "ai.onnx.preview.training"


def _graph(nodes, shapes: dict[str, tuple], xs: list[str], ints: tuple[str, ...] = (), outputs=()):
    """Inputs named by `shapes` ('b' = batch); y = sum(out * cotangent); gradients d_<x>."""
    types = {name: TensorProto.INT64 if name in ints else TensorProto.FLOAT for name in shapes}
    inputs = [helper.make_tensor_value_info(n, types[n], list(s)) for n, s in shapes.items()]
    zs = [n for n in shapes if n not in xs]
    nodes = [*nodes, helper.make_node("Mul", ["out", "cotangent"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["y"], keepdims=0),
             helper.make_node("Gradient", [*xs, *zs], [f"d_{x}" for x in xs], domain=TRAINING, xs=xs, zs=zs, y="y")]
    return nodes, inputs, [*(f"d_{x}" for x in xs), *outputs]


def _torch_grads(function, feeds: dict[str, np.ndarray], xs: list[str]):
    tensors = {k: torch.tensor(v, requires_grad=k in xs) for k, v in feeds.items()}
    out = function(tensors)
    extra = ()
    if isinstance(out, tuple):
        out, *extra = out
    (out * tensors["cotangent"]).sum().backward()
    return [tensors[x].grad.numpy() for x in xs] + [np.asarray(e.detach().numpy()) for e in extra]


def _check(nodes, shapes, xs, feeds_of, function, ints=(), outputs=(), ranks=None):
    nodes, inputs, names = _graph(nodes, shapes, xs, ints, outputs)
    ranks = {name: (len(shapes[name[2:]]) if name.startswith("d_") else ranks[name]) for name in names}
    model = expanded_model(nodes, {}, inputs, 21, names, feeds_of(4), ranks)
    for batch in (4, 7):
        feeds = feeds_of(batch)
        assert_close(run_onnxruntime(model, feeds), _torch_grads(function, feeds, xs), names, 2e-5)


def _normal(batch: int, shapes: dict[str, tuple]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch)
    return {n: rng.standard_normal(tuple(batch if d == "b" else d for d in s)).astype(np.float32)
            for n, s in shapes.items()}


def test_softmax_cross_entropy_with_weights_and_ignore_index():
    shapes = {"a": ("b", 5), "labels": ("b",), "w": (5,), "cotangent": ()}

    def feeds(batch):
        values = _normal(batch, shapes)
        values["labels"] = np.random.default_rng(batch).integers(0, 5, batch).astype(np.int64)
        values["labels"][0] = 2  # the ignored class occurs
        values["w"] = np.abs(values["w"]) + 0.5
        return values

    node = helper.make_node("SoftmaxCrossEntropyLoss", ["a", "labels", "w"], ["out"], ignore_index=2)
    _check([node], shapes, ["a"], feeds,
           lambda t: F.cross_entropy(t["a"], t["labels"], weight=t["w"], ignore_index=2), ints=("labels",))


def test_batch_normalization_training_gradients_and_running_statistics():
    shapes = {"a": ("b", 3, 4, 2), "s": (3,), "t": (3,), "rm": (3,), "rv": (3,), "cotangent": ("b", 3, 4, 2)}

    def feeds(batch):
        values = _normal(batch, shapes)
        values["rv"] = np.abs(values["rv"]) + 0.5
        return values

    node = helper.make_node("BatchNormalization", ["a", "s", "t", "rm", "rv"], ["out", "new_mean", "new_var"],
                            training_mode=1, momentum=0.8, epsilon=1e-3)

    def torch_bn(t):
        mean, var = t["rm"].detach().clone(), t["rv"].detach().clone()
        out = F.batch_norm(t["a"], mean, var, t["s"], t["t"], training=True, momentum=0.2, eps=1e-3)
        # torch updates the running variance with the unbiased batch variance; the ONNX spec
        # (and so the decomposition) uses the population one.
        batch_var = t["a"].detach().var(dim=(0, 2, 3), unbiased=False)
        return out, mean, t["rv"].detach() * 0.8 + batch_var * 0.2

    _check([node], shapes, ["a", "s", "t"], feeds, torch_bn, outputs=("new_mean", "new_var"),
           ranks={"new_mean": 1, "new_var": 1})


def test_layer_normalization_and_gelu_tanh():
    shapes = {"a": ("b", 3, 6), "s": (6,), "t": (6,), "cotangent": ("b", 3, 6)}
    nodes = [helper.make_node("LayerNormalization", ["a", "s", "t"], ["n"], epsilon=1e-4),
             helper.make_node("Gelu", ["n"], ["out"], approximate="tanh")]
    _check(nodes, shapes, ["a", "s", "t"], lambda b: _normal(b, shapes),
           lambda t: F.gelu(F.layer_norm(t["a"], (6,), t["s"], t["t"], eps=1e-4), approximate="tanh"))


def test_grouped_strided_dilated_conv_then_overlapping_max_pool():
    shapes = {"a": ("b", 4, 9, 8), "k": (6, 2, 3, 2), "kb": (6,), "cotangent": ("b", 6, 3, 3)}
    nodes = [helper.make_node("Conv", ["a", "k", "kb"], ["c"], group=2, strides=[2, 1], dilations=[1, 2],
                              pads=[1, 0, 0, 1]),
             helper.make_node("MaxPool", ["c"], ["out"], kernel_shape=[2, 3], strides=[1, 2])]

    def torch_conv_pool(t):
        padded = F.pad(t["a"], (0, 1, 1, 0))  # torch pads (left, right, top, bottom)
        conv = F.conv2d(padded, t["k"], t["kb"], stride=(2, 1), dilation=(1, 2), groups=2)
        return F.max_pool2d(conv, (2, 3), stride=(1, 2))

    _check(nodes, shapes, ["a", "k", "kb"], lambda b: _normal(b, shapes), torch_conv_pool)


def test_average_pool_with_padding_excluded_from_the_count():
    shapes = {"a": ("b", 2, 5, 6), "cotangent": ("b", 2, 3, 3)}
    node = helper.make_node("AveragePool", ["a"], ["out"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    _check([node], shapes, ["a"], lambda b: _normal(b, shapes),
           lambda t: F.avg_pool2d(t["a"], 3, stride=2, padding=1, count_include_pad=False))
