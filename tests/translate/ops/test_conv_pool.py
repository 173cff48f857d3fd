"""Convolution, pooling and image ops: behaviour the ONNX backend cases miss.

Oracles: onnx.reference.ReferenceEvaluator, onnxruntime (for the opset-7..10
Upsample/Resize forms the reference evaluator cannot run), numpy, hand-derived
values, and central finite differences in float64 for gradients.
"""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxtrain
from onnxtrain.errors import ModelLoadError
from onnxtrain.translate.model import TranslatedModel
from onnxtrain.translate.ops.conv_pool import TAPS_LIMIT, Window, conv_by_taps, depthwise_conv, library_conv

RNG = np.random.default_rng(0)


class Const:
    """An input fed by a Constant node: a host constant (shapes, scales, sizes...)."""

    def __init__(self, value: np.ndarray):
        self.value = value


def make_model(op_type: str, inputs: list, opset: int, outputs: int = 1, ir_version: int | None = None,
               output_dtypes: tuple = (), **attributes) -> onnx.ModelProto:
    """One `op_type` node reading X0, X1...: arrays are graph inputs, Const are Constant nodes,
    None leaves that input out. Outputs are typed output_dtypes, else like the first input."""
    names, nodes, graph_inputs = [], [], []
    for i, value in enumerate(inputs):
        name = "" if value is None else f"X{i}"
        names.append(name)
        if isinstance(value, Const):
            nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value.value)))
        elif value is not None:
            graph_inputs.append(helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape))
    while names and not names[-1]:
        names.pop()
    output_names = [f"Y{i}" for i in range(outputs)]
    nodes.append(helper.make_node(op_type, names, output_names, **attributes))
    first = next(v for v in inputs if isinstance(v, np.ndarray))
    dtypes = list(output_dtypes) or [first.dtype] * outputs
    graph = helper.make_graph(nodes, op_type, graph_inputs, [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(t)), None)
        for n, t in zip(output_names, dtypes)])
    extra = {} if ir_version is None else {"ir_version": ir_version}
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], **extra)


def feeds(inputs: list) -> dict[str, np.ndarray]:
    return {f"X{i}": v for i, v in enumerate(inputs) if isinstance(v, np.ndarray)}


def translated(op_type: str, inputs: list, opset: int, outputs: int = 1, **attributes) -> TranslatedModel:
    return TranslatedModel(onnxtrain.load_model(make_model(op_type, inputs, opset, outputs, **attributes)))


def run(op_type: str, inputs: list, opset: int = 22, outputs: int = 1, **attributes) -> list[np.ndarray]:
    fn = translated(op_type, inputs, opset, outputs, **attributes)
    result = fn(fn.params, feeds(inputs))
    return [np.asarray(result[f"Y{i}"]) for i in range(outputs)]


def reference(op_type: str, inputs: list, opset: int = 22, outputs: int = 1, **attributes) -> list:
    model = make_model(op_type, inputs, opset, outputs, **attributes)
    return ReferenceEvaluator(model).run(None, feeds(inputs))


def onnxruntime_run(op_type: str, inputs: list, opset: int, outputs: int = 1, output_dtypes: tuple = (),
                    **attributes) -> list[np.ndarray]:
    import onnxruntime

    model = make_model(op_type, inputs, opset, outputs, ir_version=8, output_dtypes=output_dtypes,
                       **attributes)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds(inputs))


def assert_matches_reference(op_type: str, inputs: list, opset: int = 22, outputs: int = 1,
                             rtol: float = 1e-5, atol: float = 1e-6, **attributes) -> None:
    expected = reference(op_type, inputs, opset, outputs, **attributes)
    actual = run(op_type, inputs, opset, outputs, **attributes)
    for e, a in zip(expected, actual):
        assert a.shape == e.shape and a.dtype == e.dtype, f"{a.shape} {a.dtype} != {e.shape} {e.dtype}"
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def gradient(op_type: str, inputs: list, wrt: int, opset: int = 22, rng: np.random.Generator = RNG, **attributes):
    """d sum(Y * cotangent) / d input[wrt] by jax.grad, and by central differences (float64)."""
    fn = translated(op_type, inputs, opset, **attributes)
    values = feeds(inputs)
    name = f"X{wrt}"
    cotangent = rng.standard_normal(np.shape(fn(fn.params, values)["Y0"]))

    @jax.jit
    def objective(x):
        return jnp.sum(fn.apply(fn.params, {**values, name: x})["Y0"] * cotangent)

    numeric = np.zeros_like(values[name])
    step = 1e-6
    with jax.enable_x64(True):
        analytic = np.asarray(jax.grad(objective)(jnp.asarray(values[name])))
        for index in np.ndindex(values[name].shape):
            plus, minus = values[name].copy(), values[name].copy()
            plus[index] += step
            minus[index] -= step
            numeric[index] = (float(objective(plus)) - float(objective(minus))) / (2 * step)
    return analytic, numeric


# --- Conv and ConvTranspose ------------------------------------------------------------------

@pytest.mark.parametrize("shape, kernel, attributes", [
    ((1, 4, 11), (6, 2, 3), dict(group=2, strides=[2], dilations=[2], auto_pad="SAME_LOWER")),
    ((2, 2, 7, 6), (4, 2, 3, 2), dict(strides=[2, 3], auto_pad="SAME_UPPER")),
    ((1, 3, 9, 8), (3, 1, 3, 3), dict(group=3, pads=[2, 0, 1, 3], dilations=[2, 1])),
    ((1, 2, 5, 6, 7), (4, 2, 2, 3, 2), dict(auto_pad="VALID", strides=[1, 2, 3])),
    ((2, 3, 8, 9), (6, 1, 5, 5), dict(group=3, strides=[2, 1], pads=[2, 1, 2, 3])),  # depthwise x2, 5x5
    ((1, 4, 7, 6, 5), (4, 1, 3, 2, 3), dict(group=4, dilations=[1, 2, 1], auto_pad="SAME_UPPER")),
])
def test_conv_padding_groups_and_dilations_match_reference(shape, kernel, attributes):
    x = RNG.standard_normal(shape).astype(np.float32)
    w = RNG.standard_normal(kernel).astype(np.float32)
    b = RNG.standard_normal(kernel[0]).astype(np.float32)
    assert_matches_reference("Conv", [x, w, b], **attributes)


