"""Exported CNNs (issue 36): onnxtrain against torch eager per training step, and against
onnxruntime per forward pass, paired in one process.

Each torchvision model (random weights) is exported with torch.onnx.export(dynamo=True), which
folds BatchNorm into the convolutions, so every Conv carries a bias. The systems, timed
side by side in rounds (bench/paired.py):

- training step: Trainer on make_training_model(model, loss="cross_entropy") (Adam) against
  the torchvision model in train mode with torch.optim.Adam (forward, cross entropy,
  backward, update), eagerly and under torch.compile (default mode; --no-compile skips it);
- forward pass: Trainer.infer (the main graph, compiled) against onnxruntime's
  InferenceSession on the same file, and torch eager under no_grad;
- first step: a new process from `import onnxtrain` to the first step's loss
  (bench/systems/first_step.py), cold with an empty compilation cache, then warm in another
  new process with the cache the cold one filled.

Usage: python bench/exported_cnn.py [--models resnet18,regnet_y_400mf,convnext_tiny,...]
                                    [--batch 4] [--size 64] [--rounds 7] [--calls 5]
                                    [--cache /tmp/onnxtrain-exported-cnn] [--no-compile]
Needs torch, torchvision and onnxruntime.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import run  # noqa: E402
from paired import first_steps, paired, print_table, ratio, torch_compiled_step, torch_step  # noqa: E402

import onnxtrain  # noqa: E402

MODELS = ("resnet18", "regnet_y_400mf", "convnext_tiny", "mobilenet_v3_large", "efficientnet_b0",
          "shufflenet_v2_x1_0", "squeezenet1_1", "resnext50_32x4d")
CLASSES = 1000


def export(name: str, batch: int, size: int, cache: Path) -> tuple[Path, object]:
    """(the ONNX file, the torch model it was exported from), both with the same weights."""
    import torch
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None)
    path = cache / f"{name}_b{batch}_{size}.onnx"
    weights = cache / f"{name}_b{batch}_{size}.pt"
    if path.exists() and weights.exists():
        model.load_state_dict(torch.load(weights))
    else:
        cache.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), weights)
        model.eval()
        torch.onnx.export(model, (torch.randn(batch, 3, size, size),), str(path), dynamo=True,
                          external_data=False, verbose=False)
    return path, model


def compare(name: str, batch_size: int, size: int, rounds: int, calls: int, cache: Path,
            compile_torch: bool) -> dict[str, float | str]:
    import onnxruntime
    import torch

    path, model = export(name, batch_size, size, cache)
    generator = np.random.default_rng(0)
    x = generator.standard_normal((batch_size, 3, size, size)).astype(np.float32)
    labels = generator.integers(0, CLASSES, batch_size).astype(np.int64)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (input_name,) = [i.name for i in session.get_inputs()]
    trainer = onnxtrain.Trainer(onnxtrain.make_training_model(str(path), loss="cross_entropy"))
    feeds = {input_name: x}
    np.testing.assert_allclose(np.asarray(next(iter(trainer.infer(feeds).values()))),
                               session.run(None, feeds)[0], rtol=1e-3, atol=1e-3)
    model.eval()
    torch_x = torch.from_numpy(x)
    with torch.no_grad():
        forwards = paired({
            "onnxtrain": lambda: jax.block_until_ready(trainer.infer(feeds)),
            "onnxruntime": lambda: session.run(None, feeds),
            "torch": lambda: model(torch_x)}, rounds, calls)
    trainer.step({input_name: x, "labels": labels})
    model.train()
    systems = {"onnxtrain": lambda: float(trainer.step({input_name: x, "labels": labels})["loss"]),
               "torch": torch_step(model, [x], labels, "cross_entropy")}
    if compile_torch:
        compiled, seconds = torch_compiled_step(model, [x], labels, "cross_entropy")
        if compiled is None:
            print(f"{name}: torch.compile failed: {seconds}", file=sys.stderr)
        else:
            systems["torch.compile"] = compiled
    steps = paired(systems, rounds, calls)
    return {"step ms": statistics.median(steps["onnxtrain"]) * 1e3,
            "torch step ms": statistics.median(steps["torch"]) * 1e3,
            "step / torch": ratio(steps, "onnxtrain", "torch"),
            "step / compiled": ratio(steps, "onnxtrain", "torch.compile") if "torch.compile" in steps else "",
            "forward ms": statistics.median(forwards["onnxtrain"]) * 1e3,
            "forward / ort": ratio(forwards, "onnxtrain", "onnxruntime"),
            "forward / torch": ratio(forwards, "onnxtrain", "torch"),
            **first_steps({"path": str(path), "loss": "cross_entropy"}, {input_name: x, "labels": labels})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/onnxtrain-exported-cnn"))
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile")
    arguments = parser.parse_args()
    rows = {name: compare(name, arguments.batch, arguments.size, arguments.rounds, arguments.calls,
                          arguments.cache, arguments.compile) for name in arguments.models.split(",")}
    print_table(rows, "model")
    print(f"batch {arguments.batch}, 3x{arguments.size}x{arguments.size}, {arguments.rounds} rounds of "
          f"{arguments.calls} calls per system; {run.machine()}")


if __name__ == "__main__":
    main()
