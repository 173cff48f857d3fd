"""Shape manipulation: Shape/Size, reshapes, transposes, joins and splits, slices, pads, tiles.

Also the ops that build a tensor from a shape (ConstantOfShape, EyeLike, Range)
and the block rearrangements (DepthToSpace, SpaceToDepth, CenterCropPad).
Shape and Size always return host constants, so the Reshape/Slice/Expand
chains that consume them keep static shapes under jit. Layout-only ops also
accept host string tensors (jax has no strings): they use numpy for those.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from onnxtrain.translate.ops.common import (host_ints, normalize_axes, normalize_axis, numpy_dtype, output_shape,
                                            shape_input)
from onnxtrain.translate.registry import op


def array_module(*values: Any) -> Any:
    """numpy for host string tensors (jax cannot hold them), jax.numpy otherwise."""
    for value in values:
        if isinstance(value, np.ndarray) and value.dtype.kind in "OUS":
            return np
    return jnp


def unique_axes(node: Any, axes: Sequence[int], rank: int) -> list[int]:
    """Axes normalized to [0, rank); an error when out of range or repeated."""
    normalized = normalize_axes(axes, rank)
    if any(not 0 <= a < rank for a in normalized):
        raise node.error(f"axes {list(axes)} out of range for rank {rank}")
    if len(set(normalized)) != len(normalized):
        raise node.error(f"axes {list(axes)} repeat an axis")
    return normalized


def checked_axis(node: Any, axis: int, rank: int) -> int:
    """One axis normalized to [0, rank); an error when out of range."""
    return unique_axes(node, [axis], rank)[0]


# --- Shape, Size ------------------------------------------------------------------


@op("Shape", since=1, differentiable=False)
def shape(node: Any, x: Any) -> np.ndarray:
    """The input's dimensions as int64, sliced by `start`/`end` (opset 15), clamped to the rank."""
    dims = np.array(np.shape(x), dtype=np.int64)
    start = node.attr("start", 0)
    end = node.attr("end", None)
    return dims[start:end]


@op("Size", since=1, differentiable=False)
def size(node: Any, x: Any) -> np.ndarray:
    """The number of elements of the input, an int64 scalar."""
    return np.array(np.size(x), dtype=np.int64)


# --- Reshape, Flatten, Squeeze, Unsqueeze, Transpose ---------------------------------


def _reshape_target(node: Any, dims: Sequence[int], target: Sequence[int], allowzero: bool) -> tuple:
    """ONNX's requested shape made concrete: 0 copies the input dim (unless allowzero), -1 infers."""
    if any(d == 0 and not allowzero and i >= len(dims) for i, d in enumerate(target)):
        raise node.error(f"shape {list(target)} copies dimension {len(dims)} or later (a 0 entry) "
                         f"from a rank-{len(dims)} input")
    resolved = [dims[i] if d == 0 and not allowzero else d for i, d in enumerate(target)]
    unknown = [i for i, d in enumerate(resolved) if d == -1]
    if len(unknown) > 1 or any(d < -1 for d in resolved):
        raise node.error(f"shape {list(target)} may hold one -1 and no other negative entry")
    total = math.prod(dims)
    if unknown:
        if allowzero and 0 in resolved:
            raise node.error(f"shape {list(target)} has both -1 and 0 while allowzero=1")
        known = math.prod(d for d in resolved if d != -1)
        if known == 0 or total % known:
            raise node.error(f"cannot reshape {tuple(dims)} to {list(target)}")
        resolved[unknown[0]] = total // known
    if math.prod(resolved) != total:
        raise node.error(f"cannot reshape {tuple(dims)} ({total} elements) to {list(target)}")
    return tuple(resolved)


@op("Reshape", since=1)
def reshape_v1(node: Any, data: Any) -> Any:
    """Reshape to the `shape` attribute (0 copies a dim, -1 infers one)."""
    target = _reshape_target(node, np.shape(data), shape_input(node, np.asarray(node.attr("shape"), np.int64),
                                                                "attribute shape"), allowzero=False)
    return array_module(data).reshape(data, target)


@op("Reshape", since=5, static_inputs=(1,))
def reshape(node: Any, data: Any, shape: Any) -> Any:
    """Reshape to the `shape` input; 0 copies the input dim unless allowzero=1 (opset 14)."""
    target = _reshape_target(node, np.shape(data), shape_input(node, shape, "shape"),
                             allowzero=bool(node.attr("allowzero", 0)))
    return array_module(data).reshape(data, target)


