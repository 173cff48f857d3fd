"""The XLA compiler options onnxtrain's jitted programs use, chosen by measurement on XLA:CPU.

By default, XLA:CPU (jaxlib 0.10) hands single dots, convolutions and reductions to the
YNNPACK library. onnxtrain's programs keep YNNPACK for dots and reductions only, because
XLA's own kernels run nearly every convolution shape tried, with its gradients, and the
training steps and forward passes of convolutional models faster (see bench/RESULTS.md,
"Design measurements").

Dots stay with YNNPACK because XLA's own kernel for a product with a transposed right
operand (every input gradient of a MatMul) is much slower, which would slow the training
of models with wide layers.

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
