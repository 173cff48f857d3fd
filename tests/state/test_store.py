"""StateStore on its own: copies, atomic commits, spare buffers, what set() takes and refuses."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

from onnxtrain import InputError
from onnxtrain.proto import GraphProto
from onnxtrain.state.store import StateStore, device_zeros
from onnxtrain.translate.graph import iter_initializers
from onnxtrain.translate.tensors import numpy_to_tensor
from support.host_buffers import host_array

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


@pytest.mark.parametrize("alignment_offset", [0, 16])
@pytest.mark.parametrize("shape", [(2, 3), (1024, 1024)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_holds_its_own_copy_of_every_dtype_given(dtype, shape, alignment_offset):
    """Host arrays go to the device as copies (a caller reusing its buffer changes nothing),
    aligned ones that device_put would alias included, with their dtype kept exactly, 64-bit
    and ml_dtypes included."""
    given = host_array((np.arange(np.prod(shape)) % 64).reshape(shape).astype(dtype), alignment_offset)
    expected = given.copy()
    store = StateStore({"W": given, "n": 3, "x": 2.5}, jax.random.key(0))
    given[...] = given.flat[1]
    assert store.values["W"].dtype == dtype
    np.testing.assert_array_equal(np.asarray(store.values["W"]).view(np.uint8), expected.view(np.uint8))
    assert (store.values["n"].dtype, store.values["x"].dtype) == (np.int64, np.float64)


def test_store_and_its_views_copy_device_arrays():
    device = jax.numpy.arange(6.0)
    store = StateStore({"W": device}, jax.random.key(0))
    handed_out = store.view(("W",))["W"]
    pointers = {array.unsafe_buffer_pointer() for array in (device, store.values["W"], handed_out)}
    assert len(pointers) == 3
    np.testing.assert_array_equal(handed_out, np.arange(6.0))


def _resident_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


@pytest.mark.parametrize("dtype", DTYPES)
def test_shape_values_become_zeros_of_that_shape_and_dtype(dtype):
    store = StateStore({"m": jax.ShapeDtypeStruct((3, 4), dtype), "s": jax.ShapeDtypeStruct((), dtype)},
                       jax.random.key(0))
    for name, shape in (("m", (3, 4)), ("s", ())):
        value = store.values[name]
        assert (value.shape, value.dtype) == (shape, dtype)
        np.testing.assert_array_equal(np.asarray(value).reshape(-1).view(np.uint8), np.zeros(value.size, np.uint8).repeat(np.dtype(dtype).itemsize))


def test_device_zeros_take_no_memory_until_written_and_can_be_updated_in_place():
    """Optimizer slots start as device_zeros: a large model's Adam slots must not be resident
    while the model's weights are still being loaded."""
    before = _resident_mib()
    zeros = device_zeros((64, 1024, 1024), np.float32)
    assert _resident_mib() - before < 32
    doubled_plus_one = jax.jit(lambda x: x * 2 + 1, donate_argnums=0)(zeros)
    assert zeros.is_deleted()
    assert float(doubled_plus_one[63, 1023, 1023]) == 1.0 and float(doubled_plus_one.sum()) == 64 * 2 ** 20


def test_empty_sparse_initializers_come_as_their_shape_when_asked():
    graph = GraphProto()
    graph.initializer.append(numpy_to_tensor(np.ones((2, 2), np.float32), "dense"))
    for name, values in (("empty", np.zeros(0, np.float64)), ("one_entry", np.array([5], np.int64))):
        sparse = graph.sparse_initializer.add()
        sparse.values.CopyFrom(numpy_to_tensor(values, name))
        sparse.indices.CopyFrom(numpy_to_tensor(np.array([3] * values.size, np.int64), f"{name}_indices"))
        sparse.dims.extend([2, 3])
    as_shape = dict(iter_initializers(graph, empty_sparse_as_shape=True))
    assert as_shape["empty"] == jax.ShapeDtypeStruct((2, 3), np.float64)
    np.testing.assert_array_equal(as_shape["one_entry"], [[0, 0, 0], [5, 0, 0]])
    np.testing.assert_array_equal(as_shape["dense"], np.ones((2, 2)))
    np.testing.assert_array_equal(dict(iter_initializers(graph))["empty"], np.zeros((2, 3)))


