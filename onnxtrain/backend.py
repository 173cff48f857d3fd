"""onnxtrain as an `onnx.backend.base.Backend`, so onnx's BackendTest can drive it.

onnx is a test-time dependency only: this module imports it, nothing else in
the runtime does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from onnx.backend.base import Backend, BackendRep

from onnxtrain._io.model import load_model
from onnxtrain.translate.model import TranslatedModel


class OnnxTrainRep(BackendRep):
    """A prepared model: translated once, compiled per input signature."""

    def __init__(self, model: Any, seed: int = 0, jit: bool = True):
        self.translated = TranslatedModel(load_model(model), jit=jit)
        self.key = jax.random.key(seed)

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        names = self.translated.input_names
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            if not isinstance(inputs, (list, tuple)):
                inputs = [inputs]
            feeds = dict(zip(names, inputs))
        self.key, key = jax.random.split(self.key)
        outputs = self.translated(self.translated.params, feeds, key)
        return tuple(_to_numpy(outputs[name]) for name in self.translated.output_names)


def _to_numpy(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [_to_numpy(item) for item in value]
    if isinstance(value, dict):
        return {key: _to_numpy(item) for key, item in value.items()}
    return np.asarray(value)


class OnnxTrainBackend(Backend):
    @classmethod
    def is_compatible(cls, model: Any, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device)

    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> OnnxTrainRep:
        super().prepare(model, device, **kwargs)
        return OnnxTrainRep(model, jit=kwargs.get("jit", True))

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[Any, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: Any, inputs: Sequence[Any], device: str = "CPU",
                 outputs_info: Any = None, **kwargs: Any) -> tuple[Any, ...]:
        import onnx
        from onnx import helper

        values = [np.asarray(v) for v in inputs]
        graph = helper.make_graph(
            [node], "run_node",
            [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
             for name, v in zip(node.input, values) if name],
            [helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, None)
             for name in node.output if name],
        )
        opset = kwargs.get("opset_version", onnx.defs.onnx_opset_version())
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid(node.domain, opset)])
        feeds = {name: v for name, v in zip(node.input, values) if name}
        return cls.prepare(model, device).run(feeds)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper().startswith("CPU")


prepare = OnnxTrainBackend.prepare
run_model = OnnxTrainBackend.run_model
run_node = OnnxTrainBackend.run_node
supports_device = OnnxTrainBackend.supports_device
