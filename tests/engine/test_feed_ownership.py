"""A step never keeps the caller's feed arrays: state bound to a feed, and outputs that echo
one, hold the values of the step's own call after the caller overwrites its buffer.

A checked step on one device reads the caller's arrays without copying them (it returns
only once its program has run); these tests fail if any value it returns or commits still
points into the caller's memory. The buffer is 64-byte aligned, which JAX on CPU would
otherwise use in place."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from support.host_buffers import host_array
from support.training_models import algorithm_graph, linreg_graph, make_training_model, tensor, value_info

SHAPE = (3, 4)


def _feed_bound_model(op_by_op: bool):
    """V <- F (the algorithm input itself), U <- Identity(F), and the unbound output echo =
    Identity(F) beside the loss. op_by_op: echo is F reshaped to a shape fed at run time,
    which the step cannot be compiled for."""
    main = linreg_graph()
    main.initializer.extend([tensor("V", np.zeros(SHAPE)), tensor("U", np.zeros(SHAPE))])
    inputs = [value_info("F", shape=list(SHAPE))]
    nodes = [helper.make_node("Identity", ["F"], ["F_copy"]),
             helper.make_node("ReduceSum", ["F"], ["loss"], keepdims=0)]
    if op_by_op:
        inputs.append(value_info("S", TensorProto.INT64, [2]))
        nodes.append(helper.make_node("Reshape", ["F", "S"], ["echo"]))
    else:
        nodes.append(helper.make_node("Identity", ["F"], ["echo"]))
    algorithm = algorithm_graph(nodes, ["loss", "echo", "F", "F_copy"], inputs)
    info = helper.make_training_info(algorithm, [("V", "F"), ("U", "F_copy")], None, None)
    return make_training_model(main, info)


@pytest.mark.parametrize("op_by_op", [False, True], ids=["compiled", "op_by_op"])
@pytest.mark.parametrize("nan_policy", ["raise", "skip", "ignore"])
def test_state_and_outputs_do_not_follow_a_refilled_feed_buffer(nan_policy, op_by_op):
    import onnxtrain

    trainer = onnxtrain.Trainer(_feed_bound_model(op_by_op), nan_policy=nan_policy)
    first = np.arange(12, dtype=np.float32).reshape(SHAPE)
    buffer = host_array(first)
    others = {"X": np.zeros((2, 1), np.float32)} | ({"S": np.array(SHAPE, np.int64)} if op_by_op else {})
    outputs = trainer.step({"F": buffer, **others})
    echo = outputs["echo"]
    buffer[...] = -1.0
    trainer.step({"F": host_array(np.full(SHAPE, 7, np.float32)), **others})  # lets a step in flight finish
    np.testing.assert_array_equal(np.asarray(echo), first)
    buffer[...] = -2.0
    np.testing.assert_array_equal(np.asarray(trainer.state["V"]), np.full(SHAPE, 7, np.float32))
    np.testing.assert_array_equal(np.asarray(trainer.state["U"]), np.full(SHAPE, 7, np.float32))
    assert float(outputs["loss"]) == first.sum()
