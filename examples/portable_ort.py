"""Train with stock onnxruntime (no training package): loop a step model onnxtrain exported.

    python examples/portable_ort.py model.step.onnx batches.npz trained.npz [steps]

model.step.onnx comes from `trainer.export(path, portable="step")` (or `onnxtrain export
--portable step`); batches.npz holds one array per feed and batch, named "<batch>/<feed>".
The state starts from the initializers the manifest names; each step's new state is fed back.
"""

import json
import sys

import numpy as np
import onnx
import onnxruntime
from onnx import numpy_helper


def train(model_path: str, batches_path: str, out_path: str, steps: int = 20) -> list[float]:
    model = onnx.load(model_path)
    manifest = json.loads({p.key: p.value for p in model.metadata_props}["onnxtrain.step"])
    stored = {t.name: t for t in model.graph.initializer}
    state = {name: numpy_helper.to_array(stored[initial]) for name, initial in manifest["initial"].items()}
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # no warning that nodes read no <name>.initial: this loop does
    session = onnxruntime.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
    outputs = [output.name for output in session.get_outputs()]
    batches = np.load(batches_path)
    count = len({name.split("/")[0] for name in batches.files})
    losses = []
    for step in range(steps):
        feeds = {name: batches[f"{step % count}/{name}"] for name in manifest["feeds"]}
        results = dict(zip(outputs, session.run(None, {**feeds, **state})))
        state.update({name: results[output] for name, output in manifest["state"]})
        losses.append(float(results[manifest["loss"]]))
    np.savez(out_path, losses=np.asarray(losses), **state)
    return losses


if __name__ == "__main__":
    model, batches, out, *rest = sys.argv[1:]
    for number, loss in enumerate(train(model, batches, out, *map(int, rest)), 1):
        print(f"step {number}: loss {loss:.6f}")
