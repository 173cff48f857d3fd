"""Image sampling: Resize, Upsample, GridSample, AffineGrid, RoiAlign, NonMaxSuppression.

Resize is separable: each resized axis gets, on the host, the input index and weight
of every tap of every output position; the device work is one gather and a weighted
sum per axis. GridSample and RoiAlign sample at traced coordinates with gathers, so
they stay differentiable in both the image and the coordinates.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from onnxtrain.translate.ops.common import host_ints, normalize_axes
from onnxtrain.translate.registry import op
from onnxtrain.translate.values import NeedsHostValues, known_value

# ---------------------------------------------------------------------------
# Resize: coordinates, taps and the per-axis resampling


@dataclass(frozen=True)
class ResizeAxis:
    """One resized axis: sizes, the scale used in coordinate maps, and its roi slice."""

    size: int
    output: int
    scale: float
    roi: tuple[float, float] = (0.0, 1.0)

    def is_identity(self) -> bool:
        return self.output == self.size and self.scale == 1.0 and self.roi == (0.0, 1.0)


def source_coordinates(mode: str, axis: ResizeAxis) -> np.ndarray:
    """Where each output position samples the input, per coordinate_transformation_mode.

    length_resized is size * scale, fractional when the output size came from a scale.
    """
    y = np.arange(axis.output, dtype=np.float64)
    size, scale = axis.size, axis.scale
    resized = size * scale
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        offset = size / 2 * (1 - axis.output / resized)
        return offset + (y + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (y + 0.5) / scale - 0.5 if resized > 1 else np.zeros(axis.output)
    if mode == "align_corners":
        return y * (size - 1) / (resized - 1) if resized != 1 else np.zeros(axis.output)
    if mode == "asymmetric":
        return y / scale
    if mode == "tf_half_pixel_for_nn":
        return (y + 0.5) / scale
    if mode == "tf_crop_and_resize":
        start, end = axis.roi
        if resized != 1:
            return start * (size - 1) + y * (end - start) * (size - 1) / (resized - 1)
        return np.full(axis.output, 0.5 * (start + end) * (size - 1))
    raise ValueError(mode)


COORDINATE_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
                    "asymmetric", "tf_half_pixel_for_nn", "tf_crop_and_resize")

NEAREST_ROUNDING: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "round_prefer_floor": lambda x: np.ceil(x - 0.5),
    "round_prefer_ceil": lambda x: np.floor(x + 0.5),
    "floor": np.floor,
    "ceil": np.ceil,
}


def linear_kernel(t: np.ndarray) -> np.ndarray:
    return np.maximum(0.0, 1.0 - np.abs(t))


def cubic_kernel(a: float) -> Callable[[np.ndarray], np.ndarray]:
    """Keys' cubic convolution kernel with coefficient a (support 2)."""

    def kernel(t: np.ndarray) -> np.ndarray:
        t = np.abs(t)
        near = ((a + 2) * t - (a + 3)) * t * t + 1
        far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
        return np.where(t <= 1, near, np.where(t < 2, far, 0.0))

    return kernel


