"""StateStore: the mutable variables of a training model and its PRNG key.

Compiled steps take the whole store as a donated argument, so XLA updates the
buffers in place. Two consequences shape this class:
- changes are transactional: a step hands back a complete new set of values
  and `commit` swaps it in at once; anything that raises before that leaves
  every variable as it was;
- values handed to users are copies: the store's own buffers are donated (and
  so invalidated) by the next step, a copy stays valid.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from onnxtrain.errors import InputError, ModelLoadError
from onnxtrain.host_memory import aligned_host_array


def device_zeros(shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Zeros on the device, made without compiling (jnp.zeros compiles a program per shape, too
    quick for the persistent cache to keep, which a model with many shapes paid at every start)
    and without writing them: fresh zeroed host memory is mapped by the OS only when first
    written, and on CPU device_put of aligned memory keeps using it. Nothing else holds it."""
    with jax.enable_x64(True):
        return jax.device_put(aligned_host_array(shape, dtype, zeroed=True)).block_until_ready()


def _device_array(value: Any) -> jax.Array:
    """A device copy of `value` that nothing else holds, made without compiling (see
    device_zeros); a jax.ShapeDtypeStruct stands for zeros. On CPU, device_put of an aligned
    host array aliases it, so that case is copied once more on the device; copying on the
    host instead would write every zero page of a large array it was given."""
    if isinstance(value, jax.ShapeDtypeStruct):
        return device_zeros(value.shape, value.dtype)
    with jax.enable_x64(True):
        if isinstance(value, jax.Array):
            # No target keeps an uncommitted array uncommitted (jit would otherwise see a new
            # signature); an array spanning processes needs its sharding named.
            target = None if value.is_fully_addressable else value.sharding
            return jax.device_put(value, target, may_alias=False)
        host = np.asarray(value)
        copied = jax.device_put(host)
        if _shares_memory(copied, host):
            copied = jax.device_put(copied, may_alias=False)
        # The transfer may still read the caller's buffer: finish it before the caller can reuse it.
        return copied.block_until_ready()


def _shares_memory(device: jax.Array, host: np.ndarray) -> bool:
    start = host.__array_interface__["data"][0]
    return start <= device.unsafe_buffer_pointer() < start + max(host.nbytes, 1)


class StateView(Mapping):
    """Read-only view of a store: each lookup returns a copy of the current value."""

    def __init__(self, store: StateStore, names: tuple[str, ...]):
        self._store = store
        self._names = names

    def __getitem__(self, name: str) -> jax.Array:
        if name not in self._names:
            raise KeyError(name)
        return _device_array(self._store.values[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}: {self._store.values[n].dtype}{list(self._store.values[n].shape)}"
                           for n in self._names)
        return f"<state {{{shapes}}}>"


class StateStore:
    """name -> device array, plus a PRNG key; replaced only as a whole."""

    def __init__(self, values: Mapping[str, Any] | Iterable[tuple[str, Any]], key: jax.Array):
        """values: a mapping, or (name, value) pairs moved to the device one by one (so a
        generator decoding a large model's weights never holds them all on the host); a
        jax.ShapeDtypeStruct value stands for zeros (optimizer slots), made without writing."""
        pairs = values.items() if isinstance(values, Mapping) else values
        self.values: dict[str, jax.Array] = {name: _device_array(v) for name, v in pairs}
        self.key = key

    def view(self, names: tuple[str, ...]) -> StateView:
        return StateView(self, names)

    def commit(self, values: Mapping[str, jax.Array], key: jax.Array | None = None) -> None:
        """Swap in a complete new set of values (and key) at once."""
        if set(values) != set(self.values):
            raise ValueError(f"commit must cover exactly the variables {sorted(self.values)}")
        self.values = dict(values)
        if key is not None:
            self.key = key

    def set(self, name: str, value: Any) -> None:
        """Replace one variable by a value of the same shape that its dtype holds exactly."""
        if name not in self.values:
            raise InputError(f"{name!r} is not a state variable; known: {sorted(self.values)}")
        current = self.values[name]
        array = np.asarray(value)
        if array.shape != current.shape:
            raise InputError(f"state variable {name!r} has shape {list(current.shape)}; "
                             f"got {list(array.shape)}")
        if array.dtype.kind not in "biuf":
            raise InputError(f"state variable {name!r} is {current.dtype}; got a {array.dtype} value")
        converted = array.astype(current.dtype)
        # Rounding to a float variable's precision is expected; changing an integer's value is not.
        if jnp.issubdtype(current.dtype, jnp.integer) or current.dtype == bool:
            if not np.array_equal(converted.astype(array.dtype), array):
                raise InputError(f"state variable {name!r} is {current.dtype}; {value!r} does not "
                                 "fit it exactly")
        self.values = {**self.values, name: _device_array(converted)}

    def restore(self, values: Mapping[str, Any], key: jax.Array, source: str) -> None:
        """Replace everything by saved values, which must match the variables exactly."""
        if set(values) != set(self.values):
            raise ModelLoadError(f"{source} holds {sorted(values)} but this model's state is "
                                 f"{sorted(self.values)}; it was saved from a different model")
        for name, value in values.items():
            current = self.values[name]
            if np.shape(value) != current.shape or np.asarray(value).dtype != current.dtype:
                raise ModelLoadError(f"{source}: {name!r} is {np.asarray(value).dtype}{list(np.shape(value))}, "
                                     f"the model's is {current.dtype}{list(current.shape)}")
        self.commit({name: _device_array(value) for name, value in values.items()}, key)
