"""onnxtrain.state: the mutable variables of a training model (weights,
optimizer slots, counters, PRNG key). Knows nothing of ONNX operators."""
