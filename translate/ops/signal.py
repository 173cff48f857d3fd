"""Signal processing: window functions, DFT, STFT and MelWeightMatrix.

ONNX carries complex values as a trailing dimension of size 2 (real, imaginary)
and real signals as a trailing dimension of size 1. The transforms convert to
JAX complex arrays, run jnp.fft, and convert back to that layout in the input's
dtype; float16/bfloat16 signals are transformed in float32. Real signals go
through rfft (the full spectrum follows by Hermitian symmetry), which is both
cheaper and exact where a complex FFT would leave round-off in empty bins.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from onnxtrain.translate.ops.common import host_ints, normalize_axis, numpy_dtype
from onnxtrain.translate.registry import op

_FLOAT = 1  # TensorProto.FLOAT, the default output_datatype


# --- windows -------------------------------------------------------------------------


def _window_phase(node: Any, size: Any) -> tuple[jax.Array, bool]:
    """2*pi*n/N for n in [0, size), N = size (periodic) or size - 1 (symmetric).

    The second value is True for a one-point symmetric window, whose N is 0.
    """
    (length,) = host_ints(node, size, "window size")
    if length < 0:
        raise node.error(f"window size must be >= 0, got {length}")
    denominator = length if node.attr("periodic", 1) else length - 1
    n = jnp.arange(length, dtype=jnp.float64)
    return 2 * jnp.pi * n / max(denominator, 1), denominator == 0


def _window(node: Any, size: Any, coefficients: tuple[float, ...]) -> jax.Array:
    """sum_k (-1)^k a_k cos(k * phase), the generalized cosine window, in output_datatype."""
    phase, single_point = _window_phase(node, size)
    window = sum((-1) ** k * a * jnp.cos(k * phase) for k, a in enumerate(coefficients))
    if single_point:
        window = jnp.ones_like(phase)
    return window.astype(numpy_dtype(node.attr("output_datatype", _FLOAT)))


@op("HannWindow", since=17, static_inputs=(0,))
def hann_window(node: Any, size: Any) -> jax.Array:
    """w[n] = 0.5 - 0.5 cos(2 pi n / N); N = size (periodic=1) or size - 1."""
    return _window(node, size, (0.5, 0.5))


@op("HammingWindow", since=17, static_inputs=(0,))
def hamming_window(node: Any, size: Any) -> jax.Array:
    """w[n] = 25/46 - 21/46 cos(2 pi n / N); N = size (periodic=1) or size - 1."""
    return _window(node, size, (25 / 46, 21 / 46))


@op("BlackmanWindow", since=17, static_inputs=(0,))
def blackman_window(node: Any, size: Any) -> jax.Array:
    """w[n] = 0.42 - 0.5 cos(2 pi n / N) + 0.08 cos(4 pi n / N); N = size or size - 1."""
    return _window(node, size, (0.42, 0.5, 0.08))


# --- DFT / STFT ----------------------------------------------------------------------


def _compute_dtype(dtype: Any) -> Any:
    """The real dtype a transform runs in: float32 for 16-bit floats, else the input's."""
    return jnp.promote_types(dtype, jnp.float32)