def _buffers(store: StateStore) -> list[int]:
    return [value.unsafe_buffer_pointer() for value in store.values.values()]


def test_commit_swaps_in_the_named_variables_and_refuses_unknown_names():
    store = _store()
    with pytest.raises(ValueError, match="not state variables"):
        store.commit({"V": store.values["W"]})
    before_t = store.values["T"]
    store.commit({"W": store.values["W"] * 2})
    np.testing.assert_array_equal(store.values["W"], np.arange(6).reshape(2, 3) * 2)
    assert store.values["T"] is before_t


def test_no_two_variables_ever_share_a_buffer():
    """One array committed under two names (an initialization output bound to two variables),
    restored from one host array, or passed through unchanged: every variable gets its own
    buffer, so a step may donate them all."""
    store = StateStore({"a": np.zeros(3, np.float32), "b": np.ones(3, np.float32), "c": np.ones(3, np.float32)},
                       jax.random.key(0))
    shared = jax.numpy.full(3, 5.0, np.float32)
    store.commit({"a": shared, "b": shared})
    assert len(set(_buffers(store))) == 3
    np.testing.assert_array_equal(store.values["b"], [5, 5, 5])
    store.commit({"c": store.values["a"]})
    assert len(set(_buffers(store))) == 3
    host = np.full(3, 7.0, np.float32)
    store.restore({"a": host, "b": host, "c": host}, jax.random.key(1), "test")
    assert len(set(_buffers(store))) == 3
    donate = jax.jit(lambda values: {k: v + 1 for k, v in values.items()}, donate_argnums=0)
    store.commit(donate(dict(store.values)))
    np.testing.assert_array_equal(store.values["c"], [8, 8, 8])


def test_recycled_values_become_spares_and_spares_never_alias_state():
    store = _store()
    first = store.spares(["W"])["W"]
    assert first.unsafe_buffer_pointer() not in _buffers(store)
    old_w = store.values["W"]
    store.commit({"W": first + 1}, recycle=True)
    assert store.spares(["W"])["W"] is old_w
    # A value passed through unchanged stays state: it is never handed out as a spare.
    store.commit({"W": store.values["W"]}, recycle=True)
    assert store.spares(["W"])["W"].unsafe_buffer_pointer() not in _buffers(store)


def test_keep_returns_a_refused_steps_buffers_to_the_spares():
    store = _store()
    refused = {"W": store.spares(["W"])["W"]}
    before = dict(store.values)
    store.keep(refused)
    assert store.values == before
    assert store.spares(["W"])["W"] is refused["W"]


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


def _typed_store() -> StateStore:
    values = {"f32": np.zeros((2, 3), np.float32), "f16": np.zeros(2, np.float16),
              "bf16": np.zeros(2, ml_dtypes.bfloat16), "f8": np.zeros(2, ml_dtypes.float8_e4m3fn),
              "i64": np.array(3, np.int64), "u8": np.zeros(2, np.uint8), "flag": np.array(False)}
    return StateStore(values, jax.random.key(7))


def _refused_set(store: StateStore, name: str, value, *parts: str) -> str:
    """store.set(name, value) must raise an InputError naming the variable, its dtype and
    `parts`, and leave every value as it was."""
    before = {key: np.asarray(array).copy() for key, array in store.values.items()}
    with pytest.raises(InputError) as caught:
        store.set(name, value)
    message = str(caught.value)
    for part in (repr(name), str(np.dtype(store.values[name].dtype)), *parts):
        assert part in message, f"{part!r} not in: {message}"
    for key, array in store.values.items():
        assert np.asarray(array).tobytes() == before[key].tobytes()
    return message


