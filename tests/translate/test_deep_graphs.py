"""Deep graphs: refused before compiling, never a crash; Sum of many inputs as a balanced tree.

A 30,000-node Add chain (740 KiB) or a Sum of 30,000 inputs used to kill the process inside
XLA's compiler, which recurses along chains of dependent operations on the C stack. A model
deeper than MAX_GRAPH_DEPTH is now refused with an UnsupportedOpError naming its depth and the
limit; Sum, Max, Min and Mean reduce as a balanced tree (depth log2 n). Anything that compiles
a deep program runs in a subprocess (deep_graph_worker.py), so a crash fails the test only.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import load_model
from onnxtrain.errors import UnsupportedOpError
from onnxtrain.translate.graph import MAX_GRAPH_DEPTH, plan_depth
from onnxtrain.translate.model import TranslatedModel
from onnxtrain.translate.ops.elementwise import balanced

WORKER = Path(__file__).resolve().parent / "deep_graph_worker.py"
FLOAT, BOOL = TensorProto.FLOAT, TensorProto.BOOL


def worker(kind: str, n: int, timeout: float = 600) -> dict:
    """The worker's JSON line; the test fails (rather than pytest dying) if the worker crashes."""
    done = subprocess.run([sys.executable, "-X", "faulthandler", str(WORKER), kind, str(n)],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"the worker exited with {done.returncode}:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def value(name: str, elem_type: int = FLOAT, shape: list | None = None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def translate(nodes: list, inputs: list, output: str = "Y") -> TranslatedModel:
    graph = helper.make_graph(nodes, "deep", inputs, [value(output)],
                              [numpy_helper.from_array(np.float32(1.0), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    return TranslatedModel(load_model(model.SerializeToString()))


def chain(n: int, start: str = "X", output: str = "Y", prefix: str = "v") -> list:
    names = [start, *(f"{prefix}{i}" for i in range(1, n)), output]
    return [helper.make_node("Add", [names[i], "W"], [names[i + 1]]) for i in range(n)]


# --- The depth, worked out before compiling ----------------------------------------------------


def test_the_depth_of_a_chain_is_its_length_and_of_parallel_chains_the_longest():
    fn = translate([*chain(7, output="A", prefix="a"), *chain(3, output="B", prefix="b"),
                    helper.make_node("Add", ["A", "B"], ["Y"])], [value("X")])
    assert plan_depth(fn.plan) == 8


def test_a_subgraph_adds_its_depth_to_its_node():
    """An If whose then branch is a 5-node chain reading the 2-node chain before it: 2 + 1 + 5."""
    then_branch = helper.make_graph(chain(5, start="P", output="T", prefix="t"), "then", [], [value("T")])
    else_branch = helper.make_graph([helper.make_node("Neg", ["P"], ["E"])], "else", [], [value("E")])
    nodes = [*chain(2, output="P", prefix="p"),
             helper.make_node("If", ["C"], ["Y"], then_branch=then_branch, else_branch=else_branch)]
    assert plan_depth(translate(nodes, [value("X"), value("C", BOOL, [])]).plan) == 8


def test_a_chain_over_the_limit_is_refused_naming_depth_and_limit():
    """Refused while translating, so nothing compiles: safe in this process."""
    n = MAX_GRAPH_DEPTH + 1
    with pytest.raises(UnsupportedOpError) as error:
        translate(chain(n), [value("X")])
    message = str(error.value)
    assert f"{n} nodes" in message and str(MAX_GRAPH_DEPTH) in message and "'deep'" in message


@pytest.mark.parametrize("count", [1, 2, 3, 7, 8, 1000])
def test_balanced_combines_every_value_once(count: int):
    values = [np.array([2.0**i]) for i in range(count)]
    np.testing.assert_array_equal(balanced(np.add, values), np.sum(values, axis=0))
    assert balanced(lambda a, b: f"({a}+{b})", [str(i) for i in range(count)]).count("+") == count - 1


def test_a_balanced_sum_broadcasts_like_the_chain():
    values = [np.ones((2, 1, 3)), np.arange(4.0).reshape(4, 1), np.array(5.0)]
    np.testing.assert_array_equal(balanced(np.add, values), values[0] + values[1] + values[2])


# --- In a subprocess: what used to crash -------------------------------------------------------


@pytest.mark.slow
def test_a_30000_node_add_chain_is_refused_not_a_crash():
    result = worker("add-chain", 30_000)
    assert result["outcome"] == "UnsupportedOpError", result
    assert "30000 nodes" in result["message"] and str(MAX_GRAPH_DEPTH) in result["message"]


@pytest.mark.slow
def test_a_sum_of_30000_inputs_runs():
    result = worker("sum", 30_000)
    assert result["outcome"] == "ok", result
    np.testing.assert_allclose(result["Y"], np.array([1.0, 2.0, 3.0]) * 30_000)


@pytest.mark.slow
def test_a_chain_at_the_limit_compiles_and_runs():
    """The deepest model onnxtrain accepts compiles, with the right answer."""
    result = worker("add-chain", MAX_GRAPH_DEPTH)
    assert result["outcome"] == "ok", result
    np.testing.assert_allclose(result["Y"], np.array([1.0, 2.0, 3.0]) + MAX_GRAPH_DEPTH)
