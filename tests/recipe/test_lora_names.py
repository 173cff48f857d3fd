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
    folder, model, made = tmp_path_factory.mktemp("qwen2"), llm_exports.causal_lm("qwen2"), {}

    def build(route: str):
        if route not in made:
            try:
                made[route] = llm_exports.export(route, model, folder)
            except llm_exports.Unavailable as missing:
                made[route] = missing
        if isinstance(made[route], llm_exports.Unavailable):
            pytest.skip(str(made[route]))
        return made[route]

    return build


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
