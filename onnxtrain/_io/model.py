"""Reading and writing ONNX models exactly.

load_model accepts a path, bytes, a binary file object or any message with
SerializeToString (an `onnx.ModelProto`, say), resolves external data from the
model's folder (mapping side files read-only, see mapped.py), and checks every
tensor's size against its dims, so a model that loads is one whose bytes can be
trusted. save_model writes atomically (a temporary file, then a rename:
onnxtrain.state.atomic) and moves large tensors to a side file, at aligned
offsets, when asked, or when the model would not fit in one protobuf message
(2 GiB); mapped values are streamed from their map into it.
"""

from __future__ import annotations

import io
import math
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Union

from google.protobuf.message import DecodeError, EncodeError

from onnxtrain.errors import ExportError, ModelLoadError
from onnxtrain._io import mapped
from onnxtrain._io.external_data import load_external_tensors, mark_external, uses_external_data
from onnxtrain.proto import ModelProto, TensorProto
from onnxtrain.proto.walk import iter_tensors
from onnxtrain.state import atomic
from onnxtrain.state.memory import ALIGNMENT
from onnxtrain.translate.tensors import (
    ELEMENT_TYPES,
    array_bytes,
    check_tensor_data,
    raw_size,
    tensor_to_numpy,
)

# Protobuf refuses to parse or serialize a message of 2 GiB or more.
PROTOBUF_LIMIT = 2**31 - 1

# Where a side file puts each tensor: at a multiple of SIDE_FILE_ALIGNMENT, so that a map of the
# file gives JAX on CPU arrays it uses in place (see state/memory.py); a tensor of at least
# LARGE_TENSOR_BYTES at a multiple of LARGE_TENSOR_ALIGNMENT, the allocation granularity ONNX
# Runtime needs to map a tensor on every system it runs on (Windows' is the largest).
SIDE_FILE_ALIGNMENT = ALIGNMENT
LARGE_TENSOR_ALIGNMENT = 65536
LARGE_TENSOR_BYTES = 2**20

# upb's parse depth: every message level counts, and upb cannot be told to allow more.
PROTOBUF_DEPTH_LIMIT = 100

_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_BINARY = getattr(os, "O_BINARY", 0)

# Any object with SerializeToString (an onnx.ModelProto, say) is accepted too.
ModelSource = Union[str, os.PathLike, bytes, bytearray, memoryview, BinaryIO, ModelProto]


def _not_a_model_file(path: Path, mode: int) -> ModelLoadError:
    if stat.S_ISDIR(mode):
        return ModelLoadError(f"{path} is a folder, not an ONNX model file")
    kind = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a device or socket"
    return ModelLoadError(
        f"{path} is {kind}, not a regular file; save the model to a file, or pass its "
        f"bytes to load_model"
    )


def _read_path(path: Path) -> bytes:
    """The bytes of the model file at `path`, which must be a regular file.

    Opened without blocking, so a FIFO put in the model's place is refused
    instead of waiting forever for a writer; the checks are made on the open
    descriptor, so they concern the file actually read.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | _O_NONBLOCK | _O_CLOEXEC | _O_BINARY)
    except IsADirectoryError:
        raise ModelLoadError(f"{path} is a folder, not an ONNX model file") from None
    except FileNotFoundError:
        raise ModelLoadError(f"model file {path} does not exist") from None
    except (OSError, ValueError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise ModelLoadError(f"cannot read model file {path}: {reason}") from None
    status = os.fstat(descriptor)
    if not stat.S_ISREG(status.st_mode):
        os.close(descriptor)
        raise _not_a_model_file(path, status.st_mode)
    size = status.st_size
    with os.fdopen(descriptor, "rb") as handle:
        if size > PROTOBUF_LIMIT:
            raise ModelLoadError(
                f"{path} is {size} bytes, over protobuf's 2 GiB limit for one message; "
                f"such models must keep their large tensors in external data files"
            )
        try:
            # Bounded by the size checked above, should the file grow meanwhile.
            return handle.read(size)
        except OSError as error:
            raise ModelLoadError(
                f"cannot read model file {path}: {error.strerror or error}"
            ) from None


def _folder_of(path: str | os.PathLike) -> Path:
    """The folder of the file `path` really is (links resolved), where its side files sit.

    os.path.realpath, unlike Path.resolve, ends a symbolic-link loop without
    raising; a path that cannot be resolved at all is left as given.
    """
    try:
        return Path(os.path.realpath(path)).parent
    except (OSError, ValueError):
        return Path(os.path.abspath(path)).parent


def _source_bytes(source: ModelSource) -> tuple[bytes, str, Path | None]:
    """(serialized model, description for messages, folder holding its side files)."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        return _read_path(path), str(path), _folder_of(path)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), "in-memory model", None
    if hasattr(source, "read"):
        data = source.read()
        name = getattr(source, "name", None)
        if isinstance(data, str):
            raise ModelLoadError(
                f"file object {name or source!r} is open in text mode; open ONNX models "
                f"with open(path, 'rb')"
            )
        folder = _folder_of(name) if isinstance(name, (str, os.PathLike)) else None
        return bytes(data), str(name or "file object"), folder
    if hasattr(source, "SerializeToString"):
        try:
            return source.SerializeToString(), type(source).__name__, None
        except Exception as error:  # noqa: BLE001 - any protobuf failure becomes a load error
            raise ModelLoadError(
                f"cannot serialize the given {type(source).__name__}: {error}"
            ) from None
    raise ModelLoadError(
        f"cannot load a model from {type(source).__name__}; pass a path, bytes, a binary "
        f"file object or a ModelProto"
    )


