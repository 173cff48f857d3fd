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
metadata entry ADAPTERS_KEY, so that lora_export.fold can remove them again and write the
original graph with W + (alpha/rank)·A·B in W's place.
"""

from __future__ import annotations

import ast
import collections
import difflib
import fnmatch
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from onnxtrain._recipe.objective import Names, Trainable, default_opset, trainable_names
from onnxtrain._recipe.quantized import standardize_matmul_nbits
from onnxtrain.adapters import LoRA
from onnxtrain.errors import BindingError
from onnxtrain.proto import GraphProto, ModelProto, NodeProto, TensorProto
from onnxtrain.proto.make import node
from onnxtrain.proto.metadata import ADAPTERS_KEY, FORMAT, read_record, set_record
from onnxtrain.translate.registry import normalize_domain
from onnxtrain.translate.tensors import ELEMENT_TYPES, numpy_to_tensor, tensor_to_numpy

# Ops that pass a weight on unchanged in value (a 2-D Transpose swaps its layout).
_PASS = {"Identity", "Transpose"}
# Ops a head search stops at: the result has gone through another linear layer.
_PRODUCTS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "FusedMatMul"}
# Attention projections some exporters fuse into one `qkv_proj` layer.
_FUSED_QKV = ("q_proj", "k_proj", "v_proj")
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
    module: str | None = None             # the exporter's module path of its layer, when known and its own

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


def attribute_value(item: NodeProto, name: str, default: object) -> object:
    """The value of attribute `name` of `item` (float, int, ints or string), else `default`."""
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
        if attribute_value(item, "transA", 0):
            return None, (f"{shown} has transA=1 (x transposed); LoRA adapts Gemm with transA=0 only, "
                          "so leave this weight out of targets")
        flipped = transposed != bool(attribute_value(item, "transB", 0))
        return Site(item, position, "Gemm", flipped, float(attribute_value(item, "alpha", 1.0))), None
    if item.op_type == "Conv":
        if transposed:
            return None, f"{shown} reads the weight through a Transpose"
        if attribute_value(item, "group", 1) != 1:
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
                perm = attribute_value(item, "perm", None)
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


def module_path(item: NodeProto) -> str | None:
    """The path of the torch module a node was exported from (e.g.
    "model.layers.0.self_attn.q_proj"), as peft names modules; None when the export does not
    say. torch.onnx's dynamo exporter records the scopes in the node's metadata (the last
    scope that is not an aten op); TorchScript-based exporters (optimum, onnxruntime-genai's
    builder) name nodes "/model/layers.0/self_attn/q_proj/MatMul"."""
    meta = {entry.key: entry.value for entry in item.metadata_props}
    if "pkg.torch.onnx.name_scopes" in meta:
        try:
            scopes = ast.literal_eval(meta["pkg.torch.onnx.name_scopes"])
            classes = ast.literal_eval(meta.get("pkg.torch.onnx.class_hierarchy", "[]"))
        except (ValueError, SyntaxError):
            return None
        if not isinstance(scopes, list) or not isinstance(classes, list):
            return None
        if len(classes) != len(scopes):
            classes = [""] * (len(scopes) - 1) + ["aten."]   # the last scope is the op's own
        modules = [str(scope) for scope, kind in zip(scopes, classes) if scope and not str(kind).startswith("aten.")]
        return modules[-1] if modules else None
    parts = item.name.split("/")
    if item.name.startswith("/") and len(parts) >= 3 and all(parts[1:-1]):
        return ".".join(parts[1:-1])
    return None


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
    _name_modules([candidate for candidate in kept.values() if candidate.sites])
    return kept


def _name_modules(found: list[Candidate]) -> None:
    """Give each candidate its layer's module path, where all its consumers come from one
    module and no other candidate's do (a module computing two products names neither)."""
    paths = {}
    for candidate in found:
        modules = {module_path(site.node) for site in candidate.sites}
        paths[candidate.name] = modules.pop() if len(modules) == 1 else None
    counts = collections.Counter(path for path in paths.values() if path is not None)
    for candidate in found:
        path = paths[candidate.name]
        candidate.module = path if path is not None and counts[path] == 1 else None


