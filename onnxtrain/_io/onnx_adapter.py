"""ONNX Runtime's adapter files (`.onnx_adapter`): the LoRA parameters ONNX Runtime and ONNX
Runtime GenAI bind, by name, to the inputs of an adapter-ready model. The file is a
FlatBuffer (schema onnxruntime/lora/adapter_format/adapter_schema.fbs, identifier "TORT"):

    Adapter   { format_version: int; adapter_version: int; model_version: int; parameters: [Parameter] }
    Parameter { name: string; dims: [int64]; data_type: int (ONNX's element type); raw_data: [uint8] }

Written and read here with the few FlatBuffer rules the schema needs (little-endian scalars
aligned to their size, forward offsets, a vtable per table), so that no runtime dependency is
added for it. The writer lays the buffer out front to back: the root offset and identifier,
the Adapter, the parameter tables, then each name, dims and data (8-byte aligned).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping

import numpy as np

from onnxtrain._io.files import write_export
from onnxtrain.errors import ExportError, ModelLoadError
from onnxtrain.translate.tensors import ELEMENT_TYPES

IDENTIFIER = b"TORT"
FORMAT_VERSION = 1   # what ONNX Runtime 1.20+ writes and accepts
SUFFIX = ".onnx_adapter"
_CODES = {np.dtype(info.dtype): code for code, info in ELEMENT_TYPES.items() if info.dtype is not None}


class _Buffer:
    """A byte buffer written front to back, with the alignment FlatBuffers asks for."""

    def __init__(self) -> None:
        self.data = bytearray()

    def align(self, size: int, shift: int = 0) -> None:
        """Pad so that the next write + `shift` bytes lands on a multiple of `size`."""
        self.data += b"\0" * (-(len(self.data) + shift) % size)

    def put(self, fmt: str, *values: object) -> int:
        position = len(self.data)
        self.data += struct.pack("<" + fmt, *values)
        return position

    def patch_offset(self, at: int, target: int) -> None:
        """The uoffset at `at` points forward to `target`."""
        struct.pack_into("<I", self.data, at, target - at)

    def vector(self, payload: bytes, count: int, element: int) -> int:
        """A vector of `count` elements of `element` bytes each, its elements aligned to
        max(element, 4) (8 for raw data); returns the position of its length."""
        self.align(max(element, 4), 4)
        position = self.put("I", count)
        self.data += payload
        return position


def _table(buffer: _Buffer, fields: list[str]) -> tuple[int, list[int]]:
    """A vtable and a table of 4-byte fields (`fields` are struct codes "i" or "I"), each
    field present; returns the table's position and each field's position."""
    buffer.align(4)
    vtable = buffer.put("HH", 4 + 2 * len(fields), 4 + 4 * len(fields))
    buffer.put(f"{len(fields)}H", *(4 + 4 * index for index in range(len(fields))))
    buffer.align(4)
    table = buffer.put("i", 0)
    struct.pack_into("<i", buffer.data, table, table - vtable)
    return table, [buffer.put(code, 0) for code in fields]


def adapter_bytes(parameters: Mapping[str, np.ndarray], adapter_version: int = 0, model_version: int = 0) -> bytes:
    """The `.onnx_adapter` file holding `parameters` (name -> array, in this order).

    Raises:
        ExportError: an array of a type ONNX has no element type for.
    """
    buffer = _Buffer()
    root = buffer.put("I", 0)
    buffer.data += IDENTIFIER
    adapter, (form, adapter_field, model_field, listed) = _table(buffer, ["i", "i", "i", "I"])
    buffer.patch_offset(root, adapter)
    struct.pack_into("<3i", buffer.data, form, FORMAT_VERSION, adapter_version, model_version)
    items = list(parameters.items())
    buffer.align(4)
    vector = buffer.put("I", len(items))
    slots = [buffer.put("I", 0) for _ in items]
    buffer.patch_offset(listed, vector)
    for slot, (name, value) in zip(slots, items):
        array = np.asarray(value)
        code = _CODES.get(array.dtype.newbyteorder("="))
        if code is None:
            raise ExportError(f"adapter parameter {name!r} has dtype {array.dtype}, which ONNX has no element type for")
        table, (name_field, dims_field, type_field, data_field) = _table(buffer, ["I", "I", "i", "I"])
        buffer.patch_offset(slot, table)
        struct.pack_into("<i", buffer.data, type_field, code)
        encoded = name.encode()
        buffer.patch_offset(name_field, buffer.vector(encoded + b"\0", len(encoded), 1))
        dims = np.asarray(array.shape, "<i8")
        buffer.patch_offset(dims_field, buffer.vector(dims.tobytes(), dims.size, 8))
        raw = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        buffer.patch_offset(data_field, buffer.vector(raw, len(raw), 8))
    buffer.align(8)
    return bytes(buffer.data)


def write_onnx_adapter(path: str | os.PathLike, parameters: Mapping[str, np.ndarray], adapter_version: int = 0,
                       model_version: int = 0) -> None:
    """Write `parameters` to the `.onnx_adapter` file `path`, atomically.

    Raises:
        ExportError: see adapter_bytes, or the file cannot be written.

    Example:
        >>> write_onnx_adapter("math.onnx_adapter", {"q_proj.lora_A": a, "q_proj.lora_B": b})
    """
    data = adapter_bytes(parameters, adapter_version, model_version)
    write_export(path, lambda file: file.write(data))


def read_onnx_adapter(data: bytes, source: str = "the adapter file") -> dict[str, np.ndarray]:
    """The parameters of an `.onnx_adapter` file's bytes, by name, checking every offset.

    Raises:
        ModelLoadError: the bytes are not an adapter file of a version this reader knows, or an
            offset, length or type in them is out of range.
    """
    def bad(problem: str) -> ModelLoadError:
        return ModelLoadError(f"{source} is not a valid .onnx_adapter file: {problem}")

    def scalar(fmt: str, at: int) -> int:
        if at < 0 or at + struct.calcsize("<" + fmt) > len(data):
            raise bad(f"an offset points outside the file ({at})")
        return struct.unpack_from("<" + fmt, data, at)[0]

    def fields(table: int, count: int) -> list[int | None]:
        vtable = table - scalar("i", table)
        size = scalar("H", vtable)
        return [table + scalar("H", vtable + 4 + 2 * i) if 4 + 2 * i < size and scalar("H", vtable + 4 + 2 * i)
                else None for i in range(count)]

    def target(at: int) -> int:
        return at + scalar("I", at)

    def vector(at: int | None, element: int) -> bytes:
        if at is None:
            return b""
        start = target(at)
        length = scalar("I", start) * element
        if start + 4 + length > len(data):
            raise bad("a vector runs past the end")
        return data[start + 4:start + 4 + length]

    if len(data) < 8 or data[4:8] != IDENTIFIER:
        raise bad("its identifier is not TORT")
    root = target(0)
    form, _, _, listed = fields(root, 4)
    version = scalar("i", form) if form is not None else 0
    if version != FORMAT_VERSION:
        raise bad(f"format version {version}, this reader knows {FORMAT_VERSION}")
    parameters = {}
    offsets = vector(listed, 4)
    start = target(listed) + 4 if listed is not None else 0
    for index in range(len(offsets) // 4):
        table = target(start + 4 * index)
        name_field, dims_field, type_field, data_field = fields(table, 4)
        name = vector(name_field, 1).decode("utf-8", "replace")
        dims = np.frombuffer(vector(dims_field, 8), "<i8")
        info = ELEMENT_TYPES.get(scalar("i", type_field) if type_field is not None else 0)
        if info is None or info.dtype is None or (dims < 0).any():
            raise bad(f"parameter {name!r} has an unknown type or a negative dimension")
        raw = vector(data_field, 1)
        dtype = np.dtype(info.dtype).newbyteorder("<")
        if len(raw) != int(np.prod(dims)) * dtype.itemsize:
            raise bad(f"parameter {name!r} holds {len(raw)} bytes, not what its dims {dims.tolist()} take")
        parameters[name] = np.frombuffer(raw, dtype).reshape(dims).astype(dtype.newbyteorder("="))
    return parameters
