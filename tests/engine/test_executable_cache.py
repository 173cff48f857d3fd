"""onnxtrain's executable cache: a trainer made again (in this process or a new one) loads its
programs instead of tracing them, with identical results; an entry stored under any other key
part (jaxlib, CPU features, backend, onnxtrain's source, the model) is never loaded, a damaged
one costs one warning and a compile, and a folder others can write is refused.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain._engine import compilation_cache, executable_cache
from onnxtrain._engine.executable_cache import ExecutableCache
from onnxtrain._io.digest import model_digest
from onnxtrain._io.model import load_model, save_model

TRACE = "/jax/core/compile/jaxpr_trace_duration"


def inference_model(scale: float = 1.0) -> onnx.ModelProto:
    """x -> Relu(x @ W + b) * scale: W and b train, `scale` is a constant of the model."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Mul", ["r", "scale"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
                              [numpy_helper.from_array(rng.normal(size=(6, 3)).astype(np.float32), "W"),
                               numpy_helper.from_array(np.full(3, 0.1, np.float32), "b"),
                               numpy_helper.from_array(np.float32(scale), "scale")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def training_model(scale: float = 1.0) -> onnx.ModelProto:
    return onnxtrain.make_training_model(inference_model(scale), loss="mse", optimizer=onnxtrain.optim.Adam(1e-2))


def batch(offset: float = 0.0) -> dict[str, np.ndarray]:
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6) + offset
    return {"x": x, "labels": np.tile(np.array([0.5, -0.2, 1.0], np.float32), (4, 1))}


@pytest.fixture
def cache_folder(tmp_path, monkeypatch):
    """This test's own executable cache (JAX's persistent cache stays as the suite set it)."""
    monkeypatch.setattr(compilation_cache, "_configured", True)   # JAX's own cache stays off
    monkeypatch.setenv("ONNXTRAIN_COMPILATION_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ONNXTRAIN_EXECUTABLE_CACHE", raising=False)
    compilation_cache.executable_cache.cache_clear()
    yield tmp_path / "cache" / "executables"
    compilation_cache.executable_cache.cache_clear()


@pytest.fixture
def traces():
    """How many functions JAX traces from now on."""
    counted = collections.Counter()
    listener = lambda event, seconds, **_: counted.update([event])  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    yield lambda: counted[TRACE]
    jax.monitoring.unregister_event_duration_listener(listener)


def run(trainer: onnxtrain.Trainer) -> tuple[list, dict, np.ndarray]:
    """Three steps, then inference: the losses, the state and the prediction."""
    losses = [np.asarray(trainer.step(batch(offset))["loss"]) for offset in (0.0, 0.5, -0.5)]
    state = {name: np.asarray(value) for name, value in trainer.state.items()}
    return losses, state, np.asarray(trainer.infer({"x": batch()["x"]})["y"])


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.executable"))


def assert_same_run(first: tuple, second: tuple) -> None:
    for a, b in zip(first[0], second[0]):
        np.testing.assert_array_equal(a, b)
    assert first[1].keys() == second[1].keys()
    for name in first[1]:
        np.testing.assert_array_equal(first[1][name], second[1][name], err_msg=name)
    np.testing.assert_array_equal(first[2], second[2])


def test_a_trainer_made_again_loads_its_programs_and_runs_the_same(cache_folder, traces):
    model = training_model()
    cold = run(onnxtrain.Trainer(model))
    stored = entries(cache_folder)
    assert len(stored) == 2   # the step and inference
    warm_trainer = onnxtrain.Trainer(model)
    before = traces()
    warm = run(warm_trainer)
    # Nothing of the step or the inference pass is traced again (small helpers may be).
    assert traces() - before <= 2, traces() - before
    assert_same_run(cold, warm)
    assert warm_trainer.compilations == 2
    # And both match a trainer that never saw the cache.
    os.environ["ONNXTRAIN_EXECUTABLE_CACHE"] = "off"
    try:
        compilation_cache.executable_cache.cache_clear()
        assert_same_run(cold, run(onnxtrain.Trainer(model)))
    finally:
        del os.environ["ONNXTRAIN_EXECUTABLE_CACHE"]


def test_a_loaded_step_still_names_the_values_a_fault_reached(cache_folder):
    model = training_model()
    bad = {**batch(), "x": np.full((4, 6), np.nan, np.float32)}
    messages = []
    for _ in range(2):   # traced, then loaded
        trainer = onnxtrain.Trainer(model)
        with pytest.raises(onnxtrain.NumericError) as raised:
            trainer.step(bad)
        messages.append(str(raised.value))
    assert messages[0] == messages[1] and "'W'" in messages[1], messages


def header(path: Path) -> dict:
    data = path.read_bytes()
    assert data.startswith(executable_cache.MAGIC)
    return json.loads(data[len(executable_cache.MAGIC):].split(b"\n", 1)[0])


@pytest.fixture
def looked_up(monkeypatch):
    """The key parts of every entry looked up from now on."""
    seen: list[dict] = []
    holds = ExecutableCache.holds

    def spy(self, parts):
        seen.append(dict(parts))
        return holds(self, parts)

    monkeypatch.setattr(ExecutableCache, "holds", spy)
    return seen


@pytest.mark.parametrize("part", ["jaxlib", "cpu", "backend", "onnxtrain", "devices", "python"])
def test_an_entry_of_another_environment_is_never_loaded(cache_folder, traces, looked_up, monkeypatch,
                                                          caplog, part):
    model = training_model()
    cold = run(onnxtrain.Trainer(model))
    genuine = {(header(path)["parts"]["program"], header(path)["parts"]["arguments"]): path
               for path in entries(cache_folder)}
    original = executable_cache._host_parts()
    monkeypatch.setattr(executable_cache, "_host_parts", lambda: {**original, part: "forged"})
    # Another environment's entries have other names: a plain miss, compiled and stored anew.
    looked_up.clear()
    before = traces()
    assert_same_run(cold, run(onnxtrain.Trainer(model)))
    assert traces() - before >= 2 and len(entries(cache_folder)) == 4
    # A forged entry: each genuine one copied over the name this environment looks up.
    cache = ExecutableCache(cache_folder)
    for parts in looked_up:
        shutil.copy(genuine[parts["program"], parts["arguments"]], cache_folder / f"{cache.key(parts)}.executable")
    before = traces()
    with caplog.at_level(logging.WARNING, logger="onnxtrain"):
        assert_same_run(cold, run(onnxtrain.Trainer(model)))
    assert traces() - before >= 2
    refused = [r.getMessage() for r in caplog.records if "executable cache" in r.getMessage()]
    assert len(refused) == 1 and f"stored for another {part}" in refused[0], refused


def test_an_entry_of_another_model_is_never_loaded(cache_folder, traces, looked_up):
    """Two models that differ only in a constant's value share every shape: the constant's
    value is part of the model's digest, so neither loads the other's programs."""
    first = run(onnxtrain.Trainer(training_model(scale=1.0)))
    before = traces()
    second = run(onnxtrain.Trainer(training_model(scale=2.0)))
    assert traces() - before >= 2
    assert not np.array_equal(first[2], second[2])
    fronts = {parts["front"] for parts in looked_up}
    assert len(fronts) == 2 and len(entries(cache_folder)) == 4


def test_a_damaged_entry_costs_one_warning_and_a_compile(cache_folder, traces, caplog):
    model = training_model()
    cold = run(onnxtrain.Trainer(model))
    step, inference = sorted(entries(cache_folder), key=lambda path: path.stat().st_size, reverse=True)
    data = step.read_bytes()
    step.write_bytes(data[: len(data) // 2])                 # truncated
    flipped = bytearray(inference.read_bytes())
    flipped[-100] ^= 0xFF                                       # one byte changed
    inference.write_bytes(bytes(flipped))
    before = traces()
    with caplog.at_level(logging.WARNING, logger="onnxtrain"):
        assert_same_run(cold, run(onnxtrain.Trainer(model)))
    assert traces() - before >= 2
    refused = [r.getMessage() for r in caplog.records if "executable cache" in r.getMessage()]
    assert len(refused) == 1 and "truncated or damaged" in refused[0], refused
    # Both were replaced by good entries: the next trainer loads them.
    before = traces()
    assert_same_run(cold, run(onnxtrain.Trainer(model)))
    assert traces() - before <= 2
    # Not an entry at all: the same.
    for path in entries(cache_folder):
        path.write_bytes(b"not an executable")
    assert_same_run(cold, run(onnxtrain.Trainer(model)))


def test_a_folder_others_can_write_is_refused(cache_folder, caplog):
    cache_folder.mkdir(parents=True)
    cache_folder.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="onnxtrain"):
        trainer = onnxtrain.Trainer(training_model())
        run(trainer)
    [message] = [r.getMessage() for r in caplog.records if "executable cache" in r.getMessage()]
    assert "not private" in message and "others can write" in message, message
    assert not entries(cache_folder)


def test_an_entry_others_can_write_is_not_loaded(cache_folder, caplog):
    model = training_model()
    cold = run(onnxtrain.Trainer(model))
    for path in entries(cache_folder):
        path.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="onnxtrain"):
        assert_same_run(cold, run(onnxtrain.Trainer(model)))
    [message] = [r.getMessage() for r in caplog.records if "executable cache" in r.getMessage()]
    assert "others can write the entry" in message, message


def test_the_least_recently_used_entries_go_past_the_size_bound(cache_folder):
    run(onnxtrain.Trainer(training_model()))
    sizes = {path.name: path.stat().st_size for path in entries(cache_folder)}
    cache = ExecutableCache(cache_folder, max_bytes=max(sizes.values()))
    oldest = min(entries(cache_folder), key=lambda path: path.stat().st_mtime_ns)
    os.utime(oldest, ns=(1, 1))
    cache._bound()
    assert [path.name for path in entries(cache_folder)] == sorted(set(sizes) - {oldest.name})


def test_the_digest_reads_side_files_and_ignores_the_recorded_prng_key(tmp_path):
    trainer = onnxtrain.Trainer(training_model())
    trainer.step(batch())
    trainer.export(tmp_path / "exported.onnx")
    exported = load_model(tmp_path / "exported.onnx")
    save_model(exported, tmp_path / "a.onnx", external_data=True, size_threshold=16)
    # The same file loaded twice, its side file mapped each time: one digest.
    digest = model_digest(load_model(tmp_path / "a.onnx"))
    assert digest == model_digest(load_model(tmp_path / "a.onnx"))
    # Only the recorded key differs: the same digest.
    keyless = load_model(tmp_path / "a.onnx")
    [index] = [i for i, entry in enumerate(keyless.metadata_props) if entry.key == "onnxtrain.prng_key"]
    del keyless.metadata_props[index]
    assert model_digest(keyless) == digest
    # One weight's value differs, in the side file: another digest.
    for tensor in exported.graph.initializer:
        if tensor.name == "W":
            values = bytearray(tensor.raw_data)
            values[0] ^= 1
            tensor.raw_data = bytes(values)
    save_model(exported, tmp_path / "b.onnx", external_data=True, size_threshold=16)
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith("b.")] != ["b.onnx"]
    assert model_digest(load_model(tmp_path / "b.onnx")) != digest


