"""The NaN/Inf guard of a checked training step (nan_policy "raise" and "skip"), and the life
cycle of its results.

The check is shaped for XLA:CPU, where every kernel of a program costs a launch per step
and resident code: the watched values go into one float32 vector, the evidence (a big
tensor enters as its product with a zero vector, since 0 * x is NaN exactly where x is NaN
or Inf and a matrix-vector product is XLA:CPU's fastest full pass; a small one as it is),
which one more kernel reduces to the step's flag. The host reads the flag every step and
the evidence only after a fault, to name the faulty values (bench/RESULTS.md, "Design
measurements", has the kernel counts).

A FaultLedger carries one step function's checks through their life cycle:

    watch (traced, inside the step) -> defer (a call ran ahead of the host)
        -> settle (the host reads the flags, oldest first) -> report (raise or log)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from onnxtrain.errors import InputError, NumericError

logger = logging.getLogger("onnxtrain")
NAN_POLICIES = ("raise", "skip", "ignore")

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


def check_policy(policy: str) -> None:
    if policy not in NAN_POLICIES:
        raise InputError(f"nan_policy={policy!r} is not one of {NAN_POLICIES}")


class Unsettled(dict):
    """Outputs of a call whose NaN/Inf flags the host may not have read yet: call settle()
    before using the values (it raises or logs as the policy says)."""

    def __init__(self, values: Any, ledger: FaultLedger | None = None, call: int | None = None):
        super().__init__(values)
        self._ledger, self._call = ledger, call

    def settle(self) -> None:
        if self._ledger is not None:
            self._ledger.settle(through=self._call)


class Stacked(Unsettled):
    """Outputs of several steps stacked along a first axis (from one compiled call)."""


class FaultLedger:
    """One step function's NaN/Inf policy, the layouts its checks traced, and the faults of
    calls that ran ahead of the host, oldest first. Each feed signature's program has its own
    layout (an output's stretch grows with the batch), told apart by the evidence's length. Under "raise" a call that runs ahead
    starts from `accepting`, a device flag that turns False after a fault, so the calls
    after a faulty one change nothing and the state stays the last good one."""

    def __init__(self, policy: str, where: str, replicate: Callable[[Any], Any], lock: Any):
        check_policy(policy)
        self._lock = lock
        self.policy = policy
        self.checked = policy != "ignore"
        self.where = where
        self._replicate = replicate
        self._layout = EvidenceLayout((), ())   # the one traced last
        self._layouts: dict[int, EvidenceLayout] = {}   # by the length of one step's evidence
        self._pending: list[tuple[int, Faults]] = []
        self._calls = 0
        self.accepting = self._fresh_flag()

    def _fresh_flag(self) -> jax.Array:
        return self._replicate(jnp.asarray(True))

    def watch(self, named_values: Sequence[tuple[str, Any]]) -> Faults | None:
        """Inside a traced step: the Faults of the float values among `named_values`, or None
        when unchecked."""
        if not self.checked:
            return None
        watched = [(n, v) for n, v in named_values if jnp.issubdtype(jnp.result_type(v), jnp.inexact)]
        self._layout, faults = check(watched)
        self._keep(self._layout)
        return faults

    def _keep(self, layout: EvidenceLayout) -> None:
        self._layouts[layout.ends[-1] if layout.ends else 0] = layout

    def layout_record(self) -> list:
        """The layout the last traced check left, as JSON values: stored with its program in the
        executable cache."""
        return [list(self._layout.names), list(self._layout.ends)]

    def restore_layout(self, record: list) -> None:
        """Take the layout of a program loaded from the executable cache instead of traced."""
        names, ends = record
        self._keep(EvidenceLayout(tuple(names), tuple(ends)))

    def defer(self, outputs: Unsettled, faults: Faults | None) -> Unsettled:
        """`outputs` of a call that ran ahead, its faults queued for settle()."""
        if faults is None:
            return outputs
        self._calls += 1
        self._pending.append((self._calls, faults))
        return type(outputs)(outputs, self, self._calls)

    def settle(self, through: int | None = None) -> None:
        """Read the flags of deferred calls up to call number `through` (all by default),
        oldest first, waiting for the device, and report the first fault. After a fault under
        "raise" the later calls were no-ops: they are dropped with it."""
        with self._lock:
            while self._pending and (through is None or self._pending[0][0] <= through):
                _, faults = self._pending.pop(0)
                if any_fault(faults):
                    self._pending.clear()
                    self.accepting = self._fresh_flag()
                    self.report(faults, "step")

    def report(self, faults: Faults, step: str) -> None:
        """Act on a faulty call as the policy says: log under "skip", else NumericError."""
        length = np.size(faults.evidence) // max(1, np.size(faults.flag))
        first, names = first_fault(faults, self._layouts.get(length, self._layout))
        where = f"{self.where} {step}"
        steps_in_call = np.size(faults.flag)
        if steps_in_call > 1:
            where += f" (step {first} of a {steps_in_call}-step call)"
        if self.policy == "skip":
            logger.warning("%s produced NaN/Inf in %s; skipped, state unchanged", where, names)
            return
        raise NumericError(f"{where} produced NaN or Inf in {names}; the state keeps its last good "
                           "values. Lower the learning rate, check the data, or pass "
                           "nan_policy='skip' to skip such steps.")
