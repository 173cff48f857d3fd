"""Peak memory of a training step on a 100M-parameter model with Adam.

Target (issue "Performance"): peak RSS below 1.3x the bytes of the parameters
plus two Adam slots plus activations. The model (10 MatMul layers of
3162x3162 float32, ReLU, mse loss, Adam) is built by make_training_model in
one process and saved with external data; a fresh process then loads it into a
Trainer and takes 3 steps (batch 64), or runs fit over 8 batches with 4 steps per
call, reporting its peak RSS (VmHWM) against the process's own baseline after
importing onnxtrain, once per nan_policy:
"ignore" updates a state this large in place; "raise" (the default) keeps the step
transactional (a NaN/Inf anywhere leaves the old state), so nothing may be
written before every new value is known to be finite. For a state this large it
holds the gradients until then and recomputes the optimizer's update in place,
so it peaks at least at the state plus the gradients: 4/3 of the state with
Adam, above the target. Takes ~2 minutes and ~0.5 GB of disk space in a
temporary folder.

Adapter-style rows train only a little on the same model: LoRA adapters
(onnxtrain.LoRA, rank 8), or, with --adapters bias, a bias each layer gains (an
Add after its MatMul) and nothing else (as BitFit does). The frozen weights are
constants viewed in the read-only map of the side file, so the target there is
the weights' bytes plus the trainable state and its slots plus activations, at
most 1.2x (issue 35).

With --quantized it measures adapter-style training on a quantized base instead: the same
MatMul stack as a float32 file and as ONNX Runtime's int8 weight-only quantization of it
(MatMulNBits, bits=8), each fine-tuned in a fresh process with LoRA adapters on every
MatMul (ADAPTERS; --biases trains the biases instead), reporting peak RSS and the compiled
step's scratch bytes for both bases. Needs onnxruntime.

Usage: python bench/memory.py [--layers 10] [--width 3162] [--adapters lora|bias] [--quantized [--biases]]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BUILD = """
import sys, numpy as np, onnxtrain
from onnx import TensorProto, helper, numpy_helper
layers, width, path, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
rng = np.random.default_rng(0)
nodes, weights, previous = [], [], "x"
for i in range(layers):
    weights.append(numpy_helper.from_array(
        rng.standard_normal((width, width), dtype=np.float32) * np.float32(width ** -0.5), f"W{i}"))
    nodes.append(helper.make_node("MatMul", [previous, f"W{i}"], [f"m{i}"]))
    source = f"m{i}"
    if kind == "bias":
        weights.append(numpy_helper.from_array(np.zeros(width, np.float32), f"b{i}"))
        nodes.append(helper.make_node("Add", [source, f"b{i}"], [f"s{i}"]))
        source = f"s{i}"
    previous = f"h{i}"
    nodes.append(helper.make_node("Relu" if i < layers - 1 else "Identity", [source], [previous]))
graph = helper.make_graph(nodes, "wide", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
                          [helper.make_tensor_value_info(previous, TensorProto.FLOAT, ["batch", width])], weights)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
options = {}
if kind == "bias":
    options["trainable"] = [f"b{i}" for i in range(layers)]
elif kind == "lora":
    options["adapters"] = onnxtrain.LoRA(rank=8, alpha=16)
training = onnxtrain.make_training_model(model.SerializeToString(), loss="mse", optimizer=onnxtrain.optim.Adam(lr=1e-4),
                                         **options)
onnxtrain.save_model(training, path, external_data=True)
"""

MEASURE = """
import json, sys, numpy as np, onnxtrain
def hwm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
baseline = hwm()
trainer = onnxtrain.Trainer(sys.argv[1], nan_policy=sys.argv[3])
after_load = hwm()
width = int(sys.argv[2])
batch = {"x": np.ones((64, width), np.float32), "labels": np.zeros((64, width), np.float32)}
if sys.argv[4] == "fit":
    trainer.fit([batch] * 8, progress=False, steps_per_call=4)
else:
    for _ in range(3):
        float(trainer.step(batch)["loss"])
state = sum(value.nbytes for value in trainer._store.values.values())
print(json.dumps({"baseline": baseline, "after_load": after_load, "peak": hwm(), "state": state}))
"""

RUNS = {"step": "3 Trainer.step calls", "fit": "fit(8 batches, steps_per_call=4)"}

BUILD_BASES = """
import sys, numpy as np, onnx
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
layers, width, folder = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rng = np.random.default_rng(0)
nodes, weights, previous = [], [], "x"
for i in range(layers):
    weights.append(numpy_helper.from_array(
        rng.standard_normal((width, width), dtype=np.float32) * np.float32(width ** -0.5), f"W{i}"))
    weights.append(numpy_helper.from_array(np.zeros(width, np.float32) + np.float32(0.01 * i), f"b{i}"))
    nodes.append(helper.make_node("MatMul", [previous, f"W{i}"], [f"m{i}"]))
    nodes.append(helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]))
    previous = f"h{i}"
    nodes.append(helper.make_node("Tanh" if i < layers - 1 else "Identity", [f"a{i}"], [previous]))
graph = helper.make_graph(nodes, "wide", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
                          [helper.make_tensor_value_info(previous, TensorProto.FLOAT, ["batch", width])], weights)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
quantizer = MatMulNBitsQuantizer(onnx.ModelProto.FromString(model.SerializeToString()), bits=8, block_size=128,
                                 is_symmetric=True)
