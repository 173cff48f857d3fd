"""Element-wise chains recomputed in the backward pass instead of kept for it.

Exporters spell activations as chains of element-wise nodes: transformers' GPT-2 GELU
becomes eight (0.5x, x^3, 0.044715x^3, x + ..., a scale, Tanh, 1 + t, the product), SiLU two,
the erf GELU five. Differentiated node by node, such a chain keeps several intermediates for
its backward pass, each as large as its input, though one value (the chain's input) is all
its derivative needs. A *pointwise region* is such a chain: element-wise nodes whose
intermediates nothing outside reads. A traced walk runs it as `recomputed(region, x, ...)`
(see translate.recompute) of the traced values it reads: the backward pass keeps those only
(the chain's input, and any scalars passed as arguments) and recomputes the chain, which
costs a few element-wise passes and saves the intermediates' memory. The forward values are
those of the nodes run one by one.

Regions are found once per plan from its structure; whether one runs as a region is decided
at each walk, where it is known which of its outside inputs are traced.
"""

from __future__ import annotations

import os
from collections import ChainMap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from onnxtrain.translate.recompute import recomputed
from onnxtrain.translate.registry import normalize_domain

# Element-wise ops of the default domain that a region may hold (deterministic, one output,
# no attribute that changes shapes).
_UNARY = {"Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Cos", "Cosh", "Elu", "Erf", "Exp",
          "Floor", "Gelu", "HardSigmoid", "HardSwish", "LeakyRelu", "Log", "Mish", "Neg", "Reciprocal", "Relu",
          "Round", "Selu", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus", "Softsign", "Sqrt", "Tan", "Tanh",
          "ThresholdedRelu", "Celu", "Identity"}
_BINARY = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"}
# Ops whose derivative reads a value of the forward pass: a region without one keeps nothing
# its backward pass would not keep anyway.
_KEEPING = {"Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Cos", "Cosh", "Elu", "Erf", "Exp", "Gelu",
            "HardSigmoid", "HardSwish", "Log", "Mish", "Reciprocal", "Selu", "Sigmoid", "Sin", "Sinh", "Softplus",
            "Softsign", "Sqrt", "Tan", "Tanh", "Celu", "Div", "Pow", "Mul"}
# ONNXTRAIN_POINTWISE_REGIONS=0 runs every node on its own (to compare, or to debug numerics).
ENABLED = os.environ.get("ONNXTRAIN_POINTWISE_REGIONS", "1") != "0"
# A region of fewer nodes keeps at most one value beside its input: not worth a custom rule.
MIN_NODES = 2


@dataclass(frozen=True)
class Region:
    """Plan positions of a region's nodes (ascending; the last, `tail`, computes `output`)
    and the names they read from outside it."""

    members: tuple[int, ...]
    reads: tuple[str, ...]
    output: str


def _pointwise(spec: Any) -> bool:
    proto = spec.proto
    return (normalize_domain(proto.domain) == "" and not spec.random and not spec.subgraphs
            and len(proto.output) == 1 and bool(proto.output[0])
            and (proto.op_type in _UNARY and len(proto.input) == 1
                 or proto.op_type in _BINARY and len(proto.input) == 2 and all(proto.input)))


def find_regions(nodes: list[Any], outputs: list[str], reads: Callable[[Any], set[str]]) -> dict[int, Region]:
    """The regions of a plan's nodes, by tail position.

    Args:
        nodes: the plan's node specs, in order.
        outputs: the plan's output names (read from outside every region).
        reads: the names a node spec reads (inputs, and its subgraphs' outer names).

    Returns:
        {tail position: Region}; no node is in two regions.
    """
    readers: dict[str, set[int]] = {}
    for index, spec in enumerate(nodes):
        for name in reads(spec):
            readers.setdefault(name, set()).add(index)
    candidates = [index for index, spec in enumerate(nodes) if _pointwise(spec)]
    producer = {nodes[index].proto.output[0]: index for index in candidates}
    exported = set(outputs)
    # A set grown from any of a grown set's members lies inside it, so a rejected set rules
    # out all its members as tails too: every node is grown into at most once.
    visited: set[int] = set()
    regions: dict[int, Region] = {}
    for tail in reversed(candidates):
        if tail in visited:
            continue
        members = _grow(tail, nodes, producer, readers, exported, visited)
        visited |= members
        if len(members) < MIN_NODES or not any(nodes[i].proto.op_type in _KEEPING for i in members):
            continue
        produced = {nodes[i].proto.output[0] for i in members}
        outside = sorted({name for i in members for name in nodes[i].proto.input} - produced)
        regions[tail] = Region(tuple(sorted(members)), tuple(outside), nodes[tail].proto.output[0])
    return regions


def _grow(tail: int, nodes: list[Any], producer: dict[str, int], readers: dict[str, set[int]],
          exported: set[str], visited: set[int]) -> set[int]:
    """The largest set of element-wise nodes ending at `tail` whose intermediates only its
    own members read: a producer joins once all readers of its output are members."""
    members = {tail}
    waiting = list(nodes[tail].proto.input)
    grown = True
    while grown:
        # A name read by a node not yet a member may qualify once that node joins.
        grown, deferred = False, []
        for name in waiting:  # grows while it is walked: each new member's inputs join it
            source = producer.get(name)
            if source is None or source in members or source in visited or name in exported:
                continue
            if readers.get(name, set()) <= members:
                members.add(source)
                waiting.extend(nodes[source].proto.input)
                grown = True
            else:
                deferred.append(name)
        waiting = deferred
    return members


def run_region(region: Region, scope: ChainMap, run: Callable[[int, ChainMap], None],
               is_host: Callable[[Any], bool]) -> bool:
    """Bind the region's output in scope.maps[0], computed by `recomputed` from the traced
    values it reads (the chain's input, and weights a model passes as arguments rather than
    constants, such as a frozen base's scalars); False (nothing run) when none is a float.
    `run(position, scope)` evaluates one node."""
    traced = [name for name in region.reads if not is_host(scope[name])]
    values = [scope[name] for name in traced]
    if not any(hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.floating) for value in values):
        return False

    def chain(*arguments: Any) -> Any:
        inner = ChainMap({}, dict(zip(traced, arguments)), scope)
        for position in region.members:
            run(position, inner)
        return inner.maps[0][region.output]

    scope.maps[0][region.output] = recomputed(chain, *values)
    return True
