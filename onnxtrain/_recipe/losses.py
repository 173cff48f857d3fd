"""Loss functions as ONNX nodes, for the algorithm graphs make_training_model writes.

Each builder takes the prediction's and the label's names and returns the
nodes computing a scalar mean loss, so the model trains on any runtime that
follows the spec. A user loss graph (prediction, label) -> loss is inlined
with its names prefixed.
"""

from __future__ import annotations

from collections.abc import Callable

from onnxtrain.proto import GraphProto, NodeProto, TensorProto, ValueInfoProto
from onnxtrain.proto.make import node
from onnxtrain.translate.tensors import numpy_to_tensor

import numpy as np

Names = Callable[[str], str]


def _mean(x: str, loss: str) -> NodeProto:
    return node("ReduceMean", [x], [loss], keepdims=0)


def mse(prediction: str, label: str, loss: str, fresh: Names) -> tuple[list[NodeProto], list[TensorProto]]:
    diff, square = fresh("loss.diff"), fresh("loss.square")
    return [node("Sub", [prediction, label], [diff]), node("Mul", [diff, diff], [square]),
            _mean(square, loss)], []


def l1(prediction: str, label: str, loss: str, fresh: Names) -> tuple[list[NodeProto], list[TensorProto]]:
    diff, absolute = fresh("loss.diff"), fresh("loss.abs")
    return [node("Sub", [prediction, label], [diff]), node("Abs", [diff], [absolute]),
            _mean(absolute, loss)], []


def cross_entropy(prediction: str, label: str, loss: str, fresh: Names,
                  ignore_index: int | None = None) -> tuple[list[NodeProto], list[TensorProto]]:
    """Mean softmax cross-entropy of logits [N, C, ...] against class indices [N, ...].

    ignore_index: a label value that contributes nothing (as torch's cross_entropy, the mean
    is over the other labels); the node's own attribute, so every runtime skips it.
    """
    settings = {} if ignore_index is None else {"ignore_index": int(ignore_index)}
    return [node("SoftmaxCrossEntropyLoss", [prediction, label], [loss], reduction="mean", **settings)], []


def causal_lm(prediction: str, label: str, loss: str, fresh: Names,
              ignore_index: int | None = -100) -> tuple[list[NodeProto], list[TensorProto]]:
    """Next-token cross-entropy of language-model logits [N, T, V] against token ids [N, T], as
    Hugging Face's causal LMs compute it: position t's logits predict token t + 1, so the
    loss compares logits[:, :-1] with labels[:, 1:] (pass the input ids themselves as labels),
    and labels equal to ignore_index (-100 by default, padding) contribute nothing.
    """
    names = {part: fresh(f"loss.{part}") for part in ("zero", "one", "last", "end", "logits", "scores", "targets")}
    # Slice bounds and the time axis (1, as the labels' start): one initializer per value.
    tensors = [scalar(names[part], [value], np.int64) for part, value in
               (("zero", 0), ("one", 1), ("last", -1), ("end", np.iinfo(np.int64).max))]
    settings = {} if ignore_index is None else {"ignore_index": int(ignore_index)}
    return [
        node("Slice", [prediction, names["zero"], names["last"], names["one"]], [names["logits"]]),
        # SoftmaxCrossEntropyLoss takes the classes on axis 1.
        node("Transpose", [names["logits"]], [names["scores"]], perm=[0, 2, 1]),
        node("Slice", [label, names["one"], names["end"], names["one"]], [names["targets"]]),
        node("SoftmaxCrossEntropyLoss", [names["scores"], names["targets"]], [loss], reduction="mean",
             **settings),
    ], tensors


def bce_with_logits(prediction: str, label: str, loss: str,
                    fresh: Names) -> tuple[list[NodeProto], list[TensorProto]]:
    """mean(max(x, 0) - x*y + log(1 + exp(-|x|))): stable for logits of any size."""
    names = {part: fresh(f"loss.{part}") for part in
             ("relu", "xy", "abs", "negabs", "softplus", "diff", "sum")}
    return [
        node("Relu", [prediction], [names["relu"]]),
        node("Mul", [prediction, label], [names["xy"]]),
        node("Abs", [prediction], [names["abs"]]),
        node("Neg", [names["abs"]], [names["negabs"]]),
        node("Softplus", [names["negabs"]], [names["softplus"]]),
        node("Sub", [names["relu"], names["xy"]], [names["diff"]]),
        node("Add", [names["diff"], names["softplus"]], [names["sum"]]),
        _mean(names["sum"], loss),
    ], []


BUILT_IN = {"mse": mse, "l1": l1, "cross_entropy": cross_entropy, "causal_lm": causal_lm,
            "bce_with_logits": bce_with_logits}
# The built-in losses of class indices: they take ignore_index=.
CLASS_INDEX_LOSSES = ("cross_entropy", "causal_lm")


def inline_loss_graph(graph: GraphProto, prediction: str, label: str, loss: str,
                      fresh: Names) -> tuple[list[NodeProto], list[TensorProto]]:
    """The nodes of a (prediction, label) -> loss graph, renamed into the algorithm graph."""
    renamed = {graph.input[0].name: prediction, graph.input[1].name: label, graph.output[0].name: loss}

    def rename(name: str) -> str:
        if name and name not in renamed:
            renamed[name] = fresh(f"loss.{name}")
        return renamed.get(name, name)

    initializers = []
    for tensor in graph.initializer:
        copy = TensorProto()
        copy.CopyFrom(tensor)
        copy.name = rename(tensor.name)
        initializers.append(copy)
    nodes = []
    for original in graph.node:
        copy = NodeProto()
        copy.CopyFrom(original)
        copy.name = ""
        copy.input[:] = [rename(n) for n in original.input]
        copy.output[:] = [rename(n) for n in original.output]
        nodes.append(copy)
    return nodes, initializers


def label_input(kind: str, prediction: ValueInfoProto, label: str,
                graph: GraphProto | None = None) -> ValueInfoProto:
    """The algorithm graph's label input: class indices for cross-entropy, else like the prediction."""
    value = ValueInfoProto(name=label)
    if graph is not None:
        value.type.CopyFrom(graph.input[1].type)
        return value
    value.type.CopyFrom(prediction.type)
    if kind in CLASS_INDEX_LOSSES:
        tensor = value.type.tensor_type
        tensor.elem_type = TensorProto.INT64
        # cross_entropy's classes are axis 1 of the scores, causal_lm's the last axis.
        axis = 1 if kind == "cross_entropy" else -1
        if tensor.HasField("shape") and len(tensor.shape.dim) >= 2:
            del tensor.shape.dim[axis]
    return value


def scalar(name: str, value: float | int, dtype: type) -> TensorProto:
    return numpy_to_tensor(np.array(value, dtype), name)
