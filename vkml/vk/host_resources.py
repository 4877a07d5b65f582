"""A host application's VkBuffers and VkImages in vkml's programs (the backend's `host_resources`).

Vulkan cannot report a buffer's size or usage, an image's format, extent or layout, or which
device a non-dispatchable handle belongs to, so the host declares them; what the driver can tell
is checked (the memory the resource needs holds the declared size) and everything else is checked
against the declaration before any command uses the handle."""

from __future__ import annotations

import numbers
from typing import Any

from vkml.errors import InputError
from vkml.hal import FORMATS
from vkml.vk.buffers import Buffer
from vkml.vk.context import as_handle

# VkFormat of each format name (the Vulkan spec's numbers).
VK_FORMATS = {"rgba8_unorm": 37, "rgba8_srgb": 43, "rgba16_float": 97, "r32_float": 100}
TRANSFER_SRC, TRANSFER_DST = 0x1, 0x2  # the same bit in VkBufferUsageFlags and VkImageUsageFlags
USAGE = {"read": (TRANSFER_SRC, "TRANSFER_SRC"), "write": (TRANSFER_DST, "TRANSFER_DST")}
# Layouts a host image may be in while a vkml program runs (and is left in).
LAYOUTS = {1: "GENERAL", 2: "COLOR_ATTACHMENT_OPTIMAL", 5: "SHADER_READ_ONLY_OPTIMAL",
           6: "TRANSFER_SRC_OPTIMAL", 7: "TRANSFER_DST_OPTIMAL", 1000001002: "PRESENT_SRC_KHR"}


def raw_handle(ffi: Any, handle: Any, ctype: str, what: str) -> int:
    """A non-dispatchable handle (VkBuffer, VkImage, VkSemaphore) as an integer, from a `vulkan`
    cffi handle or an int; InputError naming `what` for anything else or a null handle."""
    if isinstance(handle, ffi.CData):
        raw = int(ffi.cast("uintptr_t", handle))
    elif isinstance(handle, numbers.Integral) and not isinstance(handle, bool):
        raw = int(handle)
    else:
        raise InputError(f"{what}: expected a {ctype} (a `vulkan` cffi handle or an int), "
                         f"got {type(handle).__name__}")
    if raw == 0:
        raise InputError(f"{what}: a null {ctype}")
    return raw


class ImportedImage:
    """A host's VkImage as vkml uses it: its handle and what the host declared."""

    __slots__ = ("extent", "format", "handle", "label", "layout", "texel_bytes")

    def __init__(self, handle: Any, format: str, extent: tuple[int, int], layout: int,
                 label: str) -> None:
        self.handle, self.format, self.extent, self.layout = handle, format, extent, layout
        self.texel_bytes = FORMATS[format]
        self.label = label

    def __repr__(self) -> str:
        return f"<vk.ImportedImage {self.label!r} {self.format} {self.extent[0]}x{self.extent[1]}>"


