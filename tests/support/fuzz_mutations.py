"""Seed models and the mutations tests/io/test_fuzz_models.py applies to them.

Seeds are small valid models (built with onnx.helper, mostly by the repo's other test
factories) that between them reach every layer: inference graphs, If/Loop subgraphs, a
model-local function, external data and training_info with Gradient and optimizers.
Mutations break one thing each, the way a corrupt file or a buggy exporter would.
Byte mutations are cheap and only reach load_model; structural ones go all the way to
translation, compilation and training. Folder mutations also change the model's folder
(links, FIFOs, sub-folders under `folder/fs/`, and a file of OUTSIDE_PATTERN in the
sibling folder `outside/` that no load may ever return); wire mutations hand back bytes
protobuf's helpers could not build (nesting past its depth limit).
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.translate.graph import MAX_GRAPH_DEPTH
from support.model_factory import tensors_everywhere_model
from support.training_models import (INT64, TRAINING, algorithm_graph, gradient, linreg_model,
                                     make_training_model, tensor, training_node, value_info)

EXTERNAL_FILE = "weights.bin"
# Every file outside the model's folder is made of this; finding it in a loaded tensor is an escape.
OUTSIDE_PATTERN = b"OUTSIDE!"
OUTSIDE_SIZE = 4096
# Where folder mutations build what they point locations at, cleared before each mutant.
MUTATION_FOLDER = "fs"


@dataclass(frozen=True)
class Seed:
    """A valid model, and the folder its external data lives in (None when it has none)."""

    name: str
    model: onnx.ModelProto
    folder: Path | None = None


def mlp_model() -> onnx.ModelProto:
    """An inference MLP: MatMul, Add, Relu, MatMul."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W1"], ["h"], name="layer1"),
         helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
         helper.make_node("Relu", ["hb"], ["a"], name="relu"),
         helper.make_node("MatMul", ["a", "W2"], ["Y"], name="layer2")],
        "mlp", [value_info("X", shape=["N", 3])], [value_info("Y", shape=["N", 2])],
        initializer=[tensor("W1", rng.normal(size=(3, 4))), tensor("b1", np.zeros(4)),
                     tensor("W2", rng.normal(size=(4, 2)))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def control_flow_model() -> onnx.ModelProto:
    """If picks a branch, then a Loop adds the result to itself `trips` times."""
    then_graph = helper.make_graph([helper.make_node("Relu", ["X"], ["then_out"], name="then_relu")],
                                   "then", [], [value_info("then_out")])
    else_graph = helper.make_graph([helper.make_node("Neg", ["X"], ["else_out"], name="else_neg")],
                                   "else", [], [value_info("else_out")])
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep_going"),
         helper.make_node("Add", ["acc_in", "picked"], ["acc_out"], name="accumulate")],
        "body", [value_info("i", INT64, []), value_info("cond_in", TensorProto.BOOL, []), value_info("acc_in")],
        [value_info("cond_out", TensorProto.BOOL, []), value_info("acc_out")])
    graph = helper.make_graph(
        [helper.make_node("If", ["flag"], ["picked"], name="choose", then_branch=then_graph, else_branch=else_graph),
         helper.make_node("Loop", ["trips", "", "picked"], ["Y"], name="repeat", body=body)],
        "control_flow", [value_info("X", shape=[2, 3]), value_info("flag", TensorProto.BOOL, [])],
        [value_info("Y", shape=[2, 3])], initializer=[tensor("trips", 3, np.int64)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def external_data_model(folder: Path) -> onnx.ModelProto:
    """The MLP with W1 (3x4 float32) in folder/weights.bin."""
    model = mlp_model()
    weight = model.graph.initializer[0]
    (folder / EXTERNAL_FILE).write_bytes(weight.raw_data)
    weight.ClearField("raw_data")
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", EXTERNAL_FILE), ("offset", "0"), ("length", "48")):
        weight.external_data.add(key=key, value=value)
    return model


def adam_model() -> onnx.ModelProto:
    """A linear classifier trained with Adam on softmax cross-entropy, without initialization graph."""
    main = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["logits"], name="classify")], "linear",
                             [value_info("X", shape=["N", 3])], [value_info("logits", shape=["N", 2])],
                             initializer=[tensor("W", np.full((3, 2), 0.1))])
    state = ["W", "V_W", "H_W", "T"]
    nodes = [helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], reduction="mean"),
             gradient(["W"], "loss", zs=["X", "labels"]),
             training_node("Adam", ["LR", "T", "W", "dW", "V_W", "H_W"], ["W_new", "V_W_new", "H_W_new"]),
             helper.make_node("Add", ["T", "ONE"], ["T_new"])]
    initializer = [tensor("LR", 0.01), tensor("ONE", 1, np.int64), tensor("V_W", np.zeros((3, 2))),
                   tensor("H_W", np.zeros((3, 2))), tensor("T", 1, np.int64)]
    algorithm = algorithm_graph(nodes, ["loss"] + [f"{s}_new" for s in state],
                                [value_info("labels", INT64, ["N"])], initializer)
    return make_training_model(main, helper.make_training_info(algorithm, [(s, f"{s}_new") for s in state],
                                                               None, None))


SEED_MODELS: dict[str, Callable[[Path], onnx.ModelProto]] = {
    "mlp": lambda folder: mlp_model(),
    "control_flow": lambda folder: control_flow_model(),
    "function_and_training": lambda folder: tensors_everywhere_model(size=2),
    "external_data": external_data_model,
    "momentum": lambda folder: linreg_model("momentum"),
    "adagrad_dropout": lambda folder: linreg_model(dropout=True),
    "adam": lambda folder: adam_model(),
}


