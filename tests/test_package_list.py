"""pyproject.toml lists packages by hand (the top-level folders map into onnxtrain.*), so
a new subpackage is left out of the wheel unless it is added there. This quick check catches
it before the slow fresh-install test does."""

from __future__ import annotations

import tomllib

from support import paths


def test_every_source_package_is_listed_in_pyproject():
    config = tomllib.loads((paths.REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = set()
    for package, folder in config["package-dir"].items():
        root = paths.REPO / folder
        for init in root.rglob("__init__.py"):
            relative = init.parent.relative_to(root).parts
            on_disk.add(".".join((package, *relative)))
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    # Data-only packages (onnxtrain.models) have no __init__.py; they must still exist.
    for package in listed - on_disk:
        assert (paths.REPO / package.replace(".", "/")).is_dir(), package
