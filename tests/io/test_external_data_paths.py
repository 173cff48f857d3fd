"""External-data locations are walked inside the model's folder and nowhere else.

Oracle: the loaded tensor equals the bytes written inside the folder, or the load
raises a ModelLoadError whose message names the tensor and the location. Files
outside the folder hold a recognisable pattern that must never come back.
Both ways of opening are tested: by descriptor (POSIX) and the resolve-check-open
fallback used where there is no dir_fd (Windows).
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import helper

import onnxtrain._io.external_data as external_data
from onnxtrain import ModelLoadError, load_model
from onnxtrain.proto import ModelProto
from onnxtrain.translate.tensors import tensor_to_numpy
from support.fuzz_mutations import nested_ifs, mlp_model

WEIGHTS = np.arange(12, dtype=np.float32).tobytes()
# What every file outside the model folder holds: 48 bytes, so a W read from it would load.
OUTSIDE = b"OUTSIDE!" * 6
HANG_SECONDS = 10

posix_only = pytest.mark.skipif(os.name != "posix", reason="symbolic links and FIFOs as on POSIX")


class Hang(BaseException):
    """The watchdog fired: a load blocked."""


@contextmanager
def no_hang(seconds: int = HANG_SECONDS) -> Iterator[None]:
    """Fail instead of hanging (a FIFO open blocks in C; SIGALRM interrupts it)."""
    def fire(signum, frame):
        raise Hang(f"load blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def weight_model(location: str, **entries: str) -> onnx.ModelProto:
    """A MatMul model whose weight W (3x4 float32, 48 bytes) is external at `location`."""
    weight = onnx.TensorProto(name="W", data_type=onnx.TensorProto.FLOAT, dims=[3, 4])
    weight.data_location = onnx.TensorProto.EXTERNAL
    for key, value in {"location": location, **entries}.items():
        weight.external_data.add(key=key, value=value)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"], name="project")], "g",
        [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [2, 4])],
        initializer=[weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(params=["descriptor", "by_name"])
def walk(request, monkeypatch) -> str:
    """Run the test with each opening strategy."""
    if request.param == "descriptor" and not external_data.WALK_BY_DESCRIPTOR:
        pytest.skip("no dir_fd on this platform")
    monkeypatch.setattr(external_data, "WALK_BY_DESCRIPTOR", request.param == "descriptor")
    return request.param


@pytest.fixture
def descriptor_walk() -> None:
    if not external_data.WALK_BY_DESCRIPTOR:
        pytest.skip("no dir_fd on this platform")


@pytest.fixture
def folder(tmp_path) -> Path:
    """tmp/model (the model folder, holding real.bin and sub/real.bin) beside tmp/outside."""
    model_folder = tmp_path / "model"
    (model_folder / "sub").mkdir(parents=True)
    (model_folder / "real.bin").write_bytes(WEIGHTS)
    (model_folder / "sub" / "real.bin").write_bytes(WEIGHTS)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.bin").write_bytes(OUTSIDE)
    (tmp_path / "outside" / "real.bin").write_bytes(OUTSIDE)
    return model_folder


def save(folder: Path, location: str, **entries: str) -> Path:
    path = folder / "model.onnx"
    path.write_bytes(weight_model(location, **entries).SerializeToString())
    return path


def stored(model: ModelProto) -> bytes:
    """W's values as bytes, whether load_model mapped its side file or read it."""
    return tensor_to_numpy(model.graph.initializer[0]).tobytes()


def loads_weights(folder: Path, location: str, **entries: str) -> None:
    """Both ways of loading reach the file inside the folder: mapping it, and reading it."""
    path = save(folder, location, **entries)
    with no_hang():
        mapped, read = load_model(path), load_model(path, map_external_data=False)
    assert stored(mapped) == WEIGHTS
    assert read.graph.initializer[0].raw_data == WEIGHTS


