import sys

from onnxtrain.cli import main

sys.exit(main())
