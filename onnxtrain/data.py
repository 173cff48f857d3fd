"""Data for fit: what users pass, turned into the re-iterable batches of feed dicts the loop runs.

`fit` (of a Trainer or a FineTuner) takes its data in any of these forms:

- **Batches you made**: a list (or any re-iterable collection) of batches, or a function
  returning a fresh iterable of them each epoch. A batch is a dict input name -> array, or a
  tuple/list of arrays in the order of `trainer.step_inputs()` (the data inputs, then the
  labels), or `(inputs, labels)` with `inputs` a tuple of the data inputs or a dict naming
  them. A torch `DataLoader` of `(x, y)` samples yields such lists, one of dict samples dicts.
- **Whole arrays**, Keras style: a dict input name -> array, or a tuple `(x, y)` of arrays
  (also `((x1, x2), y)` or `({"x1": x1, "x2": x2}, y)`), all with the same number of rows.
  They are cut into batches of `batch_size` rows (default 32), in a new seeded order each
  epoch when `shuffle=True`; `validation_split=f` holds out the last fraction `f` of the rows
  (taken before shuffling, as Keras does) as the evaluation data.

- **Examples of different lengths** (tokenized text): `padded_batches(examples, batch_size,
  multiple_of=16)` pads each batch to a few lengths, so a few programs compile instead of one
  per length (`Padding` does the same as a DataLoader's collate_fn).

Arrays may be numpy or jax arrays, torch tensors (CPU, requires_grad too), pandas columns or
Python lists; they follow the feed rules of onnxtrain._engine.feeds (an array with a dtype of
its own must carry the declared one; Python numbers convert to it). Whole arrays are converted
once, before the first step, so a wrong dataset fails before training starts.

Example:
    >>> history = trainer.fit((x, y), batch_size=64, shuffle=True, validation_split=0.2, epochs=5)
    >>> loader = torch.utils.data.DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    >>> history = trainer.fit(loader, epochs=5, eval_data=(x_val, y_val))
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from onnxtrain._engine.feeds import host_array
from onnxtrain.errors import InputError
from onnxtrain._padding import Padding

Feeds = Mapping[str, Any]
# Anything fit accepts as its data (see the module docstring).
Data = Any
Seed = int | Sequence[int]

DEFAULT_BATCH_SIZE = 32
_NOTHING = object()


def _is_array(value: Any) -> bool:
    """Whether `value` is an array object with a row axis (numpy, jax, torch, pandas...)."""
    shape = getattr(value, "shape", None)
    return isinstance(shape, tuple) and len(shape) >= 1 and not isinstance(value, (str, bytes))


def _array_group(value: Any) -> bool:
    """Whether `value` is a tuple/list or dict of arrays (the inputs part of (inputs, labels))."""
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else None
    return items is not None and len(items) > 0 and all(_is_array(item) for item in items)


def is_whole_arrays(data: Any) -> bool:
    """Whether `data` is whole arrays rather than batches: a dict of arrays, a tuple/list of
    arrays and Python lists (at least one an array), or (inputs, labels) with inputs a tuple or
    dict of arrays.

    Example:
        >>> is_whole_arrays((np.zeros((8, 3)), np.zeros(8))), is_whole_arrays([{"x": np.zeros((8, 3))}])
        (True, False)
    """
    if isinstance(data, Mapping):
        return True
    if not isinstance(data, (tuple, list)) or not data:
        return False
    # A Python list among arrays is one input's values (labels as a list), not a batch.
    if (len(data) == 2 and isinstance(data[0], (tuple, Mapping)) and _array_group(data[0])
            and (_is_array(data[1]) or isinstance(data[1], list))):
        return True        # (inputs, labels) with inputs a tuple or dict of arrays; not two batches
    return any(_is_array(item) for item in data) and all(_is_array(item) or isinstance(item, list) for item in data)


def _flattenable(inputs: Any) -> bool:
    """Whether the first item of a pair is a group of data inputs, not one input's Python values."""
    return isinstance(inputs, (tuple, list)) and all(_is_array(item) for item in inputs)


