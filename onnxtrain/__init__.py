"""onnxtrain: train ONNX models, following the training recipe the model carries.

This module is the whole public surface; everything else is internal.
"""

from onnxtrain.errors import (
    BindingError,
    ExportError,
    InputError,
    ModelLoadError,
    NumericError,
    OnnxTrainError,
    UnsupportedOpError,
)
from onnxtrain import optim
from onnxtrain.builder import make_training_model
from onnxtrain.finetune import FineTuner, finetune
from onnxtrain.inference import run, translate_model
from onnxtrain.model import load_model, save_model
from onnxtrain.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "BindingError",
    "ExportError",
    "FineTuner",
    "InputError",
    "ModelLoadError",
    "NumericError",
    "OnnxTrainError",
    "Trainer",
    "UnsupportedOpError",
    "finetune",
    "load_model",
    "make_training_model",
    "optim",
    "run",
    "save_model",
    "translate_model",
]
