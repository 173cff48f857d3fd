"""Adapters: small trainable additions to a frozen model (LoRA), in standard ONNX ops.

    >>> training = onnxtrain.make_training_model("gpt2.onnx", loss="cross_entropy",
    ...                                          adapters=onnxtrain.LoRA(rank=8, alpha=16))
    >>> trainer = onnxtrain.Trainer(training)
    >>> ...
    >>> trainer.export("gpt2.merged.onnx", training=False)               # W + (alpha/rank)·A·B
    >>> trainer.export("gpt2.lora.onnx", training=False, merge=False)   # + gpt2.lora.adapter.onnx
    >>> merged = onnxtrain.apply_adapters("gpt2.onnx", "gpt2.lora.adapter.onnx")

The graph surgery (choosing targets, the branch, folding it back) is in onnxtrain._recipe.lora.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from onnxtrain._io.model import ModelSource
from onnxtrain.errors import InputError
from onnxtrain.proto import ModelProto, NodeProto

# A predicate over candidate weights: (value name, its stored array, the first consumer node).
TargetPredicate = Callable[[str, np.ndarray, NodeProto], bool]
Targets = str | Sequence[str] | TargetPredicate | None


@dataclass(frozen=True)
class LoRA:
    """Low-rank adapters: each targeted weight W computes x·W + (alpha/rank)·(x·A)·B.

    A ([in, rank]) is drawn uniformly in ±1/sqrt(in) (PEFT's Kaiming-uniform default) and
    B ([rank, out]) starts at zero, so the adapted model starts as the base model. Only A and
    B train; W stays a constant of the graph.

    Args:
        rank: the inner dimension r of A·B (a positive int).
        alpha: the scale numerator; the branch is multiplied by alpha / rank.
        targets: None for every linear layer of a transformer export (2-D float weights read
            as the weight operand of MatMul or Gemm, except embedding tables and the output
            head: a layer whose result reaches the trained output without passing another
            MatMul, Gemm or Conv); a list of layer names as peft's target_modules takes them
            (["q_proj", "v_proj"] chooses every module whose path ends in them, e.g.
            "model.layers.0.self_attn.q_proj", where the export records module paths:
            torch.onnx's dynamo exporter, optimum, onnxruntime-genai's builder) or of fnmatch
            patterns over module paths and weight names (Conv weights, heads and quantized
            weights, named by their DequantizeLinear output, can be chosen this way); or a
            predicate (name, stored value, consumer node) -> bool. Adapters are named after
            the module path where it is known ("<module>.lora_A"), else after the weight.
        dropout: the Dropout ratio applied to x in the branch while training (identity in
            inference and evaluation).
        seed: the seed A is drawn with.

    Raises:
        InputError: a rank, alpha, dropout or targets of the wrong kind or range.

    Example:
        >>> onnxtrain.LoRA(rank=8, alpha=16, targets=["*attn*", "*mlp*"], dropout=0.05)
    """

    rank: int
    alpha: float
    targets: Targets = None
    dropout: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, numbers.Integral) or self.rank < 1:
            raise InputError(f"LoRA(rank={self.rank!r}): rank must be a positive int (e.g. 8)")
        if (isinstance(self.alpha, bool) or not isinstance(self.alpha, numbers.Real)
                or not math.isfinite(self.alpha) or self.alpha <= 0):
            raise InputError(f"LoRA(alpha={self.alpha!r}): alpha must be a positive finite number "
                             "(the branch is scaled by alpha / rank; PEFT often uses 2 * rank)")
        if (isinstance(self.dropout, bool) or not isinstance(self.dropout, numbers.Real)
                or not 0.0 <= self.dropout < 1.0):
            raise InputError(f"LoRA(dropout={self.dropout!r}): dropout must be a ratio in [0, 1)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise InputError(f"LoRA(seed={self.seed!r}): seed must be an int")
        targets = self.targets
        if targets is None or isinstance(targets, str) or callable(targets):
            return
        if not isinstance(targets, Sequence) or not targets or not all(isinstance(t, str) for t in targets):
            raise InputError(f"LoRA(targets={targets!r}): targets must be None, a non-empty list of "
                             "name patterns (fnmatch, e.g. '*q_proj*'), or a predicate "
                             "(name, value, consumer node) -> bool")
        object.__setattr__(self, "targets", tuple(targets))

    @property
    def scale(self) -> float:
        """alpha / rank: what the branch (x·A)·B is multiplied by."""
        return float(self.alpha) / int(self.rank)


def apply_adapters(base: ModelSource, adapter_file: ModelSource, merge: bool = True) -> ModelProto:
    """The base model with the adapters of an adapter file (written by export(merge=False)).

    Args:
        base: the base inference model the adapters were trained on (a path, bytes, file
            object or ModelProto); for an `.onnx_adapter` file, the adapter-ready base that
            export_adapters(..., base=...) wrote.
        adapter_file: the `.adapter.onnx` file (or its bytes or ModelProto), or an ONNX
            Runtime `.onnx_adapter` file (its path or bytes).
        merge: True folds W + (alpha/rank)·A·B into each adapted weight (the same graph as
            the base, as export(merge=True) writes it); False adds the adapter branch.

    Returns:
        The new ModelProto (onnxtrain.proto), ready for onnxtrain.save_model.

    Raises:
        ModelLoadError: the adapter file carries no adapter description, or is a damaged
            `.onnx_adapter` file.
        BindingError: an adapted weight is missing from the base model or has another shape.

    Example:
        >>> merged = onnxtrain.apply_adapters("gpt2.onnx", "gpt2.lora.adapter.onnx")
        >>> onnxtrain.save_model(merged, "gpt2.merged.onnx")
        >>> merged = onnxtrain.apply_adapters("genai/model.onnx", "math.onnx_adapter")
    """
    from onnxtrain._recipe.lora_export import apply_adapter_file

    return apply_adapter_file(base, adapter_file, merge)
