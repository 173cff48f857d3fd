"""Export damage: detection and repairs on real torch exports, checked against the undamaged model.

Oracles: torch itself (autograd in train mode of a torch model built to match a repaired
export, eval-mode outputs at other batch sizes), onnxruntime on the damaged export, and the
export torch writes when told to keep what the default export damages (optimize=False).
"""

from __future__ import annotations

import functools
import io
import warnings
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, numpy_helper

import onnxtrain
from onnxtrain import BindingError, optim
from onnxtrain._io.model import load_model
from onnxtrain._recipe import damage
from onnxtrain._recipe.damage import ExportDamageWarning
from support.gradient_outputs import with_gradients

torch = pytest.importorskip("torch")
nn = torch.nn

BATCH = 4


def _kinds(model) -> set[str]:
    return {finding.kind for finding in damage.detect(load_model(model))}


def _export(module, args, **options) -> bytes:
    """`module` exported by torch.onnx in eval mode, as bytes (dynamo writes weights inline here)."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), args, buffer, **options)
    return buffer.getvalue()


def _damage_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, ExportDamageWarning)]


def _close(actual, expected, rtol=1e-5):
    """Relative to the tensor's largest magnitude, as gradient comparisons need."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    assert np.max(np.abs(actual - expected)) <= rtol * np.max(np.abs(expected)) + 1e-7


# --- a ResNet-like CNN: BatchNorm folded by default, kept with optimize=False -----------------

class _Block(nn.Module):
    def __init__(self, channels: int, batchnorm: bool):
        super().__init__()
        self.c1 = nn.Conv2d(channels, channels, 3, padding=1, bias=not batchnorm)
        self.b1 = nn.BatchNorm2d(channels) if batchnorm else nn.Identity()
        self.c2 = nn.Conv2d(channels, channels, 3, padding=1, bias=not batchnorm)
        self.b2 = nn.BatchNorm2d(channels) if batchnorm else nn.Identity()

    def forward(self, x):
        return torch.relu(x + self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))


class _ResNet(nn.Module):
    """conv-BN-ReLU stem, one residual block, global pooling, a linear classifier."""

    def __init__(self, batchnorm: bool = True):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1, bias=not batchnorm)
        self.bn = nn.BatchNorm2d(4) if batchnorm else nn.Identity()
        self.block = _Block(4, batchnorm)
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(self.block(torch.relu(self.bn(self.stem(x)))).mean((2, 3)))


@functools.cache
def _cnn_exports() -> tuple[bytes, bytes, np.ndarray]:
    """(dynamo default export: BN folded, optimize=False export: BN kept, an input batch)."""
    torch.manual_seed(0)
    model = _ResNet()
    with torch.no_grad():  # statistics and affine parameters as training leaves them
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    x = torch.randn(BATCH, 3, 8, 8)
    return (_export(model, (x,), dynamo=True), _export(model, (x,), dynamo=True, optimize=False), x.numpy())


@pytest.mark.slow
def test_folded_batchnorm_is_found_in_the_default_export_only():
    folded, kept, _ = _cnn_exports()
    assert not any(n.op_type == "BatchNormalization" for n in load_model(folded).graph.node)
    assert "folded_batchnorm" in _kinds(folded)
    assert "folded_batchnorm" not in _kinds(kept)
    with pytest.warns(ExportDamageWarning, match="BatchNorm looks folded") as record:
        onnxtrain.make_training_model(folded, loss="cross_entropy")
    assert len(_damage_warnings(record)) == 1   # one warning per model, every finding in it
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        onnxtrain.make_training_model(kept, loss="cross_entropy", repair={"relax_batch"})
    assert not _damage_warnings(record)


