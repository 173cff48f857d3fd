"""Reductions, softmax family, normalizations, losses and Dropout beyond the backend cases.

Oracles: onnx.reference.ReferenceEvaluator, numpy formulas written out here,
hand-derived gradients and finite differences. Covers old-opset semantics,
16-bit floats, integer dtypes, training-mode outputs, gradients and Dropout's
randomness (which the backend cases pin to numpy's generator).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxtrain import ModelLoadError
from support.op_testing import finite_difference, run_model, translate

RNG = np.random.default_rng(7)


def single_node_model(node: onnx.NodeProto, inputs: Mapping[str, np.ndarray], opset: int,
                      initializers: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """A model of one node; `inputs` are graph inputs, `initializers` constants."""
    initializers = initializers or {}
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for name, v in inputs.items()],
        [helper.make_tensor_value_info(name, TensorProto.UNDEFINED, None) for name in node.output],
        initializer=[onnx.numpy_helper.from_array(v, name) for name, v in initializers.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])






def reference(model: onnx.ModelProto, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    return ReferenceEvaluator(model).run(None, dict(inputs))


def onnxruntime_reference(model: onnx.ModelProto, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """onnxruntime's outputs (typed like the first input); for old-opset semantics
    onnx.reference does not implement."""
    import onnxruntime

    model = onnx.ModelProto.FromString(model.SerializeToString())
    model.ir_version = 8
    for output in model.graph.output:
        output.type.CopyFrom(model.graph.input[0].type)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, dict(inputs))


def check_against_reference(node: onnx.NodeProto, inputs: Mapping[str, np.ndarray], opset: int,
                            rtol: float = 1e-5, atol: float = 1e-6,
                            oracle=reference) -> list[np.ndarray]:
    model = single_node_model(node, inputs, opset)
    actual = run_model(model, inputs)
    for got, want in zip(actual, oracle(model, inputs), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol)
    return actual




def model_gradient(model: onnx.ModelProto, inputs: Mapping[str, np.ndarray], wrt: str,
                   output: str, key=None,
                   weights: np.ndarray | float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(jax.grad, finite differences) of sum(output * weights) with respect to input `wrt`,
    in float64."""
    fn = translate(model)

    def total(value):
        return jnp.sum(fn(fn.params, {**inputs, wrt: value}, key)[output] * weights)

    with jax.enable_x64(True):
        analytic = np.asarray(jax.grad(total)(jnp.asarray(inputs[wrt])))
        numeric = finite_difference(lambda v: float(total(v)), np.asarray(inputs[wrt]))
    return analytic, numeric


# ---------------------------------------------------------------------------
# Reductions


@pytest.mark.parametrize("op_type", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd",
                                     "ReduceL1", "ReduceL2", "ReduceLogSumExp", "ReduceSumSquare"])
@pytest.mark.parametrize("opset", [1, 11])
def test_reduce_axes_attribute_in_old_opsets(op_type, opset):
    x = RNG.random((2, 3, 4)).astype(np.float32)
    node = helper.make_node(op_type, ["X"], ["Y"], axes=[0, -1], keepdims=0)
    (y,) = check_against_reference(node, {"X": x}, opset)
    assert y.shape == (3,)


@pytest.mark.parametrize("op_type, expected", [
    ("ReduceSumSquare", lambda x: x * x),
    ("ReduceLogSum", np.log),
    ("ReduceL1", np.abs),
    ("ReduceLogSumExp", lambda x: x),
    ("ReduceMax", lambda x: x),
])
def test_noop_with_empty_axes_keeps_the_elementwise_step(op_type, expected):
    x = RNG.random((2, 3)).astype(np.float32) + 0.5
    node = helper.make_node(op_type, ["X", "axes"], ["Y"], noop_with_empty_axes=1)
    model = single_node_model(node, {"X": x}, 18, {"axes": np.array([], np.int64)})
    (y,) = run_model(model, {"X": x})
    np.testing.assert_allclose(y, expected(x), rtol=1e-6)


