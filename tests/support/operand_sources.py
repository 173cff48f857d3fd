"""ONNX backend node cases rerun with each operand from another source: a constant, or a value
computed from a graph input, traced as under jax.jit.

Op handlers see an operand as a host constant (numpy, folded while tracing) or as a traced
value, and must give the same answer either way. For graph input `i` of a case:

- "constant": input i is a Constant node; the other inputs stay graph inputs (traced), except
  those an op declares it needs as host constants (OpHandler.static_inputs), which stay constant;
- "computed": input i comes from a graph input through an Identity node (traced); every other
  input is a Constant node.

An input an op declares static that is computed cannot be traced: the jitted run must raise
NeedsHostValues naming it (the model then runs op by op, which must still give the expected
outputs). The declarations in the op registry are the one list of such inputs.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import onnx
from onnx import helper, numpy_helper

from support.backend_cases import BackendCase, _generated, assert_similar, decoded, defined_part

SOURCES = ("constant", "computed")


@dataclass(frozen=True)
class Combination:
    """One backend case with one of its graph inputs taken from one source."""

    case: BackendCase
    index: int
    source: str

    @property
    def id(self) -> str:
        return f"{self.case.name}[{self.index}]-{self.source}"


@dataclass
class Outcome:
    """What a combination did: "ok", "host" (raised NeedsHostValues, then matched op by op; the
    detail says why), or "fail" with why."""

    combination: Combination
    status: str
    detail: str = ""


def _value_kind(value: Any) -> str | None:
    """"tensor" for a numeric array, "string" for a string array, None for what the sweep skips
    (sequences, optionals, maps: a Constant node cannot hold them)."""
    if isinstance(value, np.ndarray):
        return "string" if value.dtype.kind in "OUS" else "tensor"
    return None


@dataclass(frozen=True)
class _Profile:
    """What the sweep reads of a case, worked out once: its first data set, input names and
    the names its ops need as host constants."""

    inputs: list[Any]
    expected: list[Any]
    names: list[str]
    static: set[str]


@functools.cache
def _profile(case: BackendCase) -> _Profile:
    generated = _generated(case.suite)[case.name]
    inputs, expected = generated.data_sets[0]
    # Some cases give scalars as numpy scalars, which are tensors all the same.
    inputs = [np.asarray(v) if isinstance(v, np.generic) else v for v in map(decoded, inputs)]
    return _Profile(inputs, [decoded(v) for v in expected],
                    [info.name for info in generated.model.graph.input], static_names(generated.model))


@functools.cache
def combinations(case: BackendCase) -> tuple[Combination, ...]:
    """The distinct (input, source) the sweep can build for a case: tensor inputs of its first
    data set, string inputs only as constants (a compiled function cannot take strings). Two
    combinations that make the same inputs constant are one (with two inputs, "0 constant" is
    "1 computed"); the first, in order of input then source, stands for both."""
    found, seen = [], set()
    for index, value in enumerate(_profile(case).inputs):
        kind = _value_kind(value)
        for source in SOURCES:
            if kind == "tensor" or (kind == "string" and source == "constant"):
                combination = Combination(case, index, source)
                pattern = constant_inputs(combination)
                if pattern not in seen:
                    seen.add(pattern)
                    found.append(combination)
    return tuple(found)


def mixes(combination: Combination) -> bool:
    """True when the combination has both constant and computed inputs."""
    constant = constant_inputs(combination)
    return bool(constant) and len(constant) < len(_profile(combination.case).inputs)


def constant_inputs(combination: Combination) -> frozenset[int]:
    """The positions of the inputs a combination makes Constant nodes."""
    profile = _profile(combination.case)
    constant = set()
    for index, (name, value) in enumerate(zip(profile.names, profile.inputs)):
        kind = _value_kind(value)
        if combination.source == "constant":
            chosen = index == combination.index or (name in profile.static and kind is not None)
        else:
            chosen = index != combination.index and kind is not None
        if chosen or kind == "string":
            constant.add(index)
    return frozenset(constant)


def static_names(model: onnx.ModelProto) -> set[str]:
    """Names some node of the model reads at an input position its handler declares static."""
    from onnxtrain.translate.model import static_input_names
    from onnxtrain.translate.registry import normalize_domain

    opsets = {normalize_domain(o.domain): o.version for o in model.opset_import}
    return static_input_names(model.graph, opsets)


def build(combination: Combination) -> tuple[onnx.ModelProto, dict[str, Any], list[Any], float, float, str]:
    """(model, feeds, expected outputs, rtol, atol, name of the varied input) for a combination."""
    generated = _generated(combination.case.suite)[combination.case.name]
    profile = _profile(combination.case)
    inputs, expected, names = profile.inputs, profile.expected, profile.names
    model = onnx.ModelProto()
    model.CopyFrom(generated.model)
    graph = model.graph
    constant = constant_inputs(combination)
    nodes, kept, feeds = [], [], {}
    varied = names[combination.index]
    for index, (info, value) in enumerate(zip(list(graph.input), inputs)):
        if index in constant:
            nodes.append(helper.make_node("Constant", [], [info.name], name=f"const_{index}",
                                          value=numpy_helper.from_array(np.asarray(value), info.name)))
        elif index == combination.index:
            source = info.name + "__source"
            nodes.append(helper.make_node("Identity", [source], [info.name], name=f"computed_{index}"))
            renamed = onnx.ValueInfoProto()
            renamed.CopyFrom(info)
            renamed.name = source
            kept.append(renamed)
            feeds[source] = value
        else:
            kept.append(info)
            feeds[info.name] = value
    del graph.input[:]
    graph.input.extend(kept)
    if not any(o.domain in ("", "ai.onnx") for o in model.opset_import):
        # ai.onnx.ml cases import no default opset, which the added Constant/Identity need.
        model.opset_import.append(helper.make_opsetid("", onnx.defs.onnx_opset_version()))
    body = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + body)
    return model, feeds, expected, generated.rtol, generated.atol, varied


@dataclass
class _Traced:
    """A combination traced as jax.jit traces it (every graph input a tracer), not yet run."""

    combination: Combination
    closed: Any
    outputs: Any
    arguments: list[Any]
    output_names: list[str]


def run(combination: Combination) -> Outcome:
    """Run one combination traced as under jax.jit; compare with the case's expected outputs."""
    return run_all([combination])[combination]


