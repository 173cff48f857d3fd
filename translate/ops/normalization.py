"""Normalizations and the layers that sit beside them.

Softmax, LogSoftmax and Hardmax (normalize along an axis); BatchNormalization
in inference and training mode; Instance/Layer/Group/RMS/Lp/MeanVariance
normalization; LRN; Dropout, the training-time regularizer.

Statistics of 16-bit floats are computed in float32 (or in `stash_type` where
the op has one) and results are cast back to the ONNX output dtype.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike
from numpy.typing import DTypeLike

from onnxtrain.translate.node import Node
from onnxtrain.translate.ops.common import float_attr, normalize_axis, numpy_dtype
from onnxtrain.translate.ops.reduce import compute_dtype, widened
from onnxtrain.translate.registry import op
from onnxtrain.translate.values import known_value

AxisFunction = Callable[[jax.Array, int], jax.Array]


# ---------------------------------------------------------------------------
# Softmax, LogSoftmax, Hardmax


def _shifted(x: jax.Array, axis: int) -> jax.Array:
    """x - max(x) along axis, whose maximum is exactly 0.

    XLA:CPU may contract x's producer (the mean of a pooling layer, say) into a
    fused multiply-add with the subtraction while the max reads the rounded x, so
    x - max(x) comes out off by up to an ulp of x: for large logits exp() then
    overflows or underflows everywhere and the softmax turns NaN. A second shift,
    by the max of the first, compares like with like. Both maxima are constants to
    the gradient, which therefore stays exact.
    """
    x = widened(x)
    shifted = x - lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    return shifted - lax.stop_gradient(jnp.max(shifted, axis=axis, keepdims=True))


def _softmax(x: jax.Array, axis: int) -> jax.Array:
    exponentials = jnp.exp(_shifted(x, axis))
    return (exponentials / jnp.sum(exponentials, axis=axis, keepdims=True)).astype(x.dtype)


def _log_softmax(x: jax.Array, axis: int) -> jax.Array:
    shifted = _shifted(x, axis)
    return (shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=axis, keepdims=True))).astype(x.dtype)


def _hardmax(x: jax.Array, axis: int) -> jax.Array:
    """1 at the first maximum along `axis`, 0 elsewhere."""
    return jax.nn.one_hot(jnp.argmax(x, axis=axis), x.shape[axis], dtype=x.dtype, axis=axis)


def _along_axis(node: Node, x: ArrayLike, function: AxisFunction) -> jax.Array:
    """Opset 13+: apply `function` along the `axis` attribute (default -1)."""
    x = jnp.asarray(x)
    return function(x, normalize_axis(node.attr("axis", -1), x.ndim))


def _on_2d_coercion(node: Node, x: ArrayLike, function: AxisFunction) -> jax.Array:
    """Opsets 1-12: view x as a matrix [prod(shape[:axis]), prod(shape[axis:])]
    (axis defaults to 1), apply `function` along its rows, restore the shape."""
    x = jnp.asarray(x)
    axis = normalize_axis(node.attr("axis", 1), x.ndim)
    matrix = x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))
    return function(matrix, 1).reshape(x.shape)


@op("Softmax", since=1)
def softmax_2d(node: Node, x: ArrayLike) -> jax.Array:
    """Softmax-1/11: exp(x) / sum(exp(x)) over the trailing dims from `axis` (x coerced to 2-D)."""
    return _on_2d_coercion(node, x, _softmax)


@op("Softmax", since=13)
def softmax(node: Node, x: ArrayLike) -> jax.Array:
    """Softmax-13: exp(x) / sum(exp(x)) along `axis`."""
    return _along_axis(node, x, _softmax)


@op("LogSoftmax", since=1)
def log_softmax_2d(node: Node, x: ArrayLike) -> jax.Array:
    """LogSoftmax-1/11: log of Softmax over the trailing dims from `axis` (x coerced to 2-D)."""
    return _on_2d_coercion(node, x, _log_softmax)


@op("LogSoftmax", since=13)
def log_softmax(node: Node, x: ArrayLike) -> jax.Array:
    """LogSoftmax-13: x - log(sum(exp(x))) along `axis`."""
    return _along_axis(node, x, _log_softmax)


@op("Hardmax", since=1)
def hardmax_2d(node: Node, x: ArrayLike) -> jax.Array:
    """Hardmax-1/11: one-hot of the first maximum over the trailing dims from `axis`."""
    return _on_2d_coercion(node, x, _hardmax)


@op("Hardmax", since=13)
def hardmax(node: Node, x: ArrayLike) -> jax.Array:
    """Hardmax-13: one-hot of the first maximum along `axis`."""
    return _along_axis(node, x, _hardmax)


# ---------------------------------------------------------------------------
# Shared statistics


def _standardize(x: jax.Array, axes: Sequence[int],
                 epsilon: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(x - mean) / sqrt(var + epsilon), mean and 1/sqrt(var + epsilon) over `axes`
    (kept as size-1 dims); var is the population variance."""
    mean = jnp.mean(x, axis=tuple(axes), keepdims=True)
    centered = x - mean
    variance = jnp.mean(centered * centered, axis=tuple(axes), keepdims=True)
    inv_std_dev = 1 / jnp.sqrt(variance + epsilon)
    return centered * inv_std_dev, mean, inv_std_dev


