"""The zoo's four checks on one exported model, and the acceptance table.

For a (family, exporter) pair of scripts/export_zoo.py:
- inference: onnxtrain.run against onnxruntime on the exported file, every output;
- gradients: the Gradient of make_training_model(model, loss) with the default trainable set
  against torch autograd of the same loss on the torch model (train mode where the export
  keeps BatchNorm). Exporters rename, transpose, permute (LSTM gates), concatenate (RNN
  biases) and duplicate (tied embeddings) parameters, so initializers are traced back to
  torch parameters element by element, by value: the zoo perturbs every parameter, so each
  value occurs once. A torch gradient is then the sum of the ONNX gradients of the elements
  that copy it. An initializer that copies no parameter is an exporter constant (it must not
  be trained); a parameter with a gradient that no initializer copies was folded away.
  Where float32 itself cannot give 1e-5 (train-mode BatchNorm over a handful of values per
  channel, whose gradients cancel heavily), the exact check moves to float64: the model
  converted to float64 must give torch's float64 gradients within FLOAT64_TOLERANCE, and its
  float32 gradients stay within ROUNDING_CEILING of them;
- trains: the loss falls over Adam steps on the fixed batch, and stays finite;
- export: Trainer.export(training=False) of the trained model, run by onnxruntime, against
  the Trainer's own infer.

Run as a command, it prints the acceptance table (model x exporter x check, worst error or
the first line of the failure):
    python tests/zoo/zoo_checks.py [--family NAME ...] [--exporter NAME] [--exports DIR]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
# Tolerances of issue 33's acceptance: inference vs onnxruntime, gradients vs torch autograd
# (relative to the parameter's largest gradient), the exported model vs infer.
INFERENCE_TOLERANCE = 1.5e-5
GRADIENT_TOLERANCE = 1e-5
ZERO_GRADIENT = 1e-6  # below this fraction of the model's largest gradient, one is rounding noise
# Past GRADIENT_TOLERANCE, float32 rounding explains a parameter's error only if the float64
# model is exact to FLOAT64_TOLERANCE and the float32 error stays under ROUNDING_CEILING: how
# far float32 lands from float64 there depends on the summation order of every kernel (torch's
# own float32 gradients move several-fold between its default, channels_last and one-thread
# runs), so no ratio to one torch run is a stable bound. The float64 model is exact only to
# about float32's precision where float attributes enter the gradients, since ONNX stores
# them as float32 (BatchNorm's epsilon and HardSigmoid's alpha in MobileNetV3; see
# bench/RESULTS.md, "BatchNorm's sums in one pass").
FLOAT64_TOLERANCE = 1e-7
ROUNDING_CEILING = 1e-4
EXPORT_TOLERANCE = 1e-4
STEPS = 10
LEARNING_RATE = 1e-2
# With BatchNorm folded away, the ResNet trains without batch statistics, as torch trains the
# same function (BatchNorm in eval mode): at LEARNING_RATE the loss of both grows by orders
# of magnitude at the first step and wanders after it, ending where rounding takes it; at
# this rate both fall.
FOLDED_LEARNING_RATE = 1e-3
FOLDED_RESNETS = {("tv_resnet", "dynamo"), ("tv_resnet", "torchscript")}
CHECKS = ("inference", "gradients", "trains", "export")


def _load_script():
    spec = importlib.util.spec_from_file_location("export_zoo", REPO / "scripts" / "export_zoo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("export_zoo", module)
    spec.loader.exec_module(module)
    return module


export_zoo = _load_script()


@dataclass
class Training:
    """What one make_training_model + Trainer run measured."""

    trainer: Any
    feeds: dict[str, np.ndarray]
    gradients: dict[str, np.ndarray]
    losses: list[float] = field(default_factory=list)


class Zoo:
    """Exports (written once into `folder`) and the checks on them, each computed once."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    @functools.cache
    def model(self, name: str, exporter: str) -> bytes:
        """The exported ONNX bytes, exported on first use."""
        path = self.folder / f"{name}-{exporter}.onnx"
        if not path.exists():
            path.write_bytes(export_zoo.export(name, exporter))
        return path.read_bytes()

    @functools.cache
    def feeds(self, name: str, exporter: str) -> dict[str, np.ndarray]:
        """The batch's inputs the exported graph takes (exporters drop unused ones)."""
        import onnx

        graph = onnx.load_from_string(self.model(name, exporter)).graph
        wanted = {v.name for v in graph.input} - {t.name for t in graph.initializer}
        return {k: v for k, v in export_zoo.batch(export_zoo.FAMILIES[name]).items() if k in wanted}

    @functools.cache
    def labels(self, name: str) -> np.ndarray:
        """The loss's target: class indices, or a fixed random tensor shaped like the output."""
        family = export_zoo.FAMILIES[name]
        rng = np.random.default_rng(1)
        if family.loss == "cross_entropy":
            return rng.integers(0, family.classes, size=export_zoo.BATCH).astype(np.int64)
        if name.startswith("sk_"):
            x, classes, target = export_zoo._sklearn_data()
            rows = len(export_zoo.batch(family)["X"])
            if family.output == "probabilities":
                return np.eye(3, dtype=np.float32)[classes[:rows]]
            # A new target, so the fitted regression is not already at the loss's minimum.
            return 2 * target[:rows, None] + 1
        shape = self.onnxruntime(name, next(iter(family.exporters)))[family.output].shape
        return rng.normal(size=shape).astype(np.float32)

    @functools.cache
    def onnxruntime(self, name: str, exporter: str) -> dict[str, np.ndarray]:
        import onnxruntime

        session = onnxruntime.InferenceSession(self.model(name, exporter), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, self.feeds(name, exporter))))

    def inference_error(self, name: str, exporter: str) -> float:
        """The worst |onnxtrain - onnxruntime| / (1 + |onnxruntime|) over every float output."""
        import onnxtrain

        expected = self.onnxruntime(name, exporter)
        actual = onnxtrain.run(self.model(name, exporter), self.feeds(name, exporter))
        worst = 0.0
        for key, value in expected.items():
            got = np.asarray(actual[key])
            assert got.shape == value.shape, f"output {key}: shape {got.shape}, onnxruntime {value.shape}"
            if value.dtype.kind != "f":
                np.testing.assert_array_equal(got, value, err_msg=f"output {key}")
                continue
            worst = max(worst, float(np.max(np.abs(got - value) / (1 + np.abs(value)))))
        return worst

    @functools.cache
    def training(self, name: str, exporter: str) -> Training:
        """first_step's float32 run, kept: the losses and export checks go on training it."""
        return self.first_step(name, exporter)

    def first_step(self, name: str, exporter: str, float64: bool = False) -> Training:
        """A Trainer on make_training_model(model, loss) with the default trainable set, whose
        steps also return every trainable's gradient; its first step has been taken. With
        `float64`, the model, batch and training run in float64 (see as_float64)."""
        import onnxtrain
        from onnxtrain import optim
        from onnxtrain.proto import ValueInfoProto

        family = export_zoo.FAMILIES[name]
        model = self.model(name, exporter)
        rate = FOLDED_LEARNING_RATE if (name, exporter) in FOLDED_RESNETS else LEARNING_RATE
        training = onnxtrain.make_training_model(as_float64(model) if float64 else model, loss=family.loss,
                                                 output=family.output, optimizer=optim.Adam(lr=rate))
        algorithm = training.training_info[0].algorithm
        (gradient,) = [n for n in algorithm.node if n.op_type == "Gradient"]
        algorithm.output.extend(ValueInfoProto(name=g) for g in gradient.output)
        xs = next(a for a in gradient.attribute if a.name == "xs").strings
        # NaN steps are applied, not refused: the checks then see every gradient and the losses.
        trainer = onnxtrain.Trainer(training, nan_policy="ignore")
        feeds = {**self.feeds(name, exporter), "labels": self.labels(name)}
        if float64:
            feeds = {key: value.astype(np.float64) if value.dtype == np.float32 else value
                     for key, value in feeds.items()}
        out = trainer.step(feeds)
        gradients = {x.decode(): np.asarray(out[g]) for x, g in zip(xs, gradient.output)}
        return Training(trainer, feeds, gradients, [float(out["loss"])])

    def gradient_report(self, name: str, exporter: str) -> tuple[float, list[str], list[str]]:
        """(worst gradient error, problems, notes): see the module docstring. The error of a
        parameter is max|onnxtrain - torch| over its elements relative to its largest torch
        gradient. A parameter past GRADIENT_TOLERANCE is a problem unless float32 rounding
        explains it (then it is a note): in float64, onnxtrain gives torch's float64 gradient
        within FLOAT64_TOLERANCE, and its float32 one is within ROUNDING_CEILING of that."""
        family = export_zoo.FAMILIES[name]
        onnx_gradients = self.training(name, exporter).gradients
        initial = _initializers(self.model(name, exporter))
        sklearn = initial if name.startswith("sk_") else None
        params, torch_gradients = torch_oracle(family, self.feeds(name, exporter), self.labels(name), sklearn)
        traced = trace(initial, onnx_gradients, params)
        problems, notes = [], []
        if traced.constants:
            problems.append(f"trained by default but copy no torch parameter: {traced.constants[:6]}"
                            f"{' ...' if len(traced.constants) > 6 else ''}")
        # Gradients that are zero in exact arithmetic (attention key biases, which softmax
        # cancels; a conv bias before a per-channel norm) hold only rounding noise on both
        # sides: they are measured against the model's largest gradient.
        largest = max((float(np.max(np.abs(g))) for g in torch_gradients.values() if g.size), default=0.0)
        errors = {}
        for param, expected in torch_gradients.items():
            got, covered = traced.summed[param], traced.covered[param]
            missing = ~covered & (np.abs(expected) > 1e-6 * max(np.max(np.abs(expected)), 1e-30))
            if missing.any():
                problems.append(f"parameter {param} has gradients but no trainable initializer copies "
                                f"{int(missing.sum())} of its {expected.size} elements (folded or frozen)")
                continue
            scale = float(np.max(np.abs(expected)))
            errors[param] = (_relative(got, expected, largest if scale < ZERO_GRADIENT * largest else scale))
        beyond = {param: error for param, error in errors.items() if error > GRADIENT_TOLERANCE}
        if beyond:
            _, exact = torch_oracle(family, self.feeds(name, exporter), self.labels(name), sklearn, np.float64)
            wide = trace(initial, self.first_step(name, exporter, float64=True).gradients, params).summed
            for param, error in sorted(beyond.items(), key=lambda item: -item[1]):
                scale = float(np.max(np.abs(exact[param])))
                scale = largest if scale < ZERO_GRADIENT * largest else scale
                ours = _relative(traced.summed[param], exact[param], scale)
                theirs = _relative(torch_gradients[param], exact[param], scale)
                ours64 = _relative(wide[param], exact[param], scale)
                figures = (f"{param}: {error:.1e} from torch float32; against float64 torch, onnxtrain "
                           f"{ours:.1e} and torch float32 {theirs:.1e}; onnxtrain in float64 {ours64:.1e}")
                rounding = ours64 <= FLOAT64_TOLERANCE and ours <= ROUNDING_CEILING
                (notes if rounding else problems).append(figures)
        return max(errors.values(), default=0.0), problems, notes

    def losses(self, name: str, exporter: str) -> list[float]:
        """The loss before each of STEPS + 1 Adam steps on the fixed batch."""
        run = self.training(name, exporter)
        while len(run.losses) <= STEPS:
            run.losses.append(float(run.trainer.step(run.feeds)["loss"]))
        return run.losses

    def export_error(self, name: str, exporter: str, folder: Path) -> float:
        """The worst |onnxruntime - infer| / (1 + |infer|) of the trained model's inference export."""
        import onnxruntime

        self.losses(name, exporter)
        run = self.training(name, exporter)
        output = export_zoo.FAMILIES[name].output
        path = Path(folder) / f"{name}-{exporter}.trained.onnx"
        run.trainer.export(path, training=False)
        feeds = self.feeds(name, exporter)
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        (served,) = session.run([output], feeds)
        expected = np.asarray(run.trainer.infer(feeds)[output])
        return float(np.max(np.abs(served - expected) / (1 + np.abs(expected))))


