"""Small float models, and the same models after ONNX Runtime's weight-only quantizer
(onnxruntime.quantization.matmul_nbits_quantizer): MatMulNBits (QOperator format, 2/4/8 bits)
or DequantizeLinear of int4/uint4 blocked weights + MatMul (QDQ format). Callers skip when
onnxruntime is missing."""

from __future__ import annotations

import contextlib
import io
import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def float_mlp(k: int = 40, n: int = 24, bias: bool = True, seed: int = 0) -> onnx.ModelProto:
    """x [batch, 3, k] @ W1 [k, n] (+ b1), Relu, @ W2 [n, k] (+ b2): two MatMuls the
    quantizer takes, and (bias=True) two float biases that stay float."""
    rng = np.random.default_rng(seed)
    initializers = [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "W1"),
                    numpy_helper.from_array(rng.standard_normal((n, k)).astype(np.float32) / 4, "W2")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="first")]
    if bias:
        initializers += [numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b1"),
                         numpy_helper.from_array(rng.standard_normal(k).astype(np.float32), "b2")]
        nodes += [helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
                  helper.make_node("Relu", ["hb"], ["r"], name="relu"),
                  helper.make_node("MatMul", ["r", "W2"], ["m"], name="second"),
                  helper.make_node("Add", ["m", "b2"], ["y"], name="bias2")]
    else:
        nodes += [helper.make_node("Relu", ["h"], ["r"], name="relu"),
                  helper.make_node("MatMul", ["r", "W2"], ["y"], name="second")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, k])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def deep_mlp(layers: int, width: int, seed: int = 0, dropout: float = 0.0) -> onnx.ModelProto:
    """x [batch, width] through `layers` of MatMul [width, width] + bias, Tanh (the last
    without), each Tanh followed by a Dropout of ratio `dropout` if it is positive."""
    rng = np.random.default_rng(seed)
    nodes, initializers, previous = [], [], "x"
    for i in range(layers):
        initializers += [
            numpy_helper.from_array((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32), f"W{i}"),
            numpy_helper.from_array((0.1 * rng.standard_normal(width)).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [previous, f"W{i}"], [f"m{i}"], name=f"matmul{i}"),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"bias{i}")]
        previous = f"a{i}"
        if i < layers - 1:
            nodes.append(helper.make_node("Tanh", [previous], [f"t{i}"], name=f"tanh{i}"))
            previous = f"t{i}"
            if dropout > 0:
                initializers.append(numpy_helper.from_array(np.array(dropout, np.float32), f"ratio{i}"))
                nodes.append(helper.make_node("Dropout", [previous, f"ratio{i}"], [f"d{i}"], name=f"dropout{i}"))
                previous = f"d{i}"
    graph = helper.make_graph(nodes, "deep", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
                              [helper.make_tensor_value_info(previous, TensorProto.FLOAT, ["batch", width])],
                              initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def quantized(model: onnx.ModelProto, bits: int, symmetric: bool, qdq: bool = False,
              block_size: int = 16) -> onnx.ModelProto:
    """`model` after onnxruntime's MatMulNBitsQuantizer (QOperator: MatMulNBits; QDQ:
    DequantizeLinear + MatMul), round-tripped through bytes as a saved file would be."""
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(
        onnx.ModelProto.FromString(model.SerializeToString()), bits=bits, block_size=block_size,
        is_symmetric=symmetric, quant_format=QuantFormat.QDQ if qdq else QuantFormat.QOperator)
    logging.disable(logging.INFO)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            quantizer.process()
    finally:
        logging.disable(logging.NOTSET)
    return onnx.ModelProto.FromString(quantizer.model.model.SerializeToString())


def onnxruntime_outputs(model: onnx.ModelProto, feeds: dict, optimized: bool = True) -> list[np.ndarray]:
    """The model's outputs in onnxruntime (optimized=False: without graph optimizations, so
    no DequantizeLinear + MatMul fusion)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def dequantized_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Each MatMulNBits node's (by output name) or DequantizeLinear's (by its MatMul's
    output) float weight [K, N] as onnxruntime computes it: the node alone, fed the identity."""
    found = {}
    initializers = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            k = next(a.i for a in node.attribute if a.name == "K")
            single = helper.make_graph([helper.make_node(node.op_type, ["eye", *node.input[1:]], ["w"],
                                                         domain=node.domain, **{a.name: helper.get_attribute_value(a) for a in node.attribute})],
                                       "single", [helper.make_tensor_value_info("eye", TensorProto.FLOAT, [k, k])],
                                       [helper.make_tensor_value_info("w", TensorProto.FLOAT, None)],
                                       [initializers[name] for name in node.input[1:] if name in initializers])
            (weight,) = onnxruntime_outputs(
                helper.make_model(single, opset_imports=list(model.opset_import), ir_version=model.ir_version),
                {"eye": np.eye(k, dtype=np.float32)}, optimized=False)
            found[node.output[0]] = weight
    return found


def tiny_llama(path) -> onnx.ModelProto:
    """A transformers LlamaForCausalLM (2 layers, hidden 32, vocab 100, random weights)
    exported by torch.onnx (dynamo) to `path`: input_ids [2, 8] -> logits. Its linear layers
    have no bias, so they export as MatMul, which the weight-only quantizer takes."""
    import warnings

    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False, return_dict=False)[0]

    ids = torch.randint(0, 100, (2, 8))
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            torch.onnx.export(Logits(), (ids,), str(path), input_names=["input_ids"], output_names=["logits"],
                              dynamo=True)
    finally:
        logging.disable(logging.NOTSET)
    return onnx.load(str(path))
