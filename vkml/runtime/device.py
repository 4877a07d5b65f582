"""The user's handle on a GPU: which backend runs the plans, and what it can do; and where the
sessions dropped without close() are freed.

A session that becomes unreachable is not freed by the garbage collector itself: a finalizer
runs on whatever thread drops the last reference or collects the cycle, possibly while that
thread holds PipelinePool's lock (a non-reentrant lock taken again by a release) or while
another thread submits on the queue the host shares. So its finalizer only hands the device a
release (`on_drop`), which the device runs at a safe point: at the start of the next call of
any of its sessions, the next compile, `release_dropped()` and `close()`, as that session's
close() would, waiting for its GPU work.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from vkml.errors import DeviceError
from vkml.hal import Backend, Capabilities
from vkml.runtime.pipeline_pool import PipelinePool

BACKENDS = ("auto", "vulkan", "wgpu")


class Device:
    """A GPU device owned by vkml.

    `selector` (or env VKML_DEVICE) picks one: an index in the backend's list or part of its
    name; by default a discrete GPU, then an integrated one, then a CPU driver such as lavapipe.
    `backend` (or env VKML_BACKEND when it is None) is "vulkan", "wgpu" (wgpu-py: Metal on macOS,
    also Vulkan, D3D12) or "auto": Vulkan where a Vulkan driver and device exist, else wgpu.
    """

    def __init__(self, selector: str | int | None = None, backend: str | None = None) -> None:
        choice = backend or os.environ.get("VKML_BACKEND") or "auto"
        choice = choice.strip().lower() if isinstance(choice, str) else choice
        if choice not in BACKENDS:
            raise DeviceError(f"unknown backend {choice!r} (from the backend argument or "
                              f"VKML_BACKEND); choose one of {', '.join(BACKENDS)}")
        # Resolved here, not in a backend, so an explicit choice binds every backend "auto" may
        # try: a device no backend has is refused with their lists, never replaced by a default.
        if selector is None:
            selector = os.environ.get("VKML_DEVICE") or None
        sel = None if selector is None else str(selector)
        self.backend: Backend
        self.backend_name = "wgpu" if choice == "wgpu" else "vulkan"
        if choice == "wgpu":
            self.backend = _wgpu(sel)
        elif choice == "vulkan":
            self.backend = _vulkan(sel)
        else:
            try:
                self.backend = _vulkan(sel)
            except DeviceError as vulkan_error:
                try:
                    self.backend = _wgpu(sel)
                except DeviceError as wgpu_error:
                    raise DeviceError(f"no usable device. Vulkan: {vulkan_error}\nwgpu: "
                                      f"{wgpu_error}") from None
                self.backend_name = "wgpu"
        self._start()

    @classmethod
    def _on(cls, backend: Backend, backend_name: str) -> Device:
        """A Device on a backend opened on the host's device (from_vulkan, from_wgpu)."""
        self = cls.__new__(cls)
        self.backend, self.backend_name = backend, backend_name
        self._start()
        return self

    def _start(self) -> None:
        """What every constructor sets up once the backend is open."""
        self.pipelines = PipelinePool(self.backend)
        # Releases of dropped sessions, appended by their finalizers (deque.append takes no lock
        # Python code could hold), run by release_dropped(); its lock keeps two threads from
        # releasing at once (a dropped owner and its dropped sharer free the same arenas).
        self._dropped: collections.deque[Callable[[], None]] = collections.deque()
        self._releasing = threading.Lock()
        self._closed = False

    @classmethod
    def from_vulkan(cls, instance: Any, physical_device: Any, device: Any,
                    queue_family_index: int, queue: Any, queue_lock: Any = None, *,
                    enabled_features: Iterable[str] = (), enabled_extensions: Iterable[str] = (),
                    require: Iterable[str] = ()) -> Device:
        """Run vkml on a Vulkan device and queue the host created (a game engine, an OpenXR
        session). Handles are cffi handles of the `vulkan` package or plain integers (as
        pyopenxr hands them out).

        vkml never destroys these handles (close() releases only vkml's own buffers,
        pipelines, command buffers and semaphore) and enables nothing: Vulkan cannot report
        which features a device was created with, so the host declares them.
        `enabled_features`: names of VkPhysicalDeviceVulkan11/12Features and
        VkPhysicalDeviceCooperativeMatrixFeaturesKHR members it set (vkml uses
        "timelineSemaphore", "shaderFloat16", "storageBuffer16BitAccess", "vulkanMemoryModel",
        "cooperativeMatrix"); `enabled_extensions`: device extensions it enabled
        ("VK_KHR_cooperative_matrix"). Without "timelineSemaphore" vkml tracks its work with
        fences and `session.done()` is unavailable; without the f16/cooperative-matrix features
        it generates f32 kernels. `require`: names vkml must find declared, else DeviceError
        naming the missing one and how to enable it. A declared name the device does not
        support is an error too. The instance must be Vulkan 1.1 or newer.

        `queue_lock` (anything with the threading.Lock protocol) is held around every
        vkQueueSubmit vkml makes; the host must hold the same lock around its own submits and
        presents on this queue. Without one, vkml makes a lock: `device.queue_lock`.
        """
        from vkml.vk import VulkanBackend

        return cls._on(VulkanBackend.from_handles(
            instance, physical_device, device, queue_family_index, queue, queue_lock,
            enabled_features=enabled_features, enabled_extensions=enabled_extensions,
            require=require), "vulkan")

    @classmethod
    def from_wgpu(cls, device: Any) -> Device:
        """Run vkml on a wgpu.GPUDevice the host created (its renderer's, e.g. on Metal), so
        that sessions can bind the host's GPUBuffers and GPUTextures (Session.bind_input /
        bind_output) and share its queue, which orders vkml's submissions with the host's.

        vkml never destroys the device (close() releases only vkml's own buffers and
        pipelines) and uses it with the features and limits the host requested: "shader-f16"
        and "timestamp-query" where enabled, and WebGPU's default limits unless the host
        raised them (a large model may need the adapter's `max-storage-buffer-binding-size`,
        `max-buffer-size` and `max-storage-buffers-per-shader-stage`)."""
        from vkml.webgpu.backend import WgpuBackend

        return cls._on(WgpuBackend(adopt=device), "wgpu")

    @property
    def queue_lock(self) -> Any:
        """The lock held around every queue submission; a host sharing the queue holds it too."""
        return self.backend.queue_lock

    @property
    def closed(self) -> bool:
        """Whether close() was called: the device objects of all its sessions are gone."""
        return self._closed

    @property
    def adopted(self) -> bool:
        """Whether the device belongs to a host (Device.from_vulkan, Device.from_wgpu)."""
        return not self.backend.owned

    @property
    def caps(self) -> Capabilities:
        return self.backend.caps

    @property
    def name(self) -> str:
        return self.caps.device_name

    def on_drop(self, owner: object, release: Callable[[], None]) -> weakref.finalize:
        """Run `release` at this device's next safe point once `owner` is unreachable. The
        finalizer only queues it (no lock, no device call on the collector's thread).
        `release` must not refer to `owner`, or `owner` never becomes unreachable. Detach the
        returned finalizer when `owner` is freed by hand."""
        finalizer = weakref.finalize(owner, self._dropped.append, release)
        finalizer.atexit = False  # at exit the device is closed (or the process gone) anyway
        return finalizer

    def release_dropped(self) -> int:
        """Free what sessions dropped without close() still hold on the device (their buffers,
        programs, pipelines no live session uses), waiting for the work they submitted; returns
        how many were freed. Every session call, compile and close() does it first, so this is
        only needed to free them before the next such call (after gc.collect() where a session
        was in a reference cycle); close() is still how to free one session at once."""
        if not self._dropped:
            return 0
        freed = 0
        with self._releasing:
            if self._closed:  # the backend destroyed everything
                self._dropped.clear()
                return 0
            while self._dropped:
                self._dropped.popleft()()
                freed += 1
        return freed

    def close(self) -> None:
        """Free every session's device objects and the device (the host's handles stay, see
        from_vulkan); sessions of this device fail afterwards."""
        try:
            self.release_dropped()
        finally:
            self._closed = True
            self.backend.close()

    def __repr__(self) -> str:
        c = self.caps
        api = f"Vulkan {c.api_version}" if self.backend_name == "vulkan" else c.api_version
        return f"<vkml.Device '{c.device_name}' ({c.device_type}, {api})>"


# The imports stay inside these helpers so `import vkml` needs neither `vulkan` nor `wgpu`.
def _vulkan(selector: str | None) -> Backend:
    from vkml.vk import VulkanBackend

    return VulkanBackend(selector)


def _wgpu(selector: str | None) -> Backend:
    from vkml.webgpu.backend import WgpuBackend

    return WgpuBackend(selector)


_default: Device | None = None


def default_device() -> Device:
    """One shared device per process for sessions compiled without `device=` (a new one once
    that one was closed: compile(g) after session.device.close() raised that it was)."""
    global _default
    if _default is None or _default.closed:
        _default = Device()
    return _default
