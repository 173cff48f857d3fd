"""Gradients of translated ONNX ops against central finite differences, in float64.

Training differentiates whatever the translator emits, so a handler whose
forward pass is right can still train wrong (a stop_gradient, a float32
intermediate, a custom rule, an index update that drops repeats). Each case
differentiates L = sum_k sum(w_k * Y_k), with fixed random cotangents w_k,
through TranslatedModel.apply and compares with central differences of the
same L. float64 inputs are differentiated; every other input (indices, axes,
shapes, float32 scales) becomes a constant initializer. Inputs sit away from
kinks and ties so both sides are well defined.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.translate.model import TranslatedModel
from support.op_testing import finite_difference, single_op_feeds, single_op_model, translate

RNG = np.random.default_rng(2024)


def rand(*shape: int, low: float = -2.0, high: float = 2.0, avoid: tuple[float, ...] = (0.0,)) -> np.ndarray:
    """Uniform float64 values, each at least 0.1 from the points in `avoid` (kinks)."""
    x = RNG.uniform(low, high, shape)
    for point in avoid:
        x = np.where(np.abs(x - point) < 0.1, x + np.where(x < point, -0.2, 0.2), x)
    return x


def positive(*shape: int, high: float = 2.0) -> np.ndarray:
    return rand(*shape, low=0.5, high=high)


def nonzero(*shape: int, high: float = 2.0) -> np.ndarray:
    """Magnitudes in [0.5, high) with random signs: safe divisors and factors."""
    return positive(*shape, high=high) * RNG.choice([-1.0, 1.0], shape)


def distinct(*shape: int) -> np.ndarray:
    """float64 values at least 0.2 apart: no ties for max, min, top-k or pooling."""
    n = int(np.prod(shape))
    return (RNG.permutation(n) * 0.3 - 0.15 * n + RNG.uniform(-0.05, 0.05, n)).reshape(shape)


def ints(*values: Any) -> np.ndarray:
    return np.array(values, np.int64)


@dataclass(frozen=True)
class Case:
    op: str
    inputs: tuple[np.ndarray | None, ...]
    opset: int
    attrs: dict
    outputs: int


def case(op: str, *inputs: np.ndarray | None, opset: int = 21, outputs: int = 1, variant: str = "",
         xfail: str = "", slow: bool = False, **attrs: Any) -> Any:
    """One table row, with pytest id op or op-variant; xfail holds the reason of a known bug. The
    quick run (-m "not slow") checks each op once: a variant is slow, and so is a row that takes
    over a second (slow=True)."""
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    if slow or variant:
        marks.append(pytest.mark.slow)
    return pytest.param(Case(op, inputs, opset, attrs, outputs), id=f"{op}-{variant}" if variant else op,
                        marks=marks)


def unary(op: str, x: np.ndarray | None = None, **kwargs: Any) -> Any:
    return case(op, rand(3, 4) if x is None else x, **kwargs)


CASES = [
    # Elementwise, one input
    *(unary(op) for op in ["Neg", "Abs", "Exp", "Sin", "Cos", "Tanh", "Sigmoid", "Relu", "Selu",
                           "Softplus", "Softsign", "Mish", "Erf", "Atan", "Asinh", "Sinh", "Cosh",
                           "Identity"]),
    *(unary(op, positive(3, 4)) for op in ["Log", "Sqrt"]),
    unary("Reciprocal", nonzero(3, 4)),
    unary("Tan", rand(3, 4, low=-1.2, high=1.2)),
    *(unary(op, rand(3, 4, low=-0.9, high=0.9)) for op in ["Asin", "Acos", "Atanh"]),
    unary("Acosh", rand(3, 4, low=1.2, high=3.0)),
    unary("LeakyRelu", alpha=0.1),
    unary("Elu", alpha=0.8),
    unary("Celu", alpha=0.7),
    unary("HardSigmoid", rand(3, 4, low=-3.5, high=3.5, avoid=(-2.5, 2.5)), alpha=0.2, beta=0.5),
    unary("HardSwish", rand(3, 4, low=-4.0, high=4.0, avoid=(-3.0, 3.0))),
    unary("ThresholdedRelu", rand(3, 4, avoid=(0.5,)), alpha=0.5),
    unary("Shrink", rand(3, 4, avoid=(-0.5, 0.5)), lambd=0.5, bias=0.3),
    unary("Gelu"),
    unary("Gelu", variant="tanh", approximate="tanh"),
    unary("Swish", opset=24, alpha=0.7),
    case("Clip", rand(3, 4, avoid=(-0.5, 1.0)), np.array(-0.5), np.array(1.0)),
    case("Clip", rand(3, 4, avoid=(0.2,)), np.array(0.2), variant="min-only"),
    # Elementwise, broadcasting and variadic
    case("Add", rand(3, 4), rand(4)),
    case("Sub", rand(2, 1, 4), rand(3, 1)),
    case("Mul", rand(3, 4), rand(3, 1)),
    case("Div", rand(3, 4), nonzero(4)),
    case("Pow", positive(3, 4), rand(4)),
    case("Mod", rand(3, 4, low=-3.0, high=3.0), positive(4), fmod=1),
    case("PRelu", rand(2, 3, 4), rand(3, 1)),
    *(case(op, rand(3, 4), rand(4), rand(3, 1)) for op in ["Max", "Min", "Sum", "Mean"]),
    case("Where", RNG.random((3, 4)) > 0.5, rand(3, 4), rand(4)),
    # Linear algebra
    case("MatMul", rand(2, 3, 4), rand(4, 2)),
    case("MatMul", rand(4), rand(4, 3), variant="vector"),
    case("Gemm", rand(4, 3), rand(2, 4), rand(2), transA=1, transB=1, alpha=0.7, beta=1.3),
    case("Einsum", rand(2, 2, 3), rand(2, 4, 3), equation="bij,bkj->bik"),
    case("Einsum", rand(3, 3, 2), rand(2, 2), variant="diagonal", equation="iij,jk->ik"),
    case("Det", rand(2, 3, 3) + 3 * np.eye(3)),
    # Convolution and pooling
    case("Conv", rand(1, 2, 4, 4), rand(4, 1, 2, 2), rand(4), group=2, strides=[2, 1],
         pads=[1, 0, 0, 1], dilations=[1, 2]),
    case("Conv", rand(1, 1, 5, 4), rand(2, 1, 3, 2), variant="same-lower", auto_pad="SAME_LOWER", strides=[2, 2]),
    case("DeformConv", rand(1, 1, 3, 3), rand(1, 1, 2, 2), rand(1, 8, 2, 2, low=-0.8, high=0.8, avoid=(0.0,)),
         rand(1), rand(1, 4, 2, 2), opset=19, slow=True),
    case("ConvTranspose", rand(1, 2, 3, 3), rand(2, 3, 2, 2), rand(3), strides=[2, 2],
         pads=[0, 1, 1, 0], output_padding=[1, 0]),
    case("ConvTranspose", rand(1, 2, 3, 2), rand(2, 1, 2, 2), variant="group-dilated", group=2,
         dilations=[2, 1]),
    case("MaxPool", distinct(1, 1, 4, 5), kernel_shape=[2, 3], strides=[1, 2], pads=[0, 1, 0, 1]),
    case("MaxPool", distinct(1, 1, 5, 4), variant="ceil", kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
    case("MaxPool", distinct(1, 1, 5, 4), variant="dilated", kernel_shape=[2, 2], dilations=[2, 1]),
    case("MaxPool", distinct(1, 2, 5, 7), variant="tiling", kernel_shape=[2, 3], strides=[2, 3]),
    case("MaxPool", distinct(2, 1, 7), variant="tiling-1d", kernel_shape=[3], strides=[3]),
    case("MaxUnpool", rand(1, 1, 2, 2), np.array([[[[0, 3], [9, 14]]]]), kernel_shape=[2, 2], strides=[2, 2]),
    case("AveragePool", rand(1, 2, 4, 4), kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=0),
    case("AveragePool", rand(1, 2, 5, 6), variant="tiling", kernel_shape=[2, 3], strides=[2, 3]),
    case("AveragePool", rand(1, 1, 5, 5), variant="ceil-include-pad", kernel_shape=[2, 2], strides=[2, 2],
         pads=[1, 0, 0, 0], ceil_mode=1, count_include_pad=1),
    case("LpPool", rand(1, 2, 3, 4), kernel_shape=[2, 2], p=2),
    case("LpPool", rand(1, 2, 5, 4), variant="tiling", kernel_shape=[2, 2], strides=[2, 2], p=3),
    case("GlobalAveragePool", rand(1, 2, 3, 4)),
    case("GlobalMaxPool", distinct(1, 2, 3, 4)),
    case("GlobalLpPool", rand(1, 2, 3, 4), p=2),
    case("LRN", rand(1, 4, 2, 2), size=3, alpha=0.3, beta=0.75, bias=1.5),
    # Normalization (stash_type=11: the default float32 statistics would defeat float64 differences)
    case("BatchNormalization", rand(2, 3, 2, 2), rand(3), rand(3), rand(3), positive(3), epsilon=1e-3),
    case("BatchNormalization", rand(2, 3, 2, 2), rand(3), rand(3), rand(3), positive(3), variant="training",
         training_mode=1, momentum=0.8, outputs=3),
    case("LayerNormalization", rand(2, 3, 4), rand(4), rand(4), stash_type=11),
    case("InstanceNormalization", rand(2, 3, 4), rand(3), rand(3)),
    case("GroupNormalization", rand(2, 4, 3), rand(4), rand(4), num_groups=2, stash_type=11),
    case("RMSNormalization", rand(2, 3, 4), rand(4), opset=23, stash_type=11),
    case("LpNormalization", rand(3, 4), p=2),
    case("LpNormalization", rand(3, 4), variant="p1", p=1, axis=0),
    case("MeanVarianceNormalization", rand(2, 3, 2, 2)),
    # Softmax family and losses
    case("Softmax", rand(2, 3, 4), axis=1),
    case("Softmax", rand(2, 3, 4), opset=11, variant="opset11-2d", axis=1),
    case("LogSoftmax", rand(2, 3, 4)),
    case("SoftmaxCrossEntropyLoss", rand(3, 4), ints(1, 3, 0), outputs=2),
    case("SoftmaxCrossEntropyLoss", rand(3, 4), ints(1, -1, 0), rand(4), variant="weighted-ignore",
         ignore_index=-1),
    case("NegativeLogLikelihoodLoss", rand(3, 4), ints(2, 0, 2), rand(4), reduction="mean"),
    # Reductions
    case("ReduceSum", rand(2, 3, 4), ints(1), keepdims=0),
    case("ReduceMean", rand(2, 3, 4), ints(0, 2)),
    case("ReduceMax", distinct(2, 3, 4), ints(1)),
    case("ReduceMin", distinct(2, 3, 4), ints(-1), keepdims=0),
    case("ReduceProd", nonzero(2, 3, 4, high=1.5), ints(1)),
    case("ReduceL1", rand(2, 3, 4), ints(2)),
    case("ReduceL2", rand(2, 3, 4), ints(0, 1)),
    case("ReduceLogSum", positive(2, 3, 4), ints(1)),
    case("ReduceLogSumExp", rand(2, 3, 4), ints(2)),
    case("ReduceSumSquare", rand(2, 3, 4), ints(0)),
    case("CumSum", rand(3, 4), np.array(1), exclusive=1, reverse=1),
    case("CumProd", nonzero(3, 4, high=1.5), np.array(1), opset=26),
    case("TopK", distinct(3, 5), ints(2), outputs=2),
    case("TopK", distinct(3, 5), ints(3), variant="smallest-axis0", axis=0, largest=0, outputs=2),
    # Shape and indexing
    case("Reshape", rand(2, 3, 2), ints(3, -1)),
    case("Transpose", rand(2, 3, 4), perm=[2, 0, 1]),
    case("Flatten", rand(2, 3, 2, 2), axis=2),
    case("Squeeze", rand(3, 1, 4), ints(1)),
    case("Unsqueeze", rand(3, 4), ints(0, 3)),
    case("Expand", rand(3, 1), ints(2, 3, 4)),
    case("Tile", rand(2, 3), ints(2, 1)),
    case("Concat", rand(2, 1, 3), rand(2, 2, 3), rand(2, 3, 3), axis=1),
    case("Split", rand(2, 6), ints(1, 2, 3), axis=1, outputs=3),
    case("Split", rand(7, 2), variant="num-outputs", num_outputs=3, outputs=3),
    case("Slice", rand(4, 5), ints(-1, 1), ints(-5, 5), ints(0, 1), ints(-2, 2)),
    case("Gather", rand(4, 3), ints([0, 2], [-1, 0])),
    case("GatherElements", rand(3, 4), ints([0, 0], [3, -1], [1, 2]), axis=1),
    case("GatherND", rand(2, 3, 2), ints([0, 1], [1, 2], [0, 1])),
    case("ScatterElements", rand(3, 4), ints([1], [3], [0]), rand(3, 1), axis=1),
    case("ScatterND", rand(4, 3), ints([1], [3]), rand(2, 3)),
    case("ScatterElements", rand(3, 4), ints([1, 1], [3, 0], [0, 0]), rand(3, 2), variant="add-repeats",
         axis=1, reduction="add"),
    case("ScatterElements", rand(3, 4), ints([1, 2], [3, 0], [0, 1]), rand(3, 2), variant="max",
         axis=1, reduction="max"),
    # Unique indices: JAX differentiates a multiplying scatter only then (checked on the host).
    case("ScatterND", rand(4, 3), ints([1], [3], [0]), rand(3, 3), variant="mul", reduction="mul"),
    case("TensorScatter", rand(2, 1, 4, 2), rand(2, 1, 2, 2), ints(1, 0), opset=24),
    case("Compress", rand(3, 4), np.array([True, False, True]), axis=0),
    case("Pad", rand(3, 4), ints(1, 2, 2, 1), mode="reflect"),
    case("Pad", rand(3, 4), ints(2, 0, 1, 3), variant="edge", mode="edge"),
    case("Pad", rand(3, 4), ints(1, 2, 0, 1), variant="wrap", mode="wrap"),
    case("Pad", rand(3, 4), ints(0, 1, 1, 1), np.array(0.7), ints(0, 1), variant="constant-axes"),
    case("CenterCropPad", rand(3, 5), ints(4, 3)),
    case("Trilu", rand(4, 4), np.array(1, np.int64), upper=0),
    case("ReverseSequence", rand(4, 2, 3), ints(4, 2), batch_axis=1, time_axis=0),
    case("DepthToSpace", rand(1, 8, 2, 2), blocksize=2, mode="CRD"),
    case("SpaceToDepth", rand(1, 2, 4, 4), blocksize=2),
    case("OneHot", ints(0, 2, -1), np.array(4), rand(2), axis=-1),
    case("Col2Im", rand(1, 4, 4), ints(3, 3), ints(2, 2)),
    # Resampling
    case("Resize", rand(1, 1, 3, 4), None, np.array([1, 1, 2, 1.5], np.float32), mode="linear"),
    case("Resize", rand(1, 1, 3, 4), None, np.array([1, 1, 1.5, 2], np.float32), variant="cubic", mode="cubic"),
    case("Resize", rand(1, 1, 4, 6), None, np.array([1, 1, 0.5, 0.6], np.float32), variant="antialias",
         mode="linear", antialias=1),
    case("RoiAlign", rand(1, 1, 4, 4), np.array([[0.3, 0.6, 2.7, 3.1]]), ints(0), opset=16,
         output_height=2, output_width=2, sampling_ratio=2, slow=True),
    case("DFT", rand(1, 5, 1), None, np.array(1), opset=20),
    case("STFT", rand(1, 8, 1), np.array(2), rand(4), opset=17),
    case("GridSample", rand(1, 1, 3, 3), rand(1, 2, 2, 2, low=-0.9, high=0.9, avoid=(-2 / 3, 0.0, 2 / 3)),
         mode="linear"),
    case("GridSample", rand(1, 1, 3, 3), rand(1, 2, 2, 2, low=-0.9, high=0.9), variant="cubic-border",
         mode="cubic", padding_mode="border", align_corners=1, slow=True),
    case("AffineGrid", rand(1, 2, 3), ints(1, 1, 3, 4)),
    # Recurrent and attention
    case("RNN", rand(3, 2, 2), rand(1, 2, 2), rand(1, 2, 2), rand(1, 4), None, rand(1, 2, 2),
         hidden_size=2, outputs=2),
    case("GRU", rand(3, 2, 2), rand(1, 6, 2), rand(1, 6, 2), rand(1, 12), None, rand(1, 2, 2),
         hidden_size=2, linear_before_reset=1, outputs=2, slow=True),
    case("GRU", rand(3, 2, 2), rand(2, 6, 2), rand(2, 6, 2), rand(2, 12), variant="bidirectional",
         hidden_size=2, direction="bidirectional", outputs=2, slow=True),
    case("LSTM", rand(3, 2, 2), rand(1, 8, 2), rand(1, 8, 2), rand(1, 16), None, rand(1, 2, 2),
         rand(1, 2, 2), hidden_size=2, outputs=3, slow=True),
    case("LSTM", rand(3, 2, 2), rand(1, 8, 2), rand(1, 8, 2), rand(1, 16), None, None, None, rand(1, 6),
         variant="peephole-forget", hidden_size=2, input_forget=1, outputs=3, slow=True),
    case("Attention", rand(1, 2, 3, 4), rand(1, 2, 3, 4), rand(1, 2, 3, 4), opset=23),
    case("Attention", rand(1, 2, 3, 4), rand(1, 2, 3, 4), rand(1, 2, 3, 4), opset=23,
         variant="causal-softcap", is_causal=1, softcap=2.0),
    case("Attention", rand(1, 3, 8), rand(1, 4, 4), rand(1, 4, 4), rand(3, 4), opset=23,
         variant="3d-gqa-float-mask", q_num_heads=2, kv_num_heads=1, scale=0.4),
    case("RotaryEmbedding", rand(1, 2, 3, 4), rand(1, 3, 2), rand(1, 3, 2), opset=23),
    case("RotaryEmbedding", rand(1, 2, 3, 4), rand(5, 2), rand(5, 2), ints([4, 0, 2]), opset=23,
         variant="interleaved-positions", interleaved=1),
]


def op_model(c: Case) -> onnx.ModelProto:
    """The single-op model with every input but the float64 ones moved to initializers."""
    model = single_op_model(c.op, list(c.inputs), c.opset, outputs=c.outputs, **c.attrs)
    for info in list(model.graph.input):
        value = c.inputs[int(info.name[1:])]
        if value.dtype != np.float64:
            model.graph.input.remove(info)
            model.graph.initializer.append(numpy_helper.from_array(value, info.name))
    return model


def assert_gradients_match(fn: TranslatedModel, wrt: Mapping[str, Any], feeds: Mapping[str, Any]) -> None:
    """jax.grad of L = sum_k sum(w_k * Y_k) against central differences, for each array in
    `wrt` (named like a parameter of fn or a feed, which it replaces)."""
    with jax.enable_x64(True):
        shapes = jax.eval_shape(fn.apply, fn.params, feeds)
        rng = np.random.default_rng(0)
        weights = {name: rng.standard_normal(s.shape) for name, s in shapes.items()
                   if jnp.issubdtype(s.dtype, jnp.floating)}
        assert all(shapes[name].dtype == jnp.float64 for name in weights), shapes

        def loss(values):
            params = {name: values.get(name, value) for name, value in fn.params.items()}
            outputs = fn.apply(params, {name: values.get(name, value) for name, value in feeds.items()})
            return sum(jnp.sum(w * outputs[name]) for name, w in weights.items())

        # One compiled program serves both sides: compiling dominates the run time.
        loss_and_grad = jax.jit(jax.value_and_grad(loss))
        wrt = {name: np.asarray(value, np.float64) for name, value in wrt.items()}
        _, analytic = loss_and_grad(wrt)
        for name, value in wrt.items():
            numeric = finite_difference(lambda v: float(loss_and_grad({**wrt, name: v})[0]), value)
            np.testing.assert_allclose(np.asarray(analytic[name]), numeric, rtol=1e-5, atol=1e-7,
                                       err_msg=f"dL/d{name}")


@pytest.mark.parametrize("c", CASES)
def test_op_gradient_matches_finite_differences(c):
    feeds = single_op_feeds([v if v is not None and v.dtype == np.float64 else None for v in c.inputs])
    assert_gradients_match(translate(op_model(c)), feeds, feeds)


def test_cases_cover_at_least_40_op_types():
    assert len({param.values[0].op for param in CASES if not param.marks}) >= 40


# ---------------------------------------------------------------------------------------
# Composite models: gradients chain through several nodes and reach the initializers (fn.params).

node = helper.make_node
COMPOSITES = [
    pytest.param([node("MatMul", ["x", "w"], ["h"]), node("Add", ["h", "b"], ["z"]), node("Tanh", ["z"], ["t"]),
                  node("ReduceMean", ["t", "axes"], ["y"], keepdims=0)],
                 {"x": rand(3, 4)}, {"w": rand(4, 5), "b": rand(5), "axes": ints(1)}, id="dense-tanh-mean"),
    pytest.param([node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 0, 0]), node("Sigmoid", ["c"], ["s"]),
                  node("GlobalAveragePool", ["s"], ["p"]), node("Flatten", ["p"], ["f"]),
                  node("Gemm", ["f", "wd", "bd"], ["g"], transB=1), node("LogSoftmax", ["g"], ["y"])],
                 {"x": rand(2, 2, 3, 3)},
                 {"w": rand(3, 2, 2, 2), "b": rand(3), "wd": rand(2, 3), "bd": rand(2)}, id="conv-pool-gemm"),
    # Repeated token ids: the embedding table's gradient must accumulate.
    pytest.param([node("Gather", ["table", "ids"], ["e"]),
                  node("LayerNormalization", ["e", "scale", "bias"], ["n"], stash_type=11),
                  node("MatMul", ["n", "wq"], ["q"]), node("Softmax", ["q"], ["y"])],
                 {"ids": ints([0, 3, 0], [2, 3, 3])},
                 {"table": rand(4, 3), "scale": rand(3), "bias": rand(3), "wq": rand(3, 3)}, id="embedding-norm"),
]


@pytest.mark.parametrize("nodes, inputs, initializers", COMPOSITES)
def test_composite_gradient_reaches_initializers(nodes, inputs, initializers):
    graph = helper.make_graph(
        nodes, "composite",
        [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for name, v in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)],
        initializer=[numpy_helper.from_array(v, name) for name, v in initializers.items()])
    fn = translate(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    assert set(fn.params) == {name for name, v in initializers.items() if v.dtype == np.float64}
    float_feeds = {name: v for name, v in inputs.items() if v.dtype == np.float64}
    assert_gradients_match(fn, {**fn.params, **float_feeds}, inputs)