def refused(folder: Path, location: str | None, *patterns: str, mappings: tuple[bool, ...] = (True, False),
            **entries: str) -> str:
    """Load, expecting a ModelLoadError naming W, the location (start, unless None) and `patterns`,
    both when mapping the side file and when reading it (`mappings`)."""
    path = save(folder, location or "real.bin", **entries)
    for mapping in mappings:
        with pytest.raises(ModelLoadError) as caught, no_hang():
            load_model(path, map_external_data=mapping)
        message = str(caught.value)
        for pattern in ("initializer 'W'", *([repr(location)[:40]] if location else []), *patterns):
            assert pattern in message, f"{pattern!r} not in {message!r}"
        assert caught.value.__cause__ is None
    return message


def open_descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else set()


# --- links that stay inside the folder keep working -------------------------------------------


@posix_only
@pytest.mark.parametrize("link, target, location", [
    ("w.bin", "real.bin", "w.bin"),
    ("w.bin", "sub/real.bin", "w.bin"),
    ("sub/w.bin", "../real.bin", "sub/w.bin"),
    ("sub/w.bin", "./real.bin", "sub/w.bin"),
    ("data", "sub", "data/real.bin"),
    ("data", "sub/", "data/real.bin"),
    ("sub/up", "..", "sub/up/real.bin"),
])
def test_relative_links_inside_the_folder_load(folder, walk, link, target, location):
    os.symlink(target, folder / link)
    loads_weights(folder, location)


@posix_only
def test_absolute_links_into_the_folder_load(folder, walk):
    os.symlink(folder / "real.bin", folder / "w.bin")
    os.symlink(folder / "sub", folder / "data")
    os.symlink(f"{folder}//sub/./real.bin", folder / "odd.bin")
    for location in ("w.bin", "data/real.bin", "odd.bin"):
        loads_weights(folder, location)


@posix_only
def test_absolute_link_through_an_unresolved_spelling_of_the_folder(tmp_path, folder, walk):
    """base_dir given through a link: absolute links spelled with it stay inside too."""
    os.symlink(folder, tmp_path / "alias")
    os.symlink(tmp_path / "alias" / "real.bin", folder / "w.bin")
    path = save(folder, "w.bin")
    loaded = load_model(path.read_bytes(), base_dir=tmp_path / "alias")
    assert stored(loaded) == WEIGHTS


@posix_only
def test_exactly_forty_links_are_followed_and_forty_one_refused(folder, descriptor_walk):
    previous = "real.bin"
    for index in range(41):
        os.symlink(previous, folder / f"link{index}")
        previous = f"link{index}"
    loads_weights(folder, "link39")
    refused(folder, "link40", "more than 40 symbolic links")


@pytest.mark.parametrize("location", ["./real.bin", "sub/./real.bin", "sub//real.bin", ".//sub/real.bin"])
def test_dot_and_empty_components_name_the_same_file(folder, walk, location):
    loads_weights(folder, location)


def test_one_handle_per_file_however_spelled(folder, walk):
    """Tensors reaching one file through several spellings share one open handle."""
    model = weight_model("real.bin")
    for index, location in enumerate(["./real.bin", "sub//real.bin"]):
        extra = onnx.TensorProto()
        extra.CopyFrom(model.graph.initializer[0])
        extra.name = f"W{index}"
        extra.external_data[0].value = location
        model.graph.initializer.append(extra)
    with external_data.ExternalDataReader(folder) as reader:
        tensors = list(ModelProto.FromString(model.SerializeToString()).graph.initializer)
        assert [reader.read(t, t.name) for t in tensors] == [WEIGHTS] * 3
        assert len(reader._files) == 2  # real.bin and sub/real.bin


# --- links that lead out are refused --------------------------------------------------------------


@posix_only
@pytest.mark.parametrize("link, target, location", [
    ("w.bin", "{outside}/secret.bin", "w.bin"),
    ("w.bin", "../outside/secret.bin", "w.bin"),
    ("sub/w.bin", "../../outside/secret.bin", "sub/w.bin"),
    ("data", "{outside}", "data/secret.bin"),
    ("data", "../outside", "data/secret.bin"),
    ("sub/up", "../..", "sub/up/outside/secret.bin"),
    ("w.bin", "/dev/zero", "w.bin"),
    ("w.bin", "/", "w.bin"),
    ("w.bin", "{folder}_evil/real.bin", "w.bin"),
])
def test_links_leading_out_are_refused(tmp_path, folder, walk, link, target, location):
    (tmp_path / "model_evil").mkdir()
    (tmp_path / "model_evil" / "real.bin").write_bytes(OUTSIDE)
    os.symlink(target.format(outside=tmp_path / "outside", folder=folder), folder / link)
    message = refused(folder, location)
    assert "outside" in message or "climbs above" in message


