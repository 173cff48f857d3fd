"""How values move through an exported graph: who reads and who computes each value, which ops
only move a value, and what each value depends on. The trainable set and the search for
position tables both judge an initializer by where its value goes; this is their common map.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from onnxtrain.proto import GraphProto, NodeProto, TensorProto
from onnxtrain.proto.walk import iter_graph_tree
from onnxtrain.translate.registry import normalize_domain

# Ops whose first input reaches their output unchanged in value (moved, retyped, repeated or
# cut): an initializer's role is decided where it is computed with.
PASS_THROUGH_FIRST = {"Cast", "CastLike", "Identity", "Transpose", "Reshape", "Unsqueeze", "Squeeze",
                      "Expand", "Flatten", "Tile", "Slice", "Split", "DepthToSpace", "SpaceToDepth"}
PASS_THROUGH_ALL = {"Concat", "SequenceConstruct"}

# What a value depends on, ordered: each class includes those before it. Shapes are read at
# trace time; positions come from integer inputs (token and position ids, masks) or from
# Range/CumSum over shapes, by index arithmetic alone; inputs are float inputs before any
# weight; learned values passed through a weight.
CONSTANT, SHAPE, POSITION, INPUT, LEARNED = range(5)

_INTEGER_TYPES = {TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64, TensorProto.UINT8,
                  TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64, TensorProto.BOOL}
SHAPE_READERS = {"Shape", "Size", "ConstantOfShape", "EyeLike"}
_COUNTERS = {"Range", "CumSum"}


@dataclass(frozen=True)
class Use:
    """Input `index` of `node` reads the value."""

    node: NodeProto
    index: int


def consumers(graph: GraphProto) -> dict[str, list[Use]]:
    """name -> the uses reading it, in this graph and its subgraphs."""
    uses: dict[str, list[Use]] = {}
    for subgraph, _ in iter_graph_tree(graph, "graph"):
        for item in subgraph.node:
            for index, name in enumerate(item.input):
                if name:
                    uses.setdefault(name, []).append(Use(item, index))
    return uses


def producer_of(graph: GraphProto) -> dict[str, NodeProto]:
    """Output name -> the node of `graph` computing it (optional outputs left unnamed skipped)."""
    return {name: item for item in graph.node for name in item.output if name}


def passes_through(use: Use) -> bool:
    """Whether the use only moves the value on (PASS_THROUGH_FIRST at input 0, or joins)."""
    if normalize_domain(use.node.domain) != "":
        return False
    return (use.node.op_type in PASS_THROUGH_ALL
            or (use.node.op_type in PASS_THROUGH_FIRST and use.index == 0))


def flows(graph: GraphProto, weight_positions: Mapping[str, Iterable[int]], table_readers: Iterable[str]
          ) -> dict[str, int]:
    """Name -> what the main graph's value depends on (CONSTANT ... LEARNED).

    A node with an initializer-made operand where a weight goes (weight_positions, or input 0
    of a table reader) turns positions and inputs into learned values; otherwise a value
    depends on the most of what its node reads. Values of subgraphs are not listed: take them
    as learned."""
    flow = {t.name: CONSTANT for t in graph.initializer}
    flow.update((s.values.name, CONSTANT) for s in graph.sparse_initializer)
    for value in graph.input:
        if value.name not in flow:
            flow[value.name] = POSITION if value.type.tensor_type.elem_type in _INTEGER_TYPES else INPUT
    readers = set(table_readers)
    for item in graph.node:
        flow.update(dict.fromkeys(item.output, _node_flow(item, flow, weight_positions, readers)))
    return flow


def _node_flow(item: NodeProto, flow: Mapping[str, int], weight_positions: Mapping[str, Iterable[int]],
               readers: set[str]) -> int:
    if any(a.HasField("g") or len(a.graphs) for a in item.attribute):
        return LEARNED  # a subgraph may read anything of the outer scope
    inputs = [(index, flow.get(name, LEARNED)) for index, name in enumerate(item.input) if name]
    most = max((f for _, f in inputs), default=CONSTANT)
    op_type = item.op_type
    if normalize_domain(item.domain) == "" and op_type in SHAPE_READERS:
        return SHAPE
    if op_type in _COUNTERS and most in (SHAPE, POSITION):
        return POSITION
    weights = set(weight_positions.get(op_type, ())) | ({0} if op_type in readers else set())
    held = {index for index, f in inputs if f == CONSTANT and index in weights}
    reads = max((f for index, f in inputs if index not in held), default=CONSTANT)
    # A weight applied to ids or positions is learned too: an embedding lookup, a one-hot product.
    return LEARNED if held and reads >= POSITION else most
