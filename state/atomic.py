"""Files replaced atomically: written beside the target, flushed to disk, then renamed over it.

A reader sees the old file or the new one, never a torn mix, whenever the writer dies. Every
writer of onnxtrain's files (models, their side files, checkpoints) goes through here.

Temporaries are named `.{target name}.{writer pid}.{random}.tmp`, so one left behind by a
killed writer is recognisable: the next save of the same target removes those whose writer
is no longer running.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

_SUFFIX = ".tmp"
# What stands between `.{target name}.` and `.tmp` in a temporary's name.
_TAIL = re.compile(r"(?P<pid>[0-9]{1,10})\.[0-9a-f]{12}")


def _prefix(target: Path) -> str:
    return f".{target.name}."


def _writer_is_alive(pid: int) -> bool:
    """Whether process `pid` may still be writing (when unsure: yes, so its file is kept)."""
    if pid == os.getpid() or os.name != "posix":
        # Another thread of this process may be saving; and os.kill(pid, 0) only probes on POSIX.
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True
    return True


def stale_temporaries(target: Path) -> Iterator[Path]:
    """The temporaries of `target` whose writer process is gone."""
    prefix = _prefix(target)
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return
    for entry in entries:
        name = entry.name
        if not (name.startswith(prefix) and name.endswith(_SUFFIX)):
            continue
        match = _TAIL.fullmatch(name[len(prefix):-len(_SUFFIX)])
        if match and entry.is_file(follow_symlinks=False) and not _writer_is_alive(int(match["pid"])):
            yield Path(entry.path)


def remove_stale_temporaries(target: Path) -> None:
    """Delete what killed writers of `target` left behind (one that cannot be deleted stays)."""
    for temporary in stale_temporaries(target):
        try:
            temporary.unlink(missing_ok=True)
        except OSError:
            continue


def temporary_beside(target: Path) -> Path:
    """A new empty file next to `target`, named after it and this process, after removing
    the stale temporaries of `target`.

    Created with the usual (umask) permissions: tempfile.mkstemp would make it owner-only,
    and the rename would carry that over to the saved file.

    Raises:
        OSError: the folder cannot be written.
    """
    target = Path(target)
    remove_stale_temporaries(target)
    while True:
        candidate = target.parent / f"{_prefix(target)}{os.getpid()}.{secrets.token_hex(6)}{_SUFFIX}"
        try:
            open(candidate, "xb").close()
            return candidate
        except FileExistsError:
            continue


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` and flush it to disk."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _sync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename) to disk, where the platform allows it."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    try:
        descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        # Some file systems refuse to sync a folder; the rename itself is still atomic.
        pass
    finally:
        os.close(descriptor)


def replace(temporary: Path, target: Path) -> None:
    """Rename a fully written and synced `temporary` over `target`, durably.

    Raises:
        OSError: the rename failed (`target` is then unchanged).
    """
    os.replace(temporary, target)
    _sync_folder(Path(target).parent)


def write_atomically(target: Path, write: Callable[[BinaryIO], None]) -> None:
    """Replace `target` by what `write(file)` writes, atomically and durably.

    Whatever `write` raises, `target` is unchanged and the temporary is removed.

    Args:
        target: the file to create or replace.
        write: writes the new content to the binary file it is given (seekable, at offset 0).

    Raises:
        OSError: the folder cannot be written; anything `write` raises.
    """
    target = Path(target)
    temporary = temporary_beside(target)
    try:
        with open(temporary, "r+b") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
