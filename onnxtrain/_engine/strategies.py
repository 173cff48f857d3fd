"""How a pure step function runs against the store: the execution strategies, and the one
place that chooses them.

A step function (GraphStep for a model's own recipe, OptaxStep for fine-tuning) is pure:
(state, key, constants, feeds) -> (key, updates, outputs, kept). A strategy compiles it
into one shape of program and commits the result through the store:

    InPlace          donates the whole state and overwrites it (unchecked steps)
    DoubleBuffered   reads the state, writes the updates into donated spare buffers, commits
                     them only when the NaN/Inf check passes (a refused step touched nothing)
    CheckThenUpdate  a checked step on a large state: compute and check, keeping only what the
                     update tail reads (the gradients); then recompute the tail in place
    Linked           one step whose result the host reads later: old-or-new is selected on
                     the device, into spare buffers
    Scanned          several steps in one lax.scan
    Chained          several Linked calls back to back (graphs XLA:CPU runs slowly in a loop)

`choose` picks them once per step function, from the policy and the bound state's size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from onnxtrain._engine.batches import unstack
from onnxtrain._engine.compiled import Compiled, Job, Memo, ProgramLimit
from onnxtrain._engine.faults import FaultLedger, Faults, any_fault
from onnxtrain._engine.placement import DEFAULT_DEVICE, Placement
from onnxtrain._engine.update_tail import UpdateTail
from onnxtrain.state.memory import device_zeros
from onnxtrain.state.store import StateStore

# Below this many bytes of bound state an unchecked step updates in place: the copies XLA
# makes of the weights the backward pass reads before overwriting them cost less than spare
# buffers, one more argument per updated value every call. On larger states of some models
# they cost more (bench/RESULTS.md, "Updating in place up to 16 MiB").
SMALL_STATE_BYTES = 16 * 2**20
# From here checked steps wait for each step's flag instead of running ahead: selecting
# old-or-new on the device is one more pass over the state.
LINKED_STATE_BYTES = 16 * 2**20
# From here nothing is double-buffered: a second copy of the state costs more memory than a
# large model can spare (unchecked steps update in place, checked ones check then update).
LARGE_STATE_BYTES = 256 * 2**20
# Outputs up to this many elements start copying to the host while a checked step's flag is read.
_PREFETCHED_ELEMENTS = 4096


class StepFunction(Protocol):
    """What a strategy needs of a pure step function."""

    where: str
    identity: str | None            # names its programs in the executable cache; None: not cached
    bound: tuple[str, ...]          # the state variables it updates
    random: bool                    # whether it draws random numbers (else no key in or out)
    loop_averse: bool               # whether XLA:CPU runs it slowly inside a loop
    tail: UpdateTail | None         # the elementwise nodes that can be recomputed, if any
    tail_inputs: list[str]
    constants: dict[str, Any]

    def __call__(self, state: Mapping[str, Any], key: jax.Array | None, constants: Mapping[str, Any],
                 feeds: Mapping[str, Any], kept: tuple[str, ...] = ()) -> tuple: ...

    def tail_update(self, state: Mapping[str, Any], constants: Mapping[str, Any], feeds: Mapping[str, Any],
                    kept: Mapping[str, Any]) -> dict[str, Any]: ...


def _prefetch_small(outputs: Mapping[str, Any]) -> None:
    """Start copying the small outputs (losses, metrics) to the host, overlapping the wait for
    the fault flag that a checked step does anyway. Big outputs stay on the device."""
    for value in outputs.values():
        if isinstance(value, jax.Array) and value.size <= _PREFETCHED_ELEMENTS:
            value.copy_to_host_async()


class _Strategy:
    def __init__(self, step: StepFunction, placement: Placement, ledger: FaultLedger, limit: ProgramLimit):
        self.step, self.placement, self.ledger, self.limit = step, placement, ledger, limit
        self._jitted: list[Compiled] = []

    def _jit(self, function: Any, feeds_argnum: int, stacked: bool = False, **options: Any) -> Compiled:
        """`function` jitted, one program per signature of its argument `feeds_argnum` (see Compiled)."""
        identity = self.step.identity
        jitted = Compiled(function, self.step.where, self.limit, feeds_argnum, stacked,
                          identity=None if identity is None else f"{identity} ({type(self).__name__})",
                          memo=Memo(self.ledger.layout_record, self.ledger.restore_layout), **options)
        self._jitted.append(jitted)
        return jitted

    def key(self, store: StateStore) -> jax.Array | None:
        """The key a compiled step takes: none unless the step draws random numbers, since a
        key among the arguments costs every call Python-side handling. Committing None keeps
        the store's key."""
        return store.key if self.step.random else None

    def prepare(self, store: StateStore, feeds: dict) -> list[Job]:
        """Get this strategy's single-step program for `feeds` ready without running it (see
        Compiled.prepare): the loads and compiles left to run. None by default: such programs compile at
        their first call."""
        return []

    def compilations(self) -> int:
        return sum(jitted.compilations() for jitted in self._jitted)

    def kept(self) -> int:
        return sum(jitted.kept() for jitted in self._jitted)

    def _watch(self, updates: Mapping[str, Any], outputs: Mapping[str, Any]) -> Faults | None:
        return self.ledger.watch([*updates.items(), *outputs.items()])


