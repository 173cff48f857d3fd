"""After a long compilation the C heap's free pages go back to the system (onnxtrain._engine.heap)."""

import ctypes
import sys

import jax
import pytest
import numpy as np
from jax._src import monitoring as jax_monitoring
from jax import monitoring

from onnxtrain._engine import heap
from onnxtrain._engine.compiled import Compiled, ProgramLimit

pytestmark = pytest.mark.skipif(heap._TRIM is None, reason="this C library has no malloc_trim")


@pytest.fixture
def trims(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "_TRIM", lambda pad: calls.append(pad) or 1)
    return calls


def test_installed_by_every_compiled_function():
    Compiled(lambda feeds: feeds, "test", ProgramLimit(), feeds_argnum=0)
    assert heap._installed
    assert heap._after_compile in jax_monitoring.get_event_duration_listeners()


def test_trims_after_a_long_compilation_only(trims):
    heap.trim_after_long_compilations()
    monitoring.record_event_duration_secs(heap._COMPILE_EVENT, heap.TRIM_AFTER_S + 0.5)
    monitoring.record_event_duration_secs(heap._COMPILE_EVENT, heap.TRIM_AFTER_S / 10)
    monitoring.record_event_duration_secs("/jax/some/other/event", 60.0)
    assert trims == [0]


def test_event_fires_between_compiling_and_running(trims, monkeypatch):
    """JAX records the event when the compiler returns, before the program runs: the
    trim then frees the compiler's scratch before the program's buffers are allocated."""
    heap.trim_after_long_compilations()
    monkeypatch.setattr(heap, "TRIM_AFTER_S", 0.0)
    order = []
    monkeypatch.setattr(heap, "_TRIM", lambda pad: order.append("trim") or 1)

    def traced(x):
        jax.debug.callback(lambda: order.append("run"))
        return x + 1

    jax.jit(traced)(np.arange(3.0)).block_until_ready()
    assert order == ["trim", "run"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_real_trim_returns_an_int():
    assert isinstance(ctypes.CDLL(None).malloc_trim(0), int)
