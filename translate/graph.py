"""Walk an ONNX graph in order and evaluate it as one JAX computation.

Translation (once per model) turns every graph, subgraph and model-local
function call into a GraphPlan: node specs with their handler, opset and
decoded attributes. Evaluation (once per trace) walks a plan with an
environment of named values. Nested graphs see outer names through a
ChainMap, so an If branch or Loop body reads outer values without copying.

A node whose inputs are all host constants is evaluated on the spot (under
jax.ensure_compile_time_eval) and its outputs stay host constants; that is
how shape arithmetic folds away at trace time.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from onnxtrain.errors import ModelLoadError, UnsupportedOpError
from onnxtrain.proto import FunctionProto, GraphProto, NodeProto, ValueInfoProto
from onnxtrain.translate.node import (
    Evaluation,
    Node,
    NodeSpec,
    decode_attribute,
    node_label,
    sparse_to_dense,
)
from onnxtrain.translate import pointwise
from onnxtrain.translate.recompute import recomputed, run_segments
from onnxtrain.translate.tensors import MAX_RANK, tensor_to_numpy
from onnxtrain.translate.registry import model_opsets, normalize_domain, resolve
from onnxtrain.translate.validation import check_graph, initializer_names
from onnxtrain.translate.values import NeedsHostValues, as_operands, is_host, mixes_traced, to_host


@dataclass
class NodeGroup:
    """Nodes of a plan that a traced walk evaluates together, when it reaches the first of
    them (`start`), rather than one by one: the forward pass a Gradient node differentiates,
    run once under jax.vjp (see translate.gradient). `run(scope, evaluation)` binds the
    outputs of every node at `members` (plan indices, `start` the lowest)."""

    start: int
    members: frozenset[int]
    run: Callable[[ChainMap, Evaluation], None]


@dataclass
class GraphPlan:
    """A graph ready to evaluate: its input/output names and node specs in order."""

    name: str
    inputs: list[str]
    outputs: list[str]
    nodes: list[NodeSpec]
    # The graph's own initializers that are not parameters: name -> host array.
    constants: dict[str, Any]
    # The node groups of traced walks by start index, worked out at the first walk.
    groups: dict[int, NodeGroup] | None = None
    # The plan's depth (see plan_depth), worked out once.
    depth: int | None = None
    # Output name -> the DequantizeLinear node computing it from stored tensors only (a
    # quantized weight), and the Transpose/Identity nodes after it, worked out at the first
    # walk of a model with quantized weights.
    dequantizers: dict[str, list[NodeSpec]] | None = None
    # The pointwise regions by tail position (see translate.pointwise), worked out at the
    # first traced walk.
    regions: dict[int, pointwise.Region] | None = None


def iter_initializers(graph: GraphProto, wanted: Callable[[str], bool] = lambda name: True,
                      empty_sparse_as_shape: bool = False
                      ) -> Iterator[tuple[str, np.ndarray | jax.ShapeDtypeStruct]]:
    """(name, numpy array) for the initializers `wanted` accepts, decoded one at a time, so a
    caller that keeps only some of them (or moves each to the device) never holds them all.
    empty_sparse_as_shape: a sparse initializer with no entries (all zeros) comes as its shape
    and dtype, for a caller that can make zeros more cheaply than copy them."""
    for tensor in graph.initializer:
        if wanted(tensor.name):
            yield tensor.name, tensor_to_numpy(tensor, f"initializer {tensor.name!r}")
    for sparse in graph.sparse_initializer:
        if wanted(sparse.values.name):
            where = f"sparse initializer {sparse.values.name!r}"
            if empty_sparse_as_shape and 0 in sparse.values.dims:
                dtype = tensor_to_numpy(sparse.values, where).dtype
                yield sparse.values.name, jax.ShapeDtypeStruct(tuple(sparse.dims), dtype)
            else:
                yield sparse.values.name, sparse_to_dense(sparse, where)


def graph_initializers(graph: GraphProto) -> dict[str, np.ndarray]:
    """Dense and sparse initializers of a graph as numpy arrays, by name."""
    return dict(iter_initializers(graph))


class Translator:
    """Builds GraphPlans for one model: opsets, local functions, missing-op report."""

    def __init__(self, opsets: Mapping[str, int], functions: Sequence[FunctionProto]):
        self.opsets = {normalize_domain(d): v for d, v in opsets.items()}
        self.functions = {(f.domain, f.name, f.overload): f for f in functions}
        self.missing: dict[tuple[str, str, int], list[str]] = {}
        # Functions whose bodies are being planned, outermost first: a call back into one recurses.
        self._calling: list[FunctionProto] = []

    def plan(self, graph: GraphProto, constants: Mapping[str, Any] | None = None,
             opsets: Mapping[str, int] | None = None, where: str = "main graph") -> GraphPlan:
        opsets = self.opsets if opsets is None else opsets
        nodes = [self._spec(node, opsets, where) for node in graph.node]
        plan = GraphPlan(
            name=graph.name,
            inputs=[value.name for value in graph.input],
            outputs=[value.name for value in graph.output],
            nodes=[spec for spec in nodes if spec is not None],
            constants=dict(constants or {}),
        )
        for spec in plan.nodes:
            spec.graph = plan
        return plan

    def _spec(self, node: NodeProto, opsets: Mapping[str, int], where: str) -> NodeSpec | None:
        label = f"{node_label(node)} in {where}"
        domain = normalize_domain(node.domain)
        attrs = {a.name: decode_attribute(a, label) for a in node.attribute if not a.ref_attr_name}
        function = self.functions.get((node.domain, node.op_type, node.overload))
        if function is not None:
            return self._function_spec(node, function, attrs, label)
        version = opsets.get(domain)
        handler = resolve(domain, node.op_type, version) if version is not None else None
        if handler is None:
            self.missing.setdefault((domain or "ai.onnx", node.op_type, version or 0), []).append(
                node.name or "(unnamed)")
            return None
        spec = NodeSpec(node, label, version, attrs, handler.fn, handler.static_inputs,
                        handler.random, handler.differentiable, handler.group)
        for attribute in node.attribute:
            if attribute.type == attribute.GRAPH:
                spec.subgraphs[attribute.name] = self.plan(
                    attribute.g, graph_initializers(attribute.g), opsets,
                    f"attribute {attribute.name!r} of {label}")
        return spec

    def _function_spec(self, node: NodeProto, function: FunctionProto, attrs: dict[str, Any],
                       label: str) -> NodeSpec:
        """A call of a model-local function: its body planned with this call's attributes."""
        if function in self._calling:
            chain = " -> ".join(f"{f.domain}::{f.name}" for f in [*self._calling, function])
            raise ModelLoadError(
                f"{label}: function {function.domain}::{function.name} calls itself ({chain}); "
                f"ONNX functions cannot recurse, so break the cycle in the model's functions")
        values = {a.name: decode_attribute(a, label) for a in function.attribute_proto}
        values.update(attrs)
        body = GraphProto(name=function.name, node=_bind_attributes(function.node, values, label),
                          input=[ValueInfoProto(name=name) for name in function.input],
                          output=[ValueInfoProto(name=name) for name in function.output])
        check_graph(body, f"function {function.domain}::{function.name} (called by {label})")
        opsets = dict(self.opsets)
        opsets.update(model_opsets(function.opset_import))
        self._calling.append(function)
        try:
            plan = self.plan(body, opsets=opsets, where=f"function {function.domain}::{function.name}")
        finally:
            self._calling.pop()
        plan.inputs = list(function.input)
        plan.outputs = list(function.output)

        def call(node_call: Node, *inputs: Any) -> tuple:
            # A function body sees only its own inputs, never the caller's scope.
            return tuple(evaluate_plan(plan, inputs, {}, node_call.evaluation))

        return NodeSpec(node, label, 1, values, call, subgraphs={"body": plan})

    def check_complete(self, what: str) -> None:
        """One UnsupportedOpError listing every node no handler or function covers."""
        if not self.missing:
            return
        lines = [f"  {domain}::{op} (opset {version}): nodes {', '.join(names)}"
                 for (domain, op, version), names in sorted(self.missing.items())]
        raise UnsupportedOpError(
            f"{what} uses {len(self.missing)} operator(s) onnxtrain does not implement:\n"
            + "\n".join(lines)
            + "\nRe-export the model with supported operators, or open an issue naming them."
        )


