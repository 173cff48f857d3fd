"""Control flow: If, Loop, Scan and SequenceMap, the ops that run graph attributes.

Each op runs its subgraph the cheapest way that stays faithful:
- host values only (the condition, trip count and every outer value the body
  reads are known while tracing, or the model runs eagerly): plain Python, so
  results stay host constants and shapes computed in the body keep folding;
- traced values whose shapes stay fixed: jax.lax.cond / scan / while_loop,
  one compiled body, and gradients through cond and scan;
- traced values whose shapes or types change across iterations (a growing
  sequence), or a body that needs its iteration number on the host (a Slice
  by the iteration): the iterations unrolled in Python when their count is
  known, else NeedsHostValues so the model runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from onnxtrain.errors import OnnxTrainError
from onnxtrain.translate.graph import MAX_GRAPH_DEPTH, draws_random, evaluate_plan, free_names, plan_depth
from onnxtrain.translate.node import Evaluation, Node
from onnxtrain.translate.ops.common import normalize_axis
from onnxtrain.translate.registry import op
from onnxtrain.translate.values import NeedsHostValues, is_host

# A traced loop whose body cannot run under lax.scan is unrolled into the
# program up to this many iterations; longer ones run eagerly instead.
MAX_UNROLLED_ITERATIONS = 512


def _unroll_limit(body: _Body) -> int:
    """Iterations a traced loop may unroll into one program: MAX_UNROLLED_ITERATIONS, fewer
    when the body is deep, so the unrolled chain stays within MAX_GRAPH_DEPTH."""
    return max(1, min(MAX_UNROLLED_ITERATIONS, MAX_GRAPH_DEPTH // max(plan_depth(body.plan), 1)))


class _NotAScan(Exception):
    """The body cannot run under jax.lax.scan: a value changes shape, or the loop may stop early."""


# ---------------------------------------------------------------------------
# Subgraph evaluation


class _Body:
    """A graph attribute of a node, evaluated per iteration (or branch) in the node's scope.

    A body that draws random numbers takes one key from the node and folds the
    iteration number into it, so iterations traced inside scan, cond or
    while_loop never advance the outer evaluation's key from their own trace.
    """

    def __init__(self, node: Node, attr_name: str):
        self.node = node
        self.plan = node.subgraph_plan(attr_name)
        self.key = node.next_key() if draws_random(self.plan) else None

    def __call__(self, index: Any, inputs: Sequence[Any]) -> list[Any]:
        key = None if self.key is None else jax.random.fold_in(self.key, index)
        evaluation = Evaluation(key, self.node.evaluation.eager)
        return evaluate_plan(self.plan, inputs, self.node.scope, evaluation)

    @property
    def num_outputs(self) -> int:
        return len(self.plan.outputs)

    def runs_on_host(self) -> bool:
        """True when the model runs eagerly, or when the node's inputs and every outer value
        the body reads are host constants (then the body runs in plain Python)."""
        if self.node.evaluation.eager:
            return True
        scope = self.node.scope
        return self.node.host and all(
            is_host(scope[name]) for name in free_names(self.plan) if name in scope)

    def passed_through(self, first_input: int, first_output: int, count: int) -> set[int]:
        """Slots k < count whose body output is the body input itself (loop-invariant values)."""
        inputs, outputs = self.plan.inputs, self.plan.outputs
        return {k for k in range(count)
                if first_input + k < len(inputs) and first_output + k < len(outputs)
                and inputs[first_input + k] == outputs[first_output + k]}


# ---------------------------------------------------------------------------
# Values and carries


def _is_tensor(value: Any) -> bool:
    return isinstance(value, (np.ndarray, jax.Array))


def _host_bool(node: Node, value: Any, what: str) -> bool:
    """A one-element host boolean tensor as a Python bool."""
    array = np.asarray(value)
    if array.size != 1:
        raise node.error(f"{what} must hold exactly one element, got shape {array.shape}")
    return bool(array.reshape(()))


def _host_count(node: Node, value: Any) -> int:
    """Loop's host trip count M as a Python int."""
    array = np.asarray(value)
    if array.size != 1:
        raise node.error(f"trip count M must hold exactly one element, got shape {array.shape}")
    return int(array.reshape(()))


