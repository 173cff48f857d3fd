"""Random, signal, string and ai.onnx.ml ops: behaviour the ONNX backend cases miss.

Oracles: onnx.reference.ReferenceEvaluator, onnxruntime where the reference is
known to deviate from the spec, numpy, and hand-derived values. Random ops are
checked for shape, dtype, reproducibility and distribution.
"""

from __future__ import annotations

import jax
import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxtrain import load_model
from onnxtrain.errors import ModelLoadError
from onnxtrain.translate.model import TranslatedModel

ML = "ai.onnx.ml"
STRING = TensorProto.STRING


def make_model(node: onnx.NodeProto, inputs: dict[str, np.ndarray], outputs: list[str] | None = None,
               opset: int = 22, ml_opset: int = 5) -> onnx.ModelProto:
    """A one-node model whose graph inputs have the types of `inputs`."""
    infos = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)
             for name, value in inputs.items()]
    outs = [helper.make_value_info(name, onnx.TypeProto()) for name in (outputs or list(node.output))]
    graph = helper.make_graph([node], "test", infos, outs)
    return helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", opset), helper.make_opsetid(ML, ml_opset)])


def run(model: onnx.ModelProto, inputs: dict[str, np.ndarray], key: jax.Array | None = None) -> list:
    fn = TranslatedModel(load_model(model))
    result = fn(fn.params, inputs, key)
    return [result[name] for name in fn.output_names]


