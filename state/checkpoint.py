"""Save and restore a StateStore: a zip of raw array bytes plus a JSON manifest.

No pickle: a checkpoint is data only, safe to load from anywhere. Every dtype
jax holds (bfloat16 and the 8-bit floats included) round-trips bit for bit,
and zip64 lifts any size limit. Writes are atomic (onnxtrain.state.atomic).

Loading treats the file as hostile. The manifest is read only up to a bound
and turned into typed specs (parse_manifest) before any array is touched; each
array is then read in bounded chunks into a buffer of the size its dtype and
shape declare, after the zip's own record of the entry's size agreed with it,
so an entry that would inflate past its declared size costs at most that size.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
import zlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, BinaryIO

import jax
import ml_dtypes
import numpy as np

from onnxtrain.errors import ExportError, ModelLoadError
from onnxtrain.state import atomic
from onnxtrain.state.memory import aligned_host_array

FORMAT = "onnxtrain-checkpoint"
VERSION = 1
MANIFEST_ENTRY = "manifest.json"
KEY_ENTRY = "key.bin"

# A manifest lists names, dtypes and shapes: far below this even for models with very many arrays.
MANIFEST_LIMIT = 64 << 20
# A PRNG key is a few 32-bit words.
KEY_LIMIT = 1 << 10
# Bytes decompressed per read, so reading never holds more than one chunk beyond the array.
CHUNK = 1 << 20
# numpy's limit on dimensions in its oldest supported release.
MAX_RANK = 32
# Zip flag bits for encryption (0, 6) and compressed patch data (5): features a checkpoint never uses.
_UNSUPPORTED_FLAGS = 0x1 | 0x20 | 0x40
# zipfile bounds what one read decompresses for these; bzip2 and lzma inflate a whole block at once.
_READABLE_COMPRESSION = {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED}
# Deflate's best case: one 258-byte match per two bits.
_DEFLATE_RATIO = 1032


def _dtype(name: str) -> np.dtype:
    """A numeric dtype by name (ml_dtypes' too). The manifest comes from the file, so anything
    else (objects, strings, records, arbitrary attributes) is refused as a ValueError."""
    scalar = getattr(ml_dtypes, name, None) if isinstance(name, str) else None
    try:
        dtype = np.dtype(scalar) if isinstance(scalar, type) and issubclass(scalar, np.generic) else np.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or (dtype.kind not in "biufc" and scalar is None):
        raise ValueError(f"dtype {name!r} is not a numeric array type")
    return dtype


@dataclass(frozen=True)
class ArraySpec:
    """An array the manifest declares: the zip entry holding its bytes, its dtype and shape."""

    name: str
    entry: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest, validated: every field has the type and range it must have."""

    arrays: tuple[ArraySpec, ...]
    key: ArraySpec
    key_impl: str
    metadata: Mapping[str, str]


def save_checkpoint(path: str | os.PathLike, values: Mapping[str, Any], key: jax.Array,
                    metadata: Mapping[str, str] | None = None) -> None:
    """Write `values` (name -> array), the PRNG key and string metadata to `path`, atomically.

    Raises:
        ExportError: the file cannot be written (`path` is then unchanged).
    """
    path = Path(path)
    try:
        atomic.write_atomically(path, lambda file: _write_zip(file, values, key, metadata or {}))
    except OSError as error:
        raise ExportError(f"cannot write checkpoint {str(path)!r}: {error}") from error


def _write_zip(file: BinaryIO, values: Mapping[str, Any], key: jax.Array, metadata: Mapping[str, str]) -> None:
    key_data = np.asarray(jax.random.key_data(key))
    manifest = {
        "format": FORMAT, "version": VERSION,
        "key": {"impl": str(jax.random.key_impl(key)), "dtype": key_data.dtype.name,
                "shape": list(key_data.shape)},
        "metadata": dict(metadata),
        "arrays": [],
    }
    with zipfile.ZipFile(file, "w", allowZip64=True) as archive:
        for index, (name, value) in enumerate(values.items()):
            array = np.asarray(value)
            entry = f"arrays/{index}.bin"
            archive.writestr(entry, array.tobytes())
            manifest["arrays"].append({"name": name, "entry": entry, "dtype": array.dtype.name,
                                       "shape": list(array.shape)})
        archive.writestr(KEY_ENTRY, key_data.tobytes())
        archive.writestr(MANIFEST_ENTRY, json.dumps(manifest, indent=1))


# ---- the manifest: JSON -> Manifest, or a ModelLoadError naming the field ----

def _invalid(source: str, where: str, problem: str) -> ModelLoadError:
    return ModelLoadError(f"{source}: manifest field {where} {problem}; the file is damaged or was "
                          "not written by onnxtrain's save_checkpoint")


def _shown(value: Any) -> str:
    """A short description of a JSON value for a message (never the whole of a large one)."""
    if isinstance(value, (list, dict)):
        return f"a JSON {'array' if isinstance(value, list) else 'object'} of {len(value)} items"
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


_JSON_TYPES = {dict: "a JSON object", list: "a JSON array", str: "a string", int: "an integer"}


def _typed(value: Any, kind: type, where: str, source: str) -> Any:
    # `type(...) is`, not isinstance: JSON's true and false are Python ints too.
    if type(value) is not kind:
        raise _invalid(source, where, f"must be {_JSON_TYPES[kind]}, not {_shown(value)}")
    return value


def _member(document: dict, key: str, kind: type, where: str, source: str) -> Any:
    if key not in document:
        raise _invalid(source, f"{where}{key}", "is missing")
    return _typed(document[key], kind, f"{where}{key}", source)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (readers would disagree on which one counts)."""
    document = {}
    for key, value in pairs:
        if key in document:
            raise ValueError(f"key {_shown(key)} appears twice in one object")
        document[key] = value
    return document


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _array_spec(item: Any, where: str, source: str, name: str | None = None,
                entry: str | None = None) -> ArraySpec:
    """An ArraySpec from a manifest object holding dtype and shape (and name and entry, unless given)."""
    item = _typed(item, dict, where, source)
    name = _member(item, "name", str, f"{where}.", source) if name is None else name
    entry = _member(item, "entry", str, f"{where}.", source) if entry is None else entry
    try:
        dtype = _dtype(_member(item, "dtype", str, f"{where}.", source))
    except ValueError as error:
        raise _invalid(source, f"{where}.dtype", f"is not usable: {error}") from None
    dims = _member(item, "shape", list, f"{where}.", source)
    if len(dims) > MAX_RANK:
        raise _invalid(source, f"{where}.shape", f"has {len(dims)} dimensions, more than {MAX_RANK}")
    for axis, dim in enumerate(dims):
        if type(dim) is not int or dim < 0:
            raise _invalid(source, f"{where}.shape[{axis}]", f"must be an integer >= 0, not {_shown(dim)}")
    # Bounded without the zero dims too, so numpy can make the (empty) array.
    if math.prod(max(dim, 1) for dim in dims) * dtype.itemsize >= 2**63:
        raise _invalid(source, f"{where}.shape", f"{dims} holds more bytes than any array can")
    return ArraySpec(name, entry, dtype, tuple(dims))


def _array_specs(items: list, source: str) -> tuple[ArraySpec, ...]:
    specs: list[ArraySpec] = []
    names: dict[str, int] = {}
    entries: dict[str, int] = {}
    for index, item in enumerate(items):
        spec = _array_spec(item, f"arrays[{index}]", source)
        if spec.name in names:
            raise _invalid(source, f"arrays[{index}].name", f"{_shown(spec.name)} repeats arrays[{names[spec.name]}]")
        if spec.entry in entries:
            raise _invalid(source, f"arrays[{index}].entry",
                           f"{_shown(spec.entry)} is also arrays[{entries[spec.entry]}]'s entry")
        if spec.entry in (KEY_ENTRY, MANIFEST_ENTRY):
            raise _invalid(source, f"arrays[{index}].entry", f"{_shown(spec.entry)} is not an array's entry")
        names[spec.name], entries[spec.entry] = index, index
        specs.append(spec)
    return tuple(specs)


def _metadata(document: dict, source: str) -> Mapping[str, str]:
    metadata = _typed(document.get("metadata", {}), dict, "metadata", source)
    for key, value in metadata.items():
        _typed(value, str, f"metadata[{_shown(key)}]", source)
    return MappingProxyType(dict(metadata))


def parse_manifest(raw: bytes, source: str) -> Manifest:
    """The manifest `raw` holds, with every field checked.

    Args:
        raw: the bytes of the checkpoint's manifest entry.
        source: how messages name the checkpoint, e.g. "checkpoint 'run.ckpt'".

    Returns:
        The validated Manifest.

    Raises:
        ModelLoadError: `raw` is not JSON, not an onnxtrain manifest, or a field is missing,
            of the wrong type or out of range (the message names the field).
    """
    try:
        document = json.loads(raw, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except RecursionError:
        raise ModelLoadError(f"{source}: {MANIFEST_ENTRY} nests JSON too deeply to be a checkpoint "
                             "manifest; the file is damaged or not an onnxtrain checkpoint") from None
    except ValueError as error:
        raise ModelLoadError(f"{source}: {MANIFEST_ENTRY} is not valid JSON ({error}); the file is "
                             "damaged or not an onnxtrain checkpoint") from None
    if not isinstance(document, dict):
        raise ModelLoadError(f"{source} is not an onnxtrain checkpoint (version {VERSION}): its manifest "
                             f"is {_shown(document)}, not a JSON object")
    kind, version = document.get("format"), document.get("version")
    if kind != FORMAT or type(version) is not int or version != VERSION:
        raise ModelLoadError(f"{source} is not an onnxtrain checkpoint (version {VERSION}): its manifest "
                             f"says format {_shown(kind)}, version {_shown(version)}")
    arrays = _array_specs(_member(document, "arrays", list, "", source), source)
    key_item = _member(document, "key", dict, "", source)
    key = _array_spec(key_item, "key", source, name="the PRNG key", entry=KEY_ENTRY)
    if key.nbytes > KEY_LIMIT:
        raise _invalid(source, "key.shape", f"{list(key.shape)} is far larger than any PRNG key")
    impl = _member(key_item, "impl", str, "key.", source)
    return Manifest(arrays, key, impl, _metadata(document, source))


# ---- the zip: entries read within their declared sizes ----

class _Archive:
    """A checkpoint's zip, read entry by entry within the sizes the manifest declares."""

    def __init__(self, archive: zipfile.ZipFile, length: int, source: str):
        """length: the file's size in bytes; source: how messages name the checkpoint."""
        self.zip, self.length, self.source = archive, length, source
        counts = Counter(archive.namelist())
        if len(counts) != len(archive.namelist()):
            # zipfile reads the last of two same-named entries; other tools may read the first.
            repeated = sorted(name for name, count in counts.items() if count > 1)
            raise ModelLoadError(f"{source}: the zip holds several entries named {repeated[:5]}; the "
                                 "file is damaged or hostile")

    def entry(self, name: str, what: str) -> zipfile.ZipInfo:
        """The zip's record of entry `name`, refused unless it can be read within bounds."""
        try:
            info = self.zip.getinfo(name)
        except KeyError:
            raise ModelLoadError(f"{self.source}: {what} should be in zip entry {name!r}, which the file "
                                 "does not hold; the file is incomplete or damaged") from None
        problem = _unreadable(info, self.length)
        if problem:
            raise ModelLoadError(f"{self.source}: zip entry {name!r} ({what}) {problem}; save the "
                                 "checkpoint again with save_checkpoint")
        return info

    def read(self, info: zipfile.ZipInfo, size: int, what: str) -> np.ndarray:
        """Exactly `size` bytes of an entry, read in chunks into a buffer allocated up front.

        Reading stops one byte past `size`, so an entry whose stream holds more (whatever the
        zip records) is refused without being inflated further.
        """
        try:
            buffer = aligned_host_array((size,), np.uint8)
        except MemoryError:
            raise ModelLoadError(f"{self.source}: {what} needs {size} bytes, more memory than this "
                                 "machine can give") from None
        filled = 0
        try:
            with self.zip.open(info) as stream:
                while filled < size:
                    chunk = stream.read(min(CHUNK, size - filled))
                    if not chunk:
                        raise ModelLoadError(f"{self.source}: {what} is truncated: zip entry "
                                             f"{info.filename!r} ends after {filled} of its {size} bytes")
                    buffer[filled:filled + len(chunk)] = np.frombuffer(chunk, np.uint8)
                    filled += len(chunk)
                if stream.read(1):
                    raise ModelLoadError(f"{self.source}: {what} holds more than its {size} bytes in zip "
                                         f"entry {info.filename!r}; the file is damaged")
        except (EOFError, zlib.error, zipfile.BadZipFile) as error:
            raise ModelLoadError(f"{self.source}: zip entry {info.filename!r} ({what}) is damaged: "
                                 f"{error or type(error).__name__}") from None
        return buffer

    def array(self, spec: ArraySpec) -> np.ndarray:
        """The array `spec` declares, refused before reading unless the zip records its exact size."""
        what = spec.name if spec.entry == KEY_ENTRY else f"array {spec.name!r}"
        info = self.entry(spec.entry, what)
        declared = f"{spec.dtype.name}{list(spec.shape)} = {spec.nbytes} bytes"
        if info.file_size < spec.nbytes:
            raise ModelLoadError(f"{self.source}: {what} is truncated: zip entry {spec.entry!r} holds "
                                 f"{info.file_size} bytes, its manifest declares {declared}")
        if info.file_size > spec.nbytes:
            raise ModelLoadError(f"{self.source}: {what} is oversized: zip entry {spec.entry!r} would "
                                 f"inflate to {info.file_size} bytes, its manifest declares {declared}; "
                                 "refused unread, the file is damaged or hostile")
        return self.read(info, spec.nbytes, what).view(spec.dtype).reshape(spec.shape)

    def manifest(self) -> Manifest:
        info = self.entry(MANIFEST_ENTRY, "the manifest")
        if info.file_size > MANIFEST_LIMIT:
            raise ModelLoadError(f"{self.source}: zip entry {MANIFEST_ENTRY!r} would inflate to "
                                 f"{info.file_size} bytes, more than any manifest ({MANIFEST_LIMIT}); "
                                 "refused unread")
        return parse_manifest(self.read(info, info.file_size, "the manifest").tobytes(), self.source)


def _unreadable(info: zipfile.ZipInfo, length: int) -> str | None:
    """Why an entry cannot be read within bounds, or None: zipfile checks none of this."""
    if info.flag_bits & _UNSUPPORTED_FLAGS:
        return "is encrypted"
    if info.compress_type not in _READABLE_COMPRESSION:
        return f"uses compression method {info.compress_type}; only stored or deflated entries are read"
    if info.header_offset + info.compress_size > length:
        return f"claims {info.compress_size} compressed bytes, past the end of the {length}-byte file"
    if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
        return f"is stored uncompressed yet records {info.compress_size} bytes stored and {info.file_size} read"
    if info.file_size > info.compress_size * _DEFLATE_RATIO + 64:
        return (f"records {info.file_size} bytes inflated from {info.compress_size}, more than deflate "
                "can produce")
    return None


def _refuse_other_shapes(manifest: Manifest, expected: Mapping[str, jax.ShapeDtypeStruct], source: str) -> None:
    names = [spec.name for spec in manifest.arrays]
    if set(names) != set(expected):
        raise ModelLoadError(f"{source} holds {sorted(names)} but this model's state is "
                             f"{sorted(expected)}; it was saved from a different model")
    for spec in manifest.arrays:
        want = expected[spec.name]
        if spec.dtype != np.dtype(want.dtype) or spec.shape != tuple(want.shape):
            raise ModelLoadError(f"{source}: {spec.name!r} is {spec.dtype}{list(spec.shape)}, the model's is "
                                 f"{np.dtype(want.dtype)}{list(want.shape)}; it was saved from a different model")


def _key(data: np.ndarray, impl: str, source: str) -> jax.Array:
    """The one PRNG key `data` holds for implementation `impl`."""
    try:
        key = jax.random.wrap_key_data(data, impl=impl)
    except (TypeError, ValueError) as error:
        raise ModelLoadError(f"{source}: its PRNG key ({impl!r}, {data.dtype}{list(data.shape)}) is not a "
                             f"key jax can use: {error}") from None
    if key.shape != ():
        raise ModelLoadError(f"{source}: its PRNG key data {data.dtype}{list(data.shape)} holds keys of "
                             f"shape {list(key.shape)}, not one key; the file is damaged")
    return key


def load_checkpoint(path: str | os.PathLike, expected: Mapping[str, jax.ShapeDtypeStruct] | None = None,
                    ) -> tuple[dict[str, np.ndarray], jax.Array, dict[str, str]]:
    """(values, key, metadata) as saved by save_checkpoint.

    Args:
        path: the checkpoint file.
        expected: name -> shape and dtype the values must have; checked against the manifest
            before any array is read.

    Returns:
        The arrays by name, the PRNG key and the metadata.

    Raises:
        ModelLoadError: the file is not a readable checkpoint, its manifest is malformed, an
            entry is missing, truncated or larger than declared, or it does not match `expected`.
    """
    source = f"checkpoint {str(path)!r}"
    try:
        with open(path, "rb") as file, zipfile.ZipFile(file) as opened:
            archive = _Archive(opened, os.fstat(file.fileno()).st_size, source)
            manifest = archive.manifest()
            if expected is not None:
                _refuse_other_shapes(manifest, expected, source)
            values = {spec.name: archive.array(spec) for spec in manifest.arrays}
            return values, _key(archive.array(manifest.key), manifest.key_impl, source), dict(manifest.metadata)
    except (OSError, EOFError, ValueError, zlib.error, zipfile.BadZipFile) as error:
        raise ModelLoadError(f"cannot read checkpoint {str(path)!r}: {error}") from error
