"""The command line's finetune command, train's loop options, inspect's hyperparameters, --help.

Oracles: onnxruntime scores what `finetune` writes and must agree with a FineTuner restored
from the checkpoint the command saved; the learning rate `train --lr` sets is the value in
the exported model; the numbers inspect prints are the initializers' own (read with onnx).
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import optim
from onnxtrain.cli import FINETUNE_DEMO_MODEL, demo_model_path, main


def _classifier() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "B"], ["logits"], transB=1)], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(rng.normal(size=(3, 4)).astype(np.float32), "W"),
         numpy_helper.from_array(np.zeros(3, np.float32), "B")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.mark.parametrize("optimizer, settings", [
    (optim.Adam(lr=0.003), "optimizer: Adam (alpha=0.9, beta=0.999, epsilon=1e-08"),
    (optim.Momentum(lr=0.003), "optimizer: Momentum (alpha=0.9, beta=1, norm_coefficient=0, mode=standard)"),
])
def test_inspect_reads_sparse_slots_and_prints_the_hyperparameters(tmp_path, capsys, optimizer, settings):
    path = tmp_path / "train.onnx"
    onnxtrain.save_model(onnxtrain.make_training_model(_classifier(), "cross_entropy", optimizer=optimizer), path)
    assert main(["inspect", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "not an initializer" not in printed
    assert "W.V float32[3, 4] (sparse, 0 stored values)" in printed
    assert settings in printed
    first_step = 1 if isinstance(optimizer, optim.Adam) else 0
    assert "    learning rate: learning_rate = 0.003\n" in printed
    assert f"    step counter: step = {first_step}\n" in printed


def test_inspect_prints_the_bundled_models_learning_rate_as_stored(capsys):
    model = onnx.load(demo_model_path())
    stored = {t.name: numpy_helper.to_array(t) for t in model.training_info[0].algorithm.initializer}
    assert main(["inspect", str(demo_model_path())]) == 0
    printed = capsys.readouterr().out
    assert f"learning rate: learning_rate = {float(stored['learning_rate']):.6g}\n" in printed
    assert f"step counter: step = {int(stored['step'])}\n" in printed
    assert "not an initializer" not in printed


def test_inspect_still_flags_a_binding_to_no_initializer(capsys):
    model = onnxtrain.make_training_model(_classifier(), "mse")
    model.training_info[0].update_binding.add(key="ghost", value="loss")
    assert "ghost (not an initializer!)" in onnxtrain.describe(model)


def test_one_inspect_command_and_help_with_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["info", str(demo_model_path())])
    assert exit_info.value.code == 2
    capsys.readouterr()
    for command, shown in (("train", ["--batch-size BATCH_SIZE\n", "(default: 32)", "--val-data", "--shuffle",
                                      "--checkpoint", "--lr"]),
                           ("finetune", ["(default: adam)", "(default: 0.001)", "--loss", "--ignore-index"]),
                           ("make-training", ["(default: adam)", "(default: labels)"])):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        printed = " ".join(capsys.readouterr().out.split())
        for text in shown:
            assert " ".join(text.split()) in printed, (command, text)
        assert "(default: None)" not in printed and "(default: False)" not in printed


def test_the_loss_is_a_required_option(tmp_path, capsys):
    onnx.save(_classifier(), tmp_path / "m.onnx")
    for command in (["make-training", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "t.onnx")],
                    ["finetune", str(tmp_path / "m.onnx"), "--data", "d.npz", "-o", str(tmp_path / "t.onnx")]):
        with pytest.raises(SystemExit) as exit_info:
            main(command)
        assert exit_info.value.code == 2
        assert "the following arguments are required: --loss" in capsys.readouterr().err


def _history(printed: str, name: str) -> list[float]:
    """The per-epoch values a command printed as `name: a -> b -> c`."""
    return [float(v) for v in re.search(rf"^{name}: (.*)$", printed, re.M).group(1).split(" -> ")]


def _spirals(path, count: int, seed: int = 0):
    from onnxtrain.demo import spirals

    x, labels = spirals(count // 3, seed=seed)
    np.savez(path, X=x, labels=labels)
    return x, labels


@pytest.mark.slow
def test_train_sets_the_learning_rate_shuffles_validates_and_checkpoints(tmp_path, capsys):
    _spirals(tmp_path / "train.npz", 300)
    _spirals(tmp_path / "val.npz", 90, seed=1)
    common = [str(demo_model_path()), "--data", str(tmp_path / "train.npz"), "--val-data", str(tmp_path / "val.npz"),
              "--epochs", "3", "--batch-size", "50", "--initialize", "--seed", "0", "--quiet"]
    runs = {}
    for name, extra in (("shuffled", ["--shuffle", "--lr", "0.02", "--checkpoint", str(tmp_path / "c.ckpt")]),
                        ("again", ["--shuffle", "--lr", "0.02"]), ("ordered", ["--lr", "0.02"])):
        assert main(["train", *common, *extra, "-o", str(tmp_path / f"{name}.onnx")]) == 0
        runs[name] = capsys.readouterr().out
    val_losses = _history(runs["shuffled"], "val_loss")
    assert len(val_losses) == 3 and val_losses[-1] < val_losses[0]
    trained = {name: onnx.load(tmp_path / f"{name}.onnx") for name in runs}
    rates = {name: float(numpy_helper.to_array(next(
        t for t in model.training_info[0].algorithm.initializer if t.name == "learning_rate")))
        for name, model in trained.items()}
    assert rates == {name: pytest.approx(0.02) for name in runs}

    def weights(name):
        return {t.name: numpy_helper.to_array(t) for t in trained[name].graph.initializer}

    for key, value in weights("shuffled").items():   # a seeded order: the same run twice
        np.testing.assert_array_equal(value, weights("again")[key])
    assert not np.array_equal(weights("shuffled")["W1"], weights("ordered")["W1"])
    restored = onnxtrain.Trainer(demo_model_path())
    restored.load_checkpoint(tmp_path / "c.ckpt")    # the last epoch's checkpoint is the final state
    for key, value in weights("shuffled").items():
        np.testing.assert_array_equal(np.asarray(restored.state[key]), value)


@pytest.mark.slow
def test_finetune_command_writes_what_onnxruntime_serves(tmp_path, capsys):
    onnxruntime = pytest.importorskip("onnxruntime")
    optax = pytest.importorskip("optax")
    from importlib import resources

    from onnxtrain.demo import digits

    images, labels = digits()
    np.savez(tmp_path / "train.npz", x=images[:256], labels=labels[:256])
    np.savez(tmp_path / "val.npz", x=images[256:384], labels=labels[256:384])
    model = str(resources.files("onnxtrain") / "models" / FINETUNE_DEMO_MODEL)
    out, checkpoint = tmp_path / "tuned.onnx", tmp_path / "tuned.ckpt"
    assert main(["finetune", model, "--data", str(tmp_path / "train.npz"), "--val-data", str(tmp_path / "val.npz"),
                 "--loss", "cross_entropy", "--optimizer", "adamw", "--lr", "0.003", "--epochs", "3",
                 "--batch-size", "64", "--shuffle", "--checkpoint", str(checkpoint), "--quiet",
                 "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    losses, val_losses = _history(printed, "loss"), _history(printed, "val_loss")
    assert len(losses) == len(val_losses) == 3 and losses[-1] < losses[0]
    assert not onnx.load(out).training_info
    (served,) = onnxruntime.InferenceSession(str(out)).run(None, {"x": images[384:448]})
    tuner = onnxtrain.finetune(model, "cross_entropy", optax.adamw(0.003))
    tuner.load_checkpoint(checkpoint)
    np.testing.assert_allclose(served, np.asarray(tuner.infer({"x": images[384:448]})["logits"]),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_bad_label_is_one_line_naming_it(tmp_path):
    x, labels = _spirals(tmp_path / "train.npz", 30)
    labels[7] = 5
    np.savez(tmp_path / "train.npz", X=x, labels=labels)
    result = subprocess.run([sys.executable, "-m", "onnxtrain", "train", str(demo_model_path()), "--data",
                             str(tmp_path / "train.npz"), "--batch-size", "30", "--quiet", "-o",
                             str(tmp_path / "o.onnx")], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.startswith("onnxtrain: input 'labels': label 5 at index 7 is not a class of the "
                                    "SoftmaxCrossEntropyLoss node 'loss': labels must be in 0..2")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
