"""The NaN/Inf check of a checked training step (nan_policy "raise" and "skip"), built for XLA:CPU.

On XLA:CPU every kernel of a compiled program costs a launch per step and 0.7-1 MB of
resident code, so the check is shaped to add few. The watched values go into one float32
vector, the evidence: a tensor of DOT_CHECK_ELEMENTS or more enters as its product with a
zero vector (0 * x is NaN exactly where x is NaN or Inf, and a matrix-vector product is
XLA:CPU's fastest full pass over a big tensor: vectorized and threaded), a smaller one as
it is. XLA copies the small ones into the evidence with one kernel and reduces it to the
step's flag with another. A flag per value took three kernels per value instead: the
benchmark MLP's checked step had 73 kernels, now 47 (41 unchecked); its 8-step scan 98
fusions, now 62; a process after fit ~7 MB less resident. The host reads the flag every step
and the evidence only after a fault, to name the faulty values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Watched tensors from this many elements on are reduced by a matrix-vector product before
# they enter the evidence; smaller ones are copied in whole.
DOT_CHECK_ELEMENTS = 16384
# A reduced tensor enters the evidence as one value per row of at least this many elements.
_MIN_ROW = 256


class Faults(NamedTuple):
    """What a checked step returns about NaN/Inf: `flag` is True for a faulty step (one per
    step of a multi-step call), `evidence` names the values (see EvidenceLayout)."""
    flag: Any
    evidence: Any


class EvidenceLayout(NamedTuple):
    """Which watched value each stretch of the evidence vector comes from."""
    names: tuple[str, ...]
    ends: tuple[int, ...]

    def faulty(self, evidence: np.ndarray) -> list[str]:
        """The names of the values whose stretch of one step's evidence is not all finite."""
        finite = np.isfinite(evidence)
        starts = (0, *self.ends[:-1])
        return [name for name, start, end in zip(self.names, starts, self.ends) if not finite[start:end].all()]


def _rows(value: jax.Array) -> jax.Array:
    """`value` as a matrix whose rows hold at least _MIN_ROW elements (trailing axes folded),
    so the matrix-vector product has a long inner loop and few results."""
    width = 1
    for size in reversed(value.shape):
        width *= size
        if width >= _MIN_ROW:
            break
    return value.reshape(-1, width)


def _stretch(value: jax.Array) -> jax.Array:
    """The evidence of one value: float32, non-finite exactly where the value is."""
    if value.size >= DOT_CHECK_ELEMENTS:
        rows = _rows(value)
        part = rows @ jnp.zeros(rows.shape[-1], rows.dtype)
    else:
        part = value.ravel()
        if part.dtype == jnp.float32:
            return part
        # Other types become 0 or NaN first: converting finite float64 could overflow to Inf.
        part = part * jnp.zeros((), part.dtype)
    if jnp.iscomplexobj(part):
        part = part.real + part.imag
    return part.astype(jnp.float32)


def check(named_values: Sequence[tuple[str, jax.Array]]) -> tuple[EvidenceLayout, Faults]:
    """The layout and Faults (flag, evidence) of one step's watched float values, traced
    inside the step. (A max-reduction would not do for the flag: XLA:CPU's max drops NaN.)"""
    stretches = [_stretch(value) for _, value in named_values]
    layout = EvidenceLayout(tuple(name for name, _ in named_values),
                            tuple(np.cumsum([len(s) for s in stretches], dtype=int).tolist()))
    evidence = jnp.concatenate(stretches) if stretches else jnp.zeros((0,), jnp.float32)
    return layout, Faults(jnp.isnan(jnp.sum(evidence * jnp.float32(0))), evidence)


def any_fault(faults: Faults) -> bool:
    """Whether any step behind `faults` produced NaN/Inf; waits for the device."""
    return bool(np.asarray(faults.flag).any())


def first_fault(faults: Faults, layout: EvidenceLayout) -> tuple[int, list[str]]:
    """(index of the first faulty step, the names of the values it made non-finite) of a
    call whose faults any_fault found."""
    flags = np.asarray(faults.flag).reshape(-1)
    first = int(np.argmax(flags))
    evidence = np.asarray(faults.evidence).reshape(len(flags), -1)[first]
    return first, layout.faulty(evidence)
