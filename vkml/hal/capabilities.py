"""What codegen and planning may assume about a device: an explicit input, never a global."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class Capabilities:
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
    # Cooperative matrices with bfloat16 operands (VK_KHR_shader_bfloat16: its type and
    # cooperative-matrix features, and a 16 x 16 x 16 bfloat16 x bfloat16 -> f32 subgroup
    # configuration): what precision "bf16" multiplies on.
    bf16_cooperative_matrix: bool = False
    shader_f16: bool = False
    extensions: frozenset[str] = field(default_factory=frozenset)
    # Whether a dispatch may start at a base workgroup (hal.Dispatch.base: Vulkan 1.1's
    # vkCmdDispatchBase, or base_in_uniform): how a long dispatch runs as ranges of its
    # workgroups submitted apart (runtime/chunking.py).
    dispatch_base: bool = False
    # How WebGPU, which has no dispatch base, offers one: a kernel that may be cut
    # (Kernel.cut_axis) reads its base workgroup from a uniform bound after its storage
    # bindings and adds it to its workgroup ids (kernels/common.py offset_workgroup_id), and
    # the backend binds each dispatch's base there. Vulkan keeps it off: its WGSL and SPIR-V
    # are those of a plain dispatch.
    base_in_uniform: bool = False
    # Whether a kernel may declare a storage binding read-only. WebGPU may not: vkml binds byte
    # ranges of one arena buffer, WebGPU tracks usage per buffer, and a buffer bound read-only
    # and writable in one dispatch is rejected, so there every binding is declared read_write.
    read_only_storage: bool = True
    # The most loop iterations one shader invocation may run (None: no limit). lavapipe stops
    # an invocation's loops after 65535 in all and returns what it has; kernels split longer work.
    max_loop_iterations: int | None = None
    # The compilation's arithmetic for matrix products and convolutions (vkml.compile's
    # `precision`): "f32", "f16" or "bf16" (how: `f16_products`). An option rather than a
    # device property, carried here because codegen reads it with the rest.
    precision: str = "f32"
    # Products whose operands may lie far below f16's smallest normal (6e-5), as the backward
    # pass's gradients do: at precision "f16" (bfloat16 has f32's exponent range and needs
    # none of this) their kernels scale each row of such an operand
    # by a power of two that brings its largest magnitude into f16's range before converting
    # to f16, and undo it exactly as they store (compiler/scale.py, gemm `_scales`).
    scaled_operands: bool = False

    @property
    def f16_products(self) -> Literal["cooperative", "simt"] | None:
        """How matrix products compute at precision "f16" on this device, decided here alone:
        "cooperative" where it has cooperative matrices (tensor cores: f16 operands, f32
        accumulation); "simt" where it has shaderFloat16 without them (most mobile and headset
        GPUs, whose f16 arithmetic runs at twice the f32 rate): the plain tiled kernels stage
        f16 operands and multiply-add in f16 over each staged slice of the sum, adding each
        slice's sums into f32 accumulators (kernels/gemm.py); None at precision "f32" or
        without f16 arithmetic. At precision "bf16": "cooperative" where the device has
        `bf16_cooperative_matrix` (the same kernels, their f16 operands made bfloat16 by the
        backend: hal.kernel.BFLOAT16_MARK), else None (bfloat16 has no arithmetic)."""
        if self.precision == "bf16":
            return "cooperative" if self.bf16_cooperative_matrix else None
        if self.precision != "f16" or not self.shader_f16:
            return None
        return "cooperative" if self.cooperative_matrix else "simt"
