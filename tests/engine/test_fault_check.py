"""The NaN/Inf check of checked steps (onnxtrain._engine.faults): one flag per step, the faulty
values named from the evidence.

Oracle: numpy's isfinite on each value. Values cover both ways into the evidence (reduced by a
matrix-vector product from DOT_CHECK_ELEMENTS on, copied below), every float type a state can
hold, and non-finite numbers at random places, including the last row and column.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain._engine.faults import DOT_CHECK_ELEMENTS, any_fault, check, first_fault

SHAPES = {"big": (160, 130), "big3d": (8, 40, 60), "small": (7, 11), "scalar": (), "empty": (0, 4), "vector": (300,)}
DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.complex64]
assert np.prod(SHAPES["big"]) >= DOT_CHECK_ELEMENTS > np.prod(SHAPES["small"])


def _values(rng, dtype, spoiled: dict[str, tuple[float, tuple[int, ...]]]) -> dict[str, np.ndarray]:
    """Finite values of every shape; `spoiled` puts a number (NaN, Inf, ...) at an index."""
    values = {name: np.asarray(rng.normal(size=shape)).astype(dtype) for name, shape in SHAPES.items()}
    for name, (number, index) in spoiled.items():
        values[name][index] = number
    return values


def _checked(values: dict[str, np.ndarray]):
    layout = {}

    def run(arrays):
        layout["value"], faults = check(list(arrays.items()))
        return faults

    return layout, jax.jit(run)({k: jnp.asarray(v) for k, v in values.items()})


def _expected(values: dict[str, np.ndarray]) -> list[str]:
    def finite(value):
        return np.isfinite(value if np.iscomplexobj(value) else value.astype(np.float64)).all()

    return [name for name, value in values.items() if not finite(value)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("seed", [0, *(pytest.param(seed, marks=pytest.mark.slow) for seed in range(1, 4))])
def test_the_faulty_values_are_named_exactly(dtype, seed):
    rng = np.random.default_rng(seed)
    numbers = [np.nan, np.inf, -np.inf] + ([complex(1, np.inf)] if dtype == np.complex64 else [])
    spoiled = {}
    for name in rng.choice([n for n in SHAPES if n != "empty"], size=3, replace=False):
        shape = SHAPES[name]
        last = rng.random() < 0.5
        index = tuple(size - 1 if last else int(rng.integers(size)) for size in shape)
        spoiled[str(name)] = (numbers[rng.integers(len(numbers))], index)
    values = _values(rng, dtype, spoiled)
    with jax.enable_x64(True):
        layout, faults = _checked(values)
        assert any_fault(faults)
        first, names = first_fault(faults, layout["value"])
    assert (first, sorted(names)) == (0, sorted(_expected(values)))
    assert sorted(_expected(values)) == sorted(spoiled)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_finite_values_pass(dtype):
    values = _values(np.random.default_rng(1), dtype, {})
    with jax.enable_x64(True):
        assert not any_fault(_checked(values)[1])


def test_huge_finite_float64_is_not_a_fault():
    """Finite float64 beyond float32's range must not turn into Inf on its way into the
    float32 evidence."""
    values = _values(np.random.default_rng(2), np.float64, {})
    values["small"][3, 3] = 1e300
    values["big"][5, 5] = -1e300
    with jax.enable_x64(True):
        assert not any_fault(_checked(values)[1])


def test_a_multi_step_call_names_its_first_faulty_step():
    """Faults stacked by a scan: the first faulty step and its values, not a later step's."""
    rng = np.random.default_rng(3)
    big = jnp.asarray(rng.normal(size=SHAPES["big"]).astype(np.float32))
    small = jnp.asarray(rng.normal(size=SHAPES["small"]).astype(np.float32))
    layout = {}

    def step(_, number):
        spoil_big = jnp.where(number == 2, jnp.nan, 1.0)
        spoil_small = jnp.where(number >= 3, jnp.inf, 1.0)
        layout["value"], faults = check([("big", big.at[-1, -1].multiply(spoil_big)),
                                         ("small", small.at[0, 0].multiply(spoil_small))])
        return None, faults

    _, faults = jax.jit(lambda: jax.lax.scan(step, None, jnp.arange(5)))()
    assert np.asarray(faults.flag).tolist() == [False, False, True, True, True]
    assert first_fault(faults, layout["value"]) == (2, ["big"])


def _kernels(hlo: str) -> int:
    entry = hlo[hlo.index("ENTRY"):]
    return sum(1 for op in re.findall(r"= \S+ ([\w-]+)\(", entry) if op not in ("parameter", "bitcast", "constant", "tuple"))


@pytest.mark.slow
def test_the_check_adds_a_kernel_per_big_value_and_three_in_all():
    """On XLA:CPU each kernel costs a launch per step and resident code: the checked step of
    an MLP adds one matrix-vector product per big watched value (weights and Adam moments of
    the 784x256 layer), then six: the zero vector, the copy of the small values, the
    reduction, the flag, and two where XLA splits the loss, which the check reads too, into
    more kernels. (Both steps write into spare buffers, so the difference is the check.)"""
    rng = np.random.default_rng(4)
    weights = {"W1": rng.normal(size=(784, 256)) * 0.05, "B1": np.zeros(256), "W2": rng.normal(size=(256, 10)) * 0.05,
               "B2": np.zeros(10)}
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Add", ["h", "B1"], ["hb"]),
         helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "W2"], ["o"]),
         helper.make_node("Add", ["o", "B2"], ["logits"])],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 784])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    model = onnxtrain.make_training_model(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9),
        loss="cross_entropy", optimizer=onnxtrain.optim.Adam(lr=1e-3))
    feeds = {"x": rng.normal(size=(16, 784)).astype(np.float32), "labels": rng.integers(0, 10, 16).astype(np.int64)}
    kernels = {}
    for policy in ("raise", "ignore"):
        trainer = onnxtrain.Trainer(model, nan_policy=policy)
        trainer.step(feeds)
        lowered = trainer.lowered(feeds)
        kernels[policy] = _kernels(lowered.compile().as_text())
    big_values = 3  # W1 and its two Adam moments
    assert kernels["raise"] - kernels["ignore"] <= big_values + 6, kernels
