"""Training runs for the portable export's tests: bench models with make_training_model's
recipe, a dataset at two batch sizes, onnxtrain's own 20 steps as the reference, and the
error measures the acceptance uses."""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import onnxtrain
from onnxtrain._recipe.builder import make_training_model

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
STEPS = 20
BATCHES = (4, 7) * (STEPS // 2)
sys.path.insert(0, str(ROOT / "bench"))
import models  # noqa: E402  (bench/models.py: the benchmark models)


@dataclass(frozen=True)
class Run:
    losses: np.ndarray
    state: dict[str, np.ndarray]


def forward_model(name: str):
    """The bench model `name` ("mlp" or "cnn") as onnx.ModelProto."""
    if name == "mlp":
        return models.mlp_onnx(models.mlp_weights())
    return models.cnn_onnx(models.cnn_weights())


@functools.cache
def training_bytes(name: str, optimizer: str) -> bytes:
    forward = forward_model(name)
    return make_training_model(forward.SerializeToString(), loss="cross_entropy", optimizer=optimizer).SerializeToString()


@functools.cache
def batches(name: str) -> tuple[dict[str, np.ndarray], ...]:
    """STEPS batches of feeds x and labels (random labels, so the loss stays well above 0),
    batch sizes alternating 4 and 7."""
    forward = forward_model(name)
    dims = tuple(d.dim_value for d in forward.graph.input[0].type.tensor_type.shape.dim[1:])
    rng = np.random.default_rng(1)
    return tuple({"x": rng.standard_normal((b, *dims)).astype(np.float32),
                  "labels": rng.integers(0, 10, b).astype(np.int64)} for b in BATCHES)


def run_trainer(trainer: onnxtrain.Trainer, name: str) -> Run:
    """STEPS steps of `trainer` over the batches in turn."""
    data = batches(name)
    losses = [float(trainer.step(data[i % len(data)])["loss"]) for i in range(STEPS)]
    return Run(np.asarray(losses), {k: np.asarray(v) for k, v in trainer.state.items()})


@functools.cache
def reference(name: str, optimizer: str) -> Run:
    """onnxtrain's own run of the recipe (Gradient and optimizer ops)."""
    return run_trainer(onnxtrain.Trainer(training_bytes(name, optimizer)), name)


def save_batches(name: str, folder: Path) -> tuple[Path, Path]:
    """The batches as batches.npz (examples/portable_ort.py) and batches.json (the Node runner)."""
    data = batches(name)
    npz, js = folder / "batches.npz", folder / "batches.json"
    np.savez(npz, **{f"{i}/{k}": v for i, feeds in enumerate(data) for k, v in feeds.items()})
    js.write_text(json.dumps([{k: {"type": {"float32": "float32", "int64": "int64"}[str(v.dtype)],
                                   "dims": list(v.shape), "data": v.ravel().tolist()} for k, v in feeds.items()}
                              for feeds in data]))
    return npz, js


def errors(actual: Run, expected: Run, names) -> dict[str, float]:
    """Worst relative errors: per-step loss; per state tensor, the largest element error over
    the tensor's largest magnitude ("max") and the error's norm over the tensor's ("norm")."""
    loss = float(np.max(np.abs(actual.losses - expected.losses) / np.abs(expected.losses)))
    worst_max = worst_norm = 0.0
    for name in names:
        a, b = np.asarray(actual.state[name], np.float64), np.asarray(expected.state[name], np.float64)
        assert a.shape == b.shape, name
        difference = np.abs(a - b)
        worst_max = max(worst_max, float(difference.max() / max(np.abs(b).max(), 1e-30)) if b.size else 0.0)
        worst_norm = max(worst_norm, float(np.linalg.norm(difference) / max(np.linalg.norm(b), 1e-30)))
    return {"loss": loss, "max": worst_max, "norm": worst_norm}


@functools.cache
def reference_start(name: str, optimizer: str) -> Run:
    """The state before any step (losses: those of the reference run)."""
    trainer = onnxtrain.Trainer(training_bytes(name, optimizer))
    return Run(reference(name, optimizer).losses, {k: np.asarray(v) for k, v in trainer.state.items()})
