"""Tiny causal language models (Qwen2, Llama) built from configs and exported the five ways
users export them, with the feeds each export takes and the same forward pass in torch.

Routes:
- "dynamo_static": torch.onnx.export(dynamo=True) with its defaults (shapes fixed);
- "dynamo_dynamic": the same with a dynamic batch and sequence;
- "dynamo_kv": the same over a wrapper taking the past keys and values as flat tensors
  (torch.export rejects transformers' DynamicCache as an input), dynamic past length;
- "optimum": `optimum-cli export onnx --task text-generation-with-past` (TorchScript inside).
  optimum-onnx 0.1.0 needs transformers 4.57, so it runs from a venv of its own:
  $ONNXTRAIN_OPTIMUM_PYTHON, else the checkout's .venv-optimum (`./run test` builds it);
- "genai_fp32", "genai_int4": onnxruntime-genai's model builder (`-p fp32|int4 -e cpu`) on
  the model saved to a local folder (GroupQueryAttention, MatMulNBits for int4).

Every parameter is perturbed away from its initial value, so that no two hold equal values
(an exporter would merge them) and an initializer's values name the parameter they came from.
Callers skip when torch or transformers is missing; an export whose tool is missing raises
Unavailable with the reason.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np

from support.paths import REPO

FAMILIES = ("qwen2", "llama")
# Models with ALiBi instead of rotary embeddings: exported by dynamo only.
ALIBI_FAMILIES = ("bloom", "mpt")
ROUTES = ("dynamo_static", "dynamo_dynamic", "dynamo_kv", "optimum", "genai_fp32", "genai_int4")
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 128, 64, 2, 4, 2
BATCH, LENGTH, PAST = 2, 16, 4
HEAD_SIZE = HIDDEN // HEADS


class Unavailable(Exception):
    """The tool an export needs is not installed here; the message says what to install."""


def causal_lm(family: str):
    """A tiny `family` causal LM (random, perturbed weights, eval mode, eager attention, the
    output projection untied from the embedding)."""
    import torch
    import transformers

    torch.manual_seed(0)
    shared = dict(vocab_size=VOCAB, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if family == "bloom":
        model = transformers.BloomForCausalLM(transformers.BloomConfig(
            hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS, **shared))
    elif family == "mpt":
        model = transformers.MptForCausalLM(transformers.MptConfig(
            d_model=HIDDEN, n_layers=LAYERS, n_heads=HEADS, max_seq_len=64, **shared))
    else:
        config_class, model_class = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                                     "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[family]
        # intermediate_size differs from the vocabulary: the genai builder takes every Linear
        # with vocabulary-many outputs for the LM head.
        config = config_class(hidden_size=HIDDEN, intermediate_size=3 * HIDDEN, num_hidden_layers=LAYERS,
                              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                              max_position_embeddings=128, **shared)
        config._attn_implementation = "eager"
        model = model_class(config)
    model.eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


def _wrappers():
    import torch
    from transformers import DynamicCache

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False).logits

    class FlatCache(torch.nn.Module):
        """Past keys and values as 2 x layers flat tensors in, the presents out."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, *past):
            cache = DynamicCache(config=self.model.config)
            for layer in range(LAYERS):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                             use_cache=True)
            presents = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
            return (out.logits, *presents)

    return Logits, FlatCache


def past_names() -> list[str]:
    """The flat-cache wrapper's past inputs, in its argument order."""
    return [f"past.{layer}.{kind}" for layer in range(LAYERS) for kind in ("key", "value")]


def export(route: str, model, folder: Path) -> Path:
    """`model` exported by `route` into `folder`; the .onnx path.

    Raises:
        Unavailable: the route's tool is missing.
    """
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    if route in ("optimum", "genai_fp32", "genai_int4"):
        source = folder / "hf"
        if not source.exists():
            model.save_pretrained(source)
            _tokenizer().save_pretrained(source)
        return _optimum(source, folder / "optimum") if route == "optimum" else _genai(source, folder / route)
    logits, flat_cache = _wrappers()
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    path = folder / f"{route}.onnx"
    batch, sequence, past = torch.export.Dim("batch"), torch.export.Dim("sequence"), torch.export.Dim("past")
    if route == "dynamo_kv":
        mask = torch.ones(BATCH, PAST + LENGTH, dtype=torch.int64)
        cache = [torch.zeros(BATCH, KV_HEADS, PAST, HEAD_SIZE) for _ in past_names()]
        args, module = (ids, mask, *cache), flat_cache(model)
        names = ["input_ids", "attention_mask", *past_names()]
        outputs = ["logits"] + [name.replace("past", "present") for name in past_names()]
        dynamic = {"input_ids": {0: batch, 1: sequence}, "attention_mask": {0: batch, 1: torch.export.Dim("total")},
                   "past": tuple({0: batch, 2: past} for _ in past_names())}
    else:
        args, module, names, outputs = (ids,), logits(model), ["input_ids"], ["logits"]
        dynamic = {"input_ids": {0: batch, 1: sequence}} if route == "dynamo_dynamic" else None
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), dynamo=True, input_names=names, output_names=outputs,
                          dynamic_shapes=dynamic)
    return path