class InPlace(_Strategy):
    """Donate the whole state; the step's program overwrites it. Unchecked steps only."""

    def __init__(self, step: StepFunction, placement: Placement, ledger: FaultLedger, limit: ProgramLimit):
        super().__init__(step, placement, ledger, limit)
        self._run = self._jit(self._call, 3, donate_argnums=0)

    def _call(self, state: dict, key: Any, constants: dict, feeds: dict) -> tuple:
        key, updates, outputs, _ = self.step(state, key, constants, feeds)
        return self.placement.constrain_state({**state, **updates}), key, outputs

    def run(self, store: StateStore, feeds: dict) -> tuple:
        state, key, outputs = self._run(store.values, self.key(store), self.step.constants, feeds)
        store.commit(state, key)
        return outputs, None, key

    def lower(self, store: StateStore, feeds: dict) -> jax.stages.Lowered:
        return self._run.lower(store.values, self.key(store), self.step.constants, feeds)

    def prepare(self, store: StateStore, feeds: dict) -> list[Job]:
        return self._run.prepare(store.values, self.key(store), self.step.constants, feeds)


class DoubleBuffered(_Strategy):
    """Read the state, write the bound variables' new values into donated spare buffers (the
    ones the previous step replaced). As cheap as an update in place, and a faulty step has
    touched nothing, so it is simply not committed."""

    def __init__(self, step: StepFunction, placement: Placement, ledger: FaultLedger, limit: ProgramLimit):
        super().__init__(step, placement, ledger, limit)
        self._run = self._jit(self._call, 4, donate_argnums=1, keep_unused=True)

    def _call(self, state: dict, spare: dict, key: Any, constants: dict, feeds: dict) -> tuple:
        """`spare` is donated and never read: the new values land in its buffers."""
        key, updates, outputs, _ = self.step(state, key, constants, feeds)
        updates = self.placement.constrain_state(updates)
        return updates, key, outputs, self._watch(updates, outputs)

    def run(self, store: StateStore, feeds: dict) -> tuple:
        updates, key, outputs, faults = self._run(store.values, store.spares(self.step.bound), self.key(store),
                                                  self.step.constants, feeds)
        if faults is not None:
            _prefetch_small(outputs)
            if any_fault(faults):
                store.keep(updates)
                return outputs, faults, key
        store.commit(updates, key, recycle=True)
        return outputs, None, key

    def lower(self, store: StateStore, feeds: dict) -> jax.stages.Lowered:
        return self._run.lower(*self._arguments(store, feeds))

    def prepare(self, store: StateStore, feeds: dict) -> list[Job]:
        return self._run.prepare(*self._arguments(store, feeds))

    def _arguments(self, store: StateStore, feeds: dict) -> tuple:
        """run()'s arguments, the bound values standing in for the spares (the same types)."""
        values = store.values
        return values, {name: values[name] for name in self.step.bound}, self.key(store), self.step.constants, feeds


