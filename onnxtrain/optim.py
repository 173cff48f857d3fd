"""Optimizers and learning-rate schedules for make_training_model, written as standard ONNX.

Each optimizer becomes one ai.onnx.preview.training node (Adam, Momentum or Adagrad) in the
algorithm graph; a schedule, gradient clipping, decoupled weight decay and gradient
accumulation become ai.onnx nodes around it. The model then trains on any runtime that
follows the spec, not only ours. Adam counts from 1, so its bias correction is the paper's
(the op skips it at T = 0); the others count from 0, where Momentum uses beta = 1 and
Adagrad no decay, as their ops expect.

State and hyperparameters the recipe keeps (change them between steps with
``trainer.set_state(name, value)``, no recompilation):

- ``learning_rate``: the base (peak) learning rate, a state variable the initialization
  graph resets. A schedule multiplies it by a factor computed from the step counter, so
  changing it rescales the whole schedule.
- ``step``: the optimizer's step counter T (counts updates, not micro-batches).
- ``learning_rate.warmup_steps``, ``learning_rate.warmup_start``, ``learning_rate.decay_steps``,
  ``learning_rate.end_factor``, ``learning_rate.decay_rate``: the schedule's parameters
  (start and end values as fractions of the base learning rate).
- ``clip_norm``, ``weight_decay`` (AdamW), ``accumulate.steps``: the other features' settings.

Example:
    >>> from onnxtrain import optim
    >>> optimizer = optim.AdamW(lr=optim.cosine(peak=1e-3, steps=1000, warmup=100),
    ...                         weight_decay=1e-2, clip_norm=1.0, accumulate=4)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from onnxtrain.errors import InputError

#: Which weights AdamW decays: a predicate (name, value) -> bool or a collection of names.
Mask = Callable[[str, np.ndarray], bool] | Iterable[str] | None

_KINDS = ("constant", "linear", "cosine", "exponential")


def _check_number(where: str, value: Any, low: float, inclusive: bool = True) -> float:
    """`value` as a finite float >= low (or > low); an InputError naming `where` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InputError(f"{where}={value!r} must be a number")
    number = float(value)
    if not math.isfinite(number) or number < low or (not inclusive and number == low):
        relation = ">=" if inclusive else ">"
        raise InputError(f"{where}={value!r} must be a finite number {relation} {low}")
    return number


def _check_count(where: str, value: Any, low: int) -> int:
    """`value` as an int >= low; an InputError naming `where` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InputError(f"{where}={value!r} must be an integer >= {low}")
    return int(value)


@dataclass(frozen=True)
class Schedule:
    """A learning-rate schedule: an optional linear warm-up, then a decay, over optimizer steps.

    Build one with constant(), warmup(), linear(), cosine() or exponential(); pass it as an
    optimizer's ``lr``. Step t counts optimizer updates from 0 (the first update uses t = 0,
    as optax's schedules do). The recipe stores ``peak`` as the ``learning_rate`` state and
    every other value as a fraction of it.

    Attributes:
        kind: "constant", "linear", "cosine" or "exponential": the shape after warm-up.
        peak: the learning rate at the end of warm-up (the start of the decay).
        steps: linear and cosine: the schedule's total length including warm-up;
            exponential: the steps per decay by ``rate``.
        warmup: steps of linear warm-up from ``start`` to ``peak`` (0: none).
        start: the learning rate at step 0 of the warm-up.
        end: the learning rate the decay ends at (exponential: its bound; None: unbounded).
        rate: exponential: the factor per ``steps`` steps.
        staircase: exponential: decay in whole periods (step decay) rather than smoothly.
    """

    kind: str
    peak: float
    steps: int = 0
    warmup: int = 0
    start: float = 0.0
    end: float | None = None
    rate: float = 1.0
    staircase: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise InputError(f"schedule kind {self.kind!r} is not one of {list(_KINDS)}")
        _check_number("peak", self.peak, 0.0)
        _check_number("start", self.start, 0.0)
        if self.end is not None:
            _check_number("end", self.end, 0.0)
        _check_count("warmup", self.warmup, 0)
        if self.kind in ("linear", "cosine"):
            _check_count("steps", self.steps, 1)
            if self.steps <= self.warmup:
                raise InputError(f"steps={self.steps} must be greater than warmup={self.warmup}: steps "
                                 "counts the whole schedule, warm-up included")
        if self.kind == "exponential":
            _check_count("every", self.steps, 1)
            _check_number("rate", self.rate, 0.0, inclusive=False)
        if self.peak == 0.0 and (self.start or self.end):
            raise InputError("a schedule with peak=0 keeps start and end as fractions of the peak; "
                             "give a positive peak")

    def fraction(self, value: float | None) -> float:
        """`value` as a fraction of the peak (0 for a zero peak)."""
        return (value or 0.0) / self.peak if self.peak else 0.0

    @property
    def decay_steps(self) -> int:
        """The decay's length in steps (linear, cosine) or its period (exponential)."""
        return self.steps - self.warmup if self.kind in ("linear", "cosine") else self.steps