def _real_fft(signal: jax.Array, n: int, axis: int) -> jax.Array:
    """The full spectrum of a real signal: rfft plus the conjugate mirror of bins 1..L-L//2-1."""
    half = jnp.fft.rfft(signal, n=n, axis=axis)
    mirrored = jnp.flip(jax.lax.slice_in_dim(half, 1, n - n // 2, axis=axis), axis)
    return jnp.concatenate([half, jnp.conj(mirrored)], axis=axis)


def _as_complex(node: Any, x: Any) -> tuple[jax.Array, bool]:
    """The [..., 1] or [..., 2] ONNX layout as a JAX array, and whether it was real."""
    parts = np.shape(x)[-1] if np.ndim(x) else 0
    if parts not in (1, 2):
        raise node.error(f"the last dimension must be 1 (real) or 2 (complex), got shape "
                         f"{np.shape(x)}")
    x = jnp.asarray(x).astype(_compute_dtype(x.dtype))
    if parts == 1:
        return x[..., 0], True
    return jax.lax.complex(x[..., 0], x[..., 1]), False


def _complex_layout(values: jax.Array, dtype: Any) -> jax.Array:
    """A complex JAX array in the ONNX [..., 2] layout."""
    return jnp.stack([jnp.real(values), jnp.imag(values)], axis=-1).astype(dtype)


def _transform(signal: jax.Array, is_real: bool, length: int, axis: int,
               inverse: bool, onesided: bool) -> tuple[jax.Array, bool]:
    """The transform along `axis`; returns the result and whether it is real-valued."""
    if inverse and onesided:
        return jnp.fft.irfft(signal, n=length, axis=axis), True
    if inverse:
        return jnp.fft.ifft(signal, n=length, axis=axis), False
    if is_real:
        spectrum = jnp.fft.rfft if onesided else _real_fft
        return spectrum(signal, n=length, axis=axis), False
    spectrum = jnp.fft.fft(signal, n=length, axis=axis)
    if onesided:
        spectrum = jax.lax.slice_in_dim(spectrum, 0, length // 2 + 1, axis=axis)
    return spectrum, False


def _dft(node: Any, x: Any, dft_length: Any, axis: int) -> jax.Array:
    rank = np.ndim(x)
    if not -rank <= axis <= rank - 2 or axis == -1:
        raise node.error(f"axis {axis} is out of range for an input of rank {rank} (the last "
                         f"dimension holds real/imaginary parts)")
    axis = normalize_axis(axis, rank)
    inverse = bool(node.attr("inverse", 0))
    onesided = bool(node.attr("onesided", 0))
    if dft_length is None:
        signal_length = np.shape(x)[axis]
        length = 2 * (signal_length - 1) if inverse and onesided else signal_length
    else:
        (length,) = host_ints(node, dft_length, "dft_length")
    if length < 1:
        raise node.error(f"dft_length must be >= 1, got {length}")
    signal, is_real = _as_complex(node, x)
    result, real_result = _transform(signal, is_real, length, axis, inverse, onesided)
    if real_result:
        return result[..., None].astype(x.dtype)
    return _complex_layout(result, x.dtype)


@op("DFT", since=17, static_inputs=(1,))
def dft_17(node: Any, x: Any, dft_length: Any = None) -> jax.Array:
    """Discrete Fourier transform along the `axis` attribute (default 1); see _transform."""
    return _dft(node, x, dft_length, node.attr("axis", 1))


@op("DFT", since=20, static_inputs=(1, 2))
def dft_20(node: Any, x: Any, dft_length: Any = None, axis: Any = None) -> jax.Array:
    """Discrete Fourier transform along the `axis` input (default -2): fft, ifft, rfft
    (onesided) or irfft (onesided + inverse), zero-padded or cut to dft_length."""
    axis = -2 if axis is None else host_ints(node, axis, "axis")[0]
    return _dft(node, x, dft_length, axis)


def _frame_length(node: Any, signal_length: int, window: Any, frame_length: Any) -> int:
    if frame_length is not None:
        (length,) = host_ints(node, frame_length, "frame_length")
        if window is not None and np.shape(window)[0] != length:
            raise node.error(f"window length {np.shape(window)[0]} differs from frame_length "
                             f"{length}")
        return length
    return signal_length if window is None else np.shape(window)[0]


@op("STFT", since=17, static_inputs=(1, 3))
def stft(node: Any, signal: Any, frame_step: Any, window: Any = None,
         frame_length: Any = None) -> jax.Array:
    """Short-time Fourier transform of [batch, length, 1|2] signals: the DFT of each
    (windowed) frame of frame_length samples, frames frame_step apart."""
    if np.ndim(signal) != 3:
        raise node.error(f"signal must be [batch, length, 1 or 2], got shape {np.shape(signal)}")
    (step,) = host_ints(node, frame_step, "frame_step")
    signal_length = np.shape(signal)[1]
    length = _frame_length(node, signal_length, window, frame_length)
    if step < 1 or not 1 <= length <= signal_length:
        raise node.error(f"frame_step {step} and frame_length {length} do not fit a signal of "
                         f"length {signal_length}")
    frames = (signal_length - length) // step + 1
    indices = step * np.arange(frames)[:, None] + np.arange(length)[None, :]
    values, is_real = _as_complex(node, signal)
    framed = values[:, indices]
    if window is not None:
        framed = framed * jnp.asarray(window).astype(_compute_dtype(window.dtype))
    onesided = bool(node.attr("onesided", 1))
    spectrum, _ = _transform(framed, is_real, length, 2, False, onesided)
    return _complex_layout(spectrum, signal.dtype)


# --- MelWeightMatrix -----------------------------------------------------------------


def _hertz_to_mel(hertz: jax.Array) -> jax.Array:
    return 2595 * jnp.log10(1 + hertz / 700)


def _mel_to_hertz(mel: jax.Array) -> jax.Array:
    return 700 * (10 ** (mel / 2595) - 1)


def _mel_bin_edges(num_mel_bins: int, dft_length: int, sample_rate: float, lower: float,
                   upper: float) -> jax.Array:
    """The spectrogram bin of each band's left edge, centre and right edge.

    num_mel_bins + 2 points, evenly spaced in mel from `lower` in steps of
    (mel(upper) - mel(lower)) / (num_mel_bins + 2), as ONNX's reference defines them.
    """
    low_mel = _hertz_to_mel(jnp.float64(lower))
    step = (_hertz_to_mel(jnp.float64(upper)) - low_mel) / (num_mel_bins + 2)
    hertz = _mel_to_hertz(low_mel + step * jnp.arange(num_mel_bins + 2, dtype=jnp.float64))
    return jnp.floor((dft_length + 1) * hertz / sample_rate).astype(jnp.int64)


@op("MelWeightMatrix", since=17, static_inputs=(0, 1, 2, 3, 4))
def mel_weight_matrix(node: Any, num_mel_bins: Any, dft_length: Any, sample_rate: Any,
                      lower_edge_hertz: Any, upper_edge_hertz: Any) -> jax.Array:
    """[dft_length // 2 + 1, num_mel_bins] triangular filters with peak 1 on the mel scale,
    mel(f) = 2595 log10(1 + f / 700), between lower_edge_hertz and upper_edge_hertz."""
    (bands,) = host_ints(node, num_mel_bins, "num_mel_bins")
    (length,) = host_ints(node, dft_length, "dft_length")
    (rate,) = host_ints(node, sample_rate, "sample_rate")
    if bands < 1 or length < 1 or rate < 1:
        raise node.error(f"num_mel_bins ({bands}), dft_length ({length}) and sample_rate "
                         f"({rate}) must be positive")
    edges = _mel_bin_edges(bands, length, rate, float(lower_edge_hertz),
                           float(upper_edge_hertz))
    left, centre, right = edges[None, :-2], edges[None, 1:-1], edges[None, 2:]
    j = jnp.arange(length // 2 + 1)[:, None]
    rising = jnp.where(j >= left, (j - left) / jnp.maximum(centre - left, 1), 0.0)
    falling = jnp.where(j < right, (right - j) / jnp.maximum(right - centre, 1), 0.0)
    weights = jnp.where(j < centre, rising, jnp.where(j == centre, 1.0, falling))
    return weights.astype(numpy_dtype(node.attr("output_datatype", _FLOAT)))
