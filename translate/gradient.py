"""The Gradient operator of ai.onnx.preview.training: gradients named by tensor names.

Gradient(xs, zs, y) differentiates the function y <- (xs, zs) that the graph
holding the node defines (the main graph, or main + algorithm for a training
step), evaluated at the node's own inputs rather than at the tensors' current
values. We slice that function out of the node's GraphPlan once (every node on
a path to y, stopping at the names in xs and zs), replay it under jax.vjp and
pull back a ones cotangent, so a non-scalar y gives the gradient of sum(y).
Tensors y depends on outside xs and zs are constants at their current values.
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

from onnxtrain.translate.graph import GraphPlan, node_reads, run_node
from onnxtrain.translate.node import Node, NodeSpec
from onnxtrain.translate.registry import TRAINING_DOMAIN, op


@dataclass
class _Slice:
    """The nodes to replay, in graph order, and which of them depend on xs (or zs)."""

    nodes: list[NodeSpec]
    depends_on_xs: set[int]
    depends_on_inputs: set[int]


def _slice(node: Node, plan: GraphPlan, xs: Sequence[str], zs: Sequence[str], y: str) -> _Slice:
    cut = set(xs) | set(zs)
    producers = {name: spec for spec in plan.nodes for name in spec.proto.output if name}
    wanted: set[int] = set()
    pending = [y]
    while pending:
        name = pending.pop()
        spec = producers.get(name)
        if name in cut or spec is None or id(spec) in wanted or spec is node.spec:
            continue
        wanted.add(id(spec))
        pending.extend(node_reads(spec))
    nodes = [spec for spec in plan.nodes if id(spec) in wanted]
    return _Slice(nodes, _downstream(nodes, xs), _downstream(nodes, cut))


def _downstream(nodes: list[NodeSpec], names: Sequence[str] | set[str]) -> set[int]:
    """The nodes (ids) that read any of `names`, directly or through earlier nodes."""
    tainted, found = set(names), set()
    for spec in nodes:
        if node_reads(spec) & tainted:
            found.add(id(spec))
            tainted |= {name for name in spec.proto.output if name}
    return found


def _check_names(node: Node, xs: Sequence[str], zs: Sequence[str], inputs: Sequence[Any]) -> None:
    if len(inputs) != len(xs) + len(zs):
        raise node.error(f"has {len(inputs)} inputs but xs and zs name {len(xs) + len(zs)} tensors; "
                         "input i must be the value of the i-th name of xs followed by zs")
    for name, value in zip(xs, inputs):
        if not jnp.issubdtype(jnp.result_type(value), jnp.floating):
            raise node.error(f"xs names {name!r}, a {jnp.result_type(value)} tensor; only float "
                             "tensors can be differentiated (move it to zs)")


def _is_float(value: Any) -> bool:
    return hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.floating)


@op("Gradient", since=1, domain=TRAINING_DOMAIN)
def gradient(node: Node, *inputs: Any) -> tuple[Any, ...]:
    """d(sum y)/dx for every x in xs, at the values given as inputs."""
    xs, zs, y = list(node.attr("xs")), list(node.attr("zs", [])), node.attr("y")
    _check_names(node, xs, zs, inputs)
    plan = node.spec.graph
    if "slice" not in node.spec.cache:
        node.spec.cache["slice"] = _slice(node, plan, xs, zs, y)
    graph_slice: _Slice = node.spec.cache["slice"]
    z_values = dict(zip(zs, inputs[len(xs):]))
    evaluation = node.evaluation.replay()

    def function(x_values: list[jax.Array]) -> jax.Array:
        scope = ChainMap({**z_values, **dict(zip(xs, x_values))}, node.scope)
        for spec in graph_slice.nodes:
            outputs = [name for name in spec.proto.output if name]
            if id(spec) not in graph_slice.depends_on_inputs and all(n in node.scope for n in outputs):
                continue
            run_node(spec, scope, evaluation)
            if id(spec) in graph_slice.depends_on_xs and not spec.differentiable and any(
                    _is_float(scope[name]) for name in outputs):
                raise node.error(
                    f"the path from xs to y={y!r} runs through {spec.label}, which has no "
                    "gradient; name its inputs in zs instead of xs, or cut the path")
        if y not in scope:
            raise node.error(f"y={y!r} is not computed by the graph holding this node")
        return jnp.asarray(scope[y])

    points = [jnp.asarray(value) for value in inputs[:len(xs)]]
    value, pullback = jax.vjp(function, points)
    (grads,) = pullback(jnp.ones_like(value))
    return tuple(grads)
