"""Peak memory of make_training_model on one model file, for tests/recipe/test_trainable_set.py
(a script).

    python tests/recipe/build_memory_probe.py MODEL

Runs in a fresh process so that the figure is the build's alone: after warming up (imports,
a small model built once) it resets the kernel's peak-RSS mark, builds the training model
(cross-entropy, Adam) and prints one JSON line: the peak RSS growth in bytes.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import onnxtrain


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def main(path: str) -> None:
    warm = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["logits"])], "warm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(np.ones((4, 3), np.float32), "W")]), opset_imports=[helper.make_opsetid("", 17)])
    onnxtrain.make_training_model(warm, loss="cross_entropy")
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = _status("VmRSS")
    onnxtrain.make_training_model(path, loss="cross_entropy")
    print(json.dumps({"peak_growth": _status("VmHWM") - before}))


if __name__ == "__main__":
    main(sys.argv[1])
