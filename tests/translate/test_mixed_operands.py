"""Nodes that mix constant operands with values computed from the graph inputs.

A constant (an initializer that is not a parameter, or a Constant node) reaches an op handler
folded on the host; a value computed from a graph input is traced. RoBERTa's exports gather
from a constant integer table at positions computed from the input ids, which failed while
tracing. Oracles: onnxruntime for values, gradients derived by hand, torch for the RoBERTa
weights (through onnxruntime running the exports).
"""

from __future__ import annotations

import io

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import optim

RNG = np.random.default_rng(7)
X = RNG.standard_normal((4, 3)).astype(np.float32)
TABLE = RNG.integers(-5, 6, (4, 3)).astype(np.int64)
FLOATS = RNG.standard_normal((4, 3)).astype(np.float32)


def _model(nodes: list, constants: dict[str, np.ndarray], source: str, outputs: list[str],
           inputs: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """A graph with input x (float [4, 3]) whose `constants` come from initializers or Constant nodes."""
    inputs = {"x": X} if inputs is None else inputs
    initializers = []
    if source == "initializer":
        initializers = [numpy_helper.from_array(value, name) for name, value in constants.items()]
    else:
        nodes = [helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value))
                 for name, value in constants.items()] + nodes
    graph = helper.make_graph(
        nodes, "mixed",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for n, v in inputs.items()],
        [onnx.ValueInfoProto(name=name) for name in outputs],
        initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


# Indices computed from x: the position of each row's largest entry, and those positions
# as [row, column] pairs; negative variants count from the end.
_POSITIONS = [helper.make_node("ArgMax", ["x"], ["col"], axis=1, keepdims=1)]
_PAIRS = _POSITIONS + [
    helper.make_node("Constant", [], ["rows"], value=numpy_helper.from_array(np.arange(4).reshape(4, 1))),
    helper.make_node("Concat", ["rows", "col"], ["pairs"], axis=1),
]
_NEGATIVE = _POSITIONS + [
    helper.make_node("Constant", [], ["three"], value=numpy_helper.from_array(np.array(3, np.int64))),
    helper.make_node("Sub", ["col", "three"], ["negcol"]),
]

CASES = {
    # RoBERTa's pattern: int data known, indices computed.
    "GatherElements-int-table": (_POSITIONS + [helper.make_node("GatherElements", ["table", "col"], ["y"], axis=1)],
                                 {"table": TABLE}),
    "GatherElements-negative": (_NEGATIVE + [helper.make_node("GatherElements", ["floats", "negcol"], ["y"], axis=1)],
                                {"floats": FLOATS}),
    "GatherND": (_PAIRS + [helper.make_node("GatherND", ["table", "pairs"], ["y"])], {"table": TABLE}),
    "GatherND-batch_dims": (_POSITIONS + [helper.make_node("GatherND", ["floats", "col"], ["y"], batch_dims=1)],
                            {"floats": FLOATS}),
    "Gather": (_POSITIONS + [helper.make_node("Gather", ["floats", "col"], ["y"], axis=0)], {"floats": FLOATS}),
    "ScatterElements": (_POSITIONS + [helper.make_node("ScatterElements", ["floats", "col", "x1"], ["y"], axis=1),
                                      ], {"floats": FLOATS}),
    "ScatterND": (_PAIRS + [helper.make_node("Reshape", ["x1", "flat"], ["updates"]),
                            helper.make_node("ScatterND", ["floats", "pairs", "updates"], ["y"])],
                  {"floats": FLOATS, "flat": np.array([4], np.int64)}),
}


def _case(name: str, source: str) -> onnx.ModelProto:
    nodes, constants = CASES[name]
    # x1: one value per row computed from x, for the scatters' updates.
    nodes = [helper.make_node("ReduceMax", ["x"], ["x1"], axes=[1], keepdims=1)] + nodes
    return _model(nodes, constants, source, ["y"])


