"""The default trainable set: which float initializers of an exported model are weights.

Exporters store every constant of the forward pass as an initializer: the weights, and also
exponents, attention scales, epsilons, mask fill values, zero RNN states, folded masks, and
the position tables torch keeps as buffers or computes (rotary frequencies and cos/sin
tables, ALiBi slopes). Training the latter breaks models (d/dy x^y is NaN for x < 0, so a
trained GELU exponent turns GPT-2 into NaN on the first step) or silently corrupts them (a
trained rotary table), so the default set is what torch would train, decided by how the
forward pass *consumes* each initializer, never by its name:

- follow the value through ops that only move or retype it (Cast, Identity, Transpose,
  Reshape, Unsqueeze, Expand, Concat, ...) to the nodes that compute with it;
- a use is **not** a weight use where it is an exponent, a Clip bound, a Dropout ratio, a
  quantization scale or zero point, a padding value, a comparison operand, a shape or axes
  operand, a BatchNorm running statistic, an all-zero RNN initial state, or only its shape
  is read; where it is a position table (positions.py: rotary tables, positional biases,
  the fixed inputs of attention ops); a single-element operand of elementwise arithmetic is
  a scale, epsilon or fill value, and an all-zero one with two or more axes longer than one
  is a folded mask; a tensor holding a value of magnitude 1e30 or more (or Inf/NaN), or only
  zeros and one value of magnitude 1e3 or more, is a mask or fill value wherever it goes;
- a use is a **weight** use where the op multiplies, convolves, normalizes or embeds with it
  (MatMul, Gemm, Conv, Gather data, normalization scale and bias, RNN weights, ...), where it
  is a bias (along one axis) added to such a product, or where it is an operand of wider
  elementwise arithmetic with the activations (a ViT's position embedding, layer scales).

An initializer is a weight when any of its uses is a weight use (an exporter that merges
equal tensors may share one between a weight and a constant role).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from onnxtrain._io.model import ModelSource, load_model
from onnxtrain._recipe.dataflow import PASS_THROUGH_FIRST, Use, consumers, flows, passes_through, producer_of
from onnxtrain._recipe.positions import PositionTables
from onnxtrain.proto import ModelProto, NodeProto
from onnxtrain.translate.graph import graph_initializers
from onnxtrain.translate.model import static_input_names
from onnxtrain.translate.registry import model_opsets

FLOATS = {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)}

# (op, input positions) that hold weights whatever their size.
_WEIGHT_POSITIONS: dict[str, tuple[int, ...]] = {
    "MatMul": (0, 1), "Gemm": (0, 1, 2), "Conv": (1, 2), "ConvTranspose": (1, 2), "Einsum": tuple(range(16)),
    "LayerNormalization": (1, 2), "BatchNormalization": (1, 2), "InstanceNormalization": (1, 2),
    "GroupNormalization": (1, 2), "RMSNormalization": (1,), "SimplifiedLayerNormalization": (1,),
    "SkipLayerNormalization": (2, 3, 4), "SkipSimplifiedLayerNormalization": (2, 3),
    "EmbedLayerNormalization": (2, 3, 4, 5, 6), "PRelu": (1,), "LSTM": (1, 2, 3, 7), "GRU": (1, 2, 3),
    "RNN": (1, 2, 3), "FusedMatMul": (0, 1), "Attention": (1, 2), "MultiHeadAttention": (3,),
    "FastGelu": (1,), "BiasGelu": (1,), "BiasAdd": (1,), "BiasSplitGelu": (1,),
}
# Quantized products hold their (integer) weights here: what they compute is learned too.
_QUANTIZED_WEIGHTS = {"MatMulNBits": (1,), "GatherBlockQuantized": (0,), "MatMulInteger": (1,),
                      "DynamicQuantizeMatMul": (1,), "QLinearMatMul": (3,), "QLinearConv": (3,)}
# Gather-like ops read a weight table at input 0 (an embedding); the table is a weight.
_TABLE_READERS = {"Gather", "GatherElements", "GatherND"}
# Producers whose output a following Add/Sub treats as a bias.
_PRODUCTS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "FusedMatMul"}
_ZERO_STATE_POSITIONS = {"LSTM": (5, 6), "GRU": (5,), "RNN": (5,)}
_CONSTANT_POSITIONS: dict[str, tuple[tuple[int, ...], str]] = {
    "Pow": ((1,), "exponent of Pow"),
    "Clip": ((1, 2), "bound of Clip"),
    "Dropout": ((1,), "ratio of Dropout"),
    "Pad": ((2,), "fill value of Pad"),
    "BatchNormalization": ((3, 4), "BatchNorm running statistic"),
    "Range": ((0, 1, 2), "bound of Range"),
    "OneHot": ((1, 2), "depth or off/on values of OneHot"),
    # A quantized base stays as quantized: its scales and zero points are frozen with it.
    "DequantizeLinear": ((1, 2), "scale or zero point of a quantized tensor"),
    "QuantizeLinear": ((1, 2), "scale or zero point of a quantized tensor"),
    "MatMulNBits": ((2, 3), "scale or zero point of a quantized weight"),
}
_ONLY_SHAPE = {"Shape", "Size", "EyeLike", "ConstantOfShape"}
_COMPARISONS = {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "IsNaN", "IsInf"}
# A value this large or larger is a mask or fill value (float32's lowest, -inf stand-ins), never a weight.
_FILL_MAGNITUDE = 1e30
# Zeros and one value at least this large make a two-valued additive mask.
_MASK_MAGNITUDE = 1e3
# Values _is_mask reads at a time: its float64 working copy stays a few megabytes.
_BLOCK = 2**20
# How the reasons for position tables begin (positions.py): what torch computes or keeps as buffers.
POSITION_TABLE_KINDS = ("rotary table", "sinusoidal table", "positional bias")


@dataclass(frozen=True)
class TrainableSet:
    """The float initializers of a model's main graph, split into weights and the rest (what
    onnxtrain.default_trainable returns).

    Attributes:
        weights: the names to train, in initializer order.
        left_out: every other float initializer -> why it is not a weight.

    Example:
        >>> chosen = onnxtrain.default_trainable("gpt2.onnx")
        >>> chosen.summary()
        'training 148 of 151 float initializers; left out val_116 (exponent of Pow), ...'
    """

    weights: list[str]
    left_out: dict[str, str] = field(default_factory=dict)

    def summary(self, limit: int = 8) -> str:
        """One line: how many are trained and which were left out, with reasons."""
        total = len(self.weights) + len(self.left_out)
        text = f"training {len(self.weights)} of {total} float initializers"
        if not self.left_out:
            return text
        items = [f"{name} ({reason})" for name, reason in list(self.left_out.items())[:limit]]
        more = len(self.left_out) - limit
        return f"{text}; left out {', '.join(items)}{f' and {more} more' if more > 0 else ''}"


def _reached(name: str, uses: Mapping[str, list[Use]]) -> list[Use]:
    """The uses `name`'s value reaches through pass-through ops, each node once."""
    pending, seen, reached = [name], {name}, []
    while pending:
        for use in uses.get(pending.pop(), []):
            if passes_through(use):
                for output in use.node.output:
                    if output and output not in seen:
                        seen.add(output)
                        pending.append(output)
            else:
                reached.append(use)
    return reached


