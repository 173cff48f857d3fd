"""Checkpoints on their own: exact round trips of every dtype, and the files they refuse."""

from __future__ import annotations

import zipfile

import jax
import ml_dtypes
import numpy as np
import pytest

from onnxtrain import ModelLoadError
from onnxtrain.state.checkpoint import load_checkpoint, save_checkpoint

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
          np.int64, np.int32, np.uint8, np.bool_]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_checkpoint_round_trips_bits(tmp_path, dtype):
    rng = np.random.default_rng(0)
    value = rng.standard_normal((3, 4)).astype(dtype)
    key = jax.random.key(11)
    path = tmp_path / "ckpt.zip"
    save_checkpoint(path, {"v": value, "scalar": np.array(5, np.int64)}, key, {"model": "m"})
    values, restored_key, metadata = load_checkpoint(path)
    assert values["v"].dtype == np.dtype(dtype)
    assert values["v"].tobytes() == value.tobytes()
    assert values["scalar"].shape == () and values["scalar"] == 5
    assert metadata == {"model": "m"}
    np.testing.assert_array_equal(jax.random.key_data(restored_key), jax.random.key_data(key))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.zip"]


def test_checkpoint_rejects_other_files(tmp_path):
    path = tmp_path / "not.zip"
    path.write_bytes(b"hello")
    with pytest.raises(ModelLoadError, match="cannot read checkpoint"):
        load_checkpoint(path)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("manifest.json", '{"format": "other"}')
    with pytest.raises(ModelLoadError, match="not an onnxtrain checkpoint"):
        load_checkpoint(path)


def test_truncated_checkpoint_is_refused(tmp_path):
    path = tmp_path / "c.zip"
    save_checkpoint(path, {"v": np.ones(8, np.float32)}, jax.random.key(0))
    with zipfile.ZipFile(path) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    entries["arrays/0.bin"] = entries["arrays/0.bin"][:-4]
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    with pytest.raises(ModelLoadError, match="truncated"):
        load_checkpoint(path)
