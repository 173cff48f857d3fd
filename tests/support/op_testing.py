"""Helpers shared by the op-family tests: building one-op models, running them, finite differences."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import load_model
from onnxtrain.translate.model import TranslatedModel


def _numpy(value: Any) -> Any:
    """Arrays as numpy; sequences and maps keep their structure."""
    if isinstance(value, list):
        return [_numpy(item) for item in value]
    if value is None or isinstance(value, dict):
        return value
    return np.asarray(value)


def translate(model: onnx.ModelProto) -> TranslatedModel:
    return TranslatedModel(load_model(model.SerializeToString()))


def run_model(model: onnx.ModelProto, feeds: Mapping[str, Any], key: jax.Array | None = None) -> list:
    """The model's outputs, in order, as onnxtrain computes them (jit, or eager where it must)."""
    fn = translate(model)
    outputs = fn(fn.params, dict(feeds), key)
    return [_numpy(outputs[name]) for name in fn.output_names]


def single_op_model(op_type: str, inputs: list[np.ndarray | None], opset: int, host: bool = False,
                    outputs: int = 1, **attributes: Any) -> onnx.ModelProto:
    """One `op_type` node reading X0, X1... (None leaves an input out) and writing Y0, Y1...

    host=True feeds the inputs from Constant nodes, so the op runs on host constants.
    """
    names = ["" if value is None else f"X{i}" for i, value in enumerate(inputs)]
    nodes, graph_inputs = [], []
    for name, value in zip(names, inputs):
        if value is None:
            continue
        if host:
            nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value)))
        else:
            graph_inputs.append(helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape))
    while names and not names[-1]:
        names.pop()
    output_names = [f"Y{i}" for i in range(outputs)]
    nodes.append(helper.make_node(op_type, names, output_names, **attributes))
    graph = helper.make_graph(
        nodes, op_type, graph_inputs,
        [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in output_names])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def single_op_feeds(inputs: list[np.ndarray | None]) -> dict[str, np.ndarray]:
    """The feeds of a single_op_model built from the same inputs."""
    return {f"X{i}": value for i, value in enumerate(inputs) if value is not None}


def finite_difference(f: Callable[[np.ndarray], float], x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences of the scalar function f at x (use float64)."""
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[index] = eps
        grad[index] = (f(x + step) - f(x - step)) / (2 * eps)
    return grad


def jaxpr_equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of a jaxpr, those of the jaxprs nested in its equations (pjit,
    custom_vjp, ...) included."""
    for equation in jaxpr.eqns:
        yield equation
        for param in equation.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from jaxpr_equations(inner)
