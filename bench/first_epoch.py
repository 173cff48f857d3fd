"""The first `fit` epoch against the later ones (issue 60): timm's mobilenetv3_small_050
(10 classes) exported by torch.onnx's dynamo exporter with a dynamic batch axis and its graph
optimizer off (so BatchNorm stays trainable), fine-tuned from 64x64 images in batches of 16:
340 training samples (21 full batches and a short one of 4) and 100 for evaluation (6 full
and a short one of 4) per epoch, 3 epochs, in new processes: cold (empty caches) and warm
(the caches the cold run filled; then once more with onnxtrain's executable cache off, JAX's
cache only). The first epoch compiles (or loads) four programs: the step, the step of the
short batch, evaluation of full and of short batches.

Usage: python bench/first_epoch.py [--exports /tmp/onnxtrain-zoo]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = """
import json, sys, time
start = time.perf_counter()
import numpy as np, onnxtrain
imported = time.perf_counter()
rng = np.random.default_rng(0)
x = rng.normal(size=(440, 3, 64, 64)).astype(np.float32)
y = rng.integers(0, 10, 440).astype(np.int64)
tuner = onnxtrain.Trainer(onnxtrain.make_training_model(sys.argv[1], loss="cross_entropy"))
epochs = []

class Clock(onnxtrain.callbacks.Callback):
    def on_epoch_begin(self, epoch):
        self.began = time.perf_counter()

    def on_epoch_end(self, epoch, logs):
        epochs.append(time.perf_counter() - self.began)

tuner.fit((x[:340], y[:340]), batch_size=16, epochs=3, eval_data=(x[340:], y[340:]), verbose=0,
          callbacks=[Clock()])
print(json.dumps({"set_up_s": time.perf_counter() - imported - sum(epochs), "epochs_s": epochs,
                  "programs": tuner.compilations}))
"""


def export(folder: Path) -> Path:
    import timm
    import torch

    path = folder / "mobilenetv3_small_050.dynamic.onnx"
    if not path.exists():
        torch.manual_seed(0)
        model = timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=10).eval()
        example = torch.randn(16, 3, 64, 64)
        batch = torch.export.Dim("batch", min=1, max=1024)
        program = torch.onnx.export(model, (example,), dynamo=True, input_names=["x"], output_names=["logits"],
                                    dynamic_shapes=({0: batch},), optimize=False)
        program.save(str(path))
    return path


def run(path: Path, cache: Path, executables: bool) -> dict:
    env = {**os.environ, "ONNXTRAIN_COMPILATION_CACHE": str(cache)}
    env["ONNXTRAIN_EXECUTABLE_CACHE"] = "on" if executables else "off"
    done = subprocess.run([sys.executable, "-c", WORKER, str(path)], capture_output=True, text=True, env=env,
                          timeout=1800)
    if done.returncode:
        raise SystemExit(done.stderr.strip().splitlines()[-1])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exports", type=Path, default=Path("/tmp/onnxtrain-zoo"))
    arguments = parser.parse_args()
    arguments.exports.mkdir(parents=True, exist_ok=True)
    path = export(arguments.exports)
    print("| start | set-up s | epoch 1 s | epoch 2 s | epoch 3 s | epoch 1 / later | programs |\n"
          "|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="onnxtrain-first-epoch-") as folder:
        rows = {"cold": (Path(folder) / "both", True), "warm": (Path(folder) / "both", True),
                "_fill": (Path(folder) / "jax", False), "warm, JAX cache only": (Path(folder) / "jax", False)}
        for start, (cache, executables) in rows.items():
            found = run(path, cache, executables)
            if start.startswith("_"):
                continue
            first, *later = found["epochs_s"]
            print(f"| {start} | {found['set_up_s']:.1f} | " + " | ".join(f"{s:.1f}" for s in found["epochs_s"])
                  + f" | {first / (sum(later) / len(later)):.2f} | {found['programs']} |", flush=True)


if __name__ == "__main__":
    main()
