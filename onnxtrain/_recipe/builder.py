"""make_training_model: any inference model plus a loss and an optimizer -> a training model.

The result is a standard ONNX model: its TrainingInfoProto holds
- an algorithm graph: (when Dropout or BatchNormalization must behave as in
  training) a renamed copy of the forward pass in training mode, the loss,
  one Gradient node over the trainable weights, then the update part
  (onnxtrain._recipe.update: accumulation, clipping, the learning-rate schedule,
  the optimizer node, decoupled weight decay, the step-counter increment);
  BatchNorm running statistics are bound state too;
- an initialization graph that resets the optimizer slots, the counter and the
  learning rate (and redraws weights on request);
- bindings that make weights, slots, counter and learning rate state variables,
  so a runtime can change the learning rate between steps without recompiling.
The main graph stays the inference graph, so ONNX Runtime serves the exported model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from onnxtrain._io.model import ModelSource, load_model
from onnxtrain._recipe.damage import prepare
from onnxtrain._recipe.lora import trained_weights
from onnxtrain._recipe.evaluation import LossSpec, record as record_evaluation
from onnxtrain._recipe.objective import Names, Objective, Trainable, objective
from onnxtrain._recipe.training_info import validate
from onnxtrain._recipe.update import update_nodes
from onnxtrain import optim
from onnxtrain.adapters import LoRA
from onnxtrain.errors import BindingError
from onnxtrain.optim import Optimizer
from onnxtrain.proto import (GraphProto, ModelProto, SparseTensorProto, TensorProto, TrainingInfoProto,
                             ValueInfoProto)
from onnxtrain.proto.make import bindings, node, opset, tensor_value_info
from onnxtrain.translate.graph import graph_initializers
from onnxtrain.translate.registry import TRAINING_DOMAIN
from onnxtrain.translate.tensors import data_type_of, numpy_to_tensor

def _zeros(name: str, like: np.ndarray) -> SparseTensorProto:
    """An all-zero initializer as a sparse tensor with no entries: optimizer slots start at zero,
    and a dense copy would add twice the weights' size to the file."""
    return SparseTensorProto(values=numpy_to_tensor(np.zeros(0, like.dtype), name),
                             indices=numpy_to_tensor(np.zeros(0, np.int64)), dims=like.shape)


def _initialization(names: dict[str, np.ndarray], reinitialize: dict[str, np.ndarray],
                    fresh: Names) -> tuple[GraphProto, dict[str, str]]:
    """Nodes producing every initial value: zeros and counters as constants, redrawn weights
    from RandomNormal (He scale: std = sqrt(2 / fan_in); biases to zero)."""
    graph = GraphProto(name="initialize")
    bound = {}
    for state, value in {**names, **reinitialize}.items():
        output = fresh(f"{state}.init")
        if state in reinitialize and value.ndim >= 2:
            fan_in = value.shape[0] if value.ndim == 2 else math.prod(value.shape[1:])
            graph.node.append(node("RandomNormal", [], [output], shape=list(value.shape),
                                   scale=math.sqrt(2.0 / fan_in), dtype=data_type_of(value.dtype)))
        elif not value.any() and value.ndim:
            shape = fresh(f"{state}.shape")
            graph.node.append(node("Constant", [], [shape],
                                   value=numpy_to_tensor(np.array(value.shape, np.int64), shape)))
            graph.node.append(node("ConstantOfShape", [shape], [output],
                                   value=numpy_to_tensor(np.zeros(1, value.dtype), "zero")))
        else:
            graph.node.append(node("Constant", [], [output],
                                   value=numpy_to_tensor(np.zeros_like(value) if state in reinitialize
                                                         else value, output)))
        graph.output.append(tensor_value_info(output, data_type_of(value.dtype), list(value.shape)))
        bound[state] = output
    return graph, bound


def _expose_prediction(algorithm: GraphProto, part: Objective, output: ValueInfoProto, label: str,
                       index: int) -> LossSpec:
    """Make each step return its prediction (an unbound algorithm output, which training
    metrics read), and describe the loss so evaluation can apply it to the main graph's
    prediction (see _recipe/evaluation.py)."""
    returned = part.fresh("prediction")
    algorithm.node.append(node("Identity", [part.prediction], [returned]))
    value = ValueInfoProto()
    value.CopyFrom(output)
    value.name = returned
    algorithm.output.append(value)
    return LossSpec(algorithm=index, prediction=part.output, step_prediction=part.prediction, label=label,
                    loss=part.loss, output=returned)


