"""The user's handle on a GPU: which backend runs the plans, and what it can do."""

from __future__ import annotations

from .backend import Backend, Capabilities


class Device:
    """A Vulkan device owned by vkml. `selector` (or env VKML_DEVICE) picks one: an index in
    the driver's list or part of its name; by default a discrete GPU, then an integrated one,
    then a CPU driver such as lavapipe."""

    def __init__(self, selector: str | int | None = None) -> None:
        from .vk import VulkanBackend  # the only route to `vulkan`, so `import vkml` needs no GPU

        self.backend: Backend = VulkanBackend(None if selector is None else str(selector))

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
        return f"<vkml.Device '{c.device_name}' ({c.device_type}, Vulkan {c.api_version})>"


_default: Device | None = None


def default_device() -> Device:
    """One shared device per process for sessions compiled without `device=`."""
    global _default
    if _default is None:
        _default = Device()
    return _default
