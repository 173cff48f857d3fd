"""A model's content digest: what names its compiled programs in the executable cache.

Everything that can change a program goes in: every graph's nodes, inputs and outputs, every
tensor's name, type, shape and values (side files' bytes included, read through their maps),
opsets, local functions, training bindings and metadata. Only the PRNG key an export records
is left out: it is state, not program, so a model exported after training and loaded again
names the same programs. Serialized messages are hashed as they are, so anything that makes
them differ from run to run (a map's private token) costs a cache miss, never a wrong hit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from onnxtrain._io import mapped
from onnxtrain._io.model import stored_bytes
from onnxtrain.proto import GraphProto, ModelProto, TensorProto
from onnxtrain.proto.metadata import KEY_METADATA
from onnxtrain.proto.walk import iter_graphs

_GRAPH_PARTS = ("node", "input", "output", "value_info", "quantization_annotation", "sparse_initializer")


def model_digest(model: ModelProto) -> str:
    """The hex sha256 of everything in `model` that defines what its programs compute.

    Args:
        model: a loaded model (mapped side files are read through their maps).

    Returns:
        64 hex digits; equal for models that differ only in their recorded PRNG key.

    Raises:
        ModelLoadError: a mapped side file can no longer be read.

    Example:
        >>> model_digest(load_model("model.onnx")) == model_digest(load_model("copy_of_model.onnx"))
        True
    """
    digest = hashlib.sha256()

    def add(data: bytes | memoryview) -> None:
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)

    add(f"ir {model.ir_version}".encode())
    for item in (*model.opset_import, *model.functions):
        add(item.SerializeToString(deterministic=True))
    for entry in model.metadata_props:
        if entry.key != KEY_METADATA:
            add(entry.SerializeToString(deterministic=True))
    for info in model.training_info:
        for entry in (*info.initialization_binding, *info.update_binding):
            add(entry.SerializeToString(deterministic=True))
    for graph, where in iter_graphs(model):
        add(where.encode())
        _add_graph(graph, where, add)
    return digest.hexdigest()


def _add_graph(graph: GraphProto, where: str, add: Callable[[bytes | memoryview], None]) -> None:
    add(graph.name.encode())
    for part in _GRAPH_PARTS:
        add(part.encode())
        for item in getattr(graph, part):
            add(item.SerializeToString(deterministic=True))
    for tensor in graph.initializer:
        if not (mapped.is_mapped(tensor) or tensor.HasField("raw_data")):
            # Values in typed fields (small), a placeholder's none, or an unloaded side file's reference.
            add(tensor.SerializeToString(deterministic=True))
            continue
        # The values hashed where they lie, without serializing a copy of a large tensor.
        add(TensorProto(name=tensor.name, dims=tensor.dims, data_type=tensor.data_type).SerializeToString())
        add(stored_bytes(tensor, f"initializer {tensor.name!r} of {where}"))
