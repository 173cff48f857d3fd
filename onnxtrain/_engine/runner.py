"""StepRunner: one step function under one NaN/Inf policy, run against a store.

It chooses the strategies once (at the first call, when the bound state's size is known;
see strategies.choose), then runs single steps, multi-step calls and dry runs through them,
falling back to op-by-op execution for feed signatures a graph cannot be traced for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from onnxtrain._engine.batches import unstack
from onnxtrain._engine.compiled import Compiled, Job, ProgramLimit
from onnxtrain._engine.faults import FaultLedger, Stacked, Unsettled, any_fault
from onnxtrain._engine.feeds import owned
from onnxtrain._engine.placement import DEFAULT_DEVICE, Placement
from onnxtrain._engine.strategies import CheckThenUpdate, DoubleBuffered, Plan, StepFunction, choose
from onnxtrain.errors import InputError, OnnxTrainError, without_jax_notes
from onnxtrain.state.store import StateStore
from onnxtrain.translate.model import EagerSignatures
from onnxtrain.translate.values import NeedsHostValues

logger = logging.getLogger("onnxtrain")


class StepRunner:
    """Runs `step` against a store, as `policy` says a faulty step is handled."""

    def __init__(self, step: StepFunction, policy: str, placement: Placement, lock: Any, limit: ProgramLimit):
        """lock: the store's transaction lock, which settling deferred faults takes too; limit: how
        many programs each compiled function keeps."""
        self.step = step
        self._limit = limit
        self.ledger = FaultLedger(policy, step.where, placement.replicate, lock)
        self._placement = placement
        self._plan: Plan | None = None
        self._eager_signatures = EagerSignatures()
        self._dry_run = Compiled(self._outputs_only, f"{step.where} (evaluate)", limit, 3,
                                 identity=None if step.identity is None else f"{step.identity} (evaluate)")

    def _outputs_only(self, state: dict, key: Any, constants: dict, feeds: dict) -> dict:
        return self.step(state, key, constants, feeds)[2]

    def plan(self, store: StateStore) -> Plan:
        """The strategies, chosen at the first call from the size of `store`'s bound state."""
        if self._plan is None:
            self.plan_as(store.nbytes(self.step.bound))
        return self._plan

    def plan_as(self, bound_bytes: int) -> Plan:
        """Choose the strategies as for `bound_bytes` of bound state, whatever its real size
        (for tests and benchmarks of a strategy on a small model)."""
        self._plan = choose(self.step, self.ledger, self._placement, bound_bytes, self._limit)
        return self._plan

    def done_with_feeds(self, store: StateStore) -> bool:
        """Whether run(), without settle_later, has read every feed when it returns, so that its
        feeds may be arrays the caller refills afterwards. True for a checked double-buffered
        step on one device: it waits for its fault flag, which the device sets only when the
        whole program has run (on a mesh, one device's flag says nothing of the others)."""
        return (self.ledger.checked and self._placement is DEFAULT_DEVICE
                and isinstance(self.plan(store).single, DoubleBuffered))

    def run(self, store: StateStore, feeds: dict[str, Any], step: str = "step",
            settle_later: bool = False) -> dict[str, Any]:
        """One committed step; returns its unbound outputs. settle_later: a checked step that may
        run ahead returns at once, its outputs Unsettled (the caller settles them later); else
        the faults of earlier calls are acted on first. `step` names the step in reports.
        `feeds` must be the runner's own (see feeds.owned) unless done_with_feeds."""
        plan = self.plan(store)
        if (settle_later and self.ledger.checked and plan.linked is not None
                and feeds not in self._eager_signatures):
            linked = self._compiled_or_eager(
                feeds, lambda: plan.linked.run_ahead(store, feeds, self.ledger.accepting), lambda: None)
            if linked is not None:
                outputs, faults, self.ledger.accepting = linked
                return self.ledger.defer(Unsettled(outputs), faults)
        self.ledger.settle()
        outputs, faults, key = self._compiled_or_eager(
            feeds, lambda: plan.single.run(store, feeds), lambda: self._eager(store, owned(feeds)))
        if faults is not None:
            if self.ledger.policy == "skip":
                store.commit({}, key)
            self.ledger.report(faults, step)
        return outputs

    def run_many(self, store: StateStore, stacked: dict[str, Any], settle_later: bool = False) -> Stacked:
        """len(stacked) committed steps, their outputs stacked along a new first axis. Steps run
        ahead in one call where the plan allows; settle_later leaves their faults to the
        result's settle() (or the next single step)."""
        plan = self.plan(store)
        if plan.multi is None:
            return self._step_by_step(store, stacked)
        with jax.enable_x64(True):
            try:
                outputs, faults, self.ledger.accepting = plan.multi.run_many(store, stacked, self.ledger.accepting)
            except OnnxTrainError as error:
                raise without_jax_notes(error)
            except NeedsHostValues:
                return self._step_by_step(store, stacked)
        result = self.ledger.defer(Stacked(outputs), faults)
        if not settle_later:
            self.ledger.settle()
        return result

    def _step_by_step(self, store: StateStore, stacked: dict[str, Any]) -> Stacked:
        batches = unstack(stacked)
        steps = [self.run(store, feeds, f"step (step {number} of a {len(batches)}-step call)")
                 for number, feeds in enumerate(batches)]
        names = steps[0].keys() if steps else ()
        return Stacked({name: np.stack([np.asarray(step[name]) for step in steps]) for name in names})

    def evaluate(self, store: StateStore, feeds: dict[str, Any]) -> dict[str, Any]:
        """The step's unbound outputs from the current state, which stays untouched."""
        key = store.key if self.step.random else None
        return self._compiled_or_eager(
            feeds, lambda: self._dry_run(store.values, key, self.step.constants, feeds),
            lambda: self.step.eager(store.values, store.key, feeds)[2])

    def _eager(self, store: StateStore, feeds: dict[str, Any]) -> tuple:
        """A single step op by op: (outputs, faults or None, key), committed when clean."""
        key, updates, outputs = self.step.eager(store.values, store.key, feeds)
        faults = self.ledger.watch([*updates.items(), *outputs.items()])
        if faults is not None and any_fault(faults):
            return outputs, faults, key
        store.commit(updates, key)
        return outputs, None, key

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
                        logger.warning("%s runs op by op (no jit) for these feed shapes: %s", self.step.where, reason)
                        self._eager_signatures.add(feeds)
                return eager()
            except OnnxTrainError as error:
                raise without_jax_notes(error)

    def prepare(self, store: StateStore, feeds: dict[str, Any], fitting: bool = False) -> list[Job]:
        """Get the programs of a single step and of fit's steps (with `fitting`, of fit's only)
        for `feeds` (checked and placed) ready without running them: their loads, or their
        compiles once traced now."""
        plan = self.plan(store)
        # fit runs a checked step ahead of the host (see run); an unchecked one as step() does.
        ahead = self.ledger.checked and plan.linked is not None
        parts = [plan.linked] if fitting and ahead else [plan.single, *([plan.linked] if ahead else [])]
        return self._compiled_or_eager(
            feeds, lambda: [job for part in parts for job in part.prepare(store, feeds)], list)

    def lowered(self, store: StateStore, feeds: dict[str, Any]) -> jax.stages.Lowered:
        """The single step run() compiles for `feeds` (checked and placed), lowered but not run:
        for reading its HLO and shardings."""
        single = self.plan(store).single
        if isinstance(single, CheckThenUpdate):
            raise InputError(f"{self.step.where}: a checked step on a state this large runs as two programs "
                             "(check, then update in place), not one to lower")
        with jax.enable_x64(True):
            return single.lower(store, feeds)

    def compilations(self) -> int:
        """Programs compiled so far, evicted ones included."""
        plan = 0 if self._plan is None else self._plan.compilations()
        return plan + self._dry_run.compilations()

    def kept(self) -> int:
        """Programs held now."""
        return (0 if self._plan is None else self._plan.kept()) + self._dry_run.kept()
