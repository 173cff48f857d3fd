"""Checkpoints from strangers: malformed manifests and zip entries that lie about their size.

Every file here must be refused with a ModelLoadError naming the file and the part at fault
(the manifest field, the array, the zip entry), or load exactly what it declares; never a raw
exception, and never more memory than the declared arrays take.
"""

from __future__ import annotations

import functools
import json
import struct
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnxtrain import ModelLoadError
from onnxtrain.state import checkpoint
from onnxtrain.state.checkpoint import load_checkpoint, parse_manifest, save_checkpoint
from support import peak_memory

PROBE = Path(__file__).with_name("checkpoint_memory_probe.py")
W = np.arange(8, dtype=np.float32)


# ---- building files: a valid checkpoint's parts, and zips written byte by byte ----

@functools.cache
def _valid_parts() -> tuple[bytes, dict[str, bytes]]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "valid.ckpt"
        save_checkpoint(path, {"W": W, "V": np.arange(6).reshape(2, 3)}, jax.random.key(3), {"model": "m"})
        with zipfile.ZipFile(path) as archive:
            entries = {name: archive.read(name) for name in archive.namelist()}
    return entries.pop(checkpoint.MANIFEST_ENTRY), entries


def _parts() -> tuple[dict[str, Any], dict[str, bytes]]:
    """(manifest, entries) of a valid checkpoint holding W (float32[8]) and V (int64[2, 3])."""
    manifest, entries = _valid_parts()
    return json.loads(manifest), dict(entries)


@dataclass
class Entry:
    """A zip entry as its bytes lie in the file, and what the zip's directory says of them."""

    name: str
    stored: bytes
    method: int = zipfile.ZIP_STORED
    file_size: int | None = None  # default: len(stored) (right for stored entries only)
    crc: int | None = None        # default: crc32(stored)
    compress_size: int | None = None
    flags: int = 0


def deflated(name: str, data: bytes) -> Entry:
    packer = zlib.compressobj(6, zlib.DEFLATED, -15)
    return Entry(name, packer.compress(data) + packer.flush(), zipfile.ZIP_DEFLATED, len(data), zlib.crc32(data))


def raw_zip(entries: list[Entry]) -> bytes:
    """A zip holding `entries` as given: sizes, checksums and flags are written as they are,
    true or not (zipfile would write the true ones). Sizes past 4 GiB get a zip64 field."""
    body, directory = bytearray(), bytearray()
    for entry in entries:
        name = entry.name.encode()
        usize = len(entry.stored) if entry.file_size is None else entry.file_size
        csize = len(entry.stored) if entry.compress_size is None else entry.compress_size
        crc = zlib.crc32(entry.stored) if entry.crc is None else entry.crc
        large = [size for size in (usize, csize) if size >= 0xFFFFFFFF]
        extra = struct.pack("<HH", 1, 8 * len(large)) + b"".join(struct.pack("<Q", s) for s in large) if large else b""
        fields = (entry.flags, entry.method, 0, 0x21, crc, min(csize, 0xFFFFFFFF), min(usize, 0xFFFFFFFF))
        offset = len(body)
        body += struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, *fields, len(name), 0) + name + entry.stored
        directory += struct.pack("<IHH", 0x02014B50, 45, 45) + struct.pack("<HHHHIII", *fields)
        directory += struct.pack("<HHHHHII", len(name), len(extra), 0, 0, 0, 0, offset) + name + extra
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(directory), len(body), 0)
    return bytes(body + directory + end)


def _write(path: Path, manifest: Any, entries: dict[str, bytes] | list[Entry]) -> Path:
    """A checkpoint at `path`: `manifest` (JSON-encoded unless bytes) plus stored `entries`."""
    raw = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    listed = entries if isinstance(entries, list) else [Entry(name, data) for name, data in entries.items()]
    path.write_bytes(raw_zip([*listed, Entry(checkpoint.MANIFEST_ENTRY, raw)]))
    return path


