"""A/B of onnxtrain's training step: this checkout against another, measured in one run.

Both sides run the same worker (bench/systems/lockstep.py) on the same files; only the
interpreter differs, and so the onnxtrain it imports (give the other side's with --base, e.g.
the .venv of a checkout of the commit to compare against).

Why lockstep: on a shared machine a process's speed drifts by tens of percent over seconds,
so medians of separate processes (or separate runs) cannot resolve a few percent. Here both
sides' workers are resident and warm, and take turns: a pair is one block of steps on each
side, back to back, the order alternating from pair to pair; a block lasts about --block-s
seconds. A row runs --processes such lockstep runs one after the other, each with fresh
workers: a process keeps for life the speed it happened to start with (where the allocator
and the loader put things), so pairs within one run are not independent, and comparing one
pair of processes compares two draws. The ratio reported is the median of the runs' own
median ratios (this block / base block), with a distribution-free 95 % interval over those
runs (their range when there are fewer than 6); peak RSS is each side's highest worker
high-water mark. Giving this checkout's own python as --base measures the noise floor.

--same-process CHECKOUT puts both sides in one process instead (bench/systems/same_process.py):
the base checkout's packages are copied under another top-level name, their imports
rewritten, and each of the --processes runs times both Trainers in turn. A process's own
speed then cancels out of its ratios; peak RSS is not measured per side.

Run this script with an interpreter whose environment holds the same packages as the base's:
this side is the interpreter running ab.py. The test extras (torch and its CUDA wheels) make
`import jax` itself load more modules and take more memory, which a comparison against a
runtime-only base environment would charge to onnxtrain.

Usage: THIS/.venv/bin/python bench/ab.py (--base OTHER/.venv/bin/python | --same-process OTHER)
           [--pairs 48] [--block-s 0.25] [--row-s 120]
           [--processes 12] [--models mlp,cnn,transformer,mobilenet,resnet] [--modes step,step-unchecked,fit,fit-unchecked]
           [--quick] [--cache FOLDER]
Prints a table (no file is written: copy what matters to RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import models  # noqa: E402
import run  # noqa: E402



def _host_weights() -> dict[str, np.ndarray]:
    """The MLP's shapes with 8 hidden units: a step that is almost all host-side work."""
    weights = models.mlp_weights()
    return {"W1": weights["W1"][:, :8], "B1": weights["B1"][:8], "W2": weights["W2"][:8], "B2": weights["B2"]}


# name: (weights, ONNX builder, input shape, batch); the image models use training_step.py's
# batch. "host" is the MLP shrunk until the step's host-side work is most of its time.
MODELS = {name: (*run.MODELS[name][:3], run.BATCH) for name in run.MODELS} | {
    "host": (_host_weights, models.mlp_onnx, (784,), run.BATCH),
    "mobilenet": (models.mobilenet_weights, models.mobilenet_onnx, models.MOBILENET_INPUT, run.RESNET_BATCH),
    "resnet": (models.resnet18_weights, models.resnet18_onnx, models.RESNET18_INPUT, run.RESNET_BATCH),
}
# mode: what the worker's job adds.
MODES = {"step": {}, "step-unchecked": {"nan_policy": "ignore"},
         "fit": {"fit": True}, "fit-unchecked": {"fit": True, "nan_policy": "ignore"}}
STEPS_PER_CALL = 8  # bench/systems/common.STEPS_PER_CALL: a fit block is a multiple of it
WARMUP_S = 3.0
MIN_PAIRS = 9  # a row stops at its time budget, but not before this many pairs


