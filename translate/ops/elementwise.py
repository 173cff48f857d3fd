"""Element-wise operators: unary math, binary arithmetic, comparison, logic, bitwise.

Every op keeps ONNX's element types exactly: results are cast back to the
input type wherever jax would otherwise promote (Python scalars, mixed-type
Pow), integer Div truncates toward zero like C, and Mod follows the sign rule
its `fmod` attribute selects. Opsets before 7 align the second operand of a
binary op with the legacy `broadcast`/`axis` attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from onnxtrain.translate.node import Node
from onnxtrain.translate.ops.common import normalize_axis
from onnxtrain.translate.registry import op


def is_text(value: ArrayLike) -> bool:
    """True for host string tensors, which jax cannot hold and numpy must handle."""
    return isinstance(value, np.ndarray) and value.dtype.kind in "OUS"


def is_integer(value: ArrayLike) -> bool:
    return jnp.issubdtype(value.dtype, jnp.integer)


def legacy_aligned(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """B reshaped for opset < 7 broadcasting: with broadcast=1 and `axis`, B's
    dimensions line up with A's starting at `axis` (suffix-aligned without it)."""
    if not node.attr("broadcast", 0) or not node.has_attr("axis"):
        return b
    axis = normalize_axis(node.attr("axis"), np.ndim(a))
    trailing = np.ndim(a) - axis - np.ndim(b)
    if axis < 0 or trailing < 0:
        raise node.error(f"with broadcast=1, B of shape {tuple(np.shape(b))} does not fit A of "
                         f"shape {tuple(np.shape(a))} at axis {node.attr('axis')}")
    return jnp.reshape(b, tuple(np.shape(b)) + (1,) * trailing)


# --- unary math ---------------------------------------------------------------------------

def _unary(name: str, fn: Callable, since: int, doc: str, differentiable: bool = True) -> None:
    """Register fn(x) as op `name` from opset `since` on (later versions only add types)."""

    def handler(node: Node, x: ArrayLike) -> ArrayLike:
        return fn(x)

    handler.__name__ = handler.__qualname__ = name.lower()
    handler.__doc__ = doc
    op(name, since=since, differentiable=differentiable)(handler)


_unary("Abs", jnp.abs, 1, doc="|X| element-wise (unsigned types unchanged).")
_unary("Neg", jnp.negative, 1, doc="-X element-wise (integer overflow wraps).")
_unary("Sign", jnp.sign, 9, doc="-1, 0 or 1 by the sign of X; NaN stays NaN.",
       differentiable=False)
_unary("Ceil", jnp.ceil, 1, doc="Smallest integral value >= X.",
       differentiable=False)
_unary("Floor", jnp.floor, 1, doc="Largest integral value <= X.",
       differentiable=False)
_unary("Round", jnp.round, 11, doc="X rounded to the nearest integer, halves to even.",
       differentiable=False)
_unary("Reciprocal", jnp.reciprocal, 1, doc="1 / X element-wise.")
_unary("Sqrt", jnp.sqrt, 1, doc="Square root; NaN for negative X.")
_unary("Exp", jnp.exp, 1, doc="e ** X element-wise.")
_unary("Log", jnp.log, 1, doc="Natural logarithm; -inf at 0, NaN below.")
_unary("Erf", lax.erf, 9, doc="The Gauss error function.")
_unary("Sin", jnp.sin, 7, doc="Sine of X in radians.")
_unary("Cos", jnp.cos, 7, doc="Cosine of X in radians.")
_unary("Tan", jnp.tan, 7, doc="Tangent of X in radians.")
_unary("Asin", jnp.arcsin, 7, doc="Arcsine, in [-pi/2, pi/2].")
_unary("Acos", jnp.arccos, 7, doc="Arccosine, in [0, pi].")
_unary("Atan", jnp.arctan, 7, doc="Arctangent, in (-pi/2, pi/2).")
_unary("Sinh", jnp.sinh, 9, doc="Hyperbolic sine.")
_unary("Cosh", jnp.cosh, 9, doc="Hyperbolic cosine.")
_unary("Tanh", jnp.tanh, 1, doc="Hyperbolic tangent.")
_unary("Asinh", jnp.arcsinh, 9, doc="Inverse hyperbolic sine.")
_unary("Acosh", jnp.arccosh, 9, doc="Inverse hyperbolic cosine; NaN below 1.")
_unary("Atanh", jnp.arctanh, 9, doc="Inverse hyperbolic tangent; +-inf at +-1.")
_unary("IsNaN", jnp.isnan, 9, doc="True where X is NaN.",
       differentiable=False)
_unary("Not", jnp.logical_not, 1, doc="Logical negation of a bool tensor.",
       differentiable=False)
_unary("BitwiseNot", jnp.bitwise_not, 18, doc="Bitwise complement of an integer tensor.",
       differentiable=False)


