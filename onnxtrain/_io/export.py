"""Writing a trainer's state back into its model: the exported file, and the PRNG key it carries.

The front ends hold a "light" copy of the model whose state initializers keep no data (the
store has the values); export copies it, puts each value into the initializer it came from
and saves atomically.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping

import jax
import numpy as np

from onnxtrain._io.model import save_model
from onnxtrain.errors import BindingError, ModelLoadError
from onnxtrain.proto import GraphProto, ModelProto, StringStringEntryProto
from onnxtrain.proto.graphs import light_graph
from onnxtrain.proto.metadata import EVALUATION_KEY, KEY_METADATA
from onnxtrain.translate.tensors import numpy_to_tensor

# Where a value lives in the model: None for the main graph, else the index of the
# TrainingInfoProto whose algorithm graph holds it.
Home = Mapping[str, "int | None"]


def stored_key(model: ModelProto) -> jax.Array | None:
    """The PRNG key an earlier export left in the model, if any."""
    for entry in model.metadata_props:
        if entry.key == KEY_METADATA:
            try:
                saved = json.loads(entry.value)
                data = np.frombuffer(bytes.fromhex(saved["data"]), np.dtype(saved["dtype"]))
                return jax.random.wrap_key_data(data.reshape(saved["shape"]), impl=saved["impl"])
            except (KeyError, ValueError, TypeError) as error:
                raise ModelLoadError(f"metadata {KEY_METADATA!r} is malformed ({error}); remove it "
                                     "or pass seed= to start a fresh random stream") from None
    return None


def _key_metadata(key: jax.Array) -> str:
    data = np.asarray(jax.random.key_data(key))
    return json.dumps({"impl": str(jax.random.key_impl(key)), "dtype": data.dtype.name,
                       "shape": list(data.shape), "data": data.tobytes().hex()})


def without_payloads(model: ModelProto, home: Home) -> ModelProto:
    """A copy of `model` whose initializers held in a store keep no data: the store has the
    values, and export writes them back. A fresh message, because protobuf frees a message's
    memory only as a whole."""
    for place in set(home.values()):
        graph = model.graph if place is None else model.training_info[place].algorithm
        kept = light_graph(graph, {name for name, where in home.items() if where == place})
        del graph.initializer[:], graph.sparse_initializer[:]
        graph.initializer.extend(kept.initializer)
        graph.sparse_initializer.extend(kept.sparse_initializer)
    copy = ModelProto()
    copy.CopyFrom(model)
    return copy


def replace_initializer(graph: GraphProto, name: str, value: np.ndarray) -> None:
    """Put `value` into `graph`'s initializer `name` (a sparse one becomes dense)."""
    tensor = numpy_to_tensor(value, name)
    for index, existing in enumerate(graph.initializer):
        if existing.name == name:
            tensor.doc_string = existing.doc_string
            graph.initializer[index].CopyFrom(tensor)
            return
    for index, sparse in enumerate(graph.sparse_initializer):
        if sparse.values.name == name:
            del graph.sparse_initializer[index]
            graph.initializer.append(tensor)
            return
    raise BindingError(f"initializer {name!r} disappeared from graph {graph.name!r}")


def write_model(model: ModelProto, values: Mapping[str, np.ndarray], home: Home, path: str | os.PathLike,
                key: jax.Array | None, external_data: bool | str | None = None,
                transform: Callable[[ModelProto], ModelProto] | None = None) -> None:
    """Save `model` with `values` in their home initializers. key=None writes an inference model
    (no training_info, values homed there skipped); a key keeps training_info and records the
    key, so a Trainer of the file resumes the random stream exactly. transform: applied to the
    finished model just before saving (adapters fold or write their file there)."""
    out = ModelProto()
    out.CopyFrom(model)
    for name, value in values.items():
        place = home[name]
        if place is None:
            replace_initializer(out.graph, name, value)
        elif key is not None:
            replace_initializer(out.training_info[place].algorithm, name, value)
    # An inference model has no training_info for the evaluation names to describe.
    dropped = {KEY_METADATA} if key is not None else {KEY_METADATA, EVALUATION_KEY}
    kept = [entry for entry in out.metadata_props if entry.key not in dropped]
    del out.metadata_props[:]
    out.metadata_props.extend(kept)
    if key is None:
        del out.training_info[:]
    else:
        out.metadata_props.append(StringStringEntryProto(key=KEY_METADATA, value=_key_metadata(key)))
    if transform is not None:
        out = transform(out)
    # Only a transform (an adapter export sharing its base's side file) leaves references.
    save_model(out, path, external_data=external_data, keep_references=transform is not None)
