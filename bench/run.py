"""Training-step benchmark of onnxtrain against hand-written JAX, ONNX Runtime training and
PyTorch eager, each system in its own process; writes bench/RESULTS.md.

Why processes: peak RSS is only meaningful per process, and a JAX process that also ran
torch or ONNX Runtime would measure their allocators and thread pools too. Each round runs
every system once per model (the order reversed every other round), so drift of the shared
machine spreads over all systems; per-step medians are medians over rounds of per-process
medians, and ratios are taken between medians of the same run. The workers (bench/systems)
read the same weights and batches from files this script writes, and each prints one JSON
line: per-step seconds, first-step loss (checked equal across systems), peak RSS.

ONNX Runtime training runs from its own venv, bench/.venv-ort (built on first use: it needs
onnx 1.17 and numpy < 2). The ResNet-18 row measures onnxtrain's first Trainer.step in a
fresh process with a cold, then a warm, persistent compilation cache.

Usage: python bench/run.py [--quick] [--models mlp,cnn,transformer,resnet18]
                           [--systems onnxtrain-step,...] [--rounds 5]
--quick: one round of a few steps, no ResNet-18, no venv build (< 2 min); prints only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import models  # noqa: E402

BATCH, BATCHES = 64, 8
ORT_VENV = BENCH / ".venv-ort"
ORT_PACKAGES = ["onnxruntime-training==1.19.2", "onnx==1.17.0", "numpy<2"]
# name: (worker script, what it adds to the job). onnxtrain-step and -fit run the Trainer's
# default NaN/Inf guard; the -unchecked rows (nan_policy "ignore") do what the others do.
SYSTEMS = {"onnxtrain-step": ("onnxtrain_step.py", {}),
           "onnxtrain-step-unchecked": ("onnxtrain_step.py", {"nan_policy": "ignore"}),
           "onnxtrain-fit": ("onnxtrain_fit.py", {}),
           "onnxtrain-fit-unchecked": ("onnxtrain_fit.py", {"nan_policy": "ignore"}),
           "onnxtrain-fit-k1": ("onnxtrain_fit.py", {"steps_per_call": 1}),
           "jax-handwritten": ("jax_handwritten.py", {}),
           "jax-handwritten-guarded": ("jax_handwritten.py", {"guarded": True}),
           "jax-handwritten-scan": ("jax_handwritten_scan.py", {}),
           "ort-training": ("ort_training.py", {}), "torch-eager": ("torch_eager.py", {})}
# Rows that run several steps per compiled call: their JAX reference is the faster of the two
# hand-written ones (the scan, unless a loop slows the model down: XLA:CPU convolutions).
MULTI_STEP = {"onnxtrain-fit", "onnxtrain-fit-unchecked", "jax-handwritten-scan"}
# name: (weights, ONNX builder, input shape, (warm-up, timed steps) full, quick)
MODELS = {
    "mlp": (models.mlp_weights, models.mlp_onnx, (784,), (50, 200), (8, 16)),
    "cnn": (models.cnn_weights, models.cnn_onnx, (1, 28, 28), (10, 50), (8, 8)),
    "transformer": (models.transformer_weights, models.transformer_onnx,
                    (models.TRANSFORMER["seq"], models.TRANSFORMER["d"]), (50, 200), (8, 16)),
}
RESNET_BATCH = 8
WORKER_TIMEOUT = 600


def _write_inputs(folder: Path, name: str, model: onnx.ModelProto, shape: tuple[int, ...], batch: int) -> None:
    """The batches (random, seed 0) and the onnxtrain training model of `model`."""
    rng = np.random.default_rng(0)
    np.savez(folder / f"{name}.batches.npz",
             x=rng.standard_normal((BATCHES, batch, *shape)).astype(np.float32),
             labels=rng.integers(0, 10, (BATCHES, batch)).astype(np.int64))
    onnx.save(models.training_onnx(model), folder / f"{name}.training.onnx")


def prepare(name: str, folder: Path) -> None:
    """The files the workers read: weights, batches, the onnxtrain training model and the
    inference model ONNX Runtime training generates its artifacts from."""
    weights_of, build, shape = MODELS[name][:3]
    weights = weights_of()
    np.savez(folder / f"{name}.weights.npz", **weights)
    model = build(weights)
    _write_inputs(folder, name, model, shape, BATCH)
    onnx.save(models.for_onnxruntime_training(model), folder / f"{name}.ort.onnx")


def ort_python(build: bool) -> tuple[Path | None, str]:
    """bench/.venv-ort's python, built (once) if `build`; else None and the reason."""
    python, ready = ORT_VENV / "bin" / "python", ORT_VENV / ".ready"
    if ready.exists():
        return python, ""
    if not build:
        return None, "bench/.venv-ort is not built (--quick does not build it)"
    print(f"building {ORT_VENV.relative_to(BENCH.parent)}: pip install {' '.join(ORT_PACKAGES)}", flush=True)
    try:
        for command in ([sys.executable, "-m", "venv", "--clear", str(ORT_VENV)],
                        [str(python), "-m", "pip", "install", "--quiet", *ORT_PACKAGES]):
            subprocess.run(command, capture_output=True, text=True, check=True, timeout=1200)
    except subprocess.CalledProcessError as error:
        lines = [line for line in error.stderr.splitlines() if "is ignored" not in line]
        return None, f"cannot build bench/.venv-ort: {' / '.join(lines[-2:]) or error.returncode}"
    except subprocess.TimeoutExpired as error:
        return None, f"cannot build bench/.venv-ort: {error.cmd[-1]} timed out"
    ready.touch()
    return python, ""


