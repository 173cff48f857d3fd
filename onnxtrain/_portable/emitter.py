"""Emitter: writes the standard ONNX nodes and constants a decomposition or a backward rule needs.

One Emitter serves one expansion. It knows the example value of every forward
tensor (so rules can read ranks, dtypes and constant operands such as axes)
and hands out fresh names under a scope that says what is being computed
(`grad/fc1/MatMul_dA`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onnxtrain.errors import ExportError
from onnxtrain.proto import NodeProto, TensorProto
from onnxtrain.proto.make import node as make_node
from onnxtrain.translate.node import decode_attribute
from onnxtrain.translate.tensors import data_type_of, numpy_to_tensor

def attr(proto: NodeProto, name: str, default: Any = None) -> Any:
    """The decoded value of the node's attribute `name`, or `default`."""
    for attribute in proto.attribute:
        if attribute.name == name:
            return decode_attribute(attribute, label(proto))
    return default


def label(proto: NodeProto) -> str:
    """How messages name a node: its name and op."""
    return f"node {proto.name or (proto.output[0] if proto.output else '?')!r} ({proto.op_type})"


class Emitter:
    """Appends nodes and initializers; answers questions about forward tensors.

    Args:
        values: the example value of every forward tensor (see shapes.example_values).
        opset: the default domain's opset version the nodes are written for.
        taken: every name already used in the graph; fresh names avoid them.
    """

    def __init__(self, values: Mapping[str, np.ndarray], opset: int, taken: set[str]):
        self.values = values
        self.opset = opset
        self.taken = taken
        self.nodes: list[NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.scope = "grad"
        self._shapes: dict[str, str] = {}
        self._constants: dict[tuple, str] = {}

    # -- names -------------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        """A name `<scope>/<hint>` (numbered if taken)."""
        wanted = f"{self.scope}/{hint}" if self.scope else hint
        name, counter = wanted, 1
        while name in self.taken:
            counter += 1
            name = f"{wanted}.{counter}"
        self.taken.add(name)
        return name

    # -- forward tensors ---------------------------------------------------------------------
    def example(self, name: str) -> np.ndarray:
        """The example value of a forward tensor."""
        if name not in self.values:
            raise ExportError(f"portable export: tensor {name!r} has no example value; the backward "
                              "needs the rank and dtype of every forward tensor on the gradient's path")
        return self.values[name]

    def value(self, name: str, what: str) -> np.ndarray:
        """The value of a forward tensor that must be a constant (axes, a ratio): `what` says
        what it is for the message."""
        if name not in getattr(self.values, "concrete", self.values):
            raise ExportError(f"portable export: {what} {name!r} must be a constant (an initializer or "
                              "computed from constants only); the backward is written for fixed values of it")
        return np.asarray(self.values[name])

    def rank(self, name: str) -> int:
        return np.ndim(self.example(name))

    def dtype(self, name: str) -> np.dtype:
        return np.asarray(self.example(name)).dtype

    # -- writing -----------------------------------------------------------------------------
    def add(self, op_type: str, inputs: Sequence[str], hint: str, outputs: int = 1,
            **attributes: Any) -> Any:
        """Append a node named after its first output; returns its output name (or names)."""
        names = [self.fresh(hint if outputs == 1 else f"{hint}_{i}") for i in range(outputs)]
        self.nodes.append(make_node(op_type, list(inputs), names, name=names[0], **attributes))
        return names[0] if outputs == 1 else names

    def emit(self, op_type: str, inputs: Sequence[str], outputs: Sequence[str], name: str,
             **attributes: Any) -> None:
        """Append a node writing the given (existing) output names: a decomposition's last nodes."""
        self.taken.update(outputs)
        self.nodes.append(make_node(op_type, list(inputs), list(outputs), name=name, **attributes))

    def take(self) -> list[NodeProto]:
        """The nodes written since the last take."""
        written, self.nodes = self.nodes, []
        return written

    def append(self, proto: NodeProto) -> None:
        """Append a node written elsewhere (a forward node kept as it is)."""
        self.taken.update(proto.output)
        self.nodes.append(proto)

    def constant(self, value: Any, hint: str, dtype: Any = None) -> str:
        """An initializer holding `value` (shared between equal requests)."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            name = self.fresh(hint)
            self.initializers.append(numpy_to_tensor(array, name))
            self._constants[key] = name
        return self._constants[key]

    def scalar(self, value: float, like: str) -> str:
        """A scalar constant of the dtype of tensor `like`."""
        return self.constant(np.asarray(value, self.dtype(like)), "const")

    def ints(self, values: Sequence[int]) -> str:
        """A 1-D int64 constant (axes, shapes)."""
        return self.constant(np.asarray(list(values), np.int64), "ints")

    def shape(self, name: str) -> str:
        """The Shape of a forward tensor, written once."""
        if name not in self._shapes:
            self._shapes[name] = self.add("Shape", [name], "shape")
        return self._shapes[name]

    # -- helpers over opset differences ------------------------------------------------------
    def reduce(self, op_type: str, x: str, axes: Sequence[int], keepdims: bool, hint: str) -> str:
        """ReduceSum/ReduceMean/... over `axes` (axes as an input from opset 13/18 on)."""
        axes = list(axes)
        since = 13 if op_type == "ReduceSum" else 18
        if self.opset >= since:
            return self.add(op_type, [x, self.ints(axes)], hint, keepdims=int(keepdims))
        return self.add(op_type, [x], hint, axes=axes, keepdims=int(keepdims))

    def unsqueeze(self, x: str, axes: Sequence[int], hint: str) -> str:
        return self.add("Unsqueeze", [x, self.ints(axes)], hint)

    def squeeze(self, x: str, axes: Sequence[int], hint: str) -> str:
        return self.add("Squeeze", [x, self.ints(axes)], hint)

    def zeros_like(self, name: str, hint: str) -> str:
        """Zeros with the shape and dtype of forward tensor `name`."""
        zero = numpy_to_tensor(np.zeros(1, self.dtype(name)))
        return self.add("ConstantOfShape", [self.shape(name)], hint, value=zero)

    def sum_to(self, grad: str, operand: str, result: str) -> str:
        """`grad` (shaped like forward tensor `result`) summed over the axes along which
        `operand` was broadcast to `result`'s shape (numpy rules)."""
        operand_shape, result_shape = np.shape(self.example(operand)), np.shape(self.example(result))
        if operand_shape == result_shape:
            return grad
        lead = len(result_shape) - len(operand_shape)
        kept = [lead + i for i, size in enumerate(operand_shape) if size == 1 and result_shape[lead + i] != 1]
        if kept:
            grad = self.reduce("ReduceSum", grad, kept, True, "sum_broadcast")
        if lead:
            grad = self.reduce("ReduceSum", grad, range(lead), False, "sum_leading")
        return grad

    def cast_like(self, x: str, like: str, hint: str) -> str:
        return self.add("Cast", [x], hint, to=data_type_of(self.dtype(like)))
