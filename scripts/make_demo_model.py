"""Write onnxtrain/models/mlp_classifier.onnx, the model the demo runs on.

A 2-16-3 ReLU classifier for points in the plane that carries its own training
recipe: an initialization graph (He-normal weights, zero biases and Adam
slots, step counter 1) and an algorithm graph (softmax cross-entropy, Gradient,
Adam with a 1-based step counter, counter + 1). Built with onnxtrain's own
proto classes; tests check the committed file is what this script writes.

Usage: python scripts/make_demo_model.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from onnxtrain import save_model
from onnxtrain.proto import GraphProto, ModelProto, TensorProto, TrainingInfoProto
from onnxtrain.proto.make import bindings, node, opset, tensor_value_info
from onnxtrain.translate.tensors import numpy_to_tensor

OUTPUT = Path(__file__).resolve().parents[1] / "onnxtrain" / "models" / "mlp_classifier.onnx"
FEATURES, HIDDEN, CLASSES = 2, 16, 3
PARAMETER_SHAPES = {"W1": (FEATURES, HIDDEN), "B1": (HIDDEN,), "W2": (HIDDEN, CLASSES), "B2": (CLASSES,)}
TRAINING_DOMAIN = "ai.onnx.preview.training"
FLOAT = TensorProto.FLOAT


def _he_normal(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    return (rng.normal(size=shape) * np.sqrt(2.0 / shape[0])).astype(np.float32)


def _inference_graph(rng: np.random.Generator) -> GraphProto:
    initial = {
        name: _he_normal(shape, rng) if name.startswith("W") else np.zeros(shape, np.float32)
        for name, shape in PARAMETER_SHAPES.items()
    }
    return GraphProto(
        name="mlp_classifier",
        node=[
            node("MatMul", ["X", "W1"], ["hidden_linear"], name="layer1_matmul"),
            node("Add", ["hidden_linear", "B1"], ["hidden_biased"], name="layer1_bias"),
            node("Relu", ["hidden_biased"], ["hidden"], name="layer1_relu"),
            node("MatMul", ["hidden", "W2"], ["logits_linear"], name="layer2_matmul"),
            node("Add", ["logits_linear", "B2"], ["logits"], name="layer2_bias"),
        ],
        input=[tensor_value_info("X", FLOAT, ["batch", FEATURES])],
        output=[tensor_value_info("logits", FLOAT, ["batch", CLASSES])],
        initializer=[numpy_to_tensor(value, name) for name, value in initial.items()],
    )


def _slot_names(prefix: str) -> list[str]:
    return [f"{prefix}_{name}" for name in PARAMETER_SHAPES]


def _algorithm_graph() -> GraphProto:
    parameters = list(PARAMETER_SHAPES)
    gradients, first_moments, second_moments = _slot_names("grad"), _slot_names("V"), _slot_names("H")
    zeros = [
        numpy_to_tensor(np.zeros(shape, np.float32), f"{prefix}_{name}")
        for prefix in ("V", "H")
        for name, shape in PARAMETER_SHAPES.items()
    ]
    return GraphProto(
        name="adam_step",
        node=[
            node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], name="loss",
                 reduction="mean"),
            node("Gradient", parameters + ["X", "labels"], gradients, name="gradients",
                 domain=TRAINING_DOMAIN, xs=parameters, zs=["X", "labels"], y="loss"),
            node("Adam",
                 ["learning_rate", "step"] + parameters + gradients + first_moments + second_moments,
                 [f"{n}_new" for n in parameters + first_moments + second_moments],
                 name="adam", domain=TRAINING_DOMAIN, alpha=0.9, beta=0.999, epsilon=1e-8),
            node("Add", ["step", "one"], ["step_new"], name="count_step"),
        ],
        input=[tensor_value_info("labels", TensorProto.INT64, ["batch"])],
        output=[tensor_value_info("loss", FLOAT, [])]
        + [tensor_value_info(f"{n}_new", FLOAT, PARAMETER_SHAPES[n.split("_")[-1]])
           for n in parameters + first_moments + second_moments]
        + [tensor_value_info("step_new", TensorProto.INT64, [])],
        initializer=[
            numpy_to_tensor(np.array(0.05, np.float32), "learning_rate"),
            # Adam's bias correction matches the paper only with a 1-based step.
            numpy_to_tensor(np.array(1, np.int64), "step"),
            numpy_to_tensor(np.array(1, np.int64), "one"),
            *zeros,
        ],
    )


def _initialization_graph() -> GraphProto:
    nodes, outputs = [], []
    for name, shape in PARAMETER_SHAPES.items():
        if name.startswith("W"):
            nodes.append(node("RandomNormal", [], [f"{name}_init"], name=f"init_{name}",
                              shape=list(shape), scale=float(np.sqrt(2.0 / shape[0]))))
        else:
            nodes.append(node("Constant", [], [f"{name}_init"], name=f"init_{name}",
                              value=numpy_to_tensor(np.zeros(shape, np.float32))))
        outputs.append(tensor_value_info(f"{name}_init", FLOAT, shape))
    for slot in _slot_names("V") + _slot_names("H"):
        shape = PARAMETER_SHAPES[slot.split("_")[-1]]
        nodes.append(node("Constant", [], [f"{slot}_init"], name=f"init_{slot}",
                          value=numpy_to_tensor(np.zeros(shape, np.float32))))
        outputs.append(tensor_value_info(f"{slot}_init", FLOAT, shape))
    nodes.append(node("Constant", [], ["step_init"], name="init_step",
                      value=numpy_to_tensor(np.array(1, np.int64))))
    outputs.append(tensor_value_info("step_init", TensorProto.INT64, []))
    return GraphProto(name="initialize", node=nodes, output=outputs)


def build() -> ModelProto:
    state = list(PARAMETER_SHAPES) + _slot_names("V") + _slot_names("H")
    training = TrainingInfoProto(
        initialization=_initialization_graph(),
        algorithm=_algorithm_graph(),
        initialization_binding=bindings({**{n: f"{n}_init" for n in state}, "step": "step_init"}),
        update_binding=bindings({**{n: f"{n}_new" for n in state}, "step": "step_new"}),
    )
    return ModelProto(
        ir_version=10,
        producer_name="onnxtrain",
        producer_version="demo",
        doc_string="2-16-3 ReLU classifier for points in the plane, with an Adam training recipe.",
        opset_import=[opset("", 21), opset(TRAINING_DOMAIN, 1)],
        graph=_inference_graph(np.random.default_rng(0)),
        training_info=[training],
    )


if __name__ == "__main__":
    save_model(build(), OUTPUT)
    print(f"wrote {OUTPUT}")
