"""What a backend records: storage-buffer dispatches, barriers between them, buffer copies and
fills, copies between buffers and a host application's images; and the checks every backend
makes before recording them, so a bad command list fails with a message naming the command
instead of a driver error or a crash."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from vkml.errors import DeviceError
from vkml.hal.capabilities import Capabilities

BufferKind = Literal["device", "upload", "readback"]


@dataclass(frozen=True)
class Binding:
    """One storage-buffer binding of a dispatch: a byte range of a backend buffer."""

    buffer: object  # a handle returned by Backend.create_buffer
    offset: int  # bytes, a multiple of caps.min_storage_offset_alignment
    nbytes: int
    writable: bool


@dataclass(frozen=True)
class Dispatch:
    pipeline: object  # from Backend.create_pipeline
    bindings: tuple[Binding, ...]  # in binding-index order, matching the kernel's @binding(i)
    groups: tuple[int, int, int]
    # The first workgroup's id: a range of a larger grid's workgroups (Vulkan's
    # vkCmdDispatchBase), where caps.dispatch_base allows it and the kernel's workgroups are
    # independent (Kernel.independent_workgroups, which also made its pipeline accept a base).
    base: tuple[int, int, int] = (0, 0, 0)


@dataclass(frozen=True)
class Barrier:
    """All earlier compute and transfer writes become visible to all later compute/transfer work.
    `host_stages`: every pipeline stage on both sides, so a host application's work on the shared
    queue (rendering into a buffer or image vkml reads, sampling one it writes) is ordered too."""

    host_stages: bool = False


@dataclass(frozen=True)
class Copy:
    src: object
    src_offset: int
    dst: object
    dst_offset: int
    nbytes: int


@dataclass(frozen=True)
class Fill:
    """Zeros written by the device into a range of whole 4-byte words (Vulkan's and WebGPU's
    rule for fills): no host memory crosses the bus, unlike a copy from a zeroed buffer."""

    buffer: object
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ImageRegion:
    """A rectangle of a host image's first mip level and layer, in a buffer row after row."""

    image: object  # a handle returned by the backend's host_resources.image()
    x: int
    y: int
    width: int
    height: int
    # Bytes from a row's start to the next one's in the buffer (0: tightly packed), a
    # multiple of the texel's size: host_resources.row_pitch() says what the backend copies
    # in one piece.
    pitch: int = 0

    @property
    def nbytes(self) -> int:
        """The bytes of the buffer the rows span."""
        row = self.width * getattr(self.image, "texel_bytes", 0)
        return (self.pitch or row) * (self.height - 1) + row


@dataclass(frozen=True)
class CopyFromImage:
    """An image's region into `dst` at `dst_offset`, the image moved to a layout the copy reads
    and back to its own around it."""

    region: ImageRegion
    dst: object
    dst_offset: int


@dataclass(frozen=True)
class CopyToImage:
    """`src` from `src_offset` into an image's region (the image's layout kept as for
    CopyFromImage)."""

    src: object
    src_offset: int
    region: ImageRegion


Command = Dispatch | Barrier | Copy | Fill | CopyFromImage | CopyToImage


