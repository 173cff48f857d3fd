"""Folders the tests read: the checkout, the test tree and its committed fixtures."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
