"""A human-readable outline of a model: what `onnxtrain inspect` and the demo print."""

from __future__ import annotations

import math
from collections import Counter

from onnxtrain._io.model import ModelSource, load_model
from onnxtrain.proto import (AttributeProto, GraphProto, ModelProto, SparseTensorProto, TensorProto, TrainingInfoProto,
                             TypeProto, ValueInfoProto)
from onnxtrain.proto.metadata import read_record
from onnxtrain.proto.walk import iter_graphs
from onnxtrain.translate import gradient, ops  # noqa: F401 - registers every op handler
from onnxtrain.translate.registry import TRAINING_DOMAIN, model_opsets, normalize_domain, resolve
from onnxtrain.translate.tensors import ELEMENT_TYPES, raw_size, tensor_to_numpy

# The optimizers of the training domain: input 0 is the learning rate R, input 1 the step counter T.
_OPTIMIZERS = ("Adam", "Adagrad", "Momentum")


def _element_name(code: int) -> str:
    if code == TensorProto.STRING:
        return "string"
    element = ELEMENT_TYPES.get(code)
    return element.dtype.name if element else f"type{code}"


def _type_text(value_type: TypeProto) -> str:
    kind = value_type.WhichOneof("value")
    if kind == "tensor_type":
        name = _element_name(value_type.tensor_type.elem_type)
        if not value_type.tensor_type.HasField("shape"):
            return name
        dims = [d.dim_param or (str(d.dim_value) if d.HasField("dim_value") else "?")
                for d in value_type.tensor_type.shape.dim]
        return f"{name}[{', '.join(dims)}]"
    if kind in ("sequence_type", "optional_type"):
        return f"{kind.split('_')[0]}<{_type_text(getattr(value_type, kind).elem_type)}>"
    return kind or "unknown"


def _values_text(values: list[ValueInfoProto]) -> str:
    return ", ".join(f"{v.name} {_type_text(v.type)}" for v in values) or "none"


def _tensor_text(tensor: TensorProto | SparseTensorProto) -> str:
    if isinstance(tensor, SparseTensorProto):
        # A sparse initializer's dims are the dense tensor's; make_training_model stores the
        # optimizer slots this way, with no entries (all zeros).
        stored = math.prod(tensor.values.dims)
        return (f"{tensor.values.name} {_element_name(tensor.values.data_type)}"
                f"[{', '.join(map(str, tensor.dims))}] (sparse, {stored:,} stored values)")
    return f"{tensor.name} {_element_name(tensor.data_type)}[{', '.join(map(str, tensor.dims))}]"


def _initializers(graph: GraphProto) -> dict[str, TensorProto | SparseTensorProto]:
    """Every initializer of `graph` by name, dense and sparse."""
    return {**{t.name: t for t in graph.initializer}, **{s.values.name: s for s in graph.sparse_initializer}}


def _ops_text(graph: GraphProto) -> str:
    counts = Counter(n.op_type if not n.domain else f"{n.domain}::{n.op_type}" for n in graph.node)
    return ", ".join(f"{op} x{count}" if count > 1 else op for op, count in counts.items())


def _initializer_text(graph: GraphProto) -> str:
    values = sum(math.prod(t.dims) for t in graph.initializer)
    size = sum(raw_size(ELEMENT_TYPES[t.data_type], math.prod(t.dims)) for t in graph.initializer
               if t.data_type in ELEMENT_TYPES and t.data_type != TensorProto.STRING)
    text = f"{len(graph.initializer)} ({values:,} values, {size:,} bytes)"
    if graph.sparse_initializer:
        dense = sum(math.prod(s.dims) for s in graph.sparse_initializer)
        text += f" + {len(graph.sparse_initializer)} sparse ({dense:,} values when dense)"
    return text


def _graph_lines(label: str, graph: GraphProto, indent: str) -> list[str]:
    title = f"{label} {graph.name!r}" if graph.name else label
    return [
        f"{indent}{title}: {len(graph.node)} nodes ({_ops_text(graph) or 'none'})",
        f"{indent}  inputs:  {_values_text(list(graph.input))}",
        f"{indent}  outputs: {_values_text(list(graph.output))}",
        f"{indent}  initializers: {_initializer_text(graph)}",
    ]


def unsupported_ops(model: ModelProto) -> list[str]:
    """'domain::op (opset N)' for every operator in any graph that onnxtrain cannot run."""
    opsets = model_opsets(model.opset_import)
    functions = {(f.domain, f.name) for f in model.functions}
    missing = set()
    graphs = [graph for graph, _ in iter_graphs(model)]
    graphs += [GraphProto(node=f.node) for f in model.functions]
    for graph in graphs:
        for node in graph.node:
            domain = normalize_domain(node.domain)
            if (node.domain, node.op_type) in functions:
                continue
            version = opsets.get(domain)
            if version is None or resolve(domain, node.op_type, version) is None:
                missing.add(f"{domain or 'ai.onnx'}::{node.op_type} (opset {version or 'not imported'})")
    return sorted(missing)


def _state_keys(info: TrainingInfoProto) -> list[str]:
    """The state variables of one TrainingInfoProto: its binding keys, in order, once each."""
    return list(dict.fromkeys([b.key for b in info.initialization_binding] + [b.key for b in info.update_binding]))