def _traced_scalar(node: Node, value: Any, dtype: Any, what: str) -> jax.Array:
    """A one-element tensor (host or traced) as a jax scalar of `dtype`."""
    if np.size(value) != 1:
        raise node.error(f"{what} must hold exactly one element, got shape {jnp.shape(value)}")
    return jnp.reshape(value, ()).astype(dtype)


def _same_carry(new: Any, old: Any) -> jax.Array:
    """`new` as the carry slot `old` holds, or _NotAScan when its shape or dtype differs."""
    if not _is_tensor(new) or jnp.shape(new) != jnp.shape(old) or jnp.result_type(new) != old.dtype:
        raise _NotAScan
    return jnp.asarray(new, old.dtype)


def _scan_element(value: Any) -> Any:
    if not _is_tensor(value):
        raise _NotAScan
    return value


def _merge(fixed: Sequence[Any], slots: Sequence[int], changing: Sequence[Any]) -> list[Any]:
    """`fixed` with the values at `slots` replaced by `changing`."""
    values = list(fixed)
    for slot, value in zip(slots, changing):
        values[slot] = value
    return values


def _stack_iterations(node: Node, per_iteration: list[list[Any]], num_outputs: int,
                      zero_iteration_shapes: Callable[[], list[Any]]) -> list[Any]:
    """Scan outputs of an unrolled loop: each output's values stacked on a new axis 0."""
    if num_outputs == 0:
        return []
    if not per_iteration:
        return [jnp.zeros((0, *jnp.shape(v)), jnp.result_type(v)) for v in zero_iteration_shapes()]
    stacked = []
    for k in range(num_outputs):
        values = [outputs[k] for outputs in per_iteration]
        if not all(_is_tensor(v) for v in values):
            raise node.unsupported(f"scan output {k} is not a tensor; Loop stacks only tensors")
        shapes = {jnp.shape(v) for v in values}
        if len(shapes) > 1:
            raise node.unsupported(
                f"scan output {k} changes shape across iterations ({sorted(shapes)}); "
                f"onnxtrain stacks scan outputs of one shape only")
        stacked.append(jnp.stack(values))
    return stacked


# ---------------------------------------------------------------------------
# If


def _jax_typed(outputs: Any) -> bool:
    """True when every leaf of a branch's outputs is a value jax.lax.cond can return."""
    return all(isinstance(leaf, (jax.Array, np.ndarray, np.generic)) and np.dtype(leaf.dtype).kind not in "OUS"
               for leaf in jax.tree.leaves(outputs))


def _same_structure(left: Any, right: Any) -> bool:
    """True when two branches' outputs have the same pytree structure, shapes and dtypes."""
    if jax.tree.structure(left) != jax.tree.structure(right):
        return False
    return all(a.shape == b.shape and a.dtype == b.dtype
               for a, b in zip(jax.tree.leaves(left), jax.tree.leaves(right)))


@op("If", since=1)
def if_(node: Node, condition: Any) -> tuple:
    """then_branch's outputs when the one-element bool `cond` is true, else else_branch's.

    A traced condition runs both branches under jax.lax.cond, which needs them to
    agree on output shapes and types; otherwise the condition must be known first.
    """
    if is_host(condition):
        branch = "then_branch" if _host_bool(node, condition, "cond") else "else_branch"
        return tuple(node.run_subgraph(branch, ()))
    predicate = _traced_scalar(node, condition, jnp.bool_, "cond")
    then_body, else_body = _Body(node, "then_branch"), _Body(node, "else_branch")
    # jax.lax.cond traces each branch once, and a branch holding an If traces that one
    # inside, so nested Ifs cost time linear in their depth. Checking the branches' shapes
    # first (jax.eval_shape) would trace them again and double the cost at every level.
    traced: dict[str, Any] = {}

    def run_then() -> list[Any]:
        traced["then"] = then_body(0, ())
        return traced["then"]

    def run_else() -> list[Any]:
        traced["else"] = else_body(0, ())
        return traced["else"]

    try:
        return tuple(jax.lax.cond(predicate, run_then, run_else))
    except TypeError:
        # lax.cond refuses branches whose outputs differ (or hold strings); any other
        # TypeError is not ours to reinterpret.
        if not _branches_differ(traced):
            raise
    raise NeedsHostValues(
        node.label, "has branches whose outputs differ in shape, type or structure (or are not "
        "tensors), so its condition must be known before running, but it is computed from graph "
        "inputs")


