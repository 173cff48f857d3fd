"""The `onnxtrain` command (also `python -m onnxtrain`).

    onnxtrain demo                      fine-tune the bundled exported CNN on the bundled digits
    onnxtrain inspect MODEL             graphs, opsets, state, bindings, unsupported ops
    onnxtrain make-training MODEL -o OUT --loss cross_entropy --optimizer adam --lr 1e-3 [--repair R]
    onnxtrain train MODEL --data D.npz --epochs 3 -o OUT [--inference-out SERVE.onnx]
    onnxtrain export MODEL [--checkpoint C] -o OUT   (an inference model for ONNX Runtime)

Errors print one line and exit with status 1.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

import numpy as np

from onnxtrain.errors import InputError, OnnxTrainError
from onnxtrain._io.model import load_model, save_model
from onnxtrain._io.summary import describe
from onnxtrain._recipe.damage import REPAIRS, detect

DEMO_MODEL = "mlp_classifier.onnx"
FINETUNE_DEMO_MODEL = "digits_cnn.onnx"
OPTIMIZERS = ("adam", "momentum", "sgd", "adagrad")


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
    return "\n".join(lines)


def _make_training(arguments: argparse.Namespace) -> int:
    from onnxtrain import optim
    from onnxtrain._recipe.builder import make_training_model

    optimizer = {"adam": optim.Adam, "momentum": optim.Momentum, "sgd": optim.SGD,
                 "adagrad": optim.Adagrad}[arguments.optimizer](lr=arguments.lr)
    model = make_training_model(arguments.model, loss=arguments.loss, output=arguments.output,
                                optimizer=optimizer, label=arguments.label,
                                freeze_batchnorm=arguments.freeze_batchnorm, repair=arguments.repair)
    save_model(model, arguments.out)
    print(f"wrote {arguments.out}: {optimizer.op_type} on {len(model.training_info[0].update_binding)} "
          f"state variables, label input {arguments.label!r}")
    return 0


def _batches(path: Path, names: list[str], size: int) -> list[dict[str, np.ndarray]]:
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError) as error:
        raise InputError(f"cannot read data file {str(path)!r}: {error}") from None
    missing = [name for name in names if name not in arrays]
    if missing:
        raise InputError(f"data file {str(path)!r} has arrays {sorted(arrays)}; the training step "
                         f"needs {names} (missing {missing})")
    count = len(arrays[names[0]])
    return [{name: arrays[name][start:start + size] for name in names} for start in range(0, count, size)]


def _train(arguments: argparse.Namespace) -> int:
    from onnxtrain.trainer import Trainer

    trainer = Trainer(arguments.model, seed=arguments.seed)
    if arguments.initialize:
        trainer.initialize()
    names = trainer.step_inputs(arguments.algorithm)
    batches = _batches(arguments.data, names, arguments.batch_size)
    history = trainer.fit(batches, epochs=arguments.epochs, algorithm=arguments.algorithm,
                          progress=not arguments.quiet)
    trainer.export(arguments.out, training=True)
    if arguments.inference_out:
        trainer.export(arguments.inference_out, training=False)
    # Per-epoch values only (history["step_*"] holds each step's).
    for name, values in history.items():
        if not name.startswith("step_"):
            print(f"{name}: " + " -> ".join(f"{value:.4g}" for value in values))
    print(f"wrote {arguments.out}" + (f" and {arguments.inference_out}" if arguments.inference_out else ""))
    return 0


def _export(arguments: argparse.Namespace) -> int:
    from onnxtrain.trainer import Trainer

    trainer = Trainer(arguments.model)
    if arguments.checkpoint:
        trainer.load_checkpoint(arguments.checkpoint)
    trainer.export(arguments.out, training=False)
    print(f"wrote {arguments.out} (inference model, no training_info)")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onnxtrain", description="Train ONNX models.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="fine-tune the bundled model and export it")
    demo.add_argument("--out", type=Path, help="folder for the exported model (default: a new temporary one)")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.set_defaults(run=_demo)
    for name in ("inspect", "info"):
        inspect = commands.add_parser(name, help="print the outline of an ONNX model")
        inspect.add_argument("model", help="path to an .onnx file")
        inspect.set_defaults(run=_inspect)
    make = commands.add_parser("make-training", help="add a standard training recipe to an inference model")
    make.add_argument("model")
    make.add_argument("-o", "--out", required=True, type=Path)
    make.add_argument("--loss", default="cross_entropy",
                      choices=("mse", "l1", "cross_entropy", "bce_with_logits"))
    make.add_argument("--optimizer", default="adam", choices=OPTIMIZERS)
    make.add_argument("--lr", type=float, default=1e-3)
    make.add_argument("--output", help="the model output the loss reads (default: the first)")
    make.add_argument("--label", default="labels", help="name of the label input (default: labels)")
    make.add_argument("--freeze-batchnorm", action="store_true", help="keep BatchNorm statistics fixed")
    make.add_argument("--repair", action="append", choices=(*REPAIRS, "all"),
                      help="undo export damage `inspect` lists (repeatable)")
    make.set_defaults(run=_make_training)
    train = commands.add_parser("train", help="run a training model's recipe over data in an .npz file")
    train.add_argument("model")
    train.add_argument("--data", required=True, type=Path,
                       help=".npz with one array per step input (e.g. X and labels), batch on axis 0")
    train.add_argument("--epochs", type=int, default=1)
    train.add_argument("--batch-size", type=int, default=32)
    train.add_argument("--algorithm", type=int, default=0)
    train.add_argument("--initialize", action="store_true", help="run the initialization graphs first")
    train.add_argument("--seed", type=int)
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument("-o", "--out", required=True, type=Path, help="the trained training model")
    train.add_argument("--inference-out", type=Path, help="also write an inference model here")
    train.set_defaults(run=_train)
    export = commands.add_parser("export", help="write a training model's inference model")
    export.add_argument("model")
    export.add_argument("--checkpoint", type=Path, help="restore this checkpoint first")
    export.add_argument("-o", "--out", required=True, type=Path)
    export.set_defaults(run=_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    arguments = _parser().parse_args(argv)
    try:
        return arguments.run(arguments)
    except OnnxTrainError as error:
        print(f"onnxtrain: {error}", file=sys.stderr)
        return 1