def test_fine_tuning_keeps_to_jax_caches(cache_folder):
    """finetune's optimizer is Python, outside the model: its programs are never cached here."""
    import optax

    tuner = onnxtrain.finetune(inference_model(), loss="mse", optimizer=optax.sgd(0.1))
    tuner.step(batch())
    tuner.infer({"x": batch()["x"]})
    assert not entries(cache_folder)


WARM = """
import json, sys, time
start = time.perf_counter()
import collections, jax, numpy as np, onnxtrain
counted = collections.Counter()
jax.monitoring.register_event_duration_secs_listener(lambda event, seconds, **_: counted.update([event]))
trainer = onnxtrain.Trainer(sys.argv[1])
loss = trainer.step({"x": np.ones((4, 6), np.float32), "labels": np.zeros((4, 3), np.float32)})["loss"]
print(json.dumps({"loss": float(loss), "traces": counted["%s"]}))
""" % TRACE


@pytest.mark.slow
def test_a_new_process_loads_the_step_instead_of_tracing_it(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(training_model(), path)
    env = {**os.environ, "ONNXTRAIN_COMPILATION_CACHE": str(tmp_path / "cache")}
    env.pop("ONNXTRAIN_EXECUTABLE_CACHE", None)
    results = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", WARM, str(path)], capture_output=True, text=True,
                              env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    (cold, warm) = results
    assert cold["loss"] == warm["loss"]
    assert cold["traces"] >= warm["traces"] + 1, results


def test_a_cached_program_given_other_argument_types_runs_through_jax_jit(cache_folder):
    """The program is chosen by its feeds' signature; an argument past the feeds that changes
    type (here a weakly typed scalar, then a float64 one) is refused by the executable before
    it runs, and jax.jit compiles for it instead."""
    from onnxtrain._engine.compiled import Compiled, ProgramLimit
    from onnxtrain._engine.executable_cache import ProgramCache

    cache = ProgramCache(compilation_cache.executable_cache(), "front")
    for attempt in range(2):   # compiled and stored, then loaded
        program = Compiled(lambda scale, feeds: feeds["x"] * scale, "test", ProgramLimit(cache=cache), 1,
                           identity="scaled")
        x = {"x": np.arange(3, dtype=np.float32)}
        np.testing.assert_array_equal(program(np.float32(2), x), [0, 2, 4])
        np.testing.assert_array_equal(program(np.float32(3), x), [0, 3, 6])
        with jax.enable_x64(True):
            np.testing.assert_array_equal(program(np.float64(0.5), x), [0, 0.5, 1])
        np.testing.assert_array_equal(program(np.float32(4), x), [0, 4, 8])
        assert len(entries(cache_folder)) == 1


def test_a_loaded_random_step_draws_what_the_traced_one_drew(cache_folder, traces):
    """Dropout's key is an argument like any other: the loaded program advances the state's
    key and draws the same masks as the program it was stored from."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Dropout", ["h", "ratio", "on"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
                              [numpy_helper.from_array(rng.normal(size=(6, 3)).astype(np.float32), "W"),
                               numpy_helper.from_array(np.float32(0.5), "ratio"),
                               numpy_helper.from_array(np.bool_(True), "on")])
    model = onnxtrain.make_training_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                                            ir_version=9), loss="mse")
    feeds = {"x": rng.normal(size=(4, 6)).astype(np.float32), "labels": np.ones((4, 3), np.float32)}
    runs = []
    for _ in range(2):
        trainer = onnxtrain.Trainer(model, seed=3)
        before = traces()
        runs.append([float(trainer.step(feeds)["loss"]) for _ in range(4)])
    assert traces() - before <= 2
    assert runs[0] == runs[1] and len(set(runs[0])) == 4, runs
