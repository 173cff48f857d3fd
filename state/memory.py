"""Host arrays that JAX on CPU uses in place.

device_put and jit read a 64-byte aligned host array where it lies and copy any other one,
so a buffer the program alone will read is worth allocating aligned.
"""

from __future__ import annotations

import math
from typing import Any

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
