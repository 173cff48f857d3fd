"""Fine-tuning a transformer export past protobuf's 2 GiB limit: load time, step times, peak memory.

Target (issue 35, acceptance 2): a transformer export of at least 2.5 GB (random weights,
external data) fine-tunes on this machine with a peak RSS of at most 1.2x the bytes that must
exist: the model file, the trainable state with its optimizer slots, and the activations.

The model, a transformers GPT-2 language model (GPT2LMHeadModel from a GPT2Config, random
weights; by default 14 layers of width 2048 and a vocabulary of 100, about 2.8 GB of float32
weights), is exported once with torch.onnx.export(dynamo=True, external_data=True) in its own
process and cached in --folder. A fresh process then fine-tunes it with onnxtrain.finetune and
optax.adam on a fixed batch of token ids (next-token cross-entropy) for a few steps. Only a
little trains: by default LoRA adapters (onnxtrain.LoRA, rank 8, alpha 16, on every linear
layer), or with --adapters none the LayerNorm scales and biases; the base weights stay
frozen, as graph constants viewed in the read-only map of the side file. The child reports
its peak RSS (resource.getrusage), which counts the mapped file's pages it touched.

The activation estimate counts what the backward pass keeps per layer and token: about 17
hidden-width vectors and 2.5 attention rows per head (the count of Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", in float32), plus the
logits three times (the logits, their softmax and its gradient).

Usage: python bench/large_model.py [--folder /tmp/onnxtrain-large-model] [--layers 14]
           [--width 2048] [--heads 16] [--batch 2] [--sequence 32] [--steps 4]
           [--adapters lora|none] [--read] [--warm] [--build-only]
--read also fine-tunes a copy whose side-file values were read into the message
(load_model(map_external_data=False)), for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VOCAB = 100

BUILD = """
import contextlib, io, json, sys, warnings
import torch, transformers
layers, width, heads, batch, sequence = (int(value) for value in sys.argv[1:6])
path = sys.argv[6]
torch.manual_seed(0)
config = transformers.GPT2Config(vocab_size=%d, n_positions=max(64, sequence), n_embd=width, n_layer=layers,
                                 n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                 bos_token_id=0, eos_token_id=0)
model = transformers.GPT2LMHeadModel(config).eval()

class Logits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, return_dict=False)[0]

ids = torch.randint(0, config.vocab_size, (batch, sequence))
with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
    warnings.simplefilter("ignore")
    torch.onnx.export(Logits(), (ids,), path, dynamo=True, external_data=True, input_names=["input_ids"],
                      output_names=["logits"])
print(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))
""" % VOCAB

MEASURE = """
import json, resource, sys, time
import numpy as np, optax, onnxtrain

path, batch, sequence, steps, adapters, read = sys.argv[1:7]
batch, sequence, steps = int(batch), int(sequence), int(steps)

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def resident():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(fields[key].split()[0]) * 1024 for key in ("RssAnon", "RssFile")}

def loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

baseline = peak()
started = time.perf_counter()
model = onnxtrain.load_model(path, map_external_data=False) if read == "read" else path
if adapters == "lora":
    tuner = onnxtrain.finetune(model, loss, optax.adam(1e-3), adapters=onnxtrain.LoRA(rank=8, alpha=16))
else:
    tuner = onnxtrain.finetune(model, loss, optax.adam(1e-3),
                               trainable=lambda name, value: value.ndim == 1 and ".ln_" in name)
del model
loaded = time.perf_counter() - started
after_load = peak()
rng = np.random.default_rng(0)
tokens = rng.integers(0, 100, (batch, sequence + 1))
feeds = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
losses, times = [], []
for _ in range(steps):
    started = time.perf_counter()
    losses.append(float(tuner.step(feeds)["loss"]))
    times.append(time.perf_counter() - started)