def _bind_attributes(nodes: Sequence[NodeProto], values: Mapping[str, Any],
                     label: str) -> list[NodeProto]:
    """Copies of a function body's nodes with ref_attr_name attributes resolved."""
    from onnxtrain.proto.make import attribute as make_attribute

    bound = []
    for node in nodes:
        copy = NodeProto()
        copy.CopyFrom(node)
        del copy.attribute[:]
        for attribute in node.attribute:
            if not attribute.ref_attr_name:
                copy.attribute.append(attribute)
            elif attribute.ref_attr_name in values:
                copy.attribute.append(make_attribute(attribute.name, values[attribute.ref_attr_name]))
        bound.append(copy)
    return bound


def _bind_outputs(spec: NodeSpec, scope: dict[str, Any], result: Any) -> None:
    """Name the handler's outputs; a tuple is several outputs, anything else one."""
    outputs = result if isinstance(result, tuple) else (result,)
    for index, name in enumerate(spec.proto.output):
        if not name:
            continue
        if index >= len(outputs):
            raise UnsupportedOpError(
                f"{spec.label}: output {index} ({name!r}) is not implemented; only the first "
                f"{len(outputs)} are")
        scope[name] = outputs[index]


def run_node(spec: NodeSpec, scope: ChainMap, evaluation: Evaluation) -> None:
    """Evaluate one node in `scope`, binding its outputs in the innermost map."""
    try:
        inputs = [scope[name] if name else None for name in spec.proto.input]
    except KeyError as missing:
        raise ModelLoadError(
            f"{spec.label}: input {missing.args[0]!r} is not produced by any earlier node, "
            f"initializer or graph input") from None
    host = evaluation.eager or (not spec.random and all(is_host(v) for v in inputs))
    for index in spec.static_inputs:
        if index < len(inputs) and not is_host(inputs[index]):
            raise NeedsHostValues(
                spec.label,
                f"needs input {index} ({spec.proto.input[index]!r}) known before running, "
                f"but it is computed from graph inputs")
    if not host and not spec.subgraphs and mixes_traced(inputs):
        # Not control flow, which passes values on to subgraphs whose nodes decide for themselves.
        inputs = as_operands(inputs, spec.static_inputs)
    node = Node(spec, evaluation, scope, host)
    late = _dequantized_inputs(spec) if evaluation.quantized and not host else {}
    if late and not spec.random and not spec.subgraphs:
        _bind_outputs(spec, scope.maps[0], _call_dequantizing(spec, node, inputs, late, scope, evaluation))
        return
    if host and not spec.random:
        with jax.ensure_compile_time_eval():
            result = _call(spec, node, inputs)
        result = _concrete_to_host(result)
    else:
        result = _call(spec, node, inputs)
        if evaluation.eager:
            result = _concrete_to_host(result)
    _bind_outputs(spec, scope.maps[0], result)


