"""finetune: train an inference model's weights with any optax GradientTransformation.

The step is jax.value_and_grad of the translated model plus the loss, then the
optax update, in one jitted function that reads the weights and the optimizer's
state and writes the new values into the buffers the step before replaced (see
spare_buffers; a large or a small state is donated and updated in place). That
state (moments, counts, schedule steps) lives in the StateStore next to the
weights, flattened to arrays, so checkpoints cover it.
The model runs as exported (inference mode: BatchNorm uses its running
statistics, Dropout is off); make_training_model is the path for training-mode
semantics and for recipes other runtimes can execute.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from onnxtrain.builder import Trainable, trainable_names
from onnxtrain.compilation_cache import enable_compilation_cache
from onnxtrain.errors import BindingError, ExportError, OnnxTrainError, without_jax_notes
from onnxtrain.feeds import FeedChecker
from onnxtrain.fitting import Batches, Callback, fit
from onnxtrain.model import ModelSource, load_model, save_model
from onnxtrain.programs import InferenceProgram, host_copy
from onnxtrain.proto import ModelProto, ValueInfoProto
from onnxtrain.sharding import placement
from onnxtrain.spare_buffers import SpareBuffers, updates_in_place
from onnxtrain.state import checkpoint
from onnxtrain.state.store import StateStore, StateView
from onnxtrain.trainer import replace_initializer
from onnxtrain.translate.compiler_options import jit_with_options
from onnxtrain.translate.graph import draws_random, iter_initializers
from onnxtrain.translate.layouts import row_major

# optax is imported where it is used, so `import onnxtrain` stays lighter (~4 MB, ~0.1 s) for
# the many who never fine-tune with it.
if TYPE_CHECKING:
    import optax

LossFunction = Callable[[jax.Array, jax.Array], jax.Array]


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of logits [N, C, ...] against class indices [N, ...]."""
    log_probabilities = jax.nn.log_softmax(logits, axis=1)
    picked = jnp.take_along_axis(log_probabilities, jnp.expand_dims(labels, 1).astype(jnp.int32), axis=1)
    return -jnp.mean(picked)


