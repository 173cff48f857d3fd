"""Graph surgery on the schema's messages: concatenated graphs, graphs without payloads, and
the combined graph a training step runs (the main graph followed by an algorithm graph).

Pure message work, no decoding: a large model's weights are never copied.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from onnxtrain.proto.onnx_pb2 import GraphProto, ModelProto, TensorProto

_GRAPH_FIELDS = ("input", "initializer", "output", "node", "value_info", "sparse_initializer")


def _placeholder(tensor: TensorProto) -> TensorProto:
    """An initializer's name, type and shape without its data."""
    return TensorProto(name=tensor.name, dims=tensor.dims, data_type=tensor.data_type)


def concatenated(name: str, graphs: Iterable[GraphProto], placeholders: Container[str]) -> GraphProto:
    """The graphs' fields concatenated in order; initializers named in `placeholders` (state a
    trainer passes in itself) keep no data, so a large model's weights are not copied."""
    result = GraphProto(name=name)
    for graph in graphs:
        for field in _GRAPH_FIELDS:
            if field == "initializer":
                result.initializer.extend(_placeholder(t) if t.name in placeholders else t
                                          for t in graph.initializer)
            elif field == "sparse_initializer":
                for sparse in graph.sparse_initializer:
                    if sparse.values.name in placeholders:
                        result.initializer.append(TensorProto(name=sparse.values.name, dims=sparse.dims,
                                                              data_type=sparse.values.data_type))
                    else:
                        result.sparse_initializer.append(sparse)
            else:
                getattr(result, field).extend(getattr(graph, field))
    return result


def combined_graph(model: ModelProto, index: int, placeholders: Container[str] = frozenset()) -> GraphProto:
    """Main graph ⊕ training_info[index].algorithm, concatenated field by field in that order."""
    main, algorithm = model.graph, model.training_info[index].algorithm
    return concatenated(f"{main.name}+{algorithm.name}" if algorithm.name else main.name,
                         (main, algorithm), placeholders)


def light_graph(graph: GraphProto, placeholders: Container[str]) -> GraphProto:
    """A copy of `graph` whose initializers in `placeholders` keep no data."""
    return concatenated(graph.name, (graph,), placeholders)


def model_of(model: ModelProto, graph: GraphProto) -> ModelProto:
    """A model running `graph` with `model`'s opsets, IR version and local functions."""
    result = ModelProto(ir_version=model.ir_version, graph=graph)
    result.opset_import.extend(model.opset_import)
    result.functions.extend(model.functions)
    return result
