"""Models exported by PyTorch, checked against PyTorch's own numbers.

The fixtures in tests/fixtures/torch come from scripts/make_torch_fixtures.py:
real exporter output (transposed onnx::MatMul_* weights, shape arithmetic,
BatchNormalization, LayerNormalization, erf-expanded GELU) and oracles torch
computed on the exported weights. The translated graph is the exported eval
graph, so its gradients and SGD trajectory are compared with torch's eval-mode
(frozen BatchNorm) ones. Only the last test needs torch: it re-runs the script
in memory and checks the committed files are what it produces.
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import numpy as np
import onnx
import onnxruntime
import optax
import pytest
from onnx import numpy_helper

import onnxtrain
from support import paths

ROOT = paths.REPO
FIXTURES = paths.FIXTURES / "torch"
SCRIPT = ROOT / "scripts" / "make_torch_fixtures.py"
MODELS = ["mlp", "cnn", "transformer"]


@functools.cache
def fixture(name: str) -> tuple[bytes, dict[str, np.ndarray]]:
    with np.load(FIXTURES / f"{name}_oracle.npz") as oracle:
        return (FIXTURES / f"{name}.onnx").read_bytes(), dict(oracle)


@functools.cache
def translated(name: str):
    """(loss(weights, x, y), weights): the trainable params; the others (BatchNorm running stats) stay fixed."""
    fn, params = onnxtrain.translate_model(fixture(name)[0])
    trainable = {key[len("evalgrad__"):] for key in fixture(name)[1] if key.startswith("evalgrad__")}
    frozen = {k: v for k, v in params.items() if k not in trainable}

    def loss(weights, x, y):
        logits = fn(weights | frozen, {"x": x})["logits"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss, {k: v for k, v in params.items() if k in trainable}


@pytest.mark.parametrize("name", MODELS)
def test_onnxruntime_reproduces_torch_logits(name):
    model, oracle = fixture(name)
    session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"x": oracle["batches_x"][0]})
    np.testing.assert_allclose(logits, oracle["forward_logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_translated_gradients_match_torch_eval_mode(name):
    oracle = fixture(name)[1]
    loss, weights = translated(name)
    assert {f"evalgrad__{k}" for k in weights} == {k for k in oracle if k.startswith("evalgrad__")}
    grads = jax.grad(loss)(weights, oracle["batches_x"][0], oracle["batches_y"][0])
    for key, grad in grads.items():
        expected = oracle[f"evalgrad__{key}"]
        error = np.max(np.abs(np.asarray(grad) - expected))
        assert error <= 1e-5 * np.max(np.abs(expected)) + 1e-7, f"{name} {key}: max error {error}"


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_translated_sgd_matches_torch_eval_mode(name):
    oracle = fixture(name)[1]
    loss, weights = translated(name)
    lr = oracle["sgd_lr"]

    @jax.jit
    def step(weights, x, y):
        value, grads = jax.value_and_grad(loss)(weights, x, y)
        return value, jax.tree.map(lambda w, g: w - lr * g, weights, grads)

    losses = []
    for x, y in zip(oracle["batches_x"], oracle["batches_y"]):
        value, weights = step(weights, x, y)
        losses.append(value)
    np.testing.assert_allclose(losses, oracle["sgd_losses_eval"], rtol=1e-4)


def assert_arrays_close(actual: np.ndarray, expected: np.ndarray, what: str, scale: float | None = None) -> None:
    """Exact for labels and strings; floats to what another CPU's torch may differ by, with the
    absolute tolerance relative to `scale` (default: the array's own largest value)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if actual.dtype.kind == "f":
        scale = np.max(np.abs(expected)) if scale is None else scale
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5 * scale, err_msg=what)
    else:
        np.testing.assert_array_equal(actual, expected, err_msg=what)


@pytest.mark.slow
def test_script_reproduces_committed_fixtures():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    spec = importlib.util.spec_from_file_location("make_torch_fixtures", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for name, (model_bytes, arrays) in script.build().items():
        committed_bytes, committed = fixture(name)
        model, expected = onnx.load_from_string(model_bytes), onnx.load_from_string(committed_bytes)
        for actual, reference in zip(model.graph.initializer, expected.graph.initializer, strict=True):
            assert actual.name == reference.name
            assert_arrays_close(numpy_helper.to_array(actual), numpy_helper.to_array(reference), f"{name} {actual.name}")
        del model.graph.initializer[:], expected.graph.initializer[:]
        # The exporting torch's version stamp is not part of what the fixture pins.
        model.producer_version = expected.producer_version = ""
        assert model == expected, f"{name}.onnx graph differs"
        assert arrays.keys() == committed.keys(), name
        # A gradient that is zero in exact arithmetic (a conv bias before training-mode
        # BatchNorm) is rounding noise on both sides: compare gradients on the model's scale.
        gradient_scale = max(np.max(np.abs(v)) for k, v in committed.items() if "grad__" in k)
        for key, value in arrays.items():
            scale = gradient_scale if "grad__" in key else None
            assert_arrays_close(np.asarray(value), committed[key], f"{name} {key}", scale)
