"""Translation for users: gradients through ONNX models in JAX, and one-shot runs."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from typing import Any

import jax

from onnxtrain._engine.compilation_cache import enable_compilation_cache
from onnxtrain._engine.feeds import FeedChecker
from onnxtrain.errors import InputError
from onnxtrain._io.model import ModelSource, load_model
from onnxtrain.translate.model import TranslatedModel


def translate_model(model: ModelSource, params: Iterable[str] | None = None) -> tuple[TranslatedModel, dict]:
    """The model as a JAX function of its weights, for gradients through ONNX models in JAX.

    Args:
        model: a path, bytes, file object or ModelProto.
        params: the initializers to pass as arguments (default: the float ones that are not
            shapes or axes); the others stay constants of the function.

    Returns:
        (fn, params): fn(params, inputs, key=None) -> {output name: value}, jit- and
        grad-able, compiled once per input signature (random ops draw from `key`); params,
        the chosen initializers as JAX arrays.

    Raises:
        ModelLoadError, UnsupportedOpError: the model cannot be read or has ops onnxtrain lacks.

    Example:
        >>> fn, params = onnxtrain.translate_model("model.onnx")
        >>> grads = jax.grad(lambda p: fn(p, {"x": x})["y"].sum())(params)
    """
    enable_compilation_cache()
    translated = TranslatedModel(load_model(model), params)
    return translated, dict(translated.params)


def run(model: ModelSource, inputs: Mapping[str, Any], key: jax.Array | None = None) -> dict[str, Any]:
    """One-shot inference: translate, compile for these inputs, run.

    Inputs are checked and converted as a Trainer's feeds are (onnxtrain._engine.feeds): an
    input may also replace an initializer the graph lists among its inputs. Random ops draw
    from `key`, or from a fresh random key when none is given.

    Args:
        model: a path, bytes, file object or ModelProto.
        inputs: input name -> array (numpy, JAX, torch, or Python values).
        key: a JAX PRNG key for random ops.

    Returns:
        {output name: value} for every graph output.

    Raises:
        ModelLoadError, UnsupportedOpError: the model cannot be read or has ops onnxtrain lacks.
        InputError: an input is missing, unknown, or of the wrong type or shape.

    Example:
        >>> outputs = onnxtrain.run("model.onnx", {"x": np.ones((1, 4), np.float32)})
    """
    enable_compilation_cache()
    proto = load_model(model)
    translated = TranslatedModel(proto)
    if not isinstance(inputs, Mapping):
        raise InputError(f"model {translated.name!r} takes a mapping of input name -> array, got "
                         f"{type(inputs).__name__}")
    required = set(translated.input_names)
    declared = [info for info in proto.graph.input if info.name in required or info.name in inputs]
    checked = FeedChecker(declared, f"model {translated.name!r}")(inputs)
    if key is None:
        key = jax.random.key(secrets.randbits(63))
    return translated(dict(translated.params), checked, key)
