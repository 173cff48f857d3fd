"""The XLA compiler options onnxtrain's jitted programs use, chosen by measurement on XLA:CPU.

By default, XLA:CPU (jaxlib 0.10) hands single dots, convolutions and reductions to the
YNNPACK library. XLA's own convolution kernels proved faster, so onnxtrain's programs keep
YNNPACK for dots and reductions only.

Measured here (2-core AMD EPYC, AVX-512), each variant against the default, alternating in
one process:
- A convolution with its two gradients, over 13 shapes (plain, strided, 1x1, grouped,
  depthwise, 7x7 stem, 1-D): 0.43-1.03 the time, except one case at 1.10 (3 to 64
  channels, 3x3, stride 2, on 112x112).
- A convolution's forward pass alone, over the same shapes: 0.53-1.01, that case 1.41.
- Training steps: the benchmark CNN 0.86-0.88, ResNet-18 0.93.
- Forward passes: the benchmark CNN 0.84, ResNet-18 0.88.

Dots stay with YNNPACK. XLA's own kernel for a product with a transposed right operand
(every input gradient of a MatMul) ran 1.5-9 times slower, so training steps of models with
512-2048-wide layers took 1.4-2.2 times as long.

The option is experimental in XLA, and this list replaces XLA's default list rather than
editing it. A jaxlib that lacks the option, or a backend other than CPU, gets no options.
A user's own XLA_FLAGS setting of the option wins.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

logger = logging.getLogger("onnxtrain")
YNN_FUSION_OPTION = "xla_cpu_experimental_ynn_fusion_type"
YNN_FUSIONS = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"


@functools.cache
def xla_compiler_options() -> dict[str, str] | None:
    """The compiler options of onnxtrain's jitted programs; None for XLA's defaults."""
    if YNN_FUSION_OPTION in os.environ.get("XLA_FLAGS", "") or jax.default_backend() != "cpu":
        return None
    options = {YNN_FUSION_OPTION: YNN_FUSIONS}
    try:
        jax.jit(jax.numpy.negative).lower(np.float32(0)).compile(options)
    except jax.errors.JaxRuntimeError as error:
        logger.debug("onnxtrain's programs compile with XLA's defaults: %s", error)
        return None
    return options


def jit_with_options(fun: Callable, **settings: Any) -> Callable:
    """jax.jit(fun, **settings) with onnxtrain's compiler options."""
    return jax.jit(fun, compiler_options=xla_compiler_options(), **settings)
