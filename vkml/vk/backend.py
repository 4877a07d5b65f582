"""VulkanBackend: the vkml.hal.Backend contract on top of the `vulkan` (cffi) package. It turns
each kernel's WGSL into SPIR-V itself (vkml/vk/naga.py), and offers all three optional capabilities:
a timeline semaphore, recording into the host's command buffers, and device timestamps."""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vkml.errors import DeviceError
from vkml.hal import (
    WAIT_POLL_S,
    BackendBase,
    BackendTimestamps,
    BufferKind,
    Command,
    Copy,
    CopyFromImage,
    CopyToImage,
    DeviceMemory,
    Fill,
    HostWrite,
    Kernel,
)
from vkml.interrupts import deferred_interrupts
from vkml.threads import compile_threads
from vkml.vk import naga
from vkml.vk.buffers import Buffer, allocate_buffer, device_heap, free_buffer
from vkml.vk.context import (
    WAIT_TIMEOUT_NS,
    Adopted,
    Device,
    as_handle,
    how_to_enable,
)
from vkml.vk.host_resources import HostResources, ImportedImage, raw_handle
from vkml.vk.pipelines import Pipeline, PipelineCache, create_pipeline, destroy_pipeline
from vkml.vk.programs import (
    Program,
    destroy_program,
    emit_external,
    prepare_program,
    read_timings,
    record_program,
)

MAX_READERS = 256
STAGING_BATCH = 64 << 20  # bytes staged per submission by write_buffers (larger writes: their own)
# Host writes into mapped memory run in pieces of this size on several threads (ctypes' memmove
# and memset run outside Python's lock) where a call writes more than one piece: on one thread a
# large model's parameters are a good share of a warm compile.
HOST_PIECE = 16 << 20


def _batches(sizes: Sequence[int]) -> tuple[list[list[int]], int]:
    """The indices of `sizes` in order, cut into batches of at most STAGING_BATCH bytes (an
    item larger than that is a batch of its own; items of size 0 join the batch at hand), and
    the largest batch's bytes: what a staging buffer reused for every batch must hold."""
    batches: list[list[int]] = [[]]
    size = 0
    for i, n in enumerate(sizes):
        if batches[-1] and n and size + n > STAGING_BATCH:
            batches.append([])
            size = 0
        batches[-1].append(i)
        size += n
    return batches, max(sum(sizes[i] for i in b) for b in batches)


