"""Export the model zoo: tiny real models as torch.onnx, transformers and skl2onnx emit them.

The zoo test (tests/zoo) trains what exporters actually write, so it needs real exporter
output for many families: transformers BERT, DistilBERT, RoBERTa, GPT-2, T5, ViT and
Wav2Vec2 built from tiny configs (no hub), torch.nn LSTM, GRU, a 1-D conv net, an
autoencoder, a ResNet-style and a MobileNet-style CNN, the torchvision families (ResNet,
MobileNetV3, EfficientNet, SqueezeNet, ShuffleNetV2, RegNetY, ConvNeXt: torchvision's own
module code in tiny configurations) and timm's ViT, and scikit-learn pipelines. Every torch
family is exported with both torch exporters: "dynamo" (torch.onnx.export's default) and
"torchscript" (dynamo=False), the CNNs with BatchNorm also as "dynamo_unoptimized"
(optimize=False, which keeps BatchNorm); scikit-learn pipelines with skl2onnx.

Weights are random (fixed seeds) and every floating tensor is perturbed after construction,
so no two parameters hold equal values: LayerNorm's ones and the zero biases would otherwise
let an exporter merge or drop them, and an initializer could not be traced back to the
parameter it came from. Each export comes with one fixed batch (inputs and labels) and the
name of the output the loss reads.

Usage (dev only; the test exports what it needs itself):
    python scripts/export_zoo.py OUT_DIR [--family NAME ...] [--exporter dynamo|torchscript|skl2onnx]
writes OUT_DIR/<family>-<exporter>.onnx and OUT_DIR/<family>-<exporter>.npz (the batch).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

OPSET = 18
BATCH = 4
TORCH_EXPORTERS = ("dynamo", "torchscript")
# Both torch exporters fold BatchNorm into the convolutions by default; dynamo keeps it when
# its graph optimizer is off, which is how a CNN exports for training with batch statistics.
KEEP_BATCHNORM = "dynamo_unoptimized"


@dataclass(frozen=True)
class Family:
    """One model of the zoo.

    build: a seeded factory of the model (torch.nn.Module taking the inputs in `inputs` order
        and returning one tensor; for scikit-learn, the ONNX bytes).
    inputs: the fixed batch, name -> array, in the model's argument order.
    loss: "mse" (against a random target) or "cross_entropy" (logits [N, C] vs class indices).
    batchnorm: the model has BatchNorm, so training compares with torch's train mode.
    exporters: which exporters produce it.
    requires: the modules `build` imports beyond torch (the test skips the family without them).
    """

    name: str
    build: Callable[[], object]
    inputs: Callable[[np.random.Generator], dict[str, np.ndarray]]
    loss: str = "mse"
    classes: int = 0
    batchnorm: bool = False
    exporters: tuple[str, ...] = TORCH_EXPORTERS
    output: str = "output"
    notes: str = ""
    requires: tuple[str, ...] = ()


# --- torch models -----------------------------------------------------------------------


def _perturbed(model, seed: int):
    """`model` with every float parameter and buffer nudged by seeded noise, in eval mode."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not tensor.is_floating_point():
                continue
            noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
            if name.endswith("running_var"):
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=generator))
            else:
                tensor.add_(0.05 * noise)
        _distinct([t for t in model.parameters() if t.is_floating_point()])
    return model.eval()


def _distinct(tensors) -> None:
    """Make every value of `tensors` occur once: among tens of thousands of random float32
    numbers a few repeat, and the zoo traces initializers back to parameters by value."""
    import torch

    values = torch.cat([t.detach().reshape(-1) for t in tensors]).numpy().astype(np.float32)
    # float32 bits as integers that order like the floats (-0.0 and 0.0 both 0), so "the next
    # float up" is +1 and one pass can make the sorted sequence strictly increasing: a model
    # with millions of weights holds hundreds of thousands of repeats, and nudging them one
    # float at a time would collide with the neighbours again and again.
    bits = values.view(np.int32).astype(np.int64)
    keys = np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)
    order = np.argsort(keys, kind="stable")
    steps = np.arange(keys.size)
    raised = np.maximum.accumulate(keys[order] - steps) + steps
    keys = np.empty_like(keys)
    keys[order] = raised
    bits = np.where(keys < 0, (-keys) | 0x80000000, keys)
    values = bits.astype(np.uint32).view(np.float32)
    start = 0
    for tensor in tensors:
        tensor.copy_(torch.from_numpy(values[start:start + tensor.numel()].copy()).reshape(tensor.shape))
        start += tensor.numel()