def _stash_dtype(node: Node) -> np.dtype:
    """The float dtype the `stash_type` attribute names (default float32)."""
    code = node.attr("stash_type", 1)
    try:
        dtype = numpy_dtype(code)
    except KeyError:
        raise node.error(f"stash_type {code} is not an ONNX element type") from None
    if not np.issubdtype(dtype, np.floating) and dtype.name != "bfloat16":
        raise node.error(f"stash_type must name a floating-point type, not {dtype.name}")
    return dtype


def _channel_first(param: ArrayLike, x: jax.Array) -> jax.Array:
    """A per-channel vector (C,) shaped to broadcast against x (N, C, D1, ...)."""
    return jnp.reshape(param, (-1,) + (1,) * (x.ndim - 2))


# ---------------------------------------------------------------------------
# BatchNormalization


def _batch_norm_layout(param: jax.Array, x: jax.Array, spatial: bool) -> jax.Array:
    """A BatchNormalization parameter shaped to broadcast against x (N, C, D1, ...): one
    value per channel (spatial) or per activation (shaped like x without its batch dim)."""
    return _channel_first(param, x) if spatial else jnp.reshape(param, x.shape[1:])


def _batch_norm_apply(x: jax.Array, scale: jax.Array, bias: jax.Array, mean: jax.Array,
                      var: jax.Array, epsilon: float, spatial: bool) -> jax.Array:
    """scale * (x - mean) / sqrt(var + epsilon) + bias."""
    scale, bias, mean, var = (_batch_norm_layout(p, x, spatial) for p in (scale, bias, mean, var))
    return (x - mean) / jnp.sqrt(var + epsilon) * scale + bias


def _batch_axes(x: jax.Array, spatial: bool) -> tuple[int, ...]:
    """The axes batch statistics are taken over: the batch (and spatial dims if `spatial`)."""
    return (0,) + tuple(range(2, x.ndim)) if spatial else (0,)


def _accumulator(dtype: DTypeLike) -> np.dtype:
    """float64 where the trace allows it, else `dtype`: batch sums run over many values, and
    this is how torch's CPU kernels keep batch statistics and their gradients accurate."""
    return jnp.promote_types(dtype, jax.dtypes.canonicalize_dtype(np.float64))