class VulkanBackend(BackendBase):
    """One Vulkan device and queue; buffers, pipelines and pre-recorded programs on it.

    `selector` (or env VKML_DEVICE) picks the device: an index into the enumeration or part of
    its name; by default a discrete GPU, then integrated, virtual, CPU. Completion is tracked with
    one timeline semaphore (a fence per program when the device lacks them, or when
    `timeline_semaphores=False`). Several threads may use one backend for different programs:
    `queue_lock` guards the queue (a host renderer sharing the queue takes it too) and a lock
    the command pool; one program is submitted from one thread at a time (each session
    serialises its own calls).
    """

    def __init__(self, selector: str | None = None, *, timeline_semaphores: bool = True,
                 adopt: Adopted | None = None, queue_lock: Any = None) -> None:
        super().__init__(queue_lock)
        self._pool: Any = None
        # Vulkan leaves the command pool's synchronisation to the application (allocating,
        # recording into and freeing its command buffers): sessions on several threads share it.
        self._pool_lock = threading.Lock()
        self._cache: PipelineCache | None = None
        self._semaphore: Any = None
        self._dev = dev = Device(selector, timeline_semaphores, adopt)
        self._vk, self._ffi, self._lib = dev.vk, dev.ffi, dev.lib
        self._device, self._queue = dev.device, dev.queue
        self.caps = dev.caps
        self.owned = dev.owned
        self.validation_messages = dev.validation_messages
        self._buffers: set[Buffer] = set()
        self._host_objects: set[object] = set()  # the host's buffers and images (bind_input)
        # Read-backs from memory the host cannot map, recorded once per (buffer, offset, size):
        # reading a step's loss every frame then costs a submit, not a record and an allocation.
        self._readers: dict[tuple[int, int, int], tuple[Buffer, Program]] = {}
        self._pipelines: set[Pipeline] = set()
        # Drivers compile SPIR-V outside Python's lock and a VkPipelineCache takes concurrent
        # use; on a GPU the driver's compiles are most of a cold compile.
        self.pipeline_threads = compile_threads(host_shares_device=not dev.owned)
        self._programs: set[Program] = set()
        self._in_flight: set[Program] = set()  # fence mode only
        self._timeline = dev.timeline
        self._poll_s = 0.0 if dev.caps.device_type == "cpu" else WAIT_POLL_S
        self._value = 0  # last timeline value submitted
        self._completed = 0  # a timeline value known to be reached
        vk, ffi = self._vk, self._ffi
        try:
            info = ffi.new("VkCommandPoolCreateInfo*", {
                "sType": vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
                "queueFamilyIndex": dev.queue_family})
            out = ffi.new("VkCommandPool*")
            self._check(self._lib.vkCreateCommandPool(self._device, info, ffi.NULL, out),
                        "vkCreateCommandPool")
            self._pool = out[0]
            self._cache = PipelineCache(dev)
            if self._timeline:
                kind = ffi.new("VkSemaphoreTypeCreateInfo*", {
                    "sType": vk.VK_STRUCTURE_TYPE_SEMAPHORE_TYPE_CREATE_INFO,
                    "semaphoreType": vk.VK_SEMAPHORE_TYPE_TIMELINE})
                sinfo = ffi.new("VkSemaphoreCreateInfo*", {
                    "sType": vk.VK_STRUCTURE_TYPE_SEMAPHORE_CREATE_INFO, "pNext": kind})
                sem = ffi.new("VkSemaphore[1]")
                self._check(self._lib.vkCreateSemaphore(self._device, sinfo, ffi.NULL, sem),
                            "vkCreateSemaphore (timeline)")
                self._semaphore, self._semaphore_array = sem[0], sem
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_handles(cls, instance: Any, physical_device: Any, device: Any,
                     queue_family_index: int, queue: Any, queue_lock: Any = None, *,
                     enabled_features: Iterable[str] = (), enabled_extensions: Iterable[str] = (),
                     require: Iterable[str] = ()) -> VulkanBackend:
        """A backend on a device the host created; see vkml.Device.from_vulkan."""
        adopt = Adopted(instance, physical_device, device, queue_family_index, queue,
                        frozenset(enabled_features), frozenset(enabled_extensions),
                        frozenset(require))
        return cls(adopt=adopt, queue_lock=queue_lock)

    # -- optional capabilities ----------------------------------------------------------------

    @property
    def timeline(self) -> _Timeline | None:  # type: ignore[override]
        return _Timeline(self) if self._timeline else None

    @property
    def host_recording(self) -> _HostRecording:  # type: ignore[override]
        return _HostRecording(self)

    @property
    def host_resources(self) -> HostResources:  # type: ignore[override]
        return HostResources(self)

    @property
    def timestamps(self) -> BackendTimestamps | None:  # type: ignore[override]
        if self.caps.timestamp_period_ns <= 0:
            return None
        return BackendTimestamps(functools.partial(self._record, timestamps=True), self._timings)

    def _timings(self, program: Program) -> list[float]:
        """Milliseconds per dispatch of the latest run of a program recorded with timestamps.
        Each entry spans from the end of the previous dispatch (or the program's start) to the
        end of this one, so dispatches without a Barrier between them may share time."""
        return read_timings(self._dev, program)

    # -- buffers ------------------------------------------------------------------------------

    def create_buffer(self, nbytes: int, kind: BufferKind, label: str) -> Buffer:
        self._alive()
        buf = allocate_buffer(self._dev, nbytes, kind, label)
        self._buffers.add(buf)
        return buf

    def device_memory(self) -> DeviceMemory:
        self._alive()
        return device_heap(self._dev)

    def free_buffer(self, buffer: Buffer) -> None:
        """Release `buffer`; the caller guarantees no pending or recorded program still uses it."""
        if buffer in self._buffers:
            for key in [k for k in self._readers if k[0] == id(buffer)]:
                self._drop_reader(key)
            self._buffers.discard(buffer)
            free_buffer(self._dev, buffer)

    def write_buffer(self, buffer: Buffer, offset: int, data: bytes | memoryview) -> None:
        """Host -> buffer. Mapped buffers are written at once: wait() first if in use."""
        self.write_buffers([HostWrite.of(buffer, offset, data)])

    def write_buffers(self, writes: Sequence[HostWrite]) -> None:
        """Data into mapped buffers written at once, and zeros into mapped host memory; the
        others in batches of about STAGING_BATCH bytes of data, one submission a batch: data
        through one staging buffer, zeros filled by the device (a zero write that is not in
        whole 4-byte words goes as data). (Zeros were copied from a zeroed region of the
        staging buffer: SmolLM2 training's Adam state, 1.1 GB, crossed the bus; and before that
        each batch had a staging buffer of its own, 424 allocations and submissions where there
        are now 8.)"""
        staged, mapped = [], []
        for w in writes:
            self.check_transfer("write", w.buffer, w.offset, w.nbytes)
            # Zeros go to the device where the mapping is uncached (VRAM behind a resizable BAR):
            # writing them from the CPU crosses the bus (an optimizer's state: gigabytes).
            if w.nbytes and w.buffer.host_write and (w.data is not None or w.buffer.host_read):
                mapped.append((w.buffer.pointer + w.offset, w))
            elif w.nbytes:
                staged.append(w if w.data is not None or w.fills
                              else HostWrite.of(w.buffer, w.offset, bytes(w.nbytes)))
        self._host_writes(mapped)
        if not staged:
            return
        batches, room = _batches([0 if w.data is None else w.nbytes for w in staged])
        staging = self.create_buffer(room, "upload", "staging-write") if room else None
        try:
            for batch in batches:
                self._write_staged(staging, [staged[i] for i in batch])
        finally:
            if staging is not None:
                self.free_buffer(staging)

    def _host_writes(self, writes: Sequence[tuple[Any, HostWrite]]) -> None:
        """Each write to its mapped pointer: data copied, zeros set, in HOST_PIECE pieces spread
        over the compile threads where the writes come to more than one piece's bytes."""
        def address(pointer: Any) -> int:
            return int(self._ffi.cast("uintptr_t", pointer))

        pieces = []  # (destination, source address or None for zeros, bytes)
        for pointer, w in writes:
            source = None if w.data is None else address(self._ffi.from_buffer(w.data))
            destination = address(pointer)
            for at in range(0, w.nbytes, HOST_PIECE):
                pieces.append((destination + at, None if source is None else source + at,
                               min(HOST_PIECE, w.nbytes - at)))

        def copy(piece: tuple[int, int | None, int]) -> None:
            destination, source, nbytes = piece
            if source is None:
                ctypes.memset(destination, 0, nbytes)
            else:
                ctypes.memmove(destination, source, nbytes)

        if sum(nbytes for _, _, nbytes in pieces) <= HOST_PIECE:
            for piece in pieces:
                copy(piece)
            return
        with ThreadPoolExecutor(min(compile_threads(), len(pieces))) as pool:
            list(pool.map(copy, pieces))

    def _write_staged(self, staging: Buffer | None, batch: Sequence[HostWrite]) -> None:
        """One batch, its data through `staging` (the previous batch's copies have finished;
        None when no write of the call has data)."""
        at = 0
        commands: list[Command] = []
        copies = []
        for w in batch:
            if w.data is None:
                commands.append(Fill(w.buffer, w.offset, w.nbytes))
            else:
                assert staging is not None
                copies.append((staging.pointer + at, w))
                commands.append(Copy(staging, at, w.buffer, w.offset, w.nbytes))
                at += w.nbytes
        self._host_writes(copies)  # the batch's data in one go: one pool for all its pieces
        self.run_now(commands)

    def read_buffer(self, buffer: Buffer, offset: int, nbytes: int) -> bytes:
        """Buffer -> host. Call wait() first so the work that writes `buffer` has finished."""
        self.check_transfer("read", buffer, offset, nbytes)
        if buffer.host_read:
            return self._ffi.buffer(buffer.pointer + offset, nbytes)[:]
        if nbytes == 0:
            return b""
        key = (id(buffer), offset, nbytes)
        if key not in self._readers:
            if len(self._readers) >= MAX_READERS:
                self._drop_reader(next(iter(self._readers)))
            staging = self.create_buffer(nbytes, "readback", "staging-read")
            self._readers[key] = staging, self.record(
                [Copy(buffer, offset, staging, 0, nbytes)], "read-back")
        staging, program = self._readers[key]
        self.submit(program)
        self.wait_for(program)
        return self._ffi.buffer(staging.pointer, nbytes)[:]

    def read_buffers(self, reads: Sequence[tuple[Buffer, int, int]]) -> list[bytes]:
        """Mapped buffers read in place; the others copied through one staging buffer in
        batches of about STAGING_BATCH bytes, one submission a batch, and nothing kept (where
        read_buffer keeps a staging buffer and a program per read for reading it again). Call
        wait() first."""
        results = [b""] * len(reads)
        staged = []
        for i, (buffer, offset, nbytes) in enumerate(reads):
            self.check_transfer("read", buffer, offset, nbytes)
            if nbytes and buffer.host_read:
                results[i] = self._ffi.buffer(buffer.pointer + offset, nbytes)[:]
            elif nbytes:
                staged.append(i)
        if staged:
            batches, room = _batches([reads[i][2] for i in staged])
            staging = self.create_buffer(room, "readback", "staging-reads")
            try:
                for batch in batches:
                    at, copies, places = 0, [], []
                    for i in (staged[j] for j in batch):
                        buffer, offset, nbytes = reads[i]
                        copies.append(Copy(buffer, offset, staging, at, nbytes))
                        places.append((i, at, nbytes))
                        at += nbytes
                    self.run_now(copies)
                    for i, at, nbytes in places:
                        results[i] = self._ffi.buffer(staging.pointer + at, nbytes)[:]
            finally:
                self.free_buffer(staging)
        return results

    def stage_reads(self, buffer: Buffer) -> bool:
        """Device memory the host cannot read in place (a discrete GPU's VRAM): reading it
        takes a copy on the queue, behind everything submitted before the read."""
        return not buffer.host_read

    def _drop_reader(self, key: tuple[int, int, int]) -> None:
        staging, program = self._readers.pop(key)
        self.free_program(program)
        self.free_buffer(staging)

    # -- pipelines ----------------------------------------------------------------------------

    def preload(self) -> None:
        # Not when the device opens: on two cores that slowed the graph's building as well.
        naga.preload()

    def prefetch(self, kernels: Sequence[Kernel]) -> None:
        """Translate the kernels no SPIR-V cache holds in background threads (naga), while the
        caller goes on (uploads, allocations)."""
        naga.prefetch((k.wgsl, k.name) for k in kernels)

    def why_absent(self, capability: str) -> str:
        if capability == "timeline":
            return ("the Vulkan feature 'timelineSemaphore' is not enabled on this device (vkml "
                    "tracks its work with fences): " + how_to_enable("timelineSemaphore"))
        return super().why_absent(capability)

    def create_pipeline(self, kernel: Kernel) -> Pipeline:
        """A compute pipeline for `kernel`: its WGSL through naga to SPIR-V, then the driver."""
        self._alive()
        spirv = naga.compile_wgsl(kernel.wgsl, kernel.name)
        try:
            pipe = create_pipeline(self._dev, self._cache, kernel.name, spirv,
                                   kernel.num_bindings, kernel.writable,
                                   self.caps.dispatch_base and kernel.cut_axis is not None,
                                   kernel.bfloat16)
        except DeviceError as exc:
            raise DeviceError(f"{exc}\n--- WGSL of kernel {kernel.name!r} ---\n{kernel.wgsl}"
                              ) from None
        self._pipelines.add(pipe)
        return pipe

    def free_pipeline(self, pipeline: Pipeline) -> None:
        """Destroy `pipeline`; the caller guarantees no live program still uses it."""
        if pipeline in self._pipelines:
            self._pipelines.discard(pipeline)
            destroy_pipeline(self._dev, pipeline)

    # -- programs -----------------------------------------------------------------------------

    def record(self, commands: Sequence[Command], label: str) -> Program:
        """Record `commands` once into a Program that submit() can run any number of times."""
        return self._record(commands, label, timestamps=False)

    def _record(self, commands: Sequence[Command], label: str, timestamps: bool) -> Program:
        self._alive()
        self.check(commands, label)
        with self._pool_lock:
            prog = record_program(self._dev, self._pool, commands, label, timestamps)
        vk, ffi = self._vk, self._ffi
        buffers = ffi.new("VkCommandBuffer[1]", [prog.command_buffer])
        info = ffi.new("VkSubmitInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, "commandBufferCount": 1,
            "pCommandBuffers": buffers})
        keep: tuple[Any, ...] = (buffers, info)
        if self._timeline:
            prog.signal_value = ffi.new("uint64_t[1]")
            timeline = ffi.new("VkTimelineSemaphoreSubmitInfo*", {
                "sType": vk.VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO,
                "signalSemaphoreValueCount": 1, "pSignalSemaphoreValues": prog.signal_value})
            info.pNext = timeline
            info.signalSemaphoreCount = 1
            info.pSignalSemaphores = self._semaphore_array
            keep += (timeline,)
        else:
            finfo = ffi.new("VkFenceCreateInfo*", {"sType": vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO})
            fence = ffi.new("VkFence[1]")
            result = self._lib.vkCreateFence(self._device, finfo, ffi.NULL, fence)
            if result != vk.VK_SUCCESS:
                with self._pool_lock:
                    destroy_program(self._dev, self._pool, prog)
                self._check(result, "vkCreateFence")
            prog.fence = fence
        prog.submit_info = info
        prog._keep = keep
        self._programs.add(prog)
        return prog

    def submit(self, program: Program) -> None:
        """Queue `program` to run; returns at once. A still-running `program` is waited for."""
        if program.submit_info is None:
            raise DeviceError(f"{program!r} was freed or belongs to a closed backend")
        lib = self._lib
        if self._timeline:
            if program.last_value > self._completed:
                # A command buffer without SIMULTANEOUS_USE must not be pending twice.
                self._wait_value(program.last_value)
            # A Ctrl-C between the submit and noting its value would have the next submit
            # signal the same value and resubmit a pending command buffer (vkml/interrupts.py).
            with deferred_interrupts(), self.queue_lock:
                value = self._value + 1
                program.signal_value[0] = value
                result = lib.vkQueueSubmit(self._queue, 1, program.submit_info, self._ffi.NULL)
                if result == 0:
                    self._value = program.last_value = value
        else:
            if program.in_flight:
                self._wait_fences([program])
            with deferred_interrupts():
                lib.vkResetFences(self._device, 1, program.fence)
                with self.queue_lock:
                    result = lib.vkQueueSubmit(self._queue, 1, program.submit_info,
                                               program.fence[0])
                if result == 0:
                    program.in_flight = True
                    self._in_flight.add(program)
        if result != 0:
            self._check(result, f"vkQueueSubmit of program {program.label!r}")
        program.submitted = True

    def submit_batch(self, programs: Sequence[Program],
                     wait: tuple[Any, int] | None = None) -> None:
        """Queue `programs` to run in order as ONE vkQueueSubmit (their command buffers in one
        VkSubmitInfo, which signals the timeline once, after the last); returns at once. Without
        timeline semaphores each goes in a submission of its own (a fence each). `wait`: a
        (timeline semaphore, value) of the host's the submission waits for, in every stage."""
        programs = list(programs)
        if wait is None and (len(programs) == 1 or not self._timeline):
            for program in programs:
                self.submit(program)
            return
        if not programs:
            return
        if len({id(p) for p in programs}) != len(programs):
            raise DeviceError("a batch names the same program twice (a command buffer cannot "
                              "be pending twice)")
        for program in programs:
            if program.submit_info is None:
                raise DeviceError(f"{program!r} was freed or belongs to a closed backend")
            if program.last_value > self._completed:
                self._wait_value(program.last_value)
        vk, ffi = self._vk, self._ffi
        buffers = ffi.new("VkCommandBuffer[]", [p.command_buffer for p in programs])
        signal = ffi.new("uint64_t[1]")
        timeline = ffi.new("VkTimelineSemaphoreSubmitInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO,
            "signalSemaphoreValueCount": 1, "pSignalSemaphoreValues": signal})
        info = ffi.new("VkSubmitInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, "pNext": timeline,
            "commandBufferCount": len(programs), "pCommandBuffers": buffers,
            "signalSemaphoreCount": 1, "pSignalSemaphores": self._semaphore_array})
        if wait is not None:  # kept alive in locals until the submit returns
            waits = ffi.new("VkSemaphore[1]", [ffi.cast("VkSemaphore", raw_handle(
                ffi, wait[0], "VkSemaphore", "wait_for_host"))])
            wait_values = ffi.new("uint64_t[1]", [int(wait[1])])
            stages = ffi.new("VkPipelineStageFlags[1]", [vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT])
            timeline.waitSemaphoreValueCount, timeline.pWaitSemaphoreValues = 1, wait_values
            info.waitSemaphoreCount, info.pWaitSemaphores = 1, waits
            info.pWaitDstStageMask = stages
        with deferred_interrupts(), self.queue_lock:
            value = self._value + 1
            signal[0] = value
            result = self._lib.vkQueueSubmit(self._queue, 1, info, ffi.NULL)
            if result == 0:
                self._value = value
                for program in programs:
                    program.last_value = value
        if result != 0:
            self._check(result, "vkQueueSubmit of programs "
                        + ", ".join(repr(p.label) for p in programs))
        for program in programs:
            program.submitted = True

    def wait_for(self, program: Program) -> None:
        """Block until the latest submission of `program` has finished (and, with it, all that
        was submitted before it: a signal operation's scope covers every earlier command on the
        queue); work submitted after it is not waited for."""
        if self._timeline:
            if program.last_value > self._completed:
                self._wait_value(program.last_value)
        elif program.in_flight:
            self._wait_fences([program])

    def wait(self) -> None:
        """Block until everything submitted so far has finished."""
        if self._timeline:
            target = self._value
            if target > self._completed:
                self._wait_value(target)
        elif self._in_flight:
            self._wait_fences(list(self._in_flight))

    def free_program(self, program: Program) -> None:
        """Release a program's command buffer and descriptor sets, after it has finished."""
        if program not in self._programs:
            return
        if self._timeline:
            if program.last_value > self._completed:
                self._wait_value(program.last_value)
        elif program.in_flight:
            self._wait_fences([program])
        self._programs.discard(program)
        with self._pool_lock:
            destroy_program(self._dev, self._pool, program)

    # -- teardown -----------------------------------------------------------------------------

    def live_objects(self) -> dict[str, int]:
        """Buffers (and their bytes), pipelines and programs alive, and the cached read-back
        programs among them (each with its staging buffer)."""
        return {"buffers": len(self._buffers),
                "buffer_bytes": sum(b.nbytes for b in self._buffers),
                "pipelines": len(self._pipelines),
                "programs": len(self._programs), "read_backs": len(self._readers),
                "host_resources": len(self._host_objects)}

    def close(self) -> None:
        """Wait for the device to go idle and destroy everything; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        dev, lib, null = self._dev, self._lib, self._ffi.NULL
        if self._device is not None:
            if self.owned:
                with self.queue_lock:
                    lib.vkDeviceWaitIdle(self._device)  # on device loss nothing to wait for
            else:
                # The host's device: wait for vkml's own work only, never for the host's.
                try:
                    self.wait()
                except DeviceError:
                    pass
            for prog in list(self._programs):
                destroy_program(dev, self._pool, prog)
            for pipe in self._pipelines:
                destroy_pipeline(dev, pipe)
            for buf in list(self._buffers):
                free_buffer(dev, buf)
            self._programs.clear()
            self._in_flight.clear()
            self._pipelines.clear()
            self._buffers.clear()
            self._host_objects.clear()
            if self._cache is not None:
                self._cache.save_and_destroy()
            if self._semaphore is not None:
                lib.vkDestroySemaphore(self._device, self._semaphore, null)
            if self._pool is not None:
                lib.vkDestroyCommandPool(self._device, self._pool, null)
        dev.close()

    # -- internals ----------------------------------------------------------------------------

    def _live_buffer(self, buffer: object) -> bool:
        return isinstance(buffer, Buffer) and buffer.handle is not None and (
            buffer in self._buffers or buffer in self._host_objects)

    def _check_command(self, n: int, command: Command, what: str) -> None:
        if isinstance(command, CopyFromImage | CopyToImage):
            image = command.region.image
            if not isinstance(image, ImportedImage) or image not in self._host_objects:
                raise DeviceError(f"{what}: {image!r} is not an image from this backend's "
                                  "host_resources.image()")

    def _live_pipeline(self, pipeline: object) -> bool:
        return isinstance(pipeline, Pipeline) and pipeline.handle is not None

    def _check(self, result: int, what: str) -> None:
        vk = self._vk
        if result == vk.VK_SUCCESS:
            return
        if result == vk.VK_ERROR_DEVICE_LOST:
            raise DeviceError(
                f"{what}: the Vulkan device {self.caps.device_name!r} was lost (driver reset, "
                "GPU fault or a kernel that ran out of bounds); close this backend and make a "
                "new one")
        if result == vk.VK_TIMEOUT:
            raise DeviceError(
                f"{what}: the GPU did not finish within {WAIT_TIMEOUT_NS // 10**9} s; a kernel is "
                "hung or far too slow for this device (try smaller chunks)")
        name = getattr(vk.exception_codes.get(result), "__name__", str(result))
        raise DeviceError(f"{what} failed with {name}")

    def _wait_value(self, value: int) -> None:
        ffi = self._ffi
        reached = ffi.new("uint64_t[1]")
        lib, device, semaphore = self._lib, self._device, self._semaphore
        if self._polled(lambda: lib.vkGetSemaphoreCounterValue(device, semaphore, reached) == 0
                        and reached[0] >= value):
            self._completed = max(self._completed, value)
            return
        values = ffi.new("uint64_t[1]", [value])
        info = ffi.new("VkSemaphoreWaitInfo*", {
            "sType": self._vk.VK_STRUCTURE_TYPE_SEMAPHORE_WAIT_INFO, "semaphoreCount": 1,
            "pSemaphores": self._semaphore_array, "pValues": values})
        self._check(self._lib.vkWaitSemaphores(self._device, info, WAIT_TIMEOUT_NS),
                    "waiting for submitted work")
        self._completed = max(self._completed, value)

    def _wait_fences(self, programs: list[Program]) -> None:
        fences = self._ffi.new("VkFence[]", [p.fence[0] for p in programs])
        lib, device = self._lib, self._device
        if not self._polled(lambda: all(lib.vkGetFenceStatus(device, p.fence[0]) == 0
                                        for p in programs)):
            self._check(lib.vkWaitForFences(device, len(programs), fences, 1, WAIT_TIMEOUT_NS),
                        "waiting for submitted work")
        for p in programs:
            p.in_flight = False
            self._in_flight.discard(p)


class _Timeline:
    """The backend's timeline semaphore, which every submission signals with the next value."""

    def __init__(self, backend: VulkanBackend) -> None:
        self._backend = backend

    @property
    def semaphore(self) -> Any:
        return self._backend._semaphore

    @property
    def value(self) -> int:
        return self._backend._value

    def value_of(self, program: Program) -> int:
        return program.last_value

    def submit_after(self, programs: Sequence[Program], semaphore: Any, value: int) -> None:
        self._backend.submit_batch(programs, wait=(semaphore, value))

    def check_semaphore(self, semaphore: Any) -> None:
        raw_handle(self._backend._ffi, semaphore, "VkSemaphore", "wait_for_host")