@pytest.mark.slow
def test_conv_gradients_match_finite_differences():
    x = RNG.standard_normal((1, 2, 5, 4))
    w = RNG.standard_normal((4, 1, 2, 3))
    for wrt in (0, 1):
        analytic, numeric = gradient("Conv", [x, w], wrt, group=2, strides=[2, 1], pads=[1, 1, 0, 2])
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.slow
@pytest.mark.parametrize("shape, kernel, group, window", [
    ((2, 1, 9, 8), (5, 1, 3, 3), 1, ((1, 1), (1, 1), ((1, 1), (1, 1)))),
    ((1, 2, 9, 10), (4, 2, 3, 3), 1, ((2, 1), (1, 2), ((2, 0), (1, 3)))),
    ((1, 3, 8, 7), (6, 1, 3, 3), 3, ((1, 2), (1, 1), ((0, 1), (1, 1)))),  # depthwise, multiplier 2
    ((1, 4, 11), (6, 2, 3), 2, ((2,), (2,), ((1, 2),))),
    ((1, 1, 4, 5, 6), (2, 1, 2, 2, 2), 1, ((1, 2, 1), (1, 1, 2), ((0, 1), (1, 0), (1, 1)))),
])
def test_conv_by_taps_matches_the_library_convolution_in_every_mode(shape, kernel, group, window):
    """The few-channel lowering against lax's convolution (an independent implementation):
    values, reverse and forward derivatives, and second derivatives, in float64."""
    strides, dilations, pads = window
    window = Window(tuple(kernel[2:]), strides, dilations, pads)
    assert kernel[1] * np.prod(kernel[2:]) <= TAPS_LIMIT
    with jax.enable_x64(True):
        x, w = RNG.standard_normal(shape), RNG.standard_normal(kernel)
        taps, library = (lambda a, b: conv_by_taps(a, b, window, group)), (lambda a, b: library_conv(a, b, window, group))
        np.testing.assert_allclose(taps(x, w), library(x, w), rtol=1e-12, atol=1e-12)
        cotangent = RNG.standard_normal(library(x, w).shape)
        for argnums in (0, 1, (0, 1)):
            grads = [jax.grad(lambda a, b, f=f: jnp.sum(jnp.sin(f(a, b)) * cotangent), argnums)(x, w)
                     for f in (taps, library)]
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12), *grads)
        dx, dw = RNG.standard_normal(shape), RNG.standard_normal(kernel)
        tangents = [jax.jvp(f, (x, w), (dx, dw))[1] for f in (taps, library)]
        np.testing.assert_allclose(*tangents, rtol=1e-10, atol=1e-12)
        hessians = [jax.hessian(lambda b, f=f: jnp.sum(jnp.tanh(f(x, b))))(w) for f in (taps, library)]
        np.testing.assert_allclose(*hessians, rtol=1e-9, atol=1e-12)


DEPTHWISE_WINDOWS = [
    ((2, 3, 9, 8), Window((3, 3), (1, 1), (1, 1), ((1, 1), (1, 1)))),
    ((1, 4, 9, 10), Window((3, 2), (2, 1), (1, 2), ((2, 0), (1, 3)))),
    ((2, 2, 11), Window((3,), (2,), (2,), ((1, 2),))),
    ((1, 2, 4, 5, 6), Window((2, 2, 2), (1, 2, 1), (1, 1, 2), ((0, 1), (1, 0), (1, 1)))),
    ((1, 2, 7, 6), Window((5, 5), (1, 1), (1, 1), ((2, 2), (2, 2)))),
]


@pytest.mark.slow
@pytest.mark.parametrize("shape, window", DEPTHWISE_WINDOWS)
def test_depthwise_convolution_matches_the_library_convolution_in_every_mode(shape, window):
    """The depthwise primitive against lax's grouped convolution, in float64: values (eager
    and jitted), reverse derivatives (its own weight gradient), forward derivatives, second
    derivatives (Hessians in x and in w, a gradient of a gradient), and vmap over inputs,
    weights or both, with per-example gradients."""
    channels = shape[1]
    with jax.enable_x64(True):
        x, w = RNG.standard_normal(shape), RNG.standard_normal((channels, 1, *window.kernel))
        cotangent = RNG.standard_normal(library_conv(x, w, window, channels).shape)
        dx, dw = RNG.standard_normal(shape), RNG.standard_normal(w.shape)
        xs, ws = RNG.standard_normal((3, *shape)), RNG.standard_normal((3, *w.shape))
        ours = lambda a, b: depthwise_conv(a, b, window)  # noqa: E731
        library = lambda a, b: library_conv(a, b, window, channels)  # noqa: E731
        np.testing.assert_allclose(ours(x, w), library(x, w), rtol=1e-12, atol=1e-12)

        @jax.jit
        def every_mode(x, w, dx, dw, xs, ws):
            results = []
            for conv in (ours, library):
                results.append([
                    conv(x, w),
                    *(jax.grad(lambda a, b: jnp.sum(jnp.sin(conv(a, b)) * cotangent), argnums)(x, w)
                      for argnums in (0, 1, (0, 1))),
                    jax.jvp(conv, (x, w), (dx, dw))[1],
                    *(jax.hessian(lambda a, b: jnp.sum(jnp.tanh(conv(a, b))), argnum)(x, w) for argnum in (0, 1)),
                    jax.grad(lambda b: jnp.sum(jax.grad(lambda a: jnp.sum(jnp.tanh(conv(a, b))))(x) ** 2))(w),
                    *(jax.vmap(conv, in_axes=axes)(xs if axes[0] == 0 else x, ws if axes[1] == 0 else w)
                      for axes in ((0, None), (None, 0), (0, 0))),
                    *(jax.vmap(jax.grad(lambda a, b: jnp.sum(jnp.sin(conv(a, b))), (0, 1)), in_axes=axes)(
                        xs if axes[0] == 0 else x, ws if axes[1] == 0 else w)
                      for axes in ((0, None), (None, 0), (0, 0))),
                ])
            return results

        mine, theirs = every_mode(x, w, dx, dw, xs, ws)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12), mine, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("channels, multiplier, kernel", [(4, 1, 3), (3, 2, 3), (2, 1, 5)])
