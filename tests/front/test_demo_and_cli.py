"""The bundled demo model and the command line.

Oracles: onnx's checker (on the main graph, the initialization graph and the
combined main+algorithm graph, which is how the ONNX spec defines a training
step), and onnxruntime's inference against a numpy forward pass.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime
import pytest

from onnxtrain.cli import demo_model_path, main
from support import paths
from support.onnx_checks import check_training_model

ROOT = paths.REPO


def _demo_builder():
    spec = importlib.util.spec_from_file_location("make_demo_model", ROOT / "scripts" / "make_demo_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_demo_model_is_what_the_script_writes():
    assert demo_model_path().read_bytes() == _demo_builder().build().SerializeToString()


def test_demo_model_passes_the_onnx_checker_including_its_training_graphs():
    check_training_model(onnx.load(demo_model_path()), full_check_graphs=True)


def test_onnxruntime_serves_the_demo_model_like_a_numpy_forward_pass():
    model = onnx.load(demo_model_path())
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    x = np.random.default_rng(3).normal(size=(8, 2)).astype(np.float32)
    expected = np.maximum(x @ weights["W1"] + weights["B1"], 0) @ weights["W2"] + weights["B2"]
    session = onnxruntime.InferenceSession(str(demo_model_path()))
    (logits,) = session.run(None, {"X": x})
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_demo_fine_tunes_the_exported_cnn_and_onnxruntime_serves_it(capsys, tmp_path):
    assert main(["demo", "--quiet", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    before, after = (float(v) for v in re.search(r"test accuracy\s+([\d.]+) -> ([\d.]+)", printed).groups())
    assert before < 0.7 and after > 0.9
    losses = [float(v) for v in re.search(r"loss per epoch\s+(.*)", printed).group(1).split(" -> ")]
    assert losses[-1] < 0.2 * losses[0]
    assert "3 compilations" in printed
    exported = tmp_path / "digits_cnn_finetuned.onnx"
    assert not onnx.load(exported).training_info
    assert float(re.search(r"largest difference from onnxtrain ([\deE.+-]+)", printed).group(1)) < 1e-4


@pytest.mark.slow
def test_quickstart_spirals_are_learnable_by_the_bundled_training_model():
    from onnxtrain import Trainer
    from onnxtrain.demo import spirals

    x, labels = spirals()
    trainer = Trainer(demo_model_path(), seed=0)
    trainer.initialize()
    history = trainer.fit([{"X": x[i:i + 60], "labels": labels[i:i + 60]} for i in range(0, 600, 60)],
                          epochs=30, progress=False)
    assert history["loss"][-1] < 0.2 * history["loss"][0]
    logits = np.asarray(trainer.infer({"X": x})["logits"])
    assert np.mean(logits.argmax(axis=1) == labels) > 0.9


@pytest.mark.slow
def test_info_on_a_missing_file_is_one_clear_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "onnxtrain", "inspect", str(tmp_path / "x.onnx")],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip() == f"onnxtrain: model file {tmp_path / 'x.onnx'} does not exist"
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name", ["simple/test_gradient_of_add", "light/light_resnet50"])
def test_info_outlines_backend_models(name, capsys):
    from support.backend_cases import BackendCase

    suite, case = name.split("/")
    assert main(["inspect", str(BackendCase(suite, case).model_path())]) == 0
    assert "main graph" in capsys.readouterr().out
