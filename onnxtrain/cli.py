"""The `onnxtrain` command (also `python -m onnxtrain`).

    onnxtrain demo                      fine-tune the bundled exported CNN on the bundled digits
    onnxtrain inspect MODEL             graphs, opsets, state, hyperparameters, bindings, unsupported ops
    onnxtrain make-training MODEL -o OUT --loss cross_entropy [--optimizer adam --lr 1e-3 --repair R]
    onnxtrain train MODEL --data D.npz -o OUT [--epochs 3 --batch-size 32 --shuffle --lr 1e-3
                    --val-data V.npz --checkpoint C --inference-out SERVE.onnx]
    onnxtrain finetune MODEL --data D.npz --loss cross_entropy -o OUT [--optimizer adamw --lr 1e-3 ...]
    onnxtrain export MODEL [--checkpoint C] -o OUT   (an inference model for ONNX Runtime)
    onnxtrain export MODEL --portable [step] -o OUT  (a training model for stock ONNX Runtime)

Data files are .npz archives with one array per step input (e.g. x and labels), samples on
axis 0; `train` and `finetune` cut them into batches here, with numpy. `--help` on any command
shows its options and their defaults. Errors print one line and exit with status 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from onnxtrain import optim
from onnxtrain.errors import InputError, OnnxTrainError
from onnxtrain._io.model import load_model, save_model
from onnxtrain._io.summary import describe, optimizer_nodes
from onnxtrain._portable.manifest import MANIFEST_KEY, StepManifest
from onnxtrain._recipe.damage import REPAIRS, detect
from onnxtrain._recipe.losses import BUILT_IN
from onnxtrain.proto import ModelProto

DEMO_MODEL = "mlp_classifier.onnx"
FINETUNE_DEMO_MODEL = "digits_cnn.onnx"
OPTIMIZERS = tuple(optim.OPTIMIZERS)
# finetune's optimizers are optax's, under the same names.
OPTAX_OPTIMIZERS = OPTIMIZERS
LOSSES = tuple(BUILT_IN)
Batch = dict[str, np.ndarray]
# A list of batches, or a function returning the next epoch's (shuffled) list.
Batches = list[Batch] | Callable[[], list[Batch]]


def demo_model_path() -> Path:
    """The bundled training model (a classifier that carries its own Adam training recipe)."""
    return Path(str(resources.files("onnxtrain") / "models" / DEMO_MODEL))


def _demo(arguments: argparse.Namespace) -> int:
    from onnxtrain.demo import finetune_demo

    path = Path(str(resources.files("onnxtrain") / "models" / FINETUNE_DEMO_MODEL))
    print("onnxtrain demo: fine-tune a model exported by PyTorch, then serve it with ONNX Runtime\n")
    finetune_demo(path, out_dir=arguments.out, progress=not arguments.quiet)
    return 0


def _inspect(arguments: argparse.Namespace) -> int:
    model = load_model(arguments.model)
    print(describe(model))
    manifest = next((p.value for p in model.metadata_props if p.key == MANIFEST_KEY), None)
    if manifest is not None:
        print("\n".join(StepManifest.from_json(manifest).describe()))
    if not model.training_info:
        print(_trainable_section(model))
    findings = detect(model)
    if findings:
        print("export damage (make_training_model and finetune take repair=):")
        print("\n".join(f"  {'note' if f.note else 'warning'}: {f.text()}" for f in findings))
    return 0


def _trainable_section(model) -> str:
    """What make_training_model and finetune would train by default, and what they leave out."""
    from onnxtrain._recipe.trainable import trainable_set

    chosen = trainable_set(model)
    total = len(chosen.weights) + len(chosen.left_out)
    lines = [f"default trainable set: {len(chosen.weights)} of {total} float initializers"
             + ("; left out:" if chosen.left_out else "")]
    lines += [f"    {name}: {reason}" for name, reason in chosen.left_out.items()]
    if chosen.left_out:
        lines.append("  to train one anyway: trainable=[*onnxtrain.default_trainable(model).weights, NAME]")
    return "\n".join(lines)


def _make_training(arguments: argparse.Namespace) -> int:
    from onnxtrain._recipe.builder import make_training_model

    optimizer = optim.get(arguments.optimizer, lr=arguments.lr)
    model = make_training_model(arguments.model, loss=arguments.loss, output=arguments.output,
                                optimizer=optimizer, trainable=arguments.trainable, label=arguments.label,
                                ignore_index=arguments.ignore_index,
                                freeze_batchnorm=arguments.freeze_batchnorm, repair=arguments.repair,
                                adapters=_lora(arguments))
    save_model(model, arguments.out)
    print(f"wrote {arguments.out}: {optimizer.op_type} on {len(model.training_info[0].update_binding)} "
          f"state variables, label input {arguments.label!r}")
    return 0


def _lora(arguments: argparse.Namespace) -> Any:
    """The LoRA the --lora-* options ask for, or None."""
    if arguments.lora_rank is None:
        if arguments.lora_alpha is not None or arguments.lora_targets:
            raise InputError("--lora-alpha and --lora-targets need --lora-rank")
        return None
    from onnxtrain.adapters import LoRA

    alpha = 2.0 * arguments.lora_rank if arguments.lora_alpha is None else arguments.lora_alpha
    return LoRA(arguments.lora_rank, alpha, targets=arguments.lora_targets or None)


def _arrays(path: Path, names: list[str], option: str) -> dict[str, np.ndarray]:
    """The arrays `names` of an .npz file, checked to hold the same number of samples."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError) as error:
        raise InputError(f"{option}: cannot read data file {str(path)!r}: {error}") from None
    missing = [name for name in names if name not in arrays]
    if missing:
        raise InputError(f"{option}: data file {str(path)!r} has arrays {sorted(arrays)}; the training step "
                         f"needs {names} (missing {missing})")
    counts = {name: len(arrays[name]) if arrays[name].ndim else None for name in names}
    if len(set(counts.values())) != 1 or None in counts.values():
        raise InputError(f"{option}: the arrays of {str(path)!r} must hold the same number of samples on "
                         f"axis 0; got {counts}")
    return {name: arrays[name] for name in names}


