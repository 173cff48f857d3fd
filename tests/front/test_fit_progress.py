"""fit's hooks (order, per-step values, stopping) and its Keras-like verbose levels.

run_steps is a stand-in whose loss is the number of steps run so far, so every value
a hook or the display shows is known exactly.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from onnxtrain import InputError
from onnxtrain.callbacks import Callback
from onnxtrain.fitting import fit


class Counter:
    """run_steps whose 'loss' is the number of steps so far (1, 2, 3...)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, chunk):
        outputs = []
        for _ in chunk:
            self.calls += 1
            outputs.append({"loss": np.float32(self.calls)})
        return outputs


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, trainer):
        self.events.append(("train_begin", trainer))

    def on_epoch_begin(self, epoch):
        self.events.append(("epoch_begin", epoch, self.params["steps"]))

    def on_step_end(self, step, logs):
        self.events.append(("step", step, logs["loss"]))

    def on_epoch_end(self, epoch, logs):
        self.events.append(("epoch_end", epoch, dict(logs)))

    def on_train_end(self, logs):
        self.events.append(("train_end", dict(logs)))


@pytest.mark.parametrize("steps_per_call", [1, 2])
def test_hooks_run_in_order_with_every_steps_values(steps_per_call):
    recorder, trainer = Recorder(), object()
    fit(Counter(), [{}] * 3, epochs=2, verbose=0, callbacks=[recorder], steps_per_call=steps_per_call,
        trainer=trainer)
    first, second = {"loss": 2.0}, {"loss": 5.0}
    assert recorder.events == [
        ("train_begin", trainer),
        ("epoch_begin", 0, 3), ("step", 0, 1.0), ("step", 1, 2.0), ("step", 2, 3.0), ("epoch_end", 0, first),
        ("epoch_begin", 1, 3), ("step", 3, 4.0), ("step", 4, 5.0), ("step", 5, 6.0), ("epoch_end", 1, second),
        ("train_end", second)]
    assert recorder.trainer is trainer and recorder.params["epochs"] == 2


def test_step_values_reach_the_hook_a_chunk_late_never_waiting_for_the_device():
    """When a step's values reach on_step_end, the next chunk has already been dispatched."""
    step = Counter()
    dispatched_when_seen = []

    class Watch(Callback):
        def on_step_end(self, index, logs):
            dispatched_when_seen.append(step.calls)

    fit(step, [{}] * 6, verbose=0, callbacks=[Watch()], steps_per_call=2)
    assert dispatched_when_seen == [4, 4, 6, 6, 6, 6]


@pytest.mark.parametrize("how", ["callback flag", "trainer flag"])
def test_a_step_hook_stops_training_after_the_chunk_already_dispatched(how):
    class Holder:
        stop_training = False

    holder = Holder()

    class StopAtStep2(Callback):
        def on_step_end(self, index, logs):
            if index == 2:
                if how == "callback flag":
                    self.stop_training = True
                else:
                    self.trainer.stop_training = True

    ended = []
    history = fit(Counter(), [{}] * 10, epochs=3, verbose=0, trainer=holder,
                  callbacks=[StopAtStep2(), lambda epoch, logs: ended.append(epoch)])
    assert history["step_loss"] == [1, 2, 3, 4]   # step 3 was running when step 2's values came back
    assert history["loss"] == [2.5] and ended == [0]


def test_a_flag_set_at_epoch_end_stops_and_fit_clears_the_trainers_flag():
    class Holder:
        stop_training = True   # left over from an earlier fit

    class StopAfterFirst(Callback):
        def on_epoch_end(self, epoch, logs):
            self.stop_training = True

    holder = Holder()
    history = fit(Counter(), [{}] * 2, epochs=3, verbose=0, trainer=holder, callbacks=[StopAfterFirst()])
    assert history["loss"] == [1.5]
    history = fit(Counter(), [{}] * 2, epochs=3, verbose=0, trainer=holder)
    assert len(history["loss"]) == 3 and holder.stop_training is False


def test_plain_functions_still_work_and_every_callback_sees_the_last_epoch():
    seen = []
    history = fit(Counter(), [{}] * 2, epochs=4, verbose=0,
                  callbacks=[lambda epoch, logs: epoch == 1, lambda epoch, logs: seen.append(epoch)])
    assert seen == [0, 1] and len(history["loss"]) == 2 and len(history["step_loss"]) == 4


