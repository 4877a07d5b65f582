"""The backend contract: a required core every backend implements, and named optional
capabilities a backend offers or declares absent (None). The runtime uses nothing else, so a new
backend knows exactly what it must provide and the runtime never probes with hasattr."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from vkml.hal.capabilities import Capabilities
from vkml.hal.commands import BufferKind, Command
from vkml.hal.kernel import Kernel


class TimelineSync(Protocol):
    """A timeline semaphore that every submission signals, for a host to wait on."""

    @property
    def semaphore(self) -> Any: ...
    @property
    def value(self) -> int:
        """The value the latest submission signals."""
        ...

    def value_of(self, program: object) -> int:
        """The value the latest submission of `program` signals (0: never submitted); the
        semaphore reaches it once that submission and everything before it on the queue
        finished."""
        ...

    def submit_after(self, programs: Sequence[object], semaphore: Any, value: int) -> None:
        """submit_batch(programs) as one submission that first waits, in every stage, for the
        host's timeline `semaphore` to reach `value`."""
        ...

    def check_semaphore(self, semaphore: Any) -> None:
        """InputError unless `semaphore` can be one of the host's semaphores (a handle of the
        backend's kind, not null)."""
        ...


class HostRecording(Protocol):
    """vkml's commands recorded into a command buffer the host records and submits itself."""

    def prepare(self, commands: Sequence[Command], label: str) -> object:
        """Everything the commands need (descriptor sets), made once."""
        ...

    def record_into(self, command_buffer: Any, program: object) -> None:
        """Record a prepared program into the host's command buffer, between barriers."""
        ...


class HostResources(Protocol):
    """Buffers and images a host application made on the device, for vkml's programs to read
    and write (Session.bind_input / bind_output). Where the API cannot report a resource's
    size, usage or device (Vulkan), the host declares them and the backend checks what it can;
    where it can (wgpu), the resource describes itself (describe())."""

    def buffer(self, handle: Any, device: Any, nbytes: int, usage: int, access: str,
               what: str) -> object:
        """A buffer handle for Copy and Binding commands (live until release()), from the host's
        `handle` on `device` (which must be vkml's); `access` "read" or "write" says which
        usage it needs. InputError naming `what` for anything wrong."""
        ...

    def image(self, handle: Any, device: Any, format: str, extent: tuple[int, int], usage: int,
              layout: int, access: str, what: str) -> object:
        """An image for CopyFromImage / CopyToImage (live until release()); `format` one of
        FORMATS' names, `layout` the layout it is in whenever a vkml program runs."""
        ...

    def release(self, resource: object) -> None:
        """Forget a buffer or image from buffer() / image() (the host's handle stays)."""
        ...

    def row_pitch(self, row_bytes: int) -> int:
        """The smallest row pitch (ImageRegion.pitch) at least `row_bytes` with which the
        backend copies an image region in one piece (Vulkan: `row_bytes`; WebGPU: a multiple
        of 256)."""
        ...

    def describe(self, resource: Any, what: str) -> tuple[str, dict[str, Any]]:
        """A resource of the backend's own API that reports its device, size, usage and format
        (wgpu's GPUBuffer, GPUTexture) as ("buffer", vkml.HostBuffer's fields) or ("image",
        vkml.HostImage's); InputError naming `what` and what this backend takes for anything
        else (Vulkan: everything, its handles report nothing)."""
        ...


# Image formats vkml reads and writes, with bytes per texel.
FORMATS = {"rgba8_unorm": 4, "rgba8_srgb": 4, "rgba16_float": 8, "r32_float": 4}


class Timestamps(Protocol):
    """Device timestamps around every dispatch of a program."""

    def record(self, commands: Sequence[Command], label: str) -> object: ...
    def timings(self, program: object) -> list[float]:
        """Milliseconds per dispatch of the program's latest run."""
        ...


@dataclass(frozen=True)
class DeviceMemory:
    """The memory heap a backend allocates "device" buffers from."""

    heap: int  # its index among the device's heaps
    size: int  # bytes
    # Bytes this process may still allocate there where the driver says (VK_EXT_memory_budget:
    # the budget less what the process uses), else None.
    available: int | None