def _refused(path: Path, *parts: str) -> str:
    """Load `path`, expecting a ModelLoadError naming the file and each of `parts`."""
    with pytest.raises(ModelLoadError) as caught:
        load_checkpoint(path)
    message = str(caught.value)
    for part in (str(path), *parts):
        assert part in message, f"{part!r} not in: {message}"
    return message


def test_raw_zip_writes_what_zipfile_reads(tmp_path):
    """Guards every test below: the hand-written zip of a valid checkpoint loads exactly."""
    manifest, entries = _parts()
    values, key, metadata = load_checkpoint(_write(tmp_path / "c.ckpt", manifest, entries))
    np.testing.assert_array_equal(values["W"], W)
    np.testing.assert_array_equal(values["V"], np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(jax.random.key(3)))
    assert metadata == {"model": "m"}


# ---- item 8: malformed manifests ----

def _array(manifest: dict, **changes: Any) -> dict:
    manifest["arrays"][0].update(changes)
    return manifest


def _without(document: dict, key: str) -> dict:
    del document[key]
    return document


MALFORMED = {
    # shapes
    "shape float": (lambda m: _array(m, shape=[1.5]), "arrays[0].shape[0]"),
    "shape string": (lambda m: _array(m, shape="ab"), "arrays[0].shape"),
    "shape null": (lambda m: _array(m, shape=None), "arrays[0].shape"),
    "shape negative": (lambda m: _array(m, shape=[-8]), "arrays[0].shape[0]"),
    "shape negative with a zero": (lambda m: _array(m, shape=[0, -1]), "arrays[0].shape[1]"),
    "shape 2**70": (lambda m: _array(m, shape=[2**70]), "arrays[0].shape"),
    "shape past memory with a zero dim": (lambda m: _array(m, shape=[0, 2**40, 2**40]), "arrays[0].shape"),
    "shape boolean": (lambda m: _array(m, shape=[True]), "arrays[0].shape[0]"),
    "shape nested": (lambda m: _array(m, shape=[[8]]), "arrays[0].shape[0]"),
    "shape of 33 dims": (lambda m: _array(m, shape=[1] * 33), "arrays[0].shape"),
    # the document and its lists
    "manifest a list": (lambda m: [m], "is not an onnxtrain checkpoint"),
    "manifest a string": (lambda m: "manifest", "is not an onnxtrain checkpoint"),
    "manifest null": (lambda m: None, "is not an onnxtrain checkpoint"),
    "version true": (lambda m: {**m, "version": True}, "is not an onnxtrain checkpoint"),
    "version 1.0": (lambda m: {**m, "version": 1.0}, "is not an onnxtrain checkpoint"),
    "arrays a number": (lambda m: {**m, "arrays": 5}, "arrays"),
    "arrays an object": (lambda m: {**m, "arrays": {"W": m["arrays"][0]}}, "arrays"),
    "array a string": (lambda m: {**m, "arrays": ["W"]}, "arrays[0]"),
    # missing keys
    "no arrays": (lambda m: _without(m, "arrays"), "arrays is missing"),
    "no key": (lambda m: _without(m, "key"), "key is missing"),
    "no name": (lambda m: {**m, "arrays": [_without(m["arrays"][0], "name")]}, "arrays[0].name is missing"),
    "no entry": (lambda m: {**m, "arrays": [_without(m["arrays"][0], "entry")]}, "arrays[0].entry is missing"),
    "no dtype": (lambda m: {**m, "arrays": [_without(m["arrays"][0], "dtype")]}, "arrays[0].dtype is missing"),
    "no shape": (lambda m: {**m, "arrays": [_without(m["arrays"][0], "shape")]}, "arrays[0].shape is missing"),
    "no key impl": (lambda m: {**m, "key": _without(m["key"], "impl")}, "key.impl is missing"),
    # wrong types
    "name a number": (lambda m: _array(m, name=5), "arrays[0].name"),
    "entry a list": (lambda m: _array(m, entry=["arrays/0.bin"]), "arrays[0].entry"),
    "dtype a number": (lambda m: _array(m, dtype=5), "arrays[0].dtype"),
    "dtype unknown": (lambda m: _array(m, dtype="float33"), "arrays[0].dtype"),
    "key a list": (lambda m: {**m, "key": [m["key"]]}, "key"),
    "key impl a number": (lambda m: {**m, "key": {**m["key"], "impl": 5}}, "key.impl"),
    "key shape huge": (lambda m: {**m, "key": {**m["key"], "shape": [2**20]}}, "key.shape"),
    "metadata a list": (lambda m: {**m, "metadata": ["model", "m"]}, "metadata"),
    "metadata a number value": (lambda m: {**m, "metadata": {"model": 1}}, 'metadata["model"]'),
    "metadata a null value": (lambda m: {**m, "metadata": {"model": None}}, 'metadata["model"]'),
    # names and entries
    "names repeat": (lambda m: _array(m, name="V"), "arrays[1].name"),
    "entries repeat": (lambda m: _array(m, entry=m["arrays"][1]["entry"]), "arrays[1].entry"),
    "entry is the key's": (lambda m: _array(m, entry="key.bin"), "arrays[0].entry"),
    "entry is the manifest": (lambda m: _array(m, entry="manifest.json"), "arrays[0].entry"),
}


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_malformed_manifests_are_refused_naming_the_field(tmp_path, case):
    manifest, entries = _parts()
    change, field = MALFORMED[case]
    _refused(_write(tmp_path / "c.ckpt", change(manifest), entries), field)


