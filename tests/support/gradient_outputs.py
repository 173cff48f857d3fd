"""Training models whose steps also return the gradients their Gradient node computes."""

from __future__ import annotations

import onnxtrain
from onnxtrain.proto import ModelProto, ValueInfoProto


def with_gradients(training: ModelProto) -> onnxtrain.Trainer:
    """A Trainer of `training` (from make_training_model) whose steps also return every trained
    weight's gradient, as '<weight>.grad'."""
    algorithm = training.training_info[0].algorithm
    (gradient,) = [n for n in algorithm.node if n.op_type == "Gradient"]
    algorithm.output.extend(ValueInfoProto(name=name) for name in gradient.output)
    return onnxtrain.Trainer(training)