def _single(model, key: str, names: tuple[str, ...]):
    """A transformers model as a module whose forward(*inputs) returns its output `key` alone."""
    import torch

    class Single(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            return getattr(self.model(**dict(zip(names, args))), key)

    return Single()


def _tokens(rng: np.random.Generator, length: int = 8) -> dict[str, np.ndarray]:
    ids = rng.integers(3, 100, size=(BATCH, length)).astype(np.int64)
    mask = np.ones((BATCH, length), np.int64)
    mask[0, -2:] = 0  # one padded row, so the mask matters
    return {"input_ids": ids, "attention_mask": mask}


def _bert():
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return _single(BertModel(config, add_pooling_layer=False), "last_hidden_state",
                        ("input_ids", "attention_mask"))


def _distilbert():
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                              max_position_embeddings=32, dropout=0.0, attention_dropout=0.0)
    return _single(DistilBertModel(config), "last_hidden_state", ("input_ids", "attention_mask"))


def _roberta():
    from transformers import RobertaConfig, RobertaModel

    config = RobertaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=40, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, pad_token_id=1)
    return _single(RobertaModel(config, add_pooling_layer=False), "last_hidden_state",
                        ("input_ids", "attention_mask"))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return _single(GPT2LMHeadModel(config), "logits", ("input_ids", "attention_mask"))


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    # Eager attention: the dynamo exporter cannot decompose T5's SDPA path (a view of a
    # transposed tensor), so the default attention does not export at all.
    config = T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                      dropout_rate=0.0, decoder_start_token_id=0, use_cache=False, attn_implementation="eager")
    return _single(T5ForConditionalGeneration(config), "logits",
                        ("input_ids", "attention_mask", "decoder_input_ids"))


def _t5_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {**_tokens(rng), "decoder_input_ids": rng.integers(3, 100, size=(BATCH, 6)).astype(np.int64)}


def _vit():
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    return _single(ViTForImageClassification(config), "logits", ("pixel_values",))


def _wav2vec2():
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    config = Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                            conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), conv_bias=True,
                            num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
                            feat_extract_norm="group", hidden_dropout=0.0, attention_dropout=0.0,
                            activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
                            mask_time_prob=0.0, apply_spec_augment=False)
    return _single(Wav2Vec2Model(config), "last_hidden_state", ("input_values",))


def _recurrent(kind: str):
    import torch

    class Recurrent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = getattr(torch.nn, kind)(8, 16, batch_first=True)
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.rnn(x)[0])

    return Recurrent()


def _conv1d():
    from torch import nn

    return nn.Sequential(nn.Conv1d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv1d(8, 8, 3, stride=2), nn.ReLU(),
                         nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(8, 3))


def _autoencoder():
    from torch import nn

    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 8), nn.ReLU(),
                         nn.Linear(8, 16))


def _resnet():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, channels: int):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
            self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(x + self.bn2(self.conv2(y)))

    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), Block(8),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def _mobilenet():
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.Hardswish(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8), nn.Hardswish(),
        nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))


# --- torchvision and timm: their own module code, tiny configurations ---------------------
# Dropout and stochastic depth keep the probabilities the full-size models have: exports are
# made in eval mode, and the zoo's torch oracle puts only BatchNorm in train mode.


def _tv_resnet():
    from torchvision.models.resnet import BasicBlock, ResNet

    # ResNet-18's blocks and widths with one block per stage instead of two: the full model's
    # eleven million weights made its row the slowest of the zoo by far.
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=5)


def _tv_mobilenet_v3():
    from torchvision.models.mobilenetv3 import MobileNetV3, _mobilenet_v3_conf

    # MobileNetV3-Small's first four blocks: squeeze-excitation with ReLU and with hardswish,
    # a residual block, kernels 3 and 5. The whole net costs CI minutes and adds no new op.
    setting, _ = _mobilenet_v3_conf("mobilenet_v3_small", width_mult=0.25)
    return MobileNetV3(setting[:4], last_channel=64, num_classes=5)


def _tv_efficientnet():
    from functools import partial

    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    # EfficientNet-B0's first three stages (expand ratio, kernel, stride, in, out, layers).
    stage = partial(MBConvConfig, width_mult=0.25, depth_mult=1.0)
    setting = [stage(1, 3, 1, 32, 16, 1), stage(6, 3, 2, 16, 24, 2), stage(6, 5, 2, 24, 40, 2)]
    return EfficientNet(setting, dropout=0.2, stochastic_depth_prob=0.2, num_classes=5)


