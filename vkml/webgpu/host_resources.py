"""A host application's wgpu.GPUBuffers and GPUTextures in vkml's programs (the wgpu backend's
`host_resources`).

Unlike Vulkan's handles, wgpu's objects report their device, size, usage and format, so the host
hands vkml the objects themselves (describe()) and nothing it declares is taken on trust: every
declared value is checked against what the object reports. Bound resources are only copied
from or into (a texture's texels through a buffer of vkml's, converted there by the same kernel
as on Vulkan), so they need COPY_SRC (inputs) or COPY_DST (outputs) and no other usage."""

from __future__ import annotations

import numbers
from typing import Any

from vkml.errors import InputError
from vkml.hal import FORMATS
from vkml.webgpu.buffer import Buffer

# vkml's format names for WebGPU's texture formats it reads and writes.
TEXTURE_FORMATS = {"rgba8unorm": "rgba8_unorm", "rgba8unorm-srgb": "rgba8_srgb",
                   "rgba16float": "rgba16_float", "r32float": "r32_float"}
WGPU_FORMATS = {v: k for k, v in TEXTURE_FORMATS.items()}
ROW_ALIGN = 256  # bytes: a texture copy's rows lie a multiple of this apart in its buffer
FIX = ("bind a VkBuffer or VkImage on a session of vkml.Device.from_vulkan, or the host's "
       "wgpu.GPUBuffer or GPUTexture itself on this one")


class ImportedTexture:
    """A host's GPUTexture as vkml uses it (what check_commands reads of an image)."""

    __slots__ = ("extent", "format", "handle", "label", "texel_bytes")

    def __init__(self, handle: Any, format: str, extent: tuple[int, int], label: str) -> None:
        self.handle, self.format, self.extent, self.label = handle, format, extent, label
        self.texel_bytes = FORMATS[format]

    def __repr__(self) -> str:
        return (f"<wgpu.ImportedTexture {self.label!r} {self.format} "
                f"{self.extent[0]}x{self.extent[1]}>")


