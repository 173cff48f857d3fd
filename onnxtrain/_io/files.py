"""Writing a file an export produces: atomically (onnxtrain.state.atomic), an OSError said as
the ExportError every export raises."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from onnxtrain.errors import ExportError
from onnxtrain.state.atomic import write_atomically


def write_export(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Replace `path` by what write(file) writes, atomically.

    Raises:
        ExportError: the file cannot be written (the folder is missing or read-only, the disk full).

    Example:
        >>> write_export("adapter_config.json", lambda file: file.write(b"{}"))
    """
    try:
        write_atomically(Path(path), write)
    except OSError as error:
        raise ExportError(f"cannot write {path}: {error.strerror or error}") from None
