"""Trainer.compile: the programs step(), fit(), infer() and evaluate() run for a batch shape,
compiled ahead (side by side in threads) without running anything; after it those calls
compile nothing and give exactly what a trainer that compiled on demand gives. fit's bar says
"compiling" while a program compiles and leaves that time out of its rate.
"""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import onnx
import optax
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain._engine import compilation_cache, executable_cache
from onnxtrain._engine.executable_cache import ExecutableCache
from onnxtrain._engine.progress import Progress
from onnxtrain.fitting import fit


def classifier() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["logits"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
                              [numpy_helper.from_array(rng.normal(size=(8, 16)).astype(np.float32), "W1"),
                               numpy_helper.from_array(rng.normal(size=(16, 3)).astype(np.float32), "W2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def batches(count: int = 4) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(size=(6, 8)).astype(np.float32), "labels": rng.integers(0, 3, 6).astype(np.int64)}
            for _ in range(count)]


def everything(trainer) -> tuple:
    """step, fit (with evaluation), infer and evaluate on fixed data: what each returns."""
    data = batches()
    loss = np.asarray(trainer.step(data[0])["loss"])
    history = trainer.fit(data, epochs=2, eval_data=data[:2], verbose=0)
    prediction = np.asarray(trainer.infer({"x": data[0]["x"]})["logits"])
    evaluated = trainer.evaluate(data[1])
    return loss, history, prediction, {name: np.asarray(value) for name, value in evaluated.items()}


def assert_same(first: tuple, second: tuple) -> None:
    np.testing.assert_array_equal(first[0], second[0])
    assert first[1] == second[1]
    np.testing.assert_array_equal(first[2], second[2])
    assert first[3].keys() == second[3].keys()
    for name in first[3]:
        np.testing.assert_array_equal(first[3][name], second[3][name])


@pytest.mark.parametrize("nan_policy", ["raise", "ignore"])
def test_after_compile_nothing_compiles_and_results_are_the_same(nan_policy):
    model = onnxtrain.make_training_model(classifier(), loss="cross_entropy", output="logits")
    on_demand = onnxtrain.Trainer(model, nan_policy=nan_policy)
    expected = everything(on_demand)
    ahead = onnxtrain.Trainer(model, nan_policy=nan_policy)
    compiled = ahead.compile(batches()[0])
    # The step the host waits for, fit's (run ahead) when checked, inference and evaluation.
    assert compiled == ahead.compilations == (4 if nan_policy == "raise" else 3)
    assert ahead.compile(batches()[0]) == 0
    assert_same(expected, everything(ahead))
    assert ahead.compilations == compiled == on_demand.compilations


def test_compile_loads_what_the_executable_cache_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(compilation_cache, "_configured", True)
    monkeypatch.setenv("ONNXTRAIN_COMPILATION_CACHE", str(tmp_path))
    compilation_cache.executable_cache.cache_clear()
    try:
        model = onnxtrain.make_training_model(classifier(), loss="cross_entropy", output="logits")
        first = onnxtrain.Trainer(model)
        assert first.compile(batches()[0]) == 4
        second = onnxtrain.Trainer(model)
        assert second.compile(batches()[0]) == 0 and second.compilations == 4
        assert_same(everything(first), everything(second))
    finally:
        compilation_cache.executable_cache.cache_clear()


def test_fine_tuning_compiles_ahead_too():
    tuner = onnxtrain.finetune(classifier(), loss="cross_entropy", optimizer=optax.adam(1e-2))
    assert tuner.compile(batches()[0]) >= 2
    before = tuner.compilations
    tuner.fit(batches(), verbose=0)
    tuner.infer({"x": batches()[0]["x"]})
    assert tuner.compilations == before


class FirstStep(onnxtrain.callbacks.Callback):
    """The trainer's program count when fit's first step has run."""

    def on_train_begin(self, trainer):
        self.trainer, self.programs = trainer, None

    def on_step_end(self, step, logs):
        if self.programs is None:
            self.programs = self.trainer.compilations


def arrays(rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rows)
    return rng.normal(size=(rows, 8)).astype(np.float32), rng.integers(0, 3, rows).astype(np.int64)


@pytest.mark.parametrize("nan_policy", ["raise", "ignore"])
def test_fit_has_its_first_epochs_programs_ready_before_its_first_step(nan_policy):
    """20 training rows in batches of 6 end in a short batch of 2, 10 evaluation rows in one
    of 4: fit gets the four programs ready (side by side) before any step runs, and trains
    exactly as steps run one by one do."""
    model = onnxtrain.make_training_model(classifier(), loss="cross_entropy", output="logits")
    trainer, seen = onnxtrain.Trainer(model, nan_policy=nan_policy), FirstStep()
    history = trainer.fit(arrays(20), batch_size=6, eval_data=arrays(10), epochs=2, verbose=0, callbacks=[seen])
    assert seen.programs == trainer.compilations == 4
    by_hand = onnxtrain.Trainer(model, nan_policy=nan_policy)
    x, y = arrays(20)
    losses = [float(by_hand.step({"x": x[start:start + 6], "labels": y[start:start + 6]})["loss"])
              for _ in range(2) for start in range(0, 20, 6)]
    np.testing.assert_array_equal(history["step_loss"], losses)


def test_compile_takes_several_batch_shapes_at_once():
    model = onnxtrain.make_training_model(classifier(), loss="cross_entropy", output="logits")
    trainer = onnxtrain.Trainer(model)
    x, y = arrays(20)
    # Per shape: the step the host waits for, fit's checked step, inference and evaluation.
    assert trainer.compile([{"x": x[:6], "labels": y[:6]}, {"x": x[18:], "labels": y[18:]}]) == 8
    trainer.fit((x, y), batch_size=6, eval_data=(x[:8], y[:8]), verbose=0)
    trainer.infer({"x": x[18:]})
    assert trainer.compilations == 8


def test_fit_with_steps_per_call_gets_evaluation_ready_ahead():
    trainer, seen = onnxtrain.Trainer(onnxtrain.make_training_model(classifier(), loss="cross_entropy",
                                                                     output="logits")), FirstStep()
    trainer.fit(arrays(18), batch_size=6, eval_data=arrays(10), steps_per_call=3, verbose=0, callbacks=[seen])
    # Evaluation of 6 and of 4 rows, and the one program of three stacked steps.
    assert seen.programs == trainer.compilations == 3


def test_fit_loads_its_programs_off_the_callers_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(compilation_cache, "_configured", True)
    monkeypatch.setenv("ONNXTRAIN_COMPILATION_CACHE", str(tmp_path))
    compilation_cache.executable_cache.cache_clear()
    loads = []
    load = ExecutableCache.load
    monkeypatch.setattr(ExecutableCache, "load",
                        lambda self, parts: loads.append(threading.current_thread()) or load(self, parts))
    try:
        model = onnxtrain.make_training_model(classifier(), loss="cross_entropy", output="logits")
        fits = []
        for _ in range(2):   # compiled and stored, then loaded
            trainer, seen = onnxtrain.Trainer(model), FirstStep()
            fits.append(trainer.fit(arrays(20), batch_size=6, eval_data=arrays(10), verbose=0, callbacks=[seen]))
            assert seen.programs == 4
        assert len(loads) == 4 and threading.main_thread() not in loads
        assert fits[0] == fits[1]
    finally:
        compilation_cache.executable_cache.cache_clear()


def test_each_stored_step_keeps_the_fault_layout_of_its_own_trace(tmp_path, monkeypatch):
    """With training metrics the step also returns its prediction, whose share of the NaN/Inf
    evidence grows with the batch: the full and the short batch's programs, traced one after
    the other and compiled together, each store their own layout (3 x 4 values apart), and a
    fault in a loaded program is reported by name."""
    monkeypatch.setattr(compilation_cache, "_configured", True)
    monkeypatch.setenv("ONNXTRAIN_COMPILATION_CACHE", str(tmp_path))
    compilation_cache.executable_cache.cache_clear()
    try:
        model = onnxtrain.make_training_model(classifier(), loss="cross_entropy", output="logits")
        onnxtrain.Trainer(model).fit(arrays(20), batch_size=6, metrics=["accuracy"], verbose=0)
        memos = []
        for path in (tmp_path / "executables").glob("*.executable"):
            head = json.loads(path.read_bytes()[len(executable_cache.MAGIC):].split(b"\n", 1)[0])
            memos.append(head["memo"])
        names, ends = zip(*sorted(memos, key=lambda memo: memo[1][-1]))
        assert names[0] == names[1] and ends[1][-1] - ends[0][-1] == 3 * (6 - 2)
        x, y = arrays(20)
        x[15] = np.nan   # in the third full batch, after the short one was traced
        with pytest.raises(onnxtrain.NumericError, match=r"'W1'.*'loss', 'prediction'"):
            onnxtrain.Trainer(model).fit((x, y), batch_size=6, metrics=["accuracy"], verbose=0)
    finally:
        compilation_cache.executable_cache.cache_clear()


def test_compile_checks_the_feeds_like_step():
    trainer = onnxtrain.Trainer(onnxtrain.make_training_model(classifier(), loss="cross_entropy", output="logits"))
    with pytest.raises(onnxtrain.InputError, match="labels"):
        trainer.compile({"x": batches()[0]["x"]})
    assert trainer.compilations == 0


def test_the_bar_says_compiling_and_leaves_the_compile_out_of_its_rate(capsys):
    """A first step that compiles for 2 s (a stand-in sleeping inside the watcher) then steps
    of no time: the bar's elapsed time and rate ignore the 2 s."""
    import time

    from onnxtrain._engine.compiled import _watching

    def run_steps(chunk):
        watcher = _watching.watcher
        if not getattr(run_steps, "compiled", False):
            run_steps.compiled = True
            with watcher.compiling("step"):
                print("\n[inside]", flush=True)
                time.sleep(2)
        return [{"loss": np.float32(1)} for _ in chunk]

    fit(run_steps, [{}] * 50, epochs=1, verbose=1)
    text = capsys.readouterr().out.replace("\r", "\n")
    assert "epoch 1/1 (compiling)" in text
    final = [line for line in text.splitlines() if "50/50" in line][-1]
    assert re.search(r"\[00:00<", final), final


def test_verbose_2_counts_the_compile_apart(capsys):
    import time

    from onnxtrain._engine.compiled import _watching

    def run_steps(chunk):
        if not getattr(run_steps, "compiled", False):
            run_steps.compiled = True
            with _watching.watcher.compiling("step"):
                time.sleep(0.3)
        return [{"loss": np.float32(1)} for _ in chunk]

    fit(run_steps, [{}] * 3, epochs=2, verbose=2)
    first, second = capsys.readouterr().out.strip().splitlines()
    assert re.search(r"of which compiling 0\.[3-9]s", first), first
    assert "compiling" not in second, second


def test_without_fit_no_watcher_is_left_behind():
    from onnxtrain._engine.compiled import _watching

    fit(lambda chunk: [{"loss": np.float32(1)} for _ in chunk], [{}], verbose=0)
    assert getattr(_watching, "watcher", None) is None
    assert isinstance(Progress(0, 1), Progress)


@pytest.mark.slow
def test_the_compile_command_fills_the_cache_that_a_new_process_reads(tmp_path):
    """`onnxtrain compile` in one process; in the next, every program is found in the cache."""
    import os
    import subprocess
    import sys

    onnx.save(onnxtrain.make_training_model(classifier(), loss="cross_entropy", output="logits"),
              tmp_path / "train.onnx")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x=rng.normal(size=(50, 8)).astype(np.float32),
             labels=rng.integers(0, 3, 50).astype(np.int64))
    env = {**os.environ, "ONNXTRAIN_COMPILATION_CACHE": str(tmp_path / "cache")}
    env.pop("ONNXTRAIN_EXECUTABLE_CACHE", None)
    printed = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "onnxtrain", "compile", str(tmp_path / "train.onnx"),
                               "--data", str(tmp_path / "data.npz"), "--batch-size", "16"],
                              capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        printed.append(done.stdout.strip())
    # 50 rows in batches of 16: a full batch and a short one, four programs each.
    assert printed[0].startswith("8 programs compiled") and "2 batch shape(s), 0 found" in printed[0], printed
    assert printed[1].startswith("0 programs compiled") and "8 found in the cache" in printed[1], printed
    assert str(tmp_path / "cache" / "executables") in printed[1]