def _tv_squeezenet():
    from torchvision.models import squeezenet1_1

    return squeezenet1_1(num_classes=5)


def _tv_shufflenet_v2():
    from torchvision.models.shufflenetv2 import ShuffleNetV2

    # Two units in the first stage, so a stride-1 unit (channel split, then shuffle) is there too.
    return ShuffleNetV2(stages_repeats=[2, 1, 1], stages_out_channels=[8, 16, 32, 64, 128], num_classes=5)


def _tv_regnet_y():
    from torchvision.models.regnet import BlockParams, RegNet

    # RegNetY's design space (grouped bottlenecks with squeeze-excitation) in three stages of
    # widths 8, 16, 32 and depths 1, 1, 2.
    params = BlockParams.from_init_params(depth=4, w_0=8, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25)
    return RegNet(params, num_classes=5, stem_width=16)


def _tv_convnext():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    # ConvNeXt-T's stochastic depth and layer scale, three narrow stages of one block each.
    setting = [CNBlockConfig(16, 32, 1), CNBlockConfig(32, 64, 1), CNBlockConfig(64, None, 1)]
    return ConvNeXt(setting, stochastic_depth_prob=0.1, layer_scale=1e-6, num_classes=5)


def _timm_vit():
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             num_classes=5)


def _normal(name: str, *shape: int) -> Callable[[np.random.Generator], dict[str, np.ndarray]]:
    return lambda rng: {name: rng.normal(size=shape).astype(np.float32)}


# --- scikit-learn pipelines ---------------------------------------------------------------


def _sklearn_data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(1.0, 2.0, size=(64, 6)).astype(np.float32)
    classes = (x[:, 0] + x[:, 1] > 2).astype(np.int64) + (x[:, 2] > 2)
    target = (x @ rng.normal(size=6) + 0.3).astype(np.float32)
    return x, classes, target


def _sklearn(kind: str, onnx_ops: bool) -> Callable[[], bytes]:
    """A fitted StandardScaler + estimator pipeline as skl2onnx converts it. onnx_ops: convert
    with standard ONNX ops (skl2onnx's black_op), which store the coefficients as initializers;
    the default ai.onnx.ml ops keep them in attributes, which nothing can train."""

    def build() -> bytes:
        from skl2onnx import to_onnx
        from sklearn.linear_model import LinearRegression, LogisticRegression
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        x, classes, target = _sklearn_data()
        if kind == "logistic":
            pipeline = make_pipeline(StandardScaler(), LogisticRegression()).fit(x, classes)
            options = {id(pipeline.steps[-1][1]): {"zipmap": False}}
            blocked = {"Scaler", "LinearClassifier"}
        else:
            pipeline = make_pipeline(StandardScaler(), LinearRegression()).fit(x, target)
            options, blocked = None, {"Scaler", "LinearRegressor"}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = to_onnx(pipeline, x[:1], options=options, target_opset={"": OPSET, "ai.onnx.ml": 3},
                            black_op=blocked if onnx_ops else None)
        return model.SerializeToString()

    return build