@op("IsInf", since=10, differentiable=False)
def is_inf(node: Node, x: ArrayLike) -> ArrayLike:
    """True where X is +inf (detect_positive=1) or -inf (detect_negative=1)."""
    found = jnp.zeros(np.shape(x), bool)
    if node.attr("detect_positive", 1):
        found = found | jnp.isposinf(x)
    if node.attr("detect_negative", 1):
        found = found | jnp.isneginf(x)
    return found


# --- binary arithmetic ----------------------------------------------------------------------

@op("Add", since=1)
def add(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """A + B with broadcasting; integer overflow wraps."""
    return jnp.add(a, legacy_aligned(node, a, b))


@op("Sub", since=1)
def subtract(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """A - B with broadcasting; integer overflow wraps."""
    return jnp.subtract(a, legacy_aligned(node, a, b))


@op("Mul", since=1)
def multiply(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """A * B with broadcasting; integer overflow wraps."""
    return jnp.multiply(a, legacy_aligned(node, a, b))


@op("Div", since=1)
def divide(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """A / B with broadcasting; integer division truncates toward zero (as in C)."""
    b = legacy_aligned(node, a, b)
    if is_integer(a):
        return lax.div(*jnp.broadcast_arrays(a, b))
    return jnp.divide(a, b)


def floor_remainder(a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """A - floor(A / B) * B; a zero result carries B's sign, as in Python's %."""
    remainder = jnp.remainder(a, b)
    if is_integer(remainder):
        return remainder
    return jnp.where(remainder == 0, jnp.copysign(jnp.zeros_like(remainder), b), remainder)


@op("Mod", since=10)
def modulo(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """Remainder of A / B: with the divisor's sign (fmod=0) or the dividend's (fmod=1, C fmod)."""
    fmod = node.attr("fmod", 0)
    if fmod not in (0, 1):
        raise node.error(f"attribute fmod must be 0 or 1, got {fmod}")
    return jnp.fmod(a, b) if fmod else floor_remainder(a, b)


@op("Pow", since=1)
def power(node: Node, base: ArrayLike, exponent: ArrayLike) -> ArrayLike:
    """Base ** Exponent with broadcasting; the result has Base's type (opset 12+: the
    exponent may have another numeric type)."""
    exponent = legacy_aligned(node, base, exponent)
    if not is_integer(base):
        compute = jnp.promote_types(base.dtype, exponent.dtype)
        return jnp.power(jnp.asarray(base, compute), jnp.asarray(exponent, compute)).astype(base.dtype)
    if is_integer(exponent):
        return jnp.power(base, jnp.asarray(exponent, base.dtype))
    real = jnp.power(jnp.asarray(base, jnp.float64), jnp.asarray(exponent, jnp.float64))
    return real.astype(base.dtype)


# --- comparison and logic -----------------------------------------------------------------

@op("Equal", since=1, differentiable=False)
def equal(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """A == B with broadcasting; string tensors compare on the host (opset 19+)."""
    b = legacy_aligned(node, a, b)
    if is_text(a) or is_text(b):
        return np.equal(np.asarray(a, object), np.asarray(b, object)).astype(bool)
    return jnp.equal(a, b)


@op("Greater", since=1, differentiable=False)
def greater(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """A > B with broadcasting."""
    return jnp.greater(a, legacy_aligned(node, a, b))


@op("Less", since=1, differentiable=False)
def less(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """A < B with broadcasting."""
    return jnp.less(a, legacy_aligned(node, a, b))


@op("GreaterOrEqual", since=12, differentiable=False)
def greater_or_equal(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """A >= B with broadcasting."""
    return jnp.greater_equal(a, b)


@op("LessOrEqual", since=12, differentiable=False)
def less_or_equal(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """A <= B with broadcasting."""
    return jnp.less_equal(a, b)


@op("And", since=1, differentiable=False)
def logical_and(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """Logical A and B on bool tensors, with broadcasting."""
    return jnp.logical_and(a, legacy_aligned(node, a, b))


@op("Or", since=1, differentiable=False)
def logical_or(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """Logical A or B on bool tensors, with broadcasting."""
    return jnp.logical_or(a, legacy_aligned(node, a, b))


@op("Xor", since=1, differentiable=False)
def logical_xor(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """Logical A xor B on bool tensors, with broadcasting."""
    return jnp.logical_xor(a, legacy_aligned(node, a, b))


@op("Where", since=9)
def where(node: Node, condition: ArrayLike, x: ArrayLike, y: ArrayLike) -> ArrayLike:
    """X where Condition is true, else Y, all three broadcast together."""
    if is_text(x) or is_text(y):
        return np.where(condition, x, y)
    return jnp.where(condition, x, y)


# --- bitwise ------------------------------------------------------------------------------

@op("BitwiseAnd", since=18, differentiable=False)
def bitwise_and(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """Bitwise A & B of integer tensors, with broadcasting."""
    return jnp.bitwise_and(a, b)


@op("BitwiseOr", since=18, differentiable=False)
def bitwise_or(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """Bitwise A | B of integer tensors, with broadcasting."""
    return jnp.bitwise_or(a, b)


@op("BitwiseXor", since=18, differentiable=False)
def bitwise_xor(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """Bitwise A ^ B of integer tensors, with broadcasting."""
    return jnp.bitwise_xor(a, b)


@op("BitShift", since=11, differentiable=False)
def bit_shift(node: Node, x: ArrayLike, amount: ArrayLike) -> ArrayLike:
    """X shifted LEFT or RIGHT (`direction`) by Y bits; right shifts of signed types
    sign-extend, and a shift < 0 or >= the bit width leaves only the sign fill."""
    direction = node.attr("direction")
    if direction not in ("LEFT", "RIGHT"):
        raise node.error(f"attribute direction must be 'LEFT' or 'RIGHT', got {direction!r}")
    x, amount = jnp.broadcast_arrays(x, jnp.asarray(amount, x.dtype))
    bits = jnp.iinfo(x.dtype).bits
    in_range = (amount >= 0) & (amount < bits)
    if direction == "RIGHT" and jnp.issubdtype(x.dtype, jnp.signedinteger):
        # Shifting by bits - 1 leaves exactly the sign fill: -1 for negative X, else 0.
        return lax.shift_right_arithmetic(x, jnp.where(in_range, amount, bits - 1).astype(x.dtype))
    shift = lax.shift_left if direction == "LEFT" else lax.shift_right_logical
    shifted = shift(x, jnp.where(in_range, amount, 0).astype(x.dtype))
    return jnp.where(in_range, shifted, jnp.zeros_like(x))


# --- variadic -----------------------------------------------------------------------------

def _require_inputs(node: Node, values: tuple) -> None:
    if not values:
        raise node.error("needs at least one input")


def balanced(combine: Callable[[Any, Any], Any], values: Sequence[Any]) -> Any:
    """`combine` over all values as a balanced tree of pairs: depth log2(n) where a fold would
    chain n operations, and XLA's compiler recurses once per link of a chain."""
    values = list(values)
    while len(values) > 1:
        pairs = [combine(values[i], values[i + 1]) for i in range(0, len(values) - 1, 2)]
        values = pairs + values[len(pairs) * 2:]
    return values[0]


@op("Max", since=1)
def maximum(node: Node, *values: ArrayLike) -> ArrayLike:
    """Element-wise maximum of all inputs, broadcast together; NaN wins."""
    _require_inputs(node, values)
    return balanced(jnp.maximum, values)


@op("Min", since=1)
def minimum(node: Node, *values: ArrayLike) -> ArrayLike:
    """Element-wise minimum of all inputs, broadcast together; NaN wins."""
    _require_inputs(node, values)
    return balanced(jnp.minimum, values)


@op("Sum", since=1)
def total(node: Node, *values: ArrayLike) -> ArrayLike:
    """Element-wise sum of all inputs, broadcast together."""
    _require_inputs(node, values)
    return balanced(jnp.add, values)


@op("Mean", since=1)
def mean(node: Node, *values: ArrayLike) -> ArrayLike:
    """Element-wise mean of all inputs, broadcast together."""
    _require_inputs(node, values)
    summed = jnp.asarray(balanced(jnp.add, values))
    return (summed / len(values)).astype(summed.dtype)


# --- clipping -----------------------------------------------------------------------------

def clamp(x: ArrayLike, low: ArrayLike | None, high: ArrayLike | None) -> ArrayLike:
    """min(max(X, low), high), skipping absent bounds; low > high gives high."""
    if low is not None:
        x = jnp.maximum(x, jnp.asarray(low, x.dtype))
    if high is not None:
        x = jnp.minimum(x, jnp.asarray(high, x.dtype))
    return jnp.asarray(x)


@op("Clip", since=1)
def clip_with_attributes(node: Node, x: ArrayLike) -> ArrayLike:
    """X limited to [min, max] given as float attributes (opsets 1-10)."""
    return clamp(x, node.attr("min", None), node.attr("max", None))


@op("Clip", since=11)
def clip(node: Node, x: ArrayLike, low: ArrayLike | None = None,
         high: ArrayLike | None = None) -> ArrayLike:
    """X limited to [min, max] given as optional scalar inputs (opset 11+)."""
    for name, bound in (("min", low), ("max", high)):
        if bound is not None and np.size(bound) != 1:
            raise node.error(f"input {name!r} must be a scalar, got shape {tuple(np.shape(bound))}")
    return clamp(x, None if low is None else jnp.reshape(low, ()),
                 None if high is None else jnp.reshape(high, ()))
