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

A node that mixes host constants with traced values gets its host tensor operands
as concrete JAX arrays (see as_operands), so no handler hands a tracer to numpy;
a handler that can use an operand's value when it is known reads it with
known_value, which accepts both forms.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

# Element types numpy holds and XLA does not (no XLA primitive yet).
HOST_ONLY_DTYPES = frozenset({np.dtype(ml_dtypes.float6_e2m3fn), np.dtype(ml_dtypes.float6_e3m2fn)})


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


def known_value(value: Any) -> np.ndarray | None:
    """`value` as numpy when it is known while tracing (a host constant, or a concrete JAX
    array such as a constant operand of a node that mixes it with traced values); None when
    it is traced."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, jax.Array) and not is_traced(value):
        return np.asarray(value)
    return None


def mixes_traced(inputs: Sequence[Any]) -> bool:
    """True when some input (or an element of a sequence input) is traced."""
    return any(is_traced(leaf) for leaf in jax.tree_util.tree_leaves(inputs))


def as_operands(inputs: Sequence[Any], keep: Container[int]) -> list[Any]:
    """The inputs of a node that mixes host constants with traced values, its numeric host
    tensors (but those at positions in `keep`) made concrete JAX arrays: a handler may then
    index, combine or hand them to jnp with any traced operand, as numpy would refuse to do
    with a tracer. Strings and dtypes XLA cannot hold stay numpy (such nodes run op by op)."""
    operands = list(inputs)
    for index, value in enumerate(operands):
        if (index in keep or not isinstance(value, np.ndarray) or value.dtype.kind in "OUSV"
                or value.dtype in HOST_ONLY_DTYPES):
            continue
        with jax.ensure_compile_time_eval():
            operands[index] = jnp.asarray(value)
    return operands


def to_host(value: Any) -> Any:
    """Concrete values as numpy (sequences element-wise); tracers are an error."""
    if value is None or isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        return [to_host(item) for item in value]
    if isinstance(value, dict):
        return {key: to_host(item) for key, item in value.items()}
    return np.asarray(value)