def test_depthwise_convolutions_train_without_a_library_convolution(channels, multiplier, kernel):
    """A depthwise Conv node (group = input channels, any multiplier and kernel size) runs
    forward and backward with no convolution op, the weight gradient as one reduction over
    every tap; gradients match central finite differences."""
    # Its own generator: the draws must not depend on which tests ran before (-m, -k, xdist).
    rng = np.random.default_rng([channels, multiplier, kernel])
    x = rng.standard_normal((2, channels, 7, 6))
    w = rng.standard_normal((channels * multiplier, 1, kernel, kernel))
    single = x.astype(np.float32), w.astype(np.float32)
    translated = TranslatedModel(make_model("Conv", list(single), 17, group=channels, pads=[kernel // 2] * 4))

    def loss(a, b):
        return jnp.sum(jnp.tanh(translated({}, {"X0": a, "X1": b}, None)["Y0"]))

    program = str(jax.jit(jax.grad(loss, (0, 1))).lower(*single).as_text())
    assert "convolution" not in program
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, 1))(*single))
    assert jaxpr.count(" reduce[") == 1 and "reduce_sum" not in jaxpr.split(" reduce[")[1].split("\n")[0]
    for wrt in (0, 1):
        analytic, numeric = gradient("Conv", [x, w], wrt, rng=rng, group=channels, pads=[kernel // 2] * 4)
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)


def test_few_channel_convolutions_are_lowered_by_taps():
    """Float 1-channel 3x3 convolutions take the taps path (no convolution in the program);
    wide or half-precision ones keep the library convolution (wide ones on images too large
    for conv_by_patches)."""
    def lowered(x, w):
        model = make_model("Conv", [x, w], 17, pads=[1, 1, 1, 1])
        translated = TranslatedModel(model)
        return str(jax.jit(lambda: translated({}, {"X0": x, "X1": w}, None)).lower().as_text())

    narrow = np.ones((2, 1, 6, 6), np.float32), np.ones((4, 1, 3, 3), np.float32)
    wide = np.ones((2, 8, 9, 9), np.float32), np.ones((4, 8, 3, 3), np.float32)
    half = tuple(a.astype(np.float16) for a in narrow)
    assert "convolution" not in lowered(*narrow)
    assert "convolution" in lowered(*wide)
    assert "convolution" in lowered(*half)


def test_the_taps_loop_reads_each_weight_vector_contiguously():
    """The fused loop of a taps convolution takes its weights as one (taps, out_channels) array,
    not as slices of the (O, 1, 3, 3) weights, whose vectors are strided (weights_by_tap). A
    change in XLA that folds the copy away fails here; re-measure the forward CNN then."""
    program = _compiled_conv(np.ones((2, 1, 6, 6), np.float32), np.ones((5, 1, 3, 3), np.float32), pads=[1, 1, 1, 1])
    loops = [body.strip() for body in program.split("\n\n") if "multiply(" in body]
    assert loops and all(re.search(r"f32\[9,5(,1)?\]", body.splitlines()[0]) for body in loops)
    assert all("f32[5,1,3,3]" not in body for body in loops)


def test_taps_weights_take_one_kernel_whatever_the_kernel_size():
    """weights_by_tap lays every tap's weight vector out in one gather, so a taps convolution
    compiles the same kernels for a 3x3 as for a 7x7 window (a kernel per tap would add
    40 launches and compilations)."""
    def kernels(size):
        program = _compiled_conv(np.ones((2, 4, 9, 9), np.float32), np.ones((4, 1, size, size), np.float32),
                                 group=4, pads=[size // 2] * 4)
        entry = program[program.index("ENTRY"):]
        return entry.count(" fusion(") + entry.count(" concatenate(")

    assert kernels(7) == kernels(3) <= 3


def _compiled_conv(x: np.ndarray, w: np.ndarray, **attributes) -> str:
    """The compiled program (XLA's HLO text) of one Conv node on x and w."""
    translated = TranslatedModel(make_model("Conv", [x, w], 17, **attributes))
    return jax.jit(lambda a, b: translated({}, {"X0": a, "X1": b}, None)).lower(x, w).compile().as_text()


def test_conv_rejects_unknown_auto_pad_and_channel_mismatch():
    x = np.zeros((1, 4, 5, 5), np.float32)
    with pytest.raises(ModelLoadError, match="auto_pad"):
        run("Conv", [x, np.zeros((2, 4, 3, 3), np.float32)], auto_pad="SAME")
    with pytest.raises(ModelLoadError, match="channels"):
        run("Conv", [x, np.zeros((2, 3, 3, 3), np.float32)])


def test_grouped_conv_transpose_is_per_group_conv_transpose():
    # The reference evaluator mishandles groups, so the oracle runs each group on its own.
    x = RNG.standard_normal((1, 4, 3, 4)).astype(np.float32)
    w = RNG.standard_normal((4, 3, 3, 2)).astype(np.float32)
    attributes = dict(strides=[2, 3], dilations=[2, 1], output_padding=[1, 2], pads=[1, 0, 2, 1])
    (y,) = run("ConvTranspose", [x, w], group=2, **attributes)
    expected = np.concatenate([reference("ConvTranspose", [x[:, 2 * g:2 * g + 2], w[2 * g:2 * g + 2]],
                                         **attributes)[0] for g in range(2)], axis=1)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape, kernel, attributes", [
    ((1, 2, 4, 3), (2, 3, 3, 3), dict(strides=[2, 2], output_shape=[9, 8], auto_pad="SAME_LOWER")),
    ((1, 2, 4, 3), (2, 3, 3, 3), dict(strides=[2, 2], auto_pad="SAME_LOWER")),
    ((2, 3, 5), (3, 2, 4), dict(strides=[3], output_shape=[17])),
])
def test_conv_transpose_matches_reference(shape, kernel, attributes):
    x = RNG.standard_normal(shape).astype(np.float32)
    w = RNG.standard_normal(kernel).astype(np.float32)
    assert_matches_reference("ConvTranspose", [x, w], **attributes)


def test_conv_transpose_gradient_matches_finite_differences():
    x = RNG.standard_normal((1, 2, 3, 2))
    w = RNG.standard_normal((2, 2, 2, 3))
    analytic, numeric = gradient("ConvTranspose", [x, w], 0, strides=[2, 2], pads=[1, 0, 0, 1])
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)


