"""Text batches of a few shapes: variable-length examples padded to a multiple of a length or
to the next of a few bucket lengths, as Hugging Face's collators pad them (onnxtrain.data's
Padding; onnxtrain.data.padded_batches cuts examples into batches with it).

Every new feed shape compiles a new program, which takes seconds where a step takes
milliseconds: text of every length compiles a program per length, text padded to a few
lengths a few programs (bench/RESULTS.md, "Text batches: padding and compiled programs").
Padding is exact for training: labels are -100 on padding (the loss skips them, as
`ignore_index` does), attention masks 0, and right padding never reaches a causal model's
earlier positions.

Example:
    >>> examples = [{"input_ids": ids} for ids in tokenized]          # lists of token ids
    >>> batches = onnxtrain.data.padded_batches(examples, 8, multiple_of=16, labels_from="input_ids",
    ...                                         shuffle=True)
    >>> trainer.fit(batches, epochs=3)
    >>> loader = DataLoader(examples, batch_size=8, collate_fn=onnxtrain.data.Padding(multiple_of=16))
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onnxtrain.errors import InputError

# Hugging Face's marker for a label the loss skips (torch's cross_entropy ignore_index default).
LABEL_PAD = -100


class Padding:
    """Collates examples (dicts of 1-D token sequences and scalars) into one batch whose
    sequences share a length: the longest example's, rounded up to `multiple_of` or to the
    smallest bucket that holds it. Usable as a torch DataLoader's collate_fn.

    Args:
        multiple_of: pad the length up to a multiple of this (HF's pad_to_multiple_of).
        buckets: pad the length up to the smallest of these lengths that holds it.
        pad_id: the value padding takes in token inputs.
        label_pad: the value padding takes in `labels` inputs (-100: the loss skips it).
        masks: the inputs that are attention masks: 0 on padding.
        labels: the inputs that are labels.
        labels_from: also write labels[0] as a copy of this input (a causal LM's labels are
            its input ids), -100 on padding.

    Raises:
        InputError: both or neither of multiple_of and buckets, a length that is not a
            positive int.

    Example:
        >>> Padding(multiple_of=8, labels_from="input_ids")([{"input_ids": [5, 6, 7]}])
        {'input_ids': array([[5, 6, 7, 0, 0, 0, 0, 0]]), 'labels': array([[5, 6, 7, -100, ...]])}
    """

    def __init__(self, multiple_of: int | None = None, buckets: Sequence[int] | None = None, *, pad_id: int = 0,
                 label_pad: int = LABEL_PAD, masks: Sequence[str] = ("attention_mask",),
                 labels: Sequence[str] = ("labels",), labels_from: str | None = None):
        if (multiple_of is None) == (buckets is None):
            raise InputError("Padding takes one of multiple_of= (pad each batch's length up to a multiple) "
                             "or buckets= (pad it up to the smallest of a few lengths)")
        self.multiple_of = None if multiple_of is None else _length(multiple_of, "multiple_of")
        self.buckets = None if buckets is None else sorted({_length(b, "buckets") for b in buckets})
        self.pad_id, self.label_pad = int(pad_id), int(label_pad)
        self.masks, self.labels, self.labels_from = tuple(masks), tuple(labels), labels_from
        if labels_from is not None and not self.labels:
            raise InputError("labels_from= needs the name of the labels input: labels=('labels',)")

    def length(self, longest: int) -> int:
        """The padded length of a batch whose longest example has `longest` tokens.

        Raises:
            InputError: longer than the largest bucket.
        """
        if self.multiple_of is not None:
            return -(-longest // self.multiple_of) * self.multiple_of
        fitting = [bucket for bucket in self.buckets if bucket >= longest]
        if not fitting:
            raise InputError(f"an example of {longest} tokens is longer than the largest bucket "
                             f"({self.buckets[-1]}); add a bucket of at least {longest}, or truncate the examples")
        return fitting[0]

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
        """One batch: every sequence padded on the right to the batch's padded length, and
        scalars stacked.

        Raises:
            InputError: no examples, examples naming different inputs, or an example whose
                sequences differ in length.
        """
        rows = [self._example(example, index) for index, example in enumerate(examples)]
        if not rows:
            raise InputError("Padding got no examples; a batch needs at least one")
        names = list(rows[0][0])
        for index, (values, _) in enumerate(rows):
            if list(values) != names:
                raise InputError(f"example {index} has inputs {list(values)}, example 0 has {names}; "
                                 "every example needs the same inputs")
        target = self.length(max(length for _, length in rows))
        batch = {}
        for name in names:
            column = [values[name] for values, _ in rows]
            if column[0].ndim == 0:
                batch[name] = np.stack(column)
                continue
            fill = 0 if name in self.masks else self.label_pad if name in self.labels else self.pad_id
            batch[name] = np.stack([_padded(value, target, fill) for value in column])
        return batch

    def _example(self, example: Mapping[str, Any], index: int) -> tuple[dict[str, np.ndarray], int]:
        """The example's values as arrays (labels_from copied), and its length."""
        if not isinstance(example, Mapping):
            raise InputError(f"example {index} is a {type(example).__name__}; Padding takes examples as dicts "
                             "input name -> 1-D sequence (or scalar)")
        values = {str(name): np.asarray(value) for name, value in example.items()}
        if self.labels_from is not None:
            if self.labels_from not in values:
                raise InputError(f"example {index} has no {self.labels_from!r} to copy as labels (labels_from=); "
                                 f"it has {list(values)}")
            values[self.labels[0]] = values[self.labels_from].copy()
        lengths = {name: value.shape[0] for name, value in values.items() if value.ndim >= 1}
        if not lengths:
            raise InputError(f"example {index} has no sequence to pad ({list(values)} are scalars)")
        if len(set(lengths.values())) > 1:
            raise InputError(f"example {index} holds sequences of different lengths {lengths}; the tokens, their "
                             "mask and their labels must line up")
        return values, next(iter(lengths.values()))


def _padded(value: np.ndarray, length: int, fill: int) -> np.ndarray:
    widths = [(0, length - value.shape[0])] + [(0, 0)] * (value.ndim - 1)
    return np.pad(value, widths, constant_values=np.asarray(fill).astype(value.dtype))


def _length(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InputError(f"{what} takes positive ints (token counts), got {value!r}")
    return int(value)

