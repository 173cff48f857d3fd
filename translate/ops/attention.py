"""Attention and its companions: Attention, RotaryEmbedding, LinearAttention,
FlexAttention (ai.onnx.preview) and the SwiGLU gate.

Shared conventions: 4-D tensors are (batch, heads, sequence, head_size); 3-D
ones pack the heads into the last axis, (batch, sequence, heads * head_size).
With fewer key/value heads than query heads (GQA/MQA), query head h reads
key/value head h // (q_heads / kv_heads). A query row whose keys are all masked
gets zero probabilities (and a zero output row) instead of NaN.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from onnxtrain.translate.graph import evaluate_plan
from onnxtrain.translate.ops.common import numpy_dtype
from onnxtrain.translate.registry import op

PREVIEW_DOMAIN = "ai.onnx.preview"


def _split_heads(x: jax.Array, heads: int) -> jax.Array:
    """(batch, seq, heads * size) -> (batch, heads, seq, size)."""
    batch, length, hidden = x.shape
    return x.reshape(batch, length, heads, hidden // heads).transpose(0, 2, 1, 3)


def _merge_heads(x: jax.Array) -> jax.Array:
    """(batch, heads, seq, size) -> (batch, seq, heads * size)."""
    batch, heads, length, size = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch, length, heads * size)


def _repeat_kv_heads(node: Any, x: jax.Array, q_heads: int) -> jax.Array:
    """Key/value heads repeated so that query head h reads head h // group."""
    kv_heads = x.shape[1]
    if kv_heads == q_heads:
        return x
    if kv_heads == 0 or q_heads % kv_heads:
        raise node.error(f"the number of query heads ({q_heads}) must be a multiple of the "
                         f"number of key/value heads ({kv_heads})")
    return jnp.repeat(x, q_heads // kv_heads, axis=1)


def _scaled_scores(q: jax.Array, k: jax.Array, scale: float) -> jax.Array:
    """(Q * sqrt(scale)) @ (K * sqrt(scale))^T, the factor rounded to Q's dtype first."""
    root = jnp.asarray(np.sqrt(scale), q.dtype)
    return jnp.matmul(q * root, jnp.swapaxes(k * root, -1, -2))


def _softmax_rows(scores: jax.Array) -> jax.Array:
    """Softmax over the last axis; a row that is entirely -inf becomes zeros, not NaN."""
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jax.lax.stop_gradient(jnp.where(jnp.isneginf(peak), jnp.zeros_like(peak), peak))
    exponentials = jnp.exp(scores - peak)
    total = jnp.sum(exponentials, axis=-1, keepdims=True)
    return exponentials / jnp.where(total == 0, jnp.ones_like(total), total)


def _additive(allowed: jax.Array, dtype: Any) -> jax.Array:
    """0 where allowed, -inf elsewhere."""
    return jnp.where(allowed, jnp.zeros((), dtype), jnp.full((), -jnp.inf, dtype))


# ---------------------------------------------------------------------------------------
# Attention


def _attention_heads(node: Any, q: Any, k: Any, v: Any) -> tuple[jax.Array, ...]:
    """Q, K, V as 4-D tensors; 3-D inputs are split with q_num_heads / kv_num_heads."""
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if not q.ndim == k.ndim == v.ndim or q.ndim not in (3, 4):
        raise node.error(f"Q, K and V must all be 3-D or all 4-D, got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if q.ndim == 4:
        return q, k, v
    if not (node.has_attr("q_num_heads") and node.has_attr("kv_num_heads")):
        raise node.error("3-D Q, K and V need the q_num_heads and kv_num_heads attributes")
    q_heads, kv_heads = node.attr("q_num_heads"), node.attr("kv_num_heads")
    for name, value, heads in (("Q", q, q_heads), ("K", k, kv_heads), ("V", v, kv_heads)):
        if heads <= 0 or value.shape[2] % heads:
            raise node.error(f"the last axis of {name} ({value.shape[2]}) is not a multiple "
                             f"of its number of heads ({heads})")
    return _split_heads(q, q_heads), _split_heads(k, kv_heads), _split_heads(v, kv_heads)


def _with_cache(node: Any, k: jax.Array, v: jax.Array, past_key: Any,
                past_value: Any) -> tuple[jax.Array, jax.Array]:
    """present_key / present_value: the past cache followed by the new keys and values."""
    if (past_key is None) != (past_value is None):
        raise node.error("past_key and past_value must be given together")
    if past_key is None:
        return k, v
    past_key = jnp.asarray(past_key).astype(k.dtype)
    past_value = jnp.asarray(past_value).astype(v.dtype)
    return jnp.concatenate([past_key, k], axis=2), jnp.concatenate([past_value, v], axis=2)


def _mask_bias(node: Any, mask: Any, kv_length: int, dtype: Any) -> jax.Array:
    """attn_mask as an additive bias padded to kv_length keys (padding is masked)."""
    mask = jnp.asarray(mask)
    missing = kv_length - mask.shape[-1]
    if missing < 0:
        raise node.error(f"attn_mask covers {mask.shape[-1]} keys, more than the "
                         f"{kv_length} of past_key and K together")
    if mask.dtype == jnp.bool_:
        if missing > 0:
            mask = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, missing)],
                           constant_values=False)
        return _additive(mask, dtype)
    mask = mask.astype(dtype)
    if missing > 0:
        mask = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, missing)],
                       constant_values=-jnp.inf)
    return mask