def _repaired_reference(folded: bytes):
    """The torch model the BatchNorm repair stands for, in train mode: bias-free convolutions with
    the folded weights, each followed by a BatchNorm that starts as the identity, shifted by the
    folded bias. Returns (model, its (conv, BatchNorm) pairs, the export's Conv nodes, in order)."""
    values = {t.name: numpy_helper.to_array(t) for t in load_model(folded).graph.initializer}
    convs = [n for n in load_model(folded).graph.node if n.op_type == "Conv"]
    reference = _ResNet().train()
    pairs = [(reference.stem, reference.bn), (reference.block.c1, reference.block.b1),
             (reference.block.c2, reference.block.b2)]
    with torch.no_grad():
        for conv, (torch_conv, torch_bn) in zip(convs, pairs):
            torch_conv.weight.copy_(torch.tensor(values[conv.input[1]]))
            torch_bn.bias.copy_(torch.tensor(values[conv.input[2]]) if len(conv.input) > 2
                                else torch.zeros(4))
            torch_bn.running_var.fill_(1 - 1e-5)
        reference.fc.weight.copy_(torch.tensor(values["fc.weight"]))
        reference.fc.bias.copy_(torch.tensor(values["fc.bias"]))
    return reference, pairs, convs


@pytest.mark.slow
def test_inserted_batchnorm_keeps_inference_and_trains_on_batch_statistics():
    import onnxruntime

    folded, _, x = _cnn_exports()
    labels = np.arange(BATCH, dtype=np.int64) % 5
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportDamageWarning)
        training = onnxtrain.make_training_model(folded, loss="cross_entropy", optimizer=optim.SGD(lr=0.1),
                                                 repair={"insert_batchnorm", "relax_batch"})
    graph = training.graph
    assert [n.op_type for n in graph.node].count("BatchNormalization") == 3
    trainer = with_gradients(training)
    session = onnxruntime.InferenceSession(folded, providers=["CPUExecutionProvider"])
    (served,) = session.run(None, {"x": x})
    np.testing.assert_allclose(trainer.infer({"x": x})[graph.output[0].name], served, rtol=1e-5, atol=1e-5)

    reference, pairs, convs = _repaired_reference(folded)
    loss = nn.functional.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(labels))
    loss.backward()

    out = trainer.step({"x": x, "labels": labels})
    np.testing.assert_allclose(out["loss"], loss.item(), rtol=1e-5)
    expected = {"fc.weight": reference.fc.weight.grad, "fc.bias": reference.fc.bias.grad}
    for conv, (torch_conv, torch_bn) in zip(convs, pairs):
        prefix = conv.input[1].removesuffix(".weight")
        expected[conv.input[1]] = torch_conv.weight.grad
        expected[f"{prefix}.bn.weight"] = torch_bn.weight.grad
        expected[f"{prefix}.bn.bias"] = torch_bn.bias.grad
    assert {name[:-len(".grad")] for name in out if name.endswith(".grad")} == set(expected)
    for name, gradient in expected.items():
        _close(out[f"{name}.grad"], gradient.numpy())
    # Batch statistics apply: the unrepaired model's loss is a different number.
    with pytest.warns(ExportDamageWarning):
        unrepaired = onnxtrain.Trainer(onnxtrain.make_training_model(folded, loss="cross_entropy"))
    assert abs(float(unrepaired.evaluate({"x": x, "labels": labels})["loss"]) - loss.item()) > 1e-3


@pytest.mark.slow
def test_finetune_repairs_and_warns_as_make_training_model_does():
    optax = pytest.importorskip("optax")
    folded, _, x = _cnn_exports()
    labels = np.arange(BATCH, dtype=np.int64) % 5
    # Each warning names the line that called onnxtrain, not a line inside it.
    with pytest.warns(ExportDamageWarning, match="BatchNorm looks folded") as record:
        onnxtrain.finetune(folded, "cross_entropy", optax.sgd(0.1))
        onnxtrain.FineTuner(folded, "cross_entropy", optax.sgd(0.1))
        onnxtrain.make_training_model(folded, loss="cross_entropy")
    assert [Path(w.filename).name for w in record] == [Path(__file__).name] * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportDamageWarning)
        tuner = onnxtrain.finetune(folded, "cross_entropy", optax.sgd(0.1), repair="all")
    reference, _, _ = _repaired_reference(folded)
    expected = nn.functional.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(labels))
    np.testing.assert_allclose(float(tuner.step({"x": x, "labels": labels})["loss"]), expected.item(), rtol=1e-5)
    (served,) = tuner.infer({"x": np.concatenate([x, x])}).values()   # the batch size is free now
    assert served.shape == (2 * BATCH, 5)


