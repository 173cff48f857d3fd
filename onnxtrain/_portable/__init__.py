"""Training recipes written in standard ONNX operators, for runtimes without ai.onnx.preview.training."""
