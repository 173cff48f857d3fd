"""The command line end to end: make-training, train, export, inspect, and one-line errors.

Oracle: onnxruntime serves what `train` and `export` write, matching a numpy
forward pass with the trained weights, and the loss falls.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.cli import main


def _inference_model(path):
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "B"], ["logits"], transB=1)], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(rng.normal(size=(3, 4)).astype(np.float32), "W"),
         numpy_helper.from_array(np.zeros(3, np.float32), "B")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)


def _data(path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(256, 4)).astype(np.float32)
    labels = (x @ np.array([[2, 0, -1], [0, 3, 0], [1, -1, 0], [0, 0, 2]])).argmax(axis=1).astype(np.int64)
    np.savez(path, x=x, labels=labels)
    return x, labels


@pytest.mark.slow
def test_make_training_train_export_round_trip(tmp_path, capsys):
    _inference_model(tmp_path / "inf.onnx")
    x, labels = _data(tmp_path / "data.npz")
    assert main(["make-training", str(tmp_path / "inf.onnx"), "-o", str(tmp_path / "train.onnx"),
                 "--loss", "cross_entropy", "--optimizer", "adam", "--lr", "0.05"]) == 0
    assert main(["train", str(tmp_path / "train.onnx"), "--data", str(tmp_path / "data.npz"),
                 "--epochs", "4", "--initialize", "--quiet", "-o", str(tmp_path / "trained.onnx"),
                 "--inference-out", str(tmp_path / "serve.onnx")]) == 0
    printed = capsys.readouterr().out
    losses = [float(v) for v in printed.split("loss: ")[1].splitlines()[0].split(" -> ")]
    assert len(losses) == 4 and losses[-1] < 0.7 * losses[0]
    assert main(["export", str(tmp_path / "trained.onnx"), "-o", str(tmp_path / "again.onnx")]) == 0
    assert (tmp_path / "again.onnx").read_bytes() == (tmp_path / "serve.onnx").read_bytes()
    served = onnx.load(tmp_path / "serve.onnx")
    assert not served.training_info
    weights = {t.name: numpy_helper.to_array(t) for t in served.graph.initializer}
    (logits,) = onnxruntime.InferenceSession(str(tmp_path / "serve.onnx")).run(None, {"x": x})
    np.testing.assert_allclose(logits, x @ weights["W"].T + weights["B"], rtol=1e-5, atol=1e-5)
    assert np.mean(logits.argmax(axis=1) == labels) > 0.8


def test_inspect_lists_unsupported_operators(tmp_path, capsys):
    graph = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"], domain="custom.domain")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("custom.domain", 1)])
    onnx.save(model, tmp_path / "m.onnx")
    assert main(["inspect", str(tmp_path / "m.onnx")]) == 0
    assert "unsupported operators: custom.domain::NoSuchOp (opset 1)" in capsys.readouterr().out


@pytest.mark.slow
def test_train_errors_are_one_line(tmp_path):
    _inference_model(tmp_path / "inf.onnx")
    np.savez(tmp_path / "data.npz", x=np.zeros((4, 4), np.float32))
    result = subprocess.run([sys.executable, "-m", "onnxtrain", "train", str(tmp_path / "inf.onnx"),
                             "--data", str(tmp_path / "data.npz"), "-o", str(tmp_path / "o.onnx")],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "no training_info" in result.stderr
    assert "Traceback" not in result.stderr