def test_a_callback_that_is_neither_a_callback_nor_a_function_is_refused():
    with pytest.raises(InputError, match=r"callbacks\[1\] is a str.*Callback objects"):
        fit(Counter(), [{}], verbose=0, callbacks=[lambda e, logs: None, "early_stopping"])


def _final_lines(text: str) -> list[str]:
    """What a terminal or a saved notebook shows: each line as its last carriage return left it."""
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n") if line.rsplit("\r", 1)[-1].strip()]


def test_verbose_1_keeps_one_finished_bar_per_epoch_with_the_epoch_logs(capsys):
    fit(Counter(), [{}] * 30, epochs=2, verbose=1, evaluate=lambda feeds: ({"loss": 1 / 3}, feeds),
        eval_data=[{}])
    out, err = capsys.readouterr()
    lines = _final_lines(out)
    assert err == "" and len(lines) == 2
    for epoch, (line, mean) in enumerate(zip(lines, ["15.5", "45.5"])):
        assert line.startswith(f"epoch {epoch + 1}/2: 100%") and "30/30" in line
        assert line.endswith(f"loss={mean}, val_loss=0.3333]")
    assert not any(re.search(r"(?<!10)0%\|", line) for line in lines)   # no bar left at 0%


def test_during_an_epoch_the_bar_shows_the_mean_of_the_last_20_steps(capsys):
    from onnxtrain._engine.progress import Progress

    display = Progress(1, epochs=1)
    display.epoch_begin(0, 40)
    display.advance(30, {"loss": [float(v) for v in range(1, 31)], "rate": [1 / 3] * 30})
    bar = str(display._bar)
    assert "30/40" in bar and bar.endswith(", loss=20.5, rate=0.3333]")   # loss: the mean of 11..30
    display.close()


def test_verbose_2_prints_one_summary_line_per_epoch(capsys):
    fit(Counter(), [{}] * 4, epochs=2, verbose=2, evaluate=lambda feeds: ({"loss": 2 / 3}, feeds), eval_data=[{}])
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert len(lines) == 2 and "\r" not in out
    assert re.fullmatch(r"epoch 1/2 - 4 steps - \d+\.\ds - loss: 2\.5 - val_loss: 0\.6667", lines[0])
    assert re.fullmatch(r"epoch 2/2 - 4 steps - \d+\.\ds - loss: 6\.5 - val_loss: 0\.6667", lines[1])


@pytest.mark.parametrize("arguments", [{"verbose": 0}, {"progress": False}])
def test_verbose_0_and_progress_false_print_nothing(capsys, arguments):
    fit(Counter(), [{}] * 4, epochs=2, **arguments)
    assert capsys.readouterr() == ("", "")


def test_progress_true_is_verbose_1(capsys):
    fit(Counter(), [{}] * 4, progress=True)
    assert _final_lines(capsys.readouterr().out)[0].startswith("epoch 1/1: 100%")


@pytest.mark.parametrize("arguments, match", [
    ({"verbose": 3}, "verbose=3: pass 0"),
    ({"verbose": True}, "verbose=True"),
    ({"progress": False, "verbose": 1}, "disagree"),
])
def test_bad_verbosity_is_refused(arguments, match):
    with pytest.raises(InputError, match=match):
        fit(Counter(), [{}], **arguments)


def test_an_error_mid_epoch_leaves_no_open_bar_for_the_next_fit(capsys):
    def failing(chunk):
        raise RuntimeError("device lost")

    with pytest.raises(RuntimeError):
        fit(failing, [{}] * 3, verbose=1)
    capsys.readouterr()
    fit(Counter(), [{}] * 3, verbose=1)
    out = capsys.readouterr().out
    # The abandoned bar is erased, and the new one drawn in its place, not below it.
    assert len(_final_lines(out)) == 1 and _final_lines(out)[0].startswith("epoch 1/1: 100%")
    assert "\x1b[A" not in out   # no cursor moves to a second bar position


@pytest.mark.parametrize("drop_last, shown", [(True, "2/2"), (False, "3/3")])
def test_the_bar_counts_the_steps_drop_last_leaves(capsys, drop_last, shown):
    """Ten rows in batches of four: the short third batch is skipped under drop_last, and the
    finished bar must say so instead of stopping at 2/3."""
    from onnxtrain.data import ArrayBatches

    batches = ArrayBatches({"x": np.zeros((10, 2), np.float32)}, batch_size=4)
    fit(Counter(), batches, verbose=1, drop_last=drop_last)
    (line,) = _final_lines(capsys.readouterr().out)
    assert line.startswith("epoch 1/1: 100%") and shown in line
