"""StateStore: the mutable variables of a training model, their spare buffers and a PRNG key.

The store is the only thing that writes its values, and every change goes through one of
a few calls, each of which swaps in a complete, consistent set of values at once:

    spares(names)            buffers a compiled step may write the new values into (donated)
    commit(updates, key)     swap in new values; with recycle=True the replaced ones become
                             the next step's spares (double buffering)
    keep(discarded)          a refused step: the state stays, its results become spares
    set / restore / place    a user's value, a checkpoint, a move to other devices

Two invariants hold after every call:
- no two variables (and no variable and a spare) share a buffer, whatever the model binds:
  a step donates the buffers, and one buffer cannot be donated twice;
- values handed out are copies (StateView), since the store's own buffers are donated and
  so invalidated by the next step.

`transaction()` serializes callers: a step's spares, run and commit form one unit, so
threads sharing a trainer neither lose updates nor read a donated buffer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from onnxtrain.errors import InputError, ModelLoadError
from onnxtrain.state.memory import device_copy, device_zeros

Values = Mapping[str, jax.Array]


def _distinct(values: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """`values` with every array that stands under a second name replaced by a copy."""
    seen: set[int] = set()
    for name, value in values.items():
        if id(value) in seen:
            values[name] = device_copy(value)
        seen.add(id(values[name]))
    return values


def _kind(dtype: np.dtype) -> str | None:
    """'b', 'i' or 'f' for boolean, integer (ml_dtypes' too) and floating dtypes; else None."""
    if dtype == np.bool_:
        return "b"
    if jnp.issubdtype(dtype, jnp.integer):
        return "i"
    if jnp.issubdtype(dtype, jnp.floating):
        return "f"
    return None


def _first(array: np.ndarray, where: np.ndarray) -> str:
    """The first of `array`'s values where `where` holds, and its index, for a message."""
    index = tuple(int(i) for i in np.argwhere(where)[0])
    return f"{array[index].item()!r}" + (f" at index {list(index)}" if index else "")


def _integer_range(dtype: np.dtype) -> tuple[int, int]:
    if dtype == np.bool_:
        return 0, 1
    info = ml_dtypes.iinfo(dtype)
    return int(info.min), int(info.max)


def _converted(name: str, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`array` cast to a state variable's dtype, refused where the cast would not keep its values.

    Raises:
        InputError: naming the variable, its dtype and the first offending value.
    """
    source, target = _kind(array.dtype), _kind(dtype)
    if source is None or target is None:
        raise InputError(f"state variable {name!r} is {dtype}; got a {array.dtype} value")
    if source == "f":
        broken = ~np.isfinite(array)
        if broken.any():
            raise InputError(f"state variable {name!r} is {dtype}; got {int(broken.sum())} NaN or Inf "
                             f"value(s) of {array.size}, the first {_first(array, broken)}; state "
                             "values must be finite")
    if source != "f" and target != "f":
        # Compared as Python ints: a cast and back cannot tell uint64's 2**64-1 from int64's -1.
        low, high = _integer_range(dtype)
        if array.size and (int(array.min()) < low or int(array.max()) > high):
            outside = (array < low) | (array > high)
            raise InputError(f"state variable {name!r} is {dtype}, which holds {low}..{high}; "
                             f"{_first(array, outside)} does not fit it exactly")
        return array.astype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        converted = array.astype(dtype)
        if target == "f":
            overflowed = ~np.isfinite(converted)
            if overflowed.any():
                largest = float(ml_dtypes.finfo(dtype).max)
                raise InputError(f"state variable {name!r} is {dtype}, whose largest finite value is "
                                 f"{largest:.8g}; {int(overflowed.sum())} value(s) of {array.size} overflow "
                                 f"it, the first {_first(array, overflowed)}")
            return converted
        # A finite float held by an integer dtype comes back from the cast unchanged; any other does not.
        changed = converted.astype(array.dtype) != array
    if changed.any():
        raise InputError(f"state variable {name!r} is {dtype}; {_first(array, changed)} does not fit "
                         "it exactly")
    return converted


class StateView(Mapping):
    """Read-only view of a store: each lookup returns a copy of the current value."""

    def __init__(self, store: StateStore, names: tuple[str, ...]):
        self._store = store
        self._names = names

    def __getitem__(self, name: str) -> jax.Array:
        if name not in self._names:
            raise KeyError(name)
        with self._store.transaction():
            return device_copy(self._store.values[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        values = self._store.values
        shapes = ", ".join(f"{n}: {values[n].dtype}{list(values[n].shape)}" for n in self._names)
        return f"<state {{{shapes}}}>"


class StateStore:
    """name -> device array, plus a PRNG key and the spare buffers of double-buffered steps."""

    def __init__(self, values: Mapping[str, Any] | Iterable[tuple[str, Any]], key: jax.Array):
        """values: a mapping, or (name, value) pairs moved to the device one by one (so a
        generator decoding a large model's weights never holds them all on the host); a
        jax.ShapeDtypeStruct value stands for zeros (optimizer slots), made without writing."""
        pairs = values.items() if isinstance(values, Mapping) else values
        self._values: dict[str, jax.Array] = {name: device_copy(v) for name, v in pairs}
        self.key = key
        self._spares: dict[str, jax.Array] = {}
        self._place: Callable[[Values], dict[str, jax.Array]] = dict
        self._place_key: Callable[[jax.Array], jax.Array] = lambda key: key
        self._lock = threading.RLock()

    @property
    def values(self) -> Values:
        """The current values (the store's own buffers: read them, never keep them past a step)."""
        return self._values

    def transaction(self) -> threading.RLock:
        """A reentrant lock; hold it across everything that reads, runs and commits one change."""
        return self._lock

    def view(self, names: tuple[str, ...]) -> StateView:
        return StateView(self, names)

    def nbytes(self, names: Iterable[str]) -> int:
        return sum(self._values[name].nbytes for name in names)

    def place(self, place_values: Callable[[Values], dict[str, jax.Array]],
              place_key: Callable[[jax.Array], jax.Array]) -> None:
        """Move every value (and the key) where `place_values` puts them; spares made later go
        there too. The store's values keep that placement from then on."""
        self._place, self._place_key = place_values, place_key
        self._values = _distinct(place_values(self._values))
        self.key = place_key(self.key)
        self._spares.clear()

    def spares(self, names: Iterable[str]) -> dict[str, jax.Array]:
        """Buffers for a call to write the new values of `names` into (to donate to it): those
        the last double-buffered commit replaced, zeros shaped like the values where there are
        none. The caller owns them until it commits or keeps them."""
        taken, missing = {}, {}
        for name in names:
            spare = self._spares.pop(name, None)
            if spare is None:
                value = self._values[name]
                missing[name] = device_zeros(value.shape, value.dtype)
            else:
                taken[name] = spare
        if missing:
            taken.update(self._place(missing))
        return taken

    def commit(self, updates: Values, key: jax.Array | None = None, recycle: bool = False) -> None:
        """Swap in new values for the variables in `updates` (and the key, unless None) at once.
        recycle: keep the values they replace as spares (a double-buffered step read them
        without donating them). A value passed through unchanged is the very same array: it
        is never kept."""
        old = self._values
        if not updates.keys() <= old.keys():
            unknown = sorted(updates.keys() - old.keys())
            raise ValueError(f"commit names {unknown}, which are not state variables")
        values = {**old, **updates}
        # This runs every step: a cheap check first, copies only where two names hold one array.
        live = {id(value) for value in values.values()}
        if len(live) != len(values):
            values = _distinct(values)
            live = {id(value) for value in values.values()}
        self._values = values
        if recycle:
            spares = self._spares
            for name in updates:
                if id(old[name]) not in live:
                    spares[name] = old[name]
        if key is not None:
            self.key = key

    def keep(self, discarded: Values) -> None:
        """A refused step: the state stays as it was; `discarded` (results nobody will read,
        written into spares) become spares again."""
        self._spares.update(discarded)

    def set(self, name: str, value: Any) -> None:
        """Replace one variable by a value of the same shape that its dtype holds.

        Floats are rounded to the variable's precision; anything else that would change the
        value (NaN or Inf, a float past the dtype's range, an integer or boolean it does not
        hold exactly) is refused and the variable keeps its value.

        Raises:
            InputError: `name` is not a variable, or the value's shape or values do not fit it.
        """
        if name not in self._values:
            raise InputError(f"{name!r} is not a state variable; known: {sorted(self._values)}")
        current = self._values[name]
        array = np.asarray(value)
        if array.shape != current.shape:
            raise InputError(f"state variable {name!r} has shape {list(current.shape)}; "
                             f"got {list(array.shape)}")
        converted = _converted(name, array, np.dtype(current.dtype))
        self._values = {**self._values, **self._place({name: device_copy(converted)})}

    def restore(self, values: Mapping[str, Any], key: jax.Array, source: str) -> None:
        """Replace everything by saved values, which must match the variables exactly."""
        if set(values) != set(self._values):
            raise ModelLoadError(f"{source} holds {sorted(values)} but this model's state is "
                                 f"{sorted(self._values)}; it was saved from a different model")
        for name, value in values.items():
            current = self._values[name]
            if np.shape(value) != current.shape or np.asarray(value).dtype != current.dtype:
                raise ModelLoadError(f"{source}: {name!r} is {np.asarray(value).dtype}{list(np.shape(value))}, "
                                     f"the model's is {current.dtype}{list(current.shape)}")
        self._values = _distinct(self._place({name: device_copy(value) for name, value in values.items()}))
        self.key = self._place_key(key)