def seed(name: str, folder: Path) -> Seed:
    """The valid starting point `name`, its external data (if any) written to `folder`."""
    return Seed(name, SEED_MODELS[name](folder), folder if name == "external_data" else None)


# ---------------------------------------------------------------------------
# Byte mutations: what a corrupt download or disk does


def flip_bits(data: bytes, rng: random.Random) -> bytes:
    mutated = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
    return bytes(mutated)


def truncate(data: bytes, rng: random.Random) -> bytes:
    return data[:rng.randrange(len(data))]


def splice_random_bytes(data: bytes, rng: random.Random) -> bytes:
    at = rng.randrange(len(data))
    return data[:at] + rng.randbytes(rng.randint(1, 16)) + data[at + rng.randint(0, 16):]


def overwrite_varint(data: bytes, rng: random.Random) -> bytes:
    """A huge or negative varint where a length or number was: declared sizes past the data."""
    at = rng.randrange(len(data))
    huge = rng.choice([b"\xff\xff\xff\xff\x0f", b"\xff" * 9 + b"\x01", b"\x80\x80\x80\x80\x04"])
    return data[:at] + huge + data[at + 1:]


BYTE_MUTATIONS: list[Callable[[bytes, random.Random], bytes]] = [
    flip_bits, truncate, splice_random_bytes, overwrite_varint]


# ---------------------------------------------------------------------------
# Structural mutations: what a buggy exporter or a hand edit does


def all_graphs(model: onnx.ModelProto) -> list[onnx.GraphProto]:
    """Main graph, training graphs and every subgraph, in a fixed order."""
    found: list[onnx.GraphProto] = []

    def visit(graph: onnx.GraphProto) -> None:
        found.append(graph)
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.HasField("g"):
                    visit(attribute.g)
                for subgraph in attribute.graphs:
                    visit(subgraph)

    visit(model.graph)
    for info in model.training_info:
        for graph in (info.initialization, info.algorithm):
            if graph.node or graph.output:
                visit(graph)
    return found


def all_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    nodes = [node for graph in all_graphs(model) for node in graph.node]
    return nodes + [node for function in model.functions for node in function.node]


def all_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    tensors = [t for graph in all_graphs(model) for t in graph.initializer]
    for node in all_nodes(model):
        tensors += [attribute.t for attribute in node.attribute if attribute.HasField("t")]
    return tensors


def pick(items: list, rng: random.Random):
    return items[rng.randrange(len(items))] if items else None


def wrong_data_type(model: onnx.ModelProto, rng: random.Random) -> None:
    tensor = pick(all_tensors(model), rng)
    if tensor is not None:
        tensor.data_type = rng.choice([0, 2, 7, 8, 9, 11, 16, 17, 21, 23, 25, 26, 99, -3])


def dims_disagree_with_data(model: onnx.ModelProto, rng: random.Random) -> None:
    tensor = pick(all_tensors(model), rng)
    if tensor is not None:
        tensor.dims.append(rng.choice([0, 2, 3, 7]))


def absurd_dims(model: onnx.ModelProto, rng: random.Random) -> None:
    """Negative or enormous dims on a tensor or on a declared input/output shape."""
    dim = rng.choice([-1, -7, 2**40, 2**62, 2**31])
    tensor = pick(all_tensors(model), rng)
    if tensor is not None and rng.random() < 0.5:
        if tensor.dims:
            tensor.dims[rng.randrange(len(tensor.dims))] = dim
        else:
            tensor.dims.append(dim)
        return
    declared = pick([*model.graph.input, *model.graph.output], rng)
    shape = declared.type.tensor_type.shape
    if shape.dim:
        shape.dim[rng.randrange(len(shape.dim))].dim_value = dim
    else:
        shape.dim.add().dim_value = dim


def make_cycle(model: onnx.ModelProto, rng: random.Random) -> None:
    """The first node of a graph reads what a later node writes."""
    graph = pick([g for g in all_graphs(model) if len(g.node) >= 2 and g.node[0].input], rng)
    if graph is not None:
        later = graph.node[rng.randrange(1, len(graph.node))]
        graph.node[0].input[rng.randrange(len(graph.node[0].input))] = later.output[0]


def reorder_nodes(model: onnx.ModelProto, rng: random.Random) -> None:
    graph = pick([g for g in all_graphs(model) if len(g.node) >= 2], rng)
    if graph is not None:
        nodes = list(graph.node)
        rng.shuffle(nodes)
        del graph.node[:]
        graph.node.extend(nodes)


def duplicate_output(model: onnx.ModelProto, rng: random.Random) -> None:
    """Two nodes (or a node and an initializer or input) define one name: SSA broken."""
    graph = pick([g for g in all_graphs(model) if g.node], rng)
    if graph is None:
        return
    names = [n.output[0] for n in graph.node if n.output] + [t.name for t in graph.initializer]
    names += [v.name for v in graph.input]
    node = pick(list(graph.node), rng)
    if node.output and names:
        node.output[rng.randrange(len(node.output))] = pick(names, rng)


def dangling_input(model: onnx.ModelProto, rng: random.Random) -> None:
    node = pick([n for n in all_nodes(model) if n.input], rng)
    if node is not None:
        node.input[rng.randrange(len(node.input))] = rng.choice(["nowhere", "X ", "", "Y_pred_"])


