"""The ai.onnx.ml domain: classic machine-learning operators (scikit-learn exports).

Numeric ops run as JAX code, so they jit with the rest of a model. Whatever
touches strings (string keys, labels or categories) and ZipMap's maps needs
host values and raises NeedsHostValues on traced inputs, so the model runs op
by op. Where the spec leaves a detail open (binary classifiers, SVM label
rules, SOFTMAX_ZERO) the handlers follow onnxruntime and onnx's reference
evaluator, which agree on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import ndtri

from onnxtrain.translate.registry import ML_DOMAIN, op
from onnxtrain.translate.values import NeedsHostValues

_POST_TRANSFORMS = ("NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT")


# --- shared helpers ------------------------------------------------------------------


def _is_string(value: Any) -> bool:
    return np.dtype(value.dtype).kind in "OUS"


def _require_host(node: Any, why: str) -> None:
    if not node.host:
        raise NeedsHostValues(node.label, why)


def _filled(items: list, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A numpy array of `shape` holding `items` (which may be strings) in order."""
    array = np.empty(len(items), dtype=dtype)
    array[:] = items
    return array.reshape(shape)


def _host_strings(node: Any, value: Any) -> np.ndarray:
    """A string input as a numpy object array of str."""
    _require_host(node, "works on strings, which exist only on the host")
    array = np.asarray(value)
    texts = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]
    return _filled(texts, object, array.shape)


def _features(x: Any) -> jax.Array:
    """Numeric features as float32, or float64 when they are double."""
    x = jnp.asarray(x)
    return x if x.dtype in (jnp.float32, jnp.float64) else x.astype(jnp.float32)


def _batch(x: jax.Array) -> jax.Array:
    """[C] features as one row [1, C]; [N, C] unchanged."""
    return x.reshape(1, -1) if x.ndim == 1 else x


def _softmax_zero(scores: jax.Array) -> jax.Array:
    """Softmax over the non-zero scores of each row; zeros stay zero; an all-zero row gives 0.5."""
    shifted = jnp.max(scores, axis=-1, keepdims=True)
    nonzero = jnp.abs(scores) > 1e-7
    exps = jnp.where(nonzero, jnp.exp(scores - shifted), scores * jnp.exp(-shifted))
    total = jnp.sum(exps, axis=-1, keepdims=True)
    return jnp.where(total == 0, jnp.full_like(exps, 0.5), exps / jnp.where(total == 0, 1, total))


def _post_transform(node: Any, scores: jax.Array, name: str) -> jax.Array:
    """Scores through NONE, SOFTMAX, LOGISTIC, SOFTMAX_ZERO or PROBIT (the normal quantile)."""
    if name == "NONE":
        return scores
    if name == "SOFTMAX":
        return jax.nn.softmax(scores, axis=-1)
    if name == "LOGISTIC":
        return jax.nn.sigmoid(scores)
    if name == "SOFTMAX_ZERO":
        return _softmax_zero(scores)
    if name == "PROBIT":
        return ndtri(scores)
    raise node.error(f"post_transform must be one of {', '.join(_POST_TRANSFORMS)}, got {name!r}")


def _class_labels(node: Any, ints_name: str = "classlabels_int64s") -> list:
    strings = node.attr("classlabels_strings", None)
    ints = node.attr(ints_name, None)
    if (strings is None) == (ints is None):
        raise node.error(f"exactly one of classlabels_strings and {ints_name} must be set")
    return list(strings if strings is not None else ints)


def _labels_at(node: Any, labels: list, index: jax.Array) -> Any:
    """labels[index] element-wise: int64 on the device, or a string array on the host."""
    if labels and isinstance(labels[0], str):
        _require_host(node, "outputs string class labels, which exist only on the host")
        return np.asarray(labels, dtype=object)[np.asarray(index)]
    return jnp.asarray(labels, jnp.int64)[index]


# --- element-wise transforms ---------------------------------------------------------


@op("Binarizer", since=1, domain=ML_DOMAIN, differentiable=False)
def binarizer(node: Any, x: Any) -> jax.Array:
    """1 where x > threshold, else 0, in x's dtype."""
    x = jnp.asarray(x)
    return (x > node.attr("threshold", 0.0)).astype(x.dtype)


def _per_feature(node: Any, name: str, values: list, features: int) -> np.ndarray:
    """An attribute holding one value for all features or one per feature (last axis)."""
    if len(values) not in (1, features):
        raise node.error(f"{name} has {len(values)} values; expected 1 or {features} (features)")
    return np.asarray(values)


@op("Scaler", since=1, domain=ML_DOMAIN)
def scaler(node: Any, x: Any) -> jax.Array:
    """(x - offset) * scale per feature (last axis), as float."""
    x = jnp.asarray(x)
    features = x.shape[-1] if x.ndim else 1
    offset = _per_feature(node, "offset", node.attr("offset", [0.0]), features)
    scale = _per_feature(node, "scale", node.attr("scale", [1.0]), features)
    return ((x.astype(jnp.float32) - offset.astype(np.float32)) * scale.astype(np.float32))