def as_float64(model: bytes) -> bytes:
    """The model with every float32 tensor, type and cast target made float64: initializers,
    Constant and ConstantOfShape values, graph inputs, outputs and value_info, Cast's `to` and
    the `dtype` of generators, in subgraphs too."""
    import onnx
    from onnx import AttributeProto, TensorProto, numpy_helper

    def widen(tensor: TensorProto) -> None:
        if tensor.data_type == TensorProto.FLOAT:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name))

    def graph(g) -> None:
        for tensor in g.initializer:
            widen(tensor)
        for value in (*g.input, *g.output, *g.value_info):
            if value.type.tensor_type.elem_type == TensorProto.FLOAT:
                value.type.tensor_type.elem_type = TensorProto.DOUBLE
        for node in g.node:
            for attribute in node.attribute:
                if attribute.type == AttributeProto.TENSOR:
                    widen(attribute.t)
                elif attribute.name in ("to", "dtype") and attribute.i == TensorProto.FLOAT:
                    attribute.i = TensorProto.DOUBLE
                for sub in (*([attribute.g] if attribute.type == AttributeProto.GRAPH else []), *attribute.graphs):
                    graph(sub)

    proto = onnx.load_from_string(model)
    graph(proto.graph)
    return proto.SerializeToString()


def _initializers(model: bytes) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in onnx.load_from_string(model).graph.initializer}


