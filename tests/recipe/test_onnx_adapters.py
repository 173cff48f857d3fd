"""LoRA adapters for ONNX Runtime GenAI's multi-LoRA serving: `.onnx_adapter` files (ONNX
Runtime's FlatBuffer format, written by our own writer) and the adapter-ready base they bind
to. Oracles: onnxruntime's own AdapterFormat reader and writer, and onnxruntime-genai's
greedy generation with an adapter active against generation from the merged model.
"""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

import onnxtrain
from onnxtrain._io.onnx_adapter import read_onnx_adapter, write_onnx_adapter
from support import llm_exports

ort = pytest.importorskip("onnxruntime")


def test_onnxruntime_reads_what_we_write_and_we_read_what_it_writes(tmp_path):
    parameters = {"model.layers.0.attn.qkv_proj.lora_A": np.arange(12, dtype=np.float32).reshape(3, 4),
                  "half": np.linspace(-1, 1, 6).astype(np.float16).reshape(2, 3),
                  "empty": np.zeros((0, 5), np.float32), "long": np.array([[3, -7]], np.int64)}
    write_onnx_adapter(tmp_path / "ours.onnx_adapter", parameters, adapter_version=2, model_version=7)
    theirs = ort.AdapterFormat.read_adapter(str(tmp_path / "ours.onnx_adapter"))
    assert (theirs.get_adapter_version(), theirs.get_model_version()) == (2, 7)
    read = {name: value.numpy() for name, value in theirs.get_parameters().items()}
    assert set(read) == set(parameters)
    for name, value in parameters.items():
        assert read[name].dtype == value.dtype and read[name].shape == value.shape
        np.testing.assert_array_equal(read[name], value)
    written = ort.AdapterFormat()
    written.set_parameters({name: ort.OrtValue.ortvalue_from_numpy(value) for name, value in parameters.items()
                            if value.size})
    written.export_adapter(str(tmp_path / "theirs.onnx_adapter"))
    back = read_onnx_adapter((tmp_path / "theirs.onnx_adapter").read_bytes())
    assert set(back) == {name for name, value in parameters.items() if value.size}
    for name, value in back.items():
        np.testing.assert_array_equal(value, parameters[name])


@pytest.mark.parametrize("damage", ["identifier", "truncated", "length"])
def test_a_damaged_adapter_file_is_refused_by_name(tmp_path, damage):
    write_onnx_adapter(tmp_path / "a.onnx_adapter", {"w": np.ones((4, 2), np.float32)})
    data = bytearray((tmp_path / "a.onnx_adapter").read_bytes())
    if damage == "identifier":
        data[4:8] = b"XXXX"
    elif damage == "truncated":
        del data[len(data) // 2:]
    else:   # the raw data's length, far past the end
        at = data.find((32).to_bytes(4, "little") + np.ones((4, 2), np.float32).tobytes())
        data[at:at + 4] = (1 << 30).to_bytes(4, "little")
    with pytest.raises(onnxtrain.ModelLoadError, match="not a valid .onnx_adapter file"):
        read_onnx_adapter(bytes(data), "a.onnx_adapter")


og = pytest.importorskip("onnxruntime_genai")
PROMPT = np.array([[1, 5, 9, 17, 33]], np.int32)


@pytest.fixture(scope="module")
def genai_folder(tmp_path_factory):
    try:
        path = llm_exports.export("genai_fp32", llm_exports.causal_lm("qwen2"), tmp_path_factory.mktemp("qwen2"))
    except llm_exports.Unavailable as missing:
        pytest.skip(str(missing))
    return path.parent


def trained(folder, rank: int, seed: int) -> onnxtrain.Trainer:
    path = folder / "model.onnx"
    trainer = onnxtrain.Trainer(onnxtrain.make_training_model(
        str(path), loss="causal_lm", adapters=onnxtrain.LoRA(rank, 2.0 * rank, targets=["qkv_proj", "o_proj"]),
        optimizer=onnxtrain.optim.Adam(5e-2)))
    model, rng = onnx.load(str(path), load_external_data=False), np.random.default_rng(seed)
    for _ in range(5):
        trainer.step(llm_exports.feeds("genai_fp32", model, rng))
    return trainer


def generate(folder, adapters: dict | None = None, active: str | None = None) -> list[int]:
    """onnxruntime-genai's greedy continuation of PROMPT, with adapter `active` of `adapters`."""
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=24, do_sample=False)
    generator = og.Generator(model, params)
    if active is not None:
        loaded = og.Adapters(model)
        for name, path in adapters.items():
            loaded.load(str(path), name)
        generator.set_active_adapter(loaded, active)
    generator.append_tokens(PROMPT)
    while not generator.is_done():
        generator.generate_next_token()
    return [int(token) for token in generator.get_sequence(0)]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::onnxtrain.ExportDamageWarning")
