"""The one exception hierarchy of onnxtrain.

Every error a user can cause (a bad model, a bad feed, an unsupported
operator) surfaces as a subclass of OnnxTrainError whose message names the
model part involved and what to do about it, never as a raw protobuf, OS or
XLA traceback from deep inside.
"""

from __future__ import annotations


class OnnxTrainError(Exception):
    """Base class of every error onnxtrain raises on purpose."""


class ModelLoadError(OnnxTrainError):
    """A model (or its external data) cannot be read or is inconsistent."""


class UnsupportedOpError(OnnxTrainError):
    """The model uses operators onnxtrain does not implement."""


class BindingError(OnnxTrainError):
    """A TrainingInfoProto binding names a state variable or output that does not fit."""


class InputError(OnnxTrainError):
    """A feed is missing, unexpected, or of the wrong type or shape."""


class NumericError(OnnxTrainError):
    """A training step produced NaN or Inf (the state keeps its last good values)."""


class ExportError(OnnxTrainError):
    """A model or checkpoint cannot be written."""


def without_jax_notes(error: BaseException) -> BaseException:
    """Drop the note JAX attaches to exceptions raised while tracing: our messages stand alone."""
    notes = getattr(error, "__notes__", None)
    if notes:
        error.__notes__ = [note for note in notes if "JAX has removed its internal frames" not in note]
    return error
