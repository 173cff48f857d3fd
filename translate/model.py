"""A whole ONNX model as one jitted, differentiable JAX function.

TranslatedModel translates once (plans, decoded attributes, constants) and
compiles once per input signature (jax.jit's cache). Float initializers are
parameters, passed in rather than baked into the program, so they can be
differentiated and updated; so are integer weights a DequantizeLinear or MatMulNBits
dequantizes (never differentiated), so that they are dequantized inside the program, layer
by layer. Every other initializer is a host constant.
Graphs that need concrete values (data-dependent shapes, strings) run op by op
instead, after one log line saying why.
"""

from __future__ import annotations

import logging
from collections import ChainMap
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from onnxtrain.errors import InputError, OnnxTrainError, out_of_memory, without_jax_notes
from onnxtrain.proto import GraphProto, ModelProto
from onnxtrain.proto.walk import iter_graph_tree
from onnxtrain.translate import gradient, ops  # noqa: F401 - registers every op handler
from onnxtrain.translate.compiler_options import jit_with_options
from onnxtrain.translate.graph import (
    Translator,
    check_depth,
    evaluate_nodes,
    initializer_names,
    iter_initializers,
    plan_outputs,
)
from onnxtrain.translate.node import Evaluation
from onnxtrain.translate.ops.cast import is_integer
from onnxtrain.translate.validation import check_graph
from onnxtrain.translate.registry import model_opsets, normalize_domain, resolve
from onnxtrain.translate.values import HOST_ONLY_DTYPES, NeedsHostValues, is_traced, to_host

logger = logging.getLogger("onnxtrain")


# (domain, op) -> the input position of a weight stored as integers that the op dequantizes.
_QUANTIZED_WEIGHT_INPUTS = {("", "DequantizeLinear"): 0, ("com.microsoft", "DequantizeLinear"): 0,
                            ("com.microsoft", "MatMulNBits"): 1}


def quantized_weights(graph: GraphProto) -> set[str]:
    """Names the main graph's nodes read as a quantized weight (DequantizeLinear's x,
    MatMulNBits's B); whether they are integer initializers is the caller's to check."""
    names = set()
    for node in graph.node:
        position = _QUANTIZED_WEIGHT_INPUTS.get((normalize_domain(node.domain), node.op_type))
        if position is not None and position < len(node.input) and node.input[position]:
            names.add(node.input[position])
    return names


def static_input_names(graph: GraphProto, opsets: Mapping[str, int]) -> set[str]:
    """Names used at an input position some op needs as a host constant (shapes, axes...)."""
    names = set()
    for subgraph, _ in iter_graph_tree(graph, "graph"):
        for node in subgraph.node:
            domain = normalize_domain(node.domain)
            handler = resolve(domain, node.op_type, opsets.get(domain, 0))
            for index in handler.static_inputs if handler else ():
                if index < len(node.input):
                    names.add(node.input[index])
    return names


_PARAMETER_DTYPES = {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64),
                     np.dtype(ml_dtypes.bfloat16)}


def _is_float(array: np.ndarray) -> bool:
    return array.dtype in _PARAMETER_DTYPES


def _host_only(value: Any) -> bool:
    """True for values that cannot enter or leave a jitted function: strings, maps, and
    element types XLA cannot hold."""
    if isinstance(value, (list, tuple)):
        return any(_host_only(item) for item in value)
    if isinstance(value, dict):
        return True
    return isinstance(value, np.ndarray) and (value.dtype.kind in "OUS" or value.dtype in HOST_ONLY_DTYPES)


def _signature(inputs: Mapping[str, Any]) -> Any:
    leaves, structure = jax.tree_util.tree_flatten(inputs)
    return structure, tuple((np.shape(leaf), str(getattr(leaf, "dtype", type(leaf)))) for leaf in leaves)


class EagerSignatures:
    """The input signatures (structure, shapes, dtypes) a graph could not be traced for (see
    NeedsHostValues): calls with them go op by op at once, without another failed trace."""

    def __init__(self) -> None:
        self._signatures: set[Any] = set()

    def __contains__(self, inputs: Mapping[str, Any]) -> bool:
        # Most graphs trace: they never work out a signature.
        return bool(self._signatures) and _signature(inputs) in self._signatures

    def __len__(self) -> int:
        return len(self._signatures)

    def add(self, inputs: Mapping[str, Any]) -> None:
        self._signatures.add(_signature(inputs))


