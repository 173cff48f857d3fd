"""Example values of the forward tensors: ranks, dtypes, broadcast axes and constant operands.

The backward is written once for every batch size, but its rules must know each
forward tensor's rank and dtype, along which axes an operand was broadcast, and
the values of constant operands (axes, Slice bounds, Dropout ratios). One eager
run of the forward nodes with onnxtrain's own translator at example feeds
answers all of these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np

from onnxtrain.errors import ExportError, OnnxTrainError
from onnxtrain.proto import GraphProto, ModelProto, NodeProto, SparseTensorProto, TensorProto, ValueInfoProto
from onnxtrain.proto.make import opset as make_opset
from onnxtrain.translate.registry import TRAINING_DOMAIN
from onnxtrain.translate.node import sparse_to_dense
from onnxtrain.translate.tensors import numpy_to_tensor
from onnxtrain.translate.values import is_traced


class ExampleValues(dict):
    """name -> example value; `concrete` names the entries whose values (not only shapes and
    dtypes) are known: initializers, feeds and what the translator computes from constants."""

    concrete: set[str]


def example_values(nodes: Sequence[NodeProto], initializers: Mapping[str, TensorProto],
                   inputs: Sequence[ValueInfoProto], opset: int,
                   feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every tensor the nodes read or write, evaluated at `feeds`.

    Args:
        nodes: forward nodes in topological order (no Gradient among them).
        initializers: every initializer the nodes may read.
        inputs: the graph inputs (those with an initializer are defaults).
        opset: the default domain's opset version.
        feeds: a value for every input without an initializer.

    Returns:
        name -> numpy value, for the feeds, the initializers and every node output; values
        that depend on feeds or float weights are zero-strided stand-ins giving only the shape
        and dtype (see ExampleValues.concrete).

    Raises:
        ExportError: a feed is missing, or the forward cannot run at the feeds.
    """
    from onnxtrain.translate.model import TranslatedModel  # the translator is heavy to import

    missing = [v.name for v in inputs if v.name not in initializers and v.name not in feeds]
    if missing:
        raise ExportError(f"portable export needs example values of the inputs {missing} (example_feeds) "
                          "to learn the forward tensors' ranks and dtypes")
    produced = [name for n in nodes for name in n.output if name]
    graph = GraphProto(name="portable_forward", node=list(nodes), initializer=list(initializers.values()),
                       input=[v for v in inputs if v.name not in initializers])
    if produced:
        graph.output.add().name = produced[-1]
    model = ModelProto(ir_version=10, graph=graph,
                       opset_import=[make_opset("", opset), make_opset(TRAINING_DOMAIN, 1)])
    concrete: dict[str, np.ndarray] = {}

    def forward(params, given, key):
        _, kept = translated.apply_keeping(params, given, key, produced)
        # Values the translator folds on the host (shapes, axes, constants) are known while
        # tracing; the rest are only shapes and dtypes.
        concrete.update((name, np.asarray(value)) for name, value in kept.items() if not is_traced(value))
        return {name: value for name, value in kept.items() if is_traced(value)}

    try:
        translated = TranslatedModel(model)
        with jax.enable_x64(True):
            # Tracing only: compiling the forward would cost more than the whole expansion.
            abstract = jax.eval_shape(forward, translated.params, dict(feeds), jax.random.PRNGKey(0))
    except OnnxTrainError as error:
        raise ExportError(f"portable export: the forward nodes do not run at the example feeds: {error}. "
                          "Pass a real batch, export(..., portable=..., example_feeds=batch), or run a step "
                          "first (its batch is the default)") from error
    values = ExampleValues({name: np.asarray(value)
                            for name, value in {**translated.plan.constants, **translated.params}.items()})
    values.update((name, np.asarray(value)) for name, value in feeds.items())
    values.concrete = set(values) | set(concrete)
    values.update(concrete)
    # A zero-strided array stands for each traced value: its shape and dtype, no memory.
    values.update((name, np.broadcast_to(np.zeros((), shape.dtype), shape.shape)) for name, shape in abstract.items())
    return values


def as_tensor(name: str, value: np.ndarray | TensorProto | SparseTensorProto) -> TensorProto:
    """An initializer (a numpy array, or onnx's or onnxtrain's TensorProto or SparseTensorProto)
    as onnxtrain's dense TensorProto named `name`."""
    if isinstance(value, np.ndarray) or np.isscalar(value):
        return numpy_to_tensor(np.asarray(value), name)
    if type(value).__name__ == "SparseTensorProto":
        sparse = SparseTensorProto.FromString(value.SerializeToString())
        return numpy_to_tensor(sparse_to_dense(sparse, f"initializer {name!r}"), name)
    tensor = TensorProto.FromString(value.SerializeToString())
    tensor.name = name
    return tensor


def check_example_sizes(inputs: Sequence[ValueInfoProto], feeds: Mapping[str, np.ndarray]) -> None:
    """Refuse example feeds with size 1 along an axis the model leaves open: broadcasting
    there would look like a fixed size-1 axis, and the backward would not sum over it.

    Raises:
        ExportError: naming the input and axis.
    """
    for info in inputs:
        if info.name not in feeds or not info.type.HasField("tensor_type"):
            continue
        dims = info.type.tensor_type.shape.dim
        for axis, dim in enumerate(dims):
            if not dim.HasField("dim_value") and axis < np.ndim(feeds[info.name]) \
                    and np.shape(feeds[info.name])[axis] == 1:
                raise ExportError(f"portable export: the example value of input {info.name!r} has size 1 "
                                  f"along axis {axis}, which the model leaves open; pass example_feeds= "
                                  "with a size of 2 or more there")
