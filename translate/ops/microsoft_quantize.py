"""ONNX Runtime's weight-only quantized matrix product (com.microsoft MatMulNBits), as its
quantizer writes it (onnxruntime.quantization.matmul_nbits_quantizer, QOperator format).

MatMulNBits(A, B, scales, zero_points?, g_idx?, bias?) computes A @ W with W = dequant(B)ᵀ:
B holds W's transpose [N, K] as 2, 4 or 8-bit unsigned integers packed into bytes (low bits
first) in blocks of `block_size` along K, shape [N, blocks, block_size * bits / 8]; each block
has one scale and one zero point (packed the same way; 2^(bits-1) when absent, or a float
zero point of the scales' type). The weight is dequantized inside the program at the node,
and dequantized again when the backward pass reaches the node, rather than kept from the
forward pass: a step never holds the float model (see translate.recompute).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from onnxtrain.translate.node import Node
from onnxtrain.translate.recompute import recomputed
from onnxtrain.translate.registry import op

MICROSOFT_DOMAIN = "com.microsoft"


def _unpacked(packed: Any, bits: int, count: int) -> Any:
    """The first `count` unsigned `bits`-bit integers of each row of packed bytes (low bits
    first), as int32 [rows, count]."""
    per_byte = 8 // bits
    packed = jnp.asarray(packed).astype(jnp.int32)
    rows = packed.shape[0]
    packed = packed.reshape(rows, -1)
    if per_byte == 1:
        return packed[:, :count]
    shifts = jnp.arange(per_byte, dtype=jnp.int32) * bits
    values = (packed[:, :, None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(rows, -1)[:, :count]


def _block_zero_points(node: Node, zero_points: Any, n: int, blocks: int, bits: int, dtype: Any) -> Any:
    """The zero point of every block, [N, blocks], in the scales' float type."""
    if zero_points is None:
        return jnp.full((n, blocks), 2 ** (bits - 1), dtype)
    zero_points = jnp.asarray(zero_points)
    if jnp.issubdtype(zero_points.dtype, jnp.floating):
        if zero_points.size != n * blocks:
            raise node.error(f"float zero_points hold {zero_points.size} values; N * blocks = {n * blocks} expected")
        return zero_points.reshape(n, blocks).astype(dtype)
    row_bytes = -(-blocks * bits // 8)
    if zero_points.size != n * row_bytes:
        raise node.error(f"packed zero_points hold {zero_points.size} bytes; N * ceil(blocks * bits / 8) = "
                         f"{n * row_bytes} expected")
    return _unpacked(zero_points.reshape(n, row_bytes), bits, blocks).astype(dtype)


def dequantized_weight(node: Node, b: Any, scales: Any, zero_points: Any) -> Any:
    """W [K, N] in the scales' type: (B - zero point) * scale per block, transposed."""
    k, n, bits, block = node.attr("K"), node.attr("N"), node.attr("bits", 4), node.attr("block_size")
    if bits not in (2, 4, 8):
        raise node.unsupported(f"bits={bits}: onnxtrain runs 2, 4 and 8-bit MatMulNBits")
    if block < 16 or block & (block - 1):
        raise node.error(f"block_size must be a power of 2 and at least 16, got {block}")
    blocks = -(-k // block)
    expected = (n, blocks, block * bits // 8)
    if tuple(np.shape(b)) != expected and np.size(b) != np.prod(expected):
        raise node.error(f"B of shape {list(np.shape(b))} does not hold N={n} rows of {blocks} blocks of "
                         f"{block} {bits}-bit values: shape {list(expected)} expected")
    dtype = jnp.asarray(scales).dtype
    if jnp.asarray(scales).size != n * blocks:
        raise node.error(f"scales hold {jnp.asarray(scales).size} values; N * blocks = {n * blocks} expected")
    scale = jnp.asarray(scales).reshape(n, blocks, 1)
    zero = _block_zero_points(node, zero_points, n, blocks, bits, dtype).reshape(n, blocks, 1)
    values = _unpacked(jnp.reshape(b, (n, -1)), bits, blocks * block).reshape(n, blocks, block)
    weight = ((values.astype(dtype) - zero) * scale).reshape(n, blocks * block)[:, :k]
    return weight.T


@op("MatMulNBits", since=1, domain=MICROSOFT_DOMAIN)
def matmul_nbits(node: Node, a: Any, b: Any, scales: Any, zero_points: Any = None, g_idx: Any = None,
                 bias: Any = None) -> Any:
    """A @ dequant(B)ᵀ (+ bias): a weight-only quantized MatMul, differentiable in A."""
    if g_idx is not None:
        raise node.unsupported("g_idx (act-order block indices) is not implemented; quantize the model "
                               "without act_order (its blocks then follow K in order)")
    a = jnp.asarray(a)
    if a.shape[-1] != node.attr("K"):
        raise node.error(f"A's last dimension {a.shape[-1]} differs from K={node.attr('K')}")

    def product(a: Any, b: Any, scales: Any, zero_points: Any, bias: Any) -> Any:
        weight = dequantized_weight(node, b, scales, zero_points)
        result = jnp.matmul(a, weight.astype(a.dtype))
        return result if bias is None else result + jnp.asarray(bias).astype(result.dtype)

    if node.host:
        return product(a, b, scales, zero_points, bias)
    return recomputed(product, a, b, scales, zero_points, bias, after_first=True)
