"""Training runs for the portable export's tests: bench models with make_training_model's
recipe, a dataset at two batch sizes, onnxtrain's own 20 steps as the reference, and the
error measures the acceptance uses."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import onnxtrain
from onnxtrain import optim
from onnxtrain._recipe.builder import make_training_model
from support.bench_modules import bench_module

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
STEPS = 20
BATCHES = (4, 7) * (STEPS // 2)
models = bench_module("models")


@dataclass(frozen=True)
class Run:
    losses: np.ndarray
    state: dict[str, np.ndarray]


@functools.cache
def forward_model(name: str):
    """The inference model `name` as onnx.ModelProto: "mlp" and "cnn" (bench/models.py),
    "cnn_bn" (Conv, BatchNormalization, MaxPool, Gemm), "bert" (a tiny BERT classifier
    exported by torch.onnx's dynamo exporter; needs torch and transformers)."""
    if name == "mlp":
        return models.mlp_onnx(models.mlp_weights())
    if name == "cnn":
        return models.cnn_onnx(models.cnn_weights())
    if name == "cnn_bn":
        return _cnn_batchnorm()
    return tiny_bert_model()


def _cnn_batchnorm():
    """Conv (pads) - BatchNorm - Relu - MaxPool - Conv (stride 2) - BatchNorm - Relu - Flatten -
    Gemm (transB) on x[batch, 3, 8, 8]. The convolutions have no bias, as usual before a
    BatchNorm: a bias there has a zero gradient in exact arithmetic, so Adam would move it by
    steps whose sign follows rounding noise, different in every runtime."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = {"C1": rng.standard_normal((4, 3, 3, 3)) * 0.3,
               "s1": 1 + rng.standard_normal(4) * 0.1, "t1": rng.standard_normal(4) * 0.1,
               "m1": rng.standard_normal(4) * 0.1, "v1": 1 + rng.random(4),
               "C2": rng.standard_normal((6, 4, 3, 3)) * 0.3, "s2": 1 + rng.standard_normal(6) * 0.1,
               "t2": rng.standard_normal(6) * 0.1, "m2": np.zeros(6), "v2": np.ones(6),
               "W": rng.standard_normal((10, 24)) * 0.2, "B": rng.standard_normal(10) * 0.1}
    nodes = [
        helper.make_node("Conv", ["x", "C1"], ["a1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["a1", "s1", "t1", "m1", "v1"], ["b1"], name="bn1"),
        helper.make_node("Relu", ["b1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "C2"], ["a2"], name="conv2", pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("BatchNormalization", ["a2", "s2", "t2", "m2", "v2"], ["b2"], name="bn2"),
        helper.make_node("Relu", ["b2"], ["r2"], name="relu2"),
        helper.make_node("Flatten", ["r2"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "W", "B"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(nodes, "cnn_bn",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def tiny_bert_model():
    """BertForSequenceClassification (hidden 32, 2 layers, 2 heads, 3 labels, dropout 0),
    dynamic batch; inputs input_ids, attention_mask[batch, 8]."""
    import contextlib
    import io
    import tempfile
    import warnings

    import onnx
    import pytest

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config._attn_implementation = "eager"
    bert = transformers.BertForSequenceClassification(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]

    batch = torch.export.Dim("batch", min=2, max=64)
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        path = f"{folder}/bert.onnx"
        torch.onnx.export(Logits(), (torch.randint(0, 100, (4, 8)), torch.ones(4, 8, dtype=torch.int64)), path,
                          dynamo=True, input_names=["input_ids", "attention_mask"], output_names=["logits"],
                          dynamic_shapes={"input_ids": {0: batch}, "attention_mask": {0: batch}})
        return onnx.load(path)


# Adagrad with its default epsilon (1e-6) is chaotic on the MLP: a hidden unit that is almost
# never active gets near-zero gradients every step, which g / (sqrt(H) + epsilon) amplifies a
# millionfold, so float32 runs that only round differently (another CPU, another summation
# order) end up a full step apart. epsilon 1e-3 keeps the same formula well conditioned, so
# the comparison measures the export, not the chaos (bench/RESULTS.md, "Portable training").
OPTIMIZERS = {"adagrad": optim.Adagrad(epsilon=1e-3)}


@functools.cache
def training_bytes(name: str, optimizer: str) -> bytes:
    import warnings

    forward = forward_model(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter merged equal BERT weights: not what is tested
        training = make_training_model(forward.SerializeToString(), loss="cross_entropy",
                                       optimizer=OPTIMIZERS.get(optimizer, optimizer))
    return training.SerializeToString()


@functools.cache
def batches(name: str) -> tuple[dict[str, np.ndarray], ...]:
    """STEPS batches of feeds x and labels (random labels, so the loss stays well above 0),
    batch sizes alternating 4 and 7."""
    rng = np.random.default_rng(1)
    if name == "bert":
        def feeds(b: int) -> dict[str, np.ndarray]:
            mask = np.ones((b, 8), np.int64)
            mask[0, 5:] = 0  # padding: the attention mask is on the differentiated path
            return {"input_ids": rng.integers(0, 100, (b, 8)), "attention_mask": mask,
                    "labels": rng.integers(0, 3, b).astype(np.int64)}
        return tuple(feeds(b) for b in BATCHES)
    forward = forward_model(name)
    dims = tuple(d.dim_value for d in forward.graph.input[0].type.tensor_type.shape.dim[1:])
    return tuple({"x": rng.standard_normal((b, *dims)).astype(np.float32),
                  "labels": rng.integers(0, 10, b).astype(np.int64)} for b in BATCHES)


def run_trainer(trainer: onnxtrain.Trainer, name: str) -> Run:
    """STEPS steps of `trainer` over the batches in turn."""
    data = batches(name)
    losses = [float(trainer.step(data[i % len(data)])["loss"]) for i in range(STEPS)]
    return Run(np.asarray(losses), {k: np.asarray(v) for k, v in trainer.state.items()})


@functools.cache
def reference(name: str, optimizer: str) -> Run:
    """onnxtrain's own run of the recipe (Gradient and optimizer ops)."""
    return run_trainer(onnxtrain.Trainer(training_bytes(name, optimizer)), name)


def save_batches(name: str, folder: Path) -> tuple[Path, Path]:
    """The batches as batches.npz (examples/portable_ort.py) and batches.json (the Node runner)."""
    data = batches(name)
    npz, js = folder / "batches.npz", folder / "batches.json"
    np.savez(npz, **{f"{i}/{k}": v for i, feeds in enumerate(data) for k, v in feeds.items()})
    js.write_text(json.dumps([{k: {"type": {"float32": "float32", "int64": "int64"}[str(v.dtype)],
                                   "dims": list(v.shape), "data": v.ravel().tolist()} for k, v in feeds.items()}
                              for feeds in data]))
    return npz, js


def errors(actual: Run, expected: Run, names) -> dict[str, float]:
    """Worst relative errors: per-step loss; per state tensor, the largest element error over
    the tensor's largest magnitude ("max") and the error's norm over the tensor's ("norm")."""
    loss = float(np.max(np.abs(actual.losses - expected.losses) / np.abs(expected.losses)))
    worst_max = worst_norm = 0.0
    for name in names:
        a, b = np.asarray(actual.state[name], np.float64), np.asarray(expected.state[name], np.float64)
        assert a.shape == b.shape, name
        difference = np.abs(a - b)
        worst_max = max(worst_max, float(difference.max() / max(np.abs(b).max(), 1e-30)) if b.size else 0.0)
        worst_norm = max(worst_norm, float(np.linalg.norm(difference) / max(np.linalg.norm(b), 1e-30)))
    return {"loss": loss, "max": worst_max, "norm": worst_norm}


@functools.cache
def reference_start(name: str, optimizer: str) -> Run:
    """The state before any step (losses: those of the reference run)."""
    trainer = onnxtrain.Trainer(training_bytes(name, optimizer))
    return Run(reference(name, optimizer).losses, {k: np.asarray(v) for k, v in trainer.state.items()})


def weights(name: str) -> list[str]:
    """The model's own initializers (weights, BatchNorm statistics): what the acceptance
    compares. Optimizer slots are left out: a conv bias followed by BatchNorm has a zero
    gradient in exact arithmetic, so its momentum holds rounding noise only."""
    return [t.name for t in forward_model(name).graph.initializer]


def _as_float64(model):
    """A copy of `model` computing in float64: float32 inputs, outputs, initializers, Cast
    targets and constant values become float64."""
    from onnx import AttributeProto, TensorProto, numpy_helper

    model = type(model).FromString(model.SerializeToString())

    def widen(tensor):
        return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name)

    def convert(graph):
        for value in [*graph.input, *graph.output]:
            if value.type.tensor_type.elem_type == TensorProto.FLOAT:
                value.type.tensor_type.elem_type = TensorProto.DOUBLE
        del graph.value_info[:]
        for index, tensor in enumerate(graph.initializer):
            if tensor.data_type == TensorProto.FLOAT:
                graph.initializer[index].CopyFrom(widen(tensor))
        for node in graph.node:
            for attribute in node.attribute:
                if node.op_type == "Cast" and attribute.name == "to" and attribute.i == TensorProto.FLOAT:
                    attribute.i = TensorProto.DOUBLE
                elif attribute.type == AttributeProto.TENSOR and attribute.t.data_type == TensorProto.FLOAT:
                    attribute.t.CopyFrom(widen(attribute.t))
                elif attribute.type == AttributeProto.GRAPH:
                    convert(attribute.g)

    convert(model.graph)
    return model


