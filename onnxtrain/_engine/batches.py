"""Batches stacked along a new first axis, for compiled calls that run one step per batch.

fit collects a chunk of batches while the loader makes the next ones, and a loader may
refill one buffer for every batch, so each batch is copied as it arrives. StackBuilder
copies it straight into the next row of a stacked buffer, aligned so that JAX on CPU reads
it in place, and `stack` hands such rows on as they lie: one copy per batch instead of
three (a copy on arrival, np.stack's, and JAX's copy of an unaligned stack).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from onnxtrain.state.memory import aligned_host_array

Feeds = Mapping[str, Any]

# The memory of every buffer a StackBuilder filled, by id, while it lives: `stack` views
# rows of these in place, and no other memory (a caller's array may change after a call).
_BUILT: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()


def signature(feeds: Feeds) -> tuple:
    """What batches must share to be stacked: names, shapes and dtypes."""
    return tuple((name, np.shape(value), getattr(value, "dtype", None)) for name, value in feeds.items())


def same_signature_runs(feeds: Sequence[Feeds]) -> list[list[Feeds]]:
    """Consecutive feeds split into runs of one signature."""
    runs: list[list[Feeds]] = []
    last = None
    for item in feeds:
        current = signature(item)
        if runs and current == last:
            runs[-1].append(item)
        else:
            runs.append([item])
        last = current
    return runs


def _built_rows(parts: Sequence[np.ndarray]) -> np.ndarray | None:
    """`parts` as one array without copying, if they are consecutive rows of a buffer a
    StackBuilder filled; else None."""
    first = parts[0]
    owner = first.base
    if owner is None or _BUILT.get(id(owner)) is not owner:
        return None
    start = first.__array_interface__["data"][0]
    for index, part in enumerate(parts):
        if (part.base is not owner or part.__array_interface__["data"][0] != start + index * first.nbytes
                or part.shape != first.shape or part.dtype != first.dtype or not part.flags.c_contiguous):
            return None
    return np.ndarray((len(parts), *first.shape), first.dtype, buffer=owner,
                      offset=start - owner.__array_interface__["data"][0])


def _stack_host(parts: Sequence[np.ndarray]) -> np.ndarray:
    built = _built_rows(parts)
    return np.stack(parts) if built is None else built


def stack(run: Sequence[Feeds]) -> dict[str, Any]:
    """Feeds of one signature stacked along a new first axis: on the host when they are there
    (in place when StackBuilder made them), else on the device."""
    on_host = all(isinstance(v, np.ndarray) for feeds in run for v in feeds.values())
    return {name: (_stack_host if on_host else jnp.stack)([feeds[name] for feeds in run]) for name in run[0]}


def unstack(stacked: Mapping[str, Any]) -> list[dict[str, Any]]:
    """stack's inverse: the per-step feeds of feeds stacked along a first axis."""
    count = len(next(iter(stacked.values())))
    return [{name: value[index] for name, value in stacked.items()} for index in range(count)]


class StackBuilder:
    """Copies up to `capacity` batches of one signature, whose values are all numpy arrays,
    into the rows of one aligned buffer per input; each batch's copy is a view of its row."""

    def __init__(self, first: Feeds, capacity: int):
        self._signature = signature(first)
        self._buffers = {}
        for name, value in first.items():
            buffer = aligned_host_array((capacity, *value.shape), value.dtype)
            _BUILT[id(buffer.base)] = buffer.base
            self._buffers[name] = buffer
        self._capacity = capacity
        self._count = 0

    @staticmethod
    def stackable(feeds: Feeds) -> bool:
        """Whether a builder can take `feeds`: some inputs, every one a numpy array."""
        return bool(feeds) and all(isinstance(value, np.ndarray) for value in feeds.values())

    def accepts(self, feeds: Feeds) -> bool:
        """Whether `feeds` can take the next row: room left, all numpy, the same signature."""
        return self._count < self._capacity and self.stackable(feeds) and signature(feeds) == self._signature

    def add(self, feeds: Feeds) -> dict[str, np.ndarray]:
        """Copy `feeds` (which `accepts`) into the next row; returns the copy."""
        row = {}
        for name, buffer in self._buffers.items():
            buffer[self._count] = feeds[name]
            row[name] = buffer[self._count, ...]
        self._count += 1
        return row
