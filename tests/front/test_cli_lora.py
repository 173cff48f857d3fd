"""The --lora-* options of make-training and finetune, and what inspect prints of adapters.

Oracles: the files the commands write, read with onnx; onnxruntime serves the merged model.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.cli import main


def _classifier(path) -> str:
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "B"], ["logits"], name="fc", transB=1)], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(rng.normal(size=(3, 4)).astype(np.float32), "W"),
         numpy_helper.from_array(np.zeros(3, np.float32), "B")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    return str(path)


def _record(model: onnx.ModelProto) -> dict:
    return json.loads(next(p.value for p in model.metadata_props if p.key == "onnxtrain.adapters"))


def test_make_training_with_lora_options_and_inspect_shows_the_adapters(tmp_path, capsys):
    model, out = _classifier(tmp_path / "model.onnx"), tmp_path / "train.onnx"
    assert main(["make-training", model, "-o", str(out), "--loss", "cross_entropy", "--lora-rank", "2",
                 "--lora-targets", "W"]) == 0
    record = _record(onnx.load(out))
    assert (record["rank"], record["alpha"], list(record["weights"])) == (2, 4.0, ["W"])
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "LoRA adapters: rank 2, alpha 4, dropout 0, 1 weights" in printed
    assert "W (Gemm [3, 4]): W.lora_A, W.lora_B" in printed


def test_lora_alpha_without_rank_is_one_line(tmp_path, capsys):
    model = _classifier(tmp_path / "model.onnx")
    assert main(["make-training", model, "-o", str(tmp_path / "t.onnx"), "--loss", "mse",
                 "--lora-alpha", "4"]) == 1
    assert "--lora-alpha and --lora-targets need --lora-rank" in capsys.readouterr().err


@pytest.mark.slow
def test_finetune_with_lora_writes_the_merged_model(tmp_path, capsys):
    onnxruntime = pytest.importorskip("onnxruntime")
    pytest.importorskip("optax")
    model, out = _classifier(tmp_path / "model.onnx"), tmp_path / "tuned.onnx"
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    np.savez(tmp_path / "train.npz", x=x, labels=rng.integers(0, 3, 64))
    assert main(["finetune", model, "--data", str(tmp_path / "train.npz"), "--loss", "cross_entropy",
                 "--lora-rank", "2", "--lora-alpha", "2", "--lora-targets", "W", "--epochs", "2", "--quiet",
                 "-o", str(out)]) == 0
    tuned, original = onnx.load(out), onnx.load(model)
    assert [n.op_type for n in tuned.graph.node] == ["Gemm"]
    assert sorted(t.name for t in tuned.graph.initializer) == ["B", "W"]
    assert not [p for p in tuned.metadata_props if p.key == "onnxtrain.adapters"]
    weights = {t.name: numpy_helper.to_array(t) for t in tuned.graph.initializer}
    before = {t.name: numpy_helper.to_array(t) for t in original.graph.initializer}
    # Only W moved (by the merged low-rank update); the bias was not trained.
    assert not np.array_equal(weights["W"], before["W"])
    np.testing.assert_array_equal(weights["B"], before["B"])
    assert np.linalg.matrix_rank(weights["W"].astype(np.float64) - before["W"], tol=1e-6) <= 2
    (served,) = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x[:4]})
    np.testing.assert_allclose(served, x[:4] @ weights["W"].T + weights["B"], rtol=1e-5, atol=1e-5)
