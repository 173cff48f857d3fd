"""Composite ops rewritten into the primitives whose backward rules.py knows.

Each decomposition writes the node's outputs under their own names, so nodes
that read them (the optimizer, bindings, later layers) see the same tensors.
Only nodes on a differentiated path are rewritten; the rest of the graph stays
as it was exported.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from onnxtrain._portable.emitter import Emitter, attr, label
from onnxtrain.errors import ExportError
from onnxtrain.proto import NodeProto
from onnxtrain.translate.tensors import numpy_to_tensor

Decomposition = Callable[[Emitter, NodeProto], list[NodeProto] | None]
DECOMPOSITIONS: dict[str, Decomposition] = {}


def decomposition(*op_types: str) -> Callable[[Decomposition], Decomposition]:
    """Register the decorated function as the rewrite of `op_types`. It returns the nodes
    replacing the node (None: keep the node as it is)."""
    def register(function: Decomposition) -> Decomposition:
        for op_type in op_types:
            DECOMPOSITIONS[op_type] = function
        return function
    return register


def decompose(e: Emitter, proto: NodeProto) -> list[NodeProto]:
    """The nodes computing `proto`'s outputs from primitives (the node itself if it is one)."""
    rewrite = DECOMPOSITIONS.get(proto.op_type) if proto.domain in ("", "ai.onnx") else None
    if rewrite is None:
        return [proto]
    e.scope = proto.name or proto.output[0]
    replaced = rewrite(e, proto)
    return [proto] if replaced is None else replaced


def _present(proto: NodeProto, index: int) -> str | None:
    return proto.output[index] if len(proto.output) > index and proto.output[index] else None


def _input(proto: NodeProto, index: int) -> str | None:
    return proto.input[index] if len(proto.input) > index and proto.input[index] else None


@decomposition("Gemm")
def _gemm(e: Emitter, proto: NodeProto) -> list[NodeProto]:
    """alpha * A' @ B' + beta * C, with A' and B' transposed as transA/transB say."""
    a, b, c = proto.input[0], proto.input[1], _input(proto, 2)
    if attr(proto, "transA", 0):
        a = e.add("Transpose", [a], "A_T", perm=[1, 0])
    if attr(proto, "transB", 0):
        b = e.add("Transpose", [b], "B_T", perm=[1, 0])
    alpha, beta = attr(proto, "alpha", 1.0), attr(proto, "beta", 1.0)
    y = proto.output[0]
    product = e.add("MatMul", [a, b], "MatMul")
    if alpha != 1.0:
        product = e.add("Mul", [product, e.scalar(alpha, proto.input[0])], "alpha_AB")
    if c is None:
        e.emit("Identity", [product], [y], f"{e.scope}/out")
        return e.take()
    if beta != 1.0:
        c = e.add("Mul", [c, e.scalar(beta, proto.input[0])], "beta_C")
    e.emit("Add", [product, c], [y], f"{e.scope}/Add")
    return e.take()


def _mean_and_inverse_deviation(e: Emitter, x: str, axes: list[int], epsilon: float) -> tuple[str, str, str, str]:
    """(mean, x - mean, var, 1 / sqrt(var + epsilon)) over `axes`, kept as size-1 axes; the variance
    is the population one, as BatchNormalization's and LayerNormalization's specs define it."""
    mean = e.reduce("ReduceMean", x, axes, True, "batch_mean")
    centered = e.add("Sub", [x, mean], "centered")
    variance = e.reduce("ReduceMean", e.add("Mul", [centered, centered], "squared"), axes, True, "batch_var")
    deviation = e.add("Sqrt", [e.add("Add", [variance, e.scalar(epsilon, x)], "var_eps")], "std")
    return mean, centered, variance, e.add("Reciprocal", [deviation], "inv_std")


