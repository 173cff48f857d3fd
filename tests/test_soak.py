"""A short soak: RSS stays flat over 3,000 training steps after warm-up (bench/soak.py runs 10,000)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import soak  # noqa: E402


def test_rss_does_not_grow_over_many_steps():
    records = soak.soak(steps=3000, every=500)
    assert len(records) == 6
    assert soak.growth(records) < 5.0, records