state = sum(value.nbytes for value in tuner._store.values.values())
trainable = sum(tuner._store.values[name].nbytes for name in tuner.state_names)
print(json.dumps({"baseline": baseline, "after_load": after_load, "peak": peak(), "resident": resident(),
                  "load_s": loaded, "first_step_s": times[0], "step_s": sorted(times[1:])[len(times[1:]) // 2],
                  "losses": losses, "state_bytes": state, "trainable_bytes": trainable}))
"""


def build(folder: Path, layers: int, width: int, heads: int, batch: int, sequence: int) -> Path:
    """The cached export (built on first use), for input_ids of shape [batch, sequence]; its
    name records its shape."""
    path = folder / f"gpt2_l{layers}_w{width}_h{heads}_b{batch}_s{sequence}.onnx"
    if not (path.exists() and Path(f"{path}.data").exists()):
        folder.mkdir(parents=True, exist_ok=True)
        print(f"exporting {path} (once) ...", flush=True)
        subprocess.run([sys.executable, "-c", BUILD, *map(str, (layers, width, heads, batch, sequence, path))],
                       check=True)
    return path


def activations(layers: int, width: int, heads: int, batch: int, sequence: int) -> int:
    """Bytes the backward pass keeps (see the module docstring)."""
    tokens = batch * sequence
    return 4 * (layers * tokens * (17 * width + 5 * heads * sequence // 2) + 3 * tokens * VOCAB)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/onnxtrain-large-model"))
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--sequence", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--adapters", choices=("lora", "none"), default="lora",
                        help="what trains: LoRA adapters, or (none) the LayerNorm parameters")
    parser.add_argument("--read", action="store_true")
    parser.add_argument("--warm", action="store_true",
                        help="measure a second process whose compiled programs come from the persistent "
                             "compilation cache (the first fills it): the peak without the compiler's")
    parser.add_argument("--build-only", action="store_true", help="export the model (if not cached) and stop")
    arguments = parser.parse_args()
    path = build(arguments.folder, arguments.layers, arguments.width, arguments.heads, arguments.batch,
                 arguments.sequence)
    if arguments.build_only:
        return 0
    cache = tempfile.TemporaryDirectory() if arguments.warm else None
    environment = {**os.environ, "ONNXTRAIN_COMPILATION_CACHE": cache.name if cache else "off"}
    file_bytes = path.stat().st_size + Path(f"{path}.data").stat().st_size
    active = activations(arguments.layers, arguments.width, arguments.heads, arguments.batch, arguments.sequence)
    mib = 2**20
    print(f"{path.name}: {file_bytes / 1e9:.2f} GB ({file_bytes / mib:.0f} MiB) in the model file and its "
          f"side file; activations ~{active / mib:.0f} MiB (batch {arguments.batch}, sequence {arguments.sequence})")
    for how in ("map", "read") if arguments.read else ("map",):
        if cache:  # the run that compiles and fills the cache, not reported
            subprocess.run([sys.executable, "-c", MEASURE, str(path), str(arguments.batch), str(arguments.sequence),
                            "2", arguments.adapters, how], capture_output=True, check=True, env=environment)
        result = subprocess.run([sys.executable, "-c", MEASURE, str(path), str(arguments.batch),
                                 str(arguments.sequence), str(max(arguments.steps, 2)), arguments.adapters, how],
                                capture_output=True, text=True, env=environment)
        if result.returncode:
            print(result.stderr[-4000:], file=sys.stderr)
            return result.returncode
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        needed = file_bytes + figures["state_bytes"] + active
        print(f"side file {'mapped' if how == 'map' else 'read into the message'}: load {figures['load_s']:.1f} s, "
              f"first step {figures['first_step_s']:.1f} s, step {figures['step_s']:.2f} s (median of "
              f"{len(figures['losses']) - 1}); losses {' '.join(f'{x:.4f}' for x in figures['losses'])}")
        print(f"  trainable {figures['trainable_bytes'] / mib:.1f} MiB, state with optimizer slots "
              f"{figures['state_bytes'] / mib:.1f} MiB; peak RSS {figures['peak'] / mib:.0f} MiB (after import "
              f"{figures['baseline'] / mib:.0f}, after load {figures['after_load'] / mib:.0f}; at the end anonymous "
              f"{figures['resident']['RssAnon'] / mib:.0f} + file-backed {figures['resident']['RssFile'] / mib:.0f})")
        print(f"  peak RSS / (file + state + activations) = {figures['peak'] / needed:.2f} (target <= 1.2); "
              f"(peak - after import) / (file + state + activations) = "
              f"{(figures['peak'] - figures['baseline']) / needed:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