def _batches(arrays: dict[str, np.ndarray], size: int, shuffle: bool, seed: int) -> Batches:
    """Batches of `size` samples: in file order, or (shuffle) in a new seeded order each epoch."""
    if size < 1:
        raise InputError(f"--batch-size must be at least 1, got {size}")
    count = len(next(iter(arrays.values())))
    if count == 0:
        raise InputError("the data file holds no samples")

    def split(order: np.ndarray) -> list[Batch]:
        return [{name: array[order[start:start + size]] for name, array in arrays.items()}
                for start in range(0, count, size)]

    if not shuffle:
        return [{name: array[start:start + size] for name, array in arrays.items()}
                for start in range(0, count, size)]
    generator = np.random.default_rng(seed)
    return lambda: split(generator.permutation(count))


def _data(arguments: argparse.Namespace, names: list[str]) -> tuple[Batches, Batches | None]:
    """The training batches and the validation batches (--val-data) the step inputs `names` need."""
    seed = 0 if arguments.seed is None else arguments.seed
    batches = _batches(_arrays(arguments.data, names, "--data"), arguments.batch_size, arguments.shuffle, seed)
    validation = None
    if arguments.val_data:
        validation = _batches(_arrays(arguments.val_data, names, "--val-data"), arguments.batch_size, False, seed)
    return batches, validation


def _checkpoint_every_epoch(trainer: Any, path: Path | None) -> list:
    """A fit callback saving a checkpoint to `path` after every epoch (none without a path)."""
    if path is None:
        return []

    def save(epoch: int, logs: dict[str, float]) -> None:
        trainer.save_checkpoint(path)

    return [save]


def _print_history(history: dict[str, list[float]]) -> None:
    # Per-epoch values only (history["step_*"] holds each step's).
    for name, values in history.items():
        if not name.startswith("step_"):
            print(f"{name}: " + " -> ".join(f"{value:.4g}" for value in values))