def _allowed_keys(node: Any, q_length: int, kv_length: int, past_length: int | None,
                  nonpad_kv_seqlen: Any) -> jax.Array | None:
    """Which keys each query may see under is_causal, the window attributes and
    nonpad_kv_seqlen: (q, kv) or (batch, 1, q, kv) booleans; None if unrestricted.

    Query i sits at absolute position i + offset, offset being the past length,
    else nonpad_kv_seqlen - q_length per batch entry, else 0.
    """
    causal = bool(node.attr("is_causal", 0))
    left = node.attr("left_window_size", -1)
    right = node.attr("right_window_size", -1)
    if left < -1 or right < -1:
        raise node.error(f"left_window_size and right_window_size must be -1 or nonnegative, "
                         f"got {left} and {right}")
    if not causal and left < 0 and right < 0 and nonpad_kv_seqlen is None:
        return None
    queries = jnp.arange(q_length)[:, None]
    keys = jnp.arange(kv_length)[None, :]
    if past_length is not None:
        position = queries + past_length
    elif nonpad_kv_seqlen is not None:
        valid = jnp.asarray(nonpad_kv_seqlen).astype(jnp.int64).reshape(-1, 1, 1, 1)
        position = queries + (valid - q_length)
    else:
        position = queries
    allowed = jnp.ones(jnp.broadcast_shapes(position.shape, keys.shape), jnp.bool_)
    if causal:
        allowed &= keys <= position
    if left >= 0:
        allowed &= position - keys <= left
    if right >= 0:
        allowed &= keys - position <= right
    if nonpad_kv_seqlen is not None:
        allowed &= keys < valid
    return allowed


def _attention_bias(node: Any, mask: Any, q_length: int, kv_length: int,
                    past_length: int | None, nonpad_kv_seqlen: Any, dtype: Any) -> jax.Array | None:
    """The additive bias of the scores: attn_mask plus the structural masks, or None."""
    bias = None if mask is None else _mask_bias(node, mask, kv_length, dtype)
    allowed = _allowed_keys(node, q_length, kv_length, past_length, nonpad_kv_seqlen)
    if allowed is not None:
        structural = _additive(allowed, dtype)
        bias = structural if bias is None else bias + structural
    return bias


def _softcapped(scores: jax.Array, softcap: float) -> jax.Array:
    """softcap * tanh(scores / softcap) when softcap > 0."""
    if softcap <= 0:
        return scores
    return (softcap * jnp.tanh(scores / softcap)).astype(scores.dtype)


def _check_attention_inputs(node: Any, q: Any, past_key: Any, nonpad_kv_seqlen: Any) -> None:
    heads_given = node.has_attr("q_num_heads") or node.has_attr("kv_num_heads")
    if jnp.ndim(q) == 4 and heads_given and node.opset >= 25:
        raise node.error("q_num_heads and kv_num_heads must not be set for 4-D inputs")
    if nonpad_kv_seqlen is not None and past_key is not None:
        raise node.error("nonpad_kv_seqlen cannot be combined with past_key/past_value")


def _attention_weights(node: Any, biased: jax.Array, bias: jax.Array | None,
                       dtype: Any) -> jax.Array:
    """Softmax of the biased scores in softmax_precision, fully masked rows zeroed, as dtype."""
    precision = (numpy_dtype(node.attr("softmax_precision")) if node.has_attr("softmax_precision")
                 else dtype)
    probabilities = _softmax_rows(biased.astype(precision))
    if bias is not None:
        fully_masked = jnp.isneginf(jnp.max(bias, axis=-1, keepdims=True))
        probabilities = jnp.where(fully_masked, jnp.zeros((), precision), probabilities)
    return probabilities.astype(dtype)


