"""Binding patterns of TrainingInfoProto, generated, against a numpy re-execution of the spec.

Every model is the two-feature linear regression of tests/support/training_models.py (W[2,1], B[1])
trained by plain gradient descent (Gradient node, then W_new = W - LR * dW, the same for B),
plus state variables whose bindings follow one of the patterns the IR spec allows but a
runtime can get wrong:
- one initialization-graph output bound to several variables (a zeros tensor bound to two);
- one algorithm output bound to several variables (W_new bound to W and to a shadow copy);
- swaps and rotations (V0 <- V1, V1 <- V0), through Identity nodes or by naming the
  variables themselves as algorithm outputs;
- pass-throughs (V <- Identity(V), or V bound to an algorithm output that is V itself);
- feeds bound into state (V <- Identity(F), or to F itself, F an algorithm input);
- an int64 step counter, and variables living in the main graph or in the algorithm graph.

Oracle: `Oracle` reads the model's initializers and bindings and re-executes them the way IR.md
"Training Related Information" says (state variables start at their initializers; initialize()
assigns the initialization graph's outputs per initialization_binding; a step computes every
algorithm output from the pre-step state, then assigns them all per update_binding), in float64
numpy with hand-written formulas for the few tensors the models compute. It never touches
onnxtrain internals. Each pattern runs through initialize(), step(), fit(steps_per_call=1 and
2), save_checkpoint + load_checkpoint into a fresh Trainer and export(training=True) +
Trainer(path), under every nan_policy; state and returned outputs must equal the oracle's to
RTOL, and the only exceptions onnxtrain may raise at all are OnnxTrainErrors (here none is
expected either, since every generated model is valid).

The same named patterns run on four simulated CPU devices (a "batch" mesh) in
tests/trainer/binding_worker.py, a subprocess started with
XLA_FLAGS=--xla_force_host_platform_device_count=4 (slow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from support.training_models import (FLOAT, INT64, LABEL, algorithm_graph, constant, f32, gradient,
                                     linreg_graph, linreg_loss_and_grads, make_training_model, mse_nodes,
                                     tensor, value_info)

RTOL, ATOL = 1e-5, 1e-6
NAN_POLICIES = ("raise", "skip", "ignore")
BATCH = 4                  # rows per batch: a multiple of the 4 simulated devices
SHAPE = (BATCH, 3)         # every extra state variable, and the feed F
W0 = [[0.5], [-0.5]]
LEARNING_RATE = 0.1
# Values the initialization graph can produce for extra variables: output f"init{k}".
INIT_VALUES = (np.zeros(SHAPE), np.full(SHAPE, 2.0), np.arange(12.0).reshape(SHAPE) / 4)
W_INIT = [[1.0], [2.0]]
T_START, T_INIT = 5, 0


# ---------------------------------------------------------------------------
# Patterns


@dataclass(frozen=True)
class Source:
    """An algorithm output a state variable can be bound to.

    kind "var": the value of extra variable V{of}, through an Identity node (copy_V{of}) or,
    direct=True, as an algorithm output named V{of} itself; "feed": the feed F, through
    Identity (copy_F) or as the output F; "mix": mix_V{of} = V{of} * 0.5 + F, a computed value.
    """

    kind: str
    of: int = 0
    direct: bool = False

    @property
    def output(self) -> str:
        if self.kind == "var":
            return f"V{self.of}" if self.direct else f"copy_V{self.of}"
        if self.kind == "feed":
            return "F" if self.direct else "copy_F"
        return f"mix_V{self.of}"

    def nodes(self) -> list[onnx.NodeProto]:
        if self.direct:
            return []
        if self.kind == "var":
            return [helper.make_node("Identity", [f"V{self.of}"], [self.output])]
        if self.kind == "feed":
            return [helper.make_node("Identity", ["F"], [self.output])]
        return [helper.make_node("Mul", [f"V{self.of}", "HALF"], [f"half_V{self.of}"]),
                helper.make_node("Add", [f"half_V{self.of}", "F"], [self.output])]


def var(of: int, direct: bool = False) -> Source:
    return Source("var", of, direct)


def feed(direct: bool = False) -> Source:
    return Source("feed", 0, direct)


def mix(of: int) -> Source:
    return Source("mix", of)


@dataclass(frozen=True)
class Extra:
    """Extra state variable V{i} of shape SHAPE: where its initializer lives, which
    initialization output init{k} it is bound to (None: none) and its update source."""

    home: str = "main"                 # "main" graph or "algorithm" graph initializer
    init: int | None = None
    update: Source | None = None


@dataclass(frozen=True)
class Pattern:
    extras: tuple[Extra, ...] = ()
    shadow: str | None = None          # W_shadow[2,1] <- "W_new" (shared with W), "W" or "copy_W"
    w_init: bool = False               # W <- W_init
    shadow_init: bool = False          # W_shadow <- W_init (shared with W when w_init)
    counter: bool = False              # int64 T <- T + 1, initialized to T_INIT

    def uses_feed(self) -> bool:
        return any(e.update is not None and e.update.kind in ("feed", "mix") for e in self.extras)


NAMED_PATTERNS: dict[str, Pattern] = {
    # The known bug: one initialization output (zeros) bound to two variables.
    "shared_initialization_output": Pattern((Extra(init=0, update=mix(0)), Extra(init=0, update=mix(1)))),
    # mix_V0 bound to V0 and V1, the output V0 to V2 and V3, W_new to W and W_shadow.
    "shared_update_output": Pattern((Extra(update=mix(0)), Extra("algorithm", update=mix(0)),
                                     Extra(update=var(0, direct=True)), Extra(update=var(0, direct=True))),
                                    shadow="W_new"),
    # V0 <-> V1 through Identity, V2 <-> V3 by naming them as outputs, V4 <- V5 <- V6 <- V4 mixed;
    # W_shadow lags W by one step; T counts steps.
    "swaps": Pattern((Extra(update=var(1)), Extra(update=var(0)),
                      Extra(update=var(3, direct=True)), Extra("algorithm", update=var(2, direct=True)),
                      Extra(update=var(5, direct=True)), Extra("algorithm", update=var(6)),
                      Extra(update=var(4, direct=True))), shadow="W", counter=True),
    # V0 <- Identity(V0), V1 <- the output V1; V2, V4 <- Identity(F) (one output), V3 <- the input F.
    "pass_through_and_feeds": Pattern((Extra(update=var(0)), Extra("algorithm", update=var(1, direct=True)),
                                       Extra(update=feed()), Extra("algorithm", update=feed(direct=True)),
                                       Extra(init=1, update=feed())), shadow="copy_W"),
    "everything": Pattern((Extra(init=0, update=var(1, direct=True)), Extra("algorithm", init=0, update=var(0)),
                           Extra(init=2, update=mix(0)), Extra("algorithm", init=2, update=mix(0)),
                           Extra(update=feed()), Extra(update=var(5, direct=True))),
                          shadow="W_new", w_init=True, shadow_init=True, counter=True),
}


def _sources(count: int) -> st.SearchStrategy[Source]:
    options = [st.builds(feed, st.booleans())]
    if count:
        options += [st.builds(var, st.integers(0, count - 1), st.booleans()),
                    st.builds(mix, st.integers(0, count - 1))]
    return st.one_of(options)


@st.composite
def patterns(draw) -> Pattern:
    count = draw(st.integers(0, 4))
    extras = tuple(draw(st.builds(Extra, st.sampled_from(["main", "algorithm"]), st.none() | st.integers(0, 2),
                                  st.none() | _sources(count))) for _ in range(count))
    return Pattern(extras, draw(st.sampled_from([None, "W_new", "W", "copy_W"])), draw(st.booleans()),
                   draw(st.booleans()), draw(st.booleans()))


# ---------------------------------------------------------------------------
# Models


def start_value(index: int) -> np.ndarray:
    """V{index}'s initializer: distinct from every INIT_VALUES entry and from the others."""
    return np.arange(12.0).reshape(SHAPE) * 0.1 - 1 - index


