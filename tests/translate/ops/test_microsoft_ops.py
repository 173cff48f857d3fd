"""com.microsoft contrib ops (translate/ops/microsoft*.py) against ONNX Runtime, their
gradients against the unfused ONNX formulation and finite differences.

Every value test runs one contrib node in onnxruntime (the oracle: it defines these ops) and
in onnxtrain on the same random inputs. Gradient tests differentiate the contrib node and the
standard-op subgraph ONNX Runtime's optimizer fuses into it, both translated by onnxtrain,
or (where no unfused form is short) compare with central differences in float64.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime
import pytest
from jax.test_util import check_grads
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.errors import UnsupportedOpError
from support.op_testing import translate

MS = "com.microsoft"
RNG = np.random.default_rng(33)


def rand(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (scale * RNG.standard_normal(shape)).astype(np.float32)


def contrib_model(op_type: str, inputs: dict[str, np.ndarray | None], outputs: int | list[str] = 1,
                  domain: str = MS, opset: int = 17, constants: tuple[str, ...] = (),
                  **attrs: Any) -> onnx.ModelProto:
    """One contrib node whose inputs are graph inputs (None leaves an optional input out),
    those named in `constants` coming from Constant nodes instead."""
    names = [name if value is not None else "" for name, value in inputs.items()]
    while names and not names[-1]:
        names.pop()
    out_names = [f"Y{i}" for i in range(outputs)] if isinstance(outputs, int) else outputs
    node = helper.make_node(op_type, names, out_names, domain=domain, name=f"the_{op_type}",
                            **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype),
                                                  v.shape)
                    for n, v in inputs.items() if v is not None and n not in constants]
    graph_outputs = [helper.make_empty_tensor_value_info(n)
                     for n in out_names if n]
    if op_type == "MultiHeadAttention" and len(out_names) == 4:
        # onnxruntime cannot infer the type of the qk output.
        graph_outputs[3] = helper.make_tensor_value_info(out_names[3], TensorProto.FLOAT, None)
    constant_nodes = [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(
        inputs[n], n)) for n in constants]
    graph = helper.make_graph(constant_nodes + [node], op_type, graph_inputs, graph_outputs)
    return helper.make_model(graph, ir_version=8, opset_imports=[
        helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])


def feeds_of(inputs: dict[str, np.ndarray | None],
             constants: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    return {name: value for name, value in inputs.items()
            if value is not None and name not in constants}


def ours(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    fn = translate(model)
    result = fn(fn.params, feeds)
    return [np.asarray(result[name]) for name in fn.output_names]


def theirs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_matches_onnxruntime(op_type: str, inputs: dict[str, np.ndarray | None],
                               outputs: int | list[str] = 1, rtol: float = 1e-5,
                               atol: float = 1e-5, opset: int = 17, domain: str = MS,
                               **attrs: Any) -> list[np.ndarray]:
    model = contrib_model(op_type, inputs, outputs, domain=domain, opset=opset, **attrs)
    feeds = feeds_of(inputs)
    expected = theirs(model, feeds)
    actual = ours(model, feeds)
    assert len(actual) == len(expected)
    for index, (a, e) in enumerate(zip(actual, expected)):
        assert a.shape == e.shape, f"output {index}: shape {a.shape} vs {e.shape}"
        assert a.dtype == e.dtype, f"output {index}: dtype {a.dtype} vs {e.dtype}"
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"output {index}")
    return actual


# ---------------------------------------------------------------------------------------
# Normalizations


@pytest.mark.parametrize("skip_shape", [(2, 5, 8), (1, 5, 8), (5, 8)])
@pytest.mark.parametrize("with_beta, with_bias", [(True, True), (True, False), (False, False)])
def test_skip_layer_normalization_matches_onnxruntime(skip_shape, with_beta, with_bias):
    inputs = dict(x=rand(2, 5, 8), skip=rand(*skip_shape), gamma=rand(8),
                  beta=rand(8) if with_beta else None, bias=rand(8) if with_bias else None)
    assert_matches_onnxruntime("SkipLayerNormalization", inputs, 4,
                               epsilon=1e-5)


def test_skip_layer_normalization_statistics_outputs():
    x, skip, gamma = rand(2, 3, 8), rand(2, 3, 8), rand(8)
    model = contrib_model("SkipLayerNormalization", dict(x=x, skip=skip, gamma=gamma), 4,
                          epsilon=1e-5)
    y, mean, inv_std, total = ours(model, dict(x=x, skip=skip, gamma=gamma))
    s = (x + skip).astype(np.float64)
    np.testing.assert_allclose(total, x + skip, rtol=1e-6)
    np.testing.assert_allclose(mean[..., 0], s.mean(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inv_std[..., 0], 1 / np.sqrt(s.var(-1) + 1e-5), rtol=1e-5)
    np.testing.assert_allclose(y, theirs(model, dict(x=x, skip=skip, gamma=gamma))[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_bias", [True, False])
def test_skip_simplified_layer_normalization_matches_onnxruntime(with_bias):
    inputs = dict(x=rand(2, 5, 8), skip=rand(2, 5, 8), gamma=rand(8),
                  bias=rand(8) if with_bias else None)
    assert_matches_onnxruntime("SkipSimplifiedLayerNormalization", inputs, 4,
                               epsilon=1e-6)


@pytest.mark.parametrize("axis", [-1, 1])
def test_simplified_layer_normalization_default_domain_matches_onnxruntime(axis):
    inputs = dict(x=rand(2, 3, 8), scale=rand(*(3, 8) if axis == 1 else (8,)))
    assert_matches_onnxruntime("SimplifiedLayerNormalization", inputs, 2, domain="",
                               axis=axis, epsilon=1e-6)


def test_layer_normalization_before_opset_17_is_onnxruntime_s_contrib_op():
    inputs = dict(x=rand(2, 3, 8), scale=rand(8), bias=rand(8))
    assert_matches_onnxruntime("LayerNormalization", inputs, 1, domain="", opset=16,
                               epsilon=1e-5)


@pytest.mark.parametrize("segments, mask, position_ids", [
    (True, True, False), (False, False, False), (True, False, True), (False, True, True)])
def test_embed_layer_normalization_matches_onnxruntime(segments, mask, position_ids):
    batch, length, hidden = 2, 6, 8
    inputs = dict(
        input_ids=RNG.integers(0, 20, (batch, length)).astype(np.int32),
        segment_ids=RNG.integers(0, 2, (batch, length)).astype(np.int32) if segments else None,
        word=rand(20, hidden), position=rand(16, hidden),
        segment=rand(2, hidden) if segments else None, gamma=rand(hidden), beta=rand(hidden),
        mask=np.array([[1, 1, 1, 0, 0, 0], [1] * 6], np.int32) if mask else None,
        position_ids=(RNG.integers(0, 16, (batch, length)).astype(np.int32)
                      if position_ids else None))
    outputs = ["Y0", "Y1", "Y2"] if mask else ["Y0", "", "Y2"]
    actual = assert_matches_onnxruntime("EmbedLayerNormalization", inputs, outputs,
                                        epsilon=1e-12)
    if mask:
        np.testing.assert_array_equal(actual[1], [3, 6])


# ---------------------------------------------------------------------------------------
# Activations, BiasAdd, FusedMatMul


@pytest.mark.parametrize("op_type, inputs, attrs", [
    ("Gelu", dict(x=rand(3, 16, scale=3)), {}),
    ("BiasGelu", dict(x=rand(3, 16, scale=3), bias=rand(16)), {}),
    ("FastGelu", dict(x=rand(3, 16, scale=3)), {}),
    ("FastGelu", dict(x=rand(3, 16, scale=3), bias=rand(16)), {}),
    ("QuickGelu", dict(x=rand(3, 16, scale=3)), {}),
    ("QuickGelu", dict(x=rand(3, 16, scale=3)), dict(alpha=1.0)),
], ids=["gelu", "bias_gelu", "fast_gelu", "fast_gelu_bias", "quick_gelu", "quick_gelu_alpha"])
def test_elementwise_contrib_ops_match_onnxruntime(op_type, inputs, attrs):
    assert_matches_onnxruntime(op_type, inputs, 1, **attrs)


def test_bias_add_adds_bias_and_skip():
    # onnxruntime implements BiasAdd only on CUDA; the oracle is its definition.
    inputs = dict(x=rand(2, 4, 16), bias=rand(16), skip=rand(2, 4, 16))
    (y,) = ours(contrib_model("BiasAdd", inputs), inputs)
    np.testing.assert_allclose(y, inputs["x"] + inputs["bias"] + inputs["skip"], rtol=1e-6)


@pytest.mark.parametrize("a_shape, b_shape, attrs", [
    ((3, 4), (4, 5), dict(alpha=0.5)),
    ((4, 3), (5, 4), dict(transA=1, transB=1)),
    ((2, 3, 4), (2, 5, 4), dict(transB=1, alpha=0.125)),
    ((2, 3, 4), (4, 5), {}),
    ((3, 2, 4), (2, 4, 5), dict(transBatchA=1)),
    ((2, 3, 5), (5, 2, 4), dict(transBatchB=1)),
    ((3, 2, 4), (4, 2, 5), dict(transBatchA=1, transBatchB=1, alpha=2.0)),
    ((4, 2, 3), (5, 2, 4), dict(transBatchA=1, transA=1, transBatchB=1, transB=1)),
    ((3, 2, 2, 4), (2, 2, 4, 5), dict(transBatchA=1)),
])
def test_fused_matmul_matches_onnxruntime(a_shape, b_shape, attrs):
    assert_matches_onnxruntime("FusedMatMul", dict(a=rand(*a_shape), b=rand(*b_shape)), 1,
                               **attrs)


# ---------------------------------------------------------------------------------------
# Attention


BATCH, LENGTH, HIDDEN, HEADS = 2, 5, 16, 4


def attention_inputs(**extra: np.ndarray | None) -> dict[str, np.ndarray | None]:
    inputs = dict(x=rand(BATCH, LENGTH, HIDDEN), weights=rand(HIDDEN, 3 * HIDDEN, scale=0.5),
                  bias=rand(3 * HIDDEN), mask_index=None, past=None, attention_bias=None)
    inputs.update(extra)
    return inputs


MASKS = {
    "none": None,
    "key_lengths": np.array([3, 5], np.int32),
    "end_start": np.array([5, 4, 1, 0], np.int32),
    "raw_2d": np.array([[1, 1, 0, 1, 1], [1, 1, 1, 1, 0]], np.int32),
    "raw_3d": RNG.integers(0, 2, (BATCH, LENGTH, LENGTH)).astype(np.int32) | np.eye(
        LENGTH, dtype=np.int32),
    "dummy": np.ones((BATCH, 1), np.int32),
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("unidirectional", [0, 1])
def test_attention_masks_match_onnxruntime(mask, unidirectional):
    inputs = attention_inputs(mask_index=MASKS[mask])
    assert_matches_onnxruntime("Attention", inputs, 1, num_heads=HEADS,
                               unidirectional=unidirectional)


def test_attention_megatron_4d_mask_matches_the_equivalent_3d_mask():
    # onnxruntime's CPU kernel rejects the 4-D form; it is the (max, max) causal block.
    causal = np.tril(np.ones((8, 8), np.int32))[None, None].repeat(BATCH, 0)
    x = attention_inputs(mask_index=causal)
    (four_d,) = ours(contrib_model("Attention", x, num_heads=HEADS), feeds_of(x))
    three = dict(x, mask_index=np.ascontiguousarray(causal[:, 0, :LENGTH, :LENGTH]))
    expected = theirs(contrib_model("Attention", three, num_heads=HEADS), feeds_of(three))[0]
    np.testing.assert_allclose(four_d, expected, rtol=1e-5, atol=1e-5)


def test_attention_past_present_scale_and_filter_value_match_onnxruntime():
    past = rand(2, BATCH, HEADS, 3, HIDDEN // HEADS)
    inputs = attention_inputs(mask_index=np.array([[1] * 7 + [0], [1] * 8], np.int32),
                              past=past)
    present = assert_matches_onnxruntime("Attention", inputs, 2, num_heads=HEADS,
                                         unidirectional=1, scale=0.3,
                                         mask_filter_value=-1000.0)[1]
    np.testing.assert_array_equal(present[:, :, :, :3], past)


def test_attention_bias_input_matches_onnxruntime():
    inputs = attention_inputs(mask_index=MASKS["raw_2d"],
                              attention_bias=rand(1, HEADS, LENGTH, LENGTH))
    assert_matches_onnxruntime("Attention", inputs, 1, num_heads=HEADS)


def test_attention_qkv_hidden_sizes_give_v_its_own_width():
    inputs = attention_inputs(weights=rand(HIDDEN, 2 * HIDDEN + 8, scale=0.5),
                              bias=rand(2 * HIDDEN + 8), mask_index=MASKS["key_lengths"])
    (y,) = assert_matches_onnxruntime("Attention", inputs, 1, num_heads=HEADS,
                                      qkv_hidden_sizes=[HIDDEN, HIDDEN, 8])
    assert y.shape == (BATCH, LENGTH, 8)


def test_attention_rejects_do_rotary_naming_the_node():
    inputs = attention_inputs()
    model = contrib_model("Attention", inputs, num_heads=HEADS, do_rotary=1)
    with pytest.raises(UnsupportedOpError, match=r"the_Attention.*do_rotary"):
        ours(model, feeds_of(inputs))


def mha_inputs(kv_length: int = LENGTH, **extra: np.ndarray | None) -> dict:
    inputs = dict(query=rand(BATCH, LENGTH, HIDDEN), key=rand(BATCH, kv_length, HIDDEN),
                  value=rand(BATCH, kv_length, HIDDEN), bias=rand(3 * HIDDEN),
                  key_padding_mask=None, attention_bias=None, past_key=None, past_value=None)
    inputs.update(extra)
    return inputs


@pytest.mark.parametrize("case", ["plain", "no_bias", "lengths", "padding", "causal_past",
                                  "cross_bias", "mask_3d"])
def test_multi_head_attention_matches_onnxruntime(case):
    past = dict(past_key=rand(BATCH, HEADS, 3, 4), past_value=rand(BATCH, HEADS, 3, 4))
    inputs, attrs, outputs = {
        "plain": (mha_inputs(), {}, 1),
        "no_bias": (mha_inputs(bias=None), dict(scale=0.2), 1),
        "lengths": (mha_inputs(key_padding_mask=np.array([2, 5], np.int32)), {}, 1),
        "padding": (mha_inputs(key_padding_mask=np.array([[1, 1, 1, 0, 0], [1] * 5], np.int32)),
                    dict(mask_filter_value=-500.0), 4),
        "causal_past": (mha_inputs(**past), dict(unidirectional=1), 3),
        "cross_bias": (mha_inputs(kv_length=7, attention_bias=rand(BATCH, HEADS, LENGTH, 7)),
                       {}, 4),
        "mask_3d": (mha_inputs(key_padding_mask=MASKS["raw_3d"]), {}, 1),
    }[case]
    assert_matches_onnxruntime("MultiHeadAttention", inputs, outputs, num_heads=HEADS, **attrs)


def test_multi_head_attention_packed_and_cached_forms_match_onnxruntime():
    q, k, v = rand(BATCH, LENGTH, HIDDEN), rand(BATCH, 7, HIDDEN), rand(BATCH, 7, HIDDEN)
    bias = rand(3 * HIDDEN)
    unpacked = dict(query=q, key=k, value=v, bias=bias)
    expected = theirs(contrib_model("MultiHeadAttention", unpacked, num_heads=HEADS),
                      unpacked)[0]
    # onnxruntime packs K/V and Q/K/V only on CUDA: the oracle is the unpacked call.
    heads_of = lambda t: t.reshape(BATCH, -1, HEADS, 4)  # noqa: E731
    packed_kv = dict(query=q, key=np.stack([heads_of(k), heads_of(v)], 3), value=None, bias=bias)
    (actual,) = ours(contrib_model("MultiHeadAttention", packed_kv, num_heads=HEADS),
                     feeds_of(packed_kv))
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
    self_inputs = dict(query=q, key=q * 0.5, value=q * 2, bias=bias)
    expected = theirs(contrib_model("MultiHeadAttention", self_inputs, num_heads=HEADS),
                      self_inputs)[0]
    packed_qkv = dict(query=np.stack([heads_of(q), heads_of(q * 0.5), heads_of(q * 2)], 3),
                      key=None, value=None, bias=bias)
    (actual,) = ours(contrib_model("MultiHeadAttention", packed_qkv, num_heads=HEADS),
                     feeds_of(packed_qkv))
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
    cached = dict(query=q, key=k.reshape(BATCH, 7, HEADS, 4).transpose(0, 2, 1, 3).copy(),
                  value=v.reshape(BATCH, 7, HEADS, 4).transpose(0, 2, 1, 3).copy())
    assert_matches_onnxruntime("MultiHeadAttention", cached, 1, num_heads=HEADS)


# ---------------------------------------------------------------------------------------
# RotaryEmbedding and GroupQueryAttention


def rotary_caches(positions: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    angles = np.arange(positions)[:, None] / 10000 ** (np.arange(half)[None, :] / half)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@pytest.mark.parametrize("layout, interleaved, positions, rotary_dim", [
    ("3d", 0, "ids", 0), ("3d", 1, "offset", 0), ("4d", 0, "offset", 0), ("4d", 1, "ids", 0),
    ("3d", 0, "ids", 4)])
def test_rotary_embedding_matches_onnxruntime(layout, interleaved, positions, rotary_dim):
    x = rand(BATCH, LENGTH, HEADS * 8) if layout == "3d" else rand(BATCH, HEADS, LENGTH, 8)
    cos, sin = rotary_caches(16, (rotary_dim or 8) // 2)
    position_ids = (RNG.integers(0, 16, (BATCH, LENGTH)) if positions == "ids"
                    else np.array([3])).astype(np.int64)
    attrs = dict(interleaved=interleaved)
    if layout == "3d" and rotary_dim:
        attrs.update(num_heads=HEADS, rotary_embedding_dim=rotary_dim)
    inputs = dict(x=x, position_ids=position_ids, cos_cache=cos, sin_cache=sin)
    assert_matches_onnxruntime("RotaryEmbedding", inputs, 1, **attrs)


KV_HEADS, HEAD = 2, 16  # onnxruntime rotates heads of a multiple of 16 only


def gqa_inputs(length: int, past: int, seqlens: list[int], total: int, rotary: bool = False,
               packed: bool = False) -> dict[str, np.ndarray | None]:
    query = rand(BATCH, length, HEADS * HEAD)
    key, value = rand(BATCH, length, KV_HEADS * HEAD), rand(BATCH, length, KV_HEADS * HEAD)
    if packed:
        query, key, value = np.concatenate([query, key, value], axis=-1), None, None
    cos, sin = rotary_caches(32, HEAD // 2) if rotary else (None, None)
    return dict(query=query, key=key, value=value,
                past_key=rand(BATCH, KV_HEADS, past, HEAD) if past else None,
                past_value=rand(BATCH, KV_HEADS, past, HEAD) if past else None,
                seqlens_k=np.array(seqlens, np.int32), total_sequence_length=np.array(
                    total, np.int32), cos_cache=cos, sin_cache=sin)


@pytest.mark.parametrize("case", ["prompt", "prompt_rotary_padded", "prompt_packed_window",
                                  "decode", "decode_ragged_rotary", "decode_position_ids",
                                  "softcap", "attention_bias"])
@pytest.mark.slow
def test_group_query_attention_matches_onnxruntime(case):
    inputs, attrs = {
        "prompt": (gqa_inputs(6, 0, [5, 5], 6), {}),
        "prompt_rotary_padded": (gqa_inputs(6, 0, [5, 3], 6, rotary=True), dict(do_rotary=1)),
        "prompt_packed_window": (gqa_inputs(6, 0, [5, 5], 6, packed=True),
                                 dict(local_window_size=3, scale=0.2)),
        "decode": (gqa_inputs(1, 4, [4, 4], 5), {}),
        "decode_ragged_rotary": (gqa_inputs(1, 4, [4, 2], 5, rotary=True),
                                 dict(do_rotary=1, rotary_interleaved=1)),
        "decode_position_ids": (dict(gqa_inputs(1, 4, [4, 4], 5, rotary=True),
                                     position_ids=np.array([[7], [2]], np.int64)),
                                dict(do_rotary=1)),
        "softcap": (gqa_inputs(6, 0, [5, 5], 6), dict(softcap=2.0)),
        "attention_bias": (dict(gqa_inputs(6, 0, [5, 5], 6), position_ids=None,
                                attention_bias=rand(BATCH, 1, 6, 6)), dict(softcap=3.0)),
    }[case]
    # total_sequence_length sizes the cache: a constant, as exports compute it from shapes.
    constants = ("total_sequence_length",)
    model = contrib_model("GroupQueryAttention", inputs, 3, num_heads=HEADS,
                          kv_num_heads=KV_HEADS, constants=constants, **attrs)
    feeds = feeds_of(inputs, constants)
    actual, expected = ours(model, feeds), theirs(model, feeds)
    length = inputs["query"].shape[1]
    for b, last in enumerate(inputs["seqlens_k"]):
        # Rows past a batch entry's length (its right padding) are unspecified.
        valid = min(length, int(last) + 1)
        np.testing.assert_allclose(actual[0][b, :valid], expected[0][b, :valid], rtol=1e-5,
                                   atol=1e-5)
        for ours_cache, their_cache in zip(actual[1:], expected[1:]):
            assert ours_cache.shape == their_cache.shape
            np.testing.assert_allclose(ours_cache[b, :, :last + 1], their_cache[b, :, :last + 1],
                                       rtol=1e-5, atol=1e-5)


def test_group_query_attention_rejects_quantized_cache_naming_the_attribute():
    inputs = gqa_inputs(6, 0, [5, 5], 6)
    model = contrib_model("GroupQueryAttention", inputs, 1, num_heads=HEADS,
                          kv_num_heads=KV_HEADS, k_quant_type="PER_TENSOR")
    with pytest.raises(UnsupportedOpError, match=r"the_GroupQueryAttention.*k_quant_type"):
        ours(model, feeds_of(inputs))


# ---------------------------------------------------------------------------------------
# Gradients


@pytest.fixture
def x64():
    """Gradients compare in float64, where the fused and unfused forms agree to rounding."""
    with jax.enable_x64(True):
        yield


def loss_of(model: onnx.ModelProto, feeds: dict[str, np.ndarray], wrt: list[str]):
    """(loss, args): loss(*args) = sum over float outputs of <output, fixed random weights>,
    a function of the inputs named in `wrt` (the others held at their feeds)."""
    fn = translate(model)
    forward = fn(fn.params, feeds)
    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal(np.shape(value))
               for name, value in forward.items() if jnp.issubdtype(value.dtype, jnp.floating)}

    def loss(*args: jax.Array) -> jax.Array:
        outputs = fn(fn.params, {**feeds, **dict(zip(wrt, args))})
        return sum(jnp.sum(outputs[name] * weight) for name, weight in weights.items())

    return loss, [feeds[name] for name in wrt]


def unfused_model(nodes: list[onnx.NodeProto], inputs: dict[str, np.ndarray], outputs: list[str],
                  constants: dict[str, np.ndarray], opset: int = 23) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "unfused",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for n, v in inputs.items()],
        [helper.make_empty_tensor_value_info(n) for n in outputs],
        [numpy_helper.from_array(v, n) for n, v in constants.items()])
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", opset)])


def f64(*shape: int, scale: float = 1.0) -> np.ndarray:
    return scale * RNG.standard_normal(shape)


def _skip_norm_unfused(simplified: bool) -> list[onnx.NodeProto]:
    norm = (helper.make_node("RMSNormalization", ["sum", "gamma"], ["Y0"], epsilon=1e-5,
                                     stash_type=TensorProto.DOUBLE)
            if simplified else
            helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["Y0"], epsilon=1e-5,
                                     stash_type=TensorProto.DOUBLE))
    return [helper.make_node("Add", ["x", "skip"], ["partial"]),
            helper.make_node("Add", ["partial", "bias"], ["sum"]), norm]


def _fused_cases() -> dict[str, tuple]:
    """name -> (contrib op, its inputs, attributes, unfused nodes, output count)."""
    x, skip, gamma, beta, bias = f64(2, 3, 8), f64(2, 3, 8), f64(8), f64(8), f64(8)
    ids = RNG.integers(0, 10, (2, 4)).astype(np.int32)
    segments = RNG.integers(0, 2, (2, 4)).astype(np.int32)
    gelu = f64(3, 8, scale=2)
    return {
        "SkipLayerNormalization": (
            "SkipLayerNormalization", dict(x=x, skip=skip, gamma=gamma, beta=beta, bias=bias),
            dict(epsilon=1e-5), _skip_norm_unfused(False)),
        "SkipSimplifiedLayerNormalization": (
            "SkipSimplifiedLayerNormalization", dict(x=x, skip=skip, gamma=gamma, bias=bias),
            dict(epsilon=1e-5), _skip_norm_unfused(True)),
        "EmbedLayerNormalization": (
            "EmbedLayerNormalization",
            dict(ids=ids, segments=segments, word=f64(10, 8), position=f64(6, 8),
                 segment=f64(2, 8), gamma=gamma, beta=beta), dict(epsilon=1e-5),
            [helper.make_node("Gather", ["word", "ids"], ["w"]),
             helper.make_node("Gather", ["segment", "segments"], ["s"]),
             helper.make_node("Slice", ["position", "zero", "four"], ["p"]),
             helper.make_node("Add", ["w", "p"], ["wp"]),
             helper.make_node("Add", ["wp", "s"], ["e"]),
             helper.make_node("LayerNormalization", ["e", "gamma", "beta"], ["Y0"],
                              stash_type=TensorProto.DOUBLE,
                              epsilon=1e-5)]),
        "BiasGelu": ("BiasGelu", dict(x=gelu, bias=bias), {},
                     [helper.make_node("Add", ["x", "bias"], ["a"]),
                      helper.make_node("Gelu", ["a"], ["Y0"])]),
        "FastGelu": ("FastGelu", dict(x=gelu, bias=bias), {},
                     [helper.make_node("Add", ["x", "bias"], ["a"]),
                      helper.make_node("Gelu", ["a"], ["Y0"], approximate="tanh")]),
        "Gelu": ("Gelu", dict(x=gelu), {}, [helper.make_node("Gelu", ["x"], ["Y0"])]),
        "QuickGelu": ("QuickGelu", dict(x=gelu), dict(alpha=1.5),
                      [helper.make_node("Mul", ["x", "alpha"], ["a"]),
                       helper.make_node("Sigmoid", ["a"], ["s"]),
                       helper.make_node("Mul", ["x", "s"], ["Y0"])]),
        "FusedMatMul": ("FusedMatMul", dict(a=f64(3, 2, 4), b=f64(2, 5, 4)),
                        dict(transBatchA=1, transB=1, alpha=0.5),
                        [helper.make_node("Transpose", ["a"], ["at"], perm=[1, 0, 2]),
                         helper.make_node("Transpose", ["b"], ["bt"], perm=[0, 2, 1]),
                         helper.make_node("MatMul", ["at", "bt"], ["m"]),
                         helper.make_node("Mul", ["m", "alpha"], ["Y0"])]),
    }


_CONSTANTS = {"zero": np.array([0], np.int64), "four": np.array([4], np.int64)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(_fused_cases()))
def test_contrib_op_gradients_match_the_unfused_formulation(case, x64):
    op_type, inputs, attrs, nodes = _fused_cases()[case]
    fused = contrib_model(op_type, inputs, 1, **attrs)
    constants = {"alpha": np.array(attrs["alpha"])} if "alpha" in attrs else {}
    constants.update({n: v for n, v in _CONSTANTS.items()
                      if any(n in node.input for node in nodes)})
    unfused = unfused_model(nodes, inputs, ["Y0"], constants)
    wrt = [n for n, v in inputs.items() if v.dtype == np.float64]
    fused_loss, args = loss_of(fused, inputs, wrt)
    unfused_loss, _ = loss_of(unfused, inputs, wrt)
    np.testing.assert_allclose(fused_loss(*args), unfused_loss(*args), rtol=1e-12)
    fused_grads = jax.grad(fused_loss, argnums=tuple(range(len(wrt))))(*args)
    unfused_grads = jax.grad(unfused_loss, argnums=tuple(range(len(wrt))))(*args)
    for name, g, h in zip(wrt, fused_grads, unfused_grads):
        np.testing.assert_allclose(g, h, rtol=1e-10, atol=1e-12, err_msg=name)


def _attention_gradient_cases() -> dict[str, tuple]:
    """name -> (op, inputs, attributes) for finite-difference checks."""
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.int32)
    cos, sin = rotary_caches(8, 4)
    return {
        "Attention": ("Attention", dict(x=f64(2, 4, 8), weights=f64(8, 24, scale=0.5),
                                        bias=f64(24), mask_index=mask),
                      dict(num_heads=2, unidirectional=1)),
        "MultiHeadAttention": ("MultiHeadAttention",
                               dict(query=f64(2, 4, 8), key=f64(2, 4, 8), value=f64(2, 4, 8),
                                    bias=f64(24), key_padding_mask=mask), dict(num_heads=2)),
        "RotaryEmbedding": ("RotaryEmbedding",
                            dict(x=f64(2, 4, 16), position_ids=np.array([[0, 1, 2, 3]] * 2),
                                 cos=cos.astype(np.float64), sin=sin.astype(np.float64)),
                            dict(num_heads=2)),
        "GroupQueryAttention": ("GroupQueryAttention",
                                dict(query=f64(2, 4, 16), key=f64(2, 4, 8), value=f64(2, 4, 8),
                                     past_key=None, past_value=None,
                                     seqlens_k=np.array([3, 2], np.int32),
                                     total=np.array(4, np.int32), cos=cos.astype(np.float64),
                                     sin=sin.astype(np.float64)),
                                dict(num_heads=2, kv_num_heads=1, do_rotary=1)),
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", list(_attention_gradient_cases()))
def test_attention_op_gradients_match_finite_differences(case, x64):
    op_type, inputs, attrs = _attention_gradient_cases()[case]
    constants = ("total",) if "total" in inputs else ()
    model = contrib_model(op_type, inputs, 1, constants=constants, **attrs)
    feeds = feeds_of(inputs, constants)
    wrt = [n for n, v in feeds.items() if v.dtype == np.float64 and n not in ("cos", "sin")]
    loss, args = loss_of(model, feeds, wrt)
    check_grads(loss, args, order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------
# Acceptance: BERT, GPT-2 and T5's encoder through ONNX Runtime's transformer optimizer

# What the optimizer fuses in each export (transformers' eager attention, opt_level 0): the
# torchscript BERT export gets Attention and EmbedLayerNormalization as well; T5 also keeps
# one SimplifiedLayerNormalization (default domain).
EMITTED = {
    ("bert", "torchscript"): {"Attention", "BiasGelu", "EmbedLayerNormalization",
                              "SkipLayerNormalization"},
    ("bert", "dynamo"): {"BiasGelu", "SkipLayerNormalization"},
    ("gpt2", "torchscript"): {"FastGelu", "SkipLayerNormalization"},
    ("gpt2", "dynamo"): {"FastGelu", "SkipLayerNormalization"},
    ("t5", "torchscript"): {"SkipSimplifiedLayerNormalization"},
}


@pytest.fixture(scope="module", params=sorted(EMITTED), ids="-".join)
def optimized_export(request, tmp_path_factory):
    """(family, exporter, unfused model, fused model)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from support import transformer_exports

    family, exporter = request.param
    path = transformer_exports.export(family, exporter, tmp_path_factory.mktemp("exports"))
    return family, exporter, onnx.load(path), transformer_exports.optimize(path, family)


