"""Exported CNNs (issue 36): onnxtrain against torch eager per training step, and against
onnxruntime per forward pass, paired in one process.

Each torchvision model (random weights) is exported with torch.onnx.export(dynamo=True), which
folds BatchNorm into the convolutions, so every Conv carries a bias. Then, round after round,
each system runs a few calls back to back, the order reversed every other round; a ratio
reported is the median over rounds of the per-round ratio of median call times, so the
machine's drift cancels out. The systems:

- training step: Trainer on make_training_model(model, loss="cross_entropy") (Adam) against
  the torchvision model in train mode with torch.optim.Adam (forward, cross entropy,
  backward, update);
- forward pass: the Trainer's jitted forward (onnxtrain.translate_model under jax.jit)
  against onnxruntime's InferenceSession on the same file, and torch eager under no_grad;
- first step: a new process from `import onnxtrain` to the first step's loss
  (bench/systems/first_step.py), cold with an empty compilation cache, then warm in another
  new process with the cache the cold one filled.

Usage: python bench/exported_cnn.py [--models resnet18,regnet_y_400mf,convnext_tiny,...]
                                    [--batch 4] [--size 64] [--rounds 7] [--calls 5]
                                    [--cache /tmp/onnxtrain-exported-cnn]
Needs torch, torchvision and onnxruntime.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import run  # noqa: E402

import onnxtrain  # noqa: E402

MODELS = ("resnet18", "regnet_y_400mf", "convnext_tiny", "mobilenet_v3_large", "efficientnet_b0",
          "shufflenet_v2_x1_0", "squeezenet1_1")
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


def median_seconds(call: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired(systems: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, list[float]]:
    """Median seconds per call of every system in every round, the order reversed each round."""
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    for number in range(rounds):
        order = list(systems) if number % 2 == 0 else list(reversed(systems))
        for name in order:
            seconds[name].append(median_seconds(systems[name], calls))
    return seconds


def ratio(seconds: dict[str, list[float]], top: str, bottom: str) -> float:
    return statistics.median(a / b for a, b in zip(seconds[top], seconds[bottom]))


def torch_step(model, batch: dict[str, np.ndarray]) -> Callable[[], float]:
    import torch

    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, labels = torch.from_numpy(batch["x"]), torch.from_numpy(batch["labels"])

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        optimizer.step()
        return float(loss)

    return step


def first_steps(path: Path, x: np.ndarray, input_name: str) -> dict[str, float]:
    """Seconds to the first step's loss in a new process: cold (empty compilation cache), then
    warm (the cache the cold run filled)."""
    job = {"path": str(path), "loss": "cross_entropy", "classes": CLASSES,
           "inputs": {input_name: [list(x.shape), str(x.dtype)]}}
    seconds = {}
    with tempfile.TemporaryDirectory(prefix="onnxtrain-first-step-") as cache:
        for start in ("cold", "warm"):
            result = run.run_script(Path(sys.executable), "first_step.py", job,
                                    {"ONNXTRAIN_COMPILATION_CACHE": cache})
            if "unavailable" in result:
                raise RuntimeError(f"{path.name}, {start} first step: {result['unavailable']}")
            seconds[f"{start} s"] = result["first_step_s"]
    return seconds


def compare(name: str, batch_size: int, size: int, rounds: int, calls: int, cache: Path) -> dict[str, float]:
    import onnxruntime
    import torch

    path, model = export(name, batch_size, size, cache)
    generator = np.random.default_rng(0)
    x = generator.standard_normal((batch_size, 3, size, size)).astype(np.float32)
    labels = generator.integers(0, CLASSES, batch_size).astype(np.int64)
    (input_name,) = [i.name for i in onnxruntime.InferenceSession(str(path)).get_inputs()]
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    translated, params = onnxtrain.translate_model(str(path))
    forward = jax.jit(lambda p, inputs: translated(p, inputs))
    feeds = {input_name: jax.numpy.asarray(x)}
    np.testing.assert_allclose(np.asarray(next(iter(forward(params, feeds).values()))),
                               session.run(None, {input_name: x})[0], rtol=1e-3, atol=1e-3)
    model.eval()
    torch_x = torch.from_numpy(x)
    with torch.no_grad():
        forwards = paired({
            "onnxtrain": lambda: jax.block_until_ready(forward(params, feeds)),
            "onnxruntime": lambda: session.run(None, {input_name: x}),
            "torch": lambda: model(torch_x)}, rounds, calls)
    trainer = onnxtrain.Trainer(onnxtrain.make_training_model(str(path), loss="cross_entropy"))
    trainer.step({input_name: x, "labels": labels})
    steps = paired({"onnxtrain": lambda: float(trainer.step({input_name: x, "labels": labels})["loss"]),
                    "torch": torch_step(model, {"x": x, "labels": labels})}, rounds, calls)
    return {"step ms": statistics.median(steps["onnxtrain"]) * 1e3,
            "torch step ms": statistics.median(steps["torch"]) * 1e3,
            "step / torch": ratio(steps, "onnxtrain", "torch"),
            "forward ms": statistics.median(forwards["onnxtrain"]) * 1e3,
            "forward / ort": ratio(forwards, "onnxtrain", "onnxruntime"),
            "forward / torch": ratio(forwards, "onnxtrain", "torch"),
            **first_steps(path, x, input_name)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/onnxtrain-exported-cnn"))
    arguments = parser.parse_args()
    rows = {name: compare(name, arguments.batch, arguments.size, arguments.rounds, arguments.calls,
                          arguments.cache) for name in arguments.models.split(",")}
    columns = list(next(iter(rows.values())))
    print("| model | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.2f}" for c in columns) + " |")
    print(f"batch {arguments.batch}, 3x{arguments.size}x{arguments.size}, {arguments.rounds} rounds of "
          f"{arguments.calls} calls per system; {run.machine()}")


if __name__ == "__main__":
    main()