def _branches_differ(traced: dict[str, Any]) -> bool:
    """True when the branches traced so far return what jax.lax.cond cannot join."""
    if not all(_jax_typed(outputs) for outputs in traced.values()):
        return True
    return len(traced) == 2 and not _same_structure(traced["then"], traced["else"])


# ---------------------------------------------------------------------------
# Loop


@op("Loop", since=1)
def loop(node: Node, trip_count: Any = None, condition: Any = None, *initial: Any) -> tuple:
    """Run `body` while iteration < M (if given) and cond (if given).

    Returns the final loop-carried values, then each scan output's per-iteration
    values stacked on a new axis 0. The body gets (iteration, cond, carried...).
    """
    body = _Body(node, "body")
    num_scan = body.num_outputs - 1 - len(initial)
    if num_scan < 0:
        raise node.error(f"body has {body.num_outputs} outputs; it needs the condition and "
                         f"one per loop-carried value ({len(initial)})")
    if body.runs_on_host():
        return _unrolled_loop(node, body, trip_count, condition, initial, num_scan, limit=None)
    count = _static_iterations(node, trip_count, condition)
    tensors_only = all(_is_tensor(v) for v in initial)
    if count is not None and tensors_only:
        try:
            return _scanned_loop(body, count, initial)
        except (_NotAScan, NeedsHostValues):
            pass
    scan_outputs_used = any(node.output_used(len(initial) + k) for k in range(num_scan))
    if tensors_only and not scan_outputs_used:
        try:
            return _while_loop(node, body, trip_count, condition, initial)
        except _NotAScan:
            pass
    if is_host(trip_count) and is_host(condition):
        return _unrolled_loop(node, body, trip_count, condition, initial, num_scan,
                              limit=_unroll_limit(body))
    raise NeedsHostValues(
        node.label, "has a trip count or condition computed from graph inputs, so the length of "
        "its scan outputs (or the shapes of its loop-carried values) depends on the data")


def _static_iterations(node: Node, trip_count: Any, condition: Any) -> int | None:
    """The number of iterations when M is a host constant and cond a host constant (or absent)."""
    if not is_host(condition):
        return None
    if condition is not None and not _host_bool(node, condition, "cond"):
        return 0
    if trip_count is None or not is_host(trip_count):
        return None
    return max(_host_count(node, trip_count), 0)


def _scanned_loop(body: _Body, count: int, initial: Sequence[Any]) -> tuple:
    """`count` iterations under jax.lax.scan; _NotAScan unless the body keeps cond a host True."""
    invariant = body.passed_through(first_input=2, first_output=1, count=len(initial))
    carried = [k for k in range(len(initial)) if k not in invariant]
    keep_going = np.array(True)

    def step(carry: tuple, _: None) -> tuple:
        index, *changing = carry
        values = _merge(initial, carried, changing)
        outputs = body(index, [index, keep_going, *values])
        condition = outputs[0]
        if not (isinstance(condition, np.ndarray) and condition.size == 1 and bool(condition)):
            raise _NotAScan
        new = [_same_carry(outputs[1 + k], values[k]) for k in carried]
        scans = [_scan_element(v) for v in outputs[1 + len(initial):]]
        return (index + 1, *new), scans

    start = (jnp.asarray(0, jnp.int64), *[jnp.asarray(initial[k]) for k in carried])
    (_, *final), stacked = jax.lax.scan(step, start, length=count)
    return (*_merge(initial, carried, final), *stacked)


