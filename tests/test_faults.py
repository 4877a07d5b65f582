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
from vkml import nn
from vkml.cachedir import ENTRY_MAGIC, CorruptCacheWarning, read_entry, write_entry
from vkml.compiler import memory_plan
from vkml.errors import DeviceError
from vkml.vk import naga

HEADER = len(ENTRY_MAGIC) + 32


# ---- corrupted caches ------------------------------------------------------------------------
@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cache directory of this test's own, holding nothing but naga's compiled wasm module
    where the usual cache directory has it intact (it takes seconds to compile), and a naga
    compiler that reads it."""
    warm = naga._compiler()._module_path()
    module = read_entry(warm)
    monkeypatch.setenv("VKML_CACHE_DIR", str(tmp_path))
    naga._reset_for_tests()
    if module is not None:
        write_entry(naga._compiler()._module_path(), module, tmp_path)
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


def kind_of(cache: Path, path: Path) -> str:
    parts = path.relative_to(cache).parts
    return parts[0] if len(parts) > 1 else path.name.split("-")[0]


def entries(cache: Path) -> dict[str, list[Path]]:
    """The cache's files by kind: plans, spirv, wasm, pipelines."""
    found: dict[str, list[Path]] = {}
    for path in sorted(cache.rglob("*")):
        if path.is_file() and not path.name.endswith(".tmp"):
            found.setdefault(kind_of(cache, path), []).append(path)
    return found


def rerun_reporting(files: list[Path]) -> float:
    """train_in_a_fresh_process_state() with `files` damaged: the loss, after checking that each
    file was reported once, by name, and nothing else was, and that each was written again."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = train_in_a_fresh_process_state()
    reported = [str(w.message) for w in caught if w.category is CorruptCacheWarning]
    for path in files:
        assert sum(str(path) in m for m in reported) == 1, (path, reported)
    assert len(reported) == len(files), reported
    for path in files:  # written again, intact: the next process finds them
        assert read_entry(path) is not None, path
    return loss


def cut_in_half(data: bytes, rng: np.random.Generator) -> bytes:
    return data[: len(data) // 2]


def flip_bits(data: bytes, rng: np.random.Generator) -> bytes:
    """Eight bits flipped in the entry's contents (behind the header)."""
    out = bytearray(data)
    for pos in rng.integers(HEADER, len(data), 8):
        out[pos] ^= 1 << int(rng.integers(8))
    return bytes(out)


# Every file cut in half, naga's compiled module included (compiled again: seconds); bits
# flipped in every file but that one.
CORRUPTIONS = {"cut_in_half": (cut_in_half, {"plans", "spirv", "wasm", "pipelines"}),
               "bits_flipped": (flip_bits, {"plans", "spirv", "pipelines"})}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_damaged_cache_entry_is_dropped_reported_and_compiled_again(cache, corruption):
    corrupt, kinds = CORRUPTIONS[corruption]
    clean = train_in_a_fresh_process_state()
    found = entries(cache)
    assert set(found) == {"plans", "spirv", "wasm", "pipelines"}, found
    rng = np.random.default_rng(0)
    files = [path for kind in sorted(kinds) for path in found[kind]]
    for path in files:
        path.write_bytes(corrupt(path.read_bytes(), rng))
    assert rerun_reporting(files) == clean


def float_constants_changed(spirv: bytes) -> bytes:
    """`spirv` with every 32-bit float OpConstant doubled plus one: still valid SPIR-V."""
    words = np.frombuffer(spirv, np.uint32).copy()
    float32_types, at = set(), 5  # after the module's header
    while at < len(words):
        count, opcode = int(words[at]) >> 16, int(words[at]) & 0xFFFF
        if opcode == 22 and words[at + 2] == 32:  # OpTypeFloat %result 32
            float32_types.add(int(words[at + 1]))
        elif opcode == 43 and count == 4 and int(words[at + 1]) in float32_types:  # OpConstant
            value = words[at + 3:at + 4].view(np.float32)
            words[at + 3:at + 4] = (value * 2 + 1).view(np.uint32)
        at += count
    return words.tobytes()


def test_a_valid_but_changed_spirv_entry_is_not_used(cache):
    clean = train_in_a_fresh_process_state()
    changed = {}
    for path in entries(cache)["spirv"]:
        spirv = read_entry(path)
        if float_constants_changed(spirv) != spirv:  # a module with float constants
            changed[path] = float_constants_changed(spirv)
    assert changed
    for path, spirv in changed.items():  # as an edit in place leaves them: the old digest
        path.write_bytes(path.read_bytes()[:HEADER] + spirv)
    assert rerun_reporting(list(changed)) == clean
    # The control: the same SPIR-V with digests to match is used, and the loss differs.
    for path, spirv in changed.items():
        write_entry(path, spirv, cache)
    assert train_in_a_fresh_process_state() != clean


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
