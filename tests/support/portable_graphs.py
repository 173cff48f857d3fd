"""Gradient graphs for the portable backward's tests: one graph with a Gradient node, run by
onnxtrain (jax.vjp), and the same graph expanded into standard ops, run by stock onnxruntime."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
import onnx
import onnxruntime
from onnx import helper, numpy_helper

from onnxtrain._portable.backward import expand_gradients
from onnxtrain.proto import ModelProto
from onnxtrain.translate.model import TranslatedModel

TRAINING = "ai.onnx.preview.training"


def combined(training: onnx.ModelProto | ModelProto) -> tuple[list, dict, list, int]:
    """(nodes, initializers, inputs, opset) of a training model's main graph followed by its
    algorithm graph, as a training step runs them; sparse initializers made dense. The main
    graph's nodes are the first len(training.graph.node)."""
    training = onnx.load_from_string(training.SerializeToString())
    algorithm = training.training_info[0].algorithm
    initializers = {t.name: numpy_helper.to_array(t) for g in (training.graph, algorithm) for t in g.initializer}
    for g in (training.graph, algorithm):
        for sparse in g.sparse_initializer:
            initializers[sparse.values.name] = np.zeros(tuple(sparse.dims),
                                                        helper.tensor_dtype_to_np_dtype(sparse.values.data_type))
    inputs = [v for g in (training.graph, algorithm) for v in g.input if v.name not in initializers]
    opset = next(o.version for o in training.opset_import if o.domain in ("", "ai.onnx"))
    return [*training.graph.node, *algorithm.node], initializers, inputs, opset


def gradient_model(nodes: Sequence, initializers: Mapping[str, np.ndarray], inputs: Sequence,
                   opset: int, outputs: Sequence[str], extra: Sequence = (),
                   ranks: Mapping[str, int] | None = None) -> onnx.ModelProto:
    """A model of `nodes` (without the optimizer: training-domain nodes other than Gradient and
    what reads them) returning `outputs` as float tensors (of the given ranks, sizes unknown)."""
    late: set[str] = set()
    kept = []
    for node in nodes:
        node = node if isinstance(node, onnx.NodeProto) else onnx.NodeProto.FromString(node.SerializeToString())
        if (node.domain in (TRAINING, "ai.onnx.preview") and node.op_type != "Gradient") or late & set(node.input):
            late.update(node.output)
        else:
            kept.append(node)
    used = {name for node in kept for name in node.input}
    tensors = [numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items() if k in used]
    tensors += [onnx.TensorProto.FromString(t.SerializeToString()) for t in extra]
    graph = helper.make_graph(kept, "gradients", list(inputs),
                              [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT,
                                                             None if ranks is None else [None] * ranks[name])
                               for name in outputs],
                              initializer=tensors)
    return helper.make_model(graph, ir_version=10,
                             opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(TRAINING, 1),
                                            helper.make_opsetid("ai.onnx.preview", 1)])


def expanded_model(nodes: Sequence, initializers: Mapping[str, np.ndarray], inputs: Sequence, opset: int,
                   outputs: Sequence[str], example: Mapping[str, np.ndarray],
                   ranks: Mapping[str, int] | None = None, keep_first: int = 0) -> onnx.ModelProto:
    """gradient_model after expand_gradients, checked by onnx.checker (full_check, which needs
    the outputs' ranks: given, or found by running the unexpanded model at `example`)."""
    new_nodes, new_initializers = expand_gradients(nodes, initializers, inputs, opset, example, keep_first=keep_first)
    if ranks is None:
        reference = run_onnxtrain(gradient_model(nodes, initializers, inputs, opset, outputs), example)
        ranks = {name: np.ndim(value) for name, value in zip(outputs, reference)}
    model = gradient_model(new_nodes, initializers, inputs, opset, outputs, new_initializers, ranks)
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    onnx.checker.check_model(model, full_check=True)
    return model


def compare_expansion(nodes: Sequence, initializers: Mapping[str, np.ndarray], inputs: Sequence, opset: int,
                      outputs: Sequence[str], feeds: Callable[[int], dict[str, np.ndarray]],
                      batches: Sequence[int] = (4, 7), rtol: float = 1e-5, keep_first: int = 0) -> float:
    """Expand the Gradient nodes once (example feeds at batches[0]); at every batch size, the
    expanded graph in stock onnxruntime gives `outputs` as onnxtrain's Gradient does; at the
    first, so does the expanded graph run by onnxtrain. Returns the worst relative error."""
    reference = gradient_model(nodes, initializers, inputs, opset, outputs)
    expected = {batch: run_onnxtrain(reference, feeds(batch)) for batch in batches}
    ranks = {name: np.ndim(value) for name, value in zip(outputs, expected[batches[0]])}
    expanded = expanded_model(nodes, initializers, inputs, opset, outputs, feeds(batches[0]), ranks, keep_first)
    worst = assert_close(run_onnxtrain(expanded, feeds(batches[0])), expected[batches[0]], outputs, rtol)
    for batch in batches:
        worst = max(worst, assert_close(run_onnxruntime(expanded, feeds(batch)), expected[batch], outputs, rtol))
    return worst


def run_onnxruntime(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, dict(feeds))


def run_onnxtrain(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    ours = ModelProto.FromString(model.SerializeToString())
    translated = TranslatedModel(ours)
    outputs = translated(translated.params, dict(feeds), jax.random.PRNGKey(0))
    return [np.asarray(outputs[v.name]) for v in model.graph.output]


def assert_close(actual: Sequence[np.ndarray], expected: Sequence[np.ndarray], names: Sequence[str],
                 rtol: float = 1e-5, atol: float = 1e-6) -> float:
    """Each pair close (relative to the tensor's largest magnitude); returns the worst
    relative error."""
    worst = 0.0
    for a, b, name in zip(actual, expected, names):
        assert np.shape(a) == np.shape(b), f"{name}: shape {np.shape(a)} != {np.shape(b)}"
        scale = max(float(np.max(np.abs(b))) if np.size(b) else 0.0, atol / rtol)
        error = float(np.max(np.abs(np.asarray(a, np.float64) - b))) / scale if np.size(b) else 0.0
        assert error <= rtol, f"{name}: relative error {error:.3g}"
        worst = max(worst, error)
    return worst