def test_deform_conv_groups_offset_groups_and_mask_match_reference():
    x = RNG.standard_normal((2, 4, 6, 5)).astype(np.float32)
    w = RNG.standard_normal((6, 2, 2, 3)).astype(np.float32)
    offset = (2 * RNG.standard_normal((2, 2 * 6 * 2, 3, 4))).astype(np.float32)
    b = RNG.standard_normal(6).astype(np.float32)
    mask = RNG.uniform(0, 1, (2, 2 * 6, 3, 4)).astype(np.float32)
    assert_matches_reference("DeformConv", [x, w, offset, b, mask], group=2, offset_group=2,
                             strides=[2, 1], dilations=[1, 2], pads=[1, 1, 0, 2], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_deform_conv_offset_gradient_matches_finite_differences():
    x = RNG.standard_normal((1, 1, 4, 4))
    w = RNG.standard_normal((1, 1, 2, 2))
    offset = RNG.uniform(-0.8, 0.8, (1, 8, 3, 3)) + 0.1  # away from integer kinks
    analytic, numeric = gradient("DeformConv", [x, w, offset], 2)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-7)


def causal_conv_oracle(x, w, b, past, silu):
    padded = np.concatenate([past, x], axis=2)
    k = w.shape[2]
    y = np.stack([np.sum(padded[:, :, t:t + k] * w[None, :, 0, :], axis=2)
                  for t in range(x.shape[2])], axis=2) + b[None, :, None]
    if silu:
        y = y / (1 + np.exp(-y))
    return y, padded[:, :, padded.shape[2] - (k - 1):]


