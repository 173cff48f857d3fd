"""Reverse-mode rules: for each primitive ONNX op, its vector-Jacobian product in ONNX nodes.

A rule is called as rule(emitter, node, grads, needed): `grads` holds, per output
of the forward node, the name of the gradient of the differentiated value with
respect to that output (None when no gradient reaches it); `needed[i]` says
whether input i lies on a path from the differentiated tensors. It returns one
gradient name (or None) per input, shaped like that input. Composite ops
(Gemm, BatchNormalization, the losses...) never reach a rule: decompose.py
rewrites them into these primitives first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from onnxtrain._portable.emitter import Emitter, attr, label
from onnxtrain.errors import ExportError
from onnxtrain.proto import NodeProto
from onnxtrain.translate.tensors import data_type_of, numpy_to_tensor

Grads = list[str | None]
Rule = Callable[[Emitter, NodeProto, Grads, list[bool]], Grads]
RULES: dict[str, Rule] = {}

# Ops whose outputs carry no gradient (integer, boolean or piecewise-constant results): their
# outputs count as constants, as jax.vjp treats them.
CONSTANT_OPS = frozenset({
    "Shape", "Size", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And",
    "Or", "Xor", "ArgMax", "ArgMin", "OneHot", "ConstantOfShape", "Range", "NonZero", "Floor",
    "Ceil", "Round", "Sign", "IsNaN", "IsInf", "Constant", "EyeLike", "RandomNormalLike",
    "RandomUniformLike", "BitShift",
})


def rule(*op_types: str) -> Callable[[Rule], Rule]:
    """Register the decorated function as the VJP rule of `op_types`."""
    def register(function: Rule) -> Rule:
        for op_type in op_types:
            RULES[op_type] = function
        return function
    return register


def _only(grads: Grads, node: NodeProto) -> str:
    if grads[0] is None:
        raise ExportError(f"portable export: {label(node)}: no gradient reaches its first output")
    return grads[0]


def _inputs(node: NodeProto) -> list[str]:
    return list(node.input)


# -- elementwise ------------------------------------------------------------------------------

@rule("Identity")
def _identity(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    return [grads[0]]


@rule("Add")
def _add(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    g, (a, b), y = _only(grads, node), node.input, node.output[0]
    return [e.sum_to(g, a, y) if needed[0] else None, e.sum_to(g, b, y) if needed[1] else None]


@rule("Sum")
def _sum(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    g, y = _only(grads, node), node.output[0]
    return [e.sum_to(g, x, y) if want else None for x, want in zip(node.input, needed)]


@rule("Sub")
def _sub(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    g, (a, b), y = _only(grads, node), node.input, node.output[0]
    return [e.sum_to(g, a, y) if needed[0] else None,
            e.sum_to(e.add("Neg", [g], "dB_neg"), b, y) if needed[1] else None]


@rule("Mul")
def _mul(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    g, (a, b), y = _only(grads, node), node.input, node.output[0]
    return [e.sum_to(e.add("Mul", [g, b], "dA"), a, y) if needed[0] else None,
            e.sum_to(e.add("Mul", [g, a], "dB"), b, y) if needed[1] else None]


@rule("Div")
def _div(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    g, (a, b), y = _only(grads, node), node.input, node.output[0]
    da = e.sum_to(e.add("Div", [g, b], "dA"), a, y) if needed[0] else None
    db = None
    if needed[1]:  # d(a/b)/db = -(a/b)/b
        db = e.add("Neg", [e.add("Div", [e.add("Mul", [g, y], "g_y"), b], "g_y_b")], "dB")
        db = e.sum_to(db, b, y)
    return [da, db]


@rule("Pow")
def _pow(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    g, (a, b), y = _only(grads, node), node.input, node.output[0]
    exponent = b if e.dtype(b) == e.dtype(a) else e.cast_like(b, a, "exponent")
    da = db = None
    if needed[0]:  # b * a^(b-1)
        lowered = e.add("Sub", [exponent, e.scalar(1, a)], "exponent_minus_1")
        slope = e.add("Mul", [exponent, e.add("Pow", [a, lowered], "a_pow")], "slope")
        da = e.sum_to(e.add("Mul", [g, slope], "dA"), a, y)
    if needed[1]:  # a^b * log(a)
        db = e.add("Mul", [e.add("Mul", [g, y], "g_y"), e.add("Log", [a], "log_a")], "dB")
        db = e.sum_to(db, b, y)
    return [da, db]


@rule("Neg")
def _neg(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    return [e.add("Neg", [_only(grads, node)], "dX")]


@rule("Relu")
def _relu(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    x = node.input[0]
    positive = e.add("Greater", [x, e.scalar(0, x)], "positive")
    return [e.add("Where", [positive, _only(grads, node), e.scalar(0, x)], "dX")]


@rule("LeakyRelu")
def _leaky_relu(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    x, g = node.input[0], _only(grads, node)
    positive = e.add("Greater", [x, e.scalar(0, x)], "positive")
    leaked = e.add("Mul", [g, e.scalar(attr(node, "alpha", 0.01), x)], "leaked")
    return [e.add("Where", [positive, g, leaked], "dX")]


@rule("Sqrt")
def _sqrt(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    y = node.output[0]
    twice = e.add("Mul", [y, e.scalar(2, y)], "twice_sqrt")
    return [e.add("Div", [_only(grads, node), twice], "dX")]


@rule("Exp")
def _exp(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    return [e.add("Mul", [_only(grads, node), node.output[0]], "dX")]


@rule("Log")
def _log(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    return [e.add("Div", [_only(grads, node), node.input[0]], "dX")]


@rule("Reciprocal")
def _reciprocal(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    y = node.output[0]
    square = e.add("Mul", [y, y], "y_squared")
    return [e.add("Neg", [e.add("Mul", [_only(grads, node), square], "g_y2")], "dX")]


@rule("Tanh")
def _tanh(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    y = node.output[0]
    slope = e.add("Sub", [e.scalar(1, y), e.add("Mul", [y, y], "y_squared")], "slope")
    return [e.add("Mul", [_only(grads, node), slope], "dX")]


@rule("Sigmoid")
def _sigmoid(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    y = node.output[0]
    slope = e.add("Mul", [y, e.add("Sub", [e.scalar(1, y), y], "one_minus_y")], "slope")
    return [e.add("Mul", [_only(grads, node), slope], "dX")]


@rule("Erf")
def _erf(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    x = node.input[0]
    bell = e.add("Exp", [e.add("Neg", [e.add("Mul", [x, x], "x_squared")], "minus_x_squared")], "bell")
    slope = e.add("Mul", [bell, e.scalar(2 / math.sqrt(math.pi), x)], "slope")
    return [e.add("Mul", [_only(grads, node), slope], "dX")]


@rule("Abs")
def _abs(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    return [e.add("Mul", [_only(grads, node), e.add("Sign", [node.input[0]], "sign")], "dX")]


@rule("Cast")
def _cast(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    return [e.cast_like(_only(grads, node), node.input[0], "dX")]


@rule("Where")
def _where(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    g, (condition, a, b), y = _only(grads, node), node.input, node.output[0]
    zero = e.scalar(0, y)
    da = e.sum_to(e.add("Where", [condition, g, zero], "dA"), a, y) if needed[1] else None
    db = e.sum_to(e.add("Where", [condition, zero, g], "dB"), b, y) if needed[2] else None
    return [None, da, db]


@rule("Max", "Min")
def _max_min(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    """The gradient goes to the inputs equal to the result (to each of them on ties, as
    ONNX Runtime's training kernels did; jax splits ties, so avoid comparing at ties)."""
    g, y = _only(grads, node), node.output[0]
    out: Grads = []
    for x, want in zip(node.input, needed):
        if not want:
            out.append(None)
            continue
        chosen = e.add("Equal", [x, y], "chosen")
        out.append(e.sum_to(e.add("Where", [chosen, g, e.scalar(0, y)], "dX"), x, y))
    return out


# -- linear algebra ---------------------------------------------------------------------------

def _swap_last(e: Emitter, x: str, rank: int, hint: str) -> str:
    perm = list(range(rank))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    return e.add("Transpose", [x], hint, perm=perm)


@rule("MatMul")
def _matmul(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    """dA = g @ B^T, dB = A^T @ g, then summed over broadcast batch axes; 1-D operands are
    given the axis numpy's matmul gives them, and lose it again."""
    g, (a, b), y = _only(grads, node), node.input, node.output[0]
    a_shape, b_shape = np.shape(e.example(a)), np.shape(e.example(b))
    a2, b2 = a, b
    if len(a_shape) == 1:
        a2, a_shape = e.unsqueeze(a, [0], "A_row"), (1, *a_shape)
        g = e.unsqueeze(g, [-2] if len(b_shape) > 1 else [0], "g_row")
    if len(b_shape) == 1:
        b2, b_shape = e.unsqueeze(b, [1], "B_column"), (*b_shape, 1)
        g = e.unsqueeze(g, [-1], "g_column")
    out_batch = np.broadcast_shapes(a_shape[:-2], b_shape[:-2])
    out_rank = len(out_batch) + 2
    da = db = None
    if needed[0]:
        da = e.add("MatMul", [g, _swap_last(e, b2, len(b_shape), "B_T")], "dA")
        da = _sum_to_shape(e, da, a_shape, (*out_batch, a_shape[-2], a_shape[-1]), out_rank)
        if len(np.shape(e.example(a))) == 1:
            da = e.squeeze(da, [0], "dA_vector")
    if needed[1]:
        db = e.add("MatMul", [_swap_last(e, a2, len(a_shape), "A_T"), g], "dB")
        db = _sum_to_shape(e, db, b_shape, (*out_batch, b_shape[-2], b_shape[-1]), out_rank)
        if len(np.shape(e.example(b))) == 1:
            db = e.squeeze(db, [1], "dB_vector")
    return [da, db]


def _sum_to_shape(e: Emitter, grad: str, shape: Sequence[int], full: Sequence[int], rank: int) -> str:
    """sum_to for shapes that are not forward tensors (MatMul's promoted operands)."""
    lead = rank - len(shape)
    kept = [lead + i for i, size in enumerate(shape[:-2]) if size == 1 and full[lead + i] != 1]
    if kept:
        grad = e.reduce("ReduceSum", grad, kept, True, "sum_broadcast")
    if lead:
        grad = e.reduce("ReduceSum", grad, range(lead), False, "sum_leading")
    return grad


# -- layout -----------------------------------------------------------------------------------

@rule("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    x = node.input[0]
    return [e.add("Reshape", [_only(grads, node), e.shape(x)], "dX")] + [None] * (len(node.input) - 1)


@rule("Expand")
def _expand(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    return [e.sum_to(_only(grads, node), node.input[0], node.output[0]), None]


@rule("Transpose")
def _transpose(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    rank = e.rank(node.input[0])
    perm = attr(node, "perm") or list(reversed(range(rank)))
    inverse = [0] * rank
    for position, axis in enumerate(perm):
        inverse[axis] = position
    return [e.add("Transpose", [_only(grads, node)], "dX", perm=inverse)]


def _axis_size(e: Emitter, x: str, axis: int) -> str:
    """The size of axis `axis` of forward tensor `x` as a 1-D int64 tensor."""
    return e.add("Gather", [e.shape(x), e.ints([axis])], "size")


@rule("Concat")
def _concat(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    rank = e.rank(node.output[0])
    axis = attr(node, "axis") % rank
    if len(node.input) == 1:
        return [_only(grads, node)]
    sizes = e.add("Concat", [_axis_size(e, x, axis) for x in node.input], "sizes", axis=0)
    parts = e.add("Split", [_only(grads, node), sizes], "dX", outputs=len(node.input), axis=axis)
    return [part if want else None for part, want in zip(parts, needed)]


@rule("Split")
def _split(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    axis = attr(node, "axis", 0) % e.rank(node.input[0])
    parts = [g if g is not None else e.zeros_like(y, "zero_part") for g, y in zip(grads, node.output)]
    return [e.add("Concat", parts, "dX", axis=axis)] + [None] * (len(node.input) - 1)


def _positions(e: Emitter, x: str) -> str:
    """int64 tensor shaped like forward tensor `x` holding each element's flat index."""
    size = e.add("Size", [x], "size")
    flat = e.add("Range", [e.constant(np.int64(0), "zero_i64"), size, e.constant(np.int64(1), "one_i64")],
                 "flat_positions")
    return e.add("Reshape", [flat, e.shape(x)], "positions")


def _scatter_flat(e: Emitter, x: str, positions: str, g: str, spare: bool = False) -> str:
    """Zeros shaped like `x` with g's values added at the flat `positions` (same shape as g).
    spare: positions may equal Size(x) (padding), a slot scattered to and then dropped."""
    zero = numpy_to_tensor(np.zeros(1, e.dtype(x)))
    size = e.add("Reshape", [e.add("Size", [x], "size"), e.ints([1])], "size_1d")
    slots = e.add("Add", [size, e.ints([1])], "slots") if spare else size
    zeros = e.add("ConstantOfShape", [slots], "zeros_flat", value=zero)
    flat_positions = e.add("Reshape", [positions, e.ints([-1])], "flat_positions")
    flat_g = e.add("Reshape", [g, e.ints([-1])], "flat_g")
    scattered = e.add("ScatterElements", [zeros, flat_positions, flat_g], "scattered", axis=0,
                      reduction="add")
    if spare:
        scattered = e.add("Slice", [scattered, e.ints([0]), size], "scattered_kept")
    return e.add("Reshape", [scattered, e.shape(x)], "dX")


@rule("Slice")
def _slice(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    """Slice the flat positions of X the same way, then scatter the gradient to them: right for
    any starts, ends, axes and steps, and for sizes known only at run time."""
    x = node.input[0]
    picked = e.add("Slice", [_positions(e, x), *node.input[1:]], "picked_positions")
    return [_scatter_flat(e, x, picked, _only(grads, node))] + [None] * (len(node.input) - 1)


@rule("Gather")
def _gather(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    """ScatterND with reduction add into zeros, the gathered axis moved to the front."""
    data, indices = node.input[0], node.input[1]
    rank, index_rank = e.rank(data), e.rank(indices)
    axis = attr(node, "axis", 0) % rank
    g = _only(grads, node)
    # A scalar size: a 1-D one would give a scalar index an axis.
    size = e.add("Gather", [e.shape(data), e.constant(np.int64(axis), "axis")], "axis_size")
    size = e.cast_like(size, indices, "axis_size_cast")
    negative = e.add("Less", [indices, e.constant(np.zeros((), e.dtype(indices)), "zero_index")], "negative")
    wrapped = e.add("Where", [negative, e.add("Add", [indices, size], "wrapped"), indices], "index")
    index = e.add("Cast", [e.unsqueeze(wrapped, [-1], "index_column")], "index_i64", to=data_type_of(np.int64))
    if axis:
        order = [axis, *(i for i in range(rank) if i != axis)]
        g_order = [*range(axis, axis + index_rank), *range(axis), *range(axis + index_rank, rank - 1 + index_rank)]
        g = e.add("Transpose", [g], "g_axis_first", perm=g_order)
        shape = e.add("Gather", [e.shape(data), e.ints(order)], "shape_axis_first")
    else:
        shape = e.shape(data)
    zeros = e.add("ConstantOfShape", [shape], "zeros", value=numpy_to_tensor(np.zeros(1, e.dtype(data))))
    scattered = e.add("ScatterND", [zeros, index, g], "dX" if not axis else "dX_axis_first", reduction="add")
    if axis:
        inverse = [0] * rank
        for position, source in enumerate(order):
            inverse[source] = position
        scattered = e.add("Transpose", [scattered], "dX", perm=inverse)
    return [scattered, None]


# -- reductions and normalizers ---------------------------------------------------------------

def reduce_axes(e: Emitter, node: NodeProto) -> list[int] | None:
    """The normalized axes a Reduce* node reduces (None: it is the identity)."""
    rank = e.rank(node.input[0])
    if len(node.input) > 1 and node.input[1]:
        axes = [int(a) for a in e.value(node.input[1], f"the axes of {label(node)}").reshape(-1)]
    else:
        axes = attr(node, "axes") or []
    if not axes:
        return None if attr(node, "noop_with_empty_axes", 0) else list(range(rank))
    return sorted(a % rank for a in axes)


@rule("ReduceSum", "ReduceMean")
def _reduce(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    x, y, g = node.input[0], node.output[0], _only(grads, node)
    axes = reduce_axes(e, node)
    rest = [None] * (len(node.input) - 1)
    if axes is None:
        return [g, *rest]
    if not attr(node, "keepdims", 1):
        g = e.unsqueeze(g, axes, "g_kept")
    spread = e.add("Expand", [g, e.shape(x)], "dX_spread")
    if node.op_type == "ReduceMean":
        count = e.add("Div", [e.cast_like(e.add("Size", [x], "size_x"), x, "size_x_float"),
                              e.cast_like(e.add("Size", [y], "size_y"), x, "size_y_float")], "count")
        spread = e.add("Div", [spread, count], "dX")
    return [spread, *rest]


@rule("Softmax")
def _softmax(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    y, g = node.output[0], _only(grads, node)
    axis = attr(node, "axis", -1) % e.rank(y)
    dot = e.reduce("ReduceSum", e.add("Mul", [g, y], "g_y"), [axis], True, "g_dot_y")
    return [e.add("Mul", [y, e.add("Sub", [g, dot], "g_centered")], "dX")]


@rule("LogSoftmax")
def _log_softmax(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    y, g = node.output[0], _only(grads, node)
    axis = attr(node, "axis", -1) % e.rank(y)
    total = e.reduce("ReduceSum", g, [axis], True, "g_total")
    return [e.add("Sub", [g, e.add("Mul", [e.add("Exp", [y], "softmax"), total], "softmax_total")], "dX")]


@rule("Dropout")
def _dropout(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    """The gradient where the mask kept the value, scaled as the forward was (decompose.py gives
    every dropping Dropout its mask output; the others became Identity)."""
    g = _only(grads, node)
    x = node.input[0]
    ratio = float(e.value(node.input[1], f"the ratio of {label(node)}")) if len(node.input) > 1 and node.input[1] else 0.5
    kept = e.add("Where", [node.output[1], g, e.scalar(0, x)], "kept")
    return [e.add("Mul", [kept, e.scalar(1 / (1 - ratio), x)], "dX"), None, None][:len(node.input)]


# -- convolution and pooling ------------------------------------------------------------------

def conv_geometry(e: Emitter, node: NodeProto) -> tuple[list[int], list[int], list[int], list[int]]:
    """(kernel, strides, dilations, pads as [begins..., ends...]) of a Conv or pool node, with
    auto_pad resolved at the example's spatial sizes (which the backward assumes fixed)."""
    x = e.example(node.input[0])
    spatial = list(np.shape(x)[2:])
    if node.op_type == "Conv":
        kernel = list(np.shape(e.example(node.input[1]))[2:])
    else:
        kernel = list(attr(node, "kernel_shape"))
    rank = len(spatial)
    strides = list(attr(node, "strides") or [1] * rank)
    dilations = list(attr(node, "dilations") or [1] * rank)
    pads = list(attr(node, "pads") or [0] * (2 * rank))
    auto_pad = attr(node, "auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        for i in range(rank):
            out = -(-spatial[i] // strides[i])
            total = max(0, (out - 1) * strides[i] + dilations[i] * (kernel[i] - 1) + 1 - spatial[i])
            small, large = total // 2, total - total // 2
            pads[i], pads[i + rank] = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
    elif auto_pad == "VALID":
        pads = [0] * (2 * rank)
    return kernel, strides, dilations, pads


@rule("Conv")
def _conv(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    """dX: ConvTranspose of the gradient with the same weights (output_padding restores the rows
    the strides skipped); dW: a grouped Conv of the input with the gradient as weights, batch
    as channels, stride and dilation swapped; dB: the gradient summed over all but channels."""
    g, x, w, y = _only(grads, node), node.input[0], node.input[1], node.output[0]
    kernel, strides, dilations, pads = conv_geometry(e, node)
    group = attr(node, "group", 1)
    x_shape, y_shape = np.shape(e.example(x)), np.shape(e.example(y))
    rank = len(kernel)
    out: Grads = [None] * len(node.input)
    if needed[0]:
        padding = [x_shape[2 + i] - ((y_shape[2 + i] - 1) * strides[i] - pads[i] - pads[i + rank]
                                     + dilations[i] * (kernel[i] - 1) + 1) for i in range(rank)]
        out[0] = e.add("ConvTranspose", [g, w], "dX", strides=strides, pads=pads, dilations=dilations,
                       group=group, output_padding=padding, kernel_shape=kernel)
    if needed[1]:
        channels_in, channels_out = x_shape[1] // group, y_shape[1] // group
        spatial = list(range(2, 2 + rank))
        # X [N, G*Cin, S] -> [Cin, G*N, S]: channel (g, n) of group g; grad [N, G*Cout, O] ->
        # weights [G*Cout, N, O].
        x_groups = e.add("Reshape", [x, e.ints([0, group, channels_in, *x_shape[2:]])], "X_groups")
        x_t = e.add("Transpose", [x_groups], "X_channels_first", perm=[2, 1, 0, *(s + 1 for s in spatial)])
        x_t = e.add("Reshape", [x_t, e.ints([channels_in, -1, *x_shape[2:]])], "X_batch_as_channels")
        g_groups = e.add("Reshape", [g, e.ints([0, group, channels_out, *y_shape[2:]])], "g_groups")
        g_t = e.add("Transpose", [g_groups], "g_channels_first", perm=[1, 2, 0, *(s + 1 for s in spatial)])
        g_t = e.add("Reshape", [g_t, e.ints([group * channels_out, -1, *y_shape[2:]])], "g_as_weights")
        dw = e.add("Conv", [x_t, g_t], "dW_transposed", strides=dilations, dilations=strides, pads=pads,
                   group=group)
        full = [(x_shape[2 + i] + pads[i] + pads[i + rank] - strides[i] * (y_shape[2 + i] - 1) - 1)
                // dilations[i] + 1 for i in range(rank)]
        if full != kernel:  # rows past the last window the forward read
            dw = e.add("Slice", [dw, e.ints([0] * rank), e.ints(kernel), e.ints(spatial)], "dW_kernel")
        out[1] = e.add("Transpose", [dw], "dW", perm=[1, 0, *spatial])
    if len(node.input) > 2 and needed[2]:
        out[2] = e.reduce("ReduceSum", g, [0, *range(2, 2 + rank)], False, "dB")
    return out


@rule("MaxPool")
def _max_pool(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    """The gradient added at the flat positions MaxPool's Indices output names (decompose.py
    gives every differentiated MaxPool that output)."""
    return [_scatter_flat(e, node.input[0], node.output[1], _only(grads, node))]


@rule("GlobalAveragePool")
def _global_average_pool(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    x, y = node.input[0], node.output[0]
    count = e.add("Div", [e.cast_like(e.add("Size", [x], "size_x"), x, "size_x_float"),
                          e.cast_like(e.add("Size", [y], "size_y"), x, "size_y_float")], "count")
    spread = e.add("Expand", [_only(grads, node), e.shape(x)], "spread")
    return [e.add("Div", [spread, count], "dX")]


# -- data movement by an index map --------------------------------------------------------------
# Pad and Tile copy elements of X around: the same op applied to X's flat positions says where
# each output element came from, and the gradient is added back there. Right for every mode
# (reflect, edge and wrap padding copy an element to several places) without re-deriving it.

@rule("Pad")
def _pad(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    x = node.input[0]
    if any(needed[1:]):
        raise ExportError(f"portable export: {label(node)}: only the gradient of Pad's data is supported")
    inputs = [_positions(e, x), *node.input[1:]]
    spare = (attr(node, "mode", "constant") or "constant") == "constant"
    if spare:  # padding reads position Size(x): the spare slot
        size = e.add("Size", [x], "size")
        inputs = [*inputs, ""] if len(inputs) < 3 else inputs
        inputs[2] = size
    picked = e.add("Pad", inputs, "picked_positions", mode=attr(node, "mode", "constant"))
    return [_scatter_flat(e, x, picked, _only(grads, node), spare=spare)] + [None] * (len(node.input) - 1)


@rule("Tile")
def _tile(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    x = node.input[0]
    picked = e.add("Tile", [_positions(e, x), node.input[1]], "picked_positions")
    return [_scatter_flat(e, x, picked, _only(grads, node)), None]


@rule("GatherElements")
def _gather_elements(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    data, indices = node.input[0], node.input[1]
    axis = attr(node, "axis", 0) % e.rank(data)
    return [e.add("ScatterElements", [e.zeros_like(data, "zeros"), indices, _only(grads, node)], "dX",
                  axis=axis, reduction="add"), None]


# -- more elementwise ---------------------------------------------------------------------------

@rule("Clip")
def _clip(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    """The gradient where X lies within [min, max] (bounds as inputs, opset 11 on)."""
    if any(needed[1:]):
        raise ExportError(f"portable export: {label(node)}: the gradient of Clip's bounds is not supported")
    x, g = node.input[0], _only(grads, node)
    inside = None
    for index, compare in ((1, "GreaterOrEqual"), (2, "LessOrEqual")):
        if len(node.input) > index and node.input[index]:
            within = e.add(compare, [x, node.input[index]], "within")
            inside = within if inside is None else e.add("And", [inside, within], "inside")
    if inside is None:
        return [g] + [None] * (len(node.input) - 1)
    return [e.add("Where", [inside, g, e.scalar(0, x)], "dX")] + [None] * (len(node.input) - 1)


@rule("Softplus")
def _softplus(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    return [e.add("Mul", [_only(grads, node), e.add("Sigmoid", [node.input[0]], "sigmoid")], "dX")]


@rule("Elu")
def _elu(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    x, y, g = node.input[0], node.output[0], _only(grads, node)
    positive = e.add("Greater", [x, e.scalar(0, x)], "positive")
    slope = e.add("Add", [y, e.scalar(attr(node, "alpha", 1.0), x)], "slope")
    return [e.add("Where", [positive, g, e.add("Mul", [g, slope], "g_slope")], "dX")]


@rule("HardSigmoid")
def _hard_sigmoid(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    x, y, g = node.input[0], node.output[0], _only(grads, node)
    above = e.add("Greater", [y, e.scalar(0, y)], "above")
    below = e.add("Less", [y, e.scalar(1, y)], "below")
    sloped = e.add("Mul", [g, e.scalar(attr(node, "alpha", 0.2), x)], "sloped")
    return [e.add("Where", [e.add("And", [above, below], "linear"), sloped, e.scalar(0, x)], "dX")]


@rule("Sin")
def _sin(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    return [e.add("Mul", [_only(grads, node), e.add("Cos", [node.input[0]], "cos")], "dX")]


@rule("Cos")
def _cos(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    minus_sin = e.add("Neg", [e.add("Sin", [node.input[0]], "sin")], "minus_sin")
    return [e.add("Mul", [_only(grads, node), minus_sin], "dX")]


@rule("Mean")
def _mean(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    y = node.output[0]
    share = e.add("Div", [_only(grads, node), e.scalar(len(node.input), y)], "share")
    return [e.sum_to(share, x, y) if want else None for x, want in zip(node.input, needed)]


@rule("ReduceMax", "ReduceMin")
def _reduce_extreme(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    """The gradient shared equally among the elements equal to the extreme (as jax does)."""
    x, y, g = node.input[0], node.output[0], _only(grads, node)
    axes = reduce_axes(e, node)
    rest = [None] * (len(node.input) - 1)
    if axes is None:
        return [g, *rest]
    if not attr(node, "keepdims", 1):
        g, y = e.unsqueeze(g, axes, "g_kept"), e.unsqueeze(y, axes, "y_kept")
    chosen = e.cast_like(e.add("Equal", [x, y], "chosen"), x, "chosen_float")
    ties = e.reduce("ReduceSum", chosen, axes, True, "ties")
    share = e.add("Div", [g, ties], "share")
    return [e.add("Mul", [chosen, share], "dX"), *rest]


@rule("AveragePool")
def _average_pool(e: Emitter, node: NodeProto, grads: Grads, needed: list[bool]) -> Grads:
    """Each window's gradient divided by the window's count, spread back by a depthwise
    ConvTranspose with a ones kernel. The counts (with or without the padding) are constants:
    spatial sizes are taken as fixed."""
    x, y, g = node.input[0], node.output[0], _only(grads, node)
    kernel, strides, dilations, pads = conv_geometry(e, node)
    x_shape, y_shape = np.shape(e.example(x)), np.shape(e.example(y))
    rank, channels = len(kernel), x_shape[1]
    low = [-pads[i] if attr(node, "count_include_pad", 0) else 0 for i in range(rank)]
    high = [x_shape[2 + i] + (pads[rank + i] if attr(node, "count_include_pad", 0) else 0) for i in range(rank)]
    counts = np.ones((), np.float64)
    for i in range(rank):
        starts = np.arange(y_shape[2 + i]) * strides[i] - pads[i]
        taps = starts[:, None] + np.arange(kernel[i])[None, :] * dilations[i]
        per_axis = ((taps >= low[i]) & (taps < high[i])).sum(axis=1)
        counts = np.multiply.outer(counts, per_axis)
    share = e.add("Div", [g, e.constant(counts.astype(e.dtype(x)), "window_counts")], "share")
    ones = e.constant(np.ones((channels, 1, *kernel), e.dtype(x)), "ones_kernel")
    padding, pads = list(pads), list(pads)
    for i in range(rank):
        reach = (y_shape[2 + i] - 1) * strides[i] - pads[i] - pads[i + rank] + dilations[i] * (kernel[i] - 1) + 1
        padding[i] = max(0, x_shape[2 + i] - reach)
        # ceil_mode: the last window reaches past the padding; cropping drops what it read there.
        pads[i + rank] += max(0, reach - x_shape[2 + i])
    return [e.add("ConvTranspose", [share, ones], "dX", strides=strides, pads=pads, dilations=dilations,
                  group=channels, output_padding=padding[:rank], kernel_shape=kernel)]
