"""The demo: fine-tune a model PyTorch exported, with data bundled in the package.

digits_cnn.onnx is a small CNN (Conv, BatchNormalization, ReLU, MaxPool, Gemm)
that PyTorch trained on the 8x8 digits 0-4 only and exported for inference.
The demo adds a standard training recipe (make_training_model), fine-tunes it
on all ten digits, exports the result and scores the export in ONNX Runtime
when that is installed. spirals() serves the quick-start notebook.
"""

from __future__ import annotations

import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from onnxtrain._recipe.builder import make_training_model
from onnxtrain._io.model import load_model
from onnxtrain.optim import Adam
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


def digits() -> tuple[np.ndarray, np.ndarray]:
    """The bundled 8x8 digits (UCI, CC BY 4.0): images float32 [1797, 1, 8, 8] in [0, 1], labels."""
    with np.load(resources.files("onnxtrain") / "models" / "digits.npz", allow_pickle=False) as data:
        return (data["images"] / np.float32(16)).astype(np.float32), data["labels"].astype(np.int64)


def _accuracy(logits: Any, labels: np.ndarray) -> float:
    return float(np.mean(np.asarray(logits).argmax(axis=1) == labels))


def finetune_demo(model_path: Path, epochs: int = 6, out_dir: Path | None = None,
                  progress: bool = True) -> dict[str, float]:
    """Fine-tune the exported CNN on the digits, export it, check the export; the figures."""
    images, labels = digits()
    order = np.random.default_rng(0).permutation(len(labels))
    train, test = order[:1408], order[1408:]   # 22 full batches of 64: one compiled step
    model = load_model(model_path)
    training = make_training_model(model, loss="cross_entropy", optimizer=Adam(lr=3e-3))
    state = len(training.training_info[0].update_binding)
    print(f"{model_path.name}: {len(model.graph.node)} nodes exported by {model.producer_name or 'unknown'} "
          f"({', '.join(sorted({n.op_type for n in model.graph.node}))}), trained on digits 0-4 only")
    print(f"added a standard training recipe: cross-entropy, Gradient, Adam; {state} state variables "
          "(weights, Adam moments, BatchNorm statistics, step counter)\n")
    trainer = Trainer(training, seed=0)
    trainer.initialize()
    test_feeds = {"x": images[test]}
    before = _accuracy(trainer.infer(test_feeds)["logits"], labels[test])
    batches = [{"x": images[train[i:i + 64]], "labels": labels[train[i:i + 64]]}
               for i in range(0, len(train), 64)]
    history = trainer.fit(batches, epochs=epochs, progress=progress)
    logits = np.asarray(trainer.infer(test_feeds)["logits"])
    after = _accuracy(logits, labels[test])
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="onnxtrain-demo-"))
    exported = out_dir / "digits_cnn_finetuned.onnx"
    trainer.export(exported, training=False)
    losses = history["loss"]
    print(f"\nfine-tuned {len(history['step_loss'])} steps on {len(train)} images, "
          f"{trainer.compilations} compilations")
    print("  loss per epoch  " + " -> ".join(f"{loss:.3f}" for loss in losses))
    print(f"  test accuracy   {before:.3f} -> {after:.3f} ({len(test)} held-out images, digits 0-9)")
    print(f"  exported        {exported} (inference model, no training_info)")
    figures = {"first_loss": losses[0], "last_loss": losses[-1], "accuracy_before": before,
               "accuracy_after": after}
    try:
        import onnxruntime
    except ImportError:
        print("  onnxruntime is not installed: skipped checking the export with it")
        return figures
    (served,) = onnxruntime.InferenceSession(str(exported), providers=["CPUExecutionProvider"]).run(
        ["logits"], test_feeds)
    figures["onnxruntime_difference"] = float(np.abs(served - logits).max())
    print(f"  onnxruntime     accuracy {_accuracy(served, labels[test]):.3f}, largest difference "
          f"from onnxtrain {figures['onnxruntime_difference']:.1e}")
    return figures
