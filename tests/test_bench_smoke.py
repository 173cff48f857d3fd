"""bench/run.py --quick still runs end to end: builds the models, runs each system in its own
process and prints the comparison table (the benchmark itself is not part of the suite)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_benchmark_prints_a_table_with_both_systems():
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--models", "mlp",
         "--systems", "onnxtrain-step,jax-handwritten"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| mlp |")]
    assert [row.split("|")[2].strip() for row in rows] == ["onnxtrain-step", "jax-handwritten"], done.stdout
    assert "relative spread" in done.stdout and "MISMATCH" not in done.stdout


def test_memory_benchmark_runs_every_policy_and_entry_point_on_a_tiny_model():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "memory.py"), "--layers", "2", "--width", "64"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("nan_policy=")]
    assert [row.split(":")[0] for row in rows] == [
        f"nan_policy={policy!r}, {run}" for policy in ("ignore", "raise")
        for run in ("3 Trainer.step calls", "fit(8 batches, steps_per_call=4)")], done.stdout
    assert all("(peak - baseline) / (state + activations) = " in row for row in rows)