def check_commands(commands: Sequence[Command], label: str, caps: Capabilities,
                   live_buffer: Callable[[object], bool],
                   live_pipeline: Callable[[object], bool],
                   extra: Callable[[int, Command, str], None] | None = None) -> None:
    """Raise DeviceError for the first command a backend could not run. `live_buffer` /
    `live_pipeline` say whether a handle is one of the backend's own and not yet freed;
    `extra(n, command, what)` adds the backend's own rules (e.g. WebGPU's copy alignment)."""
    for n, cmd in enumerate(commands):
        if isinstance(cmd, Dispatch):
            pipe = cmd.pipeline
            what = f"program {label!r} command {n} (kernel {getattr(pipe, 'name', pipe)!r})"
            if not live_pipeline(pipe):
                raise DeviceError(f"{what}: not a live pipeline of this backend")
            if len(cmd.bindings) != pipe.num_bindings:
                raise DeviceError(f"{what}: {len(cmd.bindings)} bindings for a kernel with "
                                  f"{pipe.num_bindings}")
            for i, b in enumerate(cmd.bindings):
                _check_range(b.buffer, b.offset, b.nbytes, f"{what} binding {i}", live_buffer)
                if b.offset % caps.min_storage_offset_alignment:
                    raise DeviceError(f"{what} binding {i}: offset {b.offset} is not a multiple "
                                      "of the storage offset alignment "
                                      f"{caps.min_storage_offset_alignment}")
                if b.nbytes > caps.max_storage_buffer_range:
                    raise DeviceError(f"{what} binding {i}: {b.nbytes} bytes exceed the largest "
                                      f"storage binding ({caps.max_storage_buffer_range})")
            if any(g > m for g, m in zip(cmd.groups, caps.max_workgroup_count, strict=True)):
                raise DeviceError(f"{what}: groups {cmd.groups} exceed the device's workgroup "
                                  f"count limits {caps.max_workgroup_count}")
            if any(cmd.base):
                if not caps.dispatch_base:
                    raise DeviceError(f"{what}: base {cmd.base} needs dispatches with a base "
                                      "workgroup, which this backend lacks (caps.dispatch_base)")
                if not pipe.dispatch_base:  # type: ignore[attr-defined]
                    raise DeviceError(f"{what}: base {cmd.base} on a pipeline made without a "
                                      "base (its kernel's workgroups are not independent)")
                ends = tuple(b + g for b, g in zip(cmd.base, cmd.groups, strict=True))
                if any(e > m for e, m in zip(ends, caps.max_workgroup_count, strict=True)):
                    raise DeviceError(f"{what}: base {cmd.base} + groups {cmd.groups} exceed the "
                                      f"device's workgroup count limits {caps.max_workgroup_count}")
        elif isinstance(cmd, Copy):
            what = f"program {label!r} command {n} (copy)"
            _check_range(cmd.src, cmd.src_offset, cmd.nbytes, f"{what} source", live_buffer)
            _check_range(cmd.dst, cmd.dst_offset, cmd.nbytes, f"{what} destination", live_buffer)
            if cmd.src is cmd.dst and abs(cmd.src_offset - cmd.dst_offset) < cmd.nbytes:
                raise DeviceError(f"{what}: source and destination ranges overlap")
        elif isinstance(cmd, Fill):
            what = f"program {label!r} command {n} (fill)"
            _check_range(cmd.buffer, cmd.offset, cmd.nbytes, what, live_buffer)
            if cmd.offset % 4 or cmd.nbytes % 4:
                raise DeviceError(f"{what}: offset {cmd.offset} and size {cmd.nbytes} must be "
                                  "multiples of 4 bytes")
        elif isinstance(cmd, CopyFromImage | CopyToImage):
            what = f"program {label!r} command {n} (image copy)"
            buffer, at = ((cmd.dst, cmd.dst_offset) if isinstance(cmd, CopyFromImage)
                          else (cmd.src, cmd.src_offset))
            r = cmd.region
            texel = getattr(r.image, "texel_bytes", 0)
            if r.pitch and (r.pitch < r.width * texel or r.pitch % max(texel, 1)):
                raise DeviceError(f"{what}: row pitch {r.pitch} is not a whole number of "
                                  f"texels of {texel} bytes, at least the row's {r.width}")
            _check_range(buffer, at, r.nbytes, what, live_buffer)
            width, height = getattr(r.image, "extent", (0, 0))
            if min(r.x, r.y) < 0 or r.width <= 0 or r.height <= 0 or r.x + r.width > width \
                    or r.y + r.height > height:
                raise DeviceError(f"{what}: region {r.width}x{r.height} at ({r.x}, {r.y}) does "
                                  f"not fit in {r.image!r}")
            if at % 4:
                raise DeviceError(f"{what}: buffer offset {at} is not a multiple of 4")
        elif isinstance(cmd, Barrier):
            continue
        else:
            raise DeviceError(f"program {label!r} command {n}: unknown command {cmd!r}")
        if extra is not None:
            extra(n, cmd, what)


def _check_range(buf: object, offset: int, nbytes: int, what: str,
                 live_buffer: Callable[[object], bool]) -> None:
    if not live_buffer(buf):
        raise DeviceError(f"{what}: {buf!r} is not a live buffer of this backend")
    if nbytes <= 0 or offset < 0 or offset + nbytes > buf.nbytes:  # type: ignore[attr-defined]
        raise DeviceError(f"{what}: bytes [{offset}, {offset + nbytes}) do not fit in {buf!r}")