def _learning_rate_variable(model: ModelProto, algorithm: int, state: Mapping[str, Any]) -> str:
    """The variable holding the learning rate of training_info[algorithm]'s optimizer: the float
    scalar of `state` (state variables and hyperparameters) its R input reads, directly or
    through nodes computing from it (a schedule)."""
    if not 0 <= algorithm < len(model.training_info):
        raise InputError(f"--algorithm {algorithm}: the model has {len(model.training_info)} TrainingInfoProto(s)")
    info = model.training_info[algorithm]
    optimizers = optimizer_nodes(info)
    if not optimizers:
        raise InputError("--lr: training_info has no Adam, Adagrad or Momentum node whose learning rate "
                         "could be set; leave --lr out")
    producers = {name: item for item in info.algorithm.node for name in item.output}
    names = set(state)  # a Mapping's `in` would read (copy) the value
    reached: list[str] = []
    for _, rate, _ in optimizers:
        pending, seen = [rate], {rate}
        while pending:
            name = pending.pop()
            if name in names:
                reached.append(name)
                continue
            for source in getattr(producers.get(name), "input", []):
                if source and source not in seen:
                    seen.add(source)
                    pending.append(source)
    # Only the few variables reached are read (a step counter is reached too, and is an integer).
    found = [name for name in dict.fromkeys(reached)
             if np.asarray(state[name]).dtype.kind == "f" and np.size(state[name]) == 1]
    if len(found) != 1:
        raise InputError(f"--lr: cannot tell which variable is the learning rate (found {found or 'none'} "
                         "feeding the optimizer's learning-rate input); leave --lr out and set it with "
                         "Trainer.set_state")
    return found[0]


