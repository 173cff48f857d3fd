"""Write the PyTorch-exported test fixtures and their PyTorch oracles.

onnxtrain's promise is fine-tuning models someone else exported, so the tests
need real exporter output (its names, transposed weights, shape arithmetic,
BatchNormalization and LayerNormalization nodes) and numbers computed by the
framework that made it. This dev-only script (torch and scikit-learn are never
runtime dependencies; the tests read its committed output) writes, deterministically (fixed seeds, one CPU
thread, deterministic algorithms):

- tests/fixtures/digits.npz: the 8x8 digits (UCI, CC BY 4.0: see SOURCE),
  images float32 in [0, 1];
- onnxtrain/models/digits.npz: the same, images uint8 0..16 (for the demo);
- onnxtrain/models/digits_cnn.onnx: a copy of the CNN fixture (the demo fine-tunes it);
- tests/fixtures/torch/{mlp,cnn,transformer}.onnx, exported with the legacy
  TorchScript exporter, opset 17, input "x", output "logits", dynamic "batch";
- tests/fixtures/torch/<name>_oracle.npz: batches, gradients, SGD trajectories
  and weights computed by torch on the exported weights, keyed by the ONNX
  initializer names and laid out as the initializers are (see NOTE).

Usage: python scripts/make_torch_fixtures.py
"""

from __future__ import annotations

import copy
import io
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from sklearn.datasets import load_digits
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
OUTPUT = FIXTURES / "torch"
DEMO_DIGITS = ROOT / "onnxtrain" / "models" / "digits.npz"
DEMO_MODEL = ROOT / "onnxtrain" / "models" / "digits_cnn.onnx"
SOURCE = ("UCI Optical Recognition of Handwritten Digits, E. Alpaydin and C. Kaynak (1998), its test set "
          "(1797 8x8 images of pixel counts 0..16), CC BY 4.0, "
          "https://archive.ics.uci.edu/ml/datasets/Optical+Recognition+of+Handwritten+Digits, "
          "as bundled with scikit-learn (sklearn.datasets.load_digits)")
OPSET, STEPS, BATCH, LR = 17, 20, 16, 0.05
NOTE = (
    "torch oracle. loss = torch.nn.functional.cross_entropy(logits, y, reduction='mean'). "
    "grad__/evalgrad__: gradient of the loss on batches_x[0] at the exported weights, model in train mode "
    "(BatchNorm uses biased batch statistics) / eval mode (running statistics). "
    "sgd_losses/sgd_losses_eval: 20 steps of plain SGD (lr sgd_lr, no momentum, no weight decay), step k "
    "on batch k, loss before the step; final__: weights after the 20 train-mode steps. "
    "forward_logits: batch 0, eval mode, exported weights. Arrays are in the ONNX initializer layout: "
    "see torch_names/transposed for the torch parameter behind each initializer."
)
BATCHNORM_NOTE = (
    " running__: BatchNorm running mean/var after the 20 train-mode steps, torch momentum 0.1, i.e. "
    "running = 0.9 * running + 0.1 * batch_stat, which is ONNX BatchNormalization momentum 0.9 "
    "(running * momentum + batch * (1 - momentum)); torch updates running_var with the UNBIASED batch "
    "variance (n / (n - 1) times the biased one, n = batch * height * width) and normalizes with the "
    "biased one."
)