@pytest.mark.parametrize("raw, problem", [
    (b"[" * 100_000 + b"]" * 100_000, "nests JSON too deeply"),
    (b'{"arrays": [], "arrays": []}', "appears twice"),
    (b'{"format": "onnxtrain-checkpoint", "version": 1, "arrays": [{"shape": [NaN]}]}', "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    (b"", "not valid JSON"),
    (b'{"format": "onnxtrain-checkpoint", "version": 1, "arrays": [', "not valid JSON"),
], ids=["deep nesting", "repeated key", "NaN", "not utf-8", "empty", "cut short"])
def test_manifests_that_are_not_json_objects_are_refused(tmp_path, raw, problem):
    _, entries = _parts()
    _refused(_write(tmp_path / "c.ckpt", raw, entries), "manifest.json", problem)


def test_parse_manifest_gives_typed_frozen_specs(tmp_path):
    manifest, _ = _parts()
    parsed = parse_manifest(json.dumps(manifest).encode(), "checkpoint 'x'")
    assert [(a.name, a.entry, a.dtype, a.shape, a.nbytes) for a in parsed.arrays] == [
        ("W", "arrays/0.bin", np.dtype(np.float32), (8,), 32), ("V", "arrays/1.bin", np.dtype(np.int64), (2, 3), 48)]
    assert parsed.key_impl == str(jax.random.key_impl(jax.random.key(0))) and dict(parsed.metadata) == {"model": "m"}
    with pytest.raises(AttributeError):
        parsed.arrays[0].shape = (1,)
    with pytest.raises(TypeError):
        parsed.metadata["model"] = "other"


@pytest.mark.parametrize("change, part", [
    (lambda m: {**m, "key": {**m["key"], "impl": "md5"}}, "md5"),
    (lambda m: {**m, "key": {**m["key"], "dtype": "float32"}}, "PRNG key"),
    (lambda m: {**m, "key": {**m["key"], "shape": [1, 2]}}, "one key"),
    (lambda m: {**m, "key": {**m["key"], "shape": [4]}}, "PRNG key"),
], ids=["unknown impl", "float key", "a batch of keys", "misshapen key"])
def test_keys_jax_cannot_use_are_refused(tmp_path, change, part):
    manifest, entries = _parts()
    manifest = change(manifest)
    spec = manifest["key"]
    entries["key.bin"] = bytes(np.dtype(spec["dtype"]).itemsize * int(np.prod(spec["shape"])))
    _refused(_write(tmp_path / "c.ckpt", manifest, entries), part)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
FIELDS = st.sampled_from([("arrays",), ("key",), ("metadata",), ("arrays", 0), ("arrays", 0, "shape"),
                          ("arrays", 0, "shape", 0), ("arrays", 0, "dtype"), ("arrays", 0, "name"),
                          ("arrays", 0, "entry"), ("key", "shape"), ("key", "impl"), ("key", "dtype")])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=FIELDS, value=JSON_VALUES)