# --- T5's tied embedding, stored twice by the TorchScript exporter ----------------------------

@functools.cache
def _t5() -> tuple[object, bytes, np.ndarray, np.ndarray]:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, tie_word_embeddings=True, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.t5 = transformers.T5ForConditionalGeneration(config)

        def forward(self, ids, decoder_ids):
            return self.t5(input_ids=ids, decoder_input_ids=decoder_ids).logits

    model = Logits().eval()
    ids, decoder_ids = torch.randint(1, 100, (2, 5)), torch.randint(1, 100, (2, 4))
    exported = _export(model, (ids, decoder_ids), dynamo=False, input_names=["ids", "decoder_ids"],
                       output_names=["logits"])
    return model, exported, ids.numpy(), decoder_ids.numpy()


@pytest.mark.slow
def test_retied_t5_embedding_is_one_state_variable_with_the_summed_gradient():
    model, exported, ids, decoder_ids = _t5()
    (pair,) = damage.duplicate_pairs(load_model(exported).graph)
    kept, copy, transposed = pair
    assert kept == "t5.shared.weight" and transposed
    assert {"duplicated_weights", "dropout_removed"} <= _kinds(exported)

    target = np.random.default_rng(0).normal(size=(2, 4, 100)).astype(np.float32)
    logits = model(torch.from_numpy(ids), torch.from_numpy(decoder_ids))
    nn.functional.mse_loss(logits, torch.from_numpy(target)).backward()
    tied_gradient = model.t5.shared.weight.grad.numpy()
    feeds = {"ids": ids, "decoder_ids": decoder_ids, "labels": target}

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        retied = onnxtrain.make_training_model(exported, loss="mse", optimizer=optim.SGD(lr=0.1),
                                               trainable=[kept], repair={"retie", "relax_batch"})
    assert not any("stored twice" in message for message in _damage_warnings(record))
    assert copy not in {t.name for t in retied.graph.initializer}
    trainer = with_gradients(retied)
    assert [name for name in trainer.state_names if name in (kept, copy)] == [kept]
    _close(trainer.step(feeds)[f"{kept}.grad"], tied_gradient)

    # Left untied, the embedding's gradient misses the output projection's share.
    with pytest.warns(ExportDamageWarning, match="stored twice"):
        untied = onnxtrain.make_training_model(exported, loss="mse", optimizer=optim.SGD(lr=0.1),
                                               trainable=[kept, copy])
    gradients = with_gradients(untied).step(feeds)
    np.testing.assert_allclose(gradients[f"{kept}.grad"] + gradients[f"{copy}.grad"].T, tied_gradient,
                               rtol=1e-4, atol=1e-6)
    assert np.max(np.abs(gradients[f"{kept}.grad"] - tied_gradient)) > 1e-3


# --- equal fresh parameters merged into one tensor by both exporters ----------------------------

class _LayerScaled(nn.Module):
    """Two pre-norm residual blocks with ConvNeXt-like layer scales: at initialization their
    LayerNorm scales and shifts, layer scales and one zeroed bias hold equal values."""

    def __init__(self):
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(8), nn.LayerNorm(8)])
        self.linears = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.scales = nn.ParameterList([nn.Parameter(1e-1 * torch.ones(8)) for _ in range(2)])
        with torch.no_grad():
            self.linears[1].bias.zero_()

    def forward(self, x):
        for norm, linear, scale in zip(self.norms, self.linears, self.scales):
            x = x + scale * linear(norm(x))
        return x


