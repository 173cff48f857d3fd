"""Side files mapped read-only: a tensor's values as a view of its file, not a copy in the message.

load_model checks every external tensor as external_data.py does (the walk inside the model's
folder, the byte range against the file and the dims, the checksum), then maps its side file
read-only, once per file, and marks the tensor with a private external_data entry naming that
map instead of reading its bytes into raw_data. tensor_to_numpy then returns a view of the map,
so a frozen weight is held in memory once (by the page cache), and JAX on CPU reads an aligned
view where it lies. A tensor at an offset JAX cannot use in place is copied once into an aligned
buffer that every later decode shares while anyone holds it.

A map lives while something holds a view of it. When nothing does, the next view maps the file
again through the same checked walk, and only if the walk still reaches the very file first
mapped (device, inode, size and modification time). So a side file must stay as it is while a
model mapping it is in use: bytes written into it would show through, and reading pages a
truncation removed kills the process (SIGBUS). save_model replaces files instead of rewriting
them, so saving over the model's own files is safe; for a folder someone else may rewrite in
place, load with map_external_data=False, which reads the values into the message.

The private entry exists only in memory: save_model writes mapped values out like any others,
and a serialized model (a file, bytes) carrying the entry is refused as an unknown key.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from onnxtrain.errors import ModelLoadError
from onnxtrain.proto import StringStringEntryProto, TensorProto
from onnxtrain.state.memory import ALIGNMENT, aligned_host_array

# The external_data key naming the map a loaded tensor views. Never written to a file.
MAP_KEY = "onnxtrain.mapped"

Identity = tuple[int, int, int, int]


class _Map(mmap.mmap):
    """A read-only map of one side file; a subclass so that it can be referred to weakly."""


@dataclass
class _Source:
    """A side file as it was when first mapped, and its map while one is alive."""

    folder: Path
    location: str
    identity: Identity
    live: weakref.ref | None = field(default=None, repr=False)

    def current(self) -> _Map | None:
        return None if self.live is None else self.live()

    def mapped(self, descriptor: int) -> _Map:
        """The live map, or a new one of `descriptor` (the file this source names)."""
        mapped = self.current()
        if mapped is None:
            mapped = _Map(descriptor, self.identity[2], access=mmap.ACCESS_READ)
            self.live = weakref.ref(mapped)
        return mapped


_LOCK = threading.RLock()
# token -> source. Entries are a few hundred bytes each and one per distinct side file a
# process maps; they are kept so that a tensor copied out of a model (whose token outlives any
# map) can always be mapped again, or refused with a message saying why.
_SOURCES: dict[str, _Source] = {}
_TOKENS: dict[Identity, str] = {}
# (token, offset, length) -> the buffer holding the aligned copy of a tensor the map cannot
# serve in place.
_COPIES: weakref.WeakValueDictionary[tuple[str, int, int], np.ndarray] = weakref.WeakValueDictionary()


def identity(status: os.stat_result) -> Identity:
    """What tells one file version from another: device, inode, size, modification time."""
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


def register(folder: Path, location: str, descriptor: int) -> tuple[str, _Map]:
    """The token naming `descriptor`'s file (a regular, non-empty file the caller checked under
    `folder`), and its map, which the caller holds while it needs the map alive.

    Loading one file again shares its token and its live map, so it is mapped once.
    """
    key = identity(os.fstat(descriptor))
    with _LOCK:
        token = _TOKENS.get(key)
        if token is None:
            token = secrets.token_hex(16)
            _TOKENS[key] = token
            _SOURCES[token] = _Source(Path(os.path.abspath(folder)), location, key)
        return token, _SOURCES[token].mapped(descriptor)


def mark(tensor: TensorProto, token: str, location: str, offset: int, length: int) -> None:
    """Point `tensor` at a byte range of the map `token` names (its values were checked)."""
    del tensor.external_data[:]
    tensor.external_data.extend(
        StringStringEntryProto(key=key, value=value)
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(length)),
                           (MAP_KEY, token)))
    tensor.data_location = TensorProto.EXTERNAL


def token_of(tensor: TensorProto) -> str | None:
    """The map token a loaded tensor carries, or None for any other tensor."""
    if tensor.data_location != TensorProto.EXTERNAL:
        return None
    for entry in tensor.external_data:
        if entry.key == MAP_KEY:
            return entry.value
    return None


def is_mapped(tensor: TensorProto) -> bool:
    return token_of(tensor) is not None


def _byte_range(tensor: TensorProto, where: str) -> tuple[int, int]:
    """(offset, length) of a mapped tensor, as mark() wrote them."""
    entries = {entry.key: entry.value for entry in tensor.external_data}
    try:
        offset, length = int(entries["offset"]), int(entries["length"])
    except (KeyError, ValueError):
        raise ModelLoadError(f"{where}: its mapped external_data lost its offset or length; load the "
                             "model again with onnxtrain.load_model") from None
    return offset, length


def _source(token: str, where: str) -> _Source:
    source = _SOURCES.get(token)
    if source is None:
        raise ModelLoadError(
            f"{where}: refers to side-file values this process never mapped (external_data "
            f"{MAP_KEY!r}); only onnxtrain.load_model writes that entry, so pass the model it "
            "returned, or load the model again")
    return source


def _reopened(source: _Source, where: str) -> _Map:
    """A new map of `source`, reached again through the checked walk; refused unless the walk
    leads to the very file first mapped."""
    from onnxtrain._io.external_data import ExternalDataReader

    with ExternalDataReader(source.folder) as reader:
        descriptor = reader.open_location(source.location, where)
        if identity(os.fstat(descriptor)) != source.identity:
            raise ModelLoadError(
                f"{where}: side file {source.location!r} in {source.folder} was replaced or changed "
                "since the model was loaded; load the model again (and keep its side files unchanged "
                "while it is in use)")
        return source.mapped(descriptor)


def _map_of(token: str, where: str) -> _Map:
    with _LOCK:
        source = _source(token, where)
        return source.current() or _reopened(source, where)


def check(tensor: TensorProto, needed: int, where: str) -> None:
    """Refuse a mapped tensor whose token is unknown or whose range disagrees with its map or dims.

    Raises:
        ModelLoadError: naming the tensor and what disagrees.
    """
    token = token_of(tensor)
    offset, length = _byte_range(tensor, where)
    size = _source(token, where).identity[2]
    if offset < 0 or length < 0 or offset + length > size:
        raise ModelLoadError(f"{where}: asks for {length} bytes at offset {offset} of a mapped side file of "
                             f"{size} bytes; load the model again")
    if length != needed:
        raise ModelLoadError(f"{where}: maps {length} bytes but its dims {list(tensor.dims)} need {needed}; "
                             "a mapped tensor's dims or type cannot be changed in place, so assign it new values")


def raw_view(tensor: TensorProto, where: str) -> memoryview:
    """The stored bytes of a mapped tensor as a read-only view of the map, wherever they lie (for
    streaming them to another file). The view keeps the map alive."""
    offset, length = _byte_range(tensor, where)
    return memoryview(_map_of(token_of(tensor), where))[offset:offset + length]


def payload(tensor: TensorProto, where: str) -> np.ndarray:
    """The stored bytes of a mapped tensor as a read-only uint8 array starting on an ALIGNMENT
    boundary: a view of the map, or the one shared copy where the file's offset is unaligned."""
    token = token_of(tensor)
    offset, length = _byte_range(tensor, where)
    mapped = _map_of(token, where)
    if offset % ALIGNMENT == 0:
        # Maps start on a page boundary, so the file's offset decides the alignment.
        return np.frombuffer(mapped, np.uint8, length, offset)
    with _LOCK:
        # The cache holds the buffer that owns the copy's memory: numpy makes every view's base
        # that owner, so the entry lives exactly as long as some view of the copy does.
        owner = _COPIES.get((token, offset, length))
        if owner is None:
            copy = aligned_host_array((length,), np.uint8)
            copy[:] = np.frombuffer(mapped, np.uint8, length, offset)
            owner = copy.base
            owner.flags.writeable = False
            _COPIES[(token, offset, length)] = owner
            _release_pages(mapped, offset, length)
    start = -owner.ctypes.data % ALIGNMENT
    return owner[start:start + length]


def _release_pages(mapped: _Map, offset: int, length: int) -> None:
    """Drop the map's pages wholly inside a copied range from this process's resident set: the
    copy holds those values now (the pages stay in the page cache, and fault back on a read)."""
    start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (offset + length) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start and hasattr(mmap, "MADV_DONTNEED"):
        mapped.madvise(mmap.MADV_DONTNEED, start, end - start)


def mapped_tensors(tensors: Iterable[tuple[TensorProto, str]]) -> list[tuple[TensorProto, str]]:
    """The mapped ones among `tensors`."""
    return [(tensor, where) for tensor, where in tensors if is_mapped(tensor)]


def stored_length(tensor: TensorProto, where: str) -> int:
    """Bytes a mapped tensor's values take."""
    return _byte_range(tensor, where)[1]
