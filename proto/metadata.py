"""The metadata_props keys onnxtrain writes into models (one place, so every layer reads them alike)."""

# The PRNG key an export records, so Trainer(path) resumes the random stream.
KEY_METADATA = "onnxtrain.prng_key"
# make_training_model's description of each recipe's loss and prediction (see _recipe/evaluation.py).
EVALUATION_KEY = "onnxtrain.evaluation"
