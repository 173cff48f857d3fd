"""Start-up (issue 60): how long a new process takes from `import onnxtrain` to its first
training step's loss (bench/systems/first_step.py: make_training_model, Trainer, one step),
beside torch eager's first step on the same model.

Each model runs in three new processes, one after the other, sharing one cache folder:
- cold: empty caches;
- warm: the caches the cold run filled (onnxtrain's executable cache and JAX's);
- warm, JAX's cache only: ONNXTRAIN_EXECUTABLE_CACHE=off in a folder whose JAX cache holds
  the programs (the start-up before the executable cache, measured in the same session).
torch eager's first step (in ms) is timed in this process on the model just built (forward,
backward and an Adam step; import and model construction not counted).

Models: the zoo's exports (scripts/export_zoo.py, batch 4), BERT-style encoders (hidden
128, 2 / 12 / 24 layers, batch 8 x 64 tokens) exported by torch.onnx's dynamo exporter with
its defaults, as users export them, and on request full-size torchvision models as
bench/exported_cnn.py exports them.

Usage: python bench/startup.py [--family bert ...] [--exporter dynamo ...] [--encoder-layers 2 12 24]
                               [--no-zoo] [--exports /tmp/onnxtrain-zoo]
                               [--torchvision resnet18 convnext_tiny ... [--torchvision-batch 4]]
Needs the test extras (torch, transformers, timm, torchvision, onnxscript).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import run  # noqa: E402
from paired import print_table, torch_step  # noqa: E402
from zoo import exported, export_zoo, zoo_checks  # noqa: E402

ENCODER_BATCH, ENCODER_LENGTH, ENCODER_HIDDEN = 8, 64, 128


def starts(job: dict, feeds: dict[str, np.ndarray]) -> dict[str, float]:
    """Seconds to the first step's loss in new processes: cold, warm, and warm with JAX's cache only."""
    seconds = {}
    with tempfile.TemporaryDirectory(prefix="onnxtrain-startup-") as folder:
        path = Path(folder) / "feeds.npz"
        np.savez(path, **feeds)
        runs = {"cold s": (Path(folder) / "both", {}),
                "warm s": (Path(folder) / "both", {}),
                # JAX's cache filled by a run of its own, then read with the executable cache off.
                "_fill": (Path(folder) / "jax", {"ONNXTRAIN_EXECUTABLE_CACHE": "off"}),
                "warm, JAX cache only s": (Path(folder) / "jax", {"ONNXTRAIN_EXECUTABLE_CACHE": "off"})}
        for column, (cache, env) in runs.items():
            result = run.run_script(Path(sys.executable), "first_step.py", {**job, "feeds": str(path)},
                                    {"ONNXTRAIN_COMPILATION_CACHE": str(cache), **env})
            if "unavailable" in result:
                raise RuntimeError(f"{job['path']}, {column}: {result['unavailable']}")
            if not column.startswith("_"):
                seconds[column] = result["first_step_s"]
    return seconds


def torch_first_step(model, inputs: list[np.ndarray], labels: np.ndarray, loss: str) -> float:
    step = torch_step(model, inputs, labels, loss)
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def zoo_rows(families: list[str] | None, exporters: list[str] | None, folder: Path) -> dict[str, dict]:
    zoo = zoo_checks.Zoo(folder)
    rows = {}
    for name, exporter in export_zoo.cases():
        if (families and name not in families) or (exporters and exporter not in exporters):
            continue
        family = export_zoo.FAMILIES[name]
        try:
            path = exported(zoo, name, exporter, export_zoo.BATCH)
        except Exception as error:  # noqa: BLE001 - a family whose exporter fails is noted, not fatal
            print(f"{name} ({exporter}): not measured: {str(error).splitlines()[0]}", file=sys.stderr)
            continue
        import onnx

        wanted = {value.name for value in onnx.load(str(path), load_external_data=False).graph.input}
        samples = export_zoo.batch(family)
        feeds = {key: value for key, value in samples.items() if key in wanted}
        labels = zoo.labels(name)
        try:
            row = starts({"path": str(path), "loss": family.loss, "output": family.output},
                         {**feeds, "labels": labels})
        except RuntimeError as error:   # e.g. a scikit-learn export with nothing to train
            print(f"{name} ({exporter}): not measured: {error}", file=sys.stderr)
            continue
        if not name.startswith("sk_"):
            row["torch first step ms"] = 1e3 * torch_first_step(zoo_checks.torch_training_model(family),
                                                         list(samples.values()), labels, family.loss)
        rows[f"{name} | {exporter}"] = row
        print(f"{name} | {exporter}: {row}", file=sys.stderr)
    return rows


def encoder(layers: int):
    """A BERT-style classifier (eval mode: Dropout off, as exported) returning its logits."""
    import torch
    import transformers

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=1000, hidden_size=ENCODER_HIDDEN, num_hidden_layers=layers,
                                     num_attention_heads=2, intermediate_size=4 * ENCODER_HIDDEN,
                                     max_position_embeddings=ENCODER_LENGTH, num_labels=2)
    return Logits(transformers.BertForSequenceClassification(config)).eval()


def encoder_export(layers: int, folder: Path) -> Path:
    """The encoder of `layers` layers exported by dynamo with its defaults (made once)."""
    import torch

    path = folder / f"bert-encoder-{layers}.onnx"
    if not path.exists():
        ids = torch.zeros((ENCODER_BATCH, ENCODER_LENGTH), dtype=torch.int64)
        torch.onnx.export(encoder(layers), (ids, torch.ones_like(ids)), str(path), dynamo=True,
                          input_names=["input_ids", "attention_mask"], output_names=["logits"])
    return path


def encoder_rows(depths: list[int], folder: Path) -> dict[str, dict]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, (ENCODER_BATCH, ENCODER_LENGTH)).astype(np.int64)
    mask = np.ones_like(ids)
    labels = rng.integers(0, 2, ENCODER_BATCH).astype(np.int64)
    rows = {}
    for layers in depths:
        path = encoder_export(layers, folder)
        row = starts({"path": str(path), "loss": "cross_entropy", "output": "logits"},
                     {"input_ids": ids, "attention_mask": mask, "labels": labels})
        row["torch first step ms"] = 1e3 * torch_first_step(encoder(layers), [ids, mask], labels, "cross_entropy")
        rows[f"BERT-style encoder, {layers} layers | dynamo"] = row
        print(f"encoder {layers}: {row}", file=sys.stderr)
    return rows


def torchvision_rows(names: list[str], batch: int, folder: Path) -> dict[str, dict]:
    """Full-size torchvision models (random weights, 3x64x64 images, 1000 classes) exported by
    dynamo, as bench/exported_cnn.py exports them."""
    from exported_cnn import CLASSES, export

    rng = np.random.default_rng(0)
    images = rng.normal(size=(batch, 3, 64, 64)).astype(np.float32)
    labels = rng.integers(0, CLASSES, batch).astype(np.int64)
    rows = {}
    for name in names:
        path, model = export(name, batch, 64, folder / "torchvision")
        input_name = onnx_input(path)
        row = starts({"path": str(path), "loss": "cross_entropy", "output": None},
                     {input_name: images, "labels": labels})
        row["torch first step ms"] = 1e3 * torch_first_step(model.train(), [images], labels, "cross_entropy")
        rows[f"{name} (full size) batch {batch} | dynamo"] = row
        print(f"{name}: {row}", file=sys.stderr)
    return rows


def onnx_input(path: Path) -> str:
    import onnx

    return onnx.load(str(path), load_external_data=False).graph.input[0].name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", choices=sorted(export_zoo.FAMILIES), help="default: all")
    parser.add_argument("--exporter", action="append", help="default: every exporter of the family")
    parser.add_argument("--encoder-layers", type=int, nargs="*", default=[2, 12, 24])
    parser.add_argument("--no-zoo", dest="zoo", action="store_false")
    parser.add_argument("--torchvision", nargs="*", default=[], metavar="NAME",
                        help="full-size torchvision models too, e.g. resnet18 convnext_tiny (none by default)")
    parser.add_argument("--torchvision-batch", type=int, default=4)
    parser.add_argument("--exports", type=Path, default=Path("/tmp/onnxtrain-zoo"))
    arguments = parser.parse_args()
    arguments.exports.mkdir(parents=True, exist_ok=True)
    rows = encoder_rows(arguments.encoder_layers, arguments.exports)
    if arguments.zoo:
        rows.update(zoo_rows(arguments.family, arguments.exporter, arguments.exports))
    rows.update(torchvision_rows(arguments.torchvision, arguments.torchvision_batch, arguments.exports))
    print_table(rows, "model | exporter")


if __name__ == "__main__":
    main()
