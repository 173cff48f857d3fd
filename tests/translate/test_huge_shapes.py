"""Shapes no array can have, and arrays too large to build on the host from a shape alone.

A tiny model used to end in a raw numpy ValueError (a Constant of dims [0, 2**62]), a raw
ValueError after most of a minute (a Reshape to rank 100,001) or a MemoryError (a 4 TiB
ConstantOfShape). Each must now be a typed error naming the tensor or node, raised quickly,
before memory is taken: dims are checked where tensors are decoded (numpy's rule: at most 64
dims, and a byte size that fits int64) and where shapes are folded (the ops that build a tensor
from a shape check it first; a node whose output has more than 64 dims is refused where it runs).
"""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.errors import ModelLoadError, OnnxTrainError, UnsupportedOpError
from onnxtrain.translate.tensors import MAX_HOST_BYTES

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
FOUR_TIB = [2**20, 2**20]  # 2**40 float32 elements: 2**42 bytes


def value(name: str, elem_type: int = FLOAT, shape: list | None = None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def model(nodes: list, inputs: list = (), initializers: list = (), output: str = "Y") -> bytes:
    graph = helper.make_graph(nodes, "huge", list(inputs), [value(output)], list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9).SerializeToString()


def ints(name: str, values: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def constant(name: str, array: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array))


def refused(data: bytes, feeds: dict, error: type[OnnxTrainError], *parts: str, seconds: float = 10) -> str:
    """Running the model raises `error` within `seconds`, its message holding every one of `parts`."""
    start = time.perf_counter()
    with pytest.raises(error) as raised:
        onnxtrain.run(data, feeds)
    assert time.perf_counter() - start < seconds
    message = str(raised.value)
    for part in parts:
        assert part in message, message
    return message


# --- Dims where tensors are decoded -------------------------------------------------------------


def empty_tensor(name: str, dims: list[int]) -> onnx.TensorProto:
    """A float tensor declaring `dims` with no values (right for a zero dim)."""
    return helper.make_tensor(name, FLOAT, dims, np.zeros(0, np.float32).tobytes(), raw=True)


@pytest.mark.parametrize("dims", [[0, 2**62], [2**62, 0, 3], [0] + [2**31] * 2])
def test_a_constant_of_impossible_dims_is_refused(dims: list[int]):
    """Empty, yet numpy's byte count of its non-zero dims overflows int64."""
    data = model([helper.make_node("Constant", [], ["Y"], name="big", value=empty_tensor("v", dims))])
    message = refused(data, {}, ModelLoadError, "'big' (Constant)", "bytes")
    assert str(2**62) in message or str(2**31) in message


def test_an_empty_constant_of_possible_dims_still_runs():
    data = model([helper.make_node("Constant", [], ["Y"], value=empty_tensor("v", [0, 2**40]))])
    assert np.asarray(onnxtrain.run(data, {})["Y"]).shape == (0, 2**40)


def test_an_initializer_of_more_than_64_dims_is_refused():
    tensor = numpy_helper.from_array(np.zeros(1, np.float32), "W")
    tensor.dims[:] = [1] * 65
    data = model([helper.make_node("Identity", ["W"], ["Y"])], initializers=[tensor])
    refused(data, {}, ModelLoadError, "'W'", "65 dimensions")


def test_a_sparse_initializer_too_large_to_make_dense_is_refused():
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(np.array([1.0], np.float32), "S"),
                                       ints("", [0]), [2**40])
    graph = helper.make_graph([helper.make_node("Identity", ["S"], ["Y"])], "huge", [], [value("Y")],
                              sparse_initializer=[sparse])
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9).SerializeToString()
    refused(data, {}, ModelLoadError, "'S'", str(4 * 2**40))


@pytest.mark.parametrize("indices, problem", [([5], "outside"), ([-1], "outside"), ([0, 1], "2 indices for 1 values")])
def test_sparse_indices_that_do_not_fit_are_refused(indices: list[int], problem: str):
    """An index past the end used to raise IndexError; a negative one silently wrapped."""
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(np.array([7.0], np.float32), "S"),
                                       ints("", indices), [5])
    graph = helper.make_graph([helper.make_node("Identity", ["S"], ["Y"])], "huge", [], [value("Y")],
                              sparse_initializer=[sparse])
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9).SerializeToString()
    refused(data, {}, ModelLoadError, "'S'", problem)


def test_a_valid_sparse_initializer_still_densifies():
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(np.array([7.0, 8.0], np.float32), "S"),
                                       ints("", [[0, 1], [1, 2]]), [2, 3])
    graph = helper.make_graph([helper.make_node("Identity", ["S"], ["Y"])], "huge", [], [value("Y")],
                              sparse_initializer=[sparse])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    # onnx's ReferenceEvaluator does not read sparse initializers: the dense value by hand.
    expected = np.array([[0, 7, 0], [0, 0, 8]], np.float32)
    np.testing.assert_array_equal(np.asarray(onnxtrain.run(proto.SerializeToString(), {})["Y"]), expected)


