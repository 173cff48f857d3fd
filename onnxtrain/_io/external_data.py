"""Tensor values kept in side files next to the model (ONNX external data).

A tensor with data_location EXTERNAL names a file relative to the model's
folder plus an optional byte offset and length. A model file is untrusted
input, and so is the folder it sits in: someone may be changing it while a
load runs. So a location is never handed to the operating system as a path.
It is walked one component at a time by descriptor, under a descriptor of the
model's folder, with every open refusing to follow a symbolic link; a link
met on the way is read and followed by this module only while it stays
inside the folder. No name is looked up twice, so nothing can be swapped
between a check and an open. The file reached must be a regular file, and
every declared size is checked against it and the tensor's dims before a
byte is read. The values are then read into the tensor, or the file reached is
mapped read-only (mapped.py), which load_model does by default.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from onnxtrain._io import mapped
from onnxtrain.errors import ModelLoadError
from onnxtrain.proto import StringStringEntryProto, TensorProto
from onnxtrain.translate.tensors import element_count, element_type, raw_size

_KNOWN_KEYS = {"location", "offset", "length", "checksum", "basepath"}

# Linux's own limit; a loop of links (a -> b -> a) ends here with a typed error.
MAX_SYMLINKS = 40
# PATH_MAX on Linux: no real model needs more, and it bounds the walk.
MAX_LOCATION_CHARS = 4096
# Offsets and lengths past 2**63 cannot be file positions.
_MAX_NUMBER_DIGITS = 19
# Each folder on the way stays open until the walk ends (`..` needs it), so bound them.
MAX_FOLDER_DEPTH = 256
_SHOWN_CHARS = 80

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOCTTY = getattr(os, "O_NOCTTY", 0)
_O_BINARY = getattr(os, "O_BINARY", 0)
_O_NOINHERIT = getattr(os, "O_NOINHERIT", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)

# True where folders can be walked by descriptor (POSIX); Windows falls back to
# resolving the path, checking it, opening it and comparing the file's identity.
WALK_BY_DESCRIPTOR = (
    hasattr(os, "O_NOFOLLOW")
    and hasattr(os, "O_DIRECTORY")
    and os.open in os.supports_dir_fd
    and os.readlink in os.supports_dir_fd
)


@dataclass(frozen=True)
class ExternalRef:
    """Where one tensor's values sit: a file under the model folder and a byte range."""

    location: str
    offset: int
    length: int | None
    checksum: str | None


