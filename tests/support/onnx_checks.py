"""onnx's own checker as an independent oracle for models carrying training_info."""

from __future__ import annotations

import onnx


def check_training_model(model: onnx.ModelProto, full_check_graphs: bool = False) -> None:
    """Run onnx.checker on `model`, on its main graph followed by training_info[0]'s algorithm
    (one graph, as the IR spec combines them) and on its initialization graph.
    full_check_graphs: also run shape inference on the two training graphs."""
    model = onnx.load_from_string(model.SerializeToString())
    onnx.checker.check_model(model, full_check=True)
    info = model.training_info[0]
    combined = onnx.GraphProto()
    combined.CopyFrom(model.graph)
    for field in ("input", "initializer", "output", "node", "value_info", "sparse_initializer"):
        getattr(combined, field).extend(getattr(info.algorithm, field))
    for graph in (combined, info.initialization):
        onnx.checker.check_model(onnx.helper.make_model(graph, opset_imports=model.opset_import,
                                                        ir_version=model.ir_version),
                                 full_check=full_check_graphs)