def run_worker(python: Path, system: str, task: dict, env: dict | None = None) -> dict:
    """One fresh process of `system`; its JSON line, or {"unavailable": why}."""
    script, settings = SYSTEMS[system]
    return run_script(python, script, {**task, **settings}, env)


def run_script(python: Path, script: str, job: dict, env: dict | None = None) -> dict:
    """One fresh process of bench/systems/`script` given `job`; its JSON line, or {"unavailable": why}."""
    command = [str(python), str(BENCH / "systems" / script), json.dumps(job)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=WORKER_TIMEOUT,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return {"unavailable": f"timed out after {WORKER_TIMEOUT} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        error = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return {"unavailable": f"worker failed: {error}"}
    return json.loads(lines[-1])


def summarize(runs: list[dict]) -> dict:
    """A system's row from its runs, one per round in round order."""
    times = [t for run in runs for t in run["times"]]
    per_round = [statistics.median(run["times"]) for run in runs]
    return {"median": statistics.median(per_round), "per_round": per_round,
            "p10": float(np.percentile(times, 10)), "p90": float(np.percentile(times, 90)),
            "rss": statistics.median(run["peak_rss_mb"] for run in runs),
            "first_loss": runs[0]["first_loss"], "note": runs[0].get("note", "")}


# Single-step rows with onnxtrain's NaN/Inf guard: compared with the hand-written step that
# gives the same guarantee, not with one that checks nothing.
GUARDED = {"onnxtrain-step", "onnxtrain-fit-k1"}


def _jax_reference(system: str, systems: dict[str, dict | str]) -> dict | None:
    """The hand-written JAX row `system` is compared with (see MULTI_STEP and GUARDED)."""
    if system in MULTI_STEP:
        names = ["jax-handwritten", "jax-handwritten-scan"]
    else:
        names = ["jax-handwritten-guarded" if system in GUARDED else "jax-handwritten"]
    rows = [row for name in names if isinstance(row := systems.get(name), dict)]
    return min(rows, key=lambda row: row["median"]) if rows else None


def table(results: dict[str, dict[str, dict | str]]) -> str:
    """Markdown: one row per model and system, with its ratios to the references."""
    rows = ["| model | system | median ms/step | p10 | p90 | × JAX | × ORT | peak RSS MB | RSS × JAX | RSS × ORT |",
            "|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(value: float, reference: dict | None, key: str) -> str:
        return f"{value / reference[key]:.2f}" if reference else "—"

    def time_ratio(row: dict, reference: dict | None) -> str:
        """The median over rounds of the ratio within each round: the two processes of a round
        run minutes apart at most, so a shared machine's slow and fast spells (which last
        minutes and move a step's time by up to 1.7x) shift both sides of a ratio alike."""
        if not reference:
            return "—"
        pairs = zip(row["per_round"], reference["per_round"])
        return f"{statistics.median(mine / theirs for mine, theirs in pairs):.2f}"

    for model, systems in results.items():
        ort_row = row if isinstance(row := systems.get("ort-training"), dict) else None
        for system, s in systems.items():
            if isinstance(s, str):
                rows.append(f"| {model} | {system} | unavailable: {s} | | | | | | | |")
                continue
            jax_row = _jax_reference(system, systems)
            label = f"{system} ({s['note']})" if s["note"] else system
            rows.append(f"| {model} | {label} | {s['median'] * 1e3:.3f} | {s['p10'] * 1e3:.3f} | "
                        f"{s['p90'] * 1e3:.3f} | {time_ratio(s, jax_row)} | "
                        f"{time_ratio(s, ort_row)} | {s['rss']:.0f} | "
                        f"{ratio(s['rss'], jax_row, 'rss')} | {ratio(s['rss'], ort_row, 'rss')} |")
    return "\n".join(rows)


def loss_check(results: dict[str, dict[str, dict | str]]) -> str:
    """All systems start from the same weights on the same batch: their first losses agree."""
    lines = []
    for model, systems in results.items():
        losses = [s["first_loss"] for s in systems.values() if isinstance(s, dict)]
        if losses:
            spread = (max(losses) - min(losses)) / abs(min(losses))
            lines.append(f"{model} {min(losses):.6f} (relative spread {spread:.1e} over {len(losses)} systems"
                         f"{'' if spread < 1e-4 else ': MISMATCH'})")
    return "First-step losses (same weights, same batch): " + "; ".join(lines) + "."


def compile_times(folder: Path) -> str:
    """onnxtrain's first Trainer.step on ResNet-18 in a fresh process, cold then warm cache."""
    weights = models.resnet18_weights()
    _write_inputs(folder, "resnet18", models.resnet18_onnx(weights), models.RESNET18_INPUT, RESNET_BATCH)
    cache = folder / "xla-cache"
    task = {"model": "resnet18", "dir": str(folder), "warmup": 1, "steps": 1}
    rows = ["| compilation cache | Trainer() s | first step s | second step s | peak RSS MB |",
            "|---|---|---|---|---|"]
    for label in ("cold (empty folder)", "warm (same folder, new process)"):
        print(f"resnet18 first step, {label} ...", flush=True)
        run = run_worker(Path(sys.executable), "onnxtrain-step", task,
                         {"ONNXTRAIN_COMPILATION_CACHE": str(cache)})
        if "unavailable" in run:
            return f"ResNet-18 first step: {run['unavailable']}"
        rows.append(f"| {label} | {run['setup_s']:.2f} | {run['first_s']:.2f} | {run['times'][0]:.3f} | "
                    f"{run['peak_rss_mb']:.0f} |")
        print(rows[-1], flush=True)
    cached = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) / 2**20
    return (f"ResNet-18 ({sum(w.size for w in weights.values()) / 1e6:.1f} M trainable parameters), batch "
            f"{RESNET_BATCH} x {'x'.join(map(str, models.RESNET18_INPUT))}, onnxtrain-step, each row a "
            f"fresh process with ONNXTRAIN_COMPILATION_CACHE=<folder> ({cached:.2f} MB in it after both):\n\n"
            + "\n".join(rows))


def machine() -> str:
    """The CPU line of the results. A cloud host's model name ("AMD EPYC") can hide a CPU
    generation: the family, model and widest vector unit tell runs on different hosts apart."""
    cpuinfo = Path("/proc/cpuinfo")
    info: dict[str, str] = {}
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    name = info.get("model name", platform.processor())
    if "cpu family" in info:
        vectors = next((unit for unit in ("avx512f", "avx2") if unit in info.get("flags", "").split()), "no AVX2")
        name += f" (family {info['cpu family']}, model {info.get('model', '?')}, {vectors})"
    return f"{name}, {os.cpu_count()} cores, {platform.system()}"


# The section of RESULTS.md a run keeps as it was: figures behind design choices, measured once.
KEPT_SECTION = "## Design measurements"
HOW_MEASURED = """\
## How measured

Every row is a separate process per round (`bench/systems/<system>.py`), run one after the
other, never concurrently; each round runs each system once per model, the order reversed
every other round, so drift of the shared machine spreads over all systems. A process loads
the same weights and 8 batches (random, seed 0) that `bench/run.py` wrote, runs the warm-up
steps untimed (the first one compiles), then times each step with `time.perf_counter`,
including feeding a numpy batch and reading the loss back as a Python float.
**median** is the median over rounds of each process's median step; **p10/p90** are
percentiles of all timed steps of all rounds. **× JAX** and **× ORT** are medians over rounds
of the ratio within each round (both processes of a round run minutes apart at most, so slow and
fast spells of the shared machine move both sides alike); **RSS ×** divides medians.
onnxtrain-step runs the Trainer's default NaN/Inf guard (`nan_policy="raise"`: every bound
value and the loss checked each step, the state double-buffered so a faulty step changes
nothing); onnxtrain-step-unchecked (`nan_policy="ignore"`) does the work the other systems do,
none of which checks. onnxtrain-fit times each `Trainer.fit` call over up to 64 batches (8 steps per compiled call;
its row says how many) and divides by that count, so its p10/p90 are over calls; its losses
come back one chunk late, and its first loss is that of the warm-up fit call's first step, so
the process compiles only what fit runs; onnxtrain-fit-unchecked is the same under
`nan_policy="ignore"`. onnxtrain-fit-k1 is the same with fit's default
of one step per call: each step is a compiled call of its own, its loss and NaN/Inf check
read one step later, so it is a single-step row. jax-handwritten-scan is onnxtrain-fit's hand-written
counterpart: a `lax.scan` over 8 stacked batches per `jax.jit` call, timed the same way, the
losses read one call late. jax-handwritten-guarded is jax-handwritten with the guarantee of
onnxtrain's default step: the new state and the loss checked for NaN/Inf in the same program,
the old state kept on a fault, the flag read with the loss. **× JAX** and **RSS × JAX**
compare the guarded single-step rows (onnxtrain-step, onnxtrain-fit-k1) with
jax-handwritten-guarded, the other single-step rows with jax-handwritten, and a multi-step row (onnxtrain-fit, -fit-unchecked, jax-handwritten-scan) with the faster
of the two hand-written rows: on the CNN a convolution inside XLA:CPU's loop runs several
times slower, so there the single-step one. **Peak RSS** is the process's
VmHWM from /proc/self/status (median over rounds; not `ru_maxrss`, which on Linux is never
below the parent's resident set at fork: 150-190 MB of the JAX-importing `run.py`): ONNX Runtime's process imports no JAX, no torch (its
training package imports torch only for ORTModule, which the training API does not use).
The first-step loss of every system on the same batch is compared as a check that they
train the same model. onnxtrain compiles its programs with one XLA:CPU option of its own
(convolutions on XLA's kernels rather than YNNPACK's: `translate/compiler_options.py`); the
hand-written JAX rows use JAX's defaults, as a plain `jax.jit` does. onnxtrain's persistent
compilation cache is off in these runs (`ONNXTRAIN_COMPILATION_CACHE=off`), except in the
ResNet-18 rows, which measure it.

Adam (lr 1e-3, betas 0.9/0.999, eps 1e-8, no weight decay) is the same update up to where
eps goes. onnxtrain and the hand-written JAX run ONNX's `ai.onnx.preview.training` Adam:
`w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)`; ONNX Runtime's generated
AdamW (weight decay 0, `adam_mode` 1, the Hugging Face form) computes the same. PyTorch's
`torch.optim.Adam` divides by `sqrt(v / (1 - b2^t)) + eps`: in the form above its eps is
`eps * sqrt(1 - b2^t)`, 31.6x smaller at step 1, 1.26x at step 1000, the same from ~5000
steps on. That changes the trajectory slightly, not the cost of a step.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round, few steps, no ResNet-18, no venv build")
    parser.add_argument("--models", help="comma-separated, of: " + ",".join([*MODELS, "resnet18"]))
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of: " + ",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=5)
    arguments = parser.parse_args()
    names = (arguments.models or ",".join([*MODELS] if arguments.quick else [*MODELS, "resnet18"])).split(",")
    systems = arguments.systems.split(",")
    unknown = set(names) - {*MODELS, "resnet18"} | set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown model or system: {', '.join(sorted(unknown))}")
    rounds = 1 if arguments.quick else arguments.rounds
    load_before = os.getloadavg()[0]
    timed = [name for name in names if name in MODELS]

    pythons: dict[str, Path | None] = {system: Path(sys.executable) for system in systems}
    results: dict[str, dict[str, list | str]] = {model: {system: [] for system in systems} for model in timed}
    if "ort-training" in systems:
        pythons["ort-training"], why = ort_python(build=not arguments.quick)
        if why:
            print(f"ort-training unavailable: {why}", flush=True)
            for model in timed:
                results[model]["ort-training"] = why

    with tempfile.TemporaryDirectory(prefix="onnxtrain-bench-") as temporary:
        folder = Path(temporary)
        for model in timed:
            prepare(model, folder)
            if isinstance(results[model].get("ort-training"), list):
                done = run_worker(pythons["ort-training"], "ort-training",
                                  {"model": model, "dir": temporary, "prepare": True})
                if "unavailable" in done:
                    results[model]["ort-training"] = done["unavailable"]
        versions = {"python": platform.python_version()}
        for index in range(rounds):
            for model in timed:
                warmup, steps = MODELS[model][4 if arguments.quick else 3]
                task = {"model": model, "dir": temporary, "warmup": warmup, "steps": steps}
                for system in systems if index % 2 == 0 else systems[::-1]:
                    if isinstance(results[model][system], str):
                        continue
                    run = run_worker(pythons[system], system, task, {"ONNXTRAIN_COMPILATION_CACHE": "off"})
                    if "unavailable" in run:
                        results[model][system] = run["unavailable"]
                        print(f"{model} {system} unavailable: {run['unavailable']}", flush=True)
                        continue
                    results[model][system].append(run)
                    suffix = " (bench/.venv-ort)" if system == "ort-training" else ""
                    versions.update({f"{name}{suffix}": v for name, v in run.get("versions", {}).items()})
                    print(f"round {index + 1}/{rounds} {model:<11} {system:<15} "
                          f"{statistics.median(run['times']) * 1e3:8.3f} ms/step  "
                          f"peak RSS {run['peak_rss_mb']:4.0f} MB", flush=True)
        summary = {model: {system: summarize(runs) if isinstance(runs, list) else runs
                           for system, runs in row.items()} for model, row in results.items()}
        report = [table(summary), loss_check(summary)] if timed else []
        if "resnet18" in names:
            report.append(compile_times(folder))

    print("\n" + "\n\n".join(report))
    if not arguments.quick:
        steps = ", ".join(f"{m} {MODELS[m][3][0]} / {MODELS[m][3][1]}" for m in timed)
        header = [
            "# Training-step benchmark",
            f"{datetime.date.today().isoformat()}, `python bench/run.py {' '.join(sys.argv[1:])}`",
            f"Machine: {machine()}",
            "Versions: " + ", ".join(f"{name} {version}" for name, version in sorted(versions.items())),
            f"Load average (1 min) before / after the run: {load_before:.2f} / {os.getloadavg()[0]:.2f} "
            f"({os.cpu_count()} cores; well above 0 before the run means other work shared the machine).",
            f"Batch {BATCH}, float32; {rounds} rounds; warm-up / timed steps per process: {steps}." if timed else "",
        ]
        results = BENCH / "RESULTS.md"
        kept = results.read_text().partition(KEPT_SECTION)[2] if results.exists() else ""
        kept = [KEPT_SECTION + kept.rstrip("\n") + "\n"] if kept else []
        results.write_text("\n\n".join(filter(None, [*header, *report, HOW_MEASURED, *kept])))
        print(f"\nwrote {BENCH / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
