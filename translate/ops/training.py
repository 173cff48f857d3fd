"""Optimizers of ai.onnx.preview.training v1: Adagrad, Momentum, Adam.

Each takes a learning rate R and an int64 step count T, then n tensors X, their
gradients G and one or two state slots per tensor, in blocks of n (X1..Xn,
G1..Gn, ...); it returns the new tensors followed by the new states, block by
block. Every tensor is updated on its own, element-wise. T means something
different per op: Adagrad decays R with it, Momentum scales G by beta only from
T > 0 on, Adam applies bias correction only from T > 0 on (feed it 1-based).
Scalar coefficients are computed in float64 from the attributes as stored
(float32) and cast to each tensor's dtype, which every output keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from onnxtrain.translate.ops.common import float_attr
from onnxtrain.translate.registry import TRAINING_DOMAIN, op


def _blocks(node: Any, tensors: Sequence[Any], per_tensor: int) -> list[tuple[Any, ...]]:
    """Regroup X1..Xn, G1..Gn, S1..Sn, ... into one (X, G, S, ...) tuple per tensor."""
    if not tensors or len(tensors) % per_tensor:
        names = ", ".join(["X", "G", "V", "H"][:per_tensor])
        raise node.error(
            f"takes R, T and then {per_tensor} blocks of n tensors ({names}), so the number of "
            f"inputs after R and T must be a positive multiple of {per_tensor}; got {len(tensors)}")
    count = len(tensors) // per_tensor
    return [tuple(tensors[block * count + index] for block in range(per_tensor))
            for index in range(count)]


def _unblock(updates: Sequence[tuple[Any, ...]]) -> tuple[Any, ...]:
    """Per-tensor (X_new, S_new, ...) tuples back to X1_new..Xn_new, S1_new..Sn_new, ..."""
    return tuple(value for block in zip(*updates) for value in block)


def _scalar(value: Any) -> jax.Array:
    """R, or T (an int64 tensor in the model), as a float64 scalar."""
    return jnp.asarray(value).astype(jnp.float64).reshape(())


class _Scalars:
    """A node's scalar coefficients, given as float64 values (constants or traced) and each
    cast once per tensor dtype. They are the same for every tensor the node updates: casting
    or deriving them per tensor would trace the same scalar ops once per weight, a good part
    of tracing a whole step on a model of many weights."""

    def __init__(self, **values: Any):
        self._values = values
        self._cast: dict[tuple[str, Any], jax.Array] = {}

    def __call__(self, name: str, like: jax.Array) -> jax.Array:
        """Coefficient `name` in the dtype of the tensor it multiplies."""
        key = (name, like.dtype)
        if key not in self._cast:
            self._cast[key] = jnp.asarray(self._values[name], jnp.float64).astype(like.dtype)
        return self._cast[key]


def _regularized(g: jax.Array, x: jax.Array, norm: float, scalars: _Scalars) -> jax.Array:
    """G + norm * X; with norm 0 the term is left out (XLA keeps 0 * X, since 0 * inf is NaN,
    which costs a read of every weight per step)."""
    return g + scalars("norm", x) * x if norm else g


def _update_all(node: Any, tensors: Sequence[Any], per_tensor: int,
                update: Callable[..., tuple[Any, ...]]) -> tuple[Any, ...]:
    blocks = _blocks(node, tensors, per_tensor)
    return _unblock([update(*[jnp.asarray(v) for v in block]) for block in blocks])


@op("Adagrad", since=1, domain=TRAINING_DOMAIN)
def adagrad(node: Any, r: Any, t: Any, *tensors: Any) -> tuple[Any, ...]:
    """X -= R/(1+T*decay) * G' / (sqrt(H + G'^2) + eps), H += G'^2, with G' = G + nc*X."""
    norm = float_attr(node, "norm_coefficient", 0.0)
    decay = float_attr(node, "decay_factor", 0.0)
    scalars = _Scalars(norm=norm, epsilon=float_attr(node, "epsilon", 1e-6),
                       rate=_scalar(r) / (1.0 + _scalar(t) * decay))

    def update(x, g, h):
        g_reg = _regularized(g, x, norm, scalars)
        h_new = h + (g_reg * g_reg).astype(h.dtype)
        root = jnp.sqrt(h_new).astype(x.dtype) + scalars("epsilon", x)
        return (x - scalars("rate", x) * g_reg / root).astype(x.dtype), h_new

    return _update_all(node, tensors, 3, update)


_MOMENTUM_MODES = ("standard", "nesterov")


@op("Momentum", since=1, domain=TRAINING_DOMAIN)
def momentum(node: Any, r: Any, t: Any, *tensors: Any) -> tuple[Any, ...]:
    """V = alpha*V + beta'*G' (beta' = 1 at T == 0), with G' = G + nc*X; X -= R*V (standard)
    or X -= R*(G' + alpha*V) (nesterov)."""
    alpha = node.attr("alpha")
    norm = node.attr("norm_coefficient")
    mode = node.attr("mode")
    if mode not in _MOMENTUM_MODES:
        raise node.error(f"mode must be 'standard' or 'nesterov', got {mode!r}")
    scalars = _Scalars(alpha=alpha, norm=norm, rate=_scalar(r),
                       gradient_scale=jnp.where(_scalar(t) > 0, node.attr("beta"), 1.0))

    def update(x, g, v):
        g_reg = _regularized(g, x, norm, scalars)
        v_new = (scalars("alpha", v) * v + scalars("gradient_scale", v) * g_reg).astype(v.dtype)
        direction = v_new if mode == "standard" else g_reg + scalars("alpha", x) * v_new
        return (x - scalars("rate", x) * direction).astype(x.dtype), v_new

    return _update_all(node, tensors, 3, update)


@op("Adam", since=1, domain=TRAINING_DOMAIN)
def adam(node: Any, r: Any, t: Any, *tensors: Any) -> tuple[Any, ...]:
    """V = alpha*V + (1-alpha)*G', H = beta*H + (1-beta)*G'^2 with G' = G + nc*X;
    X = (1-nc_post) * (X - R' * V / (sqrt(H) + eps)), R' bias-corrected only when T > 0."""
    alpha = float_attr(node, "alpha", 0.9)
    beta = float_attr(node, "beta", 0.999)
    norm = float_attr(node, "norm_coefficient", 0.0)
    scalars = _Scalars(alpha=alpha, beta=beta, norm=norm, one_minus_alpha=1.0 - alpha,
                       one_minus_beta=1.0 - beta, epsilon=float_attr(node, "epsilon", 1e-6),
                       post_scale=1.0 - float_attr(node, "norm_coefficient_post", 0.0),
                       rate=_bias_corrected_rate(_scalar(r), _scalar(t), alpha, beta))

    def update(x, g, v, h):
        g_reg = _regularized(g, x, norm, scalars)
        v_new = (scalars("alpha", v) * v + scalars("one_minus_alpha", v) * g_reg).astype(v.dtype)
        h_new = (scalars("beta", h) * h + scalars("one_minus_beta", h) * g_reg * g_reg).astype(h.dtype)
        root = jnp.sqrt(h_new).astype(x.dtype) + scalars("epsilon", x)
        x_new = x - scalars("rate", x) * v_new.astype(x.dtype) / root
        return (scalars("post_scale", x) * x_new).astype(x.dtype), v_new, h_new

    return _update_all(node, tensors, 4, update)


def _bias_corrected_rate(rate: jax.Array, step: jax.Array, alpha: float, beta: float) -> jax.Array:
    """R * sqrt(1 - beta^T) / (1 - alpha^T) for T > 0, else R."""
    safe_step = jnp.where(step > 0, step, 1.0)
    corrected = rate * jnp.sqrt(1.0 - beta ** safe_step) / (1.0 - alpha ** safe_step)
    return jnp.where(step > 0, corrected, rate)
