"""Trainer.export(portable=True / "step"): the bench MLP and CNN with Adam and Momentum, 20
steps at batch sizes 4 and 7 from one file, against onnxtrain's own run of the recipe:
the step model in stock onnxruntime (examples/portable_ort.py), the portable training_info
model back in onnxtrain; onnx.checker (full_check); node count and size."""

from __future__ import annotations

import functools
import importlib.util
import json

import numpy as np
import onnx
import pytest
from onnx import helper

import onnxtrain
from onnxtrain._portable.manifest import MANIFEST_KEY, StepManifest
from onnxtrain.errors import ExportError, ModelLoadError
from support.portable_training import (EXAMPLES, errors, forward_model, reference, reference_start, run_trainer,
                                      save_batches, training_bytes, weights)

# The bench MLP and CNN, a CNN with BatchNorm in training mode and Gemm, a tiny BERT encoder.
CASES = [("mlp", "adam"), ("cnn", "momentum"), ("cnn_bn", "momentum"), ("mlp", "momentum"), ("cnn", "adam"),
         ("cnn_bn", "adam"), ("bert", "adam"), ("mlp", "adagrad")]
TRAINING_DOMAINS = {"ai.onnx.preview.training", "ai.onnx.preview"}


@functools.cache
def _exported(name: str, optimizer: str, folder) -> dict[str, str]:
    trainer = onnxtrain.Trainer(training_bytes(name, optimizer))
    paths = {"portable": str(folder / f"{name}.{optimizer}.portable.onnx"),
             "step": str(folder / f"{name}.{optimizer}.step.onnx")}
    trainer.export(paths["portable"], portable=True)
    trainer.export(paths["step"], portable="step")
    return paths


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("portable")