# --- Shapes where they are folded -------------------------------------------------------------


@pytest.mark.parametrize("traced", [False, True], ids=["host", "traced"])
def test_a_reshape_to_rank_100001_is_refused_quickly(traced: bool):
    x = np.ones(1, np.float32)
    nodes = [] if traced else [constant("X", x)]
    nodes.append(helper.make_node("Reshape", ["X", "shape"], ["Y"], name="flat"))
    data = model(nodes, [value("X", FLOAT, [1])] if traced else [], [ints("shape", [1] * 100_001)])
    refused(data, {"X": x} if traced else {}, ModelLoadError, "'flat' (Reshape)", "100001 entries", seconds=5)


def test_a_reshape_to_rank_64_still_runs():
    x = np.arange(2, dtype=np.float32)
    data = model([helper.make_node("Reshape", ["X", "shape"], ["Y"])], [value("X", FLOAT, [2])],
                 [ints("shape", [2] + [1] * 63)])
    assert np.asarray(onnxtrain.run(data, {"X": x})["Y"]).shape == (2,) + (1,) * 63


@pytest.mark.parametrize("traced", [False, True], ids=["host", "traced"])
def test_an_unsqueeze_past_64_dims_is_refused(traced: bool):
    """Any node: the check on a node's outputs, where it runs."""
    x = np.ones([1] * 60, np.float32)
    nodes = [] if traced else [constant("X", x)]
    nodes.append(helper.make_node("Unsqueeze", ["X", "axes"], ["Y"], name="grow"))
    data = model(nodes, [value("X", FLOAT, [1] * 60)] if traced else [], [ints("axes", list(range(5)))])
    refused(data, {"X": x} if traced else {}, ModelLoadError, "'grow' (Unsqueeze)")


def test_a_constant_of_shape_of_four_tib_is_refused_before_allocating():
    data = model([helper.make_node("ConstantOfShape", ["shape"], ["Y"], name="zeros")],
                 initializers=[ints("shape", FOUR_TIB)])
    refused(data, {}, UnsupportedOpError, "'zeros' (ConstantOfShape)", str(2**42), str(MAX_HOST_BYTES))


@pytest.mark.parametrize("dims, problem", [([2**62, 4], "bytes"), ([0, 2**62], "bytes"), ([3, -2], "negative"),
                                           ([1] * 65, "65 entries")])
def test_a_constant_of_shape_no_tensor_can_have_is_refused(dims: list[int], problem: str):
    data = model([helper.make_node("ConstantOfShape", ["shape"], ["Y"], name="zeros")],
                 initializers=[ints("shape", dims)])
    refused(data, {}, ModelLoadError, "'zeros' (ConstantOfShape)", problem)


def test_a_constant_of_shape_within_the_bound_still_runs():
    data = model([helper.make_node("ConstantOfShape", ["shape"], ["Y"],
                                   value=numpy_helper.from_array(np.array([2.5], np.float32)))],
                 initializers=[ints("shape", [2, 3])])
    np.testing.assert_array_equal(np.asarray(onnxtrain.run(data, {})["Y"]), np.full((2, 3), 2.5, np.float32))


def test_an_expand_of_a_constant_to_four_tib_is_refused():
    nodes = [constant("X", np.ones(1, np.float32)), helper.make_node("Expand", ["X", "shape"], ["Y"], name="wide")]
    refused(model(nodes, initializers=[ints("shape", FOUR_TIB)]), {}, UnsupportedOpError,
            "'wide' (Expand)", str(2**42))


def test_a_tile_of_a_constant_to_four_tib_is_refused():
    nodes = [constant("X", np.ones((1, 1), np.float32)), helper.make_node("Tile", ["X", "repeats"], ["Y"], name="tiles")]
    refused(model(nodes, initializers=[ints("repeats", FOUR_TIB)]), {}, UnsupportedOpError,
            "'tiles' (Tile)", str(2**42))


def test_a_range_of_two_to_the_40_elements_is_refused():
    nodes = [constant("start", np.array(0, np.int64)), constant("limit", np.array(2**40, np.int64)),
             constant("delta", np.array(1, np.int64)),
             helper.make_node("Range", ["start", "limit", "delta"], ["Y"], name="count")]
    refused(model(nodes), {}, UnsupportedOpError, "'count' (Range)", str(8 * 2**40))


def test_a_range_to_infinity_is_refused():
    nodes = [constant("start", np.array(0, np.float32)), constant("limit", np.array(np.inf, np.float32)),
             constant("delta", np.array(1, np.float32)),
             helper.make_node("Range", ["start", "limit", "delta"], ["Y"], name="count")]
    refused(model(nodes), {}, ModelLoadError, "'count' (Range)")