@op("Normalizer", since=1, domain=ML_DOMAIN)
def normalizer(node: Any, x: Any) -> jax.Array:
    """Each row of [N, C] (or the [C] vector) divided by its MAX, L1 or L2 norm, as float;
    a row whose divisor is 0 is left unchanged."""
    rows = _batch(jnp.asarray(x).astype(jnp.float32))
    norm = node.attr("norm", "MAX")
    if norm == "MAX":
        divisor = jnp.max(rows, axis=-1, keepdims=True)
    elif norm == "L1":
        divisor = jnp.sum(jnp.abs(rows), axis=-1, keepdims=True)
    elif norm == "L2":
        divisor = jnp.sqrt(jnp.sum(rows * rows, axis=-1, keepdims=True))
    else:
        raise node.error(f"norm must be MAX, L1 or L2, got {norm!r}")
    normalized = jnp.where(divisor == 0, rows, rows / jnp.where(divisor == 0, 1, divisor))
    return normalized.reshape(np.shape(x))


@op("Imputer", since=1, domain=ML_DOMAIN)
def imputer(node: Any, x: Any) -> jax.Array:
    """Replaces elements equal to replaced_value_* (NaN matches NaN) with imputed_value_*,
    one value for all features or one per feature (last axis)."""
    x = jnp.asarray(x)
    floats = jnp.issubdtype(x.dtype, jnp.floating)
    kind = "floats" if floats else "int64s"
    imputed = node.attr(f"imputed_value_{kind}", None)
    replaced = node.attr("replaced_value_float" if floats else "replaced_value_int64", 0)
    if not imputed:
        raise node.error(f"imputed_value_{kind} must be set for {x.dtype} input")
    values = _per_feature(node, "imputed values", imputed, x.shape[-1] if x.ndim else 1)
    missing = jnp.isnan(x) if floats and np.isnan(replaced) else x == replaced
    return jnp.where(missing, jnp.asarray(values, x.dtype), x)


@op("ArrayFeatureExtractor", since=1, domain=ML_DOMAIN)
def array_feature_extractor(node: Any, x: Any, indices: Any) -> Any:
    """x[..., indices] with the indices flattened; a 1-D x gives one row [1, k]."""
    count, features = int(np.size(indices)), np.shape(x)[-1]
    shape = (1, count) if np.ndim(x) == 1 else (*np.shape(x)[:-1], count)
    if node.host:
        positions = np.asarray(indices).reshape(-1)
        if count and not (-features <= positions.min() and positions.max() < features):
            raise node.error(f"indices {positions.tolist()} are out of range for {features} "
                             f"features")
    if _is_string(x):
        return _host_strings(node, x)[..., np.asarray(indices).reshape(-1)].reshape(shape)
    return jnp.take(jnp.asarray(x), jnp.asarray(indices).reshape(-1), axis=-1).reshape(shape)


def _columns(value: Any) -> int:
    """Features per row: C of [C]; the product of the trailing dimensions of [N, ...]."""
    shape = np.shape(value)
    return int(np.prod(shape[1:])) if len(shape) > 1 else int(np.prod(shape))


@op("FeatureVectorizer", since=1, domain=ML_DOMAIN)
def feature_vectorizer(node: Any, *inputs: Any) -> jax.Array:
    """The inputs as [N, C_i] rows (1-D as [1, C]), each cut or zero-padded to
    inputdimensions[i] columns, concatenated into one float [N, sum C_i]."""
    sizes = node.attr("inputdimensions", [_columns(v) for v in inputs])
    if len(sizes) != len(inputs):
        raise node.error(f"inputdimensions has {len(sizes)} sizes for {len(inputs)} inputs")
    columns = []
    for value, size in zip(inputs, sizes):
        rows = _batch(jnp.asarray(value).astype(jnp.float32))
        rows = rows.reshape(rows.shape[0], -1)[:, :size]
        columns.append(jnp.pad(rows, ((0, 0), (0, size - rows.shape[1]))))
    return jnp.concatenate(columns, axis=1)


# --- encoders ------------------------------------------------------------------------


@op("OneHotEncoder", since=1, domain=ML_DOMAIN, differentiable=False)
def one_hot_encoder(node: Any, x: Any) -> jax.Array:
    """One float one-hot vector per element over cats_int64s or cats_strings (numeric input
    is cast to int64). Unknown values give all zeros; with zeros=0 they are an error, which
    is checked where the values are known on the host (a compiled program cannot fail)."""
    strings, ints = node.attr("cats_strings", None), node.attr("cats_int64s", None)
    if (strings is None) == (ints is None):
        raise node.error("exactly one of cats_strings and cats_int64s must be set")
    if strings is not None:
        values = _host_strings(node, x)
        hot = jnp.asarray((values[..., None] == np.asarray(strings, dtype=object)).astype(bool))
    else:
        hot = jnp.asarray(x).astype(jnp.int64)[..., None] == jnp.asarray(ints, jnp.int64)
    if not node.attr("zeros", 1) and node.host and not bool(jnp.all(jnp.any(hot, axis=-1))):
        raise node.error("an input value is not among the categories and zeros=0")
    return hot.astype(jnp.float32)


def _lookup(keys: list, values: list) -> dict:
    """key -> value; a repeated key keeps its last value."""
    return dict(zip(keys, values))


