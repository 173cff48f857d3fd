"""What an op handler sees of its node: decoded attributes, opset, PRNG, subgraphs.

Attributes are decoded once, when the model is translated, into plain Python
values: float, int, str, numpy arrays (tensors), GraphProto, TypeProto, or
lists of those. A handler is called as fn(node, *inputs) with a Node, the
per-call view of a NodeSpec.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from onnxtrain.errors import ModelLoadError, UnsupportedOpError
from onnxtrain.proto import AttributeProto, NodeProto, SparseTensorProto
from onnxtrain.translate.tensors import host_size_problem, shape_problem, tensor_to_numpy

_REQUIRED = object()


def node_label(proto: NodeProto) -> str:
    """How messages name a node: its name and op, or just the op when unnamed."""
    op = f"{proto.domain}::{proto.op_type}" if proto.domain not in ("", "ai.onnx") else proto.op_type
    return f"node {proto.name!r} ({op})" if proto.name else f"unnamed {op} node"


def _text(value: bytes) -> str | bytes:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value


def sparse_to_dense(sparse: SparseTensorProto, where: str) -> np.ndarray:
    """A SparseTensorProto as a dense numpy array (indices [NNZ] linear or [NNZ, rank]).

    Raises:
        ModelLoadError: dims no array can have or too large to materialise, or indices that
            do not fit the values or fall outside the dims.
    """
    values = tensor_to_numpy(sparse.values, where).reshape(-1)
    indices = tensor_to_numpy(sparse.indices, where).astype(np.int64)
    dims = tuple(sparse.dims)
    problem = shape_problem(dims, values.dtype.itemsize)
    if problem is None:
        problem = host_size_problem(dims, values.dtype.itemsize)
    if problem is None:
        problem = _index_problem(indices, dims, values.size)
    if problem is not None:
        raise ModelLoadError(f"{where}: {problem}. Fix the sparse tensor in the model.")
    dense = np.zeros(dims, dtype=values.dtype)
    if indices.ndim == 1:
        dense.reshape(-1)[indices] = values
    else:
        dense[tuple(indices.T)] = values
    return dense


def _index_problem(indices: np.ndarray, dims: tuple[int, ...], count: int) -> str | None:
    """Why a sparse tensor's indices do not fit its values and dims, or None when they do."""
    linear = indices.ndim == 1
    if not linear and (indices.ndim != 2 or indices.shape[1] != len(dims)):
        return f"indices of shape {list(indices.shape)} are neither [NNZ] nor [NNZ, {len(dims)}]"
    if indices.shape[0] != count:
        return f"has {indices.shape[0]} indices for {count} values"
    bounds = np.array([math.prod(dims)] if linear else dims, dtype=np.int64)
    if count and ((indices < 0).any() or (indices >= bounds).any()):
        return f"indices fall outside the dims {list(dims)}"
    return None


def decode_attribute(attribute: AttributeProto, where: str) -> Any:
    """The Python value of an AttributeProto (see module docstring)."""
    kind = attribute.type
    if kind == AttributeProto.FLOAT:
        return attribute.f
    if kind == AttributeProto.INT:
        return attribute.i
    if kind == AttributeProto.STRING:
        return _text(attribute.s)
    if kind == AttributeProto.TENSOR:
        return tensor_to_numpy(attribute.t, f"attribute {attribute.name!r} of {where}")
    if kind == AttributeProto.GRAPH:
        return attribute.g
    if kind == AttributeProto.SPARSE_TENSOR:
        return sparse_to_dense(attribute.sparse_tensor, f"attribute {attribute.name!r} of {where}")
    if kind == AttributeProto.TYPE_PROTO:
        return attribute.tp
    if kind == AttributeProto.FLOATS:
        return list(attribute.floats)
    if kind == AttributeProto.INTS:
        return list(attribute.ints)
    if kind == AttributeProto.STRINGS:
        return [_text(s) for s in attribute.strings]
    if kind == AttributeProto.TENSORS:
        return [tensor_to_numpy(t, f"attribute {attribute.name!r} of {where}") for t in attribute.tensors]
    if kind == AttributeProto.GRAPHS:
        return list(attribute.graphs)
    if kind == AttributeProto.SPARSE_TENSORS:
        return [sparse_to_dense(s, where) for s in attribute.sparse_tensors]
    if kind == AttributeProto.TYPE_PROTOS:
        return list(attribute.type_protos)
    raise ModelLoadError(f"attribute {attribute.name!r} of {where} has no type (UNDEFINED)")


@dataclass
class NodeSpec:
    """A node as translated once: its handler, opset, decoded attributes, subgraph plans."""

    proto: NodeProto
    label: str
    opset: int
    attrs: dict[str, Any]
    # Either an OpHandler's fn or a model-local function's evaluator.
    call: Callable
    static_inputs: tuple[int, ...] = ()
    random: bool = False
    differentiable: bool = True
    # The handler's NodeGroup builder (see OpHandler.group).
    group: Callable | None = None
    subgraphs: dict[str, Any] = field(default_factory=dict)
    # The GraphPlan holding this node (the Gradient op slices it), and a place
    # for handlers to keep what they derive from the plan once.
    graph: Any = None
    cache: dict[str, Any] = field(default_factory=dict)