@dataclass(frozen=True)
class HostWrite:
    """`nbytes` bytes from the host into `buffer` at `offset`: `data`, or zeros where it is None."""

    buffer: object
    offset: int
    nbytes: int
    data: memoryview | None = None

    @classmethod
    def of(cls, buffer: object, offset: int, data: bytes | memoryview) -> HostWrite:
        view = memoryview(data)
        return cls(buffer, offset, view.nbytes, view)

    @property
    def fills(self) -> bool:
        """Zeros in whole 4-byte words: what a device fill (hal.Fill) can write instead."""
        return self.data is None and self.offset % 4 == 0 and self.nbytes % 4 == 0


class Backend(Protocol):
    caps: Capabilities
    owned: bool  # False: the device belongs to a host (Device.from_vulkan); nothing is destroyed
    queue_lock: AbstractContextManager[Any]  # held around every submission to the queue
    validation_messages: list[str]  # what the driver or validation layer reported
    # Optional capabilities: None where the backend or device lacks them.
    timeline: TimelineSync | None
    host_recording: HostRecording | None
    timestamps: Timestamps | None
    host_resources: HostResources | None

    def create_buffer(self, nbytes: int, kind: BufferKind, label: str) -> object: ...
    def free_buffer(self, buffer: object) -> None: ...
    def write_buffer(self, buffer: object, offset: int, data: bytes | memoryview) -> None: ...
    def write_buffers(self, writes: Sequence[HostWrite]) -> None:
        """Many host -> buffer writes to ranges that do not overlap (a session's initial values
        and zeroed state), as write_buffer would make them one by one, in as few submissions as
        the backend can."""
        ...

    def read_buffer(self, buffer: object, offset: int, nbytes: int) -> bytes: ...
    def read_buffers(self, reads: Sequence[tuple[object, int, int]]) -> list[bytes]:
        """Many (buffer, offset, nbytes) reads, as read_buffer would return them one by one,
        in as few submissions as the backend can and keeping nothing for later reads (a
        checkpoint's hundreds of tensors, read once)."""
        ...

    def stage_reads(self, buffer: object) -> bool:
        """Whether what a program computes into `buffer` is better copied to host-readable
        memory by the program itself: read_buffer() of it would need a copy submitted
        afterwards, which queues behind whatever was submitted in between."""
        ...

    def preload(self) -> None:
        """A compile is starting: begin loading, in the background, what translating its kernels
        will need (Vulkan: naga's wasm module, where no compiled one is cached), so that it
        overlaps the lowering; return at once."""
        ...

    def prefetch(self, kernels: Sequence[Kernel]) -> None:
        """Start, in the background, whatever turning these kernels into pipelines needs before
        the driver sees them (Vulkan: WGSL -> SPIR-V through naga, for kernels no cache
        holds), and return at once; create_pipeline then waits for it (and raises its error)."""
        ...

    def why_absent(self, capability: str) -> str:
        """Why the optional capability `capability` ("timeline", "host_recording",
        "timestamps", "host_resources") is None on this backend, and what would provide it:
        for error messages."""
        ...

    def device_memory(self) -> DeviceMemory | None:
        """The heap "device" buffers come from, checked against a plan before it is bound
        (a driver may not refuse more than it has: lavapipe does not); None where the backend
        cannot tell."""
        ...

    def create_pipeline(self, kernel: Kernel) -> object: ...
    def create_pipelines(self, kernels: Sequence[Kernel]) -> list[object]:
        """create_pipeline of each kernel, in order; a backend whose driver compiles outside
        Python's lock makes them several at a time. On a failure none is left alive."""
        ...

    def free_pipeline(self, pipeline: object) -> None: ...
    def record(self, commands: Sequence[Command], label: str) -> object: ...
    def free_program(self, program: object) -> None: ...
    def submit(self, program: object) -> None: ...
    def submit_batch(self, programs: Sequence[object]) -> None:
        """Run `programs` in order as one queue submission (Vulkan: one vkQueueSubmit)."""
        ...

    def wait(self) -> None:
        """Block until everything submitted so far has finished."""
        ...

    def wait_for(self, program: object) -> None:
        """Block until the latest submission of `program` (and what was submitted before it)
        has finished; later submissions are not waited for where the backend can tell them
        apart (Vulkan), else everything is (wgpu)."""
        ...

    def run_now(self, commands: Sequence[Command]) -> None: ...
    def close(self) -> None: ...
    def live_objects(self) -> dict[str, int]:
        """How many buffers (and their bytes), pipelines and programs (and any other kind of
        object the backend makes) are alive now: what a closed session must leave as it found
        it."""
        ...