@pytest.mark.parametrize("activation", ["none", "silu"])
def test_causal_conv_with_state_matches_numpy_and_streams(activation):
    x = RNG.standard_normal((2, 3, 7)).astype(np.float32)
    w = RNG.standard_normal((3, 1, 4)).astype(np.float32)
    b = RNG.standard_normal(3).astype(np.float32)
    past = RNG.standard_normal((2, 3, 3)).astype(np.float32)
    y, state = run("CausalConvWithState", [x, w, b, past], opset=27, outputs=2, activation=activation)
    expected_y, expected_state = causal_conv_oracle(x, w, b, past, activation == "silu")
    np.testing.assert_allclose(y, expected_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(state, expected_state)
    # Two chunks with the state carried over give the same output as one pass.
    first, carry = run("CausalConvWithState", [x[:, :, :2], w, b, past], opset=27, outputs=2,
                       activation=activation)
    second, final = run("CausalConvWithState", [x[:, :, 2:], w, b, carry], opset=27, outputs=2,
                        activation=activation)
    np.testing.assert_allclose(np.concatenate([first, second], axis=2), y, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(final, state)


# --- pooling ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_max_pool_tiling_uses_strided_slices_with_exact_gradient():
    x = RNG.permutation(2 * 3 * 8 * 6).reshape(2, 3, 8, 6).astype(np.float32)
    fn = translated("MaxPool", [x], 22, kernel_shape=[2, 3], strides=[2, 3])
    y = np.asarray(fn(fn.params, {"X0": x})["Y0"])
    windows = x.reshape(2, 3, 4, 2, 2, 3)
    np.testing.assert_array_equal(y, windows.max(axis=(3, 5)))
    with jax.enable_x64(True):
        program = str(jax.make_jaxpr(lambda v: fn.apply(fn.params, {"X0": v}))(x))
        grad = np.asarray(jax.grad(lambda v: fn.apply(fn.params, {"X0": v})["Y0"].sum())(x))
    assert "reduce_window" not in program
    expected = (windows == windows.max(axis=(3, 5), keepdims=True)).astype(np.float32)
    np.testing.assert_array_equal(grad, expected.reshape(x.shape))


@pytest.mark.slow
def test_max_pool_tiling_gradient_goes_to_each_windows_first_maximum():
    """With ties (ReLU's zeros, saturated values) each window's whole gradient goes to its first
    maximum, as PyTorch and ONNX Runtime route it; the oracles are hand-derived positions and
    MaxPool's own Indices output. Forward mode is the transpose of reverse mode."""
    x = np.array([[[[1, 1, 0, 2, 5, 5, 0],
                    [1, 0, 2, 2, 5, 5, 9]],
                   [[0, 0, 3, 1, 7, 7, 0],
                    [0, 0, 3, 3, 6, 7, 0]]]], np.float32)
    attributes = dict(kernel_shape=[2, 2], strides=[2, 2])
    fn = translated("MaxPool", [x], 22, **attributes)

    def pool(v):
        return fn.apply(fn.params, {"X0": v})["Y0"]

    cotangent = np.array([[[[1, 2, 3]], [[4, 5, 6]]]], np.float32)
    (grad,) = jax.vjp(pool, x)[1](cotangent)
    expected = np.zeros_like(x)
    for channel, row, column, value in [(0, 0, 0, 1), (0, 0, 3, 2), (0, 0, 4, 3),
                                        (1, 0, 0, 4), (1, 0, 2, 5), (1, 0, 4, 6)]:
        expected[0, channel, row, column] = value
    np.testing.assert_array_equal(grad, expected)
    _, indices = run("MaxPool", [x], outputs=2, **attributes)
    np.testing.assert_array_equal(np.flatnonzero(grad), np.sort(indices.ravel()))
    tangent = RNG.standard_normal(x.shape).astype(np.float32)
    forward = jax.jvp(pool, (x,), (tangent,))[1]
    np.testing.assert_allclose(np.vdot(forward, cotangent), np.vdot(tangent, grad), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("shape, attributes", [
    ((2, 2, 7, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ((1, 2, 6, 7), dict(kernel_shape=[3, 2], strides=[1, 2], pads=[1, 0, 2, 1], ceil_mode=1)),
    ((1, 1, 7, 8), dict(kernel_shape=[2, 3], dilations=[2, 2], pads=[1, 0, 0, 1])),
    ((2, 3, 9), dict(kernel_shape=[4], strides=[3], auto_pad="SAME_UPPER")),
    ((1, 1, 4, 5, 6), dict(kernel_shape=[2, 2, 3], strides=[1, 2, 2], pads=[0, 1, 1, 1, 0, 1])),
])
def test_max_pool_gradient_reaches_the_element_its_indices_name(shape, attributes):
    """Any window (overlapping, padded, ceil mode, dilated, 1-D, 3-D), on inputs full of ties:
    the gradient is the cotangent added up at the positions MaxPool's Indices output names,
    an independent implementation of "each window's first maximum"."""
    x = RNG.integers(0, 3, shape).astype(np.float32)
    fn = translated("MaxPool", [x], 22, **attributes)
    _, indices = run("MaxPool", [x], outputs=2, **attributes)
    cotangent = RNG.standard_normal(indices.shape).astype(np.float32)
    (grad,) = jax.vjp(lambda v: fn.apply(fn.params, {"X0": v})["Y0"], x)[1](cotangent)
    expected = np.zeros(x.size, np.float32)
    np.add.at(expected, indices.ravel(), cotangent.ravel())
    np.testing.assert_allclose(grad, expected.reshape(shape), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape, attributes", [
    ((1, 2, 7, 6), dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1], storage_order=1)),
    ((2, 1, 6, 7), dict(kernel_shape=[2, 3], strides=[2, 2], ceil_mode=1, dilations=[2, 1])),
    ((1, 2, 5, 4, 6), dict(kernel_shape=[2, 2, 3], strides=[1, 2, 2], pads=[0, 1, 1, 1, 0, 1])),
])
def test_max_pool_values_and_indices_match_reference(shape, attributes):
    x = RNG.permutation(int(np.prod(shape))).reshape(shape).astype(np.float32)
    assert_matches_reference("MaxPool", [x], outputs=2, **attributes)


def test_max_pool_same_lower_with_stride_matches_onnxruntime():
    # ceil(size / stride) outputs as the spec says; the reference evaluator floors for SAME_LOWER.
    x = RNG.permutation(60).reshape(1, 2, 5, 6).astype(np.float32)
    attributes = dict(kernel_shape=[3, 3], auto_pad="SAME_LOWER", strides=[2, 2], storage_order=1)
    expected = onnxruntime_run("MaxPool", [x], 12, outputs=2, output_dtypes=(np.float32, np.int64),
                               **attributes)
    actual = run("MaxPool", [x], outputs=2, **attributes)
    for e, a in zip(expected, actual):
        np.testing.assert_array_equal(a, e)


def test_max_pool_int8_padding_never_wins():
    x = RNG.integers(-128, -100, (1, 1, 4, 5)).astype(np.int8)
    (y,) = run("MaxPool", [x], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    padded = np.pad(x, [(0, 0), (0, 0), (1, 1), (1, 1)], constant_values=-128)
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))
    assert y.dtype == np.int8
    np.testing.assert_array_equal(y, windows.max(axis=(-2, -1)))


def test_max_unpool_restores_maxima_from_max_pool_indices():
    x = RNG.permutation(32).reshape(1, 2, 4, 4).astype(np.float32)
    pooled, indices = run("MaxPool", [x], outputs=2, kernel_shape=[2, 2], strides=[2, 2])
    (unpooled,) = run("MaxUnpool", [pooled, indices], kernel_shape=[2, 2], strides=[2, 2])
    windows = x.reshape(1, 2, 2, 2, 2, 2)
    is_max = windows == windows.max(axis=(3, 5), keepdims=True)
    np.testing.assert_array_equal(unpooled, np.where(is_max, windows, 0).reshape(x.shape))


@pytest.mark.parametrize("attributes", [
    dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 1, 1, 0], count_include_pad=1, ceil_mode=1),
    dict(kernel_shape=[3, 3], strides=[2, 1], pads=[2, 1, 0, 1], ceil_mode=1),
    dict(kernel_shape=[2, 3], strides=[2, 2], auto_pad="SAME_LOWER", count_include_pad=1),
    dict(kernel_shape=[2, 2], dilations=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1),
])
def test_average_pool_counts_match_reference(attributes):
    x = RNG.standard_normal((1, 2, 7, 6)).astype(np.float32)
    assert_matches_reference("AveragePool", [x], **attributes)