def make_training_model(
    model: ModelSource,
    loss: str | GraphProto | Any,
    output: str | None = None,
    optimizer: Optimizer | str | None = None,
    trainable: Trainable = None,
    *,
    label: str = "labels",
    ignore_index: int | None = None,
    train_mode: bool = True,
    freeze_batchnorm: bool = False,
    reinitialize: Iterable[str] = (),
    lift_folded_weights: bool = False,
    repair: Iterable[str] | str | None = None,
    adapters: LoRA | None = None,
) -> ModelProto:
    """A copy of `model` with a standard TrainingInfoProto (see the module docstring).

    Args:
        model: the inference model (a path, bytes, file object or ModelProto).
        loss: required, as for finetune and the command line: "mse", "l1", "cross_entropy"
            (logits vs class indices), "causal_lm" (logits [batch, length, vocabulary] vs the
            input ids: next-token prediction, -100 ignored), "bce_with_logits", or a graph
            (prediction, label) -> scalar loss.
        output: which model output is the prediction (default: the first).
        optimizer: an onnxtrain.optim optimizer (with a learning-rate schedule, clip_norm=,
            accumulate=; AdamW for decoupled weight decay) or one of the names "adam",
            "adamw", "sgd", "momentum", "adagrad" (default: optim.Adam()).
        trainable: None for the default weights (see the README), one initializer name, a
            list of names, or a predicate (name, value) -> bool.
        label: the name of the label input the training step takes.
        ignore_index: for "cross_entropy" and "causal_lm", a label value that contributes
            nothing (e.g. -100, torch's default); labels are checked against the number of
            classes before every step.
        train_mode: run Dropout and BatchNormalization as in training (BatchNorm statistics
            become state) unless freeze_batchnorm.
        reinitialize: weights the initialization graph redraws.
        repair: export-damage repairs to apply first ("lift_constants", "retie", "untie",
            "relax_batch", "insert_batchnorm", or "all"); damage not repaired is warned about
            once. lift_folded_weights: the same as repair={"lift_constants"}.
        adapters: an onnxtrain.LoRA: the graph gains its adapter branch, and only the A and B
            factors train (plus the base weights `trainable` names, trained fully); the base
            weights stay constants (no gradients, no optimizer slots, no state). Trainer
            export(training=False) then merges them (merge=False keeps the branch and writes
            an adapter file).

    Returns:
        The training model, ready for onnxtrain.Trainer or onnxtrain.save_model.

    Raises:
        InputError: an unknown optimizer, loss option or trainable name; an optax optimizer
            (onnxtrain.finetune takes those).
        BindingError: the model already has training_info, or nothing is left to train; LoRA
            targets that select nothing or cannot be adapted.

    Example:
        >>> training = onnxtrain.make_training_model("model.onnx", loss="cross_entropy",
        ...                                          optimizer=optim.AdamW(lr=optim.cosine(1e-3, steps=1000)))
        >>> trainer = onnxtrain.Trainer(training)
    """
    optimizer = optim.get(optimizer)
    source, model = model, load_model(model)
    if model.training_info:
        raise BindingError("the model already has training_info; strip it first "
                           "(or train it as it is with onnxtrain.Trainer)")
    prepare(model, repair, "make_training_model", lift_folded_weights,
            frozen_base=adapters is not None and trainable is None)
    weights = trained_weights(model, trainable, adapters, output, source)
    if not weights:
        raise BindingError("no trainable weights: the main graph has no float initializers to train "
                           "(or `trainable` selected none)")
    part = objective(model, loss, output, label, train_mode, freeze_batchnorm, ignore_index)
    if part.loss is None:
        raise BindingError("make_training_model writes the loss as ONNX nodes: pass a loss name or a loss "
                           "graph (prediction, label) -> scalar, not a Python function (finetune takes those)")
    fresh, statistics, loss_name, output = part.fresh, part.statistics, part.loss, part.output
    outputs = {v.name: v for v in model.graph.output}
    values = graph_initializers(model.graph)
    algorithm = part.graph

    data_inputs = [v.name for v in model.graph.input if v.name not in values]
    gradients = [fresh(f"{w}.grad") for w in weights]
    algorithm.node.append(node("Gradient", [*weights, *data_inputs, label], gradients,
                               domain=TRAINING_DOMAIN, xs=weights, zs=[*data_inputs, label], y=loss_name))

    update = update_nodes(optimizer, weights, gradients, values, fresh)
    algorithm.node.extend(update.nodes)
    algorithm.sparse_initializer.extend(_zeros(name, value) for name, value in update.zeros.items())
    for name, value in {**update.counters, **update.hyperparameters}.items():
        algorithm.initializer.append(numpy_to_tensor(value, name))
    state_values = {**update.zeros, **update.counters}

    loss_type = outputs[output].type.tensor_type.elem_type or TensorProto.FLOAT
    algorithm.output.append(tensor_value_info(loss_name, loss_type, []))
    evaluation = _expose_prediction(algorithm, part, outputs[output], label, len(model.training_info))
    # BatchNorm statistics go before the counters, as the update part lists weights and slots first.
    updates = {name: value for name, value in update.updates.items() if name not in update.counters}
    updates.update(statistics)
    updates.update((name, value) for name, value in update.updates.items() if name in update.counters)
    for state, value_name in updates.items():
        value = state_values[state] if state in state_values else values[state]
        algorithm.output.append(tensor_value_info(value_name, data_type_of(value.dtype), list(value.shape)))

    unknown = sorted(set(reinitialize) - set(weights))
    if unknown:
        raise BindingError(f"reinitialize names {unknown}, which are not trainable weights ({weights})")
    redraw = {name: values[name] for name in reinitialize}
    init_graph, init_bound = _initialization(state_values, redraw, fresh)
    info = TrainingInfoProto(algorithm=algorithm, initialization=init_graph)
    info.update_binding.extend(bindings(updates))
    info.initialization_binding.extend(bindings(init_bound))
    model.training_info.append(info)
    record_evaluation(model, evaluation)
    if not any(o.domain == TRAINING_DOMAIN for o in model.opset_import):
        model.opset_import.append(opset(TRAINING_DOMAIN, 1))
    model.ir_version = max(model.ir_version, 7)
    validate(model)
    return model
