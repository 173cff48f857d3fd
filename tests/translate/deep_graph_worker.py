"""Build a deep model, translate and run it (and its gradient); print one JSON line.

test_deep_graphs.py runs this in a subprocess, so a model that crashes XLA's compiler kills
the worker, not pytest. Usage: deep_graph_worker.py KIND N, KIND one of
  add-chain   Y = X + 1 + 1 + ... (N Add nodes, each reading the last)
  sum         Y = Sum(X, X, ..., X) (one node, N inputs)
  mul-grad    Y = X * W * W * ... (N Mul nodes), and d sum(Y) / dW compiled (for measuring:
              XLA compiles such gradients in time that grows much faster than N)
"""

from __future__ import annotations

import json
import sys

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def deep_model(kind: str, n: int) -> bytes:
    one = numpy_helper.from_array(np.float32(1.0), "W")
    if kind == "sum":
        nodes = [helper.make_node("Sum", ["X"] * n, ["Y"])]
    else:
        op = "Mul" if kind == "mul-grad" else "Add"
        names = ["X", *(f"v{i}" for i in range(1, n)), "Y"]
        nodes = [helper.make_node(op, [names[i], "W"], [names[i + 1]]) for i in range(n)]
    graph = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("X", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3])], [one])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    return model.SerializeToString()


def main(kind: str, n: int) -> dict:
    import jax
    import jax.numpy as jnp

    import onnxtrain

    x = np.array([1.0, 2.0, 3.0], np.float32)
    try:
        fn, params = onnxtrain.translate_model(deep_model(kind, n))
        result = {"outcome": "ok", "Y": np.asarray(fn(params, {"X": x})["Y"]).tolist()}
        if kind == "mul-grad":
            grad = jax.jit(jax.grad(lambda p: jnp.sum(fn.apply(p, {"X": jnp.asarray(x)})["Y"])))(params)
            result["dW"] = float(grad["W"])
        return result
    except onnxtrain.OnnxTrainError as error:
        return {"outcome": type(error).__name__, "message": str(error)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))), flush=True)