class TranslatedModel:
    """fn(params, inputs, key=None) -> {output name: value}; jit- and grad-able."""

    def __init__(self, model: ModelProto, params: Iterable[str] | None = None, jit: bool = True,
                 supplied: Iterable[str] = ()):
        """params: the initializers passed in as arguments (default: the float ones not used
        as shapes or axes), decoded into self.params. supplied: initializers the caller
        passes with every call (a trainer's state), never decoded here, so a large model's
        weights are not held twice. jit=False runs every call op by op, each op's result
        rounded to its dtype: slower, but free of XLA's cross-op fusion (for debugging numerics)."""
        self.name = model.graph.name or "model"
        self.jit = jit
        # "blocks": a differentiated apply recomputes activations per segment of nodes (set by
        # the training programs that differentiate it; see translate.recompute).
        self.recompute: str | None = None
        # Before anything runs: an invalid graph would run and answer wrongly.
        check_graph(model.graph)
        opsets = model_opsets(model.opset_import)
        translator = Translator(opsets, model.functions)
        names = initializer_names(model.graph)
        self.supplied = set(supplied)
        decoded = dict(iter_initializers(model.graph, lambda name: name not in self.supplied))
        static = static_input_names(model.graph, opsets)
        # Quantized weights are arguments too: as host constants, their dequantization would
        # fold while tracing into float constants of the whole model (see translate.recompute).
        self.quantized = frozenset(n for n in quantized_weights(model.graph)
                                   if n in decoded and is_integer(decoded[n].dtype))
        if params is None:
            params = [n for n, v in decoded.items() if (_is_float(v) or n in self.quantized) and n not in static]
        unknown = sorted((set(params) | self.supplied) - set(names))
        if unknown:
            raise InputError(f"params {unknown} are not initializers of the model")
        with jax.enable_x64(True):
            # device_put, not jnp.asarray (which copies): on CPU it uses an aligned host array
            # in place, so a weight load_model mapped stays a view of its file.
            self.params = {name: jax.device_put(decoded[name]) for name in params
                           if name not in self.supplied}
        constants = {n: v for n, v in decoded.items() if n not in self.params}
        self.plan = translator.plan(model.graph, constants)
        translator.check_complete(f"model {self.name!r}")
        check_depth(self.plan, f"model {self.name!r}")
        self.input_names = [name for name in self.plan.inputs if name not in names]
        self.output_names = list(self.plan.outputs)
        self._jitted = jit_with_options(self._traced)
        self._jitted_nested = jax.jit(self._traced)
        self._eager_signatures = EagerSignatures()

    def _input_values(self, params: Mapping[str, Any], inputs: Mapping[str, Any]) -> list[Any]:
        unknown = sorted(set(inputs) - set(self.plan.inputs))
        missing = [n for n in self.input_names if n not in inputs]
        if unknown or missing:
            raise InputError(
                f"model {self.name!r} takes inputs {self.input_names}; "
                + (f"missing {missing}" if missing else "")
                + ("; " if unknown and missing else "")
                + (f"unknown {unknown}" if unknown else ""))
        values = []
        for name in self.plan.inputs:
            if name in inputs:
                values.append(inputs[name])
            elif name in params:
                values.append(params[name])
            else:
                values.append(self.plan.constants[name])
        return values

    def apply(self, params: Mapping[str, Any], inputs: Mapping[str, Any],
              key: jax.Array | None = None, eager: bool = False) -> dict[str, Any]:
        """The model's outputs; traceable (jit, grad, vmap) unless eager."""
        return self.apply_keeping(params, inputs, key, (), eager)[0]

    def apply_keeping(self, params: Mapping[str, Any], inputs: Mapping[str, Any], key: jax.Array | None,
                      kept: Iterable[str], eager: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        """apply's outputs, and the values of the `kept` names computed on the way (for a caller
        that recomputes the last nodes from them: see apply_nodes)."""
        evaluation = Evaluation(key, eager, recompute=self.recompute, quantized=bool(self.quantized))
        kept = list(kept)
        scope = evaluate_nodes(self.plan, range(len(self.plan.nodes)), self._input_values(params, inputs),
                               params, evaluation, segmented=self.recompute is not None, keep=kept)
        return dict(zip(self.output_names, plan_outputs(self.plan, scope))), {name: scope[name] for name in kept}

    def apply_nodes(self, indices: Iterable[int], params: Mapping[str, Any], inputs: Mapping[str, Any],
                    values: Mapping[str, Any]) -> Mapping[str, Any]:
        """Every value in scope after running only the plan's nodes at `indices`, given the
        `values` of the intermediate names they read. The nodes must draw no random numbers."""
        return evaluate_nodes(self.plan, indices, self._input_values(params, inputs), ChainMap(values, params),
                              Evaluation(None, False))

    def _traced(self, params: Mapping[str, Any], inputs: Mapping[str, Any],
                key: jax.Array | None) -> dict[str, Any]:
        outputs = self.apply(params, inputs, key)
        for name, value in outputs.items():
            if _host_only(value):
                raise NeedsHostValues(f"output {name!r}", "is a string tensor, a map or a 6-bit "
                                      "float, which a compiled function cannot return")
        return outputs

    def _compiled(self, params: Mapping[str, Any], inputs: Mapping[str, Any], key: jax.Array | None) -> dict:
        """The jitted model's outputs. JAX refuses compiler options on a jit nested in a caller's
        jax.jit or grad, under jax.jit only after tracing the model once; so traced arguments
        (vmap's too, whose batching would accept the options) go straight to a plain jit, and
        concrete ones inside a caller's trace (a closure under jax.jit) retry on JAX's error."""
        if any(map(is_traced, jax.tree.leaves((params, inputs, key)))):
            return self._jitted_nested(params, inputs, key)
        try:
            return self._jitted(params, inputs, key)
        except ValueError as error:
            # Only concrete arguments, yet inside a caller's trace: a closure under jax.jit.
            if "compiler_options" not in str(error):
                raise
        return self._jitted_nested(params, inputs, key)

    def __call__(self, params: Mapping[str, Any], inputs: Mapping[str, Any],
                 key: jax.Array | None = None) -> dict[str, Any]:
        """Run the model: compiled once per input signature, eagerly where it must."""
        with jax.enable_x64(True):
            eager = not self.jit or inputs in self._eager_signatures
            if not eager and not _host_only(list(inputs.values())):
                try:
                    return self._compiled(params, inputs, key)
                except OnnxTrainError as error:
                    raise without_jax_notes(error)
                except jax.errors.JaxRuntimeError as error:
                    exhausted = out_of_memory(error, f"model {self.name!r}")
                    if exhausted is None:
                        raise
                    raise exhausted from None
                except NeedsHostValues as reason:
                    logger.warning("model %r runs op by op (no jit) for these input shapes: %s",
                                   self.name, reason)
                    self._eager_signatures.add(inputs)
            host_params = {name: to_host(value) for name, value in params.items()}
            host_inputs = {name: to_host(value) for name, value in inputs.items()}
            return self.apply(host_params, host_inputs, key, eager=True)
