"""The path a newcomer takes, end to end: a torch CNN exported with torch.onnx (dynamo), fed
from torch DataLoaders of (x, y), trained with validation, a metric, early stopping and a
best-only checkpoint, exported and served by onnxruntime.

The oracle for evaluation is onnxruntime itself: the validation loss fit logs must be the
cross-entropy of the exported inference model's logits (BatchNorm on running statistics,
Dropout off), and after EarlyStopping restores the best epoch, that epoch's logged val_loss.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest

import onnxtrain
from onnxtrain.callbacks import EarlyStopping, ModelCheckpoint

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

CLASSES = 3


def _images(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Three classes of 1x8x8 images: a bright row, a bright column or a bright diagonal, in noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, rows)
    images = rng.normal(0.0, 0.6, (rows, 1, 8, 8)).astype(np.float32)
    for image, label in zip(images, labels):
        position = rng.integers(1, 7)
        if label == 0:
            image[0, position, :] += 2.0
        elif label == 1:
            image[0, :, position] += 2.0
        else:
            image[0] += 2.0 * np.eye(8, dtype=np.float32)
    return images, labels.astype(np.int64)


def _export() -> bytes:
    """A small CNN with BatchNorm and Dropout, exported the way the README says keeps it
    trainable: dynamo without its graph optimizer (which would fold BatchNorm), batch dynamic."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(16, CLASSES)).eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, (torch.zeros(4, 1, 8, 8),), dynamo=True, optimize=False,
                                    input_names=["x"], output_names=["logits"],
                                    dynamic_shapes=({0: torch.export.Dim("batch")},))
    program.save(buffer)
    return buffer.getvalue()


def _cross_entropy(logits: np.ndarray, labels: np.ndarray) -> float:
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-log_softmax[np.arange(len(labels)), labels].mean())


@pytest.mark.slow
def test_dataloader_to_fit_with_validation_to_onnxruntime(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    x, y = _images(192, seed=1)
    x_val, y_val = _images(60, seed=2)
    loader = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=16, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    val_loader = DataLoader(TensorDataset(torch.from_numpy(x_val), torch.from_numpy(y_val)), batch_size=16)

    training = onnxtrain.make_training_model(_export(), loss="cross_entropy", optimizer="adam")
    trainer = onnxtrain.Trainer(training)
    stopper = EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True)
    best = tmp_path / "best.ckpt"
    history = trainer.fit(loader, epochs=12, eval_data=val_loader, metrics=["accuracy"], verbose=0,
                          callbacks=[stopper, ModelCheckpoint(best, monitor="val_loss")])

    epochs = len(history["loss"])
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(history)
    assert all(len(history[name]) == epochs for name in ("accuracy", "val_loss", "val_accuracy"))
    assert history["val_loss"][-1] < history["val_loss"][0] and max(history["val_accuracy"]) > 0.8
    assert best.exists()

    exported = tmp_path / "model.onnx"
    trainer.export(exported, training=False)
    logits = ort.InferenceSession(str(exported), providers=["CPUExecutionProvider"]).run(
        ["logits"], {"x": x_val})[0]
    served = _cross_entropy(logits, y_val)
    # What evaluate() says is what the exported model does, on the restored best epoch.
    assert float(trainer.evaluate({"x": x_val, "labels": y_val})["loss"]) == pytest.approx(served, abs=1e-5)
    best_epoch = int(np.argmin(history["val_loss"]))
    assert history["val_loss"][best_epoch] == pytest.approx(served, abs=1e-5)
    accuracy = float(np.mean(logits.argmax(axis=1) == y_val))
    assert history["val_accuracy"][best_epoch] == pytest.approx(accuracy, abs=1e-6)
