"""OptaxStep: fine-tuning's step as a pure function (state, key, constants, feeds) -> (key,
updates, outputs, kept), the same shape as GraphStep's, so both run through the same
strategies.

It differentiates the recipe's own objective (the training-mode forward pass and loss nodes
that make_training_model writes; see _recipe/objective.py) with jax.value_and_grad, and
applies an optax transformation. The optimizer's state (moments, counts, schedule steps) is
flattened into state variables beside the weights, so checkpoints cover it; BatchNorm
running statistics are state too, updated by every step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax

from onnxtrain._engine.feeds import FeedChecker
from onnxtrain._engine.placement import Placement
from onnxtrain._engine.programs import Program, checked_assignment
from onnxtrain._recipe.objective import Objective
from onnxtrain.errors import ModelLoadError
from onnxtrain.proto import ModelProto, ValueInfoProto
from onnxtrain.proto.graphs import concatenated
from onnxtrain.translate.graph import draws_random
from onnxtrain.translate.layouts import row_major

if TYPE_CHECKING:
    import optax

LossFunction = Callable[[jax.Array, jax.Array], jax.Array]


class OptaxStep(Program):
    """One optax step over `trainable`, minimizing `objective` (or `loss_function` of its prediction)."""

    def __init__(self, model: ModelProto, objective: Objective, trainable: Sequence[str],
                 optimizer: optax.GradientTransformation, slot_names: Sequence[str], slot_tree: Any,
                 label: str, loss_function: LossFunction | None, placement: Placement,
                 recompute: str | None = None):
        """recompute: "blocks" to recompute activations per segment of nodes in the backward
        pass (see translate.recompute), None to keep them."""
        algorithm = objective.graph
        self._loss = objective.loss or objective.prediction
        self._prediction = objective.prediction
        self._statistics = dict(objective.statistics)
        main_outputs = {value.name for value in model.graph.output}
        returned = dict.fromkeys([self._loss, self._prediction, *self._statistics.values()])
        algorithm.output.extend(ValueInfoProto(name=name) for name in returned if name not in main_outputs)
        graph = concatenated(model.graph.name, (model.graph, algorithm), {*trainable, *self._statistics})
        super().__init__(model, graph, [*trainable, *self._statistics], "fine-tuning", placement,
                         "fine-tuning step")
        if loss_function is not None:
            self.check_feeds = FeedChecker([*self.declared_inputs, ValueInfoProto(name=label)], "fine-tuning step")
        self.translated.recompute = recompute
        self.trainable = tuple(trainable)
        self._optimizer = optimizer
        self._slot_names, self._slot_tree = tuple(slot_names), slot_tree
        self._label, self._loss_function = label, loss_function
        self.bound = (*self.trainable, *self._slot_names, *self._statistics)
        self.random = draws_random(self.translated.plan)
        self.loop_averse = False
        self.tail, self.tail_inputs = None, []
        # The optimizer is Python, not model: nothing outside the program's trace names it.
        self.identity = None
        self.prediction: str | None = None   # "prediction" in the copy with_prediction() makes

    def with_prediction(self) -> OptaxStep:
        """This step returning its prediction too, as "prediction" (sharing the translation)."""
        measuring = copy.copy(self)
        measuring.prediction = "prediction"
        return measuring

    def _objective(self, weights: dict, state: Mapping[str, Any], constants: Mapping[str, Any],
                   feeds: Mapping[str, Any], key: jax.Array | None) -> tuple:
        """(loss, (the prediction, the BatchNorm statistics' new values))."""
        inputs = feeds if self._loss_function is None else {n: v for n, v in feeds.items() if n != self._label}
        outputs = self.translated.apply(self.params({**state, **weights}, constants), inputs, key)
        loss = outputs[self._loss]
        if self._loss_function is not None:
            loss = self._loss_function(loss, feeds[self._label])
        where = "fine-tuning: BatchNormalization's running statistic"
        return loss, (outputs[self._prediction], {name: checked_assignment(name, outputs[new], state[name], where)
                                                   for name, new in self._statistics.items()})

    def __call__(self, state: Mapping[str, Any], key: jax.Array | None, constants: Mapping[str, Any],
                 feeds: Mapping[str, Any], kept: Sequence[str] = ()) -> tuple:
        import optax

        key, subkey = jax.random.split(key) if self.random else (key, None)
        weights = {name: state[name] for name in self.trainable}
        slots = jax.tree_util.tree_unflatten(self._slot_tree, [state[name] for name in self._slot_names])
        (loss, (prediction, statistics)), grads = jax.value_and_grad(self._objective, has_aux=True)(
            weights, state, constants, feeds, subkey)
        grads = {name: row_major(grad) for name, grad in grads.items()}
        updates, slots = self._optimizer.update(grads, slots, weights)
        weights = optax.apply_updates(weights, updates)
        new_slots = dict(zip(self._slot_names, jax.tree_util.tree_leaves(slots)))
        outputs = {"loss": loss} if self.prediction is None else {"loss": loss, self.prediction: prediction}
        return key, {**weights, **new_slots, **statistics}, outputs, {}

    def eager(self, state: Mapping[str, Any], key: jax.Array, feeds: Mapping[str, Any]) -> tuple:
        raise ModelLoadError("fine-tuning needs a model JAX can compile for these feed shapes, and this "
                             "one needs concrete values while tracing (strings, data-dependent shapes); "
                             "train it with make_training_model and Trainer instead")