def _onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("source", ["initializer", "Constant"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_constant_data_with_computed_indices_matches_onnxruntime(name, source):
    model = _case(name, source)
    (expected,) = _onnxruntime(model, {"x": X})
    np.testing.assert_array_equal(np.asarray(onnxtrain.run(model.SerializeToString(), {"x": X})["y"]), expected)
    fn, params = onnxtrain.translate_model(model.SerializeToString())
    np.testing.assert_array_equal(np.asarray(fn(params, {"x": X})["y"]), expected)


def test_constant_indices_out_of_range_are_still_refused_next_to_traced_data():
    """A traced node still range-checks indices known while tracing (an invalid model)."""
    bad = np.full((4, 1), 3, np.int64)
    model = _model([helper.make_node("GatherElements", ["x", "bad"], ["y"], axis=1)], {"bad": bad},
                   "Constant", ["y"])
    with pytest.raises(onnxtrain.ModelLoadError, match="GatherElements.*index 3 is out of range"):
        onnxtrain.run(model.SerializeToString(), {"x": X})


def test_training_step_through_gathers_of_constants_at_computed_positions():
    """y = (x @ W) * table[row, argmax(x)] + floats[argmax(x)]: one SGD step under the Trainer's
    jit moves W by the hand-derived gradient of the mean squared error."""
    weight = RNG.standard_normal((3, 3)).astype(np.float32)
    nodes = _POSITIONS + [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("GatherElements", ["table", "col"], ["picked"], axis=1),
        helper.make_node("Cast", ["picked"], ["scale"], to=TensorProto.FLOAT),
        helper.make_node("GatherND", ["floats", "col"], ["row_shift"], batch_dims=1),
        helper.make_node("Unsqueeze", ["row_shift", "one"], ["shift"]),
        helper.make_node("Mul", ["h", "scale"], ["scaled"]),
        helper.make_node("Add", ["scaled", "shift"], ["y"]),
    ]
    model = _model(nodes, {"table": TABLE, "floats": FLOATS, "one": np.array([1])}, "Constant", ["y"])
    model.graph.initializer.append(numpy_helper.from_array(weight, "W"))
    lr = 0.1
    trainer = onnxtrain.Trainer(onnxtrain.make_training_model(model.SerializeToString(), loss="mse",
                                                              optimizer=optim.SGD(lr=lr)))
    labels = RNG.standard_normal((4, 3)).astype(np.float32)
    trainer.step({"x": X, "labels": labels})

    col = X.argmax(axis=1)
    scale = TABLE[np.arange(4), col].astype(np.float64)[:, None]
    shift = FLOATS[np.arange(4), col].astype(np.float64)[:, None]
    y = (X @ weight) * scale + shift
    d_y = 2 * (y - labels) / y.size
    expected = weight - lr * (X.T.astype(np.float64) @ (d_y * scale))
    np.testing.assert_allclose(np.asarray(trainer.state["W"]), expected, rtol=1e-5, atol=1e-6)


# --- RoBERTa, exported by both torch exporters ---------------------------------------------


def _roberta_export(dynamo: bool) -> tuple[bytes, dict[str, np.ndarray]]:
    """A tiny random RoBERTa (2 layers, hidden 32, vocab 100) exported to ONNX, and feeds."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.RobertaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=64,
                                        max_position_embeddings=40, type_vocab_size=1)
    roberta = transformers.RobertaModel(config).eval()

    class Outputs(torch.nn.Module):
        """Keyword arguments and tuple outputs, which both exporters take."""

        def __init__(self) -> None:
            super().__init__()
            self.roberta = roberta

        def forward(self, ids, mask):
            return self.roberta(input_ids=ids, attention_mask=mask, return_dict=False)

    ids = torch.randint(3, 100, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    buffer = io.BytesIO()
    torch.onnx.export(Outputs(), (ids, mask), buffer, dynamo=dynamo, external_data=False,
                      input_names=["input_ids", "attention_mask"],
                      output_names=["last_hidden_state", "pooler_output"])
    feeds = {"input_ids": np.random.default_rng(1).integers(3, 100, (2, 7)).astype(np.int64),
             "attention_mask": np.array([[1] * 7, [1] * 5 + [0] * 2], np.int64)}
    return buffer.getvalue(), feeds


@pytest.mark.slow
@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_roberta_exports_run_and_match_onnxruntime(dynamo):
    model, feeds = _roberta_export(dynamo)
    ops = {node.op_type for node in onnx.load_model_from_string(model).graph.node}
    assert "GatherElements" in ops     # the position ids: the pattern that failed
    session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    expected = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    actual = onnxtrain.run(model, feeds)
    for name, value in expected.items():
        np.testing.assert_allclose(np.asarray(actual[name]), value, rtol=0, atol=1.5e-5, err_msg=name)
    # A training step traces the same graph under the Trainer's jit.
    trainer = onnxtrain.Trainer(onnxtrain.make_training_model(model, loss="mse", output="pooler_output"))
    labels = np.zeros_like(expected["pooler_output"])
    first = float(trainer.step({**feeds, "labels": labels})["loss"])
    assert np.isfinite(first)