def test_any_value_in_any_field_loads_or_is_refused_as_a_model_load_error(tmp_path, field, value):
    manifest, entries = _parts()
    parent = manifest
    for step in field[:-1]:
        parent = parent[step]
    parent[field[-1]] = value
    path = _write(tmp_path / "c.ckpt", manifest, entries)
    try:
        load_checkpoint(path)
    except ModelLoadError as error:
        assert str(path) in str(error)


# ---- zip entries: missing, repeated, encrypted, compressed otherwise, or lying about sizes ----

def test_an_array_whose_entry_is_missing_is_refused(tmp_path):
    manifest, entries = _parts()
    del entries["arrays/1.bin"]
    _refused(_write(tmp_path / "c.ckpt", manifest, entries), "array 'V'", "arrays/1.bin")
    manifest, entries = _parts()
    _refused(_write(tmp_path / "k.ckpt", manifest, _without(entries, "key.bin")), "PRNG key", "key.bin")
    (tmp_path / "m.ckpt").write_bytes(raw_zip([Entry("arrays/0.bin", W.tobytes())]))
    _refused(tmp_path / "m.ckpt", "manifest", "manifest.json")


def test_a_zip_with_two_entries_of_one_name_is_refused(tmp_path):
    manifest, entries = _parts()
    listed = [Entry(name, data) for name, data in entries.items()] + [Entry("arrays/0.bin", bytes(32))]
    _refused(_write(tmp_path / "c.ckpt", manifest, listed), "arrays/0.bin", "several entries")


@pytest.mark.parametrize("method", [zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA, 99])
def test_entries_compressed_other_than_by_deflate_are_refused_unread(tmp_path, method):
    """bzip2 and lzma inflate whole blocks per read, so zipfile cannot bound them."""
    manifest, entries = _parts()
    listed = [Entry(name, data, method=method if name == "arrays/0.bin" else 0) for name, data in entries.items()]
    _refused(_write(tmp_path / "c.ckpt", manifest, listed), "arrays/0.bin", f"compression method {method}")


def test_encrypted_entries_are_refused(tmp_path):
    manifest, entries = _parts()
    listed = [Entry(name, data, flags=1 if name == "arrays/1.bin" else 0) for name, data in entries.items()]
    _refused(_write(tmp_path / "c.ckpt", manifest, listed), "arrays/1.bin", "encrypted")


def test_deflated_checkpoints_load(tmp_path):
    """A checkpoint recompressed by a zip tool is still a checkpoint."""
    manifest, entries = _parts()
    listed = [deflated(name, data) for name, data in entries.items()]
    values, _, _ = load_checkpoint(_write(tmp_path / "c.ckpt", manifest, listed))
    np.testing.assert_array_equal(values["W"], W)


@pytest.mark.parametrize("entry, part", [
    (lambda data: deflated("arrays/0.bin", data + bytes(1 << 20)), "oversized"),
    (lambda data: Entry("arrays/0.bin", data + b"\0"), "oversized"),
    (lambda data: Entry("arrays/0.bin", data[:-4]), "truncated"),
    (lambda data: deflated("arrays/0.bin", data[:-1]), "truncated"),
    (lambda data: Entry("arrays/0.bin", data, file_size=16), "stored uncompressed"),
    (lambda data: Entry("arrays/0.bin", data, compress_size=1 << 40), "past the end"),
    (lambda data: Entry("arrays/0.bin", zlib.compress(data)[2:], zipfile.ZIP_DEFLATED, file_size=1 << 40),
     "more than deflate can produce"),
    (lambda data: Entry("arrays/0.bin", data, crc=0), "CRC"),
], ids=["inflates past", "stored longer", "stored shorter", "inflates short", "stored sizes differ",
        "past the file's end", "past deflate's ratio", "bad crc"])
