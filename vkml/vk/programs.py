"""Recording a command list into a reusable command buffer (a Program)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vkml.errors import DeviceError
from vkml.hal import Barrier, Command, CopyFromImage, CopyToImage, Dispatch, Fill


class Program:
    """A recorded command buffer plus the descriptor sets and queries it uses.

    `submit_info` (and the timeline value it points at) is built once here, so a submit only
    stores a number and calls vkQueueSubmit.
    """

    __slots__ = (
        "_keep",
        "command_buffer",
        "commands",
        "descriptor_pool",
        "fence",
        "in_flight",
        "label",
        "last_value",
        "num_dispatches",
        "query_pool",
        "sets",
        "signal_value",
        "submit_info",
        "submitted",
    )

    def __init__(self, label: str) -> None:
        self.label = label
        self.command_buffer: Any = None
        self.descriptor_pool: Any = None
        self.query_pool: Any = None
        self.num_dispatches = 0
        self.commands: tuple[Command, ...] = ()
        self.sets: list[Any] = []  # one descriptor set per dispatch with bindings, in order
        self.submit_info: Any = None
        self.signal_value: Any = None  # uint64_t[1] the timeline submit info points at
        self.fence: Any = None  # VkFence[1], only without timeline semaphores
        self.last_value = 0  # timeline value of the latest submit
        self.in_flight = False  # fence mode: submitted and not yet waited for
        self.submitted = False
        self._keep: tuple[Any, ...] = ()

    def __repr__(self) -> str:
        return f"<vk.Program {self.label!r} {self.num_dispatches} dispatches>"


def _memory_barrier(dev: Any, cb: Any, src_stage: int, src_access: int, dst_stage: int,
                    dst_access: int) -> None:
    vk, ffi = dev.vk, dev.ffi
    barrier = ffi.new("VkMemoryBarrier*", {"sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                                           "srcAccessMask": src_access,
                                           "dstAccessMask": dst_access})
    dev.lib.vkCmdPipelineBarrier(cb, src_stage, dst_stage, 0, 1, barrier, 0, ffi.NULL, 0, ffi.NULL)


def record_program(dev: Any, pool: Any, commands: Sequence[Command], label: str,
                   timestamps: bool) -> Program:
    """Record `commands` into a new primary command buffer allocated from `pool`."""
    vk, ffi, lib, device = dev.vk, dev.ffi, dev.lib, dev.device
    prog = prepare_program(dev, commands, label)
    try:
        alloc = ffi.new("VkCommandBufferAllocateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO, "commandPool": pool,
            "level": vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, "commandBufferCount": 1})
        out = ffi.new("VkCommandBuffer[1]")
        if lib.vkAllocateCommandBuffers(device, alloc, out) != vk.VK_SUCCESS:
            raise DeviceError(f"program {label!r}: vkAllocateCommandBuffers failed")
        cb = prog.command_buffer = out[0]

        query_count = prog.num_dispatches + 1
        if timestamps and dev.caps.timestamp_period_ns > 0:
            qinfo = ffi.new("VkQueryPoolCreateInfo*", {
                "sType": vk.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
                "queryType": vk.VK_QUERY_TYPE_TIMESTAMP, "queryCount": query_count})
            qout = ffi.new("VkQueryPool*")
            if lib.vkCreateQueryPool(device, qinfo, ffi.NULL, qout) != vk.VK_SUCCESS:
                raise DeviceError(f"program {label!r}: vkCreateQueryPool failed")
            prog.query_pool = qout[0]

        # Not ONE_TIME_SUBMIT: the same buffer is resubmitted for every step.
        begin = ffi.new("VkCommandBufferBeginInfo*",
                        {"sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO})
        lib.vkBeginCommandBuffer(cb, begin)
        if prog.query_pool is not None:
            lib.vkCmdResetQueryPool(cb, prog.query_pool, 0, query_count)
        compute = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
        transfer = vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        writes = vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT
        # Earlier submissions and host writes (inputs written between steps) become visible.
        _memory_barrier(dev, cb, compute | transfer | vk.VK_PIPELINE_STAGE_HOST_BIT,
                        writes | vk.VK_ACCESS_HOST_WRITE_BIT, compute | transfer, _all_access(vk))
        emit_commands(dev, cb, prog)
        # With this, a read_buffer after wait() sees the results through the mapping.
        _memory_barrier(dev, cb, compute | transfer, writes, vk.VK_PIPELINE_STAGE_HOST_BIT,
                        vk.VK_ACCESS_HOST_READ_BIT)
        if lib.vkEndCommandBuffer(cb) != vk.VK_SUCCESS:
            raise DeviceError(f"program {label!r}: vkEndCommandBuffer failed")
    except BaseException:
        destroy_program(dev, pool, prog)
        raise
    return prog


def _all_access(vk: Any) -> int:
    return (vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT
            | vk.VK_ACCESS_TRANSFER_READ_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT)


def prepare_program(dev: Any, commands: Sequence[Command], label: str) -> Program:
    """A Program's descriptor sets for `commands` (checked by the backend), with no command
    buffer yet."""
    prog = Program(label)
    prog.commands = tuple(commands)
    dispatches = [c for c in commands if isinstance(c, Dispatch)]
    prog.num_dispatches = len(dispatches)
    try:
        prog.sets = _descriptor_sets(dev, prog, [d for d in dispatches if d.bindings])
    except BaseException:
        destroy_program(dev, None, prog)
        raise
    return prog


def emit_commands(dev: Any, cb: Any, prog: Program) -> None:
    """Record a program's commands (copies, fills, barriers between levels, dispatches, and a
    timestamp after each dispatch when it has a query pool) into command buffer `cb`."""
    vk, ffi, lib = dev.vk, dev.ffi, dev.lib
    compute = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
    transfer = vk.VK_PIPELINE_STAGE_TRANSFER_BIT
    writes = vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT
    all_access = _all_access(vk)
    bottom = vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT
    if prog.query_pool is not None:
        lib.vkCmdWriteTimestamp(cb, bottom, prog.query_pool, 0)
    sets = iter(prog.sets)
    set_array = ffi.new("VkDescriptorSet[1]")
    region = ffi.new("VkBufferCopy*")
    bind = vk.VK_PIPELINE_BIND_POINT_COMPUTE
    n_dispatch = 0
    for cmd in prog.commands:
        if isinstance(cmd, Dispatch):
            lib.vkCmdBindPipeline(cb, bind, cmd.pipeline.handle)
            if cmd.bindings:
                set_array[0] = next(sets)
                lib.vkCmdBindDescriptorSets(cb, bind, cmd.pipeline.layout, 0, 1, set_array,
                                            0, ffi.NULL)
            if any(cmd.base):
                lib.vkCmdDispatchBase(cb, *cmd.base, *cmd.groups)
            else:
                lib.vkCmdDispatch(cb, *cmd.groups)
            n_dispatch += 1
            if prog.query_pool is not None:
                lib.vkCmdWriteTimestamp(cb, bottom, prog.query_pool, n_dispatch)
        elif isinstance(cmd, Barrier) and cmd.host_stages:
            everything = vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT
            _memory_barrier(dev, cb, everything, vk.VK_ACCESS_MEMORY_WRITE_BIT, everything,
                            vk.VK_ACCESS_MEMORY_READ_BIT | vk.VK_ACCESS_MEMORY_WRITE_BIT)
        elif isinstance(cmd, Barrier):
            _memory_barrier(dev, cb, compute | transfer, writes, compute | transfer, all_access)
        elif isinstance(cmd, CopyFromImage | CopyToImage):
            _copy_image(dev, cb, cmd)
        elif isinstance(cmd, Fill):
            lib.vkCmdFillBuffer(cb, cmd.buffer.handle, cmd.offset, cmd.nbytes, 0)
        else:
            region.srcOffset, region.dstOffset, region.size = (
                cmd.src_offset, cmd.dst_offset, cmd.nbytes)
            lib.vkCmdCopyBuffer(cb, cmd.src.handle, cmd.dst.handle, 1, region)


def _copy_image(dev: Any, cb: Any, cmd: CopyFromImage | CopyToImage) -> None:
    """A copy between a buffer and a host image's region, the image moved from the layout the
    host keeps it in to one a copy takes and back (GENERAL and the copy's own layout stay); the
    barriers also order the host's work on the image before and after, in any stage."""
    vk, ffi, lib = dev.vk, dev.ffi, dev.lib
    reads = isinstance(cmd, CopyFromImage)
    region, image = cmd.region, cmd.region.image
    own = (vk.VK_IMAGE_LAYOUT_TRANSFER_SRC_OPTIMAL if reads
           else vk.VK_IMAGE_LAYOUT_TRANSFER_DST_OPTIMAL)
    layout = image.layout if image.layout in (own, vk.VK_IMAGE_LAYOUT_GENERAL) else own
    access = vk.VK_ACCESS_TRANSFER_READ_BIT if reads else vk.VK_ACCESS_TRANSFER_WRITE_BIT
    everything = vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT
    transfer = vk.VK_PIPELINE_STAGE_TRANSFER_BIT
    memory = vk.VK_ACCESS_MEMORY_READ_BIT | vk.VK_ACCESS_MEMORY_WRITE_BIT
    subresource = {"aspectMask": vk.VK_IMAGE_ASPECT_COLOR_BIT, "baseMipLevel": 0,
                   "levelCount": 1, "baseArrayLayer": 0, "layerCount": 1}

    def transition(old: int, new: int, src_stage: int, src: int, dst_stage: int,
                   dst: int) -> None:
        barrier = ffi.new("VkImageMemoryBarrier*", {
            "sType": vk.VK_STRUCTURE_TYPE_IMAGE_MEMORY_BARRIER, "srcAccessMask": src,
            "dstAccessMask": dst, "oldLayout": old, "newLayout": new,
            "srcQueueFamilyIndex": vk.VK_QUEUE_FAMILY_IGNORED,
            "dstQueueFamilyIndex": vk.VK_QUEUE_FAMILY_IGNORED, "image": image.handle,
            "subresourceRange": subresource})
        lib.vkCmdPipelineBarrier(cb, src_stage, dst_stage, 0, 0, ffi.NULL, 0, ffi.NULL, 1,
                                 barrier)

    transition(image.layout, layout, everything, vk.VK_ACCESS_MEMORY_WRITE_BIT, transfer,
               access)
    copy = ffi.new("VkBufferImageCopy*", {
        "bufferOffset": cmd.dst_offset if reads else cmd.src_offset,
        "bufferRowLength": region.pitch // image.texel_bytes, "bufferImageHeight": 0,
        "imageSubresource": {"aspectMask": vk.VK_IMAGE_ASPECT_COLOR_BIT, "mipLevel": 0,
                             "baseArrayLayer": 0, "layerCount": 1},
        "imageOffset": {"x": region.x, "y": region.y, "z": 0},
        "imageExtent": {"width": region.width, "height": region.height, "depth": 1}})
    if reads:
        lib.vkCmdCopyImageToBuffer(cb, image.handle, layout, cmd.dst.handle, 1, copy)
    else:
        lib.vkCmdCopyBufferToImage(cb, cmd.src.handle, image.handle, layout, 1, copy)
    transition(layout, image.layout, transfer, 0 if reads else access, everything, memory)


def emit_external(dev: Any, cb: Any, prog: Program) -> None:
    """Record `prog` into a command buffer the host is recording, fenced by global memory
    barriers on entry and exit (see Session.record for the stages and accesses)."""
    vk = dev.vk
    compute = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
    transfer = vk.VK_PIPELINE_STAGE_TRANSFER_BIT
    everything = vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT
    memory = vk.VK_ACCESS_MEMORY_READ_BIT | vk.VK_ACCESS_MEMORY_WRITE_BIT
    writes = vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT
    # Entry: all of the host's earlier work (any stage, any write; and host writes made before
    # the submit) completes and is visible before vkml's copies and dispatches read or write.
    _memory_barrier(dev, cb, everything | vk.VK_PIPELINE_STAGE_HOST_BIT,
                    vk.VK_ACCESS_MEMORY_WRITE_BIT | vk.VK_ACCESS_HOST_WRITE_BIT,
                    compute | transfer, _all_access(vk))
    emit_commands(dev, cb, prog)
    # Exit: vkml's writes complete and are visible to all later work of the host (any stage,
    # any access) and to host reads after the host waits for its submission; and later writes
    # of the host wait for vkml's reads.
    _memory_barrier(dev, cb, compute | transfer, writes,
                    everything | vk.VK_PIPELINE_STAGE_HOST_BIT,
                    memory | vk.VK_ACCESS_HOST_READ_BIT)


def _descriptor_sets(dev: Any, prog: Program, dispatches: list[Dispatch]) -> list[Any]:
    """One descriptor set per dispatch, from a pool that belongs to `prog` alone."""
    if not dispatches:
        return []
    vk, ffi, lib, device = dev.vk, dev.ffi, dev.lib, dev.device
    total = sum(len(d.bindings) for d in dispatches)
    size = ffi.new("VkDescriptorPoolSize*", {"type": vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                             "descriptorCount": total})
    pool_info = ffi.new("VkDescriptorPoolCreateInfo*", {
        "sType": vk.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO, "maxSets": len(dispatches),
        "poolSizeCount": 1, "pPoolSizes": size})
    out_pool = ffi.new("VkDescriptorPool*")
    if lib.vkCreateDescriptorPool(device, pool_info, ffi.NULL, out_pool) != vk.VK_SUCCESS:
        raise DeviceError(f"program {prog.label!r}: vkCreateDescriptorPool failed")
    prog.descriptor_pool = out_pool[0]

    layouts = ffi.new("VkDescriptorSetLayout[]", [d.pipeline.set_layout for d in dispatches])
    alloc = ffi.new("VkDescriptorSetAllocateInfo*", {
        "sType": vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO,
        "descriptorPool": prog.descriptor_pool, "descriptorSetCount": len(dispatches),
        "pSetLayouts": layouts})
    sets = ffi.new("VkDescriptorSet[]", len(dispatches))
    if lib.vkAllocateDescriptorSets(device, alloc, sets) != vk.VK_SUCCESS:
        raise DeviceError(f"program {prog.label!r}: vkAllocateDescriptorSets failed")

    infos = ffi.new("VkDescriptorBufferInfo[]", total)
    writes = ffi.new("VkWriteDescriptorSet[]", total)
    k = 0
    for s, d in enumerate(dispatches):
        for i, b in enumerate(d.bindings):
            infos[k].buffer, infos[k].offset, infos[k].range = b.buffer.handle, b.offset, b.nbytes
            w = writes[k]
            w.sType = vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET
            w.dstSet, w.dstBinding, w.descriptorCount = sets[s], i, 1
            w.descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
            w.pBufferInfo = infos + k
            k += 1
    lib.vkUpdateDescriptorSets(device, total, writes, 0, ffi.NULL)
    return list(sets)


def read_timings(dev: Any, prog: Program) -> list[float]:
    """Milliseconds per dispatch: the time between the end of one dispatch and the next."""
    if prog.query_pool is None:
        raise DeviceError(
            f"program {prog.label!r} has no timestamps: record it with timestamps=True on a "
            "device whose queue writes timestamps (caps.timestamp_period_ns > 0)")
    if not prog.submitted:
        raise DeviceError(f"program {prog.label!r} has not been submitted yet")
    vk, ffi = dev.vk, dev.ffi
    n = prog.num_dispatches + 1
    values = ffi.new("uint64_t[]", n)
    result = dev.lib.vkGetQueryPoolResults(
        dev.device, prog.query_pool, 0, n, n * 8, values, 8,
        vk.VK_QUERY_RESULT_64_BIT | vk.VK_QUERY_RESULT_WAIT_BIT)
    if result != vk.VK_SUCCESS:
        raise DeviceError(f"program {prog.label!r}: vkGetQueryPoolResults failed ({result})")
    mask = (1 << dev.timestamp_valid_bits) - 1 if dev.timestamp_valid_bits < 64 else 2**64 - 1
    scale = dev.caps.timestamp_period_ns / 1e6
    return [((values[i + 1] - values[i]) & mask) * scale for i in range(n - 1)]


def destroy_program(dev: Any, pool: Any, prog: Program) -> None:
    lib, ffi, device = dev.lib, dev.ffi, dev.device
    if prog.command_buffer is not None and pool is not None:
        buffers = ffi.new("VkCommandBuffer[1]", [prog.command_buffer])
        lib.vkFreeCommandBuffers(device, pool, 1, buffers)
    if prog.descriptor_pool is not None:
        lib.vkDestroyDescriptorPool(device, prog.descriptor_pool, ffi.NULL)
    if prog.query_pool is not None:
        lib.vkDestroyQueryPool(device, prog.query_pool, ffi.NULL)
    if prog.fence is not None:
        lib.vkDestroyFence(device, prog.fence[0], ffi.NULL)
    prog.command_buffer = prog.descriptor_pool = prog.query_pool = prog.fence = None
    prog.submit_info = prog.signal_value = None
    prog.sets, prog.commands = [], ()
    prog._keep = ()
