"""The notebooks run top to bottom in a fresh kernel, and say what they should.

Each notebook is executed with nbclient; the checks read the printed text of
the cells that report results, so a notebook that silently stops training or
drifts from onnxruntime fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support import paths

pytestmark = pytest.mark.slow  # each notebook runs in a fresh Jupyter kernel

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = paths.REPO / "notebooks"


def _run(name: str, tmp_path: Path) -> str:
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    return "\n".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                     for output in cell.get("outputs", []))


def _figure(text: str, pattern: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not found in the notebook's output:\n{text[-2000:]}"
    return float(match.group(1))


def test_quickstart(tmp_path):
    text = _run("01_quickstart.ipynb", tmp_path)
    assert _figure(text, r"accuracy ([\d.]+)") > 0.9
    # The initialization graph, step(), fit's step (its check read a step late) and infer().
    assert _figure(text, r"compilations (\d+)") == 4
    assert _figure(text, r"max difference: ([\deE.+-]+)") < 1e-5
    assert "resumed state equals: True" in text


def test_finetune_exported_model(tmp_path):
    text = _run("02_finetune_exported_model.ipynb", tmp_path)
    before = _figure(text, r"test accuracy before fine-tuning: ([\d.]+)")
    after = _figure(text, r"test accuracy after fine-tuning: ([\d.]+)")
    assert before < 0.7 and after > 0.9
    # The held-out data is one batch, so the last epoch's val_accuracy is the test accuracy.
    assert _figure(text, r"held-out accuracy per epoch [\d.]+ -> ([\d.]+)") == after
    assert _figure(text, r"onnxruntime accuracy ([\d.]+)") == after
    assert _figure(text, r"max difference from onnxtrain: ([\deE.+-]+)") < 1e-4
    first, last = (float(v) for v in re.search(r"held-out loss ([\d.]+) -> ([\d.]+)", text).groups())
    assert last < 0.5 * first


def test_your_own_model(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    text = _run("03_your_own_model.ipynb", tmp_path)
    best_accuracy = _figure(text, r"best epoch \d+: val_loss [\d.]+, val_accuracy ([\d.]+)")
    assert best_accuracy > 0.9
    # EarlyStopping restored the best epoch, and the held-out rows are one batch: ONNX Runtime
    # scores the export exactly as fit's evaluation did.
    assert _figure(text, r"onnxruntime accuracy ([\d.]+)") == best_accuracy