class Evaluation:
    """State of one run of a graph: the PRNG key and whether we run eagerly.

    Every draw is remembered per node, so that a Gradient op re-evaluating
    part of the graph (a replay) sees the same random numbers as the forward
    run: the dropout mask a loss was computed with is the one differentiated.
    """

    def __init__(self, key: jax.Array | None, eager: bool, replay_of: Evaluation | None = None,
                 recompute: str | None = None, quantized: bool = False):
        """recompute: "blocks" to recompute activations per segment of nodes in the backward
        pass of a forward this run differentiates; quantized: the graph dequantizes integer
        weights, which a differentiated forward recomputes (see translate.recompute)."""
        self._key = key
        self.eager = eager
        self._replay_of = replay_of
        self.recompute = recompute if replay_of is None else replay_of.recompute
        self.quantized = quantized if replay_of is None else replay_of.quantized
        self.drawn: dict[int, jax.Array] = {}
        # Keys drawn ahead by a replay for nodes the forward run has not reached yet.
        self._reserved: dict[int, jax.Array] = {}
        # Keys drawn ahead for nodes that run inside a recomputed segment (see reserve_draws).
        self._pinned: dict[int, jax.Array] = {}
        self._probing: list[int] | None = None
        # What a node group left for a later node of this run, by that node's spec (id): the
        # Gradient op's (y, pullback) from its forward pass under jax.vjp.
        self.handed_on: dict[int, Any] = {}

    def replay(self) -> Evaluation:
        """A traced (never eager) evaluation that reuses this run's draws."""
        return Evaluation(None, False, replay_of=self)

    def reserve_draws(self, probe: Callable[[], Any]) -> bool:
        """Draw ahead the keys of the nodes that `probe` (a run of some nodes, traced for
        shapes only) draws from, in the order it draws them: for nodes about to run where no
        key may be split (a recomputed segment, traced again for the backward pass). The
        numbers are those of a plain run, and every run of such a node gets the same key.
        False where this run cannot (a replay, or no key)."""
        if self._replay_of is not None or self._key is None:
            return False
        self._probing = []
        try:
            probe()
            order = self._probing
        finally:
            self._probing = None
        for spec_id in order:
            if spec_id not in self._pinned:
                self._key, self._pinned[spec_id] = jax.random.split(self._key)
        return True

    def next_key(self, spec: NodeSpec) -> jax.Array:
        if self._probing is not None:
            # A shapes-only run (see reserve_draws): note the draw, change nothing.
            self._probing.append(id(spec))
            return self._key
        if self._replay_of is not None:
            return self._replay_of._key_for_replay(spec)
        if id(spec) in self._pinned:
            # Drawn ahead by reserve_draws(); kept, as a recomputation runs the node again.
            self.drawn[id(spec)] = self._pinned[id(spec)]
            return self._pinned[id(spec)]
        if id(spec) in self._reserved:
            subkey = self._reserved.pop(id(spec))
        else:
            if self._key is None:
                raise ModelLoadError(f"{spec.label} draws random numbers but no PRNG key was given")
            self._key, subkey = jax.random.split(self._key)
        self.drawn[id(spec)] = subkey
        return subkey

    def _key_for_replay(self, spec: NodeSpec) -> jax.Array:
        if id(spec) in self.drawn:
            return self.drawn[id(spec)]
        if self._replay_of is not None:
            return self._replay_of._key_for_replay(spec)
        if id(spec) not in self._reserved:
            if self._key is None:
                raise ModelLoadError(f"{spec.label} draws random numbers but no PRNG key was given")
            self._key, self._reserved[id(spec)] = jax.random.split(self._key)
        return self._reserved[id(spec)]


class Node:
    """The per-call view a handler gets: attributes, opset, host flag, PRNG, subgraphs."""

    __slots__ = ("spec", "evaluation", "scope", "host")

    def __init__(self, spec: NodeSpec, evaluation: Evaluation, scope: Mapping[str, Any], host: bool):
        self.spec = spec
        self.evaluation = evaluation
        self.scope = scope
        # True when every input is a host constant: the handler may use numpy.
        self.host = host

    @property
    def opset(self) -> int:
        return self.spec.opset

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def op_type(self) -> str:
        return self.spec.proto.op_type

    @property
    def num_outputs(self) -> int:
        return len(self.spec.proto.output)

    @property
    def input_names(self) -> Sequence[str]:
        return self.spec.proto.input

    def output_used(self, index: int) -> bool:
        outputs = self.spec.proto.output
        return index < len(outputs) and outputs[index] != ""

    def attr(self, name: str, default: Any = _REQUIRED) -> Any:
        if name in self.spec.attrs:
            return self.spec.attrs[name]
        if default is _REQUIRED:
            raise ModelLoadError(f"{self.label}: required attribute {name!r} is missing")
        return default

    def has_attr(self, name: str) -> bool:
        return name in self.spec.attrs

    def next_key(self) -> jax.Array:
        """A fresh PRNG key for a random op; the evaluation's key advances."""
        return self.evaluation.next_key(self.spec)

    def run_subgraph(self, attr_name: str, inputs: Sequence[Any]) -> list[Any]:
        """Evaluate a graph attribute with `inputs`; outer-scope names stay visible."""
        from onnxtrain.translate.graph import evaluate_plan

        return evaluate_plan(self.subgraph_plan(attr_name), inputs, self.scope, self.evaluation)

    def subgraph_plan(self, attr_name: str):
        if attr_name not in self.spec.subgraphs:
            raise self.error(f"required graph attribute {attr_name!r} is missing or not a graph")
        return self.spec.subgraphs[attr_name]

    def error(self, message: str) -> ModelLoadError:
        """An error naming this node, for handlers to raise on invalid models."""
        return ModelLoadError(f"{self.label}: {message}")

    def unsupported(self, message: str) -> UnsupportedOpError:
        """An error naming this node, for valid configurations onnxtrain cannot run."""
        return UnsupportedOpError(f"{self.label}: {message}")
