"""Every model in onnx's backend test material survives our classes byte-for-byte.

Oracle: the `onnx` package's own generated classes. Each model is parsed with
onnxtrain.proto, re-serialized, and parsed again by onnx; the result must
equal what onnx parses from the original bytes. The data sets' tensors get
the same treatment, and their decoded values are compared with
onnx.numpy_helper.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

from onnxtrain import load_model
from onnxtrain.proto import ModelProto, TensorProto
from onnxtrain.translate.tensors import tensor_to_numpy
from support.backend_cases import all_cases

CASES = all_cases()


def _tensor_typed_files(case) -> list:
    """Data-set files that hold a TensorProto (not a sequence, map or optional)."""
    graph = onnx.ModelProto.FromString(case.model_bytes()).graph
    initializers = {tensor.name for tensor in graph.initializer}
    inputs = [value for value in graph.input if value.name not in initializers]
    files = []
    for path in case.tensor_files():
        kind, _, index = path.stem.rpartition("_")
        values = inputs if kind.endswith("input") else graph.output
        if int(index) < len(values) and values[int(index)].type.HasField("tensor_type"):
            files.append(path)
    return files


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_backend_model_round_trips_through_our_schema(case):
    original = case.model_bytes()
    rewritten = ModelProto.FromString(original).SerializeToString()
    assert onnx.ModelProto.FromString(rewritten) == onnx.ModelProto.FromString(original)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_backend_model_loads_and_its_tensors_decode_like_onnx(case):
    model = load_model(case.model_bytes())
    reference = onnx.ModelProto.FromString(case.model_bytes())
    for ours, theirs in zip(model.graph.initializer, reference.graph.initializer, strict=True):
        np.testing.assert_array_equal(tensor_to_numpy(ours), onnx.numpy_helper.to_array(theirs))
    for path in _tensor_typed_files(case):
        data = path.read_bytes()
        ours = TensorProto.FromString(data)
        theirs = onnx.TensorProto.FromString(data)
        assert onnx.TensorProto.FromString(ours.SerializeToString()) == theirs
        expected = onnx.numpy_helper.to_array(theirs)
        actual = tensor_to_numpy(ours)
        assert actual.dtype == expected.dtype or expected.dtype.kind == "U"
        np.testing.assert_array_equal(actual, expected)


def test_the_sweep_covers_every_suite():
    suites = {case.suite for case in CASES}
    assert suites == {"node", "model", "simple", "pytorch-converted", "pytorch-operator", "light"}
    assert sum(case.suite == "light" for case in CASES) == 9
