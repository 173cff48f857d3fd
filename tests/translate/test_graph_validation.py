"""Graph validation (translate.validation): the IR spec's naming rules, for inference and training.

A graph that breaks them used to run and answer wrongly (the last of two writers won, a node
output replaced a graph input, an output named '' came back as None). Each broken graph must
now be refused before anything runs, with a ModelLoadError naming the graph, the node (name and
op) and the value; each legal neighbour (an overridable initializer, outer names read by a
subgraph, names reused in sibling subgraphs, a subgraph input shadowing an outer name) must keep
running and give onnx's reference answer.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxtrain
from onnxtrain import load_model
from onnxtrain.errors import BindingError, ModelLoadError
from onnxtrain.translate.model import TranslatedModel

FLOAT, BOOL, INT64 = TensorProto.FLOAT, TensorProto.BOOL, TensorProto.INT64
X = np.array([1.0, 2.0, 3.0], np.float32)


def value(name: str, elem_type: int = FLOAT, shape: list | None = (3,)) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, None if shape is None else list(shape))


def initializer(name: str, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array, np.float32), name)


def model(nodes: list, inputs: list, outputs: list, initializers: list = (), name: str = "g",
          functions: list = (), ir_version: int = 9) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, list(initializers))
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("local", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=ir_version, functions=list(functions))


def translate(proto: onnx.ModelProto) -> TranslatedModel:
    return TranslatedModel(load_model(proto.SerializeToString()))


def refused(proto: onnx.ModelProto, *names: str) -> str:
    """The ModelLoadError message translating `proto` raises; it names every one of `names`."""
    with pytest.raises(ModelLoadError) as error:
        translate(proto)
    message = str(error.value)
    for name in names:
        assert name in message, message
    return message


def reference(proto: onnx.ModelProto, feeds: dict) -> list:
    return ReferenceEvaluator(proto).run(None, feeds)


def if_node(condition: str, then_nodes: list, then_outputs: list, else_nodes: list, else_outputs: list,
            outputs: list, name: str = "choose") -> onnx.NodeProto:
    then_branch = helper.make_graph(then_nodes, "then", [], then_outputs)
    else_branch = helper.make_graph(else_nodes, "else", [], else_outputs)
    return helper.make_node("If", [condition], outputs, name=name, then_branch=then_branch,
                            else_branch=else_branch)


# --- Definitions: every name once ---------------------------------------------------------


def test_a_node_output_reusing_a_graph_input_is_refused():
    proto = model([helper.make_node("Relu", ["X"], ["X"], name="relu")], [value("X")], [value("X")])
    message = refused(proto, "'relu' (Relu)", "'X'", "graph 'g'")
    assert "input" in message


def test_a_node_output_reusing_an_initializer_is_refused():
    proto = model([helper.make_node("Add", ["X", "W"], ["W"], name="add")], [value("X")], [value("W")],
                  [initializer("W", [1, 1, 1])])
    message = refused(proto, "'add' (Add)", "'W'", "graph 'g'")
    assert "initializer" in message


def test_two_nodes_writing_one_name_are_refused():
    """The last writer used to win silently."""
    proto = model([helper.make_node("Relu", ["X"], ["Y"], name="first"),
                   helper.make_node("Neg", ["X"], ["Y"], name="second")], [value("X")], [value("Y")])
    message = refused(proto, "'second' (Neg)", "'Y'", "'first' (Relu)")
    assert "SSA" in message


def test_one_node_writing_a_name_twice_is_refused():
    proto = model([helper.make_node("Split", ["X"], ["Y", "Y"], name="split", num_outputs=2)],
                  [value("X", shape=(4,))], [value("Y", shape=(2,))])
    refused(proto, "'split' (Split)", "'Y'")


def test_an_unnamed_node_is_named_by_its_op():
    proto = model([helper.make_node("Relu", ["X"], ["Y"]), helper.make_node("Neg", ["X"], ["Y"])],
                  [value("X")], [value("Y")])
    refused(proto, "unnamed Neg node", "'Y'")


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "dense-and-sparse"])
def test_duplicate_initializers_are_refused(sparse: bool):
    second = initializer("W", [2, 2, 2])
    proto = model([helper.make_node("Add", ["X", "W"], ["Y"])], [value("X")], [value("Y")],
                  [initializer("W", [1, 1, 1])] + ([] if sparse else [second]))
    if sparse:
        proto.graph.sparse_initializer.append(helper.make_sparse_tensor(
            numpy_helper.from_array(np.array([5.0], np.float32), "W"),
            numpy_helper.from_array(np.array([1], np.int64)), [3]))
    message = refused(proto, "'W'", "graph 'g'")
    assert "initializer" in message


def test_duplicate_graph_inputs_are_refused():
    proto = model([helper.make_node("Add", ["X", "X"], ["Y"])], [value("X"), value("X")], [value("Y")])
    refused(proto, "'X'", "graph 'g'")


def test_an_input_listed_twice_beside_its_initializer_is_refused():
    proto = model([helper.make_node("Add", ["X", "W"], ["Y"])], [value("X"), value("W"), value("W")],
                  [value("Y")], [initializer("W", [1, 1, 1])])
    refused(proto, "'W'")


def test_an_initializer_that_is_also_an_input_is_an_overridable_default():
    """IR < 4 style: legal; the feed overrides the initializer, its absence keeps it."""
    proto = model([helper.make_node("Add", ["X", "W"], ["Y"])], [value("X"), value("W")], [value("Y")],
                  [initializer("W", [10, 20, 30])], ir_version=3)
    fn = translate(proto)
    assert fn.input_names == ["X"]
    np.testing.assert_allclose(np.asarray(fn(fn.params, {"X": X})["Y"]), X + [10, 20, 30])
    override = np.array([-1, -2, -3], np.float32)
    np.testing.assert_allclose(np.asarray(fn(fn.params, {"X": X, "W": override})["Y"]), X + override)
    (expected,) = reference(proto, {"X": X})
    np.testing.assert_allclose(np.asarray(onnxtrain.run(proto.SerializeToString(), {"X": X})["Y"]), expected)


# --- Empty names ---------------------------------------------------------------------------


def test_a_graph_output_named_empty_is_refused():
    """It used to come back as None."""
    proto = model([helper.make_node("Relu", ["X"], ["Y"])], [value("X")], [value("Y"), value("")])
    message = refused(proto, "graph 'g'")
    assert "output" in message and "empty name" in message


def test_a_graph_input_named_empty_is_refused():
    proto = model([helper.make_node("Relu", ["X"], ["Y"])], [value("X"), value("")], [value("Y")])
    assert "input" in refused(proto, "graph 'g'")


def test_an_initializer_named_empty_is_refused():
    proto = model([helper.make_node("Relu", ["X"], ["Y"])], [value("X")], [value("Y")],
                  [initializer("", [1, 2, 3])])
    assert "initializer" in refused(proto, "graph 'g'")


def test_an_empty_node_input_is_an_omitted_optional_one():
    """Clip with its min left out ('') and max given: legal, and onnx's answer."""
    proto = model([helper.make_node("Clip", ["X", "", "M"], ["Y"])], [value("X")], [value("Y")],
                  [numpy_helper.from_array(np.array(2.5, np.float32), "M")])
    fn = translate(proto)
    (expected,) = reference(proto, {"X": X})
    np.testing.assert_allclose(np.asarray(fn(fn.params, {"X": X})["Y"]), expected)


