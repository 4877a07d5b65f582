"""Codegen: each dispatch of the plan becomes WGSL text specialised to its shapes and the device.

Kernels come from a few archetypes (pointwise, reduce, softmax, matmul, optimizer update), each a
small Python generator. Shapes are baked in as constants, so every kernel is straight-line code
the driver can optimise and naga never has to unroll anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..backend import Capabilities
from ..graph import Tensor
from ..ops import OPS


@dataclass(frozen=True)
class Kernel:
    name: str
    wgsl: str
    writable: tuple[bool, ...]  # per binding, in binding order
    groups: tuple[int, int, int]

    @property
    def num_bindings(self) -> int:
        return len(self.writable)


def lower(node: Tensor, caps: Capabilities) -> Kernel:
    """The kernel computing `node` from its inputs (bindings: inputs in order, then output)."""
    from . import attention, conv, gather, matmul, pointwise, reduce

    archetype = OPS[node.op].archetype
    if archetype == "pointwise":
        return pointwise.generate(node, caps)
    if archetype == "reduce":
        return reduce.generate_sum(node, caps)
    if archetype == "softmax":
        return reduce.generate_softmax(node, caps)
    if archetype == "matmul":
        return matmul.generate(node, caps)
    if archetype == "gather":
        return gather.generate(node, caps)
    if archetype == "conv":
        return conv.generate(node, caps)
    if archetype == "attention":
        return attention.generate(node, caps)
    raise ValueError(f"{node.label}: archetype '{archetype}' produces no kernel")
