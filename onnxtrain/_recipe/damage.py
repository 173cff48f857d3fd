"""Export damage: what exporters do to a model that changes how it trains, found and repaired.

An exported inference model serves exactly as its source did, yet may train differently:
- torch.onnx (both exporters) folds BatchNorm into the preceding convolution, so fine-tuning
  runs without batch statistics;
- exporters fold weights into Constant nodes, which then stay fixed;
- exporters store a tied weight twice (TorchScript: T5's embedding and its transposed output
  projection; dynamo's optimizer: GPT-2's transposed output projection), so fine-tuning unties
  them;
- both exporters merge weights that happen to hold equal values (fresh LayerNorm scales and
  shifts, layer scales, zero biases) into one tensor, so fine-tuning ties them;
- a model exported without dynamic axes takes only the batch size it was exported with;
- eval-mode export removes Dropout;
- a static-shape export folds a learned position bias (T5's relative_attention_bias) into a
  constant attention mask, so it stays fixed;
- exporters store the tables torch computes or keeps as buffers (rotary tables, ALiBi slopes)
  as initializers, like weights: the default trainable set leaves them out (a note).

detect() lists these as Findings (what, which tensors or nodes, what to do); make_training_model
and finetune warn once per model about them, and `onnxtrain inspect` lists them. repair() applies
the repairs a caller opts into (REPAIRS); each keeps the inference outputs as they were.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import jax
import numpy as np

from onnxtrain._recipe.dataflow import producer_of
from onnxtrain._recipe.objective import FLOATS, Names, default_opset
from onnxtrain._recipe.trainable import POSITION_TABLE_KINDS, Roles, trainable_set
from onnxtrain.errors import BindingError, user_stacklevel
from onnxtrain.proto import GraphProto, ModelProto, NodeProto, TensorProto, ValueInfoProto
from onnxtrain.proto.make import node as make_node
from onnxtrain.proto.walk import iter_graph_tree
from onnxtrain.translate.graph import graph_initializers
from onnxtrain.translate.registry import normalize_domain
from onnxtrain.translate.tensors import ELEMENT_TYPES, numpy_to_tensor, tensor_to_numpy

# Float tensors at least this large look like weights (smaller ones are scalars, scales, eps).
FOLDED_WEIGHT_SIZE = 64
LIFT, RETIE, UNTIE, RELAX_BATCH, INSERT_BATCHNORM = (
    "lift_constants", "retie", "untie", "relax_batch", "insert_batchnorm")
REPAIRS = (LIFT, RETIE, UNTIE, RELAX_BATCH, INSERT_BATCHNORM)
BATCH = "batch"
NORMALIZATIONS = {"BatchNormalization", "InstanceNormalization", "LayerNormalization", "GroupNormalization",
                  "LpNormalization", "MeanVarianceNormalization", "RMSNormalization",
                  "SkipLayerNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"}
ACTIVATIONS = {"Relu", "LeakyRelu", "PRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Mish", "Elu",
               "Selu", "Gelu", "Tanh", "Softplus", "Swish"}
# The BatchNormalization a repair inserts: torch's defaults (eps 1e-5, momentum 0.1 there).
BN_EPSILON, BN_MOMENTUM = 1e-5, 0.9


@dataclass(frozen=True)
class Finding:
    """One kind of export damage: what it is, where (tensor or node names), what to do, and
    the repair (one of REPAIRS) that undoes it, if any. A note is shown by inspect only."""

    kind: str
    what: str
    names: tuple[str, ...]
    advice: str
    repair: str | None = None
    note: bool = False

    def text(self) -> str:
        """One paragraph: what, where, what to do."""
        shown = ", ".join(self.names[:6]) + (f" and {len(self.names) - 6} more" if len(self.names) > 6 else "")
        fix = f" Or pass repair={{{self.repair!r}}}." if self.repair else ""
        return f"{self.what} ({shown}). {self.advice}{fix}"


def repair_names(repair: Iterable[str] | str | None, lift_folded_weights: bool = False) -> frozenset[str]:
    """The repairs a caller asked for, checked: `repair` (a name, names, or "all") plus
    lift_constants when lift_folded_weights.

    Raises:
        BindingError: a name that is not one of REPAIRS.
    """
    names = {repair} if isinstance(repair, str) else set(repair or ())
    if "all" in names:
        names = (names - {"all"}) | set(REPAIRS)
    unknown = sorted(names - set(REPAIRS))
    if unknown:
        raise BindingError(f"repair={unknown} names no repair; choose from {list(REPAIRS)} (or 'all')")
    return frozenset(names | ({LIFT} if lift_folded_weights else set()))


# --- what a tensor looks like -----------------------------------------------------------------

def folded_weight(item: NodeProto, min_size: int = FOLDED_WEIGHT_SIZE) -> np.ndarray | None:
    """The value of a Constant node that looks like a weight an exporter folded, else None.

    All-equal values (zero RNN states, fill values), masks (two distinct values or fewer) and
    non-finite values are constants by nature: training them would be wrong."""
    if item.op_type != "Constant" or normalize_domain(item.domain) != "" or len(item.attribute) != 1:
        return None
    attribute = item.attribute[0]
    if attribute.name != "value":
        return None
    value = tensor_to_numpy(attribute.t, f"Constant {item.output[0]!r}")
    return value if value.dtype in FLOATS and value.size >= min_size and _weight_like(value) else None


def folded_weights(model: ModelProto, min_size: int = FOLDED_WEIGHT_SIZE) -> dict[str, np.ndarray]:
    """Output name -> value of the main graph's Constant nodes that look like folded weights
    (folded_weight) and that the default trainable set would train as initializers: not a
    rotary table in a Constant (optimum's export keeps inv_freq so), nor an exponent."""
    folded = {item.output[0]: value for item in model.graph.node
              if (value := folded_weight(item, min_size)) is not None}
    if not folded:
        return {}
    roles = Roles(model, {**graph_initializers(model.graph), **folded})
    return {name: value for name, value in folded.items() if roles.reason(name, value) is None}


def _weight_like(value: np.ndarray, whole: bool = True) -> bool:
    """Finite, with more than two distinct values among its first elements. whole=False checks
    finiteness on its ends only: a mapped weight is then not read (nor paged in) whole."""
    flat = value.ravel()
    ends = flat if whole or flat.size <= 8192 else np.concatenate([flat[:4096], flat[-4096:]])
    return bool(np.isfinite(ends).all()) and len(np.unique(flat[:4096])) > 2


def _consumers(graph: GraphProto) -> dict[str, list[NodeProto]]:
    users: dict[str, list[NodeProto]] = {}
    for item in graph.node:
        for name in item.input:
            users.setdefault(name, []).append(item)
    return users


def _is(item: NodeProto, *op_types: str) -> bool:
    return item.op_type in op_types and normalize_domain(item.domain) == ""


# --- detection --------------------------------------------------------------------------------

def detect(model: ModelProto, notes: bool = True) -> list[Finding]:
    """Every kind of export damage visible in `model`'s main graph (see the module docstring);
    with notes=False, the warnings only (what make_training_model and finetune show).

    Example:
        >>> for finding in detect(load_model("resnet.onnx")):
        ...     print(finding.text())
    """
    graph = model.graph
    values = graph_initializers(graph)
    found = [_folded_batchnorm(graph, values), _folded_constants(model), _duplicates(graph, values),
             _merged(graph, values), _fixed_batch(graph, values), _bias_in_mask(values)]
    if notes:
        found += [_dropout_removed(graph), _position_tables(model)]
    return [finding for finding in found if finding is not None]


def folded_convolutions(graph: GraphProto) -> list[NodeProto]:
    """The Conv nodes BatchNorm would follow in a torchvision-style CNN: all but those fed by
    global pooling (squeeze-and-excitation blocks, classifier heads), which have none."""
    producers = producer_of(graph)

    def pooled(name: str) -> bool:
        item = producers.get(name)
        while item is not None and item.op_type in ACTIVATIONS | {"Flatten", "Reshape", "Conv"}:
            item = producers.get(item.input[0]) if item.input else None
        return item is not None and item.op_type in {"GlobalAveragePool", "GlobalMaxPool", "ReduceMean"}

    # Malformed Conv nodes (fewer than two inputs, no output) are left to graph validation.
    return [n for n in graph.node if _is(n, "Conv") and len(n.input) >= 2 and n.output and not pooled(n.input[0])]


def _folded_batchnorm(graph: GraphProto, values: dict[str, np.ndarray]) -> Finding | None:
    """Convolutions in a net whose structure says BatchNorm was there and no normalization left:
    residual adds fed by convolutions (ResNet, MobileNetV2), grouped convolutions (MobileNet,
    EfficientNet, RegNet, ShuffleNet), or bias-free convolutions straight into an activation."""
    convs = folded_convolutions(graph)
    if len(convs) < 2 or any(n.op_type in NORMALIZATIONS for n in graph.node):
        return None
    users = _consumers(graph)
    conv_outputs = {n.output[0] for n in convs}
    residual = any(_is(n, "Add") and len(n.input) == 2 and not any(name in values for name in n.input)
                   and any(name in conv_outputs for name in n.input) for n in graph.node)
    grouped = any(a.name == "group" and a.i > 1 for n in convs for a in n.attribute)
    bare = any(len(n.input) < 3 or not n.input[2] for n in convs
               if any(u.op_type in ACTIVATIONS for u in users.get(n.output[0], [])))
    if not (residual or grouped or bare):
        return None
    evidence = ", ".join(word for word, seen in (("residual adds", residual), ("grouped convolutions", grouped),
                                                 ("bias-free convolutions before activations", bare)) if seen)
    return Finding(
        "folded_batchnorm",
        f"BatchNorm looks folded into the convolutions: {len(convs)} Conv nodes, no normalization "
        f"anywhere, and {evidence}; fine-tuning then trains without batch statistics",
        tuple(n.name or n.output[0] for n in convs),
        "Re-export with BatchNorm kept: torch.onnx.export(..., dynamo=True, optimize=False), or "
        "dynamo=False with training=torch.onnx.TrainingMode.TRAINING.",
        INSERT_BATCHNORM)


def _folded_constants(model: ModelProto) -> Finding | None:
    folded = list(folded_weights(model))
    if not folded:
        return None
    return Finding("folded_weights", "Constant nodes hold large float tensors that look like weights an "
                   "exporter folded; they stay fixed", tuple(folded),
                   "Re-export with do_constant_folding=False (TorchScript) if they should train.", LIFT)


def _digest(value: np.ndarray) -> bytes:
    """A few elements at both ends of the value, read in place (a transposed view too): enough
    to tell weights apart before comparing them whole, without copying a large model's weights."""
    rows = value.reshape(len(value), -1) if value.ndim else value.reshape(1, 1)
    return np.ascontiguousarray(rows[0, :16]).tobytes() + np.ascontiguousarray(rows[-1, -16:]).tobytes()


def duplicate_pairs(graph: GraphProto, values: dict[str, np.ndarray] | None = None
                    ) -> list[tuple[str, str, bool]]:
    """(kept, copy, transposed) for float weights stored twice: equal bytes and shape, or one
    the other's transpose, both read by nodes. All-equal tensors (fresh norm scales, zero
    biases) are equal by coincidence, not tied, and never pair."""
    values = graph_initializers(graph) if values is None else values
    users = _consumers(graph)
    candidates = [(name, value) for name, value in values.items()
                  if value.dtype in FLOATS and value.size >= FOLDED_WEIGHT_SIZE and name in users
                  and _weight_like(value, whole=False)]
    # Prefer a name the source model gave (TorchScript names computed tensors "onnx::...").
    candidates.sort(key=lambda item: item[0].startswith("onnx::"))
    seen: dict[tuple, list[str]] = {}
    pairs = []
    for name, value in candidates:
        key = (value.dtype.str, value.shape, _digest(value))
        kept = next((other for other in seen.get(key, ()) if np.array_equal(values[other], value)), None)
        if kept is not None:
            pairs.append((kept, name, False))
            continue
        if value.ndim == 2:
            flipped = (value.dtype.str, value.shape[::-1], _digest(value.T))
            kept = next((other for other in seen.get(flipped, ()) if np.array_equal(values[other], value.T)), None)
            if kept is not None:
                pairs.append((kept, name, True))
                continue
        seen.setdefault(key, []).append(name)
    return pairs


def _duplicates(graph: GraphProto, values: dict[str, np.ndarray]) -> Finding | None:
    pairs = duplicate_pairs(graph, values)
    if not pairs:
        return None
    return Finding("duplicated_weights", "Weights are stored twice with equal values (a tied weight the "
                   "exporter duplicated); fine-tuning unties them",
                   tuple(f"{copy} = {kept}{'ᵀ' if flipped else ''}" for kept, copy, flipped in pairs),
                   "Re-export with torch.onnx.export(..., dynamo=True, optimize=False), which keeps one "
                   "tensor (TorchScript always stores a copy; dynamo's optimizer folds a transposed one).", RETIE)


def merged_weights(graph: GraphProto, values: dict[str, np.ndarray] | None = None
                   ) -> dict[str, list[tuple[NodeProto, int]]]:
    """Initializer -> its uses (node, input index) for float vectors and tensors of one repeated
    value that several nodes read, directly or through Identity nodes: what exporters make of
    separate parameters that happened to be equal (TorchScript reads them through Identity
    nodes named as the parameters were). Scalars are shared constants by nature and never count."""
    values = graph_initializers(graph) if values is None else values
    producers = producer_of(graph)
    uses: dict[str, list[tuple[NodeProto, int]]] = {}
    for item in graph.node:
        if _is(item, "Identity"):
            continue
        for index, name in enumerate(item.input):
            root = name
            while root not in values and root in producers and _is(producers[root], "Identity") \
                    and producers[root].input:
                root = producers[root].input[0]
            value = values.get(root)
            if value is not None and value.dtype in FLOATS and value.size >= 2:
                uses.setdefault(root, []).append((item, index))
    return {name: found for name, found in uses.items() if len(found) >= 2
            and not (flat := values[name].ravel()).size - np.count_nonzero(flat == flat[0])}


def _merged(graph: GraphProto, values: dict[str, np.ndarray]) -> Finding | None:
    merged = merged_weights(graph, values)
    if not merged:
        return None
    return Finding("merged_weights", "Weights that held equal values (fresh norm scales and shifts, layer "
                   "scales, zero biases) were merged into one tensor; fine-tuning ties them",
                   tuple(f"{name} x{len(uses)}" for name, uses in merged.items()),
                   "Re-export with torch.onnx.export(..., dynamo=True, optimize=False), which keeps them apart.",
                   UNTIE)


def _data_inputs(graph: GraphProto, values: dict[str, np.ndarray]) -> list[ValueInfoProto]:
    return [v for v in graph.input if v.name not in values]


def _first_dim(value: ValueInfoProto) -> int | None:
    """The fixed length of axis 0 of a tensor of rank >= 2, else None."""
    tensor = value.type.tensor_type
    if not value.type.HasField("tensor_type") or not tensor.HasField("shape") or len(tensor.shape.dim) < 2:
        return None
    first = tensor.shape.dim[0]
    return first.dim_value if first.HasField("dim_value") and first.dim_value > 0 else None


def fixed_batch(graph: GraphProto, values: dict[str, np.ndarray] | None = None) -> int | None:
    """The batch size a model was exported with when every data input (rank >= 2) and some
    output have it as a fixed axis 0, else None."""
    values = graph_initializers(graph) if values is None else values
    inputs = _data_inputs(graph, values)
    firsts = {_first_dim(v) for v in inputs}
    if not inputs or len(firsts) != 1 or None in firsts:
        return None
    (size,) = firsts
    return size if any(_first_dim(v) == size for v in graph.output) else None


def _fixed_batch(graph: GraphProto, values: dict[str, np.ndarray]) -> Finding | None:
    size = fixed_batch(graph, values)
    if size is None:
        return None
    return Finding("fixed_batch", f"The inputs have a fixed batch size of {size}; the model takes no other",
                   tuple(v.name for v in _data_inputs(graph, values)),
                   "Re-export with a dynamic batch axis: dynamic_shapes= (dynamo) or dynamic_axes= "
                   "(TorchScript).", RELAX_BATCH)


def _dropout_removed(graph: GraphProto) -> Finding | None:
    """Only for transformer-like graphs (attention: Softmax among MatMuls), whose sources almost
    always use Dropout; elsewhere its absence says nothing."""
    ops = [n.op_type for n in graph.node]
    if "Dropout" in ops or "Softmax" not in ops or ops.count("MatMul") + ops.count("Gemm") < 4:
        return None
    return Finding("dropout_removed", "No Dropout in this attention model: if its source used Dropout, "
                   "eval-mode export removed it and fine-tuning runs without it",
                   tuple(n.name or n.output[0] for n in graph.node if n.op_type == "Softmax"),
                   "Re-export with Dropout kept: torch.onnx.export(..., dynamo=False, "
                   "training=torch.onnx.TrainingMode.TRAINING).", note=True)


def _bias_in_mask(values: dict[str, np.ndarray]) -> Finding | None:
    """Masks (fill values of magnitude 1e30 or more) whose other entries take three or more
    values: a learned bias folded in with the mask, which torch trains and the mask keeps fixed."""
    folded = [name for name, value in values.items()
              if value.dtype in FLOATS and value.ndim >= 2 and _bias_beside_fill(value)]
    if not folded:
        return None
    return Finding("bias_in_mask", "Attention masks hold varied values beside their fill: the exporter folded "
                   "a learned position bias (as T5's relative_attention_bias) into a constant mask, so it "
                   "stays fixed", tuple(folded),
                   "Re-export with dynamic shapes (dynamic_shapes= for dynamo, dynamic_axes= for "
                   "TorchScript), which computes the bias from its table, which then trains.")


def _bias_beside_fill(value: np.ndarray) -> bool:
    """A fill of magnitude 1e30 or more and three or more distinct finite values besides, among
    the first 2**20 entries: a mask fills part of every row, and a folded bias the rest, so a
    weight (no fill) costs a look at its first megabytes only."""
    head = np.asarray(value.reshape(-1)[:1 << 20], np.float64)
    below = np.abs(head) < 1e30
    return not below.all() and len(np.unique(head[below & np.isfinite(head)])) >= 3


def _position_tables(model: ModelProto) -> Finding | None:
    """The tables torch computes or keeps as buffers that the export stored as initializers."""
    tables = {name: reason.split(" (")[0] for name, reason in trainable_set(model).left_out.items()
              if reason.startswith(POSITION_TABLE_KINDS)}
    if not tables:
        return None
    return Finding("position_tables", "The export stores tables that torch computes or keeps as buffers as "
                   "initializers, like weights; the default trainable set leaves them out",
                   tuple(f"{name}: {kind}" for name, kind in tables.items()),
                   "To train one anyway, name it with the default set: trainable=[*onnxtrain."
                   "default_trainable(model).weights, NAME].", note=True)


# Damage to how the base model's own weights train: nothing to say when only adapters train.
BASE_TRAINING = frozenset({"folded_batchnorm", "duplicated_weights", "merged_weights", "position_tables"})


def warn_damage(findings: Iterable[Finding], repaired: Iterable[str], where: str, frozen_base: bool = False) -> None:
    """One warning listing the findings no requested repair undid (notes are for inspect);
    with frozen_base (adapters train, no base weight does), not those about how base weights train."""
    repaired = set(repaired)
    left = [f for f in findings if not f.note and f.repair not in repaired
            and not (frozen_base and f.kind in BASE_TRAINING)]
    if left:
        lines = "\n".join(f"- {f.text()}" for f in left)
        warnings.warn(f"{where}: the model shows export damage that changes how it trains:\n{lines}",
                      ExportDamageWarning, stacklevel=user_stacklevel())


class ExportDamageWarning(UserWarning):
    """An exporter changed the model in a way that changes how it trains (see detect)."""


def prepare(model: ModelProto, repair: Iterable[str] | str | None, where: str,
            lift_folded_weights: bool = False, frozen_base: bool = False) -> list[str]:
    """What make_training_model and finetune do to a model first: warn once about the damage
    the requested repairs leave (with frozen_base, only what matters when adapters alone
    train), then apply them (in place); what was repaired.

    Raises:
        BindingError: an unknown repair name or a repair that cannot be sound (see repair()).
    """
    names = repair_names(repair, lift_folded_weights)
    warn_damage(detect(model, notes=False), names, where, frozen_base)
    return _repair(model, names)


# --- repairs ----------------------------------------------------------------------------------

def repair(model: ModelProto, names: Iterable[str]) -> list[str]:
    """Apply the named repairs (REPAIRS) to `model` in place, in a fixed order; what was done.

    - lift_constants: large float Constant nodes that look like folded weights become
      initializers, so they train.
    - retie: a weight stored twice becomes one initializer; the copy is an Identity (or
      Transpose) of it, so both uses read one state variable and its gradient is their sum.
    - untie: every use of a merged weight (see merged_weights) reads a copy of its own; a copy
      read through TorchScript's Identity nodes takes that node's output name (the parameter's).
    - relax_batch: a fixed batch axis 0 of the inputs and outputs becomes the symbol "batch";
      a Reshape whose shape starts with the batch size gets -1 there (and the sizes it produced
      for its other axes). Then the graph is traced at another batch size, and a batch of the
      exported samples plus one more must answer as the original did for each sample; if not,
      nothing changes.
    - insert_batchnorm: a BatchNormalization after every convolution detect() found BatchNorm
      folded into (not those fed by global pooling: squeeze-and-excitation blocks have none).
      It starts as the identity in inference mode: running mean 0, running
      variance 1 - epsilon, scale 1, and as shift the convolution's bias (moved out of the Conv),
      so inference outputs are unchanged. Training then normalizes with batch statistics and
      updates the running ones (momentum 0.9 in ONNX terms, torch's 0.1), as in the source.

    Raises:
        BindingError: an unknown repair name, or a repair that cannot be sound for this model
            (a batch the graph bakes in, BatchNorm repair below opset 14).
    """
    return _repair(model, repair_names(names))


def _repair(model: ModelProto, names: frozenset[str]) -> list[str]:
    done = []
    if LIFT in names:
        done += [f"lifted Constant {name!r}" for name in lift_constants(model)]
    if RETIE in names:
        done += [f"tied {copy!r} to {kept!r}" for kept, copy, _ in retie(model)]
    if UNTIE in names:
        done += [f"untied {name!r}" for name in untie(model)]
    if RELAX_BATCH in names and fixed_batch(model.graph) is not None:
        done.append(f"relaxed batch size {relax_batch(model)}")
    if INSERT_BATCHNORM in names:
        finding = _folded_batchnorm(model.graph, graph_initializers(model.graph))
        if finding is not None:
            done += [f"BatchNormalization after {name!r}" for name in insert_batchnorm(model)]
    return done


def lift_constants(model: ModelProto, min_size: int = FOLDED_WEIGHT_SIZE) -> list[str]:
    """Turn the main graph's Constant nodes that look like folded weights into initializers;
    their names."""
    folded = folded_weights(model, min_size)
    lifted, kept = [], []
    for item in model.graph.node:
        if item.op_type != "Constant" or item.output[0] not in folded:
            kept.append(item)
            continue
        model.graph.initializer.append(numpy_to_tensor(folded[item.output[0]], item.output[0]))
        lifted.append(item.output[0])
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return lifted


def _drop_initializer(graph: GraphProto, name: str) -> None:
    for index, tensor in enumerate(graph.initializer):
        if tensor.name == name:
            del graph.initializer[index]
            break
    for index, value in enumerate(graph.input):
        if value.name == name:
            del graph.input[index]
            break


def retie(model: ModelProto) -> list[tuple[str, str, bool]]:
    """Tie every weight stored twice (see duplicate_pairs): the copy's initializer goes, and an
    Identity or Transpose node of the kept one produces its name. The pairs tied."""
    graph = model.graph
    pairs = duplicate_pairs(graph)
    ties = []
    for kept, copy, flipped in pairs:
        _drop_initializer(graph, copy)
        ties.append(make_node("Transpose", [kept], [copy], perm=[1, 0]) if flipped
                    else make_node("Identity", [kept], [copy]))
    if ties:
        nodes = list(graph.node)
        del graph.node[:]
        graph.node.extend([*ties, *nodes])
    return pairs


def untie(model: ModelProto) -> list[str]:
    """Give every use of a merged weight (see merged_weights) a tensor of its own; the new names."""
    graph = model.graph
    values = graph_initializers(graph)
    merged = merged_weights(graph, values)
    producers, fresh = producer_of(graph), Names(graph)
    made, aliases = [], set()
    for root, uses in merged.items():
        root_kept = False
        for item, index in uses:
            name = item.input[index]
            if name == root and not root_kept:
                root_kept = True
                continue
            if name != root and name not in aliases:
                # TorchScript named the Identity's output as the parameter: it becomes that tensor.
                aliases.add(name)
                graph.node.remove(producers[name])
                target = name
            else:
                target = fresh(f"{name}.copy")
            graph.initializer.append(numpy_to_tensor(values[root].copy(), target))
            made.append(target)
            item.input[index] = target
    _prune(graph)
    return made


def _elem_dtype(value: ValueInfoProto) -> np.dtype:
    element = ELEMENT_TYPES.get(value.type.tensor_type.elem_type)
    if element is None:
        raise BindingError(f"input {value.name!r} has no numeric element type; cannot relax its batch size")
    return element.dtype


def _constant_values(graph: GraphProto) -> dict[str, np.ndarray]:
    constants = {t.name: tensor_to_numpy(t, t.name) for t in graph.initializer if t.data_type == TensorProto.INT64}
    for item in graph.node:
        if _is(item, "Constant") and len(item.attribute) == 1 and item.attribute[0].name == "value":
            if item.attribute[0].t.data_type == TensorProto.INT64:
                constants[item.output[0]] = tensor_to_numpy(item.attribute[0].t, item.output[0])
    return constants


def _shapes_at(model: ModelProto, size: int, kept: Iterable[str]) -> tuple[dict, dict]:
    """Output and `kept` value shapes with every data input's axis 0 set to `size` (traced only)."""
    from onnxtrain.translate.model import TranslatedModel

    translated = TranslatedModel(model, params=[])
    values = graph_initializers(model.graph)
    feeds = {}
    for value in _data_inputs(model.graph, values):
        dims = [d.dim_value if d.HasField("dim_value") else 1 for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = jax.ShapeDtypeStruct((size, *dims[1:]), _elem_dtype(value))
    with jax.enable_x64(True):
        outputs, seen = jax.eval_shape(lambda f: translated.apply_keeping({}, f, None, list(kept)), feeds)
    return ({k: v.shape for k, v in outputs.items()}, {k: v.shape for k, v in seen.items()})


def relax_batch(model: ModelProto) -> int:
    """Make a fixed batch axis (see fixed_batch) the symbol "batch"; the old size.

    Raises:
        BindingError: the graph bakes the batch size in where no rewrite is sound (an Expand
            to it, a fixed recurrent state), found by tracing another batch size, or the
            relaxed graph mixes samples (a leading Reshape size that only equalled the batch).
    """
    size = fixed_batch(model.graph)
    if size is None:
        raise BindingError("relax_batch: the model has no fixed batch size to relax")
    # Worked on a copy, so a refusal leaves the model as it was.
    relaxed = ModelProto()
    relaxed.CopyFrom(model)
    graph = relaxed.graph
    constants = _constant_values(graph)
    reshapes = [n for n in graph.node if _is(n, "Reshape") and len(n.input) == 2 and n.input[1] in constants
                and constants[n.input[1]].ndim == 1 and constants[n.input[1]].size
                and constants[n.input[1]][0] == size]
    # Each such Reshape gets the shape it produces at the exported size, with -1 for the batch:
    # the same result there, and the batch follows the inputs elsewhere (checked below).
    _, produced = _shapes_at(relaxed, size, [n.output[0] for n in reshapes])
    fresh = Names(graph)
    for item in reshapes:
        shape = np.array([-1, *produced[item.output[0]][1:]], np.int64)
        name = fresh(f"{item.input[1]}.batch")
        graph.initializer.append(numpy_to_tensor(shape, name))
        item.input[1] = name
    for value in [*_data_inputs(graph, graph_initializers(graph)), *graph.output]:
        if _first_dim(value) == size:
            value.type.tensor_type.shape.dim[0].Clear()
            value.type.tensor_type.shape.dim[0].dim_param = BATCH
    # Shape hints recorded at the old size would contradict the new ones.
    kept_info = [v for v in graph.value_info if _first_dim(v) != size]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    _prune(graph)
    other = size + 1
    try:
        shapes, _ = _shapes_at(relaxed, other, [])
    except Exception as error:  # the trace names the node; any failure means the batch is baked in
        raise BindingError(f"relax_batch: the graph fails at batch size {other} ({str(error).splitlines()[0]}); "
                           "it bakes the batch size in, so re-export with a dynamic batch axis") from None
    stuck = [v.name for v in graph.output if v.type.tensor_type.shape.dim
             and v.type.tensor_type.shape.dim[0].dim_param == BATCH and shapes[v.name][:1] != (other,)]
    if stuck:
        raise BindingError(f"relax_batch: outputs {stuck} keep batch size {size} when the inputs have {other}; "
                           "the graph bakes the batch size in, so re-export with a dynamic batch axis")
    _check_samples_independent(model, relaxed, size)
    model.CopyFrom(relaxed)
    return size


def _check_samples_independent(original: ModelProto, relaxed: ModelProto, size: int) -> None:
    """Refuse unless the relaxed model, fed the exported batch plus a repeat of its first sample,
    answers as the original does for each: a leading size that only looked like the batch (a
    literal 2 in a Reshape of a batch of 2) would mix samples here."""
    from onnxtrain.translate.model import TranslatedModel

    rng = np.random.default_rng(0)
    feeds = {}
    for value in _data_inputs(original.graph, graph_initializers(original.graph)):
        dims = [d.dim_value if d.HasField("dim_value") else 1 for d in value.type.tensor_type.shape.dim]
        dtype = _elem_dtype(value)
        # Zeros are valid ids, indices and masks; floats get values that tell samples apart.
        feeds[value.name] = (rng.normal(size=dims).astype(dtype) if dtype.kind == "f"
                             else np.zeros(dims, dtype))
    grown = {name: np.concatenate([value, value[:1]]) for name, value in feeds.items()}
    key = jax.random.key(0)
    with jax.enable_x64(True):
        before = TranslatedModel(original, params=[])({}, feeds, key)
        after = TranslatedModel(relaxed, params=[])({}, grown, key)
    for value in relaxed.graph.output:
        dims = value.type.tensor_type.shape.dim
        if not dims or dims[0].dim_param != BATCH:
            continue
        expected = np.asarray(before[value.name])
        expected = np.concatenate([expected, expected[:1]])
        if not np.allclose(np.asarray(after[value.name]), expected, rtol=1e-4, atol=1e-5, equal_nan=True):
            raise BindingError(f"relax_batch: output {value.name!r} of a batch of {size + 1} differs from the "
                               f"same samples in batches of {size}: the graph mixes samples or bakes the batch "
                               "size in, so re-export with a dynamic batch axis")


def _resolve_initializer(name: str, producers: dict[str, NodeProto], values: dict[str, np.ndarray]
                         ) -> np.ndarray | None:
    """The initializer behind `name`, through Identity nodes (TorchScript shares equal biases so)."""
    while name not in values and name in producers and _is(producers[name], "Identity") and producers[name].input:
        name = producers[name].input[0]
    return values.get(name)


def insert_batchnorm(model: ModelProto) -> list[str]:
    """A BatchNormalization after every Conv folded_convolutions() names (see repair()); their names."""
    graph = model.graph
    if default_opset(model) < 14:
        raise BindingError("insert_batchnorm needs ai.onnx opset 14 or newer (training-mode "
                           "BatchNormalization); the model imports an older one")
    values, producers = graph_initializers(graph), producer_of(graph)
    fresh = Names(graph)
    targets = {item.output[0] for item in folded_convolutions(graph)}
    nodes, done = [], []
    for item in graph.node:
        nodes.append(item)
        if not item.output or item.output[0] not in targets:
            continue
        weight = values.get(item.input[1])
        if weight is None:
            raise BindingError(f"insert_batchnorm: Conv {item.name or item.output[0]!r} reads computed weights "
                               f"{item.input[1]!r}; only convolutions with initializer weights can be repaired")
        channels = weight.shape[0]
        shift = np.zeros(channels, weight.dtype)
        if len(item.input) > 2 and item.input[2]:
            bias = _resolve_initializer(item.input[2], producers, values)
            if bias is not None:
                shift = bias.astype(weight.dtype)
                del item.input[2]
        prefix = _module_name(item)
        parameters = {"weight": np.ones(channels, weight.dtype), "bias": shift,
                      "running_mean": np.zeros(channels, weight.dtype),
                      "running_var": np.full(channels, 1 - BN_EPSILON, weight.dtype)}
        names = []
        for suffix, value in parameters.items():
            names.append(fresh(f"{prefix}.bn.{suffix}"))
            graph.initializer.append(numpy_to_tensor(value, names[-1]))
        output = item.output[0]
        item.output[0] = fresh(f"{output}.conv")
        nodes.append(make_node("BatchNormalization", [item.output[0], *names], [output],
                               epsilon=BN_EPSILON, momentum=BN_MOMENTUM))
        done.append(item.name or output)
    del graph.node[:]
    graph.node.extend(nodes)
    _prune(graph)
    return done


def _read_names(graph: GraphProto) -> set[str]:
    """Every name a node of `graph` or of its subgraphs reads, and the graph's outputs."""
    return {name for inner, _ in iter_graph_tree(graph, "") for item in inner.node for name in item.input} | {
        v.name for v in graph.output}


def _module_name(conv: NodeProto) -> str:
    """The torch module a Conv came from: its weight's name less '.weight', or for TorchScript's
    computed weights ('onnx::Conv_35') the node's scope ('/block/c1/Conv' -> 'block.c1')."""
    weight = conv.input[1]
    if weight.startswith("onnx::") and conv.name.startswith("/") and conv.name.count("/") > 1:
        return conv.name.strip("/").rsplit("/", 1)[0].replace("/", ".")
    return weight.removesuffix(".weight")


def _prune(graph: GraphProto) -> None:
    """Drop Identity/Constant nodes and initializers (not also inputs) nothing reads any more."""
    while True:
        read = _read_names(graph)
        dead = [i for i, item in enumerate(graph.node) if _is(item, "Identity", "Constant")
                and not set(item.output) & read]
        if not dead:
            break
        for index in reversed(dead):
            del graph.node[index]
    read = _read_names(graph) | {v.name for v in graph.input}
    for tensor in [t for t in graph.initializer if t.name not in read]:
        _drop_initializer(graph, tensor.name)
