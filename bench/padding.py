"""Text batches of random lengths: one epoch of fit, unpadded and through
onnxtrain.data.padded_batches, against torch eager on the same batches.

A tiny Qwen2 (2 layers, hidden 64, from a config) is exported by torch.onnx's dynamo exporter
with dynamic batch and sequence axes. Twenty batches of two examples, each 8 to 64 tokens long,
train one epoch (causal LM loss, Adam) in a fresh Trainer per variant, in one process, with
JAX's compilation cache off: each variant pays its own compiles, as a first run does. Printed:
wall time of the epoch, programs compiled, and torch eager's time for the same twenty steps.

Usage: python bench/padding.py [--batches 20] [--multiple-of 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("ONNXTRAIN_COMPILATION_CACHE", "off")

import numpy as np  # noqa: E402


def _model(folder: Path):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False).logits

    ids = torch.randint(0, 128, (2, 16))
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    path = folder / "qwen2.onnx"
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(Logits(), (ids,), str(path), dynamo=True, input_names=["input_ids"],
                          output_names=["logits"], dynamic_shapes={"input_ids": {0: batch, 1: sequence}})
    return model, path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--multiple-of", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args()

    import torch

    import onnxtrain
    from onnxtrain.data import padded_batches

    rng = np.random.default_rng(arguments.seed)
    examples = [{"input_ids": rng.integers(0, 128, int(rng.integers(8, 65)))} for _ in range(2 * arguments.batches)]
    # Two examples per batch, cut to the shorter one, so the unpadded batches need no padding.
    unpadded = []
    for first, second in zip(examples[::2], examples[1::2]):
        length = min(len(first["input_ids"]), len(second["input_ids"]))
        ids = np.stack([first["input_ids"][:length], second["input_ids"][:length]])
        unpadded.append({"input_ids": ids, "labels": ids})
    padded = padded_batches([{"input_ids": b["input_ids"][i]} for b in unpadded for i in range(2)], 2,
                            multiple_of=arguments.multiple_of, labels_from="input_ids")

    with tempfile.TemporaryDirectory() as folder:
        module, path = _model(Path(folder))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            training = onnxtrain.make_training_model(str(path), "causal_lm", optimizer=onnxtrain.optim.Adam(lr=1e-3))
        rows = []
        for name, data in (("unpadded", unpadded), (f"padded to a multiple of {arguments.multiple_of}", padded)):
            trainer = onnxtrain.Trainer(training)
            start = time.perf_counter()
            trainer.fit(data, epochs=1, verbose=0)
            lengths = sorted({batch["input_ids"].shape[1] for batch in data})
            rows.append((name, time.perf_counter() - start, trainer.compilations, len(lengths)))
        adam = torch.optim.Adam(module.parameters(), lr=1e-3)
        start = time.perf_counter()
        for batch in unpadded:
            ids = torch.from_numpy(batch["input_ids"])
            loss = module(input_ids=ids, labels=ids).loss
            adam.zero_grad()
            loss.backward()
            adam.step()
        eager = time.perf_counter() - start

    print(f"| data ({arguments.batches} batches of 2, lengths 8-64) | first epoch s | programs | lengths |")
    print("|---|---|---|---|")
    for name, seconds, programs, lengths in rows:
        print(f"| onnxtrain, {name} | {seconds:.1f} | {programs} | {lengths} |")
    print(f"| torch eager, unpadded | {eager:.2f} | - | {rows[0][3]} |")


if __name__ == "__main__":
    main()
