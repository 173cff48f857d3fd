"""Every op handler gives the same answer whether an operand is a constant or computed.

The ONNX backend node cases feed every input as a graph input. support.operand_sources reruns
them, traced as under jax.jit, with each input in turn a Constant node (the others computed)
or computed from a graph input (the others Constant nodes), and compares with the case's
expected outputs; an input the op declares static (OpHandler.static_inputs) must, when
computed, stop the trace with NeedsHostValues naming it, and then give the expected outputs
op by op.

The quick run takes one combination per operator (see _selected); the slow run adds an evenly
spread sample of the others. `python -m support.operand_sources` from tests/ runs them all.
"""

from __future__ import annotations

import functools
import logging

import pytest

from support.backend_cases import BackendCase, cases, expected_failures
from support.operand_sources import Combination, Outcome, combinations, constant_inputs, mixes, run_all

_TIE = ("x / scale lands on a rounding tie (-127.5 or -127.49999): XLA:CPU's float32 division "
        "differs from numpy's correctly rounded one, and whether the program divides or multiplies "
        "by the reciprocal depends on how it is compiled")
_FLOAT4 = ("folded on the host, the saturating cast to float4e2m1 gives 0 for values beyond 6 (the "
           "traced cast gives 6): a defect of Cast's host path, not of operand sources")
# Combinations known to differ from the expected values for reasons other than operand
# sources: id -> (why, strict). Not strict where the outcome depends on compilation.
KNOWN_DIFFERENCES = {
    "test_dynamicquantizelinear[0]-constant": (_TIE, False),
    "test_dynamicquantizelinear[0]-computed": (_TIE, False),
    "test_castlike_FLOAT_to_FLOAT4E2M1[0]-constant": (_FLOAT4, True),
    "test_castlike_FLOAT16_to_FLOAT4E2M1[0]-constant": (_FLOAT4, True),
}

# One in this many of the combinations beyond the quick run's are sampled by the slow run.
SLOW_SAMPLE_EVERY = 30


@functools.cache
def _node_cases() -> list[BackendCase]:
    """The node cases the conformance run passes, but function-expanded twins."""
    known = expected_failures()
    return [case for case in cases("node") if "_expanded" not in case.name and case.id not in known]


@functools.cache
def _selected() -> tuple[list[Combination], list[Combination]]:
    """(quick, slow) combinations. Quick: for every operator, the first case using it that
    has a combination, with its first combination that mixes constant and computed inputs
    (the first input constant, the others computed), or for a case with one input its
    all-computed one: folding a whole node on the host compiles each of its operations
    apart, which the slow run can afford."""
    first: dict[tuple[str, str], BackendCase] = {}
    for case in _node_cases():
        for operator in sorted(case.operators()):
            if operator not in first and combinations(case):
                first[operator] = case
    firsts = {case.id for case in first.values()}
    quick: list[Combination] = []
    rest: list[Combination] = []
    for case in _node_cases():
        chosen = None
        if case.id in firsts:
            options = combinations(case)
            chosen = next((c for c in options if mixes(c)),
                          next((c for c in options if not constant_inputs(c)), options[0]))
            quick.append(chosen)
        rest.extend(c for c in combinations(case) if c != chosen)
    return quick, rest[::SLOW_SAMPLE_EVERY]


def _params() -> list:
    quick, slow = _selected()
    return ([pytest.param(c, id=c.id, marks=_known(c)) for c in quick]
            + [pytest.param(c, id=c.id, marks=[pytest.mark.slow, *_known(c)]) for c in slow])


def _known(combination: Combination) -> list:
    if combination.id not in KNOWN_DIFFERENCES:
        return []
    reason, strict = KNOWN_DIFFERENCES[combination.id]
    return [pytest.mark.xfail(reason=reason, strict=strict)]


@pytest.fixture(autouse=True)
def _quiet_fallback_warnings():
    """Cases whose inputs must be constant fall back to op by op, which logs a warning each."""
    logger = logging.getLogger("onnxtrain")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@functools.cache
def _outcomes(slow: bool) -> dict[Combination, Outcome]:
    """Every selected combination's outcome, run together (see run_all) on first use."""
    quick, sampled = _selected()
    return run_all(sampled if slow else quick)


@pytest.mark.parametrize("combination", _params())
def test_operand_from_either_source(combination):
    quick, _ = _selected()
    outcome = _outcomes(combination not in quick)[combination]
    assert outcome.status != "fail", outcome.detail


def test_the_quick_run_covers_every_operator_the_sweep_can_vary():
    quick, _ = _selected()
    operators = {op for case in _node_cases() if combinations(case) for op in case.operators()}
    assert operators == {op for combination in quick for op in combination.case.operators()}
    assert len(operators) > 150   # the node cases cover most operators


def test_known_differences_name_real_combinations():
    every = {c.id for case in _node_cases() for c in combinations(case)}
    assert set(KNOWN_DIFFERENCES) <= every, sorted(set(KNOWN_DIFFERENCES) - every)
