"""MatMulNBits in the standard operators, so that adapters can target its weight.

ONNX Runtime's weight-only quantizer writes 8-bit (and by default 4-bit) weights as
com.microsoft MatMulNBits(A, B, scales, zero_points): B holds W's transpose [N, K] in blocks
of `block_size` along K. The same weight in standard ONNX is

    DequantizeLinear(B as uint8/uint4 [N, K], scales [N, blocks], zero_points [N, blocks],
                     axis=1, block_size) -> Transpose -> MatMul(A, ·)

with the integer bytes unchanged (ONNX packs 4-bit values two to a byte, low bits first, as
MatMulNBits does), so LoRA sees a DequantizeLinear of an integer initializer, its quantized
base, and the integers stay integers. The result is what MatMulNBits computes (up to the
float rounding of the product), runs in onnxruntime, and needs opset 21.
"""

from __future__ import annotations

import json
import logging

import numpy as np

from onnxtrain.proto import GraphProto, ModelProto, NodeProto, OperatorSetIdProto, StringStringEntryProto, TensorProto
from onnxtrain.translate.registry import normalize_domain
from onnxtrain.translate.tensors import ELEMENT_TYPES, numpy_to_tensor, tensor_to_numpy

logger = logging.getLogger("onnxtrain")
# The MatMulNBits nodes standardize_matmul_nbits rewrote, so an inference export can write them again.
RECORD_KEY = "onnxtrain.matmul_nbits"

_MICROSOFT = "com.microsoft"
_UNSIGNED = {8: TensorProto.UINT8, 4: TensorProto.UINT4}


def _attributes(node: NodeProto) -> dict[str, int]:
    return {a.name: a.i for a in node.attribute}


def _convertible(node: NodeProto, initializers: dict[str, TensorProto]) -> bool:
    """A MatMulNBits of stored 8/4-bit weights whose K is whole blocks, without g_idx or bias."""
    if node.op_type != "MatMulNBits" or normalize_domain(node.domain) != _MICROSOFT:
        return False
    attributes = _attributes(node)
    k, block = attributes.get("K", 0), attributes.get("block_size", 0)
    stored = [name for name in node.input[1:4] if name]
    return (attributes.get("bits", 4) in _UNSIGNED and block > 0 and k % block == 0
            and not any(node.input[4:]) and all(name in initializers for name in stored)
            and initializers[node.input[2]].data_type in (TensorProto.FLOAT, TensorProto.FLOAT16)
            and (len(node.input) < 4 or not node.input[3]
                 or initializers[node.input[3]].data_type == TensorProto.UINT8))


def _packed_tensor(name: str, values: np.ndarray, bits: int) -> TensorProto:
    """An unsigned `bits`-bit tensor of `values` (uint8 holding 0..2^bits-1), packed as ONNX does."""
    tensor = TensorProto(name=name, data_type=_UNSIGNED[bits], dims=list(values.shape))
    flat = values.reshape(-1).astype(np.uint8)
    if bits == 4:
        flat = np.concatenate([flat, np.zeros(flat.size % 2, np.uint8)])
        flat = flat[0::2] | (flat[1::2] << 4)
    tensor.raw_data = flat.tobytes()
    return tensor


def _unpacked_rows(packed: np.ndarray, rows: int, count: int, bits: int) -> np.ndarray:
    """The first `count` `bits`-bit values of each of `rows` rows of packed bytes."""
    packed = packed.reshape(rows, -1)
    if bits == 8:
        return packed[:, :count]
    values = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    return values[:, :count]