@dataclass
class Traced:
    """ONNX gradients laid out as torch's parameters (summed over the copies of each element)."""

    summed: dict[str, np.ndarray]
    covered: dict[str, np.ndarray]
    constants: list[str]


def trace(initial: dict[str, np.ndarray], gradients: dict[str, np.ndarray],
          params: dict[str, np.ndarray]) -> Traced:
    """Trace each trained initializer's elements to the torch parameter elements holding the
    same value, and scatter-add its gradient there. Initializers not wholly made of parameter
    values are `constants`.

    export_zoo makes the parameters' values distinct; should a value still occur in several
    parameters, the element goes to one of those the initializer's unambiguous elements
    come from."""
    names = list(params)
    values = np.concatenate([params[n].ravel() for n in names]).astype(np.float32)
    owner = np.concatenate([np.full(params[n].size, i) for i, n in enumerate(names)])
    offset = np.concatenate([np.arange(params[n].size) for n in names])
    order = np.argsort(values, kind="stable")
    ordered, owner, offset = values[order], owner[order], offset[order]
    summed = {n: np.zeros(params[n].shape, np.float64) for n in names}
    covered = {n: np.zeros(params[n].shape, bool) for n in names}
    constants = []
    for key, gradient in gradients.items():
        value = initial[key].astype(np.float32).ravel()
        low, high = np.searchsorted(ordered, value, "left"), np.searchsorted(ordered, value, "right")
        if not len(ordered) or np.any(low == high):
            constants.append(key)
            continue
        sources = set(owner[low[high - low == 1]].tolist())
        position = low.copy()
        for element in np.flatnonzero(high - low > 1):
            candidates = range(low[element], high[element])
            position[element] = next((p for p in candidates if owner[p] in sources), low[element])
        flat = np.asarray(gradient, np.float64).ravel()
        for i in set(owner[position].tolist()):
            chosen = owner[position] == i
            np.add.at(summed[names[i]].reshape(-1), offset[position][chosen], flat[chosen])
            covered[names[i]].reshape(-1)[offset[position][chosen]] = True
    return Traced(summed, covered, constants)