@posix_only
def test_dotdot_through_a_link_cannot_climb_and_come_back(folder, descriptor_walk):
    """`../model/real.bin` from the folder would come back inside, but climbing is refused."""
    os.symlink(f"../{folder.name}/real.bin", folder / "w.bin")
    refused(folder, "w.bin", "climbs above the model's folder")


@posix_only
@pytest.mark.parametrize("links, location", [
    ({"a": "a"}, "a"),
    ({"a": "b", "b": "a"}, "a"),
    ({"a": "./b", "b": "sub/../a"}, "a"),
    ({"d": "d"}, "d/real.bin"),
    ({"d": "d/"}, "d/real.bin"),
    ({"sub/loop": "../sub/loop"}, "sub/loop"),
])
def test_link_loops_end_with_a_load_error(folder, walk, links, location):
    for name, target in links.items():
        os.symlink(target, folder / name)
    refused(folder, location, "symbolic links")


@posix_only
def test_dangling_link(folder, walk):
    os.symlink("gone.bin", folder / "w.bin")
    refused(folder, "w.bin", "does not exist")


@posix_only
def test_empty_link_target_is_refused_by_the_walk(folder, descriptor_walk, monkeypatch):
    """Linux cannot make an empty link; another system's readlink could return one."""
    real_readlink = os.readlink
    monkeypatch.setattr(external_data.os, "readlink",
                        lambda name, dir_fd=None: "" if name == "w.bin" else real_readlink(name, dir_fd=dir_fd))
    os.symlink("real.bin", folder / "w.bin")
    refused(folder, "w.bin", "empty symbolic link")


@posix_only
@pytest.mark.parametrize("then", [errno.EINVAL, errno.ENOENT])
def test_a_link_replaced_between_open_and_readlink(folder, descriptor_walk, monkeypatch, then):
    """open says "a link" (ELOOP), then readlink finds none (replaced, or removed): the
    entry changed, which is not a loop."""
    real_readlink = os.readlink

    def replaced(name, dir_fd=None):
        if name == "w.bin":
            raise OSError(then, os.strerror(then))
        return real_readlink(name, dir_fd=dir_fd)

    os.symlink("real.bin", folder / "w.bin")
    monkeypatch.setattr(external_data.os, "readlink", replaced)
    message = refused(folder, "w.bin", "changed while it was being opened")
    assert "symbolic links" not in message


# --- what the location reaches must be a regular file ------------------------------------------------


@posix_only
@pytest.mark.parametrize("make, location, pattern", [
    (lambda f: os.mkfifo(f / "w.bin"), "w.bin", "FIFO"),
    (lambda f: os.mkfifo(f / "sub" / "w.bin"), "sub/w.bin", "FIFO"),
    (lambda f: (os.mkfifo(f / "pipe"), os.symlink("pipe", f / "w.bin")), "w.bin", "FIFO"),
    (lambda f: os.symlink("sub", f / "w.bin"), "w.bin", "is a folder"),
    (lambda f: os.symlink("sub/", f / "w.bin"), "w.bin", "is a folder"),
    (lambda f: os.symlink(".", f / "w.bin"), "w.bin", "is a folder"),
    (lambda f: None, "sub", "is a folder"),
    (lambda f: None, "real.bin/x", "not a folder"),
])
def test_only_regular_files_are_read_and_nothing_blocks(folder, walk, make, location, pattern):
    make(folder)
    message = refused(folder, location)
    if walk == "descriptor":
        assert pattern in message


@posix_only
def test_a_link_to_a_file_with_a_trailing_slash_is_refused(folder, descriptor_walk):
    """`real.bin/` asks for a folder; the by-name fallback's realpath drops the slash."""
    os.symlink("real.bin/", folder / "w.bin")
    refused(folder, "w.bin", "not a folder")


@pytest.mark.parametrize("location", ["sub/", "sub/.", ".", "./", "real.bin/", "real.bin/.", "real.bin//",
                                      "real.bin\\"])