def test_empty_axes_without_noop_reduces_everything():
    x = RNG.random((2, 3)).astype(np.float32)
    node = helper.make_node("ReduceSum", ["X", "axes"], ["Y"], keepdims=0)
    model = single_node_model(node, {"X": x}, 13, {"axes": np.array([], np.int64)})
    (y,) = run_model(model, {"X": x})
    np.testing.assert_allclose(y, x.sum(), rtol=1e-6)


def test_reduce_keeps_integer_dtypes_and_wraps_like_onnx():
    x = np.array([[100, 100], [-7, 2]], np.int8)
    reduce_sum = helper.make_node("ReduceSum", ["X"], ["Y"], axes=[1])
    (total,) = run_model(single_node_model(reduce_sum, {"X": x}, 11), {"X": x})
    assert total.dtype == np.int8
    np.testing.assert_array_equal(total, np.array([[-56], [-5]], np.int8))  # 200 wraps to -56
    reduce_mean = helper.make_node("ReduceMean", ["X"], ["Y"], axes=[1])
    (mean,) = run_model(single_node_model(reduce_mean, {"X": x}, 11), {"X": x})
    np.testing.assert_array_equal(mean, np.array([[100], [-2]], np.int8))  # -2.5 truncates to -2


@pytest.mark.parametrize("op_type, expected", [
    ("ReduceMax", np.iinfo(np.int32).min), ("ReduceMin", np.iinfo(np.int32).max),
    ("ReduceProd", 1), ("ReduceSum", 0)])
def test_integer_empty_set_values(op_type, expected):
    x = np.zeros((2, 0), np.int32)
    node = helper.make_node(op_type, ["X", "axes"], ["Y"], keepdims=0)
    model = single_node_model(node, {"X": x}, 20, {"axes": np.array([1], np.int64)})
    (y,) = run_model(model, {"X": x})
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, [expected, expected])


def test_reduce_min_of_bools_is_all():
    x = np.array([[True, False], [True, True]])
    node = helper.make_node("ReduceMin", ["X", "axes"], ["Y"], keepdims=0)
    (y,) = run_model(single_node_model(node, {"X": x}, 20, {"axes": np.array([1], np.int64)}), {"X": x})
    np.testing.assert_array_equal(y, [False, True])


def test_float16_sum_accumulates_in_float32():
    x = np.full(4096, 0.1, np.float16)
    node = helper.make_node("ReduceSum", ["X"], ["Y"], keepdims=0)
    (y,) = run_model(single_node_model(node, {"X": x}, 11), {"X": x})
    assert y.dtype == np.float16
    np.testing.assert_allclose(float(y), 4096 * float(np.float16(0.1)), rtol=1e-3)


@pytest.mark.parametrize("axes, message", [([0, -2], "same axis"), ([2], "out of range")])
def test_invalid_axes_are_reported(axes, message):
    x = np.zeros((2, 3), np.float32)
    model = single_node_model(helper.make_node("ReduceSum", ["X"], ["Y"], axes=axes), {"X": x}, 11)
    with pytest.raises(ModelLoadError, match=message):
        run_model(model, {"X": x})


@pytest.mark.slow
def test_reduce_log_sum_exp_is_stable_and_differentiable():
    x = np.array([[1000.0, 1000.0], [-3.0, 2.0]])
    node = helper.make_node("ReduceLogSumExp", ["X"], ["Y"], axes=[1])
    model = single_node_model(node, {"X": x}, 13)
    (y,) = run_model(model, {"X": x})
    np.testing.assert_allclose(y[:, 0], [1000 + np.log(2), np.log(np.exp(-3) + np.exp(2))])
    analytic, _ = model_gradient(model, {"X": x}, "X", "Y")
    softmax = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(analytic, softmax / softmax.sum(1, keepdims=True), rtol=1e-9)


# ---------------------------------------------------------------------------
# Softmax family


