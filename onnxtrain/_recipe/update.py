"""The update part of the algorithm graph make_training_model writes, in standard ops only.

From the weights' gradients to their new values: gradient accumulation (sum into state, update
every K-th step), clipping by global norm, the learning-rate schedule (a factor of the step
counter), the optimizer node (ai.onnx.preview.training) and AdamW's decoupled weight decay.
Every tunable number is a scalar initializer of the algorithm graph, so a Trainer exposes it as
a hyperparameter that set_state changes without recompiling; fixed numbers are Constant nodes,
so they do not clutter that list.

On a step that only accumulates, the optimizer node still runs (an If would hide the state from
the bindings), and Where selects the old weights, slots and counter instead of its results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from onnxtrain.errors import InputError
from onnxtrain.optim import Optimizer, Schedule
from onnxtrain.proto import NodeProto
from onnxtrain.proto.make import node
from onnxtrain.translate.registry import TRAINING_DOMAIN
from onnxtrain.translate.tensors import data_type_of, numpy_to_tensor

_FLOAT = np.dtype(np.float32)


@dataclass
class Update:
    """The nodes and state of the update part.

    zeros: state variables starting at zero (optimizer slots, gradient sums), stored sparse.
    counters: other state variables with their starting values (learning rate, counters).
    hyperparameters: scalar initializers a Trainer lets set_state change.
    updates: state variable -> the name of its new value (weights and slots first).
    """

    nodes: list[NodeProto] = field(default_factory=list)
    zeros: dict[str, np.ndarray] = field(default_factory=dict)
    counters: dict[str, np.ndarray] = field(default_factory=dict)
    hyperparameters: dict[str, np.ndarray] = field(default_factory=dict)
    updates: dict[str, str] = field(default_factory=dict)


class _Writer:
    """Appends nodes to an Update under fresh names."""

    def __init__(self, part: Update, fresh: Callable[[str], str]):
        self.part, self.fresh = part, fresh
        self._constants: dict[tuple[str, object], str] = {}

    def add(self, op_type: str, inputs: Sequence[str], name: str, **attributes) -> str:
        output = self.fresh(name)
        self.part.nodes.append(node(op_type, list(inputs), [output], **attributes))
        return output

    def constant(self, value: float | int | bool, dtype: np.dtype | type = _FLOAT) -> str:
        """A Constant node holding scalar `value`, one per value and dtype."""
        key = (np.dtype(dtype).str, value)
        if key not in self._constants:
            output = self.fresh(f"update.const.{np.dtype(dtype).name}")
            self.part.nodes.append(node("Constant", [], [output],
                                        value=numpy_to_tensor(np.array(value, dtype), output)))
            self._constants[key] = output
        return self._constants[key]

    def hyperparameter(self, name: str, value: float | int, dtype: np.dtype | type = _FLOAT) -> str:
        output = self.fresh(name)
        self.part.hyperparameters[output] = np.array(value, dtype)
        return output

    def cast(self, name: str, source: np.dtype, target: np.dtype) -> str:
        """`name` as `target` (no node when the dtypes agree)."""
        if np.dtype(source) == np.dtype(target):
            return name
        return self.add("Cast", [name], f"{name}.{np.dtype(target).name}", to=data_type_of(np.dtype(target)))


def _schedule_factor(w: _Writer, schedule: Schedule, t: str) -> str | None:
    """The schedule's factor on the base learning rate at step `t` (float32, 0-based);
    None for a constant schedule. Follows optax's schedules: a warm-up joined to a decay
    that restarts its count at the warm-up's end."""
    one, zero = w.constant(1.0), w.constant(0.0)
    decay_t = t
    if schedule.warmup:
        warmup_steps = w.hyperparameter("learning_rate.warmup_steps", schedule.warmup)
        start = w.hyperparameter("learning_rate.warmup_start", schedule.fraction(schedule.start))
        progress = w.add("Div", [t, warmup_steps], "learning_rate.warmup_progress")
        rise = w.add("Mul", [w.add("Sub", [one, start], "learning_rate.warmup_rise"), progress],
                     "learning_rate.warmup_gain")
        warm = w.add("Add", [start, rise], "learning_rate.warmup_factor")
        decay_t = w.add("Max", [w.add("Sub", [t, warmup_steps], "learning_rate.decay_t"), zero],
                        "learning_rate.decay_t")
    decayed = None
    if schedule.kind in ("linear", "cosine", "exponential"):
        steps = w.hyperparameter("learning_rate.decay_steps", schedule.decay_steps)
    if schedule.kind in ("linear", "cosine"):
        end = w.hyperparameter("learning_rate.end_factor", schedule.fraction(schedule.end))
        done = w.add("Min", [w.add("Div", [decay_t, steps], "learning_rate.decay_progress"), one],
                     "learning_rate.decay_progress")
        if schedule.kind == "linear":
            shape = w.add("Sub", [one, done], "learning_rate.decay_left")
        else:
            angle = w.add("Mul", [done, w.constant(np.float32(np.pi).item())], "learning_rate.angle")
            cosine = w.add("Add", [one, w.add("Cos", [angle], "learning_rate.cos")], "learning_rate.cos1")
            shape = w.add("Mul", [cosine, w.constant(0.5)], "learning_rate.cosine")
        span = w.add("Sub", [one, end], "learning_rate.span")
        decayed = w.add("Add", [w.add("Mul", [span, shape], "learning_rate.decay_part"), end],
                        "learning_rate.decay_factor")
    elif schedule.kind == "exponential":
        rate = w.hyperparameter("learning_rate.decay_rate", schedule.rate)
        periods = w.add("Div", [decay_t, steps], "learning_rate.periods")
        if schedule.staircase:
            periods = w.add("Floor", [periods], "learning_rate.periods")
        decayed = w.add("Pow", [rate, periods], "learning_rate.decay_factor")
        if schedule.end is not None:
            bound = w.hyperparameter("learning_rate.end_factor", schedule.fraction(schedule.end))
            decayed = w.add("Max" if schedule.rate < 1 else "Min", [decayed, bound], "learning_rate.bounded")
    if not schedule.warmup:
        return decayed
    warming = w.add("Less", [t, warmup_steps], "learning_rate.warming")
    return w.add("Where", [warming, warm, decayed or one], "learning_rate.factor")


