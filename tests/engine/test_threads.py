"""One Trainer shared by several threads: every step applied exactly once, every save whole.

The model is a two-feature linear regression (tests/support/training_models.py) trained by plain
SGD, W -= LR * dloss/dW and the same for B, with an int64 step counter T (T <- T + 1 in
update_binding). T, W and B are all main-graph initializers, so even an inference export
(training=False) carries the counter. Every step gets the same feeds, so the state after c
steps does not depend on which thread ran which step.

Oracle: `sgd_oracle` re-executes those steps sequentially in float64 numpy (hand-derived
gradients, LR rounded to float32 as ONNX stores it): the state and the loss after each step
count c. The learning rate is small enough that W and B move by far more than the tolerance
every step, so a state torn between two steps, or a lost or doubled step, cannot pass.

- 8 threads x 100 step() calls on one Trainer: afterwards T == 800, W and B equal the
  oracle's after 800 steps, and the 800 returned losses are exactly the oracle's 800 losses
  (each step saw one whole pre-step state).
- export(training=False/True) and save_checkpoint() in one thread while another steps: every
  call succeeds, and every file loads and holds the oracle's state after its own counter c,
  0 <= c <= N.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import helper, numpy_helper

import onnxtrain
from support.training_models import (LABEL, algorithm_graph, f32, gradient, linreg_graph, linreg_loss_and_grads,
                                     make_training_model, mse_nodes, tensor)

THREADS, STEPS_PER_THREAD = 8, 100
SAVER_STEPS, MIN_SAVES, MAX_SAVES = 1000, 10, 400
LEARNING_RATE = 0.001
RTOL, ATOL = 1e-5, 1e-6      # float32 vs float64: < 1e-6 apart after 1000 steps; a step moves W by > 4e-4
JOIN_TIMEOUT = 300           # seconds; a thread still alive after it has deadlocked

X = np.random.default_rng(0).normal(size=(8, 2)).astype(np.float32)
FEEDS = {"X": X, "Y": (X @ np.array([[2.0], [-1.0]], np.float32) + 3).astype(np.float32)}


def sgd_model() -> onnx.ModelProto:
    main = linreg_graph(features=2, w0=[[0.5], [-0.5]])
    main.initializer.append(tensor("T", 0, np.int64))
    nodes = mse_nodes() + [gradient(["W", "B"], "loss", zs=["X", "Y"])]
    for x in ("W", "B"):
        nodes += [helper.make_node("Mul", ["LR", f"d{x}"], [f"step_{x}"]),
                  helper.make_node("Sub", [x, f"step_{x}"], [f"{x}_new"])]
    nodes.append(helper.make_node("Add", ["T", "ONE"], ["T_new"]))
    algorithm = algorithm_graph(nodes, ["loss", "W_new", "B_new", "T_new"], [LABEL],
                                [tensor("LR", LEARNING_RATE), tensor("ONE", 1, np.int64)])
    info = helper.make_training_info(algorithm, [("W", "W_new"), ("B", "B_new"), ("T", "T_new")], None, None)
    return make_training_model(main, info)


def sgd_oracle(steps: int) -> tuple[list[dict[str, np.ndarray]], list[float]]:
    """(states[c] after c steps for c = 0..steps, losses[c] returned by step c + 1), float64."""
    W, B = np.array([[0.5], [-0.5]]), np.zeros(1)
    Xd, Yd = FEEDS["X"].astype(np.float64), FEEDS["Y"].astype(np.float64)
    rate = f32(LEARNING_RATE)
    states, losses = [{"W": W, "B": B, "T": np.int64(0)}], []
    for count in range(1, steps + 1):
        loss, dW, dB = linreg_loss_and_grads(W, B, Xd, Yd)
        W, B = W - rate * dW, B - rate * dB
        states.append({"W": W, "B": B, "T": np.int64(count)})
        losses.append(loss)
    return states, losses


def assert_oracle_state(state: dict[str, np.ndarray], states: list[dict[str, np.ndarray]], what: str) -> int:
    """`state` holds a counter c in [0, len(states) - 1] and the oracle's W and B after c steps; c."""
    assert set(state) == {"W", "B", "T"}, f"{what}: state {sorted(state)}"
    count = np.asarray(state["T"])
    assert count.dtype == np.int64 and count.shape == (), f"{what}: T is {count.dtype}{list(count.shape)}"
    count = int(count)
    assert 0 <= count < len(states), f"{what}: T == {count}, outside 0..{len(states) - 1}"
    for name in ("W", "B"):
        assert np.asarray(state[name]).dtype == np.float32, f"{what}: {name} is {np.asarray(state[name]).dtype}"
        np.testing.assert_allclose(state[name], states[count][name], rtol=RTOL, atol=ATOL,
                                   err_msg=f"{what}: {name} is not the oracle's after T == {count} steps")
    return count