def reference(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> list:
    return ReferenceEvaluator(model).run(None, inputs)


def onnxruntime_outputs(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> list:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, inputs)


def assert_same(actual: list, expected: list, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Same shapes, dtypes and values (strings compared exactly)."""
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        got, want = np.asarray(got), np.asarray(want)
        assert got.shape == want.shape, (got.shape, want.shape)
        if want.dtype.kind in "OUS":
            assert got.astype(object).tolist() == want.astype(object).tolist()
            continue
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def strings(*values: str) -> np.ndarray:
    return np.array(values, dtype=object)


# --- random ---------------------------------------------------------------------------


def _random(node: onnx.NodeProto, inputs: dict[str, np.ndarray] | None = None, seed: int = 0):
    (value,) = run(make_model(node, inputs or {}), inputs or {}, jax.random.key(seed))
    return np.asarray(value)


@pytest.mark.slow
def test_random_normal_has_the_requested_moments_and_dtype():
    node = helper.make_node("RandomNormal", [], ["Y"], shape=[200, 100], mean=2.0, scale=3.0,
                            dtype=TensorProto.DOUBLE)
    y = _random(node)
    assert y.shape == (200, 100) and y.dtype == np.float64
    assert abs(y.mean() - 2.0) < 0.1 and abs(y.std() - 3.0) < 0.1


def test_random_uniform_stays_in_its_bounds_and_keeps_float16():
    node = helper.make_node("RandomUniform", [], ["Y"], shape=[10000], low=-1.0, high=3.0,
                            dtype=TensorProto.FLOAT16)
    y = _random(node)
    assert y.dtype == np.float16
    assert y.min() >= -1.0 and y.max() <= 3.0 and abs(float(y.mean()) - 1.0) < 0.05


@pytest.mark.slow
def test_random_draws_depend_on_the_key_only():
    node = helper.make_node("RandomNormal", [], ["Y"], shape=[8], seed=5.0)
    np.testing.assert_array_equal(_random(node, seed=1), _random(node, seed=1))
    assert not np.array_equal(_random(node, seed=1), _random(node, seed=2))


@pytest.mark.slow
def test_like_ops_take_shape_and_dtype_from_the_input():
    x = np.zeros((3, 4), np.float64)
    normal = _random(helper.make_node("RandomNormalLike", ["X"], ["Y"]), {"X": x})
    uniform = _random(helper.make_node("RandomUniformLike", ["X"], ["Y"], dtype=TensorProto.FLOAT),
                      {"X": x})
    assert normal.shape == (3, 4) and normal.dtype == np.float64
    assert uniform.shape == (3, 4) and uniform.dtype == np.float32


def test_like_ops_refuse_an_integer_input_without_dtype():
    x = np.zeros((2,), np.int64)
    with pytest.raises(ModelLoadError, match="not a float type"):
        _random(helper.make_node("RandomUniformLike", ["X"], ["Y"]), {"X": x})


@pytest.mark.slow
def test_bernoulli_frequency_follows_p():
    p = np.array([0.0, 0.2, 0.9, 1.0], np.float32)
    x = np.tile(p, (5000, 1))
    y = _random(helper.make_node("Bernoulli", ["X"], ["Y"], dtype=TensorProto.INT32), {"X": x})
    assert y.dtype == np.int32 and set(np.unique(y)) <= {0, 1}
    np.testing.assert_allclose(y.mean(axis=0), p, atol=0.03)


@pytest.mark.slow
def test_multinomial_samples_classes_by_their_probabilities():
    probabilities = np.array([[0.1, 0.6, 0.3], [1.0, 0.0, 0.0]], np.float32)
    logits = np.log(np.maximum(probabilities, 1e-30)).astype(np.float32)
    node = helper.make_node("Multinomial", ["X"], ["Y"], sample_size=20000, dtype=TensorProto.INT64)
    y = _random(node, {"X": logits})
    assert y.shape == (2, 20000) and y.dtype == np.int64
    frequencies = np.stack([np.bincount(row, minlength=3) / row.size for row in y])
    np.testing.assert_allclose(frequencies, probabilities, atol=0.02)


def test_multinomial_default_dtype_is_int32():
    node = helper.make_node("Multinomial", ["X"], ["Y"])
    y = _random(node, {"X": np.zeros((4, 5), np.float32)})
    assert y.shape == (4, 1) and y.dtype == np.int32


# --- signal ---------------------------------------------------------------------------


def _complex_layout(values: np.ndarray) -> np.ndarray:
    return np.stack([values.real, values.imag], axis=-1)


def _signal(shape: tuple[int, ...], dtype=np.float64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("length", [pytest.param(5, marks=pytest.mark.slow), 8, pytest.param(11, marks=pytest.mark.slow)])
def test_dft_of_a_complex_signal_pads_or_cuts_to_dft_length(length):
    x = _signal((2, 8, 3, 2))
    node = helper.make_node("DFT", ["X", "L", "A"], ["Y"])
    inputs = {"X": x, "L": np.array(length, np.int64), "A": np.array(-3, np.int64)}
    (y,) = run(make_model(node, inputs), inputs)
    expected = np.fft.fft(x[..., 0] + 1j * x[..., 1], n=length, axis=1)
    assert_same([y], [_complex_layout(expected)], atol=1e-9)


def test_dft_opset17_reads_the_axis_attribute():
    x = _signal((3, 4, 6, 1))
    node = helper.make_node("DFT", ["X"], ["Y"], axis=2, onesided=1)
    (y,) = run(make_model(node, {"X": x}, opset=17), {"X": x})
    assert_same([y], [_complex_layout(np.fft.rfft(x[..., 0], axis=2))], atol=1e-9)


def test_dft_inverse_onesided_of_odd_length():
    spectrum = np.fft.rfft(_signal((2, 7)), axis=1)
    x = _complex_layout(spectrum)
    inputs = {"X": x, "L": np.array(7, np.int64)}
    node = helper.make_node("DFT", ["X", "L"], ["Y"], inverse=1, onesided=1)
    (y,) = run(make_model(node, inputs), inputs)
    assert_same([y], [np.fft.irfft(spectrum, n=7, axis=1)[..., None]], atol=1e-9)


def test_dft_inverse_of_a_real_signal():
    x = _signal((2, 6, 1))
    node = helper.make_node("DFT", ["X"], ["Y"], inverse=1)
    (y,) = run(make_model(node, {"X": x}), {"X": x})
    assert_same([y], [_complex_layout(np.fft.ifft(x[..., 0], axis=1))], atol=1e-9)


def test_dft_keeps_float16():
    x = _signal((1, 8, 1), np.float16)
    node = helper.make_node("DFT", ["X"], ["Y"])
    (y,) = run(make_model(node, {"X": x}), {"X": x})
    expected = _complex_layout(np.fft.fft(x[..., 0].astype(np.float64), axis=1))
    assert y.dtype == np.float16
    np.testing.assert_allclose(np.asarray(y, np.float64), expected, atol=2e-2)


def test_dft_rejects_the_complex_axis():
    x = _signal((2, 4, 2))
    inputs = {"X": x, "A": np.array(2, np.int64)}
    with pytest.raises(ModelLoadError, match="axis 2 is out of range"):
        run(make_model(helper.make_node("DFT", ["X", "", "A"], ["Y"]), inputs), inputs)


def test_dft_gradient_matches_finite_differences():
    x = _signal((1, 6, 1))
    node = helper.make_node("DFT", ["X"], ["Y"], onesided=1)
    fn = TranslatedModel(load_model(make_model(node, {"X": x})))

    def loss(signal):
        return (fn(fn.params, {"X": signal})["Y"] ** 2 * np.arange(8).reshape(1, 4, 2)).sum()

    with jax.enable_x64(True):
        gradient = np.asarray(jax.grad(loss)(x))
        step = 1e-6
        numeric = np.zeros_like(x)
        for i in range(6):
            bump = np.zeros_like(x)
            bump[0, i, 0] = step
            numeric[0, i, 0] = (loss(x + bump) - loss(x - bump)) / (2 * step)
    np.testing.assert_allclose(gradient, numeric, rtol=1e-5, atol=1e-6)


def test_stft_of_a_complex_signal_with_window_and_frame_length():
    signal = _signal((2, 20, 2))
    window = np.hanning(6)
    inputs = {"S": signal, "step": np.array(3, np.int64), "W": window, "L": np.array(6, np.int64)}
    node = helper.make_node("STFT", ["S", "step", "W", "L"], ["Y"], onesided=0)
    (y,) = run(make_model(node, inputs), inputs)
    values = signal[..., 0] + 1j * signal[..., 1]
    frames = np.stack([values[:, s:s + 6] * window for s in range(0, 15, 3)], axis=1)
    assert_same([y], [_complex_layout(np.fft.fft(frames, axis=-1))], atol=1e-9)


def test_stft_refuses_a_window_of_another_length():
    inputs = {"S": _signal((1, 16, 1)), "step": np.array(4, np.int64), "W": np.ones(5),
              "L": np.array(8, np.int64)}
    with pytest.raises(ModelLoadError, match="window length 5 differs"):
        run(make_model(helper.make_node("STFT", ["S", "step", "W", "L"], ["Y"]), inputs), inputs)


@pytest.mark.parametrize("op_type", ["HannWindow", "HammingWindow", "BlackmanWindow"])
@pytest.mark.parametrize("periodic", [0, 1])
def test_windows_match_the_reference_in_double(op_type, periodic):
    inputs = {"N": np.array(9, np.int64)}
    node = helper.make_node(op_type, ["N"], ["Y"], periodic=periodic,
                            output_datatype=TensorProto.DOUBLE)
    model = make_model(node, inputs)
    assert_same(run(model, inputs), reference(model, inputs), atol=1e-12)


def test_a_one_point_symmetric_window_is_one():
    inputs = {"N": np.array(1, np.int32)}
    (y,) = run(make_model(helper.make_node("HannWindow", ["N"], ["Y"], periodic=0), inputs), inputs)
    assert_same([y], [np.ones(1, np.float32)])


@pytest.mark.slow
def test_mel_weight_matrix_matches_the_reference():
    inputs = {"bins": np.array(10, np.int64), "dft": np.array(64, np.int64),
              "rate": np.array(16000, np.int64), "low": np.array(100.0, np.float32),
              "high": np.array(7000.0, np.float32)}
    node = helper.make_node("MelWeightMatrix", list(inputs), ["Y"], output_datatype=TensorProto.DOUBLE)
    model = make_model(node, inputs)
    assert_same(run(model, inputs), reference(model, inputs))


# --- strings --------------------------------------------------------------------------


def test_string_concat_broadcasts():
    inputs = {"X": strings("a", "bc").reshape(2, 1), "Y": strings("1", "2", "3")}
    model = make_model(helper.make_node("StringConcat", ["X", "Y"], ["Z"]), inputs)
    (z,) = run(model, inputs)
    assert z.tolist() == [["a1", "a2", "a3"], ["bc1", "bc2", "bc3"]]


def test_string_split_with_delimiter_and_maxsplit_on_a_matrix():
    x = strings("a,b,c", "", "d,,e", "f").reshape(2, 2)
    node = helper.make_node("StringSplit", ["X"], ["Y", "Z"], delimiter=",", maxsplit=1)
    y, z = run(make_model(node, {"X": x}), {"X": x})
    assert y.tolist() == [[["a", "b,c"], ["", ""]], [["d", ",e"], ["f", ""]]]
    assert z.dtype == np.int64 and z.tolist() == [[2, 1], [2, 1]]


def test_string_split_on_whitespace_drops_empty_pieces():
    x = strings("  hello   world ", "   ")
    y, z = run(make_model(helper.make_node("StringSplit", ["X"], ["Y", "Z"]), {"X": x}), {"X": x})
    assert y.tolist() == [["hello", "world"], ["", ""]] and z.tolist() == [2, 0]


def test_string_normalizer_drops_stopwords_case_insensitively_and_uppercases():
    x = strings("The", "cat", "THE", "sat").reshape(1, 4)
    node = helper.make_node("StringNormalizer", ["X"], ["Y"], stopwords=["the"],
                            case_change_action="UPPER")
    (y,) = run(make_model(node, {"X": x}), {"X": x})
    assert y.shape == (1, 2) and y.tolist() == [["CAT", "SAT"]]


def test_string_normalizer_case_sensitive_keeps_other_cases_and_empties_to_one_string():
    x = strings("the", "The")
    sensitive = helper.make_node("StringNormalizer", ["X"], ["Y"], stopwords=["the"],
                                 is_case_sensitive=1)
    assert run(make_model(sensitive, {"X": x}), {"X": x})[0].tolist() == ["The"]
    everything = helper.make_node("StringNormalizer", ["X"], ["Y"], stopwords=["THE"])
    assert run(make_model(everything, {"X": x}), {"X": x})[0].tolist() == [""]


def test_regex_full_match_needs_the_whole_string():
    x = strings("abc", "abcd", "xabc", "")
    node = helper.make_node("RegexFullMatch", ["X"], ["Y"], pattern="a.c|")
    (y,) = run(make_model(node, {"X": x}), {"X": x})
    assert y.dtype == np.bool_ and y.tolist() == [True, False, False, True]


def _tfidf(mode: str, pool: dict, **attributes) -> onnx.NodeProto:
    return helper.make_node("TfIdfVectorizer", ["X"], ["Y"], mode=mode, **pool, **attributes)


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
def test_tfidf_with_string_pool_and_weights_matches_the_reference(mode):
    x = strings("a", "b", "a", "c", "b", "a", "b", "d").reshape(2, 4)
    node = _tfidf(mode, {"pool_strings": ["a", "b", "c", "a", "b", "b", "a"]}, min_gram_length=1,
                  max_gram_length=2, max_skip_count=1, ngram_counts=[0, 3],
                  ngram_indexes=[0, 1, 2, 3, 4], weights=[0.5, 2.0, 1.0, 3.0, 0.25])
    model = make_model(node, {"X": x})
    assert_same(run(model, {"X": x}), reference(model, {"X": x}))


def test_tfidf_on_int_tokens_counts_skip_grams_like_the_reference():
    x = np.array([[1, 2, 3, 1, 2, 3, 4], [4, 3, 2, 1, 1, 2, 3]], np.int32)
    node = _tfidf("TF", {"pool_int64s": [1, 2, 1, 3, 2, 3, 1, 2, 3]}, min_gram_length=2,
                  max_gram_length=3, max_skip_count=2, ngram_counts=[0, 0, 6],
                  ngram_indexes=[3, 0, 2, 1])
    model = make_model(node, {"X": x})
    assert_same(run(model, {"X": x}), reference(model, {"X": x}))


def test_tfidf_of_a_computed_int_input_runs_eagerly():
    x = np.array([1, 2, 1, 2], np.int64)
    tfidf = _tfidf("TF", {"pool_int64s": [1, 2]}, min_gram_length=1, max_gram_length=1,
                   max_skip_count=0, ngram_counts=[0], ngram_indexes=[0, 1])
    tfidf.input[0] = "T"
    graph = helper.make_graph(
        [helper.make_node("Identity", ["X"], ["T"]), tfidf], "eager",
        [helper.make_tensor_value_info("X", TensorProto.INT64, [4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])
    assert_same(run(model, {"X": x}), [np.array([2.0, 2.0], np.float32)])


# --- ai.onnx.ml: encoders and element-wise ops ----------------------------------------


def _ml(op_type: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...] = ("Y",),
        ml_opset: int = 5, **attributes) -> onnx.ModelProto:
    node = helper.make_node(op_type, list(inputs), list(outputs), domain=ML, **attributes)
    return make_model(node, inputs, ml_opset=ml_opset)


def _check_against_reference(model, inputs, rtol=1e-5, atol=1e-6):
    assert_same(run(model, inputs), reference(model, inputs), rtol, atol)


def test_label_encoder_float_keys_match_nan_and_fall_back_to_the_default():
    inputs = {"X": np.array([[1.5, np.nan], [2.0, 7.0]], np.float32)}
    model = _ml("LabelEncoder", inputs, keys_floats=[1.5, float("nan"), 2.0],
                values_int64s=[10, 20, 30], default_int64=-9)
    assert_same(run(model, inputs), [np.array([[10, 20], [30, -9]], np.int64)])


def test_label_encoder_repeated_key_keeps_the_last_value():
    inputs = {"X": np.array([3, 4, 5], np.int64)}
    model = _ml("LabelEncoder", inputs, keys_int64s=[3, 4, 3], values_floats=[1.0, 2.0, 3.0])
    assert_same(run(model, inputs), [np.array([3.0, 2.0, -0.0], np.float32)])


def test_label_encoder_tensor_keys_and_values_with_default_tensor():
    inputs = {"X": np.array([7, 8, 9], np.int32)}
    model = _ml("LabelEncoder", inputs,
                keys_tensor=helper.make_tensor("k", TensorProto.INT32, [2], [7, 9]),
                values_tensor=helper.make_tensor("v", TensorProto.DOUBLE, [2], [0.5, 1.5]),
                default_tensor=helper.make_tensor("d", TensorProto.DOUBLE, [1], [4.0]))
    _check_against_reference(model, inputs)


def test_label_encoder_int_to_string():
    inputs = {"X": np.array([1, 2, 3], np.int64)}
    model = _ml("LabelEncoder", inputs, keys_int64s=[1, 3], values_strings=["one", "three"])
    assert run(model, inputs)[0].tolist() == ["one", "_Unused", "three"]


def test_label_encoder_opset1_converts_both_ways():
    words = {"X": strings("b", "z", "a")}
    to_int = _ml("LabelEncoder", words, ml_opset=1, classes_strings=["a", "b"], default_int64=-5)
    assert_same(run(to_int, words), [np.array([1, -5, 0], np.int64)])
    codes = {"X": np.array([1, 4], np.int64)}
    to_string = _ml("LabelEncoder", codes, ml_opset=1, classes_strings=["a", "b"], default_string="?")
    assert run(to_string, codes)[0].tolist() == ["b", "?"]


def test_array_feature_extractor_of_a_vector_gives_one_row():
    inputs = {"X": np.array([5.0, 6.0, 7.0], np.float32), "I": np.array([2, 0], np.int64)}
    model = _ml("ArrayFeatureExtractor", inputs, ml_opset=1)
    assert_same(run(model, inputs), [np.array([[7.0, 5.0]], np.float32)])


def test_array_feature_extractor_of_strings():
    inputs = {"X": strings("a", "b", "c", "d").reshape(2, 2), "I": np.array([1], np.int64)}
    assert run(_ml("ArrayFeatureExtractor", inputs, ml_opset=1), inputs)[0].tolist() == [["b"], ["d"]]


def test_binarizer_keeps_the_integer_dtype():
    inputs = {"X": np.array([[-2, 0, 3]], np.int64)}
    _check_against_reference(_ml("Binarizer", inputs, ml_opset=1, threshold=0.5), inputs)


def test_scaler_per_feature_outputs_float():
    inputs = {"X": np.array([[1.0, 2.0], [3.0, 5.0]], np.float32)}
    model = _ml("Scaler", inputs, ml_opset=1, offset=[1.0, -1.0], scale=[2.0, 0.5])
    assert_same(run(model, inputs), [np.array([[0.0, 1.5], [4.0, 3.0]], np.float32)])


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_normalizer_l1_l2_match_the_reference(norm):
    inputs = {"X": np.array([[-3.0, 1.0, 2.0], [0.0, 0.0, 0.0]], np.float32)}
    _check_against_reference(_ml("Normalizer", inputs, ml_opset=1, norm=norm), inputs)


def test_normalizer_max_divides_by_the_row_maximum_like_onnxruntime():
    inputs = {"X": np.array([[-3.0, 1.0, 2.0], [-1.0, -2.0, -4.0]], np.float32)}
    model = _ml("Normalizer", inputs, ml_opset=1, norm="MAX")
    assert_same(run(model, inputs), onnxruntime_outputs(model, inputs))


def test_one_hot_encoder_ints_and_strings():
    numbers = {"X": np.array([[1.0, 5.0], [3.0, 1.0]], np.float32)}
    _check_against_reference(_ml("OneHotEncoder", numbers, ml_opset=1, cats_int64s=[1, 3]), numbers)
    words = {"X": strings("x", "y", "q")}
    _check_against_reference(_ml("OneHotEncoder", words, ml_opset=1, cats_strings=["y", "x"]), words)


def _one_hot_of_a_constant(values: np.ndarray, **attributes) -> onnx.ModelProto:
    """OneHotEncoder of an initializer (a host constant), so the node runs on the host."""
    node = helper.make_node("OneHotEncoder", ["C"], ["Y"], domain=ML, **attributes)
    graph = helper.make_graph([node], "constant", [], [helper.make_value_info("Y", onnx.TypeProto())],
                              [onnx.numpy_helper.from_array(values, "C")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(ML, 1)])


def test_one_hot_encoder_refuses_unknown_categories_when_zeros_is_0():
    model = _one_hot_of_a_constant(np.array([1, 2], np.int64), cats_int64s=[1], zeros=0)
    with pytest.raises(ModelLoadError, match="not among the categories"):
        run(model, {})


def test_one_hot_encoder_compiled_with_zeros_0_gives_zero_rows_for_unknowns():
    inputs = {"X": np.array([1, 2], np.int64)}
    (y,) = run(_ml("OneHotEncoder", inputs, ml_opset=1, cats_int64s=[1], zeros=0), inputs)
    assert_same([y], [np.array([[1.0], [0.0]], np.float32)])


def test_category_mapper_both_directions():
    words = {"X": strings("b", "zz", "a")}
    model = _ml("CategoryMapper", words, ml_opset=1, cats_strings=["a", "b"], cats_int64s=[10, 20],
                default_int64=-1)
    assert_same(run(model, words), [np.array([20, -1, 10], np.int64)])
    codes = {"X": np.array([[20, 30]], np.int64)}
    model = _ml("CategoryMapper", codes, ml_opset=1, cats_strings=["a", "b"], cats_int64s=[10, 20],
                default_string="none")
    assert run(model, codes)[0].tolist() == [["b", "none"]]


def test_imputer_replaces_nan_per_feature_and_ints_by_value():
    floats = {"X": np.array([[np.nan, 1.0], [2.0, np.nan]], np.float32)}
    _check_against_reference(_ml("Imputer", floats, ml_opset=1, imputed_value_floats=[7.0, 8.0],
                                 replaced_value_float=float("nan")), floats)
    ints = {"X": np.array([[0, 3], [4, 0]], np.int64)}
    _check_against_reference(_ml("Imputer", ints, ml_opset=1, imputed_value_int64s=[9],
                                 replaced_value_int64=0), ints)


def test_feature_vectorizer_cuts_and_pads_to_inputdimensions():
    inputs = {"A": np.array([[1, 2, 3], [4, 5, 6]], np.int64), "B": np.array([[7.0], [8.0]], np.float64)}
    model = _ml("FeatureVectorizer", inputs, ml_opset=1, inputdimensions=[2, 3])
    expected = np.array([[1, 2, 7, 0, 0], [4, 5, 8, 0, 0]], np.float32)
    assert_same(run(model, inputs), [expected])


def test_zip_map_builds_one_map_per_row():
    inputs = {"X": np.array([[0.25, 0.75], [1.0, 0.0]], np.float32)}
    node = helper.make_node("ZipMap", ["X"], ["Z"], domain=ML, classlabels_strings=["no", "yes"])
    (maps,) = run(make_model(node, inputs, ml_opset=1), inputs)
    assert all(isinstance(m, dict) for m in maps)
    assert maps == [{"no": 0.25, "yes": 0.75}, {"no": 1.0, "yes": 0.0}]


# --- ai.onnx.ml: linear models and SVMs -----------------------------------------------

_X = np.array([[0.5, -1.0, 2.0], [1.5, 0.0, -0.5], [-1.0, 2.0, 0.25], [0.0, 0.0, 0.0]], np.float32)


def test_linear_regressor_with_two_targets():
    inputs = {"X": _X}
    model = _ml("LinearRegressor", inputs, ml_opset=1, targets=2,
                coefficients=[1.0, 2.0, 3.0, -1.0, 0.5, 0.0], intercepts=[0.5, -0.5])
    _check_against_reference(model, inputs)


@pytest.mark.parametrize("post", ["NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO"])
def test_linear_classifier_multiclass_matches_the_reference(post):
    inputs = {"X": _X}
    model = _ml("LinearClassifier", inputs, ("Y", "Z"), ml_opset=1, classlabels_ints=[4, 5, 6],
                coefficients=[1.0, 0.0, -1.0, 0.5, 0.5, 0.5, -1.0, 2.0, 0.0],
                intercepts=[0.1, 0.0, -0.1], post_transform=post)
    _check_against_reference(model, inputs)


def test_linear_classifier_binary_with_string_labels():
    inputs = {"X": _X}
    model = _ml("LinearClassifier", inputs, ("Y", "Z"), ml_opset=1, classlabels_strings=["neg", "pos"],
                coefficients=[1.0, -2.0, 0.5], intercepts=[0.25], post_transform="LOGISTIC")
    _check_against_reference(model, inputs)


_SUPPORT_VECTORS = [0.0, 1.0, 1.0, 0.5, -1.0, 0.0, 2.0, 1.0, 0.0, -0.5, 1.0, 1.0]


@pytest.mark.parametrize("kernel", ["LINEAR", "POLY", "RBF", "SIGMOID"])
def test_svm_regressor_kernels_match_the_reference(kernel):
    inputs = {"X": _X}
    model = _ml("SVMRegressor", inputs, ml_opset=1, kernel_type=kernel, kernel_params=[0.5, 0.25, 3],
                n_supports=4, support_vectors=_SUPPORT_VECTORS,
                coefficients=[0.5, -1.0, 0.25, 1.5], rho=[0.1])
    _check_against_reference(model, inputs)


def test_svm_regressor_one_class_gives_signs():
    inputs = {"X": _X}
    model = _ml("SVMRegressor", inputs, ml_opset=1, kernel_type="RBF", kernel_params=[0.5, 0, 0],
                n_supports=4, support_vectors=_SUPPORT_VECTORS, one_class=1,
                coefficients=[0.5, -1.0, 0.25, 1.5], rho=[-0.3])
    _check_against_reference(model, inputs)


def _svc(inputs, labels, probabilities=False, **attributes):
    extra = {"prob_a": [-1.5, -0.5, -2.0], "prob_b": [0.1, -0.2, 0.0]} if probabilities else {}
    return _ml("SVMClassifier", inputs, ("Y", "Z"), ml_opset=1, kernel_type="RBF",
               kernel_params=[0.4, 0.0, 0], vectors_per_class=[1, 2, 1], support_vectors=_SUPPORT_VECTORS,
               coefficients=[1.0, -0.5, 0.75, -1.0, 0.5, 1.0, -0.25, -1.25], rho=[0.1, -0.2, 0.3],
               **labels, **attributes, **extra)


@pytest.mark.slow
def test_svm_classifier_one_vs_one_votes_match_the_reference():
    inputs = {"X": _X}
    _check_against_reference(_svc(inputs, {"classlabels_strings": ["a", "b", "c"]}), inputs)


@pytest.mark.slow
def test_svm_classifier_probabilities_match_onnxruntime():
    # onnx's reference couples pairwise probabilities with a matrix product where libsvm
    # (and onnxruntime) multiply element-wise, so only onnxruntime is an oracle here.
    inputs = {"X": _X}
    model = _svc(inputs, {"classlabels_ints": [1, 2, 3]}, probabilities=True)
    assert_same(run(model, inputs), onnxruntime_outputs(model, inputs), rtol=1e-4, atol=1e-5)


def test_svm_classifier_binary_decision_value_matches_the_reference():
    inputs = {"X": _X}
    model = _ml("SVMClassifier", inputs, ("Y", "Z"), ml_opset=1, kernel_type="LINEAR",
                classlabels_ints=[0, 1], vectors_per_class=[2, 1], support_vectors=_SUPPORT_VECTORS[:9],
                coefficients=[1.0, -0.5, 0.75], rho=[0.1], post_transform="LOGISTIC")
    _check_against_reference(model, inputs)


# --- ai.onnx.ml: tree ensembles -------------------------------------------------------

# Two trees over 2 features: tree 0 splits on x0 <= 0.5 then x1 < 1; tree 1 on x1 >= 0.
_LEGACY_TREES = dict(
    nodes_treeids=[0, 0, 0, 0, 0, 1, 1, 1],
    nodes_nodeids=[0, 1, 2, 3, 4, 0, 1, 2],
    nodes_featureids=[0, 1, 0, 0, 0, 1, 0, 0],
    nodes_modes=["BRANCH_LEQ", "BRANCH_LT", "LEAF", "LEAF", "LEAF", "BRANCH_GTE", "LEAF", "LEAF"],
    nodes_values=[0.5, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    nodes_truenodeids=[1, 3, 0, 0, 0, 1, 0, 0],
    nodes_falsenodeids=[2, 4, 0, 0, 0, 2, 0, 0],
    nodes_missing_value_tracks_true=[1, 0, 0, 0, 0, 0, 0, 0],
)
_TREE_X = np.array([[0.0, 0.5], [1.0, -1.0], [np.nan, 2.0], [0.5, 1.0]], np.float32)


@pytest.mark.parametrize("aggregate", ["SUM", "AVERAGE", "MIN", "MAX"])
def test_tree_ensemble_regressor_aggregates_like_the_reference(aggregate):
    inputs = {"X": _TREE_X}
    model = _ml("TreeEnsembleRegressor", inputs, ml_opset=3, n_targets=2, aggregate_function=aggregate,
                target_treeids=[0, 0, 0, 0, 1, 1, 1], target_nodeids=[2, 3, 4, 4, 1, 2, 2],
                target_ids=[0, 0, 0, 1, 1, 0, 1], target_weights=[1.0, 2.0, 3.0, -1.0, 0.5, 4.0, 2.5],
                **_LEGACY_TREES)
    _check_against_reference(model, inputs)


def test_tree_ensemble_regressor_adds_base_values_and_reads_double_thresholds():
    inputs = {"X": _TREE_X.astype(np.float64)}
    trees = {k: v for k, v in _LEGACY_TREES.items() if k != "nodes_values"}
    model = _ml("TreeEnsembleRegressor", inputs, ml_opset=3, n_targets=1,
                nodes_values_as_tensor=helper.make_tensor("v", TensorProto.DOUBLE, [8],
                                                          _LEGACY_TREES["nodes_values"]),
                target_treeids=[0, 0, 0, 1, 1], target_nodeids=[2, 3, 4, 1, 2], target_ids=[0] * 5,
                target_weights=[1.0, 2.0, 3.0, 0.5, 4.0], base_values=[10.0], **trees)
    # onnx's reference fails on nodes_values_as_tensor: compare with the float-list model.
    same_trees = _ml("TreeEnsembleRegressor", inputs, ml_opset=3, n_targets=1,
                     target_treeids=[0, 0, 0, 1, 1], target_nodeids=[2, 3, 4, 1, 2], target_ids=[0] * 5,
                     target_weights=[1.0, 2.0, 3.0, 0.5, 4.0], base_values=[10.0], **_LEGACY_TREES)
    (y,) = run(model, inputs)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, reference(same_trees, inputs)[0], rtol=1e-6)


_CLASS_VOTES = dict(class_treeids=[0, 0, 0, 1, 1], class_nodeids=[2, 3, 4, 1, 2])


@pytest.mark.parametrize("post", ["NONE", "SOFTMAX", "LOGISTIC"])
def test_tree_ensemble_classifier_multiclass_matches_the_reference(post):
    inputs = {"X": _TREE_X}
    model = _ml("TreeEnsembleClassifier", inputs, ("Y", "Z"), ml_opset=3, classlabels_int64s=[7, 8, 9],
                class_ids=[0, 1, 2, 2, 0], class_weights=[0.5, 1.0, 0.25, 0.75, 0.6],
                base_values=[0.1, 0.0, -0.1], post_transform=post, **_CLASS_VOTES, **_LEGACY_TREES)
    _check_against_reference(model, inputs)


@pytest.mark.parametrize("post", ["NONE", pytest.param("LOGISTIC", marks=pytest.mark.slow)])
def test_tree_ensemble_classifier_binary_matches_the_reference(post):
    inputs = {"X": _TREE_X}
    model = _ml("TreeEnsembleClassifier", inputs, ("Y", "Z"), ml_opset=3, classlabels_strings=["n", "y"],
                class_ids=[0] * 5, class_weights=[0.2, 0.9, -0.4, 0.3, 0.1], post_transform=post,
                **_CLASS_VOTES, **_LEGACY_TREES)
    _check_against_reference(model, inputs)


def _tree_v5(inputs, aggregate: int, post: int = 0):
    return _ml("TreeEnsemble", inputs, n_targets=2, aggregate_function=aggregate, post_transform=post,
               tree_roots=[0, 2],
               nodes_modes=helper.make_tensor("m", TensorProto.UINT8, [3], [0, 3, 4]),
               nodes_featureids=[0, 1, 1],
               nodes_splits=helper.make_tensor("s", TensorProto.FLOAT, [3], [0.5, 1.0, 2.0]),
               nodes_truenodeids=[0, 1, 3], nodes_trueleafs=[1, 1, 1],
               nodes_falsenodeids=[1, 2, 4], nodes_falseleafs=[0, 1, 1],
               nodes_missing_value_tracks_true=[1, 0, 0],
               leaf_targetids=[0, 1, 0, 1, 0],
               leaf_weights=helper.make_tensor("w", TensorProto.FLOAT, [5], [1.0, 2.0, 3.0, 4.0, 5.0]))


@pytest.mark.parametrize("aggregate", [0, 1])
def test_tree_ensemble_v5_follows_missing_values_and_aggregates(aggregate):
    inputs = {"X": _TREE_X}
    _check_against_reference(_tree_v5(inputs, aggregate), inputs)


def test_tree_ensemble_v5_applies_its_post_transform():
    # onnx's reference ignores post_transform; onnxruntime applies it as the spec says.
    inputs = {"X": _TREE_X}
    model = _tree_v5(inputs, aggregate=1, post=2)
    (raw,) = reference(_tree_v5(inputs, aggregate=1), inputs)
    assert_same(run(model, inputs), [1 / (1 + np.exp(-raw))])


def test_tree_ensemble_v5_runs_under_jit_on_computed_inputs():
    inputs = {"X": _TREE_X}
    fn = TranslatedModel(load_model(_tree_v5(inputs, aggregate=1)))
    with jax.enable_x64(True):
        jitted = jax.jit(lambda x: fn.apply(fn.params, {"X": x})["Y"])
        np.testing.assert_allclose(jitted(_TREE_X), reference(_tree_v5(inputs, 1), inputs)[0])
