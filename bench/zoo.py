"""The zoo (issue 36): every exported model of scripts/export_zoo.py (transformers, timm,
torchvision and small torch models, each by both torch exporters; scikit-learn by skl2onnx),
onnxtrain against torch eager and torch.compile per training step, and against onnxruntime
per forward pass, timed side by side in rounds (bench/paired.py) in one process.

- training step: a Trainer (default nan_policy, so the guarded step) on
  make_training_model(export, loss, output) with its default Adam, fed the zoo's fixed batch
  and labels; torch runs the same function (tests/zoo/zoo_checks.py torch_training_model:
  BatchNorm in train mode, Dropout off as in the export) with the same loss and
  torch.optim.Adam, eagerly and under torch.compile (default mode, compiled before timing);
- forward pass: Trainer.infer (the main graph, compiled) against onnxruntime's
  InferenceSession on the same file;
- first step: cold and warm new processes, as in exported_cnn.py (--first-steps).

Steps take the zoo's fixed batch (4 samples), or with --batch N its samples repeated to N, the
torch model exported again at that size by the same exporter (exporters bake the batch size
in). scikit-learn models have no torch counterpart: their step columns stay empty.

Usage: python bench/zoo.py [--family bert ...] [--exporter dynamo ...] [--rounds 7] [--calls 20]
                           [--batch 4] [--no-compile] [--first-steps] [--exports /tmp/onnxtrain-zoo]
Needs the test extras (torch, torchvision, transformers, timm, scikit-learn, skl2onnx,
onnxruntime).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import run  # noqa: E402
from paired import first_steps, paired, print_table, ratio, torch_compiled_step, torch_step  # noqa: E402

import onnxtrain  # noqa: E402


def _zoo_checks():
    path = Path(__file__).resolve().parents[1] / "tests" / "zoo" / "zoo_checks.py"
    spec = importlib.util.spec_from_file_location("zoo_checks", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["zoo_checks"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


zoo_checks = _zoo_checks()
export_zoo = zoo_checks.export_zoo


def tiled(array: np.ndarray, batch: int) -> np.ndarray:
    """`array`'s samples (axis 0) repeated in turn until there are `batch` of them."""
    return np.take(array, np.arange(batch) % len(array), axis=0)


def exported(zoo, name: str, exporter: str, batch: int) -> Path:
    """The family's export for steps of `batch` samples: the zoo's own at its batch size, else
    the torch model exported again by the same exporter on the zoo's samples repeated
    (scikit-learn exports take any batch)."""
    if batch == export_zoo.BATCH or exporter == "skl2onnx":
        zoo.model(name, exporter)  # writes the zoo's own export on first use
        return zoo.folder / f"{name}-{exporter}.onnx"
    family = export_zoo.FAMILIES[name]
    path = zoo.folder / f"{name}-{exporter}.b{batch}.onnx"
    if not path.exists():
        inputs = {key: tiled(value, batch) for key, value in export_zoo.batch(family).items()}
        path.write_bytes(export_zoo.export_torch(export_zoo.torch_model(family), inputs, exporter, family.output))
    return path


def compare(zoo, name: str, exporter: str, rounds: int, calls: int, compile_torch: bool,
            first: bool, batch: int) -> tuple[dict[str, float | str], str]:
    """One row of the table, and a note (why torch.compile is missing, if it is)."""
    import onnxruntime

    family = export_zoo.FAMILIES[name]
    path = exported(zoo, name, exporter, batch)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    wanted = {value.name for value in session.get_inputs()}
    samples = {key: tiled(value, batch) for key, value in export_zoo.batch(family).items()}
    feeds = {key: value for key, value in samples.items() if key in wanted}
    labels = tiled(zoo.labels(name), batch)
    trainer = onnxtrain.Trainer(onnxtrain.make_training_model(str(path), loss=family.loss,
                                                              output=family.output))
    forwards = paired({"onnxtrain": lambda: jax.block_until_ready(trainer.infer(feeds)),
                       "onnxruntime": lambda: session.run(None, feeds)}, rounds, calls)
    step_feeds = {**feeds, "labels": labels}
    trainer.step(step_feeds)
    steps = {"onnxtrain": lambda: float(trainer.step(step_feeds)["loss"])}
    note = ""
    if not name.startswith("sk_"):
        inputs = list(samples.values())
        steps["torch"] = torch_step(zoo_checks.torch_training_model(family), inputs, labels, family.loss)
        if compile_torch:
            compiled, seconds = torch_compiled_step(zoo_checks.torch_training_model(family), inputs,
                                                    labels, family.loss)
            if compiled is None:
                note = f"torch.compile failed: {seconds}"
            else:
                steps["torch.compile"] = compiled
    seconds = paired(steps, rounds, calls)
    row: dict[str, float | str] = {
        "step ms": statistics.median(seconds["onnxtrain"]) * 1e3,
        "torch ms": statistics.median(seconds["torch"]) * 1e3 if "torch" in seconds else "",
        "step / torch": ratio(seconds, "onnxtrain", "torch") if "torch" in seconds else "",
        "step / compiled": ratio(seconds, "onnxtrain", "torch.compile") if "torch.compile" in seconds else "",
        "forward ms": statistics.median(forwards["onnxtrain"]) * 1e3,
        "forward / ort": ratio(forwards, "onnxtrain", "onnxruntime")}
    if first:
        row.update(first_steps({"path": str(path), "loss": family.loss, "output": family.output}, step_feeds))
    return row, note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", choices=sorted(export_zoo.FAMILIES), help="default: all")
    parser.add_argument("--exporter", action="append", help="default: every exporter of the family")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile")
    parser.add_argument("--first-steps", action="store_true", help="cold and warm first steps (new processes)")
    parser.add_argument("--batch", type=int, default=export_zoo.BATCH,
                        help="samples per step: the zoo's samples repeated, and exported again at that size")
    parser.add_argument("--exports", type=Path, default=Path("/tmp/onnxtrain-zoo"))
    arguments = parser.parse_args()
    arguments.exports.mkdir(parents=True, exist_ok=True)
    zoo = zoo_checks.Zoo(arguments.exports)
    rows, notes = {}, []
    for name, exporter in export_zoo.cases():
        if (arguments.family and name not in arguments.family) or (
                arguments.exporter and exporter not in arguments.exporter):
            continue
        try:
            row, note = compare(zoo, name, exporter, arguments.rounds, arguments.calls, arguments.compile,
                                arguments.first_steps, arguments.batch)
        except onnxtrain.errors.OnnxTrainError as error:  # e.g. an ML-op pipeline with nothing to train
            notes.append(f"{name} ({exporter}): not measured: {str(error).splitlines()[0]}")
            continue
        rows[f"{name} | {exporter}"] = row
        print(f"{name} {exporter}: " + ", ".join(f"{key} {value:.3g}" for key, value in row.items()
                                                 if value != "") + (f"; {note}" if note else ""),
              file=sys.stderr, flush=True)
        if note:
            notes.append(f"{name} ({exporter}): {note}")
    print_table(rows, "model | exporter")
    print(f"batch {arguments.batch} (the zoo's exports have {export_zoo.BATCH}), {arguments.rounds} rounds of "
          f"{arguments.calls} calls per system; {run.machine()}")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