def run_threads(targets: list[Callable[[], None]]) -> list[BaseException]:
    """Run each target in its own daemon thread, started together; the exceptions they raised."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(targets))

    def guarded(target: Callable[[], None]) -> None:
        barrier.wait()
        try:
            target()
        except BaseException as error:  # noqa: BLE001  (collected and reported by the test)
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(target,), daemon=True) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT)
    assert not any(thread.is_alive() for thread in threads), f"a thread is still running after {JOIN_TIMEOUT} s"
    return errors


def describe(errors: list[BaseException], trainer: Any) -> str:
    """The exceptions the threads raised, and the step counter they left."""
    kinds = sorted({f"{type(e).__module__}.{type(e).__name__}: {str(e)[:300]}" for e in errors})
    try:
        counter = f"T == {int(np.asarray(trainer.state['T']))}"
    except Exception as error:  # noqa: BLE001
        counter = f"reading T raised {type(error).__name__}: {error}"
    return f"{len(errors)} exception(s) ({counter}), {len(kinds)} distinct:\n" + "\n".join(kinds)


def host_state(trainer: Any) -> dict[str, np.ndarray]:
    return {name: np.asarray(value) for name, value in trainer.state.items()}


@pytest.mark.parametrize("nan_policy", ["raise", "ignore"])
def test_eight_threads_stepping_one_trainer_apply_every_step_exactly_once(nan_policy):
    total = THREADS * STEPS_PER_THREAD
    states, losses = sgd_oracle(total)
    trainer = onnxtrain.Trainer(sgd_model(), nan_policy=nan_policy)
    returned: list[float] = []

    def stepper() -> None:
        for _ in range(STEPS_PER_THREAD):
            returned.append(float(np.asarray(trainer.step(FEEDS)["loss"])))

    errors = run_threads([stepper] * THREADS)
    assert not errors, describe(errors, trainer)
    final = host_state(trainer)
    assert int(final["T"]) == total, f"T == {int(final['T'])} after {total} steps"
    assert_oracle_state(final, states, f"after {total} steps from {THREADS} threads")
    # Each step saw one whole state: the returned losses are the oracle's, step for step.
    assert len(returned) == total
    np.testing.assert_allclose(sorted(returned, reverse=True), losses, rtol=RTOL)


def export_training(trainer: Any, path: Path) -> None:
    trainer.export(path, training=True)


def export_inference(trainer: Any, path: Path) -> None:
    trainer.export(path, training=False)


def checkpoint(trainer: Any, path: Path) -> None:
    trainer.save_checkpoint(path)


def load_training_export(path: Path) -> dict[str, np.ndarray]:
    return host_state(onnxtrain.Trainer(path))


def load_inference_export(path: Path) -> dict[str, np.ndarray]:
    """The initializers of the inference model, which ONNX Runtime must load and run with them."""
    model = onnx.load(path)
    assert not model.training_info, f"{path.name}: an inference export keeps training_info"
    state = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # quiet about the unused initializer T
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    (predicted,) = session.run(None, {"X": FEEDS["X"]})
    np.testing.assert_allclose(predicted, FEEDS["X"] @ state["W"] + state["B"], rtol=1e-5, atol=1e-6)
    return state


def checkpoint_loader() -> Callable[[Path], dict[str, np.ndarray]]:
    fresh = onnxtrain.Trainer(sgd_model())

    def load(path: Path) -> dict[str, np.ndarray]:
        fresh.load_checkpoint(path)
        return host_state(fresh)

    return load


SAVERS = {
    "export_training": (export_training, "onnx", lambda: load_training_export),
    "export_inference": (export_inference, "onnx", lambda: load_inference_export),
    "save_checkpoint": (checkpoint, "ckpt", checkpoint_loader),
}


@pytest.mark.parametrize("nan_policy", [pytest.param("raise", marks=pytest.mark.slow), "ignore"])  # checked: slower
@pytest.mark.parametrize("saver", list(SAVERS))
def test_saving_while_another_thread_steps_writes_whole_states(saver, nan_policy, tmp_path):
    """The saving thread saves to a new file over and over until the stepping thread is done
    (at least MIN_SAVES times); the first step runs before, so saves overlap compiled steps."""
    save, suffix, make_loader = SAVERS[saver]
    states, _ = sgd_oracle(SAVER_STEPS + 1)
    trainer = onnxtrain.Trainer(sgd_model(), nan_policy=nan_policy)
    trainer.step(FEEDS)
    stepping_done = threading.Event()
    paths: list[Path] = []

    def stepper() -> None:
        try:
            for _ in range(SAVER_STEPS):
                trainer.step(FEEDS)
        finally:
            stepping_done.set()

    def saving() -> None:
        while len(paths) < MAX_SAVES and not (stepping_done.is_set() and len(paths) >= MIN_SAVES):
            paths.append(tmp_path / f"save{len(paths)}.{suffix}")
            save(trainer, paths[-1])

    errors = run_threads([stepper, saving])
    assert not errors, describe(errors, trainer)
    assert int(host_state(trainer)["T"]) == SAVER_STEPS + 1
    assert_oracle_state(host_state(trainer), states, "the stepping Trainer")
    load = make_loader()
    for path in paths:
        assert_oracle_state(load(path), states, f"{saver} {path.name}")
