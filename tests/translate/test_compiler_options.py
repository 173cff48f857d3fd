"""onnxtrain's programs compile with their own XLA:CPU options (translate/compiler_options.py).

The oracle is the compiled HLO. XLA marks a kernel it hands to YNNPACK as a fusion with
kind "__ynn_fusion". With XLA's defaults, YNNPACK takes dots, convolutions and reductions.
onnxtrain's programs must run convolutions on XLA's own kernels and leave the rest as it is.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

import onnxtrain
from onnxtrain.translate import compiler_options
from support.model_factory import conv_classifier

RNG = np.random.default_rng(0)
# Three input channels: a 1-channel conv would run as shifted slices, not a convolution op; 9x9
# images: a conv with few output positions would run as one matrix product. With XLA's
# defaults, YNNPACK takes a convolution from 32 output channels on.
WEIGHTS = {"C": RNG.normal(size=(32, 3, 3, 3)).astype(np.float32), "W": RNG.normal(size=(2592, 5)).astype(np.float32)}
FEEDS = {"x": RNG.normal(size=(8, 3, 9, 9)).astype(np.float32), "labels": RNG.integers(0, 5, 8).astype(np.int64)}


def _inference_model():
    return conv_classifier(WEIGHTS["C"], WEIGHTS["W"], size=9)


def _training_model():
    return onnxtrain.make_training_model(_inference_model(), loss="cross_entropy",
                                         optimizer=onnxtrain.optim.Adam(lr=0.01))


def _ynn_kernels(hlo: str) -> list[list[str]]:
    """The ops (but parameters and constants) inside each YNNPACK fusion of a compiled program."""
    kernels = []
    for called in re.findall(r"calls=(%[\w.\-]+).*__ynn_fusion", hlo):
        body = re.search(re.escape(called) + r" \(.*?\n\}", hlo, re.S).group(0)
        kernels.append(sorted(set(re.findall(r"= \S+ (\w+)\(", body)) - {"parameter", "constant"}))
    return sorted(kernels)


def _trainer_step_hlo(nan_policy: str) -> str:
    trainer = onnxtrain.Trainer(_training_model(), nan_policy=nan_policy)
    return trainer.lowered(FEEDS).compile().as_text()


def _finetuner_step_hlo() -> str:
    tuner = onnxtrain.finetune(_inference_model(), loss="cross_entropy")
    return tuner.lowered(FEEDS).compile().as_text()


def _forward_hlo() -> str:
    translated, params = onnxtrain.translate_model(_inference_model())
    with jax.enable_x64(True):
        return translated._jitted.lower(params, {"x": FEEDS["x"]}, None).compile().as_text()


@pytest.fixture
def options_available():
    if compiler_options.xla_compiler_options() is None:
        pytest.skip("this jaxlib's XLA:CPU has no YNNPACK fusion option")


@pytest.mark.slow
def test_the_options_take_convolutions_from_ynnpack_and_keep_its_dots_and_reductions(options_available):
    def convolve_multiply_reduce(x, kernel, a, b):
        return jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME"), a @ b, a.sum(axis=1)

    arguments = (np.ones((8, 16, 28, 28), np.float32), np.ones((32, 16, 3, 3), np.float32),
                 np.ones((64, 256), np.float32), np.ones((256, 32), np.float32))
    lowered = jax.jit(convolve_multiply_reduce).lower(*arguments)
    # Should a jaxlib change its defaults, this fails: the option replaces the default list.
    assert _ynn_kernels(lowered.compile().as_text()) == [["convolution"], ["dot"], ["reduce"]]
    ours = lowered.compile(compiler_options.xla_compiler_options()).as_text()
    assert _ynn_kernels(ours) == [["dot"], ["reduce"]]


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [lambda: _trainer_step_hlo("raise"), lambda: _trainer_step_hlo("ignore"),
                                      _finetuner_step_hlo, _forward_hlo],
                         ids=["trainer-raise", "trainer-ignore", "finetuner", "forward"])
def test_onnxtrain_programs_run_convolutions_on_xla_kernels(options_available, compiled):
    hlo = compiled()
    assert re.findall(r"= \S+ convolution\(", hlo)
    kernels = _ynn_kernels(hlo)
    assert not [ops for ops in kernels if "convolution" in ops]
    assert [ops for ops in kernels if "dot" in ops]


def test_a_users_xla_flags_setting_of_the_option_wins(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"--{compiler_options.YNN_FUSION_OPTION}=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT")
    compiler_options.xla_compiler_options.cache_clear()
    try:
        assert compiler_options.xla_compiler_options() is None
    finally:
        compiler_options.xla_compiler_options.cache_clear()


@pytest.mark.slow
def test_a_jaxlib_without_the_option_trains_with_xla_defaults(monkeypatch):
    expected = float(onnxtrain.Trainer(_training_model()).step(FEEDS)["loss"])
    monkeypatch.setattr(compiler_options, "YNN_FUSION_OPTION", "xla_cpu_option_no_jaxlib_has")
    compiler_options.xla_compiler_options.cache_clear()
    try:
        assert compiler_options.xla_compiler_options() is None
        assert float(onnxtrain.Trainer(_training_model()).step(FEEDS)["loss"]) == pytest.approx(expected, rel=1e-6)
    finally:
        compiler_options.xla_compiler_options.cache_clear()


def test_a_translated_model_runs_inside_a_callers_jit_and_vmap_where_jax_refuses_compiler_options():
    translated, params = onnxtrain.translate_model(_inference_model())
    x = FEEDS["x"]
    expected = np.asarray(translated(params, {"x": x})["logits"])
    traced = jax.jit(lambda x: translated(params, {"x": x})["logits"])(x)
    closure = jax.jit(lambda: translated(params, {"x": x})["logits"])()
    mapped = jax.vmap(lambda x: translated(params, {"x": x})["logits"])(x.reshape(2, 4, 3, 9, 9))
    # XLA's and YNNPACK's convolutions round differently.
    for result in (traced, closure, np.reshape(mapped, (8, 5))):
        np.testing.assert_allclose(result, expected, rtol=1e-4, atol=1e-4)