def constant(value: float) -> Schedule:
    """A constant learning rate (the same as passing the number itself).

    Args:
        value: the learning rate.

    Returns:
        The schedule.

    Raises:
        InputError: a negative or non-finite value.
    """
    return Schedule("constant", value)


def warmup(peak: float, steps: int, start: float = 0.0) -> Schedule:
    """Linear warm-up from `start` to `peak` over `steps` steps, then `peak` (optax.linear_schedule).

    Args:
        peak: the learning rate after warm-up.
        steps: warm-up steps.
        start: the learning rate at step 0.

    Returns:
        The schedule.

    Raises:
        InputError: a negative value or step count.

    Example:
        >>> optim.Adam(lr=optim.warmup(peak=1e-3, steps=100))
    """
    return Schedule("constant", peak, warmup=steps, start=start)


def linear(peak: float, end: float, steps: int, warmup: int = 0, start: float = 0.0) -> Schedule:
    """Linear decay from `peak` to `end`, reached at step `steps` (then held), after an optional
    linear warm-up from `start` over `warmup` steps (optax.linear_schedule, joined to a warm-up).

    Args:
        peak: the learning rate when the decay begins.
        end: the learning rate from step `steps` on.
        steps: the schedule's total length, warm-up included.
        warmup: warm-up steps (0: none).
        start: the learning rate at step 0 of the warm-up.

    Returns:
        The schedule.

    Raises:
        InputError: negative values, or `steps` not greater than `warmup`.

    Example:
        >>> optim.SGD(lr=optim.linear(peak=0.1, end=0.0, steps=1000))
    """
    return Schedule("linear", peak, steps, warmup, start, end)


def cosine(peak: float, steps: int, warmup: int = 0, end: float = 0.0, start: float = 0.0) -> Schedule:
    """Cosine decay from `peak` to `end` over `steps` steps (warm-up included), after an optional
    linear warm-up from `start` (optax.cosine_decay_schedule, optax.warmup_cosine_decay_schedule).

    Args:
        peak: the learning rate when the decay begins.
        steps: the schedule's total length, warm-up included; `end` from then on.
        warmup: warm-up steps (0: none).
        end: the final learning rate.
        start: the learning rate at step 0 of the warm-up.

    Returns:
        The schedule.

    Raises:
        InputError: negative values, or `steps` not greater than `warmup`.

    Example:
        >>> optim.Adam(lr=optim.cosine(peak=1e-3, steps=1000, warmup=100, end=0.0))
    """
    return Schedule("cosine", peak, steps, warmup, start, end)


def exponential(peak: float, rate: float, every: int, staircase: bool = False, warmup: int = 0,
                end: float | None = None, start: float = 0.0) -> Schedule:
    """peak * rate ** (t / every), or rate ** floor(t / every) with staircase=True (step decay),
    after an optional linear warm-up (optax.exponential_decay, warmup_exponential_decay_schedule).

    Args:
        peak: the learning rate when the decay begins.
        rate: the factor per `every` steps (below 1 decays).
        every: the steps per factor `rate`.
        staircase: decay in whole periods (a step decay).
        warmup: warm-up steps (0: none).
        end: a bound the decay stops at (a floor when rate < 1, else a ceiling).
        start: the learning rate at step 0 of the warm-up.

    Returns:
        The schedule.

    Raises:
        InputError: a non-positive rate or period, or negative values.

    Example:
        >>> optim.Momentum(lr=optim.exponential(peak=0.1, rate=0.5, every=100, staircase=True))
    """
    return Schedule("exponential", peak, every, warmup, start, end, rate, staircase)


