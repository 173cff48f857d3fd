"""LoRA adapters on the way out: folding the branch into the weights (merge), the adapter-only
file, applying one to a base model again, and what a trainer's export does with them.

The record lora.insert leaves in the model's metadata says which nodes and initializers the
branch added; fold removes exactly those, so a merged export has the input model's nodes and
names, with W + (alpha/rank)·A·B in each adapted weight's place.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Collection, Mapping

import numpy as np

from onnxtrain._io.export import replace_initializer
from onnxtrain._io.external_data import mark_external, uses_external_data
from onnxtrain._io.model import ModelSource, load_model, save_model
from onnxtrain._io.onnx_adapter import IDENTIFIER, read_onnx_adapter
from onnxtrain._io.onnx_adapter import SUFFIX as ONNX_ADAPTER
from onnxtrain._recipe.lora import attribute_value, candidates, insert
from onnxtrain._recipe.quantized import (quantization_grids, recorded, restore_matmul_nbits,
                                         standardize_matmul_nbits)
from onnxtrain.adapters import LoRA
from onnxtrain.errors import BindingError, ExportError, ModelLoadError
from onnxtrain.proto import GraphProto, ModelProto, NodeProto
from onnxtrain.proto.make import tensor_value_info
from onnxtrain.proto.metadata import ADAPTERS_KEY, read_record, set_record
from onnxtrain.translate.registry import normalize_domain
from onnxtrain.translate.tensors import ELEMENT_TYPES, numpy_to_tensor, tensor_to_numpy

ADAPTER_SUFFIX = ".adapter.onnx"
logger = logging.getLogger("onnxtrain")


def _quantization(graph: GraphProto, item: NodeProto) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(integers, scale, zero point) of a DequantizeLinear of initializers, the last two in
    float64 and broadcast to the integers' shape: per tensor, per axis or blocked."""
    values = {t.name: t for t in graph.initializer}
    data = tensor_to_numpy(values[item.input[0]])
    scale = tensor_to_numpy(values[item.input[1]]).astype(np.float64)
    zero = (tensor_to_numpy(values[item.input[2]]).astype(np.float64)
            if len(item.input) > 2 and item.input[2] else np.zeros_like(scale))
    if scale.size == 1 and scale.ndim <= 1:
        return data, np.broadcast_to(scale.reshape(()), data.shape), np.broadcast_to(zero.reshape(()), data.shape)
    axis = int(attribute_value(item, "axis", 1)) % data.ndim
    block = int(attribute_value(item, "block_size", 0))
    if block:
        scale = np.repeat(scale, block, axis=axis).take(range(data.shape[axis]), axis=axis)
        zero = np.repeat(zero, block, axis=axis).take(range(data.shape[axis]), axis=axis)
        return data, scale, zero
    shape = [1] * data.ndim
    shape[axis] = -1
    return (data, np.broadcast_to(scale.reshape(shape), data.shape),
            np.broadcast_to(zero.reshape(shape), data.shape))


def _dequantized(graph: GraphProto, item: NodeProto) -> np.ndarray:
    """DequantizeLinear of initializers in float64: per tensor, per axis or blocked."""
    data, scale, zero = _quantization(graph, item)
    return (data.astype(np.float64) - zero) * scale


def _on_grid(graph: GraphProto, item: NodeProto, target: np.ndarray) -> tuple[np.ndarray, float] | None:
    """`target` (float64, the integers' shape) rounded onto the grid of DequantizeLinear
    `item` (its scales and zero points kept), as integers of the stored type, and the largest
    change relative to target's largest magnitude; None where a value falls past the grid's
    range (rounding it there would clip the merged weight)."""
    data, scale, zero = _quantization(graph, item)
    low, high = (0, 15) if data.dtype.name == "uint4" else (-8, 7) if data.dtype.name == "int4" else (
        np.iinfo(data.dtype).min, np.iinfo(data.dtype).max)
    integers = np.round(target / np.where(scale != 0, scale, 1.0)) + zero
    if integers.min() < low or integers.max() > high:
        return None
    change = np.abs((integers - zero) * scale - target).max() / max(np.abs(target).max(), 1e-30)
    return integers.astype(data.dtype), float(change)


