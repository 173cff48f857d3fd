"""fit's data forms (onnxtrain.data): each trains exactly as the explicit list of feed dicts does.

The oracle is fit over a list of feed dicts cut by hand from the same numpy arrays: every other
form (tuples by position, a torch DataLoader, whole arrays with batch_size, shuffle and
validation_split) must give the same losses bit for bit, and every mistake an InputError
naming the argument, raised before any step changes the state.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.data import ArrayBatches, by_position, fit_data, is_whole_arrays
from support.training_models import assert_state_equal, linreg_model, snapshot

ROWS, FEATURES, CLASSES = 16, 5, 3
RNG = np.random.default_rng(0)
X = RNG.normal(size=(ROWS, FEATURES)).astype(np.float32)
LABELS = RNG.integers(0, CLASSES, ROWS).astype(np.int64)


def _mlp() -> onnxtrain.proto.ModelProto:
    """x[batch, 5] -> Gemm -> Tanh -> Gemm -> logits[batch, 3], fixed weights."""
    rng = np.random.default_rng(1)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W1", "B1"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
         helper.make_node("Gemm", ["t", "W2", "B2"], ["logits"])], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        [numpy_helper.from_array(rng.normal(size=shape).astype(np.float32), name)
         for name, shape in (("W1", (FEATURES, 8)), ("B1", (8,)), ("W2", (8, CLASSES)), ("B2", (CLASSES,)))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.fixture(scope="module")
def training_model():
    return onnxtrain.make_training_model(_mlp(), loss="cross_entropy", optimizer=onnxtrain.optim.Adam(lr=0.01))


def dict_batches(x=X, labels=LABELS, size=8, order=None):
    """The oracle's batches: feed dicts cut by hand, rows in `order` (default: as they are)."""
    order = np.arange(len(x)) if order is None else order
    return [{"x": x[order[i:i + size]], "labels": labels[order[i:i + size]]} for i in range(0, len(x), size)]


def trained(model, data, **options):
    trainer = onnxtrain.Trainer(model, seed=0)
    trainer.initialize()
    history = trainer.fit(data, progress=False, **options)
    return trainer, history


_REFERENCES = {}


def reference_run(model, expected_batches, epochs):
    """trained(model, expected_batches), once per batches (compared by value) and epochs."""
    key = (id(model), epochs, tuple((b["x"].tobytes(), b["labels"].tobytes()) for b in expected_batches))
    if key not in _REFERENCES:
        trainer, history = trained(model, expected_batches, epochs=epochs)
        _REFERENCES[key] = (snapshot(trainer), history)
    return _REFERENCES[key]


def assert_same_training(model, data, expected_batches, epochs=2, **options):
    state, expected = reference_run(model, expected_batches, epochs)
    trainer, history = trained(model, data, epochs=epochs, **options)
    assert len(history["step_loss"]) == len(expected["step_loss"])
    np.testing.assert_array_equal(history["step_loss"], expected["step_loss"])
    assert_state_equal(trainer, state)
    return history


def test_the_step_takes_the_data_inputs_then_the_labels(training_model):
    assert onnxtrain.Trainer(training_model).step_inputs() == ["x", "labels"]


def _generator():
    for batch in dict_batches():
        yield batch["x"], batch["labels"]


FORMS = {
    "tuples": lambda: [(b["x"], b["labels"]) for b in dict_batches()],
    "lists": lambda: [[b["x"], b["labels"]] for b in dict_batches()],
    "inputs_tuple_and_labels": lambda: [((b["x"],), b["labels"]) for b in dict_batches()],
    "inputs_dict_and_labels": lambda: [({"x": b["x"]}, b["labels"]) for b in dict_batches()],
    "jax_arrays": lambda: [(jnp.asarray(b["x"]), b["labels"]) for b in dict_batches()],
    "python_lists": lambda: [(b["x"].tolist(), b["labels"].tolist()) for b in dict_batches()],
    "function": lambda: _generator,
}


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_batches_of_every_form_train_as_the_list_of_feed_dicts(training_model, form):
    assert_same_training(training_model, FORMS[form](), dict_batches())


WHOLE = {
    "dict": lambda: {"x": X, "labels": LABELS},
    "tuple": lambda: (X, LABELS),
    "list": lambda: [X, LABELS],
    "nested_tuple": lambda: ((X,), LABELS),
    "dict_and_labels": lambda: ({"x": X}, LABELS),
    "labels_as_python_list": lambda: (X, LABELS.tolist()),
    "jax": lambda: (jnp.asarray(X), LABELS),
}