@pytest.mark.parametrize("op_type", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("opset, axis", [(11, 1), (11, 0), (11, -1), (13, 1), (13, 0)])
def test_softmax_family_axis_semantics(op_type, opset, axis):
    # Before opset 13 the input is coerced to 2-D at `axis`; from 13 on it is a plain axis.
    # onnx.reference implements only the opset-13 meaning, onnxruntime both.
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    check_against_reference(helper.make_node(op_type, ["X"], ["Y"], axis=axis), {"X": x}, opset,
                            oracle=onnxruntime_reference)


def test_softmax_default_axis_changed_at_opset_13():
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    node = helper.make_node("Softmax", ["X"], ["Y"])
    (old,) = run_model(single_node_model(node, {"X": x}, 11), {"X": x})
    (new,) = run_model(single_node_model(node, {"X": x}, 13), {"X": x})
    np.testing.assert_allclose(old.reshape(2, 12).sum(1), 1, rtol=1e-6)
    np.testing.assert_allclose(new.sum(-1), 1, rtol=1e-6)


def test_hardmax_marks_only_the_first_maximum():
    x = np.array([[3, 1, 3], [0, 2, 2]], np.float32)
    (y,) = run_model(single_node_model(helper.make_node("Hardmax", ["X"], ["Y"]), {"X": x}, 13), {"X": x})
    np.testing.assert_array_equal(y, [[1, 0, 0], [0, 1, 0]])


def test_log_softmax_float16_keeps_dtype_and_precision():
    x = (RNG.standard_normal((3, 50)) * 4).astype(np.float16)
    (y,) = run_model(single_node_model(helper.make_node("LogSoftmax", ["X"], ["Y"]), {"X": x}, 13), {"X": x})
    assert y.dtype == np.float16
    x64 = x.astype(np.float64)
    want = x64 - x64.max(1, keepdims=True)
    want -= np.log(np.exp(want).sum(1, keepdims=True))
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------------------
# BatchNormalization


def batch_norm_inputs(shape=(4, 3, 2, 2), dtype=np.float32):
    channels = shape[1]
    return {"X": RNG.standard_normal(shape).astype(dtype),
            "scale": RNG.random(channels).astype(dtype) + 0.5,
            "B": RNG.standard_normal(channels).astype(dtype),
            "mean": RNG.standard_normal(channels).astype(dtype),
            "var": RNG.random(channels).astype(dtype) + 0.5}


def numpy_batch_norm_training(inputs, momentum, epsilon):
    x = inputs["X"].astype(np.float64)
    axes = (0, 2, 3)
    mean, var = x.mean(axes), x.var(axes)
    shape = (1, -1, 1, 1)
    y = ((x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + epsilon)
         * inputs["scale"].reshape(shape) + inputs["B"].reshape(shape))
    running_mean = inputs["mean"] * momentum + mean * (1 - momentum)
    running_var = inputs["var"] * momentum + var * (1 - momentum)
    return y, running_mean, running_var, mean, var


def test_batch_norm_training_mode_matches_reference():
    inputs = batch_norm_inputs()
    node = helper.make_node("BatchNormalization", list(inputs), ["Y", "running_mean", "running_var"],
                            training_mode=1, momentum=0.7, epsilon=1e-3)
    check_against_reference(node, inputs, 15, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("opset, attributes", [(9, {}), (7, {}), (6, {"is_test": 0})])
def test_legacy_batch_norm_training_outputs(opset, attributes):
    # Opsets 7/9 train when the statistics outputs are requested; opset 6 unless is_test.
    inputs = batch_norm_inputs()
    node = helper.make_node("BatchNormalization", list(inputs),
                            ["Y", "mean_out", "var_out", "saved_mean", "saved_var"],
                            momentum=0.8, epsilon=1e-4, **attributes)
    actual = run_model(single_node_model(node, inputs, opset), inputs)
    for got, want in zip(actual, numpy_batch_norm_training(inputs, 0.8, 1e-4), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_legacy_batch_norm_with_only_y_is_inference():
    # onnx.reference's BatchNormalization-9 trains whenever momentum is set; the spec does not.
    inputs = batch_norm_inputs()
    node = helper.make_node("BatchNormalization", list(inputs), ["Y"], epsilon=1e-4)
    (y,) = run_model(single_node_model(node, inputs, 9), inputs)
    shape = (1, -1, 1, 1)
    want = ((inputs["X"] - inputs["mean"].reshape(shape)) / np.sqrt(inputs["var"].reshape(shape) + 1e-4)
            * inputs["scale"].reshape(shape) + inputs["B"].reshape(shape))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_non_spatial_batch_norm_uses_per_activation_parameters():
    inputs = batch_norm_inputs((2, 3, 4))
    for name in ("scale", "B", "mean", "var"):
        inputs[name] = RNG.random((3, 4)).astype(np.float32) + 0.5
    node = helper.make_node("BatchNormalization", list(inputs), ["Y"], spatial=0, epsilon=1e-4)
    (y,) = run_model(single_node_model(node, inputs, 7), inputs)
    want = ((inputs["X"] - inputs["mean"]) / np.sqrt(inputs["var"] + 1e-4) * inputs["scale"]
            + inputs["B"])
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_batch_norm_float16_input_with_float32_statistics():
    inputs = batch_norm_inputs()
    inputs["X"] = inputs["X"].astype(np.float16)
    node = helper.make_node("BatchNormalization", list(inputs), ["Y", "running_mean", "running_var"],
                            training_mode=1)
    y, running_mean, running_var = run_model(single_node_model(node, inputs, 15), inputs)
    assert (y.dtype, running_mean.dtype, running_var.dtype) == (np.float16, np.float32, np.float32)
    want = numpy_batch_norm_training({**inputs, "X": inputs["X"].astype(np.float32)}, 0.9, 1e-5)
    np.testing.assert_allclose(y.astype(np.float32), want[0], rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(running_var, want[2], rtol=1e-4)


def test_batch_norm_running_outputs_need_training_mode():
    inputs = batch_norm_inputs()
    node = helper.make_node("BatchNormalization", list(inputs), ["Y", "running_mean", "running_var"])
    with pytest.raises(ModelLoadError, match="training_mode"):
        run_model(single_node_model(node, inputs, 15), inputs)


@pytest.mark.slow
def test_batch_norm_training_gradient_flows_through_batch_statistics():
    inputs = {k: v.astype(np.float64) for k, v in batch_norm_inputs((3, 2, 2, 1)).items()}
    # Weighted, since the plain sum of a batch-normalized output does not depend on X.
    weights = RNG.standard_normal(inputs["X"].shape)
    node = helper.make_node("BatchNormalization", list(inputs), ["Y"], training_mode=1)
    model = single_node_model(node, inputs, 15)
    analytic, numeric = model_gradient(model, inputs, "X", "Y", weights=weights)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-7)
    assert np.abs(analytic).max() > 1e-3


# ---------------------------------------------------------------------------
# Instance, Layer, Group, RMS normalization


def test_layer_norm_stash_outputs_match_reference():
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    inputs = {"X": x, "S": RNG.random((3, 4)).astype(np.float32),
              "B": RNG.random((3, 4)).astype(np.float32)}
    node = helper.make_node("LayerNormalization", ["X", "S", "B"], ["Y", "Mean", "InvStdDev"], axis=1)
    y, mean, inv_std = check_against_reference(node, inputs, 17, rtol=1e-5, atol=1e-5)
    assert mean.shape == inv_std.shape == (2, 1, 1)


def test_layer_norm_float16_statistics_are_in_stash_type():
    x = RNG.standard_normal((2, 8)).astype(np.float16)
    inputs = {"X": x, "S": np.ones(8, np.float16)}
    node = helper.make_node("LayerNormalization", ["X", "S"], ["Y", "Mean", "InvStdDev"])
    y, mean, inv_std = run_model(single_node_model(node, inputs, 17), inputs)
    assert (y.dtype, mean.dtype, inv_std.dtype) == (np.float16, np.float32, np.float32)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mean[:, 0], x64.mean(1), rtol=1e-6)
    want = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, want, rtol=5e-3, atol=5e-3)


def test_group_norm_opset_18_scales_per_group():
    x = RNG.standard_normal((2, 4, 3)).astype(np.float32)
    inputs = {"X": x, "scale": np.array([1.5, -2.0], np.float32),
              "bias": np.array([0.5, 1.0], np.float32)}
    node = helper.make_node("GroupNormalization", list(inputs), ["Y"], num_groups=2, epsilon=1e-3)
    check_against_reference(node, inputs, 18, rtol=1e-4, atol=1e-5)


def test_group_norm_rejects_groups_that_do_not_divide_channels():
    inputs = {"X": np.zeros((1, 4, 2), np.float32), "scale": np.ones(4, np.float32),
              "bias": np.zeros(4, np.float32)}
    node = helper.make_node("GroupNormalization", list(inputs), ["Y"], num_groups=3)
    with pytest.raises(ModelLoadError, match="num_groups"):
        run_model(single_node_model(node, inputs, 21), inputs)


def test_instance_norm_float16():
    inputs = {"X": RNG.standard_normal((2, 3, 5)).astype(np.float16),
              "S": np.array([1, 2, 3], np.float16), "B": np.array([0, 1, -1], np.float16)}
    node = helper.make_node("InstanceNormalization", list(inputs), ["Y"])
    (y,) = run_model(single_node_model(node, inputs, 6), inputs)
    assert y.dtype == np.float16
    x = inputs["X"].astype(np.float64)
    want = ((x - x.mean(2, keepdims=True)) / np.sqrt(x.var(2, keepdims=True) + 1e-5)
            * inputs["S"].astype(np.float64)[:, None] + inputs["B"].astype(np.float64)[:, None])
    np.testing.assert_allclose(y, want, rtol=5e-3, atol=5e-3)


def test_rms_norm_output_has_scale_dtype():
    inputs = {"X": RNG.standard_normal((2, 6)).astype(np.float16),
              "scale": RNG.random(6).astype(np.float32)}
    node = helper.make_node("RMSNormalization", list(inputs), ["Y"])
    (y,) = run_model(single_node_model(node, inputs, 23), inputs)
    assert y.dtype == np.float32
    x = inputs["X"].astype(np.float64)
    np.testing.assert_allclose(y, x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-5) * inputs["scale"],
                               rtol=2e-3)


