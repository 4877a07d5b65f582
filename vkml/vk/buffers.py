"""Buffers: memory-type choice (a pure function), allocation, persistent mapping."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vkml.errors import DeviceError
from vkml.hal import BufferKind, DeviceMemory

# VkMemoryPropertyFlagBits from the Vulkan spec; spelled out so the choice is testable without
# the `vulkan` package.
DEVICE_LOCAL = 0x1
HOST_VISIBLE = 0x2
HOST_COHERENT = 0x4
HOST_CACHED = 0x8
MAPPABLE = HOST_VISIBLE | HOST_COHERENT


def memory_candidates(types: Sequence[tuple[int, int]], heap_sizes: Sequence[int],
                      type_bits: int, kind: BufferKind) -> list[int]:
    """Memory type indices to try for a buffer of `kind`, best first.

    `types` holds (propertyFlags, heapIndex) per memory type; `type_bits` is the buffer's
    VkMemoryRequirements.memoryTypeBits.
    """
    allowed = [i for i in range(len(types)) if type_bits >> i & 1]

    def has(i: int, flags: int) -> bool:
        return types[i][0] & flags == flags

    local = [i for i in allowed if has(i, DEVICE_LOCAL)]
    largest = max((heap_sizes[types[i][1]] for i in local), default=0)
    # Mappable VRAM only pays when it is all of VRAM (ReBAR, unified memory); a 256 MiB BAR
    # window would run out under a real model, so it is then left to plain device memory.
    mapped = [i for i in local if has(i, MAPPABLE) and heap_sizes[types[i][1]] >= largest]
    if kind == "device":
        return mapped + [i for i in local if i not in mapped]
    host = [i for i in allowed if has(i, MAPPABLE)]
    if kind == "readback":
        # Uncached reads of write-combined memory run at a few MB/s on discrete GPUs.
        return sorted(host, key=lambda i: not has(i, HOST_CACHED))
    # Staging for uploads goes where all of VRAM is mappable, so a step's copy of its inputs
    # stays on the device; elsewhere in system memory, keeping a scarce BAR window for the device.
    return sorted(host, key=lambda i: (i not in mapped, has(i, DEVICE_LOCAL)))


def device_heap(dev: Any) -> DeviceMemory:
    """The heap of the memory type "device" buffers are tried in first, and what this process
    may still allocate there where the device has VK_EXT_memory_budget."""
    vk, ffi = dev.vk, dev.ffi
    all_types = (1 << len(dev.memory_types)) - 1
    first = memory_candidates(dev.memory_types, dev.heap_sizes, all_types, "device")[0]
    heap = dev.memory_types[first][1]
    available = None
    if "VK_EXT_memory_budget" in dev.caps.extensions:
        budget = ffi.new("VkPhysicalDeviceMemoryBudgetPropertiesEXT*", {
            "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT})
        props = ffi.new("VkPhysicalDeviceMemoryProperties2*", {
            "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2, "pNext": budget})
        dev.lib.vkGetPhysicalDeviceMemoryProperties2(dev.physical, props)
        if budget.heapBudget[heap]:  # the spec says it never is 0: a driver that ignored it
            available = max(0, budget.heapBudget[heap] - budget.heapUsage[heap])
    return DeviceMemory(heap, dev.heap_sizes[heap], available)


class Buffer:
    """A VkBuffer with its own allocation; `nbytes` is the usable size (a multiple of 4)."""

    __slots__ = (
        "handle",
        "host_read",
        "host_write",
        "kind",
        "label",
        "memory",
        "nbytes",
        "pointer",
    )

    def __init__(self, handle: Any, memory: Any, nbytes: int, label: str, kind: BufferKind,
                 pointer: Any, host_read: bool) -> None:
        self.handle = handle
        self.memory = memory
        self.nbytes = nbytes
        self.label = label
        self.kind = kind
        self.pointer = pointer  # char* into the persistent mapping, or None
        # Whether read_buffer/write_buffer may go straight through the mapping; otherwise they
        # stage through a temporary buffer and a copy on the queue.
        self.host_read = host_read
        self.host_write = pointer is not None

    def __repr__(self) -> str:
        return f"<vk.Buffer {self.label!r} {self.kind} {self.nbytes} B>"


def allocate_buffer(dev: Any, nbytes: int, kind: BufferKind, label: str) -> Buffer:
    """`dev` is a vkml.vk.device.Device."""
    vk, ffi, lib = dev.vk, dev.ffi, dev.lib
    if kind not in ("device", "upload", "readback"):
        raise DeviceError(f"buffer {label!r}: unknown kind {kind!r} (device|upload|readback)")
    size = max(4, (int(nbytes) + 3) // 4 * 4)
    info = ffi.new("VkBufferCreateInfo*", {
        "sType": vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, "size": size,
        "usage": vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
        | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT,
        "sharingMode": vk.VK_SHARING_MODE_EXCLUSIVE})
    out = ffi.new("VkBuffer*")
    if lib.vkCreateBuffer(dev.device, info, ffi.NULL, out) != vk.VK_SUCCESS:
        raise DeviceError(f"vkCreateBuffer failed for buffer {label!r} of {size} bytes")
    handle = out[0]
    req = ffi.new("VkMemoryRequirements*")
    lib.vkGetBufferMemoryRequirements(dev.device, handle, req)
    memory = None
    for index in memory_candidates(dev.memory_types, dev.heap_sizes, req.memoryTypeBits, kind):
        alloc = ffi.new("VkMemoryAllocateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, "allocationSize": req.size,
            "memoryTypeIndex": index})
        mem = ffi.new("VkDeviceMemory*")
        if lib.vkAllocateMemory(dev.device, alloc, ffi.NULL, mem) == vk.VK_SUCCESS:
            memory, flags = mem[0], dev.memory_types[index][0]
            break
    if memory is None:
        lib.vkDestroyBuffer(dev.device, handle, ffi.NULL)
        raise DeviceError(
            f"out of memory allocating buffer {label!r} ({size} bytes, kind {kind!r}) on "
            f"{dev.device_name!r}; heaps: {[f'{s / 2**30:.1f} GiB' for s in dev.heap_sizes]}")
    lib.vkBindBufferMemory(dev.device, handle, memory, 0)
    pointer = None
    if flags & MAPPABLE == MAPPABLE:
        mapped = ffi.new("void**")
        # The real size, not VK_WHOLE_SIZE: that constant overflows the binding's size field.
        if lib.vkMapMemory(dev.device, memory, 0, req.size, 0, mapped) != vk.VK_SUCCESS:
            lib.vkFreeMemory(dev.device, memory, ffi.NULL)
            lib.vkDestroyBuffer(dev.device, handle, ffi.NULL)
            raise DeviceError(f"vkMapMemory failed for buffer {label!r} ({size} bytes)")
        pointer = ffi.cast("char*", mapped[0])
    host_read = pointer is not None and (bool(flags & HOST_CACHED) or kind != "device")
    return Buffer(handle, memory, size, label, kind, pointer, host_read)


def free_buffer(dev: Any, buf: Buffer) -> None:
    # Freeing the memory unmaps it implicitly.
    dev.lib.vkDestroyBuffer(dev.device, buf.handle, dev.ffi.NULL)
    dev.lib.vkFreeMemory(dev.device, buf.memory, dev.ffi.NULL)
    buf.handle = buf.memory = buf.pointer = None
    buf.host_read = buf.host_write = False