@pytest.mark.slow
@pytest.mark.parametrize("form", WHOLE)
def test_whole_arrays_are_cut_into_batches_of_batch_size(training_model, form):
    assert_same_training(training_model, WHOLE[form](), dict_batches(size=8), batch_size=8)


@pytest.mark.slow
def test_whole_arrays_default_to_batches_of_32_rows(training_model):
    x, labels = np.concatenate([X, X, X, X]), np.concatenate([LABELS] * 4)    # 64 rows: 32 + 32
    history = assert_same_training(training_model, (x, labels), dict_batches(x, labels, size=32), epochs=1)
    assert len(history["step_loss"]) == 2


@pytest.mark.slow
def test_torch_dataloaders_of_pairs_and_of_dicts_train_as_the_list_of_feed_dicts(training_model):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

    class Unsized(IterableDataset):
        def __init__(self, features):
            self.features = features

        def __iter__(self):
            return iter(zip(self.features, torch.from_numpy(LABELS)))

    features = torch.tensor(X, requires_grad=True)     # each collated batch requires grad too
    pairs = DataLoader(TensorDataset(features, torch.from_numpy(LABELS)), batch_size=8)
    assert next(iter(pairs))[0].requires_grad
    assert_same_training(training_model, pairs, dict_batches(size=8))

    class Samples(Dataset):
        def __len__(self):
            return ROWS

        def __getitem__(self, index):
            return {"x": torch.from_numpy(X[index]), "labels": torch.tensor(LABELS[index])}

    assert_same_training(training_model, DataLoader(Samples(), batch_size=8), dict_batches(size=8))
    assert_same_training(training_model, (features, torch.from_numpy(LABELS)), dict_batches(size=8), batch_size=8)
    unsized = DataLoader(Unsized(features), batch_size=8)      # len() raises TypeError
    assert_same_training(training_model, unsized, dict_batches(size=8))


