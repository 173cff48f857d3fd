"""LoRA on tiny transformers exported by torch.onnx (dynamo): GPT-2 and Llama language models,
and the default targets of a BERT classifier.

Oracles: the same LoRA written in PyTorch on the same weights (forward hooks adding
s·(x·A)·B to each adapted module's output, A and B copied from the ONNX initializers) for the
first-step gradients; ONNX Runtime for the exports.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnxtrain
from onnxtrain import optim
from onnxtrain._recipe.lora import read_record
from support.gradient_outputs import with_gradients

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

# The exports' damage (tied or merged weights, a fixed batch) concerns weights LoRA keeps frozen.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::onnxtrain.ExportDamageWarning")]

VOCAB, HIDDEN, BATCH, LENGTH = 100, 32, 2, 8
RANK, ALPHA = 4, 8.0


class _Logits(torch.nn.Module):
    """logits as [batch, vocab, length]: the class axis second, as cross_entropy takes them."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, input_ids):
        return self.m(input_ids=input_ids, use_cache=False, return_dict=False)[0].transpose(1, 2)


def _language_model(family: str):
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(config)
    config._attn_implementation = "eager"
    return _Logits(model.eval())


def _export(module, args, path, names):
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), dynamo=True, input_names=names, output_names=["logits"])
    return path


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def exported(request, tmp_path_factory):
    module = _language_model(request.param)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    path = _export(module, (ids,), tmp_path_factory.mktemp(request.param) / "model.onnx", ["input_ids"])
    return request.param, module, ids.numpy(), path


def _torch_lora(module, base: onnx.ModelProto, record, factors):
    """Forward hooks adding s·(x·A)·B to the module owning each adapted weight (found by value:
    the weights are random, so a value identifies its parameter whatever its layout)."""
    values = {t.name: numpy_helper.to_array(t) for t in base.graph.initializer}
    params = dict(module.named_parameters())
    tensors, handles = {}, []
    for weight, entry in record["weights"].items():
        value = values[weight]
        owner = next(name for name, p in params.items()
                     if p.dim() == 2 and (tuple(p.shape) == value.shape and np.array_equal(p.detach().numpy(), value)
                                          or tuple(p.shape) == value.T.shape
                                          and np.array_equal(p.detach().numpy(), value.T)))
        a, b = (torch.tensor(v, requires_grad=True) for v in factors[weight])
        tensors[entry["A"]], tensors[entry["B"]] = a, b
        submodule = module.get_submodule(owner.rsplit(".", 1)[0])
        handles.append(submodule.register_forward_hook(
            lambda _, inputs, output, a=a, b=b: output + (ALPHA / RANK) * (inputs[0] @ a) @ b))
    return tensors, handles


def test_first_step_gradients_match_torch_lora(exported):
    family, module, ids, path = exported
    base = onnx.load(path)
    training = onnxtrain.make_training_model(str(path), loss="cross_entropy", optimizer="sgd",
                                             adapters=onnxtrain.LoRA(RANK, ALPHA))
    record = read_record(training)
    assert len(record["weights"]) == (8 if family == "gpt2" else 14)   # attention and MLP, no head
    trainer = with_gradients(training)
    rng = np.random.default_rng(0)
    factors = {}
    for weight, entry in record["weights"].items():
        b = (0.1 * rng.normal(size=trainer.get_state(entry["B"]).shape)).astype(np.float32)
        trainer.set_state(entry["B"], b)
        factors[weight] = (trainer.get_state(entry["A"]), b)
    labels = rng.integers(0, VOCAB, size=(BATCH, LENGTH))
    out = trainer.step({"input_ids": ids, "labels": labels})
    tensors, handles = _torch_lora(module, base, record, factors)
    try:
        logits = module(torch.tensor(ids))
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(labels))
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    assert abs(float(out["loss"]) - loss.item()) <= 1e-5 * loss.item()
    largest = max(float(t.grad.abs().max()) for t in tensors.values())
    worst = max(float(np.max(np.abs(np.asarray(out[f"{name}.grad"]) - t.grad.numpy()))) for name, t in tensors.items())
    print(f"\n{family}: {len(tensors)} factors, worst gradient error {worst / largest:.2e} of the largest")
    assert worst <= 1e-5 * largest


