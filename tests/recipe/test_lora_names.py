"""LoRA targets named as peft names them: `LoRA(targets=["q_proj", "v_proj"])` chooses on a
causal LM's ONNX export the layers peft's LoraConfig(target_modules=["q_proj", "v_proj"])
chooses on the torch model, and the adapters carry the module path in their names, whichever
way the model was exported (torch.onnx dynamo, optimum-cli, onnxruntime-genai's builder).

Oracle: peft itself, on the torch model each export came from.
"""

from __future__ import annotations

import pytest

import onnxtrain
from onnxtrain._recipe.lora import read_record
from support import llm_exports

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::onnxtrain.ExportDamageWarning")]

# What each route puts before the module paths torch gives the causal LM's modules: dynamo
# exports a wrapper holding the model as `model` (tests/support/llm_exports.py).
PREFIX = {"dynamo_static": "model.", "dynamo_dynamic": "model.", "dynamo_kv": "model.", "optimum": ""}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return llm_exports.exporter(tmp_path_factory.mktemp("qwen2"))


def peft_modules(targets: list[str]) -> set[str]:
    """The modules peft adapts on the torch model, by path from the causal LM."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    adapted = peft.get_peft_model(llm_exports.causal_lm("qwen2"), config)
    return {name.removeprefix("base_model.model.") for name, module in adapted.named_modules()
            if isinstance(module, peft.tuners.lora.LoraLayer)}


def adapted(path, targets: list[str]) -> tuple[onnxtrain.Trainer, dict]:
    model = onnxtrain.make_training_model(str(path), loss="causal_lm",
                                          adapters=onnxtrain.LoRA(rank=4, alpha=8, targets=targets))
    return onnxtrain.Trainer(model), read_record(model)


@pytest.mark.parametrize("route", ["dynamo_static", "dynamo_kv", "optimum"])
def test_targets_choose_the_layers_peft_chooses_and_name_adapters_by_module(exported, route):
    targets = ["q_proj", "v_proj"]
    trainer, record = adapted(exported(route), targets)
    modules = [entry["module"] for entry in record["weights"].values()]
    expected = peft_modules(targets)
    assert len(expected) == 2 * llm_exports.LAYERS
    assert {module.removeprefix(PREFIX[route]) for module in modules} == expected
    assert set(trainer.state_names) >= {f"{module}.lora_{part}" for module in modules for part in "AB"}
    # The weight values themselves keep the exporter's names (val_113, onnx::MatMul_745).
    assert all(not name.endswith(".lora_A") for name in record["weights"])


def test_a_pattern_over_module_paths_chooses_one_layer(exported):
    trainer, record = adapted(exported("dynamo_static"), ["*layers.1.mlp.down_proj"])
    assert [entry["module"] for entry in record["weights"].values()] == ["model.model.layers.1.mlp.down_proj"]


def test_a_fused_projection_is_named_and_the_error_says_how_to_target_it(exported):
    path = exported("genai_fp32")
    with pytest.raises(onnxtrain.BindingError, match="fuses q_proj, k_proj and v_proj into one qkv_proj"):
        adapted(path, ["q_proj", "v_proj"])
    trainer, record = adapted(path, ["qkv_proj", "o_proj"])
    assert sorted(entry["module"] for entry in record["weights"].values()) == [
        f"model.layers.{layer}.attn.{name}" for layer in range(llm_exports.LAYERS) for name in ("o_proj", "qkv_proj")]
    assert "model.layers.0.attn.qkv_proj.lora_B" in trainer.state_names


@pytest.mark.parametrize("route", ["dynamo_static", "optimum"])
def test_peft_loads_the_exported_adapters_and_computes_the_trainers_loss(exported, route, tmp_path):
    """Three steps train the adapters; export_adapters writes them as peft does, and peft's
    PeftModel on the torch model gives the trained model's loss on a new batch."""
    import numpy as np
    import onnx

    path = exported(route)
    trainer, _ = adapted(path, ["q_proj", "v_proj"])
    rng = np.random.default_rng(0)
    model = onnx.load(str(path), load_external_data=False)
    for _ in range(3):
        trainer.step(llm_exports.feeds(route, model, rng))
    batch = llm_exports.feeds(route, model, rng)
    ours = float(trainer.evaluate(batch)["loss"])
    trainer.export_adapters(tmp_path / "adapter", drop_prefix=PREFIX[route])
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                        "adapter_model.safetensors"]
    base = llm_exports.causal_lm("qwen2")
    with torch.no_grad():
        untrained = float(llm_exports.torch_loss(route, base, batch))
        served = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        theirs = float(llm_exports.torch_loss(route, served, batch))
    assert abs(ours - untrained) > 1e-4   # the adapters changed the model
    assert theirs == pytest.approx(ours, rel=1e-5)


def test_export_adapters_says_what_it_cannot_write(exported, tmp_path):
    trainer, _ = adapted(exported("dynamo_static"), ["q_proj"])
    with pytest.raises(onnxtrain.ExportError, match="does not start with it"):
        trainer.export_adapters(tmp_path / "adapter", drop_prefix="transformer.")
    plain = onnxtrain.Trainer(onnxtrain.make_training_model(str(exported("dynamo_static")), loss="causal_lm"))
    with pytest.raises(onnxtrain.ExportError, match="no adapters"):
        plain.export_adapters(tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()
