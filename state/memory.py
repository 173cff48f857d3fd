"""Buffers the store hands out: aligned host arrays and device arrays that nothing else holds.

JAX on CPU reads a 64-byte aligned host array where it lies and copies any other one, so a
buffer only a program will read is worth allocating aligned. And every device array the
store keeps must be its own: a step donates the store's buffers, and donating one buffer
through two arguments is an error.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

ALIGNMENT = 64


def aligned_host_array(shape: tuple[int, ...], dtype: Any, zeroed: bool = False) -> np.ndarray:
    """An uninitialized (or zeroed) array whose data starts on an ALIGNMENT boundary. Zeroed
    memory is mapped by the OS only when first written."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = (np.zeros if zeroed else np.empty)(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def device_zeros(shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Zeros on the device, made without compiling (jnp.zeros compiles a program per shape,
    too quick for the persistent cache to keep) and without writing them: device_put of
    aligned, freshly mapped host memory keeps using it. Nothing else holds the result."""
    with jax.enable_x64(True):
        return jax.device_put(aligned_host_array(shape, dtype, zeroed=True)).block_until_ready()


def device_copy(value: Any) -> jax.Array:
    """A device copy of `value` that nothing else holds, made without compiling; a
    jax.ShapeDtypeStruct stands for zeros. On CPU device_put may alias a host array, so that
    case is copied once more on the device."""
    if isinstance(value, jax.ShapeDtypeStruct):
        return device_zeros(value.shape, value.dtype)
    with jax.enable_x64(True):
        if isinstance(value, jax.Array):
            # No target keeps an uncommitted array uncommitted (jit would otherwise see a new
            # signature); an array spanning processes needs its sharding named.
            target = None if value.is_fully_addressable else value.sharding
            return jax.device_put(value, target, may_alias=False)
        host = np.asarray(value)
        copied = jax.device_put(host)
        if _shares_memory(copied, host):
            copied = jax.device_put(copied, may_alias=False)
        # The transfer may still read the caller's buffer: finish it before the caller can reuse it.
        return copied.block_until_ready()


def _shares_memory(device: jax.Array, host: np.ndarray) -> bool:
    start = host.__array_interface__["data"][0]
    return start <= device.unsafe_buffer_pointer() < start + max(host.nbytes, 1)
