"""Trainer.infer costs one compiled call: after the first call, which compiles, nothing runs
op by op around the program (deriving inference's random key eagerly once cost more than a
small model's whole forward pass)."""

from __future__ import annotations

import numpy as np
from jax._src import core as jax_core

import onnxtrain
from support import paths


def test_infer_runs_nothing_outside_its_compiled_program(monkeypatch):
    trainer = onnxtrain.Trainer(onnxtrain.make_training_model(
        str(paths.REPO / "onnxtrain" / "models" / "digits_cnn.onnx"), loss="cross_entropy"))
    feeds = {"x": np.random.default_rng(0).standard_normal((8, 1, 8, 8)).astype(np.float32)}
    first = np.asarray(next(iter(trainer.infer(feeds).values())))
    eager = []
    original = jax_core.EvalTrace.process_primitive

    def counted(self, primitive, *args, **kwargs):
        eager.append(primitive.name)
        return original(self, primitive, *args, **kwargs)

    monkeypatch.setattr(jax_core.EvalTrace, "process_primitive", counted)
    for _ in range(3):
        again = np.asarray(next(iter(trainer.infer(feeds).values())))
    assert eager == []
    np.testing.assert_array_equal(again, first)
