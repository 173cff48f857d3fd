"""Regenerate onnx_pb2.py / onnx_pb2.pyi from onnx.proto with a pinned protoc.

The protoc version decides the oldest protobuf runtime the generated module
imports with, so it is pinned here and the pyproject's lower bound on protobuf
follows it (grpcio-tools 1.74.0 bundles protoc 31.1, whose code needs
protobuf >= 6.31.1). The pinned compiler lives in its own virtual environment
so it never fights the development environment's protobuf version.

Usage: python proto/regenerate.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

GRPCIO_TOOLS_VERSION = "1.74.0"
PROTO_DIR = Path(__file__).resolve().parent
# The name the schema registers under in protobuf's descriptor pool; unique so
# it never collides with the `onnx` package's own files.
VIRTUAL_DIR = "onnxtrain/proto"
TOOL_ENV = Path.home() / ".cache" / "onnxtrain" / f"grpcio-tools-{GRPCIO_TOOLS_VERSION}"


def _tool_python() -> Path:
    python = TOOL_ENV / "bin" / "python"
    if not python.exists():
        venv.create(TOOL_ENV, with_pip=True, clear=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", f"grpcio-tools=={GRPCIO_TOOLS_VERSION}"],
            check=True,
        )
    return python


def main() -> int:
    python = _tool_python()
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [
                str(python), "-m", "grpc_tools.protoc",
                f"-I{VIRTUAL_DIR}={PROTO_DIR}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"{VIRTUAL_DIR}/onnx.proto",
            ],
            check=True,
        )
        for generated in ("onnx_pb2.py", "onnx_pb2.pyi"):
            shutil.copyfile(Path(out) / VIRTUAL_DIR / generated, PROTO_DIR / generated)
    print(f"regenerated {PROTO_DIR / 'onnx_pb2.py'} with grpcio-tools {GRPCIO_TOOLS_VERSION}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
