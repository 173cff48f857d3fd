"""LoRA graph surgery: which weights to adapt, the adapter branch, folding it back.

A target is a float weight value W read as the weight operand of MatMul (input 1), Gemm
(input 1) or Conv (input 1, group 1), directly or through Identity and 2-D Transpose nodes.
W is an initializer, or the output of a DequantizeLinear of an integer initializer (a
quantized base, as ONNX Runtime's quantizer writes it; the integer tensor is never
dequantized nor trained). Next to each consumer the graph gains

    Y = consumer(x, W, ...)  ->  Y.lora_base = consumer(x, W, ...)
                                 Y = Y.lora_base + s·((dropout(x)·A)·B)

with A, B and s new initializers (Conv: A is a conv with W's kernel to `rank` channels, B a
1x1 conv). The nodes are named `<consumer>/lora/...` and recorded, with the targets, in the
metadata entry ADAPTERS_KEY, so that `fold` can remove them again and write the original
graph with W + (alpha/rank)·A·B in W's place.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import math
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from onnxtrain._io.export import replace_initializer
from onnxtrain._io.external_data import mark_external, uses_external_data
from onnxtrain._io.model import load_model, save_model
from onnxtrain._recipe.objective import Names, Trainable, default_opset, trainable_names
from onnxtrain.adapters import LoRA
from onnxtrain.errors import BindingError, ExportError, ModelLoadError
from onnxtrain.proto import GraphProto, ModelProto, NodeProto, StringStringEntryProto, TensorProto
from onnxtrain.proto.make import node, tensor_value_info
from onnxtrain.translate.registry import normalize_domain
from onnxtrain.translate.tensors import ELEMENT_TYPES, data_type_of, numpy_to_tensor, tensor_to_numpy

ADAPTERS_KEY = "onnxtrain.adapters"
ADAPTER_SUFFIX = ".adapter.onnx"
FORMAT = 1
# Ops that pass a weight on unchanged in value (a 2-D Transpose swaps its layout).
_PASS = {"Identity", "Transpose"}
# Ops a head search stops at: the result has gone through another linear layer.
_PRODUCTS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "FusedMatMul"}
_FLOAT_CODES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}


@dataclass
class Site:
    """One consumer of a target: its node, kind, and whether W reaches it transposed (so that
    the [in, out] matrix x is multiplied with is W's transpose)."""

    node: NodeProto
    position: int   # the node's index in graph.node
    kind: str
    transposed: bool = False
    gemm_alpha: float = 1.0


@dataclass
class Candidate:
    """A weight value that can be adapted: its stored shape and type, and its consumers."""

    name: str
    dims: tuple[int, ...]
    elem_type: int
    sites: list[Site] = field(default_factory=list)
    dequantize: NodeProto | None = None   # the DequantizeLinear producing it, for a quantized base
    problem: str | None = None            # why it cannot be adapted, when it cannot
    head: bool = False

    @property
    def kind(self) -> str:
        return self.sites[0].kind

    @property
    def shape(self) -> tuple[int, int]:
        """(in, out) of the matrix x is multiplied with; (in channels, out channels) for Conv."""
        if self.kind == "Conv":
            return self.dims[1], self.dims[0]
        rows, columns = self.dims
        return (columns, rows) if self.sites[0].transposed else (rows, columns)


def _attribute(item: NodeProto, name: str, default: object) -> object:
    for attribute in item.attribute:
        if attribute.name == name:
            if attribute.type == attribute.FLOAT:
                return attribute.f
            if attribute.type == attribute.INT:
                return attribute.i
            if attribute.type == attribute.INTS:
                return list(attribute.ints)
            if attribute.type == attribute.STRING:
                return attribute.s.decode()
    return default


# value name -> (node, its position in graph.node, input index) of each node reading it.
Uses = Mapping[str, list[tuple[NodeProto, int, int]]]


def _uses(graph: GraphProto) -> dict[str, list[tuple[NodeProto, int, int]]]:
    found: dict[str, list[tuple[NodeProto, int, int]]] = {}
    for position, item in enumerate(graph.node):
        for index, name in enumerate(item.input):
            if name:
                found.setdefault(name, []).append((item, position, index))
    return found


def _site(item: NodeProto, position: int, transposed: bool) -> tuple[Site | None, str | None]:
    """The Site for a node reading a weight at input 1, or why it cannot be adapted."""
    shown = f"{item.op_type} {item.name!r}"
    if item.op_type == "MatMul":
        return Site(item, position, "MatMul", transposed), None
    if item.op_type == "Gemm":
        if _attribute(item, "transA", 0):
            return None, (f"{shown} has transA=1 (x transposed); LoRA adapts Gemm with transA=0 only, "
                          "so leave this weight out of targets")
        flipped = transposed != bool(_attribute(item, "transB", 0))
        return Site(item, position, "Gemm", flipped, float(_attribute(item, "alpha", 1.0))), None
    if item.op_type == "Conv":
        if transposed:
            return None, f"{shown} reads the weight through a Transpose"
        if _attribute(item, "group", 1) != 1:
            return None, f"{shown} is a grouped convolution (group != 1); LoRA adapts group=1 Conv only"
        return Site(item, position, "Conv"), None
    return None, None


def _reach(name: str, uses: Uses) -> tuple[list[Site], str | None]:
    """The consumer sites `name` reaches through Identity and 2-D Transpose nodes, or why one of
    its uses is not a linear layer's weight operand (merging would change that use too)."""
    sites: list[Site] = []
    pending = [(name, False)]
    while pending:
        value, transposed = pending.pop()
        for item, position, index in uses.get(value, []):
            if normalize_domain(item.domain) == "" and item.op_type in _PASS and index == 0:
                perm = _attribute(item, "perm", None)
                if item.op_type == "Transpose" and perm not in (None, [1, 0]):
                    return [], f"it is read by Transpose {item.name!r} with perm={perm}"
                pending.append((item.output[0], transposed != (item.op_type == "Transpose")))
                continue
            site, problem = (_site(item, position, transposed) if normalize_domain(item.domain) == "" and index == 1
                             else (None, None))
            if problem:
                return [], problem
            if site is None:
                return [], (f"it is also read by {item.op_type} {item.name!r} (input {index}), which is not "
                            "a linear layer's weight operand (an embedding table or a constant)")
            sites.append(site)
    return sites, None


def _integer_initializer(item: NodeProto, initializers: Mapping[str, TensorProto]) -> bool:
    """Whether `item` is a DequantizeLinear of an integer initializer with constant scale and zero point."""
    if item.op_type != "DequantizeLinear" or normalize_domain(item.domain) != "":
        return False
    data = initializers.get(item.input[0])
    if data is None or data.data_type in _FLOAT_CODES:
        return False
    return all(name in initializers for name in item.input[1:] if name)


def candidates(model: ModelProto, prediction: str | None = None) -> dict[str, Candidate]:
    """Every weight value of the main graph LoRA could adapt (and those it could not, with
    `problem` set), by name, in graph order.

    Args:
        model: the inference model.
        prediction: the trained output (default: the first); a layer whose result reaches it
            without another product on the way is the head.
    """
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    uses = _uses(graph)
    found: dict[str, Candidate] = {}
    for tensor in graph.initializer:
        if tensor.data_type in _FLOAT_CODES and len(tensor.dims) >= 2:
            found[tensor.name] = Candidate(tensor.name, tuple(tensor.dims), tensor.data_type)
    for item in graph.node:
        if _integer_initializer(item, initializers):
            data, scale = initializers[item.input[0]], initializers[item.input[1]]
            if len(data.dims) >= 2:
                found[item.output[0]] = Candidate(item.output[0], tuple(data.dims), scale.data_type,
                                                  dequantize=item)
    kept: dict[str, Candidate] = {}
    for name, candidate in found.items():
        sites, problem = _reach(name, uses)
        if not sites and problem is None:
            continue
        candidate.sites, candidate.problem = sites, problem
        if problem is None:
            kinds = {site.kind for site in sites}
            if len(kinds) > 1 or len({site.transposed for site in sites}) > 1:
                candidate.problem = "its consumers read it in different layouts or ops"
            elif kinds != {"Conv"} and len(candidate.dims) != 2:
                candidate.problem = f"it has {len(candidate.dims)} axes; MatMul and Gemm weights need 2"
            elif any(item.input[0] in initializers for item in (site.node for site in sites)):
                candidate.problem = "its consumer multiplies it with a constant, not an activation"
        kept[name] = candidate
    output = prediction or graph.output[0].name
    for candidate in kept.values():
        candidate.head = any(_reaches_output(site.node, output, uses) for site in candidate.sites)
    return kept


def _reaches_output(item: NodeProto, output: str, uses: Uses) -> bool:
    """Whether `item`'s result reaches graph output `output` without passing another product."""
    pending, seen = list(item.output), set(item.output)
    while pending:
        value = pending.pop()
        if value == output:
            return True
        for consumer, _, _ in uses.get(value, []):
            if consumer.op_type in _PRODUCTS and normalize_domain(consumer.domain) == "":
                continue
            for name in consumer.output:
                if name and name not in seen:
                    seen.add(name)
                    pending.append(name)
    return False


def select(model: ModelProto, lora: LoRA, prediction: str | None = None) -> list[Candidate]:
    """The candidates `lora.targets` chooses (see LoRA), in graph order.

    Raises:
        BindingError: nothing is chosen, a pattern matches no adaptable weight (the message
            lists the closest names), or a chosen weight cannot be adapted (and why).
    """
    found = candidates(model, prediction)
    usable = {name: c for name, c in found.items() if c.problem is None}
    targets = lora.targets
    if targets is None:
        chosen = [c for c in usable.values() if c.kind in ("MatMul", "Gemm") and not c.head]
        if not chosen:
            raise BindingError("LoRA(targets=None) found no linear layer to adapt: no 2-D float weight is the "
                               "weight operand of a MatMul or Gemm (other than embeddings and the output "
                               f"head){_listing(found)}; name the weights with targets=[...]")
        return chosen
    if callable(targets):
        chosen = [c for c in usable.values() if targets(c.name, _stored(model, c), c.sites[0].node)]
        if not chosen:
            raise BindingError(f"LoRA(targets=<predicate>) chose none of the adaptable weights{_listing(usable)}")
        return chosen
    patterns = [targets] if isinstance(targets, str) else list(targets)
    chosen_names: set[str] = set()
    for pattern in patterns:
        matched = [name for name in found if fnmatch.fnmatchcase(name, pattern)]
        adaptable = [name for name in matched if found[name].problem is None]
        if matched and (not adaptable or pattern in found):
            # An exact name, or a pattern matching only weights that cannot be adapted: say why.
            name = pattern if pattern in found else matched[0]
            if found[name].problem is not None:
                raise BindingError(f"LoRA cannot adapt {name!r}: {found[name].problem}")
        if not adaptable:
            close = difflib.get_close_matches(pattern, list(usable), n=5, cutoff=0.4)
            hint = f"; close names: {close}" if close else _listing(usable)
            raise BindingError(f"LoRA target pattern {pattern!r} matches no weight of a MatMul, Gemm or Conv"
                               f"{hint}")
        chosen_names.update(adaptable)
    return [c for name, c in usable.items() if name in chosen_names]


def _listing(found: Mapping[str, Candidate], limit: int = 8) -> str:
    names = list(found)
    if not names:
        return ""
    return f" (adaptable weights: {names[:limit]}{' ...' if len(names) > limit else ''})"


def _stored(model: ModelProto, candidate: Candidate) -> np.ndarray:
    """The stored value of a candidate: the float initializer, or a quantized base's integers."""
    name = candidate.dequantize.input[0] if candidate.dequantize is not None else candidate.name
    tensor = next(t for t in model.graph.initializer if t.name == name)
    return tensor_to_numpy(tensor, f"initializer {name!r}")


# --- the branch --------------------------------------------------------------------------------

def _initial_factors(candidate: Candidate, rank: int, rng: np.random.Generator, dtype: np.dtype
                     ) -> tuple[np.ndarray, np.ndarray]:
    """A uniform in ±1/sqrt(fan_in) (torch's Kaiming-uniform with a=sqrt(5), PEFT's default),
    B zero: the adapted model starts as the base model."""
    fan_in, out = candidate.shape
    if candidate.kind == "Conv":
        kernel = candidate.dims[2:]
        fan_in *= math.prod(kernel)
        bound = 1.0 / math.sqrt(fan_in)
        a = rng.uniform(-bound, bound, (rank, candidate.dims[1], *kernel))
        b = np.zeros((out, rank, *[1] * len(kernel)))
    else:
        bound = 1.0 / math.sqrt(fan_in)
        a = rng.uniform(-bound, bound, (fan_in, rank))
        b = np.zeros((rank, out))
    return a.astype(dtype), b.astype(dtype)


def _branch(site: Site, a: str, b: str, scale: str, ratio: str | None, fresh: Names,
            prefix: str) -> tuple[list[NodeProto], str, str]:
    """The branch nodes of one site: (nodes, renamed base output, original output)."""
    item = site.node
    output = item.output[0]
    base = fresh(f"{output}.lora_base")
    x = item.input[0]
    nodes = []
    if ratio is not None:
        dropped = fresh(f"{prefix}/lora/dropout_output")
        nodes.append(node("Dropout", [x, ratio], [dropped], name=fresh(f"{prefix}/lora/dropout")))
        x = dropped
    down, up, scaled = (fresh(f"{prefix}/lora/{part}") for part in ("xA", "xAB", "scaled"))
    if site.kind == "Conv":
        keep = {k: _attribute(item, k, None) for k in ("auto_pad", "dilations", "kernel_shape", "pads", "strides")}
        keep = {k: v for k, v in keep.items() if v is not None}
        nodes.append(node("Conv", [x, a], [down], name=fresh(f"{prefix}/lora/A"), **keep))
        nodes.append(node("Conv", [down, b], [up], name=fresh(f"{prefix}/lora/B")))
    else:
        nodes.append(node("MatMul", [x, a], [down], name=fresh(f"{prefix}/lora/A")))
        nodes.append(node("MatMul", [down, b], [up], name=fresh(f"{prefix}/lora/B")))
    nodes.append(node("Mul", [up, scale], [scaled], name=fresh(f"{prefix}/lora/scale")))
    nodes.append(node("Add", [base, scaled], [output], name=fresh(f"{prefix}/lora/add")))
    return nodes, base, output


def insert(model: ModelProto, lora: LoRA, chosen: list[Candidate],
           factors: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None) -> dict:
    """Add A, B and the branch next to every site of `chosen` (in place) and record them in the
    metadata; returns the record. factors: weight -> (A, B) to use instead of fresh ones."""
    graph = model.graph
    fresh = Names(graph)
    fresh.taken |= {n.name for n in graph.node if n.name}
    rng = np.random.default_rng(lora.seed)
    ratio = None
    if lora.dropout > 0:
        if default_opset(model) < 12:
            raise BindingError("LoRA(dropout=...) needs ai.onnx opset 12 or newer (Dropout's ratio input); "
                               "the model imports an older one: use dropout=0")
        ratio = fresh("lora.dropout_ratio")
        graph.initializer.append(numpy_to_tensor(np.array(lora.dropout, np.float32), ratio))
    record: dict = {"format": FORMAT, "rank": int(lora.rank), "alpha": float(lora.alpha),
                    "dropout": float(lora.dropout), "weights": {}}
    after: dict[int, list[NodeProto]] = {}
    for candidate in chosen:
        dtype = ELEMENT_TYPES[candidate.elem_type].dtype
        if factors is not None:
            a_value, b_value = factors[candidate.name]
        else:
            a_value, b_value = _initial_factors(candidate, lora.rank, rng, dtype)
        a, b = fresh(f"{candidate.name}.lora_A"), fresh(f"{candidate.name}.lora_B")
        graph.initializer.extend([numpy_to_tensor(a_value, a), numpy_to_tensor(b_value, b)])
        sites = []
        for index, site in enumerate(candidate.sites):
            prefix = site.node.name or f"{candidate.name}/{index}"
            scale = fresh(f"{candidate.name}.lora_scale")
            graph.initializer.append(numpy_to_tensor(np.array(lora.scale * site.gemm_alpha, dtype), scale))
            nodes, base, output = _branch(site, a, b, scale, ratio, fresh, prefix)
            graph.node[site.position].output[0] = base
            after.setdefault(site.position, []).extend(nodes)
            sites.append({"node": site.node.name, "output": output, "base": base, "scale": scale,
                          "nodes": [n.name for n in nodes]})
        record["weights"][candidate.name] = {
            "A": a, "B": b, "kind": candidate.kind, "transposed": candidate.sites[0].transposed,
            "quantized": candidate.dequantize is not None, "shape": list(candidate.dims), "sites": sites}
    if ratio is not None:
        record["dropout_ratio"] = ratio
    ordered = []
    for index, item in enumerate(graph.node):
        copy = NodeProto()
        copy.CopyFrom(item)
        ordered.append(copy)
        ordered.extend(after.get(index, []))
    del graph.node[:]
    graph.node.extend(ordered)
    _set_record(model, record)
    return record


def _set_record(model: ModelProto, record: dict | None) -> None:
    kept = [entry for entry in model.metadata_props if entry.key != ADAPTERS_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if record is not None:
        model.metadata_props.append(StringStringEntryProto(key=ADAPTERS_KEY, value=json.dumps(record)))


def read_record(model: ModelProto) -> dict | None:
    """The adapter record a model carries (see insert), or None.

    Raises:
        ModelLoadError: the record is malformed.
    """
    for entry in model.metadata_props:
        if entry.key == ADAPTERS_KEY:
            try:
                record = json.loads(entry.value)
                if record.get("format") != FORMAT or not isinstance(record.get("weights"), dict):
                    raise ValueError(f"format {record.get('format')!r}, expected {FORMAT}")
                return record
            except (ValueError, AttributeError) as error:
                raise ModelLoadError(f"metadata {ADAPTERS_KEY!r} is malformed ({error}); it must be written "
                                     "by onnxtrain's LoRA") from None
    return None


def adapt(model: ModelProto, lora: LoRA, trainable: Trainable, prediction: str | None,
          source: object = None) -> list[str]:
    """Insert `lora`'s adapters into `model` (in place) and return what trains: every A and B,
    then the base weights `trainable` names (trained fully; None adds none). source: where
    `model` was loaded from; a path is recorded, so that a merge=False export beside it can
    share its external data file.

    Raises:
        BindingError: see select; `trainable` names an adapted weight.
    """
    if not isinstance(lora, LoRA):
        raise BindingError(f"adapters={lora!r}: pass an onnxtrain.LoRA(rank=..., alpha=...)")
    if read_record(model) is not None:
        raise BindingError(f"the model already carries adapters (metadata {ADAPTERS_KEY!r}); merge them "
                           "first with onnxtrain.apply_adapters(base, adapter_file, merge=True)")
    extra = [] if trainable is None else trainable_names(model, trainable)
    chosen = select(model, lora, prediction)
    overlap = sorted({c.name for c in chosen} & set(extra))
    if overlap:
        raise BindingError(f"trainable= names {overlap}, which LoRA adapts; a weight is either adapted or "
                           "trained fully: leave it out of trainable= or of LoRA targets")
    record = insert(model, lora, chosen)
    if isinstance(source, (str, os.PathLike)):
        record["base"] = os.path.abspath(source)
        _set_record(model, record)
    factors = [name for entry in record["weights"].values() for name in (entry["A"], entry["B"])]
    return [*factors, *extra]


# --- folding back, adapter files ------------------------------------------------------------------

def _dequantized(graph: GraphProto, item: NodeProto) -> np.ndarray:
    """DequantizeLinear of initializers in float64: per tensor, per axis or blocked."""
    values = {t.name: t for t in graph.initializer}
    data = tensor_to_numpy(values[item.input[0]]).astype(np.float64)
    scale = tensor_to_numpy(values[item.input[1]]).astype(np.float64)
    zero = (tensor_to_numpy(values[item.input[2]]).astype(np.float64)
            if len(item.input) > 2 and item.input[2] else np.zeros_like(scale))
    if scale.size == 1 and scale.ndim <= 1:
        return (data - zero.reshape(())) * scale.reshape(())
    axis = int(_attribute(item, "axis", 1)) % data.ndim
    block = int(_attribute(item, "block_size", 0))
    if block:
        scale = np.repeat(scale, block, axis=axis).take(range(data.shape[axis]), axis=axis)
        zero = np.repeat(zero, block, axis=axis).take(range(data.shape[axis]), axis=axis)
        return (data - zero) * scale
    shape = [1] * data.ndim
    shape[axis] = -1
    return (data - zero.reshape(shape)) * scale.reshape(shape)


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
    by W + (alpha/rank)·A·B (in place; returned). A quantized base weight becomes a float
    initializer named as its DequantizeLinear output; the integer tensor, scale and zero point
    go when nothing else reads them."""
    record = read_record(model)
    if record is None:
        return model
    graph = model.graph
    scale = record["alpha"] / record["rank"]
    initializers = {t.name: t for t in graph.initializer}
    dropped_nodes: set[str] = set()
    dropped_values: set[str] = set(filter(None, [record.get("dropout_ratio")]))
    renamed: dict[str, str] = {}
    producers = {out: item for item in graph.node for out in item.output}
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
            base = _dequantized(graph, dequantize)
            dtype = ELEMENT_TYPES[initializers[dequantize.input[1]].data_type].dtype
            graph.initializer.append(numpy_to_tensor((base + delta(entry, a, b, scale)).astype(dtype), weight))
            dequantize.ClearField("output")
        else:
            stored = tensor_to_numpy(initializers[weight])
            replace_initializer(graph, weight, (stored.astype(np.float64) + delta(entry, a, b, scale)
                                                ).astype(stored.dtype))
    kept = []
    for item in graph.node:
        if item.name in dropped_nodes or not item.output:
            continue
        copy = NodeProto()
        copy.CopyFrom(item)
        copy.output[:] = [renamed.get(name, name) for name in item.output]
        kept.append(copy)
    del graph.node[:]
    graph.node.extend(kept)
    read = {name for item in graph.node for name in item.input} | {v.name for v in graph.output}
    unused = {t.name for t in graph.initializer if t.name not in read and t.name in _quantized_inputs(record, producers)}
    remaining = [t for t in graph.initializer if t.name not in dropped_values and t.name not in unused]
    del graph.initializer[:]
    graph.initializer.extend(remaining)
    _set_record(model, None)
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
    _set_record(out, record)
    return out


def apply_adapter_file(base: object, adapter_file: object, merge: bool = True) -> ModelProto:
    """See onnxtrain.apply_adapters."""
    model = load_model(base)
    adapters = load_model(adapter_file)
    record = read_record(adapters)
    if record is None:
        raise ModelLoadError(f"the adapter file carries no {ADAPTERS_KEY!r} metadata; pass a file written by "
                             "export(..., merge=False) (its name ends in .adapter.onnx)")
    values = {t.name: tensor_to_numpy(t) for t in adapters.graph.initializer}
    lora = LoRA(record["rank"], record["alpha"], dropout=record["dropout"])
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
    order = list(found)
    chosen.sort(key=lambda c: order.index(c.name))
    for name in record.get("trained", []):
        if name not in {t.name for t in model.graph.initializer}:
            raise BindingError(f"the adapter file holds trained weight {name!r}, which the base model lacks "
                               "(another base model?)")
        replace_initializer(model.graph, name, values[name])
    inserted = insert(model, lora, chosen, factors)
    if any(inserted["weights"][w]["A"] != record["weights"][w]["A"] for w in inserted["weights"]):
        raise BindingError("the adapter's tensor names do not fit the base model (another base model?)")
    return fold(model) if merge else model


def describe_adapters(model: ModelProto) -> list[str]:
    """Lines for `onnxtrain inspect`: each adapted weight, its kind, rank and factors."""
    record = read_record(model)
    if record is None:
        return []
    lines = [f"LoRA adapters: rank {record['rank']}, alpha {record['alpha']:g}, dropout {record['dropout']:g}, "
             f"{len(record['weights'])} weights"]
    for weight, entry in record["weights"].items():
        quantized = ", quantized base" if entry["quantized"] else ""
        lines.append(f"  {weight} ({entry['kind']} {entry['shape']}{quantized}): {entry['A']}, {entry['B']}")
    return lines


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
        if merge is None or merge:
            return fold(out)
        initializers = {t.name for t in out.graph.initializer}
        save_model(adapter_model(out, [name for name in written if name in initializers]),
                   adapter_path(str(path)))
        _share_base_data(out, record, path, written)
        return out

    return transform


