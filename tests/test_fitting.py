"""fit(): epochs, Keras-like history, eval data, callbacks, and batches it cannot repeat."""

from __future__ import annotations

import numpy as np
import pytest

from onnxtrain import InputError
from onnxtrain.fitting import fit


class Counter:
    """A stand-in step whose 'loss' is the number of calls so far: exact expected histories."""

    def __init__(self):
        self.calls = 0

    def __call__(self, feeds):
        self.calls += 1
        return {"loss": np.float32(self.calls), "vector": np.zeros(3)}


def test_history_has_steps_epoch_means_and_eval_means():
    step = Counter()
    history = fit(step, [{}] * 4, epochs=2, progress=False,
                  evaluate=lambda feeds: {"loss": feeds["v"]}, eval_data=[{"v": 1.0}, {"v": 3.0}])
    assert history["loss"] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert history["epoch_loss"] == [2.5, 6.5]
    assert history["val_loss"] == [2.0, 2.0]
    assert "vector" not in history


def test_a_callback_can_stop_training_and_sees_the_epoch_logs():
    seen = []
    history = fit(Counter(), [{}] * 3, epochs=5, progress=False,
                  callbacks=[lambda epoch, logs: seen.append((epoch, logs)) or epoch == 1])
    assert [epoch for epoch, _ in seen] == [0, 1]
    assert seen[1][1] == {"epoch_loss": 5.0}
    assert len(history["loss"]) == 6


def test_one_shot_iterators_serve_one_epoch_and_callables_many():
    with pytest.raises(InputError, match="iterate again"):
        fit(Counter(), iter([{}] * 3), epochs=2, progress=False)
    history = fit(Counter(), lambda: iter([{}] * 3), epochs=2, progress=False)
    assert len(history["loss"]) == 6
