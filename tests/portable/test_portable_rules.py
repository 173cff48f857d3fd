"""Each backward rule and decomposition on a one- or few-node graph: the expanded backward,
run by stock onnxruntime, against onnxtrain's Gradient (jax.vjp), at two batch sizes from one
expanded graph. y = sum(op(...) * cotangent) with a random cotangent, so every output element
weighs differently (a plain sum would hide a wrong Softmax gradient, which sums to zero)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from onnx import TensorProto, helper

from support.portable_graphs import compare_expansion

TRAINING = "ai.onnx.preview.training"
F, I64 = TensorProto.FLOAT, TensorProto.INT64


@dataclass
class Case:
    """nodes computing `out` from feeds; xs: the differentiated feeds (the others are zs);
    shapes: feed name -> shape with 'b' for the batch; out: the op output's shape."""

    nodes: list
    shapes: dict[str, tuple]
    xs: list[str]
    out: tuple
    opset: int = 21
    ints: dict[str, tuple[int, int]] = field(default_factory=dict)  # feed -> integer range
    positive: tuple[str, ...] = ()
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    tolerance: float = 1e-5


def _shape(shape: tuple, batch: int) -> tuple:
    return tuple(batch if d == "b" else d for d in shape)


def _feeds(case: Case, batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch)
    feeds = {}
    for name, shape in {**case.shapes, "cotangent": case.out}.items():
        shape = _shape(shape, batch)
        if name in case.ints:
            feeds[name] = rng.integers(*case.ints[name], size=shape).astype(np.int64)
        elif name.startswith("cond"):
            feeds[name] = rng.random(shape) > 0.5
        else:
            value = rng.standard_normal(shape).astype(np.float32)
            feeds[name] = np.abs(value) + 0.5 if name in case.positive else value
    return feeds


def _model_parts(case: Case):
    types = {name: (I64 if name in case.ints else TensorProto.BOOL if name.startswith("cond") else F)
             for name in [*case.shapes, "cotangent"]}
    inputs = [helper.make_tensor_value_info(name, types[name], list(shape))
              for name, shape in {**case.shapes, "cotangent": case.out}.items()]
    zs = [name for name in [*case.shapes, "cotangent"] if name not in case.xs]
    nodes = [*case.nodes,
             helper.make_node("Mul", ["out", "cotangent"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["y"], keepdims=0),
             helper.make_node("Gradient", [*case.xs, *zs], [f"d_{x}" for x in case.xs], domain=TRAINING,
                              xs=case.xs, zs=zs, y="y")]
    return nodes, inputs


def node(op_type, inputs, outputs=("out",), **attributes):
    return helper.make_node(op_type, list(inputs), list(outputs), name=f"the_{op_type}_{outputs[0]}", **attributes)


def _const(name, value):
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(
        name, I64 if np.asarray(value).dtype.kind == "i" else F, np.shape(value),
        np.asarray(value).reshape(-1).tolist()))


