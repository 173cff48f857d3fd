"""Writing the safetensors format (what peft and Hugging Face load adapters and weights from):
an 8-byte little-endian header size, a JSON header naming each tensor's dtype, shape and
byte range, then the tensors' bytes, little-endian and row-major. Written here so that no
runtime dependency is added for it.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from typing import BinaryIO

import ml_dtypes
import numpy as np

from onnxtrain._io.files import write_export
from onnxtrain.errors import ExportError

# numpy dtype -> the format's name for it.
DTYPES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
          np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32",
          np.dtype(np.int16): "I16", np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` (name -> array) to a safetensors file, atomically.

    Args:
        path: the file to write.
        tensors: the arrays, written in this order.
        metadata: string pairs for the header's "__metadata__" (e.g. {"format": "pt"}).

    Raises:
        ExportError: an array of a dtype the format has no name for, or a name it reserves.

    Example:
        >>> write_safetensors("adapter_model.safetensors", {"lora_A.weight": a}, {"format": "pt"})
    """
    header: dict[str, object] = {} if metadata is None else {"__metadata__": dict(metadata)}
    arrays, offset = [], 0
    for name, value in tensors.items():
        array = np.asarray(value)   # (np.ascontiguousarray would make a scalar 1-D)
        dtype = DTYPES.get(array.dtype.newbyteorder("="))
        if dtype is None or name == "__metadata__":
            raise ExportError(f"{path}: tensor {name!r} cannot be written as safetensors "
                              f"({'a reserved name' if dtype else f'dtype {array.dtype}'})")
        array = np.require(array.astype(array.dtype.newbyteorder("<"), copy=False), requirements="C")
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        arrays.append(array)
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)   # the tensors start 8-byte aligned

    def write(file: BinaryIO) -> None:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for array in arrays:
            file.write(array.tobytes())

    write_export(path, write)