def _too_deep(error: DecodeError) -> bool:
    """Whether protobuf refused the bytes for nesting, not for being malformed."""
    text = str(error).lower()
    return "maxdepth" in text or "too deep" in text or "recursion" in text or "nesting" in text


def _parse(data: bytes, described: str) -> ModelProto:
    model = ModelProto()
    try:
        model.ParseFromString(data)
    except DecodeError as error:
        if _too_deep(error):
            raise ModelLoadError(
                f"{described} nests subgraphs (or other messages) deeper than protobuf's "
                f"parse limit of {PROTOBUF_DEPTH_LIMIT} levels (each If/Loop subgraph costs "
                f"three), so it cannot be read; this limit cannot be raised, so flatten the "
                f"nested control flow"
            ) from None
        raise ModelLoadError(
            f"{described} is not a valid ONNX model: protobuf could not parse its "
            f"{len(data)} bytes ({error}). The file is truncated, corrupt, or not ONNX."
        ) from None
    if model.ir_version <= 0:
        raise ModelLoadError(
            f"{described} has no ir_version ({len(data)} bytes parsed): it is not an ONNX "
            f"model, or it is empty or truncated"
        )
    return model


def load_model(
    source: ModelSource,
    *,
    base_dir: str | os.PathLike | None = None,
    load_external_data: bool = True,
    map_external_data: bool = True,
) -> ModelProto:
    """Load an ONNX model as an onnxtrain.proto.ModelProto.

    Tensors kept in side files (external data) are checked and then mapped read-only rather
    than read: the message keeps a reference to the map (an entry only onnxtrain reads, see
    onnxtrain/_io/mapped.py), onnxtrain decodes them as views of the file, and save_model
    writes them out again. So a model past protobuf's 2 GiB limit costs its side file's bytes
    once, in the page cache. The side files must not be rewritten in place while the model
    is in use (replacing them, as save_model does, is fine).

    Args:
        source: a path, bytes, a binary file object, an onnx.ModelProto or ours.
        base_dir: the folder holding external data files; it defaults to the model file's
            folder and must be given for bytes or in-memory messages whose tensors live in
            side files.
        load_external_data: False keeps side-file tensors as references (their sizes are
            not checked).
        map_external_data: False reads side-file values into the tensors' raw_data (as
            other ONNX tools expect of a message), for a folder that may change while the
            model is used, or a message handed to another tool as bytes.

    Returns:
        The model (a copy when `source` is a message).

    Raises:
        ModelLoadError: the file is missing or not a regular file, the bytes are
            not an ONNX model (or nest deeper than protobuf can parse), or an
            external-data location leaves the model's folder, does not lead to a
            regular file, or disagrees with its tensor's size.

    Example:
        >>> model = onnxtrain.load_model("model.onnx")
    """
    # Only a message this process holds may carry the private entries of mapped tensors.
    trusted = isinstance(source, ModelProto)
    if trusted:
        # Copied, not serialized: an in-memory model may be past protobuf's 2 GiB limit.
        model, described, folder = ModelProto(), "in-memory model", None
        model.CopyFrom(source)
    else:
        data, described, folder = _source_bytes(source)
        model = _parse(data, described)
    if base_dir is not None:
        folder = Path(base_dir)
    if load_external_data:
        located = ((tensor, f"{described}: {where}") for tensor, where in iter_tensors(model))
        load_external_tensors(located, folder, mapping=map_external_data, trusted=trusted)
    for tensor, where in iter_tensors(model):
        check_tensor_data(tensor, f"{described}: {where}")
    return model


