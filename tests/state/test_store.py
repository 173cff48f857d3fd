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
