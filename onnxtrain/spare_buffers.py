"""Spare buffers: where a compiled training step writes the new state while it only reads the old.

Donating the state to the step looks like the lean way to update it, but on XLA:CPU it is not
for a convolutional model: XLA copies the weights the backward pass reads before updating them
in place and keeps those copies in scratch memory next to the gradients, fresh pages every
step. A ResNet-18 step needed 134 instead of 48 MB of scratch (as many MB of page faults per
step) and took 1.2x the time, Trainer and FineTuner alike. So a step writes into the buffers
the step before replaced, donated, and the state is held twice (ResNet-18's peak RSS: 813-834
against 808-812 MB): too much for a large model, which from LARGE_STATE_BYTES on is updated
in place. A tiny state is updated in place too: there a step's time is dispatch more than
memory, and the spare buffers are as many more arguments to pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax

from onnxtrain.sharding import Placement
from onnxtrain.state.store import device_zeros

# From this many bytes of updated state on, steps stop double-buffering it (a second copy of
# a 100M-parameter Adam model's state took its peak from 1.2x to 2.1x the state).
LARGE_STATE_BYTES = 256 * 2**20
# Below this many bytes a step that need not keep the old state updates it in place: double-
# buffered, the benchmark transformer (0.4 MB in 55 values) took 1.03x the time, the CNN
# (0.2 MB) the same, the MLP (2.3 MB) 0.97-1.01x.
SMALL_STATE_BYTES = 2**20


def updates_in_place(state_bytes: int) -> bool:
    """Whether a step that need not keep the old state updates a state of this size in place
    rather than double-buffer it: below SMALL_STATE_BYTES or from LARGE_STATE_BYTES on."""
    return not SMALL_STATE_BYTES <= state_bytes < LARGE_STATE_BYTES


class SpareBuffers:
    """The values the last step replaced, kept for the next step to write into."""

    def __init__(self, placement: Placement):
        self._placement = placement
        self._held: dict[str, jax.Array] = {}

    def take(self, old: Mapping[str, jax.Array], names: Iterable[str]) -> dict[str, jax.Array]:
        """Buffers for a call to write the new values of `names` into (to donate to it): the
        values the last call replaced, zeros shaped like `old`'s where there are none yet."""
        spare, self._held = self._held, {}
        missing = {name: device_zeros(old[name].shape, old[name].dtype) for name in names if name not in spare}
        spare.update(self._placement.place_state(missing))
        return spare

    def keep_replaced(self, old: Mapping[str, jax.Array], updates: Mapping[str, jax.Array]) -> None:
        """Keep the values `updates` replaced as the next call's buffers. A value a step passes
        through unchanged comes back as the very same array: never keep that one."""
        live = {id(value) for value in updates.values()}
        self._held = {name: old[name] for name in updates if id(old[name]) not in live}

    def keep(self, discarded: Mapping[str, jax.Array]) -> None:
        """Keep a result nobody will read (a refused step's) as the next call's buffers."""
        self._held = dict(discarded)
