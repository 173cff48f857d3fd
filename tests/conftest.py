"""Suite-wide settings: tests never write to the user's compilation cache."""

import os

os.environ.setdefault("ONNXTRAIN_COMPILATION_CACHE", "off")