def _clipped(w: _Writer, gradients: list[str], dtypes: list[np.dtype], clip_norm: float) -> list[str]:
    """Every gradient times min(1, clip_norm / global norm), the norm over all of them."""
    squares = [w.cast(w.add("ReduceSumSquare", [g], f"{g}.square_sum", keepdims=0), dtype, _FLOAT)
               for g, dtype in zip(gradients, dtypes)]
    total = w.add("Sum", squares, "clip.square_sum")
    norm = w.add("Sqrt", [total], "clip.global_norm")
    bound = w.hyperparameter("clip_norm", clip_norm)
    # bound / 0 is inf, so an all-zero gradient keeps the scale 1.
    scale = w.add("Min", [w.add("Div", [bound, norm], "clip.ratio"), w.constant(1.0)], "clip.scale")
    return [w.add("Mul", [g, w.cast(scale, _FLOAT, dtype)], f"{g}.clipped") for g, dtype in zip(gradients, dtypes)]


def _decay_mask(optimizer: Optimizer, weights: list[str], values: dict[str, np.ndarray]) -> list[bool]:
    mask = getattr(optimizer, "mask", None)
    if mask is not None and not callable(mask):
        unknown = sorted(set(mask) - set(weights))
        if unknown:
            raise InputError(f"the optimizer's mask names {unknown}, which are not trainable weights; "
                             f"the trainable weights are {weights}")
    return [optimizer.decays(name, values[name]) for name in weights]


def _zeros_like(weight: np.ndarray) -> np.ndarray:
    """A zero slot shaped like `weight`. np.zeros rather than np.zeros_like: its pages are
    mapped on first write, and a slot is only read (for its shape and dtype, and to see that
    it is all zero), so slots the size of a large model's weights cost no memory here."""
    return np.zeros(weight.shape, weight.dtype)