def build_model(pattern: Pattern) -> onnx.ModelProto:
    main = linreg_graph(features=2, w0=W0)
    algorithm_initializers = [tensor("LR", LEARNING_RATE), tensor("HALF", 0.5)]
    nodes = mse_nodes() + [gradient(["W", "B"], "loss", zs=["X", "Y"])]
    for x in ("W", "B"):
        nodes += [helper.make_node("Mul", ["LR", f"d{x}"], [f"step_{x}"]),
                  helper.make_node("Sub", [x, f"step_{x}"], [f"{x}_new"])]
    outputs = ["loss", "W_new", "B_new"]
    updates = [("W", "W_new"), ("B", "B_new")]
    init_nodes: dict[str, onnx.NodeProto] = {}
    inits: list[tuple[str, str]] = []

    def add_output(name: str, new_nodes: Sequence[onnx.NodeProto] = ()) -> None:
        if name not in outputs:
            outputs.append(name)
            nodes.extend(new_nodes)

    def add_init(key: str, name: str, value: Any, dtype: Any = np.float32) -> None:
        init_nodes.setdefault(name, constant(name, value, dtype))
        inits.append((key, name))

    for index, extra in enumerate(pattern.extras):
        name = f"V{index}"
        initializer = tensor(name, start_value(index))
        (main.initializer if extra.home == "main" else algorithm_initializers).append(initializer)
        if extra.init is not None:
            add_init(name, f"init{extra.init}", INIT_VALUES[extra.init])
        if extra.update is not None:
            add_output(extra.update.output, extra.update.nodes())
            updates.append((name, extra.update.output))
    if pattern.extras:  # an unbound output, returned by step(): computed from the pre-step state
        nodes += [helper.make_node("Sum", [f"V{i}" for i in range(len(pattern.extras))], ["all_V"]),
                  helper.make_node("ReduceSum", ["all_V"], ["sum_V"], keepdims=0)]
        outputs.append("sum_V")
    if pattern.shadow is not None or pattern.shadow_init:
        main.initializer.append(tensor("W_shadow", np.zeros((2, 1))))
    if pattern.shadow is not None:
        add_output(pattern.shadow, [helper.make_node("Identity", ["W"], ["copy_W"])] if pattern.shadow == "copy_W"
                   else [])
        updates.append(("W_shadow", pattern.shadow))
    if pattern.w_init:
        add_init("W", "W_init", W_INIT)
    if pattern.shadow_init:
        add_init("W_shadow", "W_init", W_INIT)
    if pattern.counter:
        algorithm_initializers += [tensor("T", T_START, np.int64), tensor("ONE", 1, np.int64)]
        nodes.append(helper.make_node("Add", ["T", "ONE"], ["T_new"]))
        outputs.append("T_new")
        updates.append(("T", "T_new"))
        if init_nodes:
            add_init("T", "T_init", T_INIT, np.int64)
    inputs = [LABEL] + ([value_info("F", FLOAT, list(SHAPE))] if pattern.uses_feed() else [])
    algorithm = algorithm_graph(nodes, outputs, inputs, algorithm_initializers)
    initialization = (helper.make_graph(list(init_nodes.values()), "initialization", [],
                                        [value_info(name, TensorProto.UNDEFINED) for name in init_nodes])
                      if init_nodes else None)
    info = helper.make_training_info(algorithm, updates, initialization, inits or None)
    return make_training_model(main, info)


