"""QLoRA that ships in 4 bits: LoRA on onnxruntime-genai's int4 export (MatMulNBits) exports
with every MatMulNBits kept, merged weights quantized again in the base's format, nothing
added, the base's node names, and about the base's bytes; the unmerged export keeps the base's
4-bit layers and adds only the branch. Oracles: onnxruntime (its MatMulNBits kernel),
onnxruntime-genai generation, and round-to-nearest's bound (half a step per element).
"""

from __future__ import annotations

import logging
import shutil

import numpy as np
import onnx
import pytest

import onnxtrain
from onnxtrain._recipe.quantized import dequantized_blocks, quantize_blocks
from support import llm_exports

ort = pytest.importorskip("onnxruntime")


@pytest.mark.parametrize("asymmetric", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantizing_again_rounds_each_weight_to_its_nearest_step(bits, asymmetric):
    rng = np.random.default_rng(bits)
    weight = rng.normal(size=(6, 64)) * np.linspace(0.1, 3, 6)[:, None]
    integers, scales, zeros = quantize_blocks(weight, bits, 16, asymmetric)
    assert integers.max() <= 2 ** bits - 1 and scales.shape == zeros.shape == (6, 4)
    error = np.abs(dequantized_blocks(integers, scales, zeros, 16) - weight).reshape(6, 4, 16)
    # Half a step, and for a zero point rounded to an integer at most one step at the range's ends.
    assert (error <= scales[..., None] * (1.0 if asymmetric else 0.5) + 1e-12).all()
    # Given the base's grid, each block takes whichever grid rounds it closer: never worse than
    # either, and for a weight near the base's (a small LoRA change) about as close as the change.
    grid = (scales, zeros.astype(np.float64))
    nearby = dequantized_blocks(integers, scales, zeros, 16) + 1e-4 * rng.normal(size=weight.shape)

    def block_errors(result):
        return np.abs(dequantized_blocks(*result, 16) - nearby).reshape(6, 4, 16).max(-1)

    chosen = block_errors(quantize_blocks(nearby, bits, 16, asymmetric, grid=grid))
    fresh = block_errors(quantize_blocks(nearby, bits, 16, asymmetric))
    kept = np.abs(dequantized_blocks(integers, scales, zeros, 16) - nearby).reshape(6, 4, 16).max(-1)
    assert (chosen <= np.minimum(fresh, kept) + 1e-15).all() and chosen.max() < 1e-3


og = pytest.importorskip("onnxruntime_genai")


def count(model: onnx.ModelProto, op_type: str) -> int:
    return sum(node.op_type == op_type for node in model.graph.node)


def stored_bytes(folder) -> int:
    return sum(path.stat().st_size for path in folder.glob("model.onnx*"))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::onnxtrain.ExportDamageWarning")
def test_qlora_on_a_genai_int4_base_exports_in_4_bits_and_serves(tmp_path, caplog):
    try:
        path = llm_exports.export("genai_int4", llm_exports.causal_lm("qwen2"), tmp_path / "qwen2")
    except llm_exports.Unavailable as missing:
        pytest.skip(str(missing))
    base = onnx.load(str(path))
    trainer = onnxtrain.Trainer(onnxtrain.make_training_model(
        str(path), loss="causal_lm", adapters=onnxtrain.LoRA(4, 8, targets=["qkv_proj", "o_proj"]),
        optimizer=onnxtrain.optim.Adam(2e-2)))
    rng = np.random.default_rng(0)
    for _ in range(3):
        trainer.step(llm_exports.feeds("genai_int4", base, rng))
    merged_folder = tmp_path / "merged"
    shutil.copytree(path.parent, merged_folder)
    for stale in merged_folder.glob("model.onnx*"):
        stale.unlink()
    with caplog.at_level(logging.WARNING, logger="onnxtrain"):
        trainer.export(merged_folder / "model.onnx", training=False)
    trainer.export(tmp_path / "branch.onnx", training=False, merge=False)
    merged, branch = onnx.load(str(merged_folder / "model.onnx")), onnx.load(str(tmp_path / "branch.onnx"))
    for op_type in ("MatMulNBits", "Transpose", "DequantizeLinear"):
        assert count(merged, op_type) == count(branch, op_type) == count(base, op_type), op_type
    assert count(base, "MatMulNBits") == 11
    assert {node.name for node in merged.graph.node} == {node.name for node in base.graph.node}
    assert stored_bytes(merged_folder) <= 1.3 * stored_bytes(path.parent)
    [said] = [r.getMessage() for r in caplog.records if "quantized them again" in r.getMessage()]
    largest = float(said.split("largest change is ")[1].split(" ")[0])
    assert 0 < largest < 0.2, said

    feeds = {name: value for name, value in llm_exports.feeds("genai_int4", base, np.random.default_rng(9)).items()
             if name != "labels"}
    logits = {name: ort.InferenceSession(str(file)).run(["logits"], feeds)[0]
              for name, file in (("base", path), ("merged", merged_folder / "model.onnx"),
                                 ("branch", tmp_path / "branch.onnx"))}
    ours = np.asarray(trainer.infer(feeds)["logits"])
    # The branch export computes the trained model (MatMulNBits' accuracy_level 4 quantizes its
    # activations to 8 bits), and the merged one keeps most of what training changed.
    assert np.abs(logits["branch"] - ours).max() < 0.1
    assert np.abs(logits["merged"] - ours).max() < 0.5 * np.abs(logits["base"] - ours).max()

    model = og.Model(str(merged_folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=16, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([[1, 5, 9, 17]], np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    assert len(generator.get_sequence(0)) == 16