def _runner():
    spec = importlib.util.spec_from_file_location("portable_ort", EXAMPLES / "portable_ort.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _manifest(path: str) -> StepManifest:
    model = onnx.load(path)
    return StepManifest.from_json({p.key: p.value for p in model.metadata_props}[MANIFEST_KEY])


@pytest.mark.slow
@pytest.mark.parametrize("name, optimizer", CASES)
def test_step_model_in_onnxruntime_reproduces_onnxtrain(name, optimizer, folder, tmp_path):
    from support.portable_training import Run

    path = _exported(name, optimizer, folder)["step"]
    npz, _ = save_batches(name, tmp_path)
    _runner().train(path, str(npz), str(tmp_path / "trained.npz"))
    saved = np.load(tmp_path / "trained.npz")
    manifest = _manifest(path)
    state = [a for a, _ in manifest.state]
    actual = Run(saved["losses"], {k: saved[k] for k in state})
    expected = reference(name, optimizer)
    measured = errors(actual, expected, [w for w in weights(name) if w in state])
    print(f"{name}/{optimizer} stock onnxruntime vs onnxtrain: weights {measured}, "
          f"with the optimizer slots {errors(actual, expected, state)}")
    assert measured["loss"] <= 1e-5 and measured["norm"] <= 1e-5, measured
    if optimizer != "adam":
        # Adam's first step g / (|g| + epsilon) turns float noise in a near-zero gradient
        # element into a full step: its worst single element is reported, not bounded.
        assert measured["max"] <= 1e-5, measured
    # The state moved: the run trained.
    assert errors(actual, reference_start(name, optimizer), state)["norm"] > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name, optimizer", [("mlp", "adam"), ("bert", "adam")])
def test_onnxruntime_stays_within_1e_5_of_the_exact_trajectory(name, optimizer, folder, tmp_path):
    """The float64 run of the same step model is the exact trajectory, an oracle independent
    of onnxtrain's own float32 rounding: onnxruntime's float32 run of the export stays within
    1e-5 of it on every element (relative to each tensor's largest magnitude), so the export
    adds no error beyond float32's. onnxtrain's own run is not bounded element by element:
    a gradient element that is a near-cancelling sum of much larger terms becomes, through
    Adam's first step g / (|g| + epsilon), a different step for every rounding of the sum."""
    from support.portable_training import Run, exact_run

    path = _exported(name, optimizer, folder)["step"]
    npz, _ = save_batches(name, tmp_path)
    _runner().train(path, str(npz), str(tmp_path / "trained.npz"))
    saved = np.load(tmp_path / "trained.npz")
    ours, exact = reference(name, optimizer), exact_run(path, name)
    names = [w for w in weights(name) if w in saved.files]
    runtime = errors(Run(saved["losses"], dict(saved)), exact, names)
    print(f"{name}/{optimizer}: onnxruntime vs float64 {runtime}, onnxtrain vs float64 {errors(ours, exact, names)}")
    assert runtime["loss"] <= 1e-5 and runtime["max"] <= 1e-5, runtime


@pytest.mark.slow
@pytest.mark.parametrize("name, optimizer", CASES[:3])
def test_portable_training_info_runs_in_onnxtrain_with_the_same_steps(name, optimizer, folder):
    path = _exported(name, optimizer, folder)["portable"]
    trainer = onnxtrain.Trainer(path)
    assert set(trainer.state_names) == set(reference(name, optimizer).state) - set(trainer.hyperparameter_names)
    measured = errors(run_trainer(trainer, name), reference(name, optimizer),
                      [w for w in weights(name) if w in trainer.state_names])
    print(f"{name}/{optimizer} portable training_info in onnxtrain vs onnxtrain: {measured}")
    assert max(measured.values()) <= 1e-5, measured


def _combined(model: onnx.ModelProto, info: onnx.TrainingInfoProto) -> onnx.ModelProto:
    """The training step's combined graph (main then algorithm) as a model of its own."""
    graph = helper.make_graph([*model.graph.node, *info.algorithm.node], "step",
                              [*model.graph.input, *info.algorithm.input], list(info.algorithm.output),
                              [*model.graph.initializer, *info.algorithm.initializer])
    return helper.make_model(graph, ir_version=model.ir_version, opset_imports=list(model.opset_import))


@pytest.mark.slow
@pytest.mark.parametrize("name, optimizer", CASES[:3])
def test_exports_use_only_standard_ops_and_pass_the_full_checker(name, optimizer, folder):
    paths = _exported(name, optimizer, folder)
    portable, step = onnx.load(paths["portable"]), onnx.load(paths["step"])
    for model in (portable, step):
        assert not {o.domain for o in model.opset_import} & TRAINING_DOMAINS
        assert model.ir_version <= 10
        onnx.checker.check_model(model, full_check=True)
    graphs = [portable.graph, step.graph, *(g for info in portable.training_info
                                             for g in (info.algorithm, info.initialization))]
    assert all(node.domain in ("", "ai.onnx") for g in graphs for node in g.node)
    for info in portable.training_info:
        onnx.checker.check_model(_combined(portable, info), full_check=True)
    # The bindings are the recipe's.
    original = onnx.load_from_string(training_bytes(name, optimizer))
    assert ([(b.key, b.value) for b in portable.training_info[0].update_binding]
            == [(b.key, b.value) for b in original.training_info[0].update_binding])
    # Dynamic batch stays dynamic.
    x = next(i for i in step.graph.input if i.name == "x")
    assert not x.type.tensor_type.shape.dim[0].HasField("dim_value")


@pytest.mark.slow
@pytest.mark.parametrize("name, optimizer", CASES)
def test_step_model_size_against_the_forward_model(name, optimizer, folder):
    step = onnx.load(_exported(name, optimizer, folder)["step"])
    forward = forward_model(name)
    original = onnx.load_from_string(training_bytes(name, optimizer))
    # The recipe's own standard nodes: forward, loss, step counter.
    recipe = [n for n in [*original.graph.node, *original.training_info[0].algorithm.node]
              if n.domain not in TRAINING_DOMAINS]
    nodes = len(step.graph.node)
    optimizer_nodes = sum(1 for n in step.graph.node if n.name.startswith(f"{optimizer}/"))
    parameters = len(forward.graph.initializer)
    size, forward_size = step.ByteSize(), forward.ByteSize()
    print(f"{name}/{optimizer}: {nodes} nodes ({optimizer_nodes} optimizer) vs {len(forward.graph.node)} "
          f"forward and {len(recipe)} in the recipe; {size} bytes vs {forward_size}")
    # Forward, loss and backward: a bounded multiple of the recipe's nodes; the optimizer: a
    # fixed number of element-wise nodes per trained tensor plus the shared rate terms.
    assert nodes - optimizer_nodes <= 12 * len(recipe)
    assert optimizer_nodes <= 12 * parameters + 16
    # Weights plus one (Momentum) or two (Adam) slots each; nodes and small constants.
    slots = 2 if optimizer == "adam" else 1  # Adagrad: H, Momentum: V
    assert size <= (1 + slots) * forward_size * 1.05 + 200 * nodes


@pytest.mark.slow
def test_manifest_pairs_every_state_input_with_an_output_and_an_initial_value(folder):
    path = _exported("mlp", "adam", folder)["step"]
    model, manifest = onnx.load(path), _manifest(path)
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    initializers = {t.name for t in model.graph.initializer}
    assert manifest.feeds == ["x", "labels"] and manifest.loss == "loss"
    assert manifest.settings == ["learning_rate"]
    assert sorted(inputs) == sorted([*manifest.feeds, *manifest.initial])
    assert sorted(outputs) == sorted([*manifest.outputs, *(b for _, b in manifest.state)])
    assert {a for a, _ in manifest.state} | set(manifest.settings) == set(manifest.initial)
    assert set(manifest.initial.values()) <= initializers
    # State inputs are plain inputs: runtimes that drop feeds for initializers still train.
    assert not set(manifest.initial) & initializers
    assert "onnxtrain.prng_key" not in {p.key for p in model.metadata_props}


def test_manifest_json_round_trip_and_bad_manifest():
    manifest = StepManifest(feeds=["x"], state=[("W", "W.new")], settings=["lr"], outputs=["loss"],
                            loss="loss", initial={"W": "W.initial", "lr": "lr.initial"})
    assert StepManifest.from_json(manifest.to_json()) == manifest
    assert json.loads(manifest.to_json())["format"] == MANIFEST_KEY
    assert "W <- W.new (W.initial)" in "\n".join(manifest.describe())
    with pytest.raises(ModelLoadError, match="onnxtrain.step"):
        StepManifest.from_json('{"format": "other"}')


@pytest.mark.parametrize("arguments, match", [
    ({"portable": True, "training": False}, "without training=False"),
    ({"portable": "flat"}, "True .* or \"step\""),
])
def test_portable_export_refuses_what_it_cannot_write(arguments, match, tmp_path):
    trainer = onnxtrain.Trainer(training_bytes("mlp", "momentum"))
    with pytest.raises(ExportError, match=match):
        trainer.export(tmp_path / "out.onnx", **arguments)
    assert not (tmp_path / "out.onnx").exists()


def _linear_training(path) -> None:
    """A Gemm classifier (a composite op in the main graph, differentiated through a copy of
    its decomposition) with make_training_model's recipe, Adam."""
    from onnxtrain._recipe.builder import make_training_model

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "B"], ["logits"], name="fc", transB=1)], "linear",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", 3])],
        [onnx.numpy_helper.from_array(rng.normal(size=(3, 4)).astype(np.float32), "W"),
         onnx.numpy_helper.from_array(np.zeros(3, np.float32), "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    training = make_training_model(model.SerializeToString(), loss="cross_entropy", optimizer="adam")
    path.write_bytes(training.SerializeToString())


@pytest.mark.slow
def test_cli_export_portable_and_inspect_show_the_manifest(tmp_path, capsys):
    import onnxruntime

    from onnxtrain.cli import main

    _linear_training(tmp_path / "training.onnx")
    assert main(["export", str(tmp_path / "training.onnx"), "--portable", "-o", str(tmp_path / "p.onnx")]) == 0
    assert main(["export", str(tmp_path / "training.onnx"), "--portable", "step", "-o", str(tmp_path / "s.onnx")]) == 0
    assert "training_info in standard ops" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "s.onnx")]) == 0
    shown = capsys.readouterr().out
    assert "feeds: x, labels" in shown and "W <- W.new (W.initial)" in shown
    # The portable model's main graph is the inference graph as it was, and serves.
    portable = onnx.load(tmp_path / "p.onnx")
    assert portable.graph.node == onnx.load(tmp_path / "training.onnx").graph.node
    x = np.random.default_rng(2).normal(size=(5, 4)).astype(np.float32)
    served = [onnxruntime.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(["logits"], {"x": x})[0]
              for p in (tmp_path / "training.onnx", tmp_path / "p.onnx")]
    np.testing.assert_allclose(served[1], served[0], rtol=1e-6, atol=1e-6)
    # And it trains in onnxtrain exactly as the recipe does.
    feeds = {"x": x, "labels": np.array([0, 1, 2, 1, 0])}
    original, rewritten = onnxtrain.Trainer(tmp_path / "training.onnx"), onnxtrain.Trainer(tmp_path / "p.onnx")
    for _ in range(3):
        np.testing.assert_allclose(rewritten.step(feeds)["loss"], original.step(feeds)["loss"], rtol=1e-6)
    np.testing.assert_allclose(rewritten.state["W"], original.state["W"], rtol=1e-6, atol=1e-7)


