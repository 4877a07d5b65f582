"""An unwritable VKML_CACHE_DIR is one warning and in-memory caches, never a crash: naga's SPIR-V
and compiled-wasm caches, and the Vulkan pipeline cache file written when a device closes.

"Unwritable" is a regular file standing where the directory should be: that fails for root too
(these tests run as root in CI, where permission bits would not stop a write)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import vkml
from vkml import nn
from vkml.cachedir import CacheWarning
from vkml.vk import naga

KERNEL = """@group(0) @binding(0) var<storage, read_write> data: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    if (id.x < arrayLength(&data)) {{ data[id.x] = data[id.x] * {scale}; }}
}}
"""


@pytest.fixture
def blocked(tmp_path: Path) -> Path:
    (tmp_path / "a_file").write_text("not a directory")
    return tmp_path / "a_file" / "vkml_cache"


@contextlib.contextmanager
def cache_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """The CacheWarnings raised inside the block, whatever the warning filters say."""
    found: list[warnings.WarningMessage] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield found
    found += [w for w in caught if issubclass(w.category, CacheWarning)]


@pytest.fixture(autouse=True)
def _fresh_default_compiler() -> Iterator[None]:
    naga._reset_for_tests()  # the process-wide compiler re-reads VKML_CACHE_DIR
    yield
    naga._reset_for_tests()


def test_naga_compiles_and_memoizes_with_an_unwritable_cache(blocked):
    compiler = naga.Compiler(cache_dir=blocked)
    with cache_warnings() as found:
        first = compiler.compile(KERNEL.format(scale="2.0"), "double")
        second = compiler.compile(KERNEL.format(scale="3.0"), "triple")  # wasm module reused
        assert compiler.compile(KERNEL.format(scale="2.0"), "double") == first
    assert first[:4] == second[:4] == naga.SPIRV_MAGIC.to_bytes(4, "little")
    assert compiler.stats["compiles"] == 2 and compiler.stats["memory_hits"] == 1
    assert compiler.stats["module_compiles"] == 1  # kept in memory: not compiled again
    # Three failed writes (compiled module, two SPIR-V files), one warning.
    assert len(found) == 1, [str(w.message) for w in found]
    assert str(blocked) in str(found[0].message) and "VKML_CACHE_DIR" in str(found[0].message)
    assert not blocked.exists()


def train_a_step(device: vkml.Device) -> float:
    # 5 -> 3 features: shapes no shipped kernel has, so naga translates (and tries to cache).
    g = vkml.Graph(seed=0)
    x, y = g.input("x", (4, 5)), g.input("y", (4, 3))
    loss = g.mse(nn.Linear(g, "fc", 5, 3)(x), y)
    session = vkml.compile(g, loss=loss, optimizer=vkml.SGD(lr=0.1), device=device)
    session.set_input("x", np.ones((4, 5), np.float32))
    session.set_input("y", np.zeros((4, 3), np.float32))
    session.step()
    value = float(session.read("loss"))
    session.close()
    return value


def test_one_warning_for_naga_and_pipeline_caches_together(blocked, monkeypatch):
    monkeypatch.setenv("VKML_CACHE_DIR", str(blocked))
    with cache_warnings() as found:
        device = vkml.Device(backend="vulkan")
        try:
            assert np.isfinite(train_a_step(device))
            assert naga.cache_stats()["compiles"] > 0  # naga did try to write
            assert device.backend.validation_messages == []
        finally:
            device.close()  # saves the pipeline cache: fails too, but already warned
    assert len(found) == 1, [str(w.message) for w in found]
    assert str(blocked) in str(found[0].message)


def test_pipeline_cache_file_unwritable_warns_at_close(tmp_path, blocked, monkeypatch):
    # naga's process-wide compiler gets a writable directory; only the device's is blocked.
    monkeypatch.setenv("VKML_CACHE_DIR", str(tmp_path / "naga_cache"))
    naga.cache_stats()
    monkeypatch.setenv("VKML_CACHE_DIR", str(blocked))
    with cache_warnings() as found:
        device = vkml.Device(backend="vulkan")
        try:
            assert np.isfinite(train_a_step(device))
            assert device.backend.validation_messages == []
        finally:
            device.close()
    assert len(found) == 1, [str(w.message) for w in found]
    assert str(blocked) in str(found[0].message)