def _sklearn_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"X": _sklearn_data()[0][:16]}


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("bert", _bert, _tokens, requires=("transformers",)),
    Family("distilbert", _distilbert, _tokens, requires=("transformers",)),
    Family("roberta", _roberta, _tokens, requires=("transformers",)),
    Family("gpt2", _gpt2, _tokens, requires=("transformers",)),
    Family("t5", _t5, _t5_inputs, notes="encoder-decoder; the loss reads the LM logits",
           requires=("transformers",)),
    Family("vit", _vit, _normal("pixel_values", BATCH, 3, 16, 16), loss="cross_entropy", classes=5,
           requires=("transformers",)),
    Family("wav2vec2", _wav2vec2, _normal("input_values", BATCH, 400), requires=("transformers",)),
    Family("lstm", lambda: _recurrent("LSTM"), _normal("x", BATCH, 5, 8)),
    Family("gru", lambda: _recurrent("GRU"), _normal("x", BATCH, 5, 8)),
    Family("conv1d", _conv1d, _normal("x", BATCH, 4, 16), loss="cross_entropy", classes=3),
    Family("autoencoder", _autoencoder, _normal("x", BATCH, 16)),
    Family("resnet", _resnet, _normal("x", BATCH, 3, 12, 12), loss="cross_entropy", classes=5, batchnorm=True,
           exporters=(*TORCH_EXPORTERS, KEEP_BATCHNORM)),
    Family("mobilenet", _mobilenet, _normal("x", BATCH, 3, 12, 12), loss="cross_entropy", classes=5,
           batchnorm=True, exporters=(*TORCH_EXPORTERS, KEEP_BATCHNORM)),
    *[Family(name, build, _normal("x", BATCH, 3, 32, 32), loss="cross_entropy", classes=5, batchnorm=True,
             exporters=(*TORCH_EXPORTERS, KEEP_BATCHNORM), requires=("torchvision",))
      for name, build in [("tv_resnet", _tv_resnet), ("tv_mobilenet_v3", _tv_mobilenet_v3),
                          ("tv_efficientnet", _tv_efficientnet), ("tv_shufflenet_v2", _tv_shufflenet_v2),
                          ("tv_regnet_y", _tv_regnet_y)]],
    Family("tv_squeezenet", _tv_squeezenet, _normal("x", BATCH, 3, 32, 32), loss="cross_entropy", classes=5,
           requires=("torchvision",)),
    Family("tv_convnext", _tv_convnext, _normal("x", BATCH, 3, 32, 32), loss="cross_entropy", classes=5,
           requires=("torchvision",)),
    Family("timm_vit", _timm_vit, _normal("x", BATCH, 3, 32, 32), loss="cross_entropy", classes=5,
           requires=("timm",)),
    Family("sk_logistic_ml", _sklearn("logistic", False), _sklearn_inputs, exporters=("skl2onnx",),
           output="probabilities", notes="ai.onnx.ml ops: coefficients are attributes, nothing to train"),
    Family("sk_logistic", _sklearn("logistic", True), _sklearn_inputs, exporters=("skl2onnx",),
           output="probabilities", notes="standard ops; mse of the probabilities against one-hot labels"),
    Family("sk_linear", _sklearn("linear", True), _sklearn_inputs, exporters=("skl2onnx",), output="variable"),
]}


def cases() -> list[tuple[str, str]]:
    """Every (family, exporter) pair of the zoo, in a stable order."""
    return [(family.name, exporter) for family in FAMILIES.values() for exporter in family.exporters]


def torch_model(family: Family, seed: int = 0):
    """The family's torch model (seeded, perturbed, eval mode)."""
    import torch

    torch.manual_seed(seed)
    return _perturbed(family.build(), seed + 1)


def batch(family: Family, seed: int = 0) -> dict[str, np.ndarray]:
    """The family's fixed batch: its inputs and (as "labels") the loss's target."""
    return family.inputs(np.random.default_rng(seed))


def export_torch(model, inputs: dict[str, np.ndarray], exporter: str, output: str) -> bytes:
    """`model` (eval mode) exported by one torch exporter, with its defaults (KEEP_BATCHNORM:
    dynamo with optimize=False)."""
    import torch

    args = tuple(torch.from_numpy(v) for v in inputs.values())
    buffer = io.BytesIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if exporter in ("dynamo", KEEP_BATCHNORM):
            program = torch.onnx.export(model, args, dynamo=True, input_names=list(inputs),
                                        output_names=[output], opset_version=OPSET, verbose=False,
                                        optimize=exporter == "dynamo")
            program.save(buffer)
        else:
            torch.onnx.export(model, args, buffer, dynamo=False, input_names=list(inputs),
                              output_names=[output], opset_version=OPSET)
    return buffer.getvalue()


def export(name: str, exporter: str) -> bytes:
    """The ONNX bytes of family `name` as `exporter` writes them."""
    family = FAMILIES[name]
    if exporter not in family.exporters:
        raise ValueError(f"{name} is not exported by {exporter} (only {family.exporters})")
    if exporter == "skl2onnx":
        return family.build()
    return export_torch(torch_model(family), batch(family), exporter, family.output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write <family>-<exporter>.onnx/.npz into")
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="default: all")
    parser.add_argument("--exporter", action="append", choices=[*TORCH_EXPORTERS, KEEP_BATCHNORM, "skl2onnx"])
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    for name, exporter in cases():
        if (options.family and name not in options.family) or (options.exporter and exporter not in options.exporter):
            continue
        path = options.out / f"{name}-{exporter}.onnx"
        path.write_bytes(export(name, exporter))
        np.savez(path.with_suffix(".npz"), **batch(FAMILIES[name]))
        print(f"{path}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