def torch_training_model(family):
    """The family's torch model computing what its training model computes: BatchNorm in
    train mode (batch statistics), every other module in eval mode, as exported (Dropout
    and stochastic depth are then the identity, as in the export)."""
    import torch

    model = export_zoo.torch_model(family)
    norms = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)
    for module in model.modules():
        module.train(family.batchnorm and isinstance(module, norms))
    return model


def torch_oracle(family, feeds: dict[str, np.ndarray], labels: np.ndarray,
                 initial: dict[str, np.ndarray] | None = None, dtype=np.float32) -> tuple[dict, dict]:
    """(parameters, gradients) of the family's loss in torch, by parameter name, computed in
    `dtype` (the parameters are returned as exported, in float32), on torch_training_model.
    scikit-learn families are rebuilt in torch from their initializers (`initial`)."""
    import torch
    import torch.nn.functional as F

    if initial is not None:
        model = _sklearn_in_torch(family, initial)
        inputs = [torch.from_numpy(feeds["X"])]
    else:
        model = torch_training_model(family)
        batch = export_zoo.batch(family)
        inputs = [torch.from_numpy(v) for v in batch.values()]
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    wide = torch.float64 if dtype == np.float64 else torch.float32
    model.to(wide)
    inputs = [x.to(wide) if x.is_floating_point() else x for x in inputs]
    prediction = model(*inputs)
    target = torch.from_numpy(labels)
    target = target.to(wide) if target.is_floating_point() else target
    loss = F.cross_entropy(prediction, target) if family.loss == "cross_entropy" else F.mse_loss(prediction, target)
    loss.backward()
    grads = {n: (p.grad.numpy().astype(np.float64) if p.grad is not None else np.zeros(p.shape))
             for n, p in model.named_parameters()}
    return params, grads