def test_op_without_a_backward_rule_fails_the_export_naming_the_node(tmp_path):
    from onnxtrain._recipe.builder import make_training_model

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="fc"),
         helper.make_node("Atan", ["h"], ["logits"], name="my_atan")], "arctangent",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", 3])],
        [onnx.numpy_helper.from_array(np.ones((4, 3), np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    trainer = onnxtrain.Trainer(make_training_model(model.SerializeToString(), loss="cross_entropy",
                                                    optimizer="momentum"))
    for portable in (True, "step"):
        with pytest.raises(ExportError, match=r"my_atan.*Atan"):
            trainer.export(tmp_path / "out.onnx", portable=portable)
    assert not (tmp_path / "out.onnx").exists()


def test_example_feeds_follow_declared_shapes_and_refuse_unknown_ranks():
    from onnxtrain._portable.export import EXAMPLE_AXIS, example_feeds
    from onnxtrain.proto import ValueInfoProto

    declared = [ValueInfoProto.FromString(helper.make_tensor_value_info(n, t, s).SerializeToString())
                for n, t, s in (("x", onnx.TensorProto.FLOAT, ["batch", 5]), ("ids", onnx.TensorProto.INT64, [None, 2]))]
    feeds = example_feeds(declared)
    assert feeds["x"].shape == (EXAMPLE_AXIS, 5) and feeds["x"].dtype == np.float32
    assert feeds["ids"].shape == (EXAMPLE_AXIS, 2) and not feeds["ids"].any()
    unranked = ValueInfoProto.FromString(helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, None).SerializeToString())
    with pytest.raises(ExportError, match="'z'.*shape"):
        example_feeds([unranked])
