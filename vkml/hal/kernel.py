"""A kernel: what codegen hands a backend. The WGSL text with everything a backend needs to run it
without reading the text: each binding's access, the workgroup size and the launch grid; and the
work it does, for estimates when nothing was measured."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Access = Literal["read", "read_write"]

# A rough roofline in flop-equivalents: one byte of memory traffic costs about as much as ten
# floating-point operations on current GPUs, and a dispatch costs a few microseconds however
# small it is. Only ratios between kernels matter (chunk balancing before anything is measured).
BYTE_COST = 10.0
DISPATCH_COST = 5e5
# WGSL has no bfloat16 type: a kernel compiled for precision "bf16" writes its cooperative
# operands as f16 and begins with this line, and the backend makes them bfloat16 (Vulkan:
# vk/spirv.py `to_bfloat16`). In the text, so that every cache keyed by it tells the two apart.
BFLOAT16_MARK = "// vkml: this kernel's f16 is bfloat16"


@dataclass(frozen=True)
class Kernel:
    name: str
    wgsl: str
    access: tuple[Access, ...]  # per binding, in @binding order: what the kernel does with it
    workgroup_size: tuple[int, int, int]
    groups: tuple[int, int, int]
    flops: int = 0  # arithmetic over the whole dispatch (an estimate)
    nbytes: int = 0  # memory traffic over the whole dispatch (an estimate)
    # Its workgroups share nothing within the dispatch (no atomics; none reads what another
    # writes) and it reads num_workgroups only to linearise the grid (x + y * nwg.x: see
    # kernels/common.py). Then ranges of its workgroups along the outermost axis with more
    # than one (`cut_axis`), run as dispatches of their own with a base workgroup, compute
    # exactly what the whole dispatch does: the other axes' counts are whole, and the cut
    # axis' count multiplies no workgroup id, those of the axes above being 0.
    independent_workgroups: bool = False

    @property
    def cut_axis(self) -> int | None:
        """The grid axis a dispatch of this kernel may be cut along (None: it may not be)."""
        if not self.independent_workgroups:
            return None
        axes = [a for a in range(3) if self.groups[a] > 1]
        return axes[-1] if axes else None

    @property
    def bfloat16(self) -> bool:
        """Whether the kernel's f16 values are bfloat16 (BFLOAT16_MARK)."""
        return self.wgsl.startswith(BFLOAT16_MARK)

    @property
    def writable(self) -> tuple[bool, ...]:
        return tuple(a == "read_write" for a in self.access)

    @property
    def num_bindings(self) -> int:
        return len(self.access)

    @property
    def cost(self) -> float:
        """Relative cost, for ordering and balancing dispatches before they are timed."""
        return max(float(self.flops), BYTE_COST * self.nbytes) + DISPATCH_COST
