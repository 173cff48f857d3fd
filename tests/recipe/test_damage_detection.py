"""Export damage on hand-built graphs: each finding, the look-alikes it must not flag, and each
repair against hand-derived values and the model before the repair (onnxtrain.run).

The same damage in real torch exports is tested in test_export_damage.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import BindingError, optim
from onnxtrain._io.model import load_model
from onnxtrain._recipe import damage
from onnxtrain._recipe.damage import ExportDamageWarning
from support.gradient_outputs import with_gradients

RNG = np.random.default_rng(0)


def _damage_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, ExportDamageWarning)]


def _graph_model(nodes, initializers, inputs, outputs, opset=17):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
                              [numpy_helper.from_array(v.astype(np.float32), n) for n, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    return onnxtrain.proto.ModelProto.FromString(model.SerializeToString())


def _conv_net(residual=False, group=1, bias=True, normalization=False, opset=17):
    """Two 3x3 convolutions with ReLUs on 4 channels, optionally a residual add, grouped
    convolutions, bias-free convolutions or a BatchNormalization."""
    weights = {"w1": RNG.normal(size=(4, 4 // group, 3, 3)), "w2": RNG.normal(size=(4, 4 // group, 3, 3)),
               "b1": RNG.normal(size=4), "b2": RNG.normal(size=4)}
    nodes = [helper.make_node("Conv", ["x", "w1", *(["b1"] if bias else [])], ["c1"], pads=[1] * 4, group=group),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", *(["b2"] if bias else [])], ["c2"], pads=[1] * 4, group=group)]
    last = "c2"
    if normalization:
        weights.update(s=np.ones(4), t=np.zeros(4), m=np.zeros(4), v=np.ones(4))
        nodes.append(helper.make_node("BatchNormalization", ["c2", "s", "t", "m", "v"], ["n2"]))
        last = "n2"
    if residual:
        nodes.append(helper.make_node("Add", [last, "x"], ["a2"]))
        last = "a2"
    nodes.append(helper.make_node("Relu", [last], ["y"]))
    return _graph_model(nodes, weights, [("x", ["n", 4, 6, 6])], [("y", ["n", 4, 6, 6])], opset)


@pytest.mark.parametrize("value, folded", [
    (np.random.default_rng(0).normal(size=(4, 32)), True),
    (np.zeros((4, 32)), False),                                   # a zero RNN state
    (np.full((4, 32), -3.4e38), False),                           # a mask fill value
    (np.triu(np.full((16, 16), -np.inf), 1), False),              # a causal mask
    (np.tile([0.0, 1.0], 64), False),                             # a 0/1 mask
    (np.random.default_rng(0).normal(size=16), False),            # too small for a weight
])
def test_only_weight_like_constants_count_as_folded_weights(value, folded):
    item = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(value.astype(np.float32)))
    proto = onnxtrain.proto.NodeProto.FromString(item.SerializeToString())
    assert (damage.folded_weight(proto) is not None) == folded


def test_unknown_repair_names_are_refused():
    with pytest.raises(BindingError, match="names no repair"):
        damage.repair_names({"retie", "refold"})
    assert damage.repair_names("all") == frozenset(damage.REPAIRS)
    assert damage.repair_names(None, lift_folded_weights=True) == {"lift_constants"}


@pytest.mark.parametrize("options, folded", [
    ({"residual": True}, True),
    ({"group": 2}, True),
    ({"bias": False}, True),
    ({}, False),                                                  # a plain conv stack (LeNet, VGG)
    ({"residual": True, "normalization": True}, False),           # BatchNorm kept
])
def test_folded_batchnorm_needs_structure_that_says_batchnorm_was_there(options, folded):
    assert ("folded_batchnorm" in {f.kind for f in damage.detect(_conv_net(**options))}) == folded


def test_bundled_exports_show_no_damage():
    models = Path(onnxtrain.__file__).parent / "models"
    for name in ("digits_cnn.onnx", "mlp_classifier.onnx"):
        assert damage.detect(load_model(models / name)) == []


@pytest.mark.slow
def test_inserted_batchnorm_is_the_identity_at_inference_and_needs_opset_14():
    model = _conv_net(residual=True)
    x = RNG.normal(size=(2, 4, 6, 6)).astype(np.float32)
    before = onnxtrain.run(model, {"x": x})["y"]
    repaired = onnxtrain.proto.ModelProto()
    repaired.CopyFrom(model)
    assert damage.repair(repaired, ["insert_batchnorm"]) == ["BatchNormalization after 'c1'",
                                                            "BatchNormalization after 'c2'"]
    assert [n.op_type for n in repaired.graph.node] == ["Conv", "BatchNormalization", "Relu", "Conv",
                                                        "BatchNormalization", "Add", "Relu"]
    assert {"b1", "b2"}.isdisjoint(t.name for t in repaired.graph.initializer)   # moved into the shifts
    np.testing.assert_allclose(onnxtrain.run(repaired, {"x": x})["y"], before, rtol=1e-5, atol=1e-5)
    with pytest.raises(BindingError, match="opset 14"):
        damage.repair(_conv_net(residual=True, opset=13), ["insert_batchnorm"])


def _matmuls(first: np.ndarray, second: np.ndarray):
    return _graph_model([helper.make_node("MatMul", ["x", "A"], ["h"]), helper.make_node("MatMul", ["h", "B"], ["y"])],
                        {"A": first, "B": second}, [("x", ["n", 8])], [("y", ["n", 8])])


def test_tied_weights_pair_only_when_equal_and_weight_like():
    weight = RNG.normal(size=(8, 8))
    assert damage.duplicate_pairs(_matmuls(weight, weight).graph) == [("A", "B", False)]
    assert damage.duplicate_pairs(_matmuls(weight, weight.T).graph) == [("A", "B", True)]
    assert damage.duplicate_pairs(_matmuls(weight, weight + 1e-3).graph) == []
    assert damage.duplicate_pairs(_matmuls(np.ones((8, 8)), np.ones((8, 8))).graph) == []  # fresh scales
    assert damage.duplicate_pairs(_matmuls(weight[:4, :4], weight[:4, :4]).graph) == []     # too small


@pytest.mark.slow
def test_retied_weights_train_as_one_with_the_summed_gradient():
    weight = RNG.normal(size=(8, 8)).astype(np.float32)
    x = RNG.normal(size=(5, 8)).astype(np.float32)
    model = _matmuls(weight, weight.T)
    training = onnxtrain.make_training_model(model, loss="mse", optimizer=optim.SGD(lr=1.0), repair="retie")
    trainer = with_gradients(training)
    assert "B" not in trainer.state_names and "A" in trainer.state_names
    gradient = trainer.step({"x": x, "labels": np.zeros((5, 8), np.float32)})["A.grad"]
    # y = x A Aᵀ and loss = mean(y²), so with g = dloss/dy = 2y / y.size the two uses of A
    # contribute xᵀ g A (through A) and gᵀ x A (through Aᵀ); the tied gradient is their sum.
    x64, a64 = x.astype(np.float64), weight.astype(np.float64)
    upstream = 2 * (x64 @ a64 @ a64.T) / (5 * 8)
    expected = x64.T @ upstream @ a64 + upstream.T @ x64 @ a64
    np.testing.assert_allclose(gradient, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inputs, outputs, size", [
    ([("x", [4, 8])], [("y", [4, 8])], 4),
    ([("x", ["n", 8])], [("y", ["n", 8])], None),                  # a dynamic batch
    ([("x", [4, 8])], [("y", [8, 8])], None),                      # no output follows axis 0
])
def test_fixed_batch_is_a_fixed_axis_0_the_outputs_share(inputs, outputs, size):
    model = _graph_model([helper.make_node("MatMul", ["x", "A"], ["y"])], {"A": RNG.normal(size=(8, 8))},
                         inputs, outputs)
    assert damage.fixed_batch(model.graph) == size


def test_relaxed_reshape_keeps_its_other_sizes():
    shape = numpy_helper.from_array(np.array([4, 2, 4], np.int64), "shape")
    model = _graph_model([helper.make_node("MatMul", ["x", "A"], ["h"]),
                          helper.make_node("Reshape", ["h", "shape"], ["y"])],
                         {"A": RNG.normal(size=(8, 8))}, [("x", [4, 8])], [("y", [4, 2, 4])])
    model.graph.initializer.append(onnxtrain.proto.TensorProto.FromString(shape.SerializeToString()))
    damage.repair(model, ["relax_batch"])
    x = RNG.normal(size=(3, 8)).astype(np.float32)
    assert onnxtrain.run(model, {"x": x})["y"].shape == (3, 2, 4)


def test_dropout_note_only_for_attention_graphs_without_dropout():
    def attention(dropout: bool):
        nodes = [helper.make_node("MatMul", ["x", w], [f"{w}x"]) for w in "QKV"]
        nodes += [helper.make_node("MatMul", ["Qx", "Kx"], ["s"]), helper.make_node("Softmax", ["s"], ["p"]),
                  helper.make_node("MatMul", ["p", "Vx"], ["y"])]
        if dropout:
            nodes.insert(-1, helper.make_node("Dropout", ["p"], ["pd"]))
            nodes[-1].input[0] = "pd"
        return _graph_model(nodes, {w: RNG.normal(size=(8, 8)) for w in "QKV"}, [("x", [8, 8])], [("y", [8, 8])])

    (note,) = [f for f in damage.detect(attention(False)) if f.kind == "dropout_removed"]
    assert note.note and "TrainingMode.TRAINING" in note.advice
    assert "dropout_removed" not in {f.kind for f in damage.detect(attention(True))}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        onnxtrain.make_training_model(attention(False), loss="mse")
    assert not any("Dropout" in message for message in _damage_warnings(record))   # a note is no warning


def _two_scales(scale: np.ndarray, through_identity: bool = False):
    """x * s * s' where s' is s itself (or, as TorchScript writes it, an Identity of s named 's2')."""
    second = "s2" if through_identity else "s"
    nodes = [helper.make_node("Mul", ["x", "s"], ["h"]), helper.make_node("Mul", ["h", second], ["y"])]
    if through_identity:
        nodes.insert(0, helper.make_node("Identity", ["s"], ["s2"]))
    return _graph_model(nodes, {"s": scale}, [("x", ["n", 8])], [("y", ["n", 8])])


@pytest.mark.parametrize("scale, merged", [
    (np.full(8, 1e-6), True),                      # layer scales
    (np.zeros(8), True),                           # zero biases
    (RNG.normal(size=8), False),                   # one weight used twice on purpose
    (np.array(2.0), False),                        # a shared scalar constant
])
def test_merged_weights_are_shared_vectors_of_one_value(scale, merged):
    assert bool(damage.merged_weights(_two_scales(scale).graph)) == merged
    assert bool(damage.merged_weights(_two_scales(scale, through_identity=True).graph)) == merged


@pytest.mark.parametrize("through_identity, copy", [(False, "s.copy"), (True, "s2")])
def test_untied_uses_get_tensors_of_their_own(through_identity, copy):
    model = _two_scales(np.full(8, 0.5), through_identity)
    x = RNG.normal(size=(3, 8)).astype(np.float32)
    before = onnxtrain.run(model, {"x": x})["y"]
    assert damage.repair(model, ["untie"]) == [f"untied {copy!r}"]
    assert [list(n.input) for n in model.graph.node] == [["x", "s"], ["h", copy]]
    assert damage.merged_weights(model.graph) == {}
    np.testing.assert_array_equal(onnxtrain.run(model, {"x": x})["y"], before)


def test_make_training_command_repairs(tmp_path: Path, capsys):
    from onnxtrain.cli import main

    model = _two_scales(np.full(8, 0.5))
    (tmp_path / "scaled.onnx").write_bytes(model.SerializeToString())
    assert main(["inspect", str(tmp_path / "scaled.onnx")]) == 0
    assert "warning: Weights that held equal values" in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportDamageWarning)
        assert main(["make-training", str(tmp_path / "scaled.onnx"), "-o", str(tmp_path / "out.onnx"),
                     "--loss", "mse", "--repair", "untie"]) == 0
    assert {"s", "s.copy"} <= {t.name for t in load_model(tmp_path / "out.onnx").graph.initializer}


def test_squeeze_and_excitation_convolutions_get_no_batchnorm():
    """MobileNetV3/EfficientNet: x * HardSigmoid(Conv(Relu(Conv(GlobalAveragePool(x))))) has no
    BatchNorm in the source, while the convolutions around it do."""
    model = _conv_net(group=2)
    graph = model.graph
    se = [helper.make_node("GlobalAveragePool", ["y"], ["pooled"]),
          helper.make_node("Conv", ["pooled", "se1"], ["s1"]), helper.make_node("Relu", ["s1"], ["s1r"]),
          helper.make_node("Conv", ["s1r", "se2"], ["s2"]), helper.make_node("HardSigmoid", ["s2"], ["gate"]),
          helper.make_node("Mul", ["y", "gate"], ["excited"])]
    graph.node.extend(onnxtrain.proto.NodeProto.FromString(n.SerializeToString()) for n in se)
    for name, shape in (("se1", (2, 4, 1, 1)), ("se2", (4, 2, 1, 1))):
        tensor = numpy_helper.from_array(RNG.normal(size=shape).astype(np.float32), name)
        graph.initializer.append(onnxtrain.proto.TensorProto.FromString(tensor.SerializeToString()))
    graph.output[0].name = "excited"
    assert [n.output[0] for n in damage.folded_convolutions(graph)] == ["c1", "c2"]
    (finding,) = [f for f in damage.detect(model) if f.kind == "folded_batchnorm"]
    assert finding.names == ("c1", "c2")
    assert damage.repair(model, ["insert_batchnorm"]) == ["BatchNormalization after 'c1'",
                                                         "BatchNormalization after 'c2'"]


def test_relax_batch_refuses_a_graph_that_would_mix_samples():
    """Transpose then Reshape to [2, 4]: the leading 2 equals the batch size but is not the batch
    axis; rewritten to -1, every shape still checks out at other sizes, but samples mix."""
    shape = numpy_helper.from_array(np.array([2, 4], np.int64), "shape")
    model = _graph_model([helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
                          helper.make_node("Reshape", ["t", "shape"], ["y"])],
                         {}, [("x", [2, 4])], [("y", [2, 4])])
    model.graph.initializer.append(onnxtrain.proto.TensorProto.FromString(shape.SerializeToString()))
    before = model.SerializeToString()
    with pytest.raises(BindingError, match="mixes samples"):
        damage.repair(model, ["relax_batch"])
    assert model.SerializeToString() == before


def test_detection_leaves_malformed_nodes_to_graph_validation():
    model = _conv_net(residual=True)
    model.graph.node.append(onnxtrain.proto.NodeProto(op_type="Conv", output=["broken"]))
    model.graph.node.append(onnxtrain.proto.NodeProto(op_type="Identity", output=["alias"]))
    model.graph.node.append(onnxtrain.proto.NodeProto(op_type="Mul", input=["alias", "alias"], output=["m"]))
    assert "folded_batchnorm" in {f.kind for f in damage.detect(model)}


def test_inserted_batchnorm_is_named_after_the_torch_module():
    model = _conv_net(residual=True)
    graph = model.graph
    graph.node[0].name, graph.node[2].name = "/block/c1/Conv", "/block/c2/Conv"
    graph.node[2].input[1] = graph.initializer[1].name = "onnx::Conv_7"   # TorchScript's computed weight
    damage.repair(model, ["insert_batchnorm"])
    names = {t.name for t in graph.initializer}
    assert {"w1.bn.weight", "w1.bn.running_var", "block.c2.bn.bias", "block.c2.bn.running_mean"} <= names


@pytest.mark.parametrize("adapters, trainable, said", [
    (None, None, True),                          # a full fine-tune trains the merged tensor
    (onnxtrain.LoRA(2, 4, targets=["W"]), None, False),   # only the adapters train
    (onnxtrain.LoRA(2, 4, targets=["W"]), ["s"], True),   # the merged tensor trains beside them
])
def test_merged_weights_are_said_only_where_base_weights_train(adapters, trainable, said):
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Mul", ["m", "s"], ["h"]),
             helper.make_node("Mul", ["h", "s"], ["y"])]
    model = _graph_model(nodes, {"W": RNG.normal(size=(8, 8)), "s": np.full(8, 1e-6)}, [("x", [2, 8])],
                         [("y", [2, 8])])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        onnxtrain.make_training_model(model, loss="mse", adapters=adapters, trainable=trainable)
    texts = [str(w.message) for w in caught if issubclass(w.category, ExportDamageWarning)]
    # The fixed batch of 2 matters to every run; the merged scales only where they train.
    assert texts and "fixed batch size of 2" in texts[0]
    assert ("merged into one tensor" in texts[0]) == said