class HostResources:
    """The `host_resources` capability of a VulkanBackend."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def buffer(self, handle: Any, device: Any, nbytes: int, usage: int, access: str,
               what: str) -> Buffer:
        b = self._backend
        raw = self._check_common(handle, "VkBuffer", device, usage, access, what)
        if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes <= 0:
            raise InputError(f"{what}: nbytes must be the buffer's size in bytes (a positive "
                             f"int, its VkBufferCreateInfo.size), got {nbytes!r}")
        ffi = b._ffi
        cast = ffi.cast("VkBuffer", raw)
        req = ffi.new("VkMemoryRequirements*")
        b._lib.vkGetBufferMemoryRequirements(b._device, cast, req)
        if req.size < nbytes:
            raise InputError(f"{what}: declared nbytes={nbytes}, but the buffer needs only "
                             f"{req.size} bytes of memory, so it is smaller: declare the size "
                             "it was created with")
        buf = Buffer(cast, None, int(nbytes), what, "device", None, False)
        b._host_objects.add(buf)
        return buf

    def image(self, handle: Any, device: Any, format: str, extent: tuple[int, int], usage: int,
              layout: int, access: str, what: str) -> ImportedImage:
        b = self._backend
        raw = self._check_common(handle, "VkImage", device, usage, access, what)
        if format not in VK_FORMATS:
            raise InputError(f"{what}: format {format!r} is not one vkml reads or writes; use "
                             f"one of {sorted(VK_FORMATS)} (VkFormat {VK_FORMATS})")
        if layout not in LAYOUTS:
            raise InputError(f"{what}: layout {layout!r} is not one an image can be in while "
                             "vkml's step runs; give its VkImageLayout then, one of "
                             + ", ".join(f"{k} ({v})" for k, v in LAYOUTS.items()))
        ffi = b._ffi
        cast = ffi.cast("VkImage", raw)
        req = ffi.new("VkMemoryRequirements*")
        b._lib.vkGetImageMemoryRequirements(b._device, cast, req)
        need = extent[0] * extent[1] * FORMATS[format]
        if req.size < need:
            raise InputError(f"{what}: a {extent[0]}x{extent[1]} {format} image needs at least "
                             f"{need} bytes, but this one needs {req.size}: declare the format "
                             "and extent it was created with")
        image = ImportedImage(cast, format, (int(extent[0]), int(extent[1])), int(layout), what)
        b._host_objects.add(image)
        return image

    def release(self, resource: object) -> None:
        self._backend._host_objects.discard(resource)

    def row_pitch(self, row_bytes: int) -> int:
        """Vulkan copies tightly packed rows in one command."""
        return row_bytes

    def describe(self, resource: Any, what: str) -> tuple[str, dict[str, Any]]:
        """Vulkan's handles describe nothing: the host declares them."""
        _refuse_wgpu(resource, what)
        raise InputError(f"{what}: expected a vkml.HostBuffer or vkml.HostImage describing "
                         f"the host's VkBuffer or VkImage, got {type(resource).__name__} "
                         "(Vulkan cannot report a handle's size, format or usage, so "
                         "they are declared with it)")

    def _check_common(self, handle: Any, ctype: str, device: Any, usage: int, access: str,
                      what: str) -> int:
        """The handle as an integer, after checking the declared device and usage."""
        b = self._backend
        ffi = b._ffi
        _refuse_wgpu(handle, what)
        raw = raw_handle(ffi, handle, ctype, what)
        try:
            theirs = as_handle(ffi, "VkDevice", device, f"{what}: device")
        except Exception as exc:
            raise InputError(f"{exc}; give the VkDevice the {ctype} was created on") from None
        if int(ffi.cast("uintptr_t", theirs)) != int(ffi.cast("uintptr_t", b._device)):
            raise InputError(f"{what}: the {ctype} was made on another VkDevice than the one "
                             "this session runs on: create it on that device (the one given "
                             "to vkml.Device.from_vulkan)")
        bit, name = USAGE[access]
        if isinstance(usage, bool) or not isinstance(usage, numbers.Integral):
            raise InputError(f"{what}: usage must be the {ctype}'s usage flags (an int), got "
                             f"{usage!r}")
        if not usage & bit:
            raise InputError(f"{what}: its usage flags {usage:#x} lack {name} ({bit:#x}), which "
                             f"vkml's copy {'from' if access == 'read' else 'into'} it needs: "
                             f"create it with VK_{'IMAGE' if ctype == 'VkImage' else 'BUFFER'}"
                             f"_USAGE_{name}_BIT")
        return raw


def _refuse_wgpu(resource: Any, what: str) -> None:
    """InputError for a wgpu object (a GPUBuffer or GPUTexture) given to a Vulkan session."""
    if type(resource).__module__.partition(".")[0] == "wgpu":
        raise InputError(f"{what}: {type(resource).__name__} is a wgpu object, and this "
                         "session runs on Vulkan: bind it on a session compiled for "
                         "vkml.Device.from_wgpu(its device), or give a VkBuffer or VkImage "
                         "(vkml.HostBuffer, vkml.HostImage) here")
