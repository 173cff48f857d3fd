"""Convolutions with few output positions, and grouped ones, run as one matrix product
(conv_by_patches).

XLA:CPU's own convolution is slow there: on a feature map smaller than the kernel (ResNet's
last stage on a 64x64 image) it swaps the operands into a convolution with a reversed
kernel, and its grouped convolution's gradients are slow on maps of every size. Oracles:
onnxruntime for values, central finite differences in float64 and torch autograd for
gradients, the compiled HLO for the lowering.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest

from onnxtrain.translate.ops.conv_pool import GROUPED_PATCHES_BYTES, PATCHES_LIMIT, WIDE_PAIRS, WIDE_PATCHES_LIMIT
from support.op_testing import finite_difference, jaxpr_equations, single_op_feeds, single_op_model, translate

CASES = {
    # ResNet-18's last stage on a 64x64 image: 3x3, pads 1, on 2x2.
    "smaller-than-kernel": ((2, 16, 2, 2), (16, 16, 3, 3), dict(pads=[1, 1, 1, 1])),
    "strided": ((2, 8, 4, 4), (12, 8, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    "1x1-strided": ((2, 8, 4, 4), (12, 8, 1, 1), dict(strides=[2, 2])),
    "grouped-dilated": ((1, 8, 5, 6), (6, 4, 2, 3), dict(group=2, dilations=[2, 1], pads=[1, 0, 0, 2])),
    "regnet-groups": ((2, 32, 3, 3), (32, 8, 3, 3), dict(group=4, pads=[1, 1, 1, 1])),
    # Grouped layers past PATCHES_LIMIT's 64 output positions.
    "grouped-large-map": ((2, 16, 12, 12), (16, 4, 3, 3), dict(group=4, pads=[1, 1, 1, 1])),
    "grouped-strided-1-d": ((1, 6, 81), (6, 2, 5), dict(group=3, strides=[1], pads=[2, 2])),
    "same-upper": ((1, 4, 5, 5), (3, 4, 4, 2), dict(auto_pad="SAME_UPPER", strides=[2, 1])),
    "1-d": ((3, 4, 9), (5, 4, 3), dict(strides=[2], pads=[1, 2])),
    "3-d": ((1, 3, 3, 4, 2), (4, 3, 2, 3, 2), dict(pads=[0, 1, 1, 1, 0, 0])),
    # Kernel positions that read only padding (left out of the derivatives' products).
    "map-of-one": ((2, 8, 1, 1), (6, 8, 3, 3), dict(pads=[1, 1, 1, 1])),
    "strided-to-one": ((2, 8, 2, 2), (6, 8, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1])),
    "gapped": ((1, 2, 1, 5), (3, 2, 3, 3), dict(strides=[3, 1], pads=[2, 1, 2, 1], dilations=[2, 1])),
    "all-padding": ((1, 2, 1, 1), (3, 2, 1, 1), dict(strides=[2, 2], pads=[1, 1, 0, 0])),
}


def _arrays(shape, kernel, dtype, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype), rng.standard_normal(kernel).astype(dtype),
            rng.standard_normal(kernel[0]).astype(dtype)]


def _program(inputs, **attributes) -> str:
    fn = translate(single_op_model("Conv", inputs, 22, **attributes))
    return jax.jit(lambda values: fn(fn.params, values)["Y0"]).lower(single_op_feeds(inputs)).compile().as_text()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.slow
def test_small_convolutions_match_onnxruntime_without_a_convolution_op(case):
    import onnxruntime

    shape, kernel, attributes = CASES[case]
    inputs = _arrays(shape, kernel, np.float32, list(map(ord, case)))
    model = single_op_model("Conv", inputs, 22, **attributes)
    model.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, single_op_feeds(inputs))
    fn = translate(model)
    actual = np.asarray(fn(fn.params, single_op_feeds(inputs))["Y0"])
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
    assert " convolution(" not in _program(inputs, **attributes)


@pytest.mark.parametrize("case", ["smaller-than-kernel", "grouped-dilated", "same-upper", "1-d", "3-d", "map-of-one",
                                  "gapped", "grouped-strided-1-d"])
@pytest.mark.parametrize("wrt", [0, 1, 2], ids=["input", "weights", "bias"])
@pytest.mark.slow
def test_small_convolution_gradients_match_finite_differences(case, wrt):
    shape, kernel, attributes = CASES[case]
    if case == "smaller-than-kernel":
        shape, kernel = (1, 3, 2, 2), (4, 3, 3, 3)
    inputs = _arrays(shape, kernel, np.float64, [wrt, *map(ord, case)])
    with jax.enable_x64(True):
        fn = translate(single_op_model("Conv", inputs, 22, **attributes))
        values = single_op_feeds(inputs)
        y = np.asarray(fn(fn.params, values)["Y0"])
        cotangent = np.random.default_rng(len(case)).standard_normal(y.shape)

        @jax.jit
        def objective(x):
            return jnp.sum(fn.apply(fn.params, {**values, f"X{wrt}": x})["Y0"] * cotangent)

        analytic = np.asarray(jax.grad(objective)(jnp.asarray(inputs[wrt])))
        numeric = finite_difference(lambda x: float(objective(x)), inputs[wrt])
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-7)


def test_the_patches_limit_is_on_output_positions_per_image():
    """8x8 outputs (the limit) run as a product, 9x9 on XLA's convolution; half precision
    keeps the library convolution, whose wider accumulation a product in half would lose."""
    assert PATCHES_LIMIT == 64
    kernel = np.ones((4, 8, 3, 3), np.float32)
    at_limit = [np.ones((2, 8, 8, 8), np.float32), kernel]
    above = [np.ones((2, 8, 9, 9), np.float32), kernel]
    half = [a.astype(np.float16) for a in at_limit]
    assert " convolution(" not in _program(at_limit, pads=[1, 1, 1, 1])
    assert " convolution(" in _program(above, pads=[1, 1, 1, 1])
    assert " convolution(" in _program(half, pads=[1, 1, 1, 1])


def test_wide_layers_use_products_on_smaller_maps_only():
    """A dense layer with a 3x3 kernel over 16 channels (144 pairs) runs as a product on 4x4
    outputs and on XLA's convolution from 5x5; with 8 channels (72 pairs), in 2 groups, or
    with a 1x1 kernel, the general limit holds."""
    assert (WIDE_PATCHES_LIMIT, WIDE_PAIRS) == (16, 128)
    pads = dict(pads=[1, 1, 1, 1])
    wide = np.ones((4, 16, 3, 3), np.float32)
    assert " convolution(" not in _program([np.ones((2, 16, 4, 4), np.float32), wide], **pads)
    assert " convolution(" in _program([np.ones((2, 16, 5, 5), np.float32), wide], **pads)
    narrow = np.ones((4, 8, 3, 3), np.float32)
    assert " convolution(" not in _program([np.ones((2, 8, 6, 6), np.float32), narrow], **pads)
    grouped = np.ones((4, 16, 3, 3), np.float32)
    assert " convolution(" not in _program([np.ones((2, 32, 6, 6), np.float32), grouped], group=2, **pads)
    pointwise = np.ones((4, 256, 1, 1), np.float32)
    assert " convolution(" not in _program([np.ones((2, 256, 6, 6), np.float32), pointwise])


def test_grouped_layers_use_products_on_maps_of_any_size_within_a_memory_bound():
    """A grouped 3x3 layer on a 32x32 map (1024 output positions) runs as a product; one whose
    patches (kernel positions x input) would pass GROUPED_PATCHES_BYTES, or in half
    precision, on XLA's grouped convolution."""
    assert GROUPED_PATCHES_BYTES == 1 << 28
    grouped = np.ones((16, 4, 3, 3), np.float32)
    large_map = [np.ones((2, 16, 32, 32), np.float32), grouped]
    assert " convolution(" not in _program(large_map, group=4, pads=[1, 1, 1, 1])
    assert " convolution(" in _program([a.astype(np.float16) for a in large_map], group=4, pads=[1, 1, 1, 1])
    # 128 kernel positions x (1, 64, 8193) float32 inputs: 268 MB of patches, just past the bound.
    long_kernel = [np.ones((1, 64, 8193), np.float32), np.ones((64, 4, 128), np.float32)]
    assert 128 * 64 * 8193 * 4 > GROUPED_PATCHES_BYTES > 128 * 64 * 8000 * 4
    assert " convolution(" in _program(long_kernel, group=16, pads=[64, 63])
    shorter = [np.ones((1, 64, 8000), np.float32), long_kernel[1]]
    assert " convolution(" not in _program(shorter, group=16, pads=[64, 63])


