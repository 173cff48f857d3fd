"""Stand-ins for other libraries' arrays, so feed tests run without torch or pandas installed.

Each reproduces what the feed check meets in the real thing: a dtype of its own that is not a
numpy dtype, `__array__` refused for a tensor that requires grad (as torch does), strides
that are not C order, and objects that only export DLPack.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class FakeTensor:
    """Like a torch CPU tensor: shape, a dtype that is not numpy's, requires_grad, detach(),
    `__array__` (refused while it requires grad) and DLPack export. `refuse_numpy` makes
    `__array__` fail as torch does for bfloat16, leaving DLPack."""

    def __init__(self, array: Any, requires_grad: bool = False, refuse_numpy: bool = False):
        self._array = array
        self.requires_grad = requires_grad
        self._refuse_numpy = refuse_numpy
        self.shape = tuple(array.shape)
        self.dtype = f"fake.{array.dtype}"

    def detach(self) -> FakeTensor:
        return FakeTensor(self._array, False, self._refuse_numpy)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self.requires_grad:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy()")
        if self._refuse_numpy:
            raise TypeError("Got unsupported ScalarType BFloat16")
        return np.asarray(self._array, dtype)

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._array.__dlpack_device__()


class DLPackOnly:
    """An array that only exports DLPack (no `__array__`)."""

    def __init__(self, array: Any):
        self._array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._array.__dlpack_device__()


class ArrayLike:
    """An object with `__array__` only, like a pandas column or an xarray DataArray."""

    def __init__(self, array: np.ndarray):
        self._array = array

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self._array, dtype)
