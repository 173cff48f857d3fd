"""Pointwise regions (translate/pointwise.py): element-wise chains found in a plan, run as one
whose backward pass keeps only what the chain reads. Oracles: the same graph walked node by
node (ONNXTRAIN_POINTWISE_REGIONS=0's path), and the compiler's own count of the step's
temporary buffers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.translate import pointwise
from onnxtrain.translate.graph import node_reads
from onnxtrain.translate.model import TranslatedModel

CONSTANTS = {"half": 0.5, "three": 3.0, "c1": 0.044715, "c2": 0.7978846, "one": 1.0, "root2": 1.4142135}


def _tanh_gelu(x: str, y: str, p: str) -> list:
    """transformers' gelu_new as torch.onnx's dynamo exporter writes it: eight nodes."""
    return [helper.make_node("Mul", [x, "half"], [p + "half_x"]), helper.make_node("Pow", [x, "three"], [p + "cube"]),
            helper.make_node("Mul", [p + "cube", "c1"], [p + "scaled_cube"]),
            helper.make_node("Add", [x, p + "scaled_cube"], [p + "inner"]),
            helper.make_node("Mul", [p + "inner", "c2"], [p + "argument"]),
            helper.make_node("Tanh", [p + "argument"], [p + "t"]), helper.make_node("Add", [p + "t", "one"], [p + "one_t"]),
            helper.make_node("Mul", [p + "half_x", p + "one_t"], [y])]


def _erf_gelu(x: str, y: str, p: str) -> list:
    return [helper.make_node("Div", [x, "root2"], [p + "d"]), helper.make_node("Erf", [p + "d"], [p + "e"]),
            helper.make_node("Add", [p + "e", "one"], [p + "a"]), helper.make_node("Mul", [x, p + "a"], [p + "m"]),
            helper.make_node("Mul", [p + "m", "half"], [y])]


def _silu(x: str, y: str, p: str) -> list:
    return [helper.make_node("Sigmoid", [x], [p + "s"]), helper.make_node("Mul", [x, p + "s"], [y])]


def _model(activation, layers: int = 2, width: int = 16, hidden: int = 64, extra_outputs=(), extra_nodes=()):
    """x -> layers of (MatMul, activation, MatMul, residual Add); weights W<l>, V<l>."""
    rng = np.random.default_rng(0)
    nodes, initializers = [], [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in CONSTANTS.items()]
    current = "x"
    for layer in range(layers):
        initializers += [numpy_helper.from_array((rng.standard_normal((width, hidden)) * 0.3).astype(np.float32), f"W{layer}"),
                         numpy_helper.from_array((rng.standard_normal((hidden, width)) * 0.3).astype(np.float32), f"V{layer}")]
        nodes += [helper.make_node("MatMul", [current, f"W{layer}"], [f"h{layer}"]),
                  *activation(f"h{layer}", f"g{layer}", f"l{layer}/"),
                  helper.make_node("MatMul", [f"g{layer}", f"V{layer}"], [f"o{layer}"]),
                  helper.make_node("Add", [current, f"o{layer}"], [f"r{layer}"])]
        current = f"r{layer}"
    nodes += list(extra_nodes)
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in (current, *extra_outputs)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width])],
                              outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), current


def _regions(model):
    translated = TranslatedModel(model, jit=False)
    plan = translated.plan
    named = {spec.proto.output[0] for spec in plan.nodes}
    regions = pointwise.find_regions(plan.nodes, plan.outputs, node_reads)
    return [sorted(plan.nodes[i].proto.output[0] for i in region.members) for region in regions.values()], named


@pytest.mark.parametrize("activation, size", [(_tanh_gelu, 8), (_erf_gelu, 5), (_silu, 2)])
def test_each_activation_chain_is_one_region(activation, size):
    regions, _ = _regions(_model(activation)[0])
    assert len(regions) == 2 and all(len(members) == size for members in regions)
    assert sorted(r[-1] if r[-1].startswith("g") else next(n for n in r if n.startswith("g")) for r in regions) == ["g0", "g1"]


def test_values_read_outside_stay_outside_the_region():
    # The cube is a graph output, and Tanh's result feeds a node outside the chain: the cube
    # is in no region, and Tanh's result ends one region and is read by the next.
    extra = [helper.make_node("Neg", ["l0/t"], ["negated"])]
    model, _ = _model(_tanh_gelu, layers=1, extra_outputs=("l0/cube", "negated"), extra_nodes=extra)
    regions, _ = _regions(model)
    assert sorted(regions) == [sorted(["l0/half_x", "l0/one_t", "g0"]),
                               sorted(["l0/scaled_cube", "l0/inner", "l0/argument", "l0/t"])]


def test_no_region_without_an_op_whose_derivative_keeps_a_value():
    chain = lambda x, y, p: [helper.make_node("Add", [x, "one"], [p + "a"]), helper.make_node("Neg", [p + "a"], [y])]
    assert _regions(_model(chain)[0])[0] == []


def test_a_value_read_twice_inside_joins_once_both_readers_have():
    # Exp's result feeds Sin and Cos, both inside: it joins only after the second of them.
    diamond = lambda x, y, p: [helper.make_node("Exp", [x], [p + "a"]), helper.make_node("Sin", [p + "a"], [p + "b"]),
                               helper.make_node("Cos", [p + "a"], [p + "c"]), helper.make_node("Mul", [p + "b", p + "c"], [y])]
    regions, _ = _regions(_model(diamond, layers=1)[0])
    assert regions == [sorted(["l0/a", "l0/b", "l0/c", "g0"])]


def test_a_long_chain_is_one_region():
    # Found in one walk of the chain: a deep model is planned in time linear in its nodes.
    def long(x, y, p, n=3000):
        names = [x, *(f"{p}{i}" for i in range(1, n)), y]
        return [helper.make_node("Mul" if i % 2 else "Add", [names[i], "half"], [names[i + 1]]) for i in range(n)]

    regions, _ = _regions(_model(long, layers=1)[0])
    assert [len(members) for members in regions] == [3000]


def _value_and_gradients(model, output, x):
    translated = TranslatedModel(model, jit=False)
    params = {name: jnp.asarray(value) for name, value in translated.params.items()}

    def loss(params, x):
        return jnp.sum(translated.apply(params, {"x": x})[output] ** 2)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, x).compile()
    value, gradients = compiled(params, x)
    return float(value), {k: np.asarray(v) for k, v in gradients.items()}, compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("activation", [_tanh_gelu, _erf_gelu, _silu])
def test_regions_give_the_node_by_node_values_and_gradients(activation, monkeypatch):
    model, output = _model(activation)
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    monkeypatch.setattr(pointwise, "ENABLED", False)
    plain = _value_and_gradients(model, output, x)
    monkeypatch.setattr(pointwise, "ENABLED", True)
    regions = _value_and_gradients(model, output, x)
    assert regions[0] == pytest.approx(plain[0], rel=1e-6)
    for name, gradient in plain[1].items():
        np.testing.assert_allclose(regions[1][name], gradient, rtol=1e-5, atol=1e-6 * np.abs(gradient).max())


def test_the_backward_pass_keeps_the_chain_input_only(monkeypatch):
    """The step's temporaries shrink by at least two hidden-width values per layer."""
    layers, rows, hidden = 4, 64, 2048
    model, output = _model(_tanh_gelu, layers=layers, width=128, hidden=hidden)
    x = np.random.default_rng(1).standard_normal((rows, 128)).astype(np.float32)
    monkeypatch.setattr(pointwise, "ENABLED", False)
    plain = _value_and_gradients(model, output, x)[2]
    monkeypatch.setattr(pointwise, "ENABLED", True)
    regions = _value_and_gradients(model, output, x)[2]
    assert plain - regions >= 2 * layers * rows * hidden * 4, (plain, regions)


def test_a_kept_intermediate_stays_visible():
    """apply_keeping's kept names (what an update tail recomputes from) are never hidden in a region."""
    model, _ = _model(_silu, layers=1)
    translated = TranslatedModel(model, jit=False)
    params = {name: jnp.asarray(value) for name, value in translated.params.items()}
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    kept = jax.jit(lambda p, x: translated.apply_keeping(p, {"x": x}, None, ["l0/s"])[1])(params, x)
    np.testing.assert_allclose(kept["l0/s"], jax.nn.sigmoid(x @ params["W0"]), rtol=1e-6)
