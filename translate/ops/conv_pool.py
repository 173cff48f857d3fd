"""Convolutions and pooling: Conv, ConvTranspose, DeformConv, CausalConvWithState,
MaxPool, AveragePool, LpPool, their Global forms, MaxUnpool and Col2Im.

Spatial attributes (kernel_shape, strides, dilations, pads, auto_pad) are static, so
padding and output sizes are plain Python ints computed while tracing; the device
work is lax.conv_general_dilated, lax.reduce_window, strided slices and gathers.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import ShapedArray
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from onnxtrain.translate.ops.common import host_ints
from onnxtrain.translate.registry import op

AUTO_PAD_MODES = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


@dataclass(frozen=True)
class Window:
    """A sliding window over the spatial axes, with its (low, high) padding per axis."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: tuple[tuple[int, int], ...]

    @property
    def spans(self) -> tuple[int, ...]:
        """How many input positions one window covers per axis, dilation included."""
        return tuple((k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations))

    def output_sizes(self, sizes: Sequence[int], ceil_mode: bool = False) -> list[int]:
        """Windows per axis; in ceil mode a last partial window counts unless it starts in the end pad."""
        outputs = []
        for size, span, stride, (low, high) in zip(sizes, self.spans, self.strides, self.pads):
            room = size + low + high - span
            count = (-(-room // stride) if ceil_mode else room // stride) + 1
            if ceil_mode and (count - 1) * stride >= size + low:
                count -= 1
            outputs.append(count)
        return outputs


# ---------------------------------------------------------------------------
# Attributes shared by every windowed op


def spatial_ints(node: Any, name: str, rank: int, default: int) -> tuple[int, ...]:
    """An ints attribute with one value per spatial axis, `default` everywhere when absent."""
    values = node.attr(name, None)
    if not values:
        return (default,) * rank
    if len(values) != rank:
        raise node.error(f"{name} has {len(values)} values but the input has {rank} spatial axes")
    return tuple(int(v) for v in values)


def explicit_pads(node: Any, rank: int) -> tuple[tuple[int, int], ...]:
    """The pads attribute [x1_begin, x2_begin, ..., x1_end, x2_end, ...] as (low, high) pairs."""
    pads = node.attr("pads", None)
    if not pads:
        return ((0, 0),) * rank
    if len(pads) != 2 * rank:
        raise node.error(f"pads has {len(pads)} values; {2 * rank} expected (begin and end per spatial axis)")
    if any(p < 0 for p in pads):
        raise node.error(f"pads must not be negative, got {list(pads)}")
    return tuple((int(pads[i]), int(pads[i + rank])) for i in range(rank))


def same_pads(auto_pad: str, sizes: Sequence[int], spans: Sequence[int],
              strides: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """SAME_UPPER/SAME_LOWER padding: ceil(size / stride) outputs, the odd pad at the end/start."""
    pads = []
    for size, span, stride in zip(sizes, spans, strides):
        total = max(0, (-(-size // stride) - 1) * stride + span - size)
        small, large = total // 2, total - total // 2
        pads.append((small, large) if auto_pad == "SAME_UPPER" else (large, small))
    return tuple(pads)


def auto_pad_mode(node: Any) -> str:
    mode = node.attr("auto_pad", "NOTSET")
    if mode not in AUTO_PAD_MODES:
        raise node.error(f"auto_pad must be one of {', '.join(AUTO_PAD_MODES)}, got {mode!r}")
    return mode


def window_of(node: Any, sizes: Sequence[int], kernel: Sequence[int]) -> Window:
    """The window a conv or pool node slides over spatial `sizes`, auto_pad resolved."""
    rank = len(sizes)
    if len(kernel) != rank:
        raise node.error(f"the kernel has {len(kernel)} spatial axes but the input has {rank}")
    strides = spatial_ints(node, "strides", rank, 1)
    dilations = spatial_ints(node, "dilations", rank, 1)
    if min(strides + dilations, default=1) < 1:
        raise node.error(f"strides and dilations must be positive, got {strides} and {dilations}")
    kernel = tuple(int(k) for k in kernel)
    mode = auto_pad_mode(node)
    if mode == "NOTSET":
        pads = explicit_pads(node, rank)
    elif mode == "VALID":
        pads = ((0, 0),) * rank
    else:
        spans = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
        pads = same_pads(mode, sizes, spans, strides)
    return Window(kernel, strides, dilations, pads)


def check_output_sizes(node: Any, outputs: Sequence[int], sizes: Sequence[int]) -> None:
    if min(outputs, default=1) < 1:
        raise node.error(f"the window does not fit the input: spatial sizes {list(sizes)} "
                         f"give output sizes {list(outputs)}")


def full_window(window: Window) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Window dimensions, strides and dilations over all axes (batch and channel get 1)."""
    return (1, 1) + window.kernel, (1, 1) + window.strides, (1, 1) + window.dilations


# ---------------------------------------------------------------------------
# Convolutions


def bias_shaped(bias: Any, rank: int) -> Any:
    """A per-channel bias (C,) shaped to broadcast over (N, C, spatial...)."""
    return jnp.reshape(bias, (1, -1) + (1,) * rank)


def kernel_from_weights(node: Any, weights: Any) -> tuple[int, ...]:
    kernel = tuple(int(k) for k in weights.shape[2:])
    declared = node.attr("kernel_shape", None)
    if declared and tuple(declared) != kernel:
        raise node.error(f"kernel_shape {list(declared)} does not match the weights' spatial shape "
                         f"{list(kernel)}")
    return kernel


def check_groups(node: Any, channels: int, weight_channels: int, group: int) -> None:
    if group < 1 or channels != weight_channels * group:
        raise node.error(f"input has {channels} channels; weights expect {weight_channels} per group "
                         f"x {group} group(s)")


def library_conv(x: Any, w: Any, window: Window, group: int) -> Any:
    return lax.conv_general_dilated(x, w, window.strides, window.pads,
                                    rhs_dilation=window.dilations, feature_group_count=group)


# At most this many (input channel per group, kernel position) pairs go to conv_by_taps: up
# to here a sum of tap products beats XLA:CPU's convolution (a first layer on one or two
# channels), while with more pairs (a 7x7 RGB stem, say) the convolution wins. A 1x1 kernel
# never does: there each tap is a whole input channel broadcast to every output channel, and
# the library convolution (a product over channels) wins, with its gradients (see
# bench/RESULTS.md, "Design measurements" and "Exported CNNs: slow paths").
TAPS_LIMIT = 18


def summable_by_taps(x: Any, w: Any) -> bool:
    """Float32 or float64 inputs and weights of one type: sums of taps in half precision
    would lose what the library convolution's wider accumulation keeps."""
    return jnp.result_type(x) in (jnp.float32, jnp.float64) and jnp.result_type(w) == jnp.result_type(x)


def uses_taps(x: Any, w: Any, window: Window) -> bool:
    positions = math.prod(window.kernel)
    return summable_by_taps(x, w) and positions > 1 and w.shape[1] * positions <= TAPS_LIMIT


def is_depthwise(x: Any, w: Any, group: int) -> bool:
    """Float convolutions with one input channel per group and several groups (MobileNet's
    and EfficientNet's depthwise layers; any kernel size, any channel multiplier). A single
    group of one channel stays with uses_taps: there the library's derivatives are faster."""
    return group > 1 and w.shape[1] == 1 and summable_by_taps(x, w)


def weights_by_tap(w: Any) -> Any:
    """The (out_channels,) weight vector of every (kernel position, input channel) pair, one
    row each, in window_taps' order, as an array XLA must materialize.

    Sliced straight from w, each vector has stride prod(kernel) in memory, and the fused
    loop of conv_by_taps would gather it for every output element it writes. The rows are
    one gather of w's columns: a transpose would be laid out to fold into the loop's reads
    again, and a slice per row is a kernel per row, each with its own launch and its own
    compilation. The barrier keeps XLA from fusing the gather into the loop, so the loop
    reads each vector contiguously (see bench/RESULTS.md, "Design measurements").
    """
    columns = w.reshape(w.shape[0], -1)
    # Row (position, channel) is column channel * prod(kernel) + position of (O, C * taps).
    order = np.arange(columns.shape[1], dtype=np.int32).reshape(w.shape[1], -1).T.reshape(-1, 1)
    numbers = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(1,), start_index_map=(1,))
    rows = lax.gather(columns, order, numbers, (columns.shape[0], 1), unique_indices=True,
                      mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    return lax.optimization_barrier(rows)


def sum_of_tap_products(x: Any, w: Any, window: Window, group: int) -> Any:
    """A convolution as a sum of products of shifted input slices and per-channel weights,
    which XLA fuses into one elementwise loop."""
    outputs = window.output_sizes(x.shape[2:])
    out_channels, per_group = w.shape[0], w.shape[1]
    # Output channel o reads input channel (o // (out_channels // group)) * per_group + c;
    # None where that is simply channel o.
    first_input = (np.arange(out_channels) // (out_channels // group)) * per_group
    inputs = [None if np.array_equal(first_input + c, np.arange(x.shape[1])) else first_input + c
              for c in range(per_group)]
    rows = weights_by_tap(w)
    spatial = (None,) * len(outputs)
    total = None
    for index, tap in enumerate(window_pieces(x, window, outputs, 0)):
        for channel, picks in enumerate(inputs):
            picked = tap if picks is None else jnp.take(tap, picks, axis=1)
            term = picked * rows[index * per_group + channel][(None, slice(None), *spatial)]
            total = term if total is None else total + term
    return total


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def conv_by_taps(x: Any, w: Any, window: Window, group: int) -> Any:
    """A convolution with few input channels per group by sum_of_tap_products. Derivatives
    are the library convolution's (see conv_by_taps_jvp), which is fast for those."""
    return sum_of_tap_products(x, w, window, group)


def bilinear_jvp(y: Any, product: Callable[[Any, Any], Any], primals: tuple, tangents: tuple) -> tuple:
    """(y, dy) of a convolution y = x * w, which is bilinear: dy = dx * w + x * dw, each term
    by `product`, whose transpose is what reverse mode runs. A zero tangent (an input that is
    not differentiated, such as the data) skips its term."""
    x, w = primals
    dx, dw = tangents
    terms = []
    if not isinstance(dx, SymbolicZero):
        terms.append(product(dx, w))
    if not isinstance(dw, SymbolicZero):
        terms.append(product(x, dw))
    return y, functools.reduce(jnp.add, terms) if terms else jnp.zeros_like(y)


def conv_by_taps_jvp(window: Window, group: int, primals: tuple, tangents: tuple) -> tuple:
    """Both terms by the library convolution."""
    return bilinear_jvp(conv_by_taps(*primals, window, group),
                        lambda x, w: library_conv(x, w, window, group), primals, tangents)


conv_by_taps.defjvp(conv_by_taps_jvp, symbolic_zeros=True)


# Convolutions with at most this many output positions per image go to conv_by_patches.
# XLA:CPU's convolution is slow on small spatial sizes: on a feature map smaller than its
# kernel (a 3x3 layer on 2x2, as ResNet's last stage on a 64x64 image) XLA swaps the
# operands into a convolution many times slower, and its weight gradients there are slow
# too; one matrix product over the windows' elements beats it up to here (see
# bench/RESULTS.md, "Exported CNNs: slow paths (issue 36)").
PATCHES_LIMIT = 64
# Grouped layers go to conv_by_patches on maps of any size, as long as their patches take at
# most this many bytes: XLA:CPU's grouped convolution, with its gradients, was slower than
# the products on every layer measured, but the patches copy the input once per kernel
# position, which a long 1-D kernel (Wav2Vec2's positional convolution) makes too large to
# hold (see bench/RESULTS.md, "Grouped convolutions as products").
GROUPED_PATCHES_BYTES = 1 << 28
# A wide layer (one group, a kernel of 3x3 or more, at least WIDE_PAIRS (input channel, kernel
# position) pairs) goes to conv_by_patches on at most WIDE_PATCHES_LIMIT positions: its patches
# copy every input value once per kernel position, which costs more than XLA's convolution
# once the map is past the sizes where that convolution is slow (ResNet's and SqueezeNet's
# 3x3 layers; see bench/RESULTS.md, "The patches limit by layer").
WIDE_PATCHES_LIMIT = 16
WIDE_PAIRS = 128


def uses_patches(x: Any, w: Any, window: Window, group: int) -> bool:
    if not summable_by_taps(x, w):
        return False
    taps = math.prod(window.kernel)
    positions = math.prod(window.output_sizes(x.shape[2:]))
    if group > 1:
        patches = taps * x.shape[0] * x.shape[1] * positions * jnp.result_type(x).itemsize
        return positions <= PATCHES_LIMIT or patches <= GROUPED_PATCHES_BYTES
    wide = taps >= 9 and w.shape[1] * taps >= WIDE_PAIRS
    return positions <= (WIDE_PATCHES_LIMIT if wide else PATCHES_LIMIT)


def reaching_offsets(window: Window, sizes: Sequence[int], outputs: Sequence[int]) -> list[np.ndarray]:
    """Per spatial axis, the kernel offsets at which some window reads an input element. At
    the others every window reads padding, whose products are zero: on a 1x1 map a 3x3
    kernel padded by 1 reads the input at its centre only. A kernel position reads input
    exactly when its offset does on every axis."""
    reaching = []
    for axis, size in enumerate(sizes):
        along = window_inputs(window, outputs, axis)
        reaching.append(np.flatnonzero(((along >= 0) & (along < size)).any(axis=1)))
    return reaching


def _kernel_at(w: Any, offsets: Sequence[np.ndarray]) -> Any:
    """w (O, C, *kernel) at the given offsets of each kernel axis: a slice where they follow
    one another, else a gather."""
    for axis, kept in enumerate(offsets, start=2):
        if len(kept) == w.shape[axis]:
            continue
        if kept[-1] - kept[0] + 1 == len(kept):
            w = lax.slice_in_dim(w, int(kept[0]), int(kept[-1]) + 1, axis=axis)
        else:
            w = jnp.take(w, kept, axis=axis)
    return w


def patches_product(x: Any, w: Any, window: Window, group: int, offsets: Sequence[np.ndarray]) -> Any:
    """The convolution as one matrix product per group between every window's elements
    (input channel x kernel position, the positions at `offsets` per kernel axis only) and
    the weights there."""
    outputs = window.output_sizes(x.shape[2:])
    batch, out_channels = x.shape[0], w.shape[0]
    if not all(len(kept) for kept in offsets):  # every window lies in the padding
        return jnp.zeros((batch, out_channels, *outputs), jnp.result_type(x, w))
    taps = np.ravel_multi_index(np.meshgrid(*offsets, indexing="ij"), window.kernel).ravel()
    # Slicing the input with its channels in front stacks the pieces straight into the
    # product's operand, (group, C per group x taps, N x positions): the product then reads
    # both operands as they lie instead of XLA copying the patches into its own layout.
    pieces = window_pieces(jnp.swapaxes(x, 0, 1), window, outputs, 0)
    patches = jnp.stack([pieces[tap] for tap in taps], axis=1).reshape(group, -1, batch * math.prod(outputs))
    weights = _kernel_at(w, offsets).reshape(group, out_channels // group, -1)
    # The product jnp.einsum("gok,gkp->gop") makes, written out: einsum's own tracing
    # (parsing its spec, planning the contraction) costs more than the product's, and a
    # network traces this three times per layer (the value and both derivatives).
    y = lax.dot_general(weights, patches, (((2,), (1,)), ((0,), (0,))), precision=lax.Precision.HIGHEST,
                        preferred_element_type=patches.dtype)
    y = y.reshape(group, out_channels // group, batch, *outputs)
    return jnp.moveaxis(y, 2, 0).reshape(batch, out_channels, *outputs)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def conv_by_patches(x: Any, w: Any, window: Window, group: int) -> Any:
    """A convolution by patches_product over every kernel position: the product reads the
    weights as they lie, where leaving out positions that read only padding would first
    copy the rest out of them. The derivatives (conv_by_patches_jvp) leave those out."""
    return patches_product(x, w, window, group, [np.arange(size) for size in window.kernel])


def conv_by_patches_jvp(window: Window, group: int, primals: tuple, tangents: tuple) -> tuple:
    """Both terms by patches_product over the kernel positions that read input (see
    reaching_offsets): their transposes, the gradients, then compute and write nothing for
    weights that only ever meet padding."""
    sizes = primals[0].shape[2:]
    offsets = reaching_offsets(window, sizes, window.output_sizes(sizes))
    return bilinear_jvp(conv_by_patches(*primals, window, group),
                        lambda x, w: patches_product(x, w, window, group, offsets), primals, tangents)


conv_by_patches.defjvp(conv_by_patches_jvp, symbolic_zeros=True)


def uses_product_gradients(x: Any, w: Any, window: Window) -> bool:
    """1x1 layers past the patches limits keep the library convolution for their value and
    take products for their derivatives (conv_with_product_gradients)."""
    return summable_by_taps(x, w) and math.prod(window.kernel) == 1


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def conv_with_product_gradients(x: Any, w: Any, window: Window, group: int) -> Any:
    """The library convolution, whose derivatives are patches products. A 1x1 layer's patches
    are its input, channels first: the gradients' products need none of the transposes
    XLA:CPU puts around its channel-last convolution's two gradients. The value stays on the
    library's kernel, which was the faster forward pass on some exports (see
    bench/RESULTS.md, "The patches stacked channels first, and 1x1 layers' gradients as
    products")."""
    return library_conv(x, w, window, group)


def conv_with_product_gradients_jvp(window: Window, group: int, primals: tuple, tangents: tuple) -> tuple:
    """Both terms by conv_by_patches: on maps past the patches limits a 1x1 kernel's one
    position always reads input, so no position is left to leave out."""
    return bilinear_jvp(conv_with_product_gradients(*primals, window, group),
                        lambda x, w: conv_by_patches(x, w, window, group), primals, tangents)


conv_with_product_gradients.defjvp(conv_with_product_gradients_jvp, symbolic_zeros=True)


# A depthwise convolution (every output channel reads its own input channel) as a bilinear
# primitive: its forward is sum_of_tap_products, its input gradient the same primitive on
# the spread-out cotangent, its weight gradient one pass over input and cotangent that sums
# every tap's products at once (a variadic reduce). All are far faster than XLA:CPU's own
# convolution on depthwise layers, and faster than the transposes JAX derives from the sum
# of taps, which pad every tap's product to the input's size or reduce tap by tap (see
# bench/RESULTS.md, "Design measurements" and "Exported CNNs: slow paths"). A primitive
# (rather than custom_jvp) is what lets the gradients differ from the derived transposes
# while forward mode, vmap and higher derivatives keep working.
depthwise_p = Primitive("onnxtrain_depthwise_conv")


def depthwise_conv(x: Any, w: Any, window: Window) -> Any:
    """x (N, C, *sizes) cross-correlated channel by channel with w (C, 1, *kernel)."""
    return depthwise_p.bind(x, w, window=window)


def _depthwise_sum(x: Any, w: Any, *, window: Window) -> Any:
    return sum_of_tap_products(x, w, window, x.shape[1])


def _depthwise_shape(x: Any, w: Any, *, window: Window) -> ShapedArray:
    return ShapedArray((*x.shape[:2], *window.output_sizes(x.shape[2:])), x.dtype)


def _depthwise_input_cotangent(cotangent: Any, x: Any, w: Any, *, window: Window) -> Any:
    """The input gradient as one more depthwise convolution: the cotangent, spread out by the
    strides and padded so every input position sees the whole kernel, against the flipped
    kernel. Each tap is then a slice of a single padded array that XLA fuses into one loop,
    where the derived transpose pads every tap's product to the input's size and sums them."""
    spread = []
    for size, output, kernel, stride, dilation, (low, _) in zip(
            x.aval.shape[2:], cotangent.shape[2:], window.kernel, window.strides, window.dilations, window.pads):
        before = (kernel - 1) * dilation - low
        # Input size plus the kernel's reach, minus what the spread cotangent and `before` cover.
        after = size + low - (output - 1) * stride - 1
        spread.append((before, after, stride - 1))
    padded = lax.pad(cotangent, np.zeros((), cotangent.dtype), [(0, 0, 0), (0, 0, 0), *spread])
    flipped = lax.rev(w, tuple(range(2, w.ndim)))
    ones = (1,) * len(window.kernel)
    return depthwise_conv(padded, flipped, Window(window.kernel, ones, window.dilations, ((0, 0),) * len(ones)))


def _depthwise_weight_cotangent(cotangent: Any, x: Any, w: Any, *, window: Window) -> Any:
    """Each tap's weight gradient, sum over batch and space of input slice x cotangent, all
    taps in one reduction."""
    products = tuple(tap * cotangent for tap in window_pieces(x, window, cotangent.shape[2:], 0))
    zeros = (np.zeros((), cotangent.dtype),) * len(products)
    sums = lax.reduce(products, zeros, lambda a, b: tuple(p + q for p, q in zip(a, b)),
                      (0, *range(2, cotangent.ndim)))
    return jnp.stack(sums, axis=-1).reshape(w.aval.shape)


def _depthwise_batched(args: Sequence[Any], dims: Sequence[int | None], *, window: Window) -> tuple:
    """vmap: a batch of inputs only joins the image batch; batched weights make the batch
    part of the channels (channels are independent)."""
    (x, w), (x_axis, w_axis) = args, dims
    if w_axis is None:
        x = jnp.moveaxis(x, x_axis, 0)
        y = depthwise_conv(x.reshape(-1, *x.shape[2:]), w, window)
        return y.reshape(x.shape[0], -1, *y.shape[1:]), 0
    w = jnp.moveaxis(w, w_axis, 0)
    size = w.shape[0]
    x = (jnp.moveaxis(x, x_axis, 1) if x_axis is not None
         else jnp.broadcast_to(x[:, None], (x.shape[0], size, *x.shape[1:])))
    y = depthwise_conv(x.reshape(x.shape[0], -1, *x.shape[3:]), w.reshape(-1, *w.shape[2:]), window)
    return y.reshape(y.shape[0], size, -1, *y.shape[2:]), 1


depthwise_p.def_impl(_depthwise_sum)
depthwise_p.def_abstract_eval(_depthwise_shape)
mlir.register_lowering(depthwise_p, mlir.lower_fun(_depthwise_sum, multiple_results=False))
ad.defbilinear(depthwise_p, _depthwise_input_cotangent, _depthwise_weight_cotangent)
batching.primitive_batchers[depthwise_p] = _depthwise_batched


@op("Conv", since=1)
def conv(node: Any, x: Any, w: Any, b: Any = None) -> Any:
    """Y = X (*) W + B: grouped, strided, dilated N-D cross-correlation with ONNX padding."""
    rank = x.ndim - 2
    group = node.attr("group", 1)
    check_groups(node, x.shape[1], w.shape[1], group)
    window = window_of(node, x.shape[2:], kernel_from_weights(node, w))
    check_output_sizes(node, window.output_sizes(x.shape[2:]), x.shape[2:])
    if is_depthwise(x, w, group):
        multiplier = w.shape[0] // group
        y = depthwise_conv(x if multiplier == 1 else jnp.repeat(x, multiplier, axis=1), w, window)
    else:
        lowering = (conv_by_taps if uses_taps(x, w, window)
                    else conv_by_patches if uses_patches(x, w, window, group)
                    else conv_with_product_gradients if uses_product_gradients(x, w, window)
                    else library_conv)
        y = lowering(x, w, window, group)
    return y if b is None else y + bias_shaped(b, rank)


def transpose_pads(node: Any, window: Window, sizes: Sequence[int],
                   output_padding: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """ConvTranspose (low, high) crops: from output_shape or SAME auto_pad if set, else pads."""
    rank = len(sizes)
    mode = auto_pad_mode(node)
    output_shape = node.attr("output_shape", None)
    if output_shape:
        targets = [int(v) for v in output_shape][-rank:]
    elif mode in ("SAME_UPPER", "SAME_LOWER"):
        targets = [size * stride for size, stride in zip(sizes, window.strides)]
    else:
        return ((0, 0),) * rank if mode == "VALID" else explicit_pads(node, rank)
    pads = []
    for size, span, stride, extra, target in zip(sizes, window.spans, window.strides,
                                                 output_padding, targets):
        total = stride * (size - 1) + extra + span - target
        small, large = total // 2, total - total // 2
        pads.append((small, large) if mode == "SAME_UPPER" else (large, small))
    return tuple(pads)


def transposed_kernel(w: Any, group: int) -> Any:
    """ConvTranspose weights (C, M/group, k...) as flipped Conv weights (M, C/group, k...)."""
    channels, per_group_out = w.shape[:2]
    spatial = w.shape[2:]
    w = jnp.reshape(w, (group, channels // group, per_group_out) + spatial)
    w = jnp.swapaxes(w, 1, 2)
    w = jnp.reshape(w, (group * per_group_out, channels // group) + spatial)
    return jnp.flip(w, axis=tuple(range(2, w.ndim)))


@op("ConvTranspose", since=1)
def conv_transpose(node: Any, x: Any, w: Any, b: Any = None) -> Any:
    """The gradient of Conv w.r.t. its input: X dilated by strides, convolved with flipped W."""
    rank = x.ndim - 2
    group = node.attr("group", 1)
    if group < 1 or x.shape[1] != w.shape[0] or w.shape[0] % group:
        raise node.error(f"input has {x.shape[1]} channels but the weights have {w.shape[0]} "
                         f"input channels for {group} group(s)")
    window = window_of(node, x.shape[2:], kernel_from_weights(node, w))
    output_padding = spatial_ints(node, "output_padding", rank, 0)
    pads = transpose_pads(node, window, x.shape[2:], output_padding)
    padding = [(span - 1 - low, span - 1 - high + extra)
               for span, (low, high), extra in zip(window.spans, pads, output_padding)]
    y = lax.conv_general_dilated(x, transposed_kernel(w, group), (1,) * rank, padding,
                                 lhs_dilation=window.strides, rhs_dilation=window.dilations,
                                 feature_group_count=group)
    check_output_sizes(node, y.shape[2:], x.shape[2:])
    return y if b is None else y + bias_shaped(b, rank)


def kernel_offsets(kernel: Sequence[int]) -> np.ndarray:
    """Every kernel position, row-major: shape (prod(kernel), rank)."""
    return np.array(list(itertools.product(*(range(k) for k in kernel))), np.int64).reshape(-1, len(kernel))


def sample_linear_zero_padded(planes: Any, positions: Sequence[Any]) -> Any:
    """Multilinear interpolation of planes (B, G, C, *S) at positions[i] (B, G, P), zero outside.

    Returns (B, G, C, P).
    """
    sizes = planes.shape[3:]
    flat = jnp.reshape(planes, planes.shape[:3] + (-1,))
    result = 0
    lows = [jnp.floor(p) for p in positions]
    for corner in itertools.product((0, 1), repeat=len(sizes)):
        weight, index, inside = 1, 0, True
        for axis, (size, position, low) in enumerate(zip(sizes, positions, lows)):
            tap = low + corner[axis]
            weight = weight * (1 - jnp.abs(position - tap))
            inside = inside & (tap >= 0) & (tap <= size - 1)
            index = index * size + jnp.clip(tap, 0, size - 1).astype(jnp.int32)
        values = jnp.take_along_axis(flat, index[:, :, None, :], axis=3)
        result = result + values * jnp.where(inside, weight, 0)[:, :, None, :].astype(planes.dtype)
    return result


@op("DeformConv", since=19)
def deform_conv(node: Any, x: Any, w: Any, offset: Any, b: Any = None, mask: Any = None) -> Any:
    """Conv whose every kernel tap samples X (bilinearly, zero outside) at a learned offset, times mask."""
    batch, channels, *sizes = x.shape
    rank = len(sizes)
    group = node.attr("group", 1)
    offset_group = node.attr("offset_group", 1)
    check_groups(node, channels, w.shape[1], group)
    kernel = kernel_from_weights(node, w)
    window = window_of(node, sizes, kernel)
    taps = math.prod(kernel)
    outputs = tuple(offset.shape[2:])
    if channels % offset_group or offset.shape[1] != offset_group * taps * rank:
        raise node.error(f"offset has {offset.shape[1]} channels; {offset_group * taps * rank} expected "
                         f"(offset_group x kernel positions x {rank}), and the {channels} channels "
                         f"must divide by offset_group {offset_group}")
    if list(outputs) != window.output_sizes(sizes):
        raise node.error(f"offset spatial shape {list(outputs)} does not match the output shape "
                         f"{window.output_sizes(sizes)} of the convolution")
    grid = np.meshgrid(*(np.arange(n) for n in outputs), indexing="ij")
    offset = jnp.reshape(offset, (batch, offset_group, taps, rank, -1))
    positions = []
    for axis in range(rank):
        origin = grid[axis].reshape(-1) * window.strides[axis] - window.pads[axis][0]
        base = origin[None, :] + kernel_offsets(kernel)[:, axis:axis + 1] * window.dilations[axis]
        positions.append(jnp.reshape(base + offset[:, :, :, axis, :], (batch, offset_group, -1)))
    planes = jnp.reshape(x, (batch, offset_group, channels // offset_group) + tuple(sizes))
    columns = sample_linear_zero_padded(planes, positions)
    columns = jnp.reshape(columns, (batch, offset_group, channels // offset_group, taps, -1))
    if mask is not None:
        columns = columns * jnp.reshape(mask, (batch, offset_group, 1, taps, -1))
    columns = jnp.reshape(columns, (batch, group, channels // group, taps, -1))
    weights = jnp.reshape(w, (group, w.shape[0] // group, channels // group, taps))
    y = jnp.einsum("bgctp,gmct->bgmp", columns, weights)
    y = jnp.reshape(y, (batch, w.shape[0]) + outputs).astype(x.dtype)
    return y if b is None else y + bias_shaped(b, rank)


CAUSAL_ACTIVATIONS = ("none", "silu", "swish")


@op("CausalConvWithState", since=27)
def causal_conv_with_state(node: Any, x: Any, w: Any, b: Any = None, past: Any = None) -> tuple:
    """Depthwise causal 1-D conv over [past_state, input]; returns (output, last k-1 positions)."""
    activation = node.attr("activation", "none")
    if activation not in CAUSAL_ACTIVATIONS:
        raise node.error(f"activation must be one of {', '.join(CAUSAL_ACTIVATIONS)}, got {activation!r}")
    if x.ndim != 3 or w.ndim != 3 or w.shape[:2] != (x.shape[1], 1):
        raise node.error(f"input must be (batch, channels, length) and weight (channels, 1, k); "
                         f"got {x.shape} and {w.shape}")
    batch, channels, _ = x.shape
    history = w.shape[2] - 1
    if past is None:
        past = jnp.zeros((batch, channels, history), x.dtype)
    elif past.shape != (batch, channels, history):
        raise node.error(f"past_state must have shape {(batch, channels, history)}, got {past.shape}")
    padded = jnp.concatenate([past, x], axis=2)
    y = lax.conv_general_dilated(padded, w, (1,), [(0, 0)], feature_group_count=channels)
    if b is not None:
        y = y + bias_shaped(b, 1)
    if activation != "none":
        wide = y.astype(jnp.promote_types(y.dtype, jnp.float32))
        y = (wide * jax.nn.sigmoid(wide)).astype(x.dtype)
    return y, padded[:, :, padded.shape[2] - history:]


# ---------------------------------------------------------------------------
# Pooling


def pool_window(node: Any, x: Any) -> tuple[Window, Window, list[int]]:
    """A pooling node's declared window, the same window padded for ceil mode, and its output sizes.

    In ceil mode the last, partial windows reach past the declared end pad; the
    padded window covers them so every output is computed.
    """
    sizes = x.shape[2:]
    kernel = node.attr("kernel_shape", None)
    if not kernel:
        raise node.error("required attribute 'kernel_shape' is missing")
    declared = window_of(node, sizes, kernel)
    ceil_mode = bool(node.attr("ceil_mode", 0)) and auto_pad_mode(node) == "NOTSET"
    outputs = declared.output_sizes(sizes, ceil_mode)
    check_output_sizes(node, outputs, sizes)
    pads = []
    for size, span, stride, (low, high), count in zip(sizes, declared.spans, declared.strides,
                                                       declared.pads, outputs):
        needed = (count - 1) * stride + span - (size + low + high)
        pads.append((low, high + max(needed, 0)))
    extended = Window(declared.kernel, declared.strides, declared.dilations, tuple(pads))
    return declared, extended, outputs


def lowest(dtype: Any) -> Any:
    """The identity of max for a dtype: -inf for floats, the minimum for integers."""
    dtype = np.dtype(dtype)
    return -np.inf if jnp.issubdtype(dtype, jnp.floating) else np.iinfo(dtype).min


def is_tiling(window: Window) -> bool:
    """Windows that tile the input: kernel == stride, no padding, no dilation."""
    return (window.kernel == window.strides and set(window.dilations) == {1}
            and all(p == (0, 0) for p in window.pads))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def max_of_windows(x: Any, window: Window, outputs: tuple[int, ...]) -> Any:
    """The maximum of each window as an elementwise max of kernel-many strided slices of the
    padded input (padding never wins). Forward, XLA:CPU runs it as fast as reduce_window, and
    with its derivative (first_maximum_jvp) much faster, so training steps of models with
    MaxPool are shorter (see bench/RESULTS.md, "Design measurements")."""
    pieces = window_pieces(x, window, outputs, lowest(x.dtype))
    while len(pieces) > 1:
        pairs = [jnp.maximum(a, b) for a, b in zip(pieces[::2], pieces[1::2])]
        pieces = pairs + pieces[len(pairs) * 2:]
    return pieces[0]


def first_maximum_jvp(window: Window, outputs: tuple[int, ...], primals: tuple, tangents: tuple) -> tuple:
    """Each window passes on the tangent of its first maximum, as PyTorch and ONNX Runtime
    route MaxPool's gradient and as its Indices output names it (a window holding NaN, whose
    maximum is NaN, passes on its last element's).

    JAX's derivative of the max of slices splits ties between them instead, and XLA:CPU
    computes its transpose with every input element re-deriving all of its window's
    comparisons (and the layer before, when that is fused in). Picking by an index made from
    the primal avoids that work; testing for NaN as well would give most of the gain back,
    so a NaN window is left to its last element (see bench/RESULTS.md, "Design
    measurements"). (reduce_window's derivative also picks the first maximum, slower: see
    max_of_windows.)
    """
    (x,), (dx,) = primals, tangents
    y = max_of_windows(x, window, outputs)
    pieces = window_pieces(x, window, outputs, lowest(x.dtype))
    first = jnp.full(y.shape, len(pieces) - 1, np.int32)
    for position in reversed(range(len(pieces) - 1)):
        first = jnp.where(pieces[position] == y, position, first)
    picked = [jnp.where(first == position, tap, jnp.zeros_like(tap))
              for position, tap in enumerate(window_pieces(dx, window, outputs, 0))]
    return y, functools.reduce(jnp.add, picked)


max_of_windows.defjvp(first_maximum_jvp)


def padded_input(x: Any, window: Window, fill: Any) -> Any:
    """x with the window's spatial padding, filled with `fill`."""
    return lax.pad(x, np.array(fill, x.dtype), ((0, 0, 0), (0, 0, 0)) + tuple(
        (low, high, 0) for low, high in window.pads))


def window_taps(x: Any, window: Window, outputs: Sequence[int], fill: Any) -> Iterator[tuple[tuple[int, ...], Any]]:
    """(kernel position, the input element at that position of every window: (N, C, *outputs))
    for each kernel position in row-major order; padding = fill."""
    padded = padded_input(x, window, fill)
    for position in itertools.product(*(range(k) for k in window.kernel)):
        start = [p * d for p, d in zip(position, window.dilations)]
        limit = [s + (n - 1) * stride + 1 for s, n, stride in zip(start, outputs, window.strides)]
        yield position, lax.slice(padded, (0, 0) + tuple(start), tuple(x.shape[:2]) + tuple(limit),
                                  (1, 1) + window.strides)


def window_pieces(x: Any, window: Window, outputs: Sequence[int], fill: Any) -> list:
    """window_taps' slices alone, one (N, C, *outputs) array per kernel position."""
    return [tap for _, tap in window_taps(x, window, outputs, fill)]


def window_patches(x: Any, window: Window, outputs: Sequence[int], fill: Any) -> Any:
    """Every window's elements stacked in front: (prod(kernel), N, C, *outputs), padding = fill."""
    return jnp.stack(window_pieces(x, window, outputs, fill))


def window_inputs(window: Window, outputs: Sequence[int], axis: int) -> np.ndarray:
    """Input position of each (kernel tap, output) along one axis: shape (kernel, outputs)."""
    starts = np.arange(outputs[axis]) * window.strides[axis] - window.pads[axis][0]
    return np.arange(window.kernel[axis])[:, None] * window.dilations[axis] + starts[None, :]


def tap_positions(window: Window, outputs: Sequence[int], sizes: Sequence[int]) -> tuple[list, np.ndarray]:
    """Per axis, the input position of every (tap, output), broadcastable to (taps, *outputs),
    and whether each (tap, output) lies inside the input."""
    rank = len(sizes)
    taps = kernel_offsets(window.kernel)
    positions, inside = [], np.ones((len(taps),) + tuple(outputs), bool)
    for axis in range(rank):
        shape = (len(taps),) + tuple(n if a == axis else 1 for a, n in enumerate(outputs))
        along = window_inputs(window, outputs, axis)[taps[:, axis]].reshape(shape)
        inside = inside & (along >= 0) & (along < sizes[axis])
        positions.append(along)
    return positions, inside


def max_pool_indices(x: Any, best: Any, window: Window, outputs: Sequence[int], column_major: bool) -> Any:
    """MaxPool's Indices: the flat index into X of each window's first maximum (`best`, the
    pooled output).

    Spatial offsets are row major, or column major (first axis fastest) when
    storage_order=1; the batch and channel offsets are row major either way.
    """
    sizes = x.shape[2:]
    rank = len(sizes)
    patches = window_patches(x, window, outputs, lowest(x.dtype))
    positions, inside = tap_positions(window, outputs, sizes)
    flat, scale = np.zeros(inside.shape, np.int64), 1
    for axis in (range(rank) if column_major else reversed(range(rank))):
        flat = flat + positions[axis] * scale
        scale *= sizes[axis]
    first = jnp.argmax(inside[:, None, None] & (patches == best[None]), axis=0)
    spatial = jnp.asarray(flat.reshape(len(flat), -1))[first.reshape(x.shape[:2] + (-1,)),
                                                       jnp.arange(math.prod(outputs))]
    plane = np.arange(x.shape[0] * x.shape[1], dtype=np.int64).reshape(x.shape[:2] + (1,))
    return jnp.reshape(plane * math.prod(sizes) + spatial, x.shape[:2] + tuple(outputs))


@op("MaxPool", since=1)
def max_pool(node: Any, x: Any) -> Any:
    """The maximum of each window (padding never wins); optionally the flat index of each maximum."""
    _, window, outputs = pool_window(node, x)
    y = max_of_windows(x, window, tuple(outputs))
    if not node.output_used(1):
        return y
    storage_order = node.attr("storage_order", 0)
    if storage_order not in (0, 1):
        raise node.error(f"storage_order must be 0 (row major) or 1 (column major), got {storage_order}")
    return y, lax.stop_gradient(max_pool_indices(x, y, window, outputs, bool(storage_order)))


def window_counts(window: Window, outputs: Sequence[int], bounds: Sequence[tuple[int, int]]) -> np.ndarray:
    """How many of each window's taps fall in [low, high) per axis; shape (*outputs)."""
    counts = np.ones((), np.int64)
    for axis, (low, high) in enumerate(bounds):
        along = window_inputs(window, outputs, axis)
        per_axis = ((along >= low) & (along < high)).sum(axis=0)
        counts = np.multiply.outer(counts, per_axis)
    return counts


def window_sums(x: Any, window: Window, outputs: Sequence[int]) -> Any:
    """The sum of each window (padding adds nothing), in the form XLA:CPU ran fastest, forward
    and with its gradient, on 1-3 spatial axes:
    - windows over one axis that overlap or leave gaps: reduce_window;
    - windows of no more taps than their sides add up to (1-D, 2x2, 1xk): the sum of the
      kernel-many strided slices, one per tap (faster than reduce_window forward and per
      training step);
    - larger windows that tile the input or move by 1: summed one axis at a time
      (sums_axis_by_axis);
    - larger windows that move by more and overlap, leave gaps or are padded: reduce_window,
      with sums_axis_by_axis as the derivative (strided_window_sums).
    The measurements behind each choice are in bench/RESULTS.md, "Design measurements".
    """
    if len(window.kernel) == 1 and not is_tiling(window):
        return reduce_window_sums(x, window)
    if math.prod(window.kernel) <= sum(window.kernel):
        return functools.reduce(jnp.add, window_pieces(x, window, outputs, 0))
    if is_tiling(window) or set(window.strides) == {1}:
        return sums_axis_by_axis(x, window, outputs)
    return strided_window_sums(x, window, tuple(outputs))


def reduce_window_sums(x: Any, window: Window) -> Any:
    dims, strides, dilations = full_window(window)
    return lax.reduce_window(x, np.array(0, x.dtype), lax.add, dims, strides,
                             ((0, 0), (0, 0)) + window.pads, window_dilation=dilations)


def sums_axis_by_axis(x: Any, window: Window, outputs: Sequence[int]) -> Any:
    """Window sums as one pass per spatial axis, each adding that axis's kernel-many strided
    slices: k1 + k2 slices rather than k1 * k2. With the gradient it is faster than
    reduce_window on every window shape tried; forward too on windows that tile or move by
    1, but not on windows that move by more and overlap (see strided_window_sums). One slice
    per tap has the faster gradient on 2x2 windows but not from 3x3 on, hence the split in
    window_sums (see bench/RESULTS.md, "Design measurements")."""
    summed = padded_input(x, window, 0)
    for axis, (kernel, stride, dilation, count) in enumerate(
            zip(window.kernel, window.strides, window.dilations, outputs), start=2):
        taps = [lax.slice_in_dim(summed, tap * dilation, tap * dilation + (count - 1) * stride + 1, stride, axis)
                for tap in range(kernel)]
        summed = functools.reduce(jnp.add, taps)
    return summed


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def strided_window_sums(x: Any, window: Window, outputs: tuple[int, ...]) -> Any:
    """reduce_window_sums, whose derivative is sums_axis_by_axis: on such windows
    reduce_window is the faster forward pass and summing axis by axis by far the faster
    gradient (see bench/RESULTS.md, "Design measurements")."""
    return reduce_window_sums(x, window)


@strided_window_sums.defjvp
def strided_window_sums_jvp(window: Window, outputs: tuple[int, ...], primals: tuple, tangents: tuple) -> tuple:
    (x,), (dx,) = primals, tangents
    return strided_window_sums(x, window, outputs), sums_axis_by_axis(dx, window, outputs)


def accumulation_dtype(dtype: Any) -> Any:
    """Half-precision sums accumulate in float32."""
    return jnp.promote_types(dtype, jnp.float32)


@op("AveragePool", since=1)
def average_pool(node: Any, x: Any) -> Any:
    """The mean of each window: over real elements, or pads too when count_include_pad=1."""
    declared, window, outputs = pool_window(node, x)
    sizes = x.shape[2:]
    if node.attr("count_include_pad", 0):
        bounds = [(-low, size + high) for size, (low, high) in zip(sizes, declared.pads)]
    else:
        bounds = [(0, size) for size in sizes]
    counts = window_counts(window, outputs, bounds)
    wide = x.astype(accumulation_dtype(x.dtype))
    return (window_sums(wide, window, outputs) / counts.astype(wide.dtype)).astype(x.dtype)


def lp_order(node: Any) -> Any:
    """The p attribute (a float in opset 1, an int from opset 2 on); positive."""
    p = node.attr("p", 2)
    if p <= 0:
        raise node.error(f"p must be positive, got {p}")
    return p


def lp_norm(power_sum: Any, p: Any) -> Any:
    """(sum |x|^p)^(1/p) from the sum."""
    return jnp.sqrt(power_sum) if p == 2 else power_sum ** (1.0 / p)


def abs_power(x: Any, p: Any) -> Any:
    return jnp.square(x) if p == 2 else jnp.abs(x) ** p


@op("LpPool", since=1)
def lp_pool(node: Any, x: Any) -> Any:
    """The p-norm of each window, (sum |x|^p)^(1/p); padding adds nothing."""
    p = lp_order(node)
    _, window, outputs = pool_window(node, x)
    wide = x.astype(accumulation_dtype(x.dtype))
    return lp_norm(window_sums(abs_power(wide, p), window, outputs), p).astype(x.dtype)


def spatial_axes(x: Any) -> tuple[int, ...]:
    return tuple(range(2, x.ndim))


@op("GlobalAveragePool", since=1)
def global_average_pool(node: Any, x: Any) -> Any:
    """The mean over all spatial axes, kept as size-1 axes."""
    wide = x.astype(accumulation_dtype(x.dtype))
    return jnp.mean(wide, axis=spatial_axes(x), keepdims=True).astype(x.dtype)


@op("GlobalMaxPool", since=1)
def global_max_pool(node: Any, x: Any) -> Any:
    """The maximum over all spatial axes, kept as size-1 axes."""
    return jnp.max(x, axis=spatial_axes(x), keepdims=True)


@op("GlobalLpPool", since=1)
def global_lp_pool(node: Any, x: Any) -> Any:
    """The p-norm over all spatial axes, kept as size-1 axes."""
    p = lp_order(node)
    wide = x.astype(accumulation_dtype(x.dtype))
    power_sum = jnp.sum(abs_power(wide, p), axis=spatial_axes(x), keepdims=True)
    return lp_norm(power_sum, p).astype(x.dtype)


# ---------------------------------------------------------------------------
# MaxUnpool and Col2Im: scattering windows back


@op("MaxUnpool", since=9, static_inputs=(2,))
def max_unpool(node: Any, x: Any, indices: Any, output_shape: Any = None) -> Any:
    """Zeros with X's values put back at MaxPool's flat indices.

    The indices address the unpooled shape (size - 1) * stride - pads + kernel;
    output_shape, when given, pads that at the end (as the ONNX backend cases expect).
    """
    rank = x.ndim - 2
    kernel = node.attr("kernel_shape")
    strides = spatial_ints(node, "strides", rank, 1)
    pads = explicit_pads(node, rank)
    if len(kernel) != rank:
        raise node.error(f"kernel_shape has {len(kernel)} values for {rank} spatial axes")
    unpooled = tuple(x.shape[:2]) + tuple(
        (size - 1) * stride - low - high + k
        for size, stride, (low, high), k in zip(x.shape[2:], strides, pads, kernel))
    if indices.shape != x.shape:
        raise node.error(f"indices have shape {indices.shape}; X has {x.shape}")
    y = jnp.zeros(math.prod(unpooled), x.dtype)
    y = y.at[jnp.reshape(indices, -1)].set(jnp.reshape(x, -1), mode="drop")
    y = jnp.reshape(y, unpooled)
    if output_shape is None:
        return y
    target = host_ints(node, output_shape, "output_shape")
    if len(target) != x.ndim or any(t < u for t, u in zip(target, unpooled)):
        raise node.error(f"output_shape {target} must have rank {x.ndim} and be at least the "
                         f"unpooled shape {list(unpooled)}")
    return jnp.pad(y, [(0, t - u) for t, u in zip(target, unpooled)])


@op("Col2Im", since=18, static_inputs=(1, 2))
def col2im(node: Any, x: Any, image_shape: Any, block_shape: Any) -> Any:
    """Sums column blocks (N, C*prod(block), L) back into images (N, C, *image_shape)."""
    image = host_ints(node, image_shape, "image_shape")
    block = host_ints(node, block_shape, "block_shape")
    rank = len(image)
    if len(block) != rank:
        raise node.error(f"image_shape has {rank} values but block_shape has {len(block)}")
    window = window_of(node, image, block)
    blocks = window.output_sizes(image)
    taps = math.prod(block)
    batch, rows, count = x.shape
    if rows % taps or count != math.prod(blocks):
        raise node.error(f"input shape {x.shape} does not hold C x {taps} rows and "
                         f"{math.prod(blocks)} blocks ({blocks}) for this image and block")
    columns = jnp.reshape(x, (batch, rows // taps, taps) + tuple(blocks))
    padded = [size + low + high for size, (low, high) in zip(image, window.pads)]
    total = 0
    for tap, position in enumerate(itertools.product(*(range(k) for k in block))):
        config = [(0, 0, 0), (0, 0, 0)]
        for axis, p in enumerate(position):
            low = p * window.dilations[axis]
            covered = (blocks[axis] - 1) * window.strides[axis] + 1
            config.append((low, padded[axis] - low - covered, window.strides[axis] - 1))
        total = total + lax.pad(columns[:, :, tap], np.array(0, x.dtype), config)
    starts = (0, 0) + tuple(low for low, _ in window.pads)
    sizes = (batch, rows // taps) + tuple(image)
    return lax.slice(total, starts, tuple(s + n for s, n in zip(starts, sizes)))