@pytest.mark.parametrize("strides", [1, 2])
@pytest.mark.slow
def test_grouped_layer_gradients_on_a_large_map_match_torch_autograd(strides):
    """RegNet's grouped bottleneck layer (8 channels per group, 3x3) on a 16x16 map, as one
    product: value and gradients against torch's grouped convolution in float64."""
    torch = pytest.importorskip("torch")
    x, w, b = _arrays((2, 24, 16, 16), (24, 8, 3, 3), np.float64, strides)
    attributes = dict(group=3, strides=[strides, strides], pads=[1, 1, 1, 1])
    with jax.enable_x64(True):
        fn = translate(single_op_model("Conv", [x, w, b], 22, **attributes))

        def loss(x, w, b):
            return jnp.sum(jnp.tanh(fn.apply(fn.params, {"X0": x, "X1": w, "X2": b})["Y0"]))

        value, gradients = jax.value_and_grad(loss, (0, 1, 2))(x, w, b)
        assert " convolution(" not in jax.jit(loss).lower(x, w, b).compile().as_text()
    tensors = [torch.tensor(a, requires_grad=True) for a in (x, w, b)]
    expected = torch.tanh(torch.nn.functional.conv2d(*tensors, stride=strides, padding=1, groups=3)).sum()
    expected.backward()
    np.testing.assert_allclose(float(value), expected.item(), rtol=1e-12)
    for actual, tensor in zip(gradients, tensors):
        np.testing.assert_allclose(np.asarray(actual), tensor.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_derivatives_leave_out_kernel_positions_reading_only_padding():
    """A 3x3 layer padded by 1 on a 1x1 map (ResNet's last stage on a 32x32 image) reads the
    input at the kernel's centre only. The forward product takes all nine positions (the
    weights as they lie); the derivative's product, and so the gradients, one."""
    inputs = _arrays((2, 64, 1, 1), (32, 64, 3, 3), np.float32, 0)
    fn = translate(single_op_model("Conv", inputs, 22, pads=[1, 1, 1, 1]))
    feeds = single_op_feeds(inputs)

    def forward(w):
        return fn.apply(fn.params, {**feeds, "X1": w})["Y0"]

    _, derivative = jax.linearize(forward, jnp.asarray(inputs[1]))
    assert _contracted(jax.make_jaxpr(forward)(inputs[1])) == [64 * 9]
    assert _contracted(jax.make_jaxpr(derivative)(inputs[1])) == [64]


def _contracted(jaxpr) -> list[int]:
    """The contracted size of every matrix product in a jaxpr."""
    sizes = []
    for equation in jaxpr_equations(jaxpr.jaxpr):
        if equation.primitive.name == "dot_general":
            (axes, _), _ = equation.params["dimension_numbers"]
            sizes.append(math.prod(equation.invars[0].aval.shape[axis] for axis in axes))
    return sizes


@pytest.mark.slow
def test_the_training_step_of_a_last_stage_has_no_swapped_convolution():
    """Forward and both gradients of a 3x3 layer on a 2x2 map compile to products, with no
    convolution and no reversed kernel (what XLA's operand swap leaves behind)."""
    x, w, b = _arrays((4, 64, 2, 2), (64, 64, 3, 3), np.float32, 0)
    fn = translate(single_op_model("Conv", [x, w, b], 22, pads=[1, 1, 1, 1]))

    def loss(w, b, x):
        return jnp.sum(jnp.tanh(fn.apply(fn.params, {"X0": x, "X1": w, "X2": b})["Y0"]))

    program = jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(w, b, x).compile().as_text()
    assert " convolution(" not in program and " reverse(" not in program
    assert " dot(" in program


@pytest.mark.parametrize("case", ["plain", "strided", "padded"])
@pytest.mark.slow
def test_pointwise_layer_gradients_on_a_large_map_are_products_matching_torch_autograd(case):
    """A 1x1 layer on a 20x20 map (past PATCHES_LIMIT) keeps XLA's convolution for its value
    and takes products for both gradients: value and gradients against torch in float64."""
    torch = pytest.importorskip("torch")
    strides, pads = {"plain": (1, 0), "strided": (2, 0), "padded": (1, 1)}[case]
    x, w, b = _arrays((2, 16, 20, 20), (24, 16, 1, 1), np.float64, len(case))
    attributes = dict(strides=[strides, strides], pads=[pads] * 4)
    with jax.enable_x64(True):
        fn = translate(single_op_model("Conv", [x, w, b], 22, **attributes))

        def loss(x, w, b):
            return jnp.sum(jnp.tanh(fn.apply(fn.params, {"X0": x, "X1": w, "X2": b})["Y0"]))

        value, gradients = jax.value_and_grad(loss, (0, 1, 2))(x, w, b)
        assert jax.jit(loss).lower(x, w, b).compile().as_text().count(" convolution(") == 1
        step = jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(x, w, b).compile().as_text()
        assert step.count(" convolution(") == 1
    tensors = [torch.tensor(a, requires_grad=True) for a in (x, w, b)]
    expected = torch.tanh(torch.nn.functional.conv2d(*tensors, stride=strides, padding=pads)).sum()
    expected.backward()
    np.testing.assert_allclose(float(value), expected.item(), rtol=1e-12)
    for actual, tensor in zip(gradients, tensors):
        np.testing.assert_allclose(np.asarray(actual), tensor.grad.numpy(), rtol=1e-10, atol=1e-12)
