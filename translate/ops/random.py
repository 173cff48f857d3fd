"""Random generators: RandomNormal/Uniform(+Like), Bernoulli, Multinomial.

Every draw comes from the evaluation's PRNG key (node.next_key()), so a run is
reproducible from the key passed to the model. The ONNX `seed` attribute is
ignored: no JAX generator reproduces the numbers another runtime draws for a
seed, and a fixed per-node seed would repeat the same numbers on every step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from onnxtrain.translate.ops.common import numpy_dtype
from onnxtrain.translate.registry import op

_FLOAT_OUTPUTS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64),
                  np.dtype(jnp.bfloat16))


def _float_dtype(node: Any, default: np.dtype) -> np.dtype:
    """The output dtype: the `dtype` attribute, else `default`; it must be a float type."""
    dtype = numpy_dtype(node.attr("dtype")) if node.has_attr("dtype") else np.dtype(default)
    if dtype not in _FLOAT_OUTPUTS:
        raise node.error(f"output dtype {dtype} is not a float type (float16, bfloat16, "
                         f"float, double); set the `dtype` attribute to one")
    return dtype


def _normal(node: Any, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
    mean = node.attr("mean", 0.0)
    scale = node.attr("scale", 1.0)
    return (jax.random.normal(node.next_key(), shape, dtype) * scale + mean).astype(dtype)


def _uniform(node: Any, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
    low = node.attr("low", 0.0)
    high = node.attr("high", 1.0)
    return jax.random.uniform(node.next_key(), shape, dtype, minval=low, maxval=high)


@op("RandomNormal", since=1, random=True, differentiable=False)
def random_normal(node: Any) -> jax.Array:
    """Samples of N(mean, scale^2) with the `shape` attribute; dtype defaults to float."""
    shape = tuple(int(d) for d in node.attr("shape"))
    return _normal(node, shape, _float_dtype(node, np.float32))


@op("RandomUniform", since=1, random=True, differentiable=False)
def random_uniform(node: Any) -> jax.Array:
    """Samples of U[low, high) with the `shape` attribute; dtype defaults to float."""
    shape = tuple(int(d) for d in node.attr("shape"))
    return _uniform(node, shape, _float_dtype(node, np.float32))


@op("RandomNormalLike", since=1, random=True, differentiable=False)
def random_normal_like(node: Any, x: Any) -> jax.Array:
    """Samples of N(mean, scale^2) shaped like the input; dtype defaults to the input's."""
    return _normal(node, tuple(np.shape(x)), _float_dtype(node, x.dtype))


@op("RandomUniformLike", since=1, random=True, differentiable=False)
def random_uniform_like(node: Any, x: Any) -> jax.Array:
    """Samples of U[low, high) shaped like the input; dtype defaults to the input's."""
    return _uniform(node, tuple(np.shape(x)), _float_dtype(node, x.dtype))


@op("Bernoulli", since=15, random=True, differentiable=False)
def bernoulli(node: Any, p: Any) -> jax.Array:
    """1 with probability p, else 0, element-wise; dtype attribute, else the input's."""
    dtype = numpy_dtype(node.attr("dtype")) if node.has_attr("dtype") else p.dtype
    compute = jnp.promote_types(p.dtype, jnp.float32)
    draws = jax.random.uniform(node.next_key(), np.shape(p), compute)
    return (draws < jnp.asarray(p, compute)).astype(dtype)


@op("Multinomial", since=7, random=True, differentiable=False)
def multinomial(node: Any, logits: Any) -> jax.Array:
    """sample_size class indices per row of [batch, classes] unnormalized log-probabilities."""
    if np.ndim(logits) != 2:
        raise node.error(f"input must be [batch_size, class_size], got shape {np.shape(logits)}")
    dtype = numpy_dtype(node.attr("dtype", 6))
    if dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise node.error(f"dtype must be int32 or int64, got {dtype}")
    sample_size = node.attr("sample_size", 1)
    batch = np.shape(logits)[0]
    compute = jnp.promote_types(logits.dtype, jnp.float32)
    samples = jax.random.categorical(node.next_key(), jnp.asarray(logits, compute),
                                     axis=-1, shape=(sample_size, batch))
    return samples.T.astype(dtype)