# Ops a dequantized weight may pass through on its way to the node that computes with it.
_WEIGHT_LAYOUT_OPS = frozenset({"Transpose", "Identity"})


def _dequantized_inputs(spec: NodeSpec) -> dict[int, list[NodeSpec]]:
    """The node's inputs (by position) that a DequantizeLinear of stored tensors computes,
    directly or through Transpose/Identity nodes: each as that chain of nodes."""
    plan = spec.graph
    if plan is None:
        return {}
    if plan.dequantizers is None:
        produced = {name for node in plan.nodes for name in node.proto.output if name}
        chains: dict[str, list[NodeSpec]] = {}
        for node in plan.nodes:
            inputs = [name for name in node.proto.input if name]
            if not node.proto.output or normalize_domain(node.proto.domain) != "":
                continue
            if node.proto.op_type == "DequantizeLinear" and not set(inputs) & produced:
                chains[node.proto.output[0]] = [node]
            elif node.proto.op_type in _WEIGHT_LAYOUT_OPS and len(inputs) == 1 and inputs[0] in chains:
                chains[node.proto.output[0]] = [*chains[inputs[0]], node]
        plan.dequantizers = chains
    return {index: plan.dequantizers[name] for index, name in enumerate(spec.proto.input)
            if name in plan.dequantizers}


