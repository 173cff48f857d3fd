"""String ops: StringConcat, StringSplit, StringNormalizer, RegexFullMatch, TfIdfVectorizer.

Strings exist only on the host (numpy object arrays of str), so these handlers
need host constants; given traced values they raise NeedsHostValues and the
model runs op by op. TfIdfVectorizer on integer tokens follows the same path.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from onnxtrain.translate.registry import op
from onnxtrain.translate.values import NeedsHostValues


def _host_strings(node: Any, *values: Any) -> list[np.ndarray]:
    """The inputs as numpy object arrays of str; NeedsHostValues if one is traced."""
    if not node.host:
        raise NeedsHostValues(node.label, "works on strings, which exist only on the host")
    arrays = []
    for value in values:
        array = np.asarray(value)
        if array.dtype.kind not in "OUS":
            raise node.error(f"expects a string tensor, got {array.dtype}")
        arrays.append(_string_array([_text(v) for v in array.reshape(-1)], array.shape))
    return arrays


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _string_array(items: Sequence[str], shape: tuple[int, ...]) -> np.ndarray:
    array = np.empty(len(items), dtype=object)
    array[:] = list(items)
    return array.reshape(shape)


@op("StringConcat", since=20, differentiable=False)
def string_concat(node: Any, x: Any, y: Any) -> np.ndarray:
    """Element-wise x + y of two string tensors, with numpy broadcasting."""
    x, y = _host_strings(node, x, y)
    return np.add(x, y, dtype=object)


@op("StringSplit", since=20, differentiable=False)
def string_split(node: Any, x: Any) -> tuple[np.ndarray, np.ndarray]:
    """Y: the substrings of each element (padded with "" to a common count) in an
    extra last dimension; Z: how many substrings each element has. An unset or
    empty delimiter splits on runs of whitespace and drops leading/trailing ones."""
    (x,) = _host_strings(node, x)
    delimiter = node.attr("delimiter", "") or None
    maxsplit = node.attr("maxsplit", -1)
    parts = [text.split(delimiter, maxsplit) for text in x.reshape(-1)]
    counts = np.array([len(p) for p in parts], dtype=np.int64).reshape(x.shape)
    width = max((len(p) for p in parts), default=0)
    padded = [item for p in parts for item in p + [""] * (width - len(p))]
    return _string_array(padded, (*x.shape, width)), counts


@op("StringNormalizer", since=10, differentiable=False)
def string_normalizer(node: Any, x: Any) -> np.ndarray:
    """Drops the elements of a [C] or [1, C] tensor that are stopwords (case-insensitively
    unless is_case_sensitive), then applies case_change_action LOWER/UPPER/NONE.
    If nothing is left the output is [""] (or [[""]])."""
    (x,) = _host_strings(node, x)
    if not (x.ndim == 1 or (x.ndim == 2 and x.shape[0] == 1)):
        raise node.error(f"input must have shape [C] or [1, C], got {x.shape}")
    kept = [text for text in x.reshape(-1) if not _is_stopword(node, text)]
    changed = [_change_case(node, text) for text in kept] or [""]
    return _string_array(changed, (len(changed),) if x.ndim == 1 else (1, len(changed)))


def _is_stopword(node: Any, text: str) -> bool:
    stopwords = node.attr("stopwords", [])
    if node.attr("is_case_sensitive", 0):
        return text in stopwords
    return text.lower() in {word.lower() for word in stopwords}


def _change_case(node: Any, text: str) -> str:
    action = node.attr("case_change_action", "NONE")
    if action == "LOWER":
        return text.lower()
    if action == "UPPER":
        return text.upper()
    if action == "NONE":
        return text
    raise node.error(f"case_change_action must be LOWER, UPPER or NONE, got {action!r}")


@op("RegexFullMatch", since=20, differentiable=False)
def regex_full_match(node: Any, x: Any) -> np.ndarray:
    """True where the whole element matches `pattern` (RE2 syntax, run with Python's re,
    which accepts every RE2 construct ONNX models use)."""
    (x,) = _host_strings(node, x)
    source = node.attr("pattern")
    try:
        pattern = re.compile(source)
    except re.error as error:
        raise node.error(f"pattern {source!r} is not a valid regex: {error}") from None
    matches = [pattern.fullmatch(text) is not None for text in x.reshape(-1)]
    return np.array(matches, dtype=np.bool_).reshape(x.shape)


# --- TfIdfVectorizer -----------------------------------------------------------------


def _pool(node: Any) -> dict[tuple, int]:
    """n-gram (a tuple of tokens) -> output column, for the lengths in [min, max]."""
    strings, ints = node.attr("pool_strings", None), node.attr("pool_int64s", None)
    if (strings is None) == (ints is None):
        raise node.error("exactly one of pool_strings and pool_int64s must be set")
    pool = list(strings if strings is not None else ints)
    starts = list(node.attr("ngram_counts")) + [len(pool)]
    indexes = node.attr("ngram_indexes")
    lowest, highest = node.attr("min_gram_length"), node.attr("max_gram_length")
    columns, ngram = {}, 0
    for n, (start, end) in enumerate(zip(starts, starts[1:]), start=1):
        for first in range(start, end, n):
            if lowest <= n <= highest:
                columns[tuple(pool[first:first + n])] = indexes[ngram]
            ngram += 1
    if ngram != len(indexes):
        raise node.error(f"the pool holds {ngram} n-grams but ngram_indexes has {len(indexes)}")
    return columns


def _ngrams(row: Sequence[Any], lowest: int, highest: int, max_skip: int) -> Iterator[tuple]:
    """Every n-gram of the row, n in [lowest, highest], tokens (skip + 1) apart for each
    skip up to max_skip; 1-grams once, since skipping does not change them."""
    for n in range(lowest, highest + 1):
        for skip in range(max_skip + 1 if n > 1 else 1):
            span = (n - 1) * (skip + 1)
            for start in range(len(row) - span):
                yield tuple(row[start:start + span + 1:skip + 1])


def _weigh(node: Any, counts: np.ndarray) -> np.ndarray:
    """TF: counts; IDF: weight where counted; TFIDF: weight * count (weights by column)."""
    mode = node.attr("mode")
    weights = np.asarray(node.attr("weights", []) or np.ones(counts.shape[-1]), np.float32)
    if weights.shape[0] != counts.shape[-1]:
        raise node.error(f"weights has {weights.shape[0]} values for {counts.shape[-1]} columns")
    if mode == "TF":
        return counts.astype(np.float32)
    if mode == "IDF":
        return np.where(counts > 0, weights, 0).astype(np.float32)
    if mode == "TFIDF":
        return (counts * weights).astype(np.float32)
    raise node.error(f"mode must be TF, IDF or TFIDF, got {mode!r}")


@op("TfIdfVectorizer", since=9, differentiable=False)
def tfidf_vectorizer(node: Any, x: Any) -> np.ndarray:
    """Counts of the pool's n-grams (with up to max_skip_count skipped tokens between
    items) in each row of a [C] or [N, C] token tensor, weighted per `mode`."""
    if not node.host:
        raise NeedsHostValues(node.label, "counts n-grams, which needs the tokens on the host")
    tokens = np.asarray(x)
    if tokens.ndim not in (1, 2):
        raise node.error(f"input must have shape [C] or [N, C], got {tokens.shape}")
    if tokens.dtype.kind in "OUS":
        tokens = _host_strings(node, tokens)[0]
    columns = _pool(node)
    lowest, highest = node.attr("min_gram_length"), node.attr("max_gram_length")
    max_skip = node.attr("max_skip_count")
    rows = tokens.reshape(-1, tokens.shape[-1]).tolist()
    counts = np.zeros((len(rows), max(node.attr("ngram_indexes")) + 1), np.int64)
    for counted, row in zip(counts, rows):
        for ngram in _ngrams(row, lowest, highest, max_skip):
            if ngram in columns:
                counted[columns[ngram]] += 1
    weighted = _weigh(node, counts)
    return weighted[0] if tokens.ndim == 1 else weighted
