"""Gradient nodes expanded into the backward pass in standard ONNX operators.

expand_gradients replaces every Gradient node (ai.onnx.preview.training, or
ai.onnx.preview as pytorch-pfn-extras writes it) by reverse-mode nodes: the
composite forward ops on the differentiated path are first rewritten into
primitives (decompose.py), then each primitive's vector-Jacobian product
(rules.py) is written from y back to the xs, fan-out summed with Sum.
Sizes that depend on the inputs are taken with Shape nodes at run time, so the
graph stays right at any batch size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from onnxtrain._portable.decompose import DECOMPOSITIONS, decompose
from onnxtrain._portable.emitter import Emitter, attr, label
from onnxtrain._portable.rules import CONSTANT_OPS, RULES
from onnxtrain._portable.shapes import as_tensor, check_example_sizes, example_values
from onnxtrain.errors import ExportError
from onnxtrain.proto import NodeProto, SparseTensorProto, TensorProto, ValueInfoProto
from onnxtrain.translate.registry import TRAINING_DOMAIN
from onnxtrain.translate.tensors import numpy_to_tensor

GRADIENT_DOMAINS = frozenset({TRAINING_DOMAIN, "ai.onnx.preview"})
# The ops the expansion writes need axes as inputs (ReduceSum, Squeeze, Split: opset 13) and
# ScatterND/ScatterElements with reduction="add" (opset 16).
MIN_OPSET = 16


def expand_gradients(nodes: Sequence[NodeProto],
                     initializers: Mapping[str, np.ndarray | TensorProto | SparseTensorProto],
                     inputs: Mapping[str, ValueInfoProto] | Sequence[ValueInfoProto], opset: int,
                     example_feeds: Mapping[str, np.ndarray], *,
                     keep_first: int = 0) -> tuple[list[NodeProto], list[TensorProto]]:
    """Replace every Gradient node by standard ai.onnx nodes computing the same outputs.

    Args:
        nodes: a flat, topologically ordered node list (the main graph's nodes followed by an
            algorithm graph's, as a training step combines them); onnx's or onnxtrain's NodeProto.
        initializers: name -> value of every initializer the nodes read (numpy, or a dense or
            sparse tensor proto of onnx or onnxtrain).
        inputs: the graph inputs (main, then algorithm), by name or as a list.
        opset: the default domain's opset version of the model (at least 16).
        example_feeds: a value for each input without an initializer; only ranks, dtypes and
            which axes broadcast are learnt from them, so an axis the inputs leave open (no
            dim_value) must not be 1 here.
        keep_first: the first `keep_first` nodes (the main graph, which must stay the inference
            graph) come back unchanged, first; composite ops among them that a gradient passes
            through are differentiated through a copy of their decomposition written right
            after them (it recomputes them, with its own output names).

    Returns:
        (the new node list, the initializers the new nodes need), as onnxtrain.proto messages.
        Forward nodes on a differentiated path (after the first `keep_first`) may be rewritten
        into primitives that write the same output names.

    Raises:
        ExportError: an op on a path from xs to y has no backward rule, the opset is too old,
            or a Gradient node's inputs are not the tensors its xs and zs name.

    Example:
        >>> new_nodes, new_initializers = expand_gradients(
        ...     [*model.graph.node, *algorithm.node], weights, [*model.graph.input, *algorithm.input],
        ...     21, {"x": x_batch, "labels": labels_batch})  # doctest: +SKIP
    """
    ours = [_as_ours(proto, NodeProto) for proto in nodes]
    if not any(_is_gradient(proto) for proto in ours):
        return ours, []
    if opset < MIN_OPSET:
        raise ExportError(f"portable export writes the backward in opset {MIN_OPSET} ops; the model "
                          f"imports opset {opset}: convert it (onnx.version_converter) first")
    tensors = {name: as_tensor(name, value) for name, value in initializers.items()}
    input_list = [_as_ours(v, ValueInfoProto) for v in (inputs.values() if isinstance(inputs, Mapping) else inputs)]
    check_example_sizes(input_list, example_feeds)
    taken = {*tensors, *(v.name for v in input_list), *(n for p in ours for n in [*p.input, *p.output])}

    values = example_values(_forward(ours), tensors, input_list, opset, example_feeds)
    e = Emitter(values, opset, taken)
    on_path = set()
    for proto in ours:
        if _is_gradient(proto):
            on_path |= set(map(id, _path(ours, proto, values)[0]))
    # Per node of `ours`, the nodes standing for it: itself or its decomposition, which the
    # backward differentiates; a kept node's decomposition is also copied, with its own output
    # names, to where the kept part ends.
    pieces: list[list[NodeProto]] = []
    copies: list[NodeProto] = []
    for index, proto in enumerate(ours):
        parts = decompose(e, proto) if id(proto) in on_path and proto.op_type in DECOMPOSITIONS else [proto]
        pieces.append(parts)
        if index < keep_first and parts != [proto]:
            copies.extend(_renamed_outputs(e, proto, parts))
    rewritten = [part for parts in pieces for part in parts]
    if len(rewritten) != len(ours):
        constants = {t.name: t for t in e.initializers}
        e.values = example_values(_forward(rewritten), {**tensors, **constants}, input_list, opset, example_feeds)
    expanded = [_backward(e, rewritten, parts[0]) if _is_gradient(parts[0]) else parts for parts in pieces]
    if not keep_first:
        return [part for parts in expanded for part in parts], e.initializers
    rest = [part for parts in expanded[keep_first:] for part in parts]
    copies = _live(copies, {name for part in rest for name in part.input})
    return [*ours[:keep_first], *copies, *rest], e.initializers


def _renamed_outputs(e: Emitter, proto: NodeProto, parts: list[NodeProto]) -> list[NodeProto]:
    """The decomposition of a kept node with the node's own output names replaced by fresh ones,
    so that it can run beside the node: the backward reads its intermediates (a MaxPool's
    Indices, a LayerNormalization's centered input), which equal the kept node's values."""
    e.scope = ""
    renamed = {name: e.fresh(f"{name}/recomputed") for name in proto.output if name}
    copies = []
    for part in parts:
        copy = NodeProto()
        copy.CopyFrom(part)
        copy.input[:] = [renamed.get(name, name) for name in part.input]
        copy.output[:] = [renamed.get(name, name) for name in part.output]
        if copy.name:
            copy.name = f"{copy.name}/recomputed"
        copies.append(copy)
    return copies


def _live(nodes: list[NodeProto], read: set[str]) -> list[NodeProto]:
    """`nodes` without those whose outputs nobody reads (directly or through kept ones)."""
    live: list[NodeProto] = []
    wanted = set(read)
    for proto in reversed(nodes):
        if wanted & set(proto.output):
            live.append(proto)
            wanted.update(proto.input)
    return live[::-1]


def _as_ours(message, kind):
    """`message` as onnxtrain.proto's `kind` (onnx's messages are wire compatible)."""
    if isinstance(message, kind):
        return message
    copy = kind()
    copy.ParseFromString(message.SerializeToString())
    return copy


def _is_gradient(proto: NodeProto) -> bool:
    return proto.op_type == "Gradient" and proto.domain in GRADIENT_DOMAINS


def _forward(nodes: Sequence[NodeProto]) -> list[NodeProto]:
    """The nodes that run before the gradients are known: neither Gradient nodes nor nodes
    reading their outputs (the optimizer and what follows)."""
    late: set[str] = set()
    forward = []
    for proto in nodes:
        if _is_gradient(proto) or late & set(proto.input):
            late.update(proto.output)
        else:
            forward.append(proto)
    return forward


def _names(nodes: Sequence[NodeProto], gradient: NodeProto) -> tuple[list[str], list[str], str]:
    """The Gradient node's xs, zs and y, checked against its inputs."""
    xs, zs, y = list(attr(gradient, "xs", [])), list(attr(gradient, "zs", [])), attr(gradient, "y")
    if gradient.domain == "ai.onnx.preview":
        # pytorch-pfn-extras names each x by an Identity copy of the node's input.
        copies = {p.output[0]: p.input[0] for p in nodes if p.op_type == "Identity" and p.input and p.output}
        given = list(gradient.input)
        xs = [given[i] if i < len(given) and copies.get(x) == given[i] else x for i, x in enumerate(xs)]
    if not isinstance(y, str) or list(gradient.input) != [*xs, *zs]:
        raise ExportError(f"portable export: {label(gradient)}: its inputs must be the tensors its xs and "
                          "zs name, in that order (a Gradient evaluated elsewhere cannot be expanded)")
    return xs, zs, y


def _path(nodes: Sequence[NodeProto], gradient: NodeProto,
          values: Mapping[str, np.ndarray]) -> tuple[list[NodeProto], set[str]]:
    """The nodes y depends on that depend on a float x (in graph order), and the names
    carrying a gradient (xs and those nodes' float outputs)."""
    xs, zs, y = _names(nodes, gradient)
    position = nodes.index(gradient)
    producers: dict[str, int] = {}
    for index, proto in enumerate(nodes[:position]):
        producers.update((name, index) for name in proto.output if name)
    cut, wanted, pending = set(xs) | set(zs), set(), [y]
    while pending:
        name = pending.pop()
        index = producers.get(name)
        if name in cut or index is None or index in wanted:
            continue
        wanted.add(index)
        pending.extend(n for n in nodes[index].input if n)
    tainted = {x for x in xs if _is_float(values.get(x))}
    path = []
    for index in sorted(wanted):
        proto = nodes[index]
        if proto.op_type in CONSTANT_OPS or not tainted & set(proto.input):
            continue
        if _is_gradient(proto):
            raise ExportError(f"portable export: {label(proto)} lies on the path of {label(gradient)}; "
                              "second-order gradients are not supported yet")
        outputs = {name for name in proto.output if name and name not in zs and _is_float(values.get(name))}
        if outputs:
            tainted |= outputs
            path.append(proto)
    return path, tainted


def _is_float(value: np.ndarray | None) -> bool:
    return value is not None and np.issubdtype(np.asarray(value).dtype, np.floating)


def _backward(e: Emitter, nodes: Sequence[NodeProto], gradient: NodeProto) -> list[NodeProto]:
    """The nodes computing the Gradient node's outputs."""
    xs, _, y = _names(nodes, gradient)
    path, tainted = _path(nodes, gradient, e.values)
    grads: dict[str, list[str]] = {}
    if y in tainted:
        e.scope = f"grad/{y}"
        if np.ndim(e.example(y)) == 0:
            seed = e.constant(np.ones((), e.dtype(y)), "seed")
        else:
            seed = e.add("ConstantOfShape", [e.shape(y)], "seed", value=numpy_to_tensor(np.ones(1, e.dtype(y))))
        grads[y] = [seed]
    for proto in reversed(path):
        incoming = [_total(e, name, grads.pop(name, [])) for name in proto.output]
        if all(g is None for g in incoming):
            continue
        rule = RULES.get(proto.op_type) if proto.domain in ("", "ai.onnx") else None
        if rule is None:
            raise ExportError(f"portable export: {label(proto)} lies between the xs and y={y!r} of "
                              f"{label(gradient)}, and portable export does not support the gradient of "
                              f"{proto.domain + '.' if proto.domain else ''}{proto.op_type} yet; name its "
                              "inputs in zs if they need no gradient")
        e.scope = f"grad/{proto.name or proto.output[0]}"
        needed = [bool(name) and name in tainted for name in proto.input]
        for name, g, want in zip(proto.input, rule(e, proto, incoming, needed), needed):
            if want and g is not None:
                grads.setdefault(name, []).append(g)
    for x, output in zip(xs, gradient.output):
        e.scope = f"grad/{x}"
        total = _total(e, x, grads.get(x, []))
        if total is None:  # y does not depend on x
            total = e.zeros_like(x, "zero")
        e.emit("Identity", [total], [output], f"grad/{x}/out")
    return e.take()


def _total(e: Emitter, name: str, parts: list[str]) -> str | None:
    """The sum of the gradient contributions reaching `name` (fan-out)."""
    if len(parts) <= 1:
        return parts[0] if parts else None
    e.scope = f"grad/{name}"
    return e.add("Sum", parts, "sum")
