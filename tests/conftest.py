"""Shared fixtures: one device per backend for the whole run, checked after every test for
messages from the Khronos validation layer (enabled by `make test`) on Vulkan, and for the errors
wgpu reports outside a call (its validation errors inside a call raise) on wgpu: either is a bug.

Every test that takes `device` runs on both backends; the wgpu ones are skipped, saying why,
where wgpu-py is not installed. wgpu runs over Vulkan here too (lavapipe), so the Khronos layer
also watches wgpu's own Vulkan calls; what it says about them reaches `validation_messages` only
if wgpu-native logs it at error level, otherwise the layer prints it (`pytest -s` shows it)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import vkml


@pytest.fixture(scope="session", params=["vulkan", "wgpu"])
def device(request):
    if request.param == "wgpu":
        pytest.importorskip("wgpu", reason="the wgpu backend needs `pip install vkml[wgpu]`")
    dev = vkml.Device(backend=request.param)
    yield dev
    dev.close()


@pytest.fixture(autouse=True)
def no_validation_messages(request):
    yield
    if "device" not in request.fixturenames:
        return
    messages = request.getfixturevalue("device").backend.validation_messages
    found = list(messages)
    messages.clear()
    assert not found, "validation layer reported:\n" + "\n".join(found)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def pytest_configure(config):
    # transformers imports torchvision where it is installed; beside a CPU torch that import
    # fails unless torchvision_compat declares the ops it cannot load (see there)
    from torchvision_compat import usable
    usable()


def pytest_report_header(config):
    layers = os.environ.get("VK_INSTANCE_LAYERS", "")
    return f"vkml: VK_INSTANCE_LAYERS={layers or '(none: validation off)'}"


def live_objects(device: vkml.Device) -> dict[str, int]:
    """What is alive on `device` (backend.live_objects()) once the sessions dropped without
    close() so far are freed: a garbage collection (sessions in reference cycles, such as
    those a failed test's traceback held), then the release a device call would run first.
    A baseline taken without it would change at the test's first call."""
    gc.collect()
    device.release_dropped()
    return device.backend.live_objects()


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python that must import vkml from this checkout
    (keeping any PYTHONPATH the packages themselves came from), plus `extra`."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join([repo, *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, **extra}


def rel_l2(actual, expected) -> float:
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.all(np.isfinite(actual)), "NaN or Inf in vkml's result"
    denom = np.linalg.norm(expected)
    return float(np.linalg.norm(actual - expected) / (denom if denom > 0 else 1.0))
