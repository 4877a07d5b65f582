"""Frames in, predictions out on the GPU: a host application's buffers and images bound to a
session's inputs and outputs (Session.bind_input / bind_output), so that a rendered frame
reaches the model, and the prediction the renderer, without passing through system memory.

A bound input is copied (a buffer of the input's own f32 layout) or converted (an image, by the
kernel of vkml/kernels/frames.py after a copy of its region into a buffer of vkml's) by a
program that every step runs first, after the inputs' upload; a bound output is copied into the
host's buffer or image by a program that ends every step. Both begin and end with barriers over
every pipeline stage, so the host's work on the shared queue before the step (its render pass)
is complete and visible to them, and its later work (sampling the prediction, rendering the
next frame into the image) waits for them: queue order is the host's synchronisation. Recorded
into the host's command buffer (Session.record), they sit inside its barriers the same way.
On wgpu the resources are the host's GPUBuffers and GPUTextures themselves (they report what
Vulkan's handles declare: the backend's host_resources.describe()), the barriers are WebGPU's
own, and its one queue's order is the synchronisation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vkml.errors import InputError
from vkml.hal import (
    FORMATS,
    Barrier,
    Binding,
    Command,
    Copy,
    CopyFromImage,
    CopyToImage,
    Dispatch,
    ImageRegion,
)
from vkml.kernels import frames as frame_kernels


@dataclass(frozen=True)
class HostBuffer:
    """A host's VkBuffer as it was created: Vulkan cannot report a buffer's device, size or
    usage, so the host declares them (vkml checks what the driver can tell).

    `handle`: the VkBuffer (a `vulkan` cffi handle or an int); `device`: the VkDevice it was
    created on; `nbytes`: its VkBufferCreateInfo.size; `usage`: its VkBufferUsageFlags (an
    input needs TRANSFER_SRC, an output TRANSFER_DST).

    Without `format` it holds a tensor as set_input takes it. With `format` (as HostImage's)
    and `extent` (width, height) it holds a picture, its texels row after row, tightly packed,
    converted as an image's are (taken whole: `region` crops images only)."""

    handle: Any
    device: Any
    nbytes: int
    usage: int
    format: str | None = None
    extent: tuple[int, int] | None = None


@dataclass(frozen=True)
class HostImage:
    """A host's VkImage (2-D, one mip level and layer, optimal or linear tiling) as it was
    created, and the layout it is in whenever vkml's step runs (vkml leaves it in that layout).

    `format`: "rgba8_unorm", "rgba8_srgb" (the stored bytes are used as they are, not made
    linear), "rgba16_float" or "r32_float"; `extent`: (width, height); `usage`: its
    VkImageUsageFlags (an input needs TRANSFER_SRC, an output TRANSFER_DST); `layout`: a
    VkImageLayout (GENERAL, COLOR_ATTACHMENT_OPTIMAL, SHADER_READ_ONLY_OPTIMAL,
    TRANSFER_SRC/DST_OPTIMAL or PRESENT_SRC_KHR)."""

    handle: Any
    device: Any
    format: str
    extent: tuple[int, int]
    usage: int
    layout: int


@dataclass
class _Bound:
    """One binding: the backend's handle of the host's resource, the copy that reads or writes
    it, the dispatch converting an image's texels (or spacing an output's rows for its image),
    and what vkml made for it (freed with it)."""

    resource: object
    copy: Command | None = None
    convert: Command | None = None
    buffers: list[object] = field(default_factory=list)
    kernels: list[Any] = field(default_factory=list)


class FrameBindings:
    """A session's bound inputs and outputs, and the commands that run them."""

    def __init__(self, bound: Any) -> None:
        self._bound = bound  # runtime.bound.BoundPlan
        self.inputs: dict[str, _Bound] = {}
        self.outputs: dict[str, _Bound] = {}

    @property
    def _backend(self) -> Any:
        return self._bound.backend

    def _resources(self, what: str) -> Any:
        resources = self._backend.host_resources
        if resources is None:
            raise InputError(f"{what}: {self._backend.why_absent('host_resources')}")
        return resources

    # ---- inputs -------------------------------------------------------------------------------
    def bind_input(self, name: str, source: HostBuffer | HostImage, offset: int,
                   region: tuple[int, int, int, int] | None, channels: Sequence[int] | None,
                   mean: Sequence[float] | None, std: Sequence[float] | None) -> None:
        plan = self._bound.plan
        what = f"bind_input('{name}')"
        if name not in plan.inputs or name.startswith("vkml/"):
            known = ", ".join(f"'{n}'" for n in plan.inputs if not n.startswith("vkml/"))
            raise InputError(f"{what}: unknown input; this session's inputs are: "
                             f"{known or 'none'}")
        slot = plan.slots[plan.inputs[name]]
        resources = self._resources(what)
        source = _described(resources, source, what)
        arena, at = self._bound.place(slot.id)
        if isinstance(source, HostBuffer) and source.format is None:
            if region is not None or channels is not None or mean is not None or std is not None:
                raise InputError(f"{what}: region, channels, mean and std convert pictures; a "
                                 "buffer without a format is copied as it is (the input's own "
                                 "layout): give HostBuffer(..., format=, extent=) for pixels")
            _check_offset(what, offset, slot.nbytes, source.nbytes)
            if slot.dtype != "f32" and slot.dtype != "i32":
                raise InputError(f"{what}: inputs of dtype {slot.dtype} cannot be bound")
            buf = resources.buffer(source.handle, source.device, source.nbytes, source.usage,
                                   "read", what)
            binding = _Bound(buf, Copy(buf, offset, arena, at, slot.nbytes))
        else:
            binding = self._picture_input(what, slot, arena, at, source, offset, region,
                                          channels, mean, std)
        self.unbind(name)
        self.inputs[name] = binding

    def _picture_input(self, what: str, slot: Any, arena: object, at: int,
                       source: HostImage | HostBuffer, offset: int,
                       region: tuple[int, int, int, int] | None,
                       channels: Sequence[int] | None, mean: Sequence[float] | None,
                       std: Sequence[float] | None) -> _Bound:
        """An image's region, or a picture in a buffer, converted by a kernel in the step."""
        image = isinstance(source, HostImage)
        if image and offset:
            raise InputError(f"{what}: offset is for buffers; an image's rectangle is `region`")
        if not image and region is not None:
            raise InputError(f"{what}: region crops images; a picture in a buffer is taken "
                             "whole (and resized to the input's size)")
        if slot.dtype != "f32":
            raise InputError(f"{what}: an image converts to f32, and this input is {slot.dtype}")
        shape = slot.shape
        if len(shape) == 4 and shape[0] == 1:
            shape = shape[1:]
        elif len(shape) == 2:
            shape = (1, *shape)
        if len(shape) != 3:
            raise InputError(f"{what}: an image fills an input of shape (1, C, H, W), (C, H, W) "
                             f"or (H, W); this one is {slot.shape}")
        format = source.format
        if format not in FORMATS:
            raise InputError(f"{what}: format {format!r} is not one vkml reads; use one "
                             f"of {sorted(FORMATS)}")
        extent = _extent(what, source.extent)
        x, y, width, height = region if region is not None else (0, 0, *extent)
        if min(x, y) < 0 or width <= 0 or height <= 0 or x + width > extent[0] \
                or y + height > extent[1]:
            raise InputError(f"{what}: region (x, y, width, height) = {(x, y, width, height)} "
                             f"does not fit in the {extent[0]}x{extent[1]} image")
        nbytes = width * height * FORMATS[format]
        if not image:
            _check_offset(what, offset, nbytes, source.nbytes)
        resources = self._resources(what)
        # Image rows land in vkml's buffer as far apart as the backend copies them in one piece
        # (WebGPU: multiples of 256 bytes); the kernel reads them there.
        pitch = resources.row_pitch(width * FORMATS[format]) if image else 0
        depth = 1 if format == "r32_float" else 4
        picks = tuple(range(min(shape[0], depth))) if channels is None else tuple(channels)
        if len(picks) != shape[0] or any(not 0 <= c < depth for c in picks):
            raise InputError(f"{what}: channels {list(picks)} must name {shape[0]} source "
                             f"channel(s) (the input's C) among the image's {depth}; e.g. "
                             f"channels={list(range(min(shape[0], depth)))}")
        means = _per_channel(what, "mean", mean, 0.0, depth)
        stds = _per_channel(what, "std", std, 1.0, depth)
        if any(s == 0 or not math.isfinite(s) for s in stds):
            raise InputError(f"{what}: std must be finite and non-zero, got {list(stds)}")
        if isinstance(source, HostImage):
            handle = resources.image(source.handle, source.device, format, extent, source.usage,
                                     source.layout, "read", what)
        else:
            handle = resources.buffer(source.handle, source.device, source.nbytes, source.usage,
                                      "read", what)
        backend = self._backend
        binding = _Bound(handle)
        try:
            region_of = ImageRegion(handle, x, y, width, height, pitch) if image else None
            texels = backend.create_buffer(region_of.nbytes if region_of else nbytes, "device",
                                           f"{what} texels")
            binding.buffers.append(texels)
            lookup = frame_kernels.table(format, (means * 4)[:4], (stds * 4)[:4])
            table = backend.create_buffer(lookup.nbytes, "device", f"{what} table")
            binding.buffers.append(table)
            backend.write_buffer(table, 0, memoryview(lookup).cast("B"))
            kernel = frame_kernels.convert(format, (width, height), shape, picks,
                                           self._bound.device.caps,
                                           pitch // FORMATS[format] if image else None)
            pipeline, = self._bound.device.pipelines.acquire([kernel])
            binding.kernels.append(kernel)
            bindings = (Binding(texels, 0, texels.nbytes, False),
                        Binding(table, 0, table.nbytes, False),
                        Binding(arena, at, slot.nbytes, True))
            binding.copy = (CopyFromImage(region_of, texels, 0) if region_of is not None
                            else Copy(handle, offset, texels, 0, nbytes))
            binding.convert = Dispatch(pipeline, bindings, kernel.groups)
        except BaseException:
            self._free(binding)
            raise
        return binding

    # ---- outputs ------------------------------------------------------------------------------
    def bind_output(self, name: str, target: HostBuffer | HostImage, offset: int,
                    region: tuple[int, int] | None) -> None:
        plan = self._bound.plan
        what = f"bind_output('{name}')"
        if name not in plan.outputs:
            raise InputError(f"{what}: unknown output; this session's outputs are: "
                             f"{sorted(plan.outputs)}")
        view = plan.outputs[name]
        slot = plan.slots[view.slot]
        nbytes = 4 * math.prod(view.shape)
        arena, at = self._bound.place(slot.id)
        resources = self._resources(what)
        target = _described(resources, target, what)
        if isinstance(target, HostBuffer):
            if region is not None:
                raise InputError(f"{what}: region is for images; a buffer takes an offset")
            _check_offset(what, offset, nbytes, target.nbytes)
            buf = resources.buffer(target.handle, target.device, target.nbytes, target.usage,
                                   "write", what)
            binding = _Bound(buf, Copy(arena, at, buf, offset, nbytes))
        else:
            if offset:
                raise InputError(f"{what}: offset is for buffers; an image takes region=(x, y)")
            if target.format != "r32_float" or slot.dtype != "f32":
                raise InputError(f"{what}: an output is written into an r32_float image (one "
                                 f"f32 per texel, as computed), not {target.format!r}")
            extent = _extent(what, target.extent)
            rows, cols = (view.shape[-2], view.shape[-1]) if len(view.shape) >= 2 else (1, 1)
            if math.prod(view.shape) != rows * cols:
                raise InputError(f"{what}: the output's shape {view.shape} is not one 2-D map "
                                 "(..., H, W) with 1 in the leading axes, which an image holds")
            x, y = region if region is not None else (0, 0)
            if min(x, y) < 0 or x + cols > extent[0] or y + rows > extent[1]:
                raise InputError(f"{what}: the {cols}x{rows} prediction at {(x, y)} does not "
                                 f"fit in the {extent[0]}x{extent[1]} image: give an image of "
                                 "the output's size, or region=(x, y) inside it")
            image = resources.image(target.handle, target.device, target.format, extent,
                                    target.usage, target.layout, "write", what)
            binding = self._image_output(what, image, x, y, rows, cols,
                                         resources.row_pitch(4 * cols), arena, at)
        self.unbind(name, outputs=True)
        self.outputs[name] = binding

    def _image_output(self, what: str, image: object, x: int, y: int, rows: int, cols: int,
                      pitch: int, arena: object, at: int) -> _Bound:
        """The output's map copied into an image at (x, y): straight from the arena where the
        backend copies tightly packed rows in one piece (`pitch`, host_resources.row_pitch,
        is the row's bytes), else first spaced as it needs them (WebGPU: rows a multiple of
        256 bytes apart) by a kernel, into a buffer of vkml's."""
        if pitch == 4 * cols or rows == 1:
            return _Bound(image, CopyToImage(arena, at, ImageRegion(image, x, y, cols, rows)))
        region = ImageRegion(image, x, y, cols, rows, pitch)
        binding = _Bound(image)
        try:
            spaced = self._backend.create_buffer(region.nbytes, "device", f"{what} rows")
            binding.buffers.append(spaced)
            kernel = frame_kernels.spaced_rows(rows, cols, pitch // 4, self._bound.device.caps)
            pipeline, = self._bound.device.pipelines.acquire([kernel])
            binding.kernels.append(kernel)
            binding.convert = Dispatch(pipeline, (Binding(arena, at, 4 * rows * cols, False),
                                                  Binding(spaced, 0, region.nbytes, True)),
                                       kernel.groups)
            binding.copy = CopyToImage(spaced, 0, region)
        except BaseException:
            self._free(binding)
            raise
        return binding

    # ---- programs -----------------------------------------------------------------------------
    def input_commands(self) -> list[Command]:
        """What a step runs before its dispatches: the bound inputs' copies and conversions."""
        if not self.inputs:
            return []
        copies = [b.copy for b in self.inputs.values() if b.copy is not None]
        converts = [b.convert for b in self.inputs.values() if b.convert is not None]
        return [Barrier(host_stages=True), *copies, *([Barrier(), *converts] if converts else []),
                Barrier(host_stages=True)]

    def output_commands(self) -> list[Command]:
        """What a step runs after its dispatches: the bound outputs' copies."""
        if not self.outputs:
            return []
        converts = [b.convert for b in self.outputs.values() if b.convert is not None]
        return [Barrier(), *([*converts, Barrier()] if converts else []),
                *[b.copy for b in self.outputs.values() if b.copy is not None],
                Barrier(host_stages=True)]

    def unbind(self, name: str, outputs: bool = False) -> bool:
        """Forget `name`'s binding (an input's, or with `outputs` an output's); whether there
        was one."""
        binding = (self.outputs if outputs else self.inputs).pop(name, None)
        if binding is None:
            return False
        self._free(binding)
        return True

    def _free(self, binding: _Bound) -> None:
        resources = self._backend.host_resources
        if resources is not None:
            resources.release(binding.resource)
        for buffer in binding.buffers:
            self._backend.free_buffer(buffer)
        for kernel in binding.kernels:
            self._bound.device.pipelines.release(kernel)
        binding.buffers, binding.kernels = [], []

    def close(self) -> None:
        for name in list(self.inputs):
            self.unbind(name)
        for name in list(self.outputs):
            self.unbind(name, outputs=True)


def _described(resources: Any, resource: Any, what: str) -> HostBuffer | HostImage:
    """A HostBuffer or HostImage as given, else the backend's own object (wgpu's GPUBuffer or
    GPUTexture, which reports what a Vulkan handle's description declares) described by the
    backend, which refuses anything else naming what it takes."""
    if isinstance(resource, HostBuffer | HostImage):
        return resource
    kind, fields = resources.describe(resource, what)
    return HostBuffer(**fields) if kind == "buffer" else HostImage(**fields)


def _extent(what: str, extent: Any) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in extent)
    except (TypeError, ValueError):
        raise InputError(f"{what}: extent must be (width, height), got {extent!r}") from None
    if width <= 0 or height <= 0:
        raise InputError(f"{what}: extent must be positive, got {extent!r}")
    return width, height


def _check_offset(what: str, offset: int, nbytes: int, size: int) -> None:
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset % 4:
        raise InputError(f"{what}: offset must be a byte offset, a multiple of 4, got {offset!r}")
    if offset + nbytes > size:
        raise InputError(f"{what}: {nbytes} bytes at offset {offset} do not fit in the "
                         f"{size}-byte buffer: the tensor needs {nbytes} bytes (f32, its "
                         "shape); give a larger buffer or a smaller offset")


def _per_channel(what: str, name: str, values: Sequence[float] | None, default: float,
                 depth: int) -> list[float]:
    """Per source channel (`depth` of them), from one number or one per channel."""
    if values is None:
        return [default] * depth
    flat = [float(v) for v in np.atleast_1d(np.asarray(values, np.float64))]
    if len(flat) == 1:
        return flat * depth
    if len(flat) == 3 and depth == 4:  # RGB's, as ImageNet's statistics come: alpha untouched
        return [*flat, default]
    if len(flat) != depth:
        raise InputError(f"{what}: {name} takes one number or one per source channel "
                         f"({depth}), got {len(flat)}")
    return flat