def update_nodes(optimizer: Optimizer, weights: list[str], gradients: list[str],
                 values: dict[str, np.ndarray], fresh: Callable[[str], str]) -> Update:
    """The update part for `weights` (names of initializers in `values`) given their `gradients`.

    Args:
        optimizer: what to emit (see onnxtrain.optim).
        weights: the trained initializers' names.
        gradients: the names of their gradients, in the same order.
        values: the main graph's initializers (for shapes and dtypes).
        fresh: a Names-like callable returning unused names.

    Returns:
        The Update; the learning rate is named "learning_rate" and the counter "step" unless
        those names are taken.

    Raises:
        InputError: an AdamW mask naming a weight that is not trained.
    """
    part = Update()
    w = _Writer(part, fresh)
    dtypes = [values[name].dtype for name in weights]
    lr, step = fresh("learning_rate"), fresh("step")
    schedule = optimizer.schedule
    part.counters[lr] = np.array(schedule.peak, np.float32)
    part.counters[step] = np.array(optimizer.first_step, np.int64)
    slots = {slot: [fresh(f"{name}.{slot}") for name in weights] for slot in optimizer.slots}
    for names in slots.values():
        part.zeros.update((slot, _zeros_like(values[name])) for slot, name in zip(names, weights))

    # An initializer rather than a Constant node, as before these features: the engine's update
    # tail then reads only the gradients and state (a scalar hyperparameter nobody sets).
    one = w.hyperparameter("step.one", 1, np.int64)
    accumulating = optimizer.accumulate > 1
    if accumulating:
        count = fresh("accumulate.count")
        part.counters[count] = np.array(0, np.int64)
        period = w.hyperparameter("accumulate.steps", optimizer.accumulate, np.int64)
        counted = w.add("Add", [count, one], "accumulate.count.next")
        # True while the step only accumulates; the K-th step updates and restarts the count.
        waiting = w.add("Less", [counted, period], "accumulate.waiting")
        sums = [fresh(f"{name}.grad_sum") for name in weights]
        part.zeros.update((s, _zeros_like(values[name])) for s, name in zip(sums, weights))
        totals = [w.add("Add", [s, g], f"{s}.next") for s, g in zip(sums, gradients)]
        period_float = w.add("Cast", [period], "accumulate.steps.float", to=data_type_of(_FLOAT))
        gradients = [w.add("Div", [total, w.cast(period_float, _FLOAT, dtype)], f"{total}.mean")
                     for total, dtype in zip(totals, dtypes)]
    if optimizer.clip_norm is not None:
        gradients = _clipped(w, gradients, dtypes, optimizer.clip_norm)

    rate = lr
    if schedule.kind != "constant" or schedule.warmup:
        t = w.add("Cast", [step], "learning_rate.t", to=data_type_of(_FLOAT))
        if optimizer.first_step:
            t = w.add("Sub", [t, w.constant(float(optimizer.first_step))], "learning_rate.t")
        factor = _schedule_factor(w, schedule, t)
        rate = w.add("Mul", [lr, factor], "learning_rate.scheduled") if factor else lr

    new_weights = [fresh(f"{name}.new") for name in weights]
    new_slots = {slot: [fresh(f"{name}.new") for name in names] for slot, names in slots.items()}
    part.nodes.append(node(
        optimizer.op_type, [rate, step, *weights, *gradients, *[n for s in slots.values() for n in s]],
        [*new_weights, *[n for s in new_slots.values() for n in s]],
        domain=TRAINING_DOMAIN, **optimizer.attributes()))

    if optimizer.decoupled_weight_decay:
        decay = w.hyperparameter("weight_decay", optimizer.decoupled_weight_decay)
        shrink = w.add("Mul", [rate, decay], "weight_decay.scaled")
        for index, (name, dtype, decays) in enumerate(zip(weights, dtypes, _decay_mask(optimizer, weights, values))):
            if decays:
                amount = w.add("Mul", [w.cast(shrink, _FLOAT, dtype), name], f"{name}.decay")
                new_weights[index] = w.add("Sub", [new_weights[index], amount], f"{name}.decayed")

    next_step = w.add("Add", [step, one], "step.new")
    if accumulating:
        new_weights = [w.add("Where", [waiting, old, new], f"{old}.kept") for old, new in zip(weights, new_weights)]
        for slot, names in slots.items():
            new_slots[slot] = [w.add("Where", [waiting, old, new], f"{old}.kept")
                               for old, new in zip(names, new_slots[slot])]
        next_step = w.add("Where", [waiting, step, next_step], "step.kept")
    part.updates.update(zip(weights, new_weights))
    for slot, names in slots.items():
        part.updates.update(zip(names, new_slots[slot]))
    if accumulating:
        for s, total, dtype in zip(sums, totals, dtypes):
            part.updates[s] = w.add("Where", [waiting, total, w.constant(0.0, dtype)], f"{s}.kept")
        part.updates[count] = w.add("Where", [waiting, counted, w.constant(0, np.int64)], "accumulate.count.kept")
    part.updates[step] = next_step
    return part
