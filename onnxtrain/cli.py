"""The `onnxtrain` command (also `python -m onnxtrain`)."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from onnxtrain.errors import OnnxTrainError
from onnxtrain.model import load_model
from onnxtrain.summary import describe

DEMO_MODEL = "mlp_classifier.onnx"


def demo_model_path() -> Path:
    """The bundled demo model (a classifier that carries its own Adam training recipe)."""
    return Path(str(resources.files("onnxtrain") / "models" / DEMO_MODEL))


def _demo(arguments: argparse.Namespace) -> int:
    from onnxtrain.demo import train_demo

    path = demo_model_path()
    print(f"onnxtrain demo: the bundled model {path.name}\n")
    print(describe(load_model(path)))
    print()
    train_demo(path, out_dir=arguments.out)
    return 0


def _info(arguments: argparse.Namespace) -> int:
    print(describe(load_model(arguments.model)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="onnxtrain", description="Train ONNX models.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train the bundled model with its own recipe and export it")
    demo.add_argument("--out", type=Path, help="folder for the exported model (default: a new temporary one)")
    demo.set_defaults(run=_demo)
    info = commands.add_parser("info", help="print the outline of an ONNX model")
    info.add_argument("model", help="path to an .onnx file")
    info.set_defaults(run=_info)
    arguments = parser.parse_args(argv)
    try:
        return arguments.run(arguments)
    except OnnxTrainError as error:
        print(f"onnxtrain: {error}", file=sys.stderr)
        return 1