def test_a_short_last_batch_is_known_ahead_only_where_the_source_says_so():
    """short_last: (batch size, rows of the last batch) for whole arrays and a DataLoader that
    will cut a short last batch; None where the batches cannot be known without reading them,
    or where the loader drops that batch itself. Checked against the batches each source yields."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, TensorDataset

    from onnxtrain.data import short_last, short_probe

    class Unsized(IterableDataset):
        def __iter__(self):
            return iter(zip(torch.from_numpy(X), torch.from_numpy(LABELS)))

    dataset = TensorDataset(torch.from_numpy(X), torch.from_numpy(LABELS))     # 16 rows
    cases = {
        "arrays 16/6": ((X, LABELS), {"batch_size": 6}, (6, 4)),
        "arrays 16/8": ((X, LABELS), {"batch_size": 8}, None),
        "loader 16/6": (DataLoader(dataset, batch_size=6), {}, (6, 4)),
        "loader 16/6, shuffled": (DataLoader(dataset, batch_size=6, shuffle=True), {}, (6, 4)),
        "loader 16/8": (DataLoader(dataset, batch_size=8), {}, None),
        "loader dropping it": (DataLoader(dataset, batch_size=6, drop_last=True), {}, None),
        "batch sampler": (DataLoader(dataset, batch_sampler=BatchSampler(SequentialSampler(dataset), 6, False)), {},
                          None),
        "iterable dataset": (DataLoader(Unsized(), batch_size=6), {}, None),
        "list": ([{"x": X[:6], "labels": LABELS[:6]}, {"x": X[6:], "labels": LABELS[6:]}], {}, None),
    }
    for case, (data, options, expected) in cases.items():
        train = fit_data(data, ["x", "labels"], **options).train
        assert short_last(train) == expected, case
        sizes = [len(batch["x"]) for batch in train]
        if expected is not None:
            assert sizes[-1] == expected[1] and set(sizes[:-1]) == {expected[0]}, case
            rows, probe = short_probe(train, next(iter(train)))
            assert rows == expected[1] and {len(value) for value in probe.values()} == {rows}, case
    # A value without the batch size on axis 0 (a lookup table beside the batch) is not cut.
    loader = fit_data(DataLoader(dataset, batch_size=6), ["x", "labels"]).train
    assert short_probe(loader, {"x": X[:6], "table": X}) is None
    assert short_probe(loader, {"x": X[:6], "scale": np.float32(2)})[1]["scale"] == 2


@pytest.mark.slow
def test_a_finetuner_takes_the_same_forms():
    optax = pytest.importorskip("optax")

    def tuned(data, **options):
        tuner = onnxtrain.finetune(_mlp(), "cross_entropy", optax.sgd(0.1))
        return tuner, tuner.fit(data, epochs=2, progress=False, **options)

    reference, expected = tuned(dict_batches(size=8))
    for data, options in (((X, LABELS), {"batch_size": 8}), ([(b["x"], b["labels"]) for b in dict_batches()], {})):
        tuner, history = tuned(data, **options)
        np.testing.assert_array_equal(history["step_loss"], expected["step_loss"])
        assert_state_equal(tuner, snapshot(reference))


def test_shuffled_epochs_are_seeded_new_orders_covering_every_row_once():
    batches = ArrayBatches({"i": np.arange(ROWS)}, batch_size=6, shuffle=True, seed=7)
    epochs = [np.concatenate([batch["i"] for batch in batches]) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(ROWS))                 # every row once
    assert [len(batch["i"]) for batch in batches] == [6, 6, 4]
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    again = ArrayBatches({"i": np.arange(ROWS)}, batch_size=6, shuffle=True, seed=7)
    assert all(np.array_equal(np.concatenate([b["i"] for b in again]), order) for order in epochs)
    other = ArrayBatches({"i": np.arange(ROWS)}, batch_size=6, shuffle=True, seed=8)
    assert not np.array_equal(np.concatenate([b["i"] for b in other]), epochs[0])
    unshuffled = ArrayBatches({"i": np.arange(ROWS)}, batch_size=6)
    assert np.array_equal(np.concatenate([b["i"] for b in unshuffled]), np.arange(ROWS))


@pytest.mark.slow
def test_fit_shuffles_rows_in_the_seeded_order_of_each_epoch(training_model):
    orders = ArrayBatches({"i": np.arange(ROWS)}, batch_size=8, shuffle=True, seed=3)
    expected = [batch for epoch in range(2) for batch in dict_batches(size=8, order=orders.order(epoch))]
    reference, oracle = trained(training_model, expected)
    trainer, history = trained(training_model, (X, LABELS), epochs=2, batch_size=8, shuffle=True, seed=3)
    np.testing.assert_array_equal(history["step_loss"], oracle["step_loss"])
    assert_state_equal(trainer, snapshot(reference))
    unshuffled = trained(training_model, (X, LABELS), epochs=2, batch_size=8)[1]
    assert not np.array_equal(history["step_loss"], unshuffled["step_loss"])


@pytest.mark.slow
def test_without_a_seed_the_shuffle_follows_the_trainers_seed(training_model):
    def losses(seed):
        trainer = onnxtrain.Trainer(training_model, seed=seed)
        trainer.initialize()
        return trainer.fit((X, LABELS), epochs=2, batch_size=8, shuffle=True, progress=False)["step_loss"]

    assert losses(5) == losses(5)
    assert losses(5) != losses(6)


@pytest.mark.slow
def test_validation_split_holds_out_the_tail_before_shuffling(training_model):
    cut = 8                                    # floor(16 * (1 - 0.5))
    reference, _ = trained(training_model, dict_batches(X[:cut], LABELS[:cut], size=4), epochs=1)
    expected_val = float(reference.evaluate({"x": X[cut:], "labels": LABELS[cut:]})["loss"])
    trainer, history = trained(training_model, {"x": X, "labels": LABELS}, epochs=1, batch_size=4,
                               validation_split=0.5)
    assert len(history["step_loss"]) == 2           # 8 training rows: 4 + 4
    assert_state_equal(trainer, snapshot(reference))
    assert history["val_loss"] == [pytest.approx(expected_val, rel=1e-6)]
    # Shuffling reorders the training rows only: the same 15 rows, the same held-out tail.
    shuffled, shuffled_history = trained(training_model, (X, LABELS), epochs=1, batch_size=4, shuffle=True,
                                         validation_split=0.5, seed=0)
    assert shuffled_history["val_loss"] != history["val_loss"]          # trained on another order
    assert shuffled_history["val_loss"] == [pytest.approx(
        float(shuffled.evaluate({"x": X[cut:], "labels": LABELS[cut:]})["loss"]), rel=1e-6)]


@pytest.mark.slow
def test_eval_data_takes_every_form_and_a_one_shot_iterator_keeps_its_first_batch(training_model):
    val = dict_batches(size=8)
    expected = trained(training_model, dict_batches(size=8), eval_data=val)[1]["val_loss"]
    for eval_data, options in (((X, LABELS), {"batch_size": 8}), ([(b["x"], b["labels"]) for b in val], {}),
                               (iter(val), {})):
        history = trained(training_model, dict_batches(size=8), eval_data=eval_data, **options)[1]
        assert history["val_loss"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow
def test_a_short_last_batch_compiles_one_program_more_and_drop_last_none(training_model):
    for drop_last, steps, programs in ((False, 9, 2), (True, 6, 1)):      # batches of 6, 6 and 4
        trainer = onnxtrain.Trainer(training_model)
        trainer.initialize()
        compiled = trainer.compilations
        history = trainer.fit((X, LABELS), epochs=3, batch_size=6, drop_last=drop_last, progress=False)
        assert len(history["step_loss"]) == steps
        assert trainer.compilations - compiled == programs


# Mistakes: each an InputError naming the argument, before any step.

def _empty():
    yield from ()


MISTAKES = {
    "empty_list": (lambda: [], {}, "batches is empty; pass at least one batch"),
    "empty_generator": (lambda: _empty, {}, "batches yielded no batch in epoch 1"),
    "zero_epochs": (lambda: dict_batches(), {"epochs": 0}, "epochs must be a positive int, got 0"),
    "float_epochs": (lambda: dict_batches(), {"epochs": 1.5}, "epochs must be a positive int, got 1.5"),
    "tuple_too_long": (lambda: [(X, LABELS, X)], {},
                       "batches: batch 0 is a tuple of 3 values, but the step takes 2 inputs ['x', 'labels']"),
    "whole_tuple_too_long": (lambda: (X, LABELS, X), {}, "batches is a tuple of 3 values, but the step takes 2"),
    "rows_differ": (lambda: (X, LABELS[:-1]), {},
                    "the arrays have different numbers of rows ({'x': 16, 'labels': 15})"),
    "one_shot_iterator": (lambda: iter(dict_batches()), {"epochs": 2}, "needs batches it can iterate again"),
    "string": (lambda: "train.npz", {}, "batches is a str ('train.npz'); pass the data itself, not a path"),
    "single_array": (lambda: X, {}, "batches is a single ndarray; pass (inputs, labels)"),
    "none": (lambda: None, {}, "batches is None"),
    "keras_names": (lambda: {"features": X, "labels": LABELS}, {},
                    "the step takes inputs ['x', 'labels']; missing ['x']; unknown ['features']"),
    "dict_and_labels_wrong": (lambda: [({"x": X, "labels": LABELS}, LABELS)], {},
                              "that dict must name every input but one"),
    "list_of_one_array": (lambda: [X[:8]], {}, "batches is a list of 1 values, but the step takes 2 inputs"),
    "batch_of_one_array": (lambda: [X] + [(b["x"], b["labels"]) for b in dict_batches()], {},
                           "batches: batch 0 is a ndarray; a batch is a dict"),
    "batch_size_for_batches": (lambda: dict_batches(), {"batch_size": 8}, "batch_size= applies to whole arrays"),
    "shuffle_for_batches": (lambda: dict_batches(), {"shuffle": True}, "shuffle= applies to whole arrays"),
    "split_for_batches": (lambda: dict_batches(), {"validation_split": 0.2}, "validation_split= applies to whole"),
    "split_and_eval_data": (lambda: (X, LABELS), {"validation_split": 0.2, "eval_data": dict_batches()},
                            "pass either validation_split or eval_data, not both"),
    "split_out_of_range": (lambda: (X, LABELS), {"validation_split": 1.0}, "validation_split must be a fraction"),
    "split_leaves_nothing": (lambda: (X[:1], LABELS[:1]), {"validation_split": 0.5}, "leaves no training rows"),
    "batch_size_zero": (lambda: (X, LABELS), {"batch_size": 0}, "batch_size must be a positive int, got 0"),
    "seed_negative": (lambda: (X, LABELS), {"shuffle": True, "seed": -1}, "seed must be a non-negative int"),
    "scalar_column": (lambda: {"x": X, "labels": np.int64(1)}, {}, "input 'labels' is a scalar"),
    "float64_arrays": (lambda: (X.astype(np.float64), LABELS), {}, "input 'x' must be float32, got a float64"),
    "float_labels": (lambda: (X, LABELS.astype(np.float32)), {}, "input 'labels' must be int64"),
    "eval_wrong_shape": (lambda: dict_batches(), {"eval_data": [{"x": X[:, :2], "labels": LABELS}]},
                         "input 'x' must have size 5 on axis 1"),
    "eval_wrong_names": (lambda: dict_batches(), {"eval_data": [{"x": X}]}, "missing ['labels']"),
    "eval_empty": (lambda: dict_batches(), {"eval_data": []}, "eval_data is empty"),
    "eval_one_shot": (lambda: dict_batches(), {"eval_data": iter(dict_batches()), "epochs": 2},
                      "needs eval_data it can iterate again"),
    "eval_string": (lambda: dict_batches(), {"eval_data": "val.npz"}, "eval_data is a str"),
    "eval_rows_differ": (lambda: dict_batches(), {"eval_data": (X, LABELS[:3])}, "eval_data: the arrays have"),
}


@pytest.mark.parametrize("case", MISTAKES)
def test_each_data_mistake_is_an_input_error_before_training(training_model, case):
    make, options, message = MISTAKES[case]
    trainer = onnxtrain.Trainer(training_model, seed=0)
    trainer.initialize()
    before, compiled = snapshot(trainer), trainer.compilations
    with pytest.raises(onnxtrain.InputError) as error:
        trainer.fit(make(), progress=False, **options)
    assert message in str(error.value), str(error.value)
    assert_state_equal(trainer, before)
    assert trainer.compilations == compiled


def test_a_torch_tensor_of_the_wrong_dtype_says_how_to_convert_it(training_model):
    torch = pytest.importorskip("torch")
    trainer = onnxtrain.Trainer(training_model)
    with pytest.raises(onnxtrain.InputError, match=re.escape("e.g. tensor.to(torch.float32)")):
        trainer.fit((torch.from_numpy(X).double(), torch.from_numpy(LABELS)), progress=False)


def test_linreg_spec_model_maps_tuples_onto_its_own_input_order():
    """A hand-written training model (inputs X of the main graph, Y of the algorithm): tuples
    follow step_inputs()."""
    trainer = onnxtrain.Trainer(linreg_model())
    names = trainer.step_inputs()
    x = np.arange(4, dtype=np.float32)[:, None]
    values = {"X": x, "Y": 2 * x + 1}
    data = fit_data([tuple(values[name] for name in names)], names)
    assert [sorted(batch) for batch in data.train] == [sorted(names)]


def test_whole_arrays_are_told_from_batches():
    assert is_whole_arrays((X, LABELS)) and is_whole_arrays({"x": X}) and is_whole_arrays(((X,), LABELS))
    assert is_whole_arrays((X, LABELS.tolist()))
    assert not is_whole_arrays([(X, LABELS)]) and not is_whole_arrays([{"x": X}]) and not is_whole_arrays([])
    assert not is_whole_arrays([[1.0, 2.0], [3.0]])
    assert not is_whole_arrays([[X, LABELS], [X, LABELS]]) and not is_whole_arrays([(X, LABELS), (X, LABELS)])
    assert not is_whole_arrays([{"x": X, "labels": LABELS}] * 2) and is_whole_arrays(([X], LABELS))
    assert by_position(((X,), LABELS), ["x", "labels"], "b")["labels"] is LABELS
    assert by_position(([1.0], [2.0]), ["x", "labels"], "b") == {"x": [1.0], "labels": [2.0]}


def test_array_batches_on_their_own_read_tensors_and_lists_and_pass_through_fit_data():
    torch = pytest.importorskip("torch")
    features = torch.tensor(X, requires_grad=True)
    batches = ArrayBatches({"x": features, "labels": LABELS.tolist()}, batch_size=8, shuffle=True, seed=1)
    train = fit_data(batches, ["x", "labels"], epochs=2).train
    first, second = ([batch["labels"] for batch in train] for _ in range(2))
    assert all(isinstance(b, np.ndarray) and b.dtype == np.int64 for b in first)
    assert sorted(np.concatenate(first)) == sorted(LABELS) == sorted(np.concatenate(second))
    rows = np.concatenate([batch["x"] for batch in ArrayBatches({"x": features}, batch_size=8)])
    assert rows.dtype == np.float32 and np.array_equal(rows, X)
    assert len(train) == 2
