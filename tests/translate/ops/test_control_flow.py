"""If, Loop, Scan, SequenceMap, sequence and optional ops: the paths the backend cases miss.

The backend cases feed every value as a graph input, so most of them run
eagerly. These tests pin down the compiled paths (lax.scan, while_loop, cond,
unrolling), gradients through them, and the attribute combinations the cases
leave out, against onnx's ReferenceEvaluator, onnxruntime and numpy.
"""

from __future__ import annotations

import jax
import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxtrain import load_model
from onnxtrain.errors import ModelLoadError
from onnxtrain.translate.model import TranslatedModel

FLOAT, INT64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def tensor(name: str, elem_type: int = FLOAT, shape: list | None = None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def sequence(name: str, elem_type: int = FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_sequence_value_info(name, elem_type, None)


def const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name],
                            value=numpy_helper.from_array(np.asarray(value)))


def model_of(nodes: list, inputs: list, outputs: list, initializers: dict | None = None,
             opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs,
                              [numpy_helper.from_array(np.asarray(v), k)
                               for k, v in (initializers or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def translate(model: onnx.ModelProto) -> TranslatedModel:
    return TranslatedModel(load_model(model.SerializeToString()))


def run(model: onnx.ModelProto, feeds: dict) -> tuple[list, TranslatedModel]:
    fn = translate(model)
    outputs = fn(fn.params, feeds)
    return [outputs[name] for name in fn.output_names], fn


def ran_eagerly(fn: TranslatedModel) -> bool:
    return bool(fn._eager_signatures)


def jaxpr_text(fn: TranslatedModel, feeds: dict) -> str:
    with jax.enable_x64(True):
        return str(jax.make_jaxpr(fn.apply)(fn.params, feeds))


def reference(model: onnx.ModelProto, feeds: dict) -> list:
    return ReferenceEvaluator(model).run(None, feeds)


def runtime(model: onnx.ModelProto, feeds: dict) -> list:
    session = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_outputs(actual: list, expected: list) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        if isinstance(e, list):
            assert isinstance(a, list) and len(a) == len(e)
            assert_outputs(a, e)
            continue
        a = np.asarray(a)
        assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, a.shape, e.dtype, e.shape)
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# Loop


def affine_loop(trip_count: int) -> onnx.ModelProto:
    """y <- y * w + x for trip_count iterations, w a trained parameter; scans out each y."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["y_in", "w"], ["scaled"]),
         helper.make_node("Add", ["scaled", "x"], ["y_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Identity", ["y_out"], ["scan_out"])],
        "body", [tensor("i", INT64, []), tensor("cond_in", BOOL, []), tensor("y_in", FLOAT, [2])],
        [tensor("cond_out", BOOL, []), tensor("y_out", FLOAT, [2]), tensor("scan_out", FLOAT, [2])])
    return model_of(
        [helper.make_node("Loop", ["M", "cond", "y0"], ["y", "ys"], body=body)],
        [tensor("x", FLOAT, [2]), tensor("y0", FLOAT, [2])],
        [tensor("y", FLOAT, [2]), tensor("ys", FLOAT, [trip_count, 2])],
        {"M": np.array(trip_count, np.int64), "cond": np.array(True),
         "w": np.array([0.5, -1.5], np.float32)})


def test_loop_with_static_trip_count_compiles_to_scan_and_matches_reference():
    model = affine_loop(4)
    feeds = {"x": np.array([1.0, 2.0], np.float32), "y0": np.array([3.0, -1.0], np.float32)}
    outputs, fn = run(model, feeds)
    assert_outputs(outputs, reference(model, feeds))
    assert not ran_eagerly(fn)
    assert "scan[" in jaxpr_text(fn, feeds)


@pytest.mark.slow
def test_loop_scan_gradient_matches_finite_differences():
    fn = translate(affine_loop(3))
    feeds = {"x": np.array([1.0, 2.0]), "y0": np.array([3.0, -1.0])}

    def loss(w: np.ndarray) -> jax.Array:
        outputs = fn.apply({**fn.params, "w": w}, feeds)
        return outputs["y"].sum() + (outputs["ys"] ** 2).sum()

    with jax.enable_x64(True):
        w = np.array([0.5, -1.5])
        gradient = np.asarray(jax.grad(loss)(w))
        step = 1e-6
        numeric = [(loss(w + step * e) - loss(w - step * e)) / (2 * step) for e in np.eye(2)]
    np.testing.assert_allclose(gradient, numeric, rtol=1e-5)


def test_loop_with_zero_trip_count_gives_empty_scan_outputs():
    model = affine_loop(0)
    feeds = {"x": np.array([1.0, 2.0], np.float32), "y0": np.array([3.0, -1.0], np.float32)}
    (y, ys), fn = run(model, feeds)
    np.testing.assert_array_equal(y, feeds["y0"])
    assert np.shape(ys) == (0, 2) and np.asarray(ys).dtype == np.float32
    assert not ran_eagerly(fn)


def slicing_loop() -> onnx.ModelProto:
    """test_loop11's body (Slice by the iteration number) over a graph input x, M a constant."""
    body = helper.make_graph(
        [const("one", np.array(1, np.int64)), const("axes", np.array([0], np.int64)),
         helper.make_node("Add", ["i", "one"], ["end"]),
         helper.make_node("Unsqueeze", ["i", "axes"], ["start_1d"]),
         helper.make_node("Unsqueeze", ["end", "axes"], ["end_1d"]),
         helper.make_node("Slice", ["x", "start_1d", "end_1d"], ["piece"]),
         helper.make_node("Add", ["y_in", "piece"], ["y_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Identity", ["y_out"], ["scan_out"])],
        "body", [tensor("i", INT64, []), tensor("cond_in", BOOL, []), tensor("y_in", FLOAT, [1])],
        [tensor("cond_out", BOOL, []), tensor("y_out", FLOAT, [1]), tensor("scan_out", FLOAT, [1])])
    return model_of(
        [helper.make_node("Loop", ["M", "", "y0"], ["y", "ys"], body=body)],
        [tensor("x", FLOAT, [5]), tensor("y0", FLOAT, [1])],
        [tensor("y", FLOAT, [1]), tensor("ys", FLOAT, [5, 1])],
        {"M": np.array(5, np.int64)})


def test_loop_whose_body_needs_the_iteration_on_the_host_is_unrolled_not_eager():
    model = slicing_loop()
    feeds = {"x": np.arange(1, 6, dtype=np.float32), "y0": np.array([-2.0], np.float32)}
    outputs, fn = run(model, feeds)
    assert_outputs(outputs, runtime(model, feeds))  # the reference skips loops without cond
    assert not ran_eagerly(fn)
    assert "scan[" not in jaxpr_text(fn, feeds)


def counting_loop(with_trip_count: bool, with_scan_output: bool) -> onnx.ModelProto:
    """s <- s + 1 while s < limit (limit a graph input), optionally also bounded by M."""
    outputs = [tensor("cond_out", BOOL, []), tensor("s_out", FLOAT, [])]
    nodes = [const("one", np.array(1.0, np.float32)),
             helper.make_node("Add", ["s_in", "one"], ["s_out"]),
             helper.make_node("Less", ["s_out", "limit"], ["cond_out"])]
    if with_scan_output:
        nodes.append(helper.make_node("Identity", ["s_out"], ["scan_out"]))
        outputs.append(tensor("scan_out", FLOAT, []))
    body = helper.make_graph(
        nodes, "body",
        [tensor("i", INT64, []), tensor("cond_in", BOOL, []), tensor("s_in", FLOAT, [])], outputs)
    inputs = [tensor("limit", FLOAT, []), tensor("s0", FLOAT, [])]
    if with_trip_count:
        inputs.append(tensor("M", INT64, []))
    loop = helper.make_node("Loop", ["M" if with_trip_count else "", "start", "s0"],
                            ["s", "ss"] if with_scan_output else ["s"], body=body)
    return model_of(
        [helper.make_node("Less", ["s0", "limit"], ["start"]), loop], inputs,
        [tensor("s", FLOAT, []), tensor("ss", FLOAT, [None])][:2 if with_scan_output else 1])


@pytest.mark.parametrize("with_trip_count", [False, True])
def test_loop_with_traced_condition_compiles_to_while_loop(with_trip_count: bool):
    model = counting_loop(with_trip_count, with_scan_output=False)
    feeds = {"limit": np.array(4.5, np.float32), "s0": np.array(0.25, np.float32)}
    if with_trip_count:
        feeds["M"] = np.array(2, np.int64)
    outputs, fn = run(model, feeds)
    assert_outputs(outputs, reference(model, feeds))
    assert not ran_eagerly(fn)
    assert "while[" in jaxpr_text(fn, feeds)


def test_pytorch_style_while_loop_with_maximal_trip_count_compiles_to_while_loop():
    body = helper.make_graph(
        [const("one", np.array(1.0, np.float32)),
         helper.make_node("Add", ["s_in", "one"], ["s_out"]),
         helper.make_node("Less", ["s_out", "limit"], ["cond_out"])], "body",
        [tensor("i", INT64, []), tensor("cond_in", BOOL, []), tensor("s_in", FLOAT, [])],
        [tensor("cond_out", BOOL, []), tensor("s_out", FLOAT, [])])
    model = model_of([helper.make_node("Loop", ["M", "cond", "s0"], ["s"], body=body)],
                     [tensor("limit", FLOAT, []), tensor("s0", FLOAT, [])],
                     [tensor("s", FLOAT, [])],
                     {"M": np.array(2**63 - 1, np.int64), "cond": np.array(True)})
    feeds = {"limit": np.array(4.5, np.float32), "s0": np.array(0.25, np.float32)}
    outputs, fn = run(model, feeds)
    assert_outputs(outputs, runtime(model, feeds))
    assert "while[" in jaxpr_text(fn, feeds)


@pytest.mark.parametrize("trip_count,expected_n,expected_ns", [
    (2, [12], [[6], [12]]),
    (0, [3], np.zeros((0, 1), np.int64)),
])
def test_loop_over_host_constants_folds_to_host_values_usable_as_shapes(
        trip_count, expected_n, expected_ns):
    body = helper.make_graph(
        [const("two", np.array([2], np.int64)),
         helper.make_node("Mul", ["n_in", "two"], ["n_out"]),
         helper.make_node("Identity", ["n_out"], ["scan_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [tensor("i", INT64, []), tensor("cond_in", BOOL, []), tensor("n_in", INT64, [1])],
        [tensor("cond_out", BOOL, []), tensor("n_out", INT64, [1]), tensor("scan_out", INT64, [1])])
    model = model_of(
        [helper.make_node("Loop", ["M", "", "n0"], ["n", "ns"], body=body),
         helper.make_node("Reshape", ["x", "n"], ["flat"])],
        [tensor("x", FLOAT, [3, None])],
        [tensor("n", INT64, [1]), tensor("ns", INT64, None), tensor("flat", FLOAT, None)],
        {"M": np.array(trip_count, np.int64), "n0": np.array([3], np.int64)})
    x = np.ones((3, expected_n[0] // 3), np.float32)
    (n, ns, flat), fn = run(model, {"x": x})
    assert_outputs([n, ns, flat], [np.array(expected_n), np.array(expected_ns, np.int64),
                                   x.reshape(-1)])
    assert not ran_eagerly(fn)


def test_loop_with_traced_condition_and_scan_outputs_runs_eagerly():
    model = counting_loop(with_trip_count=False, with_scan_output=True)
    feeds = {"limit": np.array(3.0, np.float32), "s0": np.array(0.5, np.float32)}
    outputs, fn = run(model, feeds)
    assert_outputs(outputs, runtime(model, feeds))  # the reference vstacks scalars to [n, 1]
    assert ran_eagerly(fn)


def growing_sequence_loop() -> onnx.ModelProto:
    """Appends x * k to a sequence for k = 1, 2, 3 (k carried too), then concatenates it."""
    body = helper.make_graph(
        [const("one", np.array(1.0, np.float32)),
         helper.make_node("Add", ["k_in", "one"], ["k_out"]),
         helper.make_node("Mul", ["x", "k_out"], ["item"]),
         helper.make_node("SequenceInsert", ["seq_in", "item"], ["seq_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [tensor("i", INT64, []), tensor("cond_in", BOOL, []), tensor("k_in", FLOAT, []),
                 sequence("seq_in")],
        [tensor("cond_out", BOOL, []), tensor("k_out", FLOAT, []), sequence("seq_out")])
    return model_of(
        [helper.make_node("SequenceEmpty", [], ["empty"], dtype=FLOAT),
         helper.make_node("Loop", ["M", "", "k0", "empty"], ["k", "seq"], body=body),
         helper.make_node("ConcatFromSequence", ["seq"], ["y"], axis=0)],
        [tensor("x", FLOAT, [2])], [tensor("k", FLOAT, []), tensor("y", FLOAT, [6])],
        {"M": np.array(3, np.int64), "k0": np.array(0.0, np.float32)})


def test_loop_growing_a_sequence_is_unrolled_when_its_trip_count_is_static():
    model = growing_sequence_loop()
    feeds = {"x": np.array([1.0, -2.0], np.float32)}
    outputs, fn = run(model, feeds)
    assert_outputs(outputs, runtime(model, feeds))
    assert not ran_eagerly(fn)


def test_loop_invariant_carried_shape_stays_a_host_constant_under_scan():
    body = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape_in"], ["square"]),
         helper.make_node("MatMul", ["square", "acc_in"], ["acc_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [tensor("i", INT64, []), tensor("cond_in", BOOL, []),
                 tensor("shape_in", INT64, [2]), tensor("acc_in", FLOAT, [2, 2])],
        [tensor("cond_out", BOOL, []), tensor("shape_in", INT64, [2]),
         tensor("acc_out", FLOAT, [2, 2])])
    model = model_of(
        [helper.make_node("Loop", ["M", "", "shape", "acc0"], ["shape_out", "acc"], body=body)],
        [tensor("x", FLOAT, [4]), tensor("acc0", FLOAT, [2, 2])],
        [tensor("shape_out", INT64, [2]), tensor("acc", FLOAT, [2, 2])],
        {"M": np.array(3, np.int64), "shape": np.array([2, 2], np.int64)})
    feeds = {"x": np.array([1.0, 2.0, 0.5, -1.0], np.float32), "acc0": np.eye(2, dtype=np.float32)}
    outputs, fn = run(model, feeds)
    assert_outputs(outputs, runtime(model, feeds))
    assert not ran_eagerly(fn)
    assert "scan[" in jaxpr_text(fn, feeds)


def test_random_ops_in_a_scanned_loop_body_draw_fresh_values_each_iteration():
    body = helper.make_graph(
        [helper.make_node("RandomUniformLike", ["x"], ["draw"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [tensor("i", INT64, []), tensor("cond_in", BOOL, [])],
        [tensor("cond_out", BOOL, []), tensor("draw", FLOAT, [3])])
    model = model_of([helper.make_node("Loop", ["M", ""], ["draws"], body=body)],
                     [tensor("x", FLOAT, [3])], [tensor("draws", FLOAT, [4, 3])],
                     {"M": np.array(4, np.int64)})
    fn = translate(model)
    draws = np.asarray(fn(fn.params, {"x": np.zeros(3, np.float32)}, jax.random.key(0))["draws"])
    assert draws.shape == (4, 3) and not ran_eagerly(fn)
    assert ((draws >= 0) & (draws < 1)).all()
    assert len({tuple(row) for row in draws}) == 4


# ---------------------------------------------------------------------------
# If


def branch_model(same_shapes: bool) -> onnx.ModelProto:
    """then: x * w (w a parameter); else: x - 1, or x[:1] when the shapes must differ."""
    then_branch = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["then_out"])], "then", [],
        [tensor("then_out", FLOAT, None)])
    if same_shapes:
        else_nodes = [const("one", np.array(1.0, np.float32)),
                      helper.make_node("Sub", ["x", "one"], ["else_out"])]
    else:
        else_nodes = [const("starts", np.array([0], np.int64)),
                      const("ends", np.array([1], np.int64)),
                      helper.make_node("Slice", ["x", "starts", "ends"], ["else_out"])]
    else_branch = helper.make_graph(else_nodes, "else", [], [tensor("else_out", FLOAT, None)])
    return model_of(
        [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
         helper.make_node("Greater", ["total", "zero"], ["positive"]),
         helper.make_node("If", ["positive"], ["y"], then_branch=then_branch,
                          else_branch=else_branch)],
        [tensor("x", FLOAT, [3])], [tensor("y", FLOAT, None)],
        {"w": np.array([2.0, 3.0, 4.0], np.float32), "zero": np.array(0.0, np.float32)})


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_if_with_traced_condition_and_matching_branches_compiles_to_cond(sign: float):
    model = branch_model(same_shapes=True)
    feeds = {"x": sign * np.array([1.0, 2.0, 3.0], np.float32)}
    outputs, fn = run(model, feeds)
    assert_outputs(outputs, reference(model, feeds))
    assert not ran_eagerly(fn)
    assert "cond[" in jaxpr_text(fn, feeds)


def test_if_gradient_flows_through_the_taken_branch_only():
    fn = translate(branch_model(same_shapes=True))
    with jax.enable_x64(True):
        def loss(w: np.ndarray, x: np.ndarray) -> jax.Array:
            return fn.apply({**fn.params, "w": w}, {"x": x})["y"].sum()
        w = np.array([2.0, 3.0, 4.0])
        taken = jax.grad(loss)(w, np.array([1.0, 2.0, 3.0]))
        skipped = jax.grad(loss)(w, np.array([-1.0, -2.0, -3.0]))
    np.testing.assert_allclose(taken, [1.0, 2.0, 3.0])
    np.testing.assert_allclose(skipped, [0.0, 0.0, 0.0])


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_if_with_traced_condition_and_differing_branches_runs_eagerly(sign: float):
    model = branch_model(same_shapes=False)
    feeds = {"x": sign * np.array([1.0, 2.0, 3.0], np.float32)}
    outputs, fn = run(model, feeds)
    assert_outputs(outputs, reference(model, feeds))
    assert ran_eagerly(fn)


def test_if_on_optional_has_element_of_a_traced_tensor_is_decided_on_the_host():
    then_branch = helper.make_graph([helper.make_node("Identity", ["x"], ["a"])], "then", [],
                                    [tensor("a", FLOAT, None)])
    else_branch = helper.make_graph([const("b", np.zeros(7, np.float32))], "else", [],
                                    [tensor("b", FLOAT, None)])
    model = model_of(
        [helper.make_node("OptionalHasElement", ["x"], ["present"]),
         helper.make_node("If", ["present"], ["y"], then_branch=then_branch,
                          else_branch=else_branch)],
        [tensor("x", FLOAT, [3])], [tensor("y", FLOAT, None)])
    feeds = {"x": np.array([1.0, 2.0, 3.0], np.float32)}
    outputs, fn = run(model, feeds)
    np.testing.assert_array_equal(outputs[0], feeds["x"])
    assert not ran_eagerly(fn)


# ---------------------------------------------------------------------------
# Scan


def accumulate_body(num_states: int = 1) -> onnx.GraphProto:
    """state + element -> state, and the new state as the scan output (elements of shape [2])."""
    return helper.make_graph(
        [helper.make_node("Add", ["s_in", "e"], ["s_out"]),
         helper.make_node("Identity", ["s_out"], ["scan_out"])],
        "body", [tensor("s_in", FLOAT, [2]), tensor("e", FLOAT, [2])][:num_states + 1],
        [tensor("s_out", FLOAT, [2]), tensor("scan_out", FLOAT, [2])])


@pytest.mark.parametrize("input_axis,input_direction,output_axis,output_direction",
                         [(1, 1, 1, 1), (-1, 0, -2, 1), (0, 1, 0, 0), (1, 0, 0, 1)])
def test_scan9_axes_and_directions_match_onnxruntime(input_axis, input_direction,
                                                      output_axis, output_direction):
    node = helper.make_node("Scan", ["s0", "x"], ["s", "ys"], body=accumulate_body(),
                            num_scan_inputs=1, scan_input_axes=[input_axis],
                            scan_input_directions=[input_direction],
                            scan_output_axes=[output_axis],
                            scan_output_directions=[output_direction])
    x_shape = [2, 3] if input_axis in (1, -1) else [3, 2]
    model = model_of([node], [tensor("s0", FLOAT, [2]), tensor("x", FLOAT, x_shape)],
                     [tensor("s", FLOAT, None), tensor("ys", FLOAT, None)], opset=16)
    feeds = {"s0": np.array([0.5, -1.0], np.float32),
             "x": np.arange(6, dtype=np.float32).reshape(x_shape)}
    outputs, fn = run(model, feeds)
    assert_outputs(outputs, runtime(model, feeds))
    assert not ran_eagerly(fn)
    assert "scan[" in jaxpr_text(fn, feeds)


def test_scan8_batches_with_sequence_lengths_and_reverse_direction_match_onnxruntime():
    node = helper.make_node("Scan", ["lens", "s0", "x"], ["s", "ys"], body=accumulate_body(),
                            num_scan_inputs=1, directions=[1])
    model = model_of([node], [tensor("lens", INT64, [2]),
                              tensor("s0", FLOAT, [2, 2]), tensor("x", FLOAT, [2, 3, 2])],
                     [tensor("s", FLOAT, None), tensor("ys", FLOAT, None)], opset=8)
    lens = np.array([3, 2], np.int64)
    feeds = {"lens": lens, "s0": np.array([[0, 0], [10, 20]], np.float32),
             "x": np.arange(12, dtype=np.float32).reshape(2, 3, 2)}
    (s, ys), fn = run(model, feeds)
    expected_s, expected_ys = runtime(model, feeds)
    np.testing.assert_allclose(s, expected_s)
    for batch, length in enumerate(lens):  # past its length an entry's scan output is undefined
        np.testing.assert_allclose(np.asarray(ys)[batch, :length], expected_ys[batch, :length])
    assert not ran_eagerly(fn)


def test_scan_gradient_matches_finite_differences():
    body = helper.make_graph(
        [helper.make_node("Mul", ["s_in", "e"], ["scaled"]),
         helper.make_node("Add", ["scaled", "w"], ["s_out"]),
         helper.make_node("Identity", ["s_out"], ["scan_out"])],
        "body", [tensor("s_in", FLOAT, [2]), tensor("e", FLOAT, [2])],
        [tensor("s_out", FLOAT, [2]), tensor("scan_out", FLOAT, [2])])
    model = model_of([helper.make_node("Scan", ["s0", "x"], ["s", "ys"], body=body,
                                       num_scan_inputs=1)],
                     [tensor("s0", FLOAT, [2]), tensor("x", FLOAT, [3, 2])],
                     [tensor("s", FLOAT, [2]), tensor("ys", FLOAT, [3, 2])],
                     {"w": np.array([0.5, -0.25], np.float32)}, opset=16)
    fn = translate(model)
    feeds = {"s0": np.array([1.0, 2.0]), "x": np.array([[0.5, 1.5], [-1.0, 2.0], [0.25, 0.75]])}
    with jax.enable_x64(True):
        def loss(w: np.ndarray) -> jax.Array:
            outputs = fn.apply({**fn.params, "w": w}, feeds)
            return (outputs["s"] ** 2).sum() + outputs["ys"].sum()
        w = np.array([0.5, -0.25])
        gradient = np.asarray(jax.grad(loss)(w))
        step = 1e-6
        numeric = [(loss(w + step * e) - loss(w - step * e)) / (2 * step) for e in np.eye(2)]
    np.testing.assert_allclose(gradient, numeric, rtol=1e-5)


# ---------------------------------------------------------------------------
# Sequences and optionals


def test_sequence_at_with_a_traced_position_indexes_without_going_eager():
    model = model_of(
        [helper.make_node("SequenceConstruct", ["a", "b", "c"], ["seq"]),
         helper.make_node("SequenceAt", ["seq", "pos"], ["y"])],
        [tensor("a", FLOAT, [2]), tensor("b", FLOAT, [2]), tensor("c", FLOAT, [2]),
         tensor("pos", INT64, [])], [tensor("y", FLOAT, [2])])
    feeds = {"a": np.array([1, 2], np.float32), "b": np.array([3, 4], np.float32),
             "c": np.array([5, 6], np.float32)}
    fn = translate(model)
    for position in (0, 2, -1, -3):
        feeds["pos"] = np.array(position, np.int64)
        outputs = [fn(fn.params, feeds)["y"]]
        assert_outputs(outputs, reference(model, feeds))
    assert not ran_eagerly(fn)


@pytest.mark.parametrize("split,attributes,new_axis", [
    (np.array(2, np.int64), {"axis": 1}, 0),            # scalar split, a shorter last chunk
    (np.array(2, np.int64), {"axis": 0}, 1),            # scalar split dividing the axis
    (np.array([1, 4], np.int64), {"axis": -1, "keepdims": 0}, 0),  # sizes; keepdims ignored
    (None, {"axis": 0, "keepdims": 0}, 1),              # default: size-1 chunks, axis dropped
    (None, {"axis": 1}, 0),
])
def test_split_to_sequence_then_concat_match_reference(split, attributes, new_axis):
    inputs = ["x"] if split is None else ["x", "split"]
    model = model_of(
        [helper.make_node("SplitToSequence", inputs, ["seq"], **attributes),
         helper.make_node("SequenceLength", ["seq"], ["n"]),
         helper.make_node("ConcatFromSequence", ["seq"], ["joined"], axis=-1, new_axis=new_axis)],
        [tensor("x", FLOAT, [4, 5])],
        [sequence("seq"), tensor("n", INT64, []), tensor("joined", FLOAT, None)],
        {} if split is None else {"split": split})
    feeds = {"x": np.arange(20, dtype=np.float32).reshape(4, 5)}
    outputs, fn = run(model, feeds)
    assert_outputs(outputs, reference(model, feeds))
    assert not ran_eagerly(fn)


@pytest.mark.parametrize("insert_at,erase_at", [(0, -1), (-1, 0), (3, None), (None, -4)])
def test_sequence_insert_and_erase_positions_match_reference(insert_at, erase_at):
    nodes = [helper.make_node("SequenceConstruct", ["a", "b", "c"], ["seq"])]
    initializers = {}
    insert_inputs = ["seq", "d"]
    if insert_at is not None:
        initializers["insert_at"] = np.array(insert_at, np.int64)
        insert_inputs.append("insert_at")
    erase_inputs = ["inserted"]
    if erase_at is not None:
        initializers["erase_at"] = np.array(erase_at, np.int64)
        erase_inputs.append("erase_at")
    nodes += [helper.make_node("SequenceInsert", insert_inputs, ["inserted"]),
              helper.make_node("SequenceErase", erase_inputs, ["erased"])]
    model = model_of(nodes, [tensor(n, FLOAT, [1]) for n in "abcd"],
                     [sequence("inserted"), sequence("erased")], initializers)
    feeds = {n: np.array([i], np.float32) for i, n in enumerate("abcd")}
    outputs, _ = run(model, feeds)
    assert_outputs(outputs, runtime(model, feeds))  # the reference inserts at position n first


def test_sequence_at_out_of_range_is_a_model_error():
    model = model_of(
        [helper.make_node("SequenceConstruct", ["a"], ["seq"]),
         helper.make_node("SequenceAt", ["seq", "pos"], ["y"])],
        [tensor("a", FLOAT, [1])], [tensor("y", FLOAT, [1])], {"pos": np.array(1, np.int64)})
    with pytest.raises(ModelLoadError, match="out of range"):
        run(model, {"a": np.zeros(1, np.float32)})


def test_optional_get_element_of_an_empty_optional_is_an_error():
    model = model_of(
        [helper.make_node("Optional", [], ["empty"],
                          type=helper.make_tensor_type_proto(FLOAT, [])),
         helper.make_node("OptionalGetElement", ["empty"], ["y"])],
        [], [tensor("y", FLOAT, [])], opset=18)
    with pytest.raises(ModelLoadError, match="empty"):
        run(model, {})


def test_sequence_map_over_traced_sequences_with_a_tensor_input_matches_reference():
    body = helper.make_graph(
        [helper.make_node("Mul", ["item", "scale"], ["scaled"]),
         helper.make_node("Shape", ["item"], ["shape"])],
        "body", [tensor("item", FLOAT, None), tensor("scale", FLOAT, [])],
        [tensor("scaled", FLOAT, None), tensor("shape", INT64, [1])])
    model = model_of(
        [helper.make_node("SplitToSequence", ["x", "split"], ["seq"]),
         helper.make_node("SequenceMap", ["seq", "scale"], ["scaled", "shapes"], body=body)],
        [tensor("x", FLOAT, [5]), tensor("scale", FLOAT, [])],
        [sequence("scaled"), sequence("shapes", INT64)], {"split": np.array([2, 3], np.int64)})
    feeds = {"x": np.arange(5, dtype=np.float32), "scale": np.array(-2.0, np.float32)}
    outputs, fn = run(model, feeds)
    assert_outputs(outputs, reference(model, feeds))
    assert not ran_eagerly(fn)
