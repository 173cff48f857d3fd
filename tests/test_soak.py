"""A short soak: RSS stays flat over 3,000 training steps after warm-up (bench/soak.py runs 10,000)."""

from __future__ import annotations

import pytest

from support.bench_modules import bench_module

pytestmark = pytest.mark.slow  # 3,000 steps, by design


def test_rss_does_not_grow_over_many_steps():
    soak = bench_module("soak")
    records = soak.soak(steps=3000, every=500)
    assert len(records) == 6
    assert soak.growth(records) < 5.0, records