class _Variables(Mapping):
    """A trainer's state variables and hyperparameters (what set_state changes), by name;
    reading one copies that one only."""

    def __init__(self, trainer: Any):
        self._state, self._hyperparameters = trainer.state, trainer.hyperparameters
        self._names = {**dict.fromkeys(trainer.state_names, self._state),
                       **dict.fromkeys(trainer.hyperparameter_names, self._hyperparameters)}

    def __getitem__(self, name: str) -> Any:
        return self._names[name][name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _train(arguments: argparse.Namespace) -> int:
    from onnxtrain.trainer import Trainer

    model = load_model(arguments.model)
    trainer = Trainer(model, seed=arguments.seed)
    if arguments.initialize:
        trainer.initialize()
    if arguments.lr is not None:
        # After initialize(): the initialization graph resets the learning rate to the recipe's.
        variables = _Variables(trainer)
        name = _learning_rate_variable(model, arguments.algorithm, variables)
        trainer.set_state(name, np.asarray(arguments.lr, np.asarray(variables[name]).dtype))
    batches, validation = _data(arguments, trainer.step_inputs(arguments.algorithm))
    history = trainer.fit(batches, epochs=arguments.epochs, algorithm=arguments.algorithm,
                          progress=not arguments.quiet, eval_data=validation,
                          callbacks=_checkpoint_every_epoch(trainer, arguments.checkpoint))
    trainer.export(arguments.out, training=True)
    if arguments.inference_out:
        trainer.export(arguments.inference_out, training=False)
    _print_history(history)
    written = [str(arguments.out), *filter(None, [arguments.inference_out, arguments.checkpoint])]
    print(f"wrote {', '.join(map(str, written))}")
    return 0


def _compile(arguments: argparse.Namespace) -> int:
    import time

    from onnxtrain._engine.compilation_cache import executable_cache
    from onnxtrain.trainer import Trainer

    trainer = Trainer(load_model(arguments.model))
    names = trainer.step_inputs(arguments.algorithm)
    batches = _batches(_arrays(arguments.data, names, "--data"), arguments.batch_size, False, 0)
    # The full batch, and the short last one `train` would also run.
    shapes = {tuple(array.shape for array in batch.values()): batch for batch in (batches[0], batches[-1])}
    start = time.perf_counter()
    compiled = trainer.compile(list(shapes.values()), arguments.algorithm)
    cache = executable_cache()
    where = f"kept in {cache.folder}" if cache is not None else "not kept: the executable cache is off"
    print(f"{compiled} programs compiled in {time.perf_counter() - start:.1f} s for {len(shapes)} batch "
          f"shape(s), {trainer.compilations - compiled} found in the cache; {where}")
    return 0


def _optax_optimizer(name: str, lr: float) -> Any:
    import optax

    return {"adam": lambda: optax.adam(lr), "adamw": lambda: optax.adamw(lr), "sgd": lambda: optax.sgd(lr),
            "momentum": lambda: optax.sgd(lr, momentum=0.9), "adagrad": lambda: optax.adagrad(lr)}[name]()


def _finetune(arguments: argparse.Namespace) -> int:
    from onnxtrain.finetune import finetune

    tuner = finetune(arguments.model, arguments.loss, _optax_optimizer(arguments.optimizer, arguments.lr),
                     output=arguments.output, trainable=arguments.trainable, label=arguments.label,
                     ignore_index=arguments.ignore_index, seed=0 if arguments.seed is None else arguments.seed,
                     freeze_batchnorm=arguments.freeze_batchnorm, repair=arguments.repair,
                     adapters=_lora(arguments))
    batches, validation = _data(arguments, tuner.step_inputs())
    history = tuner.fit(batches, epochs=arguments.epochs, progress=not arguments.quiet, eval_data=validation,
                        callbacks=_checkpoint_every_epoch(tuner, arguments.checkpoint))
    tuner.export(arguments.out)
    _print_history(history)
    written = [str(arguments.out), *filter(None, [arguments.checkpoint])]
    print(f"wrote {', '.join(map(str, written))} (inference model, fine-tuned with {arguments.optimizer})")
    return 0


def _export(arguments: argparse.Namespace) -> int:
    from onnxtrain.trainer import Trainer

    trainer = Trainer(arguments.model)
    if arguments.checkpoint:
        trainer.load_checkpoint(arguments.checkpoint)
    if arguments.portable == "step":
        trainer.export(arguments.out, portable="step")
        print(f"wrote {arguments.out} (step model in standard ops: feed the state back each step; "
              "`onnxtrain inspect` shows the manifest)")
    elif arguments.portable:
        trainer.export(arguments.out, portable=True)
        print(f"wrote {arguments.out} (training model, training_info in standard ops)")
    else:
        trainer.export(arguments.out, training=False)
        print(f"wrote {arguments.out} (inference model, no training_info)")
    return 0


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each option's default, except where there is none to show (None, off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _command(commands: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    return commands.add_parser(name, help=help_text, description=help_text, formatter_class=_Formatter)


def _recipe_options(command: argparse.ArgumentParser) -> None:
    """The options make-training and finetune share: what to optimize, against which label."""
    command.add_argument("--loss", required=True, choices=LOSSES,
                         help="the loss (required: cross_entropy for class indices, causal_lm for a "
                              "language model's next token, mse/l1 for values, bce_with_logits for 0/1 "
                              "targets)")
    command.add_argument("--output", help="the model output the loss reads (none: the first)")
    command.add_argument("--label", default="labels", help="name of the label input")
    command.add_argument("--trainable", action="append",
                         help="train this initializer only (exact name, repeatable; none: every weight)")
    command.add_argument("--ignore-index", type=int,
                         help="cross_entropy only: a label value that counts for nothing (e.g. -100)")
    command.add_argument("--freeze-batchnorm", action="store_true", help="keep BatchNorm statistics fixed")
    command.add_argument("--repair", action="append", choices=(*REPAIRS, "all"),
                         help="undo export damage `inspect` lists (repeatable)")
    command.add_argument("--lora-rank", type=int, help="train LoRA adapters of this rank instead of the weights")
    command.add_argument("--lora-alpha", type=float, help="LoRA's alpha (the branch is scaled by alpha/rank; "
                                                          "none: 2 x rank)")
    command.add_argument("--lora-targets", action="append",
                         help="adapt these layers (a module name as peft's target_modules, e.g. q_proj, or "
                              "an fnmatch pattern over module paths and weight names; repeatable; none: "
                              "every linear layer but the embeddings and the head)")


def _fit_options(command: argparse.ArgumentParser) -> None:
    """The options train and finetune share: the data and the loop."""
    command.add_argument("--data", required=True, type=Path,
                         help=".npz with one array per step input (e.g. x and labels), samples on axis 0")
    command.add_argument("--val-data", type=Path,
                         help=".npz like --data, whose mean outputs (e.g. val_loss) are reported after every epoch")
    command.add_argument("--epochs", type=int, default=1, help="passes over the data")
    command.add_argument("--batch-size", type=int, default=32, help="samples per step")
    command.add_argument("--shuffle", action="store_true", help="a new sample order every epoch (seeded by --seed)")
    command.add_argument("--seed", type=int, help="the PRNG seed (Dropout, initialization, shuffling)")
    command.add_argument("--checkpoint", type=Path,
                         help="save a checkpoint here after every epoch (the last one is the final state)")
    command.add_argument("--quiet", action="store_true", help="no progress bar")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onnxtrain", description="Train ONNX models.", formatter_class=_Formatter)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = _command(commands, "demo", "fine-tune the bundled model and export it")
    demo.add_argument("--out", type=Path, help="folder for the exported model (none: a new temporary one)")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.set_defaults(run=_demo)
    inspect = _command(commands, "inspect", "print the outline of an ONNX model: graphs, state, hyperparameters, "
                                            "default trainable set, export damage")
    inspect.add_argument("model", help="path to an .onnx file")
    inspect.set_defaults(run=_inspect)
    make = _command(commands, "make-training", "add a standard training recipe to an inference model")
    make.add_argument("model", help="the inference model (.onnx)")
    make.add_argument("-o", "--out", required=True, type=Path, help="the training model to write")
    make.add_argument("--optimizer", default="adam", choices=OPTIMIZERS, help="the recipe's ONNX optimizer")
    make.add_argument("--lr", type=float, default=1e-3, help="the learning rate (a state variable of the recipe)")
    _recipe_options(make)
    make.set_defaults(run=_make_training)
    train = _command(commands, "train", "run a training model's recipe over data in an .npz file")
    train.add_argument("model", help="a training model (with training_info)")
    _fit_options(train)
    train.add_argument("--lr", type=float, help="set the recipe's learning rate (default: the model's own)")
    train.add_argument("--algorithm", type=int, default=0, help="which TrainingInfoProto to run")
    train.add_argument("--initialize", action="store_true", help="run the initialization graphs first")
    train.add_argument("-o", "--out", required=True, type=Path, help="the trained training model")
    train.add_argument("--inference-out", type=Path, help="also write an inference model here")
    train.set_defaults(run=_train)
    warm = _command(commands, "compile", "compile a training model's programs for the batches of an .npz file "
                                         "ahead of `train`, into the executable cache")
    warm.add_argument("model", help="a training model (with training_info)")
    warm.add_argument("--data", required=True, type=Path,
                      help=".npz file with one array per step input (its shapes are what counts)")
    warm.add_argument("--batch-size", type=int, default=32, help="samples per step, as `train` takes it")
    warm.add_argument("--algorithm", type=int, default=0, help="which TrainingInfoProto")
    warm.set_defaults(run=_compile)
    tune = _command(commands, "finetune", "fine-tune an inference model with an optax optimizer and write the "
                                          "fine-tuned inference model")
    tune.add_argument("model", help="the inference model (.onnx)")
    _fit_options(tune)
    _recipe_options(tune)
    tune.add_argument("--optimizer", default="adam", choices=OPTAX_OPTIMIZERS,
                      help="the optax optimizer (momentum: sgd with momentum 0.9)")
    tune.add_argument("--lr", type=float, default=1e-3, help="the learning rate")
    tune.add_argument("-o", "--out", required=True, type=Path, help="the fine-tuned inference model")
    tune.set_defaults(run=_finetune)
    export = _command(commands, "export", "write a training model's inference model")
    export.add_argument("model", help="a training model (with training_info)")
    export.add_argument("--checkpoint", type=Path, help="restore this checkpoint first")
    export.add_argument("-o", "--out", required=True, type=Path, help="the model to write")
    export.add_argument("--portable", nargs="?", const="training_info", choices=("training_info", "step"),
                        help="write a training model in standard ONNX ops instead: training_info "
                             "(the default) keeps the recipe's bindings; step writes a plain step model "
                             "for runtimes without training_info (examples/portable_ort.py)")
    export.set_defaults(run=_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    arguments = _parser().parse_args(argv)
    try:
        return arguments.run(arguments)
    except OnnxTrainError as error:
        print(f"onnxtrain: {error}", file=sys.stderr)
        return 1
