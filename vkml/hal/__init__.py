"""The hardware abstraction: what the compiler hands a backend (kernels, command lists), what a
device can do (capabilities), and the contract every backend implements. Like IREE's HAL, one
concern a file; the Vulkan backend lives in vkml/vk/, the WebGPU one in vkml/webgpu/."""

from vkml.hal.base import WAIT_POLL_S, BackendBase, BackendTimestamps, seconds_from_env
from vkml.hal.capabilities import Capabilities
from vkml.hal.commands import (
    Barrier,
    Binding,
    BufferKind,
    Command,
    Copy,
    CopyFromImage,
    CopyToImage,
    Dispatch,
    Fill,
    ImageRegion,
    check_commands,
)
from vkml.hal.interface import (
    FORMATS,
    Backend,
    DeviceMemory,
    HostRecording,
    HostResources,
    HostWrite,
    TimelineSync,
    Timestamps,
)
from vkml.hal.kernel import Access, Kernel

__all__ = ["FORMATS", "WAIT_POLL_S", "Access", "Backend", "BackendBase", "BackendTimestamps",
           "Barrier", "Binding", "BufferKind", "Capabilities", "Command", "Copy",
           "CopyFromImage", "CopyToImage", "DeviceMemory", "Dispatch", "Fill", "HostRecording",
           "HostResources", "HostWrite", "ImageRegion", "Kernel", "TimelineSync", "Timestamps",
           "check_commands", "seconds_from_env"]