class Worker:
    """One side's resident lockstep.py process."""

    def __init__(self, python: Path, task: dict):
        # No persistent compilation cache unless --cache: a side that found its programs there
        # would skip the compiler's memory peak, and its peak RSS would not compare with the other's.
        self.process = subprocess.Popen([str(python), str(BENCH / "systems" / "lockstep.py"), json.dumps(task)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env={**os.environ, "ONNXTRAIN_COMPILATION_CACHE": task["cache"]})
        self.ready = self._answer()

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            error = self.process.stderr.read().strip().splitlines()
            raise SystemExit(f"lockstep worker failed: {error[-1] if error else self.process.wait()}")
        return json.loads(line)

    def block(self, steps: int) -> float:
        self.process.stdin.write(f"{steps}\n")
        self.process.stdin.flush()
        return self._answer()["seconds"]

    def close(self) -> dict:
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        final = self._answer()
        self.process.wait(timeout=60)
        return final


def prepare(name: str, folder: Path) -> None:
    weights_of, build, shape, batch = MODELS[name]
    rng = np.random.default_rng(0)
    np.savez(folder / f"{name}.batches.npz",
             x=rng.standard_normal((run.BATCHES, batch, *shape)).astype(np.float32),
             labels=rng.integers(0, 10, (run.BATCHES, batch)).astype(np.int64))
    onnx.save(models.training_onnx(build(weights_of())), folder / f"{name}.training.onnx")


# The top-level name the base checkout's packages take under --same-process.
BASE_PACKAGE = "ab_base_onnxtrain"
_IMPORT = re.compile(r"^(\s*(?:from|import)\s+)onnxtrain\b", re.MULTILINE)


def renamed_copy(checkout: Path, folder: Path) -> Path:
    """The packages of `checkout`, laid out as its pyproject.toml's package-dir says, copied
    into `folder` as the one package BASE_PACKAGE, with their `from onnxtrain...` and `import
    onnxtrain...` statements rewritten to it, so one process can import both checkouts.
    Returns `folder`, for sys.path."""
    with open(checkout / "pyproject.toml", "rb") as file:
        package_dir = tomllib.load(file)["tool"]["setuptools"]["package-dir"]
    for package, source in sorted(package_dir.items()):
        shutil.copytree(checkout / source, folder / BASE_PACKAGE / Path(*package.split(".")[1:]),
                        dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    for path in (folder / BASE_PACKAGE).rglob("*.py"):
        path.write_text(_IMPORT.sub(rf"\g<1>{BASE_PACKAGE}", path.read_text()))
    return folder


def _same_process(base_path: Path, task: dict, pairs: int, block_s: float, row_s: float) -> dict:
    """One same_process.py run: both sides in one process, `pairs` pairs of blocks."""
    job = {**task, "base_path": str(base_path), "base_package": BASE_PACKAGE, "pairs": pairs,
           "block_s": block_s, "row_s": row_s, "min_pairs": MIN_PAIRS, "warmup_s": WARMUP_S}
    found = run.run_script(Path(sys.executable), "same_process.py", job, {"ONNXTRAIN_COMPILATION_CACHE": task["cache"]})
    if "unavailable" in found:
        raise SystemExit(f"same-process {found['unavailable']}")
    ratios = [this / base for this, base in zip(found["times"]["this"], found["times"]["base"])]
    return {"steps": found["steps"], "ratios": ratios, "times": found["times"], "recompiled": found["recompiled"],
            "rss": {side: found["peak_rss_mb"] for side in ("this", "base")}}


def median_interval(values: list[float]) -> tuple[float, float]:
    """A distribution-free 95 % interval for the median: the order statistics the binomial
    (n, 1/2) puts at least 95 % between (normal approximation to the binomial)."""
    ordered, n = sorted(values), len(values)
    half = 1.96 * math.sqrt(n) / 2
    low, high = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half) - 1)
    return ordered[low], ordered[high]


def _lockstep(sides: dict[str, Path], task: dict, pairs: int, block_s: float, row_s: float,
              steps: int | None) -> dict:
    """One worker per side, `pairs` pairs of blocks (fewer past `row_s`); steps: the block size,
    or None to size blocks from the warm-up."""
    workers = {side: Worker(python, task) for side, python in sides.items()}
    try:
        unit = STEPS_PER_CALL if task.get("fit") else 1
        # The warm-up sizes blocks from the warm speed of the faster side, in whole fit calls.
        size, start = unit, time.perf_counter()
        while time.perf_counter() - start < WARMUP_S:
            seconds = max(min(workers[side].block(size) for side in sides), 1e-6)
            size = max(unit, round(size * block_s / seconds / unit) * unit)
        steps = steps or size
        ratios, times, start = [], {side: [] for side in sides}, time.perf_counter()
        for index in range(pairs):
            if index >= MIN_PAIRS and time.perf_counter() - start > row_s:
                break
            order = list(sides) if index % 2 == 0 else list(sides)[::-1]
            taken = {side: workers[side].block(steps) / steps for side in order}
            for side in sides:
                times[side].append(taken[side])
            ratios.append(taken["this"] / taken["base"])
        finals = {side: worker.close() for side, worker in workers.items()}
    finally:
        for worker in workers.values():
            worker.process.kill()
    recompiled = {side: finals[side]["compilations"] - workers[side].ready["compilations"] for side in sides}
    return {"steps": steps, "ratios": ratios, "times": times, "recompiled": recompiled,
            "rss": {side: finals[side]["peak_rss_mb"] for side in sides}}


@dataclass(frozen=True)
class SameProcess:
    """The base side of --same-process: the folder holding the renamed copy of its packages."""

    path: Path