def standardize_matmul_nbits(model: ModelProto) -> int:
    """Rewrite, in place, the main graph's MatMulNBits nodes of stored 8/4-bit weights (K a
    whole number of blocks, no g_idx or bias) as DequantizeLinear -> Transpose -> MatMul.

    Args:
        model: the model; its default opset is raised to 21 if it is lower and a node changes.

    Returns:
        How many nodes were rewritten.

    Example:
        >>> standardize_matmul_nbits(model)   # before LoRA targets the quantized weights
        15
    """
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    nodes: list[NodeProto] = []
    changed = 0
    originals: list[dict] = [*recorded(model)]
    for node in graph.node:
        if not _convertible(node, initializers):
            nodes.append(node)
            continue
        attributes = _attributes(node)
        k, n, bits, block = attributes["K"], attributes["N"], attributes.get("bits", 4), attributes["block_size"]
        blocks = k // block
        where = f"MatMulNBits {node.name!r}"
        data = tensor_to_numpy(initializers[node.input[1]], where)
        scales = tensor_to_numpy(initializers[node.input[2]], where).reshape(n, blocks)
        weight, scale, zero = (f"{node.input[1]}.dq", f"{node.input[2]}.dq", f"{node.input[1]}.dq_zero_point")
        new = [_packed_tensor(weight, _unpacked_rows(data, n, k, bits), bits)]
        scale_tensor = TensorProto()
        scale_tensor.CopyFrom(initializers[node.input[2]])
        scale_tensor.name = scale
        del scale_tensor.dims[:]
        scale_tensor.dims.extend([n, blocks])
        new.append(scale_tensor)
        if len(node.input) > 3 and node.input[3]:
            zeros = _unpacked_rows(tensor_to_numpy(initializers[node.input[3]], where), n, blocks, bits)
        else:
            zeros = np.full((n, blocks), 2 ** (bits - 1), np.uint8)
        new.append(_packed_tensor(zero, zeros, bits))
        graph.initializer.extend(new)
        originals.append({"name": node.name, "output": node.output[0], "attributes": attributes,
                          "inputs": list(node.input[1:4]),
                          "dims": [list(initializers[name].dims) if name else [] for name in node.input[1:4]]})
        prefix = node.name or node.output[0]
        transposed_weight = f"{node.output[0]}.weight_t"
        nodes += [
            NodeProto(op_type="DequantizeLinear", name=f"{prefix}/dequantize", input=[weight, scale, zero],
                      output=[transposed_weight]),
            NodeProto(op_type="Transpose", name=f"{prefix}/transpose", input=[transposed_weight],
                      output=[f"{node.output[0]}.weight"]),
            NodeProto(op_type="MatMul", name=prefix, input=[node.input[0], f"{node.output[0]}.weight"],
                      output=[node.output[0]]),
        ]
        dequantize = nodes[-3]
        dequantize.attribute.add(name="axis", type=2, i=1)
        dequantize.attribute.add(name="block_size", type=2, i=block)
        nodes[-2].attribute.add(name="perm", type=7, ints=[1, 0])
        changed += 1
    if not changed:
        return 0
    del graph.node[:]
    graph.node.extend(nodes)
    _drop_unused(graph)
    _set_recorded(model, originals)
    default = next((o for o in model.opset_import if normalize_domain(o.domain) == ""), None)
    if default is None:
        model.opset_import.append(OperatorSetIdProto(domain="", version=21))
    elif default.version < 21:
        default.version = 21
    return changed


def recorded(model: ModelProto) -> list[dict]:
    """The MatMulNBits nodes standardize_matmul_nbits rewrote in `model` (see restore)."""
    for entry in model.metadata_props:
        if entry.key == RECORD_KEY:
            return json.loads(entry.value)
    return []