def transformer_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    mask = np.ones((2, 8), np.int64)
    mask[1, 6:] = 0  # right padding, a form every fused mask representation keeps
    return {"input_ids": rng.integers(0, 100, (2, 8)).astype(np.int64), "attention_mask": mask}


def first_step_gradients(model: onnx.ModelProto, feeds: dict, labels: np.ndarray) -> dict:
    """Each weight's gradient of make_training_model's first step: plain SGD with rate 1, so
    the gradient is the weight before minus the weight after (in float64)."""
    import onnxtrain
    from onnxtrain import optim

    # The default trainable set: exporter constants (exponents, fill values) stay fixed in
    # the unfused export, as the optimizer folds them into the fused ops.
    training = onnxtrain.make_training_model(model, loss="mse", optimizer=optim.SGD(lr=1.0))
    trainer = onnxtrain.Trainer(training)
    weights = {name for name in trainer.state_names
               if name in {t.name for t in model.graph.initializer}}
    before = {name: np.asarray(trainer.state[name], np.float64) for name in weights}
    trainer.step({**feeds, "labels": labels})
    return {name: before[name] - np.asarray(trainer.state[name], np.float64) for name in weights}


@pytest.mark.slow
def test_optimized_transformer_runs_like_onnxruntime(optimized_export):
    family, exporter, _, fused = optimized_export
    from support.transformer_exports import contrib_ops

    assert contrib_ops(fused) == EMITTED[family, exporter]
    feeds = transformer_feeds()
    expected = theirs(fused, feeds)[0]
    (actual,) = ours(fused, feeds)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_optimized_transformer_trains_with_the_unfused_gradients(optimized_export):
    family, exporter, unfused, fused = optimized_export
    from support.transformer_exports import weight_sources

    feeds = transformer_feeds()
    labels = np.random.default_rng(2).standard_normal((2, 8, 32)).astype(np.float32)
    fused_grads = first_step_gradients(fused, feeds, labels)
    unfused_grads = first_step_gradients(unfused, feeds, labels)
    sources = weight_sources(fused, unfused, set(fused_grads))
    # Every fused weight comes from the export, merged Q/K/V projections included.
    assert set(sources) == set(fused_grads)
    for name, parts in sources.items():
        expected = np.concatenate([unfused_grads[p] for p in parts], axis=-1)
        np.testing.assert_allclose(fused_grads[name], expected, rtol=0, atol=1e-5,
                                   err_msg=f"{family} {exporter}: {name} from {parts}")


def test_contrib_domain_runs_without_its_opset_import():
    """optimize_model's in-memory models use com.microsoft without importing it, and ONNX
    Runtime runs them; so does onnxtrain, at the contrib domain's one version."""
    import onnxtrain

    graph = helper.make_graph([helper.make_node("FastGelu", ["x"], ["y"], domain="com.microsoft")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.array([-2.0, -0.5, 0.0, 1.5], np.float32)
    assert onnxtrain.describe(model).count("not imported") == 0
    np.testing.assert_allclose(onnxtrain.run(model, {"x": x})["y"], theirs(model, {"x": x})[0], rtol=1e-6, atol=1e-7)
