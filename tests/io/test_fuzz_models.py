"""Fuzzed models: whatever the bytes, onnxtrain raises an OnnxTrainError or works.

Valid seed models (tests/support/fuzz_mutations.py) are mutated at the byte level (thousands,
through load_model only: cheap) and structurally (hundreds, through translation,
compilation, initialize/step/infer/export: slow). The only exceptions allowed out are
subclasses of onnxtrain.OnnxTrainError; nothing may hang or allocate what a file merely
declares. Every input that once broke this is kept in tests/io/fuzz_corpus/ and replayed.
Hypothesis runs derandomized, so CI sees the same models every run.
Folder mutations also plant links and FIFOs in the model's folder and a file of
OUTSIDE_PATTERN beside it: a model that loads must not hold a byte of it. Each test
records (and prints, with -s) how many models each mutation class produced.
"""

from __future__ import annotations

import faulthandler
import random
import resource
import signal
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import onnxtrain
from support.fuzz_mutations import (BYTE_MUTATIONS, EXTERNAL_FILE, FOLDER_MUTATIONS, OUTSIDE_PATTERN,
                                    SEED_MODELS, STRUCTURAL_MUTATIONS, WIRE_MUTATIONS, deep_valid_nesting,
                                    huge_external_data, long_node_chain, mutated, nested_ifs, odd_external_numbers,
                                    outside_file, overlong_external_location, seed)
from onnxtrain.proto import ModelProto, ValueInfoProto
from onnxtrain.proto.walk import iter_tensors

CORPUS = Path(__file__).parent / "fuzz_corpus"
BYTE_EXAMPLES_PER_SEED = 100
BYTE_MUTANTS_PER_EXAMPLE = 25
STRUCTURAL_EXAMPLES_PER_SEED = 150
MINIMUM_FUZZED_MODELS = 10_000
SOFT_TIMEOUT_SECONDS = 30
HARD_TIMEOUT_SECONDS = 90
MAX_RSS_GROWTH_BYTES = 1 << 30
FEED_DIM = 2
# What the slow structural test draws from (the model folder is always given), and how many
# times each class runs at least per seed: once per cycle through the classes.
DRAWN_CLASSES = [*STRUCTURAL_MUTATIONS, *FOLDER_MUTATIONS, *WIRE_MUTATIONS]
MINIMUM_STRUCTURAL_RUNS = STRUCTURAL_EXAMPLES_PER_SEED // len(DRAWN_CLASSES)
# Classes that only reach load_model (links, FIFOs, external data, wire-level nesting): the quick
# test runs each LOAD_CLASS_RUNS times through load_model alone.
LOAD_CLASSES = [*FOLDER_MUTATIONS, odd_external_numbers, overlong_external_location, huge_external_data,
                *WIRE_MUTATIONS]
LOAD_CLASS_RUNS = 24
# Every other structural class reaches translation; the quick test runs each through the whole
# pipeline once per QUICK_SEEDS entry (inference, control flow, a function and training).
FULL_CLASSES = [*(m for m in STRUCTURAL_MUTATIONS if m not in LOAD_CLASSES), deep_valid_nesting]
QUICK_SEEDS = ["mlp", "control_flow", "function_and_training"]