def run_all(combinations: Sequence[Combination], batch: int = 48) -> dict[Combination, Outcome]:
    """The outcome of every combination. Each is traced on its own (the trace is what the sweep
    tests); the traced programs then run `batch` to one compiled program, as compiling one
    program per tiny graph would take most of the time."""
    outcomes: dict[Combination, Outcome] = {}
    traced = []
    with warnings.catch_warnings(), jax.enable_x64(True):
        warnings.simplefilter("ignore")
        for combination in combinations:
            result = _trace(combination)
            if isinstance(result, Outcome):
                outcomes[combination] = result
            else:
                traced.append(result)
        for start in range(0, len(traced), batch):
            chunk = traced[start:start + batch]
            try:
                results = _run_traced(chunk)
            except Exception:  # noqa: BLE001 - one program failing: run each alone to say which
                results = []
                for item in chunk:
                    try:
                        results.append(_run_traced([item])[0])
                    except Exception as error:  # noqa: BLE001
                        results.append(error)
            for item, result in zip(chunk, results):
                if isinstance(result, Exception):
                    outcomes[item.combination] = Outcome(item.combination, "fail",
                                                         f"{type(result).__name__}: {str(result)[:400]}")
                else:
                    outcomes[item.combination] = _compared(item.combination, result, "ok")
    return outcomes