@pytest.mark.slow
@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_untied_merged_weights_train_as_the_separate_parameters_they_were(dynamo):
    torch.manual_seed(0)
    module = _LayerScaled()
    x, target = torch.randn(BATCH, 8), torch.randn(BATCH, 8)
    exported = _export(module, (x,), dynamo=dynamo, input_names=["x"])
    merged = damage.merged_weights(load_model(exported).graph)
    assert len(merged) >= 3 and "merged_weights" in _kinds(exported)
    with pytest.warns(ExportDamageWarning, match="merged into one tensor"):
        onnxtrain.make_training_model(exported, loss="mse")
    training = onnxtrain.make_training_model(exported, loss="mse", optimizer=optim.SGD(lr=0.1),
                                             repair={"untie", "relax_batch"})
    assert damage.merged_weights(training.graph) == {}
    out = with_gradients(training).step({"x": x.numpy(), "labels": target.numpy()})
    nn.functional.mse_loss(module.train()(x), target).backward()
    nodes = {op: [n for n in training.graph.node if n.op_type == op] for op in ("LayerNormalization", "Gemm", "Mul")}
    initializers = {t.name for t in training.graph.initializer}
    checked = 0
    for index in range(2):
        norm, gemm = nodes["LayerNormalization"][index], nodes["Gemm"][index]
        pairs = [(norm.input[1], module.norms[index].weight), (norm.input[2], module.norms[index].bias),
                 (gemm.input[1], module.linears[index].weight),
                 (next(name for name in nodes["Mul"][index].input if name in initializers), module.scales[index])]
        if len(gemm.input) > 2:   # dynamo drops the zeroed bias altogether
            pairs.append((gemm.input[2], module.linears[index].bias))
        for name, parameter in pairs:
            _close(out[f"{name}.grad"], parameter.grad.numpy())
            checked += 1
    assert checked >= 8


# --- a fixed batch size (the TorchScript exporter without dynamic_axes) -----------------------

class _Flatten(nn.Module):
    def __init__(self, view: bool):
        super().__init__()
        self.view = view
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        return self.fc(y.view(y.size(0), -1) if self.view else y.flatten(1))


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["torchscript-view", "torchscript-flatten", "dynamo-view"])
def test_relaxed_batch_runs_at_other_sizes_and_matches_the_original(exporter):
    import onnxruntime

    torch.manual_seed(0)
    module = _Flatten(view=exporter.endswith("view")).eval()
    x = torch.randn(BATCH, 3, 8, 8)
    exported = _export(module, (x,), dynamo=exporter.startswith("dynamo"), input_names=["x"])
    assert "fixed_batch" in _kinds(exported)
    with pytest.warns(ExportDamageWarning, match="fixed batch size of 4"):
        onnxtrain.make_training_model(exported, loss="mse")
    training = onnxtrain.make_training_model(exported, loss="mse", optimizer=optim.SGD(lr=0.1),
                                             repair={"relax_batch"})
    assert training.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    trainer = onnxtrain.Trainer(training)
    output = training.graph.output[0].name
    session = onnxruntime.InferenceSession(exported, providers=["CPUExecutionProvider"])
    (served,) = session.run(None, {"x": x.numpy()})
    np.testing.assert_allclose(trainer.infer({"x": x.numpy()})[output], served, rtol=1e-5, atol=1e-6)
    for size in (1, 7):
        other = torch.randn(size, 3, 8, 8)
        with torch.no_grad():
            expected = module(other).numpy()
        np.testing.assert_allclose(trainer.infer({"x": other.numpy()})[output], expected, rtol=1e-5, atol=1e-6)
    for size in (1, 7):
        loss = trainer.step({"x": np.ones((size, 3, 8, 8), np.float32), "labels": np.zeros((size, 5), np.float32)})
        assert np.isfinite(loss["loss"])