def dangling_output(model: onnx.ModelProto, rng: random.Random) -> None:
    graph = pick([g for g in all_graphs(model) if g.output], rng)
    if graph is not None:
        graph.output[rng.randrange(len(graph.output))].name = "never_made"


def extra_or_missing_inputs(model: onnx.ModelProto, rng: random.Random) -> None:
    node = pick(all_nodes(model), rng)
    if node is None:
        return
    if node.input and rng.random() < 0.5:
        del node.input[rng.randrange(len(node.input)):]
    else:
        node.input.extend([node.input[0] if node.input else "", "nowhere"][: rng.randint(1, 2)])


def drop_attributes(model: onnx.ModelProto, rng: random.Random) -> None:
    node = pick([n for n in all_nodes(model) if n.attribute], rng)
    if node is not None:
        del node.attribute[rng.randrange(len(node.attribute))]


def wrong_attribute_type(model: onnx.ModelProto, rng: random.Random) -> None:
    """An attribute relabelled as another type, or given another type's value."""
    node = pick([n for n in all_nodes(model) if n.attribute], rng)
    if node is None:
        return
    attribute = node.attribute[rng.randrange(len(node.attribute))]
    if rng.random() < 0.5:
        # Only declared enumerators: protobuf refuses to set others (and drops them when parsing).
        attribute.type = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14])
        return
    name = attribute.name
    node.attribute.remove(attribute)
    value = rng.choice([1.5, 3, "text", [1, 2], [0.5], ["a", "b"], numpy_helper.from_array(np.ones(2, np.float32)),
                        helper.make_graph([], "empty", [], [])])
    node.attribute.append(helper.make_attribute(name, value))


def unknown_op(model: onnx.ModelProto, rng: random.Random) -> None:
    node = pick(all_nodes(model), rng)
    if node is not None:
        node.op_type = rng.choice(["NoSuchOp", "", "matmul", "Gradient", "Adam", "If"])
        node.domain = rng.choice([node.domain, "", "com.example", TRAINING, "local"])


def bad_opset(model: onnx.ModelProto, rng: random.Random) -> None:
    choice = rng.randrange(3)
    if choice == 0 and model.opset_import:
        model.opset_import[rng.randrange(len(model.opset_import))].version = rng.choice(
            [0, -1, 1, 6, 2**40, 10**6])
    elif choice == 1 and model.opset_import:
        del model.opset_import[rng.randrange(len(model.opset_import))]
    else:
        model.opset_import.add(domain=rng.choice(["", TRAINING]), version=rng.choice([3, 99]))


def bad_ir_version(model: onnx.ModelProto, rng: random.Random) -> None:
    model.ir_version = rng.choice([-1, 0, 1, 3, 99, 2**40])


def break_binding(model: onnx.ModelProto, rng: random.Random) -> None:
    """Binding keys that don't exist, values that aren't outputs, duplicate or empty keys."""
    if not model.training_info:
        model.training_info.add().update_binding.add(key="W1", value="nothing")
        return
    info = model.training_info[rng.randrange(len(model.training_info))]
    bindings = pick([b for b in (info.update_binding, info.initialization_binding) if b], rng)
    if bindings is None:
        info.initialization_binding.add(key="W", value="W")
        return
    entry = bindings[rng.randrange(len(bindings))]
    kind = rng.randrange(5)
    if kind == 0:
        entry.key = "no_such_initializer"
    elif kind == 1:
        entry.value = "not_an_output"
    elif kind == 2:
        bindings.add(key=entry.key, value=entry.value)
    elif kind == 3:
        entry.key = ""
    else:
        entry.value = pick([n.input[0] for n in info.algorithm.node if n.input], rng) or ""


def drop_training_graph(model: onnx.ModelProto, rng: random.Random) -> None:
    if model.training_info:
        info = model.training_info[rng.randrange(len(model.training_info))]
        info.ClearField(rng.choice(["algorithm", "initialization"]))


def wrong_value_type(model: onnx.ModelProto, rng: random.Random) -> None:
    """A declared input or output of an unknown or mismatched element type, or no type at all."""
    declared = pick([*model.graph.input, *model.graph.output], rng)
    if rng.random() < 0.3:
        declared.ClearField("type")
    else:
        declared.type.tensor_type.elem_type = rng.choice([0, 6, 8, 9, 11, 40, -2])


def break_function(model: onnx.ModelProto, rng: random.Random) -> None:
    if not model.functions:
        return
    function = model.functions[0]
    kind = rng.randrange(4)
    if kind == 0:
        function.node[0].op_type = function.name   # calls itself: unbounded recursion
        function.node[0].domain = function.domain
    elif kind == 1:
        del function.output[:]
    elif kind == 2:
        function.input.append("surplus")
    else:
        del function.opset_import[:]


def huge_external_data(model: onnx.ModelProto, rng: random.Random) -> None:
    tensor = pick([t for t in all_tensors(model) if t.data_location == TensorProto.EXTERNAL], rng)
    if tensor is None:
        return
    key = rng.choice(["length", "offset", "location"])
    value = {"length": rng.choice([str(2**40), str(2**62), "-5", "1e9", "48 "]),
             "offset": rng.choice([str(2**40), str(2**63), "-1", "0x10"]),
             "location": rng.choice(["../weights.bin", "/etc/passwd", "", "missing.bin", ".", "weights.bin\0"])}[key]
    for entry in tensor.external_data:
        if entry.key == key:
            entry.value = value
            return
    tensor.external_data.add(key=key, value=value)