def exporter(folder: Path, family: str = "qwen2"):
    """build(route) -> the path of one `family` model exported by `route` into `folder`, each
    route exported once; a route whose tool is missing skips the calling test, saying why."""
    import pytest

    model, made = causal_lm(family), {}

    def build(route: str) -> Path:
        if route not in made:
            try:
                made[route] = export(route, model, folder)
            except Unavailable as missing:
                made[route] = missing
        if isinstance(made[route], Unavailable):
            pytest.skip(str(made[route]))
        return made[route]

    return build


def _tokenizer():
    """A word-level tokenizer over the vocabulary: the genai builder and optimum read one."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t0",
                                                bos_token="t1", eos_token="t2")


def optimum_python() -> tuple[str | None, str]:
    """The python of a venv with optimum-onnx, or None, and where it was looked for."""
    given = os.environ.get("ONNXTRAIN_OPTIMUM_PYTHON")
    candidate = Path(given) if given else REPO / ".venv-optimum" / "bin" / "python"
    if candidate.exists():
        return str(candidate), str(candidate)
    return None, (f"no optimum-onnx venv at {candidate}: optimum-onnx 0.1.0 needs transformers 4.57 in a "
                  "venv of its own, which `./run test` builds as .venv-optimum (or set ONNXTRAIN_OPTIMUM_PYTHON)")


def _optimum(source: Path, out: Path) -> Path:
    python, where = optimum_python()
    if python is None:
        raise Unavailable(where)
    if not (out / "model.onnx").exists():
        _run([python, "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", str(source), "--task",
              "text-generation-with-past", str(out)], "optimum-cli export onnx")
    return out / "model.onnx"


def _genai(source: Path, out: Path) -> Path:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        raise Unavailable("onnxruntime-genai is not installed (pip install onnxruntime-genai; "
                          "`./run test` installs it)") from None
    if not (out / "model.onnx").exists():
        precision = out.name.split("_")[1]
        _run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(out),
              "-p", precision, "-e", "cpu"], f"onnxruntime-genai's model builder (-p {precision})")
    return out / "model.onnx"


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def feeds(route: str, model, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One batch of `route`'s export (ONNX `model`): its inputs and, as labels, the token ids
    (the causal_lm loss shifts them). KV-cache exports get past tensors: PAST random
    positions for the flat-cache wrapper, none for optimum and genai (a first prompt)."""
    ids = rng.integers(0, VOCAB, (BATCH, LENGTH))
    inputs = {value.name for value in model.graph.input}
    batch = {"input_ids": ids, "labels": ids}
    if route == "dynamo_kv":
        batch["attention_mask"] = np.ones((BATCH, PAST + LENGTH), np.int64)
        for name in past_names():
            batch[name] = rng.normal(size=(BATCH, KV_HEADS, PAST, HEAD_SIZE)).astype(np.float32)
        return batch
    if "attention_mask" in inputs:
        batch["attention_mask"] = np.ones((BATCH, LENGTH), np.int64)
    if "position_ids" in inputs:
        batch["position_ids"] = np.tile(np.arange(LENGTH), (BATCH, 1))
    for name in sorted(inputs):
        if name.startswith("past_key_values"):
            batch[name] = np.zeros((BATCH, KV_HEADS, 0, HEAD_SIZE), np.float32)
    return batch


def torch_loss(route: str, model, batch: dict[str, np.ndarray]):
    """transformers' own next-token loss of `model` on `batch` (a torch scalar with a graph)."""
    import torch
    from transformers import DynamicCache

    ids = torch.from_numpy(batch["input_ids"])
    extra = {}
    if "attention_mask" in batch:
        extra["attention_mask"] = torch.from_numpy(batch["attention_mask"])
    if "position_ids" in batch:
        extra["position_ids"] = torch.from_numpy(batch["position_ids"])
    if route == "dynamo_kv":
        cache = DynamicCache(config=model.config)
        for layer in range(LAYERS):
            cache.update(*(torch.from_numpy(batch[f"past.{layer}.{kind}"]) for kind in ("key", "value")), layer)
        extra["past_key_values"] = cache
    return model(input_ids=ids, labels=ids, use_cache=route == "dynamo_kv", **extra).loss
