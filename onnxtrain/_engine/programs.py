"""The compiled programs of a training model: initialization, training step, inference.

Each is translated once, when the Trainer is built (so unknown operators fail
before anything runs), and compiled once per input signature. A training step
is one jitted function (state, spare, key, constants, feeds) -> (new values,
key, outputs, faults) that reads the state and writes the bound variables' new
values into the donated spare buffers (the ones the previous step replaced), so
the state takes no fresh memory per step; an unchecked step on a very large or
a tiny state updates it in place instead (see StepProgram). Every output is
computed from the pre-step state; the bound ones are assigned together when the
step returns. State variables and hyperparameters are arguments, never baked-in
constants, so changing them never recompiles.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from onnxtrain.batch_stacks import unstack
from onnxtrain.errors import BindingError, InputError, NumericError, OnnxTrainError, without_jax_notes
from onnxtrain.fault_check import EvidenceLayout, Faults, any_fault, check, first_fault
from onnxtrain.feeds import FeedChecker
from onnxtrain.fitting import Stacked, Unsettled
from onnxtrain.proto import GraphProto, ModelProto
from onnxtrain.sharding import DEFAULT_DEVICE, Placement, host_value
# From LARGE_STATE_BYTES of bound state on, nothing is double-buffered: a checked step checks,
# then recomputes the update tail in place (StepProgram._check_then_update), an unchecked one
# updates in place, and run_many steps one call at a time instead of scanning (a scan holds
# the state twice).
from onnxtrain.spare_buffers import LARGE_STATE_BYTES, SpareBuffers, updates_in_place
from onnxtrain.state.store import StateStore, device_zeros
from onnxtrain.training import combined_graph, light_graph, model_of
from onnxtrain.translate.compiler_options import jit_with_options
from onnxtrain.translate.graph import any_node, draws_random, initializer_names
from onnxtrain.translate.model import EagerSignatures, TranslatedModel, static_input_names
from onnxtrain.translate.node import NodeSpec
from onnxtrain.translate.registry import DEFAULT_DOMAIN, normalize_domain
from onnxtrain.translate.values import NeedsHostValues, to_host
from onnxtrain.update_tail import update_tail

logger = logging.getLogger("onnxtrain")
# Outputs up to this many elements are copied to the host while a checked step is read.
_PREFETCHED_ELEMENTS = 4096
# From this many bytes of bound state on, checked steps wait for each step's flag instead of
# selecting old-or-new on the device (fit's linked steps, run_many's chains and scans): the
# select is a pass over the state, and waiting costs a step ~0.1 ms. Measured, fit per step
# against checked single steps: ResNet-18 (128 MB) 1.18x with the select; the benchmark MLP
# (2.3 MB) 0.96-1.04x.
LINKED_STATE_BYTES = 16 * 2**20


def _translated(model: ModelProto, graph: GraphProto, variables: Sequence[str], where: str) -> TranslatedModel:
    """The graph translated with the state variables it reads as parameters (`graph` may hold
    them as placeholders without data: they are never decoded here)."""
    opsets = {normalize_domain(o.domain): o.version for o in model.opset_import}
    present = set(initializer_names(graph))
    visible = [name for name in variables if name in present]
    shapes = sorted(static_input_names(graph, opsets) & set(visible))
    if shapes:
        raise BindingError(f"{where}: state variables {shapes} are used where an operator needs a "
                           "value known before running (a shape, axes, sizes); such inputs cannot "
                           "change during training, so they must not be bound")
    return TranslatedModel(model_of(model, graph), supplied=visible)


def _checked_assignment(key: str, value: Any, current: jax.Array, where: str) -> jax.Array:
    if isinstance(value, (list, dict)) or np.dtype(getattr(value, "dtype", object)).kind in "OUS":
        raise BindingError(
            f"{where}: the value bound to {key!r} is a string tensor, sequence or map; a state "
            f"variable is a numeric tensor, so bind a numeric output to it")
    value = jnp.asarray(value)
    if value.shape != current.shape or value.dtype != current.dtype:
        raise BindingError(
            f"{where}: {key!r} is {current.dtype}{list(current.shape)} but the value bound to it is "
            f"{value.dtype}{list(value.shape)}; a state variable keeps its type and shape")
    return value


def _prefetch_small(outputs: Mapping[str, Any]) -> None:
    """Start copying the small outputs (losses, metrics) to the host. A checked step waits
    for its fault flag anyway; the copy then overlaps that wait instead of following the
    caller's float(loss): 1-2.5% of a benchmark MLP step. Big outputs stay on the device
    until asked for."""
    for value in outputs.values():
        if isinstance(value, jax.Array) and value.size <= _PREFETCHED_ELEMENTS:
            value.copy_to_host_async()


class _Program:
    """What initialization, step and inference share: the translated graph, its constants."""

    def __init__(self, model: ModelProto, graph: GraphProto, variables: Sequence[str], where: str,
                 placement: Placement = DEFAULT_DEVICE):
        self.where = where
        self.placement = placement
        self.translated = _translated(model, graph, variables, where)
        placement.annotate(self.translated.plan)
        self.variables = sorted(self.translated.supplied)
        self.constants = placement.replicate(self.translated.params)
        declared = set(self.translated.input_names)
        self.declared_inputs = [value for value in graph.input if value.name in declared]
        self.check_feeds = FeedChecker(
            self.declared_inputs, "inference (main graph)" if where == "main graph" else f"{where} step")

    def params(self, values: Mapping[str, Any], constants: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The graph's parameters: `constants` (a compiled function's argument; by default
        self.constants) and the state variables it reads."""
        return {**(self.constants if constants is None else constants),
                **{name: values[name] for name in self.variables}}

    def compilations(self) -> int:
        return self.translated._jitted._cache_size()


