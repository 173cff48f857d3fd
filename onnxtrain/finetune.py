"""finetune: train an inference model's weights with any optax GradientTransformation.

The model trains the way make_training_model's recipe trains it (BatchNormalization on batch
statistics with its running statistics updated, Dropout active, the same loss nodes), but
the update is computed by jax.value_and_grad and optax instead of ONNX Gradient and
optimizer nodes. Everything else (state, NaN/Inf policy, fit, checkpoints, export, threads)
is the Trainer's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import Mesh

from onnxtrain._engine.compilation_cache import enable_compilation_cache
from onnxtrain._engine.compiled import DEFAULT_MAX_PROGRAMS, ProgramLimit
from onnxtrain._engine.core import Core
from onnxtrain._engine.faults import check_policy
from onnxtrain._engine.optax_step import LossFunction, OptaxStep
from onnxtrain._engine.placement import Placement, placement
from onnxtrain._engine.programs import EvaluationProgram, InferenceProgram
from onnxtrain._io.export import without_payloads
from onnxtrain._io.model import ModelSource, load_model
from onnxtrain._recipe.damage import prepare
from onnxtrain._recipe.evaluation import LossSpec, loss_part
from onnxtrain._recipe.lora import trained_weights
from onnxtrain._recipe.objective import Objective, Trainable, objective
from onnxtrain.adapters import LoRA
from onnxtrain.errors import BindingError, ExportError
from onnxtrain.data import Data
from onnxtrain.fitting import Callback
from onnxtrain.metrics import MetricsArgument
from onnxtrain.proto import GraphProto, ModelProto
from onnxtrain.state.store import StateStore
from onnxtrain.translate.graph import iter_initializers
from onnxtrain.translate.recompute import recompute_mode

# optax is imported where it is used, so `import onnxtrain` stays light for those who never
# fine-tune with it.
if TYPE_CHECKING:
    import optax


def _injected_hyperparameters(paths: Sequence[tuple[Any, ...]], slot_names: Sequence[str]) -> dict[str, str]:
    """Slot name -> its path in the optimizer state, for the hyperparameters that
    optax.inject_hyperparams keeps in the state (under `hyperparams`)."""
    found = {}
    for path, name in zip(paths, slot_names):
        text = jax.tree_util.keystr(path)
        if ".hyperparams[" in text:
            found[name] = text
    return found


class FineTuner(Core):
    """A model's weights trained by optax: step(), infer(), fit(), export(), checkpoints.

    Example:
        >>> tuner = onnxtrain.finetune("model.onnx", loss="cross_entropy", optimizer=optax.adamw(1e-3))
        >>> history = tuner.fit(batches, epochs=3)
        >>> tuner.export("model.finetuned.onnx")
    """

    def __init__(self, model: ModelSource, loss: str | GraphProto | LossFunction,
                 optimizer: optax.GradientTransformation, output: str | None = None, trainable: Trainable = None,
                 label: str = "labels", seed: int = 0, mesh: Mesh | None = None, nan_policy: str = "raise",
                 train_mode: bool = True, freeze_batchnorm: bool = False,
                 max_programs: int = DEFAULT_MAX_PROGRAMS, repair: Iterable[str] | str | None = None,
                 ignore_index: int | None = None, adapters: LoRA | None = None,
                 recompute: bool | str | None = None):
        """See finetune()."""
        check_policy(nan_policy)
        mode = recompute_mode(recompute)
        limit = ProgramLimit(max_programs)
        enable_compilation_cache()
        source, model = model, load_model(model)
        prepare(model, repair, "finetune", frozen_base=adapters is not None and trainable is None)
        names = trained_weights(model, trainable, adapters, output, source)
        if not names:
            raise BindingError("no trainable weights: the model has no float initializers to train "
                               "(or `trainable` selected none)")
        if label in {v.name for v in model.graph.input}:
            raise BindingError(f"label={label!r} is already an input of the model; pass another name")
        part = objective(model, loss, output, label, train_mode, freeze_batchnorm, ignore_index)
        self.output, self.label = part.output, label
        weights = dict(iter_initializers(model.graph, lambda name: name in names))
        statistics = dict(iter_initializers(model.graph, lambda name: name in part.statistics))
        with jax.enable_x64(True):
            paths, slot_tree = jax.tree_util.tree_flatten_with_path(optimizer.init(weights))
        slots = [slot for _, slot in paths]
        slot_names = tuple(f"optimizer/{index}" for index in range(len(slots)))
        injected = _injected_hyperparameters([path for path, _ in paths], slot_names)
        # Hyperparameters of an optax.inject_hyperparams optimizer are state: set_state changes them.
        self.injected_hyperparameters: dict[str, str] = injected
        self.learning_rate_names: tuple[str, ...] = tuple(
            name for name, path in injected.items() if path.endswith("['learning_rate']"))
        store = StateStore({**weights, **statistics, **dict(zip(slot_names, slots))}, jax.random.key(seed))
        home = {name: None for name in [*weights, *statistics]}
        model = without_payloads(model, home)
        place = placement(mesh, model, {name: value.shape for name, value in store.values.items()})
        step = OptaxStep(model, part, names, optimizer, slot_names, slot_tree, label,
                         loss if callable(loss) else None, place, mode)
        inference = InferenceProgram(model, list(home), place, limit)
        super().__init__(model, store, place, [step], nan_policy, inference, home, names, limit=limit,
                         evaluations=[_evaluation(model, part, label, loss, list(home), place, limit)])

    def fit(self, batches: Data, epochs: int = 1, progress: bool | None = None,
            callbacks: Sequence[Callback] = (), eval_data: Data | None = None, steps_per_call: int = 1,
            drop_last: bool = False, metrics: MetricsArgument = None, *, verbose: int | str | None = None,
            batch_size: int | None = None, shuffle: bool = False, validation_split: float | None = None,
            seed: int | None = None) -> dict[str, list[float]]:
        """Train over `batches`: batches you made or whole arrays, as Trainer.fit takes them
        (Core.fit documents every argument; a tuple's last value is the label feed). eval_data
        and evaluate() use the inference program and the same loss. The learning-rate
        callbacks need an optimizer made with optax.inject_hyperparams, whose learning rate is
        state.

        Raises:
            InputError: the data or an option is wrong (see onnxtrain.data.fit_data).

        Example:
            >>> tuner.fit((images, classes), epochs=3, batch_size=64, shuffle=True, validation_split=0.1)
        """
        return super().fit(batches, epochs, 0, progress, callbacks, eval_data, steps_per_call, drop_last, metrics,
                           verbose=verbose, batch_size=batch_size, shuffle=shuffle,
                           validation_split=validation_split, seed=seed)

    def export(self, path: str | os.PathLike, training: bool = False,
               external_data: bool | str | None = None, merge: bool | None = None) -> None:
        """Write the inference model with the trained weights (and BatchNorm statistics).

        Args:
            path: the file to write (atomically).
            training: must stay False: an optax optimizer has no ONNX form.
            external_data: True (or a file name) moves large tensors to a side file; None
                does so only past protobuf's 2 GiB limit.
            merge: for a model with adapters (LoRA): True or None writes the original graph
                with W + (alpha/rank)·A·B folded into each adapted weight; False writes the
                graph with the adapter branch and, beside it, the adapter-only file
                `<path without .onnx>.adapter.onnx` (see onnxtrain.apply_adapters).

        Raises:
            ExportError: training=True, merge given for a model without adapters, or the file
                cannot be written.

        Example:
            >>> tuner.export("model.finetuned.onnx")
        """
        if training:
            raise ExportError("an optax optimizer has no ONNX form, so finetune() exports inference "
                              "models only; use make_training_model for a model that carries its recipe")
        self._write(path, False, external_data, merge)


def _evaluation(model: ModelProto, part: Objective, label: str, loss: str | GraphProto | LossFunction,
                variables: list[str], place: Placement, limit: ProgramLimit) -> EvaluationProgram | None:
    """The inference program followed by the objective's loss of its prediction (or the JAX loss
    function applied to it): what evaluate() and fit's eval_data run."""
    if callable(loss) and not isinstance(loss, (str, GraphProto)):
        return EvaluationProgram(model, variables, place, limit, part.output, label, loss_function=loss)
    spec = LossSpec(algorithm=0, prediction=part.output, step_prediction=part.prediction, label=label,
                    loss=part.loss, output="prediction")
    loss_nodes = loss_part(part.graph, spec)
    return None if loss_nodes is None else EvaluationProgram(model, variables, place, limit, part.output, label,
                                                             loss_nodes)


