"""Trainer: a training model as the stateful object the IR spec describes.

initialize() runs the initialization graphs, step() one algorithm, infer() the
main graph, all over one StateStore of state variables (the binding keys),
hyperparameters (scalar constants of the algorithm graphs, changeable without
recompiling) and a PRNG key. export() writes the current values back into the
model, so a run can stop, be served by ONNX Runtime, or resume exactly.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from onnxtrain.batch_stacks import same_signature_runs, stack
from onnxtrain.compilation_cache import enable_compilation_cache
from onnxtrain.errors import BindingError, InputError, ModelLoadError
from onnxtrain.feeds import owned
from onnxtrain.fitting import Batches, Callback, fit
from onnxtrain.model import ModelSource, load_model, save_model
from onnxtrain.programs import InferenceProgram, InitializationProgram, StepProgram, host_copy
from onnxtrain.proto import GraphProto, ModelProto, StringStringEntryProto
from onnxtrain.sharding import placement
from onnxtrain.state import checkpoint
from onnxtrain.state.store import StateStore, StateView
from onnxtrain.training import initial_values, light_graph, validate
from onnxtrain.translate.graph import iter_initializers
from onnxtrain.translate.model import static_input_names
from onnxtrain.translate.registry import normalize_domain
from onnxtrain.translate.tensors import numpy_to_tensor

KEY_METADATA = "onnxtrain.prng_key"
_INFERENCE_STREAM = 0x1F


def _stored_key(model: ModelProto) -> jax.Array | None:
    """The PRNG key an earlier export left in the model, if any."""
    for entry in model.metadata_props:
        if entry.key == KEY_METADATA:
            try:
                saved = json.loads(entry.value)
                data = np.frombuffer(bytes.fromhex(saved["data"]), np.dtype(saved["dtype"]))
                return jax.random.wrap_key_data(data.reshape(saved["shape"]), impl=saved["impl"])
            except (KeyError, ValueError, TypeError) as error:
                raise ModelLoadError(f"metadata {KEY_METADATA!r} is malformed ({error}); remove it "
                                     "or pass seed= to start a fresh random stream") from None
    return None


def _key_metadata(key: jax.Array) -> str:
    data = np.asarray(jax.random.key_data(key))
    return json.dumps({"impl": str(jax.random.key_impl(key)), "dtype": data.dtype.name,
                       "shape": list(data.shape), "data": data.tobytes().hex()})


def _hyperparameters(model: ModelProto, state: set[str]) -> dict[str, tuple[int, np.ndarray]]:
    """Scalar numeric algorithm initializers that are not state: name -> (TrainingInfo index, value)."""
    opsets = {normalize_domain(o.domain): o.version for o in model.opset_import}
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


def without_payloads(model: ModelProto, home: Mapping[str, int | None]) -> ModelProto:
    """A copy of `model` whose initializers held in a store (name -> None for the main graph,
    or the TrainingInfoProto index) keep no data: the store has the values, and export writes
    them back. A fresh message, because protobuf frees a message's memory only as a whole."""
    for place in set(home.values()):
        graph = model.graph if place is None else model.training_info[place].algorithm
        kept = light_graph(graph, {name for name, where in home.items() if where == place})
        del graph.initializer[:], graph.sparse_initializer[:]
        graph.initializer.extend(kept.initializer)
        graph.sparse_initializer.extend(kept.sparse_initializer)
    copy = ModelProto()
    copy.CopyFrom(model)
    return copy


def replace_initializer(graph: GraphProto, name: str, value: np.ndarray) -> None:
    tensor = numpy_to_tensor(value, name)
    for index, existing in enumerate(graph.initializer):
        if existing.name == name:
            tensor.doc_string = existing.doc_string
            graph.initializer[index].CopyFrom(tensor)
            return
    for index, sparse in enumerate(graph.sparse_initializer):
        if sparse.values.name == name:
            del graph.sparse_initializer[index]
            graph.initializer.append(tensor)
            return
    raise BindingError(f"initializer {name!r} disappeared from graph {graph.name!r}")