class CheckThenUpdate(_Strategy):
    """A checked step on a state too large to hold twice, as two programs: the first computes
    the step and checks it, keeping only what the update tail reads (typically the
    gradients); if nothing is faulty, the second recomputes the tail into the donated state.
    The peak is the state plus the gradients instead of two states."""

    def __init__(self, step: StepFunction, placement: Placement, ledger: FaultLedger, limit: ProgramLimit):
        super().__init__(step, placement, ledger, limit)
        self._check = self._jit(self._check_call, 4, donate_argnums=1, keep_unused=True)
        self._update = self._jit(self._update_call, 3, donate_argnums=0)
        # A new feed signature traces the step twice: for the shapes of its scratch, then to
        # compile. Through this jit the second trace reuses the first one's jaxpr (XLA inlines
        # the nested call, so the program is the same); run() clears it after each pair.
        self._traced = jax.jit(step, static_argnums=4)
        # The last call's tail inputs, written over by the next call (fresh buffers would
        # fault in new pages over the gradients' size every step).
        self._scratch: dict[str, jax.Array] | None = None

    def _check_call(self, state: dict, spare: dict, key: Any, constants: dict, feeds: dict) -> tuple:
        key, updates, outputs, kept = self._traced(state, key, constants, feeds, tuple(self.step.tail_inputs))
        return kept, key, outputs, self._watch(updates, outputs)

    def _update_call(self, bound: dict, unbound: dict, constants: dict, feeds: dict, kept: dict) -> dict:
        updates = self.step.tail_update({**unbound, **bound}, constants, feeds, kept)
        return self.placement.constrain_state(updates)

    def run(self, store: StateStore, feeds: dict) -> tuple:
        old, key, constants = store.values, self.key(store), self.step.constants
        scratch, self._scratch = self._scratch, None
        first = scratch is None
        if first:
            shapes = jax.eval_shape(self._check_call, old, {}, key, constants, feeds)[0]
            scratch = {name: device_zeros(shape.shape, shape.dtype) for name, shape in shapes.items()}
        kept, key, outputs, faults = self._check(old, scratch, key, constants, feeds)
        if first:
            self._traced.clear_cache()
        self._scratch = kept
        _prefetch_small(outputs)
        if any_fault(faults):
            return outputs, faults, key
        bound = set(self.step.bound)
        updates = self._update({k: v for k, v in old.items() if k in bound},
                               {k: v for k, v in old.items() if k not in bound}, constants, feeds, kept)
        store.commit(updates, key)
        return outputs, None, key


def _selecting_step(strategy: _Strategy, state: dict, key: Any, constants: dict, feeds: dict,
                    accepting: Any) -> tuple:
    """One step whose bound variables take their new values only if `accepting` and the step
    is clean: (state, key, outputs, faults, accepting). Under "raise" a fault clears
    `accepting`, so the steps after it change nothing."""
    key, updates, outputs, _ = strategy.step(state, key, constants, feeds)
    new_state = strategy.placement.constrain_state({**state, **updates})
    faults = strategy._watch({name: new_state[name] for name in updates}, outputs)
    if faults is None:
        return new_state, key, outputs, None, accepting
    accept = jnp.logical_and(accepting, ~faults.flag)
    selected = {k: jnp.where(accept, v, state[k]) if k in updates else v for k, v in new_state.items()}
    if strategy.ledger.policy == "raise":
        accepting = accept
    return strategy.placement.constrain_state(selected), key, outputs, faults, accepting


class Linked(_Strategy):
    """One step that runs ahead of the host: old-or-new selected on the device and written into
    donated spare buffers (donating the state instead kept the new values in scratch until
    the select), committed at once; the caller reads its faults later."""

    def __init__(self, step: StepFunction, placement: Placement, ledger: FaultLedger, limit: ProgramLimit):
        super().__init__(step, placement, ledger, limit)
        self._run = self._jit(self._call, 4, donate_argnums=1, keep_unused=True)

    def _call(self, state: dict, spare: dict, key: Any, constants: dict, feeds: dict, accepting: Any) -> tuple:
        state, key, outputs, faults, accepting = _selecting_step(self, state, key, constants, feeds, accepting)
        return {name: state[name] for name in self.step.bound}, key, outputs, faults, accepting

    def prepare(self, store: StateStore, feeds: dict) -> list[Job]:
        values = store.values
        return self._run.prepare(values, {name: values[name] for name in self.step.bound}, self.key(store),
                                 self.step.constants, feeds, self.ledger.accepting)

    def run_ahead(self, store: StateStore, feeds: dict, accepting: Any) -> tuple:
        """(outputs, faults, accepting) of one committed step."""
        updates, key, outputs, faults, accepting = self._run(
            store.values, store.spares(self.step.bound), self.key(store), self.step.constants, feeds, accepting)
        store.commit(updates, key, recycle=True)
        return outputs, faults, accepting


