"""A/B of onnxtrain's training step: this checkout against another, measured in one run.

Both sides run the same worker scripts from this folder (bench/systems/, bench/training_step.py)
on the same files; only the interpreter differs, and so the onnxtrain it imports (give the
other side's with --base, e.g. the .venv of a checkout of the commit to compare against).
Rounds alternate which side goes first, so drift of the shared machine spreads over both.

- Systems rows (bench/run.py's workers, a fresh process each): per-step median over the
  process, median over rounds; ratio = this side / base.
- Image rows (bench/training_step.py --models M): each process times Trainer.step against the
  same network hand-written in JAX; the ratio compared is that in-process ratio, this side's
  over base's, which cancels most of the machine's drift.

Usage: python bench/ab.py --base OTHER/.venv/bin/python [--rounds 7] [--models mlp,cnn,transformer]
           [--systems onnxtrain-step,onnxtrain-step-unchecked,onnxtrain-fit,onnxtrain-fit-unchecked]
           [--images mlp,cnn,mobilenet,resnet] [--image-rounds 3] [--quick]
Prints a table (no file is written: copy what matters to RESULTS.md).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import run  # noqa: E402

ONNXTRAIN_SYSTEMS = "onnxtrain-step,onnxtrain-step-unchecked,onnxtrain-fit,onnxtrain-fit-unchecked"
_ROW = re.compile(r"^(\w+)\s+onnxtrain\s+([\d.]+) ms/step.*?ratio\s+([\d.]+)", re.M)


def _systems_rows(sides: dict[str, Path], models: list[str], systems: list[str], rounds: int,
                  quick: bool) -> list[str]:
    lines = []
    with tempfile.TemporaryDirectory() as folder:
        for model in models:
            run.prepare(model, Path(folder))
        medians = {(m, s, side): [] for m in models for s in systems for side in sides}
        for index in range(rounds):
            order = list(sides) if index % 2 == 0 else list(sides)[::-1]
            for model in models:
                warmup, timed = run.MODELS[model][4 if quick else 3]
                task = {"dir": folder, "model": model, "warmup": warmup, "steps": timed}
                for system in systems:
                    for side in order:
                        result = run.run_worker(sides[side], system, task)
                        if "unavailable" in result:
                            raise SystemExit(f"{side} {system} {model}: {result['unavailable']}")
                        medians[model, system, side].append(statistics.median(result["times"]))
            print(f"round {index + 1}/{rounds} done", flush=True)
    for model in models:
        for system in systems:
            new, base = (statistics.median(medians[model, system, side]) for side in ("this", "base"))
            lines.append(f"| {model} | {system} | {base * 1e3:.3f} | {new * 1e3:.3f} | {new / base:.3f} |")
    return lines


def _image_rows(sides: dict[str, Path], images: list[str], rounds: int, quick: bool) -> list[str]:
    found: dict[tuple[str, str], list] = {}
    arguments = ["--quick"] if quick else ["--rounds", "5"]
    for index in range(rounds):
        for side in (list(sides) if index % 2 == 0 else list(sides)[::-1]):
            done = subprocess.run([str(sides[side]), str(BENCH / "training_step.py"), "--models", ",".join(images),
                                   *arguments], capture_output=True, text=True, timeout=1800)
            if done.returncode:
                raise SystemExit(f"{side} training_step.py failed: {done.stderr.strip().splitlines()[-1:]}")
            for label, milliseconds, ratio in _ROW.findall(done.stdout):
                found.setdefault((label, side), []).append((float(milliseconds), float(ratio)))
        print(f"image round {index + 1}/{rounds} done", flush=True)
    lines = []
    for name in dict.fromkeys(label for label, _ in found):
        base, new = ([statistics.median(v) for v in zip(*found[name, side])] for side in ("base", "this"))
        lines.append(f"| {name} | Trainer.step / hand-written JAX (training_step.py) | {base[1]:.3f} | "
                     f"{new[1]:.3f} | {new[1] / base[1]:.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, type=Path, help="the python whose onnxtrain is the baseline")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", default="mlp,cnn,transformer")
    parser.add_argument("--systems", default=ONNXTRAIN_SYSTEMS)
    parser.add_argument("--images", default="mlp,cnn,mobilenet,resnet", help="training_step.py rows ('' for none)")
    parser.add_argument("--image-rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, few steps")
    arguments = parser.parse_args()
    sides = {"this": Path(sys.executable), "base": arguments.base}
    rounds = 1 if arguments.quick else arguments.rounds
    lines = ["| model | row | base | this | this / base |", "|---|---|---|---|---|"]
    models = [m for m in arguments.models.split(",") if m]
    if models:
        lines += _systems_rows(sides, models, arguments.systems.split(","), rounds, arguments.quick)
    images = [m for m in arguments.images.split(",") if m]
    if images:
        lines += _image_rows(sides, images, 1 if arguments.quick else arguments.image_rounds, arguments.quick)
    print("\nms/step for systems rows; onnxtrain / hand-written JAX for training_step.py rows\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