def _call_dequantizing(spec: NodeSpec, node: Node, inputs: list[Any], late: dict[int, list[NodeSpec]],
                       scope: ChainMap, evaluation: Evaluation) -> Any:
    """The node's result with each dequantized weight among its inputs dequantized here, from
    the integers, and again when the backward pass reaches the node: no step keeps a
    layer's float weight from its forward pass to its backward pass (see translate.recompute)."""
    traced = [index for index, value in enumerate(inputs) if index not in late and not is_host(value)]
    stored = {index: [scope[name] if name else None for name in chain[0].proto.input]
              for index, chain in late.items()}

    def consumer(values: list[Any], operands: dict[int, list[Any]]) -> Any:
        full = list(inputs)
        for index, value in zip(traced, values):
            full[index] = value
        for index, chain in late.items():
            value = _call(chain[0], Node(chain[0], evaluation, scope, False), operands[index])
            for step in chain[1:]:
                value = _call(step, Node(step, evaluation, scope, False), [value])
            full[index] = value
        return _call(spec, node, full)

    return recomputed(consumer, [inputs[index] for index in traced], stored, after_first=True)


def _check_ranks(spec: NodeSpec, result: Any) -> None:
    """No output of more dims than numpy and XLA hold: jax would accept one while tracing and
    fail later, deep in compilation, without naming the node."""
    for index, value in enumerate(result if isinstance(result, tuple) else (result,)):
        if hasattr(value, "shape") and len(value.shape) > MAX_RANK:
            raise ModelLoadError(
                f"{spec.label}: output {index} has {len(value.shape)} dimensions; numpy and XLA hold "
                f"at most {MAX_RANK}. Fix the shapes the node is given.")


# What an op handler raises when a node's inputs or attributes do not fit its operator: too
# many or too few inputs, a required input left empty (None, whose missing attributes raise
# AttributeError), shapes that do not broadcast; and what numpy raises for sizes it cannot
# hold (a count beyond int64, an allocation that fails).
_MISFIT_ERRORS = (TypeError, ValueError, IndexError, KeyError, AttributeError, OverflowError, MemoryError)


def _described(value: Any) -> str:
    if value is None:
        return "empty"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    return f"{dtype}{list(shape)}" if shape is not None else type(value).__name__


def _call(spec: NodeSpec, node: Node, inputs: list[Any]) -> Any:
    """The handler's result; a misfit error becomes a ModelLoadError naming the node and its inputs."""
    try:
        result = spec.call(node, *inputs)
    except _MISFIT_ERRORS as error:
        described = ", ".join(f"{name or '(empty)'}: {_described(value)}"
                              for name, value in zip(spec.proto.input, inputs))
        raise ModelLoadError(
            f"{spec.label}: cannot be computed from inputs [{described}] ({type(error).__name__}: "
            f"{error}). Fix the node's inputs or attributes in the model, or the shapes of the "
            f"feeds.") from None
    _check_ranks(spec, result)
    return result


def _concrete_to_host(result: Any) -> Any:
    """Host-evaluated outputs as numpy; tracers (from outer scopes) stay as they are."""
    if isinstance(result, tuple):
        return tuple(_concrete_to_host(item) for item in result)
    if isinstance(result, jax.core.Tracer):
        return result
    if isinstance(result, list):
        return [_concrete_to_host(item) for item in result]
    if isinstance(result, dict):
        return {key: _concrete_to_host(item) for key, item in result.items()}
    return to_host(result)


def node_reads(spec: NodeSpec) -> set[str]:
    """Every name a node reads: its inputs and the outer names its subgraphs use."""
    names = {name for name in spec.proto.input if name}
    for subplan in spec.subgraphs.values():
        names |= free_names(subplan)
    return names


def free_names(plan: GraphPlan) -> set[str]:
    """Names a graph (with the graphs nested in it) reads from its enclosing scopes."""
    defined = set(plan.inputs) | set(plan.constants)
    free: set[str] = set()
    for spec in plan.nodes:
        free |= node_reads(spec) - defined
        defined |= set(spec.proto.output)
    return free | (set(plan.outputs) - defined)


