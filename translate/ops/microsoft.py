"""ONNX Runtime's contrib operators (domain com.microsoft, opset 1) that its transformer
optimizer and Hugging Face Optimum emit, outside attention: the fused normalizations
(SkipLayerNormalization, SkipSimplifiedLayerNormalization, EmbedLayerNormalization, and
the LayerNormalization / SimplifiedLayerNormalization that ONNX Runtime registers in the
default domain from opset 1), the GELU family (Gelu, BiasGelu, FastGelu, QuickGelu),
BiasAdd and FusedMatMul. Attention-like ops live in microsoft_attention.

Every handler is written in jax.numpy, so it differentiates like the unfused subgraph the
optimizer replaced. Statistics of 16-bit floats are computed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from onnxtrain.translate.node import Node
from onnxtrain.translate.ops.activation import erf_gelu
from onnxtrain.translate.ops.common import float_attr, normalize_axis
from onnxtrain.translate.ops.normalization import layer_normalization
from onnxtrain.translate.ops.reduce import widened
from onnxtrain.translate.registry import op

MICROSOFT_DOMAIN = "com.microsoft"

# FastGelu's constants as ONNX Runtime's kernel writes them: sqrt(2/pi) and 0.044715*sqrt(2/pi).
_FAST_GELU_A = 0.7978845608028654
_FAST_GELU_B = 0.035677408136300125


# ---------------------------------------------------------------------------------------
# Normalizations


def standardized(x: jax.Array, epsilon: float, simplified: bool,
                 axes: tuple[int, ...] = (-1,)) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x normalized over `axes` (in float32 at least), its mean and 1/sqrt(var + epsilon).

    Args:
        x: the tensor to normalize.
        epsilon: added to the variance (or, when simplified, to the mean square).
        simplified: RMS normalization: no centering, the mean returned is zero.
        axes: the normalized axes, kept as size-1 dims in the statistics.

    Returns:
        (normalized, mean, inv_std_var), normalized in the widened dtype.
    """
    wide = widened(x)
    if simplified:
        mean = jnp.zeros((), wide.dtype)
        centered = wide
    else:
        mean = jnp.mean(wide, axis=axes, keepdims=True)
        centered = wide - mean
    inv_std_var = jax.lax.rsqrt(jnp.mean(centered * centered, axis=axes, keepdims=True) + epsilon)
    return centered * inv_std_var, mean, inv_std_var


def _skip_norm(node: Node, x: ArrayLike, skip: ArrayLike, gamma: ArrayLike, beta: ArrayLike | None,
               bias: ArrayLike | None, simplified: bool) -> tuple[jax.Array, ...]:
    """(output, mean, inv_std_var, input + skip + bias) of the Skip*LayerNormalization ops."""
    x, skip, gamma = jnp.asarray(x), jnp.asarray(skip), jnp.asarray(gamma)
    hidden = x.shape[-1]
    for name, value in (("skip", skip), ("gamma", gamma), ("beta", beta), ("bias", bias)):
        if value is not None and jnp.shape(value)[-1] != hidden:
            raise node.error(f"{name} has shape {tuple(jnp.shape(value))}; its last axis must be "
                             f"the hidden size of the input ({hidden})")
    total = x + skip
    if bias is not None:
        total = total + bias
    normalized, mean, inv_std_var = standardized(total, float_attr(node, "epsilon", 1e-12),
                                                 simplified)
    y = normalized * widened(gamma)
    if beta is not None:
        y = y + widened(beta)
    mean = jnp.broadcast_to(mean, inv_std_var.shape)
    return y.astype(x.dtype), mean, inv_std_var, total.astype(x.dtype)


@op("SkipLayerNormalization", since=1, domain=MICROSOFT_DOMAIN)
def skip_layer_normalization(node: Node, x: ArrayLike, skip: ArrayLike, gamma: ArrayLike,
                             beta: ArrayLike | None = None,
                             bias: ArrayLike | None = None) -> tuple[jax.Array, ...]:
    """LayerNorm(input + skip + bias) * gamma + beta over the last axis.

    Outputs: output, mean, inv_std_var (last axis kept as 1) and input_skip_bias_sum.
    """
    return _skip_norm(node, x, skip, gamma, beta, bias, simplified=False)


@op("SkipSimplifiedLayerNormalization", since=1, domain=MICROSOFT_DOMAIN)
def skip_simplified_layer_normalization(node: Node, x: ArrayLike, skip: ArrayLike,
                                        gamma: ArrayLike,
                                        bias: ArrayLike | None = None) -> tuple[jax.Array, ...]:
    """RMSNorm(input + skip + bias) * gamma over the last axis.

    Outputs: output, mean (zeros: no centering), inv_std_var and input_skip_bias_sum.
    """
    return _skip_norm(node, x, skip, gamma, None, bias, simplified=True)


# ONNX Runtime registers LayerNormalization in the default domain from opset 1 (the
# standard's version, with the same attributes, came in opset 17), so exports at older
# opsets carry it; the opset-17 handler serves both.
op("LayerNormalization", since=1)(layer_normalization)


