"""The Gradient operator of ai.onnx.preview.training: gradients named by tensor names.

Gradient(xs, zs, y) differentiates the function y <- (xs, zs) that the graph
holding the node defines (the main graph, or main + algorithm for a training
step), evaluated at the node's own inputs rather than at the tensors' current
values. The function is a slice of the node's GraphPlan (every node on a path
to y, stopping at the names in xs and zs), and a ones cotangent is pulled
back through it, so a non-scalar y gives the gradient of sum(y). Tensors y
depends on outside xs and zs are constants at their current values.

In the usual case (the node's inputs are the tensors xs and zs name) the
slice's nodes that depend on xs or zs run once, as a NodeGroup under jax.vjp,
where the walk of the graph reaches them: the graph's forward values are the
vjp's primal outputs and the node only pulls back. Otherwise the node replays
the slice under jax.vjp from its own inputs, and the compiled program
computes the forward pass twice unless XLA merges the copies (it does not
always: a LayerNormalization's square root simplifies differently in each).
A Gradient inside the slice is replayed like any op, which is how second
order works; random ops replay with the keys of the forward run.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from onnxtrain.errors import ModelLoadError
from onnxtrain.translate.graph import GraphPlan, NodeGroup, node_reads, run_node, run_plan_segments, run_positions
from onnxtrain.translate.layouts import row_major
from onnxtrain.translate.node import Evaluation, Node, NodeSpec
from onnxtrain.translate.registry import TRAINING_DOMAIN, op
from onnxtrain.translate.values import is_host


@dataclass
class _Slice:
    """The nodes to replay, in graph order, and which of them depend on xs (or zs)."""

    nodes: list[NodeSpec]
    depends_on_xs: set[int]
    depends_on_inputs: set[int]


def _names(spec: NodeSpec) -> tuple[list[str], list[str], str]:
    """The node's xs, zs and y, checked to be tensor names (a model may give them any type)."""
    xs, zs, y = spec.attrs.get("xs", ()), spec.attrs.get("zs", ()), spec.attrs.get("y")
    for attribute, names in (("xs", xs), ("zs", zs)):
        if not isinstance(names, (list, tuple)) or not all(isinstance(name, str) for name in names):
            raise _error(spec, f"attribute {attribute!r} must list tensor names (type STRINGS), not {names!r}")
    if not isinstance(y, str):
        raise _error(spec, f"attribute 'y' must name the tensor to differentiate (type STRING), not {y!r}")
    return _unaliased(spec, list(xs)), list(zs), y


def _unaliased(spec: NodeSpec, xs: list[str]) -> list[str]:
    """pytorch-pfn-extras (Gradient in ai.onnx.preview) names each x by an Identity copy of
    the node's input that y does not read; it means the input itself."""
    if spec.proto.domain != "ai.onnx.preview":
        return xs
    copies = {n.proto.output[0]: n.proto.input[0] for n in spec.graph.nodes
              if n.proto.op_type == "Identity" and n.proto.input and n.proto.output}
    inputs = list(spec.proto.input)
    return [inputs[i] if i < len(inputs) and copies.get(x) == inputs[i] else x for i, x in enumerate(xs)]


def _slice_of(spec: NodeSpec) -> _Slice:
    """The Gradient node's slice of its plan (worked out once): the nodes on a path to y,
    stopping at the names in xs and zs."""
    if "slice" not in spec.cache:
        xs, zs, y = _names(spec)
        cut = set(xs) | set(zs)
        producers = {name: node for node in spec.graph.nodes for name in node.proto.output if name}
        wanted: set[int] = set()
        pending = [y]
        while pending:
            name = pending.pop()
            producer = producers.get(name)
            if name in cut or producer is None or id(producer) in wanted or producer is spec:
                continue
            wanted.add(id(producer))
            pending.extend(node_reads(producer))
        nodes = [node for node in spec.graph.nodes if id(node) in wanted]
        spec.cache["slice"] = _Slice(nodes, _downstream(nodes, xs), _downstream(nodes, cut))
    return spec.cache["slice"]


def _downstream(nodes: list[NodeSpec], names: Sequence[str] | set[str]) -> set[int]:
    """The nodes (ids) that read any of `names`, directly or through earlier nodes."""
    tainted, found = set(names), set()
    for spec in nodes:
        if node_reads(spec) & tainted:
            found.add(id(spec))
            tainted |= {name for name in spec.proto.output if name}
    return found


def _error(spec: NodeSpec, message: str) -> ModelLoadError:
    return ModelLoadError(f"{spec.label}: {message}")


def _check_names(spec: NodeSpec, xs: Sequence[str], zs: Sequence[str], inputs: Sequence[Any]) -> None:
    if len(inputs) != len(xs) + len(zs):
        raise _error(spec, f"has {len(inputs)} inputs but xs and zs name {len(xs) + len(zs)} tensors; "
                     "input i must be the value of the i-th name of xs followed by zs")
    for name, value in zip(xs, inputs):
        if not jnp.issubdtype(jnp.result_type(value), jnp.floating):
            raise _error(spec, f"xs names {name!r}, a {jnp.result_type(value)} tensor; only float "
                         "tensors can be differentiated (move it to zs)")


def _is_float(value: Any) -> bool:
    return hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.floating)


def _run_differentiated(spec: NodeSpec, scope: ChainMap, evaluation: Evaluation, gradient_spec: NodeSpec) -> None:
    """Run a node of the gradient's slice inside jax.vjp. A node without a gradient on the
    path from xs is an error: its outputs would silently count as constants."""
    run_node(spec, scope, evaluation)
    graph_slice = _slice_of(gradient_spec)
    if id(spec) in graph_slice.depends_on_xs and not spec.differentiable and any(
            _is_float(scope[name]) for name in spec.proto.output if name):
        raise _error(gradient_spec, f"the path from xs to y={_names(gradient_spec)[2]!r} runs through "
                     f"{spec.label}, which has no gradient; name its inputs in zs instead of xs, or "
                     "cut the path")