class TinyEncoder(nn.Module):
    """One pre-LN block (2-head self-attention, GELU FFN), mean over seq, 3 classes."""

    def __init__(self, d: int = 16, heads: int = 2, hidden: int = 32, classes: int = 3):
        super().__init__()
        self.heads, self.scale = heads, (d // heads) ** -0.5
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.ffn = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        q, k, v = (proj(h).unflatten(-1, (self.heads, -1)).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attention = torch.softmax(q @ k.transpose(-1, -2) * self.scale, dim=-1)
        x = x + self.out((attention @ v).transpose(1, 2).flatten(2))
        x = x + self.ffn(self.ln2(x))
        return self.head(x.mean(dim=1))


def digits() -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [1797, 1, 8, 8] with values 0..16, labels int64 [1797])."""
    data = load_digits()
    return data.images.astype(np.uint8)[:, None], data.target.astype(np.int64)


def mlp(rng: np.random.Generator) -> tuple[nn.Module, np.ndarray, np.ndarray]:
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5))
    x = rng.standard_normal((STEPS * BATCH, 20), dtype=np.float32)
    return model, x, np.argmax(x @ rng.standard_normal((20, 5), dtype=np.float32), axis=1)


def cnn(rng: np.random.Generator) -> tuple[nn.Module, np.ndarray, np.ndarray]:
    """Pre-trained for 2 epochs on digits 0-4 only; the oracle batches hold all ten, unseen."""
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64, 10),
    )
    images, labels = digits()
    images = torch.from_numpy(images / np.float32(16))
    order = rng.permutation(len(labels))
    pretrain = order[:900][labels[order[:900]] < 5]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):
        for batch in np.split(pretrain, np.arange(32, len(pretrain), 32)):
            optimizer.zero_grad()
            F.cross_entropy(model(images[batch]), torch.from_numpy(labels[batch])).backward()
            optimizer.step()
    held_out = order[900:900 + STEPS * BATCH]
    return model, images[held_out].numpy(), labels[held_out]


def transformer(rng: np.random.Generator) -> tuple[nn.Module, np.ndarray, np.ndarray]:
    """LayerNorm weights and biases are moved off 1 and 0: the exporter merges bit-equal initializers."""
    model = TinyEncoder()
    with torch.no_grad():
        for norm in (model.ln1, model.ln2):
            for p in norm.parameters():
                p.add_(0.1 * torch.randn_like(p))
    x = rng.standard_normal((STEPS * BATCH, 6, 16), dtype=np.float32)
    return model, x, np.argmax(x.mean(axis=1)[:, :3], axis=1)


def export(model: nn.Module, example: torch.Tensor) -> bytes:
    """Legacy exporter; PRESERVE keeps BatchNormalization nodes (EVAL mode folds them into Conv).

    Its warning against constant folding is about models in train mode; here
    folding only turns Linear weights that feed MatMul into transposed
    onnx::MatMul_* initializers, as a default export does.
    """
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", "It is recommended that constant folding be turned off", UserWarning)
        torch.onnx.export(
            model.eval(), (example,), buffer, dynamo=False, opset_version=OPSET,
            input_names=["x"], output_names=["logits"],
            dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
            training=torch.onnx.TrainingMode.PRESERVE, keep_initializers_as_inputs=False,
        )
    return buffer.getvalue()


def initializer_layout(model: nn.Module, onnx_bytes: bytes) -> dict[str, tuple[str, bool]]:
    """torch state name -> (ONNX initializer name, stored transposed?), matched by value, one to one."""
    initializers = {t.name: numpy_helper.to_array(t) for t in onnx.load_from_string(onnx_bytes).graph.initializer}
    layout = {}
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point():
            continue
        value = tensor.numpy()
        candidates = [(False, value), (True, value.T)] if value.ndim == 2 else [(False, value)]
        hits = [(init, transposed) for init, array in initializers.items() for transposed, layout_value in candidates
                if array.shape == layout_value.shape and np.array_equal(array, layout_value)]
        if len(hits) != 1:
            raise RuntimeError(f"{name}: {len(hits)} matching initializers {hits}")
        layout[name] = hits[0]
    unmapped = {n for n, a in initializers.items() if a.dtype.kind == "f"} - {init for init, _ in layout.values()}
    if unmapped or len({init for init, _ in layout.values()}) != len(layout):
        raise RuntimeError(f"initializers not one to one with torch tensors: {sorted(unmapped)}")
    return layout


def oracle(model: nn.Module, layout: dict[str, tuple[str, bool]], x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """Everything the tests compare against, in the ONNX initializer names and layout."""
    xs, ys = x.reshape(STEPS, BATCH, *x.shape[1:]), y.reshape(STEPS, BATCH)

    def onnx_layout(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        arrays = {}
        for name, tensor in tensors.items():
            init, transposed = layout[name]
            arrays[f"{prefix}__{init}"] = np.ascontiguousarray(tensor.detach().numpy().T if transposed else tensor.detach().numpy())
        return arrays

    def loss(m: nn.Module, k: int) -> torch.Tensor:
        return F.cross_entropy(m(torch.from_numpy(xs[k])), torch.from_numpy(ys[k]))

    def copy_in(train: bool) -> nn.Module:
        return copy.deepcopy(model).train(train)

    def sgd(train: bool) -> tuple[np.ndarray, nn.Module]:
        m = copy_in(train)
        optimizer = torch.optim.SGD(m.parameters(), lr=LR)
        losses = []
        for k in range(STEPS):
            optimizer.zero_grad()
            value = loss(m, k)
            value.backward()
            optimizer.step()
            losses.append(value.item())
        return np.array(losses, np.float32), m

    params = [name for name, _ in model.named_parameters()]
    arrays = {"batches_x": xs, "batches_y": ys, "sgd_lr": np.float32(LR)}
    for prefix, train in (("grad", True), ("evalgrad", False)):
        m = copy_in(train)
        arrays |= onnx_layout(prefix, dict(zip(params, torch.autograd.grad(loss(m, 0), list(m.parameters())))))
    arrays["sgd_losses"], trained = sgd(train=True)
    arrays["sgd_losses_eval"], _ = sgd(train=False)
    arrays |= onnx_layout("final", dict(trained.named_parameters()))
    running = {n: b for n, b in trained.named_buffers() if n.endswith(("running_mean", "running_var"))}
    arrays |= onnx_layout("running", running)
    with torch.no_grad():
        arrays["forward_logits"] = copy_in(False)(torch.from_numpy(xs[0])).numpy()
    arrays["note"] = np.array(NOTE + (BATCHNORM_NOTE if running else ""))
    arrays["torch_names"] = np.array(list(layout))
    arrays["initializer_names"] = np.array([init for init, _ in layout.values()])
    arrays["transposed"] = np.array([transposed for _, transposed in layout.values()])
    return arrays


def build() -> dict[str, tuple[bytes, dict[str, np.ndarray]]]:
    """name -> (exported ONNX model, oracle arrays); the same on every run."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    fixtures = {}
    for seed, make in enumerate((mlp, cnn, transformer)):
        torch.manual_seed(seed)
        model, x, y = make(np.random.default_rng(seed))
        model = model.eval()
        onnx_bytes = export(model, torch.from_numpy(x[:2]))
        fixtures[make.__name__] = onnx_bytes, oracle(model, initializer_layout(model, onnx_bytes), x, y.astype(np.int64))
    return fixtures


def main() -> None:
    OUTPUT.mkdir(parents=True, exist_ok=True)
    images, labels = digits()
    source = np.array(SOURCE)
    np.savez_compressed(FIXTURES / "digits.npz", images=images / np.float32(16), labels=labels, source=source)
    np.savez_compressed(DEMO_DIGITS, images=images, labels=labels, source=source,
                        note=np.array("images are uint8 pixel counts 0..16: divide by 16 for [0, 1]"))
    for name, (onnx_bytes, arrays) in build().items():
        (OUTPUT / f"{name}.onnx").write_bytes(onnx_bytes)
        if name == "cnn":
            DEMO_MODEL.write_bytes(onnx_bytes)
        np.savez_compressed(OUTPUT / f"{name}_oracle.npz", **arrays)


if __name__ == "__main__":
    main()
