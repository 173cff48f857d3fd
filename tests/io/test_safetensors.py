"""Our safetensors writer against the safetensors library's own reader (the oracle)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import onnxtrain
from onnxtrain._io.safetensors import write_safetensors

safetensors_numpy = pytest.importorskip("safetensors.numpy")
safe_open = pytest.importorskip("safetensors").safe_open


def test_every_dtype_round_trips_through_the_reference_reader(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"f32": rng.normal(size=(3, 5)).astype(np.float32), "f16": rng.normal(size=7).astype(np.float16),
               "f64": rng.normal(size=(2, 2, 2)), "i64": np.arange(-3, 3, dtype=np.int64),
               "u8": np.arange(9, dtype=np.uint8).reshape(3, 3), "flags": np.array([True, False, True]),
               "empty": np.zeros((0, 4), np.float32), "scalar": np.float32(2.5),
               "transposed": rng.normal(size=(4, 3)).astype(np.float32).T,
               "big_endian": np.arange(5, dtype=">i4")}
    path = tmp_path / "t.safetensors"
    write_safetensors(path, tensors, {"format": "pt"})
    loaded = safetensors_numpy.load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(loaded[name], np.asarray(value), err_msg=name)
        assert loaded[name].shape == np.shape(value)
    with safe_open(str(path), framework="numpy") as file:
        assert file.metadata() == {"format": "pt"}


def test_bfloat16_is_written_with_its_bits(tmp_path):
    value = np.array([1.5, -2.0, 3.25], ml_dtypes.bfloat16)
    path = tmp_path / "b.safetensors"
    write_safetensors(path, {"b": value})
    header_size = int.from_bytes(path.read_bytes()[:8], "little")
    assert b'"dtype":"BF16"' in path.read_bytes()[8:8 + header_size]
    assert path.read_bytes()[8 + header_size:] == value.tobytes()


def test_a_dtype_without_a_name_in_the_format_is_refused(tmp_path):
    with pytest.raises(onnxtrain.ExportError, match="complex64"):
        write_safetensors(tmp_path / "c.safetensors", {"c": np.zeros(2, np.complex64)})
    assert not (tmp_path / "c.safetensors").exists()