def _set_recorded(model: ModelProto, originals: list[dict]) -> None:
    kept = [entry for entry in model.metadata_props if entry.key != RECORD_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if originals:
        model.metadata_props.append(StringStringEntryProto(key=RECORD_KEY, value=json.dumps(originals)))


def _drop_unused(graph: GraphProto, among: set[str] | None = None) -> None:
    """Remove the initializers (of `among`, default all) no node of the graph reads."""
    used = {name for node in graph.node for name in node.input}
    kept = [t for t in graph.initializer if t.name in used or (among is not None and t.name not in among)]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def dequantized_blocks(integers: np.ndarray, scales: np.ndarray, zeros: np.ndarray, block: int) -> np.ndarray:
    """The float64 [N, K] weight that integers [N, K], scales and zero points [N, blocks] stand for."""
    n, k = integers.shape
    grouped = integers.reshape(n, k // block, block).astype(np.float64) - zeros.astype(np.float64)[..., None]
    return (grouped * scales.astype(np.float64)[..., None]).reshape(n, k)


def quantize_blocks(weight: np.ndarray, bits: int, block: int, asymmetric: bool,
                    grid: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(integers [N, K] in 0..2^bits-1, scales [N, blocks], zero points [N, blocks]) of a float
    [N, K] weight quantized per block of `block` along K, rounding to nearest: with a zero
    point per block (asymmetric), or around the middle value 2^(bits-1) (symmetric). With
    `grid` (the base's scales and zero points), each block keeps the base's grid where that
    rounds it closer than a new one: a LoRA change smaller than a step moves few integers."""
    n, k = weight.shape
    grouped = weight.astype(np.float64).reshape(n, k // block, block)
    top = 2 ** bits - 1
    if asymmetric:
        low, high = np.minimum(grouped.min(-1), 0.0), np.maximum(grouped.max(-1), 0.0)
        scale = (high - low) / top
        zero = np.clip(np.round(-low / np.where(scale > 0, scale, 1.0)), 0, top)
    else:
        scale = np.abs(grouped).max(-1) / (2 ** (bits - 1) - 1)
        zero = np.full(scale.shape, 2.0 ** (bits - 1))
    values, error = _rounded(grouped, scale, zero, top)
    if grid is not None:
        kept_scale, kept_zero = (np.asarray(g, np.float64) for g in grid)
        kept_values, kept_error = _rounded(grouped, kept_scale, kept_zero, top)
        keep = kept_error < error
        values = np.where(keep[..., None], kept_values, values)
        scale, zero = np.where(keep, kept_scale, scale), np.where(keep, kept_zero, zero)
    return values.reshape(n, k).astype(np.uint8), scale, zero.astype(np.uint8)


def _rounded(grouped: np.ndarray, scale: np.ndarray, zero: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks [N, blocks, block] rounded onto the grid (scale, zero [N, blocks]) within
    0..top, and each block's largest change."""
    values = np.clip(np.round(grouped / np.where(scale > 0, scale, 1.0)[..., None]) + zero[..., None], 0, top)
    return values, np.abs((values - zero[..., None]) * scale[..., None] - grouped).max(-1)


def quantization_grids(model: ModelProto) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per rewritten MatMulNBits node (by output), the scales and zero points [N, blocks] its
    base stored, while the model still holds them (fold removes a merged weight's): what
    restore_matmul_nbits may keep when it quantizes the merged weight again."""
    initializers = {t.name: t for t in model.graph.initializer}
    grids = {}
    for original in recorded(model):
        b_name, s_name = original["inputs"][:2]
        scale, zero = initializers.get(f"{s_name}.dq"), initializers.get(f"{b_name}.dq_zero_point")
        if scale is not None and zero is not None:
            n = original["attributes"]["N"]
            grids[original["output"]] = (tensor_to_numpy(scale).reshape(n, -1).astype(np.float64),
                                         tensor_to_numpy(zero).reshape(n, -1).astype(np.float64))
    return grids


def _row_packed(values: np.ndarray, bits: int) -> np.ndarray:
    """[rows, count] values of `bits` bits packed per row as MatMulNBits stores them (two
    4-bit values to a byte, low bits first; a row's odd last value alone in its byte)."""
    if bits == 8:
        return values.astype(np.uint8)
    if values.shape[1] % 2:
        values = np.concatenate([values, np.zeros((values.shape[0], 1), values.dtype)], axis=1)
    return (values[:, 0::2] | (values[:, 1::2] << 4)).astype(np.uint8)


def restore_matmul_nbits(model: ModelProto, grids: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> None:
    """Write the MatMulNBits nodes standardize_matmul_nbits rewrote back (in place), for an
    inference export: each DequantizeLinear -> Transpose -> MatMul of stored integers becomes
    its MatMulNBits again with the same bytes; a weight LoRA folded into floats is quantized
    again with the node's bits, block size and zero points, on the base's grid (`grids`, see
    quantization_grids) or a new one, whichever is closer per block (the largest change is
    logged).
    Nodes the graph no longer holds in that form are left as they are."""
    originals = recorded(model)
    if not originals:
        return
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    producers = {output: node for node in graph.node for output in node.output}
    readers = {name: node for node in graph.node for name in node.input[1:2]}
    replaced: dict[int, NodeProto] = {}
    dropped: set[int] = set()
    released: set[str] = set()   # tensors only the rewritten nodes read
    errors = []
    for original in originals:
        output = original["output"]
        matmul, transpose = readers.get(f"{output}.weight"), producers.get(f"{output}.weight")
        if matmul is None or transpose is None or transpose.op_type != "Transpose":
            continue
        attributes = original["attributes"]
        n, k, bits, block = attributes["N"], attributes["K"], attributes.get("bits", 4), attributes["block_size"]
        b_name, s_name, z_name = (original["inputs"] + ["", "", ""])[:3]
        b_dims, s_dims, z_dims = (original["dims"] + [[], [], []])[:3]
        source = transpose.input[0]
        dequantize = producers.get(source)
        if dequantize is not None and dequantize.op_type == "DequantizeLinear":
            values = {name: tensor_to_numpy(initializers[name]) for name in dequantize.input}
            integers = values[dequantize.input[0]].reshape(n, k).astype(np.uint8)
            scales = values[dequantize.input[1]].reshape(n, -1)
            zeros = values[dequantize.input[2]].reshape(n, -1).astype(np.uint8)
            dtype = scales.dtype
            dropped.add(id(dequantize))
            released.update(dequantize.input)
        elif source in initializers:
            weight = tensor_to_numpy(initializers[source]).reshape(n, k)
            dtype = ELEMENT_TYPES[initializers[s_name].data_type].dtype if s_name in initializers else weight.dtype
            integers, scales, zeros = quantize_blocks(weight, bits, block, asymmetric=bool(z_name),
                                                      grid=(grids or {}).get(output))
            restored = dequantized_blocks(integers, scales, zeros, block)
            errors.append(float(np.abs(restored - weight).max() / max(np.abs(weight).max(), 1e-30)))
            scales = scales.astype(dtype)
            released.add(source)
        else:
            continue
        tensors = [numpy_to_tensor(_row_packed(integers, bits).reshape(b_dims), b_name),
                   numpy_to_tensor(np.asarray(scales, dtype).reshape(s_dims), s_name)]
        inputs = [matmul.input[0], b_name, s_name]
        if z_name:
            tensors.append(numpy_to_tensor(_row_packed(zeros, bits).reshape(-1)[:int(np.prod(z_dims))]
                                           .reshape(z_dims), z_name))
            inputs.append(z_name)
        graph.initializer.extend(tensors)
        node = NodeProto(op_type="MatMulNBits", domain=_MICROSOFT, name=original["name"], input=inputs,
                         output=list(matmul.output))
        for key, value in attributes.items():
            node.attribute.add(name=key, type=2, i=int(value))
        replaced[id(matmul)] = node
        dropped.add(id(transpose))
    kept = [replaced.get(id(node), node) for node in graph.node if id(node) not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    _drop_unused(graph, released)
    _set_recorded(model, [])
    if errors:
        logger.warning("merging LoRA into %d weights of %d-bit MatMulNBits layers quantized them again: the "
                       "largest change is %.3g of a weight's largest magnitude. export(..., merge=False) keeps "
                       "the adapters exact beside the quantized base.", len(errors),
                       originals[0]["attributes"].get("bits", 4), max(errors))