@op("CategoryMapper", since=1, domain=ML_DOMAIN, differentiable=False)
def category_mapper(node: Any, x: Any) -> np.ndarray:
    """Strings to int64 through cats_strings -> cats_int64s (default_int64 when absent), or
    int64 to strings the other way (default_string)."""
    strings, ints = node.attr("cats_strings"), node.attr("cats_int64s")
    if len(strings) != len(ints):
        raise node.error(f"cats_strings has {len(strings)} values, cats_int64s {len(ints)}")
    if _is_string(x):
        table, default = _lookup(strings, ints), node.attr("default_int64", -1)
        texts = _host_strings(node, x)
        return _filled([table.get(t, default) for t in texts.reshape(-1)], np.int64, texts.shape)
    _require_host(node, "outputs strings, which exist only on the host")
    codes = np.asarray(x)
    table, default = _lookup(ints, strings), node.attr("default_string", "_Unused")
    return _filled([table.get(c, default) for c in codes.reshape(-1).tolist()], object, codes.shape)


_DEFAULT_OF_KIND = {"O": "_Unused", "U": "_Unused", "i": -1, "u": -1, "f": -0.0}


def _encoder_keys(node: Any) -> np.ndarray:
    for name, dtype in (("keys_strings", object), ("keys_int64s", np.int64),
                        ("keys_floats", np.float32)):
        if node.has_attr(name):
            return np.asarray(node.attr(name), dtype=dtype)
    if node.has_attr("keys_tensor"):
        return node.attr("keys_tensor").reshape(-1)
    raise node.error("one of keys_strings, keys_int64s, keys_floats, keys_tensor must be set")


def _encoder_values(node: Any) -> tuple[np.ndarray, Any]:
    """The values and the default, both in the output dtype."""
    for name, dtype, default in (("values_strings", object, "default_string"),
                                 ("values_int64s", np.int64, "default_int64"),
                                 ("values_floats", np.float32, "default_float")):
        if node.has_attr(name):
            values = np.asarray(node.attr(name), dtype=dtype)
            fallback = _DEFAULT_OF_KIND[values.dtype.kind]
            return values, np.asarray(node.attr(default, fallback), dtype)
    if node.has_attr("values_tensor"):
        values = node.attr("values_tensor").reshape(-1)
        fallback = np.asarray(_DEFAULT_OF_KIND[values.dtype.kind], values.dtype)
        default = node.attr("default_tensor", fallback).reshape(-1)[0]
        return values, np.asarray(default, values.dtype)
    raise node.error("one of values_strings, values_int64s, values_floats, values_tensor must "
                     "be set")


def _encode_on_host(node: Any, x: Any, keys: np.ndarray, values: np.ndarray,
                    default: np.ndarray) -> np.ndarray:
    """Dictionary lookup for string keys or values; NaN keys match NaN inputs."""
    _require_host(node, "maps to or from strings, which exist only on the host")
    items = _host_strings(node, x) if _is_string(x) else np.asarray(x)
    table = _lookup(keys.tolist(), values.tolist())
    nan_keys = [v for k, v in table.items() if k != k]
    fallback = default.item()
    looked_up = [nan_keys[-1] if nan_keys and v != v else table.get(v, fallback)
                 for v in items.reshape(-1).tolist()]
    return _filled(looked_up, values.dtype, items.shape)


def _encode_on_device(x: Any, keys: np.ndarray, values: np.ndarray,
                      default: np.ndarray) -> jax.Array:
    """Binary search of x among the sorted keys; a repeated key keeps its last value."""
    x = jnp.asarray(x)
    keys = keys.astype(x.dtype)
    unique, last = np.unique(keys[::-1], return_index=True)
    ordered_values = values[::-1][last]
    numbers = ~np.isnan(unique) if unique.dtype.kind == "f" else np.ones(unique.shape, bool)
    sorted_keys, sorted_values = unique[numbers], ordered_values[numbers]
    if sorted_keys.size == 0:
        result = jnp.full(x.shape, default, values.dtype)
    else:
        position = jnp.clip(jnp.searchsorted(sorted_keys, x), 0, sorted_keys.size - 1)
        found = jnp.asarray(sorted_keys)[position] == x
        result = jnp.where(found, jnp.asarray(sorted_values)[position], jnp.asarray(default))
    if not numbers.all():
        result = jnp.where(jnp.isnan(x), ordered_values[~numbers][0], result)
    return result.astype(values.dtype)


@op("LabelEncoder", since=2, domain=ML_DOMAIN, differentiable=False)
def label_encoder(node: Any, x: Any) -> Any:
    """Maps each element through keys_* -> values_* (lists or tensors); absent keys give
    default_* (or default_tensor). NaN keys match NaN; a repeated key keeps its last value."""
    keys = _encoder_keys(node)
    values, default = _encoder_values(node)
    if keys.shape != values.shape:
        raise node.error(f"{keys.size} keys but {values.size} values")
    if _is_string(x) or values.dtype == object:
        return _encode_on_host(node, x, keys, values, default)
    return _encode_on_device(x, keys, values, default)


