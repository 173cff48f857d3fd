"""The zoo's exports, made once per test session (per xdist worker) into a temporary folder.

Set ONNXTRAIN_ZOO_EXPORTS to a folder to keep them between sessions while developing; the
files there are reused as they are, so empty it after changing scripts/export_zoo.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zoo_checks import Zoo


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> Zoo:
    kept = os.environ.get("ONNXTRAIN_ZOO_EXPORTS")
    folder = Path(kept) if kept else tmp_path_factory.mktemp("zoo")
    folder.mkdir(parents=True, exist_ok=True)
    return Zoo(folder)


def pytest_collection_modifyitems(items):
    """Run each model's checks one after another: they share its export and its Trainer, and
    pytest-xdist hands out consecutive tests to the same worker, so a model is exported and
    compiled once rather than once per worker."""
    from zoo_checks import export_zoo

    order = {case: index for index, case in enumerate(export_zoo.cases())}
    slots = [i for i, item in enumerate(items) if _case(item) in order]
    ranked = sorted((items[i] for i in slots), key=lambda item: order[_case(item)])  # stable: check order kept
    for slot, item in zip(slots, ranked):
        items[slot] = item


def _case(item) -> tuple[str, str] | None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return (params["name"], params["exporter"]) if "name" in params and "exporter" in params else None
