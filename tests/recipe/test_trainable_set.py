"""The default trainable set: weights are what the forward pass computes with as weights;
exporter constants (exponents, scales, fill values, epsilons, zero RNN states, shapes,
BatchNorm statistics) stay fixed.

Hand-built graphs pin each role; the reasons and the chosen names are derived by hand from
the graph. Real exports (torch + transformers, when installed) check the chosen set against
the torch module's named_parameters() and train by default.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain._recipe import trainable
from onnxtrain._recipe.trainable import trainable_set
from onnxtrain.errors import BindingError
from support import peak_memory

F = TensorProto.FLOAT
RNG = np.random.default_rng(0)


def _model(nodes, initializers: dict[str, np.ndarray], inputs=(("x", [2, 4]),), output="y",
           output_shape=None) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(name, F, shape) for name, shape in inputs],
        [helper.make_tensor_value_info(output, F, output_shape)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _f32(*shape, scale=1.0):
    return (RNG.normal(size=shape) * scale).astype(np.float32)


def _gelu_tanh_model() -> onnx.ModelProto:
    """x @ W + b, then the tanh GELU as exporters write it: 0.5·h·(1 + tanh(c·(h + k·h³)))."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["m", "b"], ["h"]),
             helper.make_node("Pow", ["h", "three"], ["h3"]), helper.make_node("Mul", ["h3", "k"], ["kh3"]),
             helper.make_node("Add", ["h", "kh3"], ["inner"]), helper.make_node("Mul", ["inner", "c"], ["ci"]),
             helper.make_node("Tanh", ["ci"], ["t"]), helper.make_node("Add", ["t", "one"], ["t1"]),
             helper.make_node("Mul", ["h", "half"], ["hh"]), helper.make_node("Mul", ["hh", "t1"], ["y"])]
    return _model(nodes, {"W": _f32(4, 3), "b": _f32(3), "three": np.float32(3.0), "k": np.float32(0.044715),
                          "c": np.float32(0.7978846), "one": np.float32(1.0), "half": np.float32(0.5)})


def test_gelu_exponent_and_scalars_are_left_out_with_reasons():
    chosen = trainable_set(_gelu_tanh_model())
    assert chosen.weights == ["W", "b"]
    assert chosen.left_out == {"three": "exponent of Pow", "k": "scalar constant of Mul",
                               "c": "scalar constant of Mul", "one": "scalar constant of Add",
                               "half": "scalar constant of Mul"}


