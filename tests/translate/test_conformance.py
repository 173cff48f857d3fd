"""The ONNX backend test suite through onnxtrain, one pytest case per backend case.

A case listed in tests/translate/conformance_expected_failures/ must fail (an
unexpected pass fails the run, so the list never goes stale); every other
case must pass. `python tests/translate/conformance.py` prints the per-suite summary.
"""

from __future__ import annotations

import pytest

from conformance import expected_failures, run_case
from support.backend_cases import all_cases, quick_case_ids

CASES = all_cases()
EXPECTED_FAILURES = expected_failures()
QUICK = quick_case_ids(CASES)   # the rest are marked slow: the quick run (-m "not slow") skips them


def test_expected_failures_name_real_cases_with_reasons():
    ids = {case.id for case in CASES}
    assert set(EXPECTED_FAILURES) <= ids, sorted(set(EXPECTED_FAILURES) - ids)
    assert all(EXPECTED_FAILURES.values()), "every expected failure needs a reason"


@pytest.mark.conformance
@pytest.mark.parametrize("case", [pytest.param(case, id=case.id, marks=() if case.id in QUICK else pytest.mark.slow)
                                  for case in CASES])
def test_backend_case(case):
    result = run_case(case)
    if case.id in EXPECTED_FAILURES:
        assert not result.passed, (
            f"{case.id} passes now: remove it from tests/translate/conformance_expected_failures/ "
            f"(listed because: {EXPECTED_FAILURES[case.id]})")
    else:
        assert result.passed, result.error
