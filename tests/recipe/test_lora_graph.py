"""LoRA on small hand-made models: MatMul (batched x), Gemm (transB 0/1, alpha), Conv and a
quantized (DequantizeLinear) base.

Oracles: onnxruntime running the base model with W + s·A·B put in by numpy (the branch must
compute the same function), hand-derived gradients of the mean squared error for the linear
layers, torch autograd for Conv, and ONNX Runtime on every export.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import optim
from onnxtrain._recipe.lora import read_record
from onnxtrain.errors import BindingError, ExportError, InputError
from support.gradient_outputs import with_gradients

ort = pytest.importorskip("onnxruntime")

RANK, ALPHA = 2, 3.0
SCALE = ALPHA / RANK


def _model(nodes, inputs, output, initializers, opset=17) -> bytes:
    graph = helper.make_graph(nodes, "lora_test", inputs, [output],
                              initializer=[numpy_helper.from_array(v, k) for k, v in initializers.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


def _float(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def matmul_model(rng) -> bytes:
    """x [N, T, 4] -> MatMul W [4, 3] + bias -> Relu -> MatMul head [3, 2]."""
    values = {"W": rng.normal(size=(4, 3)).astype(np.float32), "bias": rng.normal(size=3).astype(np.float32),
              "head": rng.normal(size=(3, 2)).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["X", "W"], ["h"], name="proj"),
             helper.make_node("Add", ["h", "bias"], ["hb"], name="proj_bias"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "head"], ["Y"], name="head_mm")]
    return _model(nodes, [_float("X", ["N", "T", 4])], _float("Y", ["N", "T", 2]), values)


def transposed_model(rng) -> bytes:
    """x [N, 4] -> MatMul with Transpose(W [3, 4]) (as torch exports nn.Linear) -> Tanh -> MatMul head."""
    values = {"W": rng.normal(size=(3, 4)).astype(np.float32), "head": rng.normal(size=(3, 2)).astype(np.float32)}
    nodes = [helper.make_node("Transpose", ["W"], ["W_t"], name="t", perm=[1, 0]),
             helper.make_node("MatMul", ["X", "W_t"], ["h"], name="proj"),
             helper.make_node("Tanh", ["h"], ["r"], name="tanh"),
             helper.make_node("MatMul", ["r", "head"], ["Y"], name="head_mm")]
    return _model(nodes, [_float("X", ["N", 4])], _float("Y", ["N", 2]), values)


def shared_model(rng) -> bytes:
    """One weight W [4, 4] read by two MatMuls (a tied layer applied twice), then a head."""
    values = {"W": rng.normal(size=(4, 4)).astype(np.float32), "head": rng.normal(size=(4, 2)).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["X", "W"], ["h1"], name="first"),
             helper.make_node("Tanh", ["h1"], ["r1"], name="tanh1"),
             helper.make_node("MatMul", ["r1", "W"], ["h2"], name="second"),
             helper.make_node("Tanh", ["h2"], ["r2"], name="tanh2"),
             helper.make_node("MatMul", ["r2", "head"], ["Y"], name="head_mm")]
    return _model(nodes, [_float("X", ["N", 4])], _float("Y", ["N", 2]), values)


def gemm_model(rng, trans_b: int, alpha: float = 0.7, trans_a: int = 0) -> bytes:
    weight = rng.normal(size=(3, 4) if trans_b else (4, 3)).astype(np.float32)
    values = {"W": weight, "C": rng.normal(size=3).astype(np.float32)}
    nodes = [helper.make_node("Gemm", ["X", "W", "C"], ["Y"], name="fc", transA=trans_a, transB=trans_b,
                              alpha=alpha, beta=1.0)]
    shape = [4, "N"] if trans_a else ["N", 4]
    return _model(nodes, [_float("X", shape)], _float("Y", ["N", 3]), values)


def conv_model(rng) -> bytes:
    values = {"W": rng.normal(size=(3, 2, 3, 3)).astype(np.float32), "b": rng.normal(size=3).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["X", "W", "b"], ["Y"], name="conv", pads=[1, 1, 1, 1], strides=[2, 2])]
    return _model(nodes, [_float("X", ["N", 2, 6, 6])], _float("Y", ["N", 3, 3, 3]), values)


def quantized_model(rng) -> bytes:
    """MatMul with an int8 weight, per-column scale and zero point, as ORT's quantizer writes it."""
    values = {"W_q": rng.integers(-100, 100, size=(4, 3)).astype(np.int8),
              "W_scale": np.array([0.01, 0.02, 0.03], np.float32), "W_zp": np.array([1, -2, 0], np.int8)}
    nodes = [helper.make_node("DequantizeLinear", ["W_q", "W_scale", "W_zp"], ["W_dq"], name="dq", axis=1),
             helper.make_node("MatMul", ["X", "W_dq"], ["Y"], name="mm")]
    return _model(nodes, [_float("X", ["N", 4])], _float("Y", ["N", 3]), values)