@pytest.mark.slow
def test_average_pool_tiling_sums_strided_slices():
    """Windows that tile the input (kernel = stride, no padding) are averaged without
    reduce_window; values against the reference evaluator, the gradient hand-derived (1/6 on
    every element a window covers, 0 on the row none does)."""
    x = RNG.standard_normal((2, 3, 7, 6)).astype(np.float32)
    attributes = dict(kernel_shape=[2, 3], strides=[2, 3])
    assert_matches_reference("AveragePool", [x], **attributes)
    fn = translated("AveragePool", [x], 22, **attributes)

    def total(v):
        return fn.apply(fn.params, {"X0": v})["Y0"].sum()

    assert "reduce_window" not in str(jax.make_jaxpr(total)(x))
    expected = np.full(x.shape, 1 / 6, np.float32)
    expected[:, :, 6] = 0
    np.testing.assert_allclose(jax.grad(total)(x), expected, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("attributes, forward_reduce_windows", [
    (dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1), 1),
    (dict(kernel_shape=[3, 3], strides=[3, 3]), 0),
    (dict(kernel_shape=[2, 3], strides=[1, 1], dilations=[2, 1], pads=[1, 0, 1, 2], count_include_pad=1), 0),
])
def test_average_pool_larger_windows_sum_axis_by_axis(attributes, forward_reduce_windows):
    """Windows with more taps than their sides add up to are summed one axis at a time; those
    that move by more than 1 and overlap keep reduce_window forward, but not in the gradient.
    Values against the reference evaluator, the gradient of the sum of all outputs
    hand-derived: each element gets 1/taps for every window covering it (count_include_pad=1
    or no padding, so every window divides by its taps)."""
    x = RNG.standard_normal((2, 3, 7, 8)).astype(np.float32)
    assert_matches_reference("AveragePool", [x], **attributes)
    fn = translated("AveragePool", [x], 22, **attributes)

    def total(v):
        return fn.apply(fn.params, {"X0": v})["Y0"].sum()

    assert str(jax.make_jaxpr(jax.grad(total))(x)).count("reduce_window_sum[") == forward_reduce_windows
    kernel, strides = attributes["kernel_shape"], attributes["strides"]
    dilations = attributes.get("dilations", [1, 1])
    low = attributes.get("pads", [0, 0, 0, 0])[:2]
    (y,) = run("AveragePool", [x], **attributes)
    coverage = np.zeros(x.shape[2:])
    for out_row, out_col in itertools.product(*map(range, y.shape[2:])):
        for tap_row, tap_col in itertools.product(*map(range, kernel)):
            row = out_row * strides[0] - low[0] + tap_row * dilations[0]
            col = out_col * strides[1] - low[1] + tap_col * dilations[1]
            if 0 <= row < x.shape[2] and 0 <= col < x.shape[3]:
                coverage[row, col] += 1
    expected = np.broadcast_to(coverage / np.prod(kernel), x.shape)
    np.testing.assert_allclose(jax.grad(total)(x), expected, rtol=1e-6)


def test_average_and_lp_pool_3d_windows_match_reference():
    x = RNG.standard_normal((1, 2, 6, 5, 7)).astype(np.float32)
    assert_matches_reference("AveragePool", [x], kernel_shape=[3, 3, 3], pads=[1, 1, 1, 1, 1, 1])
    assert_matches_reference("AveragePool", [x], kernel_shape=[3, 2, 2], strides=[2, 2, 3], ceil_mode=1)
    assert_matches_reference("LpPool", [x], kernel_shape=[2, 3, 3], strides=[1, 2, 2], p=2)


def test_average_pool_float16_stays_float16():
    x = RNG.standard_normal((1, 1, 6, 6)).astype(np.float16)
    (y,) = run("AveragePool", [x], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    (expected,) = reference("AveragePool", [x.astype(np.float32)], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.astype(np.float32), expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("p", [1, 3])
def test_lp_pools_with_other_p_match_reference(p):
    x = RNG.standard_normal((1, 2, 6, 5)).astype(np.float32)
    assert_matches_reference("LpPool", [x], p=p, kernel_shape=[2, 3], strides=[2, 1], pads=[1, 0, 1, 1])
    assert_matches_reference("LpPool", [x], p=p, kernel_shape=[3, 2], strides=[3, 2])  # tiling
    (y,) = run("GlobalLpPool", [x], p=p)
    expected = (np.abs(x.astype(np.float64)) ** p).sum(axis=(2, 3), keepdims=True) ** (1 / p)
    np.testing.assert_allclose(y, expected, rtol=1e-5)


@pytest.mark.slow
def test_lp_pool_1_float_p_and_pool_gradients():
    x = RNG.standard_normal((1, 1, 4, 4))
    (y,) = run("LpPool", [x], opset=1, p=3.0, kernel_shape=[2, 2])
    windows = np.lib.stride_tricks.sliding_window_view(np.abs(x), (2, 2), axis=(2, 3))
    np.testing.assert_allclose(y, (windows ** 3).sum(axis=(-2, -1)) ** (1 / 3), rtol=1e-12)
    for op_type, attributes in [("AveragePool", dict(kernel_shape=[3, 2], pads=[1, 0, 1, 1], ceil_mode=1,
                                                     strides=[2, 2])),
                                ("LpPool", dict(kernel_shape=[2, 2], p=2))]:
        analytic, numeric = gradient(op_type, [x], 0, **attributes)
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)


def test_col2im_strides_dilations_and_pads_together_match_reference():
    x = RNG.standard_normal((2, 2 * 6, 12)).astype(np.float32)
    image, block = Const(np.array([7, 9])), Const(np.array([2, 3]))
    assert_matches_reference("Col2Im", [x, image, block], opset=18, strides=[2, 3],
                             dilations=[2, 1], pads=[1, 2, 0, 1])


# --- Resize and Upsample ---------------------------------------------------------------------

EMPTY = Const(np.zeros(0, np.float32))


def scales(*values):
    return Const(np.array(values, np.float32))


def sizes(*values):
    return Const(np.array(values, np.int64))


@pytest.mark.parametrize("mode, nearest_mode", list(itertools.product(
    ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"],
    ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])))
