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


@dataclass(frozen=True)
class Kernel:
    name: str
    wgsl: str
    access: tuple[Access, ...]  # per binding, in @binding order: what the kernel does with it
    workgroup_size: tuple[int, int, int]
    groups: tuple[int, int, int]
    flops: int = 0  # arithmetic over the whole dispatch (an estimate)
    nbytes: int = 0  # memory traffic over the whole dispatch (an estimate)

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