def _ort(model, feeds, exact: bool = False) -> np.ndarray:
    """ONNX Runtime's output; exact: without graph optimizations, which run a DequantizeLinear
    feeding a MatMul as an integer matmul on quantized activations (an approximation)."""
    if isinstance(model, onnxtrain.proto.ModelProto):
        # Side-file values load_model mapped go into the message, which ORT gets as bytes.
        model = onnxtrain.load_model(model, map_external_data=False)
    data = model if isinstance(model, bytes) else model.SerializeToString()
    options = ort.SessionOptions()
    if exact:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _with_weight(model: bytes, name: str, value: np.ndarray) -> bytes:
    proto = onnx.load_from_string(model)
    for tensor in proto.graph.initializer:
        if tensor.name == name:
            tensor.CopyFrom(numpy_helper.from_array(value, name))
    return proto.SerializeToString()


def _factors(trainer, record, rng) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Give every B random values (B starts at zero, which would hide A's gradient)."""
    chosen = {}
    for weight, entry in record["weights"].items():
        a = trainer.get_state(entry["A"])
        b = rng.normal(size=trainer.get_state(entry["B"]).shape).astype(np.float32)
        trainer.set_state(entry["B"], b)
        chosen[weight] = (a, b)
    return chosen


CASES = {
    "matmul": (matmul_model, {"X": (3, 5, 4)}, None),
    "gemm_transB0": (lambda rng: gemm_model(rng, 0), {"X": (5, 4)}, ["W"]),
    "gemm_transB1": (lambda rng: gemm_model(rng, 1), {"X": (5, 4)}, ["W"]),
    "conv": (conv_model, {"X": (2, 2, 6, 6)}, ["W"]),
    "transposed": (transposed_model, {"X": (5, 4)}, None),
    "shared": (shared_model, {"X": (5, 4)}, None),
}


def _merged_weight(kind: str, weight: np.ndarray, a: np.ndarray, b: np.ndarray, trans_b: bool) -> np.ndarray:
    """W + s·A·B in W's layout, written out independently of onnxtrain's fold."""
    if kind == "conv":
        update = np.tensordot(b[:, :, 0, 0], a, axes=([1], [0]))
    else:
        update = a @ b
        if trans_b:
            update = update.T
    return (weight.astype(np.float64) + SCALE * update).astype(np.float32)


@pytest.mark.parametrize("case", list(CASES))
def test_branch_equals_merged_weight_and_exports_run_in_onnxruntime(case, tmp_path):
    rng = np.random.default_rng(1)
    build, shapes, targets = CASES[case]
    base = build(rng)
    feeds = {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}
    training = onnxtrain.make_training_model(base, loss="mse", optimizer=optim.SGD(lr=0.1),
                                             adapters=onnxtrain.LoRA(RANK, ALPHA, targets=targets))
    record = read_record(training)
    assert list(record["weights"]) == ["W"]
    assert len(record["weights"]["W"]["sites"]) == (2 if case == "shared" else 1)
    trainer = onnxtrain.Trainer(training)
    ((_, (a, b)),) = _factors(trainer, record, rng).items()
    weight = numpy_helper.to_array(next(t for t in onnx.load_from_string(base).graph.initializer if t.name == "W"))
    expected = _ort(_with_weight(base, "W", _merged_weight(case.split("_")[0], weight, a, b,
                                                           case in ("gemm_transB1", "transposed"))), feeds)
    got = np.asarray(trainer.infer(feeds)["Y"])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)

    trainer.export(tmp_path / "merged.onnx", training=False)
    merged = onnx.load(tmp_path / "merged.onnx")
    original = onnx.load_from_string(base)
    assert [(n.name, n.op_type, list(n.input), list(n.output)) for n in merged.graph.node] == \
        [(n.name, n.op_type, list(n.input), list(n.output)) for n in original.graph.node]
    assert sorted(t.name for t in merged.graph.initializer) == sorted(t.name for t in original.graph.initializer)
    np.testing.assert_allclose(_ort(merged, feeds), got, rtol=1e-5, atol=1e-5)

    trainer.export(tmp_path / "branch.onnx", training=False, merge=False)
    onnx.checker.check_model(onnx.load(tmp_path / "branch.onnx"))
    np.testing.assert_allclose(_ort(onnx.load(tmp_path / "branch.onnx"), feeds), got, rtol=1e-5, atol=1e-5)
    adapter = tmp_path / "branch.adapter.onnx"
    onnx.checker.check_model(onnx.load(adapter))
    assert {t.name for t in onnx.load(adapter).graph.initializer} == {"W.lora_A", "W.lora_B"}
    reapplied = onnxtrain.apply_adapters(base, adapter)
    for tensor in merged.graph.initializer:
        again = next(t for t in reapplied.graph.initializer if t.name == tensor.name)
        np.testing.assert_array_equal(numpy_helper.to_array(_onnx_tensor(again)), numpy_helper.to_array(tensor))
    with_branch = onnxtrain.apply_adapters(base, adapter, merge=False)
    np.testing.assert_allclose(_ort(with_branch, feeds), got, rtol=1e-6, atol=1e-6)