@op("Attention", since=23)
def attention(node: Any, q: Any, k: Any, v: Any, attn_mask: Any = None, past_key: Any = None,
              past_value: Any = None, nonpad_kv_seqlen: Any = None) -> tuple[jax.Array, ...]:
    """softmax(softcap(Q K^T * scale) + bias) V, bias from attn_mask, is_causal (bottom-right),
    windows and nonpad_kv_seqlen; outputs Y, present_key, present_value, qk_matmul_output."""
    _check_attention_inputs(node, q, past_key, nonpad_kv_seqlen)
    q4, k4, v4 = _attention_heads(node, q, k, v)
    present_key, present_value = _with_cache(node, k4, v4, past_key, past_value)
    keys = _repeat_kv_heads(node, present_key, q4.shape[1])
    values = _repeat_kv_heads(node, present_value, q4.shape[1])

    raw = _scaled_scores(q4, keys, node.attr("scale", 1.0 / np.sqrt(q4.shape[-1])))
    capped = _softcapped(raw, node.attr("softcap", 0.0))
    past_length = None if past_key is None else jnp.shape(past_key)[2]
    bias = _attention_bias(node, attn_mask, q4.shape[2], keys.shape[2], past_length,
                           nonpad_kv_seqlen, q4.dtype)
    biased = capped if bias is None else capped + bias
    probabilities = _attention_weights(node, biased, bias, q4.dtype)

    y = jnp.matmul(probabilities, values.astype(q4.dtype))
    if jnp.ndim(q) == 3:
        y = _merge_heads(y)
    qk_output = _qk_matmul_output(node, raw, capped, biased, probabilities)
    return y, present_key, present_value, qk_output.astype(q4.dtype)


def _qk_matmul_output(node: Any, raw: jax.Array, capped: jax.Array, biased: jax.Array,
                      probabilities: jax.Array) -> jax.Array:
    """The stage qk_matmul_output_mode selects: 0 scores, 1 softcapped, 2 biased, 3 softmax."""
    mode = node.attr("qk_matmul_output_mode", 0)
    stages = {0: raw, 1: capped, 2: biased, 3: probabilities}
    if mode not in stages:
        raise node.error(f"qk_matmul_output_mode must be 0, 1, 2 or 3, got {mode}")
    return jnp.broadcast_to(stages[mode], biased.shape)


# ---------------------------------------------------------------------------------------
# RotaryEmbedding


def _rotate(x1: jax.Array, x2: jax.Array, cos: jax.Array, sin: jax.Array,
            interleaved: bool) -> jax.Array:
    """(x1 + i x2) * (cos + i sin), laid out as halves or interleaved pairs."""
    real = cos * x1 - sin * x2
    imaginary = sin * x1 + cos * x2
    if interleaved:
        return jnp.stack([real, imaginary], axis=-1).reshape(*real.shape[:-1], -1)
    return jnp.concatenate([real, imaginary], axis=-1)


@op("RotaryEmbedding", since=23)
def rotary_embedding(node: Any, x: Any, cos_cache: Any, sin_cache: Any,
                     position_ids: Any = None) -> jax.Array:
    """Rotates the first rotary_embedding_dim features of each head by the angles of
    cos_cache/sin_cache (indexed by position_ids when given), halves or interleaved pairs."""
    x = jnp.asarray(x)
    if x.ndim == 3:
        heads = node.attr("num_heads", 0)
        if heads <= 0 or x.shape[2] % heads:
            raise node.error(f"3-D input needs num_heads dividing its last axis ({x.shape[2]}), "
                             f"got num_heads={heads}")
        heads_first = _split_heads(x, heads)
    elif x.ndim == 4:
        heads_first = x
    else:
        raise node.error(f"input must be 3-D or 4-D, got shape {x.shape}")
    head_size = heads_first.shape[-1]
    rotary_dim = node.attr("rotary_embedding_dim", 0) or head_size
    if rotary_dim % 2 or rotary_dim > head_size:
        raise node.error(f"rotary_embedding_dim ({rotary_dim}) must be even and at most the "
                         f"head size ({head_size})")
    cos, sin = jnp.asarray(cos_cache), jnp.asarray(sin_cache)
    if position_ids is not None:
        positions = jnp.asarray(position_ids)
        cos, sin = jnp.take(cos, positions, axis=0), jnp.take(sin, positions, axis=0)
    if cos.shape[-1] != rotary_dim // 2 or sin.shape[-1] != rotary_dim // 2:
        raise node.error(f"cos_cache and sin_cache must have {rotary_dim // 2} values per "
                         f"position (rotary_embedding_dim / 2), got {cos.shape[-1]} and "
                         f"{sin.shape[-1]}")
    # (batch, seq, half) -> (batch, 1, seq, half): the same angles for every head.
    cos, sin = cos[:, None].astype(x.dtype), sin[:, None].astype(x.dtype)
    rotating, passing = heads_first[..., :rotary_dim], heads_first[..., rotary_dim:]
    interleaved = bool(node.attr("interleaved", 0))
    if interleaved:
        x1, x2 = rotating[..., 0::2], rotating[..., 1::2]
    else:
        x1, x2 = jnp.split(rotating, 2, axis=-1)
    rotated = jnp.concatenate([_rotate(x1, x2, cos, sin, interleaved), passing], axis=-1)
    return _merge_heads(rotated) if x.ndim == 3 else rotated


