"""fit(): epochs, Keras-like history, eval data, callbacks, and batches it cannot repeat."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from onnxtrain import InputError
from onnxtrain.fitting import fit
from support.host_buffers import host_array


class Counter:
    """A stand-in for run_steps whose 'loss' is the number of calls so far: exact expected histories."""

    def __init__(self):
        self.calls = 0

    def __call__(self, chunk):
        outputs = []
        for _ in chunk:
            self.calls += 1
            outputs.append({"loss": np.float32(self.calls), "vector": np.zeros(3)})
        return outputs


def test_history_has_epoch_means_eval_means_and_steps_under_their_own_key():
    step = Counter()
    history = fit(step, [{}] * 4, epochs=2, progress=False,
                  evaluate=lambda feeds: ({"loss": feeds["v"]}, feeds), eval_data=[{"v": 1.0}, {"v": 3.0}])
    assert history["step_loss"] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert history["loss"] == [2.5, 6.5]
    assert history["val_loss"] == [2.0, 2.0]
    assert "vector" not in history and "step_vector" not in history


def test_a_callback_can_stop_training_and_sees_the_epoch_logs():
    seen = []
    history = fit(Counter(), [{}] * 3, epochs=5, progress=False,
                  callbacks=[lambda epoch, logs: seen.append((epoch, logs)) or epoch == 1])
    assert [epoch for epoch, _ in seen] == [0, 1]
    assert seen[1][1] == {"loss": 5.0}
    assert len(history["step_loss"]) == 6


def test_one_shot_iterators_serve_one_epoch_and_callables_many():
    with pytest.raises(InputError, match="iterate again"):
        fit(Counter(), iter([{}] * 3), epochs=2, progress=False)
    history = fit(Counter(), lambda: iter([{}] * 3), epochs=2, progress=False)
    assert len(history["step_loss"]) == 6


def _mlp_training_model():
    from onnx import TensorProto, helper, numpy_helper

    import onnxtrain

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W1", "B1"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
         helper.make_node("Gemm", ["t", "W2", "B2"], ["logits"])], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 5])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(rng.normal(size=shape).astype(np.float32), name)
         for name, shape in (("W1", (5, 8)), ("B1", (8,)), ("W2", (8, 3)), ("B2", (3,)))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return onnxtrain.make_training_model(model, loss="cross_entropy", optimizer=onnxtrain.optim.Adam(lr=0.01))


@pytest.mark.slow
def test_steps_per_call_runs_the_same_steps_in_fewer_compiled_calls():
    import onnxtrain

    rng = np.random.default_rng(1)
    batches = [{"x": rng.normal(size=(16, 5)).astype(np.float32),
                "labels": rng.integers(0, 3, 16).astype(np.int64)} for _ in range(8)]
    batches.append({"x": batches[0]["x"][:5], "labels": batches[0]["labels"][:5]})   # a partial batch
    model = _mlp_training_model()
    one, scanned = onnxtrain.Trainer(model), onnxtrain.Trainer(model)
    history_one = one.fit(batches, epochs=2, progress=False)
    history_scanned = scanned.fit(batches, epochs=2, progress=False, steps_per_call=4)
    np.testing.assert_allclose(history_scanned["step_loss"], history_one["step_loss"], rtol=1e-5)
    assert len(history_scanned["step_loss"]) == 18
    for name in one.state_names:
        np.testing.assert_allclose(scanned.state[name], one.state[name], rtol=1e-4, atol=1e-6)
    assert scanned._runners[0].plan(scanned._store).multi.compilations() == 1   # every run of 4 shares one program


def _conv_training_model():
    from onnx import TensorProto, helper, numpy_helper

    import onnxtrain

    rng = np.random.default_rng(2)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "C"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Tanh", ["c"], ["t"]),
         helper.make_node("Flatten", ["t"], ["f"]), helper.make_node("MatMul", ["f", "W"], ["logits"])], "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(rng.normal(size=(2, 3, 3, 3)).astype(np.float32), "C"),
         numpy_helper.from_array(rng.normal(size=(32, 3)).astype(np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return onnxtrain.make_training_model(model, loss="cross_entropy", optimizer=onnxtrain.optim.Adam(lr=0.01))


@pytest.mark.slow
@pytest.mark.parametrize("convolves", [False, True])
def test_steps_per_call_loop_on_the_device_unless_the_graph_convolves(convolves):
    """A dense model's K steps are one while loop; a model with a convolution, which XLA:CPU
    runs slowly inside loops, gets K single-step calls instead. Same steps either way."""
    import onnxtrain

    rng = np.random.default_rng(3)
    shape = (6, 3, 4, 4) if convolves else (6, 5)
    batches = [{"x": rng.normal(size=shape).astype(np.float32), "labels": rng.integers(0, 3, 6).astype(np.int64)}
               for _ in range(4)]
    model = _conv_training_model() if convolves else _mlp_training_model()
    one, chunked = onnxtrain.Trainer(model), onnxtrain.Trainer(model)
    losses = [float(one.step(batch)["loss"]) for batch in batches]
    np.testing.assert_allclose(chunked.fit(batches, progress=False, steps_per_call=4)["step_loss"], losses, rtol=1e-5)
    for name in one.state_names:
        np.testing.assert_allclose(chunked.state[name], one.state[name], rtol=1e-4, atol=1e-6)
    runner, store = chunked._runners[0], chunked._store
    plan = runner.plan(store)
    assert type(plan.multi).__name__ == ("Chained" if convolves else "Scanned")
    assert (plan.multi.compilations(), plan.linked.compilations()) == ((0, 1) if convolves else (1, 0))
    if not convolves:
        stacked = {name: np.stack([batch[name] for batch in batches]) for name in batches[0]}
        with jax.enable_x64(True):
            lowered = plan.multi._run.lower(store.values, plan.multi.key(store), runner.step.constants, stacked,
                                            runner.ledger.accepting).as_text()
        assert "stablehlo.while" in lowered


def _wide_linear_model():
    """One 1024x1024 MatMul: a step long enough (a few ms) for the host to run ahead of it."""
    from onnx import TensorProto, helper, numpy_helper

    import onnxtrain

    weights = np.random.default_rng(0).normal(size=(1024, 1024)).astype(np.float32) / 32
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1024])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1024])],
        [numpy_helper.from_array(weights, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return onnxtrain.make_training_model(model, loss="mse", optimizer=onnxtrain.optim.Momentum(lr=0.01))


@pytest.mark.slow
@pytest.mark.parametrize("nan_policy, call", [("raise", "fit"), ("ignore", "step"), ("raise", "step"),
                                              ("skip", "step")])
def test_steps_in_flight_do_not_read_batch_buffers_the_caller_refills(nan_policy, call):
    """fit (one step per call, its checks read a step late) and step under "ignore" return
    before the device has run the step, and a checked step() reads the caller's arrays
    without copying them; a data loader then refills its buffer with the next batch. The
    buffer is 64-byte aligned, which JAX on CPU would read in place."""
    import onnxtrain

    rng = np.random.default_rng(1)
    batches = [{"x": rng.normal(size=(512, 1024)).astype(np.float32),
                "labels": rng.normal(size=(512, 1024)).astype(np.float32)} for _ in range(6)]
    model = _wide_linear_model()
    refilled, reference = (onnxtrain.Trainer(model, nan_policy=nan_policy) for _ in range(2))
    buffers = {name: host_array(value) for name, value in batches[0].items()}

    def loader():
        for feeds in batches:
            for name, value in feeds.items():
                buffers[name][...] = value
            yield buffers

    if call == "step":
        for feeds in loader():
            refilled.step(feeds)
    else:
        refilled.fit(loader, progress=False)
    for feeds in batches:
        reference.step(feeds)
    np.testing.assert_array_equal(np.asarray(refilled.state["W"]), np.asarray(reference.state["W"]))


@pytest.mark.slow
def test_fit_with_several_steps_per_call_keeps_every_batch_of_a_loader_that_refills_one_buffer():
    """A chunk of fit collects batches before it runs them; a loader refilling one buffer
    must not turn the chunk into copies of its last batch."""
    import onnxtrain

    rng = np.random.default_rng(2)
    batches = [{"x": rng.normal(size=(8, 1024)).astype(np.float32),
                "labels": rng.normal(size=(8, 1024)).astype(np.float32)} for _ in range(8)]
    model = _wide_linear_model()
    refilled, reference = onnxtrain.Trainer(model), onnxtrain.Trainer(model)
    buffers = {name: value.copy() for name, value in batches[0].items()}

    def loader():
        for feeds in batches:
            for name, value in feeds.items():
                buffers[name][...] = value
            yield buffers

    history = refilled.fit(loader, progress=False, steps_per_call=4)
    expected = [float(reference.step(feeds)["loss"]) for feeds in batches]
    np.testing.assert_allclose(history["step_loss"], expected, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(refilled.state["W"]), np.asarray(reference.state["W"]), rtol=1e-5, atol=1e-7)
