"""Bad model bytes and bad external data give a ModelLoadError that says what and where.

Never a protobuf DecodeError, OSError or MemoryError from deep inside, and
never a large allocation for a size a file merely declares.
"""

from __future__ import annotations

import io
import os
import resource
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxtrain import ModelLoadError, load_model
from onnxtrain.translate.tensors import tensor_to_numpy


def weight_model(weight: onnx.TensorProto | None = None) -> onnx.ModelProto:
    weight = weight or numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"], name="project")], "g",
        [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [2, 4])],
        initializer=[weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def external_model(folder: Path, **entries: str) -> Path:
    """A model whose weight W (3x4 float32, 48 bytes) lives in folder/weights.bin."""
    (folder / "weights.bin").write_bytes(np.arange(12, dtype=np.float32).tobytes())
    weight = onnx.TensorProto(name="W", data_type=onnx.TensorProto.FLOAT, dims=[3, 4])
    weight.data_location = onnx.TensorProto.EXTERNAL
    for key, value in {"location": "weights.bin", **entries}.items():
        weight.external_data.add(key=key, value=value)
    path = folder / "model.onnx"
    path.write_bytes(weight_model(weight).SerializeToString())
    return path


def with_weight_entries(folder: Path, **entries: str) -> Path:
    """Like external_model, but with external_data entries replaced wholesale."""
    path = external_model(folder)
    model = onnx.load(path, load_external_data=False)
    weight = model.graph.initializer[0]
    del weight.external_data[:]
    for key, value in entries.items():
        weight.external_data.add(key=key, value=value)
    path.write_bytes(model.SerializeToString())
    return path


def expect_load_error(source, *patterns: str, **kwargs) -> str:
    with pytest.raises(ModelLoadError) as caught:
        load_model(source, **kwargs)
    message = str(caught.value)
    for pattern in patterns:
        assert pattern in message, f"{pattern!r} not in {message!r}"
    assert caught.value.__cause__ is None or isinstance(caught.value.__cause__, ModelLoadError)
    return message


def test_missing_file(tmp_path):
    expect_load_error(tmp_path / "nope.onnx", "nope.onnx", "does not exist")


def test_folder_instead_of_file(tmp_path):
    expect_load_error(tmp_path, "is a folder")


def test_empty_bytes():
    expect_load_error(b"", "no ir_version", "not an ONNX model")


def test_truncated_model():
    data = weight_model().SerializeToString()
    expect_load_error(data[: len(data) // 2], "could not parse", "truncated")


def test_random_garbage():
    expect_load_error(bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)),
                      "not a valid ONNX model")


def test_text_file_passed_as_model(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model": "resnet", "layers": 50}')
    expect_load_error(path, "config.json")


def test_text_mode_file_object(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(weight_model().SerializeToString())
    with open(path, encoding="latin-1") as handle:
        expect_load_error(handle, "text mode", "'rb'")


def test_unsupported_source_type():
    expect_load_error(12345, "int", "pass a path")


def test_raw_data_disagrees_with_dims():
    weight = numpy_helper.from_array(np.zeros((3, 4), np.float32), "W")
    weight.raw_data = weight.raw_data[:40]
    expect_load_error(weight_model(weight).SerializeToString(),
                      "initializer 'W'", "40 bytes of raw_data", "[3, 4]", "need 48")


def test_typed_field_disagrees_with_dims():
    weight = onnx.TensorProto(name="W", data_type=onnx.TensorProto.FLOAT, dims=[3, 4],
                              float_data=list(range(11)))
    expect_load_error(weight_model(weight).SerializeToString(),
                      "initializer 'W'", "11 entries in float_data", "need 12")


def test_negative_dims():
    weight = onnx.TensorProto(name="W", data_type=onnx.TensorProto.FLOAT, dims=[-3, 4])
    expect_load_error(weight_model(weight).SerializeToString(), "'W'", "negative")


def test_unknown_element_type():
    weight = onnx.TensorProto(name="W", data_type=77, dims=[1], raw_data=b"\0")
    expect_load_error(weight_model(weight).SerializeToString(), "'W'", "data_type 77")


def test_missing_external_file(tmp_path):
    path = external_model(tmp_path)
    (tmp_path / "weights.bin").unlink()
    expect_load_error(path, "initializer 'W'", "weights.bin", "does not exist")


def test_short_external_file(tmp_path):
    path = external_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"\0" * 20)
    expect_load_error(path, "'W'", "length 20 bytes disagrees", "need 48")


def test_range_past_end_of_external_file(tmp_path):
    path = external_model(tmp_path, offset="16", length="48")
    expect_load_error(path, "'W'", "has 48 bytes", "48 bytes at offset 16", "truncated")


def test_declared_huge_length_is_refused_before_reading(tmp_path):
    path = external_model(tmp_path, length=str(10**15))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    expect_load_error(path, "'W'", str(10**15))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB


def test_huge_dims_with_matching_huge_length_are_refused_before_reading(tmp_path):
    path = external_model(tmp_path)
    model = onnx.load(path, load_external_data=False)
    weight = model.graph.initializer[0]
    del weight.dims[:]
    weight.dims.extend([10**7, 10**7])
    weight.external_data.add(key="length", value=str(4 * 10**14))
    path.write_bytes(model.SerializeToString())
    expect_load_error(path, "'W'", "has 48 bytes")


def test_absolute_location(tmp_path):
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"\0" * 48)
    (tmp_path / "model").mkdir()
    path = with_weight_entries(tmp_path / "model", location=str(outside))
    expect_load_error(path, "'W'", "absolute path")


def test_parent_folder_location(tmp_path):
    (tmp_path / "secret.bin").write_bytes(b"\0" * 48)
    (tmp_path / "model").mkdir()
    path = with_weight_entries(tmp_path / "model", location="../secret.bin")
    expect_load_error(path, "'W'", "'..'")


def test_symlink_out_of_the_model_folder(tmp_path):
    (tmp_path / "secret.bin").write_bytes(b"\0" * 48)
    folder = tmp_path / "model"
    folder.mkdir()
    path = with_weight_entries(folder, location="link.bin")
    os.symlink(tmp_path / "secret.bin", folder / "link.bin")
    expect_load_error(path, "'W'", "outside the model's folder")


def test_symlink_inside_the_model_folder_is_fine(tmp_path):
    path = external_model(tmp_path)
    os.rename(tmp_path / "weights.bin", tmp_path / "real.bin")
    os.symlink(tmp_path / "real.bin", tmp_path / "weights.bin")
    loaded = load_model(path)
    np.testing.assert_array_equal(tensor_to_numpy(loaded.graph.initializer[0]).ravel(),
                                  np.arange(12, dtype=np.float32))


def test_location_with_a_nul_byte(tmp_path):
    path = with_weight_entries(tmp_path, location="weights.bin\0.txt")
    expect_load_error(path, "'W'", "NUL byte")


def test_missing_location(tmp_path):
    path = with_weight_entries(tmp_path, offset="0")
    expect_load_error(path, "'W'", "no external_data location")


def test_offset_not_an_integer(tmp_path):
    path = external_model(tmp_path, offset="sixteen")
    expect_load_error(path, "'W'", "offset='sixteen'", "not an integer")


def test_checksum_mismatch(tmp_path):
    path = external_model(tmp_path, checksum="0" * 40)
    expect_load_error(path, "'W'", "checksum")


def test_external_data_from_bytes_without_base_dir(tmp_path):
    data = external_model(tmp_path).read_bytes()
    expect_load_error(data, "'W'", "base_dir")
    assert tensor_to_numpy(load_model(data, base_dir=tmp_path).graph.initializer[0]).size == 12
    expect_load_error(io.BytesIO(data), "base_dir")


def test_file_over_the_protobuf_limit(tmp_path):
    path = tmp_path / "huge.onnx"
    with open(path, "wb") as handle:
        handle.truncate(2**31 + 1)  # sparse: no disk space, no read
    expect_load_error(path, "2 GiB", "external data")
