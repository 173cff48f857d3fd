"""Shape manipulation and indexing ops: behaviour the ONNX backend cases miss.

The backend cases feed shapes, axes and pads as graph inputs, so they run op by
op on host values. Here those come from initializers and the data is traced, so
the handlers run under jit (`jitted` fails on any fallback to eager mode).
Oracles: onnx.reference.ReferenceEvaluator, numpy, hand-derived values and
central finite differences in float64 for gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxtrain
from onnxtrain.errors import ModelLoadError
from onnxtrain.translate.model import TranslatedModel

RNG = np.random.default_rng(0)
INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min


def i64(values) -> np.ndarray:
    return np.array(values, np.int64)


def make_model(op_type: str, feeds: dict[str, np.ndarray], constants: dict[str, np.ndarray],
               inputs: list[str], outputs: int = 1, opset: int = 21, **attributes) -> onnx.ModelProto:
    """One `op_type` node reading `inputs` ("" skips one): graph inputs `feeds`, initializers
    `constants`; outputs Y0, Y1, ..."""
    node = helper.make_node(op_type, inputs, [f"Y{i}" for i in range(outputs)], **attributes)
    graph = helper.make_graph(
        [node], op_type,
        [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for name, v in feeds.items()],
        [helper.make_tensor_value_info(f"Y{i}", TensorProto.UNDEFINED, None) for i in range(outputs)],
        initializer=[numpy_helper.from_array(v, name) for name, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def translate(model: onnx.ModelProto) -> TranslatedModel:
    return TranslatedModel(onnxtrain.load_model(model))


def jitted(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The outputs computed in one jitted trace (NeedsHostValues would propagate)."""
    fn = translate(model)
    with jax.enable_x64(True):
        outputs = jax.jit(fn.apply)(fn.params, feeds)
    return [np.asarray(outputs[name]) for name in fn.output_names]


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The outputs as the runtime computes them (jit, or eager where it must)."""
    fn = translate(model)
    outputs = fn(fn.params, feeds)
    return [np.asarray(outputs[name]) for name in fn.output_names]


def reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ReferenceEvaluator(model).run(None, feeds)


def assert_same(actual: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, a.shape, e.dtype, e.shape)
        np.testing.assert_allclose(a.astype(np.float64), e.astype(np.float64), rtol=1e-6)


def check_gradient(model: onnx.ModelProto, x: np.ndarray) -> None:
    """jax.grad of sum(w * Y0), random w, with respect to X against central differences (float64)."""
    fn = translate(model)
    with jax.enable_x64(True):
        weights = RNG.standard_normal(np.shape(fn.apply(fn.params, {"X": x})["Y0"]))

        def loss(value):
            return jnp.sum(weights * fn.apply(fn.params, {"X": value})["Y0"])

        grad = np.asarray(jax.grad(loss)(jnp.asarray(x)))
        numeric = np.zeros_like(x)
        step = 1e-6
        for index in np.ndindex(x.shape):
            shift = np.zeros_like(x)
            shift[index] = step
            numeric[index] = (float(loss(x + shift)) - float(loss(x - shift))) / (2 * step)
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7)


# --- Shapes fold on the host ----------------------------------------------------------


def test_shape_chain_stays_static_under_jit():
    """Shape -> Slice -> Concat -> Reshape of a traced input compiles without eager fallback."""
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Shape", ["X"], ["dims"], start=1),
        helper.make_node("ReduceProd", ["dims"], ["inner"], keepdims=1),
        helper.make_node("Concat", ["minus_one", "inner"], ["target"], axis=0),
        helper.make_node("Reshape", ["X", "target"], ["Y"]),
        helper.make_node("Size", ["X"], ["count"]),
    ]
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("X", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("count", TensorProto.INT64, None)],
        initializer=[numpy_helper.from_array(i64([-1]), "minus_one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    y, count = jitted(model, {"X": x})
    np.testing.assert_array_equal(y, x.reshape(2, 12))
    assert count.dtype == np.int64 and count.shape == () and count == 24


# --- Reshape, Squeeze, Unsqueeze, Flatten, Transpose ------------------------------------


@pytest.mark.parametrize("target, allowzero, expected", [
    ([0, -1], 0, (2, 12)),
    ([4, 0, 2], 0, (4, 3, 2)),
    ([0, 4], 1, None),           # 0 is a real size with allowzero: 24 elements do not fit
])
def test_reshape_static_shape_under_jit(target, allowzero, expected):
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    model = make_model("Reshape", {"X": x}, {"S": i64(target)}, ["X", "S"],
                       allowzero=allowzero)
    if expected is None:
        with pytest.raises(ModelLoadError, match="cannot reshape"):
            jitted(model, {"X": x})
    else:
        (y,) = jitted(model, {"X": x})
        np.testing.assert_array_equal(y, x.reshape(expected))


def test_reshape_allowzero_makes_an_empty_tensor():
    x = np.zeros((0, 3), np.float32)
    model = make_model("Reshape", {"X": x}, {"S": i64([3, 0])}, ["X", "S"], allowzero=1)
    assert jitted(model, {"X": x})[0].shape == (3, 0)


def test_reshape_v1_reads_the_shape_attribute():
    x = RNG.standard_normal((2, 6)).astype(np.float32)
    model = make_model("Reshape", {"X": x}, {}, ["X"], opset=4, shape=[3, -1])
    np.testing.assert_array_equal(jitted(model, {"X": x})[0], x.reshape(3, 4))


def test_squeeze_unsqueeze_attribute_forms_of_old_opsets():
    x = RNG.standard_normal((1, 3, 1)).astype(np.float32)
    squeezed = make_model("Squeeze", {"X": x}, {}, ["X"], opset=11, axes=[-1])
    assert jitted(squeezed, {"X": x})[0].shape == (1, 3)
    everything = make_model("Squeeze", {"X": x}, {}, ["X"], opset=11)
    assert jitted(everything, {"X": x})[0].shape == (3,)
    unsqueezed = make_model("Unsqueeze", {"X": x}, {}, ["X"], opset=11, axes=[-1, 0])
    assert jitted(unsqueezed, {"X": x})[0].shape == (1, 1, 3, 1, 1)


def test_squeeze_of_a_dimension_larger_than_one_is_an_error():
    x = np.zeros((2, 1), np.float32)
    model = make_model("Squeeze", {"X": x}, {"A": i64([0])}, ["X", "A"], opset=13)
    with pytest.raises(ModelLoadError, match="size is not 1"):
        jitted(model, {"X": x})


def test_flatten_transpose_and_concat_v1_default_axis():
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    flat = make_model("Flatten", {"X": x}, {}, ["X"], axis=-1)
    np.testing.assert_array_equal(jitted(flat, {"X": x})[0], x.reshape(6, 4))
    flipped = make_model("Transpose", {"X": x}, {}, ["X"])
    np.testing.assert_array_equal(jitted(flipped, {"X": x})[0], x.transpose())
    joined = make_model("Concat", {"X": x}, {"C": np.ones((2, 1, 4), np.float32)}, ["X", "C"], opset=1)
    np.testing.assert_array_equal(jitted(joined, {"X": x})[0],
                                  np.concatenate([x, np.ones((2, 1, 4), np.float32)], axis=1))


def test_layout_ops_on_strings_run_on_the_host():
    x = np.array([["a", "b", "c"], ["d", "e", "f"]], dtype=object)
    reshaped = make_model("Reshape", {"X": x}, {"S": i64([3, 2])}, ["X", "S"])
    assert run(reshaped, {"X": x})[0].tolist() == [["a", "b"], ["c", "d"], ["e", "f"]]
    gathered = make_model("Gather", {"X": x}, {"I": i64([-1, 0])}, ["X", "I"], axis=1)
    assert run(gathered, {"X": x})[0].tolist() == [["c", "a"], ["f", "d"]]
    sliced = make_model("Slice", {"X": x}, {"S": i64([-1]), "E": i64([INT64_MIN]),
                                            "A": i64([1]), "T": i64([-2])},
                        ["X", "S", "E", "A", "T"])
    assert run(sliced, {"X": x})[0].tolist() == [["c", "a"], ["f", "d"]]


# --- Split, Slice ------------------------------------------------------------------------


def test_split_num_outputs_makes_a_smaller_last_part():
    x = np.arange(7, dtype=np.float32)
    model = make_model("Split", {"X": x}, {}, ["X"], outputs=3, opset=18, num_outputs=3)
    parts = jitted(model, {"X": x})
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]


def test_split_attribute_form_and_uneven_equal_split_error():
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    model = make_model("Split", {"X": x}, {}, ["X"], outputs=2, opset=11, axis=-1, split=[1, 4])
    left, right = jitted(model, {"X": x})
    np.testing.assert_array_equal(left, x[:, :1])
    np.testing.assert_array_equal(right, x[:, 1:])
    uneven = make_model("Split", {"X": x}, {}, ["X"], outputs=2, opset=13, axis=1)
    with pytest.raises(ModelLoadError, match="equal parts"):
        jitted(uneven, {"X": x})


@pytest.mark.parametrize("starts, ends, axes, steps", [
    ([INT64_MAX, -2], [INT64_MIN, 0], [1, 2], [-1, -1]),
    ([-100, 1], [100, INT64_MAX], None, [2, 3]),
    ([3], [-1], [-1], None),
    ([2, 0], [0, 5], [0, 1], [-2, 1]),
])
def test_slice_bounds_and_steps_match_the_reference(starts, ends, axes, steps):
    x = RNG.standard_normal((4, 5, 6)).astype(np.float32)
    constants = {"S": i64(starts), "E": i64(ends)}
    if axes is not None:
        constants["A"] = i64(axes)
    if steps is not None:
        constants["T"] = i64(steps)
    inputs = ["X", "S", "E", "A" if axes is not None else "", "T" if steps is not None else ""]
    while not inputs[-1]:
        inputs.pop()
    model = make_model("Slice", {"X": x}, constants, inputs)
    assert_same(jitted(model, {"X": x}), reference(model, {"X": x}))


def test_slice_v1_attributes_and_gradient_of_a_reversed_slice():
    x = RNG.standard_normal((4, 5))
    old = make_model("Slice", {"X": x.astype(np.float32)}, {}, ["X"], opset=9,
                     starts=[1, -3], ends=[1000, -1], axes=[0, 1])
    x32 = x.astype(np.float32)
    np.testing.assert_array_equal(jitted(old, {"X": x32})[0], x32[1:, -3:-1])
    reversed_slice = make_model("Slice", {"X": x}, {"S": i64([-1]), "E": i64([0]),
                                                    "A": i64([1]), "T": i64([-2])},
                                ["X", "S", "E", "A", "T"])
    check_gradient(reversed_slice, x)


# --- Expand, Tile, Pad, CenterCropPad -------------------------------------------------


def test_expand_keeps_larger_input_dims_and_tile_v1():
    x = RNG.standard_normal((3, 1)).astype(np.float32)
    model = make_model("Expand", {"X": x}, {"S": i64([2, 1, 4])}, ["X", "S"])
    np.testing.assert_array_equal(jitted(model, {"X": x})[0], np.broadcast_to(x, (2, 3, 4)))
    bad = make_model("Expand", {"X": x}, {"S": i64([2, 2])}, ["X", "S"])
    with pytest.raises(ModelLoadError, match="cannot broadcast"):
        jitted(bad, {"X": x})
    tiled = make_model("Tile", {"X": x}, {"T": i64(3), "A": i64(1)},
                       ["X", "T", "A"], opset=5)
    np.testing.assert_array_equal(jitted(tiled, {"X": x})[0], np.tile(x, (1, 3)))


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad_with_negative_pads_crops_then_pads(mode):
    x = RNG.standard_normal((4, 5)).astype(np.float32)
    pads = i64([-1, 2, 1, -2])  # begins (axis 0, 1), then ends
    model = make_model("Pad", {"X": x, "V": np.array(7, np.float32)}, {"P": pads}, ["X", "P", "V"], mode=mode)
    (y,) = jitted(model, {"X": x, "V": np.array(7, np.float32)})
    cropped = x[1:, :-2]
    widths = [(0, 1), (2, 0)]
    expected = (np.pad(cropped, widths, constant_values=7) if mode == "constant"
                else np.pad(cropped, widths, mode=mode))
    np.testing.assert_array_equal(y, expected)


def test_pad_axes_input_and_old_attribute_forms():
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    model = make_model("Pad", {"X": x}, {"P": i64([1, 0, 2, 3]), "A": i64([-1, 0])},
                       ["X", "P", "", "A"], opset=18, mode="edge")
    expected = np.pad(x, [(0, 3), (0, 0), (1, 2)], mode="edge")
    np.testing.assert_array_equal(jitted(model, {"X": x})[0], expected)
    v2 = make_model("Pad", {"X": x}, {}, ["X"], opset=2, pads=[0, 1, 0, 0, 1, 0], value=2.5)
    np.testing.assert_array_equal(jitted(v2, {"X": x})[0],
                                  np.pad(x, [(0, 0), (1, 1), (0, 0)], constant_values=2.5))
    v1 = make_model("Pad", {"X": x}, {}, ["X"], opset=1, paddings=[0, 0, 1, 0, 0, 1], mode="reflect")
    expected = np.pad(x, [(0, 0), (0, 0), (1, 1)], mode="reflect")
    np.testing.assert_array_equal(jitted(v1, {"X": x})[0], expected)


def test_pad_keeps_float16_and_reflect_pad_gradient():
    x = RNG.standard_normal((2, 3)).astype(np.float16)
    model = make_model("Pad", {"X": x}, {"P": i64([1, 1, 1, 1]), "V": np.array(0.5, np.float16)},
                       ["X", "P", "V"])
    (y,) = jitted(model, {"X": x})
    assert y.dtype == np.float16 and y[0, 0] == np.float16(0.5)
    x = RNG.standard_normal((3, 4))
    reflect = make_model("Pad", {"X": x}, {"P": i64([2, 1, 0, 3])}, ["X", "P"], mode="reflect")
    check_gradient(reflect, x)


def test_center_crop_pad_puts_the_odd_element_at_the_end():
    x = np.arange(20, dtype=np.float32).reshape(4, 5)
    model = make_model("CenterCropPad", {"X": x}, {"S": i64([7, 2])}, ["X", "S"], opset=18)
    assert_same(jitted(model, {"X": x}), reference(model, {"X": x}))


# --- Tensors from shapes: ConstantOfShape, EyeLike, Range -------------------------------


def test_constant_of_shape_and_eye_like_are_host_constants_of_the_asked_dtype():
    x = np.zeros((3, 4), np.float32)
    eye = make_model("EyeLike", {"X": x}, {}, ["X"], k=-2, dtype=TensorProto.BFLOAT16)
    (y,) = jitted(eye, {"X": x})
    assert y.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(y.astype(np.float32), np.eye(3, 4, k=-2))
    filled = make_model("ConstantOfShape", {}, {"S": i64([2, 0, 3])}, ["S"],
                        value=numpy_helper.from_array(np.array([5], np.int32)))
    (z,) = jitted(filled, {})
    assert z.dtype == np.int32 and z.shape == (2, 0, 3)


@pytest.mark.parametrize("start, limit, delta", [
    (np.int64(10), np.int64(-3), np.int64(-4)),
    (np.float32(0.5), np.float32(2.0), np.float32(0.3)),
    (np.float64(1.0), np.float64(1.0), np.float64(1.0)),
])
def test_range_from_initializers(start, limit, delta):
    model = make_model("Range", {}, {"S": np.array(start), "L": np.array(limit), "D": np.array(delta)},
                       ["S", "L", "D"], opset=11)
    (y,) = jitted(model, {})
    expected = np.arange(start, limit, delta).astype(np.asarray(start).dtype)
    assert y.dtype == expected.dtype
    np.testing.assert_allclose(y, expected, rtol=1e-6)


def test_range_float16_counts_in_float32_by_default():
    start, limit = np.array(2048, np.float16), np.array(2058, np.float16)
    model = make_model("Range", {}, {"S": start, "L": limit, "D": np.array(1, np.float16)}, ["S", "L", "D"],
                       opset=27)
    (y,) = jitted(model, {})
    assert y.dtype == np.float16 and y.shape == (10,)
    np.testing.assert_array_equal(y, np.arange(2048, 2058, dtype=np.float32).astype(np.float16))


# --- Gathers and scatters ------------------------------------------------------------------


def test_gathers_with_traced_negative_indices():
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    i = i64([[-1, 0], [2, -3]])
    gather = make_model("Gather", {"X": x, "I": i}, {}, ["X", "I"], axis=1)
    assert_same(jitted(gather, {"X": x, "I": i}), reference(gather, {"X": x, "I": i}))
    # GatherElements indices may be smaller than the data on the other axes too.
    elements = make_model("GatherElements", {"X": x, "I": i}, {}, ["X", "I"], axis=1)
    (y,) = jitted(elements, {"X": x, "I": i})
    np.testing.assert_array_equal(y, [[x[0, 3], x[0, 0]], [x[1, 2], x[1, 1]]])


def test_gather_nd_with_two_batch_dims_and_negative_indices():
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    i = RNG.integers(-4, 4, size=(2, 3, 6, 1)).astype(np.int64)
    model = make_model("GatherND", {"X": x, "I": i}, {}, ["X", "I"], batch_dims=2)
    (y,) = jitted(model, {"X": x, "I": i})
    expected = np.stack([np.stack([x[a, b][i[a, b, :, 0]] for b in range(3)]) for a in range(2)])
    np.testing.assert_array_equal(y, expected)


def test_host_indices_out_of_range_are_an_error():
    x = np.zeros((3, 4), np.float32)
    model = make_model("Gather", {"X": x}, {"I": i64([4])}, ["X", "I"], axis=1)
    with pytest.raises(ModelLoadError, match="out of range"):
        jitted(model, {"X": x})


@pytest.mark.slow
def test_gather_gradients_accumulate_repeated_indices():
    x = RNG.standard_normal((4, 3))
    gather = make_model("Gather", {"X": x}, {"I": i64([1, -3, 0, 1])}, ["X", "I"])
    check_gradient(gather, x)
    elements = make_model("GatherElements", {"X": x}, {"I": i64([[0, 3, 3], [-1, 0, 0]])},
                          ["X", "I"])
    check_gradient(elements, x)
    nd = make_model("GatherND", {"X": x}, {"I": i64([[1, 2], [1, 2], [0, -1]])}, ["X", "I"])
    check_gradient(nd, x)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_elements_with_traced_indices_and_updates(reduction):
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    i = i64([[0, -1, 2], [1, 1, -4]])
    if reduction == "none":
        i = i64([[0, -1, 2], [1, 2, -4]])  # no duplicate target: the result is defined
    u = RNG.standard_normal((2, 3)).astype(np.float32)
    feeds = {"X": x, "I": i, "U": u}
    model = make_model("ScatterElements", feeds, {}, ["X", "I", "U"], opset=18, axis=1, reduction=reduction)
    assert_same(jitted(model, feeds), reference(model, feeds))


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_nd_slices_with_negative_indices(reduction):
    x = RNG.standard_normal((4, 3)).astype(np.float32)
    i = i64([[-1], [1]] if reduction == "none" else [[-1], [1], [3]])
    u = RNG.standard_normal((len(i), 3)).astype(np.float32)
    feeds = {"X": x, "I": i, "U": u}
    model = make_model("ScatterND", feeds, {}, ["X", "I", "U"], opset=18, reduction=reduction)
    (y,) = jitted(model, feeds)
    expected = x.copy()
    combine = {"none": lambda a, b: b, "add": np.add, "mul": np.multiply,
               "max": np.maximum, "min": np.minimum}
    for row, update in zip(i[:, 0], u):
        expected[row] = combine[reduction](expected[row], update)
    np.testing.assert_allclose(y, expected, rtol=1e-6)


@pytest.mark.slow
def test_scatter_gradients_reach_data_and_updates():
    x = RNG.standard_normal((3, 4))
    model = make_model("ScatterElements", {"X": x}, {"I": i64([[1, 0, 3]]),
                                                     "U": RNG.standard_normal((1, 3))},
                       ["X", "I", "U"], axis=1, reduction="mul")
    check_gradient(model, x)
    weights = np.arange(12.0).reshape(3, 4)
    scatter = make_model("ScatterND", {"X": x, "U": np.zeros((2, 4))}, {"I": i64([[2], [0]])},
                         ["X", "I", "U"])
    fn = translate(scatter)
    with jax.enable_x64(True):
        def loss(updates):
            return jnp.sum(weights * fn.apply(fn.params, {"X": x, "U": updates})["Y0"])

        grad = jax.grad(loss)(jnp.zeros((2, 4)))
    np.testing.assert_array_equal(np.asarray(grad), weights[[2, 0]])


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensor_scatter_with_traced_write_indices(mode):
    cache = RNG.standard_normal((2, 3, 5, 2)).astype(np.float32)
    update = RNG.standard_normal((2, 3, 2, 2)).astype(np.float32)
    write = i64([4, 1] if mode == "circular" else [3, 0])
    feeds = {"C": cache, "U": update, "W": write}
    model = make_model("TensorScatter", feeds, {}, ["C", "U", "W"], opset=24, mode=mode, axis=2)
    assert_same(jitted(model, feeds), reference(model, feeds))


def test_tensor_scatter_overrunning_a_linear_cache_is_an_error():
    cache, update = np.zeros((2, 4, 3), np.float32), np.ones((2, 2, 3), np.float32)
    model = make_model("TensorScatter", {"C": cache, "U": update}, {"W": i64([1, 3])}, ["C", "U", "W"],
                       opset=24, axis=1)
    with pytest.raises(ModelLoadError, match="overrun"):
        jitted(model, {"C": cache, "U": update})


# --- OneHot, Trilu, CumSum, CumProd, ReverseSequence ------------------------------------------


def test_one_hot_float_indices_and_depth_on_a_middle_axis():
    indices = np.array([[0.0, -1.0], [2.9, 7.0], [-2.0, 1.0]], np.float32)
    values = np.array([-2, 5], np.int32)
    model = make_model("OneHot", {"I": indices, "V": values}, {"D": np.array(3.0, np.float32)},
                       ["I", "D", "V"], axis=-2)
    feeds = {"I": indices, "V": values}
    assert_same(jitted(model, feeds), reference(model, feeds))


def test_trilu_with_k_initializer_on_a_batch_of_integers():
    x = RNG.integers(-9, 9, size=(2, 3, 5)).astype(np.int32)
    for upper, k in [(1, -1), (0, 2)]:
        model = make_model("Trilu", {"X": x}, {"K": i64(k)}, ["X", "K"], opset=14, upper=upper)
        assert_same(jitted(model, {"X": x}), reference(model, {"X": x}))


@pytest.mark.parametrize("op_type, opset", [("CumSum", 14), ("CumProd", 26)])
@pytest.mark.parametrize("exclusive, reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.slow
def test_running_totals_gradients(op_type, opset, exclusive, reverse):
    x = RNG.uniform(0.5, 1.5, size=(3, 4))
    model = make_model(op_type, {"X": x}, {"A": np.array(-1, np.int32)}, ["X", "A"], opset=opset,
                       exclusive=exclusive, reverse=reverse)
    accumulate = np.cumsum if op_type == "CumSum" else np.cumprod
    identity = 0.0 if op_type == "CumSum" else 1.0
    walk = x[:, ::-1] if reverse else x
    totals = accumulate(walk, axis=1)
    if exclusive:
        totals = np.concatenate([np.full((3, 1), identity), totals[:, :-1]], axis=1)
    np.testing.assert_allclose(jitted(model, {"X": x})[0], totals[:, ::-1] if reverse else totals)
    check_gradient(model, x)


def test_cumsum_keeps_small_integer_types():
    x = np.array([100, 100, 100], np.int32)
    model = make_model("CumSum", {"X": x}, {"A": i64(0)}, ["X", "A"], opset=14)
    (y,) = jitted(model, {"X": x})
    assert y.dtype == np.int32 and y.tolist() == [100, 200, 300]


def test_reverse_sequence_batch_major_with_traced_lengths():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    lengths = i64([4, 1, 2])
    feeds = {"X": x, "L": lengths}
    model = make_model("ReverseSequence", feeds, {}, ["X", "L"], time_axis=1, batch_axis=0)
    assert jitted(model, feeds)[0].tolist() == [[3, 2, 1, 0], [4, 5, 6, 7], [9, 8, 10, 11]]


# --- Selections: Compress, NonZero, Unique -------------------------------------------------


def test_compress_with_a_constant_condition_compiles():
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    model = make_model("Compress", {"X": x}, {"C": np.array([True, False, True])}, ["X", "C"], axis=1)
    np.testing.assert_array_equal(jitted(model, {"X": x})[0], x[:, [0, 2]])
    flat = make_model("Compress", {"X": x}, {"C": np.array([False, True, True])}, ["X", "C"])
    np.testing.assert_array_equal(jitted(flat, {"X": x})[0], x.reshape(-1)[1:3])


def test_nonzero_of_a_traced_input_runs_eagerly():
    x = np.array([[0, 3], [2, 0]], np.float32)
    model = make_model("NonZero", {"X": x}, {}, ["X"])
    (y,) = run(model, {"X": x})
    assert y.dtype == np.int64 and y.tolist() == [[0, 1], [1, 0]]
    five = np.array(5, np.int32)
    (scalar,) = run(make_model("NonZero", {"X": five}, {}, ["X"]), {"X": five})
    assert scalar.tolist() == [[0]]  # as onnxruntime: a scalar counts as a 1-element vector


@pytest.mark.parametrize("axis", [None, 0, -1])
def test_unique_sorted_outputs_match_the_reference(axis):
    x = np.array([[2, 1, 2], [0, 5, 0], [2, 1, 2]], np.float32)
    model = make_model("Unique", {"X": x}, {}, ["X"], outputs=4, **({} if axis is None else {"axis": axis}))
    assert_same(run(model, {"X": x}), reference(model, {"X": x}))


@pytest.mark.parametrize("axis, expected", [
    (None, ([2, 1, 0, 5], [0, 1, 3, 4], [0, 1, 0, 2, 3, 2, 0, 1, 0], [4, 2, 2, 1])),
    (0, ([[2, 1, 2], [0, 5, 0]], [0, 1], [0, 1, 0], [2, 1])),
    (-1, ([[2, 1], [0, 5], [2, 1]], [0, 1], [0, 1, 0], [2, 1])),
])
def test_unique_unsorted_keeps_the_order_of_first_occurrence(axis, expected):
    # Hand-derived: onnx.reference takes unsorted values along axis 0 of the unflattened input.
    x = np.array([[2, 1, 2], [0, 5, 0], [2, 1, 2]], np.float32)
    model = make_model("Unique", {"X": x}, {}, ["X"], outputs=4, sorted=0,
                       **({} if axis is None else {"axis": axis}))
    outputs = run(model, {"X": x})
    assert outputs[0].dtype == np.float32 and all(o.dtype == np.int64 for o in outputs[1:])
    assert [o.tolist() for o in outputs] == [list(e) for e in expected]


# --- TopK, ArgMax, ArgMin ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.float64])
def test_top_k_smallest_is_stable_on_ties(dtype):
    info = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else np.finfo(dtype)
    x = np.array([[3, info.min, 3, info.max, 1, info.min]], dtype)
    model = make_model("TopK", {"X": x}, {"K": i64([4])}, ["X", "K"], outputs=2, largest=0)
    values, indices = jitted(model, {"X": x})
    assert indices.dtype == np.int64
    assert indices.tolist() == [[1, 5, 4, 0]] and values.dtype == x.dtype


@pytest.mark.slow
def test_top_k_v1_and_gradient():
    x = RNG.standard_normal((3, 5))
    old = make_model("TopK", {"X": x}, {}, ["X"], outputs=2, opset=9, k=2, axis=0)
    values, indices = jitted(old, {"X": x})
    np.testing.assert_array_equal(indices, np.argsort(-x, axis=0, kind="stable")[:2])
    np.testing.assert_array_equal(values, -np.sort(-x, axis=0)[:2])
    check_gradient(make_model("TopK", {"X": x}, {"K": i64([3])}, ["X", "K"], outputs=2), x)


@pytest.mark.parametrize("op_type", ["ArgMax", "ArgMin"])
def test_arg_extremes_select_last_index_without_keepdims(op_type):
    x = np.array([[1, 4, 4, 1], [7, 7, 0, 0]], np.float32)
    model = make_model(op_type, {"X": x}, {}, ["X"], axis=-1, keepdims=0, select_last_index=1)
    (y,) = jitted(model, {"X": x})
    assert y.dtype == np.int64
    assert y.tolist() == ([2, 1] if op_type == "ArgMax" else [3, 3])


def test_depth_to_space_inverts_space_to_depth_in_both_modes():
    x = RNG.standard_normal((1, 2, 4, 6)).astype(np.float32)
    for mode in ("DCR", "CRD"):
        nodes = [helper.make_node("SpaceToDepth", ["X"], ["D"], blocksize=2, mode=mode),
                 helper.make_node("DepthToSpace", ["D"], ["Y"], blocksize=2, mode=mode)]
        graph = helper.make_graph(nodes, "roundtrip",
                                  [helper.make_tensor_value_info("X", TensorProto.FLOAT, x.shape)],
                                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 28)])
        np.testing.assert_array_equal(jitted(model, {"X": x})[0], x)

