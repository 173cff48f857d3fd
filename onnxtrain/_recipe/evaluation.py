"""What evaluating a training model honestly needs: its loss nodes, applied to the main graph's
prediction instead of the training-mode copy's.

make_training_model records, in the model's metadata_props under EVALUATION_KEY, a JSON list
with one object per TrainingInfoProto it wrote (see docs/design/evaluation.md):

    {"algorithm": 0, "prediction": "logits", "step_prediction": "logits.train",
     "label": "labels", "loss": "loss", "output": "prediction"}

prediction: the main-graph output the loss is of; step_prediction: the name the algorithm's
loss nodes read (the training copy's prediction, or the main output itself); label: the
algorithm input holding the labels; loss: the algorithm output holding the loss; output: the
algorithm output returning each step's prediction. Any runtime can rebuild the evaluation
graph from these names: the main graph, then the loss nodes (`loss_part`), which read
`prediction` where they read `step_prediction`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

from onnxtrain.proto import AttributeProto, GraphProto, ModelProto, NodeProto, StringStringEntryProto
from onnxtrain.proto.metadata import EVALUATION_KEY
from onnxtrain.translate.graph import initializer_names

logger = logging.getLogger("onnxtrain")



@dataclass(frozen=True)
class LossSpec:
    """How training_info[algorithm] computes its loss from the model's prediction."""

    algorithm: int
    prediction: str
    step_prediction: str
    label: str
    loss: str
    output: str


def record(model: ModelProto, spec: LossSpec) -> None:
    """Add `spec` to the model's EVALUATION_KEY entry (replacing one for the same algorithm)."""
    specs = [s for s in read(model).values() if s.algorithm != spec.algorithm] + [spec]
    kept = [entry for entry in model.metadata_props if entry.key != EVALUATION_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    value = json.dumps([asdict(s) for s in sorted(specs, key=lambda s: s.algorithm)])
    model.metadata_props.append(StringStringEntryProto(key=EVALUATION_KEY, value=value))


def read(model: ModelProto) -> dict[int, LossSpec]:
    """The recorded specs by algorithm index; an entry that is not what record() writes is
    ignored (logged), since evaluation then falls back to the training step's dry run."""
    specs: dict[int, LossSpec] = {}
    for entry in model.metadata_props:
        if entry.key != EVALUATION_KEY:
            continue
        try:
            for item in json.loads(entry.value):
                spec = LossSpec(**item)
                if not isinstance(spec.algorithm, int) or not all(
                        isinstance(getattr(spec, field), str) for field in
                        ("prediction", "step_prediction", "label", "loss", "output")):
                    raise TypeError("a field has the wrong type")
                specs[spec.algorithm] = spec
        except (ValueError, TypeError, RecursionError) as error:
            logger.warning("metadata_props[%r] is not a list of loss descriptions (%s); evaluation runs "
                           "the training step without committing instead", EVALUATION_KEY, error)
            return {}
    return specs


def _has_subgraph(node: NodeProto) -> bool:
    return any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for a in node.attribute)


def loss_part(algorithm: GraphProto, spec: LossSpec) -> GraphProto | None:
    """The nodes computing spec.loss from spec.step_prediction and the label, reading
    spec.prediction instead, as a graph to follow the main graph (its input: the label; its
    output: the loss). None when the loss reads anything else the step computes (a
    hand-written recipe whose loss cannot be separated from the training pass).
    """
    producers = {name: index for index, n in enumerate(algorithm.node) for name in n.output if name}
    constants = set(initializer_names(algorithm))
    inputs = {value.name: value for value in algorithm.input}
    if spec.label not in inputs:
        return None
    chosen: set[int] = set()
    used_constants: set[str] = set()
    pending = [spec.loss]
    seen = {spec.loss}
    while pending:
        name = pending.pop()
        if name in (spec.step_prediction, spec.label):
            continue
        if name in constants:
            used_constants.add(name)
            continue
        if name not in producers:
            return None     # a main-graph value or an input other than the label
        index = producers[name]
        if _has_subgraph(algorithm.node[index]):
            return None     # a subgraph may read names no input lists
        chosen.add(index)
        for read_name in algorithm.node[index].input:
            if read_name and read_name not in seen:
                seen.add(read_name)
                pending.append(read_name)
    part = GraphProto(name=f"{algorithm.name or 'algorithm'}.loss")
    for index in sorted(chosen):
        copy = NodeProto()
        copy.CopyFrom(algorithm.node[index])
        copy.input[:] = [spec.prediction if name == spec.step_prediction else name for name in copy.input]
        part.node.append(copy)
    part.initializer.extend(t for t in algorithm.initializer if t.name in used_constants)
    part.sparse_initializer.extend(s for s in algorithm.sparse_initializer if s.values.name in used_constants)
    part.input.append(inputs[spec.label])
    outputs = {value.name: value for value in algorithm.output}
    if spec.loss in outputs:
        part.output.append(outputs[spec.loss])
    else:
        part.output.add(name=spec.loss)
    return part