class InitializationProgram(_Program):
    """training_info[i].initialization: no inputs; outputs assigned by initialization_binding."""

    def __init__(self, model: ModelProto, index: int):
        info = model.training_info[index]
        where = f"training_info[{index}].initialization"
        if len(info.initialization.input):
            raise BindingError(f"{where} declares inputs {[v.name for v in info.initialization.input]}; "
                               "an initialization graph takes none")
        super().__init__(model, info.initialization, (), where)
        self.bindings = [(entry.key, entry.value) for entry in info.initialization_binding]

    def run(self, values: dict[str, jax.Array], key: jax.Array) -> dict[str, jax.Array]:
        """New values for the bound variables (the caller commits them)."""
        outputs = self.translated(self.params(values), {}, key)
        where = f"{self.where.rsplit('.', 1)[0]}.initialization_binding"
        with jax.enable_x64(True):
            return {k: _checked_assignment(k, outputs[v], values[k], where) for k, v in self.bindings}


NAN_POLICIES = ("raise", "skip", "ignore")

# XLA:CPU runs convolutions inside a while loop 5-10x slower than outside one (the benchmark
# CNN, hand-written JAX alike). So run_many chains single-step calls for graphs with one.
# Unrolling the scan instead was ~5% faster per step on the benchmark CNN (8 steps) but
# compiled for 2.4x as long (6.1 against 2.6 s) and peaked ~100 MB higher (501 against 402).
_LOOP_AVERSE_OPS = frozenset({"Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "DeformConv",
                              "CausalConvWithState"})


def _loop_averse(spec: NodeSpec) -> bool:
    return normalize_domain(spec.proto.domain) == DEFAULT_DOMAIN and spec.proto.op_type in _LOOP_AVERSE_OPS


