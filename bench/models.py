"""The benchmark models, as ONNX and as hand-written JAX (inference, and training with
cross-entropy + Adam): the MLP and CNN of shared/docs/performance-anchors.md, a small
transformer encoder, ResNet-18 (ONNX only: bench/run.py times its compilation) and a
MobileNetV2-style network of depthwise convolutions (bench/training_step.py).

Both versions share the same weights so their outputs can be checked equal
before anything is timed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnx.version_converter
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


TRANSFORMER = {"seq": 32, "d": 64, "heads": 2, "ffn": 128}


def transformer_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """One post-LN encoder block (d 64, 2 heads, FFN 128) and a Linear(64->10) head."""
    rng = np.random.default_rng(seed)

    def dense(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * np.sqrt(1 / rows)).astype(np.float32)

    d, ffn = TRANSFORMER["d"], TRANSFORMER["ffn"]
    return {**{f"W{p}": dense(d, d) for p in "qkvo"}, **{f"b{p}": np.zeros(d, np.float32) for p in "qkvo"},
            "ln1_g": np.ones(d, np.float32), "ln1_b": np.zeros(d, np.float32),
            "W1": dense(d, ffn), "b1": np.zeros(ffn, np.float32),
            "W2": dense(ffn, d), "b2": np.zeros(d, np.float32),
            "ln2_g": np.ones(d, np.float32), "ln2_b": np.zeros(d, np.float32),
            "Wc": dense(d, 10), "bc": np.zeros(10, np.float32)}



def _constant(name: str, value: np.ndarray) -> onnx.NodeProto:
    """A Constant node: non-trainable values stay out of the initializers (= the weights)."""
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))


def transformer_onnx(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """x[batch, 32, 64] -> self-attention (2 heads) -> Add & LayerNorm -> FFN (ReLU) -> Add &
    LayerNorm -> mean over the sequence -> Linear(64->10).

    The LayerNormalizations also name their optional Mean and InvStdDev outputs: ONNX Runtime
    training's gradient builder for LayerNormalization reads them."""
    seq, d, heads = TRANSFORMER["seq"], TRANSFORMER["d"], TRANSFORMER["heads"]
    split = [0, 0, heads, d // heads]
    node = helper.make_node
    nodes = [_constant("split", np.array(split, np.int64)), _constant("merge", np.array([0, 0, d], np.int64)),
             _constant("scale", np.array(1 / np.sqrt(d // heads), np.float32))]
    for p, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        nodes += [node("MatMul", ["x", f"W{p}"], [f"{p}0"]), node("Add", [f"{p}0", f"b{p}"], [f"{p}1"]),
                  node("Reshape", [f"{p}1", "split"], [f"{p}2"]),
                  node("Transpose", [f"{p}2"], [p], perm=perm)]
    nodes += [
        node("MatMul", ["q", "k"], ["s0"]), node("Mul", ["s0", "scale"], ["s"]),
        node("Softmax", ["s"], ["attention"], axis=-1), node("MatMul", ["attention", "v"], ["c0"]),
        node("Transpose", ["c0"], ["c1"], perm=[0, 2, 1, 3]), node("Reshape", ["c1", "merge"], ["c"]),
        node("MatMul", ["c", "Wo"], ["o0"]), node("Add", ["o0", "bo"], ["o"]),
        node("Add", ["x", "o"], ["r1"]),
        node("LayerNormalization", ["r1", "ln1_g", "ln1_b"], ["h1", "mean1", "inv_std1"], axis=-1, epsilon=1e-5),
        node("MatMul", ["h1", "W1"], ["f0"]), node("Add", ["f0", "b1"], ["f1"]), node("Relu", ["f1"], ["f2"]),
        node("MatMul", ["f2", "W2"], ["f3"]), node("Add", ["f3", "b2"], ["f"]),
        node("Add", ["h1", "f"], ["r2"]),
        node("LayerNormalization", ["r2", "ln2_g", "ln2_b"], ["h2", "mean2", "inv_std2"], axis=-1, epsilon=1e-5),
        _constant("seq_axis", np.array([1], np.int64)),
        node("ReduceMean", ["h2", "seq_axis"], ["pooled"], keepdims=0),
        node("MatMul", ["pooled", "Wc"], ["l0"]), node("Add", ["l0", "bc"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes, "transformer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", seq, d])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    variance = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(variance + 1e-5) * scale + bias


def transformer_jax(params: dict, x: jax.Array) -> jax.Array:
    heads = TRANSFORMER["heads"]
    batch, seq, d = x.shape

    def split(p: str) -> jax.Array:
        return (x @ params[f"W{p}"] + params[f"b{p}"]).reshape(batch, seq, heads, d // heads).transpose(0, 2, 1, 3)

    q, k, v = split("q"), split("k"), split("v")
    attention = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // heads), axis=-1)
    context = (attention @ v).transpose(0, 2, 1, 3).reshape(batch, seq, d)
    h1 = _layer_norm(x + context @ params["Wo"] + params["bo"], params["ln1_g"], params["ln1_b"])
    ffn = jnp.maximum(h1 @ params["W1"] + params["b1"], 0) @ params["W2"] + params["b2"]
    h2 = _layer_norm(h1 + ffn, params["ln2_g"], params["ln2_b"])
    return h2.mean(1) @ params["Wc"] + params["bc"]


RESNET18_INPUT = (3, 112, 112)  # with batch 8: ResNet-18's graph at a quarter of the pixels


# The hand-written JAX forward pass of each timed model, by name.
JAX_FORWARD = {"mlp": mlp_jax, "cnn": cnn_jax, "transformer": transformer_jax}


def _conv_bn_weights(weights: dict[str, np.ndarray], rng: np.random.Generator, name: str, out: int,
                     per_group: int, k: int) -> None:
    """A convolution's He-initialized (out, per_group, k, k) kernel and its BatchNorm's
    scale (ones) and bias (zeros), added to `weights`."""
    weights[name] = (rng.standard_normal((out, per_group, k, k)) * np.sqrt(2 / (per_group * k * k))).astype(np.float32)
    weights[f"{name}_g"], weights[f"{name}_b"] = np.ones(out, np.float32), np.zeros(out, np.float32)


_BN_EPSILON = 1e-5  # BatchNormalization's default, which _conv_bn_nodes leaves in place


def _conv_bn_jax(params: dict, h: jax.Array, name: str, stride: int, groups: int = 1) -> jax.Array:
    """_conv_bn_nodes by hand: a lax convolution, then BatchNorm with zero mean, unit variance."""
    k = params[name].shape[-1]
    h = jax.lax.conv_general_dilated(h, params[name], (stride, stride), [(k // 2, k // 2)] * 2,
                                     feature_group_count=groups)
    scale = params[f"{name}_g"] / np.float32(np.sqrt(1 + _BN_EPSILON))
    return h * scale[None, :, None, None] + params[f"{name}_b"][None, :, None, None]


def _classifier_head_jax(params: dict, features: jax.Array) -> jax.Array:
    """_image_classifier's head by hand: global average pool, then the 10-class Gemm."""
    return jnp.mean(features, axis=(2, 3)) @ params["fc_W"] + params["fc_b"]


def _conv_bn_nodes(nodes: list[onnx.NodeProto], x: str, name: str, weights: dict[str, np.ndarray],
                   stride: int, group: int = 1) -> str:
    """Conv `name` (padded to keep the size at stride 1) then inference BatchNorm with zero
    mean and unit variance as Constants, appended to `nodes`; the BatchNorm's output."""
    k, channels = weights[name].shape[-1], weights[name].shape[0]
    grouping = {"group": group} if group != 1 else {}
    nodes.extend([
        helper.make_node("Conv", [x, name], [f"{name}_conv"], kernel_shape=[k, k], strides=[stride] * 2,
                         pads=[k // 2] * 4, **grouping),
        _constant(f"{name}_mean", np.zeros(channels, np.float32)),
        _constant(f"{name}_var", np.ones(channels, np.float32)),
        helper.make_node("BatchNormalization", [f"{name}_conv", f"{name}_g", f"{name}_b", f"{name}_mean",
                                                f"{name}_var"], [f"{name}_bn"])])
    return f"{name}_bn"


def resnet18_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """ResNet-18's 11.2 M trainable parameters (convolutions, BatchNorm scale/bias, the head)."""
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    _conv_bn_weights(weights, rng, "stem", 64, 3, 7)
    for name, inp, out, stride in _resnet18_blocks():
        _conv_bn_weights(weights, rng, f"{name}_a", out, inp, 3)
        _conv_bn_weights(weights, rng, f"{name}_b", out, out, 3)
        if stride != 1 or inp != out:
            _conv_bn_weights(weights, rng, f"{name}_down", out, inp, 1)
    weights["fc_W"] = (rng.standard_normal((512, 10)) * np.sqrt(1 / 512)).astype(np.float32)
    weights["fc_b"] = np.zeros(10, np.float32)
    return weights


def _resnet18_blocks() -> list[tuple[str, int, int, int]]:
    """(name, in channels, out channels, stride) of the 4 stages x 2 basic blocks."""
    blocks, inp = [], 64
    for stage, out in enumerate((64, 128, 256, 512)):
        for index in range(2):
            stride = 2 if stage > 0 and index == 0 else 1
            blocks.append((f"s{stage}b{index}", inp, out, stride))
            inp = out
    return blocks


def _image_classifier(name: str, nodes: list[onnx.NodeProto], features: str, input_shape: tuple[int, ...],
                      weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The model of `nodes` (input x [batch, *input_shape]) with a head on `features`:
    global average pool, Gemm to 10 logits."""
    nodes = [*nodes, helper.make_node("GlobalAveragePool", [features], ["gap"]),
             helper.make_node("Flatten", ["gap"], ["flat"], axis=1),
             helper.make_node("Gemm", ["flat", "fc_W", "fc_b"], ["logits"])]
    graph = helper.make_graph(
        nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *input_shape])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def resnet18_onnx(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """conv 7x7/2 + BN + ReLU + maxpool 3x3/2, 4 stages x 2 basic blocks (64/128/256/512),
    global average pool, Gemm. BatchNorm in inference form, running statistics as Constants."""
    nodes: list[onnx.NodeProto] = []

    def conv_bn(x: str, name: str, stride: int, relu: bool) -> str:
        normalized = _conv_bn_nodes(nodes, x, name, weights, stride)
        if not relu:
            return normalized
        nodes.append(helper.make_node("Relu", [normalized], [f"{name}_out"]))
        return f"{name}_out"

    h = conv_bn("x", "stem", 2, relu=True)
    nodes.append(helper.make_node("MaxPool", [h], ["pool"], kernel_shape=[3, 3], strides=[2, 2],
                                  pads=[1, 1, 1, 1]))
    h = "pool"
    for name, _, _, stride in _resnet18_blocks():
        branch = conv_bn(conv_bn(h, f"{name}_a", stride, relu=True), f"{name}_b", 1, relu=False)
        shortcut = conv_bn(h, f"{name}_down", stride, relu=False) if f"{name}_down" in weights else h
        nodes += [helper.make_node("Add", [branch, shortcut], [f"{name}_sum"]),
                  helper.make_node("Relu", [f"{name}_sum"], [f"{name}_out"])]
        h = f"{name}_out"
    return _image_classifier("resnet18", nodes, h, RESNET18_INPUT, weights)


def resnet18_jax(params: dict, x: jax.Array) -> jax.Array:
    """resnet18_onnx by hand, as one writes it in JAX: lax convolutions (NCHW), max pooling
    with lax.reduce_window."""
    def conv_bn(h: jax.Array, name: str, stride: int, relu: bool) -> jax.Array:
        h = _conv_bn_jax(params, h, name, stride)
        return jax.nn.relu(h) if relu else h

    h = conv_bn(x, "stem", 2, relu=True)
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 1, 3, 3), (1, 1, 2, 2), ((0, 0), (0, 0), (1, 1), (1, 1)))
    for name, _, _, stride in _resnet18_blocks():
        branch = conv_bn(conv_bn(h, f"{name}_a", stride, relu=True), f"{name}_b", 1, relu=False)
        shortcut = conv_bn(h, f"{name}_down", stride, relu=False) if f"{name}_down" in params else h
        h = jax.nn.relu(branch + shortcut)
    return _classifier_head_jax(params, h)


MOBILENET_INPUT = (3, 112, 112)
# MobileNetV2's inverted residual stages, cut after 96 channels: (expansion, out channels,
# blocks, first stride). Every block's middle convolution is a 3x3 depthwise one.
_MOBILENET_STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 2, 2), (6, 96, 1, 1))


def _mobilenet_layers() -> list[tuple[str, int, int, int, int, bool]]:
    """(name, in channels, out channels, kernel, stride, depthwise) of every convolution, each
    followed by inference BatchNorm; a block is its layers named <block>_expand, _dw, _project."""
    layers, inp = [("stem", 3, 32, 3, 2, False)], 32
    for stage, (expansion, out, blocks, stride) in enumerate(_MOBILENET_STAGES):
        for index in range(blocks):
            name, hidden = f"s{stage}b{index}", inp * expansion
            if expansion != 1:
                layers.append((f"{name}_expand", inp, hidden, 1, 1, False))
            layers += [(f"{name}_dw", hidden, hidden, 3, stride if index == 0 else 1, True),
                       (f"{name}_project", hidden, out, 1, 1, False)]
            inp = out
    return layers


def mobilenet_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """The MobileNetV2-style model's weights: convolutions (depthwise ones (C, 1, 3, 3)),
    BatchNorm scale/bias, the 10-class head."""
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name, inp, out, k, _, depthwise in _mobilenet_layers():
        _conv_bn_weights(weights, rng, name, out, 1 if depthwise else inp, k)
    weights["fc_W"] = (rng.standard_normal((96, 10)) * np.sqrt(1 / 96)).astype(np.float32)
    weights["fc_b"] = np.zeros(10, np.float32)
    return weights


def _mobilenet_blocks() -> list[tuple[str, list[tuple[str, int, int, int, int, bool]]]]:
    """The stem and each inverted residual block with its layers, in order."""
    blocks: dict[str, list] = {}
    for layer in _mobilenet_layers():
        blocks.setdefault(layer[0].split("_")[0], []).append(layer)
    return list(blocks.items())


def _is_residual(block: str, layers: list[tuple[str, int, int, int, int, bool]]) -> bool:
    """Whether a block adds its input to its output: it keeps channels and resolution."""
    return block != "stem" and layers[0][1] == layers[-1][2] and all(layer[4] == 1 for layer in layers)


def mobilenet_onnx(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """Conv + BatchNorm + ReLU6 (Clip 0..6) layers, the projection without ReLU6, a residual
    Add where a block keeps its shape; global average pool, Gemm."""
    nodes: list[onnx.NodeProto] = [_constant("zero", np.array(0, np.float32)),
                                   _constant("six", np.array(6, np.float32))]

    h = "x"
    for block, layers in _mobilenet_blocks():
        start = h
        for name, _, out, _, stride, depthwise in layers:
            h = _conv_bn_nodes(nodes, h, name, weights, stride, group=out if depthwise else 1)
            if not name.endswith("_project"):
                nodes.append(helper.make_node("Clip", [h, "zero", "six"], [f"{name}_out"]))
                h = f"{name}_out"
        if _is_residual(block, layers):
            nodes.append(helper.make_node("Add", [h, start], [f"{block}_sum"]))
            h = f"{block}_sum"
    return _image_classifier("mobilenet", nodes, h, MOBILENET_INPUT, weights)


def mobilenet_jax(params: dict, x: jax.Array) -> jax.Array:
    """mobilenet_onnx by hand, the depthwise convolutions as lax's grouped convolution."""
    def layer(h: jax.Array, name: str, stride: int, depthwise: bool, relu6: bool) -> jax.Array:
        h = _conv_bn_jax(params, h, name, stride, h.shape[1] if depthwise else 1)
        return jnp.clip(h, 0, 6) if relu6 else h

    h = x
    for block, layers in _mobilenet_blocks():
        start = h
        for name, _, _, _, stride, depthwise in layers:
            h = layer(h, name, stride, depthwise, relu6=not name.endswith("_project"))
        if _is_residual(block, layers):
            h = h + start
    return _classifier_head_jax(params, h)


def for_onnxruntime_training(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` at opset 17 and IR version 9, which onnx 1.17 and onnxruntime-training 1.19 accept."""
    converted = onnx.version_converter.convert_version(model, 17)
    converted.ir_version = 9
    return converted


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


def _adam_step(forward):
    """The training step of training_onnx by hand: jax.value_and_grad and the spec's Adam
    (norm coefficients 0). step(state, x, labels) -> (state, loss).

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

    return step


def train_step_jax(forward):
    """One jax.jit of _adam_step, state donated: step(state, x, labels) -> (state, loss)."""
    return jax.jit(_adam_step(forward), donate_argnums=0)


def train_step_jax_guarded(forward):
    """train_step_jax with the guarantee onnxtrain's default step gives, written by hand: the
    new state and the loss are checked for NaN/Inf in the same program, and a faulty step
    returns the old state. step(state, x, labels) -> (state, loss, finite)."""
    step = _adam_step(forward)

    def guarded(state, x, labels):
        new, loss = step(state, x, labels)
        checked = [leaf for leaf in jax.tree.leaves((new, loss)) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in checked]))
        return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state), loss, finite

    return jax.jit(guarded, donate_argnums=0)


def train_steps_jax(forward):
    """K steps per compiled call, the way one writes it by hand: jax.jit of a lax.scan of
    _adam_step over a stack of K batches, state donated.
    steps(state, xs[K, ...], labels[K, ...]) -> (state, losses[K])."""
    step = _adam_step(forward)

    def steps(state, xs, labels):
        return jax.lax.scan(lambda carry, batch: step(carry, *batch), state, (xs, labels))

    return jax.jit(steps, donate_argnums=0)
