"""Activation recomputation (recompute="blocks" on finetune and Trainer): the same loss and
updates as without it, less scratch memory in the compiled step of a deeper model, and no
extra compilation per call."""

from __future__ import annotations

import numpy as np
import pytest

import onnxtrain
from onnxtrain.errors import InputError
from onnxtrain.translate.recompute import segments
from support.quantized_models import deep_mlp

optax = pytest.importorskip("optax")

LAYERS, WIDTH, BATCH = 24, 64, 256


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((BATCH, WIDTH)).astype(np.float32),
            "labels": rng.standard_normal((BATCH, WIDTH)).astype(np.float32)}


def _temp_bytes(trainer) -> int:
    return trainer.lowered(_batch()).compile().memory_analysis().temp_size_in_bytes


def test_segments_cover_every_node_once_in_order():
    for count in (1, 2, 3, 10, 16, 17, 101):
        parts = segments(count)
        assert [i for part in parts for i in part] == list(range(count))
        assert len(parts) <= int(np.ceil(np.sqrt(count))) + 1
    assert segments(0) == []


@pytest.mark.parametrize("value", ["layers", 2, "all"])
def test_unknown_recompute_values_are_refused(value):
    with pytest.raises(InputError, match="recompute"):
        onnxtrain.finetune(deep_mlp(2, 4).SerializeToString(), "mse", recompute=value)


def _finetuned(recompute, steps: int = 2):
    tuner = onnxtrain.finetune(deep_mlp(LAYERS, WIDTH).SerializeToString(), "mse", optax.adam(1e-3),
                               recompute=recompute)
    losses = [float(tuner.step(_batch(seed))["loss"]) for seed in range(steps)]
    return tuner, losses


@pytest.mark.slow
def test_finetune_recompute_gives_the_same_steps_with_less_scratch():
    plain, plain_losses = _finetuned(None)
    blocks, block_losses = _finetuned("blocks")
    np.testing.assert_allclose(block_losses, plain_losses, rtol=1e-6)
    for name in plain.state_names:
        np.testing.assert_allclose(blocks.get_state(name), plain.get_state(name), rtol=1e-6, atol=1e-7)
    assert blocks.compilations == plain.compilations, "no program more than without recompute"
    assert _temp_bytes(blocks) < 0.7 * _temp_bytes(plain)


@pytest.mark.slow
def test_trainer_recompute_gives_the_same_steps_with_less_scratch():
    training = onnxtrain.make_training_model(deep_mlp(LAYERS, WIDTH).SerializeToString(), loss="mse",
                                             optimizer=onnxtrain.optim.Adam(lr=1e-3))
    plain, blocks = onnxtrain.Trainer(training), onnxtrain.Trainer(training, recompute=True)
    for seed in range(2):
        expected, actual = plain.step(_batch(seed))["loss"], blocks.step(_batch(seed))["loss"]
        np.testing.assert_allclose(actual, expected, rtol=1e-6)
    for name in plain.state_names:
        np.testing.assert_allclose(blocks.get_state(name), plain.get_state(name), rtol=1e-6, atol=1e-7)
    assert blocks.compilations == plain.compilations
    assert _temp_bytes(blocks) < 0.7 * _temp_bytes(plain)


@pytest.mark.slow
def test_recompute_draws_the_same_dropout_masks():
    """Random nodes draw their keys before their segment starts, so the forward pass and its
    recomputation use the masks a plain step draws: the same losses and weights."""
    model = deep_mlp(6, WIDTH, dropout=0.3).SerializeToString()
    runs = {}
    for recompute in (None, True):
        tuner = onnxtrain.finetune(model, "mse", optax.sgd(0.1), recompute=recompute, seed=3)
        runs[recompute] = ([float(tuner.step(_batch(seed))["loss"]) for seed in range(3)], tuner)
    np.testing.assert_allclose(runs[True][0], runs[None][0], rtol=1e-6)
    for name in runs[None][1].state_names:
        np.testing.assert_allclose(runs[True][1].get_state(name), runs[None][1].get_state(name), rtol=1e-6, atol=1e-7)
    deterministic = onnxtrain.finetune(model, "mse", optax.sgd(0.1), train_mode=False)
    assert float(deterministic.step(_batch(0))["loss"]) != pytest.approx(runs[None][0][0], rel=1e-3), \
        "Dropout is active in training"