@op("LabelEncoder", since=1, domain=ML_DOMAIN, differentiable=False)
def label_encoder_1(node: Any, x: Any) -> np.ndarray:
    """Strings to their index in classes_strings (default_int64 when absent), or int64
    indices to those strings (default_string when out of range)."""
    classes = node.attr("classes_strings", [])
    if _is_string(x):
        table, default = {c: i for i, c in enumerate(classes)}, node.attr("default_int64", -1)
        texts = _host_strings(node, x)
        return _filled([table.get(t, default) for t in texts.reshape(-1)], np.int64, texts.shape)
    _require_host(node, "outputs strings, which exist only on the host")
    indices, default = np.asarray(x), node.attr("default_string", "_Unused")
    mapped = [classes[i] if 0 <= i < len(classes) else default
              for i in indices.reshape(-1).tolist()]
    return _filled(mapped, object, indices.shape)


@op("ZipMap", since=1, domain=ML_DOMAIN, differentiable=False)
def zip_map(node: Any, x: Any) -> list[dict]:
    """One map {class label: score} per row of [N, C] scores (a sequence of maps)."""
    _require_host(node, "builds maps, which exist only on the host")
    labels = _class_labels(node)
    rows = np.asarray(x, np.float32).reshape(-1, np.shape(x)[-1] if np.ndim(x) else 1)
    if rows.shape[1] != len(labels):
        raise node.error(f"input has {rows.shape[1]} columns for {len(labels)} class labels")
    return [dict(zip(labels, row.tolist())) for row in rows]


# --- linear models -------------------------------------------------------------------


def _linear_scores(node: Any, x: Any, outputs: int | None) -> jax.Array:
    """x @ W.T + b for coefficients W [outputs, features] (outputs inferred when None)."""
    rows = _batch(_features(x))
    coefficients = np.asarray(node.attr("coefficients"), np.float32)
    features = rows.shape[1]
    if outputs is None:
        outputs = coefficients.size // max(features, 1)
    if coefficients.size != outputs * features:
        raise node.error(f"{coefficients.size} coefficients do not make {outputs} rows of "
                         f"{features} features")
    scores = rows @ jnp.asarray(coefficients.reshape(outputs, features), rows.dtype).T
    intercepts = node.attr("intercepts", None)
    if intercepts:
        scores = scores + jnp.asarray(intercepts, rows.dtype)
    return scores


@op("LinearRegressor", since=1, domain=ML_DOMAIN)
def linear_regressor(node: Any, x: Any) -> jax.Array:
    """[N, targets] = x @ coefficients.T + intercepts, then post_transform, as float."""
    scores = _linear_scores(node, x, node.attr("targets", 1))
    return _post_transform(node, scores, node.attr("post_transform", "NONE")).astype(jnp.float32)


@op("LinearClassifier", since=1, domain=ML_DOMAIN, differentiable=False)
def linear_classifier(node: Any, x: Any) -> tuple[Any, jax.Array]:
    """Scores x @ coefficients.T + intercepts per class (one score s for two classes is
    [-s, s]), post_transform, and the label of the best score."""
    labels = _class_labels(node, "classlabels_ints")
    scores = _linear_scores(node, x, None)
    if scores.shape[1] == 1 and len(labels) == 2:
        scores = jnp.concatenate([-scores, scores], axis=1)
    post = node.attr("post_transform", "NONE")
    scores = _post_transform(node, scores, post).astype(jnp.float32)
    if scores.shape[1] > 1:
        return _labels_at(node, labels, jnp.argmax(scores, axis=1)), scores
    if labels and isinstance(labels[0], str):
        raise node.unsupported("one score with string labels has no defined label rule; use "
                               "two classes or integer labels")
    positive = scores[:, 0] >= (0 if post == "NONE" else 0.5)
    label = labels[0] if labels else 1
    return jnp.where(positive, label, 0).astype(jnp.int64), scores


# --- support vector machines ---------------------------------------------------------


def _kernel(node: Any, x: jax.Array, vectors: np.ndarray) -> jax.Array:
    """k(x_n, v_j) for every row and support vector: LINEAR, POLY, RBF or SIGMOID."""
    gamma, coef0, degree = (list(node.attr("kernel_params", [])) + [0.0, 0.0, 0.0])[:3]
    vectors = jnp.asarray(vectors, x.dtype)
    kind = node.attr("kernel_type", "LINEAR")
    dots = x @ vectors.T
    if kind == "LINEAR":
        return dots
    if kind == "POLY":
        return (gamma * dots + coef0) ** int(degree)
    if kind == "SIGMOID":
        return jnp.tanh(gamma * dots + coef0)
    if kind == "RBF":
        distances = jnp.sum(x * x, axis=1)[:, None] + jnp.sum(vectors * vectors, axis=1) - 2 * dots
        return jnp.exp(-gamma * jnp.maximum(distances, 0))
    raise node.error(f"kernel_type must be LINEAR, POLY, RBF or SIGMOID, got {kind!r}")