class Trainer:
    """Run a model's TrainingInfoProtos: initialize(), step(), infer(), fit(), export()."""

    def __init__(self, model: ModelSource, seed: int | None = None, nan_policy: str = "raise",
                 mesh: Mesh | None = None):
        """seed: the PRNG seed. None resumes the key an exported model carries, else uses 0.
        nan_policy: what a step producing NaN/Inf in the state or its outputs does: "raise"
        (NumericError, state kept), "skip" (log, state kept) or "ignore" (apply it).
        mesh: train data-parallel on every device of this jax.sharding.Mesh, feeds split along
        axis 0 over its "batch" axis (else its first), honouring the model's sharding
        annotations (see onnxtrain.sharding). None: the default device."""
        enable_compilation_cache()
        self._model = load_model(model)
        if not self._model.training_info:
            raise BindingError("the model has no training_info, so there is nothing to train; build "
                               "one with onnxtrain.make_training_model(model, loss=..., optimizer=...)")
        layout = validate(self._model)
        self._home = dict(layout.home)
        self.state_names: tuple[str, ...] = layout.names
        hyper = _hyperparameters(self._model, set(layout.names))
        self.hyperparameter_names: tuple[str, ...] = tuple(hyper)
        self._home.update({name: index for name, (index, _) in hyper.items()})
        stored = _stored_key(self._model) if seed is None else None
        key = stored if stored is not None else jax.random.key(0 if seed is None else seed)
        values = itertools.chain(initial_values(self._model, layout), ((n, v) for n, (_, v) in hyper.items()))
        self._store = StateStore(values, key)
        self._model = without_payloads(self._model, self._home)
        self._placement = placement(mesh, self._model, {n: v.shape for n, v in self._store.values.items()})
        self._placement.place_store(self._store)
        variables = [*self.state_names, *self.hyperparameter_names]
        self._initializations = [InitializationProgram(self._model, i) if info.HasField("initialization")
                                 else None for i, info in enumerate(self._model.training_info)]
        self._steps = [StepProgram(self._model, i, variables, nan_policy, self._placement)
                       for i in range(len(self._model.training_info))]
        self._inference = InferenceProgram(self._model, variables, self._placement)

    @property
    def state(self) -> StateView:
        """The state variables, read-only; each value read is a copy that stays valid."""
        return self._store.view(self.state_names)

    @property
    def hyperparameters(self) -> StateView:
        """Scalar constants of the algorithm graphs (learning rates...), read-only; see set_state."""
        return self._store.view(self.hyperparameter_names)

    @property
    def compilations(self) -> int:
        """Programs compiled so far (one per program and input signature)."""
        programs = [*self._steps, self._inference, *filter(None, self._initializations)]
        return sum(program.compilations() for program in programs)

    def set_state(self, name: str, value: Any) -> None:
        """Replace a state variable or hyperparameter (same shape and dtype); no recompilation."""
        self._store.set(name, value)
        self._placement.place_store(self._store)

    def initialize(self) -> None:
        """Run every initialization graph in model order, applying its bindings after each."""
        values, key = dict(self._store.values), self._store.key
        for program in self._initializations:
            if program is not None:
                key, subkey = jax.random.split(key)
                values.update(program.run(values, subkey))
        self._store.commit(values, key)
        self._placement.place_store(self._store)

    def step(self, feeds: Mapping[str, Any], algorithm: int = 0) -> dict[str, Any]:
        """One training step of training_info[algorithm]; returns the outputs no binding consumes."""
        program = self._step_program(algorithm)
        checked = self._placement.place_batch(program.check_feeds(feeds), program.where)
        return program.run(self._store, checked)

    def step_inputs(self, algorithm: int = 0) -> list[str]:
        """The feed names step(feeds, algorithm) takes."""
        return [value.name for value in self._step_program(algorithm).declared_inputs]

    def _step_program(self, algorithm: int) -> StepProgram:
        if not isinstance(algorithm, int) or not 0 <= algorithm < len(self._steps):
            raise InputError(f"algorithm={algorithm!r}: the model has {len(self._steps)} "
                             f"TrainingInfoProto(s), numbered 0..{len(self._steps) - 1}")
        return self._steps[algorithm]

    def infer(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """The main graph's outputs with the current state; changes nothing."""
        checked = self._placement.replicate(self._inference.check_feeds(feeds))
        key = jax.random.fold_in(self._store.key, _INFERENCE_STREAM)
        return self._inference.run(self._store.values, checked, key)

    def fit(self, batches: Batches, epochs: int = 1, algorithm: int = 0, progress: bool = True,
            callbacks: Sequence[Callback] = (), eval_data: Batches | None = None,
            steps_per_call: int = 1) -> dict[str, list[float]]:
        """Step through `batches` `epochs` times (see onnxtrain.fitting for the history's layout).

        batches: a re-iterable collection of feed dicts, or a function returning a fresh
        iterable each epoch. eval_data: batches whose algorithm outputs (e.g. the loss) are
        computed from the current state, without updating it, after every epoch.
        callbacks: callback(epoch, logs) after every epoch; returning True stops training.
        steps_per_call: run this many consecutive same-shaped batches per compiled call
        (a lax.scan on the device; for graphs with convolutions, as many single-step calls
        back to back), saving the per-step dispatch. Whatever the chunk size, values and
        NaN/Inf checks are read back a chunk later, while the device runs the next chunk.
        """
        return fit(lambda chunk: self._run_steps(chunk, algorithm, settle_later=True), batches, epochs,
                   progress, callbacks, lambda feeds: self.evaluate(feeds, algorithm), eval_data, steps_per_call)

    def run_steps(self, batches: Sequence[Mapping[str, Any]], algorithm: int = 0) -> list[Mapping[str, Any]]:
        """One step per batch; each run of same-shaped batches is one compiled call whose
        outputs come back Stacked. Every feed is checked before any step runs."""
        return self._run_steps(batches, algorithm)

    def _run_steps(self, batches: Sequence[Mapping[str, Any]], algorithm: int = 0,
                   settle_later: bool = False) -> list[Mapping[str, Any]]:
        """run_steps; settle_later leaves the NaN/Inf checks of scanned calls to the caller
        (see StepProgram.run_many)."""
        program = self._step_program(algorithm)
        place = self._placement
        # Uncopied: a run of batches is stacked into a new array (or, from fit, rows of one that
        # holds fit's own copies: see batch_stacks); a single batch is copied below.
        checked = [place.check_batch(program.check_feeds(feeds, copy=False), program.where) for feeds in batches]
        return [program.run_many(self._store, place.place_batch(stack(run), program.where, stacked=True),
                                 settle_later)
                if len(run) > 1 else program.run(self._store, place.place_batch(owned(run[0]), program.where),
                                                 settle_later=settle_later)
                for run in same_signature_runs(checked)]

    def evaluate(self, feeds: Mapping[str, Any], algorithm: int = 0) -> dict[str, Any]:
        """What step() would return for these feeds, without changing any state."""
        program = self._step_program(algorithm)
        checked = self._placement.place_batch(program.check_feeds(feeds), program.where)
        return program.evaluate(self._store, checked)

    def export(self, path: str | os.PathLike, training: bool = True,
               external_data: bool | str | None = None) -> None:
        """Write the model with every state variable's current value in its initializer.

        training=False drops training_info: a clean inference model for ONNX Runtime.
        training=True keeps it and records the PRNG key, so Trainer(path) resumes exactly.
        """
        model = ModelProto()
        model.CopyFrom(self._model)
        for name, value in host_copy(self._store.values).items():
            place = self._home[name]
            if place is None:
                replace_initializer(model.graph, name, value)
            elif training:
                replace_initializer(model.training_info[place].algorithm, name, value)
        kept = [e for e in model.metadata_props if e.key != KEY_METADATA]
        del model.metadata_props[:]
        model.metadata_props.extend(kept)
        if training:
            model.metadata_props.append(StringStringEntryProto(key=KEY_METADATA,
                                                               value=_key_metadata(self._store.key)))
        else:
            del model.training_info[:]
        save_model(model, path, external_data=external_data)

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Save every state variable, hyperparameter and the PRNG key (no pickle)."""
        checkpoint.save_checkpoint(path, host_copy(self._store.values), self._store.key,
                                   {"model": self._model.graph.name})

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint saved by a Trainer of the same model."""
        values, key, _ = checkpoint.load_checkpoint(path)
        self._store.restore(values, key, f"checkpoint {str(path)!r}")
        self._placement.place_store(self._store)

    def __repr__(self) -> str:
        return (f"Trainer({self._model.graph.name or 'model'!r}: {len(self.state_names)} state "
                f"variables, {len(self._steps)} algorithm(s))")

