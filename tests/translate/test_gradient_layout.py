"""A convolution kernel's gradient is transposed into the kernel's layout once per step.

XLA:CPU's convolution writes a kernel gradient as (in, h, w, out); left to itself, XLA
folds the move to (out, in, h, w) into each of its consumers, and Adam's two moment
updates both read it across the grain (a ResNet-18 step paid ~10 % for that). Oracle: in
the optimized HLO, every convolution whose result is a reordering of a kernel's shape (a
kernel gradient) has exactly one user, the transposing copy, instead of one per moment.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import optax
import pytest
from onnx import helper, numpy_helper

import onnxtrain
from support.model_factory import conv_classifier

pytestmark = pytest.mark.slow  # each test compiles a convolutional training step

RNG = np.random.default_rng(0)
KERNEL = RNG.normal(size=(32, 16, 3, 3)).astype(np.float32) * 0.1
# 9x9 images: a convolution with few output positions would run as a matrix product.
DENSE = RNG.normal(size=(32 * 81, 5)).astype(np.float32) * 0.05
FEEDS = {"x": RNG.normal(size=(8, 16, 9, 9)).astype(np.float32), "labels": RNG.integers(0, 5, 8).astype(np.int64)}


def _kernel_gradient_users(hlo: str) -> list[int]:
    """For every convolution in the entry computation whose result reorders KERNEL's shape,
    how many instructions read it."""
    entry = hlo[hlo.index("\nENTRY"):]
    kernel_dims = sorted(KERNEL.shape)
    counts = []
    for name, dims in re.findall(r"%(\S+) = f32\[([\d,]+)\]\S* convolution\(", entry):
        shape = [int(d) for d in dims.split(",")]
        if sorted(shape) == kernel_dims and shape != list(KERNEL.shape):
            counts.append(len(re.findall(rf"%{re.escape(name)}[,)]", entry)))
    return counts


def _trainer_hlo() -> str:
    model = onnxtrain.make_training_model(conv_classifier(KERNEL, DENSE, size=9), loss="cross_entropy",
                                          optimizer=onnxtrain.optim.Adam(lr=1e-3))
    trainer = onnxtrain.Trainer(model, nan_policy="ignore")
    return trainer.lowered(FEEDS).compile().as_text()


def _finetuner_hlo() -> str:
    tuner = onnxtrain.finetune(conv_classifier(KERNEL, DENSE, size=9), "cross_entropy", optax.adam(1e-3))
    return tuner.lowered(FEEDS).compile().as_text()


@pytest.mark.parametrize("hlo", [_trainer_hlo, _finetuner_hlo], ids=["Trainer", "FineTuner"])
def test_kernel_gradients_are_read_once_by_the_optimizer(hlo):
    users = _kernel_gradient_users(hlo())
    assert users, "no kernel-gradient convolution found: the oracle no longer applies"
    assert users == [1] * len(users)


@pytest.mark.parametrize("nan_policy", ["ignore", "raise"])
def test_a_gradient_bound_to_state_as_it_is_updates_in_place(nan_policy):
    """A layout-pinned gradient that the step returns unchanged must still fill the donated
    buffer of the state variable it is bound to."""
    ours = onnxtrain.make_training_model(conv_classifier(KERNEL, DENSE, size=9), loss="cross_entropy",
                                         optimizer=onnxtrain.optim.SGD(lr=0.1))
    model = onnx.ModelProto.FromString(ours.SerializeToString())
    model.graph.initializer.append(numpy_helper.from_array(np.zeros_like(KERNEL), "C.last_grad"))
    info = model.training_info[0]
    info.algorithm.output.append(helper.make_tensor_value_info("C.grad", 1, list(KERNEL.shape)))
    binding = info.update_binding.add()
    binding.key, binding.value = "C.last_grad", "C.grad"
    trainer = onnxtrain.Trainer(model.SerializeToString(), nan_policy=nan_policy)
    for _ in range(2):
        trainer.step(FEEDS)
    weights = {name: np.asarray(trainer.state[name]) for name in ("C", "W")}
    expected = jax.grad(_loss)(weights)
    before = dict(weights)
    trainer.step(FEEDS)
    np.testing.assert_allclose(np.asarray(trainer.state["C.last_grad"]), expected["C"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(trainer.state["C"]), before["C"] - 0.1 * expected["C"], rtol=1e-4, atol=1e-6)


def _loss(weights):
    c = jax.lax.conv_general_dilated(FEEDS["x"], weights["C"], (1, 1), [(1, 1), (1, 1)])
    logits = jnp.maximum(c, 0).reshape(len(FEEDS["x"]), -1) @ weights["W"]
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), FEEDS["labels"][:, None], axis=1)
    return -jnp.mean(picked)