def compare(sides: dict[str, Path | SameProcess], task: dict, pairs: int, block_s: float, row_s: float,
            processes: int) -> dict:
    """`processes` lockstep runs, each with fresh workers (see the module docstring)."""
    runs, steps = [], None
    for _ in range(processes):
        if isinstance(sides["base"], SameProcess):
            runs.append(_same_process(sides["base"].path, task, math.ceil(pairs / processes), block_s,
                                      row_s / processes))
        else:
            runs.append(_lockstep(sides, task, math.ceil(pairs / processes), block_s, row_s / processes, steps))
        steps = runs[0]["steps"]
    medians = [statistics.median(found["ratios"]) for found in runs]
    times = {side: [t for found in runs for t in found["times"][side]] for side in sides}
    return {"steps": steps, "pairs": sum(len(found["ratios"]) for found in runs),
            "ratio": statistics.median(medians),
            "interval": median_interval(medians) if len(medians) >= 6 else (min(medians), max(medians)),
            "per_process": medians,
            "ms": {side: statistics.median(times[side]) * 1e3 for side in sides},
            "rss": {side: max(found["rss"][side] for found in runs) for side in sides},
            "recompiled": {side: sum(found["recompiled"][side] for found in runs) for side in sides}}


def rss(found: dict, one_process: bool) -> str:
    """The peak RSS column: base / this, or the shared process's peak under --same-process."""
    if one_process:
        return f"{found['rss']['this']:.0f} (one process)"
    return f"{found['rss']['base']:.0f} / {found['rss']['this']:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    base = parser.add_mutually_exclusive_group(required=True)
    base.add_argument("--base", type=Path, help="the python whose onnxtrain is the baseline")
    base.add_argument("--same-process", type=Path, metavar="CHECKOUT",
                      help="the baseline's checkout, run in the same process as this side")
    parser.add_argument("--pairs", type=int, default=48)
    parser.add_argument("--block-s", type=float, default=0.25, help="seconds per block, about")
    parser.add_argument("--row-s", type=float, default=120.0,
                        help=f"time budget per row: fewer pairs (at least {MIN_PAIRS}) where blocks are long")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--processes", type=int, default=12,
                        help="fresh worker pairs per row, the pairs split among them")
    parser.add_argument("--quick", action="store_true", help="smoke run: mlp only, 5 short pairs")
    parser.add_argument("--cache", type=Path,
                        help="the workers' compilation cache folder (default: none); with it, every process after "
                             "the first loads this side's programs from onnxtrain's executable cache")
    arguments = parser.parse_args()
    sides = {"this": Path(sys.executable), "base": arguments.base}
    names = ["mlp"] if arguments.quick else [m for m in arguments.models.split(",") if m]
    modes = [m for m in arguments.modes.split(",") if m]
    pairs, block_s, processes = ((5, 0.05, 1) if arguments.quick
                                 else (arguments.pairs, arguments.block_s, arguments.processes))
    unknown = set(names) - set(MODELS) | set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown models or modes: {sorted(unknown)}; models: {list(MODELS)}, modes: {list(MODES)}")
    lines = ["| model | mode | steps/block | pairs | base ms/step | this ms/step | this / base (95 % interval over processes) "
             "| per process pair | peak RSS MB base / this |", "|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as folder:
        if arguments.same_process is not None:
            sides["base"] = SameProcess(renamed_copy(arguments.same_process.resolve(), Path(folder) / "base"))
        for name in names:
            prepare(name, Path(folder))
            for mode in modes:
                # The image models warm up one step: their first call compiles for tens of seconds.
                warmup = STEPS_PER_CALL if "fit" in mode else 3
                task = {"dir": folder, "model": name, "warmup": warmup, "cache": str(arguments.cache or "off"),
                        **MODES[mode]}
                found = compare(sides, task, pairs, block_s, arguments.row_s, processes)
                if any(found["recompiled"].values()):
                    raise SystemExit(f"{name} {mode}: a worker compiled again while timed: {found['recompiled']}")
                low, high = found["interval"]
                line = (f"| {name} | {mode} | {found['steps']} | {found['pairs']} "
                        f"| {found['ms']['base']:.3f} | {found['ms']['this']:.3f} "
                        f"| {found['ratio']:.3f} ({low:.3f}-{high:.3f}) "
                        f"| {' '.join(f'{r:.2f}' for r in found['per_process'])} "
                        f"| {rss(found, arguments.same_process is not None)} |")
                print(line, flush=True)
                lines.append(line)
    base_side = (f"{arguments.same_process} in the same process" if arguments.same_process is not None
                 else sides["base"])
    print(f"\nat most {pairs} pairs per row (at most {arguments.row_s:.0f} s after warm-up), blocks of about "
          f"{block_s} s; this = {sides['this']}, base = {base_side}\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