# ---------------------------------------------------------------------------------------
# LinearAttention

_UPDATE_RULES = {"linear": (False, False), "gated": (True, False), "delta": (False, True),
                 "gated_delta": (True, True)}


def _per_step(x: jax.Array, heads: int) -> jax.Array:
    """(batch, T, heads * d) -> (T, batch, heads, d): the scan runs over axis 0."""
    batch, length, hidden = x.shape
    return x.reshape(batch, length, heads, hidden // heads).transpose(1, 0, 2, 3)


def _linear_attention_gates(node: Any, decay: Any, beta: Any, kv_heads: int, key_size: int,
                            compute: Any) -> tuple[jax.Array | None, jax.Array | None]:
    """decay as (T, batch, kv_heads, 1 or d_k) and beta as (T, batch, kv_heads or 1, 1)."""
    rule = node.attr("update_rule", "gated_delta")
    gated, delta = _UPDATE_RULES[rule]
    for name, value, needed in (("decay", decay, gated), ("beta", beta, delta)):
        if needed and value is None:
            raise node.error(f"update_rule {rule!r} needs the {name} input")
        if not needed and value is not None:
            raise node.error(f"update_rule {rule!r} takes no {name} input")
    if decay is not None:
        decay = jnp.asarray(decay).astype(compute)
        if decay.ndim != 3 or decay.shape[-1] not in (kv_heads, kv_heads * key_size):
            raise node.error(f"decay must be (batch, T, {kv_heads}) or (batch, T, "
                             f"{kv_heads * key_size}), got {decay.shape}")
        decay = _per_step(decay, kv_heads)
    if beta is not None:
        beta = jnp.asarray(beta).astype(compute)
        if beta.ndim != 3 or beta.shape[-1] not in (kv_heads, 1):
            raise node.error(f"beta must be (batch, T, {kv_heads}) or (batch, T, 1), "
                             f"got {beta.shape}")
        beta = _per_step(beta, beta.shape[-1])
    return decay, beta


@op("LinearAttention", since=27)
def linear_attention(node: Any, query: Any, key: Any, value: Any, past_state: Any = None,
                     decay: Any = None, beta: Any = None) -> tuple[jax.Array, jax.Array]:
    """Recurrent linear attention: S_t = exp(g_t) S_{t-1} + k_t (x) v'_t (gating optional,
    v'_t = beta_t (v_t - S^T k_t) for delta rules); o_t = scale * q_t^T S_t."""
    rule = node.attr("update_rule", "gated_delta")
    if rule not in _UPDATE_RULES:
        raise node.error(f"update_rule must be one of {', '.join(_UPDATE_RULES)}, got {rule!r}")
    q_heads, kv_heads = node.attr("q_num_heads"), node.attr("kv_num_heads")
    if q_heads <= 0 or kv_heads <= 0 or q_heads % kv_heads:
        raise node.error(f"q_num_heads ({q_heads}) must be a positive multiple of kv_num_heads "
                         f"({kv_heads})")
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    if not query.ndim == key.ndim == value.ndim == 3:
        raise node.error(f"query, key and value must be 3-D (batch, T, heads * size), got "
                         f"{query.shape}, {key.shape}, {value.shape}")
    compute = jnp.promote_types(query.dtype, jnp.float32)
    batch = query.shape[0]
    key_size = query.shape[-1] // q_heads
    value_size = value.shape[-1] // kv_heads
    state_shape = (batch, kv_heads, key_size, value_size)
    if past_state is None:
        state, state_dtype = jnp.zeros(state_shape, compute), query.dtype
    else:
        past_state = jnp.asarray(past_state)
        if past_state.shape != state_shape:
            raise node.error(f"past_state must have shape {state_shape}, got {past_state.shape}")
        state, state_dtype = past_state.astype(compute), past_state.dtype
    decay_steps, beta_steps = _linear_attention_gates(node, decay, beta, kv_heads, key_size,
                                                      compute)
    scale = node.attr("scale", 0.0) or 1.0 / np.sqrt(key_size)
    group = q_heads // kv_heads

    def step(state, inputs):
        q_t, k_t, v_t, decay_t, beta_t = inputs
        if decay_t is not None:
            state = state * jnp.exp(decay_t)[..., None]
        if beta_t is not None:
            v_t = beta_t * (v_t - jnp.einsum("bhdm,bhd->bhm", state, k_t))
        state = state + k_t[..., :, None] * v_t[..., None, :]
        grouped = q_t.reshape(batch, kv_heads, group, key_size)
        read = jnp.einsum("bhgd,bhdm->bhgm", grouped, state).reshape(batch, q_heads, value_size)
        return state, scale * read

    steps = (_per_step(query.astype(compute), q_heads), _per_step(key.astype(compute), kv_heads),
             _per_step(value.astype(compute), kv_heads), decay_steps, beta_steps)
    state, outputs = jax.lax.scan(step, state, steps)
    output = outputs.transpose(1, 0, 2, 3).reshape(batch, query.shape[1], q_heads * value_size)
    return output.astype(query.dtype), state.astype(state_dtype)


# ---------------------------------------------------------------------------------------
# FlexAttention


def _flex_precision(node: Any, dtype: Any) -> Any:
    """softmax_precision, else float32 for inputs narrower than 32 bits, else the input's."""
    if node.has_attr("softmax_precision"):
        return numpy_dtype(node.attr("softmax_precision"))
    return jnp.promote_types(dtype, jnp.float32)


def _run_modifier(node: Any, name: str, tensor: jax.Array) -> jax.Array:
    """Apply the score_mod/prob_mod subgraph when the node has it."""
    if not node.has_attr(name):
        return tensor
    (result,) = evaluate_plan(node.subgraph_plan(name), [tensor], node.scope, node.evaluation)
    result = jnp.asarray(result)
    if result.shape != tensor.shape:
        raise node.error(f"{name} must keep the shape {tensor.shape}, returned {result.shape}")
    return result.astype(tensor.dtype)


@op("FlexAttention", since=1, domain=PREVIEW_DOMAIN)
def flex_attention(node: Any, q: Any, k: Any, v: Any) -> jax.Array:
    """prob_mod(softmax(score_mod(Q K^T * scale))) V over 4-D inputs, the softmax (and the
    subgraphs) in softmax_precision."""
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if not q.ndim == k.ndim == v.ndim == 4:
        raise node.error(f"Q, K and V must be 4-D, got shapes {q.shape}, {k.shape}, {v.shape}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2] or q.shape[3] != k.shape[3]:
        raise node.error(f"K and V must share heads and length, Q and K the head size; got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    q_heads = q.shape[1]
    keys, values = _repeat_kv_heads(node, k, q_heads), _repeat_kv_heads(node, v, q_heads)
    scale = node.attr("scale", 1.0 / np.sqrt(q.shape[-1]))
    precision = _flex_precision(node, q.dtype)
    scores = _scaled_scores(q, keys, float(np.float32(scale))).astype(precision)
    scores = _run_modifier(node, "score_mod", scores)
    probabilities = _run_modifier(node, "prob_mod", _softmax_rows(scores))
    return jnp.matmul(probabilities, values.astype(precision)).astype(v.dtype)


# ---------------------------------------------------------------------------------------
# SwiGLU


@op("SwiGLU", since=28)
def swiglu(node: Any, a: Any, b: Any) -> jax.Array:
    """Swish(A) * B = A * sigmoid(alpha * A) * B, element-wise on equal shapes."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.shape != b.shape:
        raise node.error(f"A and B must have the same shape (no broadcasting), got "
                         f"{a.shape} and {b.shape}")
    alpha = node.attr("alpha", 1.0)
    gate = jax.nn.sigmoid(alpha * a).astype(a.dtype)
    return (a * gate * b.astype(a.dtype)).astype(a.dtype)
