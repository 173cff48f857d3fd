"""Compiled programs are bounded: each new feed shape compiles a program, each step, evaluation
and inference program keeps at most max_programs of them (least recently used evicted), a
warning says once which input keeps changing shape, and fit(drop_last=True) avoids the
short last batch's program. Results stay exact, and `compilations` counts every compile.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import onnxtrain
from onnxtrain._engine.compiled import DEFAULT_MAX_PROGRAMS
from support.training_models import (assert_state_equal, linreg_graph, linreg_model, linreg_oracle,
                                     make_training_model, snapshot)

WORKER = Path(__file__).with_name("program_limit_worker.py")


def batch(size: int, offset: float = 0.0) -> dict[str, np.ndarray]:
    x = (np.arange(size, dtype=np.float32) + offset).reshape(size, 1) / 8
    return {"X": x, "Y": 2 * x + 1}


def churn_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "max_programs" in r.getMessage()]


@pytest.mark.slow
def test_programs_are_bounded_and_results_stay_exact(caplog):
    sizes = [*range(1, 9), *range(1, 9)]
    limited = onnxtrain.Trainer(linreg_model(), max_programs=2)
    roomy = onnxtrain.Trainer(linreg_model(), max_programs=64)
    with caplog.at_level(logging.WARNING, logger="onnxtrain"):
        for size in sizes:
            feeds = batch(size)
            assert np.array_equal(limited.step(feeds)["loss"], roomy.step(feeds)["loss"])
            assert limited.programs_kept <= 2
    assert_state_equal(limited, snapshot(roomy))
    # Against the spec's float64 oracle too, not only against another trainer.
    _, states = linreg_oracle("adagrad", [batch(size) for size in sizes])
    np.testing.assert_allclose(np.asarray(limited.state["W"]), states[-1]["W"], rtol=1e-5)
    # Truthful counts: every size compiled twice (evicted in between), against once.
    assert limited.compilations == len(sizes) and limited.programs_kept == 2
    assert roomy.compilations == roomy.programs_kept == 8
    [message] = churn_warnings(caplog)
    assert "input 'X' changes size on axis 0" in message and "drop_last" in message, message


def test_the_warning_comes_once_and_names_the_changing_input(caplog):
    trainer = onnxtrain.Trainer(linreg_model(), max_programs=1)
    with caplog.at_level(logging.WARNING, logger="onnxtrain"):
        for size in range(1, 4):
            trainer.evaluate(batch(size))
            trainer.infer({"X": batch(size)["X"]})
    [message] = churn_warnings(caplog)
    assert "(1, then 2)" in message and "input 'X'" in message, message
    assert trainer.programs_kept == 2    # one evaluation program, one inference program


def test_an_evicted_shape_recompiles_to_the_same_results():
    trainer = onnxtrain.Trainer(linreg_model(), max_programs=1)
    feeds = batch(5, offset=3)
    first = trainer.evaluate(feeds)["loss"]
    predicted = trainer.infer({"X": feeds["X"]})["Y_pred"]
    trainer.evaluate(batch(6))
    trainer.infer({"X": batch(6)["X"]})
    compiled = trainer.compilations
    assert np.array_equal(trainer.evaluate(feeds)["loss"], first)
    assert np.array_equal(trainer.infer({"X": feeds["X"]})["Y_pred"], predicted)
    assert trainer.compilations == compiled + 2


def test_the_same_shape_never_recompiles():
    trainer = onnxtrain.Trainer(linreg_model(), max_programs=1)
    for offset in range(5):
        trainer.step(batch(4, offset))
    assert trainer.compilations == trainer.programs_kept == 1


@pytest.mark.slow  # several trainers, or many compilations
def test_multi_step_calls_are_bounded_too(caplog):
    trainer = onnxtrain.Trainer(linreg_model(), max_programs=1)
    reference = onnxtrain.Trainer(linreg_model())
    batches = [batch(size) for size in (2, 2, 3, 3, 2, 2)]
    with caplog.at_level(logging.WARNING, logger="onnxtrain"):
        trainer.run_steps(batches)
    for feeds in batches:
        reference.step(feeds)
    np.testing.assert_allclose(np.asarray(trainer.state["W"]), np.asarray(reference.state["W"]), rtol=1e-6)
    assert trainer.programs_kept == 1
    assert len(churn_warnings(caplog)) == 1


@pytest.mark.slow  # several trainers, or many compilations
def test_a_fine_tuner_keeps_max_programs_too():
    import optax

    tuner = onnxtrain.finetune(make_training_model(linreg_graph()), "mse", optax.sgd(0.1), label="Y",
                               max_programs=1)
    for size in (2, 3, 4, 2):
        tuner.step(batch(size))
    assert tuner.programs_kept == 1 and tuner.compilations == 4


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8", None])
def test_max_programs_must_be_a_positive_integer(bad):
    with pytest.raises(onnxtrain.InputError, match="max_programs"):
        onnxtrain.Trainer(linreg_model(), max_programs=bad)
    with pytest.raises(onnxtrain.InputError, match="max_programs"):
        onnxtrain.finetune(linreg_model(), "mse", label="Y2", max_programs=bad)


def test_the_default_limit_is_documented():
    assert f"max_programs={DEFAULT_MAX_PROGRAMS}" in Path(onnxtrain.__file__).parent.parent.joinpath(
        "README.md").read_text()


@pytest.mark.slow  # several trainers, or many compilations
@pytest.mark.parametrize("steps_per_call", [1, 2])
def test_fit_drop_last_skips_a_short_last_batch(steps_per_call):
    batches = [batch(4, offset) for offset in range(3)] + [batch(2, 9)]
    dropped = onnxtrain.Trainer(linreg_model())
    history = dropped.fit(batches, epochs=2, progress=False, steps_per_call=steps_per_call, drop_last=True)
    assert len(history["step_loss"]) == 6
    reference = onnxtrain.Trainer(linreg_model())
    reference.fit(batches[:3], epochs=2, progress=False, steps_per_call=steps_per_call)
    assert_state_equal(dropped, snapshot(reference))
    assert dropped.compilations == reference.compilations
    kept = onnxtrain.Trainer(linreg_model())
    assert len(kept.fit(batches, epochs=2, progress=False, steps_per_call=steps_per_call)["step_loss"]) == 8
    assert kept.compilations > dropped.compilations


@pytest.mark.slow  # several trainers, or many compilations
def test_fit_drop_last_keeps_batches_a_loader_refills():
    """drop_last holds each batch while it reads the next: it must hold a copy."""
    batches = [batch(4, offset) for offset in range(3)] + [batch(2, 9)]

    def refilled():
        x, y = np.empty((4, 1), np.float32), np.empty((4, 1), np.float32)
        for feeds in batches[:3]:
            x[...], y[...] = feeds["X"], feeds["Y"]
            yield {"X": x, "Y": y}
        yield batches[3]

    trainer = onnxtrain.Trainer(linreg_model())
    trainer.fit(refilled, progress=False, drop_last=True)
    reference = onnxtrain.Trainer(linreg_model())
    reference.fit(batches[:3], progress=False)
    assert_state_equal(trainer, snapshot(reference))


@pytest.mark.parametrize("batches", [[batch(3)], [batch(3), batch(3)]], ids=["one", "same"])
def test_fit_drop_last_keeps_batches_of_one_size(batches):
    # No batches at all is an InputError (tests/trainer/test_fit_data.py).
    trainer = onnxtrain.Trainer(linreg_model())
    assert len(trainer.fit(batches, progress=False, drop_last=True)["step_loss"]) == len(batches)


@pytest.mark.slow
def test_two_hundred_batch_sizes_keep_memory_and_programs_bounded():
    """The issue's case, in a fresh process: 200 batch sizes through a small model."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, str(WORKER), "8", "200"], capture_output=True, text=True,
                            env=environment, timeout=1800, check=True)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    print(figures)
    assert figures["compilations"] == 200 and figures["kept"] <= 8
    assert figures["warnings"] == 1
    assert figures["exact"]
    # After the first sizes, memory stays nearly flat: programs are freed as fast as they are
    # made (kept, each program adds megabytes; what remains is JAX's own bounded caches).
    assert figures["growth_after_warmup_mib"] < 60, figures