def _as_model(model: object) -> ModelProto:
    if isinstance(model, ModelProto):
        return model
    if hasattr(model, "SerializeToString"):
        return load_model(model, load_external_data=False)
    raise ExportError(f"cannot save a {type(model).__name__}; pass a ModelProto")


def stored_bytes(tensor: TensorProto, where: str) -> bytes | memoryview:
    """A tensor's values in raw_data encoding, whichever field holds them; a mapped tensor's
    are a view of its map, so writing them streams from the file without a copy."""
    if mapped.is_mapped(tensor):
        return mapped.raw_view(tensor, where)
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    return array_bytes(tensor_to_numpy(tensor, where))


def _payload_size(tensor: TensorProto) -> int:
    """Bytes of the tensor's values, from its dims (no copy of the data is made)."""
    element = ELEMENT_TYPES.get(tensor.data_type)
    if element is None:
        return 0
    return raw_size(element, math.prod(tensor.dims))


def _inline_size(model: ModelProto) -> int:
    """The model's serialized size with every mapped tensor's values inline (an upper bound:
    their references are counted too); more than PROTOBUF_LIMIT where protobuf cannot tell."""
    try:
        size = model.ByteSize()
    except EncodeError:
        return PROTOBUF_LIMIT + 1
    return size + sum(mapped.stored_length(tensor, where)
                      for tensor, where in mapped.mapped_tensors(iter_tensors(model)))


def _refuse_unloaded_external_data(model: ModelProto) -> None:
    for tensor, where in iter_tensors(model):
        if uses_external_data(tensor) and not mapped.is_mapped(tensor):
            raise ExportError(
                f"{where}: still refers to external data that was never loaded; load the "
                f"model with load_external_data=True before saving it"
            )


def _externalizable(model: ModelProto, threshold: int) -> list[tuple[TensorProto, str]]:
    """The tensors to move to a side file: numeric, whole, at least `threshold` bytes, and
    holding their values (inline, or mapped by load_model), not references kept as such."""
    return [
        (tensor, where)
        for tensor, where in iter_tensors(model)
        if tensor.data_type != TensorProto.STRING
        and not tensor.HasField("segment")
        and (mapped.is_mapped(tensor) or not uses_external_data(tensor))
        and _payload_size(tensor) >= threshold
    ]


@contextmanager
def _inlined(model: ModelProto) -> Iterator[None]:
    """The model's mapped tensors hold their values in raw_data inside the block, and their
    map references again after it."""
    originals: list[tuple[TensorProto, TensorProto]] = []
    try:
        for tensor, where in mapped.mapped_tensors(iter_tensors(model)):
            original = TensorProto()
            original.CopyFrom(tensor)
            with mapped.raw_view(tensor, where) as view:
                values = bytes(view)
            originals.append((tensor, original))
            del tensor.external_data[:]
            tensor.ClearField("data_location")
            tensor.raw_data = values
        yield
    finally:
        for tensor, original in originals:
            tensor.CopyFrom(original)


def _serialize(model: ModelProto) -> bytes:
    # Checked before mapped values are copied in: a model too big for one message is refused
    # without first building it.
    if _inline_size(model) > PROTOBUF_LIMIT:
        raise ExportError(
            "model is over protobuf's 2 GiB limit for one message; save it with "
            "external_data=True or None, and a lower size_threshold if it is still too big"
        )
    with _inlined(model):
        return model.SerializeToString()


