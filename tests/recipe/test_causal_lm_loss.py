"""loss="causal_lm": a GPT-2 language model exported as it is (logits [batch, length, vocab])
trains on next-token prediction with the input ids as labels, as Hugging Face computes it.

Oracle: transformers' own loss (model(input_ids, labels=...).loss, which shifts the labels
inside) and torch autograd of it, on the same weights.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import pytest

import onnxtrain
from onnxtrain import optim
from support.gradient_outputs import with_gradients

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::onnxtrain.ExportDamageWarning")]

VOCAB, BATCH, LENGTH = 50, 2, 6


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, input_ids):
        return self.m(input_ids=input_ids, use_cache=False, return_dict=False)[0]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    config._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    path = tmp_path_factory.mktemp("gpt2") / "model.onnx"
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(_Logits(model), (ids,), str(path), dynamo=True, input_names=["input_ids"],
                          output_names=["logits"])
    return model, ids, path


def _labels(ids: torch.Tensor) -> torch.Tensor:
    """The input ids with the last two positions of the first row as padding (-100)."""
    labels = ids.clone()
    labels[0, -2:] = -100
    return labels


def test_loss_and_gradients_equal_transformers_own(exported):
    model, ids, path = exported
    labels = _labels(ids)
    expected = model(input_ids=ids, labels=labels, use_cache=False)
    expected.loss.backward()
    training = onnxtrain.make_training_model(path, loss="causal_lm",
                                             optimizer=optim.SGD(lr=0.0))
    trainer = with_gradients(training)
    out = trainer.step({"input_ids": ids.numpy(), "labels": labels.numpy()})
    np.testing.assert_allclose(float(out["loss"]), expected.loss.item(), rtol=1e-5)
    # The attention projection: a weight the export stores as torch holds it ([in, out]).
    torch_gradient = model.transformer.h[0].attn.c_attn.weight.grad.numpy()
    got = np.asarray(out["m.transformer.h.0.attn.c_attn.weight.grad"])
    assert np.max(np.abs(got - torch_gradient)) <= 1e-5 * np.max(np.abs(torch_gradient))
    evaluated = trainer.evaluate({"input_ids": ids.numpy(), "labels": labels.numpy()})
    np.testing.assert_allclose(float(evaluated["loss"]), expected.loss.item(), rtol=1e-5)


def test_the_loss_falls_and_a_token_past_the_vocabulary_is_refused(exported):
    _, ids, path = exported
    trainer = onnxtrain.Trainer(onnxtrain.make_training_model(path, loss="causal_lm",
                                                              optimizer=optim.Adam(lr=1e-2)))
    batch = {"input_ids": ids.numpy(), "labels": ids.numpy()}
    losses = [float(trainer.step(batch)["loss"]) for _ in range(15)]
    assert losses[-1] < 0.7 * losses[0], losses
    wrong = ids.numpy().copy()
    wrong[1, 3] = VOCAB
    with pytest.raises(onnxtrain.InputError, match=rf"label {VOCAB} at index \[1, 3\].*0\.\.{VOCAB - 1}"):
        trainer.step({"input_ids": ids.numpy(), "labels": wrong})


def test_causal_lm_refuses_an_output_that_is_not_logits_by_position(exported):
    from onnxtrain.proto import GraphProto, ModelProto, TensorProto
    from onnxtrain.proto.make import node, opset, tensor_value_info
    from onnxtrain.translate.tensors import numpy_to_tensor

    graph = GraphProto(name="classifier", node=[node("MatMul", ["x", "w"], ["scores"])],
                       initializer=[numpy_to_tensor(np.ones((3, 4), np.float32), "w")],
                       input=[tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
                       output=[tensor_value_info("scores", TensorProto.FLOAT, ["n", 4])])
    model = ModelProto(ir_version=8, graph=graph, opset_import=[opset("", 17)])
    with pytest.raises(onnxtrain.BindingError, match="causal_lm.*rank 2.*cross_entropy"):
        onnxtrain.make_training_model(model, loss="causal_lm")
