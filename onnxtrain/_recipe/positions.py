"""Position tables: the float initializers an exporter writes for what torch computes in the
forward pass or keeps as buffers, so that no torch model trains them.

Rotary embeddings and ALiBi make attention depend on where a token sits, through inverse
frequencies (a buffer), cos/sin tables (computed from them, or folded by the exporter), ALiBi
slopes and biases (computed). Exporters store each as an initializer of the same kind as a
weight, and training one silently corrupts the model while its loss still falls
(docs/design/trainable-set.md).

They are recognised by what the forward pass does with them, never by name:

- a fixed input of an attention op: the cos/sin caches of GroupQueryAttention and
  RotaryEmbedding, the masks and biases of the attention ops;
- scaled by positions: combined by arithmetic with token positions and nothing learned
  (rotary frequencies times position ids, ALiBi slopes times a mask's running count);
- feeding Sin or Cos through arithmetic with nothing learned (the frequencies of rotary and
  sinusoidal embeddings of positions or time steps); a layer on the raw inputs (a product
  with a weight, as in SIREN) stays a weight;
- a cos/sin pair: two tables multiplying a tensor and its rotation, added, whose squares sum
  to one constant (cos² + sin², times any attention scaling): the folded tables of a
  static-shape export;
- linear in position: a table added to attention scores whose every row along the last axis
  is an arithmetic progression (a folded ALiBi bias).

Positions are values computed from the integer inputs (token and position ids, masks) or by
Range and CumSum; learned values are those that passed through a weight (an embedding lookup,
a product or normalization with an initializer). What cannot be told apart from a parameter
stays one: a learned table read by Gather (GPT-2's position embeddings, T5's relative biases)
or added to the activations (a ViT's position embedding).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping

import numpy as np

from onnxtrain._recipe.dataflow import (INPUT, LEARNED, PASS_THROUGH_FIRST, POSITION, SHAPE_READERS, Use,
                                        passes_through)
from onnxtrain.proto import GraphProto, NodeProto
from onnxtrain.translate.registry import normalize_domain

# Arithmetic a position table is combined with positions by, and the ops a table's values may
# pass through on their way into Sin or Cos.
_ARITHMETIC = {"Mul", "Div", "Add", "Sub", "MatMul", "Gemm", "Einsum"}
_PRODUCTS = {"MatMul", "Gemm", "Einsum"}
_ON_THE_WAY = _ARITHMETIC | {"Neg", "Reciprocal", "Sqrt", "Exp", "Log", "Pow", "Where", "Max", "Min", "Abs"}
_TRIG = {"Sin", "Cos"}
# Ops between attention scores and their Softmax (scaling, masking, reshaping).
_SCORES_WAY = {"Add", "Sub", "Mul", "Div", "Where", "Cast", "Reshape", "Unsqueeze", "Expand", "Slice", "Transpose"}
_SOFTMAX = {"Softmax", "LogSoftmax"}
# Ops a cos/sin table reaches its product through: moves, and Gather's rows by position ids.
_TABLE_WAY = PASS_THROUGH_FIRST | {"Gather"}
# Fixed inputs of attention ops, by (domain, op): input position -> what it is.
_ROTARY, _MASK = "rotary table (cos/sin cache of {op})", "attention mask or bias of {op}"
ATTENTION_INPUTS: dict[tuple[str, str], dict[int, str]] = {
    ("com.microsoft", "GroupQueryAttention"): {7: _ROTARY, 8: _ROTARY, 10: _MASK},
    ("com.microsoft", "RotaryEmbedding"): {2: _ROTARY, 3: _ROTARY},
    ("", "RotaryEmbedding"): {1: _ROTARY, 2: _ROTARY},
    ("com.microsoft", "MultiHeadAttention"): {4: _MASK, 5: _MASK},
    ("com.microsoft", "Attention"): {3: _MASK, 5: _MASK},
    ("", "Attention"): {3: _MASK},
}
# A pair whose squares' sum spreads by more than this (relative) is no cos/sin pair.
_PAIR_TOLERANCE = 1e-4
# A row whose second differences exceed this (relative to the table's largest value) is not linear.
_LINEAR_TOLERANCE = 1e-5
# Elements read at a time: float64 working copies stay a few megabytes.
_BLOCK = 2**20
# Values the search for Sin/Cos visits at most from one use.
_SEARCH_LIMIT = 4096


class PositionTables:
    """Decides, use by use, whether a float initializer is a position table (module docstring).

    Args:
        graph: the main graph.
        values: the float initializers' values (a pair and a folded bias are judged by them).
        uses: dataflow.consumers(graph).
        producers: dataflow.producer_of(graph).
        flow: dataflow.flows(graph, ...).
        static: names read as shapes or axes.
    """

    def __init__(self, graph: GraphProto, values: Mapping[str, np.ndarray], uses: Mapping[str, list[Use]],
                 producers: Mapping[str, NodeProto], flow: Mapping[str, int], static: set[str]):
        self.uses, self.flow, self.static = uses, flow, static
        self.outputs = {v.name for v in graph.output}
        self.pairs = _rotary_pairs(graph, values, producers)
        self._trig: dict[str, bool] = {}

    def role(self, use: Use, value: np.ndarray) -> str | None:
        """Why this use makes `value` a position table, or None."""
        node, index = use.node, use.index
        domain, op_type = normalize_domain(node.domain), node.op_type
        fixed = ATTENTION_INPUTS.get((domain, op_type), {}).get(index)
        if fixed is not None:
            return fixed.format(op=op_type)
        if node.input[index] in self.pairs:
            return "rotary table (a folded cos/sin pair: their squares sum to a constant)"
        # A single element is a scale or a bias whatever it meets (the trainable set's rules).
        if domain != "" or op_type not in _ARITHMETIC or value.size <= 1:
            return None
        if op_type in ("Add", "Sub") and _linear_rows(value) and self._into_softmax(node.output):
            return "positional bias (linear in position, added to attention scores: a folded ALiBi bias)"
        if self._layer(use):
            return None  # a weight of a layer, even one whose output goes into Sin (SIREN)
        others = self._others(use)
        trig = all(self._into_trig(name) for name in node.output if name)
        if POSITION in others and trig:
            return "rotary table (frequencies times positions, into Sin/Cos)"
        if POSITION in others and op_type not in _PRODUCTS:  # a product with ids is a one-hot embedding
            return "positional bias (a scale of token positions, as ALiBi slopes)"
        if trig:
            return "sinusoidal table (into Sin/Cos)" if INPUT in others else "rotary table (into Sin/Cos)"
        return None

    def _others(self, use: Use, own: Container[str] = ()) -> list[int]:
        """What the node's other value operands depend on, but shape operands and `own` values
        (those computed from the table itself)."""
        return [self.flow.get(name, LEARNED) for i, name in enumerate(use.node.input)
                if i != use.index and name and name not in self.static and name not in own]

    def _layer(self, use: Use, own: Container[str] = ()) -> bool:
        """Whether the use computes with learned values, or is a product with the inputs."""
        others = self._others(use, own)
        return LEARNED in others or (use.node.op_type in _PRODUCTS and INPUT in others)

    def _into_trig(self, name: str) -> bool:
        """Whether the value reaches Sin or Cos through arithmetic with nothing learned, and
        nothing else computes with it (no graph output, weight op or learned operand)."""
        if name not in self._trig:
            self._trig[name] = self._search_trig(name)
        return self._trig[name]

    def _search_trig(self, start: str) -> bool:
        pending, seen, found = [start], {start}, False
        while pending:
            name = pending.pop()
            if name in self.outputs or len(seen) > _SEARCH_LIMIT:
                return False
            for use in self.uses.get(name, []):
                node = use.node
                if normalize_domain(node.domain) != "":
                    return False
                if node.op_type in _TRIG:
                    found = True
                elif node.op_type in SHAPE_READERS or node.input[use.index] in self.static:
                    continue
                elif (node.op_type in _ON_THE_WAY or passes_through(use)) and not self._layer(use, seen):
                    fresh = [out for out in node.output if out and out not in seen]
                    seen.update(fresh)
                    pending += fresh
                else:
                    return False
        return found

    def _into_softmax(self, names: Iterable[str]) -> bool:
        """Whether these values reach a Softmax within a few score-shaping ops."""
        pending, seen = [(name, 0) for name in names], set(names)
        while pending:
            name, depth = pending.pop()
            for use in self.uses.get(name, []):
                if use.node.op_type in _SOFTMAX:
                    return True
                if depth < 8 and use.node.op_type in _SCORES_WAY:
                    fresh = [out for out in use.node.output if out and out not in seen]
                    seen.update(fresh)
                    pending += [(out, depth + 1) for out in fresh]
        return False


def _origin(name: str, values: Mapping[str, np.ndarray], producers: Mapping[str, NodeProto]) -> str | None:
    """The float initializer a value is read from, through moves and cuts of it, or None."""
    seen = set()
    while name not in values:
        item = producers.get(name)
        if (item is None or name in seen or not item.input or normalize_domain(item.domain) != ""
                or item.op_type not in _TABLE_WAY):
            return None
        seen.add(name)
        name = item.input[0]
    return name


def _rotary_pairs(graph: GraphProto, values: Mapping[str, np.ndarray], producers: Mapping[str, NodeProto]
                  ) -> set[str]:
    """Initializers that are one half of a folded cos/sin pair: x * C + rotate(x) * S."""
    found: set[str] = set()
    for item in graph.node:
        if item.op_type not in ("Add", "Sub") or normalize_domain(item.domain) != "" or len(item.input) != 2:
            continue
        products = [producers.get(name) for name in item.input]
        if not all(p is not None and p.op_type == "Mul" and normalize_domain(p.domain) == "" for p in products):
            continue
        tables = [{t for t in (_origin(n, values, producers) for n in p.input) if t} for p in products]
        if not all(len(t) == 1 for t in tables):
            continue
        (cos,), (sin,) = tables
        if cos != sin and _cos_sin(values[cos], values[sin]):
            found.update((cos, sin))
    return found


def _cos_sin(cos: np.ndarray, sin: np.ndarray) -> bool:
    """Whether cos² + sin² is one constant over two tables that each vary. Read a block at a
    time: a long-context cache holds millions of entries."""
    if cos.shape != sin.shape or cos.size < 2:
        return False
    flat_cos, flat_sin = cos.reshape(-1), sin.reshape(-1)
    low, high, varies = np.inf, -np.inf, False
    for start in range(0, flat_cos.size, _BLOCK):
        c = flat_cos[start:start + _BLOCK].astype(np.float64)
        s = flat_sin[start:start + _BLOCK].astype(np.float64)
        total = c * c + s * s
        if not np.all(np.isfinite(total)):
            return False
        low, high = min(low, float(total.min())), max(high, float(total.max()))
        varies = varies or bool(np.any(c != flat_cos[0]) and np.any(s != flat_sin[0]))
    return varies and high > 0 and high - low <= _PAIR_TOLERANCE * high


def _linear_rows(value: np.ndarray) -> bool:
    """Whether every row along the last axis is an arithmetic progression, not all flat, in a
    table with two or more axes longer than one (a bias over heads and positions). Read some
    rows at a time: a folded bias may span every pair of positions."""
    if value.ndim < 2 or value.shape[-1] < 3 or sum(size > 1 for size in value.shape) < 2:
        return False
    rows = value.reshape(-1, value.shape[-1])
    step = max(1, _BLOCK // rows.shape[1])
    largest, sloped, bent = 0.0, False, 0.0
    for start in range(0, len(rows), step):
        block = rows[start:start + step].astype(np.float64)
        if not np.all(np.isfinite(block)):
            return False
        steps = np.diff(block, axis=1)
        largest = max(largest, float(np.abs(block).max()))
        sloped = sloped or bool(np.any(steps != 0))
        bent = max(bent, float(np.abs(np.diff(steps, axis=1)).max()))
    return sloped and bent <= _LINEAR_TOLERANCE * largest