def _fed_by_product(item: NodeProto, index: int, producers: Mapping[str, NodeProto]) -> bool:
    """Whether the other operand of a binary Add/Sub comes from a MatMul-like op (so the
    initializer is that product's bias), looking back through pass-through ops."""
    for other, name in enumerate(item.input[:2]):
        if other == index:
            continue
        source = producers.get(name)
        while source is not None and source.op_type in PASS_THROUGH_FIRST and source.input:
            source = producers.get(source.input[0])
        if source is not None and source.op_type in _PRODUCTS:
            return True
    return False


class Roles:
    """What each value of one model's main graph is to training: a weight, or why not.

    Args:
        model: the inference model.
        values: the float values to judge by (the initializers; Constant nodes' values too
            when those are judged).

    Example:
        >>> roles = Roles(model, graph_initializers(model.graph))
        >>> roles.reason("m.model.rotary_emb.inv_freq", inv_freq)
        'rotary table (frequencies times positions, into Sin/Cos)'
    """

    def __init__(self, model: ModelProto, values: Mapping[str, np.ndarray]):
        graph = model.graph
        self.static = static_input_names(graph, model_opsets(model.opset_import))
        self.uses, self.producers = consumers(graph), producer_of(graph)
        flow = flows(graph, {**_WEIGHT_POSITIONS, **_QUANTIZED_WEIGHTS}, _TABLE_READERS)
        self.positions = PositionTables(graph, values, self.uses, self.producers, flow, self.static)

    def reason(self, name: str, value: np.ndarray) -> str | None:
        """None for a weight, else why `name` is left out."""
        if name in self.static:
            return "shape or axes operand"
        reached = _reached(name, self.uses)
        if not reached:
            return "no node computes with it"
        if _is_mask(value):
            return "mask or fill value"
        reasons = [self._role(use, value) for use in reached]
        if any(reason is None for reason in reasons):
            return None
        return ", ".join(dict.fromkeys(reasons))

    def _role(self, use: Use, value: np.ndarray) -> str | None:
        """None for a weight use, else why this use does not make `value` a weight."""
        op_type, index, item = use.node.op_type, use.index, use.node
        if item.input[index] in self.static:
            return f"shape or axes operand of {op_type}"
        if index in _CONSTANT_POSITIONS.get(op_type, ((), ""))[0]:
            return _CONSTANT_POSITIONS[op_type][1]
        if index in _ZERO_STATE_POSITIONS.get(op_type, ()):
            return None if value.any() else f"zero initial state of {op_type}"
        if op_type in _ONLY_SHAPE:
            return f"only its shape is read, by {op_type}"
        if op_type in _COMPARISONS:
            return f"operand of {op_type}"
        if _group_norm_identity(use, value, self.producers):
            return f"unit scale or zero shift of a GroupNorm written as {op_type}"
        table = self.positions.role(use, value)
        if table is not None:
            return table
        if index in _WEIGHT_POSITIONS.get(op_type, ()) or (op_type in _TABLE_READERS and index == 0):
            return None
        long_axes = sum(size > 1 for size in value.shape)
        if op_type in ("Add", "Sub") and long_axes <= 1 and _fed_by_product(item, index, self.producers):
            return None  # a bias runs along one axis; a mask added to attention scores spans two
        if value.size <= 1:
            return f"scalar constant of {op_type}"
        if long_axes >= 2 and not value.any():
            # An exporter folds an attention mask without padding into zeros of the scores' shape.
            return f"all-zero mask of {op_type}"
        return None


