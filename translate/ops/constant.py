"""Constant and Identity: values that pass through unchanged."""

from __future__ import annotations

import numpy as np

from onnxtrain.translate.registry import op

_VALUE_ATTRIBUTES = {
    "value": lambda v: v,
    "sparse_value": lambda v: v,
    "value_float": lambda v: np.array(v, np.float32),
    "value_floats": lambda v: np.array(v, np.float32),
    "value_int": lambda v: np.array(v, np.int64),
    "value_ints": lambda v: np.array(v, np.int64),
    "value_string": lambda v: np.array(v, object),
    "value_strings": lambda v: np.array(v, object),
}


@op("Constant", since=1)
def constant(node):
    """The one attribute that is set holds the value (a host constant)."""
    for name, convert in _VALUE_ATTRIBUTES.items():
        if node.has_attr(name):
            return convert(node.attr(name))
    raise node.error("Constant needs one of the attributes " + ", ".join(_VALUE_ATTRIBUTES))


@op("Identity", since=1)
def identity(node, x):
    return x
