"""bench/run.py --quick still runs end to end: builds the models, runs each system in its own
process and prints the comparison table (the benchmark itself is not part of the suite)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support import paths

ROOT = paths.REPO


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_run_module(monkeypatch):
    """bench/run.py as a module. Its `import models` must find bench/models.py, not any other
    module imported under that name before; monkeypatch puts back whatever was there for the
    tests that come next."""
    monkeypatch.setitem(sys.modules, "models", _load(ROOT / "bench" / "models.py", "models"))
    return _load(ROOT / "bench" / "run.py", "bench_run")


def test_table_compares_multi_step_rows_with_the_faster_hand_written_jax(monkeypatch):
    def row(median, rss):
        return {"median": median, "per_round": [median], "p10": median, "p90": median, "rss": rss,
                "first_loss": 1.0, "note": ""}

    results = {"cnn": {"onnxtrain-step": row(0.024, 330), "onnxtrain-step-unchecked": row(0.023, 330),
                       "onnxtrain-fit": row(0.022, 360), "jax-handwritten": row(0.020, 300),
                       "jax-handwritten-guarded": row(0.021, 300), "jax-handwritten-scan": row(0.100, 320),
                       "ort-training": row(0.025, 90)},
               "mlp": {"onnxtrain-fit": row(0.0012, 280), "jax-handwritten": row(0.0010, 250),
                       "jax-handwritten-scan": row(0.0008, 350)}}
    cells = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[6:11]]
             for line in _bench_run_module(monkeypatch).table(results).splitlines()[2:]}
    # × JAX, × ORT, RSS MB, RSS × JAX, RSS × ORT
    # The guarded step against the guarded hand-written one; the unchecked against the plain.
    assert cells["cnn", "onnxtrain-step"] == ["1.14", "0.96", "330", "1.10", "3.67"]
    assert cells["cnn", "onnxtrain-step-unchecked"] == ["1.15", "0.92", "330", "1.10", "3.67"]
    assert cells["cnn", "onnxtrain-fit"] == ["1.10", "0.88", "360", "1.20", "4.00"]
    assert cells["cnn", "jax-handwritten-scan"] == ["5.00", "4.00", "320", "1.07", "3.56"]
    assert cells["mlp", "onnxtrain-fit"] == ["1.50", "—", "280", "0.80", "—"]
    assert cells["mlp", "jax-handwritten"] == ["1.00", "—", "250", "1.00", "—"]


def test_time_ratios_pair_the_processes_of_each_round(monkeypatch):
    """A slow spell of the machine that catches one system's process in a round but the other's
    in the next must not show as a difference between the systems."""
    run = _bench_run_module(monkeypatch)
    onnxtrain_rounds = [1.1, 1.1, 2.2, 2.2, 2.2]
    jax_rounds = [1.0, 1.0, 1.0, 2.0, 2.0]

    def runs(rounds):
        return [{"times": [seconds], "peak_rss_mb": 100, "first_loss": 1.0} for seconds in rounds]

    results = {"mlp": {"onnxtrain-step-unchecked": run.summarize(runs(onnxtrain_rounds)),
                       "jax-handwritten": run.summarize(runs(jax_rounds))}}
    line = next(line for line in run.table(results).splitlines() if "| onnxtrain-step-unchecked |" in line)
    # The medians alone would say 2.2 / 1.0.
    assert line.split("|")[6].strip() == "1.10"


@pytest.mark.slow
def test_guarded_hand_written_step_keeps_the_state_on_a_fault(monkeypatch):
    """The reference for onnxtrain's default step gives its guarantee: a batch with a NaN
    leaves every state value as it was and says so; a clean batch updates them."""
    import numpy as np

    models = _bench_run_module(monkeypatch).models
    step = models.train_step_jax_guarded(models.JAX_FORWARD["mlp"])
    state = models.adam_state_jax(models.mlp_weights())
    before = [np.asarray(leaf) for leaf in models.jax.tree.leaves(state)]
    x = np.random.default_rng(0).standard_normal((4, 784)).astype(np.float32)
    labels = np.arange(4)
    x[1, 3] = np.nan
    state, loss, finite = step(state, x, labels)
    assert not bool(finite) and np.isnan(float(loss))
    for old, new in zip(before, models.jax.tree.leaves(state)):
        np.testing.assert_array_equal(old, np.asarray(new))
    x[1, 3] = 0.0
    state, loss, finite = step(state, x, labels)
    assert bool(finite) and np.isfinite(float(loss))
    assert not np.array_equal(before[0], np.asarray(models.jax.tree.leaves(state)[0]))


@pytest.mark.slow
def test_quick_benchmark_prints_a_table_with_every_jax_system():
    """The multi-step rows' first losses come from their first call: the spread check covers them."""
    systems = ["onnxtrain-step", "onnxtrain-fit", "jax-handwritten", "jax-handwritten-guarded", "jax-handwritten-scan"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--models", "mlp", "--systems", ",".join(systems)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| mlp |")]
    assert [row.split("|")[2].strip().split(" (")[0] for row in rows] == systems, done.stdout
    assert "over 5 systems" in done.stdout and "MISMATCH" not in done.stdout


