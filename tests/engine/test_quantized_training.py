"""Training on a weight-only quantized base (ONNX Runtime's quantizer output): the integer
weights are never trained, never state and never dequantized all at once; the float
weights that remain train with the gradients torch autograd gives on the weights as
onnxruntime dequantizes them."""

from __future__ import annotations

import numpy as np
import pytest

import onnxtrain

from support.quantized_models import deep_mlp, dequantized_weights, float_mlp, onnxruntime_outputs, quantized

pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")
optax = pytest.importorskip("optax")

LR = 0.05


def _batch(k: int = 40, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((2, 3, k)).astype(np.float32),
            "labels": rng.standard_normal((2, 3, k)).astype(np.float32)}


def _torch_step(weights: list[np.ndarray], biases: dict[str, np.ndarray], batch: dict) -> tuple[float, dict]:
    """The loss and SGD-updated biases of relu(x @ W1 + b1) @ W2 + b2 under mse, by torch autograd."""
    torch = pytest.importorskip("torch")
    w1, w2 = (torch.tensor(w, dtype=torch.float64) for w in weights)
    b = {name: torch.tensor(value, dtype=torch.float64, requires_grad=True) for name, value in biases.items()}
    x, labels = (torch.tensor(batch[name], dtype=torch.float64) for name in ("x", "labels"))
    y = torch.relu(x @ w1 + b["b1"]) @ w2 + b["b2"]
    loss = ((y - labels) ** 2).mean()
    loss.backward()
    return float(loss.detach()), {name: (value - LR * value.grad).detach().numpy() for name, value in b.items()}


def _weights(model) -> list[np.ndarray]:
    """The two MatMul weights as onnxruntime dequantizes them, in graph order."""
    found = dequantized_weights(model)
    if found:
        return list(found.values())
    # QDQ: DequantizeLinear outputs, read from onnxruntime as extra graph outputs.
    import onnx

    probe = onnx.ModelProto.FromString(model.SerializeToString())
    names = [node.output[0] for node in probe.graph.node if node.op_type == "DequantizeLinear"]
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in names)
    return onnxruntime_outputs(probe, {"x": _batch()["x"]}, optimized=False)[1:]


def _initial_biases(model) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name in ("b1", "b2")}


QUANTIZATIONS = [pytest.param(8, False, False, id="int8"),
                 pytest.param(4, True, False, id="int4", marks=pytest.mark.slow),
                 pytest.param(4, False, True, id="int4-qdq", marks=pytest.mark.slow)]


@pytest.mark.parametrize("bits, symmetric, qdq", QUANTIZATIONS)
def test_finetune_trains_only_the_float_weights_like_torch(bits, symmetric, qdq):
    model = quantized(float_mlp(), bits, symmetric, qdq)
    tuner = onnxtrain.finetune(model.SerializeToString(), "mse", optax.sgd(LR))
    assert set(tuner.state_names) == {"b1", "b2"}, "scales, zero points and integer weights never train"
    integers = [t.name for t in model.graph.initializer if t.data_type not in (1,)]
    assert integers and not set(integers) & set(tuner._store.values)
    batch = _batch()
    loss = float(tuner.step(batch)["loss"])
    expected_loss, expected = _torch_step(_weights(model), _initial_biases(model), batch)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    for name, value in expected.items():
        np.testing.assert_allclose(tuner.get_state(name), value, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("bits, symmetric, qdq", QUANTIZATIONS[:1] + QUANTIZATIONS[2:])
def test_trainer_recipe_trains_only_the_float_weights_like_torch(bits, symmetric, qdq):
    """make_training_model's Gradient + SGD recipe on the quantized model."""
    model = quantized(float_mlp(), bits, symmetric, qdq)
    training = onnxtrain.make_training_model(model.SerializeToString(), loss="mse",
                                             optimizer=onnxtrain.optim.SGD(lr=LR))
    trainer = onnxtrain.Trainer(training)
    assert {"b1", "b2"} <= set(trainer.state_names)
    assert not any(name.endswith(("_Q8", "_Q4", "_DQ_Q4", "_scales", "_zero_points")) for name in trainer.state_names)
    batch = _batch()
    loss = float(trainer.step(batch)["loss"])
    expected_loss, expected = _torch_step(_weights(model), _initial_biases(model), batch)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    for name, value in expected.items():
        np.testing.assert_allclose(trainer.get_state(name), value, rtol=1e-5, atol=1e-6)


def _temp_bytes(trainer, batch) -> int:
    return trainer.lowered(batch).compile().memory_analysis().temp_size_in_bytes


LAYERS, WIDTH, BATCH = 8, 256, 4


@pytest.mark.slow
@pytest.mark.parametrize("bits, qdq", [(8, False), (4, False), (4, True)], ids=["int8", "int4", "int4-qdq"])
def test_a_quantized_step_dequantizes_one_layer_at_a_time(bits, qdq):
    """The compiled step's scratch memory stays far below the dequantized model's size: XLA
    dequantizes each layer where it is used, in the forward and again in the backward pass.
    It is close to the scratch the float model's step needs with its weights frozen (whose
    weights are arguments, not scratch)."""
    model = deep_mlp(LAYERS, WIDTH)
    float_bytes = LAYERS * WIDTH * WIDTH * 4
    biases = [f"b{i}" for i in range(LAYERS)]
    batch = {"x": np.ones((BATCH, WIDTH), np.float32), "labels": np.zeros((BATCH, WIDTH), np.float32)}
    base = quantized(model, bits, False, qdq, block_size=32).SerializeToString()
    quantized_tuner = onnxtrain.finetune(base, "mse", optax.sgd(LR), trainable=biases)
    float_tuner = onnxtrain.finetune(model.SerializeToString(), "mse", optax.sgd(LR), trainable=biases)
    ours, frozen_float = _temp_bytes(quantized_tuner, batch), _temp_bytes(float_tuner, batch)
    assert ours < float_bytes / 4, (ours, float_bytes)
    assert ours < frozen_float + 2 * WIDTH * WIDTH * 4, (ours, frozen_float)
    # The Trainer's own recipe (Gradient node) too.
    training = onnxtrain.make_training_model(base, loss="mse", optimizer=onnxtrain.optim.SGD(lr=LR),
                                             trainable=biases)
    assert _temp_bytes(onnxtrain.Trainer(training), batch) < float_bytes / 4


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from support.quantized_models import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("llama") / "llama.onnx")


