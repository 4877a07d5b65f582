"""Faults injected on purpose: each must end in a clear error or a warning and a correct result,
never a crash, a silently wrong answer, a leak or lost data (the README's "What vkml
guarantees").

- corrupted cache entries (cut short, bits flipped, a constant changed in valid SPIR-V): each
  dropped, reported once by name, compiled again; the loss equals the clean run's exactly;
- out of device memory (or any other failure) at any point of binding a compiled plan: the
  error is raised and everything made before it is freed, so a smaller model compiles next;
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import vkml
from vkml import naga, nn
from vkml.compiler import memory_plan
from vkml.cachedir import ENTRY_MAGIC, CorruptCacheWarning, read_entry
from vkml.errors import DeviceError

HEADER = len(ENTRY_MAGIC) + 32


# ---- corrupted caches ------------------------------------------------------------------------
@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty cache directory of this test's own, and a naga compiler that reads it."""
    monkeypatch.setenv("VKML_CACHE_DIR", str(tmp_path))
    naga._reset_for_tests()
    yield tmp_path
    naga._reset_for_tests()


def train_in_a_fresh_process_state() -> float:
    """Two SGD steps of a model with shapes no shipped kernel has (so naga translates), on a
    device of its own (so its pipeline cache is read and written), with naga's in-memory caches
    forgotten: everything comes from the cache directory or is compiled again. The loss after
    them, which depends on every kernel's SPIR-V."""
    naga._reset_for_tests()
    device = vkml.Device(backend="vulkan")
    try:
        g = vkml.Graph(seed=0)
        x, y = g.input("x", (4, 5)), g.input("y", (4, 3))
        loss = g.mse(nn.Linear(g, "fc", 5, 3)(nn.Linear(g, "fc0", 5, 5)(x).tanh()), y)
        session = vkml.compile(g, loss=loss, optimizer=vkml.SGD(lr=0.1), device=device)
        rng = np.random.default_rng(0)
        session.set_input("x", rng.standard_normal((4, 5)).astype(np.float32))
        session.set_input("y", rng.standard_normal((4, 3)).astype(np.float32))
        session.step()
        session.step()
        value = float(session.read("loss"))
        assert device.backend.validation_messages == []
        session.close()
    finally:
        device.close()  # writes the pipeline cache
    for thread in threading.enumerate():  # the plan cache's writer
        if thread.name == "vkml-plan-cache":
            thread.join()
    return value


def cut_in_half(data: bytes, rng: np.random.Generator) -> bytes:
    return data[: len(data) // 2]


def flip_bits(data: bytes, rng: np.random.Generator) -> bytes:
    """Eight bits flipped in the entry's contents (behind the header)."""
    out = bytearray(data)
    for pos in rng.integers(HEADER, len(data), 8):
        out[pos] ^= 1 << int(rng.integers(8))
    return bytes(out)


CORRUPTIONS: dict[str, Callable[[bytes, np.random.Generator], bytes]] = {
    "cut_in_half": cut_in_half, "bits_flipped": flip_bits}


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".tmp"))


@pytest.mark.parametrize("corrupt", CORRUPTIONS)
def test_a_corrupted_cache_is_dropped_reported_and_compiled_again(cache, corrupt):
    clean = train_in_a_fresh_process_state()
    files = entries(cache)
    kinds = {p.relative_to(cache).parts[0] if len(p.relative_to(cache).parts) > 1
             else p.name.split("-")[0] for p in files}
    assert kinds == {"plans", "spirv", "wasm", "pipelines"}, files
    rng = np.random.default_rng(0)
    for path in files:
        path.write_bytes(CORRUPTIONS[corrupt](path.read_bytes(), rng))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train_in_a_fresh_process_state() == clean
    reported = [str(w.message) for w in caught if w.category is CorruptCacheWarning]
    for path in files:  # each once, by name
        assert sum(str(path) in m for m in reported) == 1, (path, reported)
    assert len(reported) == len(files), reported
    for path in files:  # written again, intact: the next process finds them
        assert read_entry(path) is not None, path


# ---- failures while binding a plan -----------------------------------------------------------
# What binding makes on the device, one object per call.
MAKERS = ("create_buffer", "create_pipeline", "record")


def small_training_session(device: vkml.Device, width: int) -> vkml.Session:
    g = vkml.Graph(seed=0)
    x, y = g.input("x", (2, width)), g.input("y", (2, 3))
    loss = g.mse(nn.Linear(g, "fc", width, 3)(x).relu(), y)
    return vkml.compile(g, loss=loss, optimizer=vkml.Adam(lr=0.1), device=device)


def test_a_failure_at_any_point_of_binding_frees_everything_made_before_it(device, monkeypatch):
    """Each call that makes a device object (a buffer, a pipeline, a program) fails in turn, as
    an out-of-memory would: the compile raises it, and what it had made is gone."""
    # Arenas of at most 1 KiB, so that the plan has several (models have several of 1 GiB),
    # and no plan cache to keep such a plan.
    monkeypatch.setattr(memory_plan, "ARENA_LIMIT", 1024)
    monkeypatch.setenv("VKML_PLAN_CACHE", "0")
    backend = device.backend
    baseline = backend.live_objects()
    calls: list[str] = []
    fail_at: list[int] = []  # the number of the call that fails, if any
    lock = threading.Lock()  # pipelines may be made in several threads

    def injected(name: str, make: Callable) -> Callable:
        def call(*args, **kwargs):
            with lock:
                calls.append(name)
                failing = fail_at and len(calls) == fail_at[0]
            if failing:
                raise DeviceError(f"out of memory (injected, call {len(calls)}: {name})")
            return make(*args, **kwargs)
        return call

    for name in MAKERS:
        monkeypatch.setattr(backend, name, injected(name, getattr(backend, name)))
    session = small_training_session(device, 7)
    assert len(session.plan.memory.arena_bytes) > 1
    session.close()
    made = list(calls)
    assert set(made) == set(MAKERS), made
    for n in range(1, len(made) + 1):
        calls.clear()
        fail_at[:] = [n]
        with pytest.raises(DeviceError, match=f"injected, call {n}:"):
            small_training_session(device, 7)
        assert backend.live_objects() == baseline, (n, made[n - 1])
    fail_at.clear()
    session = small_training_session(device, 5)  # and the device is as good as new
    session.set_input("x", np.ones((2, 5), np.float32))
    session.set_input("y", np.ones((2, 3), np.float32))
    session.step()
    assert np.isfinite(session.read("loss"))
    session.close()
    assert backend.live_objects() == baseline
