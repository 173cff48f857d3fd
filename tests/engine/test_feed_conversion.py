"""The one conversion every feed goes through (onnxtrain._engine.feeds): its dtype rules for
each kind of value, and the check's fast path, which must only ever hand on what it checked.

Values with a dtype of their own must carry the declared one; Python values are converted,
floats rounding but never overflowing, integers and booleans exactly.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxtrain import InputError
from onnxtrain._engine import feeds as feeds_module
from onnxtrain._engine.feeds import FeedChecker, as_array
from support.foreign_arrays import ArrayLike, DLPackOnly, FakeTensor

F32, F16, F64 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64)
I32, I64, U8, U64, BOOL = (np.dtype(t) for t in (np.int32, np.int64, np.uint8, np.uint64, np.bool_))

# (value, declared dtype, the array expected)
CONVERTED = {
    "float_rounds": (0.1, F32, np.float32(0.1)),
    "int_list": ([1, 2], I64, np.array([1, 2], np.int64)),
    "nested_list": ([[1, 2], [3, 4]], F16, np.array([[1, 2], [3, 4]], np.float16)),
    "big_int_into_float32": (10**30, F32, np.float32(1e30)),
    "huge_ints_into_float64": ([10**30, 1], F64, np.array([1e30, 1.0])),
    "int_beyond_int64_into_float32": ([2**70, 1], F32, np.array([2.0**70, 1.0], np.float32)),
    "int_rounds_into_float32": (2**24 + 1, F32, np.float32(2**24)),
    "uint8_top": (255, U8, np.uint8(255)),
    "uint64_top": (2**64 - 1, U64, np.uint64(2**64 - 1)),
    "int64_bottom": (-2**63, I64, np.int64(-2**63)),
    "whole_floats_into_int": ([1.0, -2.0], I32, np.array([1, -2], np.int32)),
    "bools": ([True, False], BOOL, np.array([True, False])),
    "zero_one_into_bool": ([0, 1], BOOL, np.array([False, True])),
    "bool_into_float": (True, F32, np.float32(1)),
    "nan_into_float": (math.nan, F32, np.float32(np.nan)),
    "inf_into_float": (-math.inf, F16, np.float16(-np.inf)),
    "real_complex_into_float": (2 + 0j, F32, np.float32(2)),
    "tuple": ((1.5, 2.5), F32, np.array([1.5, 2.5], np.float32)),
    "empty_list": ([], F32, np.zeros(0, np.float32)),
    "object_array_of_numbers": (np.array([1, 2**70], dtype=object), F32, np.array([1, 2.0**70], np.float32)),
}

# (value, declared dtype, a phrase the message must hold)
REJECTED = {
    "300_into_uint8": (300, U8, "do not fit"),
    "negative_into_uint8": (-1, U8, "do not fit"),
    "negative_into_uint64": ([-1, 5], U64, "do not fit"),          # wraps around and casts back unchanged
    "beyond_int64": ([2**63, 1], I64, "do not fit"),                # as uint64, wraps around the same way
    "huge_into_int64": (10**30, I64, "do not fit"),
    "overflows_float32": ([10**39], F32, "do not fit"),
    "float_overflows_float32": ([1e300], F32, "do not fit"),
    "int_overflows_float64": (10**400, F64, "do not fit"),
    "overflows_float16": (70000, F16, "do not fit"),
    "fraction_into_int": (1.5, I32, "do not fit"),
    "nan_into_int": (math.nan, I32, "do not fit"),
    "inf_into_int": (math.inf, I64, "do not fit"),
    "two_into_bool": (2, BOOL, "do not fit"),
    "half_into_bool": (0.5, BOOL, "do not fit"),
    "imaginary_into_float": (1 + 2j, F32, "do not fit"),
    "strings_for_float": (["a", "b"], F32, "strings"),
    "numeric_string": ("1.5", F32, "strings"),
    "bytes": (b"1", F32, "strings"),
    "string_among_numbers": ([1, "2"], F32, "strings"),
    "none_among_numbers": ([1.0, None], F32, "NoneType"),
    "none": (None, F32, "NoneType"),
    "dict": ({"a": 1}, F32, "dict"),
    "ragged": ([[1, 2], [3]], F32, "rectangular"),
    "object_array_with_none": (np.array([1.0, None], dtype=object), F32, "NoneType"),
    "plain_object": (object(), F32, "object"),
    # Values with a dtype of their own are never cast.
    "float64_array": (np.zeros(2), F32, "must be float32"),
    "float64_scalar": (np.float64(1), F32, "must be float32"),
    "big_endian_array": (np.zeros(2, ">f4"), F32, "must be float32"),
    "int64_array_for_int32": (np.zeros(2, np.int64), I32, "must be int32"),
    "jax_float_for_int": (jnp.zeros(2, jnp.float32), I32, "must be int32"),
    "tensor_float64": (FakeTensor(np.zeros(2)), F32, "must be float32"),
    "array_like_float64": (ArrayLike(np.zeros(2)), F32, "must be float32"),
    "dlpack_only_int": (DLPackOnly(np.zeros(2, np.int64)), F32, "must be float32"),
    "numbers_for_string_input": ([1, 2], np.dtype(object), "string tensor"),
    "float_array_for_string_input": (np.zeros(2, np.float32), np.dtype(object), "string tensor"),
}


@pytest.mark.parametrize("case", CONVERTED)
def test_python_values_convert_to_the_declared_dtype(case):
    value, dtype, expected = CONVERTED[case]
    converted = as_array("x", value, dtype)
    assert isinstance(converted, np.ndarray) and converted.dtype == dtype
    np.testing.assert_array_equal(converted, expected, strict=False)
    assert converted.shape == np.shape(expected)


@pytest.mark.parametrize("case", REJECTED)
def test_values_that_do_not_fit_raise_input_error_naming_the_input(case):
    value, dtype, phrase = REJECTED[case]
    with pytest.raises(InputError, match="input 'x'") as error:
        as_array("x", value, dtype)
    assert phrase in str(error.value)


@pytest.mark.parametrize("value", [np.ones(3, np.float32), np.float32(2), jnp.ones(3, jnp.float32)],
                         ids=["numpy", "numpy_scalar", "jax"])
def test_arrays_of_the_declared_dtype_come_back_as_they_are(value):
    assert as_array("x", value, F32) is value


def test_string_inputs_take_any_strings_as_an_object_array():
    for value in (["a", "bc"], np.array(["a", "bc"]), np.array([b"a", b"bc"]), np.array(["a", "bc"], object)):
        converted = as_array("s", value, np.dtype(object))
        assert converted.dtype == object and [str(v) for v in converted] in (["a", "bc"], ["b'a'", "b'bc'"])


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_tensors_are_read_whatever_their_grad_and_strides(requires_grad, contiguous):
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    data = base if contiguous else base.T          # a transposed view: not C-contiguous
    converted = as_array("x", FakeTensor(data, requires_grad), F32)
    assert isinstance(converted, np.ndarray)
    np.testing.assert_array_equal(converted, data)


def test_a_tensor_numpy_cannot_hold_is_read_through_dlpack():
    data = jnp.arange(4, dtype=jnp.bfloat16)
    bfloat16 = np.dtype(ml_dtypes.bfloat16)
    converted = as_array("x", FakeTensor(data, refuse_numpy=True), bfloat16)
    assert isinstance(converted, np.ndarray) and converted.dtype == bfloat16
    np.testing.assert_array_equal(converted.astype(np.float32), np.arange(4, dtype=np.float32))


def test_objects_with_only_dlpack_or_only_array_are_read():
    data = np.arange(4, dtype=np.float32)
    for value in (DLPackOnly(data), ArrayLike(data), memoryview(data)):
        converted = as_array("x", value, F32)
        assert isinstance(converted, np.ndarray)
        np.testing.assert_array_equal(converted, data)


def test_a_deleted_jax_array_is_an_input_error():
    value = jnp.ones(3)
    value.delete()
    with pytest.raises(InputError, match="input 'x' .*deleted"):
        as_array("x", value, F32)


def test_a_tracer_is_an_input_error():
    def traced(value):
        as_array("x", value, F32)
        return value

    with pytest.raises(InputError, match="input 'x' is a JAX tracer"):
        jax.jit(traced)(jnp.ones(3))


# ---------------------------------------------------------------------------
# FeedChecker: the fast path


def _checker(elem_type: int = TensorProto.FLOAT) -> FeedChecker:
    return FeedChecker([helper.make_tensor_value_info("x", elem_type, ["N"])], "test step")


@pytest.fixture
def conversions(monkeypatch):
    """Counts as_array calls: the fast path makes none."""
    calls = []
    original = feeds_module.as_array

    def counted(*args):
        calls.append(args[0])
        return original(*args)

    monkeypatch.setattr(feeds_module, "as_array", counted)
    return calls


def test_the_same_arrays_again_skip_the_check(conversions):
    checker, x = _checker(), np.ones(4, np.float32)
    assert checker({"x": x}, copy=False)["x"] is x
    assert checker({"x": np.zeros(4, np.float32)}, copy=False)["x"] is not x
    assert len(conversions) == 1
    copied = checker({"x": x})["x"]
    assert copied is not x and np.array_equal(copied, x)   # copy=True: the caller's buffer stays theirs


@pytest.mark.parametrize("make", [lambda: FakeTensor(np.ones(4, np.float32)), lambda: [1.0] * 4,
                                  lambda: ArrayLike(np.ones(4, np.float32))], ids=["tensor", "list", "array_like"])
def test_converted_feeds_are_converted_every_call(make, conversions):
    """The original bug: a tensor passed the check once, then went to the program as it was."""
    checker = _checker()
    for _ in range(3):
        checked = checker({"x": make()}, copy=False)["x"]
        assert type(checked) is np.ndarray and checked.dtype == np.float32
    assert len(conversions) == 3


def test_a_signature_that_passed_as_arrays_does_not_let_a_tensor_through():
    checker = _checker()
    checker({"x": np.ones(4, np.float32)}, copy=False)
    assert type(checker({"x": FakeTensor(np.ones(4, np.float32))}, copy=False)["x"]) is np.ndarray


def test_a_jax_array_deleted_after_it_passed_is_caught():
    checker, x = _checker(), jnp.ones(4)
    assert checker({"x": x})["x"] is x
    x.delete()
    with pytest.raises(InputError, match="input 'x' .*deleted"):
        checker({"x": x})
    # A live array of the same signature still passes.
    checker({"x": jnp.zeros(4)})


def test_a_rejected_feed_leaves_the_fast_path_to_arrays_that_passed(conversions):
    checker, x = _checker(TensorProto.UINT8), np.ones(4, np.uint8)
    checker({"x": x})
    with pytest.raises(InputError, match="input 'x'"):
        checker({"x": [300] * 4})
    assert checker({"x": x}, copy=False)["x"] is x


def test_an_untyped_input_takes_numbers_only():
    """A JAX loss function's label has no declared type: numbers pass as they are, strings not."""
    assert as_array("y", [1, 2], None).dtype == np.int64
    value = np.ones(2, np.float64)
    assert as_array("y", value, None) is value
    for bad in (["a"], np.array([None, 1.0], object)):
        with pytest.raises(InputError, match="input 'y' takes numbers"):
            as_array("y", bad, None)


# ---------------------------------------------------------------------------
# The real libraries, where installed


def test_real_torch_tensors():
    torch = pytest.importorskip("torch")
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    tensor = torch.tensor(data, requires_grad=True)
    for value in (tensor, tensor.T, tensor.detach()):
        np.testing.assert_array_equal(as_array("x", value, F32), np.asarray(value.detach()))
    converted = as_array("x", torch.arange(4, dtype=torch.bfloat16), np.dtype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(converted.astype(np.float32), np.arange(4, dtype=np.float32))
    with pytest.raises(InputError, match="must be float32"):
        as_array("x", tensor.double(), F32)


def test_real_pandas_columns():
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame({"a": np.arange(3, dtype=np.float32), "b": [1.0, None, 2.0],
                              "c": pandas.array([1, None, 3], dtype="Int64")})
    np.testing.assert_array_equal(as_array("x", frame["a"], F32), np.arange(3, dtype=np.float32))
    with pytest.raises(InputError, match="must be float32"):
        as_array("x", frame["b"], F32)       # float64, NaN for the missing value
    with pytest.raises(InputError, match="input 'x'"):
        as_array("x", frame["c"], I64)       # a missing value has no int64