def delta(entry: Mapping, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """(alpha/rank)·A·B in the stored layout of the weight (float64)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if entry["kind"] == "Conv":
        change = np.einsum("or,ri...->oi...", b64.reshape(b64.shape[:2]), a64)
    else:
        change = a64 @ b64
        if entry["transposed"]:
            change = change.T
    return scale * change


def fold(model: ModelProto) -> ModelProto:
    """`model` (with an adapter branch) as the original graph with each adapted weight replaced
    by W + (alpha/rank)·A·B (in place; returned). A quantized base weight (a DequantizeLinear
    of integers) is rounded onto its own grid: the integers change, the scales, zero points and
    nodes stay (the largest change is logged). A MatMulNBits' rewritten weight, integers other
    nodes read too, or a merged weight past its grid's range become instead a float
    initializer named as the DequantizeLinear output (restore_matmul_nbits quantizes the first
    again); the integer tensor, scale and zero point go when nothing else reads them."""
    record = read_record(model)
    if record is None:
        return model
    graph = model.graph
    scale = record["alpha"] / record["rank"]
    initializers = {t.name: t for t in graph.initializer}
    dropped_nodes: set[str] = set()
    dropped_values: set[str] = set(filter(None, [record.get("dropout_ratio")]))
    renamed: dict[str, str] = {}
    folded: set[str] = set()
    producers = {out: item for item in graph.node for out in item.output}
    readers = Counter(name for item in graph.node for name in item.input)
    rewritten = {f"{original['inputs'][0]}.dq" for original in recorded(model)}
    changes: list[float] = []
    for weight, entry in record["weights"].items():
        a = tensor_to_numpy(initializers[entry["A"]])
        b = tensor_to_numpy(initializers[entry["B"]])
        dropped_values.update([entry["A"], entry["B"]])
        for site in entry["sites"]:
            dropped_nodes.update(site["nodes"])
            dropped_values.add(site["scale"])
            renamed[site["base"]] = site["output"]
        if entry["quantized"]:
            dequantize = producers[weight]
            merged = _dequantized(graph, dequantize) + delta(entry, a, b, scale)
            integers = dequantize.input[0]
            gridded = _on_grid(graph, dequantize, merged) if integers not in rewritten and readers[integers] == 1 \
                else None
            if gridded is not None:
                # Quantized again on the base's grid: the model keeps its integers and QDQ nodes.
                replace_initializer(graph, integers, gridded[0])
                changes.append(gridded[1])
                continue
            # A MatMulNBits' rewritten weight (restore_matmul_nbits quantizes it again), integers
            # other nodes read too, or a merged weight past the grid's range: a float
            # initializer in the DequantizeLinear's place.
            dtype = ELEMENT_TYPES[initializers[dequantize.input[1]].data_type].dtype
            graph.initializer.append(numpy_to_tensor(merged.astype(dtype), weight))
            folded.add(weight)   # its DequantizeLinear goes: the weight is an initializer now
        else:
            stored = tensor_to_numpy(initializers[weight])
            replace_initializer(graph, weight, (stored.astype(np.float64) + delta(entry, a, b, scale)
                                                ).astype(stored.dtype))
    quantized = _quantized_inputs(record, producers)
    kept = []
    for item in graph.node:
        if item.name in dropped_nodes or (item.output and item.output[0] in folded):
            continue
        copy = NodeProto()
        copy.CopyFrom(item)
        copy.output[:] = [renamed.get(name, name) for name in item.output]
        kept.append(copy)
    del graph.node[:]
    graph.node.extend(kept)
    read = {name for item in graph.node for name in item.input} | {v.name for v in graph.output}
    unused = {t.name for t in graph.initializer if t.name not in read and t.name in quantized}
    remaining = [t for t in graph.initializer if t.name not in dropped_values and t.name not in unused]
    del graph.initializer[:]
    graph.initializer.extend(remaining)
    set_record(model, None)
    if changes:
        logger.warning("merging LoRA into %d quantized weights rounded them onto their DequantizeLinear's "
                       "grid: the largest change is %.3g of a weight's largest magnitude. export(..., "
                       "merge=False) keeps the adapters exact beside the quantized base.", len(changes), max(changes))
    return model


def _quantized_inputs(record: Mapping, producers: Mapping[str, NodeProto]) -> set[str]:
    """The integer tensors, scales and zero points of the quantized weights' DequantizeLinear."""
    names: set[str] = set()
    for weight, entry in record["weights"].items():
        if entry["quantized"] and weight in producers:
            names.update(producers[weight].input)
    return names


def adapter_path(path: str) -> str:
    """The adapter file beside the model file `path`: model.onnx -> model.adapter.onnx."""
    stem = path[:-len(".onnx")] if path.endswith(".onnx") else path
    return stem + ADAPTER_SUFFIX


def adapter_model(model: ModelProto, trained: Collection[str] = ()) -> ModelProto:
    """An ONNX model holding only the A and B initializers of `model` (each also a graph
    output, so the file is a valid model ONNX Runtime can load) and the adapter record, plus
    the base weights in `trained` (trained fully, as PEFT's modules_to_save), listed in the
    record under "trained"."""
    record = dict(read_record(model) or {})
    if not record:
        raise BindingError("the model carries no adapters")
    names = [name for entry in record["weights"].values() for name in (entry["A"], entry["B"])]
    record.pop("base", None)   # a local path, meaningless elsewhere
    record["trained"] = [name for name in trained if name not in names]
    names += record["trained"]
    values = {t.name: t for t in model.graph.initializer}
    graph = GraphProto(name="lora_adapters")
    for name in names:
        tensor = values[name]
        graph.initializer.append(tensor)
        graph.output.append(tensor_value_info(name, tensor.data_type, list(tensor.dims)))
    out = ModelProto(ir_version=model.ir_version, producer_name="onnxtrain", graph=graph)
    out.opset_import.extend(o for o in model.opset_import if normalize_domain(o.domain) == "")
    set_record(out, record)
    return out


def apply_adapter_file(base: ModelSource, adapter_file: ModelSource, merge: bool = True) -> ModelProto:
    """See onnxtrain.apply_adapters."""
    data = _onnx_adapter_bytes(adapter_file)
    if data is not None:
        return _bind(load_model(base), read_onnx_adapter(data, str(adapter_file)), merge)
    model = load_model(base)
    adapters = load_model(adapter_file)
    record = read_record(adapters)
    if record is None:
        raise ModelLoadError(f"the adapter file carries no {ADAPTERS_KEY!r} metadata; pass a file written by "
                             "export(..., merge=False) (its name ends in .adapter.onnx)")
    values = {t.name: tensor_to_numpy(t) for t in adapters.graph.initializer}
    lora = LoRA(record["rank"], record["alpha"], dropout=record["dropout"])
    standardize_matmul_nbits(model)   # as adapt() did before choosing the targets
    found = candidates(model)
    chosen, factors = [], {}
    for name, entry in record["weights"].items():
        candidate = found.get(name)
        if candidate is None or candidate.problem is not None:
            why = "it is not there" if candidate is None else candidate.problem
            raise BindingError(f"the adapter file adapts {name!r}, but the base model cannot take it: {why} "
                               "(another base model?)")
        if list(candidate.dims) != entry["shape"] or candidate.kind != entry["kind"]:
            raise BindingError(f"adapted weight {name!r} is a {candidate.kind} weight of shape "
                               f"{list(candidate.dims)} in the base model, but the adapter was trained on a "
                               f"{entry['kind']} weight of shape {entry['shape']}: another base model?")
        chosen.append(candidate)
        factors[name] = (values[entry["A"]], values[entry["B"]])
    # Graph order, as at training time, so the branch gets the same names.
    position = {name: index for index, name in enumerate(found)}
    chosen.sort(key=lambda c: position[c.name])
    for name in record.get("trained", []):
        if name not in {t.name for t in model.graph.initializer}:
            raise BindingError(f"the adapter file holds trained weight {name!r}, which the base model lacks "
                               "(another base model?)")
        replace_initializer(model.graph, name, values[name])
    inserted = insert(model, lora, chosen, factors)
    if any(inserted["weights"][w]["A"] != record["weights"][w]["A"] for w in inserted["weights"]):
        raise BindingError("the adapter's tensor names do not fit the base model (another base model?)")
    grids = quantization_grids(model)
    restore_matmul_nbits(fold(model) if merge else model, grids)
    return model


def _onnx_adapter_bytes(source: ModelSource) -> bytes | None:
    """The bytes of an ONNX Runtime adapter file (a path ending in .onnx_adapter, or bytes
    carrying its identifier), else None."""
    if isinstance(source, (str, os.PathLike)) and os.fspath(source).endswith(ONNX_ADAPTER):
        try:
            with open(source, "rb") as file:
                return file.read()
        except OSError as error:
            raise ModelLoadError(f"cannot read {source}: {error.strerror or error}") from None
    if isinstance(source, (bytes, bytearray)) and bytes(source[4:8]) == IDENTIFIER:
        return bytes(source)
    return None


def _bind(model: ModelProto, parameters: Mapping[str, np.ndarray], merge: bool) -> ModelProto:
    """The adapter-ready base `model` (see adapter_ready_transform) with an .onnx_adapter
    file's factors in its A and B inputs' place, folded in with merge."""
    record = read_record(model)
    if record is None:
        raise ModelLoadError("an .onnx_adapter file binds to the adapter-ready base that "
                             "export_adapters(..., base=...) writes; this base model carries no adapters")
    names = {name for entry in record["weights"].values() for name in (entry["A"], entry["B"])}
    missing = sorted(names - set(parameters))
    if missing:
        raise BindingError(f"the adapter file lacks {missing[:4]}, which the base model's adapter inputs name "
                           "(an adapter trained on other layers?)")
    ranks = {parameters[entry["A"]].shape[-1] for entry in record["weights"].values()}
    for entry in record["weights"].values():
        a, b = parameters[entry["A"]], parameters[entry["B"]]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or len(ranks) != 1:
            raise BindingError(f"the adapter file's {entry['A']} {list(a.shape)} and {entry['B']} {list(b.shape)} "
                               "are not the two factors of one rank")
        replace_initializer(model.graph, entry["A"], a)
        replace_initializer(model.graph, entry["B"], b)
    kept = [value for value in model.graph.input if value.name not in names]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    # The file's B carries alpha/rank and the base's branch multiplies by 1.
    rank = ranks.pop()
    set_record(model, {**record, "rank": int(rank), "alpha": float(rank)})
    return fold(model) if merge else model


def _share_base_data(out: ModelProto, record: Mapping, path: str, written: Collection[str]) -> None:
    """Point the base weights of `out` at the base model's external data file instead of
    copying them, when the base came from a file with external data in the folder `path` is
    written to (a location may not leave its model's folder). Values the export writes
    (trained state) and tensors whose type or shape changed are left inline."""
    base = record.get("base")
    if not base or os.path.dirname(os.path.abspath(path)) != os.path.dirname(base) or not os.path.isfile(base):
        return
    stored = {t.name: t for t in load_model(base, load_external_data=False).graph.initializer
              if uses_external_data(t)}
    for tensor in out.graph.initializer:
        reference = stored.get(tensor.name)
        if (reference is None or tensor.name in written or tensor.data_type != reference.data_type
                or list(tensor.dims) != list(reference.dims)):
            continue
        entries = {entry.key: entry.value for entry in reference.external_data}
        if set(entries) - {"location", "offset", "length"} or "length" not in entries:
            continue   # a checksum or a missing length, which this writer does not reproduce: copy
        mark_external(tensor, entries["location"], int(entries.get("offset", 0)), int(entries["length"]))


def onnx_adapter_parameters(record: Mapping, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The parameters of an `.onnx_adapter` file for these adapters: A, and B times alpha/rank
    (the adapter-ready base multiplies by 1, so adapters of other ranks and alphas fit it).

    Raises:
        ExportError: a Conv adapter (ONNX Runtime binds adapters to MatMul layers).
    """
    scale = record["alpha"] / record["rank"]
    parameters = {}
    for weight, entry in record["weights"].items():
        if entry["kind"] == "Conv":
            raise ExportError(f"weight {weight!r} is a Conv's; ONNX Runtime's adapter files hold the "
                              "factors of MatMul and Gemm layers only: write export(..., merge=False)")
        a, b = values[entry["A"]], values[entry["B"]]
        parameters[entry["A"]] = a
        parameters[entry["B"]] = (b.astype(np.float64) * scale).astype(b.dtype)
    return parameters


def adapter_ready_transform(path: str, written: Collection[str] = ()):
    """What an export of the adapter-ready base does before saving: each A and B becomes a
    graph input ([in, rank] and [rank, out], the rank open) whose default is empty ([in, 0],
    [0, out]), so the branch adds nothing until ONNX Runtime binds an adapter file's factors
    to them by name, and each branch's scale becomes 1 (the file's B carries alpha/rank)."""

    def transform(out: ModelProto) -> ModelProto:
        record = read_record(out)
        scale = record["alpha"] / record["rank"]
        initializers = {t.name: t for t in out.graph.initializer}
        for entry in record["weights"].values():
            a, b = initializers[entry["A"]], initializers[entry["B"]]
            dtype = ELEMENT_TYPES[a.data_type].dtype
            rank = f"{entry['A']}.rank"
            replace_initializer(out.graph, entry["A"], np.zeros((a.dims[0], 0), dtype))
            replace_initializer(out.graph, entry["B"], np.zeros((0, b.dims[1]), dtype))
            out.graph.input.extend([tensor_value_info(entry["A"], a.data_type, [a.dims[0], rank]),
                                    tensor_value_info(entry["B"], b.data_type, [rank, b.dims[1]])])
            for site in entry["sites"]:
                factor = tensor_to_numpy(initializers[site["scale"]])
                replace_initializer(out.graph, site["scale"], (factor.astype(np.float64) / scale).astype(factor.dtype))
        _share_base_data(out, record, path, written)
        return out

    return transform


def export_transform(model: ModelProto, training: bool, merge: bool | None, path: str,
                     written: Collection[str] = ()):
    """What an export of a model with adapters does before saving: None for a model without
    adapters; merge (default for inference exports) folds them in; merge=False keeps the
    branch, shares the base model's external data file when it can (see _share_base_data)
    and writes the adapter file beside `path`. written: the names the export writes values for.

    Raises:
        ExportError: merge=True with training=True (a training model keeps its branch, so that
            Trainer(path) resumes), or merge given for a model without adapters.
    """
    record = read_record(model)
    if record is None:
        if merge is not None:
            raise ExportError(f"merge={merge} applies to models with adapters (LoRA); this model has none")
        return None
    if training:
        if merge:
            raise ExportError("a training export keeps the adapter branch and A, B as state, so that "
                              "Trainer(path) resumes; export(training=False) to merge")
        return None

    def transform(out: ModelProto) -> ModelProto:
        # MatMulNBits bases are written back as such, a merged weight quantized again.
        if merge is None or merge:
            grids = quantization_grids(out)
            restore_matmul_nbits(fold(out), grids)
            return out
        initializers = {t.name for t in out.graph.initializer}
        save_model(adapter_model(out, [name for name in written if name in initializers]),
                   adapter_path(str(path)))
        restore_matmul_nbits(out)
        _share_base_data(out, record, path, written)
        return out

    return transform