# --- Reads: only after the definition --------------------------------------------------------


def test_a_node_reading_a_later_name_is_refused():
    proto = model([helper.make_node("Relu", ["T"], ["Y"], name="early"),
                   helper.make_node("Neg", ["X"], ["T"], name="late")], [value("X")], [value("Y")])
    message = refused(proto, "'early' (Relu)", "'T'", "graph 'g'")
    assert "topological" in message


def test_a_node_reading_an_undefined_name_is_refused():
    proto = model([helper.make_node("Relu", ["ghost"], ["Y"], name="reader")], [value("X")], [value("Y")])
    refused(proto, "'reader' (Relu)", "'ghost'")


def test_a_graph_output_never_computed_is_refused():
    proto = model([helper.make_node("Relu", ["X"], ["Y"])], [value("X")], [value("Y"), value("Z")])
    message = refused(proto, "'Z'", "graph 'g'")
    assert "never computed" in message


def test_onnxtrain_run_refuses_an_invalid_graph():
    proto = model([helper.make_node("Relu", ["X"], ["Y"], name="first"),
                   helper.make_node("Neg", ["X"], ["Y"], name="second")], [value("X")], [value("Y")])
    with pytest.raises(ModelLoadError, match=r"'second' \(Neg\).*'Y'"):
        onnxtrain.run(proto.SerializeToString(), {"X": X})


