"""The names of a graph checked as the IR spec defines them, once for inference and training.

A value name is defined by a graph input, an initializer or a node output, and every name
is defined once (single static assignment). The one exception: a name may be both an
input and an initializer of the same graph (an initializer the caller may override). A node
reads only names defined before it, in its own graph or in the graphs enclosing it; a
subgraph (a node attribute) sees the names its enclosing graphs define before that node.
A subgraph's node outputs must differ from every name it sees; its own inputs and
initializers may shadow outer names, as ONNX's checker allows. Graph inputs, outputs and
initializers need a name; an empty node input or output is an omitted optional one.

An invalid graph would otherwise run and answer wrongly: the last of two nodes writing a
name wins, a node output can silently replace a graph input, an output named '' is None.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from onnxtrain.errors import ModelLoadError, OnnxTrainError
from onnxtrain.proto import AttributeProto, GraphProto, NodeProto
from onnxtrain.translate.node import node_label


class _Scope:
    """The names one graph has defined so far (with what defined each), before its outer scopes."""

    def __init__(self, outer: _Scope | None = None):
        self.origin: dict[str, str] = {}
        # Initializers no input has claimed yet: an input of the same name overrides one.
        self.overridable: set[str] = set()
        self.outer = outer

    def find(self, name: str) -> str | None:
        """What defines `name` here or in an enclosing graph; None when nothing does yet."""
        scope: _Scope | None = self
        while scope is not None:
            if name in scope.origin:
                return scope.origin[name]
            scope = scope.outer
        return None


class _Checker:
    """Checks graphs for one caller: its message prefix and error type."""

    def __init__(self, prefix: str, error: type[OnnxTrainError]):
        self.prefix = prefix
        self.error = error

    def fail(self, message: str) -> OnnxTrainError:
        return self.error(f"{self.prefix}{message}")

    def define(self, scope: _Scope, name: str, what: str, origin: str, visible_outside: bool) -> None:
        """Record `name` as defined by `what` (`origin` says so for later messages); an error if
        it is defined already, in this graph or, when `visible_outside`, in an enclosing one
        (node outputs may not shadow outer names)."""
        earlier = scope.find(name) if visible_outside else scope.origin.get(name)
        if earlier is not None:
            raise self.fail(
                f"{what} defines {name!r}, which is already defined as {earlier}. Every value "
                "name must be defined once (SSA): rename one of them in the model.")
        scope.origin[name] = origin

    def require_name(self, name: str, what: str, part: str) -> None:
        if not name:
            raise self.fail(f"{what} of {part} has an empty name; every graph input, output and "
                            "initializer needs a name. Name it in the model.")

    def check(self, parts: Sequence[tuple[GraphProto, str]], outer: _Scope | None) -> None:
        """Check `parts`, graphs concatenated field by field into one, seeing the `outer` names."""
        scope = _Scope(outer)
        for graph, part in parts:
            for name in initializer_names(graph):
                self.require_name(name, "an initializer", part)
                self.define(scope, name, f"an initializer of {part}", f"an initializer of {part}",
                            visible_outside=False)
                scope.overridable.add(name)
        for graph, part in parts:
            for value in graph.input:
                self.require_name(value.name, "an input", part)
                if value.name in scope.overridable:
                    scope.overridable.discard(value.name)
                    continue
                self.define(scope, value.name, f"an input of {part}", f"an input of {part}",
                            visible_outside=False)
        for graph, part in parts:
            for node in graph.node:
                self.check_node(node, scope, part)
        for graph, part in parts:
            for value in graph.output:
                self.require_name(value.name, "an output", part)
                if scope.find(value.name) is None:
                    raise self.fail(
                        f"output {value.name!r} of {part} is never computed: no input, initializer "
                        "or node output has that name. Fix the output's name or add the node.")

    def check_node(self, node: NodeProto, scope: _Scope, part: str) -> None:
        """A node's reads (its inputs, and what its subgraphs read) and then its outputs."""
        label = node_label(node)
        for name in node.input:
            if name and scope.find(name) is None:
                raise self.fail(
                    f"{label} in {part} reads {name!r}, which is not defined before it (by an "
                    "input, an initializer or an earlier node's output, here or in an enclosing "
                    "graph). Nodes must be in topological order: fix the name or the order.")
        for attribute in node.attribute:
            for index, graph in _attribute_graphs(attribute):
                subpart = (f"graph {graph.name!r} (attribute {attribute.name!r}{index} of {label} "
                           f"in {part})")
                self.check([(graph, subpart)], scope)
        for name in node.output:
            if name:
                producer = label if node.name else f"the {label}"
                self.define(scope, name, f"{label} in {part}", f"an output of {producer} in {part}",
                            visible_outside=True)


def _attribute_graphs(attribute: AttributeProto) -> Iterable[tuple[str, GraphProto]]:
    """(index text, graph) for the graphs an attribute holds: '' for `g`, '[i]' for `graphs`."""
    if attribute.HasField("g"):
        yield "", attribute.g
    for index, graph in enumerate(attribute.graphs):
        yield f"[{index}]", graph


def initializer_names(graph: GraphProto) -> list[str]:
    """Names of a graph's dense and sparse initializers."""
    return [t.name for t in graph.initializer] + [s.values.name for s in graph.sparse_initializer]


def check_graph(graph: GraphProto, part: str | None = None,
                error: type[OnnxTrainError] = ModelLoadError) -> None:
    """Check a graph's names and those of every subgraph nested in it (see the module docstring).

    Args:
        graph: the graph to check.
        part: how messages name it; by default "graph '<its name>'".
        error: the error type to raise.

    Raises:
        error (ModelLoadError by default), naming the graph, the node (name and op) and the value.
    """
    check_graphs([(graph, part or f"graph {graph.name!r}")], error=error)


def check_graphs(parts: Sequence[tuple[GraphProto, str]], prefix: str = "",
                 error: type[OnnxTrainError] = ModelLoadError) -> None:
    """Check graphs concatenated field by field, in order, as one graph (a training step runs
    the main graph followed by an algorithm graph that way).

    Args:
        parts: (graph, how messages name it) in order.
        prefix: text every message starts with (which model part the graphs make up).
        error: the error type to raise.

    Raises:
        error (ModelLoadError by default), naming the graph, the node (name and op) and the value.
    """
    _Checker(prefix, error).check(parts, None)