def _while_loop(node: Node, body: _Body, trip_count: Any, condition: Any,
                initial: Sequence[Any]) -> tuple:
    """The loop under jax.lax.while_loop (no scan outputs); _NotAScan if a carried shape changes."""
    invariant = body.passed_through(first_input=2, first_output=1, count=len(initial))
    carried = [k for k in range(len(initial)) if k not in invariant]
    limit = (None if trip_count is None
             else _traced_scalar(node, trip_count, jnp.int64, "trip count M"))

    def keep_going(carry: tuple) -> jax.Array:
        index, condition, _ = carry
        return condition if limit is None else condition & (index < limit)

    def step(carry: tuple) -> tuple:
        index, condition, changing = carry
        values = _merge(initial, carried, changing)
        outputs = body(index, [index, condition, *values])
        new = [_same_carry(outputs[1 + k], values[k]) for k in carried]
        return index + 1, _traced_scalar(node, outputs[0], jnp.bool_, "body condition output"), new

    start_condition = (jnp.asarray(True) if condition is None
                       else _traced_scalar(node, condition, jnp.bool_, "cond"))
    start = (jnp.asarray(0, jnp.int64), start_condition, [jnp.asarray(initial[k]) for k in carried])
    _, _, final = jax.lax.while_loop(keep_going, step, start)
    return tuple(_merge(initial, carried, final))


def _unrolled_loop(node: Node, body: _Body, trip_count: Any, condition: Any,
                   initial: Sequence[Any], num_scan: int, limit: int | None) -> tuple:
    """The iterations run one by one in Python; cond must stay a host value throughout."""
    count = None if trip_count is None else _host_count(node, trip_count)
    keep_going = condition is None or _host_bool(node, condition, "cond")
    values = list(initial)
    per_iteration = []
    index = 0
    while keep_going and (count is None or index < count):
        if limit is not None and index >= limit:
            raise NeedsHostValues(
                node.label, f"cannot run under jax.lax.scan and runs over {limit} iterations, "
                "too many to unroll into one program")
        iteration = np.array(index, np.int64)
        outputs = body(iteration, [iteration, np.array(True), *values])
        if not is_host(outputs[0]):
            raise NeedsHostValues(
                node.label, "stops on a condition computed from graph inputs while its scan "
                "outputs or loop-carried values change shape, so it must run eagerly")
        keep_going = _host_bool(node, outputs[0], "body condition output")
        values = outputs[1:1 + len(initial)]
        per_iteration.append(outputs[1 + len(initial):])
        index += 1

    def zero_iteration_shapes() -> list[Any]:
        return _zero_iteration_scan_values(node, body, values)[1 + len(initial):]

    return (*values, *_stack_iterations(node, per_iteration, num_scan, zero_iteration_shapes))


def _zero_iteration_scan_values(node: Node, body: _Body, values: Sequence[Any]) -> list[Any]:
    """The body's outputs for the carried `values`, evaluated only to learn scan output shapes."""
    iteration = np.array(0, np.int64)
    try:
        return body(iteration, [iteration, np.array(True), *values])
    except (OnnxTrainError, NeedsHostValues) as reason:
        raise node.unsupported(
            f"the loop runs zero times and the shapes of its scan outputs cannot be learned "
            f"by evaluating its body ({reason})") from None


# ---------------------------------------------------------------------------
# Scan


def _scan_attribute(node: Node, name: str, count: int) -> list[int]:
    values = node.attr(name, [0] * count)
    if len(values) != count:
        raise node.error(f"attribute {name!r} has {len(values)} entries for {count} values")
    return [int(v) for v in values]


def _time_major(value: Any, axis: int, direction: int) -> Any:
    """A scan input with its scanned axis first, reversed for direction 1."""
    moved = jnp.moveaxis(value, normalize_axis(axis, jnp.ndim(value)), 0)
    return moved[::-1] if direction == 1 else moved


def _from_time_major(value: Any, axis: int, direction: int) -> Any:
    """A stacked scan output (iterations on axis 0) laid out as the node asks."""
    ordered = value[::-1] if direction == 1 else value
    return jnp.moveaxis(ordered, 0, normalize_axis(axis, jnp.ndim(value)))


def _sequence_length(node: Node, sequences: Sequence[Any]) -> int:
    if not sequences:
        raise node.error("Scan needs at least one scan input (num_scan_inputs >= 1)")
    lengths = {jnp.shape(x)[0] for x in sequences}
    if len(lengths) != 1:
        raise node.error(f"scan inputs differ in length along their scan axes: {sorted(lengths)}")
    return lengths.pop()