class _HostRecording:
    """Programs recorded into the host's command buffers (Session.record)."""

    def __init__(self, backend: VulkanBackend) -> None:
        self._backend = backend

    def prepare(self, commands: Sequence[Command], label: str) -> Program:
        """Descriptor sets for `commands`, to be recorded into the host's command buffers by
        record_into() (as often as the host likes; nothing is allocated per call)."""
        b = self._backend
        b._alive()
        b.check(commands, label)
        prog = prepare_program(b._dev, commands, label)
        b._programs.add(prog)
        return prog

    def record_into(self, command_buffer: Any, program: Program) -> None:
        """Record `program` (from prepare) into a command buffer in the recording state, from
        this device's queue family, between global memory barriers."""
        b = self._backend
        b._alive()
        if program not in b._programs or program.command_buffer is not None:
            raise DeviceError(f"{program!r} is not a program from host_recording.prepare() of "
                              "this backend")
        cb = as_handle(b._ffi, "VkCommandBuffer", command_buffer, "command_buffer",
                       same_device_as=b._device)
        # The device and its queues begin with the same word as its command buffers: tell
        # the handles the host holds anyway apart by value.
        address = int(b._ffi.cast("uintptr_t", cb))
        for other, kind in ((b._device, "VkDevice"), (b._queue, "VkQueue")):
            if address == int(b._ffi.cast("uintptr_t", other)):
                raise DeviceError(f"command_buffer is the {kind} vkml runs on, not a "
                                  "VkCommandBuffer: give the command buffer the host is "
                                  "recording")
        emit_external(b._dev, cb, program)