FUZZ_SETTINGS = dict(derandomize=True, database=None, deadline=None, print_blob=False,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


class Hang(BaseException):
    """Raised by the watchdog; a BaseException so no `except Exception` in the library hides it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise Hang(f"example ran past {SOFT_TIMEOUT_SECONDS} s")


@contextmanager
def watchdog() -> Iterator[None]:
    """Fail an example that hangs (soft: SIGALRM) or hangs in C code (hard: the worker exits with
    a traceback), and one whose peak RSS grows by more than a model could justify."""
    rss_before = peak_rss_bytes()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(SOFT_TIMEOUT_SECONDS)
    faulthandler.dump_traceback_later(HARD_TIMEOUT_SECONDS, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    growth = peak_rss_bytes() - rss_before
    assert growth <= MAX_RSS_GROWTH_BYTES, f"peak RSS grew by {growth >> 20} MiB on one model"


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def feed_for(declared: ValueInfoProto) -> np.ndarray:
    """A small array matching a declared input where it can (absurd dims become FEED_DIM)."""
    tensor_type = declared.type.tensor_type
    try:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
    except KeyError:
        dtype = np.dtype(np.float32)
    if dtype.kind not in "biuf":
        dtype = np.dtype(np.float32)
    dims = tensor_type.shape.dim
    # Many dims of FEED_DIM would make a huge feed, so those get 1; and numpy holds at most 64
    # dims, so a feed for a rank-65 declaration is cut short (and then refused).
    other = FEED_DIM if len(dims) <= 8 else 1
    shape = [d.dim_value if 0 < d.dim_value <= 8 else other for d in dims][:64]
    if dtype.kind == "f":
        return np.random.default_rng(0).normal(size=shape).astype(dtype)
    return np.ones(shape, dtype) if dtype.kind == "b" else np.zeros(shape, dtype)


def feeds_for(names: list[str], graphs: list[Any]) -> dict[str, np.ndarray]:
    declared = {value.name: value for graph in graphs for value in graph.input}
    return {name: feed_for(declared[name]) for name in names if name in declared}


def run_inference(model: ModelProto) -> None:
    fn, params = onnxtrain.translate_model(model)
    fn(params, feeds_for(fn.input_names, [model.graph]))


def run_training(model: ModelProto, folder: Path) -> None:
    trainer = onnxtrain.Trainer(model, seed=0, nan_policy="ignore")
    trainer.initialize()
    graphs = [model.graph, *(info.algorithm for info in model.training_info)]
    trainer.step(feeds_for(trainer.step_inputs(), graphs))
    trainer.infer(feeds_for([value.name for value in model.graph.input], [model.graph]))
    trainer.export(folder / "exported.onnx")


def exercise(source: bytes | onnx.ModelProto, folder: Path, full: bool = True) -> None:
    """Load the model and, when `full`, run it the way a user would; raises only OnnxTrainError."""
    model = onnxtrain.load_model(source, base_dir=folder)
    for tensor, where in iter_tensors(model):
        assert OUTSIDE_PATTERN not in tensor.raw_data, f"{where} holds bytes from outside the model's folder"
    if not full:
        return
    if model.training_info:
        run_training(model, folder)
    else:
        run_inference(model)


def check(source: bytes | onnx.ModelProto, folder: Path, what: str, full: bool = True) -> None:
    """exercise() under the watchdog; an error that is not an OnnxTrainError fails, its input kept."""
    try:
        with watchdog():
            exercise(source, folder, full)
    except onnxtrain.OnnxTrainError as error:
        assert str(error), f"{type(error).__name__} without a message for {what}"
    except (Exception, Hang) as error:
        data = source if isinstance(source, bytes) else source.SerializeToString()
        kept = folder / "failing.onnx"
        kept.write_bytes(data)
        raise AssertionError(f"{what}: {type(error).__name__}: {error} (input kept in {kept})") from error


def model_folder(tmp_path: Path) -> Path:
    """tmp/model, where the seed and the mutations live, beside tmp/outside/secret.bin."""
    folder = tmp_path / "model"
    folder.mkdir(parents=True)
    outside_file(folder)
    return folder


def report_runs(record_property, counts: Counter, models: int, started: float) -> None:
    """Record and print the models run per mutation class (pytest -s or the junit XML)."""
    runs = dict(sorted(counts.items()))
    record_property("runs_per_mutation", runs)
    record_property("fuzzed_models", models)
    record_property("seconds", round(time.monotonic() - started, 1))
    print(f"{models} models; runs per mutation class: {runs}")


@pytest.mark.slow
def test_every_seed_is_valid_and_runs(tmp_path: Path) -> None:
    """A mutant failing means something only if its seed works."""
    for name in SEED_MODELS:
        path = tmp_path / f"{name}.onnx"
        path.write_bytes(seed(name, tmp_path).model.SerializeToString())
        onnx.checker.check_model(str(path))
        exercise(path.read_bytes(), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", SEED_MODELS)
def test_byte_mutations_raise_only_onnxtrain_errors(name: str, tmp_path: Path, record_property) -> None:
    folder = model_folder(tmp_path)
    data = seed(name, folder).model.SerializeToString()
    counts, models, started = Counter(), [0], time.monotonic()

    @settings(max_examples=BYTE_EXAMPLES_PER_SEED, **FUZZ_SETTINGS)
    @given(st.integers(0, 2**32 - 1))
    def mutants_of(rng_seed: int) -> None:
        rng = random.Random(rng_seed)
        for index in range(BYTE_MUTANTS_PER_EXAMPLE):
            mutant = data
            for _ in range(rng.randint(1, 3)):
                if mutant:
                    mutation = rng.choice(BYTE_MUTATIONS)
                    mutant = mutation(mutant, rng)
                    counts[mutation.__name__] += 1
            check(mutant, folder, f"{name} byte mutant {rng_seed}/{index}", full=index == 0)
            models[0] += 1

    mutants_of()
    report_runs(record_property, counts, models[0], started)
    assert models[0] >= BYTE_EXAMPLES_PER_SEED * BYTE_MUTANTS_PER_EXAMPLE
    assert all(counts[mutation.__name__] for mutation in BYTE_MUTATIONS)


@pytest.mark.slow
@pytest.mark.parametrize("name", SEED_MODELS)
def test_structural_mutations_raise_only_onnxtrain_errors(name: str, tmp_path: Path, record_property) -> None:
    folder = model_folder(tmp_path)
    start = seed(name, folder)
    counts, models, started = Counter(), [0], time.monotonic()

    @settings(max_examples=STRUCTURAL_EXAMPLES_PER_SEED, **FUZZ_SETTINGS)
    @given(st.integers(0, 2**32 - 1), st.integers(1, 3))
    def mutant_of(rng_seed: int, count: int) -> None:
        # The first mutation cycles through the classes, so each runs as often as the others.
        first = DRAWN_CLASSES[models[0] % len(DRAWN_CLASSES)]
        model, applied = mutated(start.model, random.Random(rng_seed), count, folder, first=first)
        check(model, folder, f"{name} mutated by {applied} (seed {rng_seed})")
        counts.update(applied)
        models[0] += 1

    mutant_of()
    report_runs(record_property, counts, models[0], started)
    assert models[0] >= STRUCTURAL_EXAMPLES_PER_SEED
    assert min(counts[mutation.__name__] for mutation in DRAWN_CLASSES) >= MINIMUM_STRUCTURAL_RUNS, counts


@pytest.mark.parametrize("name", ["external_data", "mlp"])
def test_load_mutation_classes_raise_only_onnxtrain_errors(name: str, tmp_path: Path, record_property) -> None:
    """Links, FIFOs, loops, overlong names, odd numbers, deep nesting: each class run
    LOAD_CLASS_RUNS times through load_model, in the quick set."""
    folder = model_folder(tmp_path)
    start = seed(name, folder)
    counts, started = Counter(), time.monotonic()
    for mutation in LOAD_CLASSES:
        for index in range(LOAD_CLASS_RUNS):
            model, applied = mutated(start.model, random.Random(index), 1, folder, classes=[mutation])
            check(model, folder, f"{name} mutated by {applied} (seed {index})", full=False)
            counts.update(applied)
    report_runs(record_property, counts, sum(counts.values()), started)
    assert counts == Counter({mutation.__name__: LOAD_CLASS_RUNS for mutation in LOAD_CLASSES})


@pytest.mark.slow
def test_structural_mutation_classes_raise_only_onnxtrain_errors(tmp_path: Path, record_property) -> None:
    """Every structural class that reaches translation (broken SSA, '' names, order, scoping,
    impossible dims, huge shape constants, broken sparse tensors, depth past the limit, ...)
    run through load, translation and a run or a training step, once per QUICK_SEEDS entry."""
    counts, changed, started = Counter(), set(), time.monotonic()
    for name in QUICK_SEEDS:
        folder = model_folder(tmp_path / name)
        start = seed(name, folder)
        for index, mutation in enumerate(FULL_CLASSES):
            model, applied = mutated(start.model, random.Random(index), 1, folder, classes=[mutation])
            check(model, folder, f"{name} mutated by {applied} (seed {index})")
            counts.update(applied)
            if model != start.model:
                changed.add(mutation.__name__)
    report_runs(record_property, counts, sum(counts.values()), started)
    assert counts == Counter({mutation.__name__: len(QUICK_SEEDS) for mutation in FULL_CLASSES})
    # A class that left every seed as it was would pass without testing anything.
    assert changed == {mutation.__name__ for mutation in FULL_CLASSES}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "control_flow", "adam"])
def test_long_node_chain_is_refused_by_depth(name: str, tmp_path: Path) -> None:
    """A chain of Identity nodes far past MAX_GRAPH_DEPTH: refused by the depth bound before
    anything compiles. It has its own test rather than random draws: building and planning
    such a model costs far more than any other mutant."""
    folder = model_folder(tmp_path)
    for index in range(2):
        model, applied = mutated(seed(name, folder).model, random.Random(index), 1, folder,
                                 classes=[long_node_chain])
        with pytest.raises(onnxtrain.UnsupportedOpError, match="longest chain of dependent nodes"), watchdog():
            exercise(model, folder)


def test_the_fuzz_volume_meets_the_acceptance_point() -> None:
    """Issue 7: at least 10,000 fuzzed models per CI run."""
    per_seed = BYTE_EXAMPLES_PER_SEED * BYTE_MUTANTS_PER_EXAMPLE + STRUCTURAL_EXAMPLES_PER_SEED
    assert per_seed * len(SEED_MODELS) >= MINIMUM_FUZZED_MODELS


def corpus_entries() -> list[Path]:
    return sorted(CORPUS.glob("*.onnx"))


@pytest.mark.parametrize("path", corpus_entries(), ids=lambda path: path.stem)
def test_corpus_entry_raises_an_onnxtrain_error(path: Path, tmp_path: Path) -> None:
    """Every input that once escaped with another exception (see fuzz_corpus/README.md)."""
    (tmp_path / EXTERNAL_FILE).write_bytes(np.arange(12, dtype=np.float32).tobytes())
    with pytest.raises(onnxtrain.OnnxTrainError), watchdog():
        exercise(path.read_bytes(), tmp_path)


@pytest.mark.parametrize("depth", [1, 30, 200, 1000])
def test_deeply_nested_subgraphs_raise_only_onnxtrain_errors(depth: int, tmp_path: Path) -> None:
    """Nesting is bounded by protobuf's parse depth, so no depth reaches a RecursionError."""
    for name in ("mlp", "control_flow"):
        check(nested_ifs(seed(name, tmp_path).model, depth), tmp_path, f"{name} in {depth} nested If nodes")


def test_every_corpus_entry_is_described() -> None:
    readme = (CORPUS / "README.md").read_text()
    assert all(path.name in readme for path in corpus_entries())
