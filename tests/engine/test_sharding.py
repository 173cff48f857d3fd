"""Trainer(mesh=...): data-parallel and annotated (IR-11) sharded training on simulated devices.

JAX fixes its device count when it starts, and this process already has one CPU device, so
every multi-device run happens in tests/engine/sharding_worker.py under
XLA_FLAGS=--xla_force_host_platform_device_count=N. Oracle: the same model trained on one
device (in the worker, and in this process for the two-process run) with the same batches;
data parallelism changes only the order of floating-point sums, hence the 1e-5 tolerance.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import onnxtrain
from onnxtrain import ShardingAnnotationWarning

# The worker script sits beside this module, whose folder pytest puts on sys.path to import it.
import sharding_worker  # (the scenarios, shared with the one-device checks here)

WORKER = Path(sharding_worker.__file__).resolve()

RTOL = 1e-5


def _worker_env(devices: int) -> dict[str, str]:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    env.pop("JAX_ENABLE_X64", None)
    return env


def _run_worker(*arguments: str, devices: int = 4, timeout: float = 180) -> dict:
    done = subprocess.run([sys.executable, str(WORKER), *arguments], env=_worker_env(devices),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _relative(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected) / np.abs(expected)))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_four_devices_train_like_one_and_their_files_load_on_one(name, tmp_path):
    outcome = _run_worker("parity", name, str(tmp_path))
    assert outcome["devices"] == 4
    assert _relative(outcome["sharded"], outcome["single"]) <= RTOL
    # Relative to each tensor's largest magnitude; the 1e-6 floor covers a conv bias before a
    # train-mode BatchNorm, whose gradient is zero in exact arithmetic and rounding noise here.
    for variable, (difference, scale) in outcome["state_difference"].items():
        assert difference <= RTOL * scale + 1e-6, (variable, difference, scale)
    assert outcome["state_specs"] == ["P()"]  # data parallel: every state variable replicated
    assert _relative(outcome["finetune_sharded"], outcome["finetune_single"]) <= RTOL
    assert "input 'x'" in outcome["uneven_error"] and "4 devices" in outcome["uneven_error"]

    with np.load(tmp_path / "sharded_state.npz") as saved:
        expected = dict(saved)
    exported = onnxtrain.Trainer(tmp_path / "sharded.onnx")
    resumed = onnxtrain.Trainer(sharding_worker.training_model(name))
    resumed.load_checkpoint(tmp_path / "sharded.ckpt")
    for trainer in (exported, resumed):
        for key, value in expected.items():
            np.testing.assert_array_equal(np.asarray(trainer.state[key]), value)


@pytest.mark.slow
def test_annotations_become_shardings_of_the_compiled_step():
    outcome = _run_worker("annotated")
    assert _relative(outcome["losses"], outcome["reference"]) <= RTOL
    constraints = {tuple(pair) for pair in outcome["constraints"]}
    assert ('[{"batch"}, {}]', "tensor<32x20xf32>") in constraints    # 0.weight rows over 4 devices
    assert ('[{}, {"batch"}]', "tensor<16x32xf32>") in constraints    # /0/Gemm_output_0 columns
    assert ('[{}, {}]', "tensor<16x5xf32>") in constraints            # logits replicated
    assert outcome["compiled_input_spec"] == {"0.weight": "P('batch',)", "2.weight": "P()"}
    assert outcome["stored_spec"] == {"0.weight": "P('batch',)", "0.bias": "P()"}
    assert "sharding={devices=[4,1]<=[4]}" in outcome["compiled_devices_annotations"]
    ignored = outcome["warnings"]
    assert len(ignored) == 3, ignored
    for node, tensor, reason in [("/0/Gemm", "0.bias", "does not split evenly"),
                                 ("/1/Relu", "/1/Relu_output_0", "has 2 devices but the mesh has 4"),
                                 ("/2/Gemm", "2.weight", "devices [3, 2, 1, 0]")]:
        assert any(f"node {node!r}" in w and f"tensor {tensor!r}" in w and reason in w for w in ignored)


@pytest.mark.slow
def test_one_device_mesh_ignores_four_device_annotations_with_one_warning_each():
    feeds = sharding_worker.batches("mlp", 2)
    plain = onnxtrain.Trainer(sharding_worker.training_model("mlp"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meshed = onnxtrain.Trainer(sharding_worker.annotated_model(), mesh=Mesh(np.array(jax.devices()[:1]),
                                                                                ("batch",)))
        for batch in feeds:
            np.testing.assert_allclose(meshed.step(batch)["loss"], plain.step(batch)["loss"], rtol=RTOL)
    ignored = [str(w.message) for w in caught if w.category is ShardingAnnotationWarning]
    assert len(ignored) == 6 and all("the mesh has 1" in message for message in ignored), ignored


def test_mesh_must_be_a_jax_mesh():
    with pytest.raises(onnxtrain.InputError, match="jax.sharding.Mesh"):
        onnxtrain.Trainer(sharding_worker.training_model("mlp"), mesh=jax.devices())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_like_one():
    if "jax_cpu_collectives_implementation" not in jax.config.values:
        pytest.skip(f"jax {jax.__version__} has no CPU collectives for multi-process runs")
    port, steps = _free_port(), 3
    processes = [subprocess.Popen([sys.executable, str(WORKER), "multihost", str(index), str(port), str(steps)],
                                  env=_worker_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for index in range(2)]
    try:
        finished = [process.communicate(timeout=180) for process in processes]
    finally:
        for process in processes:
            process.kill()
    for process, (_, stderr) in zip(processes, finished):
        assert process.returncode == 0, stderr[-3000:]
    first, second = (json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in finished)
    assert (first["devices"], first["local_devices"]) == (4, 2)
    assert first["losses"] == second["losses"] and first["bias"] == second["bias"]
    single = onnxtrain.Trainer(sharding_worker.training_model("mlp"))
    expected = [float(single.step(batch)["loss"]) for batch in sharding_worker.batches("mlp", steps)]
    assert _relative(first["losses"], expected) <= RTOL
    np.testing.assert_allclose(first["bias"], np.asarray(single.state["2.bias"]), rtol=RTOL, atol=1e-7)
