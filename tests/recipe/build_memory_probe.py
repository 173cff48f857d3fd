"""Peak memory of make_training_model on one model file, for tests/recipe/test_trainable_set.py
(a script).

    python tests/recipe/build_memory_probe.py MODEL

Runs in a fresh process so that the figure is the build's alone (support.peak_memory): after
warming up (imports, a small model built once) it builds the training model (cross-entropy,
Adam) and prints one JSON line: the peak RSS growth in bytes.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from support.peak_memory import peak_growth


def main(path: str) -> None:
    warm = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["logits"])], "warm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(np.ones((4, 3), np.float32), "W")]), opset_imports=[helper.make_opsetid("", 17)])
    onnxtrain.make_training_model(warm, loss="cross_entropy")
    growth, _ = peak_growth(lambda: onnxtrain.make_training_model(path, loss="cross_entropy"))
    print(json.dumps({"peak_growth": growth}))


if __name__ == "__main__":
    main(sys.argv[1])
