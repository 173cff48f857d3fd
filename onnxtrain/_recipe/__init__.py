"""Training recipes: make_training_model, the objective both trainers optimize, losses, training_info validation (internal)."""