# ---------------------------------------------------------------------------
# Lp, mean-variance and local response normalization


def test_lp_normalization_p1_and_zero_vectors():
    x = np.array([[3.0, -1.0], [0.0, 0.0]], np.float32)
    (y,) = run_model(single_node_model(helper.make_node("LpNormalization", ["X"], ["Y"], p=1), {"X": x}, 1),
               {"X": x})
    np.testing.assert_allclose(y, [[0.75, -0.25], [0, 0]])


def test_lp_normalization_gradient():
    x = RNG.standard_normal((2, 3))
    model = single_node_model(helper.make_node("LpNormalization", ["X"], ["Y"], axis=0), {"X": x}, 22)
    analytic, numeric = model_gradient(model, {"X": x}, "X", "Y")
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-8)


def test_mean_variance_normalization_custom_axes():
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    node = helper.make_node("MeanVarianceNormalization", ["X"], ["Y"], axes=[1, 2])
    (y,) = run_model(single_node_model(node, {"X": x}, 13), {"X": x})
    x64 = x.astype(np.float64)
    mean = x64.mean((1, 2), keepdims=True)
    np.testing.assert_allclose(y, (x64 - mean) / (x64.std((1, 2), keepdims=True) + 1e-9), rtol=1e-5)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_lrn_window_around_each_channel(size):
    x = RNG.standard_normal((2, 5, 3)).astype(np.float32)
    node = helper.make_node("LRN", ["X"], ["Y"], size=size, alpha=0.1, beta=0.6, bias=2.0)
    (y,) = run_model(single_node_model(node, {"X": x}, 13), {"X": x})
    below, above = (size - 1) // 2, size - 1 - (size - 1) // 2
    want = np.empty_like(x, dtype=np.float64)
    for c in range(5):
        window = x[:, max(0, c - below):c + above + 1].astype(np.float64)
        want[:, c] = x[:, c] / (2.0 + 0.1 / size * (window ** 2).sum(1)) ** 0.6
    np.testing.assert_allclose(y, want, rtol=1e-5)