@op("Flatten", since=1)
def flatten(node: Any, x: Any) -> Any:
    """2-D view: dims before `axis` (default 1, may be negative) times dims from `axis` on."""
    dims = np.shape(x)
    axis = normalize_axis(node.attr("axis", 1), len(dims))
    if not 0 <= axis <= len(dims):
        raise node.error(f"axis {node.attr('axis', 1)} out of range for rank {len(dims)}")
    return array_module(x).reshape(x, (math.prod(dims[:axis]), math.prod(dims[axis:])))


def _squeeze(node: Any, data: Any, axes: Sequence[int] | None) -> Any:
    dims = np.shape(data)
    if axes is None:
        axes = [i for i, d in enumerate(dims) if d == 1]
    axes = unique_axes(node, axes, len(dims))
    if any(dims[a] != 1 for a in axes):
        raise node.error(f"cannot squeeze axes {axes} of shape {dims}: their size is not 1")
    return array_module(data).squeeze(data, axis=tuple(axes))


@op("Squeeze", since=1)
def squeeze_v1(node: Any, data: Any) -> Any:
    """Drop the size-1 dims listed in the `axes` attribute (all size-1 dims when absent)."""
    return _squeeze(node, data, node.attr("axes", None))


@op("Squeeze", since=13, static_inputs=(1,))
def squeeze(node: Any, data: Any, axes: Any = None) -> Any:
    """Drop the size-1 dims listed in the `axes` input (all size-1 dims when omitted)."""
    return _squeeze(node, data, None if axes is None else host_ints(node, axes, "axes"))


def _unsqueeze(node: Any, data: Any, axes: Sequence[int]) -> Any:
    """Insert size-1 dims at `axes`, positions in the output (negative counts from its end)."""
    axes = unique_axes(node, axes, np.ndim(data) + len(axes))
    return array_module(data).expand_dims(data, tuple(sorted(axes)))


@op("Unsqueeze", since=1)
def unsqueeze_v1(node: Any, data: Any) -> Any:
    """Insert size-1 dims at the output positions of the `axes` attribute."""
    return _unsqueeze(node, data, node.attr("axes"))


@op("Unsqueeze", since=13, static_inputs=(1,))
def unsqueeze(node: Any, data: Any, axes: Any) -> Any:
    """Insert size-1 dims at the output positions of the `axes` input."""
    return _unsqueeze(node, data, host_ints(node, axes, "axes"))


@op("Transpose", since=1)
def transpose(node: Any, data: Any) -> Any:
    """Permute the dims by `perm` (default: reverse them)."""
    rank = np.ndim(data)
    perm = node.attr("perm", None)
    perm = list(range(rank))[::-1] if perm is None else unique_axes(node, perm, rank)
    if len(perm) != rank:
        raise node.error(f"perm {node.attr('perm')} does not list all {rank} axes")
    return array_module(data).transpose(data, perm)


# --- Concat, Split ----------------------------------------------------------------


@op("Concat", since=1)
def concat(node: Any, *inputs: Any) -> Any:
    """Join the inputs along `axis` (required from opset 4, default 1 before)."""
    axis = node.attr("axis", 1) if node.opset < 4 else node.attr("axis")
    if not inputs:
        raise node.error("Concat needs at least one input")
    rank = np.ndim(inputs[0])
    axis = checked_axis(node, axis, rank)
    if any(np.ndim(x) != rank for x in inputs):
        raise node.error(f"inputs have different ranks: {[np.shape(x) for x in inputs]}")
    return array_module(*inputs).concatenate(inputs, axis=axis)