# The deepest plan onnxtrain compiles (see plan_depth). XLA's compiler recurses once per
# link of a chain of dependent operations, on the C stack of the thread that compiles, and a
# deeper program overflows that stack and kills the process; a training step, whose backward
# pass continues the forward chain, is about twice as deep as the model.
MAX_GRAPH_DEPTH = 5000


def check_depth(plan: GraphPlan, what: str) -> None:
    """Refuse a plan deeper than MAX_GRAPH_DEPTH before anything compiles it.

    Raises:
        UnsupportedOpError: naming the depth found and the limit.
    """
    depth = plan_depth(plan)
    if depth > MAX_GRAPH_DEPTH:
        raise UnsupportedOpError(
            f"{what}: its longest chain of dependent nodes is {depth} nodes long, over the "
            f"{MAX_GRAPH_DEPTH} onnxtrain compiles: XLA's compiler recurses along such chains and "
            "would overflow its stack and crash the process. Shorten the chain (a Sum of many "
            "inputs rather than a chain of Adds), or split the model into several.")


def plan_depth(plan: GraphPlan) -> int:
    """The longest chain of dependent nodes in the plan: what XLA's compiler recurses along.

    A node counts 1 plus the depth of its deepest graph attribute (an If branch, a Loop
    body, a function body); names from outside the plan start at depth 0. Host-constant
    arithmetic that folds away while tracing is counted too, so this bounds the depth of
    the compiled program from above (times the few XLA operations an ONNX node becomes).
    """
    if plan.depth is None:
        depth_of: dict[str, int] = {}
        deepest = 0
        for spec in plan.nodes:
            start = max((depth_of.get(name, 0) for name in node_reads(spec)), default=0)
            depth = start + 1 + max((plan_depth(sub) for sub in spec.subgraphs.values()), default=0)
            depth_of.update((name, depth) for name in spec.proto.output if name)
            deepest = max(deepest, depth)
        plan.depth = deepest
    return plan.depth


def any_node(plan: GraphPlan, test: Callable[[NodeSpec], bool]) -> bool:
    """True when `test` holds for a node of the plan or of any graph or function body nested in it."""
    return any(test(spec) or any(any_node(sub, test) for sub in spec.subgraphs.values())
               for spec in plan.nodes)


def draws_random(plan: GraphPlan) -> bool:
    return any_node(plan, lambda spec: spec.random)


def evaluate_plan(plan: GraphPlan, inputs: Sequence[Any], outer: Mapping[str, Any],
                  evaluation: Evaluation) -> list[Any]:
    """Evaluate a plan: bind inputs (in order), run the nodes, return the outputs."""
    return plan_outputs(plan, evaluate_nodes(plan, range(len(plan.nodes)), inputs, outer, evaluation))


def evaluate_nodes(plan: GraphPlan, indices: Iterable[int], inputs: Sequence[Any], outer: Mapping[str, Any],
                   evaluation: Evaluation, segmented: bool = False, keep: Iterable[str] = ()) -> ChainMap:
    """Bind a plan's inputs (in order) and run the nodes at `indices` (in plan order); every
    value then named, except the intermediates of pointwise regions (see translate.pointwise)
    that are not in `keep`. `outer` must hold whatever those nodes read that they do not
    produce. A traced walk evaluates a NodeGroup whose members are all among `indices` as one,
    and a pointwise region likewise.
    segmented: a traced walk of a plan without groups runs its nodes in recomputed
    segments (activation recomputation, see translate.recompute)."""
    local: dict[str, Any] = dict(plan.constants)
    for name, value in zip(plan.inputs, inputs):
        if name:
            local[name] = value
    scope = ChainMap(local, outer)
    indices = list(indices)
    groups = {} if evaluation.eager else _groups(plan)
    if segmented and not evaluation.eager and not groups:
        run_plan_segments(plan, indices, scope, evaluation)
        return scope
    wanted = set(indices)
    grouped = {i for group in groups.values() if group.members <= wanted for i in group.members}
    regions = _active_regions(plan, wanted, grouped, set(keep)) if not evaluation.eager else {}
    deferred = {i for region in regions.values() for i in region.members}
    done: set[int] = set()
    for index in indices:
        group = groups.get(index)
        if group is not None and group.members <= wanted:
            group.run(scope, evaluation)
            done |= group.members
        elif index in done:
            continue
        elif index in deferred:
            if index in regions:
                _run_region(plan, regions[index], scope, evaluation, run_node)
        else:
            run_node(plan.nodes[index], scope, evaluation)
    return scope