@pytest.mark.slow
@pytest.mark.parametrize("bits, symmetric, qdq", QUANTIZATIONS)
def test_quantized_llama_infers_like_onnxruntime_and_trains(llama, bits, symmetric, qdq):
    """A tiny Llama export quantized by onnxruntime: logits as onnxruntime gives them (the
    QDQ model unfused, see test_quantized_weights), and fine-tuning its float weights (the
    norms and the embedding) lowers the next-token loss on a fixed batch."""
    model = quantized(llama, bits, symmetric, qdq)
    ids = np.random.default_rng(0).integers(0, 100, (2, 8)).astype(np.int64)
    (expected,) = onnxruntime_outputs(model, {"input_ids": ids}, optimized=not qdq)
    def next_token_loss(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    with pytest.warns(onnxtrain.ExportDamageWarning):   # tied norm weights and a fixed batch: left as they are
        tuner = onnxtrain.finetune(model.SerializeToString(), next_token_loss, optax.adam(1e-2))
    logits = np.asarray(tuner.infer({"input_ids": ids})["logits"])
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
    assert not any(name.endswith(("_Q8", "_Q4", "_scales", "_zero_points")) for name in tuner.state_names)
    batch = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1)}
    losses = [float(tuner.step(batch)["loss"]) for _ in range(15)]
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.slow
def test_recompute_on_a_quantized_llama_gives_the_same_steps_with_less_scratch(llama):
    """recompute=True on a real export (shape arithmetic, attention, RoPE inside segments)
    over an int8 base: the same losses and weights, less scratch, one program."""
    model = quantized(llama, 8, False).SerializeToString()
    ids = np.random.default_rng(1).integers(0, 100, (2, 8)).astype(np.int64)
    batch = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1)}

    def next_token_loss(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    runs = {}
    for recompute in (None, True):
        with pytest.warns(onnxtrain.ExportDamageWarning):
            tuner = onnxtrain.finetune(model, next_token_loss, optax.adam(1e-2), recompute=recompute)
        scratch = _temp_bytes(tuner, batch)
        runs[recompute] = (tuner, [float(tuner.step(batch)["loss"]) for _ in range(3)], scratch)
    (plain, plain_losses, plain_scratch), (blocks, block_losses, block_scratch) = runs[None], runs[True]
    np.testing.assert_allclose(block_losses, plain_losses, rtol=1e-6)
    for name in plain.state_names:
        np.testing.assert_allclose(blocks.get_state(name), plain.get_state(name), rtol=1e-6, atol=1e-7)
    # Two tiny layers, whose rotary tables no longer train, leave recompute little to save: the
    # bound asks for a clear saving, not a deep model's.
    assert block_scratch < 0.9 * plain_scratch
    assert blocks.compilations == plain.compilations


def _float_twin(standard) -> "onnx.ModelProto":
    """The standardized quantized model with every DequantizeLinear of stored integers replaced
    by a float initializer of the same name holding its output as onnxruntime computes it."""
    import onnx

    probe = onnx.ModelProto.FromString(standard.SerializeToString())
    dequantizers = [node for node in probe.graph.node if node.op_type == "DequantizeLinear"]
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)
                              for node in dequantizers)
    ids = np.zeros((2, 8), np.int64)
    values = onnxruntime_outputs(probe, {"input_ids": ids}, optimized=False)[1:]
    twin = onnx.ModelProto.FromString(standard.SerializeToString())
    kept = [node for node in twin.graph.node if node.op_type != "DequantizeLinear"]
    del twin.graph.node[:]
    twin.graph.node.extend(kept)
    twin.graph.initializer.extend(onnx.numpy_helper.from_array(value, node.output[0])
                                  for node, value in zip(dequantizers, values))
    used = {name for node in twin.graph.node for name in node.input}
    kept_initializers = [t for t in twin.graph.initializer if t.name in used]
    del twin.graph.initializer[:]
    twin.graph.initializer.extend(kept_initializers)
    return twin