@dataclass(frozen=True)
class Optimizer:
    """What the builder needs to emit an optimizer node, plus the features around it.

    Attributes:
        lr: the learning rate: a number or a Schedule.
        clip_norm: scale the gradients by min(1, clip_norm / global norm) before the update
            (optax.clip_by_global_norm); None: no clipping.
        accumulate: sum the gradients of this many steps and update once with their mean
            (optax.MultiSteps); the weights and slots stay unchanged in between, while
            BatchNorm running statistics still follow every micro-batch. Clipping applies
            to the mean.
    """

    lr: float | Schedule
    clip_norm: float | None = field(default=None, kw_only=True)
    accumulate: int = field(default=1, kw_only=True)
    op_type: str = field(init=False)
    slots: tuple[str, ...] = field(init=False)
    first_step: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not isinstance(self.lr, Schedule):
            _check_number("lr", self.lr, 0.0)
        if self.clip_norm is not None:
            _check_number("clip_norm", self.clip_norm, 0.0, inclusive=False)
        _check_count("accumulate", self.accumulate, 1)

    @property
    def schedule(self) -> Schedule:
        """The learning rate as a Schedule (a number is a constant one)."""
        return self.lr if isinstance(self.lr, Schedule) else constant(self.lr)

    @property
    def decoupled_weight_decay(self) -> float:
        """The weight decay applied after the update, scaled by the learning rate (AdamW)."""
        return 0.0

    def decays(self, name: str, value: np.ndarray) -> bool:
        """Whether decoupled weight decay applies to weight `name`."""
        return False

    def attributes(self) -> dict[str, Any]:
        """The optimizer node's attributes."""
        raise NotImplementedError


@dataclass(frozen=True)
class Adam(Optimizer):
    """Adam (the op's alpha/beta are the paper's beta1/beta2); weight_decay adds
    weight_decay * X to the gradient (L2 regularization; see AdamW for decoupled decay).

    The op adds epsilon to sqrt(H) before the bias correction, optax after it: they agree
    unless a gradient entry is about as small as epsilon.

    Example:
        >>> optim.Adam(lr=1e-3, clip_norm=1.0)
    """

    lr: float | Schedule = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    weight_decay: float = 0.0
    op_type: str = field(init=False, default="Adam")
    slots: tuple[str, ...] = field(init=False, default=("V", "H"))
    first_step: int = field(init=False, default=1)

    def attributes(self) -> dict[str, Any]:
        return {"alpha": self.beta1, "beta": self.beta2, "epsilon": self.epsilon,
                "norm_coefficient": self.weight_decay}