def test_resize_nearest_roundings_match_reference(mode, nearest_mode):
    x = RNG.standard_normal((1, 2, 6, 7)).astype(np.float32)
    assert_matches_reference("Resize", [x, EMPTY, scales(1, 1, 1.5, 0.6)], opset=19, mode="nearest",
                             coordinate_transformation_mode=mode, nearest_mode=nearest_mode)


@pytest.mark.parametrize("attributes, size_input", [
    (dict(mode="cubic", exclude_outside=1, cubic_coeff_a=-0.5), sizes(1, 2, 9, 4)),
    (dict(mode="cubic", antialias=1, exclude_outside=1), scales(1, 1, 0.3, 0.45)),
    (dict(mode="linear", antialias=1, axes=[2, 3]), scales(0.4, 0.25)),
    (dict(mode="cubic", antialias=1, axes=[3, 2]), sizes(2, 3)),
    (dict(mode="nearest", axes=[3, 2], keep_aspect_ratio_policy="not_larger"), sizes(5, 9)),
    (dict(mode="linear", axes=[3], keep_aspect_ratio_policy="not_smaller"), sizes(9)),
    (dict(mode="cubic", coordinate_transformation_mode="align_corners"), scales(1, 1, 1.7, 0.7)),
    (dict(mode="linear", coordinate_transformation_mode="half_pixel_symmetric"), scales(1, 1, 1.3, 0.7)),
])
def test_resize_modes_match_reference(attributes, size_input):
    x = RNG.standard_normal((1, 2, 6, 7)).astype(np.float32)
    inputs = [x, EMPTY, size_input] if size_input.value.dtype == np.float32 else [x, EMPTY, EMPTY, size_input]
    # Weighted sums of unit-scale float32 values, summed in another order than the reference's.
    assert_matches_reference("Resize", inputs, opset=19, atol=1e-5, **attributes)


def test_resize_tf_crop_and_resize_cubic_extrapolates_outside_the_roi():
    x = RNG.standard_normal((1, 2, 6, 7)).astype(np.float32)
    roi = Const(np.array([0, 0, -0.3, 0.2, 1, 1, 0.8, 1.3], np.float32))
    assert_matches_reference("Resize", [x, roi, EMPTY, sizes(1, 2, 8, 4)], opset=19, mode="cubic", atol=1e-5,
                             coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=-3.0)


def test_resize_integer_input_rounds_like_reference():
    x = RNG.integers(0, 256, (1, 1, 5, 6)).astype(np.uint8)
    for mode in ("linear", "cubic"):
        assert_matches_reference("Resize", [x, EMPTY, scales(1, 1, 1.7, 0.7)], opset=19, mode=mode, atol=0)


def test_resize_negative_axes_are_counted_from_the_end():
    x = RNG.standard_normal((1, 2, 6, 7)).astype(np.float32)
    (negative,) = run("Resize", [x, EMPTY, scales(0.5, 1.5)], opset=19, mode="linear", axes=[-1, -2])
    (positive,) = run("Resize", [x, EMPTY, scales(0.5, 1.5)], opset=19, mode="linear", axes=[3, 2])
    assert negative.shape == (1, 2, 9, 3)
    np.testing.assert_array_equal(negative, positive)


def test_resize_pytorch_half_pixel_to_length_one_samples_position_zero():
    # The spec (and onnxruntime) use x_original = 0 there; the reference evaluator uses -0.5.
    x = RNG.standard_normal((1, 1, 6, 7)).astype(np.float32)
    (y,) = run("Resize", [x, EMPTY, EMPTY, sizes(1, 1, 1, 3)], opset=19, mode="cubic",
               coordinate_transformation_mode="pytorch_half_pixel")
    (expected,) = onnxruntime_run("Resize", [x, EMPTY, EMPTY, sizes(1, 1, 1, 3)], 19, mode="cubic",
                                  coordinate_transformation_mode="pytorch_half_pixel")
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("factors", [(1, 1, 0.6, 0.5), (1, 1, 1.7, 2.5), (1, 1, 0.75, 3.0)])
def test_resize_10_matches_onnxruntime(mode, factors):
    x = RNG.standard_normal((1, 2, 5, 7)).astype(np.float32)
    (y,) = run("Resize", [x, scales(*factors)], opset=10, mode=mode)
    np.testing.assert_allclose(y, onnxruntime_run("Resize", [x, scales(*factors)], 10, mode=mode)[0],
                               rtol=1e-5, atol=1e-6)


def test_resize_11_tf_half_pixel_for_nn_matches_onnxruntime():
    x = RNG.standard_normal((1, 1, 5, 7)).astype(np.float32)
    inputs = [x, EMPTY, scales(1, 1, 1.5, 0.75)]
    (y,) = run("Resize", inputs, opset=11, coordinate_transformation_mode="tf_half_pixel_for_nn")
    (expected,) = onnxruntime_run("Resize", inputs, 11, coordinate_transformation_mode="tf_half_pixel_for_nn")
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample_7_and_9_match_onnxruntime(mode):
    x = RNG.standard_normal((1, 2, 3, 4)).astype(np.float32)
    factors = [1.0, 1.0, 1.7, 2.5]
    (expected,) = onnxruntime_run("Upsample", [x, scales(*factors)], 9, mode=mode)
    np.testing.assert_allclose(run("Upsample", [x, scales(*factors)], opset=9, mode=mode)[0], expected,
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(run("Upsample", [x], opset=7, mode=mode, scales=factors)[0], expected,
                               rtol=1e-6, atol=1e-6)


def test_upsample_rejects_shrinking():
    x = np.zeros((1, 1, 4, 4), np.float32)
    with pytest.raises(ModelLoadError, match="Upsample scales must be >= 1"):
        run("Upsample", [x, scales(1, 1, 0.5, 1)], opset=9)


def test_resize_cubic_gradient_matches_finite_differences():
    x = RNG.standard_normal((1, 1, 3, 4))
    analytic, numeric = gradient("Resize", [x, EMPTY, scales(1, 1, 1.5, 0.75)], 0, opset=19, mode="cubic")
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)