def _scalar_text(tensor: TensorProto | SparseTensorProto) -> str | None:
    """The value of a one-element dense tensor as text, else None."""
    if isinstance(tensor, SparseTensorProto) or math.prod(tensor.dims) != 1:
        return None
    if tensor.data_type not in ELEMENT_TYPES or tensor.data_type == TensorProto.STRING:
        return None
    try:
        value = tensor_to_numpy(tensor).reshape(()).item()
    except Exception:  # an outline never fails on one unreadable value; it shows what it can
        return None
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def optimizer_nodes(info: TrainingInfoProto) -> list[tuple[str, str, str]]:
    """(op type, learning-rate input, step-counter input) of each training-domain optimizer node
    of an algorithm graph: the names its R and T inputs read (a state variable or a computed value)."""
    return [(n.op_type, n.input[0], n.input[1]) for n in info.algorithm.node
            if n.domain == TRAINING_DOMAIN and n.op_type in _OPTIMIZERS and len(n.input) >= 2]


def _attribute_text(attribute: AttributeProto) -> str:
    if attribute.type == attribute.FLOAT:
        return f"{attribute.f:.6g}"
    if attribute.type == attribute.INT:
        return str(attribute.i)
    return attribute.s.decode("utf-8", "replace")


def _hyperparameter_lines(info: TrainingInfoProto, scope: dict[str, TensorProto | SparseTensorProto],
                          indent: str) -> list[str]:
    """The optimizer, its learning rate and step counter by name, and every scalar state
    variable with its initial value (the ones a runtime can change between steps)."""
    lines = []
    for item in info.algorithm.node:
        if item.domain != TRAINING_DOMAIN or item.op_type not in _OPTIMIZERS or len(item.input) < 2:
            continue
        settings = ", ".join(f"{a.name}={_attribute_text(a)}" for a in item.attribute
                             if a.type in (a.FLOAT, a.INT, a.STRING))
        lines.append(f"{indent}optimizer: {item.op_type}" + (f" ({settings})" if settings else ""))
        for role, name in (("learning rate", item.input[0]), ("step counter", item.input[1])):
            value = _scalar_text(scope[name]) if name in scope else None
            lines.append(f"{indent}  {role}: {name}" + (f" = {value}" if value is not None else " (computed)"))
    scalars = [(key, _scalar_text(scope[key])) for key in _state_keys(info) if key in scope]
    shown = [f"{key} = {value}" for key, value in scalars if value is not None]
    if shown:
        lines.append(f"{indent}scalar state variables (initial values): {', '.join(shown)}")
    return lines


def describe(model: ModelSource) -> str:
    """An outline of a model: opsets, graphs, and each training recipe's state and bindings.

    Args:
        model: a path, bytes, file object or ModelProto.

    Returns:
        Several lines of text (what `onnxtrain inspect` prints).

    Raises:
        ModelLoadError: the model cannot be read.

    Example:
        >>> print(onnxtrain.describe("model.onnx"))
    """
    model = load_model(model)
    opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in model.opset_import)
    producer = " ".join(filter(None, (model.producer_name, model.producer_version)))
    lines = [f"ONNX model, IR version {model.ir_version}" + (f", produced by {producer}" if producer else "")]
    if model.doc_string:
        lines.append(f"  {model.doc_string}")
    lines.append(f"opsets: {opsets or 'none'}")
    lines += _graph_lines("main graph", model.graph, "")
    lines += describe_adapters(model)
    initializers = _initializers(model.graph)
    for index, info in enumerate(model.training_info):
        lines.append(f"training_info[{index}]:")
        if info.HasField("initialization"):
            lines += _graph_lines("initialization", info.initialization, "  ")
        lines += _graph_lines("algorithm", info.algorithm, "  ")
        scope = {**initializers, **_initializers(info.algorithm)}
        keys = _state_keys(info)
        state = [_tensor_text(scope[key]) if key in scope else f"{key} (not an initializer!)"
                 for key in keys]
        lines.append(f"  state variables ({len(keys)}): {', '.join(state)}")
        lines += _hyperparameter_lines(info, scope, "  ")
        lines.append("  update_binding: " + (", ".join(
            f"{b.key} <- {b.value}" for b in info.update_binding) or "none"))
    if model.functions:
        lines.append("functions: " + ", ".join(f"{f.domain}::{f.name}" for f in model.functions))
    lines.append("unsupported operators: " + (", ".join(unsupported_ops(model)) or "none"))
    return "\n".join(lines)


def describe_adapters(model: ModelProto) -> list[str]:
    """Lines for `onnxtrain inspect`: each adapted weight, its kind, rank and factors."""
    record = read_record(model)
    if record is None:
        return []
    lines = [f"LoRA adapters: rank {record['rank']}, alpha {record['alpha']:g}, dropout {record['dropout']:g}, "
             f"{len(record['weights'])} weights"]
    for weight, entry in record["weights"].items():
        quantized = ", quantized base" if entry["quantized"] else ""
        lines.append(f"  {weight} ({entry['kind']} {entry['shape']}{quantized}): {entry['A']}, {entry['B']}")
    return lines
