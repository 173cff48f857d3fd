"""The one exception hierarchy of onnxtrain.

Every error a user can cause (a bad model, a bad feed, an unsupported
operator) surfaces as a subclass of OnnxTrainError whose message names the
model part involved and what to do about it, never as a raw protobuf, OS or
XLA traceback from deep inside. Warnings, likewise, point at the user's line
that called onnxtrain (user_stacklevel).
"""

from __future__ import annotations

import sys


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


def user_stacklevel() -> int:
    """The stacklevel for warnings.warn, called from the function that warns, that points at
    the first frame outside onnxtrain (and outside JAX, which runs onnxtrain's code while it
    traces), so a warning names the user's line however deep inside onnxtrain it is raised
    (what Python 3.12's skip_file_prefixes does).

    Example:
        >>> warnings.warn("...", ExportDamageWarning, stacklevel=user_stacklevel())
    """
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and _inside(frame.f_globals.get("__name__", "")):
        frame, level = frame.f_back, level + 1
    return level


def _inside(module: str) -> bool:
    return module.partition(".")[0] in ("onnxtrain", "jax", "jaxlib")
