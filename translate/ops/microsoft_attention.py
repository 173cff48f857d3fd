"""ONNX Runtime's contrib attention operators (domain com.microsoft, opset 1): Attention
(BERT and GPT-2 after the transformer optimizer), MultiHeadAttention, GroupQueryAttention
(Llama-style models from Optimum / the model builder) and RotaryEmbedding.

Masks follow ONNX Runtime's kernels: a key a mask excludes gets mask_filter_value added to
its score rather than -inf (so a query whose keys are all masked averages the values as ONNX
Runtime does, rather than turning NaN), while a later key under unidirectional (causal)
attention gets the lowest float, which outweighs any mask; GroupQueryAttention leaves every
masked key out of the softmax.
Modes that ONNX Runtime's optimizer and Optimum do not emit for training (shared past/present
buffers, quantized KV caches, ragged packing) raise UnsupportedOpError naming the node and the
attribute or input.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from onnxtrain.translate.node import Node
from onnxtrain.translate.ops.attention import _merge_heads, _rotate, _split_heads
from onnxtrain.translate.ops.common import float_attr, host_ints
from onnxtrain.translate.ops.microsoft import MICROSOFT_DOMAIN
from onnxtrain.translate.registry import op


def _unsupported_attr(node: Node, name: str, default: Any = 0) -> None:
    """Raise UnsupportedOpError when attribute `name` is set to other than its default."""
    value = node.attr(name, default)
    if value != default:
        raise node.unsupported(f"attribute {name}={value!r} is not supported; onnxtrain runs "
                               f"this op with {name}={default!r} only")


def _unsupported_input(node: Node, index: int, value: Any, name: str) -> None:
    if value is not None:
        raise node.unsupported(f"input {index} ({name}) is not supported; remove it or run "
                               "the unfused model")


def _scale(node: Node, head_size: int) -> float:
    """The scale attribute, or 1/sqrt(head_size) when absent or 0."""
    scale = float_attr(node, "scale", 0.0)
    return scale if scale != 0.0 else 1.0 / math.sqrt(head_size)


def _heads(node: Node, hidden: int, what: str, heads: int | None = None) -> int:
    """The head size of a packed hidden axis split into `heads` (num_heads) heads."""
    heads = node.attr("num_heads") if heads is None else heads
    if heads <= 0 or hidden % heads:
        raise node.error(f"{what} has {hidden} features, not a positive multiple of the "
                         f"{heads} heads")
    return hidden // heads


def _masked(scores: jax.Array, allowed: jax.Array | None, fill: float,
            causal: jax.Array | None) -> jax.Array:
    """scores with `fill` added where keys are not `allowed`, and replaced by the lowest float
    (finite, so that the gradient stays finite) where keys are not `causal`."""
    if allowed is not None:
        scores = scores + jnp.where(allowed, jnp.zeros((), scores.dtype),
                                    jnp.asarray(fill, scores.dtype))
    if causal is not None:
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    return scores


def _causal(q_length: int, kv_length: int, past: Any) -> jax.Array:
    """(q, kv) booleans: query i (at absolute position past + i) sees keys up to itself."""
    return jnp.arange(kv_length)[None, :] <= jnp.arange(q_length)[:, None] + past


def _key_mask(node: Node, mask: Any, batch: int, q_length: int, kv_length: int,
              past_length: int, what: str) -> jax.Array | None:
    """ONNX Runtime's mask_index / key_padding_mask forms as (batch, 1, q | 1, kv) booleans.

    (batch): keys before each row's end position; (2 * batch): end positions then start
    positions (left padding); (batch, kv) and (batch, q, kv): nonzero entries are keys to
    attend; (batch, 1, max, max): Megatron's causal mask, the block of the current
    positions; (batch, 1) or (1, 1): a placeholder that masks nothing.
    """
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    keys = jnp.arange(kv_length)
    if mask.ndim == 1 and mask.shape[0] in (batch, 2 * batch):
        allowed = keys[None, :] < mask[:batch, None]
        if mask.shape[0] == 2 * batch:
            allowed &= keys[None, :] >= mask[batch:, None]
        return allowed[:, None, None, :]
    if mask.ndim == 2 and mask.shape[1] == 1 and kv_length != 1:
        return None
    if mask.ndim == 2 and mask.shape[1] == kv_length:
        return (mask != 0)[:, None, None, :]
    if mask.ndim == 3 and mask.shape[1:] == (q_length, kv_length):
        return (mask != 0)[:, None, :, :]
    if mask.ndim == 4 and mask.shape[1] == 1 and mask.shape[2] >= past_length + q_length \
            and mask.shape[3] >= kv_length:
        block = mask[:, :, past_length:past_length + q_length, :kv_length]
        return block != 0
    raise node.unsupported(f"{what} of shape {tuple(mask.shape)} is not supported for batch "
                           f"{batch}, {q_length} queries and {kv_length} keys; use (batch), "
                           "(2 * batch), (batch, keys), (batch, queries, keys) or "
                           "(batch, 1, max, max)")


def _attend(node: Node, q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
            allowed: jax.Array | None, past_length: int,
            attention_bias: Any) -> tuple[jax.Array, jax.Array]:
    """(batch, heads, q, size) attention output and the scores it takes the softmax of
    (scaled, biased and masked); keys not `allowed` are masked, and later keys too when the
    node is unidirectional."""
    scores = jnp.matmul(q, jnp.swapaxes(k, -1, -2)) * jnp.asarray(scale, q.dtype)
    biased = scores if attention_bias is None else scores + jnp.asarray(attention_bias)
    fill = float_attr(node, "mask_filter_value", -10000.0)
    causal = (_causal(q.shape[2], k.shape[2], past_length) if node.attr("unidirectional", 0)
              else None)
    logits = _masked(biased, allowed, fill, causal)
    probabilities = jax.nn.softmax(logits, axis=-1)
    return jnp.matmul(probabilities.astype(v.dtype), v), logits


# ---------------------------------------------------------------------------------------
# Attention


@op("Attention", since=1, domain=MICROSOFT_DOMAIN)
def attention(node: Node, x: ArrayLike, weights: ArrayLike, bias: ArrayLike | None = None,
              mask_index: ArrayLike | None = None, past: ArrayLike | None = None,
              attention_bias: ArrayLike | None = None,
              past_sequence_length: ArrayLike | None = None) -> tuple[jax.Array, ...]:
    """Self-attention with the Q, K, V projections merged into one weight (BERT, GPT-2).

    input (batch, seq, in) @ weights (in, q + k + v) + bias, split per qkv_hidden_sizes (or in
    thirds) and into num_heads heads; past (2, batch, heads, past, size) precedes K and V;
    unidirectional masks later keys; mask_index in any of ONNX Runtime's forms. Outputs the
    attention (batch, seq, v) and present (2, batch, heads, past + seq, size).
    """
    _unsupported_attr(node, "do_rotary")
    _unsupported_attr(node, "past_present_share_buffer")
    _unsupported_input(node, 6, past_sequence_length, "past_sequence_length")
    x, weights = jnp.asarray(x), jnp.asarray(weights)
    if x.ndim != 3 or weights.ndim != 2 or weights.shape[0] != x.shape[2]:
        raise node.error(f"input (batch, seq, in) and weights (in, q + k + v) do not fit: "
                         f"shapes {x.shape} and {weights.shape}")
    sizes = node.attr("qkv_hidden_sizes", None)
    if sizes is None:
        if weights.shape[1] % 3:
            raise node.error(f"weights have {weights.shape[1]} columns, not divisible by 3; "
                             "set qkv_hidden_sizes")
        sizes = [weights.shape[1] // 3] * 3
    if len(sizes) != 3 or sum(sizes) != weights.shape[1] or sizes[0] != sizes[1]:
        raise node.error(f"qkv_hidden_sizes {list(sizes)} must be three sizes, Q's equal to "
                         f"K's, summing to the {weights.shape[1]} weight columns")
    projected = jnp.matmul(x, weights)
    if bias is not None:
        projected = projected + bias
    q, k, v = jnp.split(projected, [sizes[0], sizes[0] + sizes[1]], axis=-1)
    heads = node.attr("num_heads")
    head_size = _heads(node, sizes[0], "Q")
    _heads(node, sizes[2], "V")
    q, k, v = _split_heads(q, heads), _split_heads(k, heads), _split_heads(v, heads)
    past_length = 0
    if past is not None:
        past = jnp.asarray(past).astype(k.dtype)
        if past.ndim != 5 or past.shape[0] != 2 or past.shape[4] != head_size:
            raise node.error(f"past must be (2, batch, heads, past, {head_size}), got shape "
                             f"{past.shape}")
        past_length = past.shape[3]
        k = jnp.concatenate([past[0], k], axis=2)
        v = jnp.concatenate([past[1], v], axis=2)
    batch, _, length, _ = q.shape
    total = k.shape[2]
    allowed = _key_mask(node, mask_index, batch, length, total, past_length, "mask_index")
    out, _ = _attend(node, q, k, v, _scale(node, head_size), allowed, past_length,
                     attention_bias)
    if not node.output_used(1):
        return (_merge_heads(out),)
    if sizes[1] != sizes[2]:
        raise node.error(f"present needs K and V of one width, got qkv_hidden_sizes {sizes}")
    return _merge_heads(out), jnp.stack([k, v])


# ---------------------------------------------------------------------------------------
# MultiHeadAttention


def _mha_projections(node: Node, query: jax.Array, key: Any, value: Any,
                     bias: Any) -> tuple[jax.Array, jax.Array, jax.Array, bool]:
    """Q, K, V as (batch, heads, seq, size), and whether K/V came in as a past cache
    (4-D BNSH key and value, which no bias is added to and no past precedes)."""
    heads = node.attr("num_heads")
    if query.ndim == 5:
        if key is not None or value is not None:
            raise node.error("a packed QKV query (5-D) comes without key and value")
        if query.shape[3] != 3:
            raise node.error(f"packed QKV must be (batch, seq, heads, 3, size), got "
                             f"{query.shape}")
        q, k, v = (query[:, :, :, i].transpose(0, 2, 1, 3) for i in range(3))
        if bias is not None:
            q, k, v = (t + b.reshape(heads, 1, -1) for t, b in
                       zip((q, k, v), jnp.split(jnp.asarray(bias), 3)))
        return q, k, v, False
    if query.ndim != 3:
        raise node.error(f"query must be 3-D (batch, seq, hidden) or packed 5-D, got shape "
                         f"{query.shape}")
    hidden = query.shape[2]
    q_bias = k_bias = v_bias = None
    if bias is not None:
        bias = jnp.asarray(bias)
        q_bias, k_bias, v_bias = bias[:hidden], bias[hidden:2 * hidden], bias[2 * hidden:]
    if q_bias is not None:
        query = query + q_bias
    q = _split_heads(query, heads)
    if key is None:
        raise node.error("key is required unless query packs Q, K and V")
    key = jnp.asarray(key)
    if key.ndim == 5:
        if value is not None or key.shape[3] != 2:
            raise node.error(f"packed KV must be (batch, kv_seq, heads, 2, size) without "
                             f"value, got key {key.shape}")
        k, v = (key[:, :, :, i].transpose(0, 2, 1, 3) for i in range(2))
        if k_bias is not None:
            k = k + k_bias.reshape(heads, 1, -1)
            v = v + v_bias.reshape(heads, 1, -1)
        return q, k, v, False
    if value is None:
        raise node.error("value is required with a 3-D or 4-D key")
    value = jnp.asarray(value)
    if key.ndim == 4:
        if value.ndim != 4:
            raise node.error("a 4-D key (batch, heads, kv_seq, size) needs a 4-D value")
        return q, key, value, True
    if k_bias is not None:
        key, value = key + k_bias, value + v_bias
    _heads(node, value.shape[2], "value")
    return q, _split_heads(key, heads), _split_heads(value, heads), False


@op("MultiHeadAttention", since=1, domain=MICROSOFT_DOMAIN)
def multi_head_attention(node: Node, query: ArrayLike, key: ArrayLike | None = None,
                         value: ArrayLike | None = None, bias: ArrayLike | None = None,
                         key_padding_mask: ArrayLike | None = None,
                         attention_bias: ArrayLike | None = None,
                         past_key: ArrayLike | None = None, past_value: ArrayLike | None = None,
                         past_sequence_length: ArrayLike | None = None,
                         cache_indirection: ArrayLike | None = None) -> tuple[jax.Array, ...]:
    """Self or cross attention on projected Q, K, V (3-D, packed 5-D, or K/V as a 4-D cache).

    bias (q + k + v) is added to the projections; past_key/past_value (batch, heads, past,
    size) precede K and V; key_padding_mask in any of ONNX Runtime's forms; unidirectional
    masks later keys. Outputs the attention (batch, seq, v), present_key, present_value and
    qk (the scaled, biased and masked Q K^T the softmax takes).
    """
    _unsupported_input(node, 8, past_sequence_length, "past_sequence_length")
    _unsupported_input(node, 9, cache_indirection, "cache_indirection")
    query = jnp.asarray(query)
    q, k, v, cached = _mha_projections(node, query, key, value, bias)
    past_length = 0
    if (past_key is None) != (past_value is None):
        raise node.error("past_key and past_value must be given together")
    if past_key is not None:
        if cached:
            raise node.error("past_key/past_value cannot follow a 4-D key/value cache")
        past_length = jnp.shape(past_key)[2]
        k = jnp.concatenate([jnp.asarray(past_key).astype(k.dtype), k], axis=2)
        v = jnp.concatenate([jnp.asarray(past_value).astype(v.dtype), v], axis=2)
    batch, _, length, head_size = q.shape
    total = k.shape[2]
    allowed = _key_mask(node, key_padding_mask, batch, length, total, past_length,
                        "key_padding_mask")
    out, logits = _attend(node, q, k, v, _scale(node, head_size), allowed, past_length,
                          attention_bias)
    return _merge_heads(out), k, v, logits


# ---------------------------------------------------------------------------------------
# RotaryEmbedding


def rotated(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
    """x (batch, heads, seq, size) with its first 2 * cos.shape[-1] features rotated by the
    angles cos/sin (batch | 1, seq, half), halves or interleaved pairs."""
    rotary_dim = 2 * cos.shape[-1]
    cos, sin = cos[:, None].astype(x.dtype), sin[:, None].astype(x.dtype)
    rotating, passing = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        x1, x2 = rotating[..., 0::2], rotating[..., 1::2]
    else:
        x1, x2 = jnp.split(rotating, 2, axis=-1)
    return jnp.concatenate([_rotate(x1, x2, cos, sin, interleaved), passing], axis=-1)


@op("RotaryEmbedding", since=1, domain=MICROSOFT_DOMAIN)
def rotary_embedding(node: Node, x: ArrayLike, position_ids: ArrayLike, cos_cache: ArrayLike,
                     sin_cache: ArrayLike) -> jax.Array:
    """RoPE on (batch, seq, hidden) or (batch, heads, seq, size) input.

    position_ids (batch, seq) index the caches; a 1-element position_ids is the position of
    the first token, the others following it. The head size is hidden / num_heads, or twice
    the cache width when num_heads is 0; rotary_embedding_dim (default: the head size)
    features of each head rotate.
    """
    _unsupported_attr(node, "is_packed_batching")
    if float_attr(node, "scale", 1.0) != 1.0:
        raise node.unsupported(f"attribute scale={node.attr('scale')} is not supported; "
                               "onnxtrain runs this op with scale=1.0 only")
    x = jnp.asarray(x)
    cos, sin = jnp.asarray(cos_cache), jnp.asarray(sin_cache)
    if x.ndim == 4:
        heads_first, head_size = x, x.shape[3]
    elif x.ndim == 3:
        heads = node.attr("num_heads", 0)
        head_size = (_heads(node, x.shape[2], "input", heads) if heads
                     else 2 * cos.shape[-1])
        heads_first = _split_heads(x, x.shape[2] // head_size)
    else:
        raise node.error(f"input must be 3-D or 4-D, got shape {x.shape}")
    rotary_dim = node.attr("rotary_embedding_dim", 0) or head_size
    if rotary_dim % 2 or rotary_dim > head_size or cos.shape[-1] < rotary_dim // 2:
        raise node.error(f"rotary_embedding_dim {rotary_dim} must be even, at most the head "
                         f"size {head_size} and at most twice the cache width {cos.shape[-1]}")
    length = heads_first.shape[2]
    positions = jnp.asarray(position_ids)
    if positions.size == 1:
        positions = positions.reshape(1, 1) + jnp.arange(length)[None, :]
    half = rotary_dim // 2
    cos = jnp.take(cos[:, :half], positions, axis=0)
    sin = jnp.take(sin[:, :half], positions, axis=0)
    out = rotated(heads_first, cos, sin, bool(node.attr("interleaved", 0)))
    return _merge_heads(out) if x.ndim == 3 else out


# ---------------------------------------------------------------------------------------
# GroupQueryAttention

_GQA_UNSUPPORTED_INPUTS = {11: "head_sink", 12: "k_scale", 13: "v_scale", 14: "q_norm_weight",
                           15: "k_norm_weight", 16: "query_seqlens"}


def _written_at(cache: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """cache (batch, heads, length, size) with new (batch, heads, seq, size) written at
    each batch row's start position."""
    def write(row: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
        zero = jnp.zeros_like(start)
        return jax.lax.dynamic_update_slice(row, rows, (zero, start, zero))
    return jax.vmap(write)(cache, new, starts.astype(jnp.int32))


@op("GroupQueryAttention", since=1, domain=MICROSOFT_DOMAIN, static_inputs=(6,))
def group_query_attention(node: Node, query: ArrayLike, key: ArrayLike | None,
                          value: ArrayLike | None, past_key: ArrayLike | None,
                          past_value: ArrayLike | None, seqlens_k: ArrayLike,
                          total_sequence_length: ArrayLike, cos_cache: ArrayLike | None = None,
                          sin_cache: ArrayLike | None = None,
                          position_ids: ArrayLike | None = None,
                          attention_bias: ArrayLike | None = None,
                          *rest: ArrayLike | None) -> tuple[jax.Array, ...]:
    """Causal attention with fewer key/value heads than query heads and a KV cache (Llama).

    Batch row b holds seqlens_k[b] + 1 tokens after this step, the new ones starting at
    P_b = seqlens_k[b] + 1 - seq; they are written into the cache at P_b and query s sits at
    position P_b + s (the rotary angle with do_rotary, and the causal and local_window_size
    limits). Outputs the attention (batch, seq, heads * size), present_key and present_value
    (batch, kv_heads, max(past + seq, total_sequence_length), size).
    """
    for index, value_ in enumerate(rest, start=11):
        _unsupported_input(node, index, value_, _GQA_UNSUPPORTED_INPUTS.get(index, "extra"))
    for name in ("qk_output", "smooth_softmax", "sliding_window_cache"):
        _unsupported_attr(node, name)
    for name in ("k_quant_type", "v_quant_type"):
        _unsupported_attr(node, name, "NONE")
    heads, kv_heads = node.attr("num_heads"), node.attr("kv_num_heads")
    if kv_heads <= 0 or heads % kv_heads:
        raise node.error(f"num_heads ({heads}) must be a positive multiple of kv_num_heads "
                         f"({kv_heads})")
    query = jnp.asarray(query)
    if query.ndim != 3:
        raise node.error(f"query must be (batch, seq, hidden), got shape {query.shape}")
    if key is None and value is None:
        head_size = _heads(node, query.shape[2], "packed QKV", heads + 2 * kv_heads)
        query, key, value = jnp.split(query, [heads * head_size, (heads + kv_heads) * head_size],
                                      axis=-1)
    elif key is None or value is None:
        raise node.error("key and value must be given together (or both left out for packed "
                         "QKV)")
    else:
        head_size = _heads(node, query.shape[2], "query")
    key, value = jnp.asarray(key), jnp.asarray(value)
    if key.shape[1] != query.shape[1]:
        raise node.unsupported(f"key has {key.shape[1]} positions and query {query.shape[1]}; "
                               "only self-attention (equal lengths) is supported")
    q = _split_heads(query, heads)
    k, v = _split_heads(key, kv_heads), _split_heads(value, kv_heads)
    batch, _, length, _ = q.shape
    total = host_ints(node, total_sequence_length, "total_sequence_length")[0]
    seqlens = jnp.asarray(seqlens_k).astype(jnp.int32).reshape(-1)
    # A first prompt (as long as the whole sequence) starts at 0 in every row; seqlens_k then
    # marks where each row's right padding begins rather than where the row started.
    first_prompt = total == length
    starts = jnp.zeros_like(seqlens) if first_prompt else seqlens + 1 - length
    positions = starts[:, None] + jnp.arange(length)[None, :]
    if node.attr("do_rotary", 0):
        if cos_cache is None or sin_cache is None:
            raise node.error("do_rotary needs cos_cache and sin_cache")
        if position_ids is not None:
            positions = jnp.asarray(position_ids).astype(jnp.int32)
        cos = jnp.take(jnp.asarray(cos_cache), positions, axis=0)
        sin = jnp.take(jnp.asarray(sin_cache), positions, axis=0)
        interleaved = bool(node.attr("rotary_interleaved", 0))
        q, k = rotated(q, cos, sin, interleaved), rotated(k, cos, sin, interleaved)
    past_length = 0 if past_key is None else jnp.shape(past_key)[2]
    if (past_key is None) != (past_value is None):
        raise node.error("past_key and past_value must be given together")
    capacity = max(past_length + length, total)
    cache_k = jnp.zeros((batch, kv_heads, capacity, head_size), k.dtype)
    cache_v = jnp.zeros_like(cache_k)
    if past_key is not None:
        cache_k = cache_k.at[:, :, :past_length].set(jnp.asarray(past_key).astype(k.dtype))
        cache_v = cache_v.at[:, :, :past_length].set(jnp.asarray(past_value).astype(v.dtype))
    present_k = _written_at(cache_k, k, starts)
    present_v = _written_at(cache_v, v, starts)
    keys = jnp.arange(capacity)[None, None, :]
    query_positions = (starts[:, None] + jnp.arange(length)[None, :])[:, :, None]
    allowed = keys <= query_positions
    if first_prompt:
        allowed &= keys <= seqlens[:, None, None]
    window = node.attr("local_window_size", -1)
    if window > 0:
        allowed &= keys > query_positions - window
    group = heads // kv_heads
    scores = jnp.matmul(q, jnp.swapaxes(jnp.repeat(present_k, group, axis=1), -1, -2))
    scores = scores * jnp.asarray(_scale(node, head_size), q.dtype)
    softcap = float_attr(node, "softcap", 0.0)
    if softcap > 0:
        scores = softcap * jnp.tanh(scores / softcap)
    if attention_bias is not None:
        scores = scores + jnp.asarray(attention_bias)[..., :capacity]
    scores = jnp.where(allowed[:, None], scores, -jnp.inf)
    probabilities = jax.nn.softmax(scores, axis=-1)
    out = jnp.matmul(probabilities.astype(v.dtype), jnp.repeat(present_v, group, axis=1))
    return _merge_heads(out), present_k, present_v
