"""Save and restore a StateStore: a zip of raw array bytes plus a JSON manifest.

No pickle: a checkpoint is data only, safe to load from anywhere. Every dtype
jax holds (bfloat16 and the 8-bit floats included) round-trips bit for bit,
and zip64 lifts any size limit. Writes are atomic (temp file, then rename).
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from onnxtrain.errors import ExportError, ModelLoadError

FORMAT = "onnxtrain-checkpoint"
VERSION = 1


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


def save_checkpoint(path: str | os.PathLike, values: Mapping[str, Any], key: jax.Array,
                    metadata: Mapping[str, str] | None = None) -> None:
    """Write `values` (name -> array), the PRNG key and string metadata to `path`."""
    path = Path(path)
    key_data = np.asarray(jax.random.key_data(key))
    manifest = {
        "format": FORMAT, "version": VERSION,
        "key": {"impl": str(jax.random.key_impl(key)), "dtype": key_data.dtype.name,
                "shape": list(key_data.shape)},
        "metadata": dict(metadata or {}),
        "arrays": [],
    }
    try:
        descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
        with os.fdopen(descriptor, "wb") as file, zipfile.ZipFile(file, "w", allowZip64=True) as archive:
            for index, (name, value) in enumerate(values.items()):
                array = np.asarray(value)
                entry = f"arrays/{index}.bin"
                archive.writestr(entry, array.tobytes())
                manifest["arrays"].append({"name": name, "entry": entry, "dtype": array.dtype.name,
                                           "shape": list(array.shape)})
            archive.writestr("key.bin", key_data.tobytes())
            archive.writestr("manifest.json", json.dumps(manifest, indent=1))
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, path)
    except OSError as error:
        if "temporary" in locals() and os.path.exists(temporary):
            os.unlink(temporary)
        raise ExportError(f"cannot write checkpoint {str(path)!r}: {error}") from error


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def load_checkpoint(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], jax.Array, dict[str, str]]:
    """(values, key, metadata) as saved by save_checkpoint."""
    try:
        with zipfile.ZipFile(path) as archive:
            manifest = json.loads(archive.read("manifest.json"))
            if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
                raise ModelLoadError(f"{str(path)!r} is not an onnxtrain checkpoint (version {VERSION})")
            values = {}
            for item in manifest["arrays"]:
                dtype, shape = _dtype(item["dtype"]), tuple(item["shape"])
                data = archive.read(item["entry"])
                if len(data) != dtype.itemsize * int(np.prod(shape)):
                    raise ModelLoadError(f"checkpoint {str(path)!r}: array {item['name']!r} is truncated")
                values[item["name"]] = np.frombuffer(data, dtype).reshape(shape).copy()
            spec = manifest["key"]
            key_data = np.frombuffer(archive.read("key.bin"), _dtype(spec["dtype"])).reshape(spec["shape"])
            key = jax.random.wrap_key_data(key_data, impl=spec["impl"])
            return values, key, dict(manifest.get("metadata", {}))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as error:
        raise ModelLoadError(f"cannot read checkpoint {str(path)!r}: {error}") from error
