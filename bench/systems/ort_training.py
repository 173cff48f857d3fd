"""ort-training: onnxruntime-training 1.19.2's on-device training API (CPU), run with
bench/.venv-ort's python (it needs onnx 1.17, numpy < 2).

{"prepare": true} generates the artifacts once, untimed: training/eval/optimizer models and
checkpoint from <model>.ort.onnx, every initializer trainable, CrossEntropyLoss, and AdamW
with weight decay 0 and eps 1e-8 (the only Adam it generates; ONNX Runtime's AdamW mode 1
= the Hugging Face formula, the same as ONNX Adam's). Otherwise it trains with
CheckpointState, Module and Optimizer, float(loss) every step.

onnxruntime/training/__init__.py imports torch for ORTModule and amp, which this API does
not use: importing the subpackages through a bare package object keeps torch (and its
~200 MB) out of the venv and of the measured peak RSS.
"""

import importlib.util
import sys
import types
from pathlib import Path

import common

LEARNING_RATE = 1e-3


def _training_package():
    spec = importlib.util.find_spec("onnxruntime.training")
    package = types.ModuleType("onnxruntime.training")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["onnxruntime.training"] = package


def prepare(task: dict, artifacts_dir: Path) -> None:
    import onnx
    from onnxruntime.training import artifacts, onnxblock

    model = onnx.load(Path(task["dir"]) / f"{task['model']}.ort.onnx")
    artifacts_dir.mkdir(exist_ok=True)
    artifacts.generate_artifacts(
        model, requires_grad=[tensor.name for tensor in model.graph.initializer],
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=onnxblock.optim.AdamW(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
        artifact_directory=artifacts_dir)
    common.report(prepared=str(artifacts_dir))


def train(task: dict, artifacts_dir: Path) -> None:
    from onnxruntime.training import api

    state = api.CheckpointState.load_checkpoint(artifacts_dir / "checkpoint")
    module = api.Module(artifacts_dir / "training_model.onnx", state, artifacts_dir / "eval_model.onnx", "cpu")
    optimizer = api.Optimizer(artifacts_dir / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(LEARNING_RATE)
    module.train()

    def step(batch):
        loss = module(batch["x"], batch["labels"])
        optimizer.step()
        module.lazy_reset_grad()
        return float(loss)

    common.report(**common.time_steps(step, common.batches(task), task),
                  versions=common.versions("onnxruntime-training", "onnx", "numpy"))


task = common.job()
try:
    _training_package()
except ImportError as error:
    common.unavailable(f"onnxruntime-training not importable ({error})")
(prepare if task.get("prepare") else train)(task, Path(task["dir"]) / f"ort-{task['model']}")
