"""The Vulkan backend. Importing this package never loads libvulkan; constructing
`VulkanBackend` does, and raises DeviceError with an install hint when it is missing."""

from vkml.vk.backend import VulkanBackend
from vkml.vk.buffers import Buffer, memory_candidates
from vkml.vk.pipelines import Pipeline
from vkml.vk.programs import Program
from vkml.vk.select import rank_devices, select_device

__all__ = ["Buffer", "Pipeline", "Program", "VulkanBackend", "memory_candidates", "rank_devices",
           "select_device"]
