"""The persistent compilation cache: on by default in a fresh process, movable, switchable off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test starts fresh Python processes

SCRIPT = """
import numpy as np, jax, onnxtrain
from onnx import TensorProto, helper, numpy_helper
rng = np.random.default_rng(0)
graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 256])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64])],
    [numpy_helper.from_array(rng.normal(size=(256, 64)).astype(np.float32), "W")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
training = onnxtrain.make_training_model(model, loss="mse")
trainer = onnxtrain.Trainer(training)
trainer.step({"x": np.ones((4, 256), np.float32), "labels": np.zeros((4, 64), np.float32)})
print(jax.config.jax_compilation_cache_dir)
"""


def _run(environment: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONNXTRAIN_COMPILATION_CACHE", "ONNXTRAIN_EXECUTABLE_CACHE")} | environment
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_default_folder_is_the_user_cache_and_gets_entries(tmp_path):
    used = _run({"XDG_CACHE_HOME": str(tmp_path)})
    assert Path(used) == tmp_path / "onnxtrain" / "xla"
    assert any(Path(used).iterdir())
    executables = tmp_path / "onnxtrain" / "executables"
    assert any(executables.glob("*.executable")) and executables.stat().st_mode & 0o077 == 0


def test_folder_can_be_moved_or_switched_off(tmp_path):
    assert Path(_run({"ONNXTRAIN_COMPILATION_CACHE": str(tmp_path / "c")})) == tmp_path / "c"
    assert any((tmp_path / "c").iterdir())
    assert any((tmp_path / "c" / "executables").glob("*.executable"))
    assert _run({"ONNXTRAIN_COMPILATION_CACHE": "off", "XDG_CACHE_HOME": str(tmp_path / "x")}) == "None"
    assert not (tmp_path / "x").exists()


START_UP = """
import logging, sys, numpy as np, jax, onnxtrain
from onnx import TensorProto, helper, numpy_helper
widths = [8 + 4 * i for i in range(int(sys.argv[1]) + 1)]
rng = np.random.default_rng(0)
nodes, weights, name = [], [], "x"
for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
    weights += [numpy_helper.from_array(rng.normal(size=(fan_in, fan_out)).astype(np.float32), f"W{i}"),
                numpy_helper.from_array(np.zeros(fan_out, np.float32), f"b{i}")]
    nodes += [helper.make_node("MatMul", [name, f"W{i}"], [f"m{i}"]),
              helper.make_node("Add", [f"m{i}", f"b{i}"], [f"h{i}"])]
    name = f"h{i}"
graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", widths[0]])],
                          [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", widths[-1]])], weights)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
training = onnxtrain.make_training_model(model, loss="mse", optimizer=onnxtrain.optim.Adam(1e-3))
compiled = []
handler = logging.Handler()
handler.emit = lambda record: compiled.append(record.getMessage()) if record.getMessage().startswith(
    "Finished XLA compilation") else None
logging.getLogger("jax").addHandler(handler)
jax.config.update("jax_log_compiles", True)
trainer = onnxtrain.Trainer(training)
at_construction = len(compiled)
trainer.step({"x": np.ones((4, widths[0]), np.float32), "labels": np.zeros((4, widths[-1]), np.float32)})
print(at_construction, len(compiled) - at_construction)
"""


def _start_up_compilations(layers: int) -> tuple[int, int]:
    """Programs compiled by Trainer() and by the first step of a `layers`-layer MLP."""
    env = {**os.environ, "ONNXTRAIN_COMPILATION_CACHE": "off"}
    result = subprocess.run([sys.executable, "-c", START_UP, str(layers)], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    at_construction, first_step = result.stdout.strip().splitlines()[-1].split()
    return int(at_construction), int(first_step)


def test_start_up_compiles_the_same_programs_whatever_the_number_of_state_shapes():
    """Without the persistent cache, start-up programs are compiled again at every start: copying
    the state into the store and making the checked step's spare buffers must not cost one
    per state shape (a ResNet-18 paid 0.3 s and 0.7 s of its warm start for them)."""
    assert _start_up_compilations(1) == _start_up_compilations(4)


WARM = """
import collections, json, numpy as np, jax, onnxtrain
from onnx import TensorProto, helper, numpy_helper
events = collections.Counter()
jax.monitoring.register_event_listener(lambda event, **_: events.update([event]))
nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["r"]),
         helper.make_node("MatMul", ["r", "W"], ["y"])]
graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
    [numpy_helper.from_array(np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32), "W")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
trainer = onnxtrain.Trainer(onnxtrain.make_training_model(model, loss="mse"))
trainer.step({"x": np.ones((4, 16), np.float32), "labels": np.zeros((4, 8), np.float32)})
print(json.dumps([events["/jax/compilation_cache/compile_requests_use_cache"],
                  events["/jax/compilation_cache/cache_hits"]]))
"""


def test_a_warm_start_compiles_nothing(tmp_path):
    """Every program of a start is kept, the small ones too (the shape folding's, the state's
    set-up): a second process with the same cache folder finds them all. (With onnxtrain's
    executable cache off: it would serve the step before JAX's cache is asked.)"""
    env = {**os.environ, "ONNXTRAIN_COMPILATION_CACHE": str(tmp_path), "ONNXTRAIN_EXECUTABLE_CACHE": "off"}
    runs = [subprocess.run([sys.executable, "-c", WARM], capture_output=True, text=True, env=env, timeout=300)
            for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), [run.stderr for run in runs]
    (cold_programs, cold_hits), (warm_programs, warm_hits) = (
        json.loads(run.stdout.strip().splitlines()[-1]) for run in runs)
    assert cold_programs > 0 and cold_hits == 0
    assert warm_hits == warm_programs == cold_programs
