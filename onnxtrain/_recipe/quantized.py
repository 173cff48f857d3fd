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

import numpy as np

from onnxtrain.proto import ModelProto, NodeProto, OperatorSetIdProto, TensorProto
from onnxtrain.translate.registry import normalize_domain
from onnxtrain.translate.tensors import tensor_to_numpy

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
    used = {name for node in graph.node for name in node.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    default = next((o for o in model.opset_import if normalize_domain(o.domain) == ""), None)
    if default is None:
        model.opset_import.append(OperatorSetIdProto(domain="", version=21))
    elif default.version < 21:
        default.version = 21
    return changed
