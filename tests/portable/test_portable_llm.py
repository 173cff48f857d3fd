"""The portable step of a LoRA fine-tune on KV-cache exports of a causal LM (optimum-cli, and
dynamo over a flat cache): traced at a real batch (given, or the last one a step ran), the
step model trains in stock onnxruntime with onnxtrain's losses. Invented feeds break these
models' own relations between inputs, which the error says how to avoid.

Oracle: onnxtrain's own steps on the same batches, run by examples/portable_ort.py in
onnxruntime.
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest

import onnxtrain
from support import llm_exports
from support.paths import REPO

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")
sys.path.insert(0, str(REPO / "examples"))
from portable_ort import train  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::onnxtrain.ExportDamageWarning")]
STEPS = 5


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return llm_exports.exporter(tmp_path_factory.mktemp("qwen2"))


def lora_trainer(path) -> onnxtrain.Trainer:
    return onnxtrain.Trainer(onnxtrain.make_training_model(
        str(path), loss="causal_lm", adapters=onnxtrain.LoRA(4, 8, targets=["o_proj", "v_proj"]),
        optimizer=onnxtrain.optim.Adam(1e-2)))


def batches(route: str, path) -> list[dict[str, np.ndarray]]:
    model, rng = onnx.load(str(path), load_external_data=False), np.random.default_rng(0)
    return [llm_exports.feeds(route, model, rng) for _ in range(STEPS)]


@pytest.mark.parametrize("route", ["optimum", "dynamo_kv"])
def test_the_step_model_trains_in_onnxruntime_as_onnxtrain_does(exported, route, tmp_path):
    path, data = exported(route), batches(route, exported(route))
    lora_trainer(path).export(tmp_path / "step.onnx", portable="step", example_feeds=data[0])
    ours = lora_trainer(path)
    expected = [float(ours.step(feeds)["loss"]) for feeds in data]
    np.savez(tmp_path / "batches.npz", **{f"{i}/{name}": value for i, feeds in enumerate(data)
                                          for name, value in feeds.items()})
    losses = train(str(tmp_path / "step.onnx"), str(tmp_path / "batches.npz"), str(tmp_path / "out.npz"), STEPS)
    assert len(set(expected)) == STEPS   # the batches and the steps differ
    np.testing.assert_allclose(losses, expected, rtol=1e-5)


def test_without_a_batch_the_error_says_how_to_give_one_and_a_step_gives_it(exported, tmp_path):
    path, data = exported("optimum"), batches("optimum", exported("optimum"))
    trainer = lora_trainer(path)
    with pytest.raises(onnxtrain.ExportError, match=r"example_feeds=batch\), or run a step first"):
        trainer.export(tmp_path / "step.onnx", portable="step")
    trainer.step(data[0])
    trainer.export(tmp_path / "step.onnx", portable="step")   # at the batch the step ran
    assert (tmp_path / "step.onnx").stat().st_size > 0


def test_example_feeds_are_checked_like_a_step_s(exported, tmp_path):
    path = exported("optimum")
    with pytest.raises(onnxtrain.InputError, match="labels"):
        lora_trainer(path).export(tmp_path / "step.onnx", portable="step",
                                  example_feeds={"input_ids": np.zeros((2, 4), np.int64)})