def _matches(pattern: str, candidate: Candidate) -> bool:
    """Whether a target pattern chooses a candidate: by its weight's name (fnmatch), or by its
    module path as peft matches target_modules (the path, or its last parts after a dot) or
    by fnmatch."""
    if fnmatch.fnmatchcase(candidate.name, pattern):
        return True
    module = candidate.module
    return module is not None and (module == pattern or module.endswith("." + pattern)
                                   or fnmatch.fnmatchcase(module, pattern))


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
                               f"head){_listing(usable)}; name the weights with targets=[...]")
        return chosen
    if callable(targets):
        chosen = [c for c in usable.values() if targets(c.name, _stored(model, c), c.sites[0].node)]
        if not chosen:
            raise BindingError(f"LoRA(targets=<predicate>) chose none of the adaptable weights{_listing(usable)}")
        return chosen
    patterns = [targets] if isinstance(targets, str) else list(targets)
    chosen_names: set[str] = set()
    for pattern in patterns:
        matched = [name for name, candidate in found.items() if _matches(pattern, candidate)]
        adaptable = [name for name in matched if found[name].problem is None]
        if matched and (not adaptable or pattern in found):
            # An exact name, or a pattern matching only weights that cannot be adapted: say why.
            name = pattern if pattern in found else matched[0]
            if found[name].problem is not None:
                raise BindingError(f"LoRA cannot adapt {name!r}: {found[name].problem}")
        if not adaptable:
            names = [*usable, *(c.module for c in usable.values() if c.module is not None)]
            close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.4)
            hint = f"; close names: {close}" if close else _listing(usable)
            if pattern in _FUSED_QKV and any(c.module.endswith(".qkv_proj") for c in usable.values() if c.module):
                hint = ("; this export fuses q_proj, k_proj and v_proj into one qkv_proj layer (as "
                        "onnxruntime-genai's builder does), so target 'qkv_proj' to adapt the three together"
                        + hint)
            raise BindingError(f"LoRA target pattern {pattern!r} matches no weight of a MatMul, Gemm or Conv"
                               f"{hint}")
        chosen_names.update(adaptable)
    return [c for name, c in usable.items() if name in chosen_names]


def _listing(found: Mapping[str, Candidate], limit: int = 8) -> str:
    names = [name if c.module is None else f"{name} ({c.module})" for name, c in found.items()]
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
        keep = {k: attribute_value(item, k, None) for k in ("auto_pad", "dilations", "kernel_shape", "pads", "strides")}
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
        # Named as peft names them (the layer's module path) where the export says it.
        stem = candidate.module or candidate.name
        a, b = fresh(f"{stem}.lora_A"), fresh(f"{stem}.lora_B")
        graph.initializer.extend([numpy_to_tensor(a_value, a), numpy_to_tensor(b_value, b)])
        sites = []
        for index, site in enumerate(candidate.sites):
            prefix = site.node.name or f"{candidate.name}/{index}"
            scale = fresh(f"{stem}.lora_scale")
            graph.initializer.append(numpy_to_tensor(np.array(lora.scale * site.gemm_alpha, dtype), scale))
            nodes, base, output = _branch(site, a, b, scale, ratio, fresh, prefix)
            graph.node[site.position].output[0] = base
            after.setdefault(site.position, []).extend(nodes)
            sites.append({"node": site.node.name, "output": output, "base": base, "scale": scale,
                          "nodes": [n.name for n in nodes]})
        record["weights"][candidate.name] = {
            "A": a, "B": b, "kind": candidate.kind, "transposed": candidate.sites[0].transposed,
            "quantized": candidate.dequantize is not None, "shape": list(candidate.dims), "sites": sites,
            "module": candidate.module}
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
    set_record(model, record)
    return record


def trained_weights(model: ModelProto, trainable: Trainable, adapters: LoRA | None, prediction: str | None,
                    source: object = None) -> list[str]:
    """What make_training_model and finetune train: the weights `trainable` selects, or, with
    adapters, the adapters' factors (and the base weights `trainable` adds; see adapt)."""
    if adapters is None:
        return trainable_names(model, trainable)
    return adapt(model, adapters, trainable, prediction, source)


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
    # MatMulNBits (onnxruntime's 8/4-bit weights) as DequantizeLinear + MatMul: a quantized base.
    standardize_matmul_nbits(model)
    chosen = select(model, lora, prediction)
    overlap = sorted({c.name for c in chosen} & set(extra))
    if overlap:
        raise BindingError(f"trainable= names {overlap}, which LoRA adapts; a weight is either adapted or "
                           "trained fully: leave it out of trainable= or of LoRA targets")
    record = insert(model, lora, chosen)
    if isinstance(source, (str, os.PathLike)):
        record["base"] = os.path.abspath(source)
        set_record(model, record)
    factors = [name for entry in record["weights"].values() for name in (entry["A"], entry["B"])]
    return [*factors, *extra]
