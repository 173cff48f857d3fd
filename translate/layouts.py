"""Values pinned to XLA's row-major layout where XLA:CPU's own choice reads them slowly.

- Gradients, laid out the way the state that consumes them is. XLA:CPU's convolution writes
  a kernel's gradient as (in, h, w, out) in memory, and XLA folds the move to the kernel's
  (out, in, h, w) order into every consumer: Adam's two moment updates then each read the
  gradient across the grain. Pinning the gradient makes XLA transpose it once instead, which
  shortens the training steps of convolutional models (see bench/RESULTS.md, "Design
  measurements"). A gradient already row-major, such as a matrix product's, is unchanged.
- Gemm's left operand when B is transposed (see ops.math.gemm): a transpose folded into
  that product would leave both of its operands transposed, a form XLA:CPU runs on a slow
  fallback kernel.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental.layout import Layout, with_layout_constraint


def row_major(value: Any) -> Any:
    """`value` (a traced array of any rank) constrained to XLA's default layout."""
    if not isinstance(value, jax.core.Tracer) or value.ndim < 2:
        return value
    pinned = with_layout_constraint(value, Layout(major_to_minor=tuple(range(value.ndim))))
    # A constrained value that a program returns as it is gets no layout JAX can match
    # with a donated buffer (a gradient bound to state, say); the barrier, free at run
    # time, hands on an ordinary value.
    return jax.lax.optimization_barrier(pinned)
