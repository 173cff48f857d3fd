"""Compiled programs kept on disk, so a new process runs its first step without tracing,
lowering or compiling it.

JAX's persistent cache (compilation_cache.py) finds an executable by its lowered program, so
a warm start still traces and lowers every program (seconds on a deep model) before XLA
rebuilds the executable from its cached form. This cache finds a serialized executable by
what fixes the program before any tracing:

    front      the front end's fingerprint: the model's content digest and its options
    program    which of the front end's programs (identity, function, jit options)
    arguments  the arguments' structure, shapes, dtypes and shardings
    the rest   onnxtrain's own source, jax and jaxlib, the backend and its devices, the CPU's
               features, the compiler options, XLA_FLAGS and JAX's configuration

A cache entry is code: loading it runs what it holds. So entries are read only from a folder
this user owns and no one else can write, an entry's header must repeat every key part it
was stored under, and its payload must match the header's checksum. An entry failing any
check costs one warning and a compile, never an error. Entries are written atomically; the
least recently used go once the folder passes its size bound.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import platform
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from jax import tree_util
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache.compilation_cache import reset_cache

from onnxtrain._engine.faults import Faults
from onnxtrain.state import atomic
from onnxtrain.translate.compiler_options import xla_compiler_options

logger = logging.getLogger("onnxtrain")

FORMAT = "onnxtrain-executable-1"
MAGIC = b"ONNXTRAIN-EXECUTABLE\n"
SUFFIX = ".executable"
# Room for a few dozen full-size models' programs; the least recently used go beyond it.
DEFAULT_MAX_BYTES = 4 * 2**30
# JAX settings that never change what a program computes: caches, logs and dumps.
_IRRELEVANT_CONFIG = ("cache", "log", "dump", "traceback", "pprint", "verbose", "explain", "timeout")
_PACKAGES = ("onnxtrain", "onnxtrain.translate", "onnxtrain.state", "onnxtrain.proto")


@functools.cache
def _source_digest() -> str:
    """sha256 of onnxtrain's Python source: a changed handler must not reuse old programs."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        root = Path(sys.modules[package].__path__[0])
        for folder, subfolders, files in os.walk(root):
            subfolders.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    path = Path(folder) / name
                    digest.update(f"{package}/{path.relative_to(root)}".encode())
                    digest.update(path.read_bytes())
    return digest.hexdigest()