def _accumulated_sum(v: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """sum(v) over `axes` (kept as size-1 dims) in _accumulator's type, rounded back to v's dtype."""
    return jnp.sum(v, axis=axes, keepdims=True, dtype=_accumulator(v.dtype)).astype(v.dtype)


# From this many summed positions per channel, BatchNorm's backward takes its two sums in one
# pass over the batch, and so do its statistics where x is narrower than their accumulator:
# one reduction with two results, which reads each position once for both and fuses the
# products it sums, where XLA:CPU's library reductions read each operand separately, from
# copies transposed for the library. Over fewer positions (the 2x2 and 1x1 maps of a ResNet's
# last stages on small images) separate reductions made whole training steps faster (see
# bench/RESULTS.md, "BatchNorm's sums in one pass").
ONE_PASS_POSITIONS = 64


def _wide_sums(a: jax.Array, b: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """sum(a) and sum(b) over `axes` (kept as size-1 dims) in _accumulator's type, in one pass."""
    wide = _accumulator(a.dtype)
    zero = np.zeros((), wide)
    sums = lax.reduce((a.astype(wide), b.astype(wide)), (zero, zero),
                      lambda x, y: (x[0] + y[0], x[1] + y[1]), axes)
    return jnp.expand_dims(sums[0], axes), jnp.expand_dims(sums[1], axes)


def _batch_statistics(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """The batch's mean and population variance over `axes` (kept as size-1 dims), in x's dtype.

    Two passes (the mean, then the squares of x minus it), unless x is narrower than its
    accumulator and one pass pays (ONE_PASS_POSITIONS): then the accumulator's sums of d
    and d * d, d = x minus the channel's first sample. Shifting by a value among the data keeps
    E[d^2] - E[d]^2 from cancelling the way E[x^2] - E[x]^2 would on a large mean."""
    count = math.prod(x.shape[axis] for axis in axes)
    wide = _accumulator(x.dtype)
    if count < ONE_PASS_POSITIONS or np.dtype(wide).itemsize <= np.dtype(x.dtype).itemsize:
        mean = _accumulated_sum(x, axes) / count
        centered = x - mean
        return mean, _accumulated_sum(centered * centered, axes) / count
    first_sample = [1 if axis in axes else size for axis, size in enumerate(x.shape)]
    shift = lax.slice(x, [0] * x.ndim, first_sample).astype(wide)
    d = x.astype(wide) - shift
    first, second = _wide_sums(d, d * d, axes)
    mean = first / count
    var = jnp.maximum(second / count - mean * mean, 0)
    return (shift + mean).astype(x.dtype), var.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _normalize_batch(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float,
                     axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(scale * (x - mean) / sqrt(var + epsilon) + bias, mean, var) with the batch's mean and
    population variance over `axes`; scale and bias are shaped like the statistics (the
    reduced axes kept as size 1).

    Its backward pass is the closed form (as torch's is), its sums accumulated like the
    forward's, rather than autodiff's derivative of each step of the forward."""
    return _normalize_batch_forward(x, scale, bias, epsilon, axes)[0]


def _normalize_batch_forward(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float,
                             axes: tuple[int, ...]) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    mean, var = _batch_statistics(x, axes)
    inv_std_dev = 1 / jnp.sqrt(var + epsilon)
    y = (x - mean) * inv_std_dev * scale + bias
    return (y, mean, var), (x, mean, inv_std_dev, scale)


def _normalize_batch_backward(epsilon: float, axes: tuple[int, ...], residuals: tuple[jax.Array, ...],
                              cotangents: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    x, mean, inv_std_dev, scale = residuals
    d_y, d_mean, d_var = cotangents
    count = math.prod(x.shape[axis] for axis in axes)
    centered = x - mean
    normalized = centered * inv_std_dev
    if count >= ONE_PASS_POSITIONS:
        d_bias, d_scale = (total.astype(d_y.dtype) for total in _wide_sums(d_y, d_y * normalized, axes))
    else:
        d_bias, d_scale = _accumulated_sum(d_y, axes), _accumulated_sum(d_y * normalized, axes)
    d_x = (scale * inv_std_dev) * (d_y - (d_bias + normalized * d_scale) / count)
    # The mean and variance are outputs too (running statistics, the op's optional outputs).
    d_x = d_x + (d_mean + 2 * d_var * centered) / count
    return d_x, d_scale, d_bias


_normalize_batch.defvjp(_normalize_batch_forward, _normalize_batch_backward)


def _batch_norm(node: Node, x: ArrayLike, scale: ArrayLike, bias: ArrayLike, mean: ArrayLike,
                var: ArrayLike, training: bool, spatial: bool = True) -> tuple[jax.Array, ...]:
    """Y, then (training only) running mean/var after the momentum update and the
    batch mean/var. Y has x's dtype, statistics the dtype of the `mean` input."""
    x = jnp.asarray(x)
    stats_dtype = jnp.asarray(mean).dtype
    work = compute_dtype(x.dtype)
    xw, scale, bias, mean, var = (jnp.asarray(v).astype(work) for v in (x, scale, bias, mean, var))
    epsilon = float_attr(node, "epsilon", 1e-5)
    if not training:
        return (_batch_norm_apply(xw, scale, bias, mean, var, epsilon, spatial).astype(x.dtype),)
    momentum = float_attr(node, "momentum", 0.9)
    axes = _batch_axes(xw, spatial)
    kept = tuple(1 if axis in axes else size for axis, size in enumerate(xw.shape))
    y, batch_mean, batch_var = _normalize_batch(xw, scale.reshape(kept), bias.reshape(kept), epsilon, axes)
    batch_mean, batch_var = batch_mean.reshape(scale.shape), batch_var.reshape(scale.shape)
    running_mean = mean * momentum + batch_mean * (1 - momentum)
    running_var = var * momentum + batch_var * (1 - momentum)
    statistics = (running_mean, running_var, batch_mean, batch_var)
    return (y.astype(x.dtype),) + tuple(s.astype(stats_dtype) for s in statistics)


@op("BatchNormalization", since=1)
def batch_normalization_is_test(node: Node, x: ArrayLike, scale: ArrayLike, bias: ArrayLike,
                                mean: ArrayLike, var: ArrayLike) -> tuple[jax.Array, ...]:
    """BatchNormalization-1/6: inference with the given statistics when is_test is set;
    otherwise training mode: Y from batch statistics, running mean/var, batch mean/var."""
    training = not node.attr("is_test", 0)
    return _batch_norm(node, x, scale, bias, mean, var, training, bool(node.attr("spatial", 1)))


@op("BatchNormalization", since=7)
def batch_normalization_by_outputs(node: Node, x: ArrayLike, scale: ArrayLike, bias: ArrayLike,
                                   mean: ArrayLike, var: ArrayLike) -> tuple[jax.Array, ...]:
    """BatchNormalization-7/9: training mode exactly when a statistics output is requested
    (Y, running mean/var, batch mean/var); `spatial` (7 only) as in opset 1."""
    training = any(node.output_used(i) for i in range(1, 5))
    return _batch_norm(node, x, scale, bias, mean, var, training, bool(node.attr("spatial", 1)))


@op("BatchNormalization", since=14)
def batch_normalization(node: Node, x: ArrayLike, scale: ArrayLike, bias: ArrayLike,
                        input_mean: ArrayLike, input_var: ArrayLike) -> tuple[jax.Array, ...]:
    """BatchNormalization-14/15: with training_mode, Y from batch statistics plus the
    momentum-updated running mean/var; otherwise Y from the given statistics."""
    training = bool(node.attr("training_mode", 0))
    if not training and (node.output_used(1) or node.output_used(2)):
        raise node.error("running_mean/running_var outputs exist only with training_mode=1")
    return _batch_norm(node, x, scale, bias, input_mean, input_var, training)[:3]


# ---------------------------------------------------------------------------
# Instance, Layer, Group, RMS normalization


@op("InstanceNormalization", since=1)
def instance_normalization(node: Node, x: ArrayLike, scale: ArrayLike, bias: ArrayLike) -> jax.Array:
    """y = scale * (x - mean) / sqrt(var + epsilon) + bias, statistics per instance and channel."""
    x = jnp.asarray(x)
    epsilon = float_attr(node, "epsilon", 1e-5)
    normalized, _, _ = _standardize(widened(x), range(2, x.ndim), epsilon)
    y = normalized * _channel_first(widened(scale), x) + _channel_first(widened(bias), x)
    return y.astype(x.dtype)


@op("LayerNormalization", since=17)
def layer_normalization(node: Node, x: ArrayLike, scale: ArrayLike,
                        bias: ArrayLike | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Standardize over the dims from `axis` on (in stash_type), then * Scale + B.
    Also returns Mean and InvStdDev (stash_type, reduced dims kept as 1)."""
    x = jnp.asarray(x)
    axis = normalize_axis(node.attr("axis", -1), x.ndim)
    stash = _stash_dtype(node)
    normalized, mean, inv_std_dev = _standardize(
        x.astype(stash), range(axis, x.ndim), float_attr(node, "epsilon", 1e-5))
    y = normalized.astype(x.dtype) * scale
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype), mean, inv_std_dev


def _group_standardize(x: jax.Array, num_groups: int, epsilon: float, dtype: DTypeLike) -> jax.Array:
    """x (N, C, ...) standardized per instance over each group of C/num_groups channels."""
    group_size = math.prod(x.shape[1:]) // num_groups
    grouped = x.astype(dtype).reshape(x.shape[0], num_groups, group_size)
    normalized, _, _ = _standardize(grouped, (2,), epsilon)
    return normalized.reshape(x.shape).astype(x.dtype)


def _num_groups(node: Node, x: jax.Array) -> int:
    groups = node.attr("num_groups")
    if x.ndim < 2 or groups <= 0 or x.shape[1] % groups:
        raise node.error(f"num_groups {groups} must divide the channel count of the input "
                         f"(shape {tuple(x.shape)})")
    return groups


@op("GroupNormalization", since=18)
def group_normalization_per_group(node: Node, x: ArrayLike, scale: ArrayLike,
                                  bias: ArrayLike) -> jax.Array:
    """GroupNormalization-18: standardize each group of channels; scale and bias hold
    one value per group."""
    x = jnp.asarray(x)
    groups = _num_groups(node, x)
    epsilon = float_attr(node, "epsilon", 1e-5)
    normalized = _group_standardize(x, groups, epsilon, compute_dtype(x.dtype))
    per_channel = x.shape[1] // groups
    y = (normalized * _channel_first(jnp.repeat(scale, per_channel), x)
         + _channel_first(jnp.repeat(bias, per_channel), x))
    return y.astype(x.dtype)


@op("GroupNormalization", since=21)
def group_normalization(node: Node, x: ArrayLike, scale: ArrayLike, bias: ArrayLike) -> jax.Array:
    """GroupNormalization-21: standardize each group of channels (in stash_type); scale
    and bias hold one value per channel."""
    x = jnp.asarray(x)
    groups = _num_groups(node, x)
    epsilon = float_attr(node, "epsilon", 1e-5)
    normalized = _group_standardize(x, groups, epsilon, _stash_dtype(node))
    y = normalized * _channel_first(scale, x) + _channel_first(bias, x)
    return y.astype(x.dtype)


@op("RMSNormalization", since=23)
def rms_normalization(node: Node, x: ArrayLike, scale: ArrayLike) -> jax.Array:
    """x / sqrt(mean(x^2) + epsilon) over the dims from `axis` on (in stash_type), * scale."""
    x = jnp.asarray(x)
    scale = jnp.asarray(scale)
    axes = tuple(range(normalize_axis(node.attr("axis", -1), x.ndim), x.ndim))
    stashed = x.astype(_stash_dtype(node))
    mean_square = jnp.mean(stashed * stashed, axis=axes, keepdims=True)
    normalized = stashed / jnp.sqrt(mean_square + float_attr(node, "epsilon", 1e-5))
    return (normalized.astype(x.dtype) * scale).astype(scale.dtype)


# ---------------------------------------------------------------------------
# Lp, mean-variance and local response normalization


@op("LpNormalization", since=1)
def lp_normalization(node: Node, x: ArrayLike) -> jax.Array:
    """x / ||x||_p along `axis` (p is 1 or 2); a zero norm gives 0."""
    x = jnp.asarray(x)
    axis = normalize_axis(node.attr("axis", -1), x.ndim)
    p = node.attr("p", 2)
    wide = widened(x)
    if p == 1:
        norm = jnp.sum(jnp.abs(wide), axis=axis, keepdims=True)
    elif p == 2:
        norm = jnp.sqrt(jnp.sum(wide * wide, axis=axis, keepdims=True))
    else:
        raise node.error(f"p must be 1 or 2, not {p}")
    zero = norm == 0
    return jnp.where(zero, 0, wide / jnp.where(zero, 1, norm)).astype(x.dtype)


# The epsilon of MeanVarianceNormalization's function body, added to the standard deviation.
_MVN_EPSILON = np.float32(1e-9).item()


@op("MeanVarianceNormalization", since=9)
def mean_variance_normalization(node: Node, x: ArrayLike) -> jax.Array:
    """(x - mean) / (std + 1e-9) with mean and population std over `axes` (default [0, 2, 3])."""
    x = jnp.asarray(x)
    axes = tuple(normalize_axis(a, x.ndim) for a in node.attr("axes", [0, 2, 3]))
    wide = widened(x)
    mean = jnp.mean(wide, axis=axes, keepdims=True)
    std = jnp.sqrt(jnp.mean(jnp.square(wide - mean), axis=axes, keepdims=True))
    return ((wide - mean) / (std + _MVN_EPSILON)).astype(x.dtype)


@op("LRN", since=1)
def local_response_normalization(node: Node, x: ArrayLike) -> jax.Array:
    """x / (bias + alpha / size * sum of x^2 over a window of `size` channels) ** beta;
    the window around channel c spans [c - floor((size-1)/2), c + ceil((size-1)/2)]."""
    x = jnp.asarray(x)
    size = node.attr("size")
    if size <= 0 or x.ndim < 2:
        raise node.error(f"needs size > 0 and an input of rank >= 2 (size {size}, shape {x.shape})")
    square = jnp.square(widened(x))
    before = (size - 1) // 2
    padding = [(0, 0), (before, size - 1 - before)] + [(0, 0)] * (x.ndim - 2)
    window = (1, size) + (1,) * (x.ndim - 2)
    square_sum = lax.reduce_window(square, np.zeros((), square.dtype), lax.add, window,
                                   (1,) * x.ndim, padding)
    alpha, beta = float_attr(node, "alpha", 1e-4), float_attr(node, "beta", 0.75)
    bias = float_attr(node, "bias", 1.0)
    return (widened(x) / (bias + alpha / size * square_sum) ** beta).astype(x.dtype)


# ---------------------------------------------------------------------------
# Dropout


def _kept_mask(node: Node, x: jax.Array, ratio: ArrayLike) -> jax.Array:
    """True where an element survives: each one independently with probability 1 - ratio."""
    return jax.random.bernoulli(node.next_key(), 1 - jnp.asarray(ratio, jnp.float32), x.shape)


def _dropped(x: jax.Array, kept: jax.Array, ratio: ArrayLike) -> jax.Array:
    """x * mask / (1 - ratio); everything is dropped (0) when ratio is 1."""
    wide = widened(x)
    ratio = jnp.asarray(ratio).astype(wide.dtype)
    scale = jnp.where(ratio < 1, 1 / jnp.where(ratio < 1, 1 - ratio, 1), 0)
    return (wide * kept * scale).astype(x.dtype)


def _inference_dropout(x: ArrayLike, mask_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
    """(x, all-true mask): Dropout outside training."""
    x = jnp.asarray(x)
    return x, jnp.ones(x.shape, mask_dtype)


def _dropout(node: Node, x: ArrayLike, ratio: ArrayLike, training: bool | jax.Array,
             mask_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
    """(output, mask): random dropout when `training` (a bool or a traced bool scalar),
    identity with an all-true mask otherwise."""
    if training is False:
        return _inference_dropout(x, mask_dtype)
    x = jnp.asarray(x)
    kept = _kept_mask(node, x, ratio)
    output = _dropped(x, kept, ratio)
    if training is not True:
        output = jnp.where(training, output, x)
        kept = jnp.where(training, kept, True)
    return output, kept.astype(mask_dtype)


@op("Dropout", since=1, random=True)
def dropout_is_test(node: Node, data: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """Dropout-1/6: identity when is_test is set; otherwise drops each element with
    probability `ratio` and scales the rest by 1/(1 - ratio). The mask has data's type."""
    data = jnp.asarray(data)
    training = not node.attr("is_test", 0)
    return _dropout(node, data, float_attr(node, "ratio", 0.5), training, data.dtype)


@op("Dropout", since=7)
def dropout_inference_typed_mask(node: Node, data: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """Dropout-7/9: no training switch exists, so onnxtrain runs it as inference
    (identity, all-ones mask of data's type); export at opset 12+ to train with it."""
    return _inference_dropout(data, jnp.asarray(data).dtype)


@op("Dropout", since=10)
def dropout_inference(node: Node, data: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """Dropout-10/11: as Dropout-7 (run as inference, identity), with a boolean mask."""
    return _inference_dropout(data, np.bool_)


@op("Dropout", since=12, random=True)
def dropout(node: Node, data: ArrayLike, ratio: ArrayLike | None = None,
            training_mode: ArrayLike | None = None) -> tuple[jax.Array, jax.Array]:
    """Dropout-12+: when training_mode is true, output = data * mask / (1 - ratio) with
    mask ~ Bernoulli(1 - ratio) (default ratio 0.5); identity otherwise. The mask comes
    from the run's PRNG key; the `seed` attribute is not used."""
    ratio = 0.5 if ratio is None else ratio
    known = None if training_mode is None else known_value(training_mode)
    if training_mode is None:
        training = False
    elif known is not None:
        training = bool(known)
    else:
        training = jnp.asarray(training_mode, bool).reshape(())
    return _dropout(node, data, ratio, training, np.bool_)