def finetune(model: ModelSource, loss: str | GraphProto | LossFunction,
             optimizer: optax.GradientTransformation | None = None, *, output: str | None = None,
             trainable: Trainable = None, label: str = "labels", ignore_index: int | None = None, seed: int = 0,
             mesh: Mesh | None = None, nan_policy: str = "raise", train_mode: bool = True,
             freeze_batchnorm: bool = False, max_programs: int = DEFAULT_MAX_PROGRAMS,
             repair: Iterable[str] | str | None = None, adapters: LoRA | None = None,
             recompute: bool | str | None = None) -> FineTuner:
    """A FineTuner that trains `model`'s weights with an optax optimizer.

    Args:
        model: a path, bytes, file object or ModelProto of an inference model.
        loss: required, as for make_training_model: "cross_entropy" (logits vs class
            indices), "causal_lm" (a language model's next-token loss, the input ids as labels),
            "mse", "l1", "bce_with_logits", a loss graph (prediction, label) ->
            scalar, or a JAX function (prediction, label) -> scalar.
        optimizer: any optax GradientTransformation (default: optax.adam(1e-3)).
        output: which model output is the prediction (default: the first).
        trainable: one name or a list of names of float initializers to train (exact
            names), or a predicate (name, value) -> bool (default: the weights; exporter
            constants such as exponents, scales, fill values and zero RNN states stay fixed,
            see onnxtrain._recipe.trainable).
        label: the name of the label feed.
        ignore_index: for loss="cross_entropy", a label value that contributes nothing (e.g.
            -100, as torch's default). Labels are checked against the number of classes
            before every step.
        seed: the PRNG seed (Dropout).
        mesh: train data-parallel on this jax.sharding.Mesh, as Trainer(mesh=...) does.
        nan_policy: "raise", "skip" or "ignore", as for Trainer.
        train_mode: run Dropout and BatchNormalization as in training, as make_training_model
            does; False trains the model in inference mode.
        freeze_batchnorm: keep BatchNormalization on its running statistics.
        max_programs: compiled programs kept per step, evaluation and inference program, as
            for Trainer.
        repair: export-damage repairs to apply first ("lift_constants", "retie", "untie",
            "relax_batch", "insert_batchnorm", or "all"), as for make_training_model; damage
            left is warned about once.
        adapters: an onnxtrain.LoRA: train low-rank adapters (A and B, plus the base weights
            `trainable` names) instead of the weights, as make_training_model(adapters=) does.
            On a quantized base (DequantizeLinear of integer weights) the adapters sit on
            the dequantized weights, which stay integers (QLoRA-style).
        recompute: True (or "blocks") recomputes the forward pass's activations in the
            backward pass, one segment of about sqrt(n) nodes at a time, instead of keeping
            them all: less peak memory for more compute, the same results. Quantized
            weights (DequantizeLinear of an integer initializer, MatMulNBits) are always
            dequantized where they are used and recomputed in the backward pass, never
            held as a float model.

    Returns:
        A FineTuner: step(), fit(), evaluate(), infer(), export(), checkpoints.

    Raises:
        BindingError: an unknown loss or output, a trainable initializer that cannot be
            trained, or a label that is taken.
        InputError: a trainable name that names no initializer, an ignore_index without
            loss="cross_entropy", a bad nan_policy, mesh or max_programs.
        ModelLoadError, UnsupportedOpError: the model cannot be read or translated.

    Example:
        >>> tuner = onnxtrain.finetune("cnn.onnx", "cross_entropy", optax.adam(1e-3))
        >>> tuner.step({"x": images, "labels": classes})["loss"]
    """
    if optimizer is None:
        import optax

        optimizer = optax.adam(1e-3)
    return FineTuner(model, loss, optimizer, output, trainable, label, seed, mesh, nan_policy, train_mode,
                     freeze_batchnorm, max_programs, repair, ignore_index, adapters, recompute)
