"""Position tables stay out of the default trainable set: rotary frequencies and cos/sin tables,
sinusoidal frequencies, ALiBi slopes and folded ALiBi biases, the fixed inputs of attention
ops. Their look-alikes that torch trains stay in: SIREN's first layer, Snake's frequencies, a
learned gate pair, a learned bias added to attention scores, a weight scaled by a shape.

Hand-built graphs pin each rule; the expected sets and reasons are derived by hand from the
graph. tests/recipe/test_trainable_llm_exports.py checks the rules on real exports.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain._recipe import damage
from onnxtrain._recipe.trainable import trainable_set

F, I64 = TensorProto.FLOAT, TensorProto.INT64
RNG = np.random.default_rng(0)
T, D, HEADS = 6, 8, 2
ROTARY = "rotary table (frequencies times positions, into Sin/Cos)"


def _f32(*shape):
    return (RNG.normal(size=shape) * 0.1).astype(np.float32)


def _i64(*values):
    return np.array(values, np.int64)


def _model(nodes, initializers, inputs, outputs=("y",), opsets=(("", 18),), constants=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        list(constants) + nodes, "g",
        [helper.make_tensor_value_info(name, kind, shape) for name, kind, shape in inputs],
        [helper.make_tensor_value_info(name, F, None) for name in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], ir_version=10)


def _angles() -> np.ndarray:
    inv_freq = 1.0 / 10000 ** (np.arange(0, D, 2) / D)
    freqs = np.outer(np.arange(T), inv_freq)
    return np.concatenate([freqs, freqs], axis=-1)


def _rotate(q: str, prefix: str) -> list:
    """rotate_half(q) as exporters write it: Concat(-q[..., D/2:], q[..., :D/2])."""
    return [helper.make_node("Slice", [q, "half", "end", "last"], [f"{prefix}_hi"]),
            helper.make_node("Slice", [q, "zero", "half", "last"], [f"{prefix}_lo"]),
            helper.make_node("Neg", [f"{prefix}_hi"], [f"{prefix}_neg"]),
            helper.make_node("Concat", [f"{prefix}_neg", f"{prefix}_lo"], [f"{prefix}_rot"], axis=-1)]


SLICES = {"half": _i64(D // 2), "end": _i64(D), "zero": _i64(0), "last": _i64(-1)}


def _rotary_model(positions: str) -> onnx.ModelProto:
    """q = x @ Wq rotated by angles inv_freq * positions, as transformers computes them: the
    positions from a position_ids input, or from Range over the sequence length."""
    if positions == "ids":
        source = [helper.make_node("Cast", ["position_ids"], ["pos"], to=F)]
        inputs = [("x", F, [1, T, D]), ("position_ids", I64, [1, T])]
    else:
        source = [helper.make_node("Shape", ["x"], ["shape"]),
                  helper.make_node("Gather", ["shape", "one"], ["length"], axis=0),
                  helper.make_node("Range", ["zero_scalar", "length", "one_scalar"], ["range"]),
                  helper.make_node("Cast", ["range"], ["pos"], to=F)]
        inputs = [("x", F, [1, T, D])]
    nodes = source + [
        helper.make_node("Unsqueeze", ["pos", "axis_last"], ["pos_col"]),
        helper.make_node("Mul", ["pos_col", "inv_freq"], ["freqs"]),
        helper.make_node("Concat", ["freqs", "freqs"], ["angles"], axis=-1),
        helper.make_node("Cos", ["angles"], ["cos"]), helper.make_node("Sin", ["angles"], ["sin"]),
        helper.make_node("MatMul", ["x", "Wq"], ["q"]), *_rotate("q", "q"),
        helper.make_node("Mul", ["q", "cos"], ["qc"]), helper.make_node("Mul", ["q_rot", "sin"], ["qs"]),
        helper.make_node("Add", ["qc", "qs"], ["y"])]
    values = {"inv_freq": (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32), "Wq": _f32(D, D),
              "axis_last": _i64(-1), "one": _i64(1), "zero_scalar": np.array(0, np.int64),
              "one_scalar": np.array(1, np.int64), **SLICES}
    return _model(nodes, values, inputs)


@pytest.mark.parametrize("positions", ["ids", "range"])
def test_rotary_frequencies_times_positions_are_left_out(positions):
    chosen = trainable_set(_rotary_model(positions))
    assert chosen.weights == ["Wq"]
    assert chosen.left_out["inv_freq"] == ROTARY


def test_folded_cos_sin_pair_is_left_out_and_a_learned_gate_pair_is_not():
    """x·C + rotate(x)·S: C, S the cos and sin of the angles (a static export folds them); the
    same pattern with two learned tables (a gated mix) trains."""
    def model(c, s):
        nodes = [helper.make_node("MatMul", ["x", "Wq"], ["q"]), *_rotate("q", "q"),
                 helper.make_node("Mul", ["q", "C"], ["qc"]), helper.make_node("Mul", ["q_rot", "S"], ["qs"]),
                 helper.make_node("Add", ["qc", "qs"], ["y"])]
        return _model(nodes, {"Wq": _f32(D, D), "C": c, "S": s, **SLICES}, [("x", F, [1, T, D])])

    angles = _angles()
    scaled = 0.8  # an attention scaling multiplies both tables
    chosen = trainable_set(model((scaled * np.cos(angles)).astype(np.float32)[None],
                                 (scaled * np.sin(angles)).astype(np.float32)[None]))
    assert chosen.weights == ["Wq"]
    assert set(chosen.left_out) == {"C", "S"} and chosen.left_out["C"].startswith("rotary table (a folded cos/sin")
    learned = trainable_set(model(_f32(1, T, D), _f32(1, T, D)))
    assert learned.weights == ["Wq", "C", "S"]


def test_cos_sin_caches_read_by_position_ids_are_a_pair():
    """Older transformers code gathers the rows of precomputed cos/sin caches by position ids."""
    angles = _angles()
    nodes = [helper.make_node("Gather", ["cos_cached", "position_ids"], ["cos"]),
             helper.make_node("Gather", ["sin_cached", "position_ids"], ["sin"]),
             helper.make_node("MatMul", ["x", "Wq"], ["q"]), *_rotate("q", "q"),
             helper.make_node("Mul", ["q", "cos"], ["qc"]), helper.make_node("Mul", ["q_rot", "sin"], ["qs"]),
             helper.make_node("Add", ["qc", "qs"], ["y"])]
    chosen = trainable_set(_model(nodes, {"cos_cached": np.cos(angles).astype(np.float32),
                                          "sin_cached": np.sin(angles).astype(np.float32), "Wq": _f32(D, D),
                                          **SLICES}, [("x", F, [1, T, D]), ("position_ids", I64, [1, T])]))
    assert chosen.weights == ["Wq"] and set(chosen.left_out) == {"cos_cached", "sin_cached"}


def test_sin_of_a_layer_is_a_weight_and_sin_of_scaled_inputs_is_a_table():
    """SIREN: sin(x W + b) trains W and b. Snake: h + sin²(a h)/a trains a. A time step t
    scaled by fixed frequencies into Sin/Cos (diffusion models, NeRF) is a sinusoidal table."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["pre"]),
             helper.make_node("Sin", ["pre"], ["h"]),
             helper.make_node("Mul", ["h", "alpha"], ["ah"]), helper.make_node("Sin", ["ah"], ["s"]),
             helper.make_node("Mul", ["s", "s"], ["s2"]), helper.make_node("Div", ["s2", "alpha"], ["snake"]),
             helper.make_node("Add", ["h", "snake"], ["hs"]),
             helper.make_node("Unsqueeze", ["t", "axis_last"], ["t_col"]),
             helper.make_node("Mul", ["t_col", "freqs"], ["tf"]),
             helper.make_node("Sin", ["tf"], ["ts"]), helper.make_node("Cos", ["tf"], ["tc"]),
             helper.make_node("Concat", ["ts", "tc"], ["te"], axis=-1),
             helper.make_node("MatMul", ["te", "Wt"], ["temb"]), helper.make_node("Add", ["hs", "temb"], ["y"])]
    values = {"W": _f32(4, D), "b": _f32(D), "alpha": np.abs(_f32(D)) + 0.5,
              "freqs": np.exp(-np.arange(D // 2) / 2).astype(np.float32), "Wt": _f32(D, D), "axis_last": _i64(-1)}
    chosen = trainable_set(_model(nodes, values, [("x", F, [3, 4]), ("t", F, [3])]))
    assert chosen.weights == ["W", "b", "alpha", "Wt"]
    assert chosen.left_out == {"freqs": "sinusoidal table (into Sin/Cos)"}


def test_a_scaled_weight_of_a_layer_into_sin_is_a_weight():
    """SIREN's first layer with its weight scaled first (omega_0 · W): the scaling meets only a
    constant, but the product with the inputs it feeds is a layer."""
    nodes = [helper.make_node("Mul", ["W", "omega"], ["scaled"]), helper.make_node("MatMul", ["x", "scaled"], ["xw"]),
             helper.make_node("Sin", ["xw"], ["y"])]
    chosen = trainable_set(_model(nodes, {"W": _f32(4, D), "omega": np.float32(30)}, [("x", F, [3, 4])]))
    assert chosen.weights == ["W"] and chosen.left_out == {"omega": "scalar constant of Mul"}


def _scores(bias_nodes, values, inputs) -> onnx.ModelProto:
    """softmax(q kᵀ + bias) over HEADS heads; the bias nodes write "bias"."""
    nodes = [helper.make_node("MatMul", ["x", "Wq"], ["q"]), helper.make_node("MatMul", ["x", "Wk"], ["k"]),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["qk"]), *bias_nodes,
             helper.make_node("Add", ["qk", "bias"], ["scores"]),
             helper.make_node("Softmax", ["scores"], ["y"], axis=-1)]
    return _model(nodes, {"Wq": _f32(D, D), "Wk": _f32(D, D), **values}, [("x", F, [HEADS, T, D]), *inputs])


def test_alibi_slopes_times_the_masks_running_count_are_left_out():
    """BLOOM: positions = (cumsum(mask) - 1) * mask; bias = slopes[:, None] * positions."""
    nodes = [helper.make_node("CumSum", ["attention_mask", "axis0"], ["count"]),
             helper.make_node("Sub", ["count", "one"], ["from0"]),
             helper.make_node("Mul", ["from0", "attention_mask"], ["positions"]),
             helper.make_node("Cast", ["positions"], ["positions_f"], to=F),
             helper.make_node("Unsqueeze", ["positions_f", "axis0"], ["row"]),
             helper.make_node("Mul", ["slopes", "row"], ["bias"])]
    model = _scores(nodes, {"slopes": np.array([[0.25], [0.0625]], np.float32), "axis0": _i64(0), "one": _i64(1)},
                    [("attention_mask", I64, [T])])
    chosen = trainable_set(model)
    assert chosen.weights == ["Wq", "Wk"]
    assert chosen.left_out["slopes"] == "positional bias (a scale of token positions, as ALiBi slopes)"


def test_a_folded_alibi_bias_is_left_out_and_a_folded_learned_bias_is_not():
    """A static export folds ALiBi into slopes × key positions: every row linear in position.
    T5's relative position bias folds into values with no such pattern: a weight."""
    alibi = (np.array([0.25, 0.0625])[:, None, None] * np.arange(1 - T, 1)[None, None, :]).astype(np.float32)
    chosen = trainable_set(_scores([helper.make_node("Identity", ["folded"], ["bias"])], {"folded": alibi}, []))
    assert chosen.left_out["folded"].startswith("positional bias (linear in position")
    learned = trainable_set(_scores([helper.make_node("Identity", ["folded"], ["bias"])],
                                    {"folded": _f32(HEADS, 1, T)}, []))
    assert learned.weights == ["Wq", "Wk", "folded"]


def test_linear_values_are_a_weight_away_from_attention_scores():
    """A linspace-initialised parameter added to the activations (no Softmax after) trains."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "ramp"], ["y"])]
    ramp = np.tile(np.linspace(-1, 1, D, dtype=np.float32), (T, 1))
    chosen = trainable_set(_model(nodes, {"W": _f32(D, D), "ramp": ramp}, [("x", F, [T, D])]))
    assert chosen.weights == ["W", "ramp"]


def test_a_weight_scaled_by_a_shape_is_a_weight():
    """Shapes are trace-time constants, not positions: g · sqrt(width) trains g."""
    nodes = [helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Gather", ["shape", "one"], ["width"]),
             helper.make_node("Cast", ["width"], ["width_f"], to=F), helper.make_node("Sqrt", ["width_f"], ["root"]),
             helper.make_node("Mul", ["g", "root"], ["scale"]), helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("Mul", ["h", "scale"], ["y"])]
    chosen = trainable_set(_model(nodes, {"W": _f32(D, D), "g": _f32(D), "one": _i64(1)}, [("x", F, [T, D])]))
    assert chosen.weights == ["W", "g"]


def test_fixed_inputs_of_attention_ops_are_left_out():
    """GroupQueryAttention's cos/sin caches and attention bias; RotaryEmbedding's caches in
    both domains (their inputs sit at different positions); MultiHeadAttention's bias."""
    angles = _angles()[:, : D // 2]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "Wqkv"], ["qkv"]),
             helper.make_node("GroupQueryAttention", ["qkv", "", "", "past_key", "past_value", "seqlens_k",
                                                      "total_length", "cos_cache", "sin_cache", "", "gqa_bias"],
                              ["attended", "present_key", "present_value"], domain="com.microsoft",
                              num_heads=2, kv_num_heads=1, do_rotary=1),
             helper.make_node("RotaryEmbedding", ["attended", "position_ids", "ms_cos", "ms_sin"], ["rotated"],
                              domain="com.microsoft"),
             helper.make_node("Reshape", ["rotated", "heads_shape"], ["by_head"]),
             helper.make_node("RotaryEmbedding", ["by_head", "onnx_cos", "onnx_sin", "position_ids"], ["y"],
                              num_heads=2)]
    values = {"Wqkv": _f32(2 * D, 4 * D), "cos_cache": cos, "sin_cache": sin, "gqa_bias": np.zeros((1, 1, T, T),
              np.float32) + _f32(1, 1, T, T), "ms_cos": cos.copy(), "ms_sin": sin.copy(), "onnx_cos": cos.copy(),
              "onnx_sin": sin.copy(), "seqlens_k": np.full(1, T - 1, np.int32), "total_length": np.array(T, np.int32),
              "heads_shape": _i64(1, T, 2 * D)}
    inputs = [("x", F, [1, T, 2 * D]), ("past_key", F, [1, 1, 0, D]), ("past_value", F, [1, 1, 0, D]),
              ("position_ids", I64, [1, T])]
    chosen = trainable_set(_model(nodes, values, inputs, opsets=(("", 23), ("com.microsoft", 1))))
    assert chosen.weights == ["Wqkv"]
    assert chosen.left_out == {
        "cos_cache": "rotary table (cos/sin cache of GroupQueryAttention)",
        "sin_cache": "rotary table (cos/sin cache of GroupQueryAttention)",
        "gqa_bias": "attention mask or bias of GroupQueryAttention",
        **{name: "rotary table (cos/sin cache of RotaryEmbedding)"
           for name in ("ms_cos", "ms_sin", "onnx_cos", "onnx_sin")}}


def test_inv_freq_in_a_constant_node_is_no_folded_weight():
    """optimum's TorchScript export keeps inv_freq (64 values for a head size of 128) in a
    Constant node: it is no weight to lift, so no folded_weights warning and no lift; a folded
    weight in a Constant still is one."""
    inv_freq = (1.0 / 10000 ** (np.arange(0, 128, 2) / 128)).astype(np.float32)[:, None]
    constants = [helper.make_node("Constant", [], ["inv_freq"], value=numpy_helper.from_array(inv_freq)),
                 helper.make_node("Constant", [], ["folded_W"], value=numpy_helper.from_array(_f32(D, 8)))]
    nodes = [helper.make_node("Cast", ["position_ids"], ["pos"], to=F),
             helper.make_node("MatMul", ["inv_freq", "pos"], ["freqs"]),
             helper.make_node("Cos", ["freqs"], ["cos"]), helper.make_node("MatMul", ["x", "folded_W"], ["h"]),
             helper.make_node("ReduceSum", ["cos"], ["c"], keepdims=0), helper.make_node("Mul", ["h", "c"], ["y"])]
    model = onnxtrain.load_model(_model(nodes, {}, [("x", F, [T, D]), ("position_ids", I64, [1, T])],
                                        constants=constants))
    findings = {f.kind: f for f in damage.detect(model)}
    assert findings["folded_weights"].names == ("folded_W",)
    assert damage.lift_constants(model) == ["folded_W"]


def test_damage_notes_position_tables_and_warns_of_a_bias_folded_into_a_mask():
    """A static export of T5's decoder folds its learned relative bias into the causal mask:
    torch trains that bias, the export keeps it fixed (a warning). The rotary tables a model
    stores as initializers are a note for inspect."""
    mask = np.triu(np.full((T, T), np.finfo(np.float32).min, np.float32), 1)
    bias_in_mask = mask + np.tril(_f32(T, T))
    findings = {f.kind: f for f in damage.detect(_scores([helper.make_node("Identity", ["folded"], ["bias"])],
                                                         {"folded": bias_in_mask[None]}, []))}
    assert findings["bias_in_mask"].names == ("folded",) and not findings["bias_in_mask"].note
    plain = {f.kind for f in damage.detect(_scores([helper.make_node("Identity", ["folded"], ["bias"])],
                                                   {"folded": mask[None]}, []))}
    assert "bias_in_mask" not in plain

    note = {f.kind: f for f in damage.detect(_rotary_model("ids"))}["position_tables"]
    assert note.note and note.names == ("inv_freq: rotary table",)
    assert "default_trainable" in note.advice


def test_a_left_out_table_trains_when_named_beside_the_default_set(tmp_path):
    model = _rotary_model("ids")
    path = tmp_path / "rotary.onnx"
    onnx.save(model, path)
    chosen = onnxtrain.default_trainable(path)
    assert chosen.weights == ["Wq"] and chosen.left_out["inv_freq"] == ROTARY
    training = onnxtrain.make_training_model(path, "mse", trainable=[*chosen.weights, "inv_freq"])
    assert {b.key for b in training.training_info[0].update_binding} >= {"Wq", "inv_freq"}
    default = onnxtrain.make_training_model(path, "mse")
    assert "inv_freq" not in {b.key for b in default.training_info[0].update_binding}


def test_inspect_names_each_left_out_table_and_how_to_train_it(tmp_path, capsys):
    from onnxtrain.cli import main

    path = tmp_path / "rotary.onnx"
    onnx.save(_rotary_model("range"), path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"    inv_freq: {ROTARY}" in out
    assert "to train one anyway: trainable=[*onnxtrain.default_trainable(model).weights, NAME]" in out
    assert "note: The export stores tables that torch computes or keeps as buffers" in out


def test_weights_applied_to_ids_are_weights():
    """An embedding written as a one-hot product, or fused into EmbedLayerNormalization (ONNX
    Runtime's transformer optimizer): what follows is learned, not positions, so the layers
    after it train."""
    nodes = [helper.make_node("OneHot", ["input_ids", "depth", "on_off"], ["one_hot"], axis=-1),
             helper.make_node("MatMul", ["one_hot", "embedding"], ["e"]),
             helper.make_node("Add", ["e", "bias"], ["h"]), helper.make_node("MatMul", ["h", "W"], ["y"])]
    chosen = trainable_set(_model(nodes, {"depth": _i64(10), "on_off": np.array([0, 1], np.float32),
                                          "embedding": _f32(10, D), "bias": _f32(D), "W": _f32(D, D)},
                                  [("input_ids", I64, [2, T])]))
    assert chosen.weights == ["embedding", "bias", "W"]

    fused = [helper.make_node("EmbedLayerNormalization", ["input_ids", "", "words", "positions", "", "gamma", "beta"],
                              ["embedded", "mask_index"], domain="com.microsoft", epsilon=1e-12),
             helper.make_node("MatMul", ["embedded", "W"], ["projected"]),
             helper.make_node("Add", ["projected", "bias"], ["y"])]
    chosen = trainable_set(_model(fused, {"words": _f32(10, D), "positions": _f32(T, D), "gamma": _f32(D),
                                          "beta": _f32(D), "W": _f32(D, D), "bias": _f32(D)},
                                  [("input_ids", TensorProto.INT32, [2, T])],
                                  opsets=(("", 18), ("com.microsoft", 1))))
    assert chosen.weights == ["words", "positions", "gamma", "beta", "W", "bias"]