def by_position(values: Any, inputs: Sequence[str], what: str) -> dict[str, Any]:
    """`values` (a dict, a tuple/list in the order of `inputs`, or (data inputs, labels)) as a
    feed dict.

    Args:
        values: a dict input name -> value (returned as a dict), a tuple/list with one value per
            input, or a pair `(inputs, labels)` whose first item is a tuple/list of the data
            inputs or a dict naming all inputs but the labels'.
        inputs: the step's input names, in order (`trainer.step_inputs()`).
        what: how the error names `values` (e.g. "batches: batch 3").

    Returns:
        The feed dict.

    Raises:
        InputError: `values` is of another type, or holds another number of values.

    Example:
        >>> by_position((x, y), ["x", "labels"], "batch")
        {'x': x, 'labels': y}
    """
    if isinstance(values, Mapping):
        return dict(values)
    if not isinstance(values, (tuple, list)):
        raise InputError(
            f"{what} is a {type(values).__name__}; a batch is a dict input name -> array, or a tuple of "
            f"arrays in the order of the step's inputs {list(inputs)}. To pass whole arrays, pass "
            "fit((x, y)) or fit({name: array}) with batch_size=")
    if len(values) == 2 and isinstance(values[0], Mapping):
        named, labels = values
        rest = [name for name in inputs if name not in named]
        if len(rest) != 1 or any(name not in inputs for name in named):
            raise InputError(
                f"{what} is (inputs, labels) with inputs a dict of {sorted(map(str, named))}; the step takes "
                f"{list(inputs)}, so that dict must name every input but one, the labels'")
        return {**named, rest[0]: labels}
    flat = list(values)
    if len(values) == 2 and len(values[0]) + 1 == len(inputs) and _flattenable(values[0]):
        flat = [*values[0], values[1]]
    if len(flat) != len(inputs):
        raise InputError(
            f"{what} is a {type(values).__name__} of {len(flat)} values, but the step takes {len(inputs)} "
            f"inputs {list(inputs)}; pass one value per input in that order, (inputs, labels), or a dict")
    return dict(zip(inputs, flat))


def _rows(arrays: Mapping[str, Any], argument: str) -> int:
    """The number of rows every array has (axis 0)."""
    rows = {}
    for name, value in arrays.items():
        shape = np.shape(value) if not hasattr(value, "shape") else tuple(value.shape)
        if not shape:
            raise InputError(f"{argument}: input {name!r} is a scalar, but whole arrays need a row axis "
                             "(axis 0) to cut into batches; pass batches of feed dicts instead")
        rows[name] = shape[0]
    if len(set(rows.values())) > 1:
        raise InputError(f"{argument}: the arrays have different numbers of rows ({rows}); every input "
                         "needs one row per sample")
    count = next(iter(rows.values()), 0)
    if count == 0:
        raise InputError(f"{argument} has no rows; pass at least one sample")
    return count


def _check_seed(seed: Seed) -> list[int]:
    entropy = [seed] if isinstance(seed, numbers.Integral) else list(seed) if isinstance(seed, Sequence) else None
    if entropy is None or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0
                                  for v in entropy):
        raise InputError(f"seed must be a non-negative int (or a sequence of them), got {seed!r}")
    return [int(v) for v in entropy]


def _check_batch_size(batch_size: Any) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise InputError(f"batch_size must be a positive int, got {batch_size!r}")
    return int(batch_size)