# ---------------------------------------------------------------------------
# Losses


def test_nll_mean_with_weights_and_out_of_range_ignore_index():
    log_prob = np.log(RNG.dirichlet(np.ones(4), size=(3, 2)).transpose(0, 2, 1)).astype(np.float32)
    target = np.array([[0, 9], [3, 1], [9, 9]], np.int64)
    weight = np.array([0.5, 2.0, 1.0, 3.0], np.float32)
    node = helper.make_node("NegativeLogLikelihoodLoss", ["X", "T", "W"], ["L"], ignore_index=9)
    (loss,) = check_against_reference(node, {"X": log_prob, "T": target, "W": weight}, 22)
    picked = [(0, 0, 0), (1, 3, 0), (1, 1, 1)]
    want = (-sum(log_prob[n, c, d] * weight[c] for n, c, d in picked)
            / sum(weight[c] for _, c, _ in picked))
    np.testing.assert_allclose(loss, want, rtol=1e-6)


def test_nll_int32_targets_and_reduction_none_shape():
    log_prob = RNG.standard_normal((2, 3, 2, 2)).astype(np.float32)
    target = RNG.integers(0, 3, (2, 2, 2)).astype(np.int32)
    node = helper.make_node("NegativeLogLikelihoodLoss", ["X", "T"], ["L"], reduction="none")
    (loss,) = check_against_reference(node, {"X": log_prob, "T": target}, 13)
    assert loss.shape == (2, 2, 2)


