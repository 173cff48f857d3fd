"""Matrix math: MatMul, Gemm, Einsum, Det.

Products run at HIGHEST precision, so accelerators do not silently lower
float32 to TF32 or bfloat16 passes; results keep the input's element type.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from onnxtrain.translate.layouts import row_major
from onnxtrain.translate.node import Node
from onnxtrain.translate.registry import op

PRECISION = lax.Precision.HIGHEST


def scaled(x: ArrayLike, factor: float) -> ArrayLike:
    """factor * X in X's type; a factor of 1 leaves X untouched (exact for integers)."""
    return x if factor == 1 else (factor * x).astype(x.dtype)


@op("MatMul", since=1)
def matmul(node: Node, a: ArrayLike, b: ArrayLike) -> ArrayLike:
    """Matrix product with numpy.matmul semantics: 1-D operands and batch broadcasting."""
    return jnp.matmul(a, b, precision=PRECISION)


@op("Gemm", since=1)
def gemm(node: Node, a: ArrayLike, b: ArrayLike, c: ArrayLike | None = None) -> ArrayLike:
    """alpha * A' @ B' + beta * C, A' and B' transposed by transA/transB; C (optional
    from opset 11) broadcasts to the (M, N) result."""
    if np.ndim(a) != 2 or np.ndim(b) != 2:
        raise node.error(f"A and B must be matrices, got shapes {tuple(np.shape(a))} "
                         f"and {tuple(np.shape(b))}")
    if node.attr("transA", 0):
        a = jnp.transpose(a)
    if node.attr("transB", 0):
        b = jnp.transpose(b)
        # XLA:CPU may fold a transpose made by A's producer (a classifier head after a
        # global pool) into the product, and a product of two transposed operands runs on
        # a slow fallback kernel: A' is handed over row-major.
        a = row_major(a)
    product = scaled(jnp.matmul(a, b, precision=PRECISION), node.attr("alpha", 1.0))
    if c is None:
        return product
    return product + scaled(jnp.asarray(c), node.attr("beta", 1.0))


@op("Einsum", since=12)
def einsum(node: Node, *operands: ArrayLike) -> ArrayLike:
    """Einstein summation over the operands as `equation` spells it (numpy.einsum rules,
    ellipsis and implicit output included)."""
    equation = node.attr("equation").replace(" ", "")
    try:
        return jnp.einsum(equation, *operands, precision=PRECISION)
    except ValueError as problem:
        raise node.error(f"equation {equation!r} does not fit the operands: {problem}") from None


@op("Det", since=11)
def det(node: Node, x: ArrayLike) -> ArrayLike:
    """Determinant of each square matrix in the last two axes of X."""
    shape = np.shape(x)
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise node.error(f"input must hold square matrices in its last two axes, got shape {shape}")
    if np.dtype(x.dtype).itemsize < 4:
        # LU factorization needs at least float32; half types round the result back.
        return jnp.linalg.det(jnp.asarray(x, jnp.float32)).astype(x.dtype)
    return jnp.linalg.det(x)