@op("SVMRegressor", since=1, domain=ML_DOMAIN)
def svm_regressor(node: Any, x: Any) -> jax.Array:
    """sum_j coef_j k(x, sv_j) + rho (a linear model when n_supports is 0); one_class
    gives +1/-1 by the sign. Output [N, 1] float."""
    rows = _batch(_features(x))
    coefficients = np.asarray(node.attr("coefficients"), np.float32)
    rho = node.attr("rho", [0.0])[0]
    supports = node.attr("n_supports", 0)
    if supports > 0:
        vectors = np.asarray(node.attr("support_vectors"), np.float32).reshape(supports, -1)
        scores = _kernel(node, rows, vectors) @ jnp.asarray(coefficients, rows.dtype) + rho
    else:
        scores = rows @ jnp.asarray(coefficients, rows.dtype) + rho
    if node.attr("one_class", 0):
        scores = jnp.where(scores > 0, 1.0, -1.0)
    scores = _post_transform(node, scores[:, None], node.attr("post_transform", "NONE"))
    return scores.astype(jnp.float32)


def _class_pairs(classes: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(classes) for j in range(i + 1, classes)]


def _one_vs_one(node: Any, rows: jax.Array, classes: int, per_class: list[int],
                coefficients: np.ndarray, rho: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """libsvm's one-vs-one decision values [N, pairs] and votes [N, classes]."""
    vectors = np.asarray(node.attr("support_vectors"), np.float32).reshape(sum(per_class), -1)
    kernels = _kernel(node, rows, vectors)
    dual = jnp.asarray(coefficients.reshape(classes - 1, -1), rows.dtype)
    starts = np.concatenate([[0], np.cumsum(per_class)])
    decisions, votes = [], jnp.zeros((rows.shape[0], classes), rows.dtype)
    for pair, (i, j) in enumerate(_class_pairs(classes)):
        of_i, of_j = slice(starts[i], starts[i + 1]), slice(starts[j], starts[j + 1])
        decision = (rho[pair] + kernels[:, of_i] @ dual[j - 1, of_i]
                    + kernels[:, of_j] @ dual[i, of_j])
        decisions.append(decision)
        votes = votes.at[:, i].add(decision > 0).at[:, j].add(decision <= 0)
    return jnp.stack(decisions, axis=1), votes


def _couple_probabilities(pairwise: jax.Array, classes: int) -> jax.Array:
    """Class probabilities from pairwise ones, r[i, j] = P(i | i or j): libsvm's
    multiclass_probability fixed-point iteration (Wu, Lin and Weng 2004)."""
    off_diagonal = ~np.eye(classes, dtype=bool)
    q = jnp.where(off_diagonal, -pairwise.T * pairwise, jnp.diag(jnp.sum(pairwise**2, axis=0)))
    tolerance, max_iterations = 0.005 / classes, max(100, classes)

    def converged(p: jax.Array) -> jax.Array:
        qp = q @ p
        return jnp.max(jnp.abs(qp - p @ qp)) < tolerance

    def sweep(state: tuple) -> tuple:
        p, iteration = state
        qp = q @ p
        pqp = p @ qp
        for t in range(classes):
            step = (pqp - qp[t]) / q[t, t]
            p = p.at[t].add(step)
            pqp = (pqp + step * (step * q[t, t] + 2 * qp[t])) / (1 + step) ** 2
            p = p / (1 + step)
            qp = (qp + step * q[t]) / (1 + step)
        return p, iteration + 1

    def running(state: tuple) -> jax.Array:
        p, iteration = state
        return (iteration < max_iterations) & ~converged(p)

    start = jnp.full((classes,), 1.0 / classes, pairwise.dtype)
    return jax.lax.while_loop(running, sweep, (start, 0))[0]


def _svm_probabilities(node: Any, decisions: jax.Array, classes: int) -> jax.Array:
    """Platt-scaled pairwise probabilities 1 / (1 + exp(A d + B)), coupled per row."""
    a = jnp.asarray(node.attr("prob_a"), decisions.dtype)
    b = jnp.asarray(node.attr("prob_b"), decisions.dtype)
    pairwise_p = jnp.clip(jax.nn.sigmoid(-(decisions * a + b)), 1e-7, 1 - 1e-7)
    pairwise = jnp.zeros((decisions.shape[0], classes, classes), decisions.dtype)
    for pair, (i, j) in enumerate(_class_pairs(classes)):
        pairwise = pairwise.at[:, i, j].set(pairwise_p[:, pair])
        pairwise = pairwise.at[:, j, i].set(1 - pairwise_p[:, pair])
    return jax.vmap(lambda r: _couple_probabilities(r, classes))(pairwise)


def _svm_output_scores(node: Any, scores: jax.Array, two_labels: bool) -> jax.Array:
    """Post-transformed scores; a single decision value d of a two-class model becomes
    [-d, d] first (PROBIT keeps the single column)."""
    post = node.attr("post_transform", "NONE")
    if scores.shape[1] == 1 and post != "PROBIT":
        if not two_labels:
            return scores
        scores = jnp.concatenate([-scores, scores], axis=1)
    return _post_transform(node, scores, post)


@op("SVMClassifier", since=1, domain=ML_DOMAIN, differentiable=False)
def svm_classifier(node: Any, x: Any) -> tuple[Any, jax.Array]:
    """libsvm classification: one-vs-one votes over kernel decision values (or linear
    scores without support vectors), optional Platt probabilities, post_transform."""
    labels = _class_labels(node, "classlabels_ints")
    classes = max(len(labels), 1)
    rows = _batch(_features(x))
    coefficients = np.asarray(node.attr("coefficients"), np.float32)
    rho = np.asarray(node.attr("rho"), np.float32)
    per_class = list(node.attr("vectors_per_class", []))
    votes = None
    if sum(per_class) > 0:
        scores, votes = _one_vs_one(node, rows, classes, per_class, coefficients, rho)
    else:
        weights = jnp.asarray(coefficients.reshape(classes, -1), rows.dtype)
        scores = rows @ weights.T + rho[0]
    probabilities = votes is not None and len(node.attr("prob_a", [])) > 0
    if probabilities:
        scores = _svm_probabilities(node, scores, classes)
    ranking = scores if votes is None else votes
    best = jnp.argmax(ranking, axis=1)
    best_weight = jnp.max(ranking, axis=1)
    if rho.size == 1 and len(labels) == 2:
        positive_weights = not probabilities and coefficients.min() >= 0
        index = jnp.where(positive_weights & (best_weight >= 0.5), 1, best)
    elif rho.size == 1:
        index = (best_weight > 0).astype(jnp.int64)
        labels = labels if labels and isinstance(labels[0], str) else [0, 1]
    else:
        index = best
    scores = _svm_output_scores(node, scores, len(labels) == 2 and rho.size == 1)
    return _labels_at(node, labels, index), scores.astype(jnp.float32)


# --- tree ensembles ------------------------------------------------------------------

_MODE_CODES = {"BRANCH_LEQ": 0, "BRANCH_LT": 1, "BRANCH_GTE": 2, "BRANCH_GT": 3,
               "BRANCH_EQ": 4, "BRANCH_NEQ": 5, "BRANCH_MEMBER": 6}
_MEMBER = 6
_LEGACY_MODES = {"LEAF", *_MODE_CODES} - {"BRANCH_MEMBER"}
_AGGREGATES = ("AVERAGE", "SUM", "MIN", "MAX")


@dataclass
class _Forest:
    """Trees as flat arrays. A *state* below len(feature) is an interior node; state
    len(feature) + l is leaf l. Leaf l adds leaf_values[l, t] to target t where
    leaf_targets[l, t]."""

    feature: np.ndarray
    threshold: np.ndarray
    mode: np.ndarray
    missing_true: np.ndarray
    members: np.ndarray  # [nodes, max members], NaN padded; used by BRANCH_MEMBER nodes
    true_next: np.ndarray
    false_next: np.ndarray
    roots: np.ndarray
    leaf_values: np.ndarray
    leaf_targets: np.ndarray



def _depth(node: Any, forest: _Forest) -> int:
    """The most comparisons any path makes (the number of descent steps)."""
    nodes, deepest, frontier = len(forest.feature), 0, [(int(r), 0) for r in forest.roots]
    states = nodes + len(forest.leaf_values)
    while frontier:
        state, depth = frontier.pop()
        if not 0 <= state < states:
            raise node.error(f"a tree refers to node or leaf {state}, which does not exist")
        if state >= nodes:
            deepest = max(deepest, depth)
        elif depth > nodes:
            raise node.error("the trees contain a cycle")
        else:
            frontier += [(int(forest.true_next[state]), depth + 1),
                         (int(forest.false_next[state]), depth + 1)]
    return deepest


def _goes_true(forest: _Forest, node_index: jax.Array, value: jax.Array) -> jax.Array:
    """The comparison of each visited node, NaN values following missing_true."""
    threshold = jnp.asarray(forest.threshold, value.dtype)[node_index]
    outcomes = jnp.stack([value <= threshold, value < threshold, value >= threshold,
                          value > threshold, value == threshold, value != threshold])
    if forest.members.shape[1]:
        members = jnp.asarray(forest.members, value.dtype)[node_index]
        outcomes = jnp.concatenate([outcomes, jnp.any(value[..., None] == members, axis=-1)[None]])
    mode = jnp.asarray(forest.mode)[node_index]
    chosen = jnp.take_along_axis(outcomes, mode[None].astype(jnp.int32), axis=0)[0]
    return chosen | (jnp.asarray(forest.missing_true)[node_index] & jnp.isnan(value))


def _leaves(node: Any, forest: _Forest, rows: jax.Array) -> jax.Array:
    """The leaf each row reaches in each tree: [N, trees]."""
    nodes = len(forest.feature)
    depth = _depth(node, forest)
    start = jnp.broadcast_to(jnp.asarray(forest.roots), (rows.shape[0], len(forest.roots)))
    if nodes == 0:
        return start - nodes

    def descend(_: int, state: jax.Array) -> jax.Array:
        interior = state < nodes
        index = jnp.where(interior, state, 0)
        value = jnp.take_along_axis(rows, jnp.asarray(forest.feature)[index], axis=1)
        nxt = jnp.where(_goes_true(forest, index, value), jnp.asarray(forest.true_next)[index],
                        jnp.asarray(forest.false_next)[index])
        return jnp.where(interior, nxt, state)

    return jax.lax.fori_loop(0, depth, descend, start) - nodes


def _aggregate(forest: _Forest, leaves: jax.Array, how: str, dtype: Any) -> jax.Array:
    """[N, targets] from the leaves reached: SUM, AVERAGE, MIN or MAX over the trees; a
    target no reached leaf mentions is 0."""
    values = jnp.asarray(forest.leaf_values, dtype)
    targets = jnp.asarray(forest.leaf_targets)
    if how in ("SUM", "AVERAGE"):
        total = jax.lax.fori_loop(0, leaves.shape[1], lambda t, acc: acc + values[leaves[:, t]],
                                  jnp.zeros((leaves.shape[0], values.shape[1]), dtype))
        return total / len(forest.roots) if how == "AVERAGE" else total
    pick, bound = (jnp.minimum, jnp.inf) if how == "MIN" else (jnp.maximum, -jnp.inf)

    def combine(t: int, acc: jax.Array) -> jax.Array:
        return pick(acc, jnp.where(targets[leaves[:, t]], values[leaves[:, t]], bound))

    extreme = jax.lax.fori_loop(0, leaves.shape[1], combine,
                                jnp.full((leaves.shape[0], values.shape[1]), bound, dtype))
    return jnp.where(extreme == bound, 0, extreme)


def _node_tensor(node: Any, name: str) -> np.ndarray | None:
    """A *_as_tensor attribute if set, else the float list attribute, else None."""
    if node.has_attr(f"{name}_as_tensor"):
        return np.asarray(node.attr(f"{name}_as_tensor"), np.float64).reshape(-1)
    return np.asarray(node.attr(name), np.float64) if node.has_attr(name) else None


def _legacy_forest(node: Any, prefix: str, outputs: int) -> _Forest:
    """A _Forest from TreeEnsembleRegressor/Classifier attributes: nodes keyed by
    (tree id, node id), mode LEAF marking leaves, votes in {prefix}_* attributes."""
    trees, ids = node.attr("nodes_treeids"), node.attr("nodes_nodeids")
    modes = node.attr("nodes_modes")
    position = {key: i for i, key in enumerate(zip(trees, ids))}
    interior = [i for i, m in enumerate(modes) if m != "LEAF"]
    leaves = [i for i, m in enumerate(modes) if m == "LEAF"]
    state = {i: s for s, i in enumerate(interior)}
    state.update({i: len(interior) + s for s, i in enumerate(leaves)})

    def child(i: int, ids_name: str) -> int:
        key = (trees[i], node.attr(ids_name)[i])
        if key not in position:
            raise node.error(f"node {ids[i]} of tree {trees[i]} points to missing node {key[1]}")
        return state[position[key]]

    unknown = sorted(set(modes) - _LEGACY_MODES)
    if unknown:
        raise node.error(f"unknown nodes_modes {unknown}")
    values = _node_tensor(node, "nodes_values")
    missing = node.attr("nodes_missing_value_tracks_true", None) or [0] * len(modes)
    first_of_tree = {}
    for i, tree in enumerate(trees):
        first_of_tree.setdefault(tree, i)
    leaf_values = np.zeros((len(leaves), outputs))
    leaf_targets = np.zeros((len(leaves), outputs), bool)
    weights = _node_tensor(node, f"{prefix}_weights")
    vote_targets = node.attr(f"{prefix}_ids")
    for k, key in enumerate(zip(node.attr(f"{prefix}_treeids"), node.attr(f"{prefix}_nodeids"))):
        if key not in position or modes[position[key]] != "LEAF":
            raise node.error(f"{prefix} weight {k} is for node {key[1]} of tree {key[0]}, which "
                             f"is not a leaf")
        if not 0 <= vote_targets[k] < outputs:
            raise node.error(f"{prefix}_ids[{k}] = {vote_targets[k]} is not below {outputs}")
        leaf = state[position[key]] - len(interior)
        leaf_values[leaf, vote_targets[k]] += weights[k]
        leaf_targets[leaf, vote_targets[k]] = True
    return _Forest(
        feature=np.asarray([node.attr("nodes_featureids")[i] for i in interior], np.int64),
        threshold=np.asarray([values[i] for i in interior], np.float64),
        mode=np.asarray([_MODE_CODES[modes[i]] for i in interior], np.int8),
        missing_true=np.asarray([bool(missing[i]) for i in interior], bool),
        members=np.zeros((len(interior), 0)),
        true_next=np.asarray([child(i, "nodes_truenodeids") for i in interior], np.int64),
        false_next=np.asarray([child(i, "nodes_falsenodeids") for i in interior], np.int64),
        roots=np.asarray([state[i] for _, i in sorted(first_of_tree.items())], np.int64),
        leaf_values=leaf_values, leaf_targets=leaf_targets)


def _membership_sets(node: Any, modes: np.ndarray) -> np.ndarray:
    """[nodes, max set size] NaN-padded members of each BRANCH_MEMBER node, in node order."""
    members = node.attr("membership_values", None)
    sets = [] if members is None else np.split(np.asarray(members, np.float64).reshape(-1),
                                               np.flatnonzero(np.isnan(members)) + 1)
    sets = [s[~np.isnan(s)] for s in sets][:int(np.sum(modes == _MEMBER))]
    if len(sets) != int(np.sum(modes == _MEMBER)):
        raise node.error(f"{int(np.sum(modes == _MEMBER))} BRANCH_MEMBER nodes but "
                         f"{len(sets)} NaN-terminated sets in membership_values")
    width = max((len(s) for s in sets), default=0)
    table = np.full((len(modes), width), np.nan)
    for row, values in zip(np.flatnonzero(modes == _MEMBER), sets):
        table[row, :len(values)] = values
    return table


def _forest_v5(node: Any) -> _Forest:
    """A _Forest from TreeEnsemble-5 attributes (separate nodes_* and leaf_* tuples)."""
    modes = np.asarray(node.attr("nodes_modes"), np.int8).reshape(-1)
    nodes = modes.size
    if modes.size and (modes.min() < 0 or modes.max() > _MEMBER):
        raise node.error(f"nodes_modes must be in 0..6, got {sorted(set(modes.tolist()))}")
    targets = node.attr("n_targets")
    leaf_targets_ids = node.attr("leaf_targetids")
    leaf_weights = np.asarray(node.attr("leaf_weights"), np.float64).reshape(-1)
    leaf_values = np.zeros((leaf_weights.size, targets))
    leaf_targets = np.zeros((leaf_weights.size, targets), bool)
    leaf_values[np.arange(leaf_weights.size), leaf_targets_ids] = leaf_weights
    leaf_targets[np.arange(leaf_weights.size), leaf_targets_ids] = True

    def next_states(ids: str, is_leaf: str) -> np.ndarray:
        leaf = np.asarray(node.attr(is_leaf), np.int64)
        return np.asarray(node.attr(ids), np.int64) + nodes * leaf

    missing = node.attr("nodes_missing_value_tracks_true", None) or [0] * nodes
    return _Forest(
        feature=np.asarray(node.attr("nodes_featureids"), np.int64),
        threshold=np.asarray(node.attr("nodes_splits"), np.float64).reshape(-1),
        mode=modes, missing_true=np.asarray(missing, bool),
        members=_membership_sets(node, modes),
        true_next=next_states("nodes_truenodeids", "nodes_trueleafs"),
        false_next=next_states("nodes_falsenodeids", "nodes_falseleafs"),
        roots=np.asarray(node.attr("tree_roots"), np.int64),
        leaf_values=leaf_values, leaf_targets=leaf_targets)


def _base_values(node: Any, outputs: int) -> np.ndarray:
    base = _node_tensor(node, "base_values")
    if base is None or base.size == 0:
        return np.zeros(outputs)
    if base.size != outputs:
        raise node.error(f"base_values has {base.size} values for {outputs} outputs")
    return base


@op("TreeEnsemble", since=5, domain=ML_DOMAIN)
def tree_ensemble(node: Any, x: Any) -> jax.Array:
    """[N, n_targets] in x's dtype: each tree's leaf weight added to its target, aggregated
    over trees (AVERAGE, SUM, MIN, MAX), then post_transform."""
    forest = _forest_v5(node)
    rows = jnp.asarray(x)
    compute = jnp.promote_types(rows.dtype, jnp.float32)
    how = _AGGREGATES[node.attr("aggregate_function", 1)]
    scores = _aggregate(forest, _leaves(node, forest, rows), how, compute)
    post = _POST_TRANSFORMS[node.attr("post_transform", 0)]
    return _post_transform(node, scores, post).astype(rows.dtype)


@op("TreeEnsembleRegressor", since=1, domain=ML_DOMAIN)
def tree_ensemble_regressor(node: Any, x: Any) -> jax.Array:
    """[N, n_targets] float: target weights of the leaves reached, aggregated over trees,
    plus base_values, then post_transform."""
    targets = node.attr("n_targets", 1)
    forest = _legacy_forest(node, "target", targets)
    rows = _batch(_features(x))
    how = node.attr("aggregate_function", "SUM")
    if how not in _AGGREGATES:
        raise node.error(f"aggregate_function must be one of {', '.join(_AGGREGATES)}, got {how!r}")
    scores = _aggregate(forest, _leaves(node, forest, rows), how, rows.dtype)
    scores = scores + _base_values(node, targets)
    return _post_transform(node, scores, node.attr("post_transform", "NONE")).astype(jnp.float32)


@op("TreeEnsembleClassifier", since=1, domain=ML_DOMAIN, differentiable=False)
def tree_ensemble_classifier(node: Any, x: Any) -> tuple[Any, jax.Array]:
    """Class scores: base_values plus the class weights of the leaves reached, summed over
    trees, then post_transform; the label of the best score. Weights for a single class
    id make a binary model whose scores are [1 - s, s] (NONE, PROBIT) or [-s, s]."""
    labels = _class_labels(node)
    class_ids = sorted(set(node.attr("class_ids")))
    forest = _legacy_forest(node, "class", max(len(labels), class_ids[-1] + 1 if class_ids else 1))
    rows = _batch(_features(x))
    scores = _aggregate(forest, _leaves(node, forest, rows), "SUM", rows.dtype)
    scores = scores[:, :max(len(labels), 1)] + _base_values(node, max(len(labels), 1))
    post = node.attr("post_transform", "NONE")
    if len(class_ids) == 1 and len(labels) <= 2:
        score = scores[:, class_ids[0]:class_ids[0] + 1]
        other = 1 - score if post in ("NONE", "PROBIT") else -score
        scores = jnp.concatenate([other, score], axis=1)
        labels = labels if len(labels) == 2 else [0, *labels]
    scores = _post_transform(node, scores, post).astype(jnp.float32)
    return _labels_at(node, labels, jnp.argmax(scores, axis=1)), scores
