"""The Vulkan backend. Importing this package never loads libvulkan; constructing
`VulkanBackend` does, and raises DeviceError with an install hint when it is missing.

`compile_wgsl(wgsl, name)` is the backend's WGSL -> SPIR-V translation (naga, cached), public for
a host app's own shaders."""

from vkml.vk.backend import VulkanBackend
from vkml.vk.buffers import Buffer, memory_candidates
from vkml.vk.naga import compile_wgsl
from vkml.vk.pipelines import Pipeline
from vkml.vk.programs import Program
from vkml.vk.select import rank_devices, select_device

__all__ = ["Buffer", "Pipeline", "Program", "VulkanBackend", "compile_wgsl", "memory_candidates",
           "rank_devices", "select_device"]
