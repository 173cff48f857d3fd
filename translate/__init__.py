"""onnxtrain.translate: ONNX graphs to JAX functions. Knows nothing of training."""