# --- GridSample, AffineGrid ------------------------------------------------------------------

@pytest.mark.parametrize("mode, padding, align_corners", [
    pytest.param(*values, marks=pytest.mark.slow) if values[0] == "cubic" else values   # cubic: seconds each
    for values in itertools.product(["linear", "nearest", "cubic"], ["zeros", "border", "reflection"], [0, 1])])
def test_grid_sample_2d_matches_reference(mode, padding, align_corners):
    x = RNG.standard_normal((2, 2, 4, 5)).astype(np.float32)
    grid = RNG.uniform(-1.6, 1.6, (2, 3, 6, 2)).astype(np.float32)
    assert_matches_reference("GridSample", [x, grid], mode=mode, padding_mode=padding,
                             align_corners=align_corners, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode, padding", [("linear", "reflection"), ("nearest", "zeros"),
                                           ("cubic", "border")])
def test_grid_sample_3d_matches_reference(mode, padding):
    x = RNG.standard_normal((1, 2, 3, 4, 5)).astype(np.float32)
    grid = RNG.uniform(-1.3, 1.3, (1, 2, 3, 2, 3)).astype(np.float32)
    assert_matches_reference("GridSample", [x, grid], mode=mode, padding_mode=padding, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_grid_sample_16_uses_the_old_mode_names():
    x = RNG.standard_normal((1, 1, 4, 5)).astype(np.float32)
    grid = RNG.uniform(-1, 1, (1, 3, 3, 2)).astype(np.float32)
    (old,) = run("GridSample", [x, grid], opset=16, mode="bicubic")
    (new,) = run("GridSample", [x, grid], opset=20, mode="cubic")
    np.testing.assert_array_equal(old, new)
    with pytest.raises(ModelLoadError, match="mode must be one of"):
        run("GridSample", [x, grid], opset=16, mode="cubic")


@pytest.mark.slow
def test_grid_sample_grid_gradient_matches_finite_differences():
    x = RNG.standard_normal((1, 1, 4, 5))
    grid = RNG.uniform(-0.9, 0.9, (1, 2, 3, 2))
    analytic, numeric = gradient("GridSample", [x, grid], 1, padding_mode="border")
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("align_corners", [0, 1])
def test_identity_affine_grid_samples_the_image_back(align_corners):
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    theta = np.tile(np.eye(2, 3, dtype=np.float32), (2, 1, 1))
    (grid,) = run("AffineGrid", [theta, Const(np.array(x.shape))], opset=20, align_corners=align_corners)
    (y,) = run("GridSample", [x, grid], opset=20, align_corners=align_corners)
    np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5)


# --- RoiAlign, NonMaxSuppression -------------------------------------------------------------

ROIS = np.array([[0.5, 1.0, 6.5, 5.2], [2.0, 0.0, 3.0, 1.5], [-1.0, 2.0, 9.0, 9.0]], np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("opset, attributes", [
    (16, dict(sampling_ratio=0, output_height=3, output_width=2, spatial_scale=0.9)),
    (16, dict(sampling_ratio=2, coordinate_transformation_mode="output_half_pixel", mode="max")),
    (16, dict(sampling_ratio=0, mode="max", output_height=2, output_width=4)),
])
def test_roi_align_matches_reference(opset, attributes):
    x = RNG.standard_normal((2, 3, 8, 7)).astype(np.float32)
    batch = np.array([1, 0, 1], np.int64)
    assert_matches_reference("RoiAlign", [x, ROIS, batch], opset=opset, rtol=1e-4, atol=1e-5, **attributes)


@pytest.mark.slow
def test_roi_align_10_uses_output_half_pixel_like_onnxruntime():
    x = RNG.standard_normal((2, 3, 8, 7)).astype(np.float32)
    inputs = [x, ROIS, np.array([1, 0, 1], np.int64)]
    attributes = dict(sampling_ratio=0, output_height=2, output_width=3, spatial_scale=0.8)
    np.testing.assert_allclose(run("RoiAlign", inputs, opset=10, **attributes)[0],
                               onnxruntime_run("RoiAlign", inputs, 10, **attributes)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_roi_align_with_sampling_ratio_is_jitted_and_differentiable():
    x = RNG.standard_normal((1, 1, 5, 5))
    rois = np.array([[0.3, 0.7, 3.6, 4.1]])
    batch = np.zeros(1, np.int64)
    analytic, numeric = gradient("RoiAlign", [x, rois, batch], 1, sampling_ratio=2, output_height=2,
                                 output_width=2)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-7)


def nms_inputs(center_point_box: bool):
    corners = RNG.uniform(0, 10, (2, 12, 2, 2))
    if center_point_box:
        boxes = np.concatenate([corners[:, :, 0], RNG.uniform(1, 5, (2, 12, 2))], axis=2)
    else:
        boxes = corners.reshape(2, 12, 4)
    return boxes.astype(np.float32), RNG.uniform(0, 1, (2, 3, 12)).astype(np.float32)


@pytest.mark.parametrize("center_point_box", [0, 1])
def test_non_max_suppression_matches_reference(center_point_box):
    boxes, scores = nms_inputs(center_point_box)
    limits = [np.array([4], np.int64), np.array([0.2], np.float32), np.array([0.3], np.float32)]
    expected = reference("NonMaxSuppression", [boxes, scores, *limits], center_point_box=center_point_box)[0]
    actual = run("NonMaxSuppression", [boxes, scores, *limits], center_point_box=center_point_box)[0]
    assert len(expected) > 0
    np.testing.assert_array_equal(actual, expected)
    assert actual.dtype == np.int64


def test_non_max_suppression_without_limit_selects_nothing():
    boxes, scores = nms_inputs(False)
    (selected,) = run("NonMaxSuppression", [boxes, scores])
    assert selected.shape == (0, 3) and selected.dtype == np.int64
