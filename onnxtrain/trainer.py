"""Trainer: a training model as the stateful object the IR spec describes.

initialize() runs the initialization graphs, step() one algorithm, infer() the main graph,
all over one store of state variables (the binding keys), hyperparameters (scalar constants
of the algorithm graphs, changeable without recompiling) and a PRNG key. export() writes the
current values back into the model, so a run can stop, be served by ONNX Runtime, or resume
exactly.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from onnxtrain._engine.compilation_cache import enable_compilation_cache, program_cache
from onnxtrain._engine.compiled import DEFAULT_MAX_PROGRAMS, ProgramLimit
from onnxtrain._engine.core import Core
from onnxtrain._engine.faults import check_policy
from onnxtrain._engine.graph_step import GraphStep
from onnxtrain._engine.placement import placement
from onnxtrain._engine.programs import InferenceProgram, InitializationProgram, host_copy, recorded_evaluation
from onnxtrain._io.export import stored_key, without_payloads, write_model
from onnxtrain._io.model import ModelSource, load_model
from onnxtrain._portable.export import portable_transform
from onnxtrain._recipe.training_info import initial_values, validate
from onnxtrain.errors import BindingError
from onnxtrain.proto import ModelProto
from onnxtrain.state.store import StateStore, StateView
from onnxtrain.translate.graph import iter_initializers
from onnxtrain.translate.model import static_input_names
from onnxtrain.translate.recompute import recompute_mode
from onnxtrain.translate.registry import model_opsets


def _hyperparameters(model: ModelProto, state: set[str]) -> dict[str, tuple[int, np.ndarray]]:
    """Scalar numeric algorithm initializers that are not state: name -> (TrainingInfo index, value)."""
    opsets = model_opsets(model.opset_import)
    found: dict[str, tuple[int, np.ndarray]] = {}
    repeated: set[str] = set()
    for index, info in enumerate(model.training_info):
        static = static_input_names(info.algorithm, opsets)
        scalars = {t.name for t in info.algorithm.initializer if not t.dims}
        for name, value in iter_initializers(info.algorithm, scalars.__contains__):
            if name in state or name in static or value.dtype.kind not in "fiub":
                continue
            if name in found:
                repeated.add(name)
            found[name] = (index, value)
    return {name: item for name, item in found.items() if name not in repeated}


class Trainer(Core):
    """Run a model's TrainingInfoProtos: initialize(), step(), infer(), fit(), export().

    Calls that read or change the state are serialized, so several threads may share one
    Trainer: each call is applied whole, in some order.

    Example:
        >>> trainer = onnxtrain.Trainer("model.training.onnx")
        >>> trainer.initialize()
        >>> loss = trainer.step({"X": x, "labels": y})["loss"]
        >>> trainer.export("model.trained.onnx", training=False)
    """

    def __init__(self, model: ModelSource, seed: int | None = None, nan_policy: str = "raise",
                 mesh: Mesh | None = None, max_programs: int = DEFAULT_MAX_PROGRAMS,
                 recompute: bool | str | None = None):
        """Load `model` (a path, bytes, file object or ModelProto that has training_info).

        Args:
            seed: the PRNG seed. None resumes the key an exported model carries, else uses 0.
            nan_policy: what a step producing NaN/Inf in the state or its outputs does:
                "raise" (NumericError, state kept), "skip" (log, state kept) or "ignore"
                (apply it).
            mesh: train data-parallel on every device of this jax.sharding.Mesh, feeds split
                along axis 0 over its "batch" axis (else its first), honouring the model's
                sharding annotations. None: the default device.
            max_programs: compiled programs kept per step, evaluation and inference program,
                one per feed signature (shapes and dtypes); the least recently used is dropped
                beyond it, and a warning says which input keeps changing shape.
            recompute: True (or "blocks") recomputes the forward pass's activations in the
                backward pass, one segment of about sqrt(n) nodes at a time, instead of
                keeping them all: less peak memory for more compute, the same results.

        Raises:
            ModelLoadError, UnsupportedOpError: the model cannot be read or translated.
            BindingError: training_info breaks a rule of the IR spec.
            InputError: a bad nan_policy, mesh or max_programs.
        """
        check_policy(nan_policy)
        mode = recompute_mode(recompute)
        limit = ProgramLimit(max_programs)
        enable_compilation_cache()
        model = load_model(model)
        if not model.training_info:
            raise BindingError("the model has no training_info, so there is nothing to train; build "
                               "one with onnxtrain.make_training_model(model, loss=..., optimizer=...)")
        layout = validate(model)
        home = dict(layout.home)
        hyper = _hyperparameters(model, set(layout.names))
        home.update({name: index for name, (index, _) in hyper.items()})
        stored = stored_key(model) if seed is None else None
        key = stored if stored is not None else jax.random.key(0 if seed is None else seed)
        values = itertools.chain(initial_values(model, layout), ((n, v) for n, (_, v) in hyper.items()))
        store = StateStore(values, key)
        model = without_payloads(model, home)
        if mesh is None:
            # The model (its state's values aside) and these options fix every program: a new
            # process loads them from the executable cache instead of tracing them again.
            limit.cache = program_cache(model, trainer="Trainer", nan_policy=nan_policy, recompute=mode)
        place = placement(mesh, model, {n: v.shape for n, v in store.values.items()})
        variables = [*layout.names, *hyper]
        self._initializations = [InitializationProgram(model, i) if info.HasField("initialization") else None
                                 for i, info in enumerate(model.training_info)]
        steps = [GraphStep(model, i, variables, place, mode) for i in range(len(model.training_info))]
        evaluations = [recorded_evaluation(model, i, variables, place, limit) for i in range(len(steps))]
        super().__init__(model, store, place, steps, nan_policy, InferenceProgram(model, variables, place, limit),
                         home, layout.names, [p for p in self._initializations if p is not None], limit,
                         evaluations)
        self.hyperparameter_names: tuple[str, ...] = tuple(hyper)

    @property
    def hyperparameters(self) -> StateView:
        """Scalar constants of the algorithm graphs (learning rates...), read-only; see set_state."""
        return self._store.view(self.hyperparameter_names)

    def initialize(self) -> None:
        """Run every initialization graph in model order, applying its bindings after each.

        A model as exported holds its starting values already; initialize() resets what its
        initialization graphs produce (for make_training_model's recipe: the optimizer slots,
        the step counter and the learning rate, and any weights it redraws).

        Raises:
            NumericError, InputError: an initialization graph fails on the current state.

        Example:
            >>> trainer = onnxtrain.Trainer("model.training.onnx")
            >>> trainer.initialize()
        """
        with self._store.transaction():
            values, key = dict(self._store.values), self._store.key
            updates: dict[str, Any] = {}
            for program in self._initializations:
                if program is not None:
                    key, subkey = jax.random.split(key)
                    results = program.run(values, subkey)
                    values.update(results)
                    updates.update(results)
            self._store.commit(updates, key)
            self._store.place(self._placement.place_state, self._placement.replicate)

    def export(self, path: str | os.PathLike, training: bool = True,
               external_data: bool | str | None = None, merge: bool | None = None,
               portable: bool | str = False, example_feeds: Mapping[str, Any] | None = None) -> None:
        """Write the model with every state variable's current value in its initializer.

        Args:
            path: the file to write (atomically).
            training: keep training_info and record the PRNG key, so Trainer(path) resumes
                exactly; False writes a clean inference model for ONNX Runtime.
            external_data: True (or a file name) moves large tensors to a side file; None
                does so only past protobuf's 2 GiB limit.
            merge: for a model with adapters (LoRA) and training=False: True or None writes
                the original inference graph with W + (alpha/rank)·A·B folded into each
                adapted weight; False writes the graph with the adapter branch and, beside
                it, the adapter-only file `<path without .onnx>.adapter.onnx`. A training
                export keeps the branch with A and B as state (merge=True is refused).
            portable: for stock runtimes that lack ai.onnx.preview.training (training=True
                only). True keeps training_info with its algorithms written in standard ops
                (Gradient expanded into the backward, optimizers into their formulas), so
                Trainer(path) gives the same steps. "step" writes the first algorithm as a
                plain model (no training_info): inputs are the feeds and every state
                variable (named as the variable, its current value as the initializer of
                that name), outputs are the algorithm's unbound outputs and the next state;
                the JSON manifest in metadata_props["onnxtrain.step"] pairs them
                (docs/design/portable.md, examples/portable_ort.py).
            example_feeds: for portable, a batch as step() takes it, at which the forward
                pass is traced to write its backward (only shapes and index values matter).
                By default the last batch a step ran; before any step, feeds invented from
                the declared shapes (open axes 3, integer inputs 0), which models relating
                their inputs (a KV cache's lengths, position ids) refuse.

        Returns:
            None; the file at `path` is complete once this returns.

        Raises:
            ExportError: the file cannot be written, merge does not apply (see merge), or
                portable is asked for an inference export or an op without a standard-op form.
            InputError: example_feeds do not fit the step's inputs.

        Example:
            >>> trainer.export("model.trained.onnx", training=False)   # for ONNX Runtime
            >>> trainer.export("model.step.onnx", portable="step")     # for stock ONNX Runtime
        """
        if portable is False:
            self._write(path, training, external_data, merge)
            return
        if example_feeds is not None:
            runner = self._runner(0)
            feeds = {name: np.asarray(value) for name, value in runner.step.check_feeds(example_feeds).items()}
        else:
            feeds = self._last_feeds()
        transform = portable_transform(portable, training, merge, feeds)
        with self._store.transaction():
            values = host_copy({name: value for name, value in self._store.values.items() if name in self._home})
            key = self._store.key
        write_model(self._model, values, self._home, path, key, external_data, transform)

    def __repr__(self) -> str:
        return (f"Trainer({self._model.graph.name or 'model'!r}: {len(self.state_names)} state "
                f"variables, {len(self._runners)} algorithm(s))")
