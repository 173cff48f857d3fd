"""The demo: train the bundled classifier with the recipe it carries, then export it.

The data are three interleaved spiral arms in the plane (made with numpy, so
the demo needs nothing beyond the runtime dependencies): not linearly
separable, so the loss only falls if the hidden layer really trains.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from onnxtrain.model import load_model
from onnxtrain.trainer import Trainer


def spirals(points_per_class: int = 200, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Three noisy spiral arms: X float32[3n, 2], labels int64[3n]."""
    rng = np.random.default_rng(seed)
    radius = np.linspace(0.1, 1.0, points_per_class)
    xs, labels = [], []
    for arm in range(3):
        angle = radius * 3.5 + arm * 2 * np.pi / 3 + rng.normal(0, 0.15, points_per_class)
        xs.append(np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1))
        labels.append(np.full(points_per_class, arm))
    order = rng.permutation(3 * points_per_class)
    return np.concatenate(xs)[order].astype(np.float32), np.concatenate(labels)[order].astype(np.int64)


def batches(x: np.ndarray, labels: np.ndarray, size: int) -> list[dict[str, np.ndarray]]:
    return [{"X": x[i:i + size], "labels": labels[i:i + size]} for i in range(0, len(x), size)]


def accuracy(trainer: Trainer, x: np.ndarray, labels: np.ndarray) -> float:
    logits = np.asarray(trainer.infer({"X": x})["logits"])
    return float(np.mean(logits.argmax(axis=1) == labels))


def train_demo(model_path: Path, epochs: int = 40, out_dir: Path | None = None) -> dict[str, float]:
    """Initialize, fit and export the demo model; the figures it prints, by name."""
    x, labels = spirals()
    trainer = Trainer(model_path, seed=0)
    trainer.initialize()
    before = accuracy(trainer, x, labels)
    history = trainer.fit(batches(x, labels, 60), epochs=epochs, progress=False)
    after = accuracy(trainer, x, labels)
    losses = history["loss"]
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="onnxtrain-demo-"))
    exported = out_dir / "mlp_classifier_trained.onnx"
    trainer.export(exported, training=False)
    reloaded = load_model(exported)
    print(f"trained {len(losses)} steps ({epochs} epochs of {len(x)} spiral points), "
          f"{trainer.compilations} compilations")
    print(f"  loss      {np.mean(losses[:10]):.4f} (first 10 steps) -> {np.mean(losses[-10:]):.4f} (last 10)")
    print(f"  accuracy  {before:.3f} -> {after:.3f}")
    print(f"  exported  {exported} ({len(reloaded.graph.initializer)} trained weights, "
          f"no training_info: ready for ONNX Runtime)")
    return {"first_loss": float(np.mean(losses[:10])), "last_loss": float(np.mean(losses[-10:])),
            "accuracy_before": before, "accuracy_after": after}