@pytest.mark.slow
def test_gelu_trains_by_default_where_training_the_exponent_gives_nan():
    """d/dy x^y = x^y·log x is NaN for x < 0: with the exponent trained, the first step's
    update is NaN; the default set keeps it (and the loss) finite."""
    model = _gelu_tanh_model()
    feeds = {"x": _f32(2, 4, scale=3.0), "labels": _f32(2, 3)}
    default = onnxtrain.Trainer(onnxtrain.make_training_model(model, "mse"))
    losses = [float(default.step(feeds)["loss"]) for _ in range(3)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert "three" not in default.state
    everything = onnxtrain.Trainer(onnxtrain.make_training_model(
        model, "mse", trainable=lambda name, value: True), nan_policy="ignore")
    everything.step(feeds)
    assert np.isnan(np.asarray(everything.state["three"]))


def test_attention_scale_and_mask_fill_values_are_left_out():
    """Div by a scalar scale; an additive mask holding float32's lowest; Where with a fill."""
    mask = np.zeros((2, 3), np.float32)
    mask[:, 2] = np.finfo(np.float32).min
    nodes = [helper.make_node("MatMul", ["x", "Wq"], ["q"]), helper.make_node("Div", ["q", "scale"], ["s"]),
             helper.make_node("Add", ["s", "mask"], ["masked"]),
             helper.make_node("Less", ["masked", "zero"], ["negative"]),
             helper.make_node("Where", ["negative", "fill", "masked"], ["y"])]
    chosen = trainable_set(_model(nodes, {"Wq": _f32(4, 3), "scale": np.float32(4.0), "mask": mask,
                                          "zero": np.float32(0), "fill": np.float32(-1e4)}))
    assert chosen.weights == ["Wq"]
    assert chosen.left_out == {"scale": "scalar constant of Div", "mask": "mask or fill value",
                               "zero": "operand of Less", "fill": "scalar constant of Where"}


def test_folded_masks_are_left_out_and_biases_are_not():
    """Masks added to attention scores (a MatMul product): all zeros (no padding) and zeros
    with -10000 are masks; a bias along the last axis, even all zeros, is a weight."""
    old_style = np.zeros((2, 1, 3, 3), np.float32)
    old_style[..., 2] = -10000.0
    nodes = [helper.make_node("MatMul", ["q", "k"], ["scores"]),
             helper.make_node("Add", ["scores", "no_padding"], ["a"]),
             helper.make_node("Add", ["a", "old_style"], ["b"]),
             helper.make_node("Add", ["b", "zero_bias"], ["y"])]
    chosen = trainable_set(_model(nodes, {"k": _f32(2, 1, 4, 3), "no_padding": np.zeros((2, 1, 3, 3), np.float32),
                                          "old_style": old_style, "zero_bias": np.zeros((1, 1, 1, 3), np.float32)},
                                  inputs=(("q", [2, 1, 3, 4]),)))
    assert chosen.weights == ["k", "zero_bias"]
    assert chosen.left_out == {"no_padding": "all-zero mask of Add", "old_style": "mask or fill value"}


def test_vectors_and_biases_are_weights_even_of_size_one():
    """A Linear(n, 1) bias is one element but a weight: it is added to a MatMul's product
    (here through a Reshape). A position embedding and a layer scale are wider elementwise
    operands; a one-element divisor is a scale."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Reshape", ["m", "shape"], ["r"]),
             helper.make_node("Add", ["r", "bias"], ["h"]), helper.make_node("Add", ["h", "position"], ["p"]),
             helper.make_node("Mul", ["p", "layer_scale"], ["l"]),
             helper.make_node("Div", ["l", "temperature"], ["y"])]
    chosen = trainable_set(_model(nodes, {"W": _f32(4, 1), "shape": np.array([2, 1], np.int64),
                                          "bias": _f32(1), "position": _f32(2, 1), "layer_scale": _f32(2, 1),
                                          "temperature": np.ones((1, 1), np.float32)},
                                  output_shape=[2, 1]))
    assert chosen.weights == ["W", "bias", "position", "layer_scale"]
    assert chosen.left_out == {"temperature": "scalar constant of Div"}


def test_roles_are_followed_through_pass_through_ops():
    """Transpose -> MatMul is a weight; Cast -> Mul of a scalar and Expand of a scalar fill
    are constants; a float cast to a shape is a shape operand; Shape reads only the shape."""
    nodes = [helper.make_node("Transpose", ["Wt"], ["W"], perm=[1, 0]), helper.make_node("MatMul", ["x", "W"], ["m"]),
             helper.make_node("Cast", ["scale"], ["scale16"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["m", "scale16"], ["s"]),
             helper.make_node("Shape", ["s"], ["shape"]), helper.make_node("Expand", ["fill", "shape"], ["filled"]),
             helper.make_node("Add", ["s", "filled"], ["a"]),
             helper.make_node("Cast", ["float_shape"], ["int_shape"], to=TensorProto.INT64),
             helper.make_node("Reshape", ["a", "int_shape"], ["r"]),
             helper.make_node("Shape", ["probe"], ["probe_shape"]),
             helper.make_node("Cast", ["probe_shape"], ["probe_float"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["r", "probe_float"], ["y"])]
    chosen = trainable_set(_model(nodes, {"Wt": _f32(3, 4), "scale": np.float16(0.5), "fill": np.float32(-2.0),
                                          "float_shape": np.array([2, 3], np.float32), "probe": _f32(1)}))
    assert chosen.weights == ["Wt"]
    assert chosen.left_out == {"scale": "scalar constant of Mul", "fill": "scalar constant of Add",
                               "float_shape": "shape or axes operand of Reshape", "probe": "only its shape is read, by Shape"}


def test_embeddings_normalization_and_batchnorm_statistics():
    ids = ("ids", [2, 3])
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["e"]),
         helper.make_node("Concat", ["cls", "e"], ["c"], axis=1),
         helper.make_node("LayerNormalization", ["c", "gamma", "beta"], ["n"], axis=-1),
         helper.make_node("Add", ["n", "epsilon"], ["ne"]),
         helper.make_node("Transpose", ["ne"], ["t"], perm=[0, 2, 1]),
         helper.make_node("BatchNormalization", ["t", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["b"]),
         helper.make_node("Clip", ["b", "low", "high"], ["y"])],
        "g", [helper.make_tensor_value_info(*ids[:1], TensorProto.INT64, ids[1])],
        [helper.make_tensor_value_info("y", F, None)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in {
            "table": _f32(10, 4), "cls": _f32(2, 1, 4), "gamma": np.ones(4, np.float32),
            "beta": np.zeros(4, np.float32), "epsilon": np.float32(1e-5), "bn_scale": _f32(4),
            "bn_bias": _f32(4), "bn_mean": _f32(4), "bn_var": np.ones(4, np.float32),
            "low": np.float32(-6), "high": np.float32(6)}.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    chosen = trainable_set(model)
    assert chosen.weights == ["table", "cls", "gamma", "beta", "bn_scale", "bn_bias"]
    assert chosen.left_out == {"epsilon": "scalar constant of Add", "bn_mean": "BatchNorm running statistic",
                               "bn_var": "BatchNorm running statistic", "low": "bound of Clip",
                               "high": "bound of Clip"}


@pytest.mark.parametrize("op_type, zero_state", [("LSTM", True), ("GRU", True), ("RNN", True), ("LSTM", False)])
def test_rnn_weights_are_trained_and_zero_initial_states_are_not(op_type, zero_state):
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op_type]
    hidden = 5
    state = np.zeros((1, 2, hidden), np.float32) if zero_state else _f32(1, 2, hidden)
    inputs = ["x", "W", "R", "B", "", "h0"] + (["c0"] if op_type == "LSTM" else [])
    values = {"W": _f32(1, gates * hidden, 4), "R": _f32(1, gates * hidden, hidden), "B": _f32(1, 2 * gates * hidden),
              "h0": state, **({"c0": np.zeros((1, 2, hidden), np.float32)} if op_type == "LSTM" else {})}
    nodes = [helper.make_node("Transpose", ["x0"], ["x"], perm=[1, 0, 2]),
             helper.make_node(op_type, inputs, ["", "y"], hidden_size=hidden)]
    chosen = trainable_set(_model(nodes, values, inputs=(("x0", [2, 3, 4]),)))
    reason = f"zero initial state of {op_type}"
    assert chosen.weights == ["W", "R", "B"] + ([] if zero_state else ["h0"])
    assert chosen.left_out == ({"h0": reason} if zero_state else {}) | (
        {"c0": reason} if op_type == "LSTM" else {})


def test_a_tensor_shared_by_a_weight_and_a_constant_role_is_a_weight():
    """Exporters merge equal tensors: one initializer may be both a bias and a Pow exponent."""
    nodes = [helper.make_node("Gemm", ["x", "W", "shared"], ["g"]), helper.make_node("Pow", ["g", "shared"], ["y"])]
    chosen = trainable_set(_model(nodes, {"W": _f32(4, 1), "shared": np.full(1, 2.0, np.float32)}))
    assert chosen.weights == ["W", "shared"] and chosen.left_out == {}


def test_unused_initializer_is_left_out():
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"])]
    chosen = trainable_set(_model(nodes, {"W": _f32(4, 3), "unused": _f32(3)}))
    assert chosen.weights == ["W"] and chosen.left_out == {"unused": "no node computes with it"}


def test_trainable_overrides_the_default_and_may_name_constants():
    model = _gelu_tanh_model()
    training = onnxtrain.make_training_model(model, "mse", trainable=["W", "half"])
    assert {b.key for b in training.training_info[0].update_binding} >= {"W", "half"}
    assert "b" not in {b.key for b in training.training_info[0].update_binding}
    by_predicate = onnxtrain.make_training_model(model, "mse", trainable=lambda name, value: value.ndim == 0)
    assert {b.key for b in by_predicate.training_info[0].update_binding} >= {"three", "k", "c", "one", "half"}


def test_batchnorm_statistics_cannot_be_named_trainable():
    nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "mean", "var"], ["y"])]
    model = _model(nodes, {"s": _f32(4), "b": _f32(4), "mean": _f32(4), "var": np.ones(4, np.float32)})
    with pytest.raises(BindingError, match="mean"):
        onnxtrain.make_training_model(model, "mse", trainable=["s", "mean"])


def test_the_chosen_set_is_logged_once_by_make_training_model_and_finetune(caplog):
    optax = pytest.importorskip("optax")
    model = _gelu_tanh_model()
    with caplog.at_level(logging.INFO, logger="onnxtrain"):
        onnxtrain.make_training_model(model, "mse")
        onnxtrain.finetune(model, "mse", optax.sgd(0.1))
    lines = [r.getMessage() for r in caplog.records if "float initializers" in r.getMessage()]
    assert len(lines) == 2
    assert lines[0] == lines[1]
    assert lines[0].startswith("training 2 of 7 float initializers; left out three (exponent of Pow)")


def test_inspect_prints_the_default_trainable_set(tmp_path, capsys):
    from onnxtrain.cli import main

    path = tmp_path / "gelu.onnx"
    path.write_bytes(_gelu_tanh_model().SerializeToString())
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "default trainable set: 2 of 7 float initializers; left out:" in out
    assert "    three: exponent of Pow" in out


def test_group_norm_written_as_instance_norm_trains_only_the_module_affine():
    """torch's dynamo exporter writes GroupNorm as Reshape -> InstanceNormalization(ones,
    zeros) -> Reshape -> Mul(gamma) -> Add(beta): the ones and zeros are its constants, gamma
    and beta the module's weights. An InstanceNormalization on its own keeps its affine."""
    groups, channels = 2, 4
    nodes = [helper.make_node("Reshape", ["x", "grouped"], ["g"]),
             helper.make_node("InstanceNormalization", ["g", "ones", "zeros"], ["n"]),
             helper.make_node("Reshape", ["n", "back"], ["r"]),
             helper.make_node("Mul", ["r", "gamma"], ["m"]),
             helper.make_node("Add", ["m", "beta"], ["y"])]
    weights = {"grouped": np.array([2, groups, -1], np.int64), "back": np.array([2, channels, 3], np.int64),
               "ones": np.ones(groups, np.float32), "zeros": np.zeros(groups, np.float32),
               "gamma": _f32(channels, 1), "beta": _f32(channels, 1)}
    chosen = trainable_set(_model(nodes, weights, inputs=(("x", [2, channels, 3]),)))
    assert chosen.weights == ["gamma", "beta"]
    assert set(chosen.left_out) >= {"ones", "zeros"}
    assert "GroupNorm" in chosen.left_out["ones"]

    alone = [helper.make_node("InstanceNormalization", ["x", "ones", "zeros"], ["y"])]
    chosen = trainable_set(_model(alone, {"ones": np.ones(channels, np.float32),
                                          "zeros": np.zeros(channels, np.float32)},
                                  inputs=(("x", [2, channels, 3]),)))
    assert chosen.weights == ["ones", "zeros"]


