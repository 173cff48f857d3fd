"""Atomic saves of checkpoints and models (onnxtrain.state.atomic): what their temporaries are
called, which of them a save clears away, and that the bytes reach the disk before the rename.

(That a SIGKILLed writer never leaves a torn file is tests/state/test_crash_safety.py.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest

from onnxtrain import ExportError, save_model
from onnxtrain.proto import GraphProto, ModelProto
from onnxtrain.state.checkpoint import load_checkpoint, save_checkpoint
from onnxtrain.translate.tensors import numpy_to_tensor


def _save_checkpoint(path: Path, version: float = 1.0) -> None:
    save_checkpoint(path, {"W": np.full(4, version, np.float32)}, jax.random.key(0))


def _save_model(path: Path, version: float = 1.0, external_data: bool = False) -> None:
    tensor = numpy_to_tensor(np.full(512, version, np.float32), "W")
    save_model(ModelProto(ir_version=9, graph=GraphProto(name="g", initializer=[tensor])), path,
               external_data=external_data, size_threshold=16)


SAVERS: dict[str, Callable[..., None]] = {"checkpoint": _save_checkpoint, "model": _save_model}


def _temporary_pattern(target: Path) -> re.Pattern:
    return re.compile(rf"\.{re.escape(target.name)}\.{os.getpid()}\.[0-9a-f]{{12}}\.tmp")


@pytest.mark.parametrize("kind", SAVERS)
def test_a_failed_rename_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, kind):
    target = tmp_path / "target"
    SAVERS[kind](target, 1.0)
    before = target.read_bytes()
    renamed = []

    def failing_replace(source, destination):
        renamed.append(Path(source))
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(ExportError, match="target"):
        SAVERS[kind](target, 2.0)
    # The temporary was beside the target, named after it and this process.
    assert len(renamed) == 1 and renamed[0].parent == tmp_path
    assert _temporary_pattern(target).fullmatch(renamed[0].name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
    assert target.read_bytes() == before


def test_a_write_that_raises_leaves_the_old_checkpoint_and_no_temporary(tmp_path):
    class Unconvertible:
        def __array__(self, *args, **kwargs):
            raise RuntimeError("cannot be an array")

    target = tmp_path / "state.ckpt"
    _save_checkpoint(target, 1.0)
    before = target.read_bytes()
    with pytest.raises(RuntimeError, match="cannot be an array"):
        save_checkpoint(target, {"W": np.zeros(2), "bad": Unconvertible()}, jax.random.key(0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.ckpt"]
    assert target.read_bytes() == before


@pytest.fixture
def pids():
    """(a pid whose process has exited, a pid whose process is running)."""
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield finished.pid, running.pid
    running.kill()
    running.wait()


def _plant(folder: Path, names: list[str]) -> None:
    for name in names:
        (folder / name).write_bytes(b"left over")


@pytest.mark.parametrize("kind", SAVERS)
def test_a_save_removes_its_targets_temporaries_whose_writer_is_gone(tmp_path, pids, kind):
    dead, alive = pids
    stale = [f".target.{dead}.0123456789ab.tmp"]
    kept = [
        f".target.{alive}.0123456789ab.tmp",          # a writer still running
        f".target.{os.getpid()}.0123456789ab.tmp",    # another thread of this process
        f".other.{dead}.0123456789ab.tmp",            # another target's
        f".target.backup.{dead}.0123456789ab.tmp",    # the temporary of target.backup
        f".target.{dead}.tmp",                        # not a name a save gives
        f".target.{dead}.0123456789AB.tmp",
        f".target.{dead}.0123456789ab.tmp.keep",
        f"target.{dead}.0123456789ab.tmp",
    ]
    _plant(tmp_path, stale + kept)
    (tmp_path / f".target.{dead}.ba9876543210.tmp").mkdir()  # a folder is never removed
    SAVERS[kind](tmp_path / "target")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(kept + ["target", f".target.{dead}.ba9876543210.tmp"])


def test_a_model_save_removes_its_side_files_stale_temporaries(tmp_path, pids):
    dead, _ = pids
    _plant(tmp_path, [f".m.onnx.{dead}.0123456789ab.tmp", f".m.onnx.data.{dead}.0123456789ab.tmp"])
    _save_model(tmp_path / "m.onnx", external_data=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]


@pytest.mark.parametrize("kind", SAVERS)
def test_saves_sync_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch, kind):
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(descriptor):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        fsync(descriptor)

    def recording_replace(source, destination):
        events.append(("replace", str(source), str(destination)))
        replace(source, destination)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    target = tmp_path / "target"
    SAVERS[kind](target)
    assert len(events) == 3, events
    (_, synced), (_, source, destination), (_, folder) = events
    assert events[0][0] == "fsync" and events[1][0] == "replace" and events[2][0] == "fsync"
    assert synced == source and _temporary_pattern(target).fullmatch(Path(source).name)
    assert destination == str(target) and Path(folder).resolve() == tmp_path.resolve()
    if kind == "checkpoint":
        np.testing.assert_array_equal(load_checkpoint(target)[0]["W"], np.ones(4, np.float32))


def test_saves_keep_the_umask_permissions(tmp_path):
    """tempfile.mkstemp makes owner-only files, and the rename would carry that over."""
    mask = os.umask(0o022)
    try:
        for kind, save in SAVERS.items():
            save(tmp_path / kind)
            assert (tmp_path / kind).stat().st_mode & 0o777 == 0o644, kind
    finally:
        os.umask(mask)