def run_positions(plan: GraphPlan, positions: Sequence[int], scope: ChainMap, evaluation: Evaluation,
                  run: Callable[[NodeSpec, ChainMap, Evaluation], None] = run_node) -> None:
    """Run the plan's nodes at `positions` (in order) with `run`, each pointwise region wholly
    among them as one (see translate.pointwise); a Gradient's forward pass runs this way."""
    regions = {} if evaluation.eager else _active_regions(plan, set(positions), set(), set())
    deferred = {i for region in regions.values() for i in region.members}
    for index in positions:
        if index not in deferred:
            run(plan.nodes[index], scope, evaluation)
        elif index in regions:
            _run_region(plan, regions[index], scope, evaluation, run)


def _active_regions(plan: GraphPlan, wanted: set[int], grouped: set[int], keep: set[str]) -> dict[int, pointwise.Region]:
    """The plan's pointwise regions a walk of the nodes at `wanted` runs as one: wholly among
    them, in no node group it runs, and computing none of the names `keep` asks for."""
    if not pointwise.ENABLED:
        return {}
    if plan.regions is None:
        named = {name for spec in plan.nodes if spec.proto.op_type == "Gradient"
                 for attribute in spec.proto.attribute for name in [attribute.s, *attribute.strings] if name}
        plan.regions = pointwise.find_regions(plan.nodes, [*plan.outputs, *(n.decode() for n in named)], node_reads)
    return {tail: region for tail, region in plan.regions.items()
            if set(region.members) <= wanted and not set(region.members) & grouped
            and not keep & {plan.nodes[i].proto.output[0] for i in region.members}}


def _run_region(plan: GraphPlan, region: pointwise.Region, scope: ChainMap, evaluation: Evaluation,
                run: Callable[[NodeSpec, ChainMap, Evaluation], None]) -> None:
    """A pointwise region recomputed in the backward pass, or its nodes one by one where it
    reads no traced float value."""
    def member(index: int, inner: ChainMap) -> None:
        run(plan.nodes[index], inner, evaluation)

    if not pointwise.run_region(region, scope, member, is_host):
        for index in region.members:
            member(index, scope)


def run_plan_segments(plan: GraphPlan, indices: Sequence[int], scope: ChainMap, evaluation: Evaluation,
                      run: Callable[[NodeSpec, ChainMap, Evaluation], None] | None = None) -> None:
    """Run the plan's nodes at `indices` in recomputed segments (see recompute.run_segments);
    `run` evaluates one node (default run_node)."""
    run = run or run_node
    nodes = plan.nodes

    def prepare(members: list[int], probe: Callable[[], Any]) -> bool:
        if not any(nodes[i].random for i in members):
            return True
        if any(draws_random(sub) for i in members for sub in nodes[i].subgraphs.values()):
            return False
        return evaluation.reserve_draws(probe)

    run_segments(indices, scope, lambda i: node_reads(nodes[i]),
                 lambda i: [name for name in nodes[i].proto.output if name], prepare,
                 lambda i, inner: run(nodes[i], inner, evaluation), is_host)


def _groups(plan: GraphPlan) -> dict[int, NodeGroup]:
    """The plan's node groups (see NodeGroup); a group sharing a node with an earlier one
    is dropped, so every node is evaluated once."""
    if plan.groups is None:
        groups: dict[int, NodeGroup] = {}
        taken: set[int] = set()
        for index, spec in enumerate(plan.nodes):
            group = spec.group(spec, index) if spec.group is not None else None
            if group is not None and not group.members & taken:
                groups[group.start] = group
                taken |= group.members
        plan.groups = groups
    return plan.groups


def plan_outputs(plan: GraphPlan, scope: Mapping[str, Any]) -> list[Any]:
    try:
        return [scope[name] for name in plan.outputs]
    except KeyError as missing:
        raise ModelLoadError(
            f"graph {plan.name!r}: output {missing.args[0]!r} is never produced") from None