class ArrayBatches:
    """Whole arrays cut into batches of `batch_size` rows, re-iterable: one epoch per iteration.

    Every epoch covers each row once. With shuffle, each iteration draws a new order from
    (seed, epoch number), so two runs with the same seed see the same orders. The last batch
    holds the rows left over when `batch_size` does not divide the rows: one more batch shape,
    so one more compiled program (fit(drop_last=True) skips it instead).

    Args:
        arrays: input name -> array, all with the same number of rows (axis 0).
        batch_size: rows per batch.
        shuffle: a new random order of the rows each epoch.
        seed: the shuffle's seed (an int or a sequence of ints).
        convert: reads each value as an array that takes numpy indices (default: host_array,
            keeping each value's dtype; fit converts to the declared dtypes instead).
        argument: how errors name `arrays`.

    Raises:
        InputError: a value is not an array, a scalar, or the arrays' row counts differ.

    Example:
        >>> batches = ArrayBatches({"x": x, "labels": y}, batch_size=64, shuffle=True, seed=0)
        >>> trainer.fit(batches, epochs=3)
    """

    def __init__(self, arrays: Mapping[str, Any], batch_size: int = DEFAULT_BATCH_SIZE, shuffle: bool = False,
                 seed: Seed = 0, convert: Callable[[str, Any], Any] = host_array, argument: str = "data"):
        self.batch_size = _check_batch_size(batch_size)
        self.shuffle = bool(shuffle)
        self._entropy = _check_seed(seed)
        self._arrays = {str(name): convert(str(name), value) for name, value in arrays.items()}
        self.rows = _rows(self._arrays, argument)
        self._epoch = 0

    def __len__(self) -> int:
        return -(-self.rows // self.batch_size)

    def short_last(self) -> tuple[int, int] | None:
        """(batch size, rows of each epoch's last batch) when that batch is short; None when
        batch_size divides the rows."""
        left = self.rows % self.batch_size
        return (self.batch_size, left) if left else None

    def order(self, epoch: int) -> np.ndarray | None:
        """The row order of epoch `epoch` (counted from 0), or None when not shuffled."""
        if not self.shuffle:
            return None
        return np.random.default_rng([*self._entropy, epoch]).permutation(self.rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        order = self.order(self._epoch)
        self._epoch += 1
        for start in range(0, self.rows, self.batch_size):
            # Slices of the arrays in order (views), else the shuffled rows (copies).
            rows = slice(start, start + self.batch_size) if order is None else order[start:start + self.batch_size]
            yield {name: value[rows] for name, value in self._arrays.items()}


class FeedBatches:
    """Batches a user made, as feed dicts: each batch mapped by `by_position`, re-iterable when
    the source is (a collection, or a function returning a fresh iterable each epoch).

    Args:
        source: an iterable of batches, or a function returning one.
        inputs: the step's input names, in order.
        argument: how errors name the source ("batches", "eval_data").

    Raises:
        InputError (while iterating): a batch of another form, or an epoch without batches.
    """

    def __init__(self, source: Iterable[Any] | Callable[[], Iterable[Any]], inputs: Sequence[str],
                 argument: str = "batches"):
        self._source = source
        self._inputs = list(inputs)
        self.argument = argument
        self._epoch = 0

    def _fresh(self) -> Iterable[Any]:
        source = self._source() if callable(self._source) else self._source
        if isinstance(source, (str, bytes, Mapping)) or not isinstance(source, Iterable):
            raise InputError(f"{self.argument}() returned a {type(source).__name__}; it must return a fresh "
                             "iterable of batches each epoch")
        return source

    def _empty(self, epoch: int) -> InputError:
        return InputError(f"{self.argument} yielded no batch in epoch {epoch}; pass at least one batch (a "
                          "function passed as data must return a fresh iterable each epoch)")

    def first(self) -> dict[str, Any]:
        """The first batch as a feed dict, for checking before training; a one-shot source
        gets it back in front, so its epoch still starts with it.

        Raises:
            InputError: the source has no batch, or the batch is of another form.
        """
        source = self._fresh()
        iterator = iter(source)
        batch = next(iterator, _NOTHING)
        if batch is _NOTHING:
            raise self._empty(self._epoch + 1)
        if iterator is source:
            self._source = itertools.chain([batch], iterator)
        return by_position(batch, self._inputs, f"{self.argument}: batch 0")

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._epoch += 1
        count = 0
        for count, batch in enumerate(self._fresh(), 1):
            yield by_position(batch, self._inputs, f"{self.argument}: batch {count - 1}")
        if count == 0:
            raise self._empty(self._epoch)


class SizedFeedBatches(FeedBatches):
    """FeedBatches of a source that knows its length (a list, a DataLoader): fit shows it."""

    def __len__(self) -> int:
        return len(self._source)  # type: ignore[arg-type]

    def short_last(self) -> tuple[int, int] | None:
        """(batch size, rows of each epoch's last batch) when a torch DataLoader's settings say
        that batch is short (batch_size rows from a sampler with a length, drop_last off); None
        otherwise, or when the source does not say."""
        loader = self._source
        size = getattr(loader, "batch_size", None)
        if not isinstance(size, int) or size < 1 or getattr(loader, "drop_last", None) is not False:
            return None
        try:
            rows = len(loader.sampler)  # type: ignore[attr-defined]
            if len(loader) != -(-rows // size):  # type: ignore[arg-type]
                return None  # a loader that batches otherwise
        except (AttributeError, TypeError):
            return None
        return (size, rows % size) if rows % size else None


class PaddedBatches:
    """Examples of different lengths (dicts of 1-D token sequences) cut into batches as
    ArrayBatches cuts rows (a new seeded order each epoch when shuffled), each batch padded
    by `padding`. Re-iterable, one epoch per iteration; fit() takes it as its data.

    Example:
        >>> trainer.fit(PaddedBatches(examples, 8, Padding(multiple_of=16), shuffle=True), epochs=2)
    """

    def __init__(self, examples: Sequence[Mapping[str, Any]], batch_size: int, padding: Padding,
                 shuffle: bool = False, seed: Seed = 0, drop_last: bool = False):
        self.examples, self.padding, self.drop_last = list(examples), padding, bool(drop_last)
        if not self.examples:
            raise InputError("padded_batches got no examples; pass at least one")
        self._rows = ArrayBatches({"example": np.arange(len(self.examples))}, batch_size, shuffle, seed,
                                  argument="examples")

    def __len__(self) -> int:
        return len(self._rows) - (self.drop_last and self._rows.short_last() is not None)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for batch in self._rows:
            rows = batch["example"]
            if self.drop_last and len(rows) < self._rows.batch_size:
                return
            yield self.padding([self.examples[i] for i in rows])


def padded_batches(examples: Sequence[Mapping[str, Any]], batch_size: int, *, multiple_of: int | None = None,
                   buckets: Sequence[int] | None = None, labels_from: str | None = None, shuffle: bool = False,
                   seed: Seed = 0, drop_last: bool = False, **options: Any) -> PaddedBatches:
    """Variable-length examples as batches of a few shapes, for fit: each batch padded to its
    longest example's length rounded up to `multiple_of`, or to the smallest of `buckets` that
    holds it, so the batches compile a few programs instead of one per length (Padding).

    Args:
        examples: dicts input name -> 1-D token sequence (or a scalar, stacked as is).
        batch_size: examples per batch.
        multiple_of: pad lengths up to a multiple of this.
        buckets: pad lengths up to the smallest of these.
        labels_from: write `labels` as a copy of this input (-100 on padding): a causal LM.
        shuffle: a new order each epoch, seeded by (seed, epoch).
        seed: the shuffle's seed (an int or a sequence of ints).
        drop_last: leave out a last batch of fewer than batch_size examples.
        options: Padding's other settings (pad_id, label_pad, masks, labels).

    Returns:
        A re-iterable of padded batches (dicts input name -> array), with a length.

    Raises:
        InputError: see Padding; no examples, a batch_size or seed of another kind.

    Example:
        >>> batches = padded_batches([{"input_ids": ids} for ids in tokenized], 8, multiple_of=16,
        ...                          labels_from="input_ids", shuffle=True)
        >>> trainer.fit(batches, epochs=3)
    """
    padding = Padding(multiple_of, buckets, labels_from=labels_from, **options)
    return PaddedBatches(examples, batch_size, padding, shuffle=shuffle, seed=seed, drop_last=drop_last)


def short_last(batches: Any) -> tuple[int, int] | None:
    """(batch size, rows of the short batch that ends each epoch) when `batches` knows it ahead
    (ArrayBatches, or a torch DataLoader's SizedFeedBatches); None otherwise."""
    return batches.short_last() if isinstance(batches, (ArrayBatches, SizedFeedBatches)) else None


def short_probe(batches: Any, first: Mapping[str, Any]) -> tuple[int, dict[str, Any]] | None:
    """(rows, `first` cut to them) for the short batch that ends each epoch of `batches`, so a
    check can meet that batch's shape before training; `first` is the epoch's first batch.

    None when no short last batch is known (see ArrayBatches.short_last and
    SizedFeedBatches.short_last), or when a value of `first` does not have the batch size on
    axis 0, so cutting it would not show what the last batch holds. Scalars stay as they are.
    """
    short = short_last(batches)
    if short is None:
        return None
    size, rows = short
    probe = {}
    for name, value in first.items():
        try:
            shape = np.shape(value)
        except ValueError:  # a ragged nested list
            return None
        if shape and shape[0] != size:
            return None
        probe[name] = value[:rows] if shape else value
    return rows, probe


class FitData(NamedTuple):
    """What fit runs: the training batches, the evaluation batches (or None), and evaluation
    batches of each shape known ahead (the first, the short last one), for compiling early."""

    train: Iterable[dict[str, Any]]
    eval: Iterable[dict[str, Any]] | None
    eval_shapes: tuple[dict[str, Any], ...] = ()


def _length(source: Any) -> int | None:
    """len(source), or None when it has none (a generator; a DataLoader of an IterableDataset
    defines __len__ but raises TypeError)."""
    if callable(source):
        return None
    try:
        return len(source)
    except TypeError:
        return None


def _refuse_non_data(data: Any, argument: str) -> None:
    if data is None:
        raise InputError(f"{argument} is None; pass batches (a list of feed dicts, a DataLoader) or whole "
                         "arrays ((x, y) or {name: array})")
    if isinstance(data, (str, bytes)):
        raise InputError(f"{argument} is a {type(data).__name__} ({str(data)[:40]!r}); pass the data itself, "
                         "not a path: load it first (e.g. numpy.load) and pass the arrays")
    if _is_array(data) or not (callable(data) or isinstance(data, Iterable)):
        raise InputError(f"{argument} is a single {type(data).__name__}; pass (inputs, labels), a dict input "
                         "name -> array, or batches of feed dicts")


def _whole(data: Any, inputs: Sequence[str], argument: str) -> dict[str, Any]:
    """Whole arrays as a dict input name -> array, checking the names."""
    arrays = dict(data) if isinstance(data, Mapping) else by_position(data, inputs, argument)
    missing = [name for name in inputs if name not in arrays]
    unknown = sorted(str(name) for name in arrays if name not in inputs)
    if missing or unknown:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])
        raise InputError(f"{argument}: the step takes inputs {list(inputs)}; {'; '.join(parts)}")
    return arrays


def _batches_of(data: Any, inputs: Sequence[str], argument: str, epochs: int) -> FeedBatches:
    _refuse_non_data(data, argument)
    if epochs > 1 and isinstance(data, Iterator):
        raise InputError(f"fit(epochs>1) needs {argument} it can iterate again: a list, a re-iterable "
                         "dataset (a DataLoader), or a function returning a new iterator each epoch")
    length = _length(data)
    if length == 0:
        raise InputError(f"{argument} is empty; pass at least one batch")
    return FeedBatches(data, inputs, argument) if length is None else SizedFeedBatches(data, inputs, argument)


def _check_split(validation_split: Any) -> float:
    if (isinstance(validation_split, bool) or not isinstance(validation_split, numbers.Real)
            or not 0 < validation_split < 1):
        raise InputError(f"validation_split must be a fraction between 0 and 1 (exclusive), got "
                         f"{validation_split!r}")
    return float(validation_split)


def _split_tail(arrays: dict[str, Any], fraction: float, rows: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(head, tail) of the rows, the tail holding `fraction` of them (Keras's rounding)."""
    cut = int(np.floor(rows * (1 - fraction)))
    if cut == 0 or cut == rows:
        raise InputError(f"validation_split={fraction} of {rows} rows leaves "
                         f"{'no training' if cut == 0 else 'no validation'} rows; pass more data or "
                         "another fraction")
    return ({name: value[:cut] for name, value in arrays.items()},
            {name: value[cut:] for name, value in arrays.items()})


def fit_data(data: Data, inputs: Sequence[str], *, eval_data: Data | None = None, epochs: int = 1,
             batch_size: int | None = None, shuffle: bool = False, validation_split: float | None = None,
             seed: Seed = 0, convert: Callable[[str, Any], Any] = host_array,
             check: Callable[[Feeds], Any] | None = None) -> FitData:
    """The training and evaluation batches of fit's arguments (see the module docstring).

    Args:
        data: batches (a collection of feed dicts or tuples, a DataLoader, a function returning
            a fresh iterable) or whole arrays (a dict name -> array, a tuple (x, y)).
        inputs: the step's input names, in order (`trainer.step_inputs()`).
        eval_data: evaluation data in any of the same forms (whole arrays are cut into batches
            of batch_size rows, never shuffled).
        epochs: how many epochs fit runs (a positive int).
        batch_size: rows per batch of whole arrays (default 32); batches you made keep theirs.
        shuffle: shuffle whole arrays' rows, in a new order each epoch.
        validation_split: hold out this last fraction of whole arrays' rows as eval_data.
        seed: the shuffle's seed.
        convert: convert(name, value) converts a whole array once (fit: to the declared dtype).
        check: check(feeds) validates a batch (fit: the step's feed check); it runs on the
            first evaluation batch here, so a wrong eval_data fails before training starts.

    Returns:
        FitData(train, eval, eval_shapes): re-iterable batches of feed dicts (eval None without
        eval data), and the evaluation batches of each shape known ahead.

    Raises:
        InputError: what the data or an option is wrong about, naming the argument: no data or
            an empty dataset, a string or a single array, epochs < 1, a batch or tuple whose
            length does not match the inputs, arrays with different numbers of rows,
            batch_size/shuffle/validation_split with batches already made, validation_split
            together with eval_data, a one-shot iterator with epochs > 1.

    Example:
        >>> train, val = fit_data((x, y), ["x", "labels"], batch_size=16, validation_split=0.25)
    """
    if isinstance(epochs, bool) or not isinstance(epochs, numbers.Integral) or epochs < 1:
        raise InputError(f"epochs must be a positive int, got {epochs!r}")
    if batch_size is not None:
        batch_size = _check_batch_size(batch_size)
    split = None if validation_split is None else _check_split(validation_split)
    inputs = list(inputs)
    eval_batches = None
    if is_whole_arrays(data):
        arrays = {name: convert(name, value) for name, value in _whole(data, inputs, "batches").items()}
        size = batch_size or DEFAULT_BATCH_SIZE
        if split is not None:
            if eval_data is not None:
                raise InputError("pass either validation_split or eval_data, not both: validation_split holds "
                                 "out the tail of the training arrays as the evaluation data")
            train, held_out = _split_tail(arrays, split, _rows(arrays, "batches"))
            eval_batches = ArrayBatches(held_out, size, False, 0, lambda name, value: value, "validation_split")
            arrays = train
        train_batches: Iterable[dict[str, Any]] = ArrayBatches(arrays, size, shuffle, seed,
                                                               lambda name, value: value, "batches")
    else:
        made = "batches you made keep their size and order"
        # batch_size may be meant for whole evaluation arrays only.
        sized = None if eval_data is not None and is_whole_arrays(eval_data) else batch_size
        for name, value in (("batch_size", sized), ("shuffle", shuffle or None), ("validation_split", split)):
            if value is not None:
                raise InputError(f"{name}= applies to whole arrays (fit((x, y)) or fit({{name: array}})); "
                                 f"{made}: batch them and shuffle them yourself (e.g. DataLoader(shuffle=True)) "
                                 "and pass eval_data= for validation")
        train_batches = _batches_of(data, inputs, "batches", epochs)
    if eval_data is not None:
        if is_whole_arrays(eval_data):
            arrays = {name: convert(name, value) for name, value in _whole(eval_data, inputs, "eval_data").items()}
            eval_batches = ArrayBatches(arrays, batch_size or DEFAULT_BATCH_SIZE, False, 0,
                                        lambda name, value: value, "eval_data")
        else:
            eval_batches = _batches_of(eval_data, inputs, "eval_data", epochs)
    shapes: tuple[dict[str, Any], ...] = ()
    if eval_batches is not None and check is not None:
        # The first evaluation batch is checked now, not after an epoch of training, and so is
        # the shape of a short last one.
        first = eval_batches.first() if isinstance(eval_batches, FeedBatches) else next(iter(eval_batches))
        check(first)
        shapes = (first,)
        probe = short_probe(eval_batches, first)
        if probe is not None:
            try:
                check(probe[1])
            except InputError as error:
                raise InputError(f"eval_data ends in a batch of {probe[0]} rows, which the model refuses "
                                 f"(found before training): {error}. Evaluation keeps every row, so for "
                                 "eval_data pass a number of rows the batch size divides") from None
            shapes += (probe[1],)
    return FitData(train_batches, eval_batches, shapes)
