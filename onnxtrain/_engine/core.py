"""Core: what Trainer and FineTuner share. They differ only in how a step computes its updates
(the model's algorithm graph, or jax.value_and_grad and optax); everything else is here.

The store's transaction lock serializes every call that reads or changes state, so threads
sharing one trainer each get whole calls applied in some order. A step's path:

    Core.step -> StepRunner.run -> strategy (strategies.py) -> compiled step -> StateStore.commit
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from onnxtrain._engine.batches import same_signature_runs, stack
from onnxtrain._engine.compiled import Job, ProgramLimit
from onnxtrain._engine.feeds import owned
from onnxtrain._engine.placement import Placement, host_value
from onnxtrain._engine.programs import EvaluationProgram, InferenceProgram, Program, host_copy
from onnxtrain._engine.runner import StepRunner
from onnxtrain._engine.strategies import StepFunction
from onnxtrain._io.export import Home, write_model
from onnxtrain._io.onnx_adapter import SUFFIX as ONNX_ADAPTER
from onnxtrain._io.onnx_adapter import write_onnx_adapter
from onnxtrain._recipe.lora_export import adapter_ready_transform, export_transform, onnx_adapter_parameters
from onnxtrain._recipe.peft_export import write_peft_adapter
from onnxtrain.errors import ExportError, InputError, ModelLoadError
from onnxtrain.data import Data, fit_data
from onnxtrain.fitting import Batches, Callback, evaluate_batches, fit
from onnxtrain.metrics import MetricSet, MetricsArgument
from onnxtrain.proto import ModelProto
from onnxtrain.proto.metadata import read_record
from onnxtrain.state import checkpoint
from onnxtrain.state.store import StateStore, StateView

logger = logging.getLogger("onnxtrain")

@dataclass(frozen=True)
class Snapshot:
    """Host copies of state values and the PRNG key, taken by Core.snapshot."""

    values: Mapping[str, np.ndarray]
    key: jax.Array


class Core:
    """A store of state, the step functions that update it and the inference program that reads it."""

    # A callback sets it to end fit after the current chunk of steps; fit clears it when it starts.
    stop_training: bool = False

    def __init__(self, model: ModelProto, store: StateStore, placement: Placement, steps: Sequence[StepFunction],
                 nan_policy: str, inference: InferenceProgram, home: Home, state_names: Sequence[str],
                 other_programs: Sequence[Program] = (), limit: ProgramLimit | None = None,
                 evaluations: Sequence[EvaluationProgram | None] = ()):
        """model: the model without the stored values' payloads (see export.without_payloads);
        home: where each exported value's initializer lives; state_names: what `state` shows;
        limit: how many programs each step function keeps (`inference` has its own);
        evaluations: per step function, the program evaluate() runs (the main graph and the
        loss of its prediction), or None where the loss cannot be separated from the step."""
        self._model = model
        self._store = store
        self._placement = placement
        store.place(placement.place_state, placement.replicate)
        limit = limit or ProgramLimit()
        self._runners = [StepRunner(step, nan_policy, placement, store.transaction(), limit) for step in steps]
        # Per algorithm, made at the first fit with metrics: the step returning its prediction too.
        self._measuring: dict[int, StepRunner] = {}
        self._nan_policy, self._limit = nan_policy, limit
        self._inference = inference
        self._home = dict(home)
        self._evaluations = [*evaluations, *[None] * (len(steps) - len(evaluations))]
        self._other_programs = [*other_programs, *(p for p in self._evaluations if p is not None)]
        self._dry_run_said = False
        # The feeds of the last batch a step ran (a stacked run's, with True): what a portable
        # export traces the model at unless given other feeds.
        self._last_batch: tuple[dict[str, Any], bool] | None = None
        self.state_names: tuple[str, ...] = tuple(state_names)

    @property
    def state(self) -> StateView:
        """The state variables, read-only; each value read is a copy that stays valid."""
        return self._store.view(self.state_names)

    @property
    def compilations(self) -> int:
        """Programs compiled so far: one per program and feed signature, and one more each time a
        signature evicted by max_programs comes back."""
        programs = [self._inference, *self._other_programs]
        runners = [*self._runners, *self._measuring.values()]
        return sum(runner.compilations() for runner in runners) + sum(p.compilations() for p in programs)

    @property
    def programs_kept(self) -> int:
        """Compiled programs held now: at most max_programs feed signatures' worth per step,
        evaluation and inference program."""
        programs = [self._inference, *self._other_programs]
        runners = [*self._runners, *self._measuring.values()]
        return sum(runner.kept() for runner in runners) + sum(p.kept() for p in programs)

    def set_state(self, name: str, value: Any) -> None:
        """Replace a state variable or hyperparameter (same shape and dtype); no recompilation."""
        with self._store.transaction():
            self._store.set(name, value)

    def get_state(self, name: str) -> np.ndarray:
        """A host copy of one value set_state can set: a state variable, hyperparameter or slot.

        Raises:
            InputError: `name` is not one of them.
        """
        with self._store.transaction():
            if name not in self._store.values:
                raise InputError(f"{name!r} is not a state variable; known: {sorted(self._store.values)}")
            return np.array(host_value(self._store.values[name]))

    def snapshot(self, exclude: Collection[str] = ()) -> Snapshot:
        """Host copies of every state value (but `exclude`) and the PRNG key, for restore_snapshot:
        what save_checkpoint writes, kept in memory."""
        with self._store.transaction():
            # Copied: a numpy view of a CPU buffer would see the step that later donates it.
            values = {name: np.array(host_value(value)) for name, value in self._store.values.items()
                      if name not in exclude}
            return Snapshot(values, self._store.key)

    def restore_snapshot(self, snapshot: Snapshot) -> None:
        """Put back the values and key of `snapshot`; values it excluded keep their current values."""
        with self._store.transaction():
            current = {name: value for name, value in self._store.values.items() if name not in snapshot.values}
            self._store.restore({**snapshot.values, **current}, snapshot.key, "snapshot")

    def _runner(self, algorithm: int) -> StepRunner:
        if not isinstance(algorithm, int) or not 0 <= algorithm < len(self._runners):
            raise InputError(f"algorithm={algorithm!r}: the model has {len(self._runners)} "
                             f"TrainingInfoProto(s), numbered 0..{len(self._runners) - 1}")
        return self._runners[algorithm]

    def _measuring_runner(self, algorithm: int) -> StepRunner:
        """The runner of algorithm's step that also returns the step's prediction (for training
        metrics); only models naming their prediction get here (MetricSet checks)."""
        runner = self._runner(algorithm)
        if algorithm not in self._measuring:
            step = runner.step.with_prediction()
            self._measuring[algorithm] = StepRunner(step, self._nan_policy, self._placement,
                                                    self._store.transaction(), self._limit)
        return self._measuring[algorithm]

    def _placed(self, runner: StepRunner, feeds: Mapping[str, Any], copy: bool = True) -> dict[str, Any]:
        return self._placement.place_batch(runner.step.check_feeds(feeds, copy=copy), runner.step.where)

    def step(self, feeds: Mapping[str, Any], algorithm: int = 0) -> dict[str, Any]:
        """One training step; returns the outputs no binding consumes (e.g. the loss)."""
        runner = self._runner(algorithm)
        with self._store.transaction():
            # A step that has read its feeds when it returns can take the caller's arrays as they are.
            placed = self._placed(runner, feeds, copy=not runner.done_with_feeds(self._store))
            self._last_batch = (placed, False)
            return runner.run(self._store, placed)

    def step_inputs(self, algorithm: int = 0) -> list[str]:
        """The feed names step(feeds, algorithm) takes."""
        return list(self._runner(algorithm).step.check_feeds.names)

    def evaluate(self, data: Mapping[str, Any] | Batches, algorithm: int = 0,
                 metrics: MetricsArgument = None) -> dict[str, Any]:
        """The loss, predictions and metrics the exported inference model gives; changes no state.

        Models built by make_training_model or finetune are evaluated with inference semantics:
        the main graph on the current state (BatchNormalization on its running statistics, no
        Dropout), then the recipe's loss of its prediction. A hand-written recipe whose loss
        cannot be separated from its training pass is evaluated by running the training step
        without committing it (Dropout and BatchNorm as in training; said once in the log).

        Args:
            data: one feed dict, or batches (a re-iterable of feed dicts, or a function
                returning one).
            algorithm: which TrainingInfoProto's loss (and step inputs).
            metrics: names in onnxtrain.metrics ("accuracy", "top_k_accuracy", "mae", "mse"),
                functions (predictions, labels) -> float, or a dict {name: function}.

        Returns:
            For one feed dict: the step's unbound outputs (e.g. "loss" and, for models that
            name it, "prediction") as arrays, and each metric as a float. For batches: the
            scalar outputs and metrics as floats, averaged over the batches weighted by batch
            size.

        Raises:
            InputError: a bad feed, an unknown metric, or metrics on a model that does not
                name its prediction and label.

        Example:
            >>> trainer.evaluate(held_out_batches, metrics=["accuracy"])
            {'loss': 0.31, 'accuracy': 0.91}
        """
        measured = self._metric_set(algorithm, metrics)   # checks `algorithm` too
        if isinstance(data, Mapping):
            outputs, checked = self._evaluate_batch(data, algorithm)
            if measured:
                outputs.update(measured(outputs[measured.prediction], checked[measured.label]))
            return outputs
        return evaluate_batches(lambda feeds: self._evaluate_batch(feeds, algorithm), data, measured)

    def _metric_set(self, algorithm: int, metrics: MetricsArgument) -> MetricSet:
        where = self._runner(algorithm).step.where
        program = self._evaluations[algorithm]
        if program is None:
            return MetricSet(metrics, None, None, where)
        return MetricSet(metrics, program.names[1], program.label, where)

    def _evaluate_batch(self, feeds: Mapping[str, Any], algorithm: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(outputs, the checked feeds) of one evaluation batch."""
        program = self._evaluations[algorithm]
        if program is None:
            runner = self._runner(algorithm)
            if not self._dry_run_said:
                self._dry_run_said = True
                logger.info("%s: the loss cannot be separated from the training pass (a hand-written "
                            "recipe), so evaluation runs the training step without committing it: Dropout "
                            "and BatchNormalization behave as in training", runner.step.where)
            with self._store.transaction():
                checked = runner.step.check_feeds(feeds)
                return runner.evaluate(self._store, self._placement.place_batch(checked, runner.step.where)), checked
        with self._store.transaction():
            checked = program.check_feeds(feeds)
            return program.run(self._store.values, self._placement.replicate(checked), self._store.key), checked

    def infer(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """The main graph's outputs with the current state; changes nothing."""
        with self._store.transaction():
            checked = self._placement.replicate(self._inference.check_feeds(feeds))
            return self._inference.run(self._store.values, checked, self._store.key)

    def fit(self, batches: Data, epochs: int = 1, algorithm: int = 0, progress: bool | None = None,
            callbacks: Sequence[Callback] = (), eval_data: Data | None = None,
            steps_per_call: int = 1, drop_last: bool = False, metrics: MetricsArgument = None, *,
            verbose: int | str | None = None, batch_size: int | None = None,
            shuffle: bool = False, validation_split: float | None = None,
            seed: int | None = None) -> dict[str, list[float]]:
        """Step through `batches` `epochs` times (see onnxtrain.fitting for the history's layout).

        Args:
            batches: batches you made (a re-iterable collection of feed dicts or of tuples in
                the order of step_inputs(), e.g. a torch DataLoader of (x, y), or a function
                returning a fresh iterable each epoch), or whole arrays ((x, y), or a dict
                input name -> array) cut into batches; see onnxtrain.data.
            epochs: how many passes over the data (a positive int).
            algorithm: which TrainingInfoProto steps.
            progress: False is verbose=0 (kept for older code).
            callbacks: Callback objects (onnxtrain.callbacks: hooks per step and per epoch,
                early stopping, checkpoints, learning-rate schedules, loggers) or functions
                callback(epoch, logs) run after every epoch, where returning True stops training.
            eval_data: data in any of the same forms, evaluated after every epoch as
                evaluate() does (inference semantics; logged as "val_loss", "val_<metric>").
                Its first batch is checked before training starts.
            steps_per_call: run this many consecutive same-shaped batches per compiled call,
                saving the per-step dispatch. Whatever the chunk size, values and NaN/Inf
                checks are read back a chunk later, while the device runs the next chunk.
                Other threads' calls may run between chunks.
            drop_last: skip the last batch of an epoch when its batch size (axis 0) differs from
                the first's. Without it, a short last batch (whole arrays whose rows batch_size
                does not divide) compiles one program more, once.
            metrics: as evaluate() takes them; computed from each step's own prediction for
                training (no second forward pass) and logged per epoch.
            verbose: 1 a progress bar per epoch, kept (default), 2 one line per epoch, 0 silent.
            batch_size: rows per batch of whole arrays (default 32).
            shuffle: visit whole arrays' rows in a new random order each epoch.
            validation_split: hold out this last fraction of whole arrays' rows (before
                shuffling, as Keras does) as eval_data.
            seed: the shuffle's seed; None draws it from the trainer's PRNG key, so a trainer
                made with the same seed shuffles the same way.

        Returns:
            The history: a list of values per name (see onnxtrain.fitting).

        Raises:
            InputError: the data or an option is wrong (see onnxtrain.data.fit_data), or a
                batch does not fit the step's inputs; nothing has trained when the data's form
                or the first evaluation batch is wrong.
            NumericError: a step produced NaN or Inf under nan_policy="raise".

        Example:
            >>> history = trainer.fit((x, y), epochs=5, batch_size=64, shuffle=True, validation_split=0.2)
        """
        check = self._runner(algorithm).step.check_feeds
        data = fit_data(batches, check.names, eval_data=eval_data, epochs=epochs, batch_size=batch_size,
                        shuffle=shuffle, validation_split=validation_split,
                        seed=self._data_seed() if seed is None else seed, convert=check.convert,
                        check=lambda feeds: check(feeds, copy=False))
        measured = self._metric_set(algorithm, metrics)
        runner = self._measuring_runner(algorithm) if measured else self._runner(algorithm)
        # The first epoch's programs load or compile side by side before its first step; a
        # chunk of several steps runs a program of its own, compiled when first met.
        ahead = functools.partial(self._get_ready, runner, algorithm, evaluations=data.eval_shapes, fitting=True)
        return fit(lambda chunk: self._run_steps(chunk, algorithm, settle_later=True, runner=runner), data.train,
                   epochs, progress, callbacks, lambda feeds: self._evaluate_batch(feeds, algorithm), data.eval,
                   steps_per_call, drop_last, lambda feeds: check(feeds, copy=False), measured, verbose=verbose,
                   trainer=self, ahead=lambda known: ahead(known if steps_per_call == 1 else []))

    def _last_feeds(self) -> dict[str, np.ndarray] | None:
        """The feeds of the last batch a step ran, as host arrays (None before any step)."""
        if self._last_batch is None:
            return None
        placed, stacked = self._last_batch
        return {name: np.asarray(value[-1] if stacked else value) for name, value in placed.items()}

    def _data_seed(self) -> list[int]:
        """The shuffle's seed, drawn from the state's PRNG key (which each step advances)."""
        with self._store.transaction():
            key = self._store.key
        return [int(word) for word in np.asarray(jax.random.key_data(key)).ravel()]

    def run_steps(self, batches: Sequence[Mapping[str, Any]], algorithm: int = 0) -> list[Mapping[str, Any]]:
        """One step per batch; each run of same-shaped batches is one compiled call whose
        outputs come back stacked. Every feed is checked before any step runs."""
        return self._run_steps(batches, algorithm)

    def _run_steps(self, batches: Sequence[Mapping[str, Any]], algorithm: int = 0,
                   settle_later: bool = False, runner: StepRunner | None = None) -> list[Mapping[str, Any]]:
        runner, place = runner or self._runner(algorithm), self._placement
        where = runner.step.where
        with self._store.transaction():
            # Uncopied: a run of batches is stacked into a new array (or, from fit, rows of one
            # that holds fit's own copies: see batches.StackBuilder); a single batch is copied.
            checked = [place.check_batch(runner.step.check_feeds(feeds, copy=False), where) for feeds in batches]
            results = []
            for run in same_signature_runs(checked):
                if len(run) > 1:
                    placed = place.place_batch(stack(run), where, stacked=True)
                    results.append(runner.run_many(self._store, placed, settle_later))
                else:
                    placed = place.place_batch(owned(run[0]), where)
                    results.append(runner.run(self._store, placed, settle_later=settle_later))
                self._last_batch = (placed, len(run) > 1)
            return results

    def compile(self, feeds: Mapping[str, Any] | Sequence[Mapping[str, Any]], algorithm: int = 0) -> int:
        """Compile, ahead of the first step, the programs that step(), fit() and evaluate()
        run for batches shaped like `feeds`, and infer() for its inputs among them: each is
        loaded from the executable cache where it is there, else traced, then compiled and
        stored; loads and compiles run side by side in threads. Nothing runs and no state
        changes.

        Args:
            feeds: an example batch (its values are not used, only its shapes and dtypes), as
                step() takes it; or a list of them (e.g. the full batch and a short last one),
                all made ready together.
            algorithm: which TrainingInfoProto's step.

        Returns:
            How many programs were compiled (0 when all were compiled or cached already).

        Raises:
            InputError: a feed does not fit the step's inputs.

        Example:
            >>> trainer.compile({"X": np.zeros((32, 784), np.float32), "labels": np.zeros(32, np.int64)})
            3
        """
        batches = [feeds] if isinstance(feeds, Mapping) else list(feeds)
        return self._get_ready(self._runner(algorithm), algorithm, batches, batches)

    def _get_ready(self, runner: StepRunner, algorithm: int, steps: Sequence[Mapping[str, Any]],
                   evaluations: Sequence[Mapping[str, Any]], fitting: bool = False) -> int:
        """Load or compile the programs `runner` steps each batch of `steps` with (with
        `fitting`, fit's only; else step()'s, fit's and infer()'s of the inputs among them)
        and evaluation each batch of `evaluations` with. Tracing runs on this thread; loads
        and compiles side by side in threads. Returns how many programs were compiled."""
        jobs: list[Job] = []
        inputs = set(self._inference.check_feeds.names)
        with self._store.transaction():
            for feeds in steps:
                jobs += runner.prepare(self._store, self._placed(runner, feeds, copy=False), fitting)
                given = {name: value for name, value in feeds.items() if name in inputs}
                if not fitting and inputs <= set(given):
                    checked = self._placement.replicate(self._inference.check_feeds(given))
                    jobs += self._inference.prepare(self._store.values, checked, self._store.key)
            evaluation = self._evaluations[algorithm]
            for feeds in evaluations if evaluation is not None else ():
                checked = self._placement.replicate(evaluation.check_feeds(feeds))
                jobs += evaluation.prepare(self._store.values, checked, self._store.key)
            with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
                for done in [pool.submit(job) for job in jobs]:
                    done.result()
        return sum(not job.loads for job in jobs)

    def lowered(self, feeds: Mapping[str, Any], algorithm: int = 0) -> jax.stages.Lowered:
        """The single step step() compiles for `feeds`, lowered but not run: for reading its HLO."""
        runner = self._runner(algorithm)
        with self._store.transaction():
            return runner.lowered(self._store, self._placed(runner, feeds))

    def _write(self, path: str | os.PathLike, training: bool, external_data: bool | str | None,
               merge: bool | None = None) -> None:
        # Adapters (LoRA) fold into their weights, or keep their branch and write an adapter file.
        transform = export_transform(self._model, training, merge, os.fspath(path), set(self._home))
        with self._store.transaction():
            values = host_copy({name: value for name, value in self._store.values.items() if name in self._home})
            key = self._store.key
        write_model(self._model, values, self._home, path, key if training else None, external_data, transform)

    def export_adapters(self, path: str | os.PathLike, drop_prefix: str = "",
                        base: str | os.PathLike | None = None) -> None:
        """Write the LoRA adapters for the runtime that serves them, by `path`:

        - `<name>.onnx_adapter`: ONNX Runtime's adapter file, which ONNX Runtime GenAI loads
          (`og.Adapters(model).load(path, name)`) and binds to an adapter-ready base; `base`
          writes that base (the model with each A and B as an input whose default is empty,
          so it serves the base model until an adapter is active). One base serves every
          adapter trained on the same layers.
        - any other path: a folder with peft's adapter_config.json and
          adapter_model.safetensors, which `peft.PeftModel.from_pretrained(torch_model, path)`
          puts on the torch model the ONNX export came from (modules named by the paths the
          exporter recorded).

        Args:
            path: the adapter file, or the folder (created; its files are replaced atomically).
            drop_prefix: for peft, a start to remove from every module path: the attribute a
                wrapper module held the model as when it was exported (e.g. "model.").
            base: with an `.onnx_adapter` path, where to write the adapter-ready base model.

        Returns:
            None; every file is complete once this returns.

        Raises:
            ExportError: the model has no adapters, trains base weights fully besides them
                (an adapter file would lose them), an adapted layer's module is unknown
                (peft) or is a Conv (ONNX Runtime), base is given for peft, or a file cannot
                be written.

        Example:
            >>> trainer.export_adapters("qwen2-lora")   # PeftModel.from_pretrained(model, "qwen2-lora")
            >>> trainer.export_adapters("math.onnx_adapter", base="genai/model.onnx")
        """
        record = read_record(self._model)
        if record is None:
            raise ExportError("the model has no adapters to export: pass adapters=onnxtrain.LoRA(...) to "
                              "make_training_model or finetune")
        factors = {name for entry in record["weights"].values() for name in (entry["A"], entry["B"])}
        initializers = {tensor.name for tensor in self._model.graph.initializer}
        fully = sorted(name for name in self._home if name in initializers and name not in factors)
        if fully:
            raise ExportError(f"besides its adapters the model trains {fully[:5]} fully, which an adapter file "
                              "would leave out; write export(path, training=False, merge=False) (its adapter "
                              "file keeps them) or the merged model")
        with self._store.transaction():
            values = host_copy({name: self._store.values[name] for name in factors})
        if not os.fspath(path).endswith(ONNX_ADAPTER):
            if base is not None:
                raise ExportError(f"base= writes the model ONNX Runtime binds an {ONNX_ADAPTER} file to; "
                                  f"name the adapter file <name>{ONNX_ADAPTER}")
            write_peft_adapter(path, record, values, drop_prefix)
            return
        write_onnx_adapter(path, onnx_adapter_parameters(record, values))
        if base is not None:
            with self._store.transaction():
                state = host_copy({name: value for name, value in self._store.values.items() if name in self._home})
            write_model(self._model, state, self._home, base, None, None,
                        adapter_ready_transform(os.fspath(base), set(self._home)))

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Save every state variable, optimizer slot, hyperparameter and the PRNG key (no pickle)."""
        with self._store.transaction():
            values, key = host_copy(self._store.values), self._store.key
        checkpoint.save_checkpoint(path, values, key, {"model": self._model.graph.name})

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint saved from the same model (by this kind of trainer).

        Raises:
            ModelLoadError: the file is not a checkpoint of this model's state, or its PRNG key
                is of another implementation than this trainer's (nothing is changed then).
        """
        with self._store.transaction():
            # The shapes bound what reading may allocate: a file declaring others is refused unread.
            expected = {name: jax.ShapeDtypeStruct(value.shape, value.dtype)
                        for name, value in self._store.values.items()}
            impl = jax.random.key_impl(self._store.key)
        values, key, _ = checkpoint.load_checkpoint(path, expected)
        saved = jax.random.key_impl(key)
        if saved != impl:
            # Continuing with either key would not resume the saved run's random stream.
            raise ModelLoadError(
                f"checkpoint {str(path)!r} holds a {saved} PRNG key, but this trainer draws from a "
                f"{impl} key; to resume that run, create the trainer with seed= given after "
                f"jax.config.update('jax_default_prng_impl', '{saved}')")
        with self._store.transaction():
            self._store.restore(values, key, f"checkpoint {str(path)!r}")