def test_masks_are_found_whatever_block_of_the_value_holds_them(monkeypatch):
    """_is_mask reads a value a block at a time: a fill value or a mask's large entry in a
    later block counts as much as in the first, and a weight stays a weight."""
    monkeypatch.setattr(trainable, "_BLOCK", 4)
    late_fill = np.zeros((3, 5), np.float32)
    late_fill[2, 4] = np.finfo(np.float32).min
    late_mask = np.zeros((3, 5), np.float32)
    late_mask[2, 3:] = -10000.0
    late_nan = _f32(3, 5)
    late_nan[2, 4] = np.nan
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["m", "late_fill"], ["a"]),
             helper.make_node("Add", ["a", "late_mask"], ["b"]), helper.make_node("Add", ["b", "late_nan"], ["y"])]
    chosen = trainable_set(_model(nodes, {"W": _f32(4, 5), "late_fill": late_fill, "late_mask": late_mask,
                                          "late_nan": late_nan}))
    assert chosen.weights == ["W"]
    assert chosen.left_out == {name: "mask or fill value" for name in ["late_fill", "late_mask", "late_nan"]}


PROBE = Path(__file__).with_name("build_memory_probe.py")


@pytest.mark.skipif(not peak_memory.AVAILABLE, reason="needs Linux's peak-RSS reset")
def test_building_a_training_model_holds_few_copies_of_a_large_weight(tmp_path):
    """A model of one 64 MiB weight: building its training model (Adam) grows peak memory by
    less than 4.5 times the weight (3 here: the file's bytes, the parsed model and the weight
    read from it). A float64 copy of the weight and of its magnitude, made to tell a weight
    from a mask, and dense optimizer slots took it to 6."""
    weight = np.full((4096, 4096), 0.01, np.float32)
    path = tmp_path / "big.onnx"
    onnx.save(_model([helper.make_node("MatMul", ["x", "W"], ["y"])], {"W": weight}, inputs=(("x", [2, 4096]),)),
              path)
    growth = peak_memory.run_probe(PROBE, str(path))["peak_growth"]
    assert growth < 4.5 * weight.nbytes, f"peak grew by {growth / weight.nbytes:.1f} times the weight"