def exact_run(step_path: str, name: str) -> Run:
    """The step model's STEPS steps in float64 (onnx.reference on a float64 copy): the exact
    trajectory that onnxtrain's and onnxruntime's float32 runs both approximate."""
    import onnx
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.ops.op_one_hot import OneHot as ReferenceOneHot, _one_hot

    class OneHot(ReferenceOneHot):  # new_ops matches classes by name
        # onnx.reference's OneHot takes depth as a scalar only; the spec allows one element.
        def _run(self, indices, depth, values, axis=None):
            hot = _one_hot(indices, int(np.ravel(depth)[0]), axis=axis, dtype=values.dtype)
            return (hot * (values[1] - values[0]) + values[0],)

    model = onnx.load(step_path)
    manifest = json.loads({p.key: p.value for p in model.metadata_props}["onnxtrain.step"])
    wide = _as_float64(model)
    stored = {t.name: numpy_helper.to_array(t) for t in wide.graph.initializer}
    state = {name: stored[initial] for name, initial in manifest["initial"].items()}
    evaluator = ReferenceEvaluator(wide, new_ops=[OneHot])
    outputs = [output.name for output in wide.graph.output]
    data = batches(name)
    losses = []
    for step in range(STEPS):
        feeds = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in data[step % len(data)].items()}
        results = dict(zip(outputs, evaluator.run(None, {**feeds, **state})))
        state.update({name: results[output] for name, output in manifest["state"]})
        losses.append(float(results[manifest["loss"]]))
    return Run(np.asarray(losses), state)
