"""Optimizers for make_training_model, written as the ai.onnx.preview.training ops they become.

Each describes one optimizer node: its op, attributes, the state slots it keeps
per weight, and where its step counter starts. The model then runs on any
runtime that follows the spec, not only ours. Adam counts from 1, so its bias
correction is the paper's (the op skips it at T = 0); the others count from 0,
where Momentum uses beta = 1 and Adagrad no decay, as their ops expect.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Optimizer:
    """What the builder needs to emit an optimizer node."""

    lr: float
    op_type: str = field(init=False)
    slots: tuple[str, ...] = field(init=False)
    first_step: int = field(init=False, default=0)

    def attributes(self) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True)
class Adam(Optimizer):
    """Adam (the op's alpha/beta are the paper's beta1/beta2); weight_decay adds
    weight_decay * X to the gradient, decoupled_decay shrinks X after the update (AdamW-like)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    weight_decay: float = 0.0
    decoupled_decay: float = 0.0
    op_type: str = field(init=False, default="Adam")
    slots: tuple[str, ...] = field(init=False, default=("V", "H"))
    first_step: int = field(init=False, default=1)

    def attributes(self) -> dict[str, Any]:
        return {"alpha": self.beta1, "beta": self.beta2, "epsilon": self.epsilon,
                "norm_coefficient": self.weight_decay, "norm_coefficient_post": self.decoupled_decay}


@dataclass(frozen=True)
class Momentum(Optimizer):
    """SGD with momentum: V = momentum*V + dampening_scale*G, X -= lr*V (or Nesterov)."""

    lr: float = 1e-2
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
    """Plain gradient descent, X -= lr*G: Momentum with momentum 0."""

    lr: float = 1e-2
    momentum: float = 0.0


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """Adagrad: H += G^2, X -= lr/(1 + T*decay) * G / (sqrt(H) + epsilon)."""

    lr: float = 1e-2
    decay: float = 0.0
    epsilon: float = 1e-6
    weight_decay: float = 0.0
    op_type: str = field(init=False, default="Adagrad")
    slots: tuple[str, ...] = field(init=False, default=("H",))

    def attributes(self) -> dict[str, Any]:
        return {"decay_factor": self.decay, "epsilon": self.epsilon,
                "norm_coefficient": self.weight_decay}