def make_batches(pattern: Pattern, count: int, seed: int = 7) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        X = rng.normal(size=(BATCH, 2)).astype(np.float32)
        batch = {"X": X, "Y": (X @ np.array([[2.0], [-1.0]], np.float32) + 3).astype(np.float32)}
        if pattern.uses_feed():
            batch["F"] = rng.normal(size=SHAPE).astype(np.float32)
        batches.append(batch)
    return batches


# ---------------------------------------------------------------------------
# The oracle


class Oracle:
    """The spec re-executed in float64: values of every initializer, bindings read from the model."""

    def __init__(self, model: onnx.ModelProto):
        info = model.training_info[0]
        self.initialization_binding = [(e.key, e.value) for e in info.initialization_binding]
        self.update_binding = [(e.key, e.value) for e in info.update_binding]
        bound = {value for _, value in self.update_binding}
        self.returned = [o.name for o in info.algorithm.output if o.name not in bound]
        self.state_names = list(dict.fromkeys(k for k, _ in [*self.initialization_binding, *self.update_binding]))
        self.values: dict[str, np.ndarray] = {}
        self.dtypes: dict[str, np.dtype] = {}
        for t in [*model.graph.initializer, *info.algorithm.initializer]:
            array = numpy_helper.to_array(t)
            self.dtypes[t.name] = array.dtype
            self.values[t.name] = array.astype(np.float64) if array.dtype.kind == "f" else array.copy()
        # The initialization graph holds Constant nodes only.
        self.init_outputs = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in info.initialization.node}

    @property
    def state(self) -> dict[str, np.ndarray]:
        return {name: self.values[name] for name in self.state_names}

    def copy(self) -> Oracle:
        twin = object.__new__(Oracle)
        twin.__dict__.update(self.__dict__, values=dict(self.values))
        return twin

    def initialize(self) -> None:
        """IR.md: evaluate the initialization graph, assign its outputs per initialization_binding."""
        self.values.update({key: np.array(self.init_outputs[value], self.values[key].dtype)
                            for key, value in self.initialization_binding})

    def _algorithm_outputs(self, feeds: Mapping[str, np.ndarray]) -> dict[str, Any]:
        v = self.values
        X, Y = (feeds[n].astype(np.float64) for n in "XY")
        rate = f32(LEARNING_RATE)
        loss, dW, dB = linreg_loss_and_grads(v["W"], v["B"], X, Y)
        out: dict[str, Any] = {"loss": np.float64(loss), "W_new": v["W"] - rate * dW, "B_new": v["B"] - rate * dB,
                               "W": v["W"], "copy_W": v["W"]}
        extras = sorted((n for n in v if n.startswith("V") and n[1:].isdigit()), key=lambda n: int(n[1:]))
        if "F" in feeds:
            F = feeds["F"].astype(np.float64)
            out.update(F=F, copy_F=F)
            out.update({f"mix_{n}": v[n] * 0.5 + F for n in extras})
        out.update({n: v[n] for n in extras})
        out.update({f"copy_{n}": v[n] for n in extras})
        if extras:
            out["sum_V"] = np.float64(sum(v[n].sum() for n in extras))
        if "T" in v:
            out["T_new"] = v["T"] + 1
        return out

    def step(self, feeds: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """IR.md: all outputs from the pre-step state, then every update_binding assigned together."""
        outputs = self._algorithm_outputs(feeds)
        self.values.update({key: outputs[value] for key, value in self.update_binding})
        return {name: outputs[name] for name in self.returned}


# ---------------------------------------------------------------------------
# Driving a Trainer through the public API


def call(what: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """function(*args, **kwargs), any exception turned into a failure that says which call
    raised what: a raw (non-OnnxTrainError) exception, or a rejection of a valid model."""
    try:
        return function(*args, **kwargs)
    except onnxtrain.OnnxTrainError as error:
        raise AssertionError(f"{what}: onnxtrain rejected a valid model: "
                             f"{type(error).__name__}: {error}") from error
    except Exception as error:
        raise AssertionError(f"{what}: raised {type(error).__module__}.{type(error).__name__} (not an "
                             f"OnnxTrainError): {str(error)[:500]}") from error


def assert_close(actual: Mapping[str, Any], expected: Mapping[str, Any], dtypes: Mapping[str, np.dtype],
                 what: str) -> None:
    assert set(actual) == set(expected), f"{what}: names {sorted(actual)}, expected {sorted(expected)}"
    for name, value in expected.items():
        got = np.asarray(actual[name])
        if name in dtypes:
            assert got.dtype == dtypes[name], f"{what}: {name} is {got.dtype}, expected {dtypes[name]}"
        assert got.shape == np.shape(value), f"{what}: {name} has shape {got.shape}, expected {np.shape(value)}"
        np.testing.assert_allclose(got, value, rtol=RTOL, atol=ATOL, err_msg=f"{what}: {name}")


def check_state(trainer: Any, oracle: Oracle, what: str) -> None:
    state = call(f"{what}: reading .state", lambda: {k: np.asarray(v) for k, v in trainer.state.items()})
    assert_close(state, oracle.state, oracle.dtypes, what)


def check_step(trainer: Any, oracle: Oracle, batch: Mapping[str, np.ndarray], what: str) -> None:
    outputs = call(what, trainer.step, batch)
    assert_close(call(f"{what}: reading outputs", lambda: {k: np.asarray(v) for k, v in outputs.items()}),
                 oracle.step(batch), {}, f"{what} outputs")
    check_state(trainer, oracle, f"state after {what}")


def check_fit(trainer: Any, oracle: Oracle, batches: Sequence[Mapping[str, np.ndarray]], steps_per_call: int) -> None:
    what = f"fit(steps_per_call={steps_per_call})"
    history = call(what, trainer.fit, list(batches), epochs=1, progress=False, steps_per_call=steps_per_call)
    per_step = [oracle.step(batch) for batch in batches]
    for name in oracle.returned:  # every returned output here is a scalar, so fit records it
        assert f"step_{name}" in history, f"{what}: history has {sorted(history)}, no step_{name!r}"
        np.testing.assert_allclose(history[f"step_{name}"], [float(s[name]) for s in per_step], rtol=RTOL, atol=ATOL,
                                   err_msg=f"{what}: history['step_{name}']")
    check_state(trainer, oracle, f"state after {what}")


def exercise(pattern: Pattern, nan_policy: str, workdir: str | os.PathLike, mesh: Any = None) -> None:
    """The whole public life cycle of one pattern's Trainer, each stage checked against the oracle."""
    workdir = Path(workdir)
    model = build_model(pattern)
    batches = make_batches(pattern, 11)
    options = dict(nan_policy=nan_policy, mesh=mesh)
    oracle = Oracle(model)

    trainer = call("Trainer(model)", onnxtrain.Trainer, model, seed=0, **options)
    check_state(trainer, oracle, "state before initialize()")
    call("initialize()", trainer.initialize)
    oracle.initialize()
    check_state(trainer, oracle, "state after initialize()")
    for index in range(3):
        check_step(trainer, oracle, batches[index], f"step() #{index + 1}")
    check_fit(trainer, oracle, batches[3:5], steps_per_call=1)
    check_fit(trainer, oracle, batches[5:9], steps_per_call=2)

    call("save_checkpoint()", trainer.save_checkpoint, workdir / "run.ckpt")
    call("export(training=True)", trainer.export, workdir / "run.onnx", training=True)
    restored = call("Trainer(model) for the checkpoint", onnxtrain.Trainer, model, seed=3, **options)
    call("load_checkpoint()", restored.load_checkpoint, workdir / "run.ckpt")
    resumed = call("Trainer(exported path)", onnxtrain.Trainer, workdir / "run.onnx", **options)
    for name, other in (("the checkpointed Trainer", restored), ("the exported Trainer", resumed),
                        ("the original Trainer", trainer)):
        check_state(other, oracle, f"state of {name}")
        twin = oracle.copy()
        check_step(other, twin, batches[9], f"step() of {name}")
        check_step(other, twin, batches[10], f"second step() of {name}")


# ---------------------------------------------------------------------------
# Tests


def test_the_named_patterns_are_valid_onnx_and_the_oracle_reads_them():
    """Guards the models and the oracle: each pattern binds what its name says, and the
    combined graph (main graph then algorithm graph), its outputs typed as the oracle computes
    them, passes onnx's full check."""
    for name, pattern in NAMED_PATTERNS.items():
        model = build_model(pattern)
        info = model.training_info[0]
        computed = Oracle(model)._algorithm_outputs(make_batches(pattern, 1)[0])
        outputs = [helper.make_tensor_value_info(o.name, INT64 if o.name == "T_new" else FLOAT,
                                                 np.shape(computed[o.name]))
                   for o in [*model.graph.output, *info.algorithm.output] if o.name != "Y_pred"]
        combined = helper.make_graph([*model.graph.node, *info.algorithm.node], "combined",
                                     [*model.graph.input, *info.algorithm.input], outputs,
                                     [*model.graph.initializer, *info.algorithm.initializer])
        checked = helper.make_model(combined, ir_version=model.ir_version, opset_imports=model.opset_import)
        onnx.checker.check_model(checked, full_check=True)
        values = [e.value for e in info.update_binding]
        init_values = [e.value for e in info.initialization_binding]
        if name in ("shared_initialization_output", "everything"):
            assert len(init_values) > len(set(init_values)), name
        if name in ("shared_update_output", "everything"):
            assert len(values) > len(set(values)), name
    swaps = NAMED_PATTERNS["swaps"]
    oracle = Oracle(build_model(swaps))
    assert {("V0", "copy_V1"), ("V1", "copy_V0"), ("V2", "V3"), ("V3", "V2")} <= set(oracle.update_binding)
    before = dict(oracle.state)
    oracle.step(make_batches(swaps, 1)[0])
    for key, value in [("V0", "V1"), ("V1", "V0"), ("V2", "V3"), ("V3", "V2"), ("V4", "V5"), ("V5", "V6"),
                       ("V6", "V4"), ("W_shadow", "W")]:
        assert np.array_equal(oracle.state[key], before[value]), key
    assert oracle.state["T"] == T_START + 1


@pytest.mark.slow
@pytest.mark.parametrize("nan_policy", NAN_POLICIES)
@pytest.mark.parametrize("name", list(NAMED_PATTERNS))
def test_named_pattern_trains_like_the_oracle(name, nan_policy, tmp_path):
    exercise(NAMED_PATTERNS[name], nan_policy, tmp_path)


@pytest.mark.slow
@settings(max_examples=5, deadline=None, derandomize=True, database=None, print_blob=False,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow])
@given(pattern=patterns(), nan_policy=st.sampled_from(NAN_POLICIES))
def test_generated_pattern_trains_like_the_oracle(pattern, nan_policy):
    """No shrinking: every example compiles several programs. A failure prints the pattern."""
    with tempfile.TemporaryDirectory() as workdir:
        exercise(pattern, nan_policy, workdir)


# ---------------------------------------------------------------------------
# Four simulated devices

WORKER = Path(__file__).resolve().parent / "binding_worker.py"


def _run_worker(name: str, nan_policy: str, devices: int = 4, timeout: float = 300) -> dict:
    """The worker's JSON line; one process per case, so a crash (the faulthandler prints where)
    fails that case only."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    env.pop("JAX_ENABLE_X64", None)
    done = subprocess.run([sys.executable, "-X", "faulthandler", str(WORKER), name, nan_policy], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"the worker exited with {done.returncode}:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("nan_policy", NAN_POLICIES)
@pytest.mark.parametrize("name", list(NAMED_PATTERNS))
def test_named_pattern_trains_like_the_oracle_on_four_devices(name, nan_policy):
    """The same life cycle on mesh=jax.make_mesh((4,), ("batch",)), in a subprocess that sees
    four CPU devices (JAX fixes its device count when it starts)."""
    outcome = _run_worker(name, nan_policy)
    assert outcome["devices"] == 4
    assert not outcome["failure"], outcome["failure"]
