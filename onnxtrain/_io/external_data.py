"""Tensor values kept in side files next to the model (ONNX external data).

A tensor with data_location EXTERNAL names a file relative to the model's
folder plus an optional byte offset and length. A model file is untrusted
input, so every location is confined to the model's folder (no absolute
paths, no `..`, no symlinks leading out) and every declared size is checked
against the file and the tensor's dims before a byte is read.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from onnxtrain.errors import ModelLoadError
from onnxtrain.proto import StringStringEntryProto, TensorProto
from onnxtrain.translate.tensors import element_count, element_type, raw_size

_KNOWN_KEYS = {"location", "offset", "length", "checksum", "basepath"}


@dataclass(frozen=True)
class ExternalRef:
    """Where one tensor's values sit: a file under the model folder and a byte range."""

    location: str
    offset: int
    length: int | None
    checksum: str | None


def uses_external_data(tensor: TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL


def _integer(value: str, key: str, where: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ModelLoadError(f"{where}: external_data {key}={value!r} is not an integer") from None
    if number < 0:
        raise ModelLoadError(f"{where}: external_data {key}={number} is negative")
    return number


def external_ref(tensor: TensorProto, where: str) -> ExternalRef:
    """Parse and sanity-check a tensor's external_data entries."""
    entries = {entry.key: entry.value for entry in tensor.external_data}
    unknown = sorted(set(entries) - _KNOWN_KEYS)
    if unknown:
        raise ModelLoadError(
            f"{where}: unknown external_data keys {unknown}; expected location, offset, "
            f"length, checksum"
        )
    if not entries.get("location"):
        raise ModelLoadError(f"{where}: data_location is EXTERNAL but no external_data location")
    return ExternalRef(
        location=entries["location"],
        offset=_integer(entries.get("offset", "0"), "offset", where),
        length=_integer(entries["length"], "length", where) if "length" in entries else None,
        checksum=entries.get("checksum"),
    )


def confined_path(base_dir: Path, location: str, where: str) -> Path:
    """The file `location` names inside base_dir; ModelLoadError if it would leave it."""
    if "\0" in location:
        raise ModelLoadError(f"{where}: external data location {location!r} contains a NUL byte")
    posix, windows = PurePosixPath(location), PureWindowsPath(location)
    if posix.is_absolute() or windows.is_absolute() or windows.drive:
        raise ModelLoadError(
            f"{where}: external data location {location!r} is an absolute path; ONNX external "
            f"data must be a path relative to the model's folder"
        )
    if ".." in posix.parts or ".." in windows.parts:
        raise ModelLoadError(
            f"{where}: external data location {location!r} contains '..'; refusing to read "
            f"outside the model's folder {base_dir}"
        )
    root = base_dir.resolve()
    path = (root / location).resolve()
    if not path.is_relative_to(root):
        raise ModelLoadError(
            f"{where}: external data location {location!r} resolves to {path}, outside the "
            f"model's folder {root} (a symbolic link leads out); refusing to read it"
        )
    return path


class ExternalDataReader:
    """Reads external tensor values, keeping each side file open once."""

    def __init__(self, base_dir: Path | None):
        self.base_dir = base_dir
        self._files: dict[Path, object] = {}

    def __enter__(self) -> ExternalDataReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._files.values():
            handle.close()

    def _open(self, path: Path, location: str, where: str):
        if path not in self._files:
            if not path.is_file():
                state = "is not a regular file" if path.exists() else "does not exist"
                raise ModelLoadError(
                    f"{where}: external data file {location!r} ({path}) {state}; keep the "
                    f"model's side files next to it"
                )
            self._files[path] = open(path, "rb")  # noqa: SIM115 - closed in __exit__
        return self._files[path]

    def read(self, tensor: TensorProto, where: str) -> bytes:
        """The tensor's raw bytes from its side file, after every size check."""
        if self.base_dir is None:
            raise ModelLoadError(
                f"{where}: values are in external file(s) but the model was not loaded from "
                f"a path; pass base_dir= (the folder holding the side files) to load_model"
            )
        ref = external_ref(tensor, where)
        element = element_type(tensor.data_type, where)
        needed = raw_size(element, element_count(tensor, where))
        path = confined_path(self.base_dir, ref.location, where)
        handle = self._open(path, ref.location, where)
        file_size = os.fstat(handle.fileno()).st_size
        length = file_size - ref.offset if ref.length is None else ref.length
        if ref.offset + length > file_size or length < 0:
            raise ModelLoadError(
                f"{where}: external data file {ref.location!r} has {file_size} bytes but the "
                f"tensor asks for {length} bytes at offset {ref.offset}; the side file is "
                f"truncated or belongs to another model"
            )
        if length != needed:
            raise ModelLoadError(
                f"{where}: external data length {length} bytes disagrees with dims "
                f"{list(tensor.dims)} of {element.name}, which need {needed} bytes"
            )
        handle.seek(ref.offset)
        data = handle.read(length)
        if ref.checksum and hashlib.sha1(data).hexdigest() != ref.checksum.lower():
            raise ModelLoadError(
                f"{where}: external data in {ref.location!r} fails its SHA-1 checksum; the "
                f"side file was changed after the model was written"
            )
        return data


def load_external_tensors(
    tensors: Iterable[tuple[TensorProto, str]], base_dir: Path | None
) -> None:
    """Move the values of every external tensor into its raw_data."""
    with ExternalDataReader(base_dir) as reader:
        for tensor, where in tensors:
            if uses_external_data(tensor):
                tensor.raw_data = reader.read(tensor, where)
                del tensor.external_data[:]
                tensor.ClearField("data_location")


def mark_external(tensor: TensorProto, location: str, offset: int, length: int) -> None:
    """Point a tensor at a byte range of a side file, dropping its inline values."""
    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data",
                  "uint64_data", "string_data"):
        tensor.ClearField(field)
    del tensor.external_data[:]
    tensor.external_data.extend(
        StringStringEntryProto(key=key, value=value)
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(length)))
    )
    tensor.data_location = TensorProto.EXTERNAL
