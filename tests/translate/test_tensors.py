"""TensorProto <-> numpy for every ONNX element type, checked against onnx.numpy_helper.

Three directions are proven for each type: our encoding decodes identically
in onnx; onnx's raw encoding decodes identically here; onnx's typed-field
encoding (int32_data bit patterns, packed nibbles, interleaved complex, ...)
decodes identically here.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnxtrain import ModelLoadError
from onnxtrain.proto import TensorProto
from onnxtrain.translate.tensors import (
    ELEMENT_TYPES,
    array_bytes,
    data_type_of,
    numpy_to_tensor,
    tensor_to_numpy,
)

TYPE_NAMES = sorted(e.name for e in ELEMENT_TYPES.values())
REQUIRED = {
    "FLOAT", "DOUBLE", "FLOAT16", "BFLOAT16", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2",
    "FLOAT8E5M2FNUZ", "FLOAT8E8M0", "FLOAT4E2M1", "INT2", "UINT2", "INT4", "UINT4", "INT8",
    "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64", "BOOL", "STRING",
    "COMPLEX64", "COMPLEX128",
}


def sample(type_name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Values that fill the type's range, including its edge cases where it has them."""
    rng = np.random.default_rng(seed)
    element = ELEMENT_TYPES[TensorProto.DataType.Value(type_name)]
    count = int(np.prod(shape))
    dtype = element.dtype
    if type_name == "STRING":
        words = ["", "a", "ünïcödé", "日本", "x" * 40, "tab\tnew\nline"]
        return np.array([words[i % len(words)] for i in rng.integers(0, 99, count)],
                        dtype=object).reshape(shape)
    if type_name == "BOOL":
        return rng.integers(0, 2, count).astype(bool).reshape(shape)
    if dtype.kind in "iu" or type_name in ("INT2", "UINT2", "INT4", "UINT4"):
        info = ml_dtypes.iinfo(dtype) if dtype.kind == "V" else np.iinfo(dtype)
        draw_dtype = np.int64 if dtype.kind == "V" else dtype
        values = rng.integers(info.min, info.max, count, endpoint=True, dtype=draw_dtype)
        if count >= 2:
            values[:2] = (info.min, info.max)
        return values.astype(dtype).reshape(shape)
    if dtype.kind == "c":
        parts = rng.normal(size=(count, 2)) * 1e3
        return (parts[:, 0] + 1j * parts[:, 1]).astype(dtype).reshape(shape)
    values = rng.normal(size=count) * 4
    if type_name == "FLOAT8E8M0":
        values = 2.0 ** rng.integers(-20, 20, count)
    elif count >= 3 and type_name in ("FLOAT", "DOUBLE", "FLOAT16", "BFLOAT16"):
        values[:3] = (np.inf, -0.0, np.nan)
    return values.astype(dtype).reshape(shape)


def assert_identical(actual: np.ndarray, expected: np.ndarray) -> None:
    """Same shape and the same values bit for bit (NaNs and -0.0 included)."""
    assert actual.shape == expected.shape
    if expected.dtype == object or expected.dtype.kind == "U":
        assert actual.tolist() == expected.astype(object).tolist()
        return
    assert actual.dtype == expected.dtype
    assert actual.tobytes() == expected.tobytes()


SHAPES = [(), (0,), (1,), (3,), (2, 3), (5, 1, 7)]


def test_every_required_element_type_is_supported():
    assert REQUIRED <= set(TYPE_NAMES)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("type_name", TYPE_NAMES)
def test_our_encoding_decodes_identically_in_onnx(type_name, shape):
    array = sample(type_name, shape, seed=len(shape))
    ours = numpy_to_tensor(array, name="t")
    assert ours.data_type == TensorProto.DataType.Value(type_name)
    theirs = onnx.TensorProto.FromString(ours.SerializeToString())
    assert_identical(onnx.numpy_helper.to_array(theirs), array)
    assert_identical(tensor_to_numpy(ours), array)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("type_name", TYPE_NAMES)
def test_onnx_raw_encoding_decodes_identically_here(type_name, shape):
    array = sample(type_name, shape, seed=7)
    theirs = onnx.numpy_helper.from_array(array, "t")
    ours = TensorProto.FromString(theirs.SerializeToString())
    assert_identical(tensor_to_numpy(ours), onnx.numpy_helper.to_array(theirs))
    if type_name != "STRING":
        assert array_bytes(array) == theirs.raw_data


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("type_name", sorted(set(TYPE_NAMES) - {"STRING"}))
def test_onnx_typed_field_encoding_decodes_identically_here(type_name, shape):
    array = sample(type_name, shape, seed=11)
    code = TensorProto.DataType.Value(type_name)
    theirs = onnx.helper.make_tensor("t", code, shape, array.ravel(), raw=False)
    assert not theirs.HasField("raw_data")
    ours = TensorProto.FromString(theirs.SerializeToString())
    assert_identical(tensor_to_numpy(ours), onnx.numpy_helper.to_array(theirs))


@settings(max_examples=60, deadline=None)
@given(
    type_name=st.sampled_from(TYPE_NAMES),
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
    seed=st.integers(0, 2**16),
)
def test_round_trip_of_random_shapes(type_name, shape, seed):
    array = sample(type_name, shape, seed)
    decoded = tensor_to_numpy(TensorProto.FromString(numpy_to_tensor(array).SerializeToString()))
    assert_identical(decoded, array)


@pytest.mark.parametrize("dtype", ["<f4", ">f4", ">i8", ">c8", ">u2", ">f8", ">c16"])
def test_raw_bytes_are_little_endian_whatever_the_array_byte_order(dtype):
    array = np.array([1.5, -2.0, 3.25], dtype=np.float64).astype(dtype)
    little = array.astype(np.dtype(dtype).newbyteorder("<"))
    assert array_bytes(array) == little.tobytes()
    assert data_type_of(array.dtype) == data_type_of(little.dtype)


def test_unknown_data_type_is_a_load_error_naming_the_tensor():
    tensor = TensorProto(name="weird", data_type=99, dims=[1], raw_data=b"\0")
    with pytest.raises(ModelLoadError, match=r"'weird'.*data_type 99"):
        tensor_to_numpy(tensor)


def test_invalid_utf8_strings_stay_bytes():
    tensor = TensorProto(data_type=TensorProto.STRING, dims=[2], string_data=[b"ok", b"\xff\xfe"])
    assert tensor_to_numpy(tensor).tolist() == ["ok", b"\xff\xfe"]