# --- Subgraphs: outer names are visible, never redefined --------------------------------------


def choose(then_nodes: list, else_nodes: list, outer: list | None = None, after: list = ()) -> onnx.ModelProto:
    """Y = If(C) with branches writing then/else outputs T and E; `outer` nodes run before it."""
    nodes = [*(outer or [helper.make_node("Neg", ["X"], ["N"], name="negate")]),
             if_node("C", then_nodes, [value("T")], else_nodes, [value("E")], ["Y"]), *after]
    return model(nodes, [value("X"), value("C", BOOL, ())], [value("Y")])


def test_a_subgraph_node_redefining_an_outer_name_is_refused():
    proto = choose([helper.make_node("Relu", ["X"], ["N"], name="inner"),
                    helper.make_node("Identity", ["N"], ["T"])],
                   [helper.make_node("Identity", ["N"], ["E"])])
    message = refused(proto, "'inner' (Relu)", "'N'", "graph 'then'", "'choose' (If)", "graph 'g'")
    assert "SSA" in message


def test_a_subgraph_node_redefining_an_outer_graph_input_is_refused():
    proto = choose([helper.make_node("Relu", ["N"], ["X"], name="inner"),
                    helper.make_node("Identity", ["X"], ["T"])],
                   [helper.make_node("Identity", ["N"], ["E"])])
    refused(proto, "'inner' (Relu)", "'X'", "graph 'then'")


def test_a_subgraph_reading_an_outer_name_defined_after_its_node_is_refused():
    proto = choose([helper.make_node("Identity", ["L"], ["T"], name="too_early")],
                   [helper.make_node("Identity", ["X"], ["E"])],
                   after=[helper.make_node("Neg", ["X"], ["L"], name="later")])
    refused(proto, "'too_early' (Identity)", "'L'", "graph 'then'")


def test_a_subgraph_output_never_computed_is_refused():
    proto = choose([helper.make_node("Identity", ["X"], ["T"])], [helper.make_node("Identity", ["X"], ["F"])])
    refused(proto, "'E'", "graph 'else'")


def test_a_subgraph_node_output_named_twice_inside_it_is_refused():
    proto = choose([helper.make_node("Relu", ["X"], ["T"], name="one"),
                    helper.make_node("Neg", ["X"], ["T"], name="two")],
                   [helper.make_node("Identity", ["X"], ["E"])])
    refused(proto, "'two' (Neg)", "'T'", "graph 'then'")


def test_a_nested_subgraph_is_checked_with_every_enclosing_scope():
    """An If inside the then branch: its node redefines a name of the outermost graph."""
    inner = if_node("C", [helper.make_node("Relu", ["X"], ["N"], name="deep"),
                          helper.make_node("Identity", ["N"], ["TT"])], [value("TT")],
                    [helper.make_node("Identity", ["X"], ["EE"])], [value("EE")], ["T"], name="inner_if")
    proto = choose([inner], [helper.make_node("Identity", ["X"], ["E"])])
    refused(proto, "'deep' (Relu)", "'N'", "'inner_if' (If)", "'choose' (If)")


def test_legal_scoping_runs_and_matches_the_reference():
    """Branches read outer names (N, X) and define the same local name (S) in both; valid."""
    proto = choose([helper.make_node("Add", ["N", "X"], ["S"]), helper.make_node("Relu", ["S"], ["T"])],
                   [helper.make_node("Mul", ["N", "X"], ["S"]), helper.make_node("Neg", ["S"], ["E"])])
    fn = translate(proto)
    for condition in (True, False):
        feeds = {"X": X, "C": np.array(condition)}
        (expected,) = reference(proto, feeds)
        np.testing.assert_allclose(np.asarray(fn(fn.params, feeds)["Y"]), expected)