def _varint(number: int) -> bytes:
    encoded = bytearray()
    while True:
        low, number = number & 0x7F, number >> 7
        encoded.append(low | (0x80 if number else 0))
        if not number:
            return bytes(encoded)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _graph_attribute(name: str, graph: bytes) -> bytes:
    """NodeProto.attribute {name, g, type: GRAPH}, as bytes."""
    attribute = _field(1, name.encode()) + _field(6, graph) + _varint(20 << 3) + _varint(onnx.AttributeProto.GRAPH)
    return _field(5, attribute)


def nested_ifs(model: onnx.ModelProto, depth: int, condition: str | None = None) -> bytes:
    """The model with its first main-graph node wrapped in `depth` nested If nodes, as bytes.

    Written at the wire level: building it with onnx.helper crashes protobuf (upb) past
    about 20 levels. The else branch is shallow, so the size grows linearly. The Ifs test
    `condition` (default: the first graph input, whatever its type).
    """
    graph, rest = onnx.GraphProto(), onnx.ModelProto()
    graph.CopyFrom(model.graph)
    rest.CopyFrom(model)
    rest.ClearField("graph")
    first = graph.node[0]
    output = first.output[0].encode()
    condition = (condition or graph.input[0].name).encode()
    declared_output = _field(12, _field(1, output))
    shallow = _field(1, onnx.helper.make_node("Identity", [graph.input[0].name], [first.output[0]])
                     .SerializeToString()) + _field(2, b"shallow") + declared_output
    node = first.SerializeToString()
    for level in range(depth):
        branch = _field(1, node) + _field(2, f"level{level}".encode()) + declared_output
        node = (_field(1, condition) + _field(2, output) + _field(3, f"if{level}".encode()) + _field(4, b"If")
                + _graph_attribute("then_branch", branch) + _graph_attribute("else_branch", shallow))
    del graph.node[0]
    return rest.SerializeToString() + _field(7, _field(1, node) + graph.SerializeToString())


def odd_external_numbers(model: onnx.ModelProto, rng: random.Random) -> None:
    """Offsets and lengths int() would take but a plain decimal reader would not."""
    tensor = pick([t for t in all_tensors(model) if t.data_location == TensorProto.EXTERNAL], rng)
    if tensor is None:
        tensor = _externalized(model, rng, EXTERNAL_FILE)
    if tensor is None:
        return
    key = rng.choice(["offset", "length"])
    value = rng.choice(["0_0", " 48 ", "+5", "+0", "٤٨", "４８", "⁴⁸", "\t0", "0\n", "", "00", "048",
                        "9" * 30, "9" * 5000, str(2**64), "0x0", "1e1", "48.0", "-0"])
    _set_entry(tensor, key, value)


def overlong_external_location(model: onnx.ModelProto, rng: random.Random) -> None:
    """Components and locations longer than the system takes, or very many components."""
    location = rng.choice(["x" * 256, "x" * 300, "sub/" + "x" * 300 + "/w.bin", "x" * 5000,
                           "a/" * 2500, "a/" * 2000 + "w.bin", "./" * 2040 + EXTERNAL_FILE,
                           "x" * 255, "é" * 200])
    tensor = pick([t for t in all_tensors(model) if t.data_location == TensorProto.EXTERNAL], rng)
    if tensor is None:
        tensor = _externalized(model, rng, location)
    if tensor is not None:
        _set_entry(tensor, "location", location)


def _set_entry(tensor: onnx.TensorProto, key: str, value: str) -> None:
    for entry in tensor.external_data:
        if entry.key == key:
            entry.value = value
            return
    tensor.external_data.add(key=key, value=value)


def _externalized(model: onnx.ModelProto, rng: random.Random, location: str) -> onnx.TensorProto | None:
    """A numeric initializer turned into a reference to `location` (its values dropped, their size kept)."""
    numeric = [t for g in all_graphs(model) for t in g.initializer
               if t.data_type in (TensorProto.FLOAT, TensorProto.INT64, TensorProto.DOUBLE)
               and t.data_location != TensorProto.EXTERNAL]
    tensor = pick(numeric, rng)
    if tensor is None:
        return None
    try:
        size = numpy_helper.to_array(tensor).nbytes
    except ValueError:  # another mutation already made dims and values disagree
        size = len(tensor.raw_data)
    for field in ("raw_data", "float_data", "int64_data", "double_data"):
        tensor.ClearField(field)
    del tensor.external_data[:]
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(size))):
        tensor.external_data.add(key=key, value=value)
    return tensor


# ---------------------------------------------------------------------------
# Structural mutations that break graph validation, depth and size bounds in translate/


def _subgraphs_with_scope(model: onnx.ModelProto) -> list[tuple[onnx.GraphProto, set[str]]]:
    """Every If/Loop/Scan subgraph, with the names its enclosing graphs define."""
    found: list[tuple[onnx.GraphProto, set[str]]] = []

    def visit(graph: onnx.GraphProto, outer: set[str]) -> None:
        scope = outer | {v.name for v in graph.input} | {t.name for t in graph.initializer}
        for node in graph.node:
            for attribute in node.attribute:
                for subgraph in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                    found.append((subgraph, set(scope)))
                    visit(subgraph, scope)
            scope |= {name for name in node.output if name}

    for top in [model.graph] + [g for info in model.training_info for g in (info.initialization, info.algorithm)]:
        visit(top, set())
    return found