def _write_all(handle: io.FileIO, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[handle.write(view):]


def _alignment(size: int) -> int:
    return LARGE_TENSOR_ALIGNMENT if size >= LARGE_TENSOR_BYTES else SIDE_FILE_ALIGNMENT


def _aligned_offset(handle: io.FileIO, size: int) -> int:
    """Pad the side file to where a tensor of `size` bytes starts; that offset."""
    offset = handle.tell()
    padding = -offset % _alignment(size)
    if padding:
        _write_all(handle, bytes(padding))
    return offset + padding


def _read_exactly(descriptor: int, length: int, offset: int) -> bytes:
    """pread until `length` bytes are in (one call stops short of 2 GiB on Linux)."""
    chunks = []
    while length:
        chunk = os.pread(descriptor, length, offset)
        if not chunk:
            raise ExportError("side file shrank while saving; the model object may be incomplete")
        chunks.append(chunk)
        offset, length = offset + len(chunk), length - len(chunk)
    return b"".join(chunks)


@contextmanager
def _moved_to_side_file(
    tensors: list[tuple[TensorProto, str]], side_file: Path, location: str
) -> Iterator[None]:
    """Write the tensors' values to side_file, each at an aligned offset (see
    SIDE_FILE_ALIGNMENT), and point the tensors at it.

    On exit, whatever happened, every tensor gets its values back: raw_data is
    read back from the side file (so the model is never held twice in memory),
    tensors that used typed fields or were mapped are restored from a copy. Writes
    are unbuffered, so a tensor is marked only once its bytes reached the file.
    """
    moved: list[tuple[TensorProto, int, int, TensorProto | None]] = []
    with open(side_file, "w+b", buffering=0) as side:
        try:
            for tensor, where in tensors:
                data = stored_bytes(tensor, where)
                original = None
                if not tensor.HasField("raw_data"):
                    original = TensorProto()
                    original.CopyFrom(tensor)
                offset = _aligned_offset(side, len(data))
                _write_all(side, data)
                length = len(data)
                del data   # a mapped tensor's view holds its map
                mark_external(tensor, location, offset, length)
                moved.append((tensor, offset, length, original))
            os.fsync(side.fileno())
            yield
        finally:
            for tensor, offset, length, original in moved:
                if original is not None:
                    tensor.CopyFrom(original)
                    continue
                del tensor.external_data[:]
                tensor.ClearField("data_location")
                tensor.raw_data = _read_exactly(side.fileno(), length, offset)


def _side_file_name(path: Path, external_data: bool | str) -> str:
    if external_data is True:
        return f"{path.name}.data"
    name = str(external_data)
    if not name or Path(name).name != name or name in (".", ".."):
        raise ExportError(
            f"external_data={name!r} must be a plain file name; the side file is always "
            f"written next to the model"
        )
    return name


def save_model(
    model: ModelProto | object,
    path: str | os.PathLike,
    external_data: bool | str | None = None,
    *,
    size_threshold: int = 1024,
    keep_references: bool = False,
) -> None:
    """Write `model` to `path` atomically.

    Args:
        model: our ModelProto or an onnx.ModelProto (left as it was).
        path: the file to write; its folder must exist.
        external_data: None keeps every tensor inline unless the model would pass
            protobuf's 2 GiB limit, in which case it behaves like True; True writes every
            tensor of at least `size_threshold` bytes (in any graph, training graphs
            included) to `<file name>.data` beside the model; a string names that side file
            instead; False never writes one. Each tensor starts at an aligned offset of the
            side file (SIDE_FILE_ALIGNMENT; LARGE_TENSOR_ALIGNMENT for large ones), so
            load_model (and ONNX Runtime) can map it in place; values load_model mapped are
            written straight from their map.
        size_threshold: the smallest tensor, in bytes, moved to the side file.
        keep_references: tensors that still refer to external data are written as such
            references (an adapter export pointing at its base model's side file) instead of
            being refused.

    Raises:
        ExportError: the folder does not exist, the file cannot be written, or the model
            passes 2 GiB with external_data=False.
        ModelLoadError: a mapped tensor's side file was replaced or changed since the
            model was loaded (see load_model).

    Example:
        >>> onnxtrain.save_model(training_model, "model.training.onnx")
    """
    model = _as_model(model)
    path = Path(path)
    if not path.parent.is_dir():
        raise ExportError(f"cannot save to {path}: folder {path.parent} does not exist")
    if not keep_references:
        _refuse_unloaded_external_data(model)
    if external_data is None:
        external_data = _inline_size(model) > PROTOBUF_LIMIT
    location = _side_file_name(path, external_data) if external_data is not False else None
    moving = _externalizable(model, size_threshold) if location else []
    side_file = path.parent / location if moving else None
    temporaries: list[Path] = []
    try:
        if side_file is None:
            serialized = _serialize(model)
        else:
            temporaries.append(atomic.temporary_beside(side_file))
            with _moved_to_side_file(moving, temporaries[-1], location):
                serialized = _serialize(model)
        temporaries.append(atomic.temporary_beside(path))
        atomic.write_synced(temporaries[-1], serialized)
        if side_file is not None:
            atomic.replace(temporaries[0], side_file)
        atomic.replace(temporaries[-1], path)
        temporaries.clear()
    except OSError as error:
        raise ExportError(f"cannot write model to {path}: {error.strerror or error}") from None
    finally:
        for temporary in temporaries:
            temporary.unlink(missing_ok=True)