def test_nll_rejects_mismatched_target_shape():
    inputs = {"X": np.zeros((2, 3, 4), np.float32), "T": np.zeros((2, 5), np.int64)}
    node = helper.make_node("NegativeLogLikelihoodLoss", ["X", "T"], ["L"])
    with pytest.raises(ModelLoadError, match="target has shape"):
        run_model(single_node_model(node, inputs, 13), inputs)


def test_softmax_cross_entropy_gradient_is_softmax_minus_one_hot():
    scores = RNG.standard_normal((4, 5))
    labels = np.array([1, 0, 4, 2], np.int64)
    node = helper.make_node("SoftmaxCrossEntropyLoss", ["S", "L"], ["loss"], reduction="sum")
    model = single_node_model(node, {"S": scores, "L": labels}, 13)
    analytic, _ = model_gradient(model, {"S": scores, "L": labels}, "S", "loss")
    softmax = np.exp(scores) / np.exp(scores).sum(1, keepdims=True)
    np.testing.assert_allclose(analytic, softmax - np.eye(5)[labels], rtol=1e-9, atol=1e-12)


def test_softmax_cross_entropy_float16_keeps_dtype():
    scores = RNG.standard_normal((3, 4, 2)).astype(np.float16)
    labels = np.array([[0, 3], [1, 2], [2, 2]], np.int64)
    node = helper.make_node("SoftmaxCrossEntropyLoss", ["S", "L"], ["loss", "log_prob"])
    check_against_reference(node, {"S": scores, "L": labels}, 13, rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------------------
# Dropout


def dropout_model(opset: int = 13, ratio: float | None = None, training: bool | None = None,
                  feed_training: bool = False, outputs=("Y", "mask")) -> onnx.ModelProto:
    """Dropout on input X; ratio and training_mode as constants, or training_mode as
    a graph input when `feed_training`."""
    inputs = {"X": np.zeros((), np.float32)}
    initializers = {}
    names = ["X"]
    if ratio is not None:
        initializers["ratio"] = np.array(ratio, np.float32)
    if training is not None or feed_training:
        names += ["ratio" if ratio is not None else "", "training"]
        if feed_training:
            inputs["training"] = np.array(True)
        else:
            initializers["training"] = np.array(training)
    elif ratio is not None:
        names.append("ratio")
    model = single_node_model(helper.make_node("Dropout", names, list(outputs)), inputs, opset,
                              initializers)
    model.graph.input[0].type.tensor_type.ClearField("shape")
    return model


def test_training_dropout_statistics_and_mask_consistency():
    x = RNG.standard_normal((200, 100)).astype(np.float32) + 3.0
    fn = translate(dropout_model(ratio=0.3, training=True))
    outputs = fn(fn.params, {"X": x}, jax.random.key(0))
    y, mask = np.asarray(outputs["Y"]), np.asarray(outputs["mask"])
    assert y.dtype == np.float32 and mask.dtype == np.bool_
    assert abs(mask.mean() - 0.7) < 0.01
    np.testing.assert_allclose(y, np.where(mask, x / 0.7, 0), rtol=1e-6)
    other = np.asarray(fn(fn.params, {"X": x}, jax.random.key(1))["mask"])
    assert (other != mask).mean() > 0.3


def test_training_dropout_without_key_is_an_error():
    x = np.ones((3,), np.float32)
    fn = translate(dropout_model(training=True))
    with pytest.raises(ModelLoadError, match="PRNG key"):
        fn(fn.params, {"X": x})


def test_dropout_inference_is_identity_with_true_mask():
    x = RNG.standard_normal((4, 5)).astype(np.float32)
    for model in (dropout_model(), dropout_model(ratio=0.5, training=False), dropout_model(opset=11)):
        y, mask = run_model(model, {"X": x})
        np.testing.assert_array_equal(y, x)
        assert mask.dtype == np.bool_ and mask.all()


def test_dropout_7_mask_has_data_type():
    x = RNG.standard_normal((2, 3)).astype(np.float64)
    y, mask = run_model(dropout_model(opset=7), {"X": x})
    np.testing.assert_array_equal(y, x)
    assert mask.dtype == np.float64 and (mask == 1).all()


def test_dropout_6_trains_unless_is_test():
    x = np.ones((50, 50), np.float32)
    fn = translate(single_node_model(helper.make_node("Dropout", ["X"], ["Y"], ratio=0.25), {"X": x}, 6))
    y = np.asarray(fn(fn.params, {"X": x}, jax.random.key(3))["Y"])
    assert set(np.unique(y)) == {0.0, np.float32(1 / 0.75)}
    (y_test,) = run_model(single_node_model(helper.make_node("Dropout", ["X"], ["Y"], is_test=1), {"X": x}, 6),
                    {"X": x})
    np.testing.assert_array_equal(y_test, x)


@pytest.mark.slow
def test_dropout_training_mode_fed_at_run_time_stays_jitted():
    x = np.ones((10, 10), np.float32)
    fn = translate(dropout_model(ratio=0.5, feed_training=True))
    key = jax.random.key(5)
    trained = fn(fn.params, {"X": x, "training": np.array(True)}, key)
    held = fn(fn.params, {"X": x, "training": np.array(False)}, key)
    assert not np.asarray(trained["mask"]).all()
    np.testing.assert_array_equal(np.asarray(held["Y"]), x)
    assert np.asarray(held["mask"]).all()
    assert not fn._eager_signatures


@pytest.mark.slow
def test_dropout_ratio_one_drops_everything_with_finite_gradient():
    x = RNG.standard_normal((3, 4))
    model = dropout_model(ratio=1.0, training=True, outputs=("Y",))
    key = jax.random.key(0)
    (y,) = run_model(model, {"X": x}, key)
    np.testing.assert_array_equal(y, 0)
    analytic, _ = model_gradient(model, {"X": x}, "X", "Y", key)
    np.testing.assert_array_equal(analytic, 0)


@pytest.mark.slow
def test_dropout_gradient_is_mask_over_keep_probability():
    x = RNG.standard_normal((6, 7))
    model = dropout_model(ratio=0.4, training=True)
    key = jax.random.key(11)
    _, mask = run_model(model, {"X": x}, key)
    analytic, _ = model_gradient(model, {"X": x}, "X", "Y", key)
    keep = 1 - np.float64(np.float32(0.4))  # the ratio input is float32
    np.testing.assert_allclose(analytic, mask / keep, rtol=1e-12)