def _rename_everywhere(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Rename what reads `old` in `graph` (its nodes, nested subgraphs, outputs) to `new`."""
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
        for attribute in node.attribute:
            for subgraph in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                _rename_everywhere(subgraph, old, new)
    for declared in graph.output:
        if declared.name == old:
            declared.name = new


def output_redefines_name(model: onnx.ModelProto, rng: random.Random) -> None:
    """A node's output, and what reads it, renamed to a graph input, an initializer or an
    earlier node's output: the graph is consistent except that one name is defined twice."""
    graph = pick([g for g in all_graphs(model) if any(any(n.output) for n in g.node)], rng)
    if graph is None:
        return
    defined = [v.name for v in graph.input] + [t.name for t in graph.initializer]
    options: dict[str, list[tuple[int, str]]] = {"input": [], "initializer": [], "earlier_output": []}
    for index, node in enumerate(graph.node):
        if any(node.output):
            options["input"] += [(index, v.name) for v in graph.input]
            options["initializer"] += [(index, t.name) for t in graph.initializer]
            options["earlier_output"] += [(index, name) for earlier in graph.node[:index]
                                          for name in earlier.output if name and name not in defined]
    kind = pick([kind for kind, pairs in options.items() if pairs], rng)
    if kind is None:
        return
    index, new = pick(options[kind], rng)
    node = graph.node[index]
    position = rng.choice([p for p, name in enumerate(node.output) if name])
    old = node.output[position]
    node.output[position] = new
    for later in graph.node[index + 1:]:
        later.input[:] = [new if name == old else name for name in later.input]
    for declared in graph.output:
        if declared.name == old:
            declared.name = new


def duplicate_initializer(model: onnx.ModelProto, rng: random.Random) -> None:
    """An initializer listed twice: the same values, or other values or dims under the same name."""
    graph = pick([g for g in all_graphs(model) if g.initializer], rng)
    if graph is None:
        return
    copy = graph.initializer.add()
    copy.CopyFrom(graph.initializer[rng.randrange(len(graph.initializer) - 1)])
    if rng.random() < 0.5:
        values = np.arange(rng.choice([1, 2, 6]), dtype=np.float32)
        copy.CopyFrom(numpy_helper.from_array(values, copy.name))
    if rng.random() < 0.5:  # the copy first, so order alone does not decide which one wins
        tensors = list(graph.initializer)
        del graph.initializer[:]
        graph.initializer.extend([tensors[-1], *tensors[:-1]])


def duplicate_graph_input(model: onnx.ModelProto, rng: random.Random) -> None:
    """A graph input declared twice, the second time as it was or with another type."""
    graph = pick([g for g in all_graphs(model) if g.input], rng)
    if graph is None:
        return
    copy = graph.input.add()
    copy.CopyFrom(graph.input[rng.randrange(len(graph.input) - 1)])
    if rng.random() < 0.5:
        copy.type.tensor_type.elem_type = rng.choice([TensorProto.INT64, TensorProto.BOOL, TensorProto.DOUBLE])


def empty_name(model: onnx.ModelProto, rng: random.Random) -> None:
    """A graph input, graph output, initializer or node output named '' (ONNX's "absent")."""
    graph = pick([g for g in all_graphs(model) if g.node], rng)
    if graph is None:
        return
    named = ([("input", v) for v in graph.input] + [("output", v) for v in graph.output]
             + [("initializer", t) for t in graph.initializer])
    choice = pick(named, rng)
    if choice is not None and rng.random() < 0.8:
        choice[1].name = ""
        return
    node = pick([n for n in graph.node if n.output], rng)
    if node is not None:
        node.output[rng.randrange(len(node.output))] = ""


def node_before_producer(model: onnx.ModelProto, rng: random.Random) -> None:
    """A node moved to just before the node that produces one of its inputs."""
    graphs = []
    for graph in all_graphs(model):
        producer = {name: index for index, node in enumerate(graph.node) for name in node.output if name}
        pairs = [(producer[name], index) for index, node in enumerate(graph.node) for name in node.input
                 if producer.get(name, index) < index]
        if pairs:
            graphs.append((graph, pairs))
    chosen = pick(graphs, rng)
    if chosen is None:
        return
    graph, pairs = chosen
    before, index = pick(pairs, rng)
    nodes = list(graph.node)
    moved = nodes.pop(index)
    nodes.insert(before, moved)
    del graph.node[:]
    graph.node.extend(nodes)


def subgraph_shadows_outer_name(model: onnx.ModelProto, rng: random.Random) -> None:
    """A subgraph node's output (and what reads it) renamed to a name an enclosing graph defines."""
    chosen = pick([(g, outer) for g, outer in _subgraphs_with_scope(model) if g.node and outer], rng)
    if chosen is None:
        return
    graph, outer = chosen
    node = pick([n for n in graph.node if any(n.output)], rng)
    if node is None:
        return
    position = rng.choice([p for p, name in enumerate(node.output) if name])
    old, new = node.output[position], rng.choice(sorted(outer))
    node.output[position] = new
    _rename_everywhere(graph, old, new)


IMPOSSIBLE_DIMS = [[0, 2**62], [2**62, 0], [0, 2**63 - 1], [0, 2**40, 2**40], [1] * 65, [1] * 100, [0] * 65]


def impossible_dims(model: onnx.ModelProto, rng: random.Random) -> None:
    """Dims no array can have even when the data agrees: [0, 2**62] (no elements), rank 65."""
    dims = rng.choice(IMPOSSIBLE_DIMS)
    numeric = [t for t in all_tensors(model) if t.data_type in (TensorProto.FLOAT, TensorProto.INT64,
                                                                   TensorProto.DOUBLE, TensorProto.BOOL)]
    tensor = pick(numeric, rng)
    if tensor is not None and rng.random() < 0.5:
        itemsize = helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        for field in ("raw_data", "float_data", "int64_data", "double_data", "int32_data"):
            tensor.ClearField(field)
        del tensor.dims[:]
        tensor.dims.extend(dims)
        # Data that agrees with the dims: none when a dim is 0, one element otherwise.
        tensor.raw_data = b"" if 0 in dims else bytes(itemsize)
        return
    declared = pick([v for g in all_graphs(model) for v in (*g.input, *g.output)], rng)
    if declared is not None:
        shape = declared.type.tensor_type.shape
        del shape.dim[:]
        for dim in dims:
            shape.dim.add().dim_value = dim


# Shapes no array can have: over int64 bytes, negative, rank 65.
IMPOSSIBLE_SHAPES = [[2**62], [2**31, 2**31], [2**40, 2**40, 2**40], [2**63 - 1], [0, 2**62], [-5], [-1, 2**40],
                     [1] * 65]
# Shapes an array can have, but larger than any machine's memory.
HUGE_SHAPES = [[2**20, 2**20, 2**20], [2**36], [2**20, 2**20]]


def huge_shape_constant(model: onnx.ModelProto, rng: random.Random) -> None:
    """A ConstantOfShape, Expand, Tile, Range or Reshape fed a huge (or negative, or rank 65)
    shape constant, its result a new graph output.

    Expand, Tile and Reshape (of a graph input or of a constant) get only shapes no array
    can have. Huge shapes that fit int64 go to ConstantOfShape and Range, which build their
    output from the shape alone: translation bounds what it builds on the host. (Expanded or
    tiled to such a shape, a tensor reaches XLA, which raises its own RESOURCE_EXHAUSTED
    when it allocates: left out of the default runs, see the fuzz corpus README.)
    """
    graph = model.graph
    op = rng.choice(["ConstantOfShape", "Expand", "Tile", "Range", "Reshape"])
    traced = bool(graph.input) and rng.random() < 0.5
    shape = rng.choice(IMPOSSIBLE_SHAPES + HUGE_SHAPES if op == "ConstantOfShape" else IMPOSSIBLE_SHAPES)
    name = f"huge_{op.lower()}"
    constants: list[onnx.TensorProto] = []
    if traced:
        source, rank = graph.input[0].name, len(graph.input[0].type.tensor_type.shape.dim)
        elem_type = graph.input[0].type.tensor_type.elem_type
    else:
        constants.append(tensor(f"{name}_data", np.ones((2, 3))))
        source, rank, elem_type = constants[0].name, 2, TensorProto.FLOAT
    if op == "Range":
        limit = rng.choice([2**62, 2**40, 2**63 - 1, -(2**62)])
        constants += [tensor(f"{name}_start", 0, np.int64), tensor(f"{name}_limit", limit, np.int64),
                      tensor(f"{name}_delta", rng.choice([1, -1, 0]), np.int64)]
        inputs, elem_type = [t.name for t in constants[-3:]], TensorProto.INT64
    else:
        if op == "Tile":  # one repeat per dimension of the input
            shape = (shape * rank)[:rank] if rank else shape
        constants.append(tensor(f"{name}_shape", np.array(shape, np.int64), np.int64))
        inputs = [constants[-1].name] if op == "ConstantOfShape" else [source, constants[-1].name]
        elem_type = TensorProto.FLOAT if op == "ConstantOfShape" else elem_type
    if rng.random() < 0.5:
        graph.initializer.extend(constants)
    else:  # the same constants as Constant nodes, which shape folding sees another way
        graph.node.extend(helper.make_node("Constant", [], [t.name], name=f"{t.name}_node", value=t)
                          for t in constants)
    graph.node.append(helper.make_node(op, inputs, [name], name=name))
    graph.output.append(helper.make_tensor_value_info(name, elem_type, None))


def _sparse(dense: onnx.TensorProto) -> onnx.SparseTensorProto:
    """`dense` as a sparse tensor that lists every element (flat indices 0..n-1)."""
    values = numpy_helper.to_array(dense).reshape(-1)
    return helper.make_sparse_tensor(numpy_helper.from_array(values, dense.name),
                                     numpy_helper.from_array(np.arange(values.size, dtype=np.int64)),
                                     list(dense.dims))


def broken_sparse_initializer(model: onnx.ModelProto, rng: random.Random) -> None:
    """A dense initializer made sparse, then one of its indices past the end or negative, one
    repeated, the indices of another rank, or fewer or more indices than values."""
    graph = pick([g for g in all_graphs(model) if any(t.data_type == TensorProto.FLOAT and t.dims
                                                       for t in g.initializer)], rng)
    if graph is None:
        return
    dense = pick([t for t in graph.initializer if t.data_type == TensorProto.FLOAT and t.dims
                  and t.data_location != TensorProto.EXTERNAL], rng)
    if dense is None:
        return
    try:
        sparse = _sparse(dense)
    except ValueError:  # another mutation already made dims and values disagree
        return
    graph.initializer.remove(dense)
    indices = numpy_helper.to_array(sparse.indices).copy()
    size = int(np.prod(dense.dims))
    kind = rng.choice(["past_end", "far_past_end", "negative", "duplicate", "too_few", "too_many", "rank"])
    if kind == "past_end":
        indices[-1] = size
    elif kind == "far_past_end":
        indices[rng.randrange(len(indices))] = rng.choice([2**40, 2**62, 2**63 - 1])
    elif kind == "negative":
        indices[rng.randrange(len(indices))] = rng.choice([-1, -size, -(2**63)])
    elif kind == "duplicate":
        indices[-1] = indices[0]
    elif kind == "too_few":
        indices = indices[:-1]
    elif kind == "too_many":
        indices = np.append(indices, [0, 1])
    else:  # coordinates of the wrong rank: [NNZ, rank + 1]
        indices = np.zeros((len(indices), len(dense.dims) + 1), np.int64)
    sparse.indices.CopyFrom(numpy_helper.from_array(indices))
    graph.sparse_initializer.append(sparse)


def repeat_past_depth_limit(model: onnx.ModelProto, rng: random.Random) -> None:
    """A node repeated in a chain (each copy reads the previous copy's first output) until the
    graph is deeper than translate's MAX_GRAPH_DEPTH: refused before anything compiles."""
    graph = pick([g for g in all_graphs(model) if any(n.input and n.output for n in g.node)], rng)
    if graph is None:
        return
    index = pick([i for i, n in enumerate(graph.node) if n.input and n.output and n.output[0]], rng)
    if index is None:
        return
    original = graph.node[index]
    old = original.output[0]
    copies = []
    previous = old
    for count in range(MAX_GRAPH_DEPTH + rng.choice([1, 2, 100])):
        copy = onnx.NodeProto()
        copy.CopyFrom(original)
        copy.name = f"{original.name or original.op_type}_again{count}"
        copy.input[0] = previous
        copy.output[:] = [f"{name}_again{count}" if name else "" for name in original.output]
        previous = copy.output[0]
        copies.append(copy)
    for later in graph.node[index + 1:]:
        later.input[:] = [previous if name == old else name for name in later.input]
    for declared in graph.output:
        if declared.name == old:
            declared.name = previous
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes[:index + 1] + copies + nodes[index + 1:])


