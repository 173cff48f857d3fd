"""Host constants versus traced values.

A value flowing through a translated graph is one of:
- a numpy array: a *host constant*, known while tracing (initializers that are
  not parameters, Constant nodes, Shape/Size of anything, and whatever is
  computed only from those). Ops on host constants are evaluated right away,
  so Reshape/Slice/Expand/Resize chains get static shapes under jit;
- a JAX array or tracer: a value computed on the device;
- a Python list of values: an ONNX sequence (a dict: an ONNX map, from ZipMap);
- None: an omitted optional input, or an empty optional.

Ops whose output shape depends on the data (NonZero, Unique, ...) and string
ops need host constants; when they meet a traced value they raise
NeedsHostValues, and the model falls back to running op by op (eager mode).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


class NeedsHostValues(Exception):
    """A node needs concrete input values; the graph must run in eager mode."""

    def __init__(self, node_label: str, reason: str):
        super().__init__(f"{node_label} {reason}")
        self.node_label = node_label
        self.reason = reason


def is_host(value: Any) -> bool:
    """True for values known on the host: numpy arrays and sequences of them (None too)."""
    if value is None or isinstance(value, np.ndarray):
        return True
    if isinstance(value, list):
        return all(is_host(item) for item in value)
    if isinstance(value, dict):
        return all(is_host(item) for item in value.values())
    return False


def is_traced(value: Any) -> bool:
    return isinstance(value, jax.core.Tracer)


def to_host(value: Any) -> Any:
    """Concrete values as numpy (sequences element-wise); tracers are an error."""
    if value is None or isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        return [to_host(item) for item in value]
    if isinstance(value, dict):
        return {key: to_host(item) for key, item in value.items()}
    return np.asarray(value)
