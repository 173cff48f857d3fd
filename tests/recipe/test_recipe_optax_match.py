"""make_training_model's schedules, clipping, AdamW and accumulation train as optax does.

Oracle: optax (schedules, clip_by_global_norm, adam/adamw/sgd, MultiSteps) applied with
jax.value_and_grad to the same MLP and loss written in jax.numpy, batch by batch; the
recipe runs in onnxtrain.Trainer from the ONNX it writes. Losses and final weights agree
within 1e-5 over 20 optimizer updates. The written algorithm graph is checked with onnx's
checker and for its operator domains (ai.onnx and ai.onnx.preview.training only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import optim
from support.onnx_checks import check_training_model

optax = pytest.importorskip("optax")
# Each test compiles a training step and runs 20 or more updates on both sides.
pytestmark = pytest.mark.slow

TRAINING_DOMAIN = "ai.onnx.preview.training"
UPDATES = 20
RNG = np.random.default_rng(34)
PARAMS = {
    "W1": RNG.normal(0.0, 0.6, (4, 8)).astype(np.float32),
    "b1": RNG.normal(0.0, 0.1, 8).astype(np.float32),
    "W2": RNG.normal(0.0, 0.4, (8, 3)).astype(np.float32),
    "b2": RNG.normal(0.0, 0.1, 3).astype(np.float32),
}
# Enough micro-batches for 20 updates at accumulate=3.
BATCHES = [(RNG.normal(size=(6, 4)).astype(np.float32), RNG.normal(size=(6, 3)).astype(np.float32))
           for _ in range(3 * UPDATES)]


def _mlp(dtype=np.float32):
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["h"]), helper.make_node("MatMul", ["h", "W2"], ["y0"]),
             helper.make_node("Add", ["y0", "b2"], ["y"])]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", elem, ["batch", 4])],
                              [helper.make_tensor_value_info("y", elem, ["batch", 3])],
                              [numpy_helper.from_array(value.astype(dtype), name) for name, value in PARAMS.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _loss(params, x, y):
    hidden = jax.nn.relu(x @ params["W1"] + params["b1"])
    return jnp.mean((hidden @ params["W2"] + params["b2"] - y) ** 2)


def optax_run(transformation, batches, dtype=np.float32):
    """Losses (before each step) and final parameters of `transformation` on `batches`."""
    params = {name: jnp.asarray(value.astype(dtype)) for name, value in PARAMS.items()}
    state = transformation.init(params)
    # Jitted, as optax is used in practice (MultiSteps' conditionals are slow op by op).
    value_and_grad, update = jax.jit(jax.value_and_grad(_loss)), jax.jit(transformation.update)
    losses, norms = [], []
    for x, y in batches:
        loss, grads = value_and_grad(params, x, y)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
        norms.append(float(optax.tree.norm(grads)))
    return np.array(losses), {name: np.asarray(value) for name, value in params.items()}, np.array(norms)


def build(optimizer, dtype=np.float32):
    return onnxtrain.make_training_model(_mlp(dtype), loss="mse", optimizer=optimizer, trainable=list(PARAMS))


def onnxtrain_run(optimizer, batches, model=None):
    trainer = onnxtrain.Trainer(model or build(optimizer))
    losses = [float(trainer.step({"x": x, "labels": y})["loss"]) for x, y in batches]
    return np.array(losses), {name: np.asarray(trainer.state[name]) for name in PARAMS}, trainer


def assert_same_training(ours, theirs):
    np.testing.assert_allclose(ours[0], theirs[0], rtol=0, atol=1e-5, err_msg="losses")
    for name in PARAMS:
        np.testing.assert_allclose(ours[1][name], theirs[1][name], rtol=0, atol=1e-5, err_msg=name)
    # The features must have changed the weights: a trajectory that stays put proves nothing.
    assert max(np.abs(theirs[1][name] - PARAMS[name]).max() for name in PARAMS) > 1e-2


SCHEDULES = {
    "warmup": (optim.warmup(peak=0.08, steps=6, start=0.01), optax.linear_schedule(0.01, 0.08, 6)),
    "cosine": (optim.cosine(peak=0.08, steps=15, end=0.01), optax.cosine_decay_schedule(0.08, 15, 0.01 / 0.08)),
    "cosine_warmup": (optim.cosine(peak=0.08, steps=16, warmup=5, end=0.004),
                      optax.warmup_cosine_decay_schedule(0.0, 0.08, 5, 16, 0.004)),
    "linear_warmup": (optim.linear(peak=0.1, end=0.02, steps=14, warmup=4),
                      optax.join_schedules([optax.linear_schedule(0.0, 0.1, 4),
                                            optax.linear_schedule(0.1, 0.02, 10)], [4])),
    "exponential": (optim.exponential(peak=0.1, rate=0.8, every=3),
                    optax.exponential_decay(0.1, 3, 0.8)),
    "step_decay_warmup_floor": (optim.exponential(peak=0.1, rate=0.5, every=4, staircase=True, warmup=3, end=0.02),
                                optax.warmup_exponential_decay_schedule(0.0, 0.1, 3, 4, 0.5, staircase=True,
                                                                        end_value=0.02)),
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_matches_optax_with_sgd(name):
    """With plain SGD each update is lr_t * gradient, so the trajectory pins lr_t at every step."""
    ours, theirs = SCHEDULES[name]
    batches = BATCHES[:UPDATES]
    assert_same_training(onnxtrain_run(optim.SGD(lr=ours), batches), optax_run(optax.sgd(theirs), batches))


def test_cosine_warmup_schedule_matches_optax_with_adam():
    """Adam counts from 1; the schedule must still see step 0 on the first update."""
    ours, theirs = SCHEDULES["cosine_warmup"]
    batches = BATCHES[:UPDATES]
    assert_same_training(onnxtrain_run(optim.Adam(lr=ours), batches), optax_run(optax.adam(theirs), batches))


def test_clipping_by_global_norm_matches_optax():
    batches = BATCHES[:UPDATES]
    theirs = optax_run(optax.chain(optax.clip_by_global_norm(0.8), optax.sgd(0.05, momentum=0.9)), batches)
    norms = theirs[2]
    assert (norms > 0.8).any() and (norms < 0.8).any(), norms   # both branches of min(1, c/|g|) ran
    assert_same_training(onnxtrain_run(optim.Momentum(lr=0.05, momentum=0.9, clip_norm=0.8), batches), theirs)


def test_clipping_above_every_norm_changes_nothing():
    batches = BATCHES[:UPDATES]
    theirs = optax_run(optax.sgd(0.05, momentum=0.9), batches)
    assert theirs[2].max() < 1e3
    assert_same_training(onnxtrain_run(optim.Momentum(lr=0.05, momentum=0.9, clip_norm=1e3), batches), theirs)


def test_adamw_matches_optax_adamw():
    batches = BATCHES[:UPDATES]
    theirs = optax_run(optax.adamw(0.03, weight_decay=0.5), batches)
    assert_same_training(onnxtrain_run(optim.AdamW(lr=0.03, weight_decay=0.5), batches), theirs)
    # The decay is real: plain Adam ends elsewhere.
    plain = optax_run(optax.adam(0.03), batches)
    assert np.abs(plain[1]["W1"] - theirs[1]["W1"]).max() > 1e-3


def test_adamw_mask_leaves_out_what_optax_masks():
    batches = BATCHES[:UPDATES]
    theirs = optax_run(optax.adamw(0.03, weight_decay=0.5,
                                   mask=lambda params: {k: v.ndim >= 2 for k, v in params.items()}), batches)
    by_predicate = onnxtrain_run(optim.AdamW(lr=0.03, weight_decay=0.5, mask=lambda name, w: w.ndim >= 2), batches)
    assert_same_training(by_predicate, theirs)
    by_names = onnxtrain_run(optim.AdamW(lr=0.03, weight_decay=0.5, mask=["W1", "W2"]), batches)
    assert_same_training(by_names, theirs)


def test_accumulation_matches_optax_multisteps():
    """Adam, so the counter T must count updates only and both slots stay put in between.

    The Adam op adds epsilon to sqrt(H) before the bias correction, optax after it; with the
    default 1e-8 that alone moves a weight whose gradients stay near zero by about 1e-5 here,
    so both sides use a smaller epsilon to test the accumulation rather than that placement."""
    k, epsilon = 3, 1e-10
    batches = BATCHES[:k * UPDATES]
    theirs = optax_run(optax.MultiSteps(optax.adam(0.05, eps=epsilon), every_k_schedule=k), batches)
    trainer = onnxtrain.Trainer(build(optim.Adam(lr=0.05, accumulate=k, epsilon=epsilon)))
    losses, before = [], {n: np.asarray(trainer.state[n]) for n in PARAMS}
    for index, (x, y) in enumerate(batches):
        losses.append(float(trainer.step({"x": x, "labels": y})["loss"]))
        now = {n: np.asarray(trainer.state[n]) for n in PARAMS}
        changed = any(not np.array_equal(now[n], before[n]) for n in PARAMS)
        assert changed == ((index + 1) % k == 0), f"micro-step {index}: weights changed={changed}"
        before = now
    assert int(trainer.state["step"]) == 1 + UPDATES       # Adam's counter counts updates from 1
    assert int(trainer.state["accumulate.count"]) == 0
    assert_same_training((np.array(losses), before), theirs)


def test_accumulated_update_is_one_step_on_the_mean_gradient():
    """Independent of MultiSteps: K micro-batches of SGD equal one step on their mean gradient."""
    k, lr = 4, 0.1
    trainer = onnxtrain.Trainer(build(optim.SGD(lr=lr, accumulate=k)))
    params = {name: jnp.asarray(value) for name, value in PARAMS.items()}
    grads = [jax.grad(_loss)(params, x, y) for x, y in BATCHES[:k]]
    for x, y in BATCHES[:k]:
        trainer.step({"x": x, "labels": y})
    for name in PARAMS:
        expected = PARAMS[name] - lr * np.mean([np.asarray(g[name]) for g in grads], axis=0)
        np.testing.assert_allclose(trainer.state[name], expected, rtol=0, atol=1e-6)
        assert not np.asarray(trainer.state[f"{name}.grad_sum"]).any()


def _combination():
    return optim.AdamW(lr=optim.cosine(peak=0.05, steps=UPDATES, warmup=4, end=0.005), weight_decay=0.2,
                       clip_norm=0.5, accumulate=2)


def test_combination_matches_optax_and_uses_only_standard_ops():
    k = 2
    batches = BATCHES[:k * UPDATES]
    model = build(_combination())
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.05, 4, UPDATES, 0.005)
    inner = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(schedule, weight_decay=0.2))
    theirs = optax_run(optax.MultiSteps(inner, every_k_schedule=k), batches)
    ours = onnxtrain_run(None, batches, model)
    assert_same_training(ours[:2], theirs)

    check_training_model(model)
    info = model.training_info[0]
    domains = {n.domain for n in [*info.algorithm.node, *info.initialization.node]}
    assert domains <= {"", "ai.onnx", TRAINING_DOMAIN}, domains
    assert [n.op_type for n in info.algorithm.node if n.domain == TRAINING_DOMAIN] == ["Gradient", "Adam"]
    adam = next(n for n in info.algorithm.node if n.op_type == "Adam")
    assert {a.name: a.f for a in adam.attribute}.get("norm_coefficient_post", 0.0) == 0.0
    bound = {e.key for e in info.initialization_binding}
    assert {"learning_rate", "step", "accumulate.count", "W1.grad_sum"} <= bound


def test_float64_weights_get_the_features_in_their_dtype():
    """The learning rate and hyperparameters are float32; float64 weights get them cast, and
    keep their dtype (optax in float64 as the oracle)."""
    k = 2
    batches = [(x.astype(np.float64), y.astype(np.float64)) for x, y in BATCHES[:k * UPDATES]]
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.05, 4, UPDATES, 0.005)
    inner = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(schedule, weight_decay=0.2))
    with jax.enable_x64(True):
        theirs = optax_run(optax.MultiSteps(inner, every_k_schedule=k), batches, np.float64)
    model = build(_combination(), np.float64)
    check_training_model(model)
    ours = onnxtrain_run(None, batches, model)
    assert all(value.dtype == np.float64 for value in ours[1].values())
    assert_same_training(ours[:2], theirs)


def test_learning_rate_and_schedule_change_without_recompiling():
    batches = BATCHES[:6]
    trainer = onnxtrain.Trainer(build(_combination()))
    assert {"learning_rate.warmup_steps", "learning_rate.decay_steps", "learning_rate.end_factor",
            "clip_norm", "weight_decay", "accumulate.steps"} <= set(trainer.hyperparameter_names)
    assert "learning_rate" in trainer.state_names
    trainer.step({"x": batches[0][0], "labels": batches[0][1]})
    compiled = trainer.compilations
    trainer.set_state("learning_rate", 0.0)
    trainer.set_state("weight_decay", 0.0)
    trainer.set_state("accumulate.steps", 1)
    trainer.set_state("learning_rate.decay_steps", 40.0)
    before = {n: np.asarray(trainer.state[n]) for n in PARAMS}
    for x, y in batches[1:]:
        trainer.step({"x": x, "labels": y})
    assert trainer.compilations == compiled
    assert int(trainer.state["step"]) == 1 + 5          # accumulate.steps=1: every step updates
    for name in PARAMS:                                 # learning rate 0 and no decay: no change
        np.testing.assert_array_equal(trainer.state[name], before[name])


def test_changing_the_base_learning_rate_rescales_the_schedule():
    """set_state("learning_rate", 2 * peak) from the start equals optax with the schedule doubled."""
    batches = BATCHES[:UPDATES]
    ours, _ = SCHEDULES["cosine_warmup"]
    trainer = onnxtrain.Trainer(build(optim.SGD(lr=ours)))
    trainer.set_state("learning_rate", 0.16)
    losses = [float(trainer.step({"x": x, "labels": y})["loss"]) for x, y in batches]
    doubled = optax.warmup_cosine_decay_schedule(0.0, 0.16, 5, 16, 0.008)
    assert_same_training((np.array(losses), {n: np.asarray(trainer.state[n]) for n in PARAMS}),
                         optax_run(optax.sgd(doubled), batches))


def _update_part_model(model):
    """The combined training graph without its Gradient node: gradients and state variables
    become inputs, the bound values and the loss outputs, so onnx.reference can run it."""
    import onnx

    model = onnx.load_from_string(model.SerializeToString())
    info = model.training_info[0]
    graph = onnx.GraphProto()
    graph.CopyFrom(model.graph)
    for field in ("input", "initializer", "output", "node", "value_info", "sparse_initializer"):
        getattr(graph, field).extend(getattr(info.algorithm, field))
    gradient = next(n for n in graph.node if n.op_type == "Gradient")
    graph.node.remove(gradient)
    bindings = {e.key: e.value for e in info.update_binding}
    state = {t.name: numpy_helper.to_array(t) for t in graph.initializer if t.name in bindings}
    for sparse in graph.sparse_initializer:
        dtype = helper.tensor_dtype_to_np_dtype(sparse.values.data_type)
        state[sparse.values.name] = np.zeros(tuple(sparse.dims), dtype)
    kept = [t for t in graph.initializer if t.name not in bindings]
    del graph.initializer[:], graph.sparse_initializer[:], graph.output[:]
    graph.initializer.extend(kept)
    for name, value in state.items():
        graph.input.append(helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape)))
    xs = [name.decode() for a in gradient.attribute if a.name == "xs" for name in a.strings]
    for weight, name in zip(xs, gradient.output):
        graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(PARAMS[weight].shape)))
    for name in ["loss", *bindings.values()]:
        graph.output.append(helper.make_empty_tensor_value_info(name))
    part = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    return part, state, bindings, dict(zip(xs, gradient.output))


def test_onnx_reference_runs_the_update_part_as_optax_does():
    """A second runtime: onnx.reference has no Gradient kernel, so jax supplies the gradients and
    onnx.reference runs everything else the recipe wrote (schedule, clipping, Adam, decay, Where)."""
    reference = pytest.importorskip("onnx.reference")
    k = 2
    batches = BATCHES[:k * UPDATES]
    part, state, bindings, gradient_names = _update_part_model(build(_combination()))
    evaluator = reference.ReferenceEvaluator(part)
    losses = []
    for x, y in batches:
        params = {name: jnp.asarray(state[name]) for name in PARAMS}
        grads = jax.grad(_loss)(params, x, y)
        feeds = {"x": x, "labels": y, **state,
                 **{gradient_names[name]: np.asarray(grads[name]) for name in PARAMS}}
        outputs = evaluator.run(None, feeds)
        losses.append(float(outputs[0]))
        state = {key: np.asarray(value) for key, value in zip(bindings, outputs[1:])}
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.05, 4, UPDATES, 0.005)
    inner = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(schedule, weight_decay=0.2))
    theirs = optax_run(optax.MultiSteps(inner, every_k_schedule=k), batches)
    assert_same_training((np.array(losses), {name: state[name] for name in PARAMS}), theirs)
