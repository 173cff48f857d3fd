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


class ResourceError(OnnxTrainError):
    """A compiled program needs more memory than the device has."""


def out_of_memory(error: BaseException, where: str) -> ResourceError | None:
    """A ResourceError naming `where` when `error` is XLA's RESOURCE_EXHAUSTED, else None.

    A model can ask for outputs no device holds (a Tile or Expand to a huge shape) while every
    shape stays valid, so only running the program finds out.
    """
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if not first_line.startswith("RESOURCE_EXHAUSTED"):
        return None
    return ResourceError(
        f"{where}: the compiled program needs more memory than the device has ({first_line[:200]}). "
        "Check the model's shapes (an Expand, Tile or ConstantOfShape to a huge shape), or feed "
        "smaller batches")


def without_jax_notes(error: BaseException) -> BaseException:
    """Drop the note JAX attaches to exceptions raised while tracing: our messages stand alone."""
    notes = getattr(error, "__notes__", None)
    if notes:
        error.__notes__ = [note for note in notes if "JAX has removed its internal frames" not in note]
    return error
