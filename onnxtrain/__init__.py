"""onnxtrain: train ONNX models, following the training recipe the model carries.

This module is the whole public surface, with the submodules optim, data, metrics, callbacks,
fitting, cli, backend, translate, state and proto. Modules under onnxtrain._engine,
onnxtrain._recipe and
onnxtrain._io are internal and may change without notice.
"""

from onnxtrain.errors import (
    BindingError,
    ExportError,
    InputError,
    ModelLoadError,
    NumericError,
    OnnxTrainError,
    ResourceError,
    UnsupportedOpError,
)
from onnxtrain import callbacks, data, metrics, optim
from onnxtrain._engine.placement import ShardingAnnotationWarning
from onnxtrain.adapters import LoRA, apply_adapters
from onnxtrain._io.model import load_model, save_model
from onnxtrain._io.summary import describe
from onnxtrain._recipe.builder import make_training_model
from onnxtrain._recipe.damage import ExportDamageWarning
from onnxtrain._recipe.trainable import TrainableSet, default_trainable
from onnxtrain.finetune import FineTuner, finetune
from onnxtrain.inference import run, translate_model
from onnxtrain.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "BindingError",
    "ExportDamageWarning",
    "ExportError",
    "FineTuner",
    "InputError",
    "LoRA",
    "ModelLoadError",
    "NumericError",
    "OnnxTrainError",
    "ResourceError",
    "ShardingAnnotationWarning",
    "Trainer",
    "TrainableSet",
    "UnsupportedOpError",
    "apply_adapters",
    "callbacks",
    "data",
    "default_trainable",
    "describe",
    "finetune",
    "load_model",
    "make_training_model",
    "metrics",
    "optim",
    "run",
    "save_model",
    "translate_model",
]