def _onnx_tensor(tensor) -> onnx.TensorProto:
    return onnx.TensorProto.FromString(tensor.SerializeToString())


@pytest.mark.parametrize("case", ["matmul", "gemm_transB0", "gemm_transB1"])
def test_factor_gradients_match_hand_derived_values(case):
    """loss = mean((y - t)^2), y = base + g·s·(x A) B: dB = g·s (xA)^T dY, dA = g·s x^T dY B^T,
    with dY = 2 (y - t) / size and g the Gemm's alpha (0.7) or 1."""
    rng = np.random.default_rng(2)
    build, shapes, targets = CASES[case]
    base = build(rng)
    x = rng.normal(size=shapes["X"]).astype(np.float32)
    training = onnxtrain.make_training_model(base, loss="mse", optimizer="sgd",
                                             adapters=onnxtrain.LoRA(RANK, ALPHA, targets=targets))
    record = read_record(training)
    trainer = with_gradients(training)
    ((_, (a, b)),) = _factors(trainer, record, rng).items()
    y = np.asarray(trainer.infer({"X": x})["Y"]).astype(np.float64)
    label = rng.normal(size=y.shape).astype(np.float32)
    out = trainer.step({"X": x, "labels": label})
    if case == "matmul":
        # Only the first layer is adapted; back through the head and the Relu by hand.
        initial = {t.name: numpy_helper.to_array(t) for t in onnx.load_from_string(base).graph.initializer}
        h = x @ initial["W"] + SCALE * (x @ a) @ b + initial["bias"]
        d_out = 2 * (y - label) / y.size
        d_y = (d_out @ initial["head"].T) * (h > 0)
        gain = 1.0
    else:
        d_y, gain = 2 * (y - label) / y.size, 0.7
    x2, d2 = x.reshape(-1, x.shape[-1]).astype(np.float64), d_y.reshape(-1, d_y.shape[-1])
    expected_b = gain * SCALE * (x2 @ a).T @ d2
    expected_a = gain * SCALE * x2.T @ d2 @ b.T
    for name, expected in (("W.lora_A", expected_a), ("W.lora_B", expected_b)):
        got = np.asarray(out[f"{name}.grad"])
        assert np.max(np.abs(got - expected)) <= 1e-5 * np.max(np.abs(expected)), name


@pytest.mark.slow
def test_conv_factor_gradients_match_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    base = conv_model(rng)
    x = rng.normal(size=(2, 2, 6, 6)).astype(np.float32)
    training = onnxtrain.make_training_model(base, loss="mse", optimizer="sgd",
                                             adapters=onnxtrain.LoRA(RANK, ALPHA, targets=["W"]))
    trainer = with_gradients(training)
    ((_, (a, b)),) = _factors(trainer, read_record(training), rng).items()
    label = rng.normal(size=(2, 3, 3, 3)).astype(np.float32)
    out = trainer.step({"X": x, "labels": label})
    initial = {t.name: torch.tensor(numpy_helper.to_array(t)) for t in onnx.load_from_string(base).graph.initializer}
    a_t, b_t = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    xt = torch.tensor(x)
    y = torch.nn.functional.conv2d(xt, initial["W"], initial["b"], stride=2, padding=1)
    y = y + SCALE * torch.nn.functional.conv2d(torch.nn.functional.conv2d(xt, a_t, stride=2, padding=1), b_t)
    torch.mean((y - torch.tensor(label)) ** 2).backward()
    for name, tensor in (("W.lora_A", a_t), ("W.lora_B", b_t)):
        expected = tensor.grad.numpy()
        assert np.max(np.abs(np.asarray(out[f"{name}.grad"]) - expected)) <= 1e-5 * np.max(np.abs(expected)), name