def _cpu_features() -> str:
    """The host CPU's model and feature flags: XLA:CPU compiles for the features it finds."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            lines = [line for line in handle if line.startswith(("flags", "Features", "model name"))]
        described = "".join(dict.fromkeys(lines))
    except OSError:
        described = ""
    return hashlib.sha256(f"{platform.machine()}|{platform.processor()}|{described}".encode()).hexdigest()


@functools.cache
def _host_parts() -> dict[str, str]:
    import jaxlib

    device = jax.devices()[0]
    return {"format": FORMAT, "onnxtrain": _source_digest(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "python": platform.python_version(),
            "backend": f"{device.platform} {device.client.platform_version}",
            "devices": f"{len(jax.devices())} x {device.device_kind}", "cpu": _cpu_features()}


def environment_parts() -> dict[str, str]:
    """The key parts that come from this process and host, not from the program."""
    config = {name: repr(getattr(jax.config, name, value)) for name, value in sorted(jax.config.values.items())
              if not any(word in name for word in _IRRELEVANT_CONFIG)}
    return {**_host_parts(), "compiler": repr(xla_compiler_options()),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "config": hashlib.sha256(json.dumps(config).encode()).hexdigest()}


def argument_signature(args: tuple) -> str:
    """The arguments' tree, and each leaf's shape, dtype, weak type and sharding."""
    leaves, tree = jax.tree.flatten(args)
    described = [str(tree)]
    for leaf in leaves:
        aval = jax.typeof(leaf)
        sharding = getattr(leaf, "sharding", None)
        described.append(f"{aval.str_short()}|{getattr(aval, 'weak_type', False)}|{sharding}")
    return hashlib.sha256("\n".join(described).encode()).hexdigest()


def _private_folder(folder: Path) -> str | None:
    """Why `folder` is not one this user alone can write, or None when it is."""
    try:
        status = folder.stat()
    except OSError as error:
        return f"it cannot be read ({error.strerror})"
    if hasattr(os, "getuid") and status.st_uid != os.getuid():
        return "another user owns it"
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"others can write it (mode {stat.filemode(status.st_mode)})"
    return None


_fresh_lock = threading.Lock()
_fresh_compiles = 0
_jax_cache_was_enabled = True


@contextmanager
def fresh_compiles() -> Iterator[None]:
    """JAX's persistent cache off for the compiles inside (threads count, the last one out
    turns it back on): on XLA:CPU (jaxlib 0.10) an executable that JAX loaded from its cache
    serializes without the code of its kernels, so an entry stored here must be compiled afresh."""
    global _fresh_compiles, _jax_cache_was_enabled
    with _fresh_lock:
        if _fresh_compiles == 0:
            _jax_cache_was_enabled = jax.config.jax_enable_compilation_cache
            jax.config.update("jax_enable_compilation_cache", False)
            reset_cache()   # JAX decides once whether its cache is used; make it decide again
        _fresh_compiles += 1
    try:
        yield
    finally:
        with _fresh_lock:
            _fresh_compiles -= 1
            if _fresh_compiles == 0:
                jax.config.update("jax_enable_compilation_cache", _jax_cache_was_enabled)
                reset_cache()


@dataclass(frozen=True)
class Entry:
    """What a cache hit gives: the loaded executable and what its tracing left behind."""

    executable: jax.stages.Compiled
    memo: Any


class ExecutableCache:
    """Serialized executables in one private folder, bounded in size."""

    def __init__(self, folder: Path, max_bytes: int = DEFAULT_MAX_BYTES):
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self._warned = False

    @classmethod
    def open(cls, folder: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> ExecutableCache | None:
        """The cache in `folder` (created owner-only), or None, said once in the log, where the
        folder cannot be made or others can write it."""
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as error:
            logger.warning("executable cache disabled: cannot create %s (%s)", folder, error.strerror)
            return None
        problem = _private_folder(folder)
        if problem is not None:
            # Loading an entry runs it, so a folder others can write would let them run code as you.
            logger.warning("executable cache disabled: %s is not private (%s); programs compile in each "
                           "new process. Make it yours alone (chmod go-w) or set ONNXTRAIN_COMPILATION_CACHE "
                           "to a folder of your own.", folder, problem)
            return None
        return cls(folder, max_bytes)

    def key(self, parts: Mapping[str, str]) -> str:
        """The entry name of these key parts."""
        return hashlib.sha256(json.dumps(dict(parts), sort_keys=True).encode()).hexdigest()

    def holds(self, parts: Mapping[str, str]) -> bool:
        """Whether an entry is stored under `parts` (not yet whether it will load)."""
        return (self.folder / f"{self.key(parts)}{SUFFIX}").is_file()

    def load(self, parts: Mapping[str, str]) -> Entry | None:
        """The entry stored under `parts`, or None (a miss, or an entry refused with one warning
        and removed)."""
        path = self.folder / f"{self.key(parts)}{SUFFIX}"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            self._refuse(path, f"it cannot be read ({error.strerror})")
            return None
        try:
            entry = self._entry(path, data, parts)
        except Exception as error:  # noqa: BLE001 - a damaged entry of any kind costs a compile, never a crash
            self._refuse(path, str(error) or type(error).__name__)
            return None
        try:
            os.utime(path)   # recently used: the size bound evicts others first
        except OSError:
            pass
        return entry

    def _entry(self, path: Path, data: bytes, parts: Mapping[str, str]) -> Entry:
        problem = _private_folder(self.folder) or _foreign_file(path)
        if problem is not None:
            raise ValueError(f"the folder or entry is not private: {problem}")
        if not data.startswith(MAGIC):
            raise ValueError("it is not an onnxtrain executable")
        stream = io.BytesIO(data[len(MAGIC):])
        header = json.loads(stream.readline())
        if header.get("parts") != dict(parts):
            changed = sorted(name for name in {*parts, *header.get("parts", {})}
                             if header.get("parts", {}).get(name) != parts.get(name))
            raise ValueError(f"it was stored for another {', '.join(changed)}")
        payload = stream.read()
        if len(payload) != header.get("size") or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            raise ValueError("it is truncated or damaged (size or checksum differs)")
        in_tree, out_tree = _decoded_tree(header["in_tree"]), _decoded_tree(header["out_tree"])
        return Entry(serialize_executable.deserialize_and_load(payload, in_tree, out_tree), header["memo"])

    def store(self, parts: Mapping[str, str], executable: jax.stages.Compiled, memo: Any) -> None:
        """Keep `executable` (and `memo`, plain JSON values) under `parts`; an executable that
        cannot be serialized, or a folder that cannot be written, is skipped with a note in the log."""
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(executable)
            header = json.dumps({"parts": dict(parts), "size": len(payload),
                                 "sha256": hashlib.sha256(payload).hexdigest(), "memo": memo,
                                 "in_tree": _encoded_tree(in_tree), "out_tree": _encoded_tree(out_tree)},
                                sort_keys=True).encode()
        except Exception as error:  # noqa: BLE001 - the program still runs; only its reuse is lost
            logger.debug("executable cache: a program cannot be serialized (%s)", error)
            return
        path = self.folder / f"{self.key(parts)}{SUFFIX}"
        try:
            atomic.write_atomically(path, lambda handle: handle.write(MAGIC + header + b"\n" + payload))
        except OSError as error:
            logger.debug("executable cache: cannot write %s (%s)", path, error)
            return
        self._bound()

    def _bound(self) -> None:
        """Remove the least recently used entries until the folder fits max_bytes."""
        entries = []
        for path in self.folder.glob(f"*{SUFFIX}"):
            try:
                status = path.stat()
            except OSError:
                continue
            entries.append((status.st_mtime, status.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size

    def _refuse(self, path: Path, why: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("executable cache: entry %s is not used (%s); the program compiles instead, and "
                           "the entry is removed", path.name, why)
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass


# The node types of onnxtrain's programs' argument and result trees, by the name an entry uses.
_NODES: dict[str, type] = {"tuple": tuple, "list": list, "dict": dict, "none": type(None), "faults": Faults}
_NODE_NAMES = {node: name for name, node in _NODES.items()}
_LEAF = "*"


def _encoded_tree(tree: Any) -> Any:
    """A pytree structure as JSON values (entries hold no pickles); TypeError for a node type
    outside _NODES, which leaves that program out of the cache."""
    if tree_util.treedef_is_leaf(tree) and tree.num_leaves == 1:
        return _LEAF
    node, data = tree.node_data()
    if node not in _NODE_NAMES or (data is not None and not all(isinstance(key, str) for key in data)):
        raise TypeError(f"a program's tree holds a {node.__name__} node, which the cache does not store")
    return [_NODE_NAMES[node], data, [_encoded_tree(child) for child in tree.children()]]


def _decoded_tree(encoded: Any) -> Any:
    if encoded == _LEAF:
        return tree_util.tree_structure(0)
    name, data, children = encoded
    return tree_util.PyTreeDef.from_node_data_and_children(
        tree_util.default_registry, (_NODES[name], data), [_decoded_tree(child) for child in children])


def _foreign_file(path: Path) -> str | None:
    status = path.stat()
    if hasattr(os, "getuid") and status.st_uid != os.getuid():
        return "another user owns the entry"
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "others can write the entry"
    return None


@dataclass(frozen=True)
class ProgramCache:
    """The executable cache as one front end uses it: its fingerprint names its programs."""

    cache: ExecutableCache
    front: str

    def parts(self, program: str, args: tuple) -> dict[str, str]:
        """Every key part of `program` (an identity unique within the front end) called with `args`."""
        return {**environment_parts(), "front": self.front, "program": program,
                "arguments": argument_signature(args)}


def program_name(identity: str, function: Callable, options: Mapping[str, Any]) -> str:
    """A program's name within its front end: what it is, the function and the jit options."""
    return f"{identity}|{getattr(function, '__qualname__', repr(function))}|{sorted(options.items())!r}"