def test_locations_ending_in_a_folder_are_refused(folder, walk, location):
    refused(folder, location, "names a folder")


@posix_only
def test_a_device_in_the_folder_is_refused(folder, walk, monkeypatch):
    """A device node needs root to create, so the walk is shown /dev/null's descriptor."""
    real_open = os.open

    def open_devnull(name, flags, mode=0o777, *, dir_fd=None):
        if str(name).endswith("w.bin"):
            return real_open("/dev/null", flags)
        return real_open(name, flags, mode, dir_fd=dir_fd)

    (folder / "w.bin").write_bytes(WEIGHTS)
    monkeypatch.setattr(external_data.os, "open", open_devnull)
    refused(folder, "w.bin", "device" if walk == "descriptor" else "")


# --- names the system refuses become load errors ----------------------------------------------


@pytest.mark.parametrize("location, pattern", [
    ("x" * 300, "longer than the file system allows"),
    ("sub/" + "x" * 300 + "/real.bin", "longer than the file system allows"),
    ("a/" * 2500, "longer than the 4096 characters"),
    ("x" * 5000, "longer than the 4096 characters"),
    ("a/" * 2000 + "real.bin", "does not exist"),
    ("missing/real.bin", "does not exist"),
])
def test_impossible_names_are_load_errors(folder, walk, location, pattern):
    message = refused(folder, location)
    if walk == "descriptor":
        assert pattern in message
    assert len(message) < 1000, "an absurd location is shortened in the message"


def test_folder_depth_is_bounded(folder, descriptor_walk):
    """Every folder of the walk stays open (for `..`), so their number is bounded."""
    deep = folder / Path(*["d"] * external_data.MAX_FOLDER_DEPTH)
    deep.mkdir(parents=True)
    (deep / "real.bin").write_bytes(WEIGHTS)
    (deep / "d").mkdir()
    (deep / "d" / "real.bin").write_bytes(WEIGHTS)
    loads_weights(folder, "d/" * (external_data.MAX_FOLDER_DEPTH - 1) + "d/real.bin")
    refused(folder, "d/" * (external_data.MAX_FOLDER_DEPTH + 1) + "real.bin",
            f"more than {external_data.MAX_FOLDER_DEPTH} folders deep")


@pytest.mark.parametrize("location", ["w\0.bin", "/etc/passwd", "C:\\w.bin", "..\\w.bin",
                                      "sub/../real.bin", "../model/real.bin"])
def test_locations_refused_before_any_lookup(folder, walk, location):
    refused(folder, location)


@posix_only
@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads anything")
def test_unreadable_file_and_folder(folder, walk):
    (folder / "sub" / "real.bin").chmod(0)
    refused(folder, "sub/real.bin", "permission denied" if walk == "descriptor" else "")
    (folder / "sub").chmod(0)
    try:
        refused(folder, "sub/real.bin", "permission denied" if walk == "descriptor" else "")
    finally:
        (folder / "sub").chmod(0o755)


@posix_only
def test_refusals_leak_no_descriptors(folder, walk):
    os.symlink("../outside/secret.bin", folder / "sub" / "out.bin")
    os.symlink("a", folder / "a")
    os.mkfifo(folder / "sub" / "pipe")
    save(folder, "sub/out.bin")
    before = open_descriptors()
    for location in ("sub/out.bin", "a", "sub/pipe", "sub/missing", "real.bin/x"):
        with pytest.raises(ModelLoadError):
            load_model(save(folder, location))
    loads_weights(folder, "sub/real.bin")
    assert open_descriptors() == before


def test_the_by_name_fallback_catches_a_swap_between_check_and_open(folder, monkeypatch):
    """Between its check and its open the file is replaced: the identities differ."""
    monkeypatch.setattr(external_data, "WALK_BY_DESCRIPTOR", False)
    real_open = os.open

    def swapping_open(path, flags, *args, **kwargs):
        if str(path).endswith("real.bin"):
            os.replace(folder / "other.bin", folder / "real.bin")
        return real_open(path, flags, *args, **kwargs)

    (folder / "other.bin").write_bytes(OUTSIDE)
    monkeypatch.setattr(external_data, "os", SimpleNamespace(**{
        name: getattr(os, name) for name in dir(os) if not name.startswith("__")} | {"open": swapping_open}))
    refused(folder, "real.bin", "changed while it was being opened", mappings=(True,))


