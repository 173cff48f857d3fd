"""Files from strangers are data: nothing in them is unpickled or evaluated.

Oracle: a pickled object whose unpickling would create a marker file; the marker
must never appear, and the loaders must answer with an OnnxTrainError.
"""

from __future__ import annotations

import ast
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

import onnxtrain
from onnxtrain.cli import main
from onnxtrain.state import checkpoint
from support import paths

ROOT = paths.REPO
PACKAGE_FOLDERS = ("onnxtrain", "translate", "state", "proto")
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}


class _Planted:
    """Unpickling this creates `marker`: proof that something was unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _package_sources() -> list[Path]:
    return [path for folder in PACKAGE_FOLDERS for path in (ROOT / folder).rglob("*.py")
            if not path.name.endswith("_pb2.py")]


def _violations(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            found.append(f"from {node.module} import")
        elif isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if isinstance(node.func, ast.Name) and name in FORBIDDEN_CALLS:
                found.append(f"{name}() call")
            if name == "load" and isinstance(node.func, ast.Attribute) and getattr(node.func.value, "id", "") == "np":
                explicit = [k for k in node.keywords if k.arg == "allow_pickle"]
                if not explicit or not (isinstance(explicit[0].value, ast.Constant) and explicit[0].value.value is False):
                    found.append("np.load without allow_pickle=False")
    return [f"{path.relative_to(ROOT)}:{v}" for v in found]


def test_package_source_never_unpickles_or_evaluates():
    sources = _package_sources()
    assert len(sources) > 30
    assert [v for path in sources for v in _violations(path)] == []


def test_pickled_arrays_in_a_data_file_are_refused_without_being_unpickled(tmp_path, capsys):
    marker = tmp_path / "unpickled"
    data = tmp_path / "data.npz"
    np.savez(data, X=np.array([_Planted(marker)], dtype=object), Y=np.zeros(1, np.float32))
    model = tmp_path / "model.onnx"
    onnxtrain.save_model(_linear_training_model(), model)
    assert main(["train", str(model), "--data", str(data), "--quiet", "-o", str(tmp_path / "out.onnx")]) != 0
    assert "cannot read data file" in capsys.readouterr().err
    assert not marker.exists()


def _checkpoint_with(tmp_path: Path, dtype: str, payload: bytes) -> Path:
    path = tmp_path / "state.ckpt"
    checkpoint.save_checkpoint(path, {"W": np.zeros(2, np.float32)}, _key(), {})
    with zipfile.ZipFile(path) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    manifest = json.loads(entries["manifest.json"])
    manifest["arrays"][0]["dtype"] = dtype
    entries[manifest["arrays"][0]["entry"]] = payload
    entries["manifest.json"] = json.dumps(manifest).encode()
    with zipfile.ZipFile(path, "w") as archive:
        for name, content in entries.items():
            archive.writestr(name, content)
    return path


@pytest.mark.parametrize("dtype", ["object", "O", "U8", "S4", "V8", "finfo", "float32, int8", "pickle"])
def test_checkpoint_arrays_must_be_numeric(tmp_path, dtype):
    import pickle  # noqa: PLC0415 - the test plants a pickle; the package itself never imports it

    marker = tmp_path / "unpickled"
    path = _checkpoint_with(tmp_path, dtype, pickle.dumps(_Planted(marker)))
    with pytest.raises(onnxtrain.ModelLoadError, match="checkpoint"):
        checkpoint.load_checkpoint(path)
    assert not marker.exists()


def test_checkpoint_keeps_ml_dtypes_arrays(tmp_path):
    import ml_dtypes

    path = tmp_path / "state.ckpt"
    values = {"W": np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16)}
    checkpoint.save_checkpoint(path, values, _key(), {})
    loaded, _, _ = checkpoint.load_checkpoint(path)
    assert loaded["W"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(loaded["W"].astype(np.float32), np.arange(4, dtype=np.float32))


def _key():
    import jax

    return jax.random.key(0)


def _linear_training_model():
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y_pred"])], "linear",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 2])],
        [helper.make_tensor_value_info("Y_pred", TensorProto.FLOAT, ["batch", 1])],
        [numpy_helper.from_array(np.ones((2, 1), np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return onnxtrain.make_training_model(model, loss="mse", label="Y")