@pytest.mark.slow
def test_lora_on_onnxruntimes_int8_llama_trains_like_lora_on_its_float_weights(llama, tmp_path):
    """QLoRA-style: LoRA on the int8 weights onnxruntime's quantizer writes (MatMulNBits,
    rewritten to DequantizeLinear + MatMul so that LoRA sees the quantized base). Only the
    adapters are state; two SGD steps give the adapters the LoRA on a float model holding
    the weights as onnxruntime dequantizes them gives; the loss falls; the merged export
    runs in onnxruntime like infer()."""
    import onnx

    from onnxtrain._recipe.quantized import standardize_matmul_nbits

    base = quantized(llama, 8, False)
    standard = onnxtrain.load_model(base.SerializeToString())
    assert standardize_matmul_nbits(standard) == sum(n.op_type == "MatMulNBits" for n in base.graph.node)
    twin = _float_twin(onnx.ModelProto.FromString(standard.SerializeToString()))
    ids = np.random.default_rng(2).integers(0, 100, (2, 8)).astype(np.int64)
    batch = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1)}

    def next_token_loss(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    tuners = []
    for model in (base, twin):
        with pytest.warns(onnxtrain.ExportDamageWarning):
            tuners.append(onnxtrain.finetune(model.SerializeToString(), next_token_loss, optax.sgd(0.5),
                                             adapters=onnxtrain.LoRA(rank=4, alpha=8)))
    ours, theirs = tuners
    assert all(name.endswith((".lora_A", ".lora_B")) for name in ours.state_names)
    assert list(ours.state_names) == list(theirs.state_names) and len(ours.state_names) >= 2 * 14
    losses = []
    for _ in range(2):
        losses.append(float(ours.step(batch)["loss"]))
        assert losses[-1] == pytest.approx(float(theirs.step(batch)["loss"]), rel=1e-5)
    for name in ours.state_names:
        expected = theirs.get_state(name)
        np.testing.assert_allclose(ours.get_state(name), expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    losses += [float(ours.step(batch)["loss"]) for _ in range(10)]
    assert min(losses) < 0.96 * losses[0] and losses[-1] < losses[0], losses
    path = tmp_path / "merged.onnx"
    ours.export(path)
    merged = onnx.load(path)
    # Every MatMulNBits written back, the merged weights quantized again to 8 bits: within a
    # few steps of 1/255 of the weights' range of what infer() computes in floats.
    assert [n.name for n in merged.graph.node if n.op_type == "MatMulNBits"] == \
        [n.name for n in base.graph.node if n.op_type == "MatMulNBits"]
    (served,) = onnxruntime_outputs(merged, {"input_ids": ids})
    inferred = np.asarray(ours.infer({"input_ids": ids})["logits"])
    np.testing.assert_allclose(served, inferred, rtol=0, atol=1e-2 * np.abs(inferred).max())
    # The branch export keeps the adapters exact beside the 8-bit base.
    ours.export(tmp_path / "branch.onnx", merge=False)
    (branch,) = onnxruntime_outputs(onnx.load(tmp_path / "branch.onnx"), {"input_ids": ids})
    np.testing.assert_allclose(branch, inferred, rtol=0, atol=1e-4 * np.abs(inferred).max())
    # The adapter file, applied again to the quantized base as onnxruntime wrote it, as a branch.
    reapplied = onnxtrain.apply_adapters(base.SerializeToString(), tmp_path / "branch.adapter.onnx", merge=False)
    (again,) = onnxruntime_outputs(onnx.ModelProto.FromString(reapplied.SerializeToString()), {"input_ids": ids})
    np.testing.assert_allclose(again, inferred, rtol=0, atol=1e-4 * np.abs(inferred).max())


@pytest.mark.slow
@pytest.mark.parametrize("bits, qdq", [(8, False), (4, True)], ids=["int8", "int4-qdq"])
def test_lora_on_a_quantized_base_dequantizes_one_layer_at_a_time(bits, qdq):
    """With adapters too (whose base product reads the weight through a Transpose in the
    standard form of MatMulNBits) the step's scratch stays far below the float weights."""
    model = deep_mlp(LAYERS, WIDTH)
    batch = {"x": np.ones((BATCH, WIDTH), np.float32), "labels": np.zeros((BATCH, WIDTH), np.float32)}
    tuner = onnxtrain.finetune(quantized(model, bits, False, qdq, block_size=32).SerializeToString(), "mse",
                               optax.adam(1e-3), adapters=onnxtrain.LoRA(rank=4, alpha=8, targets=["*"]))
    assert len(tuner.state_names) >= 2 * LAYERS
    assert _temp_bytes(tuner, batch) < LAYERS * WIDTH * WIDTH * 4 / 4
