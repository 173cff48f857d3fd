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


def _rewritten(path, change) -> None:
    with zipfile.ZipFile(path) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    change(entries)
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)


@pytest.mark.parametrize("expected, part", [
    ({"v": jax.ShapeDtypeStruct((4,), np.float32)}, "float32[8], the model's is float32[4]"),
    ({"v": jax.ShapeDtypeStruct((8,), np.float16)}, "float32[8], the model's is float16[8]"),
    ({"w": jax.ShapeDtypeStruct((8,), np.float32)}, "holds ['v'] but this model's state is ['w']"),
    ({}, "holds ['v'] but this model's state is []"),
], ids=["shape", "dtype", "name", "none"])
def test_a_checkpoint_of_other_arrays_than_expected_is_refused_unread(tmp_path, expected, part):
    """The manifest is compared with the model's state before any array is read: here the
    array's entry is truncated too, and the comparison is what refuses it."""
    path = tmp_path / "c.ckpt"
    save_checkpoint(path, {"v": np.ones(8, np.float32)}, jax.random.key(0))
    _rewritten(path, lambda entries: entries.update({"arrays/0.bin": entries["arrays/0.bin"][:4]}))
    with pytest.raises(ModelLoadError, match="truncated"):
        load_checkpoint(path)
    with pytest.raises(ModelLoadError) as caught:
        load_checkpoint(path, {name: value for name, value in expected.items()})
    assert part in str(caught.value) and str(path) in str(caught.value)


@pytest.mark.slow  # builds a trainer
def test_a_checkpoint_with_another_prng_implementation_is_refused(tmp_path):
    """The trainer draws from a threefry key; the checkpoint holds an rbg key. Loading would
    switch the trainer's random stream to another generator without a word: refused, naming
    both, and the advice it gives works."""
    import onnxtrain
    from support.training_models import assert_state_equal, linreg_model, snapshot

    trainer = onnxtrain.Trainer(linreg_model(), seed=1)
    assert str(jax.random.key_impl(jax.random.key(0))) == "threefry2x32"
    saved = tmp_path / "threefry.ckpt"
    trainer.save_checkpoint(saved)
    values, _, metadata = load_checkpoint(saved)
    values = {name: value + 1 if value.dtype == np.float32 else value for name, value in values.items()}
    path = tmp_path / "rbg.ckpt"
    save_checkpoint(path, values, jax.random.key(5, impl="rbg"), metadata)
    before = snapshot(trainer)
    with pytest.raises(ModelLoadError) as caught:
        trainer.load_checkpoint(path)
    for part in (str(path), "rbg", "threefry2x32", "jax_default_prng_impl"):
        assert part in str(caught.value)
    assert_state_equal(trainer, before)
    trainer.load_checkpoint(saved)  # its own kind of key still loads

    default = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", "rbg")
    try:
        resumed = onnxtrain.Trainer(linreg_model(), seed=1)
        resumed.load_checkpoint(path)
    finally:
        jax.config.update("jax_default_prng_impl", default)
    assert_state_equal(resumed, {name: values[name] for name in resumed.state})
    assert str(jax.random.key_impl(resumed._store.key)) == "rbg"
