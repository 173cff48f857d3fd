"""onnxtrain.state: the mutable variables of a training model (weights, optimizer slots,
counters, PRNG key), their buffers and checkpoints. Knows nothing of ONNX operators."""