def test_genai_serves_two_adapters_on_one_base_as_their_merged_models(genai_folder, tmp_path):
    first, second = trained(genai_folder, rank=4, seed=0), trained(genai_folder, rank=2, seed=1)
    served = tmp_path / "served"
    shutil.copytree(genai_folder, served)
    adapters = {"first": tmp_path / "first.onnx_adapter", "second": tmp_path / "second.onnx_adapter"}
    first.export_adapters(adapters["first"], base=served / "model.onnx")
    second.export_adapters(adapters["second"])
    expected = {}
    for name, trainer in (("first", first), ("second", second)):
        merged = tmp_path / f"merged-{name}"
        shutil.copytree(genai_folder, merged)
        trainer.export(merged / "model.onnx", training=False)
        expected[name] = generate(merged)
    original = generate(genai_folder)
    assert expected["first"] != original and expected["second"] != original   # the adapters changed it
    assert generate(served) == original                                      # no adapter: the base model
    for name in adapters:
        assert generate(served, adapters, name) == expected[name], name
    # Bound back onto the base by onnxtrain, merged or as a branch: the merged model's logits.
    model = onnx.load(str(genai_folder / "model.onnx"), load_external_data=False)
    feeds = {name: value for name, value in llm_exports.feeds("genai_fp32", model, np.random.default_rng(5)).items()
             if name != "labels"}
    merged_logits = ort.InferenceSession(str(tmp_path / "merged-second" / "model.onnx")).run(["logits"], feeds)[0]
    for merge in (True, False):
        bound = onnxtrain.apply_adapters(served / "model.onnx", adapters["second"], merge=merge)
        onnxtrain.save_model(bound, tmp_path / f"bound-{merge}.onnx")
        logits = ort.InferenceSession(str(tmp_path / f"bound-{merge}.onnx")).run(["logits"], feeds)[0]
        np.testing.assert_allclose(logits, merged_logits, rtol=1e-4, atol=1e-5, err_msg=f"merge={merge}")


@pytest.mark.filterwarnings("ignore::onnxtrain.ExportDamageWarning")
def test_export_adapters_refuses_base_for_peft_and_conv_layers(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W"], ["y"], name="/net/conv/Conv")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 3, 3])],
        [numpy_helper.from_array(rng.normal(size=(3, 2, 3, 3)).astype(np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    trainer = onnxtrain.Trainer(onnxtrain.make_training_model(
        model, loss="mse", adapters=onnxtrain.LoRA(2, 4, targets=["W"])))
    with pytest.raises(onnxtrain.ExportError, match="MatMul and Gemm layers only"):
        trainer.export_adapters(tmp_path / "conv.onnx_adapter")
    with pytest.raises(onnxtrain.ExportError, match="base= writes the model ONNX Runtime binds"):
        trainer.export_adapters(tmp_path / "peft", base=tmp_path / "base.onnx")
    assert not any(tmp_path.iterdir())