def test_quantized_base_trains_factors_only_and_merges_to_a_float_weight(tmp_path):
    rng = np.random.default_rng(4)
    base = quantized_model(rng)
    x = rng.normal(size=(5, 4)).astype(np.float32)
    training = onnxtrain.make_training_model(base, loss="mse", optimizer="sgd",
                                             adapters=onnxtrain.LoRA(RANK, ALPHA, targets=["W_dq"]))
    record = read_record(training)
    assert record["weights"]["W_dq"]["quantized"]
    (gradient,) = [n for n in training.training_info[0].algorithm.node if n.op_type == "Gradient"]
    assert list(gradient.input[:2]) == ["W_dq.lora_A", "W_dq.lora_B"]
    trainer = onnxtrain.Trainer(training)
    assert "W_q" not in trainer.state_names and "W_dq" not in trainer.state_names
    ((_, (a, b)),) = _factors(trainer, record, rng).items()
    got = np.asarray(trainer.infer({"X": x})["Y"])
    # The oracle: ORT runs the quantized base on x, plus the branch in float64.
    expected = _ort(base, {"X": x}, exact=True) + SCALE * (x.astype(np.float64) @ a) @ b
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    trainer.export(tmp_path / "merged.onnx", training=False)
    merged = onnx.load(tmp_path / "merged.onnx")
    assert [n.op_type for n in merged.graph.node] == ["MatMul"]
    assert {t.name: t.data_type for t in merged.graph.initializer} == {"W_dq": TensorProto.FLOAT}
    np.testing.assert_allclose(_ort(merged, {"X": x}), got, rtol=1e-5, atol=1e-5)
    trainer.export(tmp_path / "branch.onnx", training=False, merge=False)
    branch = onnx.load(tmp_path / "branch.onnx")
    assert {t.name for t in branch.graph.initializer} >= {"W_q", "W_scale", "W_zp"}
    np.testing.assert_allclose(_ort(branch, {"X": x}, exact=True), got, rtol=1e-5, atol=1e-5)