class Scanned(_Strategy):
    """Several steps, one per leading-axis slice of the stacked feeds, as one lax.scan over the
    donated state."""

    def __init__(self, step: StepFunction, placement: Placement, ledger: FaultLedger, limit: ProgramLimit):
        super().__init__(step, placement, ledger, limit)
        self._run = self._jit(self._call, 3, stacked=True, donate_argnums=0)

    def _call(self, state: dict, key: Any, constants: dict, stacked: dict, accepting: Any) -> tuple:
        def body(carry: tuple, feeds: dict) -> tuple:
            state, key, accepting = carry
            state, key, outputs, faults, accepting = _selecting_step(self, state, key, constants, feeds, accepting)
            return (state, key, accepting), (outputs, faults)

        (state, key, accepting), (outputs, faults) = jax.lax.scan(body, (state, key, accepting), stacked)
        return self.placement.constrain_state(state), key, outputs, faults, accepting

    def run_many(self, store: StateStore, stacked: dict, accepting: Any) -> tuple:
        state, key, outputs, faults, accepting = self._run(store.values, self.key(store), self.step.constants,
                                                           stacked, accepting)
        store.commit(state, key)
        return outputs, faults, accepting


class Chained:
    """Several steps as Linked calls dispatched back to back: XLA:CPU runs convolutions inside a
    loop several times slower than outside one."""

    def __init__(self, linked: Linked):
        self._linked = linked

    def compilations(self) -> int:
        return 0

    def kept(self) -> int:
        return 0

    def run_many(self, store: StateStore, stacked: dict, accepting: Any) -> tuple:
        results = []
        for feeds in unstack(stacked):
            outputs, faults, accepting = self._linked.run_ahead(store, feeds, accepting)
            results.append((outputs, faults))
        outputs, faults = jax.tree.map(lambda *steps: jnp.stack(steps), *results)
        return outputs, faults, accepting


@dataclass(frozen=True)
class Plan:
    """The strategies of one step function: `single` for a step the host waits for, `linked`
    for one it reads later and `multi` for several per call (None: such steps do not run
    ahead of the host, and go one by one)."""

    single: InPlace | DoubleBuffered | CheckThenUpdate
    linked: Linked | None
    multi: Scanned | Chained | None

    def compilations(self) -> int:
        """Programs compiled so far, evicted ones included."""
        return sum(part.compilations() for part in self._parts())

    def kept(self) -> int:
        """Programs held now."""
        return sum(part.kept() for part in self._parts())

    def _parts(self) -> list[Any]:
        return [part for part in (self.single, self.linked, self.multi) if part is not None]


def choose(step: StepFunction, ledger: FaultLedger, placement: Placement, bound_bytes: int,
           limit: ProgramLimit) -> Plan:
    """The strategies for `step` under `ledger`'s policy, with `bound_bytes` of bound state, each
    keeping the programs of at most `limit.max_programs` feed signatures."""
    checked, large = ledger.checked, bound_bytes >= LARGE_STATE_BYTES
    # On a mesh the scratch buffers would need the shardings XLA picks for the tail's inputs.
    recomputable = placement is DEFAULT_DEVICE and step.tail is not None and bool(step.tail.nodes)
    if not checked and not SMALL_STATE_BYTES <= bound_bytes < LARGE_STATE_BYTES:
        single = InPlace(step, placement, ledger, limit)
    elif checked and large and recomputable:
        single = CheckThenUpdate(step, placement, ledger, limit)
    else:
        single = DoubleBuffered(step, placement, ledger, limit)
    if large or (checked and bound_bytes >= LINKED_STATE_BYTES):
        return Plan(single, None, None)
    linked = Linked(step, placement, ledger, limit)
    return Plan(single, linked, Chained(linked) if step.loop_averse else Scanned(step, placement, ledger, limit))