def uses_external_data(tensor: TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL


def _shown(location: str) -> str:
    """The location for a message, shortened when it is absurdly long."""
    if len(location) <= _SHOWN_CHARS:
        return repr(location)
    return f"{location[:_SHOWN_CHARS]!r}... ({len(location)} characters)"


def _integer(value: str, key: str, where: str) -> int:
    """A non-negative integer written in ASCII decimal digits only.

    int() would also take signs, spaces, underscores and other scripts' digits
    ("+5", " 48 ", "0_0", "٤٨"); a model file has no business writing those.
    """
    if not (value.isascii() and value.isdigit()):
        raise ModelLoadError(
            f"{where}: external_data {key}={_shown(value)} is not an integer written in the "
            f"digits 0-9 alone (no sign, spaces or underscores); fix the model's external_data"
        )
    if len(value.lstrip("0")) > _MAX_NUMBER_DIGITS:
        raise ModelLoadError(
            f"{where}: external_data {key}={_shown(value)} is larger than any file can be"
        )
    return int(value)


def _text(value: str | bytes, where: str) -> str:
    """An external_data key or value; protobuf hands back bytes when they are not UTF-8."""
    if isinstance(value, bytes):
        raise ModelLoadError(
            f"{where}: external_data entry {value[:_SHOWN_CHARS]!r} is not valid UTF-8 text; "
            f"the model file is corrupt"
        )
    return value


def external_ref(tensor: TensorProto, where: str) -> ExternalRef:
    """Parse and sanity-check a tensor's external_data entries.

    Raises:
        ModelLoadError: unknown keys, no location, or an offset or length that
            is not a plain decimal number.
    """
    entries = {_text(entry.key, where): _text(entry.value, where) for entry in tensor.external_data}
    unknown = sorted(set(entries) - _KNOWN_KEYS)
    if unknown:
        hint = (f" ({mapped.MAP_KEY!r} marks a tensor mapped in memory by onnxtrain.load_model and "
                f"means nothing in a file: save models with onnxtrain.save_model)"
                if mapped.MAP_KEY in unknown else "")
        raise ModelLoadError(
            f"{where}: unknown external_data keys {unknown}; expected location, offset, "
            f"length, checksum{hint}"
        )
    if not entries.get("location"):
        raise ModelLoadError(f"{where}: data_location is EXTERNAL but no external_data location")
    return ExternalRef(
        location=entries["location"],
        offset=_integer(entries.get("offset", "0"), "offset", where),
        length=_integer(entries["length"], "length", where) if "length" in entries else None,
        checksum=entries.get("checksum"),
    )


def check_location(location: str, where: str) -> None:
    """Refuse a location that could only name something outside the model's folder.

    Raises:
        ModelLoadError: a NUL byte, an absolute path, a '..' component, a
            location ending in a folder ('/' or '.'), or one longer than any path
            the system accepts.
    """
    if "\0" in location:
        raise ModelLoadError(f"{where}: external data location {_shown(location)} contains a NUL byte")
    if len(location) > MAX_LOCATION_CHARS:
        raise ModelLoadError(
            f"{where}: external data location {_shown(location)} is longer than the "
            f"{MAX_LOCATION_CHARS} characters a path may have; keep side files next to the model"
        )
    posix, windows = PurePosixPath(location), PureWindowsPath(location)
    if posix.is_absolute() or windows.is_absolute() or windows.drive:
        raise ModelLoadError(
            f"{where}: external data location {_shown(location)} is an absolute path; ONNX "
            f"external data must be a path relative to the model's folder"
        )
    if location.replace("\\", "/").rsplit("/", 1)[-1] in ("", "."):
        raise ModelLoadError(
            f"{where}: external data location {_shown(location)} ends in '/' or '.', so it "
            f"names a folder, not a file; fix the location"
        )
    if ".." in posix.parts or ".." in windows.parts:
        raise ModelLoadError(
            f"{where}: external data location {_shown(location)} contains '..'; refusing to "
            f"read outside the model's folder"
        )


def _problem(error: OSError) -> str:
    """What an OSError met while opening a side file means, and what to do."""
    code = error.errno
    if code == errno.ENOENT:
        return "does not exist; keep the model's side files next to it"
    if code == errno.ENOTDIR:
        return "runs through something that is not a folder; fix the location"
    if code == errno.ENAMETOOLONG:
        return "has a name longer than the file system allows; fix the location"
    if code in (errno.EACCES, errno.EPERM):
        return "cannot be opened: permission denied; make the side files readable"
    if code == errno.ELOOP:
        return f"passes through more than {MAX_SYMLINKS} symbolic links (a loop?); fix the links"
    if code == errno.ENXIO:
        return "is a socket or a device, not a regular file"
    return f"cannot be opened ({error.strerror or error}); check the model's folder"


def _open_problem(error: OSError) -> str:
    """Why an entry could not be opened, when readlink cannot read it as a link either.

    The name is one component opened with O_NOFOLLOW, so an open refused as "a
    link" (ELOOP; EMLINK on FreeBSD) whose link readlink then cannot read means
    the entry was replaced or removed in between.
    """
    if error.errno in (errno.ELOOP, errno.EMLINK):
        return ("changed while it was being opened; load the model again once its folder "
                "stops changing")
    return _problem(error)


def _refused(where: str, location: str, at: str, what: str) -> ModelLoadError:
    place = "" if at in ("", location) else f" (at {_shown(at)})"
    return ModelLoadError(f"{where}: external data file {_shown(location)}{place} {what}")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "is a folder, not a file"
    if stat.S_ISFIFO(mode):
        return "is a FIFO (named pipe), not a regular file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "is a device, not a regular file"
    if stat.S_ISSOCK(mode):
        return "is a socket, not a regular file"
    return "is not a regular file"


def _split(path: str) -> list[str]:
    """Path components; a trailing '/' becomes a last '.' (it asks for a folder)."""
    parts = path.split("/")
    return [part or "." for part in parts]


class _Walk:
    """One location resolved by descriptor under the model folder's descriptor.

    `folders` holds the descriptors of the folders from the root down to the
    current one, so `..` (from a link target) goes back by descriptor instead
    of looking the name up again.
    """

    def __init__(self, root_fd: int, root_names: list[list[str]], location: str, where: str):
        self.root_fd, self.root_names = root_fd, root_names
        self.location, self.where = location, where
        self.folders: list[int] = [root_fd]
        self.walked: list[str] = []
        self.pending: deque[str] = deque(_split(location))
        self.links = 0

    def refuse(self, what: str, name: str = "") -> ModelLoadError:
        return _refused(self.where, self.location, "/".join([*self.walked, name]).strip("/"), what)

    def close(self) -> None:
        for descriptor in self.folders[1:]:
            os.close(descriptor)
        del self.folders[1:]

    def run(self) -> int:
        """The descriptor of the regular file the location leads to (the caller closes it)."""
        try:
            while True:
                name = self.pending.popleft()
                if name == ".":
                    if self.pending:
                        continue
                    raise self.refuse(_kind(stat.S_IFDIR))
                if name == "..":
                    self._up()
                    continue
                opened = self._open(name, last=not self.pending)
                if opened is None:
                    continue
                if not self.pending:
                    return opened
                self.folders.append(opened)
                self.walked.append(name)
                if len(self.walked) > MAX_FOLDER_DEPTH:
                    raise self.refuse(f"lies more than {MAX_FOLDER_DEPTH} folders deep")
        finally:
            self.close()

    def _up(self) -> None:
        if len(self.folders) == 1:
            raise self.refuse(
                "is reached through a symbolic link whose '..' climbs above the model's "
                "folder; refusing to read outside it", "..")
        os.close(self.folders.pop())
        self.walked.pop()

    def _open(self, name: str, last: bool) -> int | None:
        """Open `name` in the current folder without following a link; None if it was a link."""
        if last:
            flags = os.O_RDONLY | os.O_NOFOLLOW | _O_NONBLOCK | _O_NOCTTY | _O_CLOEXEC
        else:
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | _O_NONBLOCK | _O_CLOEXEC
        try:
            return os.open(name, flags, dir_fd=self.folders[-1])
        except OSError as error:
            # Whatever errno a platform gives for "that is a symlink", readlink tells for sure.
            try:
                target = os.readlink(name, dir_fd=self.folders[-1])
            except OSError:
                raise self.refuse(_open_problem(error), name) from None
        self._follow(name, target)
        return None

    def _follow(self, name: str, target: str) -> None:
        """Queue a link's target in place of the link, if it stays in the model's folder."""
        self.links += 1
        if self.links > MAX_SYMLINKS:
            raise self.refuse(_problem(OSError(errno.ELOOP, "loop")), name)
        if not target:
            raise self.refuse("is an empty symbolic link", name)
        parts = _split(target)
        if target.startswith("/"):
            parts = self._inside_root(target, name)
            self.close()
            self.walked.clear()
        self.pending.extendleft(reversed(parts))

    def _inside_root(self, target: str, name: str) -> list[str]:
        """An absolute link target as components under the model folder, or a refusal."""
        names = [part for part in _split(target) if part != "."]
        for root in self.root_names:
            if names[: len(root)] == root:
                rest = names[len(root):]
                if target.endswith("/") or not rest:
                    rest.append(".")
                return rest
        raise self.refuse(
            f"is a symbolic link to {_shown(target)}, outside the model's folder; refusing "
            f"to read it", name)


def _open_walking(root_fd: int, root_names: list[list[str]], location: str, where: str) -> int:
    """Open `location` under root_fd by descriptor; the caller closes the result."""
    return _Walk(root_fd, root_names, location, where).run()


def _open_by_name(base_dir: Path, location: str, where: str) -> int:
    """Fallback without dir_fd (Windows): resolve, check, open, then compare identities.

    A swap between the check and the open is caught by comparing the opened
    file with the checked one; it cannot be prevented by name.
    """
    try:
        root = os.path.realpath(base_dir)
        path = os.path.realpath(os.path.join(root, location))
        inside = os.path.commonpath([root, path]) == root
    except (OSError, ValueError) as error:
        raise _refused(where, location, "", f"cannot be resolved ({error}); fix the location") from None
    if not inside:
        raise _refused(
            where, location, "",
            f"resolves to {path}, outside the model's folder {root} (a symbolic link leads "
            f"out); refusing to read it")
    try:
        checked = os.stat(path)
        if not stat.S_ISREG(checked.st_mode):
            raise _refused(where, location, "", _kind(checked.st_mode))
        descriptor = os.open(path, os.O_RDONLY | _O_BINARY | _O_NOINHERIT | _O_NONBLOCK)
    except OSError as error:
        raise _refused(where, location, "", _problem(error)) from None
    if not os.path.samestat(os.fstat(descriptor), checked):
        os.close(descriptor)
        raise _refused(where, location, "", "changed while it was being opened; load the model again "
                       "once its folder stops changing")
    return descriptor


def _read_exactly(descriptor: int, offset: int, length: int, location: str, where: str) -> bytes:
    """pread until `length` bytes are in; the file shrinking meanwhile is a load error."""
    chunks, wanted = [], length
    while wanted:
        try:
            chunk = os.pread(descriptor, min(wanted, 1 << 30), offset)
        except OSError as error:
            raise _refused(where, location, "", f"cannot be read ({error.strerror or error})") from None
        if not chunk:
            raise _refused(where, location, "", "shrank while it was being read; load the model "
                           "again once its folder stops changing")
        chunks.append(chunk)
        offset, wanted = offset + len(chunk), wanted - len(chunk)
    return b"".join(chunks)


class ExternalDataReader:
    """Reads external tensor values, keeping each side file open once.

    Side files are cached by the identity (device, inode) of the file opened,
    so locations spelled differently that reach one file share one handle.
    """

    def __init__(self, base_dir: Path | None):
        self.base_dir = base_dir
        self._root_fd: int | None = None
        self._root_names: list[list[str]] = []
        self._files: dict[tuple[int, int], int] = {}

    def __enter__(self) -> ExternalDataReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for descriptor in self._files.values():
            os.close(descriptor)
        self._files.clear()
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None

    def _root(self, where: str) -> int:
        """A descriptor of the model's folder (opened once; its own path is the caller's)."""
        if self._root_fd is None:
            try:
                self._root_fd = os.open(self.base_dir, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
            except OSError as error:
                raise ModelLoadError(
                    f"{where}: the model's folder {self.base_dir} holding its external data "
                    f"cannot be opened ({error.strerror or error}); pass base_dir= the folder "
                    f"that holds the side files"
                ) from None
            # Absolute links are accepted when they spell a path into the folder.
            spellings = {os.path.realpath(self.base_dir), os.path.abspath(self.base_dir)}
            self._root_names = [[p for p in s.split("/") if p not in ("", ".")] for s in spellings]
        return self._root_fd

    def open_location(self, location: str, where: str) -> int:
        """The descriptor (cached; the reader closes it) of the regular file `location` leads to,
        after every check of the walk.

        Raises:
            ModelLoadError: the location leaves the folder or does not lead to a regular file.
        """
        check_location(location, where)
        if WALK_BY_DESCRIPTOR:
            descriptor = _open_walking(self._root(where), self._root_names, location, where)
        else:
            descriptor = _open_by_name(self.base_dir, location, where)
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            os.close(descriptor)
            raise _refused(where, location, "", _kind(status.st_mode))
        identity = (status.st_dev, status.st_ino)
        if identity in self._files:
            os.close(descriptor)
        else:
            self._files[identity] = descriptor
        return self._files[identity]

    def locate(self, tensor: TensorProto, where: str) -> tuple[int, ExternalRef, int]:
        """(descriptor of the side file, the parsed reference, the byte length) of an external
        tensor, after every check but the checksum; nothing is read.

        Raises:
            ModelLoadError: no base folder, a location that leaves the folder or
                does not lead to a regular file, or sizes that disagree.
        """
        if self.base_dir is None:
            raise ModelLoadError(
                f"{where}: values are in external file(s) but the model was not loaded from "
                f"a path; pass base_dir= (the folder holding the side files) to load_model"
            )
        ref = external_ref(tensor, where)
        element = element_type(tensor.data_type, where)
        needed = raw_size(element, element_count(tensor, where))
        descriptor = self.open_location(ref.location, where)
        file_size = os.fstat(descriptor).st_size
        length = file_size - ref.offset if ref.length is None else ref.length
        if ref.offset + length > file_size or length < 0:
            raise ModelLoadError(
                f"{where}: external data file {_shown(ref.location)} has {file_size} bytes but "
                f"the tensor asks for {length} bytes at offset {ref.offset}; the side file is "
                f"truncated or belongs to another model"
            )
        if length != needed:
            raise ModelLoadError(
                f"{where}: external data length {length} bytes disagrees with dims "
                f"{list(tensor.dims)} of {element.name}, which need {needed} bytes"
            )
        return descriptor, ref, length

    def read(self, tensor: TensorProto, where: str) -> bytes:
        """The tensor's raw bytes from its side file, after every check (see locate).

        Raises:
            ModelLoadError: as locate, or a checksum that disagrees.
        """
        descriptor, ref, length = self.locate(tensor, where)
        data = _read_exactly(descriptor, ref.offset, length, ref.location, where)
        _check_sum(data, ref, where)
        return data

    def map(self, tensor: TensorProto, where: str, held: dict[str, object]) -> None:
        """Point the tensor at a read-only map of its side file (see mapped.py) instead of reading
        it, after every check of read(); `held` keeps each file's map alive by token while the
        caller maps the model's tensors, so each file is mapped once.

        Raises:
            ModelLoadError: as read().
        """
        descriptor, ref, length = self.locate(tensor, where)
        if not length:
            # Nothing to map (and an empty file cannot be mapped).
            del tensor.external_data[:]
            tensor.ClearField("data_location")
            tensor.raw_data = b""
            return
        token, mapping = mapped.register(self.base_dir, ref.location, descriptor)
        held[token] = mapping
        if ref.checksum:
            with memoryview(mapping) as whole, whole[ref.offset:ref.offset + length] as values:
                _check_sum(values, ref, where)
        mapped.mark(tensor, token, ref.location, ref.offset, length)


def _check_sum(data: bytes | memoryview, ref: ExternalRef, where: str) -> None:
    if ref.checksum and hashlib.sha1(data).hexdigest() != ref.checksum.lower():
        raise ModelLoadError(
            f"{where}: external data in {_shown(ref.location)} fails its SHA-1 checksum; "
            f"the side file was changed after the model was written"
        )


def load_external_tensors(
    tensors: Iterable[tuple[TensorProto, str]], base_dir: Path | None, mapping: bool = False,
    trusted: bool = False,
) -> None:
    """Make the values of every external tensor available: read into its raw_data, or with
    `mapping`, viewed in a read-only map of its side file (see mapped.py).

    Args:
        tensors: (tensor, where) pairs, e.g. from proto.walk.iter_tensors.
        base_dir: the model's folder, under which every location must stay.
        mapping: map side files instead of reading them.
        trusted: the tensors come from a message this process built, whose mapped tensors
            (from an earlier load) stay mapped, or are read into raw_data without `mapping`;
            a serialized model's private map entries are refused as unknown keys.

    Raises:
        ModelLoadError: a tensor's side file cannot be read safely or disagrees
            with the tensor (see ExternalDataReader.read).
    """
    held: dict[str, object] = {}
    with ExternalDataReader(base_dir) as reader:
        for tensor, where in tensors:
            if not uses_external_data(tensor):
                continue
            if trusted and mapped.is_mapped(tensor):
                element = element_type(tensor.data_type, where)
                mapped.check(tensor, raw_size(element, element_count(tensor, where)), where)
                if not mapping:
                    tensor.raw_data = mapped.raw_view(tensor, where).tobytes()
                    del tensor.external_data[:]
                    tensor.ClearField("data_location")
            elif mapping:
                reader.map(tensor, where, held)
            else:
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
