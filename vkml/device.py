"""The user's handle on a GPU: which backend runs the plans, and what it can do."""

from __future__ import annotations

import os

from .backend import Backend, Capabilities
from .errors import DeviceError

BACKENDS = ("auto", "vulkan", "wgpu")


class Device:
    """A GPU device owned by vkml.

    `selector` (or env VKML_DEVICE) picks one: an index in the backend's list or part of its
    name; by default a discrete GPU, then an integrated one, then a CPU driver such as lavapipe.
    `backend` (or env VKML_BACKEND when it is None) is "vulkan", "wgpu" (wgpu-py: Metal on macOS,
    also Vulkan, D3D12) or "auto": Vulkan where a Vulkan driver and device exist, else wgpu.
    """

    def __init__(self, selector: str | int | None = None, backend: str | None = None) -> None:
        choice = (backend or os.environ.get("VKML_BACKEND") or "auto").strip().lower()
        if choice not in BACKENDS:
            raise DeviceError(f"unknown backend {choice!r} (from the backend argument or "
                              f"VKML_BACKEND); choose one of {', '.join(BACKENDS)}")
        sel = None if selector is None else str(selector)
        self.backend_name = "wgpu" if choice == "wgpu" else "vulkan"
        if choice == "wgpu":
            self.backend: Backend = _wgpu(sel)
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

    @property
    def caps(self) -> Capabilities:
        return self.backend.caps

    @property
    def name(self) -> str:
        return self.caps.device_name

    def close(self) -> None:
        self.backend.close()

    def __repr__(self) -> str:
        c = self.caps
        api = f"Vulkan {c.api_version}" if self.backend_name == "vulkan" else c.api_version
        return f"<vkml.Device '{c.device_name}' ({c.device_type}, {api})>"


# The imports stay inside these helpers so `import vkml` needs neither `vulkan` nor `wgpu`.
def _vulkan(selector: str | None) -> Backend:
    from .vk import VulkanBackend

    return VulkanBackend(selector)


def _wgpu(selector: str | None) -> Backend:
    from .wgpu_backend import WgpuBackend

    return WgpuBackend(selector)


_default: Device | None = None


def default_device() -> Device:
    """One shared device per process for sessions compiled without `device=`."""
    global _default
    if _default is None:
        _default = Device()
    return _default