def test_a_subgraph_input_may_shadow_an_outer_name():
    """A Loop body whose carried input is named like an outer value: its own value wins
    (ONNX's checker allows it; the spec forbids only node outputs that shadow). onnxruntime is
    the oracle: onnx's ReferenceEvaluator reads the outer value instead."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond"], ["cond_out"]), helper.make_node("Add", ["N", "N"], ["N_out"])],
        "body", [value("i", INT64, ()), value("cond", BOOL, ()), value("N")], [value("cond_out", BOOL, ()), value("N_out")])
    nodes = [helper.make_node("Neg", ["X"], ["N"]),
             helper.make_node("Constant", [], ["M"], value=numpy_helper.from_array(np.array(3, np.int64))),
             helper.make_node("Loop", ["M", "", "X"], ["Y"], body=body)]
    proto = model(nodes, [value("X")], [value("Y")])
    onnx.checker.check_model(proto, full_check=True)
    fn = translate(proto)
    (expected,) = onnxruntime.InferenceSession(proto.SerializeToString()).run(None, {"X": X})
    np.testing.assert_allclose(np.asarray(fn(fn.params, {"X": X})["Y"]), expected)
    np.testing.assert_allclose(expected, X * 8)


def test_a_function_body_is_checked_too():
    function = helper.make_function(
        "local", "Twice", ["A"], ["B"],
        [helper.make_node("Relu", ["A"], ["B"], name="f1"), helper.make_node("Neg", ["A"], ["B"], name="f2")],
        [helper.make_opsetid("", 18)])
    proto = model([helper.make_node("Twice", ["X"], ["Y"], domain="local", name="call")], [value("X")],
                  [value("Y")], functions=[function])
    refused(proto, "'f2' (Neg)", "'B'", "local::Twice", "'call'")


def test_a_valid_function_body_still_runs():
    function = helper.make_function(
        "local", "ReluNeg", ["A"], ["B"],
        [helper.make_node("Relu", ["A"], ["R"]), helper.make_node("Neg", ["R"], ["B"])],
        [helper.make_opsetid("", 18)])
    proto = model([helper.make_node("ReluNeg", ["X"], ["Y"], domain="local")], [value("X")], [value("Y")],
                  functions=[function])
    fn = translate(proto)
    (expected,) = reference(proto, {"X": -X})
    np.testing.assert_allclose(np.asarray(fn(fn.params, {"X": -X})["Y"]), expected)


# --- The trainer's check is the same one ---------------------------------------------------


def training_model(algorithm_nodes: list) -> onnx.ModelProto:
    """Y = X * W (W trained); the algorithm's nodes end in an output `loss`."""
    main = helper.make_graph([helper.make_node("Mul", ["X", "W"], ["Y"], name="scale")], "main",
                             [value("X")], [value("Y")], [initializer("W", [1, 1, 1])])
    algorithm = helper.make_graph(algorithm_nodes, "algorithm", [value("C", BOOL, ())],
                                  [value("loss", FLOAT, ())])
    proto = helper.make_model(main, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    proto.training_info.append(helper.make_training_info(algorithm, [], None, []))
    return proto


def test_the_trainer_refuses_a_subgraph_redefining_a_main_graph_name():
    """A branch of an If in the algorithm writes Y, a main-graph node's output."""
    bad_if = if_node("C", [helper.make_node("Neg", ["X"], ["Y"], name="shadow"),
                           helper.make_node("ReduceSum", ["Y"], ["T"], keepdims=0)], [value("T", FLOAT, ())],
                     [helper.make_node("ReduceSum", ["Y"], ["E"], keepdims=0)], [value("E", FLOAT, ())], ["loss"])
    with pytest.raises(BindingError) as error:
        onnxtrain.Trainer(training_model([bad_if]))
    message = str(error.value)
    for part in ("training_info[0]", "'shadow' (Neg)", "'Y'", "'scale' (Mul)", "graph 'then'"):
        assert part in message, message


def test_the_trainer_accepts_a_subgraph_reading_main_graph_names():
    good_if = if_node("C", [helper.make_node("ReduceSum", ["Y"], ["T"], keepdims=0)], [value("T", FLOAT, ())],
                      [helper.make_node("ReduceMax", ["Y"], ["E"], keepdims=0)], [value("E", FLOAT, ())], ["loss"])
    trainer = onnxtrain.Trainer(training_model([good_if]))
    outputs = trainer.step({"X": X, "C": np.array(True)})
    np.testing.assert_allclose(float(np.asarray(outputs["loss"])), float(X.sum()))