def test_loss_falls_and_exports_match_onnxruntime(exported, tmp_path):
    family, _, ids, path = exported
    training = onnxtrain.make_training_model(str(path), loss="cross_entropy", optimizer=optim.Adam(lr=1e-2),
                                             adapters=onnxtrain.LoRA(RANK, ALPHA))
    trainer = onnxtrain.Trainer(training)
    # Next token on a fixed batch (the last position predicts the first token).
    feeds = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1)}
    losses = [float(trainer.step(feeds)["loss"]) for _ in range(30)]
    print(f"\n{family}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps")
    assert losses[-1] < 0.9 * losses[0]

    expected = np.asarray(trainer.infer({"input_ids": ids})["logits"])
    trainer.export(tmp_path / "merged.onnx", training=False)
    session = ort.InferenceSession(str(tmp_path / "merged.onnx"), providers=["CPUExecutionProvider"])
    merged = session.run(None, {"input_ids": ids})[0]
    merged_error = float(np.max(np.abs(merged - expected)))
    trainer.export(tmp_path / "branch.onnx", training=False, merge=False)
    session = ort.InferenceSession(str(tmp_path / "branch.onnx"), providers=["CPUExecutionProvider"])
    branch_error = float(np.max(np.abs(session.run(None, {"input_ids": ids})[0] - expected)))
    print(f"{family}: onnxruntime vs infer: merged {merged_error:.2e}, with branch {branch_error:.2e}")
    assert merged_error <= 1e-4 and branch_error <= 1e-4

    reapplied = onnxtrain.apply_adapters(str(path), tmp_path / "branch.adapter.onnx")
    written = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "merged.onnx").graph.initializer}
    again = {t.name: numpy_helper.to_array(onnx.TensorProto.FromString(t.SerializeToString()))
             for t in reapplied.graph.initializer}
    assert written.keys() == again.keys()
    for name, value in written.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)


def test_default_targets_of_a_bert_classifier_skip_embeddings_and_head(tmp_path):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=2 * HIDDEN, max_position_embeddings=64, num_labels=3)
    model = transformers.BertForSequenceClassification(config).eval()

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids):
            return self.m(input_ids=input_ids, return_dict=False)[0]

    ids = torch.randint(0, VOCAB, (BATCH, LENGTH))
    path = _export(Classifier(), (ids,), tmp_path / "bert.onnx", ["input_ids"])
    training = onnxtrain.make_training_model(str(path), loss="cross_entropy", adapters=onnxtrain.LoRA(RANK, ALPHA))
    record = read_record(training)
    params = {name: p.detach().numpy() for name, p in model.named_parameters()}
    values = {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}

    def owner(weight):
        value = values[weight]
        return next(name for name, p in params.items()
                    if p.shape == value.shape and np.array_equal(p, value)
                    or p.shape == value.T.shape and np.array_equal(p, value.T))

    adapted = sorted(owner(w) for w in record["weights"])
    expected = sorted(name for name, p in params.items() if p.ndim == 2 and "embeddings" not in name
                      and "classifier" not in name)
    assert adapted == expected
    assert len(adapted) == 13   # q, k, v, attention output, intermediate, output per layer; the pooler


def test_finetune_with_lora_learns_and_exports_what_onnxruntime_serves(exported, tmp_path):
    optax = pytest.importorskip("optax")
    family, _, ids, path = exported
    tuner = onnxtrain.finetune(str(path), "cross_entropy", optax.adam(1e-2), adapters=onnxtrain.LoRA(RANK, ALPHA))
    assert len(tuner.state_names) == (16 if family == "gpt2" else 28)
    assert all(name.endswith((".lora_A", ".lora_B")) for name in tuner.state_names)
    feeds = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1)}
    losses = [float(tuner.step(feeds)["loss"]) for _ in range(30)]
    print(f"\n{family} (finetune, optax): loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps")
    assert losses[-1] < 0.9 * losses[0]
    tuner.export(tmp_path / "merged.onnx")
    session = ort.InferenceSession(str(tmp_path / "merged.onnx"), providers=["CPUExecutionProvider"])
    error = float(np.max(np.abs(session.run(None, {"input_ids": ids})[0]
                                - np.asarray(tuner.infer({"input_ids": ids})["logits"]))))
    print(f"{family} (finetune): onnxruntime vs infer, merged: {error:.2e}")
    assert error <= 1e-4