CASES: dict[str, Case] = {
    "Add_broadcast": Case([node("Add", ["a", "c"])], {"a": ("b", 3, 4), "c": (4,)}, ["a", "c"], ("b", 3, 4)),
    "Sub_broadcast": Case([node("Sub", ["a", "c"])], {"a": ("b", 3, 4), "c": (1, 4)}, ["a", "c"], ("b", 3, 4)),
    "Mul_both_broadcast": Case([node("Mul", ["a", "c"])], {"a": ("b", 3, 1), "c": (3, 4)}, ["a", "c"], ("b", 3, 4)),
    "Div": Case([node("Div", ["a", "c"])], {"a": ("b", 3), "c": (3,)}, ["a", "c"], ("b", 3), positive=("c",)),
    "Pow": Case([node("Pow", ["a", "c"])], {"a": ("b", 3), "c": (3,)}, ["a", "c"], ("b", 3), positive=("a",)),
    "Sum": Case([node("Sum", ["a", "c", "a"])], {"a": ("b", 3), "c": (3,)}, ["a", "c"], ("b", 3)),
    "Max": Case([node("Max", ["a", "c"])], {"a": ("b", 3), "c": ("b", 3)}, ["a", "c"], ("b", 3)),
    "Where": Case([node("Where", ["cond", "a", "c"])], {"cond": ("b", 3), "a": ("b", 3), "c": (3,)},
                  ["a", "c"], ("b", 3)),
    **{op: Case([node(op, ["a"])], {"a": ("b", 3)}, ["a"], ("b", 3), positive=("a",) if op in ("Sqrt", "Log") else ())
       for op in ["Relu", "Neg", "Sqrt", "Exp", "Log", "Tanh", "Sigmoid", "Erf", "Reciprocal", "Abs", "Identity"]},
    "LeakyRelu": Case([node("LeakyRelu", ["a"], alpha=0.2)], {"a": ("b", 3)}, ["a"], ("b", 3)),
    "Cast_double": Case([node("Cast", ["a"], ["wide"], to=TensorProto.DOUBLE), node("Cast", ["wide"], to=F)],
                        {"a": ("b", 3)}, ["a"], ("b", 3)),
    "MatMul_batched": Case([node("MatMul", ["a", "c"])], {"a": ("b", 2, 3, 4), "c": (4, 5)}, ["a", "c"], ("b", 2, 3, 5)),
    "MatMul_broadcast_batch": Case([node("MatMul", ["a", "c"])], {"a": ("b", 1, 3, 4), "c": (2, 4, 5)}, ["a", "c"],
                                   ("b", 2, 3, 5)),
    "MatMul_vector_right": Case([node("MatMul", ["a", "c"])], {"a": ("b", 4), "c": (4,)}, ["a", "c"], ("b",)),
    "MatMul_vector_left": Case([node("MatMul", ["c", "a"])], {"c": (4,), "a": ("b", 4, 3)}, ["a", "c"], ("b", 3)),
    "Gemm_trans_alpha_beta": Case([node("Gemm", ["a", "c", "d"], transB=1, alpha=0.5, beta=2.0)],
                                  {"a": ("b", 4), "c": (3, 4), "d": (3,)}, ["a", "c", "d"], ("b", 3)),
    "Gemm_transA": Case([node("Gemm", ["a", "c"], transA=1)], {"a": (4, "b"), "c": (4, 3)}, ["a", "c"], ("b", 3)),
    "Reshape": Case([_const("shape", [0, -1]), node("Reshape", ["a", "shape"])], {"a": ("b", 3, 4)}, ["a"], ("b", 12)),
    "Flatten": Case([node("Flatten", ["a"], axis=1)], {"a": ("b", 3, 4, 2)}, ["a"], ("b", 24)),
    "Transpose": Case([node("Transpose", ["a"], perm=[2, 0, 1])], {"a": ("b", 3, 4)}, ["a"], (4, "b", 3)),
    "Unsqueeze": Case([_const("axes", [1]), node("Unsqueeze", ["a", "axes"])], {"a": ("b", 3)}, ["a"], ("b", 1, 3)),
    "Squeeze": Case([_const("axes", [1]), node("Squeeze", ["a", "axes"])], {"a": ("b", 1, 3)}, ["a"], ("b", 3)),
    "Expand": Case([_const("shape", [2, 3, 4]), node("Expand", ["a", "shape"])], {"a": (3, 1)}, ["a"], (2, 3, 4)),
    "Concat": Case([node("Concat", ["a", "c", "a"], axis=1)], {"a": ("b", 2), "c": ("b", 3)}, ["a", "c"], ("b", 7)),
    "Split": Case([_const("sizes", [1, 2]), node("Split", ["a", "sizes"], ["s1", "s2"], axis=1),
                   node("Mul", ["s2", "s2"], ["sq"]), node("Concat", ["sq", "s1"], axis=1)],
                  {"a": ("b", 3)}, ["a"], ("b", 3)),
    "Slice_negative_step": Case([_const("starts", [-1, 0]), _const("ends", [-100, 3]), _const("axes", [2, 1]),
                                 _const("steps", [-2, 2]), node("Slice", ["a", "starts", "ends", "axes", "steps"])],
                                {"a": ("b", 4, 5)}, ["a"], ("b", 2, 3)),
    "Gather_axis0": Case([node("Gather", ["table", "ids"])], {"table": (10, 4), "ids": ("b", 3)}, ["table"],
                         ("b", 3, 4), ints={"ids": (-10, 10)}),
    "Gather_axis1": Case([node("Gather", ["a", "ids"], axis=1)], {"a": ("b", 6, 2), "ids": (4,)}, ["a"],
                         ("b", 4, 2), ints={"ids": (0, 6)}),
    "Gather_scalar_index_axis1": Case([_const("first", np.int64(-3)), node("Gather", ["a", "first"], axis=1)],
                                      {"a": ("b", 6, 2)}, ["a"], ("b", 2)),
    "ReduceSum": Case([_const("axes", [1]), node("ReduceSum", ["a", "axes"], keepdims=0)], {"a": ("b", 3, 4)}, ["a"],
                      ("b", 4)),
    "ReduceMean_keepdims": Case([_const("axes", [0, 2]), node("ReduceMean", ["a", "axes"])], {"a": ("b", 3, 4)},
                                ["a"], (1, 3, 1)),
    "ReduceMean_all": Case([node("ReduceMean", ["a"], keepdims=0), node("Mul", ["a", "m"], ["out"])],
                           {"a": ("b", 3)}, ["a"], ("b", 3)),
    "Softmax": Case([node("Softmax", ["a"], axis=1)], {"a": ("b", 5, 2)}, ["a"], ("b", 5, 2)),
    "LogSoftmax": Case([node("LogSoftmax", ["a"])], {"a": ("b", 5)}, ["a"], ("b", 5)),
    "LayerNormalization": Case([node("LayerNormalization", ["a", "s", "t"], axis=-1, epsilon=1e-3)],
                               {"a": ("b", 3, 6), "s": (6,), "t": (6,)}, ["a", "s", "t"], ("b", 3, 6)),
    "LayerNormalization_axis1_mean": Case(
        [node("LayerNormalization", ["a", "s"], ["n", "mean", "inv"], axis=1),
         node("Mul", ["n", "mean"], ["nm"]), node("Mul", ["nm", "inv"])],
        {"a": ("b", 3, 4), "s": (3, 4)}, ["a", "s"], ("b", 3, 4)),
    "BatchNormalization_training": Case(
        [node("BatchNormalization", ["a", "s", "t", "rm", "rv"], ["bn", "new_mean", "new_var"], training_mode=1,
              momentum=0.8, epsilon=1e-3),
         node("Unsqueeze", ["new_mean", "one"], ["m1"]), node("Unsqueeze", ["new_var", "one"], ["v1"]),
         node("Mul", ["bn", "m1"], ["bm"]), node("Add", ["bm", "v1"])],
        {"a": ("b", 3, 2, 2), "s": (3,), "t": (3,), "rm": (3,), "rv": (3,)}, ["a", "s", "t", "rm"], ("b", 3, 2, 2),
        positive=("rv",), constants={"one": np.array([1, 2], np.int64)}),
    "BatchNormalization_inference": Case([node("BatchNormalization", ["a", "s", "t", "rm", "rv"])],
                                         {"a": ("b", 3, 2), "s": (3,), "t": (3,), "rm": (3,), "rv": (3,)},
                                         ["a", "s", "t"], ("b", 3, 2), positive=("rv",)),
    "Gelu": Case([node("Gelu", ["a"])], {"a": ("b", 3)}, ["a"], ("b", 3)),
    "Gelu_tanh": Case([node("Gelu", ["a"], approximate="tanh")], {"a": ("b", 3)}, ["a"], ("b", 3)),
    "SCE_mean": Case([node("SoftmaxCrossEntropyLoss", ["a", "labels"])], {"a": ("b", 5), "labels": ("b",)},
                     ["a"], (), ints={"labels": (0, 5)}),
    "SCE_sum_log_prob_3d": Case(
        [node("SoftmaxCrossEntropyLoss", ["a", "labels"], ["loss", "log_prob"], reduction="sum"),
         node("Mul", ["log_prob", "loss"])],
        {"a": ("b", 5, 2), "labels": ("b", 2)}, ["a"], ("b", 5, 2), ints={"labels": (0, 5)}),
    "SCE_weights_ignore_index_mean": Case(
        [node("SoftmaxCrossEntropyLoss", ["a", "labels", "w"], ignore_index=1)],
        {"a": ("b", 4), "labels": ("b",), "w": (4,)}, ["a"], (), ints={"labels": (0, 4)}, positive=("w",)),
    "SCE_none_ignore_index": Case([node("SoftmaxCrossEntropyLoss", ["a", "labels"], reduction="none", ignore_index=-1)],
                                  {"a": ("b", 4), "labels": ("b",)}, ["a"], ("b",), ints={"labels": (-1, 4)}),
    "NLL_mean": Case([node("NegativeLogLikelihoodLoss", ["a", "labels"])], {"a": ("b", 4), "labels": ("b",)},
                     ["a"], (), ints={"labels": (0, 4)}),
    "Conv_stride_pads_bias": Case([node("Conv", ["a", "k", "kb"], strides=[2, 2], pads=[1, 0, 1, 1])],
                                  {"a": ("b", 2, 7, 6), "k": (3, 2, 3, 3), "kb": (3,)}, ["a", "k", "kb"], ("b", 3, 4, 3)),
    "Conv_group_dilation": Case([node("Conv", ["a", "k"], group=2, dilations=[2, 1], pads=[1, 1, 1, 1])],
                                {"a": ("b", 4, 6, 5), "k": (6, 2, 2, 3)}, ["a", "k"], ("b", 6, 6, 5)),
    "Conv_same_upper_1d": Case([node("Conv", ["a", "k"], auto_pad="SAME_UPPER", strides=[2])],
                               {"a": ("b", 2, 7), "k": (3, 2, 4)}, ["a", "k"], ("b", 3, 4)),
    "MaxPool_overlapping_pads": Case([node("MaxPool", ["a"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])],
                                     {"a": ("b", 2, 5, 5)}, ["a"], ("b", 2, 3, 3)),
    "GlobalAveragePool": Case([node("GlobalAveragePool", ["a"])], {"a": ("b", 2, 3, 3)}, ["a"], ("b", 2, 1, 1)),
    "Dropout_ratio_zero_training": Case(
        [_const("ratio", np.float32(0.0)), helper.make_node("Constant", [], ["train"], value=helper.make_tensor(
            "train", TensorProto.BOOL, [], [True])), node("Dropout", ["a", "ratio", "train"])],
        {"a": ("b", 3)}, ["a"], ("b", 3)),
    "Pad_constant": Case([_const("pads", [0, 1, 0, 2]), node("Pad", ["a", "pads"])], {"a": ("b", 3)}, ["a"], ("b", 6)),
    "Pad_reflect_crop": Case([_const("pads", [0, 2, -1, 0, 1, 0]), node("Pad", ["a", "pads"], mode="reflect")],
                             {"a": ("b", 4, 3)}, ["a"], ("b", 7, 2)),
    "Pad_edge_axes": Case([_const("pads", [2, 1]), _const("axes", [-1]), node("Pad", ["a", "pads", "", "axes"], mode="edge")],
                          {"a": ("b", 3)}, ["a"], ("b", 6), opset=21),
    "Tile": Case([_const("repeats", [1, 2, 3]), node("Tile", ["a", "repeats"])], {"a": ("b", 2, 2)}, ["a"], ("b", 4, 6)),
    "GatherElements": Case([node("GatherElements", ["a", "ids"], axis=1)], {"a": ("b", 5), "ids": ("b", 3)}, ["a"],
                           ("b", 3), ints={"ids": (0, 5)}),
    "Clip": Case([_const("lo", np.float32(-0.5)), _const("hi", np.float32(0.7)), node("Clip", ["a", "lo", "hi"])],
                 {"a": ("b", 6)}, ["a"], ("b", 6)),
    "Clip_max_only": Case([_const("hi", np.float32(0.2)), node("Clip", ["a", "", "hi"])], {"a": ("b", 6)}, ["a"], ("b", 6)),
    **{op: Case([node(op, ["a"])], {"a": ("b", 6)}, ["a"], ("b", 6)) for op in ["Softplus", "Elu", "Sin", "Cos"]},
    "HardSigmoid": Case([node("HardSigmoid", ["a"], alpha=0.4)], {"a": ("b", 6)}, ["a"], ("b", 6)),
    "Mean": Case([node("Mean", ["a", "c"])], {"a": ("b", 3), "c": (3,)}, ["a", "c"], ("b", 3)),
    "ReduceMax": Case([_const("axes", [1]), node("ReduceMax", ["a", "axes"], keepdims=0)], {"a": ("b", 4, 3)}, ["a"],
                      ("b", 3)),
    "ReduceMin_all_keepdims": Case([node("ReduceMin", ["a"])], {"a": ("b", 4)}, ["a"], (1, 1)),
    "AveragePool_pads_exclusive": Case([node("AveragePool", ["a"], kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 1, 1])],
                                       {"a": ("b", 2, 5, 4)}, ["a"], ("b", 2, 3, 4)),
    "AveragePool_include_pad_ceil": Case([node("AveragePool", ["a"], kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 0, 0],
                                               count_include_pad=1, ceil_mode=1)],
                                         {"a": ("b", 2, 4, 5)}, ["a"], ("b", 2, 3, 3)),
    # Opset 17: ReduceMean takes its axes as an attribute (the decompositions write it so).
    "LayerNormalization_opset17": Case([node("LayerNormalization", ["a", "s"], axis=1)], {"a": ("b", 3, 2), "s": (3, 2)},
                                       ["a", "s"], ("b", 3, 2), opset=17),
    "SCE_mean_opset17": Case([node("SoftmaxCrossEntropyLoss", ["a", "labels"])], {"a": ("b", 5), "labels": ("b",)},
                             ["a"], (), ints={"labels": (0, 5)}, opset=17),
    "ReduceMean_attribute_axes_opset17": Case([node("ReduceMean", ["a"], axes=[1], keepdims=0)], {"a": ("b", 3, 4)},
                                              ["a"], ("b", 4), opset=17),
}
# The Gradient of "ReduceMean_all" multiplies by the mean: its node writes "m".
CASES["ReduceMean_all"].nodes[0] = node("ReduceMean", ["a"], ["m"], keepdims=0)


def _check(case: Case) -> None:
    nodes, inputs = _model_parts(case)
    nodes = [*(helper.make_node("Constant", [], [k], value=helper.make_tensor(k, I64, v.shape, v.tolist()))
               for k, v in case.constants.items()), *nodes]
    outputs = [f"d_{x}" for x in case.xs]
    compare_expansion(nodes, {}, inputs, case.opset, outputs, lambda batch: _feeds(case, batch), rtol=case.tolerance)


# Each case compiles onnxtrain's reference at two batch sizes. The quick run keeps one case
# of each kind (element-wise, broadcast, matrix product, convolution, normalization,
# reduction, shape, loss); the others run with the slow tests.
QUICK = {"Relu", "Add_broadcast", "MatMul_batched", "Conv_stride_pads_bias", "LayerNormalization_opset17",
         "ReduceMean_keepdims", "Reshape", "Slice_negative_step", "SCE_mean"}


@pytest.mark.parametrize("name", [name if name in QUICK else pytest.param(name, marks=pytest.mark.slow)
                                  for name in sorted(CASES)])
def test_rule_matches_onnxtrain_gradient(name):
    _check(CASES[name])
