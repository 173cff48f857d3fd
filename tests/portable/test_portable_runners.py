"""examples/portable_node.mjs: the step model trained by onnxruntime-node reproduces onnxtrain's
run (losses and final state) and stock onnxruntime's in Python, at batch sizes 4 and 7 from
one exported file. onnxruntime-node is installed once into a folder of the system's temp
directory (npm install --ignore-scripts: the CPU binaries ship in the package)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

import onnxtrain
from support.portable_training import EXAMPLES, Run, errors, reference, save_batches, training_bytes, weights

NODE_FOLDER = Path(tempfile.gettempdir()) / "onnxtrain-tests-onnxruntime-node"


@pytest.fixture(scope="module")
def node_folder() -> Path:
    """A folder with onnxruntime-node installed and the example beside it (ES modules resolve
    packages from the script's folder)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed to run examples/portable_node.mjs")
    NODE_FOLDER.mkdir(exist_ok=True)
    if not (NODE_FOLDER / "node_modules" / "onnxruntime-node").is_dir():
        (NODE_FOLDER / "package.json").write_text('{"name": "onnxtrain-tests", "private": true}')
        try:
            done = subprocess.run(["npm", "install", "--ignore-scripts", "--no-audit", "--no-fund", "onnxruntime-node"],
                                  cwd=NODE_FOLDER, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.skip("npm install onnxruntime-node timed out (no registry reachable?)")
        if done.returncode:
            pytest.skip(f"npm install onnxruntime-node failed: {done.stderr.strip()[-300:]}")
    shutil.copy(EXAMPLES / "portable_node.mjs", NODE_FOLDER / "portable_node.mjs")
    return NODE_FOLDER


def _python_runner():
    spec = importlib.util.spec_from_file_location("portable_ort", EXAMPLES / "portable_ort.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("name, optimizer", [("mlp", "adam"), ("cnn", "momentum"), ("cnn_bn", "adam"),
                                             ("bert", "adam")])
def test_node_runner_reproduces_onnxtrain_and_python(name, optimizer, node_folder, tmp_path):
    step_path = tmp_path / "model.step.onnx"
    onnxtrain.Trainer(training_bytes(name, optimizer)).export(step_path, portable="step")
    npz, js = save_batches(name, tmp_path)
    done = subprocess.run(["node", "portable_node.mjs", str(step_path), str(js), str(tmp_path / "node.json")],
                          cwd=node_folder, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 20: loss" in done.stdout
    saved = json.loads((tmp_path / "node.json").read_text())
    expected = reference(name, optimizer)
    state = {k: np.asarray(v["data"], expected.state[k].dtype).reshape(v["dims"]) for k, v in saved["state"].items()}
    actual = Run(np.asarray(saved["losses"]), state)
    names = [k for k in state if k in expected.state]
    assert len(names) == len(state)
    measured = errors(actual, expected, [w for w in weights(name) if w in state])
    print(f"{name}/{optimizer} onnxruntime-node vs onnxtrain: weights {measured}")
    assert measured["loss"] <= 1e-5 and measured["norm"] <= 1e-5, measured
    if optimizer == "momentum":
        assert measured["max"] <= 1e-5, measured
    # The same runtime in Python gives the same numbers.
    _python_runner().train(str(step_path), str(npz), str(tmp_path / "python.npz"))
    python = np.load(tmp_path / "python.npz")
    np.testing.assert_allclose(actual.losses, python["losses"], rtol=1e-6)
    for key in names:
        np.testing.assert_allclose(state[key], python[key], rtol=1e-5, atol=1e-7)
