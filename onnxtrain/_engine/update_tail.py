"""The update tail of a training step: the elementwise nodes at the end of the algorithm graph
that turn gradients and old state into the bound new values (the optimizer ops, a counter's
increment). Recomputing them costs one more pass over the state, where computing the whole
new state before writing any of it costs a second copy of the state; a checked step on a large
model takes the first (see strategies.CheckThenUpdate).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass

from onnxtrain.translate.graph import GraphPlan
from onnxtrain.translate.node import NodeSpec
from onnxtrain.translate.registry import DEFAULT_DOMAIN, TRAINING_DOMAIN, normalize_domain

# Ops whose outputs are computed element by element from their inputs (with broadcasting).
_ELEMENTWISE = {
    DEFAULT_DOMAIN: frozenset({"Abs", "Add", "Cast", "CastLike", "Clip", "Div", "Exp", "Identity", "Log",
                               "Max", "Mean", "Min", "Mul", "Neg", "Pow", "Reciprocal", "Sign", "Sqrt",
                               "Sub", "Sum", "Where"}),
    TRAINING_DOMAIN: frozenset({"Adagrad", "Adam", "Momentum"}),
}


@dataclass(frozen=True)
class UpdateTail:
    """Node indices (in plan order) and the names they read but do not produce, together with
    bound values produced before the tail (the caller must supply both to recompute it)."""

    nodes: tuple[int, ...]
    reads: tuple[str, ...]


def _elementwise(spec: NodeSpec) -> bool:
    ops = _ELEMENTWISE.get(normalize_domain(spec.proto.domain), frozenset())
    return spec.proto.op_type in ops and not spec.subgraphs and not spec.random


def update_tail(plan: GraphPlan, bound: Collection[str]) -> UpdateTail:
    """The largest set of elementwise nodes whose outputs feed only each other and the bound
    values: nothing else the step computes or returns depends on them."""
    consumers: dict[str, set[int]] = defaultdict(set)
    for index, spec in enumerate(plan.nodes):
        for name in spec.proto.input:
            consumers[name].add(index)
    returned = set(plan.outputs) - set(bound)
    tail: set[int] = set()
    for index in reversed(range(len(plan.nodes))):
        spec = plan.nodes[index]
        outputs = [name for name in spec.proto.output if name]
        if _elementwise(spec) and all(consumers[name] <= tail and name not in returned for name in outputs):
            tail.add(index)
    produced = {name for index in tail for name in plan.nodes[index].proto.output}
    read = {name for index in tail for name in plan.nodes[index].proto.input if name}
    return UpdateTail(tuple(sorted(tail)), tuple(sorted((read | set(bound)) - produced)))
