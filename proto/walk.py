"""Visit every graph and every tensor of a model.

Tensors hide in many places: initializers and sparse initializers of the main
graph, of every subgraph held in a node attribute (If/Loop/Scan bodies), of
model-local function bodies and of the training graphs. Loading, saving and
validation all need the same complete walk, so it is written once here. Each
item comes with a human-readable description of where it sits, for messages.
"""

from __future__ import annotations

from collections.abc import Iterator

from onnxtrain.proto.onnx_pb2 import (
    AttributeProto,
    GraphProto,
    ModelProto,
    NodeProto,
    SparseTensorProto,
    TensorProto,
)


def _node_label(node: NodeProto) -> str:
    return f"node {node.name!r} ({node.op_type})" if node.name else f"unnamed {node.op_type} node"


def _attribute_graphs(nodes: list[NodeProto], where: str) -> Iterator[tuple[GraphProto, str]]:
    for node in nodes:
        for attribute in node.attribute:
            inner = f"attribute {attribute.name!r} of {_node_label(node)} in {where}"
            if attribute.HasField("g"):
                yield from iter_graph_tree(attribute.g, inner)
            for index, graph in enumerate(attribute.graphs):
                yield from iter_graph_tree(graph, f"{inner}[{index}]")


def iter_graph_tree(graph: GraphProto, where: str) -> Iterator[tuple[GraphProto, str]]:
    """`graph` and every subgraph nested in its nodes' attributes."""
    yield graph, where
    yield from _attribute_graphs(graph.node, f"graph {graph.name!r}" if graph.name else where)


def iter_graphs(model: ModelProto) -> Iterator[tuple[GraphProto, str]]:
    """Every graph of the model: main, training, and all nested subgraphs."""
    if model.HasField("graph"):
        yield from iter_graph_tree(model.graph, "main graph")
    for index, info in enumerate(model.training_info):
        if info.HasField("initialization"):
            yield from iter_graph_tree(info.initialization, f"training_info[{index}].initialization")
        if info.HasField("algorithm"):
            yield from iter_graph_tree(info.algorithm, f"training_info[{index}].algorithm")
    for function in model.functions:
        yield from _attribute_graphs(function.node, f"function {function.domain}::{function.name}")


def _sparse_parts(sparse: SparseTensorProto, where: str) -> Iterator[tuple[TensorProto, str]]:
    yield sparse.values, f"values of {where}"
    yield sparse.indices, f"indices of {where}"


def _attribute_tensors(
    attribute: AttributeProto, where: str
) -> Iterator[tuple[TensorProto, str]]:
    inner = f"attribute {attribute.name!r} of {where}"
    if attribute.HasField("t"):
        yield attribute.t, inner
    for index, tensor in enumerate(attribute.tensors):
        yield tensor, f"{inner}[{index}]"
    if attribute.HasField("sparse_tensor"):
        yield from _sparse_parts(attribute.sparse_tensor, inner)
    for index, sparse in enumerate(attribute.sparse_tensors):
        yield from _sparse_parts(sparse, f"{inner}[{index}]")


def _node_tensors(nodes: list[NodeProto], where: str) -> Iterator[tuple[TensorProto, str]]:
    for node in nodes:
        for attribute in node.attribute:
            yield from _attribute_tensors(attribute, f"{_node_label(node)} in {where}")


def iter_tensors(model: ModelProto) -> Iterator[tuple[TensorProto, str]]:
    """Every TensorProto stored in the model, with where it sits."""
    for graph, where in iter_graphs(model):
        for tensor in graph.initializer:
            yield tensor, f"initializer {tensor.name!r} of {where}"
        for sparse in graph.sparse_initializer:
            yield from _sparse_parts(sparse, f"sparse initializer {sparse.values.name!r} of {where}")
        yield from _node_tensors(graph.node, where)
    for function in model.functions:
        label = f"function {function.domain}::{function.name}"
        yield from _node_tensors(function.node, label)
        for attribute in function.attribute_proto:
            yield from _attribute_tensors(attribute, label)