def test_entries_whose_size_disagrees_with_the_manifest_are_refused(tmp_path, entry, part):
    manifest, entries = _parts()
    listed = [entry(data) if name == "arrays/0.bin" else Entry(name, data) for name, data in entries.items()]
    _refused(_write(tmp_path / "c.ckpt", manifest, listed), part)


def test_a_declared_size_past_deflates_ratio_is_refused_before_allocating(tmp_path):
    """A 1 KB file whose zip directory and manifest agree on a terabyte: refused unread."""
    manifest, entries = _parts()
    _array(manifest, shape=[1 << 38])
    entries["arrays/0.bin"] = b"\0" * 100
    listed = [Entry(name, data, zipfile.ZIP_DEFLATED, file_size=1 << 40) if name == "arrays/0.bin"
              else Entry(name, data) for name, data in entries.items()]
    _refused(_write(tmp_path / "c.ckpt", manifest, listed), "arrays/0.bin", "more than deflate can produce")


def test_an_entry_that_inflates_past_what_the_zip_records_is_read_only_that_far(tmp_path):
    """The zip says 32 bytes (with their CRC); the stream holds a megabyte more. Reading stops
    at the declared size: W loads, the rest is never inflated."""
    manifest, entries = _parts()
    longer = deflated("arrays/0.bin", W.tobytes() + bytes(1 << 20))
    longer.file_size, longer.crc = W.nbytes, zlib.crc32(W.tobytes())
    listed = [longer if name == "arrays/0.bin" else Entry(name, data) for name, data in entries.items()]
    values, _, _ = load_checkpoint(_write(tmp_path / "c.ckpt", manifest, listed))
    np.testing.assert_array_equal(values["W"], W)


# ---- item 3: zip bombs, measured in a fresh process ----

DECLARED = 32 << 20            # what the manifest declares: float32[8M]
INFLATED = 512 << 20           # what the bomb's stream inflates to
LIMIT = 2 * DECLARED


@pytest.fixture(scope="module")
def bomb_stream() -> tuple[bytes, int]:
    """INFLATED zero bytes, deflated quickly (to about 2 MB), and the CRC of DECLARED zeros."""
    packer, chunk = zlib.compressobj(1, zlib.DEFLATED, -15), bytes(8 << 20)
    stream = b"".join(packer.compress(chunk) for _ in range(INFLATED // len(chunk))) + packer.flush()
    return stream, zlib.crc32(bytes(DECLARED))


def _bomb(path: Path, stream: bytes, file_size: int, crc: int) -> Path:
    manifest, entries = _parts()
    _array(manifest, shape=[DECLARED // 4])
    bomb = Entry("arrays/0.bin", stream, zipfile.ZIP_DEFLATED, file_size=file_size, crc=crc)
    return _write(path, manifest, [bomb] + [Entry(n, d) for n, d in entries.items() if n != "arrays/0.bin"])


@pytest.mark.slow  # starts processes, deflates half a gigabyte
@pytest.mark.parametrize("recorded", ["inflated size", "declared size, true crc", "declared size, wrong crc"])
def test_zip_bombs_cost_at_most_their_declared_size(tmp_path, bomb_stream, recorded):
    """A 2 MB checkpoint whose entry inflates to 512 MiB while its manifest declares 32 MiB:
    peak memory grows by less than twice the declared size, whatever the zip records."""
    stream, declared_crc = bomb_stream
    file_size, crc = (INFLATED, 0) if recorded == "inflated size" else (DECLARED, declared_crc)
    if recorded.endswith("wrong crc"):
        crc ^= 1
    path = _bomb(tmp_path / "bomb.ckpt", stream, file_size, crc)
    assert path.stat().st_size < 3 << 20
    report = peak_memory.run_probe(PROBE, str(path))
    assert report["peak_growth"] < LIMIT, report
    if recorded == "declared size, true crc":
        assert report["error"] is None and report["loaded"] == {"W": [DECLARED // 4], "V": [2, 3]}
    else:
        assert report["error"].startswith("ModelLoadError") and str(path) in report["error"], report