@op("SimplifiedLayerNormalization", since=1)
def simplified_layer_normalization(node: Node, x: ArrayLike,
                                   scale: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """ONNX Runtime's RMS normalization (default domain): x / sqrt(mean(x^2) + epsilon) * scale
    over the dims from `axis` on. Outputs Y and inv_std_var (reduced dims kept as 1)."""
    x = jnp.asarray(x)
    if node.attr("stash_type", 1) != 1:
        raise node.unsupported(f"stash_type {node.attr('stash_type')} is not supported (only 1, "
                               "float32); re-export with the default stash_type")
    axes = tuple(range(normalize_axis(node.attr("axis", -1), x.ndim), x.ndim))
    normalized, _, inv_std_var = standardized(x, float_attr(node, "epsilon", 1e-5), True, axes)
    return (normalized * widened(scale)).astype(x.dtype), inv_std_var


@op("EmbedLayerNormalization", since=1, domain=MICROSOFT_DOMAIN)
def embed_layer_normalization(node: Node, input_ids: ArrayLike, segment_ids: ArrayLike | None,
                              word_embedding: ArrayLike, position_embedding: ArrayLike,
                              segment_embedding: ArrayLike | None = None,
                              gamma: ArrayLike | None = None, beta: ArrayLike | None = None,
                              mask: ArrayLike | None = None,
                              position_ids: ArrayLike | None = None) -> tuple[jax.Array, ...]:
    """BERT's embedding layer: LayerNorm(word[ids] + position[pos] + segment[segment_ids]).

    Positions are position_ids ((batch, seq) or (1, seq)) or 0..seq-1. Outputs: output,
    mask_index (int32 per batch row: the number of nonzero mask entries, as ONNX Runtime
    computes it; zeros without a mask) and embedding_sum (the sum before normalization).
    """
    if gamma is None or beta is None:
        raise node.error("gamma and beta (inputs 5 and 6) are required")
    if (segment_ids is None) != (segment_embedding is None):
        raise node.error("segment_ids and segment_embedding must be given together")
    ids = jnp.asarray(input_ids)
    if ids.ndim != 2:
        raise node.error(f"input_ids must be 2-D (batch, sequence), got shape {ids.shape}")
    words = jnp.asarray(word_embedding)
    total = jnp.take(words, ids, axis=0)
    if position_ids is None:
        positions = jnp.arange(ids.shape[1])[None, :]
    else:
        positions = jnp.asarray(position_ids)
    total = total + jnp.take(jnp.asarray(position_embedding), positions, axis=0)
    if segment_ids is not None:
        total = total + jnp.take(jnp.asarray(segment_embedding), jnp.asarray(segment_ids), axis=0)
    normalized, _, _ = standardized(total, float_attr(node, "epsilon", 1e-12), False)
    y = (normalized * widened(gamma) + widened(beta)).astype(words.dtype)
    if mask is None:
        mask_index = jnp.zeros(ids.shape[:1], jnp.int32)
    else:
        mask_index = jnp.sum(jnp.asarray(mask) != 0, axis=1).astype(jnp.int32)
    return y, mask_index, total


# ---------------------------------------------------------------------------------------
# GELU family and BiasAdd


@op("Gelu", since=1, domain=MICROSOFT_DOMAIN)
def gelu(node: Node, x: ArrayLike) -> jax.Array:
    """x * Phi(x) with the exact normal CDF."""
    return erf_gelu(jnp.asarray(x))


@op("BiasGelu", since=1, domain=MICROSOFT_DOMAIN)
def bias_gelu(node: Node, a: ArrayLike, b: ArrayLike) -> jax.Array:
    """Gelu(A + B), B a bias along the last axis."""
    return erf_gelu(jnp.asarray(a) + b)


@op("FastGelu", since=1, domain=MICROSOFT_DOMAIN)
def fast_gelu(node: Node, x: ArrayLike, bias: ArrayLike | None = None) -> jax.Array:
    """The tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) of Gelu(x + bias)."""
    x = jnp.asarray(x)
    if bias is not None:
        x = x + bias
    inner = x * (_FAST_GELU_A + _FAST_GELU_B * x * x)
    return x * (0.5 * (1 + jnp.tanh(inner)))


@op("QuickGelu", since=1, domain=MICROSOFT_DOMAIN)
def quick_gelu(node: Node, x: ArrayLike) -> jax.Array:
    """x * sigmoid(alpha * x), alpha 1.702 by default."""
    x = jnp.asarray(x)
    return x * jax.nn.sigmoid(float_attr(node, "alpha", 1.702) * x)


@op("BiasAdd", since=1, domain=MICROSOFT_DOMAIN)
def bias_add(node: Node, x: ArrayLike, bias: ArrayLike, skip: ArrayLike) -> jax.Array:
    """X + bias + skip (X and skip (N, S, C), bias (C))."""
    return jnp.asarray(x) + bias + skip


# ---------------------------------------------------------------------------------------
# FusedMatMul


def _fused_operand(x: jax.Array, batch_first: bool, transpose: bool) -> jax.Array:
    """A FusedMatMul operand with its transBatch and trans attributes applied.

    transBatch moves dim 0 behind the other batch dims (the Transpose perm [1, ..., r-2, 0,
    r-1] it replaced); trans then swaps the last two dims.
    """
    if batch_first and x.ndim > 2:
        x = jnp.moveaxis(x, 0, x.ndim - 2)
    if transpose and x.ndim >= 2:
        x = jnp.swapaxes(x, -1, -2)
    return x


@op("FusedMatMul", since=1, domain=MICROSOFT_DOMAIN)
def fused_matmul(node: Node, a: ArrayLike, b: ArrayLike) -> jax.Array:
    """alpha * MatMul(op(A), op(B)), op given by transA/transB and transBatchA/transBatchB."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    a = _fused_operand(a, bool(node.attr("transBatchA", 0)), bool(node.attr("transA", 0)))
    b = _fused_operand(b, bool(node.attr("transBatchB", 0)), bool(node.attr("transB", 0)))
    product = jnp.matmul(a, b)
    alpha = float_attr(node, "alpha", 1.0)
    return product if alpha == 1.0 else (product * alpha).astype(product.dtype)