@decomposition("BatchNormalization")
def _batch_norm(e: Emitter, proto: NodeProto) -> list[NodeProto]:
    """Training mode: batch statistics over every axis but the channel (1), the running
    statistics as the spec's momentum formula; inference mode: the given statistics."""
    if attr(proto, "is_test") is not None or attr(proto, "spatial") is not None:
        raise ExportError(f"portable export: {label(proto)} uses BatchNormalization before opset 9 "
                          "(is_test/spatial); convert the model to opset 15 or later")
    x, scale, bias, mean, var = proto.input[:5]
    rank = e.rank(x)
    channel_axes = [0, *range(2, rank)]
    epsilon = attr(proto, "epsilon", 1e-5)

    def per_channel(v: str, hint: str) -> str:
        v = v if e.dtype(v) == e.dtype(x) else e.cast_like(v, x, f"{hint}_cast")
        return e.unsqueeze(v, channel_axes, hint)

    y = proto.output[0]
    if attr(proto, "training_mode", 0):
        batch_mean, centered, batch_var, inverse = _mean_and_inverse_deviation(e, x, channel_axes, epsilon)
        normalized = e.add("Mul", [centered, inverse], "normalized")
        scaled = e.add("Mul", [normalized, per_channel(scale, "scale")], "scaled")
        e.emit("Add", [scaled, per_channel(bias, "bias")], [y], f"{e.scope}/Y")
        momentum = attr(proto, "momentum", 0.9)
        for index, given, hint in ((1, mean, "batch_mean"), (2, var, "batch_var")):
            output = _present(proto, index)
            if output is None:
                continue
            batch = e.squeeze(batch_mean if index == 1 else batch_var, channel_axes, f"{hint}_per_channel")
            if e.dtype(given) != e.dtype(x):
                batch = e.cast_like(batch, given, f"{hint}_cast")
            kept = e.add("Mul", [given, e.scalar(momentum, given)], f"running_{hint[6:]}_kept")
            added = e.add("Mul", [batch, e.scalar(1 - momentum, given)], f"running_{hint[6:]}_added")
            e.emit("Add", [kept, added], [output], f"{e.scope}/running_{hint[6:]}")
        return e.take()
    deviation = e.add("Sqrt", [e.add("Add", [per_channel(var, "var"), e.scalar(epsilon, x)], "var_eps")], "std")
    centered = e.add("Sub", [x, per_channel(mean, "mean")], "centered")
    normalized = e.add("Div", [centered, deviation], "normalized")
    scaled = e.add("Mul", [normalized, per_channel(scale, "scale")], "scaled")
    e.emit("Add", [scaled, per_channel(bias, "bias")], [y], f"{e.scope}/Y")
    return e.take()


@decomposition("LayerNormalization")
def _layer_norm(e: Emitter, proto: NodeProto) -> list[NodeProto]:
    """(x - mean) / sqrt(var + epsilon) * scale + bias over the axes from `axis` on; Mean and
    InvStdDev outputs when the node has them."""
    x, scale, bias = proto.input[0], proto.input[1], _input(proto, 2)
    rank = e.rank(x)
    axes = list(range(attr(proto, "axis", -1) % rank, rank))
    mean, centered, _, inverse = _mean_and_inverse_deviation(e, x, axes, attr(proto, "epsilon", 1e-5))
    scaled = e.add("Mul", [e.add("Mul", [centered, inverse], "normalized"), scale], "scaled")
    if bias is None:
        e.emit("Identity", [scaled], [proto.output[0]], f"{e.scope}/Y")
    else:
        e.emit("Add", [scaled, bias], [proto.output[0]], f"{e.scope}/Y")
    for index, value in ((1, mean), (2, inverse)):
        if _present(proto, index):
            e.emit("Identity", [value], [proto.output[index]], f"{e.scope}/out{index}")
    return e.take()


@decomposition("Gelu")
def _gelu(e: Emitter, proto: NodeProto) -> list[NodeProto]:
    """x/2 * (1 + erf(x/sqrt 2)), or the tanh form when approximate='tanh'."""
    x = proto.input[0]
    if attr(proto, "approximate", "none") == "tanh":
        cube = e.add("Mul", [e.add("Mul", [x, x], "x_squared"), x], "x_cubed")
        inner = e.add("Add", [x, e.add("Mul", [cube, e.scalar(0.044715, x)], "cubic_term")], "inner")
        curve = e.add("Tanh", [e.add("Mul", [inner, e.scalar(math.sqrt(2 / math.pi), x)], "scaled")], "curve")
    else:
        curve = e.add("Erf", [e.add("Mul", [x, e.scalar(1 / math.sqrt(2), x)], "scaled")], "curve")
    half = e.add("Mul", [x, e.scalar(0.5, x)], "half_x")
    e.emit("Mul", [half, e.add("Add", [curve, e.scalar(1, x)], "one_plus")], [proto.output[0]], f"{e.scope}/Y")
    return e.take()


@decomposition("SoftmaxCrossEntropyLoss")
def _softmax_cross_entropy(e: Emitter, proto: NodeProto) -> list[NodeProto]:
    """LogSoftmax over the class axis, then the negative log-likelihood."""
    scores = proto.input[0]
    log_prob = _present(proto, 1)
    if log_prob is None:
        log_prob = e.add("LogSoftmax", [scores], "log_prob", axis=1)
    else:
        e.emit("LogSoftmax", [scores], [log_prob], f"{e.scope}/log_prob", axis=1)
    _negative_log_likelihood(e, proto, log_prob)
    return e.take()