STRUCTURAL_MUTATIONS: list[Callable[[onnx.ModelProto, random.Random], None]] = [
    wrong_data_type, dims_disagree_with_data, absurd_dims, make_cycle, reorder_nodes, duplicate_output,
    dangling_input, dangling_output, extra_or_missing_inputs, drop_attributes, wrong_attribute_type,
    unknown_op, bad_opset, bad_ir_version, break_binding, drop_training_graph, wrong_value_type,
    break_function, huge_external_data, odd_external_numbers, overlong_external_location,
    output_redefines_name, duplicate_initializer, duplicate_graph_input, empty_name, node_before_producer,
    subgraph_shadows_outer_name, impossible_dims, huge_shape_constant, broken_sparse_initializer,
    repeat_past_depth_limit]


# ---------------------------------------------------------------------------
# Folder mutations: what someone who can write into the model's folder does


def outside_file(folder: Path) -> Path:
    """A file beside the model's folder, made of OUTSIDE_PATTERN, that no load may read."""
    path = folder.parent / "outside" / "secret.bin"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(OUTSIDE_PATTERN * (OUTSIDE_SIZE // len(OUTSIDE_PATTERN)))
    return path


def clear_mutation_folder(folder: Path) -> None:
    """Remove what earlier folder mutations built (never the seed's own files)."""
    shutil.rmtree(folder / MUTATION_FOLDER, ignore_errors=True)


def _workspace(folder: Path, rng: random.Random) -> tuple[Path, str]:
    """A new empty sub-folder for one mutation, and its location relative to `folder`."""
    name = f"{MUTATION_FOLDER}/{rng.randrange(16**8):08x}"
    (folder / name).mkdir(parents=True, exist_ok=True)
    return folder / name, name


def _point_at(model: onnx.ModelProto, rng: random.Random, folder: Path, location: str) -> None:
    """Make an external tensor (or a newly externalized one) read from `location`."""
    tensor = pick([t for t in all_tensors(model) if t.data_location == TensorProto.EXTERNAL], rng)
    if tensor is None:
        _externalized(model, rng, location)
    else:
        _set_entry(tensor, "location", location)


def symlinked_external_location(model: onnx.ModelProto, rng: random.Random, folder: Path) -> None:
    """A location through a symbolic link: out (absolute, relative, via a folder), to a
    device, to a folder, dangling, or honestly inside."""
    work, name = _workspace(folder, rng)
    outside = outside_file(folder)
    up = "../" * (name.count("/") + 1)
    kind = rng.choice(["absolute_out", "relative_out", "folder_out", "folder_relative_out", "dev_zero",
                       "to_folder", "dangling", "inside", "absolute_inside", "root"])
    link, target = "w.bin", {
        "absolute_out": str(outside), "relative_out": f"{up}../outside/secret.bin",
        "folder_out": str(outside.parent), "folder_relative_out": f"{up}../outside",
        "dev_zero": "/dev/zero", "to_folder": ".", "dangling": "gone.bin",
        "inside": f"{up}{EXTERNAL_FILE}", "absolute_inside": str(folder / EXTERNAL_FILE), "root": "/",
    }[kind]
    os.symlink(target, work / link)
    location = f"{name}/{link}"
    if kind.startswith("folder"):
        location += "/secret.bin"
    _point_at(model, rng, folder, location)


def looping_external_location(model: onnx.ModelProto, rng: random.Random, folder: Path) -> None:
    """Links that never end: a -> a, a -> b -> a, a folder link to itself, 41 in a chain."""
    work, name = _workspace(folder, rng)
    kind = rng.randrange(4)
    if kind == 0:
        os.symlink("a", work / "a")
        location = "a"
    elif kind == 1:
        os.symlink("b", work / "a")
        os.symlink("a", work / "b")
        location = "a"
    elif kind == 2:
        os.symlink("d/", work / "d")
        location = "d/w.bin"
    else:
        previous = f"{'../' * (name.count('/') + 1)}{EXTERNAL_FILE}"
        for index in range(41):
            os.symlink(previous, work / f"l{index}")
            previous = f"l{index}"
        location = previous
    _point_at(model, rng, folder, f"{name}/{location}")


def fifo_external_location(model: onnx.ModelProto, rng: random.Random, folder: Path) -> None:
    """A FIFO (which a blocking open would wait on forever): directly, via a link, in a sub-folder."""
    work, name = _workspace(folder, rng)
    kind = rng.randrange(3)
    if kind == 0:
        os.mkfifo(work / "w.bin")
        location = "w.bin"
    elif kind == 1:
        os.mkfifo(work / "pipe")
        os.symlink("pipe", work / "w.bin")
        location = "w.bin"
    else:
        (work / "sub").mkdir()
        os.mkfifo(work / "sub" / "w.bin")
        location = "sub/w.bin"
    _point_at(model, rng, folder, f"{name}/{location}")


FOLDER_MUTATIONS: list[Callable[[onnx.ModelProto, random.Random, Path], None]] = [
    symlinked_external_location, looping_external_location, fifo_external_location]


# ---------------------------------------------------------------------------
# Wire mutations: models only the wire format can express; they return bytes


def deep_nesting(model: onnx.ModelProto, rng: random.Random) -> bytes:
    """The model inside If nodes nested just past protobuf's depth limit (33 for the seeds) and far past it."""
    if not model.graph.node or not model.graph.input:
        return model.SerializeToString()
    return nested_ifs(model, rng.choice([33, 34, 40, 100, 1000]))


def invalid_utf8_external_data(model: onnx.ModelProto, rng: random.Random) -> bytes:
    """An external_data key or value whose bytes are not UTF-8 (protobuf then hands back bytes)."""
    marker = b"\x01utf8\x01"
    tensor = pick([t for t in all_tensors(model) if t.data_location == TensorProto.EXTERNAL], rng)
    if tensor is None:
        tensor = _externalized(model, rng, marker.decode())
    if tensor is None:
        return model.SerializeToString()
    entry = tensor.external_data[rng.randrange(len(tensor.external_data))]
    if rng.random() < 0.5:
        entry.key = marker.decode()
    else:
        entry.value = marker.decode()
    return model.SerializeToString().replace(marker, rng.choice([b"\xff\xfe\xfd\xfc\xfb\xfa",
                                                                 b"\xc0\xaftf8\x01", b"\xed\xa0\x80ut\x01"]))


def deep_valid_nesting(model: onnx.ModelProto, rng: random.Random) -> bytes:
    """If nodes nested as deep as protobuf parses, on a boolean input of their own (so the
    model loads and translation traces every level), or on the first input as it is."""
    if not model.graph.node or not model.graph.input:
        return model.SerializeToString()
    condition = None
    if rng.random() < 0.75:
        condition = "nesting_flag"
        model.graph.input.append(helper.make_tensor_value_info(condition, TensorProto.BOOL, []))
    return nested_ifs(model, rng.choice([20, 25, 28, 30, 31]), condition)


WIRE_MUTATIONS: list[Callable[[onnx.ModelProto, random.Random], bytes]] = [
    deep_nesting, invalid_utf8_external_data, deep_valid_nesting]


# ---------------------------------------------------------------------------
# Mutations that cost too much to draw at random: each has its own test


def long_node_chain(model: onnx.ModelProto, rng: random.Random) -> None:
    """30,000 Identity nodes between the main graph's first input and its first consumer."""
    graph = model.graph
    if not graph.input or not graph.node:
        return
    source = graph.input[0].name
    previous = source
    for index in range(30_000):
        graph.node.add(op_type="Identity", input=[previous], output=[f"chain{index}"], name=f"chain{index}")
        previous = f"chain{index}"
    for node in graph.node[:-30_000]:
        for position, name in enumerate(node.input):
            if name == source:
                node.input[position] = previous
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes[-30_000:] + nodes[:-30_000])


def mutation_names() -> list[str]:
    """Every mutation class mutated() may apply, by name."""
    return [m.__name__ for m in (*STRUCTURAL_MUTATIONS, *FOLDER_MUTATIONS, *WIRE_MUTATIONS)]


def mutated(model: onnx.ModelProto, rng: random.Random, count: int, folder: Path | None = None,
            classes: list[Callable] | None = None,
            first: Callable | None = None) -> tuple[onnx.ModelProto | bytes, list[str]]:
    """A copy of `model` with `count` random mutations, and their names.

    `classes` limits the choice (default: every structural mutation, plus the
    folder mutations when a folder is given, plus the wire ones); `first`, when
    given, is the first of the `count` (so a caller can cycle through the classes).
    Folder mutations write under folder/fs, cleared first. A wire mutation, if
    drawn, is applied last, and the result is then bytes.
    """
    if classes is None:
        classes = [*STRUCTURAL_MUTATIONS, *(FOLDER_MUTATIONS if folder else []), *WIRE_MUTATIONS]
    if folder is not None:
        clear_mutation_folder(folder)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    applied: list[str] = []
    wire = None
    for index in range(count):
        mutation = first if first is not None and index == 0 else rng.choice(classes)
        if mutation in WIRE_MUTATIONS:
            wire = wire or mutation
        elif mutation in FOLDER_MUTATIONS:
            mutation(copy, rng, folder)
        else:
            mutation(copy, rng)
        applied.append(mutation.__name__)
    return (wire(copy, rng) if wire else copy), applied