@dataclass(frozen=True)
class Interpolation:
    """How Resize turns a source coordinate into taps: mode and its attributes."""

    mode: str
    nearest_mode: str = "round_prefer_floor"
    cubic_a: float = -0.75
    exclude_outside: bool = False
    antialias: bool = False

    def taps(self, x: np.ndarray, size: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
        """Input indices (clamped to the edge) and weights, both (outputs, taps)."""
        if self.mode == "nearest":
            index = NEAREST_ROUNDING[self.nearest_mode](x)[:, None]
            return np.clip(index, 0, size - 1).astype(np.int64), np.ones_like(index)
        kernel, support = (linear_kernel, 1) if self.mode == "linear" else (cubic_kernel(self.cubic_a), 2)
        stretch = min(scale, 1.0) if self.antialias else 1.0
        reach = math.ceil(support / stretch)
        index = np.floor(x)[:, None] + np.arange(1 - reach, reach + 1)[None, :]
        weights = kernel(stretch * (index - x[:, None]))
        if self.exclude_outside:
            weights = np.where((index < 0) | (index > size - 1), 0.0, weights)
        if self.exclude_outside or self.antialias:
            total = weights.sum(axis=1, keepdims=True)
            weights = weights / np.where(total == 0, 1.0, total)
        return np.clip(index, 0, size - 1).astype(np.int64), weights


def resample_axis(x: Any, axis: int, index: np.ndarray, weights: np.ndarray, exact: bool) -> Any:
    """Along `axis`, output o = sum_t weights[o, t] * x[index[o, t]]."""
    outputs, taps = index.shape
    gathered = jnp.take(x, index.reshape(-1), axis=axis)
    if exact:
        return gathered
    gathered = jnp.reshape(gathered, x.shape[:axis] + (outputs, taps) + x.shape[axis + 1:])
    shape = (outputs, taps) + (1,) * (x.ndim - axis - 1)
    return jnp.sum(gathered * weights.reshape(shape).astype(x.dtype), axis=axis + 1)


def compute_dtype(dtype: Any) -> Any:
    """Interpolation runs in float64 for float64 and integers, float32 for the rest."""
    dtype = np.dtype(dtype)
    if dtype == np.float64 or not jnp.issubdtype(dtype, jnp.floating):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def back_to(dtype: Any, y: Any) -> Any:
    """Cast an interpolated float result to the input dtype (integers rounded and saturated)."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        info = np.iinfo(dtype)
        y = jnp.clip(jnp.round(y), info.min, info.max)
    return y.astype(dtype)


def resize_axes(x: Any, axes: dict[int, ResizeAxis], interpolation: Interpolation,
                coordinate_mode: str, extrapolation: float | None) -> Any:
    """Resample every non-identity axis; tf_crop_and_resize fills outside samples with `extrapolation`."""
    exact = interpolation.mode == "nearest"
    y = x if exact else jnp.asarray(x).astype(compute_dtype(x.dtype))
    outside = np.zeros((), bool)
    for axis, spec in axes.items():
        if spec.is_identity():
            continue
        coordinates = source_coordinates(coordinate_mode, spec)
        index, weights = interpolation.taps(coordinates, spec.size, spec.scale)
        y = resample_axis(y, axis, index, weights, exact)
        if extrapolation is not None:
            shape = [1] * x.ndim
            shape[axis] = spec.output
            outside = outside | ((coordinates < 0) | (coordinates > spec.size - 1)).reshape(shape)
    if outside.any():
        y = jnp.where(outside, np.array(extrapolation, y.dtype), y)
    return y if exact else back_to(x.dtype, y)


# ---------------------------------------------------------------------------
# Resize: sizes and scales


def axes_from_scales(shape: Sequence[int], axes: Sequence[int], scales: Sequence[float],
                     rois: Sequence[tuple[float, float]]) -> dict[int, ResizeAxis]:
    """Output size floor(size * scale) per axis; the scale itself maps coordinates."""
    return {axis: ResizeAxis(shape[axis], int(math.floor(shape[axis] * scale)), scale, roi)
            for axis, scale, roi in zip(axes, scales, rois)}


def axes_from_sizes(shape: Sequence[int], axes: Sequence[int], sizes: Sequence[int],
                    rois: Sequence[tuple[float, float]], policy: str) -> dict[int, ResizeAxis]:
    """Scales output/input per axis, or one common scale under keep_aspect_ratio_policy."""
    scales = [size / shape[axis] for axis, size in zip(axes, sizes)]
    if policy == "stretch":
        return {axis: ResizeAxis(shape[axis], size, scale, roi)
                for axis, size, scale, roi in zip(axes, sizes, scales, rois)}
    scale = min(scales) if policy == "not_larger" else max(scales)
    return {axis: ResizeAxis(shape[axis], int(scale * shape[axis] + 0.5), scale, roi)
            for axis, roi in zip(axes, rois)}


def float_list(value: Any) -> list[float]:
    return [float(v) for v in np.asarray(value, np.float64).reshape(-1)]


def present(value: Any) -> bool:
    """An optional tensor input that is given and not empty."""
    return value is not None and np.size(value) > 0


def read_choice(node: Any, name: str, default: str, choices: Sequence[str]) -> str:
    value = node.attr(name, default)
    if value not in choices:
        raise node.error(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def resize_plan(node: Any, x: Any, roi: Any, scales: Any, sizes: Any) -> dict[int, ResizeAxis]:
    """Which axes Resize changes, to what sizes, with which scales and roi slices."""
    rank = x.ndim
    axes = normalize_axes(node.attr("axes", None) or range(rank), rank)
    if sorted(set(axes)) != sorted(axes) or any(not 0 <= a < rank for a in axes):
        raise node.error(f"axes must be distinct axes of the rank-{rank} input, got {node.attr('axes')}")
    rois = [(0.0, 1.0)] * len(axes)
    if present(roi):
        values = float_list(roi)
        if len(values) != 2 * len(axes):
            raise node.error(f"roi has {len(values)} values; {2 * len(axes)} expected "
                             f"(start and end per axis)")
        rois = list(zip(values[:len(axes)], values[len(axes):]))
    if present(scales) == present(sizes):
        raise node.error("exactly one of scales and sizes must be given")
    if present(sizes):
        targets = host_ints(node, sizes, "sizes")
        if len(targets) != len(axes) or min(targets) < 0:
            raise node.error(f"sizes {targets} must give one non-negative size per resized axis "
                             f"({len(axes)})")
        policy = read_choice(node, "keep_aspect_ratio_policy", "stretch",
                             ("stretch", "not_larger", "not_smaller"))
        return axes_from_sizes(x.shape, axes, targets, rois, policy)
    factors = [float(v) for v in np.asarray(scales).reshape(-1)]
    if len(factors) != len(axes) or min(factors) <= 0:
        raise node.error(f"scales {factors} must give one positive scale per resized axis ({len(axes)})")
    return axes_from_scales(x.shape, axes, factors, rois)


def interpolation_of(node: Any) -> Interpolation:
    """Resize's interpolation attributes; antialias only affects linear and cubic."""
    mode = read_choice(node, "mode", "nearest", ("nearest", "linear", "cubic"))
    return Interpolation(
        mode=mode,
        nearest_mode=read_choice(node, "nearest_mode", "round_prefer_floor", tuple(NEAREST_ROUNDING)),
        cubic_a=float(node.attr("cubic_coeff_a", -0.75)),
        exclude_outside=bool(node.attr("exclude_outside", 0)),
        antialias=bool(node.attr("antialias", 0)) and mode != "nearest",
    )


@op("Resize", since=11, static_inputs=(1, 2, 3))
def resize(node: Any, x: Any, roi: Any = None, scales: Any = None, sizes: Any = None) -> Any:
    """Resample X to sizes (or size * scales) with nearest, linear or cubic interpolation."""
    coordinate_mode = read_choice(node, "coordinate_transformation_mode", "half_pixel", COORDINATE_MODES)
    interpolation = interpolation_of(node)
    plan = resize_plan(node, x, roi, scales, sizes)
    extrapolation = (float(node.attr("extrapolation_value", 0.0))
                     if coordinate_mode == "tf_crop_and_resize" else None)
    return resize_axes(x, plan, interpolation, coordinate_mode, extrapolation)


def legacy_upsample(node: Any, x: Any, scales: Sequence[float], mode: str) -> Any:
    """Upsample and Resize-10: floor(size * scale) outputs, asymmetric coordinates.

    Nearest picks floor(x) when the axis grows and ceil(x) when it shrinks, as
    onnxruntime does for these versions; linear clamps at the edges.
    """
    if len(scales) != x.ndim or min(scales) <= 0:
        raise node.error(f"scales {list(scales)} must give one positive scale per axis of the "
                         f"rank-{x.ndim} input")
    if node.op_type == "Upsample" and min(scales) < 1:
        raise node.error(f"Upsample scales must be >= 1, got {list(scales)}; use Resize to shrink")
    plan = axes_from_scales(x.shape, range(x.ndim), scales, [(0.0, 1.0)] * x.ndim)
    exact = mode == "nearest"
    y = x if exact else jnp.asarray(x).astype(compute_dtype(x.dtype))
    for axis, spec in plan.items():
        if spec.is_identity():
            continue
        rounding = "floor" if spec.scale >= 1 else "ceil"
        interpolation = Interpolation(mode, nearest_mode=rounding)
        index, weights = interpolation.taps(source_coordinates("asymmetric", spec), spec.size, spec.scale)
        y = resample_axis(y, axis, index, weights, exact)
    return y if exact else back_to(x.dtype, y)


@op("Resize", since=10, static_inputs=(1,))
def resize_10(node: Any, x: Any, scales: Any) -> Any:
    """Resize-10: nearest or linear resampling by scales, asymmetric coordinates."""
    mode = read_choice(node, "mode", "nearest", ("nearest", "linear"))
    return legacy_upsample(node, x, float_list(scales), mode)


@op("Upsample", since=9, static_inputs=(1,))
def upsample_9(node: Any, x: Any, scales: Any) -> Any:
    """Upsample by the scales input (nearest or linear, asymmetric coordinates)."""
    mode = read_choice(node, "mode", "nearest", ("nearest", "linear"))
    return legacy_upsample(node, x, float_list(scales), mode)


@op("Upsample", since=7)
def upsample_7(node: Any, x: Any) -> Any:
    """Upsample by the scales attribute (nearest or linear, asymmetric coordinates)."""
    mode = read_choice(node, "mode", "nearest", ("nearest", "linear"))
    return legacy_upsample(node, x, [float(s) for s in node.attr("scales")], mode)


@op("Upsample", since=1)
def upsample_1(node: Any, x: Any) -> Any:
    """Upsample-1: a 4-D input scaled by height_scale and width_scale (nearest or bilinear)."""
    if x.ndim != 4:
        raise node.error(f"Upsample-1 takes a 4-D input, got rank {x.ndim}")
    mode = read_choice(node, "mode", "nearest", ("nearest", "bilinear"))
    scales = [1.0, 1.0, float(node.attr("height_scale")), float(node.attr("width_scale"))]
    return legacy_upsample(node, x, scales, "nearest" if mode == "nearest" else "linear")


# ---------------------------------------------------------------------------
# GridSample and AffineGrid


def reflect(x: Any, low: float, high: float) -> Any:
    """Fold coordinates into [low, high] by mirroring at the borders, repeatedly."""
    span = high - low
    if span <= 0:
        return jnp.full_like(x, low)
    below = low - x
    above = x - high
    folds_below = jnp.floor(below / span)
    folds_above = jnp.floor(above / span)
    rest_below = below - folds_below * span
    rest_above = above - folds_above * span
    from_below = jnp.where(folds_below % 2 == 0, low + rest_below, high - rest_below)
    from_above = jnp.where(folds_above % 2 == 0, high - rest_above, low + rest_above)
    return jnp.where(x < low, from_below, jnp.where(x > high, from_above, x))


@dataclass(frozen=True)
class GridAxis:
    """One spatial axis GridSample reads: its size, borders and padding mode."""

    size: int
    align_corners: bool
    padding: str

    @property
    def borders(self) -> tuple[float, float]:
        if self.align_corners:
            return 0.0, self.size - 1.0
        return -0.5, self.size - 0.5

    def unnormalize(self, g: Any) -> Any:
        """[-1, 1] grid values to pixel coordinates."""
        if self.align_corners:
            return (g + 1) / 2 * (self.size - 1)
        return ((g + 1) * self.size - 1) / 2

    def fold(self, x: Any) -> Any:
        """Coordinates outside the borders, moved inside for border/reflection padding."""
        low, high = self.borders
        if self.padding == "border":
            return jnp.where((x < low) | (x > high), jnp.clip(x, 0, self.size - 1), x)
        if self.padding == "reflection":
            return reflect(x, low, high)
        return x

    def fetch(self, index: Any) -> tuple[Any, Any]:
        """Integer tap positions as valid indices, and whether each reads real data (zeros padding)."""
        if self.padding == "zeros":
            inside = (index >= 0) & (index <= self.size - 1)
            return jnp.clip(index, 0, self.size - 1).astype(jnp.int32), inside
        if self.padding == "reflection":
            low, high = self.borders
            index = jnp.trunc(reflect(index, low, high))
        return jnp.clip(index, 0, self.size - 1).astype(jnp.int32), None


def cubic_weights(fraction: Any, a: float = -0.75) -> list:
    """Keys cubic weights of the taps at -1, 0, 1, 2 from floor(x) (distances within [0, 2])."""

    def kernel(t: Any) -> Any:
        return jnp.where(t <= 1, ((a + 2) * t - (a + 3)) * t * t + 1,
                         ((a * t - 5 * a) * t + 8 * a) * t - 4 * a)

    return [kernel(fraction + 1), kernel(fraction), kernel(1 - fraction), kernel(2 - fraction)]


def grid_taps(axis: GridAxis, mode: str, x: Any) -> list[tuple[Any, Any]]:
    """(integer position, weight) of every tap along one axis, for coordinates x."""
    if mode == "nearest":
        return [(axis.fold(jnp.round(x)), None)]
    x = axis.fold(x)
    low = jnp.floor(x)
    fraction = x - low
    if mode == "linear":
        return [(low, 1 - fraction), (low + 1, fraction)]
    return [(low + offset, weight) for offset, weight in zip((-1, 0, 1, 2), cubic_weights(fraction))]


GRID_MODES = {16: ("bilinear", "nearest", "bicubic"), 20: ("linear", "nearest", "cubic")}
GRID_MODE_NAMES = {"bilinear": "linear", "bicubic": "cubic"}


@op("GridSample", since=16)
@op("GridSample", since=20)
def grid_sample(node: Any, x: Any, grid: Any) -> Any:
    """Sample X (N, C, *S) at the normalized grid (N, *O, len(S)) points; output (N, C, *O)."""
    modes = GRID_MODES[20 if node.opset >= 20 else 16]
    mode = read_choice(node, "mode", modes[0], modes)
    mode = GRID_MODE_NAMES.get(mode, mode)
    padding = read_choice(node, "padding_mode", "zeros", ("zeros", "border", "reflection"))
    align_corners = bool(node.attr("align_corners", 0))
    batch, channels, *sizes = x.shape
    rank = len(sizes)
    if node.opset < 20 and rank != 2:
        raise node.error(f"GridSample-16 takes 4-D inputs; got rank {x.ndim} (opset 20 allows N-D)")
    if grid.shape[0] != batch or grid.shape[-1] != rank:
        raise node.error(f"grid shape {grid.shape} does not match X {x.shape}: "
                         f"(N, *outputs, {rank}) expected")
    outputs = grid.shape[1:-1]
    points = jnp.reshape(grid, (batch, -1, rank))
    axes = [GridAxis(size, align_corners, padding) for size in sizes]
    per_axis = [grid_taps(axis, mode, axis.unnormalize(points[..., rank - 1 - i]))
                for i, axis in enumerate(axes)]
    exact = mode == "nearest"
    values_dtype = x.dtype if exact else compute_dtype(x.dtype)
    planes = jnp.reshape(jnp.asarray(x).astype(values_dtype), (batch, channels, -1))
    y = 0
    for combination in itertools.product(*per_axis):
        flat, weight = 0, jnp.ones(points.shape[:2], points.dtype)
        for axis, (position, tap_weight) in zip(axes, combination):
            index, inside = axis.fetch(position)
            flat = flat * axis.size + index
            if tap_weight is not None:
                weight = weight * tap_weight
            if inside is not None:
                weight = jnp.where(inside, weight, 0)
        values = jnp.take_along_axis(planes, flat[:, None, :], axis=2)
        if exact:
            y = y + jnp.where(weight[:, None, :] > 0, values, np.zeros((), values.dtype))
        else:
            y = y + values * weight[:, None, :].astype(values.dtype)
    y = jnp.reshape(y, (batch, channels) + tuple(outputs))
    return y if exact else back_to(x.dtype, y)


def base_grid(sizes: Sequence[int], align_corners: bool) -> np.ndarray:
    """Normalized pixel centers (or corners) as homogeneous points (*sizes, rank + 1), x first."""
    axes = []
    for size in sizes:
        index = np.arange(size, dtype=np.float64)
        if align_corners:
            axes.append(-1 + 2 * index / (size - 1) if size > 1 else np.full(size, -1.0))
        else:
            axes.append((2 * index + 1) / size - 1)
    mesh = np.meshgrid(*axes, indexing="ij")
    return np.stack([*mesh[::-1], np.ones(tuple(sizes))], axis=-1)


@op("AffineGrid", since=20, static_inputs=(1,))
def affine_grid(node: Any, theta: Any, size: Any) -> Any:
    """The sampling grid of affine maps theta (N, r, r+1) over size (N, C, *spatial[r])."""
    shape = host_ints(node, size, "size")
    spatial = shape[2:]
    rank = len(spatial)
    if rank not in (2, 3) or theta.shape != (shape[0], rank, rank + 1):
        raise node.error(f"theta {theta.shape} and size {shape} do not match: (N, 2, 3) with "
                         f"(N, C, H, W) or (N, 3, 4) with (N, C, D, H, W) expected")
    points = base_grid(spatial, bool(node.attr("align_corners", 0))).reshape(-1, rank + 1)
    grid = jnp.einsum("pk,nik->npi", points.astype(theta.dtype), theta)
    return jnp.reshape(grid, (shape[0],) + tuple(spatial) + (rank,))


# ---------------------------------------------------------------------------
# RoiAlign


@dataclass(frozen=True)
class RoiTaps:
    """Bilinear taps of RoiAlign's sample points along one axis, shaped (R, bins, slots),
    and which sample slots each roi uses (R, 1, slots)."""

    low: Any
    high: Any
    low_weight: Any
    high_weight: Any
    used: np.ndarray

    def pairs(self) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
        """(index, weight) of the low and the high tap."""
        return (self.low, self.low_weight), (self.high, self.high_weight)


def roi_axis_taps(start: Any, length: Any, bins: int, samples: np.ndarray, size: int) -> RoiTaps:
    """Every roi takes samples[r] evenly spaced points per bin; points more than one
    pixel outside weigh nothing, points past the last pixel read the last pixel."""
    most = int(samples.max(initial=1))
    slot = np.arange(most)
    bin_size = (length / bins)[:, None, None]
    point = (start[:, None, None] + np.arange(bins)[None, :, None] * bin_size
             + (slot[None, None, :] + 0.5) * bin_size / samples[:, None, None])
    valid = (point >= -1.0) & (point <= size)
    point = jnp.maximum(point, 0)
    low = jnp.minimum(jnp.floor(point), size - 1)
    at_edge = low >= size - 1
    high = jnp.where(at_edge, low, low + 1)
    fraction = jnp.where(at_edge, 0, point - low)
    used = (slot[None, :] < samples[:, None])[:, None, :]
    return RoiTaps(low.astype(jnp.int32), high.astype(jnp.int32), jnp.where(valid, 1 - fraction, 0),
                   jnp.where(valid, fraction, 0), used)


def roi_geometry(node: Any, rois: Any, half_pixel: bool, bins: Sequence[int]) -> tuple:
    """Per axis (y, x): roi starts, lengths and samples per bin.

    With sampling_ratio 0 the sample count is ceil(length / bins) per roi, so
    the rois must be host values then.
    """
    ratio = node.attr("sampling_ratio", 0)
    known = known_value(rois)
    rois, xp = (known, np) if known is not None else (rois, jnp)
    if ratio <= 0 and xp is jnp:
        raise NeedsHostValues(node.label, "with sampling_ratio 0 samples each roi adaptively, "
                                          "which needs the roi coordinates known")
    boxes = rois * node.attr("spatial_scale", 1.0) - (0.5 if half_pixel else 0.0)
    starts = [boxes[:, 1], boxes[:, 0]]
    lengths = [boxes[:, 3] - boxes[:, 1], boxes[:, 2] - boxes[:, 0]]
    if not half_pixel:
        lengths = [xp.maximum(length, 1.0) for length in lengths]
    if ratio > 0:
        samples = [np.full(len(rois), ratio, np.int64)] * 2
    else:
        samples = [np.maximum(np.ceil(length / n), 1).astype(np.int64)
                   for length, n in zip(lengths, bins)]
    return starts, lengths, samples


@op("RoiAlign", since=10)
@op("RoiAlign", since=16)
def roi_align(node: Any, x: Any, rois: Any, batch_indices: Any) -> Any:
    """Average (or max) of bilinear samples in each bin of each roi (x1, y1, x2, y2) of X[batch]."""
    mode = read_choice(node, "mode", "avg", ("avg", "max"))
    transform = read_choice(node, "coordinate_transformation_mode", "half_pixel",
                            ("half_pixel", "output_half_pixel"))
    half_pixel = node.opset >= 16 and transform == "half_pixel"
    bins = (node.attr("output_height", 1), node.attr("output_width", 1))
    if x.ndim != 4 or rois.ndim != 2 or rois.shape[1] != 4 or batch_indices.shape != rois.shape[:1]:
        raise node.error(f"expected X (N, C, H, W), rois (R, 4) and batch_indices (R,); got "
                         f"{x.shape}, {rois.shape}, {batch_indices.shape}")
    count, channels, height, width = len(rois), x.shape[1], x.shape[2], x.shape[3]
    starts, lengths, samples = roi_geometry(node, rois, half_pixel, bins)
    rows = roi_axis_taps(starts[0], lengths[0], bins[0], samples[0], height)
    columns = roi_axis_taps(starts[1], lengths[1], bins[1], samples[1], width)
    images = jnp.asarray(x)[jnp.asarray(batch_indices).astype(jnp.int32)]
    planes = jnp.reshape(images, (count, channels, -1))
    corners = []
    for row, row_weight in rows.pairs():
        for column, column_weight in columns.pairs():
            index = row[:, :, :, None, None] * width + column[:, None, None, :, :]
            weight = row_weight[:, :, :, None, None] * column_weight[:, None, None, :, :]
            values = jnp.take_along_axis(planes, jnp.reshape(index, (count, 1, -1)), axis=2)
            values = jnp.reshape(values, (count, channels) + index.shape[1:])
            corners.append(values * weight[:, None].astype(values.dtype))
    used = (rows.used[:, :, :, None, None] & columns.used[:, None, None, :, :])[:, None]
    if mode == "avg":
        total = jnp.sum(jnp.where(used, sum(corners), 0), axis=(3, 5))
        per_bin = (samples[0] * samples[1]).reshape(-1, 1, 1, 1)
        return (total / per_bin.astype(total.dtype)).astype(x.dtype)
    best = jnp.max(jnp.stack(corners), axis=0)
    return jnp.max(jnp.where(used, best, np.array(-np.inf, best.dtype)), axis=(3, 5)).astype(x.dtype)


# ---------------------------------------------------------------------------
# NonMaxSuppression (host only: the number of selected boxes depends on the data)


def corner_boxes(boxes: np.ndarray, center_point_box: int) -> np.ndarray:
    """Boxes as (y_min, x_min, y_max, x_max) from corners in any order or (x, y, w, h) centers."""
    if center_point_box:
        x, y, w, h = np.moveaxis(boxes, -1, 0)
        return np.stack([y - h / 2, x - w / 2, y + h / 2, x + w / 2], axis=-1)
    y1, x1, y2, x2 = np.moveaxis(boxes, -1, 0)
    return np.stack([np.minimum(y1, y2), np.minimum(x1, x2), np.maximum(y1, y2), np.maximum(x1, x2)], axis=-1)


def overlaps(box: np.ndarray, others: np.ndarray, threshold: Any) -> np.ndarray:
    """Whether each of `others` has IoU with `box` strictly above threshold."""
    top = np.maximum(box[0], others[:, 0])
    left = np.maximum(box[1], others[:, 1])
    bottom = np.minimum(box[2], others[:, 2])
    right = np.minimum(box[3], others[:, 3])
    intersection = np.where((bottom > top) & (right > left), (bottom - top) * (right - left), 0)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
    union = area + areas - intersection
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = np.where((intersection > 0) & (area > 0) & (areas > 0) & (union > 0), intersection / union, 0)
    return iou > threshold


def select_boxes(boxes: np.ndarray, scores: np.ndarray, limit: int, iou_threshold: Any,
                 score_threshold: Any) -> list[int]:
    """Greedy NMS of one class: best score first (lower index on ties), at most `limit`."""
    order = np.lexsort((np.arange(len(scores)), -scores))
    if score_threshold is not None:
        order = order[scores[order] > score_threshold]
    selected: list[int] = []
    for index in order:
        if len(selected) >= limit:
            break
        if not selected or not overlaps(boxes[index], boxes[selected], iou_threshold).any():
            selected.append(int(index))
    return selected


def scalar_input(value: Any, default: Any) -> Any:
    return np.asarray(value).reshape(-1)[0] if present(value) else default


@op("NonMaxSuppression", since=10, differentiable=False)
def non_max_suppression(node: Any, boxes: Any, scores: Any, max_output_boxes_per_class: Any = None,
                        iou_threshold: Any = None, score_threshold: Any = None) -> Any:
    """Per batch and class, greedily keep the best-scoring boxes that overlap no kept box;
    returns (selected, 3) int64 rows [batch, class, box]."""
    if not node.host:
        raise NeedsHostValues(node.label, "returns a number of boxes that depends on the data")
    center_point_box = node.attr("center_point_box", 0)
    if center_point_box not in (0, 1):
        raise node.error(f"center_point_box must be 0 or 1, got {center_point_box}")
    if boxes.ndim != 3 or boxes.shape[2] != 4 or scores.ndim != 3 or scores.shape[::2] != boxes.shape[:2]:
        raise node.error(f"expected boxes (B, N, 4) and scores (B, C, N); got {boxes.shape} and "
                         f"{scores.shape}")
    limit = max(int(scalar_input(max_output_boxes_per_class, 0)), 0)
    iou = scalar_input(iou_threshold, np.float32(0))
    threshold = scalar_input(score_threshold, None)
    corners = corner_boxes(np.asarray(boxes), center_point_box)
    rows = [(batch, label, box)
            for batch in range(scores.shape[0]) for label in range(scores.shape[1])
            for box in select_boxes(corners[batch], np.asarray(scores[batch, label]), limit, iou, threshold)]
    return np.array(rows, np.int64).reshape(-1, 3)
