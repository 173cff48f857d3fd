"""Text batches of a few shapes: onnxtrain.data.Padding and padded_batches.

Oracles: hand-written padded arrays; the loss of the unpadded example (padding must change
nothing); the number of programs compiled for twenty batches of random lengths; the warning a
user gets while lengths keep changing.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

import onnxtrain
from onnxtrain.data import Padding, padded_batches
from onnxtrain.errors import InputError


def test_padding_rounds_up_to_a_multiple_and_fills_by_role():
    batch = Padding(multiple_of=4, labels_from="input_ids")([
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "label_id": 2},
        {"input_ids": [8, 9, 10, 11, 12], "attention_mask": [1, 1, 1, 1, 1], "label_id": 0}])
    np.testing.assert_array_equal(batch["input_ids"], [[5, 6, 7, 0, 0, 0, 0, 0], [8, 9, 10, 11, 12, 0, 0, 0]])
    np.testing.assert_array_equal(batch["attention_mask"], [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(batch["labels"], [[5, 6, 7, -100, -100, -100, -100, -100],
                                                    [8, 9, 10, 11, 12, -100, -100, -100]])
    np.testing.assert_array_equal(batch["label_id"], [2, 0])
    assert batch["input_ids"].dtype == np.int64


def test_buckets_take_the_smallest_that_holds_the_batch():
    padding = Padding(buckets=[32, 8, 16])
    assert [padding.length(n) for n in (1, 8, 9, 16, 17, 32)] == [8, 8, 16, 16, 32, 32]
    with pytest.raises(InputError, match="33 tokens is longer than the largest bucket \\(32\\); add a bucket"):
        padding([{"input_ids": list(range(33))}])


@pytest.mark.parametrize("arguments, examples, message", [
    ({}, [], "one of multiple_of= .* or buckets="),
    ({"multiple_of": 8, "buckets": [8]}, [], "one of multiple_of="),
    ({"multiple_of": 0}, [], "positive ints"),
    ({"multiple_of": 8}, [], "no examples"),
    ({"multiple_of": 8}, [{"input_ids": [1, 2], "attention_mask": [1]}], "sequences of different lengths"),
    ({"multiple_of": 8}, [{"input_ids": [1]}, {"ids": [1]}], "example 1 has inputs \\['ids'\\]"),
    ({"multiple_of": 8}, [[1, 2, 3]], "example 0 is a list; Padding takes examples as dicts"),
    ({"multiple_of": 8, "labels_from": "ids"}, [{"input_ids": [1]}], "no 'ids' to copy as labels"),
])
def test_padding_refuses_what_it_cannot_pad_and_says_why(arguments, examples, message):
    with pytest.raises(InputError, match=message):
        Padding(**arguments)(examples)


def test_padded_batches_cover_every_example_once_per_epoch_in_a_seeded_order():
    examples = [{"input_ids": list(range(1, n + 1))} for n in range(1, 12)]
    batches = padded_batches(examples, 4, multiple_of=8, shuffle=True, seed=3)
    assert len(batches) == 3
    epochs = [[row[row > 0].size for batch in batches for row in batch["input_ids"]] for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(1, 12)) and epochs[0] != epochs[1]
    again = padded_batches(examples, 4, multiple_of=8, shuffle=True, seed=3)
    assert [row[row > 0].size for batch in again for row in batch["input_ids"]] == epochs[0]
    assert len(padded_batches(examples, 4, multiple_of=8, drop_last=True)) == 2


@pytest.fixture(scope="module")
def language_model(tmp_path_factory):
    """A tiny Qwen2 exported by the dynamo exporter with dynamic batch and sequence axes."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from support import llm_exports

    path = llm_exports.export("dynamo_dynamic", llm_exports.causal_lm("qwen2"), tmp_path_factory.mktemp("qwen2"))
    return onnxtrain.make_training_model(str(path), "causal_lm", optimizer=onnxtrain.optim.Adam(lr=1e-3))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::onnxtrain.ExportDamageWarning")
def test_padding_changes_no_loss(language_model):
    """Right padding with labels -100: the padded batch's loss is the unpadded example's."""
    trainer = onnxtrain.Trainer(language_model)
    ids = np.random.default_rng(0).integers(0, 128, 13)
    plain = trainer.evaluate([{"input_ids": ids[None], "labels": ids[None]}])["loss"]
    padded = trainer.evaluate([Padding(multiple_of=16, labels_from="input_ids")([{"input_ids": ids}])])["loss"]
    assert abs(padded - plain) <= 1e-6 * abs(plain)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::onnxtrain.ExportDamageWarning")
def test_twenty_batches_of_random_lengths_compile_at_most_four_programs(language_model, caplog):
    rng = np.random.default_rng(1)
    examples = [{"input_ids": rng.integers(0, 128, int(rng.integers(8, 65)))} for _ in range(40)]
    batches = padded_batches(examples, 2, multiple_of=16, labels_from="input_ids", shuffle=True)
    trainer = onnxtrain.Trainer(language_model)
    with caplog.at_level(logging.WARNING, logger="onnxtrain"):
        history = trainer.fit(batches, epochs=1, verbose=0)
    lengths = {batch["input_ids"].shape[1] for batch in batches}
    print(f"\n20 batches, padded lengths {sorted(lengths)}: {trainer.compilations} programs")
    assert len(history["step_loss"]) == 20 and np.isfinite(history["loss"][-1])
    assert trainer.compilations <= 4
    assert not [r for r in caplog.records if "sizes on axis" in r.getMessage()]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::onnxtrain.ExportDamageWarning")
def test_lengths_that_keep_changing_name_the_padding_helper(language_model, caplog):
    trainer = onnxtrain.Trainer(language_model)
    rng = np.random.default_rng(2)
    with caplog.at_level(logging.WARNING, logger="onnxtrain"):
        for length in range(9, 19):
            ids = rng.integers(0, 128, (2, length))
            trainer.step({"input_ids": ids, "labels": ids})
    warned = [r.getMessage() for r in caplog.records if "sizes on axis" in r.getMessage()]
    assert len(warned) == 1
    assert "input 'input_ids' has taken 8 sizes on axis 1 (9, 10, 11, 12, 13, 14, 15, 16)" in warned[0]
    assert "onnxtrain.data.padded_batches" in warned[0]