def _bce_with_logits(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.mean(jnp.maximum(logits, 0) - logits * labels + jax.nn.softplus(-jnp.abs(logits)))


LOSSES: dict[str, LossFunction] = {
    "mse": lambda prediction, label: jnp.mean((prediction - label) ** 2),
    "l1": lambda prediction, label: jnp.mean(jnp.abs(prediction - label)),
    "cross_entropy": _cross_entropy,
    "bce_with_logits": _bce_with_logits,
}


class FineTuner:
    """A model's weights trained by optax: step(), infer(), fit(), export(), checkpoints."""

    def __init__(self, model: ModelSource, loss: str | LossFunction, optimizer: optax.GradientTransformation,
                 output: str | None = None, trainable: Trainable = None, label: str = "labels",
                 seed: int = 0, mesh: Mesh | None = None):
        """mesh: train data-parallel on this jax.sharding.Mesh, as Trainer(mesh=...) does."""
        enable_compilation_cache()
        self.model = load_model(model)
        self.state_names = tuple(trainable_names(self.model, trainable))
        if not self.state_names:
            raise BindingError("no trainable weights: the model has no float initializers to train "
                               "(or `trainable` selected none)")
        if isinstance(loss, str) and loss not in LOSSES:
            raise BindingError(f"loss={loss!r} is not one of {sorted(LOSSES)} (or pass a function "
                               "(prediction, label) -> scalar)")
        self._loss = LOSSES[loss] if isinstance(loss, str) else loss
        outputs = [v.name for v in self.model.graph.output]
        self.output = output or outputs[0]
        if self.output not in outputs:
            raise BindingError(f"output={self.output!r} is not an output of the model; outputs are {outputs}")
        if label in {v.name for v in self.model.graph.input}:
            raise BindingError(f"label={label!r} is already an input of the model; pass another name")
        self.label = label
        self._optimizer = optimizer
        weights = dict(iter_initializers(self.model.graph, lambda name: name in self.state_names))
        self._placement = placement(mesh, self.model, {name: value.shape for name, value in weights.items()})
        self._inference = InferenceProgram(self.model, self.state_names, self._placement)
        with jax.enable_x64(True):
            slots, self._slot_tree = jax.tree_util.tree_flatten(optimizer.init(weights))
        self._slot_names = tuple(f"optimizer/{index}" for index in range(len(slots)))
        self._store = StateStore({**weights, **dict(zip(self._slot_names, slots))}, jax.random.key(seed))
        self._placement.place_store(self._store)
        self._check_feeds = FeedChecker([*self._inference.declared_inputs, ValueInfoProto(name=label)],
                                        "fine-tuning step")
        # As in a Trainer's step: no key in or out unless the model draws random numbers.
        self._random = draws_random(self._inference.translated.plan)
        self._jitted = jit_with_options(self._spare_step, donate_argnums=1, keep_unused=True)
        self._in_place = jit_with_options(self._step, donate_argnums=0)
        self._spare = SpareBuffers(self._placement)
        self._updates_in_place = updates_in_place(sum(value.nbytes for value in self._store.values.values()))
        self._loss_only = jit_with_options(self._objective)

    @property
    def state(self) -> StateView:
        """The trained weights, read-only; each value read is a copy that stays valid."""
        return self._store.view(self.state_names)

    @property
    def compilations(self) -> int:
        return (self._jitted._cache_size() + self._in_place._cache_size() + self._loss_only._cache_size()
                + self._inference.compilations())

    def _objective(self, weights: dict[str, jax.Array], constants: dict[str, Any], feeds: dict[str, Any],
                   key: jax.Array) -> jax.Array:
        inputs = {name: value for name, value in feeds.items() if name != self.label}
        outputs = self._inference.translated.apply({**constants, **weights}, inputs, key)
        return self._loss(outputs[self.output], feeds[self.label])

    def _step(self, values: dict[str, jax.Array], key: jax.Array | None, constants: dict[str, Any],
              feeds: dict[str, Any]) -> tuple[dict[str, jax.Array], jax.Array | None, dict[str, jax.Array]]:
        key, subkey = jax.random.split(key) if self._random else (None, None)
        weights = {name: values[name] for name in self.state_names}
        slots = jax.tree_util.tree_unflatten(self._slot_tree, [values[n] for n in self._slot_names])
        loss, grads = jax.value_and_grad(self._objective)(weights, constants, feeds, subkey)
        grads = {name: row_major(grad) for name, grad in grads.items()}
        import optax

        updates, slots = self._optimizer.update(grads, slots, weights)
        weights = optax.apply_updates(weights, updates)
        new_slots = jax.tree_util.tree_leaves(slots)
        new_values = {**weights, **dict(zip(self._slot_names, new_slots))}
        return self._placement.constrain_state(new_values), key, {"loss": loss}

    def _spare_step(self, values: dict[str, jax.Array], spare: dict[str, jax.Array], key: jax.Array | None,
                    constants: dict[str, Any], feeds: dict[str, Any]) -> tuple:
        """_step with the new values written into the donated `spare` buffers, never read."""
        return self._step(values, key, constants, feeds)

    def lowered(self, feeds: dict[str, Any]) -> jax.stages.Lowered:
        """The step step() compiles for `feeds` (checked), lowered but not run: for reading its HLO."""
        values, key = self._store.values, self._store.key if self._random else None
        with jax.enable_x64(True):
            if self._updates_in_place:
                return self._in_place.lower(values, key, self._inference.constants, feeds)
            return self._jitted.lower(values, values, key, self._inference.constants, feeds)

    def _run(self, feeds: dict[str, Any]) -> tuple:
        """(new values, key, outputs) of one step on checked, placed feeds."""
        old, key = self._store.values, self._store.key if self._random else None
        if self._updates_in_place:
            return self._in_place(old, key, self._inference.constants, feeds)
        values, key, outputs = self._jitted(old, self._spare.take(old, old), key, self._inference.constants, feeds)
        self._spare.keep_replaced(old, values)
        return values, key, outputs

    def step(self, feeds: Mapping[str, Any]) -> dict[str, jax.Array]:
        """One optimizer step on a batch: the model's inputs plus the label; returns {"loss": ...}."""
        checked = self._placement.place_batch(self._check_feeds(feeds), self._check_feeds.where)
        with jax.enable_x64(True):
            try:
                values, key, outputs = self._run(checked)
            except OnnxTrainError as error:
                raise without_jax_notes(error)
        self._store.commit(values, key)
        return outputs

    def evaluate(self, feeds: Mapping[str, Any]) -> dict[str, jax.Array]:
        """The loss on a batch with the current weights; changes nothing."""
        checked = self._placement.place_batch(self._check_feeds(feeds), self._check_feeds.where)
        weights = {name: self._store.values[name] for name in self.state_names}
        with jax.enable_x64(True):
            return {"loss": self._loss_only(weights, self._inference.constants, checked, self._store.key)}

    def infer(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """The model's outputs with the current weights."""
        checked = self._placement.replicate(self._inference.check_feeds(feeds))
        return self._inference.run(self._store.values, checked, self._store.key)

    def fit(self, batches: Batches, epochs: int = 1, progress: bool = True,
            callbacks: Sequence[Callback] = (), eval_data: Batches | None = None) -> dict[str, list[float]]:
        """Train over `batches` (see onnxtrain.fitting for the history's layout)."""
        return fit(lambda chunk: [self.step(feeds) for feeds in chunk], batches, epochs, progress,
                   callbacks, self.evaluate, eval_data)

    def export(self, path: str | os.PathLike, training: bool = False,
               external_data: bool | str | None = None) -> None:
        """Write the inference model with the trained weights (for ONNX Runtime)."""
        if training:
            raise ExportError("an optax optimizer has no ONNX form, so finetune() exports inference "
                              "models only; use make_training_model for a model that carries its recipe")
        model = ModelProto()
        model.CopyFrom(self.model)
        for name, value in host_copy({n: self._store.values[n] for n in self.state_names}).items():
            replace_initializer(model.graph, name, value)
        save_model(model, path, external_data=external_data)

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Save the weights, the optimizer state and the PRNG key (no pickle)."""
        checkpoint.save_checkpoint(path, host_copy(self._store.values), self._store.key,
                                   {"model": self.model.graph.name})

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        values, key, _ = checkpoint.load_checkpoint(path)
        self._store.restore(values, key, f"checkpoint {str(path)!r}")
        self._placement.place_store(self._store)


def finetune(model: ModelSource, loss: str | LossFunction = "cross_entropy",
             optimizer: optax.GradientTransformation | None = None, *, output: str | None = None,
             trainable: Trainable = None, label: str = "labels", seed: int = 0,
             mesh: Mesh | None = None) -> FineTuner:
    """A FineTuner for `model`: loss as in make_training_model (or a jax function
    (prediction, label) -> scalar), any optax optimizer (default: adam 1e-3), on `mesh` if given."""
    if optimizer is None:
        import optax

        optimizer = optax.adam(1e-3)
    return FineTuner(model, loss, optimizer, output, trainable, label, seed, mesh)