@pytest.mark.parametrize("name", ["f32", "f16", "bf16", "f8", "i64", "u8", "flag"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_set_refuses_nan_and_inf_for_every_dtype(name, bad):
    store = _typed_store()
    shape = store.values[name].shape
    value = np.full(shape, bad) if shape else bad
    _refused_set(store, name, value, "NaN or Inf", repr(float(bad)))


def test_set_counts_the_non_finite_values_and_names_the_first():
    store = _typed_store()
    value = np.array([[0.0, np.nan, 1.0], [np.inf, np.nan, 2.0]])
    _refused_set(store, "f32", value, "3 NaN or Inf value(s) of 6", "nan at index [0, 1]")
    _refused_set(store, "bf16", np.array([1.0, np.nan], ml_dtypes.bfloat16), "1 NaN or Inf", "index [1]")


@pytest.mark.parametrize("name, value, largest", [
    ("f32", np.full((2, 3), 1e40), "3.4028235e+38"),              # the case
    ("f32", np.array([[1.0, 2.0, 3.0], [4.0, -1e39, 6.0]]), "3.4028235e+38"),
    ("f16", [65520.0, 0.0], "65504"),                               # first value that rounds to inf
    ("f16", np.array([70000, 1], np.int64), "65504"),               # an integer array overflows too
    ("f16", np.array([2**64 - 1, 0], np.uint64), "65504"),
    ("bf16", [1e39, 0.0], "3.3895314e+38"),
    ("f8", [1e4, 0.0], "448"),                                     # no inf: overflow gives NaN
], ids=["1e40 into float32", "one of six", "float16 edge", "int64 into float16", "uint64 into float16",
        "bfloat16", "float8_e4m3fn"])
def test_set_refuses_values_that_overflow_the_dtype(name, value, largest):
    message = _refused_set(_typed_store(), name, value, "overflow", largest)
    assert "the first" in message


def test_set_keeps_values_at_the_edge_of_the_range():
    store = _typed_store()
    store.set("f16", [65519.0, -65504.0])                     # rounds to float16's largest, not past it
    np.testing.assert_array_equal(store.values["f16"], np.array([65504, -65504], np.float16))
    store.set("f32", np.full((2, 3), 3.4028235e38))
    assert np.isfinite(np.asarray(store.values["f32"])).all()
    store.set("f8", [448.0, -448.0])
    np.testing.assert_array_equal(np.asarray(store.values["f8"]).astype(np.float32), [448, -448])
    store.set("bf16", np.array([1.5, -2.0], ml_dtypes.bfloat16))  # ml_dtypes values are floats too
    np.testing.assert_array_equal(np.asarray(store.values["bf16"]).astype(np.float32), [1.5, -2.0])


@pytest.mark.parametrize("name, value, shown", [
    ("i64", 2**63, "9223372036854775808"),                    # numpy makes it uint64
    ("i64", np.uint64(2**64 - 1), "18446744073709551615"),    # a cast and back would call it -1
    ("i64", 1e19, "1e+19"),
    ("i64", 2.5, "2.5"),
    ("u8", [256, 0], "256"),
    ("u8", [0, -1], "-1 at index [1]"),
    ("u8", [0.0, 255.5], "255.5"),
    ("flag", 2, "2"),
    ("flag", 0.5, "0.5"),
    ("flag", -1, "-1"),
], ids=["2**63 into int64", "uint64 max into int64", "1e19 into int64", "2.5 into int64", "256 into uint8",
        "-1 into uint8", "255.5 into uint8", "2 into bool", "0.5 into bool", "-1 into bool"])
def test_set_refuses_integers_and_booleans_their_dtype_does_not_hold(name, value, shown):
    _refused_set(_typed_store(), name, value, "does not fit", shown)


def test_set_takes_integers_and_booleans_that_fit():
    store = _typed_store()
    store.set("i64", np.uint64(2**63 - 1))
    assert int(store.values["i64"]) == 2**63 - 1
    store.set("u8", np.array([255.0, 0.0]))
    np.testing.assert_array_equal(store.values["u8"], np.array([255, 0], np.uint8))
    for value in (1, True, 1.0, np.int8(0)):
        store.set("flag", value)
        assert bool(store.values["flag"]) == bool(value) and store.values["flag"].dtype == np.bool_
    store.set("f32", np.ones((2, 3), np.int64))
    assert store.values["f32"].dtype == np.float32


@pytest.mark.parametrize("value", [1 + 2j, "nan", None, 10**40], ids=["complex", "string", "None", "huge int"])
def test_set_refuses_values_that_are_not_numbers(value):
    _refused_set(_typed_store(), "i64", value, "got a")