@dataclass(frozen=True)
class AdamW(Optimizer):
    """Adam with decoupled weight decay, as optax.adamw: X -= lr * (adam_direction + wd * X).

    The Adam op's own norm_coefficient_post shrinks the updated weight by a fixed factor,
    not by the (scheduled) learning rate times the decay, so the recipe leaves it at 0 and
    subtracts lr * weight_decay * X with standard ops after the op.

    Attributes:
        weight_decay: the decay rate (a hyperparameter named ``weight_decay``).
        mask: which weights decay: a predicate (name, value) -> bool or a collection of
            names; None decays every trainable weight (optax's default). A common choice
            leaves biases and normalization scales out: ``mask=lambda name, w: w.ndim >= 2``.

    Example:
        >>> optim.AdamW(lr=optim.cosine(peak=1e-3, steps=1000), weight_decay=1e-2)
    """

    lr: float | Schedule = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    weight_decay: float = 1e-4
    mask: Mask = None
    op_type: str = field(init=False, default="Adam")
    slots: tuple[str, ...] = field(init=False, default=("V", "H"))
    first_step: int = field(init=False, default=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_number("weight_decay", self.weight_decay, 0.0)
        if self.mask is not None and not callable(self.mask):
            if isinstance(self.mask, str):
                raise InputError(f"mask={self.mask!r} is one string; pass a list of weight names "
                                 "or a predicate (name, value) -> bool")
            object.__setattr__(self, "mask", tuple(self.mask))

    @property
    def decoupled_weight_decay(self) -> float:
        return float(self.weight_decay)

    def decays(self, name: str, value: np.ndarray) -> bool:
        if self.mask is None:
            return True
        if callable(self.mask):
            return bool(self.mask(name, value))
        return name in self.mask

    def attributes(self) -> dict[str, Any]:
        return {"alpha": self.beta1, "beta": self.beta2, "epsilon": self.epsilon}


@dataclass(frozen=True)
class Momentum(Optimizer):
    """SGD with momentum: V = momentum*V + dampening_scale*G, X -= lr*V (or Nesterov).

    Example:
        >>> optim.Momentum(lr=0.01, momentum=0.9, nesterov=True)
    """

    lr: float | Schedule = 1e-2
    momentum: float = 0.9
    gradient_scale: float = 1.0
    nesterov: bool = False
    weight_decay: float = 0.0
    op_type: str = field(init=False, default="Momentum")
    slots: tuple[str, ...] = field(init=False, default=("V",))

    def attributes(self) -> dict[str, Any]:
        return {"alpha": self.momentum, "beta": self.gradient_scale,
                "norm_coefficient": self.weight_decay,
                "mode": "nesterov" if self.nesterov else "standard"}


@dataclass(frozen=True)
class SGD(Momentum):
    """Plain gradient descent, X -= lr*G: Momentum with momentum 0.

    Example:
        >>> optim.SGD(lr=optim.linear(peak=0.1, end=0.0, steps=500))
    """

    lr: float | Schedule = 1e-2
    momentum: float = 0.0


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """Adagrad: H += G^2, X -= lr/(1 + T*decay) * G / (sqrt(H) + epsilon).

    Example:
        >>> optim.Adagrad(lr=0.05)
    """

    lr: float | Schedule = 1e-2
    decay: float = 0.0
    epsilon: float = 1e-6
    weight_decay: float = 0.0
    op_type: str = field(init=False, default="Adagrad")
    slots: tuple[str, ...] = field(init=False, default=("H",))

    def attributes(self) -> dict[str, Any]:
        return {"decay_factor": self.decay, "epsilon": self.epsilon,
                "norm_coefficient": self.weight_decay}


#: The names get() accepts.
OPTIMIZERS: dict[str, type[Optimizer]] = {"adam": Adam, "adamw": AdamW, "sgd": SGD,
                                          "momentum": Momentum, "adagrad": Adagrad}


def _is_optax(value: Any) -> bool:
    """True for an optax GradientTransformation (or one of its wrappers, such as MultiSteps)."""
    module = type(value).__module__ or ""
    return module.split(".")[0] == "optax" or (callable(getattr(value, "init", None))
                                                and callable(getattr(value, "update", None)))


def get(optimizer: Optimizer | str | None = None, **options: Any) -> Optimizer:
    """The optimizer `optimizer` names: an Optimizer as it is, a name with `options`, None -> Adam.

    Args:
        optimizer: an Optimizer, one of the names in OPTIMIZERS ("adam", "adamw", "sgd",
            "momentum", "adagrad"), or None for Adam().
        options: fields of the named optimizer (lr=..., clip_norm=..., ...), or fields to
            replace on a given Optimizer.

    Returns:
        The Optimizer.

    Raises:
        InputError: an unknown name or option, an optax optimizer (make_training_model writes
            the optimizer as ONNX; onnxtrain.finetune takes optax), or any other type.

    Example:
        >>> optim.get("adamw", lr=3e-4, weight_decay=1e-2)
        AdamW(lr=0.0003, ...)
    """
    if optimizer is None:
        optimizer = "adam"
    if isinstance(optimizer, Optimizer):
        return _built(type(optimizer).__name__, lambda: replace(optimizer, **options)) if options else optimizer
    if isinstance(optimizer, str):
        chosen = OPTIMIZERS.get(optimizer.strip().lower())
        if chosen is None:
            raise InputError(f"optimizer={optimizer!r} is not one of {sorted(OPTIMIZERS)}; or pass an "
                             "onnxtrain.optim optimizer such as optim.Adam(lr=1e-3)")
        return _built(optimizer, lambda: chosen(**options))
    if isinstance(optimizer, type) and issubclass(optimizer, Optimizer):
        raise InputError(f"optimizer=optim.{optimizer.__name__} is the class; pass an instance, "
                         f"e.g. optim.{optimizer.__name__}(lr=...)")
    if _is_optax(optimizer):
        raise InputError(
            f"optimizer is an optax optimizer ({type(optimizer).__name__}); make_training_model writes "
            "the optimizer into the model as ONNX operators, so it takes an onnxtrain.optim optimizer "
            f"(one of {sorted(OPTIMIZERS)} or e.g. optim.AdamW(lr=optim.cosine(...), clip_norm=1.0)). "
            "To train with an optax optimizer, use onnxtrain.finetune(model, loss, optimizer=...)")
    raise InputError(f"optimizer={optimizer!r} (type {type(optimizer).__name__}) is not an optimizer; pass "
                     f"one of {sorted(OPTIMIZERS)} or an onnxtrain.optim optimizer such as "
                     "optim.Adam(lr=1e-3)")


def _built(name: str, build: Callable[[], Optimizer]) -> Optimizer:
    """`build()`, with an unknown option reported as an InputError naming the optimizer."""
    try:
        return build()
    except TypeError as error:
        raise InputError(f"optimizer {name!r}: {error}; see help(onnxtrain.optim)") from None