@pytest.mark.slow
def test_memory_benchmark_runs_every_policy_and_entry_point_on_a_tiny_model():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "memory.py"), "--layers", "2", "--width", "64"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("nan_policy=")]
    assert [row.split(":")[0] for row in rows] == [
        f"nan_policy={policy!r}, {run}" for policy in ("ignore", "raise")
        for run in ("3 Trainer.step calls", "fit(8 batches, steps_per_call=4)")], done.stdout
    assert all("(peak - baseline) / (state + activations) = " in row for row in rows)
    adapted = [line for line in done.stdout.splitlines() if line.startswith("adapter-style")]
    assert [row.split(":")[0] for row in adapted] == [
        f"adapter-style (LoRA adapters train, weights frozen), {run}"
        for run in ("3 Trainer.step calls", "fit(8 batches, steps_per_call=4)")], done.stdout
    assert all("(peak - baseline) / (weights + state + activations) = " in row for row in adapted)


@pytest.mark.slow
def test_large_model_benchmark_runs_on_a_tiny_export(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "large_model.py"), "--folder", str(tmp_path),
                           "--layers", "1", "--width", "64", "--heads", "2", "--steps", "2"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert list(tmp_path.glob("*.onnx.data")), "the export keeps its weights in a side file"
    assert "side file mapped: load " in done.stdout and "first step " in done.stdout, done.stdout
    assert "peak RSS / (file + state + activations) = " in done.stdout, done.stdout