class StepProgram(_Program):
    """The main graph ⊕ training_info[i].algorithm as one donated, jitted step.

    With nan_policy "raise" or "skip", the step also checks every bound float value and every
    returned float output for NaN/Inf and, if it finds any, keeps the old state: "raise" then
    raises NumericError, "skip" logs and goes on. A single checked step reads the state without
    donating it and writes the bound variables' new values into a spare set of buffers that is
    donated instead (the previous step's old values): as cheap as an in-place update, and a
    faulty step has touched nothing. Selecting old-or-new after the fact would need the whole
    new state first, one more pass over every buffer. Scanned steps still select per step, and
    so do linked steps (fit's, whose faults the host reads a step later), into spare buffers.

    Under "ignore" a single step double-buffers the same way, without the check, from
    SMALL_STATE_BYTES of bound state on: donating the state instead is slower (see
    spare_buffers). A smaller state is donated and updated in place.

    The spare buffers are a second copy of the bound state, too much for a large model (a
    100M-parameter Adam model peaked at 2.1x its state). From LARGE_STATE_BYTES of bound state
    on, an unchecked step updates the donated state in place, and (on one device) a checked
    step runs as two programs instead: the first computes the step and checks it, keeping
    only what the update tail (see update_tail) reads, such as the gradients; if nothing is
    faulty, the second recomputes the tail into the donated state. That peaks at the state
    plus the gradients: 1.52x for the same model.
    """

    def __init__(self, model: ModelProto, index: int, variables: Sequence[str], nan_policy: str = "raise",
                 placement: Placement = DEFAULT_DEVICE):
        info = model.training_info[index]
        super().__init__(model, combined_graph(model, index, set(variables)), variables,
                         f"training_info[{index}]", placement)
        if nan_policy not in NAN_POLICIES:
            raise InputError(f"nan_policy={nan_policy!r} is not one of {NAN_POLICIES}")
        self.nan_policy = nan_policy
        self.bindings = [(entry.key, entry.value) for entry in info.update_binding]
        bound = {value for _, value in self.bindings}
        self._bound_variables = frozenset(key for key, _ in self.bindings)
        self.returned = [o.name for o in info.algorithm.output if o.name not in bound]
        # Only graphs with random ops advance the key: a split costs a loop in every step.
        self.random = draws_random(self.translated.plan)
        self.chained = any_node(self.translated.plan, _loop_averse)
        self._layout = EvidenceLayout((), ())
        self._spare = SpareBuffers(placement)
        # Scanned calls whose faults the host has not read yet (see run_many), oldest first,
        # and the flag the next scanned call starts from: False after a fault among them.
        self._unsettled: list[tuple[int, jax.Array]] = []
        self._calls = itertools.count()
        self._accepting = self._accepting_flag()
        self._jitted = jit_with_options(self._spare_step, donate_argnums=1, keep_unused=True)
        self._in_place = jit_with_options(self._step, donate_argnums=0)
        self._dry_run = jit_with_options(self._step)
        plan = self.translated.plan
        self.tail = update_tail(plan, bound)
        given = {*plan.inputs, *plan.constants, *self.translated.params, *self.variables}
        # What the tail reads that only the graph computes (the gradients, typically).
        self._tail_inputs = [name for name in self.tail.reads if name not in given]
        # On a mesh the spare buffers would need the shardings XLA picks for the tail's inputs.
        self._tail_recomputable = placement is DEFAULT_DEVICE and bool(self.tail.nodes)
        self._bound_nbytes: int | None = None
        self._spare_tail_inputs: dict[str, jax.Array] | None = None
        self._check_pass = jit_with_options(self._checked_tail_inputs, donate_argnums=1, keep_unused=True)
        self._update_pass = jit_with_options(self._tail_update, donate_argnums=0)
        self._scanned = jit_with_options(self._steps, donate_argnums=0)
        self._link = jit_with_options(self._spare_link, donate_argnums=1, keep_unused=True)
        self._eager_signatures = EagerSignatures()

    def _updates(self, state: dict[str, Any], outputs: Mapping[str, Any]) -> dict[str, Any]:
        """The bound variables' new values."""
        where = f"{self.where}.update_binding"
        return {k: _checked_assignment(k, outputs[v], state[k], where) for k, v in self.bindings}

    def _faults(self, state: dict[str, Any], outputs: dict[str, Any]) -> Faults:
        """The NaN/Inf check (see fault_check) of the bound values and the float outputs."""
        candidates = [*((k, state[k]) for k, _ in self.bindings), *outputs.items()]
        watched = [(n, v) for n, v in candidates if jnp.issubdtype(jnp.result_type(v), jnp.inexact)]
        self._layout, faults = check(watched)
        return faults

    def _outputs(self, state: dict[str, jax.Array], key: jax.Array | None, constants: dict[str, Any],
                 feeds: dict[str, Any], kept: Sequence[str] = ()) -> tuple:
        """(key, the bound variables' new values, the returned outputs, the values of the `kept`
        intermediate names) of one step; `key` is None for graphs without random ops (see `_key`)."""
        key, subkey = jax.random.split(key) if self.random else (key, None)
        outputs, values = self.translated.apply_keeping(self.params(state, constants), feeds, subkey, kept)
        return key, self._updates(state, outputs), {name: outputs[name] for name in self.returned}, values

    def _step(self, state: dict[str, jax.Array], key: jax.Array, constants: dict[str, Any],
              feeds: dict[str, Any], accepting: Any = True) -> tuple:
        """(new state, key, outputs, faults); a faulty step leaves the state as it was."""
        key, updates, returned, _ = self._outputs(state, key, constants, feeds)
        new_state = self.placement.constrain_state({**state, **updates})
        if self.nan_policy == "ignore":
            return new_state, key, returned, None
        faults = self._faults(new_state, returned)
        accept = jnp.logical_and(accepting, ~faults.flag)
        kept = {k: jnp.where(accept, v, state[k]) if k in self._bound_variables else v
                for k, v in new_state.items()}
        return kept, key, returned, faults

    def _spare_step(self, state: dict[str, jax.Array], spare: dict[str, jax.Array], key: jax.Array,
                    constants: dict[str, Any], feeds: dict[str, Any]) -> tuple:
        """(new values of the bound variables, key, outputs, faults or None under "ignore");
        the new values land in the donated `spare` buffers, which the computation never reads."""
        key, updates, returned, _ = self._outputs(state, key, constants, feeds)
        updates = self.placement.constrain_state(updates)
        faults = None if self.nan_policy == "ignore" else self._faults(updates, returned)
        return updates, key, returned, faults

    def _checked_tail_inputs(self, state: dict[str, jax.Array], spare: dict[str, jax.Array],
                             key: jax.Array | None, constants: dict[str, Any], feeds: dict[str, Any]) -> tuple:
        """(the computed values the update tail reads, key, outputs, faults) of one step; those
        values land in the donated `spare` buffers (the previous step's), which are never read:
        fresh buffers would cost page faults over the size of the gradients every step."""
        key, updates, returned, kept = self._outputs(state, key, constants, feeds, self._tail_inputs)
        return kept, key, returned, self._faults(updates, returned)

    def _tail_update(self, bound: dict[str, jax.Array], unbound: dict[str, jax.Array],
                     constants: dict[str, Any], feeds: dict[str, Any], kept: dict[str, Any]) -> dict:
        """The bound variables' new values, the update tail recomputed from `kept`; they land
        in the donated `bound` buffers."""
        state = {**unbound, **bound}
        values = self.translated.apply_nodes(self.tail.nodes, self.params(state, constants), feeds, kept)
        return self.placement.constrain_state(self._updates(state, values))

    def _check_then_update(self, store: StateStore, feeds: dict[str, Any]) -> tuple:
        """A checked step in two programs (see the class docstring); the state to commit and,
        after a fault only, the faults."""
        old, key = store.values, self._key(store)
        spare, self._spare_tail_inputs = self._spare_tail_inputs, None
        if spare is None:
            shapes = jax.eval_shape(self._checked_tail_inputs, old, {}, key, self.constants, feeds)[0]
            spare = {name: device_zeros(shape.shape, shape.dtype) for name, shape in shapes.items()}
        kept, key, outputs, faults = self._check_pass(old, spare, key, self.constants, feeds)
        self._spare_tail_inputs = kept
        _prefetch_small(outputs)
        if any_fault(faults):
            return old, key, outputs, faults
        bound = self._bound_variables
        updates = self._update_pass({k: old[k] for k in bound}, {k: v for k, v in old.items() if k not in bound},
                                    self.constants, feeds, kept)
        return {**old, **updates}, key, outputs, None

    def _bound_bytes(self, store: StateStore) -> int:
        """The bound state's size in bytes (fixed at the first step)."""
        if self._bound_nbytes is None:
            self._bound_nbytes = sum(store.values[k].nbytes for k, _ in self.bindings)
        return self._bound_nbytes

    def _large_state(self, store: StateStore) -> bool:
        return self._bound_bytes(store) >= LARGE_STATE_BYTES

    def _runs_ahead(self, store: StateStore) -> bool:
        """Whether steps may run ahead of the host reading their faults (scanned or linked,
        selecting old-or-new on the device when checked); not for large states, nor for
        checked ones from LINKED_STATE_BYTES on."""
        if self._large_state(store):
            return False
        return self.nan_policy == "ignore" or self._bound_bytes(store) < LINKED_STATE_BYTES

    def _updates_in_place(self, store: StateStore) -> bool:
        """Whether a single step donates the state and updates it in place (unchecked steps on
        a large or a small state; see the class docstring)."""
        return self.nan_policy == "ignore" and updates_in_place(self._bound_bytes(store))

    def _checks_then_updates(self, store: StateStore) -> bool:
        """Whether a single step runs as two programs (checked steps on a large state)."""
        return self.nan_policy != "ignore" and self._tail_recomputable and self._large_state(store)

    def _single_run(self, store: StateStore, feeds: dict[str, Any]) -> tuple:
        """One step the way its policy and the state's size call for (see the class docstring)."""
        if self._updates_in_place(store):
            return self._in_place(store.values, self._key(store), self.constants, feeds)
        return (self._check_then_update if self._checks_then_updates(store) else self._double_buffered)(store, feeds)

    def _spare_buffers(self, old: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Buffers for a call to write the bound variables' new values into."""
        return self._spare.take(old, self._bound_variables)

    def _double_buffered(self, store: StateStore, feeds: dict[str, Any]) -> tuple:
        """One step into spare buffers; returns the state to commit: the new one, or after a
        fault the old one and the faults. The replaced values become the next step's spare
        buffers."""
        old = store.values
        updates, key, outputs, faults = self._jitted(old, self._spare_buffers(old), self._key(store),
                                                     self.constants, feeds)
        if faults is not None:
            _prefetch_small(outputs)
            if any_fault(faults):
                self._spare.keep(updates)
                return old, key, outputs, faults
        self._spare.keep_replaced(old, updates)
        return {**old, **updates}, key, outputs, None

    def _chain_link(self, state: dict[str, jax.Array], key: jax.Array | None, constants: dict[str, Any],
                    feeds: dict[str, Any], accepting: jax.Array) -> tuple:
        """One step of run_many: (state, key, outputs, faults, accepting). Under "raise", a
        step after a faulty one (`accepting` False) is a no-op, so the state stays the last
        good one."""
        state, key, outputs, faults = self._step(state, key, constants, feeds, accepting)
        if self.nan_policy == "raise":
            accepting = jnp.logical_and(accepting, ~faults.flag)
        return self.placement.constrain_state(state), key, outputs, faults, accepting

    def _spare_link(self, state: dict[str, jax.Array], spare: dict[str, jax.Array], key: jax.Array | None,
                    constants: dict[str, Any], feeds: dict[str, Any], accepting: jax.Array) -> tuple:
        """_chain_link with the bound variables' values (new, or old after a fault) written into
        the donated `spare` buffers, which it never reads, and the state only read. Donating the
        state instead kept the new values in scratch memory until the select wrote them over
        the old ones: a ResNet-18 step needed 175 instead of 86 MB of scratch, fresh pages
        every step, and took 1.16x the time."""
        state, key, outputs, faults, accepting = self._chain_link(state, key, constants, feeds, accepting)
        return {k: state[k] for k in self._bound_variables}, key, outputs, faults, accepting

    def _linked(self, store: StateStore, key: jax.Array | None, feeds: dict[str, Any], accepting: jax.Array) -> tuple:
        """One call of _spare_link on the store's values: (state, key, outputs, faults, accepting)."""
        old = store.values
        updates, key, outputs, faults, accepting = self._link(old, self._spare_buffers(old), key, self.constants,
                                                              feeds, accepting)
        self._spare.keep_replaced(old, updates)
        return {**old, **updates}, key, outputs, faults, accepting

    def _steps(self, state: dict[str, jax.Array], key: jax.Array | None, constants: dict[str, Any],
               stacked: dict[str, Any], accepting: jax.Array) -> tuple:
        """_chain_link over the leading-axis slices of `stacked`, in order, as one lax.scan."""
        def body(carry, feeds):
            state, key, accepting = carry
            state, key, outputs, faults, accepting = self._chain_link(state, key, constants, feeds, accepting)
            return (state, key, accepting), (outputs, faults)

        (state, key, accepting), (outputs, faults) = jax.lax.scan(body, (state, key, accepting), stacked)
        return self.placement.constrain_state(state), key, outputs, faults, accepting

    def _chain(self, store: StateStore, stacked: dict[str, Any]) -> tuple:
        """What _steps returns, from one call per step (see _LOOP_AVERSE_OPS), dispatched back
        to back, each into spare buffers (see _spare_link)."""
        key, accepting, results = self._key(store), self._accepting, []
        for feeds in unstack(stacked):
            state, key, outputs, faults, accepting = self._linked(store, key, feeds, accepting)
            store.commit(state, key)
            results.append((outputs, faults))
        outputs, faults = jax.tree.map(lambda *steps: jnp.stack(steps), *results)
        return store.values, key, outputs, faults, accepting

    def _key(self, store: StateStore) -> jax.Array | None:
        """The key a compiled step takes: none unless the graph draws random numbers, since
        a typed key among the arguments or results costs every call ~10 us of Python-side
        handling (a tenth of a small model's dispatch). A None key is returned as None, and
        committing None keeps the store's key."""
        return store.key if self.random else None

    def _report(self, faults: Faults, step: str) -> None:
        """Act on the faults of a call (some step faulty) as the policy says."""
        first, names = first_fault(faults, self._layout)
        where = f"{self.where} {step}"
        steps_in_call = np.size(faults.flag)
        if steps_in_call > 1:
            where += f" (step {first} of a {steps_in_call}-step call)"
        if self.nan_policy == "skip":
            logger.warning("%s produced NaN/Inf in %s; skipped, state unchanged", where, names)
            return
        raise NumericError(f"{where} produced NaN or Inf in {names}; the state keeps its last good "
                           "values. Lower the learning rate, check the data, or pass "
                           "nan_policy='skip' to skip such steps.")

    def _settle(self, store: StateStore, state: dict, key: jax.Array | None, faults: Any, step: str) -> None:
        """Commit a single step's result, then act on its faults as the policy says. `faults`
        is None for a clean step (whose flag the run has read) and under nan_policy "ignore",
        which so never waits for the device. A step that "raise" refuses keeps the key too:
        retrying it draws the same numbers."""
        if faults is None:
            store.commit(state, key)
            return
        store.commit(state, key if self.nan_policy == "skip" else None)
        self._report(faults, step)

    def _accepting_flag(self) -> jax.Array:
        """The flag a chain of scanned calls starts from: no fault yet."""
        return self.placement.replicate(jnp.asarray(True))

    def settle(self, through: int | None = None) -> None:
        """Act on the faults of scanned calls run with settle_later, oldest first, up to call
        number `through` (every one by default); the host waits for those calls here. After a
        fault under "raise" the later calls were no-ops: they are dropped with it."""
        while self._unsettled and (through is None or self._unsettled[0][0] <= through):
            _, faults = self._unsettled.pop(0)
            if any_fault(faults):
                self._unsettled.clear()
                self._accepting = self._accepting_flag()
                self._report(faults, "step")

    def run_many(self, store: StateStore, stacked: dict[str, Any], settle_later: bool = False) -> Stacked:
        """len(stacked) steps in one compiled call; the outputs stacked along a new first axis.

        settle_later: return without waiting for the device, leaving the call's faults to
        the returned outputs' `settle` (or the next step, which settles first). Until then the
        next scanned call runs only if this one had no fault ("raise"), on the device, so the
        state is the last good one either way, and the host prepares the next call while the
        device computes this one. Runs step by step for graphs that cannot be traced, and for
        large or checked states too big to select on the device (see LARGE_STATE_BYTES and
        LINKED_STATE_BYTES), whose steps are too long for dispatch to matter.
        """
        if not self._runs_ahead(store):
            return self._step_by_step(store, stacked)
        with jax.enable_x64(True):
            try:
                state, key, outputs, faults, self._accepting = (
                    self._chain(store, stacked) if self.chained else
                    self._scanned(store.values, self._key(store), self.constants, stacked, self._accepting))
            except OnnxTrainError as error:
                raise without_jax_notes(error)
            except NeedsHostValues:
                return self._step_by_step(store, stacked)
        store.commit(state, key)
        return self._settle_later(Stacked(outputs), faults, settle_later)

    def _settle_later(self, result: Unsettled, faults: Faults | None, later: bool) -> Unsettled:
        """`result`, its call's faults queued for `settle`, which runs now unless `later`."""
        if faults is not None:
            number = next(self._calls)
            self._unsettled.append((number, faults))
            result.settle = lambda: self.settle(through=number)
        if not later:
            self.settle()
        return result

    def _step_by_step(self, store: StateStore, stacked: dict[str, Any]) -> Stacked:
        """What run_many returns, from one committed run per step (checked unless "ignore")."""
        batches = unstack(stacked)
        steps = [self.run(store, feeds, f"step (step {number} of a {len(batches)}-step call)")
                 for number, feeds in enumerate(batches)]
        return Stacked({name: np.stack([np.asarray(step[name]) for step in steps]) for name in self.returned})

    def run(self, store: StateStore, feeds: dict[str, Any], step: str = "step",
            settle_later: bool = False) -> dict[str, Any]:
        """One step: new state committed to `store`; the unbound outputs returned. Faults of
        earlier scanned calls are acted on first. `step` names the step in fault reports.
        settle_later: return without waiting for the device, as run_many does: the step is
        then a chain link (see _chain_link), its outputs come back Unsettled, and earlier
        calls' faults are left to their own settle."""
        if (settle_later and feeds not in self._eager_signatures and self.nan_policy != "ignore"
                and self._runs_ahead(store)):
            linked = self._linked_step(store, feeds)
            if linked is not None:
                return linked
        self.settle()
        state, key, outputs, faults = self._compiled_or_eager(
            feeds, lambda: self._single_run(store, feeds), lambda: self._eager_step(store, feeds))
        self._settle(store, state, key, faults, step)
        return outputs

    def _compiled_or_eager(self, feeds: dict[str, Any], compiled: Callable[[], Any],
                           eager: Callable[[], Any]) -> Any:
        """compiled(), or eager() if the graph cannot be traced for these feeds' signature (that
        is remembered, and said once); both under x64, errors without JAX's internal notes."""
        with jax.enable_x64(True):
            try:
                if feeds not in self._eager_signatures:
                    try:
                        return compiled()
                    except NeedsHostValues as reason:
                        logger.warning("%s runs op by op (no jit) for these feed shapes: %s", self.where, reason)
                        self._eager_signatures.add(feeds)
                return eager()
            except OnnxTrainError as error:
                raise without_jax_notes(error)

    def _linked_step(self, store: StateStore, feeds: dict[str, Any]) -> Unsettled | None:
        """run(settle_later=True) of a checked step: one chain link, so the host does not wait
        for the step's fault flag (a checked single step does, every step); None for a graph
        that cannot be traced, which run then steps eagerly. Its outputs are not prefetched
        (see _prefetch_small): read a step later, they are ready by then, and starting the copy
        cost 2.5-4.6 % of a benchmark MLP fit step."""
        linked = self._compiled_or_eager(
            feeds, lambda: self._linked(store, self._key(store), feeds, self._accepting),
            lambda: None)
        if linked is None:
            return None
        state, key, outputs, faults, self._accepting = linked
        store.commit(state, key)
        return self._settle_later(Unsettled(outputs), faults, later=True)

    def lowered(self, store: StateStore, feeds: dict[str, Any]) -> jax.stages.Lowered:
        """The single step run() compiles for `feeds` (checked and placed), lowered but not run:
        for reading its HLO and shardings."""
        if self._checks_then_updates(store):
            raise InputError(f"{self.where}: a checked step on a state this large runs as two programs "
                             "(check, then update in place), not one to lower")
        values, key = store.values, self._key(store)
        with jax.enable_x64(True):
            if self._updates_in_place(store):
                return self._in_place.lower(values, key, self.constants, feeds)
            spare = {name: values[name] for name in self._bound_variables}
            return self._jitted.lower(values, spare, key, self.constants, feeds)

    def evaluate(self, store: StateStore, feeds: dict[str, Any]) -> dict[str, Any]:
        """The step's unbound outputs from the current state, which stays untouched."""
        return self._compiled_or_eager(
            feeds, lambda: self._dry_run(store.values, self._key(store), self.constants, feeds)[2],
            lambda: self._eager_step(store, feeds)[2])

    def _eager_step(self, store: StateStore, feeds: dict[str, Any]) -> tuple:
        key, subkey = jax.random.split(store.key) if self.random else (store.key, None)
        params = {name: to_host(value) for name, value in self.params(store.values).items()}
        host_feeds = {name: to_host(value) for name, value in feeds.items()}
        outputs = self.translated.apply(params, host_feeds, subkey, eager=True)
        updates = self._updates(dict(store.values), outputs)
        new_state = {n: jnp.asarray(v) for n, v in {**store.values, **updates}.items()}
        returned = {name: outputs[name] for name in self.returned}
        if self.nan_policy == "ignore":
            return new_state, key, returned, None
        faults = self._faults(new_state, returned)
        return (dict(store.values), key, returned, faults) if any_fault(faults) else (new_state, key, returned, None)

    def compilations(self) -> int:
        return sum(f._cache_size() for f in (self._jitted, self._in_place, self._dry_run, self._scanned, self._link,
                                              self._check_pass, self._update_pass))


class InferenceProgram(_Program):
    """The main graph with the current state; reads the store, never writes it."""

    def __init__(self, model: ModelProto, variables: Sequence[str], placement: Placement = DEFAULT_DEVICE):
        super().__init__(model, light_graph(model.graph, set(variables)), variables, "main graph", placement)

    def run(self, values: Mapping[str, jax.Array], feeds: dict[str, Any], key: jax.Array) -> dict[str, Any]:
        return self.translated(self.params(values), feeds, key)


def host_copy(values: Mapping[str, jax.Array]) -> dict[str, np.ndarray]:
    """Values as numpy arrays (for writing them out), gathered from every device."""
    return {name: host_value(value) for name, value in values.items()}
