"""Training steps compile with their own XLA:CPU options (see onnxtrain/compiler_options.py).

The oracle is the compiled HLO. XLA marks a kernel it hands to YNNPACK as a fusion with
kind "__ynn_fusion". Training steps must run their dots on XLA's own kernels and keep
YNNPACK for reductions. A forward pass alone, compiled with XLA's defaults, shows that the
same dots would otherwise go to YNNPACK.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import compiler_options

RNG = np.random.default_rng(0)
WEIGHTS = {"W1": RNG.normal(size=(12, 16)).astype(np.float32), "W2": RNG.normal(size=(16, 4)).astype(np.float32)}
FEEDS = {"x": RNG.normal(size=(8, 12)).astype(np.float32), "labels": RNG.integers(0, 4, 8).astype(np.int64)}


def _inference_model():
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W1"], ["h0"]), helper.make_node("Relu", ["h0"], ["h"]),
         helper.make_node("MatMul", ["h", "W2"], ["logits"])],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 12])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(v, k) for k, v in WEIGHTS.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _training_model():
    return onnxtrain.make_training_model(_inference_model(), loss="cross_entropy",
                                         optimizer=onnxtrain.optim.Adam(lr=0.01))


def _ynn_kernels(hlo: str) -> list[set[str]]:
    """The ops inside each YNNPACK fusion of a compiled program."""
    kernels = []
    for called in re.findall(r"calls=(%[\w.\-]+).*__ynn_fusion", hlo):
        body = re.search(re.escape(called) + r" \(.*?\n\}", hlo, re.S).group(0)
        kernels.append(set(re.findall(r"= \S+ (\w+)\(", body)) - {"parameter"})
    return kernels


def _trainer_step_hlo(nan_policy: str) -> str:
    trainer = onnxtrain.Trainer(_training_model(), nan_policy=nan_policy)
    program = trainer._steps[0]
    store = trainer._store
    spare = {name: store.values[name] for name, _ in program.bindings}
    with jax.enable_x64(True):
        arguments = ((store.values, program._key(store)) if nan_policy == "ignore"
                     else (store.values, spare, program._key(store)))
        return program._jitted.lower(*arguments, program.constants, program.check_feeds(FEEDS)).compile().as_text()


def _finetuner_step_hlo() -> str:
    tuner = onnxtrain.finetune(_inference_model(), loss="cross_entropy")
    with jax.enable_x64(True):
        return tuner._jitted.lower(tuner._store.values, None, tuner._inference.constants,
                                   tuner._check_feeds(FEEDS)).compile().as_text()


@pytest.fixture
def options_available():
    if compiler_options.training_compiler_options() is None:
        pytest.skip("this jaxlib's XLA:CPU has no YNNPACK fusion option")


def test_a_forward_pass_keeps_xla_defaults_which_give_dots_to_ynnpack(options_available):
    translated, params = onnxtrain.translate_model(_inference_model())
    with jax.enable_x64(True):
        hlo = translated._jitted.lower(params, {"x": FEEDS["x"]}, None).compile().as_text()
    assert sum("dot" in ops for ops in _ynn_kernels(hlo)) == 2


def test_the_options_keep_ynnpack_for_reductions_only(options_available):
    def dot_and_reduce(a, b):
        return a @ b, a.sum(axis=1)

    a, b = np.ones((64, 256), np.float32), np.ones((256, 32), np.float32)
    defaults = jax.jit(dot_and_reduce).lower(a, b).compile().as_text()
    ours = jax.jit(dot_and_reduce).lower(a, b).compile(compiler_options.training_compiler_options()).as_text()
    assert sorted(sorted(ops) for ops in _ynn_kernels(defaults)) == [["constant", "reduce"], ["dot"]]
    assert [sorted(ops) for ops in _ynn_kernels(ours)] == [["constant", "reduce"]]


@pytest.mark.parametrize("step_hlo", [lambda: _trainer_step_hlo("raise"), lambda: _trainer_step_hlo("ignore"),
                                      _finetuner_step_hlo], ids=["trainer-raise", "trainer-ignore", "finetuner"])
def test_training_steps_run_dots_on_xla_kernels(options_available, step_hlo):
    hlo = step_hlo()
    # Forward, weight-gradient and input-gradient products: all on XLA's own kernels.
    assert len(re.findall(r"= \S+ dot\(", hlo)) >= 3
    assert not [ops for ops in _ynn_kernels(hlo) if "dot" in ops]


def test_a_users_xla_flags_setting_of_the_option_wins(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"--{compiler_options.YNN_FUSION_OPTION}=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT")
    compiler_options.training_compiler_options.cache_clear()
    try:
        assert compiler_options.training_compiler_options() is None
    finally:
        compiler_options.training_compiler_options.cache_clear()


def test_a_jaxlib_without_the_option_trains_with_xla_defaults(monkeypatch):
    expected = float(onnxtrain.Trainer(_training_model()).step(FEEDS)["loss"])
    monkeypatch.setattr(compiler_options, "YNN_FUSION_OPTION", "xla_cpu_option_no_jaxlib_has")
    compiler_options.training_compiler_options.cache_clear()
    try:
        assert compiler_options.training_compiler_options() is None
        assert float(onnxtrain.Trainer(_training_model()).step(FEEDS)["loss"]) == pytest.approx(expected, rel=1e-6)
    finally:
        compiler_options.training_compiler_options.cache_clear()
