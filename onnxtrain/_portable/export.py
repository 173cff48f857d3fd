"""Training models rewritten for runtimes that only know standard ONNX.

portable_model keeps the TrainingInfoProtos and their bindings but writes every
algorithm in `ai.onnx` ops: Gradient nodes through expand_gradients, optimizers
through expand_optimizers. step_model flattens the one algorithm into a plain
model a runtime without training_info can loop over: the feeds and the state in,
the unbound outputs and the new state out, described by a manifest (manifest.py).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from onnxtrain._portable.backward import GRADIENT_DOMAINS, expand_gradients
from onnxtrain._portable.manifest import MANIFEST_KEY, StepManifest
from onnxtrain._portable.optimizers import OPTIMIZER_DOMAINS, expand_optimizers
from onnxtrain.errors import ExportError
from onnxtrain.proto import (GraphProto, ModelProto, NodeProto, StringStringEntryProto, TensorProto,
                             ValueInfoProto)
from onnxtrain.proto.metadata import EVALUATION_KEY, KEY_METADATA
from onnxtrain.translate.graph import graph_initializers
from onnxtrain.translate.tensors import data_type_of, element_type, numpy_to_tensor

TRAINING_DOMAINS = GRADIENT_DOMAINS | OPTIMIZER_DOMAINS
# The size an example feed gets along an axis whose size the model leaves open. Not 1, so
# the backward never mistakes a varying axis for a broadcast one.
EXAMPLE_AXIS = 3
# Opsets up to 22 need IR version 10 at most. A stock runtime refuses IR versions newer than it
# knows (onnxruntime-node 1.30 stops at 13), so the portable files claim no more than needed.
PORTABLE_IR_VERSION = 10
PORTABLE_IR_MAX_OPSET = 22


def portable_model(model: ModelProto, feeds: Mapping[str, np.ndarray] | None = None) -> ModelProto:
    """`model` with every algorithm graph in standard ops, the same bindings and values.

    Args:
        model: a training model (onnxtrain.proto) with its state values in its initializers.
        feeds: a batch the expansion traces the forward nodes at (see _expanded).

    Returns:
        A new model: no node of, and no opset import for, ai.onnx.preview.training; the
        main graph's nodes as they were.

    Raises:
        ExportError: an op without a backward rule, an input whose rank is unknown, or an
            opset below 16 (see expand_gradients).

    Example:
        >>> portable = portable_model(training)  # doctest: +SKIP
    """
    out = ModelProto()
    out.CopyFrom(model)
    for index, info in enumerate(out.training_info):
        for proto in info.initialization.node:
            if proto.domain in TRAINING_DOMAINS:
                raise ExportError(f"portable export: training_info[{index}]'s initialization graph uses "
                                  f"{proto.op_type} ({proto.domain}), which has no standard-op form here; "
                                  "write the initialization with standard ops")
        _, algorithm, constants = _expanded(out, index, feeds)
        del info.algorithm.node[:]
        info.algorithm.node.extend(algorithm)
        info.algorithm.initializer.extend(constants)
    _drop_training_opsets(out)
    return out


def step_model(model: ModelProto, algorithm: int = 0, feeds: Mapping[str, np.ndarray] | None = None) -> ModelProto:
    """One algorithm of `model` as a plain model: feeds and state in, outputs and new state out.

    Every state variable is a required input named as the variable; the value it has now is
    kept in the initializer `<name>.initial` (the manifest names it), which no node reads: a
    runner reads it once to start. The output its update_binding names returns its next
    value. State that only the initialization binds (a learning rate) is an input too, fed
    its initial value every step. Required inputs rather than overridable initializers,
    because some runtimes (onnxruntime-node) drop feeds for inputs that have an initializer.

    Args:
        model: a training model (onnxtrain.proto) with its state values in its initializers.
        algorithm: which TrainingInfoProto's algorithm to write.
        feeds: a batch the expansion traces the forward nodes at (see _expanded).

    Returns:
        The step model, without training_info, its manifest in metadata_props[MANIFEST_KEY].

    Raises:
        ExportError: no such algorithm, or the expansion fails (see portable_model).

    Example:
        >>> step = step_model(training)  # doctest: +SKIP
    """
    if not 0 <= algorithm < len(model.training_info):
        raise ExportError(f"the model has {len(model.training_info)} TrainingInfoProto(s); there is no "
                          f"algorithm {algorithm} to write as a step model")
    info = model.training_info[algorithm]
    main, rest, constants = _expanded(model, algorithm, feeds)
    values = {**graph_initializers(model.graph), **graph_initializers(info.algorithm)}
    bound = [(b.key, b.value) for b in info.update_binding]
    settings = [b.key for b in info.initialization_binding if b.key not in dict(bound)]
    state = [*dict.fromkeys([key for key, _ in bound] + settings)]
    feeds = [v for g in (model.graph, info.algorithm) for v in g.input if v.name not in values]
    bound_outputs = {value for _, value in bound}
    outputs = [v for v in info.algorithm.output if v.name not in bound_outputs]
    nodes = [*main, *rest]
    taken = {*values, *(t.name for t in constants), *(n for p in nodes for n in [*p.input, *p.output])}
    initial = {name: _fresh(f"{name}.initial", taken) for name in state}

    graph = GraphProto(name=f"{model.graph.name or 'model'}.step")
    graph.node.extend(nodes)
    graph.input.extend(feeds)
    graph.input.extend(_value_info(name, values[name]) for name in state)
    graph.output.extend(outputs)
    # Each next value leaves typed as its variable, the type it has when fed back.
    graph.output.extend(_value_info(value, values[key]) for key, value in bound)
    graph.initializer.extend(numpy_to_tensor(array, name) for name, array in values.items() if name not in initial)
    graph.initializer.extend(numpy_to_tensor(values[name], initial[name]) for name in state)
    graph.initializer.extend(constants)
    step = ModelProto()
    step.CopyFrom(model)
    del step.training_info[:]
    step.graph.CopyFrom(graph)
    _drop_training_opsets(step)
    manifest = StepManifest(feeds=[v.name for v in feeds], state=bound, settings=settings,
                            outputs=[v.name for v in outputs], loss=_loss_name(model, algorithm, outputs),
                            initial=initial)
    # The PRNG key and the evaluation record describe training_info, which a step model lacks.
    kept = [entry for entry in step.metadata_props if entry.key not in (MANIFEST_KEY, KEY_METADATA, EVALUATION_KEY)]
    del step.metadata_props[:]
    step.metadata_props.extend(kept)
    step.metadata_props.append(StringStringEntryProto(key=MANIFEST_KEY, value=manifest.to_json()))
    return step


def _fresh(wanted: str, taken: set[str]) -> str:
    """`wanted`, numbered if a tensor of that name exists."""
    name, counter = wanted, 1
    while name in taken:
        counter += 1
        name = f"{wanted}.{counter}"
    taken.add(name)
    return name


def portable_transform(portable: bool | str, training: bool, merge: bool | None,
                       feeds: Mapping[str, np.ndarray] | None = None) -> Callable[[ModelProto], ModelProto]:
    """What Trainer.export(portable=...) applies to the finished training model; `feeds` is
    the batch the expansion traces the forward nodes at (None: invented, see example_feeds).

    Raises:
        ExportError: portable is neither True nor "step", or is combined with training=False
            or merge=True.
    """
    if portable is not True and portable != "step":
        raise ExportError(f"portable must be True (training_info in standard ops) or \"step\" (a plain "
                          f"step model); got {portable!r}")
    if not training or merge:
        raise ExportError("portable export writes a training model: call export(path, portable=...) "
                          "without training=False or merge=True")
    if portable is True:
        return functools.partial(portable_model, feeds=feeds)
    return functools.partial(step_model, feeds=feeds)


def example_feeds(inputs: Sequence[ValueInfoProto], seed: int = 0) -> dict[str, np.ndarray]:
    """A value for each input, shaped as declared (open axes get EXAMPLE_AXIS).

    Raises:
        ExportError: an input declares no tensor type or no shape (its rank is unknown).
    """
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in inputs:
        tensor = value.type.tensor_type
        if not value.type.HasField("tensor_type") or not tensor.HasField("shape"):
            raise ExportError(f"portable export: input {value.name!r} declares no tensor shape, so the "
                              "backward cannot know its rank; declare its shape (open axes may stay "
                              "symbolic) in the model")
        shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else EXAMPLE_AXIS
                      for d in tensor.shape.dim)
        dtype = _numpy_dtype(tensor.elem_type, value.name)
        if dtype.kind == "f":
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
        else:
            # Zeros are a valid index (class label, token id) for any lookup the feed drives.
            feeds[value.name] = np.zeros(shape, dtype)
    return feeds


def _expanded(model: ModelProto, index: int, given: Mapping[str, np.ndarray] | None = None
              ) -> tuple[list[NodeProto], list[NodeProto], list[TensorProto]]:
    """(main graph nodes, algorithm nodes, new constants) of TrainingInfoProto `index` in
    standard ops, the forward traced at the batch `given` (every feed of the step), or else at
    invented feeds (see example_feeds), which a model relating its inputs' sizes or values
    (a KV cache's lengths, position ids) may refuse."""
    info = model.training_info[index]
    opset = _default_opset(model)
    initializers = {**graph_initializers(model.graph), **graph_initializers(info.algorithm)}
    inputs = [v for g in (model.graph, info.algorithm) for v in g.input]
    wanted = [v for v in inputs if v.name not in initializers]
    if given is None:
        feeds = example_feeds(wanted)
    else:
        missing = [v.name for v in wanted if v.name not in given]
        if missing:
            raise ExportError(f"portable export: the example feeds lack {missing}; give a whole batch as "
                              "step() takes it")
        feeds = {v.name: np.asarray(given[v.name]) for v in wanted}
    nodes = [*model.graph.node, *info.algorithm.node]
    # The main graph stays the inference graph as exported; the backward goes after it.
    kept = len(model.graph.node)
    expanded, gradient_constants = expand_gradients(nodes, initializers, inputs, opset, feeds, keep_first=kept)
    dtypes = {name: value.dtype for name, value in initializers.items()}
    expanded, optimizer_constants = expand_optimizers(expanded, dtypes, opset)
    for proto in expanded:
        if proto.domain in TRAINING_DOMAINS:
            raise ExportError(f"portable export: node {proto.name or proto.output[0]!r} ({proto.op_type}, "
                              f"domain {proto.domain}) has no standard-op form; remove it from the recipe")
    return expanded[:kept], expanded[kept:], [*gradient_constants, *optimizer_constants]


def _loss_name(model: ModelProto, algorithm: int, outputs: Sequence[ValueInfoProto]) -> str | None:
    """The loss output make_training_model recorded for this algorithm, else an output named
    "loss", else None."""
    names = {v.name for v in outputs}
    for entry in model.metadata_props:
        if entry.key == EVALUATION_KEY:
            for record in json.loads(entry.value):
                if record.get("algorithm") == algorithm and record.get("loss") in names:
                    return record["loss"]
    return "loss" if "loss" in names else None


def _drop_training_opsets(model: ModelProto) -> None:
    """Remove the training domains' opset imports (no node uses them any more) and lower the
    IR version to what the default opset needs."""
    kept = [o for o in model.opset_import if o.domain not in TRAINING_DOMAINS]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    if _default_opset(model) <= PORTABLE_IR_MAX_OPSET and model.ir_version > PORTABLE_IR_VERSION:
        model.ir_version = PORTABLE_IR_VERSION


def _default_opset(model: ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    raise ExportError("the model imports no default-domain opset; add one (opset_import domain '')")


def _numpy_dtype(elem_type: int, name: str) -> np.dtype:
    return np.dtype(element_type(elem_type, f"input {name!r}").dtype)


def _value_info(name: str, value: np.ndarray) -> ValueInfoProto:
    """A tensor ValueInfoProto of `value`'s dtype and (fixed) shape."""
    info = ValueInfoProto(name=name)
    tensor = info.type.tensor_type
    tensor.elem_type = data_type_of(value.dtype)
    tensor.shape.SetInParent()
    for size in value.shape:
        tensor.shape.dim.add().dim_value = size
    return info