def _split_sizes(node: Any, dim: int, split: Any) -> list[int]:
    """Output lengths: the `split` input or attribute, else `num_outputs` (opset 18) parts,
    else as many equal parts as the node has outputs."""
    if split is not None:
        sizes = host_ints(node, split, "split")
    elif node.has_attr("split"):
        sizes = [int(s) for s in node.attr("split")]
    elif node.has_attr("num_outputs"):
        parts = node.attr("num_outputs")
        chunk = -(-dim // parts)
        sizes = [chunk] * (parts - 1) + [dim - chunk * (parts - 1)]
        if parts != node.num_outputs or sizes[-1] < 0:
            raise node.error(f"cannot split a dimension of {dim} into num_outputs={parts} parts "
                             f"for {node.num_outputs} outputs")
    else:
        parts = node.num_outputs
        if dim % parts:
            raise node.error(f"cannot split a dimension of {dim} into {parts} equal parts; "
                             f"give `split`")
        sizes = [dim // parts] * parts
    if sum(sizes) != dim or any(s < 0 for s in sizes) or len(sizes) != node.num_outputs:
        raise node.error(f"split {sizes} does not cut a dimension of {dim} into "
                         f"{node.num_outputs} outputs")
    return sizes


@op("Split", since=1, static_inputs=(1,))
def split(node: Any, x: Any, split: Any = None) -> tuple:
    """Cut the input along `axis` into consecutive parts of the given lengths."""
    axis = checked_axis(node, node.attr("axis", 0), np.ndim(x))
    sizes = _split_sizes(node, np.shape(x)[axis], split)
    return tuple(array_module(x).split(x, np.cumsum(sizes)[:-1].tolist(), axis=axis))


# --- Slice --------------------------------------------------------------------------


def _axis_slice(start: int, end: int, step: int, dim: int) -> slice:
    """One axis of ONNX Slice as a Python slice: negatives count from the end, then clamp."""
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        return slice(min(max(start, 0), dim), min(max(end, 0), dim), step)
    start = min(max(start, 0), dim - 1)
    end = min(max(end, -1), dim - 1)
    return slice(start, None if end < 0 else end, step)


def _slice(node: Any, data: Any, starts: Sequence[int], ends: Sequence[int],
           axes: Sequence[int] | None, steps: Sequence[int] | None) -> Any:
    dims = np.shape(data)
    axes = list(range(len(starts))) if axes is None else unique_axes(node, axes, len(dims))
    steps = [1] * len(starts) if steps is None else steps
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise node.error(f"starts {list(starts)}, ends {list(ends)}, axes {axes} and steps "
                         f"{list(steps)} must have the same length")
    if 0 in steps:
        raise node.error("steps cannot be 0")
    index = [slice(None)] * len(dims)
    for start, end, axis, step in zip(starts, ends, axes, steps):
        index[axis] = _axis_slice(start, end, step, dims[axis])
    return data[tuple(index)]


@op("Slice", since=1)
def slice_v1(node: Any, data: Any) -> Any:
    """Slice by the `starts`, `ends` and optional `axes` attributes (step 1)."""
    return _slice(node, data, node.attr("starts"), node.attr("ends"), node.attr("axes", None), None)


@op("Slice", since=10, static_inputs=(1, 2, 3, 4))
def slice_(node: Any, data: Any, starts: Any, ends: Any, axes: Any = None, steps: Any = None) -> Any:
    """Slice by the starts/ends/axes/steps inputs; out-of-range bounds clamp, steps may be negative."""
    return _slice(node, data, host_ints(node, starts, "starts"), host_ints(node, ends, "ends"),
                  None if axes is None else host_ints(node, axes, "axes"),
                  None if steps is None else host_ints(node, steps, "steps"))


# --- Expand, Tile -------------------------------------------------------------------


@op("Expand", since=8, static_inputs=(1,))
def expand(node: Any, x: Any, shape: Any) -> Any:
    """Broadcast the input against `shape` (numpy rules; a 1 in `shape` keeps the input dim)."""
    target = shape_input(node, shape, "shape")
    try:
        out_shape = np.broadcast_shapes(np.shape(x), tuple(target))
    except ValueError:
        raise node.error(f"cannot broadcast shape {np.shape(x)} to {target}") from None
    # numpy broadcasts as a view; jax (also when folding on the host) fills the whole output.
    output_shape(node, out_shape, x.dtype, node.host and array_module(x) is jnp)
    return array_module(x).broadcast_to(x, out_shape)


def _tile(node: Any, x: Any, repeats: Sequence[int]) -> Any:
    if len(repeats) != np.ndim(x) or any(r < 0 for r in repeats):
        raise node.error(f"repeats {list(repeats)} must hold one non-negative count per "
                         f"dimension of the rank-{np.ndim(x)} input")
    output_shape(node, [d * r for d, r in zip(np.shape(x), repeats)], x.dtype, node.host)
    return array_module(x).tile(x, repeats)


@op("Tile", since=1, static_inputs=(1, 2))
def tile_v1(node: Any, x: Any, tiles: Any, axis: Any) -> Any:
    """Repeat the input `tiles` times along `axis` (both scalar inputs)."""
    (count,), (along,) = host_ints(node, tiles, "tiles"), host_ints(node, axis, "axis")
    repeats = [1] * np.ndim(x)
    repeats[checked_axis(node, along, np.ndim(x))] = count
    return _tile(node, x, repeats)


@op("Tile", since=6, static_inputs=(1,))
def tile(node: Any, x: Any, repeats: Any) -> Any:
    """Repeat the input repeats[i] times along each dimension i."""
    return _tile(node, x, host_ints(node, repeats, "repeats"))


# --- Pad ----------------------------------------------------------------------------

_PAD_MODES = {"constant", "reflect", "edge", "wrap"}


def _pad(node: Any, data: Any, pads: Sequence[int], mode: str, value: Any,
         axes: Sequence[int] | None = None) -> Any:
    """Pad (or crop, for negative amounts) `axes` by pads = [begins..., ends...]."""
    dims = np.shape(data)
    axes = list(range(len(dims))) if axes is None else unique_axes(node, axes, len(dims))
    if len(pads) != 2 * len(axes):
        raise node.error(f"pads {list(pads)} must hold a begin and an end for each of {len(axes)} axes")
    if mode not in _PAD_MODES:
        raise node.error(f"mode {mode!r} is not one of {sorted(_PAD_MODES)}")
    widths = [(0, 0)] * len(dims)
    for i, axis in enumerate(axes):
        widths[axis] = (pads[i], pads[len(axes) + i])
    if any(dim + begin + end < 0 for dim, (begin, end) in zip(dims, widths)):
        raise node.error(f"pads {list(pads)} crop more than the input shape {dims} holds")
    if mode == "constant":
        fill = jnp.zeros((), data.dtype) if value is None else jnp.asarray(value, data.dtype).reshape(())
        return lax.pad(data, fill, [(begin, end, 0) for begin, end in widths])
    cropped = data[tuple(slice(max(-begin, 0), dim - max(-end, 0))
                         for dim, (begin, end) in zip(dims, widths))]
    widths = [(max(begin, 0), max(end, 0)) for begin, end in widths]
    for dim, (begin, end) in zip(np.shape(cropped), widths):
        if dim == 0 and begin + end > 0:
            raise node.error(f"mode {mode!r} cannot pad an empty dimension")
    return jnp.pad(cropped, widths, mode=mode)


@op("Pad", since=1)
def pad_v1(node: Any, data: Any) -> Any:
    """Pad by the `paddings` attribute with `mode`; constant mode fills with `value`."""
    return _pad(node, data, node.attr("paddings"), node.attr("mode", "constant"), node.attr("value", 0.0))


@op("Pad", since=2)
def pad_v2(node: Any, data: Any) -> Any:
    """Pad by the `pads` attribute with `mode`; constant mode fills with `value`."""
    return _pad(node, data, node.attr("pads"), node.attr("mode", "constant"), node.attr("value", 0.0))


@op("Pad", since=11, static_inputs=(1, 3))
def pad(node: Any, data: Any, pads: Any, constant_value: Any = None, axes: Any = None) -> Any:
    """Pad by the `pads` input (negative crops) over `axes` (opset 18) with constant, reflect,
    edge or wrap (opset 19) `mode`; constant mode fills with `constant_value` (default 0)."""
    return _pad(node, data, host_ints(node, pads, "pads"), node.attr("mode", "constant"),
                constant_value, None if axes is None else host_ints(node, axes, "axes"))


@op("CenterCropPad", since=18, static_inputs=(1,))
def center_crop_pad(node: Any, x: Any, shape: Any) -> Any:
    """Crop or zero-pad `axes` (default all) to `shape`, keeping the input centered
    (the odd element goes to the end)."""
    target = host_ints(node, shape, "shape")
    rank = np.ndim(x)
    axes = unique_axes(node, node.attr("axes", range(rank)), rank)
    if len(target) != len(axes):
        raise node.error(f"shape {target} must give one size for each of the axes {axes}")
    pads = [0] * (2 * rank)
    for axis, size in zip(axes, target):
        change = size - np.shape(x)[axis]
        pads[axis] = change // 2 if change > 0 else -(-change // 2)
        pads[rank + axis] = change - pads[axis]
    return _pad(node, x, pads, "constant", None)


# --- Tensors built from shapes: ConstantOfShape, EyeLike, Range ---------------------------


@op("ConstantOfShape", since=9, static_inputs=(0,), differentiable=False)
def constant_of_shape(node: Any, shape: Any) -> np.ndarray:
    """A tensor of the given shape filled with the one-element `value` (default float 0)."""
    dims = shape_input(node, shape, "shape")
    value = node.attr("value", np.zeros(1, np.float32))
    if np.size(value) != 1:
        raise node.error(f"value must hold one element, not {np.size(value)}")
    return np.full(output_shape(node, dims, value.dtype, on_host=True), value.reshape(()), dtype=value.dtype)


@op("EyeLike", since=9, differentiable=False)
def eye_like(node: Any, x: Any) -> np.ndarray:
    """A 2-D tensor shaped like the input with ones on diagonal `k`; `dtype` defaults to the input's."""
    if np.ndim(x) != 2:
        raise node.error(f"input must be 2-D, got shape {np.shape(x)}")
    dtype = numpy_dtype(node.attr("dtype")) if node.has_attr("dtype") else x.dtype
    rows, columns = np.shape(x)
    return np.eye(rows, columns, k=node.attr("k", 0), dtype=dtype)


@op("Range", since=11, static_inputs=(0, 1, 2), differentiable=False)
def range_(node: Any, start: Any, limit: Any, delta: Any) -> np.ndarray:
    """start + i * delta for i in [0, max(ceil((limit - start) / delta), 0)); float16 and
    bfloat16 compute in `stash_type` (opset 27, default float)."""
    dtype = start.dtype
    compute = dtype
    if dtype in (np.dtype(np.float16), np.dtype(jnp.bfloat16)):
        compute = numpy_dtype(node.attr("stash_type", 1))
    first, stop, step = (np.asarray(v).reshape(()).astype(compute) for v in (start, limit, delta))
    if step == 0:
        raise node.error("delta cannot be 0")
    if dtype.kind in "iu":
        count = -(-(int(stop) - int(first)) // int(step))
    else:
        count = math.ceil((float(stop) - float(first)) / float(step))
    output_shape(node, [max(count, 0)], compute, on_host=True)
    return (first + np.arange(max(count, 0), dtype=compute) * step).astype(dtype)


# --- Block rearrangements: DepthToSpace, SpaceToDepth -----------------------------------


def _blocks(node: Any, x: Any) -> tuple[int, int, int, int, int]:
    """(batch, channels, height, width, blocksize) of a 4-D NCHW input."""
    if np.ndim(x) != 4:
        raise node.error(f"input must be 4-D (N, C, H, W), got shape {np.shape(x)}")
    block = node.attr("blocksize")
    if block <= 0:
        raise node.error(f"blocksize must be positive, got {block}")
    return (*np.shape(x), block)


def _block_mode(node: Any) -> str:
    mode = node.attr("mode", "DCR")
    if mode not in ("DCR", "CRD"):
        raise node.error(f"mode {mode!r} is not 'DCR' or 'CRD'")
    return mode


@op("DepthToSpace", since=1)
def depth_to_space(node: Any, x: Any) -> Any:
    """Move channel blocks into blocksize x blocksize spatial tiles; channels ordered
    depth-column-row (DCR) or column-row-depth (CRD)."""
    n, c, h, w, b = _blocks(node, x)
    if c % (b * b):
        raise node.error(f"channels {c} are not a multiple of blocksize^2 = {b * b}")
    depth = c // (b * b)
    if _block_mode(node) == "DCR":
        blocks = jnp.reshape(x, (n, b, b, depth, h, w)).transpose(0, 3, 4, 1, 5, 2)
    else:
        blocks = jnp.reshape(x, (n, depth, b, b, h, w)).transpose(0, 1, 4, 2, 5, 3)
    return blocks.reshape(n, depth, h * b, w * b)


@op("SpaceToDepth", since=1)
def space_to_depth(node: Any, x: Any) -> Any:
    """Move blocksize x blocksize spatial tiles into channels; the inverse of DepthToSpace
    in `mode` (opset 28, default DCR)."""
    n, c, h, w, b = _blocks(node, x)
    if h % b or w % b:
        raise node.error(f"height {h} and width {w} must be multiples of blocksize {b}")
    tiles = jnp.reshape(x, (n, c, h // b, b, w // b, b))
    if _block_mode(node) == "DCR":
        tiles = tiles.transpose(0, 3, 5, 1, 2, 4)
    else:
        tiles = tiles.transpose(0, 1, 3, 5, 2, 4)
    return tiles.reshape(n, c * b * b, h // b, w // b)

