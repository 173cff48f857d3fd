"""Host arrays placed where JAX on CPU treats them differently: device_put and jit use a
64-byte aligned host array in place and copy (possibly later) any other."""

from __future__ import annotations

import numpy as np


def host_array(values: np.ndarray, alignment_offset: int = 0) -> np.ndarray:
    """A copy of `values` whose data starts `alignment_offset` bytes past a 64-byte boundary."""
    nbytes = values.nbytes
    raw = np.empty(nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + alignment_offset
    array = raw[start:start + nbytes].view(values.dtype).reshape(values.shape)
    array[...] = values
    return array
