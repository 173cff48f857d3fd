"""The distribution: what a wheel holds, what it depends on, and a fresh install.

`pip install .` must install the onnxtrain package tree only (the folders
translate/, state/, proto/ map to onnxtrain.* subpackages, never to top-level
modules) and declare exactly the runtime dependencies.
"""

from __future__ import annotations

import email.parser
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from support import paths

pytestmark = pytest.mark.slow  # builds a wheel with pip, and a virtual environment

ROOT = paths.REPO
RUNTIME_DEPENDENCIES = {"jax", "jaxlib", "protobuf", "optax", "numpy", "tqdm"}


def _build_sources(target: Path) -> Path:
    """A copy of the checkout without its virtual environments, git data and build output.
    setuptools writes build/ and *.egg-info into the tree it builds, and under pytest-xdist
    every worker that runs a test here builds its own wheel, so two builds of the checkout
    itself would race (and leave files in it)."""
    shutil.copytree(ROOT, target, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"))
    return target


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    sources = _build_sources(tmp_path_factory.mktemp("checkout") / "onnxtrain")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--disable-pip-version-check",
         "-w", str(out), str(sources)],
        check=True, capture_output=True,
    )
    (built,) = out.glob("onnxtrain-*.whl")
    return built


def test_wheel_holds_only_the_onnxtrain_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"onnxtrain"}
    for module in ("onnxtrain/translate/tensors.py", "onnxtrain/proto/onnx_pb2.py",
                   "onnxtrain/proto/onnx.proto", "onnxtrain/state/__init__.py",
                   "onnxtrain/models/mlp_classifier.onnx"):
        assert module in names


def test_wheel_declares_exactly_the_runtime_dependencies(wheel):
    archive = zipfile.ZipFile(wheel)
    metadata_name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = email.parser.Parser().parsestr(archive.read(metadata_name).decode())
    requirements = metadata.get_all("Requires-Dist")
    runtime = {re.split(r"[<>=!~ ;\[]", r)[0].lower() for r in requirements if "extra ==" not in r}
    assert runtime == RUNTIME_DEPENDENCIES
    assert metadata["Requires-Python"] == ">=3.10"
    entry_points = next(n for n in archive.namelist() if n.endswith("entry_points.txt"))
    assert "onnxtrain = onnxtrain.cli:main" in archive.read(entry_points).decode()


def test_fresh_install_imports_onnxtrain_and_nothing_at_top_level(wheel, tmp_path):
    env = tmp_path / "env"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    str(wheel)], check=True, capture_output=True)
    script = (
        "import importlib, onnxtrain, onnxtrain.translate, onnxtrain.state, onnxtrain.proto\n"
        "for name in ('state', 'translate', 'proto'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError:\n"
        "        continue\n"
        "    raise SystemExit(f'top-level module {name} is importable')\n"
        "from onnxtrain.cli import demo_model_path\n"
        "print(len(onnxtrain.load_model(demo_model_path()).training_info))\n"
    )
    result = subprocess.run([str(python), "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"
    demo = subprocess.run([str(env / "bin" / "onnxtrain"), "demo"], capture_output=True, text=True)
    assert demo.returncode == 0 and "test accuracy" in demo.stdout, demo.stderr


def test_importing_onnxtrain_loads_optax_only_for_fine_tuning():
    """Trainer users never pay optax's import; the fine-tuning tests show
    FineTuner still gets it where it is used."""
    script = "import sys, onnxtrain\nprint('optax' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