def _masked(active: Any, new: Any, old: Any) -> Any:
    """`new` where the iteration is within its sequence's length, else `old`."""
    return new if active is None else jnp.where(active, new, old)


def _run_scan(node: Node, body: _Body, states: Sequence[Any], sequences: Sequence[Any],
              on_host: bool, valid_length: Any = None) -> tuple[list[Any], list[Any]]:
    """Final states and stacked scan outputs of `body` over axis 0 of `sequences`.

    valid_length (Scan-8's sequence_lens): iterations at or past it keep the
    states unchanged and give zero scan outputs.
    """
    length = _sequence_length(node, sequences)
    if on_host:
        return _unrolled_scan(node, body, states, sequences, length, valid_length, limit=None)
    try:
        return _lax_scan(body, states, sequences, valid_length)
    except (_NotAScan, NeedsHostValues):
        return _unrolled_scan(node, body, states, sequences, length, valid_length,
                              limit=_unroll_limit(body))


def _lax_scan(body: _Body, states: Sequence[Any], sequences: Sequence[Any],
              valid_length: Any) -> tuple[list[Any], list[Any]]:
    invariant = body.passed_through(first_input=0, first_output=0, count=len(states))
    carried = [k for k in range(len(states)) if k not in invariant]

    def step(carry: tuple, elements: list[Any]) -> tuple:
        index, *changing = carry
        values = _merge(states, carried, changing)
        outputs = body(index, [*values, *elements])
        active = None if valid_length is None else index < valid_length
        new = [_masked(active, _same_carry(outputs[k], values[k]), values[k]) for k in carried]
        scans = [_scan_element(v) for v in outputs[len(states):]]
        scans = [_masked(active, v, jnp.zeros_like(v)) for v in scans]
        return (index + 1, *new), scans

    start = (jnp.asarray(0, jnp.int64), *[jnp.asarray(states[k]) for k in carried])
    (_, *final), stacked = jax.lax.scan(step, start, list(sequences))
    return _merge(states, carried, final), stacked


def _unrolled_scan(node: Node, body: _Body, states: Sequence[Any], sequences: Sequence[Any],
                   length: int, valid_length: Any,
                   limit: int | None) -> tuple[list[Any], list[Any]]:
    if limit is not None and length > limit:
        raise NeedsHostValues(
            node.label, f"cannot run under jax.lax.scan and runs {length} iterations, "
            f"over the {limit} onnxtrain unrolls into one program")
    values = list(states)
    per_iteration = []
    for index in range(length):
        iteration = np.array(index, np.int64)
        outputs = body(iteration, [*values, *(x[index] for x in sequences)])
        active = None if valid_length is None else iteration < valid_length
        values = [_masked(active, new, old) for new, old in zip(outputs[:len(states)], values)]
        per_iteration.append([_masked(active, v, jnp.zeros_like(v)) for v in outputs[len(states):]])

    def zero_iteration_shapes() -> list[Any]:
        raise node.unsupported("the scan inputs are empty, so the shapes of the scan outputs "
                               "cannot be learned by running the body")

    num_scan = body.num_outputs - len(states)
    return values, _stack_iterations(node, per_iteration, num_scan, zero_iteration_shapes)


