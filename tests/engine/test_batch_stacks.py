"""Stacking a chunk of batches: fit copies each batch once, into the stack it runs from."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from onnxtrain._engine.batches import same_signature_runs, stack
from onnxtrain.fitting import _chunks
from support.host_buffers import host_array


def _batches(rows: list[int], seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(n, 3)).astype(np.float32), "labels": rng.integers(0, 5, n).astype(np.int32)} for n in rows]


def _refilling_loader(batches):
    """Yields one dict of buffers, refilled with each batch in turn (as a data loader may)."""
    buffers = {name: np.empty_like(value) for name, value in batches[0].items()}
    for feeds in batches:
        for name, value in feeds.items():
            buffers[name][...] = value
        yield buffers


def test_a_chunk_is_copied_on_arrival_into_aligned_stacks_that_stack_uses_in_place():
    batches = _batches([4] * 6)
    chunks = list(_chunks(_refilling_loader(batches), 3))
    assert [len(chunk) for chunk in chunks] == [3, 3]
    for chunk, originals in zip(chunks, (batches[:3], batches[3:])):
        stacked = stack(chunk)
        for name in ("x", "labels"):
            np.testing.assert_array_equal(stacked[name], np.stack([feeds[name] for feeds in originals]))
            assert all(np.shares_memory(stacked[name], feeds[name]) for feeds in chunk)
            assert stacked[name].ctypes.data % 64 == 0


def test_a_chunk_splits_its_stacks_where_the_signature_changes():
    batches = _batches([4, 4, 2, 2, 4])
    batches[3] = {name: jnp.asarray(value) for name, value in batches[3].items()}   # not on the host
    (chunk,) = list(_chunks(iter(batches), 5))
    runs = same_signature_runs(chunk)
    assert [len(run) for run in runs] == [2, 2, 1]
    first, second = stack(runs[0]), stack(runs[1])
    np.testing.assert_array_equal(first["x"], np.stack([batches[0]["x"], batches[1]["x"]]))
    assert np.shares_memory(first["x"], chunk[0]["x"])
    # A host batch and a device batch of one signature: stacked on the device, values intact.
    np.testing.assert_array_equal(np.asarray(second["x"]), np.stack([batches[2]["x"], np.asarray(batches[3]["x"])]))
    assert all(not np.shares_memory(feeds["x"], original["x"]) for feeds, original in zip(chunk, batches)
               if isinstance(original["x"], np.ndarray))


def test_stack_copies_rows_it_did_not_build_and_rows_out_of_order():
    """A caller's own array may change after the call returns, so only fit's copies are used
    in place; rows of a built stack taken out of order are copied too."""
    data = host_array(np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 3))
    callers = [{"x": data[i]} for i in range(4)]
    stacked = stack(callers)["x"]
    np.testing.assert_array_equal(stacked, data)
    assert not np.shares_memory(stacked, data)

    (chunk,) = list(_chunks(iter(callers), 4))
    swapped = stack([chunk[1], chunk[0], chunk[2]])["x"]
    np.testing.assert_array_equal(swapped, data[[1, 0, 2]])
    assert not np.shares_memory(swapped, chunk[0]["x"])
    tail = stack(chunk[1:3])["x"]
    np.testing.assert_array_equal(tail, data[1:3])
    assert np.shares_memory(tail, chunk[1]["x"])


def test_scalar_feeds_stack_as_arrays():
    feeds = [{"lr": np.asarray(0.1 * i, np.float32), "x": np.ones((2,), np.float32)} for i in range(3)]
    (chunk,) = list(_chunks(iter(feeds), 3))
    assert all(isinstance(item["lr"], np.ndarray) and item["lr"].shape == () for item in chunk)
    stacked = stack(chunk)
    np.testing.assert_array_equal(stacked["lr"], np.float32([0.0, 0.1, 0.2]))
    assert np.shares_memory(stacked["lr"], chunk[0]["lr"])