quantizer.process()
onnx.save(quantizer.model.model, folder + "/int8.onnx", save_as_external_data=True, location="int8.onnx.data")
onnx.save(model, folder + "/fp32.onnx", save_as_external_data=True, location="fp32.onnx.data")
"""

# What trains in the quantized-base rows: LoRA adapters on every MatMul (as source text for
# the measuring process); --biases trains only the biases instead.
ADAPTERS = "onnxtrain.LoRA(rank=16, alpha=32, targets=['*'])"

MEASURE_ADAPTED = """
import json, sys, numpy as np, optax, onnxtrain
def hwm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
baseline = hwm()
path, width, layers, adapters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
options = ({"trainable": [f"b{i}" for i in range(layers)]} if adapters == "None"
           else {"adapters": eval(adapters)})
tuner = onnxtrain.finetune(path, "mse", optax.adam(1e-4), **options)
after_load = hwm()
batch = {"x": np.ones((64, width), np.float32), "labels": np.zeros((64, width), np.float32)}
scratch = tuner.lowered(batch).compile().memory_analysis().temp_size_in_bytes
for _ in range(3):
    float(tuner.step(batch)["loss"])
print(json.dumps({"baseline": baseline, "after_load": after_load, "peak": hwm(), "scratch": scratch}))
"""


def quantized_rows(layers: int, width: int, environment: dict[str, str], adapters: str | None) -> None:
    """Adapter-style training on the float32 base and on its int8 quantization: peak RSS."""
    mib = 2 ** 20
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-c", BUILD_BASES, str(layers), str(width), folder], check=True,
                       env=environment, stdout=subprocess.DEVNULL)
        sizes = {base: sum(p.stat().st_size for p in Path(folder).glob(f"{base}.onnx*")) for base in ("fp32", "int8")}
        results = {base: subprocess.run(
            [sys.executable, "-c", MEASURE_ADAPTED, str(Path(folder) / f"{base}.onnx"), str(width), str(layers),
             str(adapters)], check=True, capture_output=True, text=True, env=environment)
            for base in ("fp32", "int8")}
    print(f"{layers} MatMul layers of {width}x{width}; training {adapters or 'the biases only'} with Adam, "
          f"batch 64, 3 steps")
    for base, result in results.items():
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        print(f"{base} base: files {sizes[base] / mib:.0f} MiB, baseline {figures['baseline'] / mib:.0f} MiB, "
              f"after load {figures['after_load'] / mib:.0f} MiB, peak {figures['peak'] / mib:.0f} MiB "
              f"(peak - baseline {(figures['peak'] - figures['baseline']) / mib:.0f} MiB), compiled step "
              f"scratch {figures['scratch'] / mib:.1f} MiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--width", type=int, default=3162)
    parser.add_argument("--adapters", choices=("lora", "bias"), default="lora",
                        help="what trains in the adapter-style rows")
    parser.add_argument("--quantized", action="store_true",
                        help="adapter-style training on an int8 weight-only base vs the float32 base")
    parser.add_argument("--biases", action="store_true", help="with --quantized: train the biases, not LoRA")
    arguments = parser.parse_args()
    environment = {**os.environ, "ONNXTRAIN_COMPILATION_CACHE": "off"}
    if arguments.quantized:
        quantized_rows(arguments.layers, arguments.width, environment, None if arguments.biases else ADAPTERS)
        return 0
    sizes = [str(arguments.layers), str(arguments.width)]
    with tempfile.TemporaryDirectory() as folder:
        path, adapted = str(Path(folder) / "wide.onnx"), str(Path(folder) / "adapted" / "wide.onnx")
        Path(adapted).parent.mkdir()
        for built, kind in ((path, "full"), (adapted, arguments.adapters)):
            subprocess.run([sys.executable, "-c", BUILD, *sizes, built, kind], check=True, env=environment)
        results = {(policy, run): subprocess.run(
            [sys.executable, "-c", MEASURE, path, str(arguments.width), policy, run],
            check=True, capture_output=True, text=True, env=environment)
            for policy in ("ignore", "raise") for run in RUNS}
        adapter_results = {run: subprocess.run(
            [sys.executable, "-c", MEASURE, adapted, str(arguments.width), "raise", run],
            check=True, capture_output=True, text=True, env=environment) for run in RUNS}
    parameters = arguments.layers * arguments.width ** 2
    state = 3 * 4 * parameters
    activations = 2 * 4 * 64 * arguments.width * arguments.layers
    mib = 2 ** 20
    print(f"{parameters / 1e6:.1f}M parameters; parameters + 2 Adam slots {state / mib:.0f} MiB, "
          f"activations ~{activations / mib:.0f} MiB")
    for (policy, run), result in results.items():
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        print(f"nan_policy={policy!r}, {RUNS[run]}: baseline (python + jax + onnxtrain) "
              f"{figures['baseline'] / mib:.0f} MiB, after load {figures['after_load'] / mib:.0f} MiB, "
              f"peak {figures['peak'] / mib:.0f} MiB; "
              f"(peak - baseline) / (state + activations) = "
              f"{(figures['peak'] - figures['baseline']) / (state + activations):.2f} (target < 1.3)")
    trained = {"bias": "biases", "lora": "LoRA adapters"}[arguments.adapters]
    for run, result in adapter_results.items():
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        # The frozen weights, mapped from the side file, plus the trainer's whole state.
        needed = 4 * parameters + figures["state"] + activations
        print(f"adapter-style ({trained} train, weights frozen), {RUNS[run]}: state with Adam slots "
              f"{figures['state'] / mib:.1f} MiB, baseline {figures['baseline'] / mib:.0f} MiB, after load "
              f"{figures['after_load'] / mib:.0f} MiB, peak {figures['peak'] / mib:.0f} MiB; "
              f"(peak - baseline) / (weights + state + activations) = "
              f"{(figures['peak'] - figures['baseline']) / needed:.2f} (target <= 1.2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
