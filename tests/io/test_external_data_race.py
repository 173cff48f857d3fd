"""Someone rewriting the model's folder while models load can neither leak nor hang a load.

A writer thread keeps swapping the sub-folder that holds a model's external data
for links leading out (absolute and relative), a FIFO, a link to /dev/zero, a
regular file, nothing, or an honest folder, while the main thread loads the model
in a loop. Oracle: every load returns the true weights or raises an OnnxTrainError;
no load returns a byte of the outside files (which hold a recognisable pattern), whether it
maps the side file or reads it;
no load blocks (a per-load alarm and a whole-test faulthandler deadline).
"""

from __future__ import annotations

import faulthandler
import os
import random
import shutil
import signal
import stat
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

import onnxtrain._io.external_data as external_data
from onnxtrain import OnnxTrainError, load_model
from onnxtrain.translate.tensors import tensor_to_numpy

pytestmark = pytest.mark.skipif(os.name != "posix" or not external_data.WALK_BY_DESCRIPTOR,
                                reason="the race is closed by walking descriptors (POSIX)")

WEIGHTS = np.arange(12, dtype=np.float32).tobytes()
OUTSIDE = b"OUTSIDE!" * 6   # 48 bytes: a W read from outside would load without complaint
LOAD_TIMEOUT_SECONDS = 10
LOCATION = "sub/weights.bin"
# Message fragments to tally the typed errors by what the load met.
CATEGORIES = ["climbs above", "outside", "FIFO", "device", "does not exist", "not a folder",
              "is a folder", "shrank", "changed", "bytes"]


class Hang(BaseException):
    """One load ran past LOAD_TIMEOUT_SECONDS."""


def _remove(path: Path) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _build(state: str, at: Path, outside: Path) -> None:
    """Make `at` what `state` says the sub-folder should be."""
    if state == "folder":
        at.mkdir()
        (at / "weights.bin").write_bytes(WEIGHTS)
    elif state == "link_inside":
        os.symlink("honest", at)
    elif state == "link_out_absolute":
        os.symlink(outside, at)
    elif state == "link_out_relative":
        os.symlink("../outside", at)
    elif state in ("fifo", "file_link_out", "dev_zero"):
        at.mkdir()
        if state == "fifo":
            os.mkfifo(at / "weights.bin")
        else:
            os.symlink(outside / "weights.bin" if state == "file_link_out" else "/dev/zero", at / "weights.bin")
    elif state == "file":
        at.write_bytes(OUTSIDE)


STATES = ["folder", "link_inside", "link_out_absolute", "link_out_relative", "fifo", "file_link_out",
          "dev_zero", "missing", "file"]


def _writer(folder: Path, outside: Path, stop: threading.Event, swaps: Counter) -> None:
    """Swap folder/sub between STATES as fast as it can (symlink-for-symlink swaps are atomic)."""
    rng = random.Random(0)
    sub, fresh, old = folder / "sub", folder / ".fresh", folder / ".old"
    while not stop.is_set():
        state = rng.choice(STATES)
        _remove(fresh)
        _remove(old)
        _build(state, fresh, outside)
        try:
            os.replace(fresh, sub)   # works unless sub is a folder, or fresh is one and sub is not
        except OSError:
            if os.path.lexists(sub):
                os.rename(sub, old)
            if os.path.lexists(fresh):
                os.rename(fresh, sub)
        swaps[state] += 1
        time.sleep(0)


def _on_alarm(signum, frame) -> None:
    raise Hang(f"a load ran past {LOAD_TIMEOUT_SECONDS} s")


def race(tmp_path: Path, seconds: float) -> dict:
    """Load for `seconds` while the writer swaps; the tallies."""
    folder, outside = tmp_path / "model", tmp_path / "outside"
    (folder / "honest").mkdir(parents=True)
    (folder / "honest" / "weights.bin").write_bytes(WEIGHTS)
    outside.mkdir()
    (outside / "weights.bin").write_bytes(OUTSIDE)
    _build("folder", folder / "sub", outside)
    weight = onnx.TensorProto(name="W", data_type=onnx.TensorProto.FLOAT, dims=[3, 4])
    weight.data_location = onnx.TensorProto.EXTERNAL
    weight.external_data.add(key="location", value=LOCATION)
    graph = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "g",
                              [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [2, 4])],
                              initializer=[weight])
    path = folder / "model.onnx"
    path.write_bytes(helper.make_model(graph).SerializeToString())

    tally = {"loads": 0, "true_weights": 0, "outside_bytes_loads": 0, "other_bytes_loads": 0,
             "typed_errors": Counter(), "other_messages": [], "untyped_errors": [],
             "swaps": Counter()}
    stop = threading.Event()
    writer = threading.Thread(target=_writer, args=(folder, outside, stop, tally["swaps"]), daemon=True)
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    faulthandler.dump_traceback_later(seconds + 120, exit=True)
    writer.start()
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            tally["loads"] += 1
            signal.alarm(LOAD_TIMEOUT_SECONDS)
            try:
                # Every other load maps the side file (and decodes it at once) instead of reading it.
                mapping = tally["loads"] % 2 == 0
                data = tensor_to_numpy(load_model(path, map_external_data=mapping).graph.initializer[0]).tobytes()
            except OnnxTrainError as error:
                message = str(error)
                category = next((c for c in CATEGORIES if c in message), "other")
                tally["typed_errors"][category] += 1
                if category == "other" and len(tally["other_messages"]) < 5:
                    tally["other_messages"].append(message)
                continue
            except Exception as error:  # noqa: BLE001 - exactly what the test counts
                tally["untyped_errors"].append(f"{type(error).__name__}: {error}")
                continue
            finally:
                signal.alarm(0)
            if data == WEIGHTS:
                tally["true_weights"] += 1
            elif b"OUTSIDE!" in data:
                tally["outside_bytes_loads"] += 1
            else:
                tally["other_bytes_loads"] += 1
    finally:
        stop.set()
        writer.join()
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)
    return tally


def check_race(tally: dict, record_property) -> None:
    print(f"race: {tally['loads']} loads, {tally['true_weights']} true weights, "
          f"{sum(tally['typed_errors'].values())} typed errors {dict(tally['typed_errors'])}, "
          f"{tally['outside_bytes_loads']} loads of outside bytes, {tally['other_bytes_loads']} of other bytes, "
          f"{len(tally['untyped_errors'])} untyped errors, swaps {dict(tally['swaps'])}, "
          f"uncategorised messages {tally['other_messages']}")
    for key in ("loads", "true_weights", "outside_bytes_loads", "other_bytes_loads"):
        record_property(key, tally[key])
    record_property("typed_errors", dict(tally["typed_errors"]))
    assert tally["untyped_errors"] == []
    assert tally["outside_bytes_loads"] == 0
    assert tally["other_bytes_loads"] == 0
    # The race was live: the writer went through every state, and loads both worked and failed.
    assert set(tally["swaps"]) == set(STATES)
    assert tally["true_weights"] > 0 and sum(tally["typed_errors"].values()) > 0


@pytest.mark.slow
def test_a_folder_rewritten_during_loads_quick(tmp_path, record_property):
    check_race(race(tmp_path, 2.0), record_property)


@pytest.mark.slow
def test_a_folder_rewritten_during_twenty_seconds_of_loads(tmp_path, record_property):
    check_race(race(tmp_path, 20.0), record_property)
