"""RNN/GRU/LSTM, attention ops and the training optimizers: what the backend cases miss.

The backend cases leave out clip, sequence_lens, non-default activations,
input_forget, gradients, float64 state and every T > 0 branch of the
optimizers. Oracles: onnxruntime for the recurrent layers (it implements every
attribute), onnx's ReferenceEvaluator for the attention ops, the reference
table of docs/training-semantics.md section 2.6, numpy formulas and finite
differences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.errors import ModelLoadError
from support.op_testing import finite_difference, run_model, translate

TRAINING = "ai.onnx.preview.training"
PREVIEW = "ai.onnx.preview"


def model_of(node: onnx.NodeProto, feeds: dict, outputs: list[str],
             opsets: dict[str, int], ir_version: int = 8) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype),
                                            value.shape) for name, value in feeds.items()]
    typed_like = inputs[0] if op_outputs_follow_first_input(node) else inputs[2]
    output_type = typed_like.type.tensor_type.elem_type
    graph = helper.make_graph(
        [node], "g", inputs, [helper.make_tensor_value_info(n, output_type, None) for n in outputs])
    return helper.make_model(graph, ir_version=ir_version,
                             opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])


def op_outputs_follow_first_input(node: onnx.NodeProto) -> bool:
    """The optimizers' first two inputs are R and T; their outputs have X's type."""
    return node.domain != TRAINING






@pytest.fixture(autouse=True)
def x64():
    """onnxtrain computes under x64; tests that differentiate from outside need it too."""
    with jax.enable_x64(True):
        yield




# ---------------------------------------------------------------------------------------
# Optimizers


def optimizer_model(op: str, attrs: dict, feeds: dict, outputs: list[str]) -> onnx.ModelProto:
    node = helper.make_node(op, list(feeds), outputs, domain=TRAINING, **attrs)
    return model_of(node, feeds, outputs, {TRAINING: 1}, ir_version=7)


X0 = np.array([1.0, -2.0], np.float32)
G0 = np.array([0.5, -1.5], np.float32)


@pytest.mark.parametrize("step, expected", [
    (0, [0.924814, -1.905922]), (1, [0.931649, -1.914475]), (3, [0.942165, -1.927632])])
def test_adagrad_decays_the_rate_with_t(step, expected):
    feeds = dict(R=np.float32(0.1), T=np.int64(step), X=X0, G=G0,
                 H=np.array([0.2, 0.3], np.float32))
    model = optimizer_model("Adagrad", dict(decay_factor=0.1, norm_coefficient=0.01), feeds,
                            ["X_new", "H_new"])
    x_new, h_new = run_model(model, feeds)
    np.testing.assert_allclose(x_new, expected, rtol=1e-5)
    np.testing.assert_allclose(h_new, [0.2, 0.3] + (G0 + 0.01 * X0) ** 2, rtol=1e-6)


@pytest.mark.parametrize("step, expected", [(0, [0.733246, -1.975083]), (1, [0.881457, -1.923743])])
def test_adam_bias_correction_only_from_t_1(step, expected):
    feeds = dict(R=np.float32(0.1), T=np.int64(step), X=X0, G=G0,
                 V=np.array([0.2, 0.3], np.float32), H=np.array([0.01, 0.02], np.float32))
    attrs = dict(alpha=0.9, beta=0.999, norm_coefficient=0.01, norm_coefficient_post=0.05)
    x_new, _, _ = run_model(optimizer_model("Adam", attrs, feeds, ["X_new", "V_new", "H_new"]), feeds)
    np.testing.assert_allclose(x_new, expected, rtol=1e-5)
    assert x_new.dtype == np.float32


@pytest.mark.parametrize("step, gradient_scale", [(0, 1.0), (2, 0.5)])
@pytest.mark.parametrize("mode", ["standard", "nesterov"])
def test_momentum_scales_gradient_by_beta_after_the_first_step(step, gradient_scale, mode):
    v = np.array([0.25, -0.5], np.float32)
    feeds = dict(R=np.float32(0.1), T=np.int64(step), X=X0, G=G0, V=v)
    attrs = dict(alpha=0.75, beta=0.5, norm_coefficient=0.0, mode=mode)
    x_new, v_new = run_model(optimizer_model("Momentum", attrs, feeds, ["X_new", "V_new"]), feeds)
    expected_v = 0.75 * v + gradient_scale * G0
    direction = expected_v if mode == "standard" else G0 + 0.75 * expected_v
    np.testing.assert_allclose(v_new, expected_v, rtol=1e-6)
    np.testing.assert_allclose(x_new, X0 - 0.1 * direction, rtol=1e-6)


def test_optimizers_keep_float64_state_and_precision():
    rng = np.random.default_rng(0)
    x, g, v, h = (rng.standard_normal(3) for _ in range(4))
    h = np.abs(h)
    feeds = dict(R=np.float64(0.01), T=np.int64(2), X1=x, X2=2 * x, G1=g, G2=g, V1=v, V2=v,
                 H1=h, H2=h)
    outputs = ["X1_new", "X2_new", "V1_new", "V2_new", "H1_new", "H2_new"]
    attrs = dict(alpha=0.5, beta=0.75, epsilon=1e-8)
    results = run_model(optimizer_model("Adam", attrs, feeds, outputs), feeds)
    assert [r.dtype for r in results] == [np.float64] * 6
    v_new = 0.5 * v + 0.5 * g
    h_new = 0.75 * h + 0.25 * g * g
    rate = 0.01 * np.sqrt(1 - 0.75 ** 2) / (1 - 0.5 ** 2)
    np.testing.assert_allclose(results[0], x - rate * v_new / (np.sqrt(h_new) + 1e-8), rtol=1e-13)
    np.testing.assert_allclose(results[1], 2 * x - rate * v_new / (np.sqrt(h_new) + 1e-8),
                               rtol=1e-13)
    np.testing.assert_allclose(results[2], v_new, rtol=1e-14)
    np.testing.assert_allclose(results[5], h_new, rtol=1e-14)


def test_optimizer_step_count_can_be_a_traced_input():
    feeds = dict(R=np.float32(0.1), T=np.int64(1), X=X0, G=G0, H=np.array([0.2, 0.3], np.float32))
    fn = translate(optimizer_model("Adagrad", dict(decay_factor=0.1, norm_coefficient=0.01),
                                   feeds, ["X_new", "H_new"]))
    step = jax.jit(lambda t: fn(fn.params, {**feeds, "T": t})["X_new"])
    np.testing.assert_allclose(step(np.int64(3)), [0.942165, -1.927632], rtol=1e-5)


def test_optimizer_rejects_a_ragged_variadic_layout():
    feeds = dict(R=np.float32(0.1), T=np.int64(0), X1=X0, X2=X0, G1=G0, G2=G0, V1=X0)
    with pytest.raises(ModelLoadError, match="multiple of 4"):
        run_model(optimizer_model("Adam", {}, feeds, ["X1_new"]), feeds)


def test_momentum_rejects_an_unknown_mode():
    feeds = dict(R=np.float32(0.1), T=np.int64(0), X=X0, G=G0, V=X0)
    attrs = dict(alpha=0.9, beta=1.0, norm_coefficient=0.0, mode="bogus")
    with pytest.raises(ModelLoadError, match="standard"):
        run_model(optimizer_model("Momentum", attrs, feeds, ["X_new", "V_new"]), feeds)


# ---------------------------------------------------------------------------------------
# RNN, GRU, LSTM against onnxruntime

SEQ, BATCH, INPUT, HIDDEN = 5, 3, 2, 4
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def recurrent_feeds(op: str, directions: int, lengths: list[int] | None, seed: int = 0,
                    dtype=np.float32) -> dict:
    rng = np.random.default_rng(seed)
    gates = GATES[op]
    feeds = dict(
        X=rng.standard_normal((SEQ, BATCH, INPUT)),
        W=rng.standard_normal((directions, gates * HIDDEN, INPUT)),
        R=rng.standard_normal((directions, gates * HIDDEN, HIDDEN)),
        B=rng.standard_normal((directions, 2 * gates * HIDDEN)),
        initial_h=rng.standard_normal((directions, BATCH, HIDDEN)))
    if op == "LSTM":
        feeds["initial_c"] = rng.standard_normal((directions, BATCH, HIDDEN))
        feeds["P"] = rng.standard_normal((directions, 3 * HIDDEN))
    feeds = {name: value.astype(dtype) for name, value in feeds.items()}
    if lengths is not None:
        feeds["sequence_lens"] = np.array(lengths, np.int32)
    return feeds


def recurrent_model(op: str, attrs: dict, feeds: dict) -> onnx.ModelProto:
    order = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]
    inputs = [name if name in feeds else "" for name in order[:8 if op == "LSTM" else 6]]
    while inputs[-1] == "":
        inputs.pop()
    outputs = ["Y", "Y_h", "Y_c"][:3 if op == "LSTM" else 2]
    node = helper.make_node(op, inputs, outputs, hidden_size=HIDDEN, **attrs)
    return model_of(node, feeds, outputs, {"": 14})


def onnxruntime_outputs(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


RECURRENT_CASES = [
    ("RNN", dict(activations=["Relu"], clip=1.5)),
    ("RNN", dict(activations=["ScaledTanh"], activation_alpha=[0.5], activation_beta=[2.0])),
    ("GRU", dict(clip=0.5, linear_before_reset=1)),
    ("GRU", dict(activations=["HardSigmoid", "Elu"], activation_alpha=[0.3, 0.7],
                 activation_beta=[0.4])),
    ("LSTM", dict(clip=0.7)),
    ("LSTM", dict(input_forget=1, activations=["Sigmoid", "Softsign", "LeakyRelu"],
                  activation_alpha=[0.2])),
]


@pytest.mark.parametrize("direction", ["forward", "reverse", pytest.param("bidirectional", marks=pytest.mark.slow)])
@pytest.mark.parametrize("op, attrs", RECURRENT_CASES)
def test_recurrent_layers_match_onnxruntime(op, attrs, direction):
    directions = 2 if direction == "bidirectional" else 1
    attrs = dict(attrs, direction=direction)
    if "activations" in attrs:
        attrs["activations"] = attrs["activations"] * directions
        for key in ("activation_alpha", "activation_beta"):
            if key in attrs:
                attrs[key] = attrs[key] * directions
    feeds = recurrent_feeds(op, directions, lengths=[5, 2, 3])
    model = recurrent_model(op, attrs, feeds)
    for ours, theirs in zip(run_model(model, feeds), onnxruntime_outputs(model, feeds)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_activation_parameters_are_consumed_only_by_activations_that_take_them():
    # Tanh takes no alpha, so the single alpha belongs to the backward LeakyRelu.
    attrs = dict(direction="bidirectional", activations=["Tanh", "LeakyRelu"],
                 activation_alpha=[0.3])
    feeds = recurrent_feeds("RNN", 2, lengths=None)
    model = recurrent_model("RNN", attrs, feeds)
    for ours, theirs in zip(run_model(model, feeds), onnxruntime_outputs(model, feeds)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_empty_sequences_output_zeros_like_onnxruntime(op):
    feeds = recurrent_feeds(op, 2, lengths=[0, 5, 1])
    model = recurrent_model(op, dict(direction="bidirectional"), feeds)
    ours = run_model(model, feeds)
    for mine, theirs in zip(ours, onnxruntime_outputs(model, feeds)):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
    assert not ours[1][:, 0].any()


@pytest.mark.slow
@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_batch_major_layout_is_the_transposed_sequence_major_layout(op):
    feeds = recurrent_feeds(op, 2, lengths=[4, 5, 1])
    sequence_major = recurrent_model(op, dict(direction="bidirectional"), feeds)
    expected = onnxruntime_outputs(sequence_major, feeds)
    batch_major = dict(feeds, X=feeds["X"].swapaxes(0, 1),
                       initial_h=feeds["initial_h"].swapaxes(0, 1))
    if op == "LSTM":
        batch_major["initial_c"] = feeds["initial_c"].swapaxes(0, 1)
    outputs = run_model(recurrent_model(op, dict(direction="bidirectional", layout=1), batch_major),
                  batch_major)
    np.testing.assert_allclose(outputs[0], expected[0].transpose(2, 0, 1, 3), rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(outputs[1:], expected[1:]):
        np.testing.assert_allclose(ours, theirs.swapaxes(0, 1), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_recurrent_gradient_matches_finite_differences(op):
    feeds = recurrent_feeds(op, 2, lengths=[5, 3, 2], dtype=np.float64)
    model = recurrent_model(op, dict(direction="bidirectional"), feeds)
    fn = translate(model)

    def loss(w):
        outputs = fn(fn.params, {**feeds, "W": w})
        return jnp.sum(outputs["Y"] ** 2) + jnp.sum(outputs["Y_h"])

    gradient = jax.jit(jax.grad(loss))(jnp.asarray(feeds["W"]))
    expected = finite_difference(lambda w: float(loss(w)), feeds["W"])
    np.testing.assert_allclose(gradient, expected, rtol=1e-5, atol=1e-7)


def test_recurrent_layer_rejects_weights_of_the_wrong_direction_count():
    feeds = recurrent_feeds("GRU", 1, lengths=None)
    with pytest.raises(ModelLoadError, match="bidirectional"):
        run_model(recurrent_model("GRU", dict(direction="bidirectional"), feeds), feeds)


# ---------------------------------------------------------------------------------------
# Attention


def attention_model(attrs: dict, feeds: dict, opset: int, outputs: list[str]) -> onnx.ModelProto:
    order = ["Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen"]
    inputs = [name if name in feeds else "" for name in order]
    while inputs[-1] == "":
        inputs.pop()
    node = helper.make_node("Attention", inputs, outputs, **attrs)
    return model_of(node, feeds, [o for o in outputs if o], {"": opset}, ir_version=10)


def reference_outputs(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ReferenceEvaluator(model).run(None, feeds)


def test_attention_3d_gqa_with_cache_float_mask_and_causal_matches_reference():
    rng = np.random.default_rng(1)
    feeds = dict(Q=rng.standard_normal((2, 3, 4 * 4)), K=rng.standard_normal((2, 3, 2 * 4)),
                 V=rng.standard_normal((2, 3, 2 * 5)), attn_mask=rng.standard_normal((3, 7)),
                 past_key=rng.standard_normal((2, 2, 4, 4)),
                 past_value=rng.standard_normal((2, 2, 4, 5)))
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    attrs = dict(q_num_heads=4, kv_num_heads=2, is_causal=1, softcap=3.0, scale=0.3,
                 qk_matmul_output_mode=2)
    model = attention_model(attrs, feeds, 23, ["Y", "present_key", "present_value", "qk"])
    for ours, theirs in zip(run_model(model, feeds), reference_outputs(model, feeds)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_attention_window_with_external_cache_matches_reference():
    rng = np.random.default_rng(2)
    feeds = dict(Q=rng.standard_normal((2, 2, 3, 4)).astype(np.float32),
                 K=rng.standard_normal((2, 1, 8, 4)).astype(np.float32),
                 V=rng.standard_normal((2, 1, 8, 4)).astype(np.float32),
                 attn_mask=rng.random((2, 1, 3, 6)) > 0.2,
                 nonpad_kv_seqlen=np.array([6, 4], np.int64))
    attrs = dict(is_causal=1, left_window_size=2, qk_matmul_output_mode=3)
    model = attention_model(attrs, feeds, 25, ["Y", "", "", "qk"])
    for ours, theirs in zip(run_model(model, feeds), reference_outputs(model, feeds)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_attention_qk_output_mode_0_is_the_raw_scaled_product_even_with_softcap():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for _ in range(3))
    feeds = dict(Q=q, K=k, V=v)
    model = attention_model(dict(softcap=1.0, qk_matmul_output_mode=0), feeds, 23,
                            ["Y", "", "", "qk"])
    _, qk = run_model(model, feeds)
    np.testing.assert_allclose(qk, q @ k.swapaxes(-1, -2) / 2.0, rtol=1e-5)


@pytest.mark.slow
def test_attention_fully_masked_rows_are_zero_with_finite_gradients():
    rng = np.random.default_rng(4)
    feeds = dict(Q=rng.standard_normal((1, 1, 3, 4)), K=rng.standard_normal((1, 1, 5, 4)),
                 V=rng.standard_normal((1, 1, 5, 4)))
    feeds = {k: v.astype(np.float64) for k, v in feeds.items()}
    mask = np.ones((3, 5), bool)
    mask[1] = False
    feeds["attn_mask"] = mask
    fn = translate(attention_model({}, feeds, 24, ["Y"]))

    def loss(q):
        return jnp.sum(fn(fn.params, {**feeds, "Q": q})["Y"] ** 2)

    y = np.asarray(fn(fn.params, feeds)["Y"])
    assert not y[0, 0, 1].any() and y[0, 0, [0, 2]].all()
    gradient = np.asarray(jax.grad(loss)(jnp.asarray(feeds["Q"])))
    assert np.isfinite(gradient).all() and not gradient[0, 0, 1].any()
    np.testing.assert_allclose(gradient, finite_difference(lambda q: float(loss(q)), feeds["Q"]),
                               rtol=1e-5, atol=1e-8)


def test_attention_rejects_heads_that_do_not_group():
    feeds = dict(Q=np.zeros((1, 3, 2, 4), np.float32), K=np.zeros((1, 2, 2, 4), np.float32),
                 V=np.zeros((1, 2, 2, 4), np.float32))
    with pytest.raises(ModelLoadError, match="multiple"):
        run_model(attention_model({}, feeds, 23, ["Y"]), feeds)


# ---------------------------------------------------------------------------------------
# RotaryEmbedding, LinearAttention, FlexAttention, SwiGLU


def test_rotary_embedding_with_traced_positions_matches_reference():
    rng = np.random.default_rng(5)
    feeds = dict(X=rng.standard_normal((2, 3, 2 * 8)).astype(np.float32),
                 cos_cache=rng.standard_normal((10, 3)).astype(np.float32),
                 sin_cache=rng.standard_normal((10, 3)).astype(np.float32),
                 position_ids=np.array([[0, 4, 9], [2, 2, 7]], np.int64))
    node = helper.make_node("RotaryEmbedding", list(feeds), ["Y"], num_heads=2,
                            rotary_embedding_dim=6, interleaved=1)
    model = model_of(node, feeds, ["Y"], {"": 23}, ir_version=10)
    np.testing.assert_allclose(run_model(model, feeds)[0], reference_outputs(model, feeds)[0],
                               rtol=1e-6, atol=1e-6)


def linear_attention_model(attrs: dict, feeds: dict) -> onnx.ModelProto:
    order = ["query", "key", "value", "past_state", "decay", "beta"]
    inputs = [name if name in feeds else "" for name in order]
    while inputs[-1] == "":
        inputs.pop()
    node = helper.make_node("LinearAttention", inputs, ["output", "present_state"], **attrs)
    return model_of(node, feeds, ["output", "present_state"], {"": 27}, ir_version=10)


def linear_attention_feeds(dtype, seed: int = 6) -> dict:
    rng = np.random.default_rng(seed)
    batch, steps, q_heads, kv_heads, key_size, value_size = 2, 4, 4, 2, 3, 2
    feeds = dict(query=rng.standard_normal((batch, steps, q_heads * key_size)),
                 key=rng.standard_normal((batch, steps, kv_heads * key_size)) / 2,
                 value=rng.standard_normal((batch, steps, kv_heads * value_size)),
                 past_state=rng.standard_normal((batch, kv_heads, key_size, value_size)),
                 decay=-rng.random((batch, steps, kv_heads * key_size)),
                 beta=rng.random((batch, steps, 1)))
    return {k: v.astype(dtype) for k, v in feeds.items()}


LINEAR_ATTENTION_ATTRS = dict(q_num_heads=4, kv_num_heads=2, update_rule="gated_delta")


def test_linear_attention_gqa_per_key_decay_matches_reference():
    feeds = linear_attention_feeds(np.float32)
    model = linear_attention_model(LINEAR_ATTENTION_ATTRS, feeds)
    for ours, theirs in zip(run_model(model, feeds), reference_outputs(model, feeds)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_linear_attention_keeps_float64_precision():
    feeds = linear_attention_feeds(np.float64)
    output, state = run_model(linear_attention_model(LINEAR_ATTENTION_ATTRS, feeds), feeds)
    assert output.dtype == state.dtype == np.float64
    # The recurrence written out in float64: S = e^g S; v' = beta (v - S^T k); S += k v'^T.
    s = feeds["past_state"].copy()
    q = feeds["query"].reshape(2, 4, 4, 3)
    k = feeds["key"].reshape(2, 4, 2, 3)
    v = feeds["value"].reshape(2, 4, 2, 2)
    g = feeds["decay"].reshape(2, 4, 2, 3)
    expected = np.zeros((2, 4, 4, 2))
    for t in range(4):
        s = s * np.exp(g[:, t])[..., None]
        retrieved = np.einsum("bhdm,bhd->bhm", s, k[:, t])
        corrected = feeds["beta"][:, t, :, None] * (v[:, t] - retrieved)
        s = s + k[:, t, :, :, None] * corrected[:, :, None, :]
        expected[:, t] = np.einsum("bhd,bhdm->bhm", q[:, t], np.repeat(s, 2, axis=1)) / np.sqrt(3)
    np.testing.assert_allclose(output, expected.reshape(2, 4, 8), rtol=1e-12)
    np.testing.assert_allclose(state, s, rtol=1e-12)


def test_linear_attention_requires_the_inputs_of_its_rule():
    feeds = linear_attention_feeds(np.float32)
    del feeds["beta"]
    with pytest.raises(ModelLoadError, match="beta"):
        run_model(linear_attention_model(LINEAR_ATTENTION_ATTRS, feeds), feeds)


def flex_model(feeds: dict, score_mod: onnx.GraphProto | None) -> onnx.ModelProto:
    attrs = {} if score_mod is None else {"score_mod": score_mod}
    node = helper.make_node("FlexAttention", ["Q", "K", "V"], ["Y"], domain=PREVIEW, **attrs)
    return model_of(node, feeds, ["Y"], {"": 26, PREVIEW: 1}, ir_version=10)


@pytest.mark.slow
def test_flex_attention_score_mod_reads_its_own_initializers_and_is_differentiable():
    rng = np.random.default_rng(7)
    feeds = {name: rng.standard_normal((1, 2, 3, 4)) for name in "QKV"}
    bias = rng.standard_normal((3, 3))
    score_mod = helper.make_graph(
        [helper.make_node("Add", ["scores", "bias"], ["out"])], "score_mod",
        [helper.make_tensor_value_info("scores", TensorProto.DOUBLE, None)],
        [helper.make_tensor_value_info("out", TensorProto.DOUBLE, None)],
        [onnx.numpy_helper.from_array(bias, "bias")])
    model = flex_model(feeds, score_mod)
    fn = translate(model)
    y = np.asarray(fn(fn.params, feeds)["Y"])
    scores = feeds["Q"] @ feeds["K"].swapaxes(-1, -2) / 2.0 + bias
    probabilities = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
    np.testing.assert_allclose(y, probabilities @ feeds["V"], rtol=1e-12)

    def loss(k):
        return jnp.sum(fn(fn.params, {**feeds, "K": k})["Y"] ** 3)

    gradient = jax.grad(loss)(jnp.asarray(feeds["K"]))
    np.testing.assert_allclose(gradient, finite_difference(lambda k: float(loss(k)), feeds["K"]),
                               rtol=1e-6, atol=1e-9)


def test_swiglu_keeps_bfloat16_and_matches_numpy():
    rng = np.random.default_rng(8)
    a, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    feeds = {"A": a.astype(jnp.bfloat16), "B": b.astype(jnp.bfloat16)}
    node = helper.make_node("SwiGLU", ["A", "B"], ["Y"], alpha=1.5)
    (y,) = run_model(model_of(node, feeds, ["Y"], {"": 28}, ir_version=10), feeds)
    assert y.dtype == jnp.bfloat16
    a32, b32 = (x.astype(np.float32) for x in feeds.values())
    np.testing.assert_allclose(y.astype(np.float32), a32 / (1 + np.exp(-1.5 * a32)) * b32,
                               rtol=2e-2, atol=1e-2)
