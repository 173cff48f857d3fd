"""Run onnx's backend test cases through onnxtrain and compare with each case's expectations.

Used by tests/translate/test_conformance.py (one pytest case per backend case) and as a
command that prints a summary:

    python tests/translate/conformance.py [--suite node] [-k REGEX] [--failures]

Expected values: the case's own data sets (node, model, simple, pytorch-*),
and onnxruntime on fixed random inputs for the light models (they ship no
inputs). Tolerances are each case's rtol/atol, as onnx's own runner uses them.

The light models run op by op (jit=False): their placeholder weights inflate
activations to 1e9..1e31, where one float32 ulp exceeds a softmax's whole
range, and XLA:CPU's fused multiply-adds (taken or not depending on buffer
alignment, so varying from process to process) decide between a finite
softmax and NaN. Op by op, every result is rounded like onnxruntime's.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

if __name__ == "__main__":  # run as a command: the support package is in tests/, one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support.backend_cases import (  # noqa: E402
    DATA_ROOT,
    GENERATED_SUITES,
    SUITES,
    BackendCase,
    _generated,
    assert_similar,
    cases,
    decoded,
    defined_part,
    expected_failures,
)

# Backend cases feed shapes and axes as graph inputs, so many run op by op on purpose.
logging.getLogger("onnxtrain").setLevel(logging.ERROR)
LIGHT_TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}


def _load_value(path: Path, value_type: Any) -> Any:
    import onnx
    from onnx import numpy_helper

    data = path.read_bytes()
    if value_type.HasField("sequence_type"):
        return numpy_helper.to_list(onnx.SequenceProto.FromString(data))
    if value_type.HasField("optional_type"):
        return numpy_helper.to_optional(onnx.OptionalProto.FromString(data))
    return numpy_helper.to_array(onnx.TensorProto.FromString(data))


def data_sets(case: BackendCase, model: Any) -> tuple[list[tuple[list, list]], float, float]:
    """[(inputs, expected outputs)], rtol, atol for a case."""
    if case.suite in GENERATED_SUITES:
        generated = _generated(case.suite)[case.name]
        sets = [([decoded(v) for v in i], [decoded(v) for v in o]) for i, o in generated.data_sets]
        return sets, generated.rtol, generated.atol
    if case.suite == "light":
        return _light_data(case, model), LIGHT_TOLERANCE["rtol"], LIGHT_TOLERANCE["atol"]
    sets = []
    folder = DATA_ROOT / case.suite / case.name
    graph = model.graph
    for data_dir in sorted(folder.glob("test_data_set_*")):
        inputs = [_load_value(data_dir / f"input_{i}.pb", graph.input[i].type)
                  for i in range(len(list(data_dir.glob("input_*.pb"))))]
        outputs = [_load_value(data_dir / f"output_{i}.pb", graph.output[i].type)
                   for i in range(len(list(data_dir.glob("output_*.pb"))))]
        sets.append((inputs, outputs))
    return sets, 1e-3, 1e-7


def _light_data(case: BackendCase, model: Any) -> list[tuple[list, list]]:
    """Unit-normal inputs and onnxruntime's outputs for them."""
    import onnxruntime
    from onnx import helper

    initializers = {t.name for t in model.graph.initializer}
    rng = np.random.default_rng(0)
    inputs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        shape = [d.dim_value or 1 for d in value.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        inputs.append(rng.standard_normal(shape).astype(dtype))
    session = onnxruntime.InferenceSession(str(case.model_path()), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return [(inputs, session.run(None, dict(zip(names, inputs))))]


@dataclass
class Result:
    case: BackendCase
    passed: bool
    error: str = ""
    seconds: float = 0.0


def run_case(case: BackendCase) -> Result:
    import onnx

    from onnxtrain.backend import OnnxTrainRep

    start = time.perf_counter()
    try:
        model = onnx.ModelProto.FromString(case.model_bytes())
        sets, rtol, atol = data_sets(case, model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rep = OnnxTrainRep(case.model_bytes(), jit=case.suite != "light")
            for inputs, expected in sets:
                outputs = rep.run(inputs)
                assert len(outputs) == len(expected), f"{len(outputs)} outputs, expected {len(expected)}"
                for index, (e, a) in enumerate(zip(expected, outputs)):
                    e, a = defined_part(model, inputs, e, a)
                    assert_similar(e, a, rtol, atol, f"output {index}")
    except Exception as error:  # noqa: BLE001 - every failure is a result to report
        message = f"{type(error).__name__}: {error}"
        if not isinstance(error, AssertionError) and type(error).__module__.startswith(("jax", "builtins")):
            message += "\n" + "".join(traceback.format_tb(error.__traceback__)[-3:])
        return Result(case, False, message, time.perf_counter() - start)
    return Result(case, True, seconds=time.perf_counter() - start)


def handler_coverage(selected: list[BackendCase]) -> tuple[set, set]:
    """(exercised, registered): handler keys (domain, op_type, since_version) the cases reach."""
    import onnx

    from onnxtrain.translate import ops  # noqa: F401 - registers every handler
    from onnxtrain.translate.registry import normalize_domain, registered, resolve

    exercised = set()
    for case in selected:
        model = onnx.ModelProto.FromString(case.model_bytes())
        opsets = {normalize_domain(o.domain): o.version for o in model.opset_import}
        graphs = [model.graph] + [onnx.helper.make_graph(f.node, f.name, [], []) for f in model.functions]
        while graphs:
            graph = graphs.pop()
            for node in graph.node:
                domain = normalize_domain(node.domain)
                handler = resolve(domain, node.op_type, opsets.get(domain, 0))
                if handler is not None:
                    exercised.add((handler.domain, handler.op_type, handler.since_version))
                graphs.extend(a.g for a in node.attribute if a.type == a.GRAPH)
                graphs.extend(g for a in node.attribute for g in a.graphs)
    every = {(domain, op_type, since) for (domain, op_type), versions in registered().items()
             for since in versions}
    return exercised, every


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=SUITES, action="append", help="suites to run (default: all)")
    parser.add_argument("-k", dest="pattern", help="only cases whose id matches this regex")
    parser.add_argument("--failures", action="store_true", help="print every failing case and why")
    parser.add_argument("--coverage", action="store_true",
                        help="only list the op handler versions no selected case reaches")
    arguments = parser.parse_args(argv)
    if arguments.coverage:
        selected = [c for s in arguments.suite or SUITES for c in cases(s)]
        exercised, every = handler_coverage(selected)
        for domain, op_type, since in sorted(every - exercised):
            print(f"not reached: {domain or 'ai.onnx'}::{op_type} since {since}")
        print(f"{len(exercised & every)} of {len(every)} handler versions reached by {len(selected)} cases")
        return 0
    known = expected_failures()
    pattern = re.compile(arguments.pattern) if arguments.pattern else None
    totals: dict[str, Counter] = {}
    surprises = []
    for suite in arguments.suite or SUITES:
        for case in cases(suite):
            if pattern and not pattern.search(case.id):
                continue
            result = run_case(case)
            counts = totals.setdefault(suite, Counter())
            counts["total"] += 1
            expected_to_fail = case.id in known
            if result.passed:
                counts["pass"] += 1
                if expected_to_fail:
                    surprises.append(f"UNEXPECTED PASS {case.id}")
            else:
                counts["expected-fail" if expected_to_fail else "FAIL"] += 1
                if not expected_to_fail:
                    surprises.append(f"FAIL {case.id}: {result.error.splitlines()[0][:300]}")
                if arguments.failures:
                    print(f"--- {case.id}\n{result.error}")
    for line in surprises:
        print(line)
    print(f"{'suite':<20}{'pass':>6}{'xfail':>7}{'FAIL':>6}{'total':>7}{'pass %':>8}")
    for suite, counts in totals.items():
        share = 100 * counts["pass"] / counts["total"]
        print(f"{suite:<20}{counts['pass']:>6}{counts['expected-fail']:>7}{counts['FAIL']:>6}"
              f"{counts['total']:>7}{share:>7.1f}%")
    return 1 if surprises else 0


if __name__ == "__main__":
    sys.exit(main())
