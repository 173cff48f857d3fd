"""Class labels checked against the loss node that reads them, on the host, before a step runs.

SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss take class indices in [0, C), or the
node's ignore_index; the standard leaves every other value undefined. Run anyway, a label of
C or more reads outside the scores (a NaN loss that looks like a diverging step) and a
negative one picks a real class, silently. So every label input a step is fed directly is
checked here: against C where the scores' class axis (axis 1) has a declared size, else
against 0 only. Labels cut from a fed input (causal_lm shifts them with a Slice) are checked
on the whole input.

The check reads host arrays only (numpy, and what the feed check converted to numpy: torch
tensors, lists); a jax.Array is left alone, since reading it back would wait for the device.
Its cost is one pass over the labels; the offending index is searched only on failure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnxtrain.errors import InputError
from onnxtrain.proto import GraphProto, NodeProto, TypeProto
from onnxtrain.translate.registry import normalize_domain

_LOSSES = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
_LISTED = 1024  # labels up to this many are checked as a Python list (see LabelRule.check)


@dataclass(frozen=True)
class LabelRule:
    """What one fed label input may hold.

    input: the feed's name. classes: C, the size of the scores' class axis, when declared.
    ignore_index: the loss node's ignore_index, if it has one. loss: the node, for messages.
    """

    input: str
    classes: int | None
    ignore_index: int | None
    loss: str

    def check(self, value: Any) -> None:
        """Raise InputError if a label of `value` is neither a class nor the ignore_index."""
        if not isinstance(value, np.ndarray) or value.size == 0 or value.dtype.kind not in "iu":
            return
        if value.size <= _LISTED:
            # This runs every step, right after the device's work has filled the caches: on a
            # batch's worth of labels, Python's min and max cost less than numpy's reductions.
            listed = value.ravel().tolist()
            if min(listed) >= 0 and (self.classes is None or max(listed) < self.classes):
                return
        elif self.classes is None:
            if value.min() >= 0:
                return
        elif value.view(f"u{value.itemsize}").max() < self.classes:
            # Read as unsigned, a negative label is larger than any class: one pass checks both ends.
            return
        bad = value < 0
        if self.classes is not None:
            bad |= value >= self.classes
        if self.ignore_index is not None:
            bad &= value != self.ignore_index
        if not bad.any():
            return
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InputError(self._message(value[index].item(), index))

    def _message(self, label: int, index: tuple[int, ...]) -> str:
        valid = f"0..{self.classes - 1}" if self.classes is not None else "0 or more"
        ignored = f" or {self.ignore_index} (its ignore_index)" if self.ignore_index is not None else ""
        where = index[0] if len(index) == 1 else list(index)
        advice = ("check the labels (class indices counted from 0)" if label >= 0 else
                  "to skip samples with a marker label, give the loss an ignore_index "
                  "(make_training_model and finetune take ignore_index=)")
        return (f"input {self.input!r}: label {label} at index {where} is not a class of the {self.loss}: "
                f"labels must be in {valid}{ignored}; {advice}")


def _declared_dim(value_type: TypeProto | None, axis: int) -> int | None:
    """The declared size of `axis` of a tensor type, or None."""
    if value_type is None or not value_type.HasField("tensor_type"):
        return None
    tensor = value_type.tensor_type
    if not tensor.HasField("shape") or len(tensor.shape.dim) <= axis:
        return None
    dim = tensor.shape.dim[axis]
    return dim.dim_value if dim.HasField("dim_value") and dim.dim_value > 0 else None


def _ignore_index(item: NodeProto) -> int | None:
    return next((a.i for a in item.attribute if a.name == "ignore_index"), None)


def label_rules(graph: GraphProto, fed: Iterable[str]) -> list[LabelRule]:
    """A rule for each input in `fed` that a class-index loss node of `graph` reads as its
    labels, directly or through Identity and Slice (causal_lm's shifted labels: the rule then
    checks the whole fed tensor)."""
    fed = set(fed)
    # Untyped entries (a step listing an output by name only) must not hide a declared type.
    types = {v.name: v.type for v in [*graph.input, *graph.value_info, *graph.output]
             if v.type.HasField("tensor_type")}
    producers = {name: item for item in graph.node for name in item.output if name}
    rules = []
    for item in graph.node:
        if item.op_type not in _LOSSES or normalize_domain(item.domain) != "" or len(item.input) < 2:
            continue
        source = _fed_source(item.input[1], producers, fed)
        if source is not None:
            loss = f"{item.op_type} node {item.name!r}" if item.name else f"{item.op_type} node"
            rules.append(LabelRule(source, _class_count(item.input[0], types, producers),
                                   _ignore_index(item), loss))
    return rules


# Ops that keep a tensor's values in place along the axis followed (a Slice may shorten other
# axes; one shortening the class axis only makes the check looser, never wrong).
_KEEPS_VALUES = ("Identity", "Slice")


def _fed_source(name: str, producers: Mapping[str, NodeProto], fed: set[str]) -> str | None:
    """The fed input `name` is cut from by Identity and Slice nodes, or None."""
    while name not in fed:
        item = producers.get(name)
        if item is None or item.op_type not in _KEEPS_VALUES:
            return None
        name = item.input[0]
    return name


def _class_count(scores: str, types: Mapping[str, TypeProto], producers: Mapping[str, NodeProto]) -> int | None:
    """The declared size of the scores' class axis (axis 1), followed back through Identity,
    Slice and Transpose to a value whose type declares it; None when none does."""
    name, axis = scores, 1
    while True:
        size = _declared_dim(types.get(name), axis)
        item = producers.get(name)
        if size is not None or item is None:
            return size
        if item.op_type == "Transpose":
            perm = next((list(a.ints) for a in item.attribute if a.name == "perm"), None)
            if not perm or axis >= len(perm):
                return None
            axis = perm[axis]
        elif item.op_type not in _KEEPS_VALUES:
            return None
        name = item.input[0]


class LabelCheckedFeeds:
    """A feed check followed by the label rules: called like the check it wraps, and with
    its attributes (names, where)."""

    def __init__(self, check: Callable[..., dict[str, Any]], rules: list[LabelRule]):
        self._check = check
        self._rules = rules

    def __call__(self, feeds: Mapping[str, Any], copy: bool = True) -> dict[str, Any]:
        checked = self._check(feeds, copy=copy)
        for rule in self._rules:
            rule.check(checked[rule.input])
        return checked

    def __getattr__(self, name: str) -> Any:
        return getattr(self._check, name)


def with_label_check(check: Any, graph: GraphProto) -> Any:
    """`check` (a FeedChecker of `graph`'s inputs), also checking the labels `graph`'s losses
    read; `check` itself when no loss reads a fed label, so other graphs pay nothing."""
    rules = label_rules(graph, check.names)
    return LabelCheckedFeeds(check, rules) if rules else check