def test_a_small_change_merges_onto_the_quantized_bases_own_grid(tmp_path, caplog):
    """A LoRA change that keeps the merged weight within its int8 grid's range is rounded onto
    that grid: the merged export keeps DequantizeLinear, its scale and zero point, and moves
    integers; each output is then within half a step per weight of infer() (round to nearest)."""
    rng = np.random.default_rng(5)
    base = quantized_model(rng)
    x = rng.normal(size=(5, 4)).astype(np.float32)
    training = onnxtrain.make_training_model(base, loss="mse", optimizer="sgd",
                                             adapters=onnxtrain.LoRA(RANK, ALPHA, targets=["W_dq"]))
    trainer, entry = onnxtrain.Trainer(training), read_record(training)["weights"]["W_dq"]
    trainer.set_state(entry["B"], 0.05 * rng.normal(size=trainer.get_state(entry["B"]).shape).astype(np.float32))
    got = np.asarray(trainer.infer({"X": x})["Y"])
    with caplog.at_level(logging.WARNING, logger="onnxtrain"):
        trainer.export(tmp_path / "merged.onnx", training=False)
    merged = onnx.load(tmp_path / "merged.onnx")
    assert [n.op_type for n in merged.graph.node] == ["DequantizeLinear", "MatMul"]
    stored = {t.name: numpy_helper.to_array(t) for t in merged.graph.initializer}
    original = {t.name: numpy_helper.to_array(t) for t in onnx.load_from_string(base).graph.initializer}
    assert stored["W_q"].dtype == np.int8 and (stored["W_q"] != original["W_q"]).any()
    np.testing.assert_array_equal(stored["W_scale"], original["W_scale"])
    np.testing.assert_array_equal(stored["W_zp"], original["W_zp"])
    half_steps = np.abs(x).astype(np.float64) @ np.tile(original["W_scale"] / 2, (4, 1))
    assert (np.abs(_ort(merged, {"X": x}, exact=True) - got) <= half_steps + 1e-5).all()
    assert any("onto their DequantizeLinear's grid" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_adapter_export_shares_the_base_models_external_data(tmp_path):
    rng = np.random.default_rng(11)
    base = onnx.load_from_string(matmul_model(rng))
    (tmp_path / "base").mkdir()
    onnx.save_model(base, tmp_path / "base" / "model.onnx", save_as_external_data=True, location="model.data",
                    size_threshold=0)
    x = rng.normal(size=(3, 5, 4)).astype(np.float32)
    training = onnxtrain.make_training_model(str(tmp_path / "base" / "model.onnx"), loss="mse",
                                             adapters=onnxtrain.LoRA(RANK, ALPHA), trainable=["head"])
    trainer = onnxtrain.Trainer(training)
    _factors(trainer, read_record(training), rng)
    trainer.step({"X": x, "labels": np.zeros((3, 5, 2), np.float32)})
    expected = np.asarray(trainer.infer({"X": x})["Y"])
    beside = tmp_path / "base" / "adapted.onnx"
    trainer.export(beside, training=False, merge=False)
    tensors = {t.name: t for t in onnx.load(beside, load_external_data=False).graph.initializer}
    shared = {name for name, t in tensors.items() if t.data_location == TensorProto.EXTERNAL}
    # The frozen base weights point into the base's file; trained values (head, A, B) are inline.
    assert shared == {"W", "bias"}
    assert {e.key: e.value for e in tensors["W"].external_data}["location"] == "model.data"
    np.testing.assert_allclose(_ort(onnx.load(beside), {"X": x}), expected, rtol=1e-5, atol=1e-5)
    # The adapter file carries the fully trained head too, so re-applying it gives the same model.
    reapplied = onnxtrain.apply_adapters(str(tmp_path / "base" / "model.onnx"),
                                         tmp_path / "base" / "adapted.adapter.onnx")
    np.testing.assert_allclose(_ort(reapplied, {"X": x}), expected, rtol=1e-5, atol=1e-5)
    # Elsewhere a location could not reach the base's file: the weights are written.
    (tmp_path / "elsewhere").mkdir()
    trainer.export(tmp_path / "elsewhere" / "adapted.onnx", training=False, merge=False)
    written = onnx.load(tmp_path / "elsewhere" / "adapted.onnx", load_external_data=False)
    assert not [t.name for t in written.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    np.testing.assert_allclose(_ort(written, {"X": x}), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_fit_evaluation_and_checkpoints_work_unchanged(tmp_path):
    rng = np.random.default_rng(12)
    x = rng.normal(size=(32, 5, 4)).astype(np.float32)
    y = rng.normal(size=(32, 5, 2)).astype(np.float32)
    training = onnxtrain.make_training_model(matmul_model(rng), loss="mse", optimizer=optim.Adam(lr=1e-2),
                                             adapters=onnxtrain.LoRA(RANK, ALPHA, dropout=0.1))
    trainer = onnxtrain.Trainer(training, seed=0)
    history = trainer.fit((x, y), epochs=3, batch_size=8, validation_split=0.25, verbose=0, metrics=["mae"])
    assert history["val_loss"][-1] < history["val_loss"][0]
    trainer.save_checkpoint(tmp_path / "lora.ckpt")
    other = onnxtrain.Trainer(training, seed=0)
    other.load_checkpoint(tmp_path / "lora.ckpt")
    for name in trainer.state_names:
        np.testing.assert_array_equal(other.get_state(name), trainer.get_state(name))
    evaluated = trainer.evaluate({"X": x[:8], "labels": y[:8]})
    prediction = np.asarray(trainer.infer({"X": x[:8]})["Y"])
    assert float(evaluated["loss"]) == pytest.approx(float(np.mean((prediction - y[:8]) ** 2)), rel=1e-5)


@pytest.mark.slow
def test_base_weights_are_constants_without_slots_or_state():
    rng = np.random.default_rng(5)
    training = onnxtrain.make_training_model(matmul_model(rng), loss="mse", optimizer=optim.Adam(lr=1e-2),
                                             adapters=onnxtrain.LoRA(RANK, ALPHA), trainable=["head"])
    trainer = onnxtrain.Trainer(training)
    names = set(trainer.state_names)
    assert {"W.lora_A", "W.lora_B", "head"} <= names
    assert "W" not in names and "bias" not in names
    assert not [n for n in names if n.startswith(("W.", "bias.")) and ".lora_" not in n]
    assert any(n.startswith("W.lora_A.") for n in names)   # Adam's slots of A
    before = trainer.get_state("head")
    x = rng.normal(size=(3, 5, 4)).astype(np.float32)
    losses = [float(trainer.step({"X": x, "labels": np.zeros((3, 5, 2), np.float32)})["loss"]) for _ in range(20)]
    assert losses[-1] < losses[0]
    assert not np.array_equal(trainer.get_state("head"), before)


@pytest.mark.slow
def test_finetune_with_lora_trains_factors_and_exports_merged(tmp_path):
    optax = pytest.importorskip("optax")
    rng = np.random.default_rng(6)
    base = matmul_model(rng)
    tuner = onnxtrain.finetune(base, "mse", optax.adam(1e-2), adapters=onnxtrain.LoRA(RANK, ALPHA))
    assert set(tuner.state_names) == {"W.lora_A", "W.lora_B"}
    x = rng.normal(size=(3, 5, 4)).astype(np.float32)
    feeds = {"X": x, "labels": np.zeros((3, 5, 2), np.float32)}
    losses = [float(tuner.step(feeds)["loss"]) for _ in range(20)]
    assert losses[-1] < losses[0]
    tuner.export(tmp_path / "merged.onnx")
    np.testing.assert_allclose(_ort(onnx.load(tmp_path / "merged.onnx"), {"X": x}),
                               np.asarray(tuner.infer({"X": x})["Y"]), rtol=1e-5, atol=1e-5)


def test_dropout_is_identity_in_inference():
    rng = np.random.default_rng(7)
    base = matmul_model(rng)
    training = onnxtrain.make_training_model(base, loss="mse", optimizer="sgd",
                                             adapters=onnxtrain.LoRA(RANK, ALPHA, dropout=0.5))
    trainer = onnxtrain.Trainer(training)
    ((_, (a, b)),) = _factors(trainer, read_record(training), rng).items()
    x = rng.normal(size=(3, 5, 4)).astype(np.float32)
    first, second = (np.asarray(trainer.infer({"X": x})["Y"]) for _ in range(2))
    np.testing.assert_array_equal(first, second)
    weight = numpy_helper.to_array(next(t for t in onnx.load_from_string(base).graph.initializer if t.name == "W"))
    np.testing.assert_allclose(first, _ort(_with_weight(base, "W", _merged_weight("matmul", weight, a, b, False)),
                                           {"X": x}), rtol=1e-5, atol=1e-5)
    assert any(n.op_type == "Dropout" for n in training.graph.node)


def test_default_targets_skip_the_head_and_training_export_keeps_the_branch(tmp_path):
    rng = np.random.default_rng(8)
    training = onnxtrain.make_training_model(matmul_model(rng), loss="mse", adapters=onnxtrain.LoRA(RANK, ALPHA))
    assert list(read_record(training)["weights"]) == ["W"]
    trainer = onnxtrain.Trainer(training)
    trainer.export(tmp_path / "training.onnx")
    again = onnxtrain.Trainer(tmp_path / "training.onnx")
    assert set(again.state_names) == set(trainer.state_names)
    with pytest.raises(ExportError, match="keeps the adapter branch"):
        trainer.export(tmp_path / "x.onnx", training=True, merge=True)


@pytest.mark.parametrize("arguments, message", [
    (dict(rank=0, alpha=1), "rank must be a positive int"),
    (dict(rank=2.5, alpha=1), "rank must be a positive int"),
    (dict(rank=True, alpha=1), "rank must be a positive int"),
    (dict(rank=2, alpha=0), "alpha must be a positive finite"),
    (dict(rank=2, alpha=float("nan")), "alpha must be a positive finite"),
    (dict(rank=2, alpha=1, dropout=1.0), "dropout must be a ratio"),
    (dict(rank=2, alpha=1, targets=[]), "targets must be None"),
])
def test_bad_arguments_are_refused(arguments, message):
    with pytest.raises(InputError, match=message):
        onnxtrain.LoRA(**arguments)


def test_selection_errors_name_the_problem(tmp_path):
    rng = np.random.default_rng(9)
    with pytest.raises(BindingError, match="transA=1"):
        onnxtrain.make_training_model(gemm_model(rng, 0, trans_a=1), loss="mse",
                                      adapters=onnxtrain.LoRA(RANK, ALPHA, targets=["W"]))
    with pytest.raises(BindingError, match="found no linear layer"):
        # Its only layer is the head.
        onnxtrain.make_training_model(gemm_model(rng, 1), loss="mse", adapters=onnxtrain.LoRA(RANK, ALPHA))
    with pytest.raises(BindingError, match=r"matches no weight.*close names: \['head'\]"):
        onnxtrain.make_training_model(matmul_model(rng), loss="mse",
                                      adapters=onnxtrain.LoRA(RANK, ALPHA, targets=["heat"]))
    with pytest.raises(BindingError, match="either adapted or trained fully"):
        onnxtrain.make_training_model(matmul_model(rng), loss="mse", trainable=["W"],
                                      adapters=onnxtrain.LoRA(RANK, ALPHA))
    with pytest.raises(ExportError, match="applies to models with adapters"):
        trainer = onnxtrain.Trainer(onnxtrain.make_training_model(matmul_model(rng), loss="mse"))
        trainer.export(tmp_path / "unused.onnx", training=False, merge=False)


def test_embedding_table_is_not_adaptable():
    table = np.random.default_rng(10).normal(size=(10, 4)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], name="embed"),
             helper.make_node("MatMul", ["e", "table_t"], ["Y"], name="tied")]
    model = _model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"])],
                   _float("Y", ["N", 10]), {"table": table, "table_t": table.T.copy()})
    with pytest.raises(BindingError, match="embedding table"):
        onnxtrain.make_training_model(model, loss="mse", adapters=onnxtrain.LoRA(RANK, ALPHA, targets=["table"]))


