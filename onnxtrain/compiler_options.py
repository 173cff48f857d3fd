"""XLA compiler options for training-step programs, chosen by measurement on XLA:CPU.

By default, XLA:CPU (jaxlib 0.10) hands single dots, convolutions and reductions to the
YNNPACK library. A single training step ran faster with XLA's own dot and convolution kernels.
Reductions stay with YNNPACK, because without it the transformer's layer norms lose 5%.
The step-time ratios, measured in one process with the two variants alternating:
- MLP: 0.88-0.95;
- CNN: 0.82-0.86;
- transformer: 0.99;
- MLP, 8 steps per call: 0.99-1.01.

A forward pass alone does better with YNNPACK's dots (the MLP: 0.13 against 0.17 ms), so
inference programs keep XLA's defaults.

The option is experimental in XLA. A jaxlib that lacks it, or a backend other than CPU, gets
no options. A user's own XLA_FLAGS setting of the option wins.
"""

from __future__ import annotations

import functools
import logging
import os

import jax
import numpy as np

logger = logging.getLogger("onnxtrain")
YNN_FUSION_OPTION = "xla_cpu_experimental_ynn_fusion_type"
TRAINING_YNN_FUSIONS = "LIBRARY_FUSION_TYPE_REDUCE"


@functools.cache
def training_compiler_options() -> dict[str, str] | None:
    """The compiler options of jitted training steps; None for XLA's defaults."""
    if YNN_FUSION_OPTION in os.environ.get("XLA_FLAGS", "") or jax.default_backend() != "cpu":
        return None
    options = {YNN_FUSION_OPTION: TRAINING_YNN_FUSIONS}
    try:
        jax.jit(jax.numpy.negative).lower(np.float32(0)).compile(options)
    except jax.errors.JaxRuntimeError as error:
        logger.debug("training steps compile with XLA's defaults: %s", error)
        return None
    return options
