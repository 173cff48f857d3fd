"""The training objective both trainers optimize: the forward pass in training mode and a loss,
as ONNX nodes.

make_training_model puts these nodes into the algorithm graph it writes (followed by the
Gradient and optimizer nodes); finetune() differentiates the very same nodes with JAX. So
BatchNormalization uses batch statistics (its running statistics become state, updated by
each step) and Dropout is active in both, unless the caller asks otherwise.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from onnxtrain._recipe.losses import BUILT_IN, CLASS_INDEX_LOSSES, inline_loss_graph, label_input
from onnxtrain._recipe.trainable import FLOATS, trainable_set
from onnxtrain.errors import BindingError, InputError
from onnxtrain.proto import GraphProto, ModelProto, NodeProto, ValueInfoProto
from onnxtrain.proto.make import attribute, node
from onnxtrain.translate.graph import graph_initializers, initializer_names
from onnxtrain.translate.model import static_input_names
from onnxtrain.translate.registry import model_opsets, normalize_domain
from onnxtrain.translate.tensors import numpy_to_tensor

logger = logging.getLogger("onnxtrain")
Trainable = str | Iterable[str] | Callable[[str, np.ndarray], bool] | None


class Names:
    """Fresh names that collide with nothing in the model."""

    def __init__(self, graph: GraphProto):
        self.taken = {v.name for v in [*graph.input, *graph.output, *graph.value_info]}
        self.taken |= set(initializer_names(graph))
        self.taken |= {name for n in graph.node for name in n.output}

    def __call__(self, wanted: str) -> str:
        name, counter = wanted, 1
        while name in self.taken:
            counter += 1
            name = f"{wanted}.{counter}"
        self.taken.add(name)
        return name


def default_opset(model: ModelProto) -> int:
    return next((o.version for o in model.opset_import if normalize_domain(o.domain) == ""), 0)


def _batchnorm_statistics(graph: GraphProto) -> set[str]:
    return {n.input[i] for n in graph.node if n.op_type == "BatchNormalization" for i in (3, 4)
            if len(n.input) > i}


def trainable_names(model: ModelProto, trainable: Trainable = None, log: bool = True) -> list[str]:
    """The float initializers to train.

    Args:
        model: the inference model.
        trainable: None for the default set (the weights trainable_set finds: exporter
            constants such as exponents, scales, fill values, zero RNN states and position
            tables stay fixed), one name or a list of names of float initializers (any, constants
            included; exact names, not patterns), or a predicate (name, value) -> bool over
            the float initializers (for patterns: lambda name, value: name.startswith("head.")).
        log: log the chosen set (one INFO line on logger "onnxtrain").

    Returns:
        The names, in initializer order for the default set and predicates.

    Raises:
        InputError: a name that is no initializer of the main graph (the message lists the
            closest names).
        BindingError: an initializer that cannot be trained: not float, a shape operand or a
            BatchNorm running statistic.

    Example:
        >>> trainable_names(model, "head.weight")
        ['head.weight']
    """
    if trainable is None:
        chosen = trainable_set(model)
        if log:
            logger.info("%s (pass trainable= to choose; onnxtrain.default_trainable(model) lists them)",
                        chosen.summary())
        return chosen.weights
    # Only an explicit choice needs the candidates (trainable_set decodes the weights itself).
    values = graph_initializers(model.graph)
    opsets = model_opsets(model.opset_import)
    excluded = static_input_names(model.graph, opsets) | _batchnorm_statistics(model.graph)
    candidates = [n for n, v in values.items() if v.dtype in FLOATS and n not in excluded]
    if callable(trainable):
        return [n for n in candidates if trainable(n, values[n])]
    # A single string is one name: list("head.weight") would be its characters.
    names = [trainable] if isinstance(trainable, str) else list(trainable)
    _check_known(names, list(values))
    unknown = [n for n in names if n not in candidates]
    if unknown:
        raise BindingError(f"trainable names {unknown} are not float weights of the main graph (shape "
                           f"operands and BatchNorm statistics cannot be trained); candidates are "
                           f"{candidates}")
    return names


def _check_known(names: list[str], initializers: list[str]) -> None:
    """Raise InputError for the first name that is no initializer at all, with the closest ones."""
    for name in names:
        if not isinstance(name, str):
            raise InputError(f"trainable= takes initializer names (str), a predicate or None; got "
                             f"{type(name).__name__} {name!r} among the names")
        if name in initializers:
            continue
        # A module's own name (inv_freq, weight) ends the exporter's full path (m.model.rotary_emb.inv_freq).
        ending = [n for n in initializers if n.endswith(f".{name}")]
        close = list(dict.fromkeys(ending + difflib.get_close_matches(name, initializers, n=5, cutoff=0.6)))[:5]
        hint = f"did you mean {', '.join(map(repr, close))}?" if close else (
            f"the initializers are {initializers[:10]}" + (" ..." if len(initializers) > 10 else ""))
        raise InputError(f"trainable={name!r} names no initializer of the main graph; {hint} "
                         "(trainable takes exact names, or a predicate (name, value) -> bool)")


def training_forward(model: ModelProto, fresh: Names, freeze_batchnorm: bool
                      ) -> tuple[list[NodeProto], dict[str, str], dict[str, str]]:
    """A copy of the forward pass with Dropout/BatchNormalization in training mode.

    Returns (nodes, renamed outputs, BatchNorm statistic -> its updated value)."""
    graph, opset_version = model.graph, default_opset(model)
    renamed: dict[str, str] = {}
    statistics: dict[str, str] = {}
    nodes = []
    initial = set(initializer_names(graph))
    true_name = None
    for original in graph.node:
        copy = NodeProto()
        copy.CopyFrom(original)
        copy.name = f"{original.name}.train" if original.name else ""
        copy.input[:] = [renamed.get(n, n) for n in original.input]
        copy.output[:] = []
        for name in original.output:
            renamed[name] = fresh(f"{name}.train") if name else ""
            copy.output.append(renamed[name])
        if original.op_type == "Dropout" and opset_version >= 12:
            if true_name is None:
                true_name = fresh("training_mode")
                nodes.append(node("Constant", [], [true_name],
                                  value=numpy_to_tensor(np.array(True), true_name)))
            inputs = list(copy.input) + [""] * (2 - len(copy.input))
            copy.input[:] = inputs[:2] + [true_name]
        if original.op_type == "BatchNormalization" and not freeze_batchnorm and opset_version >= 14:
            _train_batchnorm(copy, original, initial, fresh, statistics)
        nodes.append(copy)
    return nodes, renamed, statistics


def _train_batchnorm(copy: NodeProto, original: NodeProto, initial: set[str], fresh: Names,
                     statistics: dict[str, str]) -> None:
    for existing in list(copy.attribute):
        if existing.name == "training_mode":
            copy.attribute.remove(existing)
    copy.attribute.append(attribute("training_mode", 1))
    mean, variance = original.input[3], original.input[4]
    outputs = [copy.output[0], fresh(f"{mean}.new"), fresh(f"{variance}.new")]
    copy.output[:] = outputs
    for statistic, updated in ((mean, outputs[1]), (variance, outputs[2])):
        if statistic in initial:
            statistics[statistic] = updated


@dataclass
class Objective:
    """The algorithm-graph part computing the loss of model output `output`: `graph` holds the training-mode forward
    copy (when one is needed) and the loss nodes, takes the label as input (unless the loss
    is a JAX function, applied by the caller to `prediction`) and outputs nothing yet."""

    graph: GraphProto
    output: str
    prediction: str
    loss: str | None
    statistics: dict[str, str] = field(default_factory=dict)  # BatchNorm statistic -> new value
    fresh: Names | None = None


def objective(model: ModelProto, loss: str | GraphProto | Callable, output: str | None, label: str,
              train_mode: bool = True, freeze_batchnorm: bool = False,
              ignore_index: int | None = None) -> Objective:
    """The objective for `model`'s `output` (default: the first) against the label input `label`.

    loss: "mse", "l1", "cross_entropy", "causal_lm", "bce_with_logits", a loss graph (prediction, label) ->
    scalar, or a JAX function (prediction, label) -> scalar (left to the caller).
    train_mode: Dropout and BatchNormalization as in training (BatchNorm statistics become
    state) unless freeze_batchnorm keeps BatchNorm on its running statistics.
    ignore_index: for "cross_entropy" and "causal_lm", a label value that contributes nothing.
    """
    outputs = {v.name: v for v in model.graph.output}
    output = output or model.graph.output[0].name
    if output not in outputs:
        raise BindingError(f"output={output!r} is not an output of the model; outputs are {list(outputs)}")
    if isinstance(loss, str) and loss not in BUILT_IN:
        raise BindingError(f"loss={loss!r} is not one of {sorted(BUILT_IN)} (or pass a loss graph "
                           "(prediction, label) -> scalar; finetune also takes a JAX function)")
    _check_ignore_index(loss, ignore_index)
    if loss in CLASS_INDEX_LOSSES and default_opset(model) < 13:
        raise BindingError(f"loss={loss!r} needs ai.onnx opset 13 or newer (SoftmaxCrossEntropyLoss); "
                           "the model imports an older one. Pass a loss graph instead.")
    if loss == "causal_lm" and len(outputs[output].type.tensor_type.shape.dim) not in (0, 3):
        raise BindingError(f"loss='causal_lm' takes logits [batch, length, vocabulary]; output {output!r} "
                           f"has rank {len(outputs[output].type.tensor_type.shape.dim)}. Pick the logits "
                           "output with output=, or use loss='cross_entropy' (classes on axis 1)")
    fresh = Names(model.graph)
    graph = GraphProto(name="train_step")
    needs_training_mode = train_mode and any(
        n.op_type == "Dropout" or (n.op_type == "BatchNormalization" and not freeze_batchnorm)
        for n in model.graph.node)
    statistics: dict[str, str] = {}
    prediction = output
    if needs_training_mode:
        forward, renamed, statistics = training_forward(model, fresh, freeze_batchnorm)
        graph.node.extend(forward)
        prediction = renamed[output]
        # The training copy has the output's type; declared, so the label check knows the classes.
        graph.value_info.append(ValueInfoProto(name=prediction, type=outputs[output].type))
    if label in fresh.taken:
        raise BindingError(f"label={label!r} is already a name in the model; pass another label name")
    fresh.taken.add(label)
    if callable(loss):
        return Objective(graph, output, prediction, None, statistics, fresh)
    loss_name = fresh("loss")
    if isinstance(loss, str):
        build = BUILT_IN[loss] if ignore_index is None else partial(BUILT_IN[loss], ignore_index=ignore_index)
        loss_nodes, loss_initializers = build(prediction, label, loss_name, fresh)
        graph.input.append(label_input(loss, outputs[output], label))
    else:
        loss_graph = GraphProto.FromString(loss.SerializeToString())
        loss_nodes, loss_initializers = inline_loss_graph(loss_graph, prediction, label, loss_name, fresh)
        graph.input.append(label_input("graph", outputs[output], label, loss_graph))
    graph.node.extend(loss_nodes)
    graph.initializer.extend(loss_initializers)
    return Objective(graph, output, prediction, loss_name, statistics, fresh)


def _check_ignore_index(loss: str | GraphProto | Callable, ignore_index: int | None) -> None:
    """ignore_index is an attribute of the cross-entropy node, so it needs that loss and an int."""
    if ignore_index is None:
        return
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
        raise InputError(f"ignore_index={ignore_index!r} must be an int (e.g. -100, as in torch), or None")
    if not isinstance(loss, str) or loss not in CLASS_INDEX_LOSSES:
        shown = loss if isinstance(loss, str) else type(loss).__name__
        raise InputError(f"ignore_index={ignore_index} applies to loss='cross_entropy' or 'causal_lm' only, "
                         f"not {shown!r}; "
                         "leave it out, or write the loss as a graph that skips those labels")
