"""Tiny transformers models exported by torch.onnx and fused by ONNX Runtime's transformer
optimizer, and the map from the fused model's weights to the exported ones.

The models have random weights perturbed away from their initial values (so that no two
LayerNorm scales or biases are equal and an exporter neither merges them nor drops all-zero
biases) and eager attention (the pattern the optimizer's attention fusion recognizes).
Callers skip when torch or transformers is missing.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

HIDDEN, HEADS, VOCAB, BATCH, LENGTH = 32, 4, 100, 2, 8


def _model(family: str):
    import torch
    import transformers

    torch.manual_seed(0)
    if family == "bert":
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN,
                                         num_hidden_layers=2, num_attention_heads=HEADS,
                                         intermediate_size=2 * HIDDEN, max_position_embeddings=64)
        model = transformers.BertModel(config)
    elif family == "t5":
        config = transformers.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS,
                                       d_ff=2 * HIDDEN, num_layers=2, num_heads=HEADS)
        model = transformers.T5EncoderModel(config)
    elif family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2,
                                         n_head=HEADS, n_positions=64)
        model = transformers.GPT2Model(config)
    else:
        raise ValueError(family)
    config._attn_implementation = "eager"
    model.eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))

    class LastHiddenState(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            extra = {"use_cache": False} if family == "gpt2" else {}
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              return_dict=False, **extra)[0]

    return LastHiddenState()


def export(family: str, exporter: str, folder: Path) -> Path:
    """`family` ("bert", "gpt2", "t5": its encoder) exported by `exporter` ("dynamo" or
    "torchscript") into folder/<family>_<exporter>.onnx, inputs input_ids and attention_mask
    (int64)."""
    import torch

    path = folder / f"{family}_{exporter}.onnx"
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH))
    mask = torch.ones(BATCH, LENGTH, dtype=torch.int64)
    options = dict(input_names=["input_ids", "attention_mask"],
                   output_names=["last_hidden_state"])
    if exporter == "torchscript":
        axes = {0: "batch", 1: "sequence"}
        options.update(dynamo=False, dynamic_axes={"input_ids": axes, "attention_mask": axes})
    else:
        options.update(dynamo=True)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(_model(family), (ids, mask), str(path), **options)
    return path


def optimize(path: Path, family: str) -> onnx.ModelProto:
    """The model at `path` after onnxruntime.transformers.optimizer.optimize_model, saved
    beside it as <name>_optimized.onnx and loaded back (as users get it: only saving adds the
    com.microsoft opset import)."""
    from onnxruntime.transformers.optimizer import optimize_model

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        optimized = optimize_model(str(path), model_type=family, num_heads=HEADS,
                                   hidden_size=HIDDEN, opt_level=0, use_gpu=False)
        saved = path.with_name(f"{path.stem}_optimized.onnx")
        optimized.save_model_to_file(str(saved))
    return onnx.load(saved)


def contrib_ops(model: onnx.ModelProto) -> set[str]:
    return {node.op_type for node in model.graph.node if node.domain == "com.microsoft"}


def weight_sources(fused: onnx.ModelProto, unfused: onnx.ModelProto,
                   names: set[str]) -> dict[str, list[str]]:
    """For each of `names` (fused initializers), the unfused initializers holding its value:
    one of equal value, or the Q, K and V tensors the optimizer concatenated along the last
    axis into a merged projection. Names with no source are left out."""
    unfused_values = {t.name: numpy_helper.to_array(t) for t in unfused.graph.initializer}

    def same(value: np.ndarray) -> str | None:
        return next((n for n, v in unfused_values.items()
                     if v.shape == value.shape and np.array_equal(v, value)), None)

    sources = {}
    for tensor in fused.graph.initializer:
        if tensor.name not in names:
            continue
        value = numpy_helper.to_array(tensor)
        found = same(value)
        if found is not None:
            sources[tensor.name] = [found]
            continue
        if value.shape[-1] % 3 == 0:
            parts = [same(part) for part in np.split(value, 3, axis=-1)]
            if None not in parts:
                sources[tensor.name] = parts
    return sources