def _y_value(spec: NodeSpec, scope: ChainMap) -> jax.Array:
    y = _names(spec)[2]
    if y not in scope:
        raise _error(spec, f"y={y!r} is not computed by the graph holding this node")
    return jnp.asarray(scope[y])


def _forward_group(spec: NodeSpec, index: int) -> NodeGroup | None:
    """The nodes of this Gradient's slice that depend on xs or zs (with the later nodes they
    read, moved ahead) as a NodeGroup run under jax.vjp; None where that would not be the
    same computation: inputs other than the tensors xs and zs name, a Gradient among the
    nodes (second order replays), or nodes that cannot be moved ahead of the group."""
    if "xs" not in spec.attrs or "y" not in spec.attrs:
        return None
    xs, zs, _ = _names(spec)
    if list(spec.proto.input) != [*xs, *zs]:
        return None
    plan: GraphPlan = spec.graph
    graph_slice = _slice_of(spec)
    position = {id(node): number for number, node in enumerate(plan.nodes)}
    block = sorted(position[id(node)] for node in graph_slice.nodes if id(node) in graph_slice.depends_on_inputs)
    if not block or block[-1] > index or any(plan.nodes[number].group is not None for number in block):
        return None
    ahead = _moved_ahead(plan, block, [*xs, *zs])
    if ahead is None:
        return None

    def run(scope: ChainMap, evaluation: Evaluation) -> None:
        for number in ahead:
            run_node(plan.nodes[number], scope, evaluation)
        if any(name not in scope for name in zs) or any(name not in scope or is_host(scope[name]) for name in xs):
            # Node by node: the errors name the missing inputs, and a forward pass folded on
            # the host stays so (the Gradient node replays it).
            for number in block:
                run_node(plan.nodes[number], scope, evaluation)
            return
        points = [scope[name] for name in xs]
        _check_names(spec, xs, zs, [*points, *(scope[name] for name in zs)])
        host_values: dict[str, Any] = {}

        def forward(x_values: list[jax.Array]) -> tuple[jax.Array, dict[str, Any]]:
            local: dict[str, Any] = {}
            inner = ChainMap(local, dict(zip(xs, x_values)), scope)
            if evaluation.recompute:
                run_plan_segments(plan, block, inner, evaluation,
                                  lambda node, where, run: _run_differentiated(node, where, run, spec))
            else:
                run_positions(plan, block, inner, evaluation,
                              lambda node, where, run: _run_differentiated(node, where, run, spec))
            host_values.update((name, value) for name, value in local.items() if is_host(value))
            return _y_value(spec, inner), {name: value for name, value in local.items() if name not in host_values}

        value, pullback, traced = jax.vjp(forward, [jnp.asarray(point) for point in points], has_aux=True)
        scope.maps[0].update(traced)
        scope.maps[0].update(host_values)
        evaluation.handed_on[id(spec)] = (value, pullback)

    return NodeGroup(block[0], frozenset([*ahead, *block]), run)


def _moved_ahead(plan: GraphPlan, block: list[int], cut: list[str]) -> list[int] | None:
    """The nodes after the block's first that the block reads from (directly, or through
    other such nodes), in plan order, to run before it; None if one of them reads the block."""
    producers = {name: number for number, node in enumerate(plan.nodes) for name in node.proto.output if name}
    members = set(block)
    outputs = {name for number in block for name in plan.nodes[number].proto.output if name}
    ahead: set[int] = set()
    pending = [*cut, *(name for number in block for name in node_reads(plan.nodes[number]))]
    while pending:
        number = producers.get(pending.pop())
        if number is None or number < block[0] or number in members or number in ahead:
            continue
        reads = node_reads(plan.nodes[number])
        if reads & outputs:
            return None
        ahead.add(number)
        pending.extend(reads)
    return sorted(ahead)


@op("Gradient", since=1, domain=TRAINING_DOMAIN, group=_forward_group)
def gradient(node: Node, *inputs: Any) -> tuple[Any, ...]:
    """d(sum y)/dx for every x in xs, at the values given as inputs."""
    xs, zs, _ = list(node.attr("xs")), list(node.attr("zs", [])), node.attr("y")
    # The node's forward group (checked as it ran), or a replay from the node's inputs.
    forward = node.evaluation.handed_on.pop(id(node.spec), None)
    if forward is None:
        _check_names(node.spec, xs, zs, inputs)
        forward = _replayed(node, xs, zs, inputs)
    value, pullback = forward
    (grads,) = pullback(jnp.ones_like(value))
    return tuple(row_major(grad) for grad in grads)


def _replayed(node: Node, xs: list[str], zs: list[str], inputs: Sequence[Any]) -> tuple:
    """(y, pullback) of the slice replayed under jax.vjp from the node's own inputs."""
    graph_slice = _slice_of(node.spec)
    z_values = dict(zip(zs, inputs[len(xs):]))
    evaluation = node.evaluation.replay()

    def function(x_values: list[jax.Array]) -> jax.Array:
        scope = ChainMap({**z_values, **dict(zip(xs, x_values))}, node.scope)
        for spec in graph_slice.nodes:
            outputs = [name for name in spec.proto.output if name]
            if id(spec) not in graph_slice.depends_on_inputs and all(n in node.scope for n in outputs):
                continue
            _run_differentiated(spec, scope, evaluation, node.spec)
        return _y_value(node.spec, scope)

    value, pullback = jax.vjp(function, [jnp.asarray(value) for value in inputs[:len(xs)]])
    return value, pullback