def test_a_fixed_batch_meeting_a_short_last_batch_says_what_to_do_and_each_way_works():
    """A DataLoader whose data does not divide into the export's batch size: the error names
    both ways out, and each of them trains."""
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    exported = _export(_Flatten(view=True), (torch.randn(BATCH, 3, 8, 8),), dynamo=True, input_names=["x"])
    data = TensorDataset(torch.randn(2 * BATCH + 1, 3, 8, 8), torch.randn(2 * BATCH + 1, 5))
    loader = DataLoader(data, batch_size=BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportDamageWarning)
        fixed = onnxtrain.Trainer(onnxtrain.make_training_model(exported, loss="mse"))
    before = {name: np.asarray(value) for name, value in fixed.state.items()}
    # The short last batch is known ahead (a DataLoader's settings, whole arrays' rows), so
    # the refusal comes before the first step, not after an epoch's other steps have trained.
    for data in (loader, (data.tensors[0].numpy(), data.tensors[1].numpy())):
        with pytest.raises(onnxtrain.InputError) as error:
            fixed.fit(data, batch_size=None if data is loader else BATCH, verbose=0)
        message = str(error.value)
        assert "ends in a batch of 1 rows" in message and "nothing has trained" in message
        assert f"must have size {BATCH} on axis 0" in message
        assert "repair={'relax_batch'}" in message and "drop_last=True" in message
        assert all(np.array_equal(before[name], value) for name, value in fixed.state.items())
    # So is evaluation data's, which drop_last does not cut.
    with pytest.raises(onnxtrain.InputError, match="eval_data ends in a batch of 1 rows"):
        fixed.fit(loader, drop_last=True, eval_data=loader, verbose=0)
    assert all(np.array_equal(before[name], value) for name, value in fixed.state.items())

    class Totals(onnxtrain.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_epoch_begin(self, epoch):
            self.seen.append(self.params["steps"])

    totals = Totals()
    assert len(fixed.fit(loader, drop_last=True, verbose=0, callbacks=[totals])["step_loss"]) == 2
    assert totals.seen == [2]  # the dropped batch is not counted in the epoch's steps
    relaxed = onnxtrain.Trainer(onnxtrain.make_training_model(exported, loss="mse", repair={"relax_batch"}))
    assert len(relaxed.fit(loader, verbose=0)["step_loss"]) == 3


class _LSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 32, batch_first=True)
        self.fc = nn.Linear(32, 3)

    def forward(self, x):
        return self.fc(self.lstm(x)[0][:, -1])


@functools.cache
def _lstm_export() -> bytes:
    torch.manual_seed(0)
    return _export(_LSTM(), (torch.randn(BATCH, 5, 8),), dynamo=False, input_names=["x"])


@pytest.mark.slow
def test_lstm_zero_states_are_no_folded_weights_and_bake_the_batch_in():
    exported = _lstm_export()
    zero_states = [n for n in load_model(exported).graph.node if n.op_type == "Constant"
                   and n.attribute[0].t.data_type == TensorProto.FLOAT and len(n.attribute[0].t.dims) == 3]
    assert zero_states and all(np.prod(n.attribute[0].t.dims) >= damage.FOLDED_WEIGHT_SIZE for n in zero_states)
    assert "folded_weights" not in _kinds(exported)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        training = onnxtrain.make_training_model(exported, loss="mse", repair="lift_constants")
    assert not any("Constant nodes" in message for message in _damage_warnings(record))
    assert not {n.output[0] for n in zero_states} & set(onnxtrain.Trainer(training).state_names)
    # The zero states are expanded to the exported batch size: relaxing it must refuse, not guess.
    with pytest.raises(BindingError, match="bakes the batch size in"):
        onnxtrain.make_training_model(exported, loss="mse", repair="relax_batch")


# --- the command line ----------------------------------------------------------------------

@pytest.mark.slow
def test_inspect_lists_the_damage(tmp_path: Path, capsys):
    from onnxtrain.cli import main

    folded, _, _ = _cnn_exports()
    (tmp_path / "cnn.onnx").write_bytes(folded)
    (tmp_path / "t5.onnx").write_bytes(_t5()[1])
    assert main(["inspect", str(tmp_path / "cnn.onnx")]) == 0
    printed = capsys.readouterr().out
    assert "warning: BatchNorm looks folded" in printed and "fixed batch size of 4" in printed
    assert "insert_batchnorm" in printed and "optimize=False" in printed
    assert main(["inspect", str(tmp_path / "t5.onnx")]) == 0
    printed = capsys.readouterr().out
    assert "warning: Weights are stored twice" in printed and "note: No Dropout" in printed