@decomposition("NegativeLogLikelihoodLoss")
def _nll(e: Emitter, proto: NodeProto) -> list[NodeProto]:
    _negative_log_likelihood(e, proto, proto.input[0])
    return e.take()


def _negative_log_likelihood(e: Emitter, proto: NodeProto, log_prob: str) -> None:
    """-log_prob[n, label[n], ...] (times the label's weight), picked with a one-hot mask; the
    mean divides by the summed weights of the labels not ignored, as the spec says."""
    labels, weights = proto.input[1], _input(proto, 2)
    ignore_index = attr(proto, "ignore_index")
    reference = proto.input[0]
    valid = None
    if ignore_index is not None:
        ignored = e.add("Equal", [labels, e.constant(np.asarray(ignore_index, e.dtype(labels)), "ignore_index")],
                        "ignored")
        valid = e.add("Not", [ignored], "valid")
        labels = e.add("Where", [valid, labels, e.constant(np.zeros((), e.dtype(labels)), "label_zero")],
                       "safe_labels")
    classes = e.add("Gather", [e.shape(reference), e.ints([1])], "classes")
    on_off = e.constant(np.asarray([0, 1], e.dtype(reference)), "off_on")
    one_hot = e.add("OneHot", [labels, classes, on_off], "one_hot", axis=1)
    picked = e.reduce("ReduceSum", e.add("Mul", [log_prob, one_hot], "masked"), [1], False, "picked")
    losses = e.add("Neg", [picked], "losses")
    weight = None
    if weights is not None:
        weight = e.add("Gather", [weights, labels], "label_weight")
    if valid is not None:
        valid_float = e.cast_like(valid, reference, "valid_float")
        weight = valid_float if weight is None else e.add("Mul", [weight, valid_float], "label_weight_valid")
    if weight is not None:
        losses = e.add("Mul", [losses, weight], "weighted")
    reduction = attr(proto, "reduction", "mean")
    rank = e.rank(proto.input[1])
    loss = proto.output[0]
    if reduction == "none":
        e.emit("Identity", [losses], [loss], f"{e.scope}/loss")
    elif reduction == "sum":
        e.emit("ReduceSum", [losses, e.ints(range(rank))], [loss], f"{e.scope}/loss", keepdims=0)
    elif weight is None:
        if e.opset >= 18:
            e.emit("ReduceMean", [losses, e.ints(range(rank))], [loss], f"{e.scope}/loss", keepdims=0)
        else:
            e.emit("ReduceMean", [losses], [loss], f"{e.scope}/loss", axes=list(range(rank)), keepdims=0)
    else:
        total = e.reduce("ReduceSum", losses, range(rank), False, "total")
        count = e.reduce("ReduceSum", weight, range(rank), False, "weight_total")
        e.emit("Div", [total, count], [loss], f"{e.scope}/loss")
    return None


@decomposition("MaxPool")
def _max_pool(e: Emitter, proto: NodeProto) -> list[NodeProto] | None:
    """MaxPool with its Indices output, which the backward scatters the gradient to."""
    if _present(proto, 1):
        if attr(proto, "storage_order", 0):
            raise ExportError(f"portable export: {label(proto)} writes column-major Indices "
                              "(storage_order=1); the backward needs row-major ones")
        return None
    copy = NodeProto()
    copy.CopyFrom(proto)
    del copy.output[1:]
    copy.output.append(e.fresh("indices"))
    return [copy]


@decomposition("Dropout")
def _dropout(e: Emitter, proto: NodeProto) -> list[NodeProto] | None:
    """Dropout that drops (training mode, ratio > 0) with its mask output, which the backward
    multiplies by; otherwise the identity."""
    ratio = float(e.value(proto.input[1], f"the ratio of {label(proto)}")) if _input(proto, 1) else attr(proto, "ratio", 0.5)
    training = bool(e.value(proto.input[2], f"the training_mode of {label(proto)}")) if _input(proto, 2) else False
    if attr(proto, "is_test") is not None:
        training = not attr(proto, "is_test")
    if not training or ratio == 0:
        e.emit("Identity", [proto.input[0]], [proto.output[0]], f"{e.scope}/identity")
        mask = _present(proto, 1)
        if mask is not None:
            ones = e.add("Shape", [proto.input[0]], "shape")
            e.emit("ConstantOfShape", [ones], [mask], f"{e.scope}/mask", value=numpy_to_tensor(np.ones(1, np.bool_)))
        return e.take()
    if _present(proto, 1):
        return None
    copy = NodeProto()
    copy.CopyFrom(proto)
    del copy.output[1:]
    copy.output.append(e.fresh("mask"))
    return [copy]