@op("Scan", since=9)
def scan(node: Node, *inputs: Any) -> tuple:
    """Run `body` over slices of the scan inputs along scan_input_axes, carrying states.

    Inputs are the initial states then num_scan_inputs scan inputs; outputs are
    the final states then the per-iteration scan outputs stacked along
    scan_output_axes (reversed where scan_output_directions is 1).
    """
    body = _Body(node, "body")
    num_scan_inputs = node.attr("num_scan_inputs")
    num_states = len(inputs) - num_scan_inputs
    num_scan_outputs = body.num_outputs - num_states
    if num_states < 0 or num_scan_outputs < 0:
        raise node.error(f"{len(inputs)} inputs and {body.num_outputs} body outputs do not fit "
                         f"num_scan_inputs={num_scan_inputs}")
    states, sequences = inputs[:num_states], inputs[num_states:]
    input_axes = _scan_attribute(node, "scan_input_axes", num_scan_inputs)
    input_directions = _scan_attribute(node, "scan_input_directions", num_scan_inputs)
    sequences = [_time_major(x, axis, direction)
                 for x, axis, direction in zip(sequences, input_axes, input_directions)]
    final, stacked = _run_scan(node, body, states, sequences, body.runs_on_host())
    output_axes = _scan_attribute(node, "scan_output_axes", num_scan_outputs)
    output_directions = _scan_attribute(node, "scan_output_directions", num_scan_outputs)
    outputs = [_from_time_major(y, axis, direction)
               for y, axis, direction in zip(stacked, output_axes, output_directions)]
    return (*final, *outputs)


def _reversed_within(value: Any, valid_length: Any) -> Any:
    """A time-major sequence whose first valid_length steps are reversed (the rest is padding)."""
    steps = jnp.shape(value)[0]
    order = jnp.clip(valid_length - 1 - jnp.arange(steps), 0, max(steps - 1, 0))
    return jnp.take(value, order, axis=0)


@op("Scan", since=8)
def scan_batched(node: Node, sequence_lens: Any = None, *inputs: Any) -> tuple:
    """Scan-8: batch axis 0 on every input, scan axis 1 on scan inputs; `directions` reverses.

    sequence_lens (per batch entry) stops each entry early: its states keep their
    values and its scan outputs are zero past its length.
    """
    body = _Body(node, "body")
    num_scan_inputs = node.attr("num_scan_inputs")
    num_states = len(inputs) - num_scan_inputs
    if num_states < 0 or body.num_outputs < num_states:
        raise node.error(f"{len(inputs)} inputs and {body.num_outputs} body outputs do not fit "
                         f"num_scan_inputs={num_scan_inputs}")
    directions = _scan_attribute(node, "directions", num_scan_inputs)
    on_host = body.runs_on_host()

    def one_entry(states: list[Any], sequences: list[Any], valid_length: Any) -> tuple:
        sequences = [
            (_reversed_within(x, valid_length) if valid_length is not None else x[::-1])
            if direction == 1 else x
            for x, direction in zip(sequences, directions)]
        return _run_scan(node, body, states, sequences, on_host, valid_length)

    states, sequences = list(inputs[:num_states]), list(inputs[num_states:])
    if on_host:
        batch = _sequence_batch(node, [*states, *sequences])
        entries = [one_entry([s[b] for s in states], [x[b] for x in sequences],
                             None if sequence_lens is None else sequence_lens[b])
                   for b in range(batch)]
        final = [jnp.stack([entry[0][k] for entry in entries]) for k in range(num_states)]
        stacked = [jnp.stack([entry[1][k] for entry in entries])
                   for k in range(body.num_outputs - num_states)]
    else:
        final, stacked = jax.vmap(one_entry)(states, sequences, sequence_lens)
    return (*final, *stacked)


def _sequence_batch(node: Node, values: Sequence[Any]) -> int:
    sizes = {jnp.shape(v)[0] for v in values}
    if len(sizes) != 1:
        raise node.error(f"inputs differ in batch size (axis 0): {sorted(sizes)}")
    return sizes.pop()


# ---------------------------------------------------------------------------
# SequenceMap


@op("SequenceMap", since=17)
def sequence_map(node: Node, sequence: list, *additional: Any) -> tuple:
    """Run `body` once per position of the input sequence(s); tensor inputs are passed whole.

    Each body output becomes a sequence with one element per position.
    """
    body = _Body(node, "body")
    lengths = {len(v) for v in (sequence, *additional) if isinstance(v, list)}
    if len(lengths) != 1:
        raise node.error(f"input sequences differ in length: {sorted(lengths)}")
    results: list[list[Any]] = [[] for _ in range(body.num_outputs)]
    for index in range(len(sequence)):
        inputs = [v[index] if isinstance(v, list) else v for v in (sequence, *additional)]
        for result, value in zip(results, body(np.array(index, np.int64), inputs)):
            result.append(value)
    return tuple(results)