class HostResources:
    """The `host_resources` capability of a WgpuBackend."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._wgpu = backend._wgpu

    def row_pitch(self, row_bytes: int) -> int:
        return row_pitch(row_bytes)

    def describe(self, resource: Any, what: str) -> tuple[str, dict[str, Any]]:
        """A GPUBuffer as vkml.HostBuffer's fields ("buffer", holding a tensor as set_input
        takes it), a GPUTexture as vkml.HostImage's ("image"), from what the object reports."""
        wgpu = self._wgpu
        if isinstance(resource, wgpu.GPUBuffer):
            return "buffer", {"handle": resource, "device": resource._device,
                              "nbytes": resource.size, "usage": int(resource.usage)}
        if isinstance(resource, wgpu.GPUTexture):
            format = TEXTURE_FORMATS.get(resource.format, resource.format)
            return "image", {"handle": resource, "device": resource._device, "format": format,
                             "extent": (resource.width, resource.height),
                             "usage": int(resource.usage), "layout": 0}
        raise InputError(f"{what}: expected a wgpu.GPUBuffer or wgpu.GPUTexture of this "
                         f"session's device, got {type(resource).__name__} (a picture in a "
                         "buffer: vkml.HostBuffer(buffer, device, buffer.size, buffer.usage, "
                         "format=, extent=))")

    def buffer(self, handle: Any, device: Any, nbytes: int, usage: int, access: str,
               what: str) -> Any:
        wgpu = self._wgpu
        if not isinstance(handle, wgpu.GPUBuffer):
            raise InputError(f"{what}: this session runs on wgpu, and the buffer given is "
                             f"{_kind(handle)}, not a wgpu.GPUBuffer: {FIX}")
        self._check_device(handle, device, "GPUBuffer", what)
        if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) \
                or not 0 < nbytes <= handle.size:
            raise InputError(f"{what}: declared nbytes={nbytes!r}, but the GPUBuffer holds "
                             f"{handle.size} bytes: declare its size (buffer.size)")
        flag = wgpu.BufferUsage.COPY_SRC if access == "read" else wgpu.BufferUsage.COPY_DST
        self._check_usage(handle, flag, "BufferUsage", access, what)
        buf = Buffer(handle, int(nbytes), "device", what)
        self._backend._host_objects.add(buf)
        return buf

    def image(self, handle: Any, device: Any, format: str, extent: tuple[int, int], usage: int,
              layout: int, access: str, what: str) -> ImportedTexture:
        """`layout` is Vulkan's: WebGPU tracks texture state itself, so it is ignored."""
        wgpu = self._wgpu
        if not isinstance(handle, wgpu.GPUTexture):
            raise InputError(f"{what}: this session runs on wgpu, and the image given is "
                             f"{_kind(handle)}, not a wgpu.GPUTexture: {FIX}")
        self._check_device(handle, device, "GPUTexture", what)
        if format not in WGPU_FORMATS:
            raise InputError(f"{what}: texture format {handle.format!r} is not one vkml reads "
                             f"or writes; use one of {sorted(WGPU_FORMATS.values())}")
        if WGPU_FORMATS[format] != handle.format:
            raise InputError(f"{what}: declared format {format!r}, but the GPUTexture is "
                             f"{handle.format!r}: pass the texture itself")
        if handle.dimension != "2d" or handle.sample_count != 1:
            raise InputError(f"{what}: the GPUTexture is {handle.dimension} with "
                             f"{handle.sample_count} samples per texel; vkml copies from and "
                             "into 2d textures of one sample (resolve a multisampled one "
                             "first)")
        width, height = (int(v) for v in extent)
        if width > handle.width or height > handle.height:
            raise InputError(f"{what}: declared extent {width}x{height}, but the GPUTexture is "
                             f"{handle.width}x{handle.height}: pass the texture itself")
        flag = wgpu.TextureUsage.COPY_SRC if access == "read" else wgpu.TextureUsage.COPY_DST
        self._check_usage(handle, flag, "TextureUsage", access, what)
        texture = ImportedTexture(handle, format, (width, height), what)
        self._backend._host_objects.add(texture)
        return texture

    def release(self, resource: object) -> None:
        self._backend._host_objects.discard(resource)

    def _check_device(self, handle: Any, device: Any, kind: str, what: str) -> None:
        # WebGPU has no public accessor for an object's device; wgpu-py keeps it as _device.
        mine = self._backend._device
        if handle._device is not mine:
            raise InputError(f"{what}: the {kind} was made on another wgpu device than the one "
                             "this session runs on: create it on that device (the one given to "
                             "vkml.Device.from_wgpu), or compile the session for its device")
        if device is not mine:
            raise InputError(f"{what}: declared device {device!r} is not this session's "
                             f"wgpu device: give the {kind}'s own")

    def _check_usage(self, handle: Any, flag: int, flags: str, access: str, what: str) -> None:
        have = int(handle.usage)
        if not have & flag:
            name = "COPY_SRC" if access == "read" else "COPY_DST"
            raise InputError(f"{what}: its usage flags {have:#x} lack {name}, which vkml's copy "
                             f"{'from' if access == 'read' else 'into'} it needs: create it "
                             f"with usage including wgpu.{flags}.{name}")


def row_pitch(row_bytes: int) -> int:
    """WebGPU spaces a texture copy's rows by a multiple of 256 bytes."""
    return -(-row_bytes // ROW_ALIGN) * ROW_ALIGN


def _kind(handle: Any) -> str:
    """What a handle given in place of a wgpu object is, for an error message."""
    if isinstance(handle, numbers.Integral) or type(handle).__module__.startswith("_cffi"):
        return "a Vulkan handle (a `vulkan` cffi handle or an int)"
    return f"a {type(handle).__name__}"