def _run_traced(chunk: list[_Traced]) -> list[list[Any]]:
    """Each traced program's outputs, in order of its output names, all compiled as one."""
    def together(arguments: list[list[Any]]) -> list[list[Any]]:
        return [jax.core.eval_jaxpr(item.closed.jaxpr, item.closed.consts, *leaves)
                for item, leaves in zip(chunk, arguments)]

    flats = jax.jit(together)([item.arguments for item in chunk])
    results = []
    for item, flat in zip(chunk, flats):
        outputs = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(item.outputs), flat)
        results.append([outputs[name] for name in item.output_names])
    return results


def _trace(combination: Combination) -> _Traced | Outcome:
    """The traced program of a combination, or its outcome when it does not trace: a computed
    input the op declares static (or data-dependent shapes) stop the trace with NeedsHostValues
    and then run op by op, as TranslatedModel does."""
    from onnxtrain.translate.model import TranslatedModel
    from onnxtrain.translate.values import NeedsHostValues

    model, feeds, _, _, _, varied = build(combination)
    static = combination.source == "computed" and varied in _profile(combination.case).static
    key = jax.random.split(jax.random.key(0))[1]
    try:
        translated = TranslatedModel(onnx_model(model))
        arguments = (translated.params, feeds, key)
        try:
            closed, shapes = jax.make_jaxpr(translated._traced, return_shape=True)(*arguments)
        except NeedsHostValues as reason:
            if static and repr(varied) not in str(reason):
                return Outcome(combination, "fail", f"NeedsHostValues does not name {varied!r}: {reason}")
            outputs = translated(translated.params, feeds, key)
            return _compared(combination, [outputs[name] for name in translated.output_names], "host",
                             str(reason))
    except Exception as error:  # noqa: BLE001 - every failure is an outcome to report
        return Outcome(combination, "fail", f"{type(error).__name__}: {str(error)[:400]}")
    if static:
        return Outcome(combination, "fail", f"{varied!r} is declared static but traced without error")
    return _Traced(combination, closed, shapes, jax.tree_util.tree_leaves(arguments), translated.output_names)


def _compared(combination: Combination, actual: list[Any], status: str, detail: str = "") -> Outcome:
    """`status` (and `detail`) when the outputs match the case's expected ones, else a failure
    saying how."""
    generated = _generated(combination.case.suite)[combination.case.name]
    profile = _profile(combination.case)
    try:
        assert len(actual) == len(profile.expected), f"{len(actual)} outputs, expected {len(profile.expected)}"
        for index, (e, a) in enumerate(zip(profile.expected, actual)):
            e, a = defined_part(generated.model, profile.inputs, e,
                                a if a is None or isinstance(a, list) else np.asarray(a))
            assert_similar(e, a, generated.rtol, generated.atol, f"output {index}")
    except AssertionError as error:
        return Outcome(combination, "fail", f"AssertionError: {str(error)[:400]}")
    return Outcome(combination, status, detail)


def onnx_model(model: onnx.ModelProto) -> Any:
    """onnx's ModelProto as onnxtrain's."""
    from onnxtrain import load_model

    return load_model(model.SerializeToString())


def main() -> int:
    """Run every combination of the node cases the conformance run passes; print the failures
    and a count by outcome. From tests/: python -m support.operand_sources [substring]."""
    import logging
    import sys
    from collections import Counter

    from support.backend_cases import cases, expected_failures

    logging.getLogger("onnxtrain").setLevel(logging.ERROR)
    known = expected_failures()
    pattern = sys.argv[1] if len(sys.argv) > 1 else ""
    selected = [combination for case in cases("node")
                if "_expanded" not in case.name and case.id not in known and pattern in case.name
                for combination in combinations(case)]
    counts: Counter = Counter()
    for combination, outcome in run_all(selected).items():
        counts[outcome.status] += 1
        if outcome.status != "ok":
            first_line = (outcome.detail.splitlines() or [""])[0]
            print(f"{outcome.status.upper()} {combination.id}: {first_line[:300]}", flush=True)
    print(f"{sum(counts.values())} combinations: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