@pytest.mark.slow
def test_kernel_profile_lists_kernels_of_both_steps():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_times.py"), "--model", "mlp", "--steps", "3", "--top", "2"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    headers = [index for index, line in enumerate(lines) if " us of kernels per step (" in line]
    assert [lines[index].split(":")[0] for index in headers] == [
        "onnxtrain Trainer.step (nan_policy='raise')", "hand-written JAX"], done.stdout
    for index in headers:
        rows = lines[index + 1:index + 3]
        assert all(row.startswith("  ") and " us  " in row for row in rows), done.stdout
        assert float(lines[index].split(": ")[1].split(" us")[0]) > 0


@pytest.mark.slow
def test_training_step_benchmark_checks_and_times_a_dense_and_an_image_model():
    """bench/training_step.py --quick on the MLP (checked exactly against the hand-written step)
    and ResNet-18 (checked loosely, as its ReLU kinks and max pooling round differently)."""
    command = [sys.executable, str(ROOT / "bench" / "training_step.py"), "--quick", "--models", "mlp,resnet"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for name in ("MLP", "ResNet"):
        assert any(line.startswith(name) and " check: 3 steps" in line for line in lines), done.stdout
        timed = [line for line in lines if line.startswith(name) and " onnxtrain " in line and " ratio " in line]
        assert len(timed) == 1, done.stdout
    assert "weights, V, H and T equal" in done.stdout and "weights within 6 lr" in done.stdout
    assert not any(line.startswith(("CNN", "MobileNet")) for line in lines)


@pytest.mark.slow
def test_same_process_ab_times_this_checkout_against_a_renamed_copy_of_a_checkout():
    """bench/ab.py --same-process, with this checkout as its own base: the copy imports under
    another name beside onnxtrain, and both sides' step and fit rows come out."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ab.py"), "--same-process", str(ROOT), "--quick", "--modes", "step,fit"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| mlp |")]
    assert sorted({row[2].strip() for row in rows}) == ["fit", "step"], done.stdout
    assert all("(one process)" in row[-2] for row in rows), done.stdout


@pytest.mark.slow
def test_first_step_worker_compiles_cold_and_loads_warm_from_the_cache(monkeypatch, tmp_path):
    """bench/systems/first_step.py on the bundled digits CNN: the cold run compiles into an
    empty cache folder, the warm one (a new process, same folder) retrieves from it."""
    run = _bench_run_module(monkeypatch)
    feeds = tmp_path / "feeds.npz"
    generator = np.random.default_rng(0)
    np.savez(feeds, x=generator.standard_normal((8, 1, 8, 8)).astype(np.float32),
             labels=generator.integers(0, 10, 8))
    job = {"path": str(ROOT / "onnxtrain" / "models" / "digits_cnn.onnx"), "loss": "cross_entropy",
           "feeds": str(feeds)}
    cache = tmp_path / "cache"
    env = {"ONNXTRAIN_COMPILATION_CACHE": str(cache)}
    cold, warm = (run.run_script(Path(sys.executable), "first_step.py", job, env) for _ in range(2))
    assert "unavailable" not in cold and "unavailable" not in warm, (cold, warm)
    assert cold["loss"] == pytest.approx(warm["loss"]) and cold["loss"] > 0
    assert cold["compile_s"] > 0 and cold["cache_retrieval_s"] == 0
    assert warm["cache_retrieval_s"] > 0
    assert any(cache.iterdir())


@pytest.mark.slow
def test_startup_benchmark_times_cold_and_warm_starts_of_a_zoo_export():
    """bench/startup.py on one small zoo export: its row has the three new-process starts and
    torch eager's first step."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "startup.py"), "--encoder-layers",
                           "--family", "autoencoder", "--exporter", "torchscript"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    header, _, row = done.stdout.strip().splitlines()
    assert header.split("|")[3:-1] == [" cold s ", " warm s ", " warm, JAX cache only s ", " torch first step ms "]
    values = [float(cell) for cell in row.split("|")[3:-1]]
    assert row.startswith("| autoencoder | torchscript |") and all(value > 0 for value in values), row


def test_repeated_layers_benchmark_lowers_a_stack_four_ways():
    from support.bench_modules import bench_module

    rows = bench_module("repeated_layers").measure(2, rounds=1, calls=1)
    assert list(rows) == ["unrolled", "nested jit", "scan", "scan, unroll 2"]
    assert rows["unrolled"]["step / unrolled"] == 1.0
    assert all(row["compile s"] > 0 and row["step ms"] > 0 for row in rows.values())


def test_tracing_benchmark_times_both_ways_of_tracing_a_chain():
    from support.bench_modules import bench_module

    timings = bench_module("tracing").chain_timings(length=20)
    assert list(timings) == ["jax.numpy, traced s", "jax.numpy, under vjp s", "lax, traced s", "lax, under vjp s"]
    assert all(value > 0 for value in timings.values())


def bench_lines(script: str, *arguments: str, timeout: int = 600) -> list[str]:
    """The lines bench/`script` prints, run with `arguments` in a new process (it must succeed)."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *arguments],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()


@pytest.mark.slow
def test_tracing_benchmark_counts_nested_jits_by_the_line_calling_them(tmp_path):
    lines = bench_lines("tracing.py", "--encoder-layers", "1", "--exports", str(tmp_path), "--lines", "3")
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("1 layers: trace ")):]
    assert "nested jit traces" in lines[0], lines
    # The optimizer's arithmetic is among the callers named, by file and line.
    assert len(lines[1:4]) == 3 and any("translate/ops/training.py:" in line for line in lines[1:4]), lines


@pytest.mark.slow
def test_startup_benchmark_times_a_full_size_torchvision_model(tmp_path):
    row = bench_lines("startup.py", "--no-zoo", "--encoder-layers", "--exports", str(tmp_path),
                      "--torchvision", "squeezenet1_1", timeout=900)[-1]
    values = [float(cell) for cell in row.split("|")[3:-1]]
    assert row.startswith("| squeezenet1_1 (full size) batch 4 | dynamo |") and all(v > 0 for v in values), row
