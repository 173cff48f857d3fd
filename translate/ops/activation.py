"""Activation functions: the Relu family, sigmoids, smooth rectifiers, Gelu, Shrink.

Float attributes are stored in ONNX as float32, so their defaults are rounded
to float32 as well. Exponentials are evaluated only where their branch is
selected (on min(X, 0)), so large inputs give finite values and gradients.
Results keep the input's element type.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from onnxtrain.translate.node import Node
from onnxtrain.translate.ops.common import float_attr
from onnxtrain.translate.registry import op

SELU_ALPHA = 1.67326319217681884765625
SELU_GAMMA = 1.05070102214813232421875


def negative_expm1(x: ArrayLike) -> ArrayLike:
    """exp(min(X, 0)) - 1: the negative branch of the exponential units, overflow-free."""
    return jnp.expm1(jnp.minimum(x, 0))


@op("Relu", since=1)
def relu(node: Node, x: ArrayLike) -> ArrayLike:
    """max(X, 0); float types, and signed integers from opset 14."""
    return jax.nn.relu(x)


@op("LeakyRelu", since=1)
def leaky_relu(node: Node, x: ArrayLike) -> ArrayLike:
    """X for X >= 0, alpha * X below (alpha defaults to 0.01)."""
    return jnp.where(x >= 0, x, float_attr(node, "alpha", 0.01) * x)


@op("PRelu", since=1)
def prelu_legacy(node: Node, x: ArrayLike, slope: ArrayLike) -> ArrayLike:
    """X for X >= 0, Slope * X below; opsets 1-6: a 1-D Slope holds one value per channel (axis 1)."""
    if np.ndim(slope) == 1 and np.size(slope) > 1 and np.ndim(x) > 2:
        slope = jnp.reshape(slope, (-1,) + (1,) * (np.ndim(x) - 2))
    return prelu(node, x, slope)


@op("PRelu", since=7)
def prelu(node: Node, x: ArrayLike, slope: ArrayLike) -> ArrayLike:
    """X for X >= 0, Slope * X below, Slope broadcast to X's shape."""
    return jnp.where(x >= 0, x, slope * x).astype(x.dtype)


@op("Elu", since=1)
def elu(node: Node, x: ArrayLike) -> ArrayLike:
    """X for X > 0, alpha * (exp(X) - 1) below (alpha defaults to 1)."""
    return jnp.where(x > 0, x, float_attr(node, "alpha", 1.0) * negative_expm1(x))


@op("Selu", since=1)
def selu(node: Node, x: ArrayLike) -> ArrayLike:
    """gamma * (X for X > 0, alpha * (exp(X) - 1) below), with SELU's constants by default."""
    alpha = float_attr(node, "alpha", SELU_ALPHA)
    gamma = float_attr(node, "gamma", SELU_GAMMA)
    return gamma * jnp.where(x > 0, x, alpha * negative_expm1(x))


@op("Celu", since=12)
def celu(node: Node, x: ArrayLike) -> ArrayLike:
    """max(0, X) + min(0, alpha * (exp(X / alpha) - 1)) (alpha defaults to 1)."""
    alpha = float_attr(node, "alpha", 1.0)
    return jnp.where(x > 0, x, alpha * jnp.expm1(jnp.minimum(x, 0) / alpha))


@op("ThresholdedRelu", since=10)
def thresholded_relu(node: Node, x: ArrayLike) -> ArrayLike:
    """X where X > alpha, else 0 (alpha defaults to 1)."""
    return jnp.where(x > float_attr(node, "alpha", 1.0), x, jnp.zeros_like(x))


@op("Sigmoid", since=1)
def sigmoid(node: Node, x: ArrayLike) -> ArrayLike:
    """1 / (1 + exp(-X))."""
    return jax.nn.sigmoid(x)


@op("HardSigmoid", since=1)
def hard_sigmoid(node: Node, x: ArrayLike) -> ArrayLike:
    """max(0, min(1, alpha * X + beta)) (alpha 0.2, beta 0.5 by default)."""
    alpha = float_attr(node, "alpha", 0.2)
    beta = float_attr(node, "beta", 0.5)
    return jnp.clip(alpha * x + beta, 0, 1)


@op("HardSwish", since=14)
def hard_swish(node: Node, x: ArrayLike) -> ArrayLike:
    """X * max(0, min(1, X / 6 + 1/2))."""
    return x * jnp.clip(x * (1 / 6) + 0.5, 0, 1)


@op("Swish", since=24)
def swish(node: Node, x: ArrayLike) -> ArrayLike:
    """X * sigmoid(alpha * X) (alpha defaults to 1)."""
    return x * jax.nn.sigmoid(float_attr(node, "alpha", 1.0) * x)


@op("Softplus", since=1)
def softplus(node: Node, x: ArrayLike) -> ArrayLike:
    """log(exp(X) + 1), computed without overflow."""
    return jax.nn.softplus(x)


@op("Softsign", since=1)
def softsign(node: Node, x: ArrayLike) -> ArrayLike:
    """X / (1 + |X|)."""
    return x / (1 + jnp.abs(x))


@op("Mish", since=18)
def mish(node: Node, x: ArrayLike) -> ArrayLike:
    """X * tanh(softplus(X))."""
    return x * jnp.tanh(jax.nn.softplus(x))


def erf_gelu(x: ArrayLike) -> ArrayLike:
    """x * Phi(x) with the exact normal CDF (ONNX Gelu and ONNX Runtime's contrib Gelu)."""
    return x * (0.5 * (1 + jax.lax.erf(x * math.sqrt(0.5))))


@op("Gelu", since=20)
def gelu(node: Node, x: ArrayLike) -> ArrayLike:
    """X * Phi(X) with the exact normal CDF (approximate='none') or its tanh approximation."""
    approximate = node.attr("approximate", "none")
    if approximate == "none":
        return erf_gelu(x)
    if approximate == "tanh":
        inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)
        return x * (0.5 * (1 + jnp.tanh(inner)))
    raise node.error(f"attribute approximate must be 'none' or 'tanh', got {approximate!r}")


@op("Shrink", since=9)
def shrink(node: Node, x: ArrayLike) -> ArrayLike:
    """X + bias below -lambd, X - bias above lambd, 0 in between (lambd 0.5, bias 0)."""
    lambd = float_attr(node, "lambd", 0.5)
    bias = float_attr(node, "bias", 0.0)
    shrunk = jnp.where(x < -lambd, x + bias, jnp.where(x > lambd, x - bias, 0))
    return shrunk.astype(x.dtype)