def _relative(got: np.ndarray, expected: np.ndarray, scale: float) -> float:
    """max|got - expected| relative to `scale` (absolute where the scale is zero)."""
    error = float(np.max(np.abs(got - expected), initial=0.0))
    return error / scale if scale else error


def _sklearn_in_torch(family, initial: dict[str, np.ndarray]):
    """The skl2onnx graph of StandardScaler + a linear model (standard ops), written in torch
    from its initializers: ((x - offset) / scale) @ coef + intercept, softmax for classifiers."""
    import torch

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for key in ("Su_Subcst", "Di_Divcst", "coef", "intercept"):
                self.register_parameter(key, torch.nn.Parameter(torch.from_numpy(initial[key].copy())))

        def forward(self, x):
            y = (x - self.Su_Subcst) / self.Di_Divcst @ self.coef + self.intercept
            return torch.softmax(y, -1) if family.output == "probabilities" else y.reshape(-1, 1)

    return Linear()


# --- the acceptance table ---------------------------------------------------------------


def measure(zoo: Zoo, name: str, exporter: str, check: str, folder: Path) -> str:
    """One cell of the table: the check's figure, or the first line of what failed."""
    try:
        if check == "inference":
            return f"{zoo.inference_error(name, exporter):.1e}"
        if name == "sk_logistic_ml":
            return "n/a"
        if check == "gradients":
            worst, problems, notes = zoo.gradient_report(name, exporter)
            return (f"{worst:.1e}" + (f" FAIL {problems[0]}" if problems else "")
                    + (f" (float32 rounding: {notes[0]})" if notes and not problems else ""))
        if check == "trains":
            losses = zoo.losses(name, exporter)
            return f"{losses[0]:.3g} -> {losses[-1]:.3g}"
        return f"{zoo.export_error(name, exporter, folder):.1e}"
    except Exception as error:  # the table reports every failure instead of stopping at one
        first = (str(error).strip().splitlines() or [""])[0]
        return f"FAIL {type(error).__name__}: {first[:160]}"


def main() -> None:
    parser = argparse.ArgumentParser(description="Print the zoo's acceptance table.")
    parser.add_argument("--family", action="append", choices=sorted(export_zoo.FAMILIES))
    parser.add_argument("--exporter", action="append")
    parser.add_argument("--exports", type=Path, help="folder to keep exports in (default: a temporary one)")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = options.exports or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        zoo = Zoo(folder)
        print("| model | exporter | " + " | ".join(CHECKS) + " |")
        print("|---|---|" + "---|" * len(CHECKS))
        for name, exporter in export_zoo.cases():
            if name not in (options.family or [name]) or exporter not in (options.exporter or [exporter]):
                continue
            try:
                zoo.model(name, exporter)
            except Exception:
                cells = ["export FAILED: " + traceback.format_exc().strip().splitlines()[-1][:160]] * len(CHECKS)
            else:
                cells = [measure(zoo, name, exporter, check, Path(scratch)) for check in CHECKS]
            print(f"| {name} | {exporter} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