def test_patterns_and_predicates_choose_targets():
    rng = np.random.default_rng(13)
    model = matmul_model(rng)
    by_pattern = onnxtrain.make_training_model(model, loss="mse", adapters=onnxtrain.LoRA(RANK, ALPHA, targets="*"))
    assert list(read_record(by_pattern)["weights"]) == ["W", "head"]   # a pattern may choose the head
    seen = []

    def only_the_head(name, value, consumer):
        seen.append((name, value.shape, consumer.name))
        return consumer.name == "head_mm"

    by_predicate = onnxtrain.make_training_model(model, loss="mse",
                                                 adapters=onnxtrain.LoRA(RANK, ALPHA, targets=only_the_head))
    assert list(read_record(by_predicate)["weights"]) == ["head"]
    assert seen == [("W", (4, 3), "proj"), ("head", (3, 2), "head_mm")]
    with pytest.raises(BindingError, match="chose none"):
        onnxtrain.make_training_model(model, loss="mse",
                                      adapters=onnxtrain.LoRA(RANK, ALPHA, targets=lambda *_: False))
    conv = conv_model(rng)
    with pytest.raises(BindingError, match="found no linear layer"):
        onnxtrain.make_training_model(conv, loss="mse", adapters=onnxtrain.LoRA(RANK, ALPHA))


def test_apply_adapters_refuses_files_that_do_not_fit(tmp_path):
    rng = np.random.default_rng(14)
    base = matmul_model(rng)
    trainer = onnxtrain.Trainer(onnxtrain.make_training_model(base, loss="mse", adapters=onnxtrain.LoRA(RANK, ALPHA)))
    trainer.export(tmp_path / "adapted.onnx", training=False, merge=False)
    adapter = tmp_path / "adapted.adapter.onnx"
    with pytest.raises(onnxtrain.ModelLoadError, match="carries no 'onnxtrain.adapters' metadata"):
        onnxtrain.apply_adapters(base, base)
    other = _with_weight(base, "W", rng.normal(size=(4, 3)).astype(np.float32))
    proto = onnx.load_from_string(other)
    proto.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.zeros((4, 5), np.float32), "W"))
    with pytest.raises(BindingError, match=r"shape \[4, 5\] in the base model.*another base model"):
        onnxtrain.apply_adapters(proto.SerializeToString(), adapter)
    broken = onnx.load(adapter)
    broken.metadata_props[0].value = "{not json"
    with pytest.raises(onnxtrain.ModelLoadError, match="is malformed"):
        onnxtrain.apply_adapters(base, broken.SerializeToString())
