"""StateStore and checkpoints on their own: copies, atomic commits, exact round trips, bad files."""

from __future__ import annotations

import zipfile

import jax
import ml_dtypes
import numpy as np
import pytest

from onnxtrain import InputError, ModelLoadError
from onnxtrain.state.checkpoint import load_checkpoint, save_checkpoint
from onnxtrain.state.store import StateStore

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
          np.int64, np.int32, np.uint8, np.bool_]


def _store() -> StateStore:
    values = {"W": np.arange(6, dtype=np.float32).reshape(2, 3), "T": np.array(3, np.int64)}
    return StateStore(values, jax.random.key(7))


def test_view_is_read_only_and_hands_out_copies():
    store = _store()
    view = store.view(("W", "T"))
    with pytest.raises(TypeError):
        view["W"] = np.zeros((2, 3))
    first = view["W"]
    store.commit({"W": store.values["W"] + 1, "T": store.values["T"]})
    np.testing.assert_array_equal(first, np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(view["W"], np.arange(6).reshape(2, 3) + 1)
    assert view["T"].dtype == np.int64


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_holds_its_own_copy_of_every_dtype_given(dtype):
    """Host arrays go to the device as copies (a caller reusing its buffer changes nothing),
    with their dtype kept exactly, 64-bit and ml_dtypes included."""
    given = np.arange(6).reshape(2, 3).astype(dtype)
    expected = given.copy()
    store = StateStore({"W": given, "n": 3, "x": 2.5}, jax.random.key(0))
    given[...] = given[0, 1]
    assert store.values["W"].dtype == dtype
    np.testing.assert_array_equal(np.asarray(store.values["W"]), expected)
    assert (store.values["n"].dtype, store.values["x"].dtype) == (np.int64, np.float64)


def test_commit_requires_every_variable():
    store = _store()
    with pytest.raises(ValueError):
        store.commit({"W": store.values["W"]})
    assert set(store.values) == {"W", "T"}


@pytest.mark.parametrize("value, message", [
    (np.zeros((3, 2)), "shape"), ("text", "str"), (2.5, "int64"),
])
def test_set_refuses_what_does_not_fit(value, message):
    store = _store()
    name = "T" if message in ("int64", "str") else "W"
    before = dict(store.values)
    with pytest.raises(InputError, match=message if message != "str" else "<U4"):
        store.set(name, value)
    assert store.values == before


def test_set_rounds_floats_and_keeps_dtype():
    store = _store()
    store.set("W", np.full((2, 3), 0.1))
    assert store.values["W"].dtype == np.float32
    np.testing.assert_array_equal(store.values["W"], np.full((2, 3), np.float32(0.1)))
    store.set("T", 9)
    assert int(store.values["T"]) == 9 and store.values["T"].dtype == np.int64


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
