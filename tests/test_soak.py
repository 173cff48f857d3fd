"""A short soak: RSS stays flat over 3,000 training steps after warm-up (bench/soak.py runs 10,000)."""

from __future__ import annotations

import importlib.util

import pytest

from support import paths

pytestmark = pytest.mark.slow  # 3,000 steps, by design


def _soak_module():
    """bench/soak.py, loaded from its file: bench/ is not a package and stays off sys.path."""
    spec = importlib.util.spec_from_file_location("bench_soak", paths.REPO / "bench" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rss_does_not_grow_over_many_steps():
    soak = _soak_module()
    records = soak.soak(steps=3000, every=500)
    assert len(records) == 6
    assert soak.growth(records) < 5.0, records
