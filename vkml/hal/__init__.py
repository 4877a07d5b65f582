"""The contract between the compiler and a GPU backend (Vulkan in `vkml/vk/`, wgpu later).

The session talks to a backend only through these types, so everything above this line is
testable without a GPU and a second backend implements the same few methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

BufferKind = Literal["device", "upload", "readback"]


@dataclass(frozen=True)
class Capabilities:
    """What codegen and planning may assume about the device; an explicit input, never a global."""

    device_name: str
    device_type: str  # "discrete" | "integrated" | "virtual" | "cpu" | "other"
    api_version: str  # e.g. "1.3.239"
    driver: str
    max_workgroup_invocations: int
    max_workgroup_size: tuple[int, int, int]
    max_workgroup_count: tuple[int, int, int]
    max_shared_memory_bytes: int
    min_storage_offset_alignment: int
    max_storage_buffer_range: int
    max_bindings_per_stage: int
    subgroup_size: int
    timestamp_period_ns: float  # 0.0 when the queue cannot write timestamps
    cooperative_matrix: bool = False
    shader_f16: bool = False
    extensions: frozenset[str] = field(default_factory=frozenset)


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


@dataclass(frozen=True)
class Barrier:
    """All earlier compute and transfer writes become visible to all later compute/transfer work."""


@dataclass(frozen=True)
class Copy:
    src: object
    src_offset: int
    dst: object
    dst_offset: int
    nbytes: int


Command = Dispatch | Barrier | Copy


class Backend(Protocol):
    caps: Capabilities
    # False where the backend compiles the WGSL itself (wgpu): then no SPIR-V is made for it.
    consumes_spirv: bool

    def create_buffer(self, nbytes: int, kind: BufferKind, label: str) -> object: ...
    def write_buffer(self, buffer: object, offset: int, data: bytes | memoryview) -> None: ...
    def read_buffer(self, buffer: object, offset: int, nbytes: int) -> bytes: ...
    def create_pipeline(self, name: str, wgsl: str, spirv: bytes, num_bindings: int,
                        writable: Sequence[bool]) -> object: ...
    def free_buffer(self, buffer: object) -> None: ...
    def record(self, commands: Sequence[Command], label: str) -> object: ...
    def free_program(self, program: object) -> None: ...
    def submit(self, program: object) -> None: ...
    def wait(self) -> None: ...
    def run_now(self, commands: Sequence[Command]) -> None: ...
    def close(self) -> None: ...