def _group_norm_identity(use: Use, value: np.ndarray, producers: Mapping[str, NodeProto]) -> bool:
    """Whether `value` is the ones (scale) or zeros (shift) of an InstanceNormalization that an
    exporter wrote for GroupNorm: reshaped input, normalized per group, with the module's own
    scale and shift applied afterwards by Mul and Add (torch's dynamo exporter does this)."""
    if use.node.op_type != "InstanceNormalization" or use.index not in (1, 2):
        return False
    source = producers.get(use.node.input[0])
    identity = 1.0 if use.index == 1 else 0.0
    return source is not None and source.op_type == "Reshape" and bool(np.all(value == identity))


def _is_mask(value: np.ndarray) -> bool:
    """A value of magnitude _FILL_MAGNITUDE or more (or Inf/NaN) anywhere, or zeros and one
    large value (an additive mask written with -10000 or the like). Read a block at a time:
    a float64 copy of a large model's embedding would take several times its size."""
    largest = 0.0
    flat = value.reshape(-1)
    for start in range(0, flat.size, _BLOCK):
        with np.errstate(invalid="ignore"):
            magnitude = np.abs(flat[start:start + _BLOCK].astype(np.float64))
        if not np.all(magnitude < _FILL_MAGNITUDE):
            return True
        largest = max(largest, float(magnitude.max()))
    if largest < _MASK_MAGNITUDE or not 0 < np.count_nonzero(value) < value.size:
        return False
    filled = value[value != 0]
    return bool(np.all(filled == filled.flat[0]))


def trainable_set(model: ModelProto) -> TrainableSet:
    """Split the main graph's float initializers into weights and constants, by how the
    forward pass uses each one (see the module docstring).

    Args:
        model: an inference model (its training_info, if any, is not read).

    Returns:
        A TrainableSet: the weight names in initializer order, and each left-out float
        initializer with a short reason.

    Example:
        >>> chosen = trainable_set(onnxtrain.load_model("gpt2.onnx"))
        >>> chosen.left_out["val_116"]
        'exponent of Pow'
    """
    values = {name: value for name, value in graph_initializers(model.graph).items() if value.dtype in FLOATS}
    roles = Roles(model, values)
    weights, left_out = [], {}
    for name, value in values.items():
        reason = roles.reason(name, value)
        if reason is None:
            weights.append(name)
        else:
            left_out[name] = reason
    return TrainableSet(weights, left_out)


def default_trainable(model: ModelSource) -> TrainableSet:
    """What make_training_model and finetune train when `trainable=` is not given: the
    weights torch would train, and every other float initializer with why it is left out
    (exponents, masks, BatchNorm statistics, rotary tables, ALiBi slopes, ...).

    Args:
        model: an inference model: a path, bytes, file object or ModelProto.

    Returns:
        A TrainableSet: `.weights`, the names in initializer order, and `.left_out`, name ->
        reason (what `onnxtrain inspect` lists).

    Raises:
        ModelLoadError: the model cannot be read.

    Example:
        To train a left-out table anyway, name it beside the default set:

        >>> chosen = onnxtrain.default_trainable("qwen2.onnx")
        >>> chosen.left_out["model.rotary_emb.inv_freq"]
        'rotary table (frequencies times positions, into Sin/Cos)'
        >>> onnxtrain.make_training_model("qwen2.onnx", "causal_lm",
        ...                               trainable=[*chosen.weights, "model.rotary_emb.inv_freq"])
    """
    return trainable_set(load_model(model))
