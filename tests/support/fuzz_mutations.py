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


def nested_ifs(model: onnx.ModelProto, depth: int) -> bytes:
    """The model with its first main-graph node wrapped in `depth` nested If nodes, as bytes.

    Written at the wire level: building it with onnx.helper crashes protobuf (upb) past
    about 20 levels. The else branch is shallow, so the size grows linearly.
    """
    graph, rest = onnx.GraphProto(), onnx.ModelProto()
    graph.CopyFrom(model.graph)
    rest.CopyFrom(model)
    rest.ClearField("graph")
    first = graph.node[0]
    output, condition = first.output[0].encode(), graph.input[0].name.encode()
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


STRUCTURAL_MUTATIONS: list[Callable[[onnx.ModelProto, random.Random], None]] = [
    wrong_data_type, dims_disagree_with_data, absurd_dims, make_cycle, reorder_nodes, duplicate_output,
    dangling_input, dangling_output, extra_or_missing_inputs, drop_attributes, wrong_attribute_type,
    unknown_op, bad_opset, bad_ir_version, break_binding, drop_training_graph, wrong_value_type,
    break_function, huge_external_data, odd_external_numbers, overlong_external_location]


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


WIRE_MUTATIONS: list[Callable[[onnx.ModelProto, random.Random], bytes]] = [
    deep_nesting, invalid_utf8_external_data]


# ---------------------------------------------------------------------------
# Mutations for holes translate/ has yet to close (issue 32): run them with
# ONNXTRAIN_FUZZ_PENDING=1 until then, and move them into the lists above once
# they pass.


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


def deep_valid_nesting(model: onnx.ModelProto, rng: random.Random) -> bytes:
    """If nodes nested as deep as protobuf can parse: loads, then translation must cope."""
    if not model.graph.node or not model.graph.input:
        return model.SerializeToString()
    return nested_ifs(model, rng.choice([20, 25, 28, 30, 31]))


PENDING_TRANSLATE_MUTATIONS: dict[str, Callable] = {
    "long_node_chain": long_node_chain, "deep_valid_nesting": deep_valid_nesting}

if os.environ.get("ONNXTRAIN_FUZZ_PENDING") == "1":
    STRUCTURAL_MUTATIONS.append(long_node_chain)
    WIRE_MUTATIONS.append(deep_valid_nesting)


def mutation_names() -> list[str]:
    """Every mutation class mutated() may apply, by name."""
    return [m.__name__ for m in (*STRUCTURAL_MUTATIONS, *FOLDER_MUTATIONS, *WIRE_MUTATIONS)]


def mutated(model: onnx.ModelProto, rng: random.Random, count: int, folder: Path | None = None,
            classes: list[Callable] | None = None) -> tuple[onnx.ModelProto | bytes, list[str]]:
    """A copy of `model` with `count` random mutations, and their names.

    `classes` limits the choice (default: every structural mutation, plus the
    folder mutations when a folder is given, plus the wire ones). Folder
    mutations write under folder/fs, cleared first. A wire mutation, if drawn,
    is applied last, and the result is then bytes.
    """
    if classes is None:
        classes = [*STRUCTURAL_MUTATIONS, *(FOLDER_MUTATIONS if folder else []), *WIRE_MUTATIONS]
    if folder is not None:
        clear_mutation_folder(folder)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    applied: list[str] = []
    wire = None
    for _ in range(count):
        mutation = rng.choice(classes)
        if mutation in (*WIRE_MUTATIONS, deep_valid_nesting):
            wire = wire or mutation
        elif mutation in FOLDER_MUTATIONS:
            mutation(copy, rng, folder)
        else:
            mutation(copy, rng)
        applied.append(mutation.__name__)
    return (wire(copy, rng) if wire else copy), applied