@pytest.mark.parametrize("field", ["location", "offset", "key"])
def test_external_data_that_is_not_utf8(folder, field):
    """Protobuf returns bytes for a string field that is not UTF-8; that is a corrupt model."""
    model = weight_model("real.bin", offset="0000")
    marker = {"location": b"real.bin", "offset": b"0000", "key": b"offset"}[field]
    data = model.SerializeToString()
    assert data.count(marker) == 1
    data = data.replace(marker, b"\xff" * len(marker))
    with pytest.raises(ModelLoadError, match="initializer 'W'.*not valid UTF-8"):
        load_model(data, base_dir=folder)


# --- offsets and lengths: ASCII decimal digits only ------------------------------------------------


@pytest.mark.parametrize("value", ["0_0", " 48 ", "+5", "-1", "", "٤٨", "４８", "1e2", "0x30", "48.0", "\t48",
                                   "48\n", "⁴⁸", "𝟒𝟖", "0b1"])
@pytest.mark.parametrize("key", ["offset", "length"])
def test_offsets_and_lengths_are_ascii_decimal(folder, key, value):
    message = refused(folder, None, f"{key}={value!r}", "digits 0-9", **{key: value})
    assert "not an integer" in message


def test_plain_numbers_with_leading_zeros_are_fine(folder):
    loaded = load_model(save(folder, "real.bin", offset="0000", length="048"))
    assert stored(loaded) == WEIGHTS


def test_a_number_no_file_can_reach_is_refused_without_converting_it(folder):
    refused(folder, None, "larger than any file", offset="9" * 5000)
    refused(folder, "real.bin", "has 48 bytes", length=str(2**63))


# --- the model file itself -------------------------------------------------------------------------


@posix_only
def test_model_path_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "model.onnx")
    with pytest.raises(ModelLoadError, match="FIFO"), no_hang():
        load_model(tmp_path / "model.onnx")


@posix_only
@pytest.mark.parametrize("make, pattern", [
    (lambda p: os.symlink(p.name, p), "model.onnx.*symbolic links"),
    (lambda p: (os.symlink("b", p), os.symlink(p.name, p.parent / "b")), "model.onnx.*symbolic links"),
    (lambda p: os.symlink("gone.onnx", p), "does not exist"),
])
def test_model_path_link_loops_and_dangling_links(tmp_path, make, pattern):
    make(tmp_path / "model.onnx")
    with pytest.raises(ModelLoadError, match=pattern):
        load_model(tmp_path / "model.onnx")


@pytest.mark.parametrize("name", ["x" * 300 + ".onnx", "d/" * 3000 + "m.onnx"])
def test_model_path_too_long(tmp_path, name):
    with pytest.raises(ModelLoadError, match="model file"):
        load_model(tmp_path / name)


# --- protobuf's nesting limit ------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [33, 40, 200])
def test_nesting_past_protobufs_limit_says_so(depth):
    with pytest.raises(ModelLoadError) as caught:
        load_model(nested_ifs(mlp_model(), depth))
    message = str(caught.value)
    assert "deeper than protobuf's parse limit" in message and "flatten" in message
    assert "truncated" not in message


@pytest.mark.parametrize("depth", [1, 20, 30])
def test_nesting_within_the_limit_loads(depth):
    model = load_model(nested_ifs(mlp_model(), depth))
    assert model.graph.node[0].op_type == "If"


def test_corrupt_bytes_still_say_corrupt():
    data = mlp_model().SerializeToString()
    with pytest.raises(ModelLoadError, match="truncated, corrupt, or not ONNX"):
        load_model(data[:-7])



def test_a_side_file_shrinking_during_the_read_is_a_load_error(folder, monkeypatch):
    """Reads are bounded by the length checked against fstat; a short read is not padded."""
    monkeypatch.setattr(external_data.os, "pread", lambda descriptor, length, offset: b"")
    refused(folder, "real.bin", "shrank while it was being read", mappings=(False,))
