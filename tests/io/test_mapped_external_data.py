"""Side files are mapped, not read: frozen weights live once, in the map, and save streams them.

Oracles: the bytes written into the side file by hand (and onnx's own loader), onnxruntime
running the same file, the address range of the map (an array or a device buffer inside it
is a view of the file, not a copy), and the in-memory load (map_external_data=False).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import jax
import numpy as np
import onnx
import optax
import pytest
from onnx import helper, numpy_helper

import onnxtrain
import onnxtrain._io.model as model_io
from onnxtrain import ExportError, ModelLoadError, load_model, save_model
from onnxtrain._io import mapped
from onnxtrain.proto import ModelProto, TensorProto
from onnxtrain.translate.tensors import tensor_to_numpy

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 8)).astype(np.float32)
B = RNG.standard_normal(8).astype(np.float32)
# Where the hand-written side file holds them: B at an offset JAX cannot use in place, W at one it can.
OFFSETS = {"B": 4, "W": 64}


def _external(name: str, value: np.ndarray, offset: int) -> onnx.TensorProto:
    tensor = onnx.TensorProto(name=name, data_type=onnx.TensorProto.FLOAT, dims=value.shape)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, entry in (("location", "weights.bin"), ("offset", str(offset)), ("length", str(value.nbytes))):
        tensor.external_data.add(key=key, value=entry)
    return tensor


def write_model(folder: Path) -> Path:
    """folder/model.onnx: Y = X @ W + B, W and B in folder/weights.bin at OFFSETS."""
    side = bytearray(256)
    for name, value in (("B", B), ("W", W)):
        side[OFFSETS[name]:OFFSETS[name] + value.nbytes] = value.tobytes()
    (folder / "weights.bin").write_bytes(bytes(side))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["XW"], name="project"),
         helper.make_node("Add", ["XW", "B"], ["Y"], name="shift")], "g",
        [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, ["n", 8])],
        initializer=[_external("W", W, OFFSETS["W"]), _external("B", B, OFFSETS["B"])])
    path = folder / "model.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    return path


@pytest.fixture
def model_path(tmp_path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    return write_model(folder)


def initializer(model: ModelProto, name: str) -> TensorProto:
    return next(tensor for tensor in model.graph.initializer if tensor.name == name)


def the_map(tensor: TensorProto) -> np.ndarray:
    """The whole live map a mapped tensor views, as uint8."""
    return np.frombuffer(mapped._map_of(mapped.token_of(tensor), "test"), np.uint8)


def inside(address: int, whole: np.ndarray) -> bool:
    return whole.ctypes.data <= address < whole.ctypes.data + whole.nbytes


def test_loading_maps_the_side_file_instead_of_reading_it(model_path):
    model = load_model(model_path)
    weight, bias = initializer(model, "W"), initializer(model, "B")
    for tensor in (weight, bias):
        assert tensor.data_location == TensorProto.EXTERNAL and not tensor.HasField("raw_data")
        assert mapped.is_mapped(tensor)
    values = tensor_to_numpy(weight)
    np.testing.assert_array_equal(values, W)
    np.testing.assert_array_equal(tensor_to_numpy(bias), B)
    whole = the_map(weight)
    assert np.shares_memory(values, whole) and not values.flags.writeable
    assert values.ctypes.data == whole.ctypes.data + OFFSETS["W"]


def test_an_unaligned_tensor_is_copied_once_into_an_aligned_buffer(model_path):
    bias = initializer(load_model(model_path), "B")
    first, second = tensor_to_numpy(bias), tensor_to_numpy(bias)
    assert not np.shares_memory(first, the_map(bias))
    assert first.ctypes.data % 64 == 0 and not first.flags.writeable
    assert np.shares_memory(first, second), "every decode shares the one copy"
    np.testing.assert_array_equal(first, B)


def test_reading_instead_of_mapping_puts_the_bytes_in_the_message(model_path):
    model = load_model(model_path, map_external_data=False)
    assert initializer(model, "W").raw_data == W.tobytes()
    assert initializer(model, "B").raw_data == B.tobytes()
    # A mapped message loaded again keeps its maps, or is read into the message on request.
    again = load_model(load_model(model_path))
    assert mapped.is_mapped(initializer(again, "W"))
    read = load_model(load_model(model_path), map_external_data=False)
    assert initializer(read, "W").raw_data == W.tobytes()


def test_mapped_and_read_models_compute_what_onnxruntime_computes(model_path):
    ort = pytest.importorskip("onnxruntime")
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    expected = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    from_map = onnxtrain.run(model_path, {"X": x})["Y"]
    from_message = onnxtrain.run(load_model(model_path, map_external_data=False), {"X": x})["Y"]
    np.testing.assert_array_equal(np.asarray(from_map), np.asarray(from_message))
    np.testing.assert_allclose(np.asarray(from_map), expected, rtol=1e-6, atol=1e-6)


def test_jax_uses_an_aligned_mapped_weight_where_it_lies(model_path):
    model = load_model(model_path)
    whole = the_map(initializer(model, "W"))
    _, params = onnxtrain.translate_model(model)
    assert inside(params["W"].unsafe_buffer_pointer(), whole)
    assert not inside(params["B"].unsafe_buffer_pointer(), whole)


def test_frozen_weights_stay_in_the_map_and_out_of_the_state(model_path):
    """finetune trains B; W is a constant of every program, a view of the map, never donated."""
    model = load_model(model_path)
    whole = the_map(initializer(model, "W"))
    tuner = onnxtrain.finetune(model, "mse", optax.sgd(0.1), trainable=["B"])
    assert tuner.state_names == ("B",)
    programs = [tuner._runners[0].step, tuner._inference]
    pointers = [program.constants["W"].unsafe_buffer_pointer() for program in programs]
    assert all(inside(pointer, whole) for pointer in pointers)
    assert not inside(tuner._store.values["B"].unsafe_buffer_pointer(), whole)
    x, y = RNG.standard_normal((5, 4)).astype(np.float32), RNG.standard_normal((5, 8)).astype(np.float32)
    losses = [float(tuner.step({"X": x, "labels": y})["loss"]) for _ in range(3)]
    assert losses[2] < losses[0]
    assert [program.constants["W"].unsafe_buffer_pointer() for program in programs] == pointers
    np.testing.assert_array_equal(np.asarray(tuner._inference.constants["W"]), W)
    # The step's own arithmetic: the loss of the current B (mse against y) from W and x.
    bias = np.asarray(tuner.state["B"])
    np.testing.assert_allclose(float(tuner.evaluate({"X": x, "labels": y})["loss"]),
                               np.mean((x @ W + bias - y) ** 2), rtol=1e-5)


def test_path_safety_still_holds_when_mapping(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    path = write_model(folder)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"OUTSIDE!" * 32)
    (folder / "weights.bin").unlink()
    os.symlink(outside, folder / "weights.bin")
    with pytest.raises(ModelLoadError, match="outside the model's folder"):
        load_model(path)
    (folder / "weights.bin").unlink()
    (folder / "weights.bin").write_bytes(b"\0" * 100)
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(path)


def test_a_serialized_mapped_model_is_refused(model_path):
    data = load_model(model_path).SerializeToString()
    with pytest.raises(ModelLoadError, match="onnxtrain.mapped"):
        load_model(data, base_dir=model_path.parent)
    forged = load_model(model_path)
    for entry in initializer(forged, "W").external_data:
        if entry.key == mapped.MAP_KEY:
            entry.value = "0" * 32
    with pytest.raises(ModelLoadError, match="never mapped"):
        load_model(forged)


def test_a_dropped_map_is_mapped_again_only_if_the_file_is_unchanged(model_path):
    model = load_model(model_path)
    weight = initializer(model, "W")
    token = mapped.token_of(weight)
    gc.collect()
    assert mapped._SOURCES[token].current() is None, "nothing holds a view, so nothing holds the map"
    np.testing.assert_array_equal(tensor_to_numpy(weight), W)
    gc.collect()
    replacement = model_path.parent / "new.bin"
    replacement.write_bytes(b"\1" * 256)
    os.replace(replacement, model_path.parent / "weights.bin")
    with pytest.raises(ModelLoadError, match="replaced or changed"):
        tensor_to_numpy(weight)


def side_offsets(path: Path) -> dict[str, int]:
    stored = onnx.load(path, load_external_data=False)
    return {t.name: int(next(e.value for e in t.external_data if e.key == "offset"))
            for t in stored.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}


def test_saving_streams_mapped_values_to_aligned_offsets(model_path, tmp_path, monkeypatch):
    model = load_model(model_path)
    before = model.SerializeToString()
    written = []
    original = model_io._write_all
    monkeypatch.setattr(model_io, "_write_all", lambda handle, data: (written.append(data), original(handle, data)))
    out = tmp_path / "out.onnx"
    save_model(model, out, external_data=True, size_threshold=0)
    assert model.SerializeToString() == before, "saving must not change the model object"
    streamed = [data for data in written if isinstance(data, memoryview) and data.nbytes in (W.nbytes, B.nbytes)]
    assert len(streamed) == 2 and all(isinstance(data.obj, mapped._Map) for data in streamed)
    assert all(offset % model_io.SIDE_FILE_ALIGNMENT == 0 for offset in side_offsets(out).values())
    reloaded = onnx.load(out)
    np.testing.assert_array_equal(numpy_helper.to_array(reloaded.graph.initializer[0]), W)
    np.testing.assert_array_equal(numpy_helper.to_array(reloaded.graph.initializer[1]), B)
    # Mapped again in place: both offsets aligned now, so neither is copied.
    again = load_model(out)
    for name, value in (("W", W), ("B", B)):
        tensor = initializer(again, name)
        np.testing.assert_array_equal(tensor_to_numpy(tensor), value)
        assert np.shares_memory(tensor_to_numpy(tensor), the_map(tensor))


def test_large_tensors_start_on_the_large_alignment(model_path, tmp_path, monkeypatch):
    monkeypatch.setattr(model_io, "LARGE_TENSOR_BYTES", W.nbytes)
    model = load_model(model_path)
    # B first: W, the large one, then follows a small tensor in the side file.
    tensors = [initializer(model, "B"), initializer(model, "W")]
    copies = [TensorProto() for _ in tensors]
    for copy, tensor in zip(copies, tensors):
        copy.CopyFrom(tensor)
    del model.graph.initializer[:]
    model.graph.initializer.extend(copies)
    out = tmp_path / "out.onnx"
    save_model(model, out, external_data=True, size_threshold=0)
    offsets = side_offsets(out)
    assert offsets == {"B": 0, "W": model_io.LARGE_TENSOR_ALIGNMENT}
    assert (tmp_path / "out.onnx.data").stat().st_size == model_io.LARGE_TENSOR_ALIGNMENT + W.nbytes
    np.testing.assert_array_equal(numpy_helper.to_array(onnx.load(out).graph.initializer[1]), W)


def test_mapped_values_count_toward_protobufs_limit(model_path, tmp_path, monkeypatch):
    """A mapped model's message is small, yet written inline it would pass the limit, so an
    automatic save goes external and an inline one is refused before any value is copied."""
    model = load_model(model_path)
    assert model.ByteSize() < 1000
    monkeypatch.setattr(model_io, "PROTOBUF_LIMIT", model.ByteSize() + 100)
    save_model(model, tmp_path / "auto.onnx", size_threshold=0)
    assert (tmp_path / "auto.onnx.data").exists()
    np.testing.assert_array_equal(numpy_helper.to_array(onnx.load(tmp_path / "auto.onnx").graph.initializer[0]), W)
    with pytest.raises(ExportError, match="2 GiB"):
        save_model(model, tmp_path / "never.onnx", external_data=False)
    assert not (tmp_path / "never.onnx").exists()


def test_saving_a_mapped_model_inline(model_path, tmp_path):
    model = load_model(model_path)
    before = model.SerializeToString()
    save_model(model, tmp_path / "inline.onnx", external_data=False)
    assert model.SerializeToString() == before
    stored = onnx.load(tmp_path / "inline.onnx", load_external_data=False)
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in stored.graph.initializer)
    np.testing.assert_array_equal(numpy_helper.to_array(stored.graph.initializer[0]), W)


def test_export_load_round_trip_keeps_frozen_and_trained_values(model_path, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    tuner = onnxtrain.finetune(model_path, "mse", optax.sgd(0.1), trainable=["B"])
    x, y = RNG.standard_normal((5, 4)).astype(np.float32), RNG.standard_normal((5, 8)).astype(np.float32)
    tuner.step({"X": x, "labels": y})
    out = tmp_path / "exported" / "tuned.onnx"
    out.parent.mkdir()
    tuner.export(out, external_data=True)
    reloaded = load_model(out)
    np.testing.assert_array_equal(tensor_to_numpy(initializer(reloaded, "W")), W)
    trained = np.asarray(tuner.state["B"])
    assert not np.array_equal(trained, B)
    np.testing.assert_array_equal(tensor_to_numpy(initializer(reloaded, "B")), trained)
    served = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    np.testing.assert_allclose(np.asarray(tuner.infer({"X": x})["Y"]), served, rtol=1e-6, atol=1e-6)


def test_a_training_model_keeps_its_frozen_weights_mapped(model_path, tmp_path):
    """make_training_model, save, Trainer: W stays a view of a map, and one SGD step moves B by
    the hand-derived gradient of the mse (2/(N*8) times the column sums of the residual)."""
    training = onnxtrain.make_training_model(model_path, loss="mse", optimizer=onnxtrain.optim.SGD(lr=0.1),
                                             trainable=["B"])
    assert mapped.is_mapped(initializer(training, "W"))
    path = tmp_path / "training" / "model.onnx"
    path.parent.mkdir()
    save_model(training, path, external_data=True, size_threshold=0)
    model = load_model(path)
    whole = the_map(initializer(model, "W"))
    trainer = onnxtrain.Trainer(model)
    assert "W" not in trainer.state_names
    assert inside(trainer._runners[0].step.constants["W"].unsafe_buffer_pointer(), whole)
    x, y = RNG.standard_normal((5, 4)).astype(np.float32), RNG.standard_normal((5, 8)).astype(np.float32)
    trainer.step({"X": x, "labels": y})
    expected = B - 0.1 * 2 / y.size * (x @ W + B - y).sum(axis=0)
    np.testing.assert_allclose(np.asarray(trainer.state["B"]), expected, rtol=1e-5, atol=1e-6)
